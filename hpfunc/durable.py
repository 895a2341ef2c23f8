"""Making written files durable: ``fsync`` of a file and of the folder that names it.

A file written and renamed into place survives a crash only once its bytes and the folder entry are
on the disk. The output folder of the trainer (``hpfunc.train.output``), checkpoints
(``hpfunc.checkpoint``) and ``save_pretrained`` (``hpfunc.models.qwen3.hf``) all sync through these two.

    >>> import pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "a.txt").write_text("x")
    1
    >>> fsync_file(d / "a.txt"); fsync_dir(d)
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["fsync_file", "fsync_dir"]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of a folder (files created or renamed in it) durable; a no-op where the file
    system does not allow syncing a folder."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
