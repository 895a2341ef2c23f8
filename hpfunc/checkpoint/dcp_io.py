"""``save(path, state, step=)`` and ``load(path, target)``: a whole train state through
``torch.distributed.checkpoint`` (DCP), written atomically and verified on the way back.

The state is flattened to dotted path keys that name every field (:mod:`hpfunc.checkpoint.keys`:
``params.layers.0.attn.wq``, ``opt_state.mu.layers.0.attn.wq``, ``step``, ``config.model.hidden``; a
NamedTuple's fields by name, so that plain ``torch.distributed.checkpoint`` reads them without hpfunc;
a checkpoint of an older hpfunc with positional keys ``0.layers...`` still loads); DTensor leaves are saved by every rank
as its own blocks, plain tensors once (they are taken to be the same on every rank), other leaves
(ints, floats, strings) by rank 0. The files are DCP's (``.metadata``, ``__<rank>_<n>.distcp``) plus a
completion marker (:mod:`hpfunc.checkpoint.marker`).

A save writes into a hidden sibling ``.NAME.partial``; DCP syncs every file; each rank then checksums
its share of the files, rank 0 writes the marker after all ranks are done and renames the folder to
``NAME``. A folder called ``NAME`` therefore always holds a complete checkpoint.

A load reads the marker, compares the checkpoint's keys, shapes and dtypes with the target (every
mismatch is an error naming the key, before any tensor is read), checks every file's size and (by
default) its CRC-32, each rank its share, then allocates this rank's block of each target leaf and lets
DCP read the overlapping pieces of the saved blocks: a checkpoint saved on one mesh and plan loads on
another (other world size, other specs, one process) without any rank holding the full model.

>>> import tempfile, pathlib, torch
>>> d = pathlib.Path(tempfile.mkdtemp()) / "step_3"
>>> state = {"params": {"w": torch.arange(6.).reshape(2, 3)}, "step": 3, "config": {"name": "tiny"}}
>>> save(d, state, step=3).step
3
>>> out = load(d, abstract(state))
>>> out["params"]["w"].tolist(), out["step"], out["config"]
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 3, {'name': 'tiny'})
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import time
import warnings
from typing import Any

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpfunc import tree as _tree
from hpfunc.checkpoint import _ranks, marker as _marker
from hpfunc.checkpoint.abstract import Abstract, abstract, empty, is_abstract_leaf
from hpfunc.checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError, listed
from hpfunc.checkpoint.files import partial_name, publish
from hpfunc.checkpoint.save_faults import agree, cause, check_step, remove_partial, short_write, short_write_cause
from hpfunc.faults import is_comm_failure
from hpfunc.checkpoint.keys import key_paths

__all__ = ["save", "load", "info", "SaveResult", "flatten_state", "check_metadata", "write_flat", "abstract"]


@attrs.frozen
class SaveResult:
    """A finished save: where, which step, how many bytes, and how long the write took."""

    path: pathlib.Path
    step: int
    bytes: int
    seconds: float


def flatten_state(state: Any) -> dict[str, Any]:
    """``{dotted_path: leaf}`` of a state, tensors detached (what DCP is given)."""
    flat: dict[str, Any] = {}
    for path, leaf in zip(key_paths(state), _tree.leaves(state)):
        if isinstance(leaf, Abstract):
            raise CheckpointError(f"save: the state leaf {path!r} is an abstract {leaf.describe()}, not a value; "
                                  f"save real tensors (abstract states are load targets)")
        flat[path] = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
    if not flat:
        raise CheckpointError("save: the state has no leaves; nothing to save")
    return flat


def check_metadata(metadata: Any) -> None:
    """Refuse, before anything is written, metadata that is not strict JSON."""
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save: metadata must be strict JSON (numbers, strings, lists, dicts; no NaN): {e}; "
                              f"found {metadata!r}") from None


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns on every call made without a process group; one process is a supported case here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _on_rank0(fn, group: Any) -> Any:
    """Run ``fn`` on rank 0; ``(its result, None)`` or ``(None, the cause of its error)`` on every rank."""
    out: Any = (None, None)
    if _ranks.rank(group) == 0:
        try:
            out = (fn(), None)
        except Exception as e:  # noqa: BLE001 - handed to every rank
            out = (None, cause(e))
    return _ranks.from_rank0(out, group)


class _SaveFailed(Exception):
    """A phase of a save failed on some rank; every rank holds the same ``cause``."""


def write_flat(path: str | os.PathLike, flat: dict[str, Any], *, step: int, metadata: Any = None,
               group: Any = None, planner: Any = None, expect_bytes: int | None = None,
               agreed: bool = False) -> SaveResult:
    """The collective write of a flat state (:func:`save` and the async writer's thread; every rank calls it).

    ``planner``: DCP's save planner (``None``: its default); :mod:`hpfunc.checkpoint.safetensors_io`'s
    Block planner lets values be :class:`~hpfunc.checkpoint.safetensors_io.Block` pieces.
    ``expect_bytes``: the size the save is expected to need (the previous checkpoint's), checked against
    the free space first; ``agreed``: the ranks already compared path and step
    (:func:`hpfunc.checkpoint.save_faults.agree`).

    Any failure of the write (no space, read-only, no permission, a folder that vanished) is one
    :class:`CheckpointError` naming the folder, the step and the cause, raised on every rank; the
    partial folder is removed, an older checkpoint of the folder's parent is untouched."""
    start = time.perf_counter()
    step = check_step(step, "save")
    final = pathlib.Path(path)
    tmp = partial_name(final)
    if not agreed:
        agree(final, step, group=group, expect_bytes=expect_bytes)
    try:
        files = _write_phases(final, tmp, flat, step=step, metadata=metadata, group=group, planner=planner)
    except _SaveFailed as e:
        if _ranks.rank(group) == 0:
            remove_partial(tmp)
        raise CheckpointError(f"cannot save the checkpoint of step {step} to {final}: {e}; nothing of it was kept "
                              f"(the partial folder was removed), older checkpoints are untouched") from None
    return SaveResult(final, int(step), sum(f["bytes"] for f in files.values()), time.perf_counter() - start)


def _write_phases(final: pathlib.Path, tmp: pathlib.Path, flat: dict[str, Any], *, step: int, metadata: Any,
                  group: Any, planner: Any) -> dict[str, dict]:
    """The phases of :func:`write_flat`, each ending with the ranks agreeing whether it failed."""

    def prepare() -> None:
        if tmp.exists():  # left by a killed save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _, err = _on_rank0(prepare, group)
    if err is not None:
        raise _SaveFailed(err)
    # every rank's keys: the ranks of a pipeline hold different stages (and so different keys)
    keys: dict[str, dict] = {}
    for part in _ranks.all_gather({k: _marker.key_entry(v) for k, v in flat.items()}, group):
        keys.update(part)
    try:
        with _quiet_single_process():
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group,
                     planner=planner, no_dist=not _ranks.active())
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's error and raises it on every rank
        if is_comm_failure(e):
            raise
        why = cause(e)
        if short_write(e):  # (the same on every rank) rank 0 asks the file system, before the partial folder goes
            why = _ranks.from_rank0(short_write_cause(e, tmp) if _ranks.rank(group) == 0 else None, group)
        raise _SaveFailed(why) from None
    # DCP returns once rank 0 wrote .metadata after every rank's files: list, then checksum in parallel
    names, err = _on_rank0(lambda: sorted(p.name for p in tmp.iterdir() if p.is_file()), group)
    if err is not None:
        raise _SaveFailed(err)
    r, w = _ranks.rank(group), _ranks.world(group)
    try:
        mine, err = _marker.describe_files(tmp, names[r::w]), None
    except Exception as e:  # noqa: BLE001 - handed to every rank
        mine, err = {}, f"{cause(e)} (on rank {r})"
    files: dict[str, dict] = {}
    errors = []
    for part, part_err in _ranks.all_gather((mine, err), group):
        files.update(part)
        errors += [part_err] if part_err else []
    if errors:
        raise _SaveFailed(errors[0])

    def finish() -> None:
        _marker.write(tmp, _marker.build(step=step, metadata=metadata, keys=keys,
                                         files=dict(sorted(files.items())), world_size=w))
        publish(tmp, final)

    _, err = _on_rank0(finish, group)
    if err is not None:
        raise _SaveFailed(err)
    return files


def save(path: str | os.PathLike, state: Any, *, step: int, metadata: Any = None,
         process_group: Any = None, expect_bytes: int | None = None) -> SaveResult:
    """Save ``state`` (any pytree of DTensors, tensors and plain values) as the checkpoint folder ``path``.

    Every rank calls it (SPMD). The folder appears only when complete (see the module docstring); an old
    folder of that name is replaced. ``metadata`` is strict JSON kept in the marker; ``process_group``
    defaults to the whole world.

    >>> import tempfile, pathlib, torch
    >>> save(pathlib.Path(tempfile.mkdtemp()) / "ckpt", {"w": torch.ones(2)}, step=1).bytes > 0
    True
    """
    check_metadata(metadata)
    check_step(step, "save")
    return write_flat(path, flatten_state(state), step=step, metadata=metadata, group=process_group,
                      expect_bytes=expect_bytes)


def info(path: str | os.PathLike) -> dict:
    """The completion marker of a checkpoint (step, metadata, files, keys), checked to exist.

    >>> import tempfile, pathlib, torch
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "c"
    >>> _ = save(d, {"w": torch.ones(2)}, step=5, metadata={"loss": 1.5})
    >>> info(d)["step"], info(d)["metadata"], info(d)["keys"]["w"]
    (5, {'loss': 1.5}, {'kind': 'tensor', 'shape': [2], 'dtype': 'float32'})
    """
    return _marker.read(path)


def _check_target(folder: pathlib.Path, saved: dict[str, dict], target: dict[str, Any],
                  all_targets: set[str] | None = None) -> None:
    """The target's keys, shapes and dtypes against the saved ones. ``all_targets``: the keys of every
    rank's target (a pipeline rank's target holds only its stages': a saved key must be in some rank's)."""
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(set(saved) - (set(target) if all_targets is None else all_targets))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the target has {len(missing)} key(s) the checkpoint lacks: {listed(missing)}")
        if unexpected:
            parts.append(f"the checkpoint has {len(unexpected)} key(s) the target lacks: {listed(unexpected)}")
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(folder)!r} is of another model or state: " + "; ".join(parts) +
            ". Load it into a target built like the saved state (same model config, optimizer and state "
            "structure), or pick the checkpoint of this model")
    for key, want in target.items():
        got = saved[key]
        if isinstance(want, Abstract):
            if got["kind"] != "tensor":
                raise CheckpointMismatchError(f"checkpoint {os.fspath(folder)!r}, key {key!r}: the target wants a "
                                              f"tensor {want.describe()}, the checkpoint holds a {got['type']}")
            if list(want.shape) != got["shape"]:
                raise CheckpointMismatchError(
                    f"checkpoint {os.fspath(folder)!r}, key {key!r}: saved shape {tuple(got['shape'])}, the target "
                    f"wants {want.shape}; the model configs differ (build the target from the saved config, "
                    f"info(path)['metadata'], or load a checkpoint of this config)")
            if _marker.dtype_name(want.dtype) != got["dtype"]:
                raise CheckpointMismatchError(
                    f"checkpoint {os.fspath(folder)!r}, key {key!r}: saved dtype {got['dtype']}, the target wants "
                    f"{_marker.dtype_name(want.dtype)}; load with the saved dtype and cast afterwards")
        elif got["kind"] == "tensor":
            raise CheckpointMismatchError(
                f"checkpoint {os.fspath(folder)!r}, key {key!r}: the checkpoint holds a tensor "
                f"{got['dtype']}{got['shape']}, the target a {type(want).__name__}; give an Abstract (or a tensor) "
                f"for it in the target")


def _verify(folder: pathlib.Path, marker: dict, *, checksums: bool, group: Any) -> None:
    names = sorted(marker["files"])
    r, w = _ranks.rank(group), _ranks.world(group)
    mine = set(names[r::w])
    # sizes of every file on every rank (cheap: what this rank may read), checksums of this rank's share
    problems = _marker.check_files(folder, marker, checksums=False, names=[n for n in names if n not in mine])
    problems += _marker.check_files(folder, marker, checksums=checksums, names=sorted(mine))
    found = sorted({p for part in _ranks.all_gather(problems, group) for p in part})
    if found:
        more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
        raise CorruptCheckpointError(f"checkpoint {os.fspath(folder)!r} is damaged: {found[0]}{more}")


def load(path: str | os.PathLike, target: Any, *, verify: bool = True, process_group: Any = None) -> Any:
    """Load the checkpoint folder ``path`` into the layout of ``target``; returns a state shaped like it.

    ``target`` is an abstract state (:func:`~hpfunc.checkpoint.abstract.abstract`,
    :func:`~hpfunc.checkpoint.abstract.abstract_like`) or a real one (its tensors give the layout; their
    values are not used). Tensor leaves come back as DTensors of the target's sharding (plain tensors
    where it has none); other leaves come back as saved. Every rank calls it.

    Raises (on every rank, before reading any tensor): :class:`IncompleteCheckpointError` (no marker),
    :class:`CheckpointMismatchError` (keys, shapes, dtypes), :class:`CorruptCheckpointError` (a shard file
    missing, another size or, with ``verify``, a checksum mismatch).

    >>> import tempfile, pathlib, torch
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "c"
    >>> _ = save(d, {"w": torch.ones(2)}, step=1)
    >>> load(d, {"w": torch.empty(3)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.checkpoint.errors.CheckpointMismatchError: checkpoint '...', key 'w': saved shape (2,), the target wants (3,); ...
    """
    folder = pathlib.Path(path)
    leaves, treedef = _tree.flatten(target, is_leaf=is_abstract_leaf)
    paths = key_paths(target, is_leaf=is_abstract_leaf)
    positional = key_paths(target, is_leaf=is_abstract_leaf, named=False)
    flat = {p: abstract(x) if isinstance(x, torch.Tensor) else x for p, x in zip(paths, leaves)}
    # one collective: every rank's folder (they must load the same checkpoint) and target keys, named and
    # positional (a checkpoint of an older hpfunc keys NamedTuple fields by position)
    seen = _ranks.all_gather((os.path.abspath(folder), sorted(flat), sorted(positional)), process_group)
    if len({f for f, _, _ in seen}) > 1:
        per_rank = "; ".join(f"rank {r}: {f!r}" for r, (f, _, _) in enumerate(seen))
        raise CheckpointError(f"load: the ranks were given different checkpoints ({per_rank}); every rank must "
                              f"load the same folder")
    marker = _marker.read(folder)
    saved = set(marker["keys"])
    old = paths != positional and not set(paths) <= saved and set(positional) <= saved
    if old:
        paths = positional
        flat = {p: abstract(x) if isinstance(x, torch.Tensor) else x for p, x in zip(paths, leaves)}
    all_targets = {k for _, named, pos in seen for k in (pos if old else named)}
    try:
        _check_target(folder, marker["keys"], flat, all_targets)
        problem = None
    except CheckpointMismatchError as err:
        problem = str(err)
    # the ranks' targets may differ (pipeline stages): every rank raises the first rank's problem
    found = [p for p in _ranks.all_gather(problem, process_group) if p is not None]
    if found:
        raise CheckpointMismatchError(found[0])
    _verify(folder, marker, checksums=verify, group=process_group)
    sd = {k: empty(v) if isinstance(v, Abstract) else v for k, v in flat.items()}
    try:
        with _quiet_single_process():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), process_group=process_group,
                     no_dist=not _ranks.active())
    except Exception as e:  # a file that passed the checks but DCP could not read
        raise CorruptCheckpointError(f"checkpoint {os.fspath(folder)!r}: DCP could not read it: "
                                     f"{type(e).__name__}: {e}") from e
    return _tree.unflatten(treedef, [sd[p] for p in paths])


