"""What a save checks before it writes, and how a save that failed is told: one error, on every rank.

* :func:`check_step`: the step is an int >= 0 (before any communication).
* :func:`agree`: the ranks compare the folder and the step they were given (one small collective)
  and, where the file system says how much space is free, rank 0 compares it with the size the save
  is expected to need (the previous checkpoint's); a mismatch or too little space is a
  :class:`~hpfunc.checkpoint.errors.CheckpointError` raised on every rank before anything is written.
* :func:`cause`: the root cause of a failed write in one phrase: the ``OSError`` under DCP's
  ``CheckpointException`` (which lists every rank's traceback) or under torch's serializer
  (``unexpected pos 704 vs 598``), with its errno name and what it means. Where torch's serializer
  lost the ``OSError`` of a write the file system cut short (:func:`short_write`), the file system is
  asked (:func:`short_write_cause`): almost no free space left is a full disk (ENOSPC).

>>> check_step(-1, "save")
Traceback (most recent call last):
...
hpfunc.checkpoint.errors.CheckpointError: save: the step must be an int >= 0 (the number of steps done), found -1
>>> import errno
>>> cause(OSError(errno.ENOSPC, "No space left on device"))
'No space left on device (ENOSPC): the file system is full'
>>> agree("/tmp/ckpt/step_1", 1, group=None)  # one process: nothing to compare
"""

from __future__ import annotations

import errno as _errno
import os
import pathlib
import shutil
from typing import Any

from hpfunc.checkpoint import _ranks
from hpfunc.checkpoint.errors import CheckpointError

__all__ = ["check_step", "agree", "cause", "short_write", "short_write_cause", "free_bytes", "remove_partial"]

_HINTS = {_errno.ENOSPC: "the file system is full", _errno.EDQUOT: "the disk quota is used up",
          _errno.EROFS: "the file system is mounted read-only", _errno.EACCES: "no permission to write there",
          _errno.EPERM: "no permission to write there", _errno.ENOENT: "the folder vanished while it was written",
          _errno.EFBIG: "the file size limit (ulimit -f) is reached", _errno.EIO: "the device reported an I/O error"}


def check_step(step: Any, who: str) -> int:
    """``step`` as an int, or a :class:`CheckpointError` (a bool, a float, a negative number)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{who}: the step must be an int >= 0 (the number of steps done), found {step!r}")
    return int(step)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (its nearest existing
    folder), or None where the file system does not say (no statvfs, or it reports no blocks)."""
    p = pathlib.Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except (OSError, AttributeError):
        return None
    if st.f_blocks == 0:  # a pseudo file system that keeps no count
        return None
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def agree(path: str | os.PathLike, step: int, *, group: Any, expect_bytes: int | None = None,
          who: str = "save") -> None:
    """Every rank's ``(path, step)`` must be the same, and (rank 0) the free space must hold
    ``expect_bytes``; else a :class:`CheckpointError` on every rank, before any file is written."""
    mine = (os.path.abspath(path), int(step))
    problem = None
    if _ranks.rank(group) == 0 and expect_bytes:
        free = free_bytes(path)
        if free is not None and free < expect_bytes:
            problem = (f"{free_bytes_text(free)} on the file system of {os.path.dirname(mine[0])}, and the previous "
                       f"checkpoint took {_mib(expect_bytes)}; free some space (or keep fewer checkpoints: "
                       f"keep_last) and continue from the newest checkpoint")
    seen = _ranks.all_gather((mine, problem), group)
    found = sorted({m for m, _ in seen})
    if len(found) > 1:
        per_rank = "; ".join(f"rank {r}: {p!r} step {s}" for r, ((p, s), _) in enumerate(seen))
        raise CheckpointError(
            f"{who}: the ranks were given different checkpoints ({per_rank}); every rank must save the same "
            f"folder and step (a folder built from the rank or the host name, or a per-rank step counter, is a "
            f"bug); nothing was written")
    problem = seen[0][1]
    if problem is not None:
        raise CheckpointError(f"cannot save the checkpoint of step {step} to {mine[0]}: not enough space: {problem}; "
                              f"nothing was written")


def free_bytes_text(free: int) -> str:
    return f"{_mib(free)} free"


def _os_errors(e: BaseException, seen: set[int] | None = None) -> list[tuple[str, OSError]]:
    """``(where, OSError)`` found in ``e``: its cause and context chain, and DCP's per-rank failures."""
    seen = set() if seen is None else seen
    out: list[tuple[str, OSError]] = []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            out.append(("", e))
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for rank, pair in sorted(failures.items()):
                inner = pair[0] if isinstance(pair, tuple) and pair else pair
                if isinstance(inner, BaseException):
                    out += [(w or f"rank {rank}", x) for w, x in _os_errors(inner, seen)]
        e = e.__cause__ or e.__context__
    return out


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = sorted(failures.items())[0]
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_first_line(inner)}"
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def cause(e: BaseException) -> str:
    """The root cause of a failed write in one phrase (see the module docstring)."""
    found = _os_errors(e)
    if found:
        where, err = found[0]
        name = _errno.errorcode.get(err.errno or 0, "")
        text = f"{err.strerror or err} ({name})" if name else f"{err.strerror or err}"
        hint = _HINTS.get(err.errno or 0)
        return text + (f": {hint}" if hint else "") + (f" (on {where})" if where else "")
    return _first_line(e)


_SHORT_WRITE = "unexpected pos"  # torch's zip writer (inline_container.cc) on a write cut short
FULL_BELOW = 64 * 1024  # a short write with less free space than this on the file system: a full disk


def _texts(e: BaseException) -> list[str]:
    """The messages of ``e``, its cause and context chain, and DCP's per-rank failures."""
    out, todo, seen = [], [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(str(x))
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) and pair else pair for pair in failures.values()]
        todo += [x.__cause__, x.__context__]
    return [t for t in out if t]


def short_write(e: BaseException) -> bool:
    """Whether ``e`` is a write the file system cut short with no ``OSError`` left to say why: torch's zip
    writer (``torch.save``, which DCP uses for the non-tensor items) then raises ``[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598`` (seen on a full tmpfs).

    >>> short_write(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    True
    >>> import errno
    >>> short_write(OSError(errno.ENOSPC, "No space left on device"))  # the OSError says why
    False
    """
    return not _os_errors(e) and any(_SHORT_WRITE in t for t in _texts(e))


def short_write_cause(e: BaseException, folder: str | os.PathLike) -> str:
    """The cause of a short write (:func:`short_write`) into ``folder``, from its file system: less than
    :data:`FULL_BELOW` bytes free is a full disk, said as :func:`cause` says ENOSPC; otherwise torch's line.
    Ask before the partial folder is removed (its files hold the space)."""
    free = free_bytes(folder)
    if free is not None and free < FULL_BELOW:
        return (f"{os.strerror(_errno.ENOSPC)} (ENOSPC): {_HINTS[_errno.ENOSPC]} ({free_bytes_text(free)} after a "
                f"write stopped short: {_first_line(e)})")
    return _first_line(e)


def remove_partial(tmp: pathlib.Path) -> None:
    """Remove what a failed save left (best effort: the space goes back; nothing half-written stays)."""
    shutil.rmtree(tmp, ignore_errors=True)
