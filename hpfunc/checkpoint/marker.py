"""The completion marker: ``hpfunc_checkpoint.json``, written last, after every file is synced.

Its presence means the save finished; it records the step, the user's metadata, the hpfunc and torch
versions, every file with its size and CRC-32, and every key with its kind, shape, dtype and the
layout it was saved from. A folder without it is incomplete; a file that differs from it is corrupt.

>>> import pathlib, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "data.bin").write_bytes(b"abc")
>>> m = build(step=7, metadata={"lr": 0.1}, keys={}, files=describe_files(d, ["data.bin"]), world_size=1)
>>> write(d, m)
>>> read(d)["step"], check_files(d, read(d), checksums=True)
(7, [])
>>> _ = (d / "data.bin").write_bytes(b"abd")
>>> check_files(d, read(d), checksums=True)[0]  # doctest: +ELLIPSIS
'...data.bin: checksum mismatch (crc32 ... recorded, ... found); the file is corrupt, load another checkpoint'
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable

import torch

from hpfunc.checkpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from hpfunc.checkpoint.files import file_crc32
from hpfunc.durable import fsync_dir, fsync_file

__all__ = ["MARKER", "FORMAT", "build", "write", "read", "describe_files", "check_files", "key_entry",
           "dtype_name", "parse_dtype"]

MARKER = "hpfunc_checkpoint.json"
FORMAT = "hpfunc-dcp-checkpoint/1"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint's marker")
    return dtype


def key_entry(value: Any) -> dict[str, Any]:
    """What the marker records of one saved leaf."""
    from torch.distributed.tensor import DTensor

    from hpfunc.checkpoint.safetensors_io import Block

    if isinstance(value, Block):  # pieces of a global tensor (an offline conversion's stacked experts)
        return {"kind": "tensor", "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    if isinstance(value, torch.Tensor):
        entry: dict[str, Any] = {"kind": "tensor", "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
        if isinstance(value, DTensor):
            from hpfunc.sharding import sharding_of

            sh = sharding_of(value)
            entry["saved_as"] = f"{sh.spec!r} on {sh.mesh.shape}"
        return entry
    return {"kind": "object", "type": type(value).__name__}


def describe_files(folder: pathlib.Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": n, "crc32": hex}}`` of files in ``folder``."""
    return {n: {"bytes": (folder / n).stat().st_size, "crc32": file_crc32(folder / n)} for n in names}


def build(*, step: int, metadata: Any, keys: dict[str, dict], files: dict[str, dict], world_size: int) -> dict:
    from hpfunc import __version__

    return {"format": FORMAT, "step": int(step), "metadata": metadata, "hpfunc_version": __version__,
            "torch_version": torch.__version__, "world_size": int(world_size), "files": files, "keys": keys}


def write(folder: pathlib.Path, marker: dict) -> None:
    """Write the marker into ``folder`` (strict JSON), sync it and the folder."""
    try:
        text = json.dumps(marker, indent=1, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata must be strict JSON (numbers, strings, lists, dicts; no NaN): "
                              f"{e}; found {marker.get('metadata')!r}") from None
    path = folder / MARKER
    with open(path, "w") as f:
        f.write(text)
    fsync_file(path)
    fsync_dir(folder)


def read(folder: str | os.PathLike) -> dict:
    """The marker of a checkpoint folder; :class:`IncompleteCheckpointError` where there is none."""
    folder = pathlib.Path(folder)
    path = folder / MARKER
    if not folder.is_dir():
        raise IncompleteCheckpointError(f"no checkpoint at {os.fspath(folder)!r}: the folder does not exist; "
                                        f"use hpfunc.checkpoint.latest(root) to find the newest complete one")
    if not path.exists():
        raise IncompleteCheckpointError(
            f"checkpoint {os.fspath(folder)!r} is incomplete: it has no completion marker {MARKER} (the save did "
            f"not finish: the process was killed or a rank failed); load the previous one, e.g. "
            f"hpfunc.checkpoint.latest(root), which skips incomplete checkpoints")
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: the completion marker is not readable JSON ({e}); the checkpoint "
                                     f"cannot be trusted, load another one") from None
    if not isinstance(marker, dict):
        raise CorruptCheckpointError(f"{path}: the completion marker is damaged: expected a JSON object, found a "
                                     f"{type(marker).__name__}; the checkpoint cannot be trusted, load another one")
    found = marker.get("format")
    family = FORMAT.rsplit("/", 1)[0] + "/"
    if found != FORMAT:
        if isinstance(found, str) and found.startswith(family) and found[len(family):].isdigit():
            raise CorruptCheckpointError(f"{path}: the checkpoint is of format {found!r}, this hpfunc reads "
                                         f"{FORMAT!r}; load it with the hpfunc version that wrote it "
                                         f"({marker.get('hpfunc_version')!r})")
        raise CorruptCheckpointError(f"{path}: the completion marker is damaged: its 'format' key reads {found!r}, "
                                     f"expected {FORMAT!r}; the checkpoint cannot be trusted, load another one")
    lacking = [k for k, kind in (("step", int), ("files", dict), ("keys", dict)) if not isinstance(marker.get(k), kind)]
    if lacking:
        raise CorruptCheckpointError(f"{path}: the completion marker is damaged: the key(s) {lacking} are missing or "
                                     f"of the wrong type; the checkpoint cannot be trusted, load another one")
    return marker


def check_files(folder: pathlib.Path, marker: dict, *, checksums: bool, names: Iterable[str] | None = None) -> list[str]:
    """Problems with the files the marker lists (all, or ``names``): missing, another size, a CRC mismatch."""
    problems = []
    files = marker["files"]
    for name in sorted(files) if names is None else names:
        want = files[name]
        path = folder / name
        if not path.exists():
            problems.append(f"{path}: shard file missing (the marker lists it with {want['bytes']} bytes); the "
                            f"checkpoint is damaged, load another one")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes found, {want['bytes']} recorded in {MARKER}; the file was "
                            f"truncated or replaced, load another checkpoint")
            continue
        if checksums:
            crc = file_crc32(path)
            if crc != want["crc32"]:
                problems.append(f"{path}: checksum mismatch (crc32 {want['crc32']} recorded, {crc} found); the file "
                                f"is corrupt, load another checkpoint")
    return problems
