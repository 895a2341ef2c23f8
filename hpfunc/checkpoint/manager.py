"""A folder of checkpoints, one per step: save (synchronous or asynchronous), find the newest complete
one, restore, and prune old ones.

The layout is ``root/step_00000120/`` (zero-padded so names sort by step), each a checkpoint of
:func:`hpfunc.checkpoint.save`. A hidden ``.step_XXXXXXXX.partial`` folder is a save in progress or
one a kill interrupted; :func:`latest` never returns it, nor a folder whose files do not match its
marker. Retention: ``keep_last=k`` keeps the ``k`` newest, ``keep_every=n`` also keeps every step that
is a multiple of ``n``; the newest complete checkpoint is never removed. Only rank 0 deletes.

>>> import tempfile, torch
>>> root = tempfile.mkdtemp()
>>> manager = CheckpointManager(root, keep_last=2)
>>> for step in (1, 2, 3):
...     _ = manager.save({"w": torch.full((2,), float(step))}, step)
>>> manager.steps(), latest(root).name
([2, 3], 'step_00000003')
>>> manager.restore({"w": torch.empty(2)})["w"].tolist()
[3.0, 3.0]
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
from typing import Any

from hpfunc.checkpoint import _ranks, marker as _marker
from hpfunc.checkpoint.async_save import DEFAULT_TIMEOUT_S, AsyncSaver, PendingSave
from hpfunc.checkpoint.dcp_io import SaveResult, load, save
from hpfunc.checkpoint.errors import CheckpointError, IncompleteCheckpointError
from hpfunc.checkpoint.marker import MARKER
from hpfunc.checkpoint.files import is_partial, remove_dir

__all__ = ["CheckpointManager", "latest", "complete_steps", "step_dir", "newest_verified", "set_aside", "DAMAGED"]

_STEP = re.compile(r"step_(\d+)")


def step_dir(root: str | os.PathLike, step: int) -> pathlib.Path:
    """``root/step_00000042``."""
    return pathlib.Path(root) / f"step_{int(step):08d}"


def _is_complete(folder: pathlib.Path) -> bool:
    try:
        marker = _marker.read(folder)
    except CheckpointError:
        return False
    return not _marker.check_files(folder, marker, checksums=False)


def complete_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first (marker present, files of the
    recorded sizes; checksums are checked by :func:`~hpfunc.checkpoint.load`)."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir() and _is_complete(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


DAMAGED = ".damaged"


def _problem(folder: pathlib.Path, checksums: bool) -> str | None:
    """Why ``folder`` is not a whole checkpoint (no marker, an unreadable marker, a file missing, of
    another size or, with ``checksums``, another CRC-32), or None."""
    try:
        marker = _marker.read(folder)
    except CheckpointError as e:
        return str(e)
    try:
        problems = _marker.check_files(folder, marker, checksums=checksums)
    except (OSError, KeyError, TypeError) as e:
        return f"{folder}: its files cannot be checked ({type(e).__name__}: {e})"
    return problems[0] if problems else None


def newest_verified(root: str | os.PathLike, *, checksums: bool = True) -> tuple[pathlib.Path | None,
                                                                                  list[tuple[pathlib.Path, str]]]:
    """The newest checkpoint under ``root`` whose files all match its marker (sizes and, with
    ``checksums``, CRC-32s), and ``[(folder, why)]`` of the newer ``step_*`` folders that do not (no
    marker, truncated, a flipped bit), newest first. Nothing is changed on disk (:func:`set_aside`).

    >>> import tempfile, pathlib, torch
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> m = CheckpointManager(root)
    >>> _ = m.save({"w": torch.ones(4)}, 1); _ = m.save({"w": torch.ones(4)}, 2)
    >>> (root / "step_00000002" / MARKER).unlink()
    >>> found, skipped = newest_verified(root)
    >>> found.name, [(p.name, "has no completion marker" in why) for p, why in skipped]
    ('step_00000001', [('step_00000002', True)])
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        return None, []
    candidates = sorted(((int(m.group(1)), p) for p in root.iterdir()
                         if (m := _STEP.fullmatch(p.name)) and p.is_dir()), reverse=True)
    skipped: list[tuple[pathlib.Path, str]] = []
    for _, folder in candidates:
        why = _problem(folder, checksums)
        if why is None:
            return folder, skipped
        skipped.append((folder, why))
    return None, skipped


def set_aside(folder: pathlib.Path) -> pathlib.Path:
    """Rename a damaged checkpoint folder to ``NAME.damaged`` (``.damaged.2``, ... if taken): kept for
    the user to inspect or remove, never again taken for a checkpoint nor replaced by a new save."""
    target = folder.with_name(folder.name + DAMAGED)
    n = 2
    while target.exists():
        target = folder.with_name(f"{folder.name}{DAMAGED}.{n}")
        n += 1
    os.replace(folder, target)
    return target


def latest(root: str | os.PathLike) -> pathlib.Path | None:
    """The folder of the newest complete checkpoint under ``root``, or ``None``.

    >>> import tempfile
    >>> latest(tempfile.mkdtemp()) is None
    True
    """
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


class CheckpointManager:
    """Checkpoints of one run under ``root`` (see the module docstring).

    Args:
        root: the folder of the run's checkpoints (created on the first save).
        keep_last: keep this many newest checkpoints (``None``: all).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        async_save: :meth:`save` stages the state and returns a :class:`PendingSave` at once; the write
            goes on in the background (creating the manager is then a collective call).
        timeout_s: with ``async_save``: how long the background write waits for the other ranks
            (:class:`~hpfunc.checkpoint.async_save.AsyncSaver`).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, keep_every: int | None = None,
                 async_save: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"CheckpointManager: {name} must be a positive int or None, found {v!r}")
        self.root = pathlib.Path(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self._saver = AsyncSaver(after_save=self._prune, timeout_s=timeout_s) if async_save else None
        self._last_bytes: int | None = None  # the previous checkpoint's size: what a save is checked to fit

    def expected_bytes(self) -> int | None:
        """The size a save is expected to need: the last one's, or the newest complete checkpoint's."""
        if self._last_bytes is None:
            newest = self.latest()
            if newest is not None:
                try:
                    self._last_bytes = sum(f["bytes"] for f in _marker.read(newest)["files"].values())
                except (CheckpointError, KeyError, TypeError):
                    return None
        return self._last_bytes

    def save(self, state: Any, step: int, *, metadata: Any = None,
             process_group: Any = None) -> SaveResult | PendingSave:
        """Save ``state`` as step ``step`` (replacing a checkpoint of that step), then prune.

        Before writing, the free space is checked against the previous checkpoint's size where the
        file system reports it (:func:`hpfunc.checkpoint.save`); a failed save raises a
        :class:`CheckpointError` naming the folder, the step and the cause and prunes nothing: the
        previous checkpoint stays the newest complete one.

        ``process_group`` (synchronous managers only) is the group the save's collectives run on
        (default: the whole world), e.g. one with a short timeout for a save on the way out."""
        path = step_dir(self.root, step)
        if self._saver is not None:
            if process_group is not None:
                raise ValueError("CheckpointManager.save: an asynchronous manager saves on its own process group; "
                                 "use a synchronous manager to pass process_group")
            return self._saver.save(path, state, step=step, metadata=metadata, expect_bytes=self.expected_bytes())
        result = save(path, state, step=step, metadata=metadata, process_group=process_group,
                      expect_bytes=self.expected_bytes())
        self._prune(result)
        return result

    def wait(self) -> SaveResult | None:
        """Wait for an asynchronous save in flight (a no-op for synchronous managers)."""
        return None if self._saver is None else self._saver.wait()

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return complete_steps(self.root)

    def latest(self) -> pathlib.Path | None:
        """The newest complete checkpoint's folder, or ``None``."""
        return latest(self.root)

    def restore(self, target: Any, *, step: int | None = None, verify: bool = True) -> Any:
        """Load step ``step`` (default: the newest complete one) into ``target``'s layout."""
        path = self.latest() if step is None else step_dir(self.root, step)
        if path is None:
            raise IncompleteCheckpointError(f"no complete checkpoint under {os.fspath(self.root)!r} to restore; "
                                            f"start from scratch or point root at the run's checkpoint folder")
        return load(path, target, verify=verify)

    def _prune(self, result: SaveResult) -> None:
        """On rank 0: remove checkpoints the retention does not keep, and folders left by killed saves."""
        self._last_bytes = result.bytes
        if _ranks.rank(None) != 0:
            return
        steps = complete_steps(self.root)
        keep = set(steps if self.keep_last is None else steps[-self.keep_last:])
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        keep.add(result.step)
        for s in steps:
            if s not in keep:
                remove_dir(step_dir(self.root, s))
        for p in self.root.iterdir():
            if is_partial(p.name) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
