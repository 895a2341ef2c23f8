"""Hugging Face safetensors folders written and read by every rank, through DCP's HuggingFace storage.

A :class:`Block` names the pieces of one global tensor that this rank holds (each a local tensor, a
view welcome, at its offsets in the global tensor). :func:`save_safetensors` hands a flat
``{tensor name: Block}`` to ``dcp.save`` with ``torch.distributed.checkpoint.HuggingFaceStorageWriter``
(each rank writes its own pieces, replicas once, into ``sharded/``), then DCP's
``consolidate_safetensors_files_on_every_rank`` assembles the published files (``model-0000i-of-0000N
.safetensors``, each rank the files ``i % world == rank``, one tensor in memory at a time) and the
``model.safetensors.index.json``; the folder is written under a hidden sibling and renamed into place
(atomic, as :func:`hpfunc.checkpoint.save`). :func:`load_safetensors` reads a folder (a hub download, a
``save_pretrained`` folder, an export) into Blocks with ``HuggingFaceStorageReader``: each rank reads
only the slices its pieces cover.

Why Blocks and not DTensors: a stacked ``[E, ...]`` expert tensor is published as ``E`` tensors, and a
rank holds whole experts of it; the view of expert ``e`` inside the rank's block is a piece of the
global tensor ``experts.e`` at known offsets, which a DTensor cannot express without communication. DCP's
planners have an extension point for exactly this (``lookup_object`` / ``lookup_tensor``); a Block
implements the ``__create_write_items__`` / ``__create_chunk_list__`` protocol DTensor uses.

>>> import tempfile, pathlib, torch
>>> d = pathlib.Path(tempfile.mkdtemp()) / "model"
>>> w = torch.arange(6.).reshape(2, 3)
>>> save_safetensors(d, {"w": Block.whole(w), "b": Block.whole(torch.ones(2))}, files={"w": 1, "b": 1})
>>> sorted(p.name for p in d.iterdir())
['model-00001-of-00001.safetensors', 'model.safetensors.index.json']
>>> header(d)["w"]
((2, 3), torch.float32)
>>> out = torch.zeros(1, 3)                      # the second row only
>>> load_safetensors(d, {"w": Block((2, 3), torch.float32, [((1, 0), out)]), "b": Block.whole(torch.zeros(2))})
>>> out.tolist()
[[3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import shutil
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from hpfunc.checkpoint import _ranks
from hpfunc.checkpoint.errors import CheckpointError, CheckpointMismatchError, listed
from hpfunc.checkpoint.files import partial_name, publish
from hpfunc.durable import fsync_file

__all__ = ["Block", "save_safetensors", "load_safetensors", "header", "mmap_safetensors", "write_folder",
           "block_planner", "INDEX_FILE", "SUFFIX"]

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
_SHARDED = "sharded"  # the per-rank files, removed once consolidated


def _ints(x: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


@attrs.define
class Block:
    """This rank's pieces of one global tensor: ``[(offsets, local tensor)]`` (``shape``: the global shape).

    Pieces of different ranks may overlap only where they are replicas (equal values): a save writes
    each distinct piece once. A rank with nothing of the tensor gives no pieces.
    """

    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: torch.dtype
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = attrs.field(factory=list)

    @staticmethod
    def whole(t: torch.Tensor) -> "Block":
        """The whole of a plain tensor (every rank holds all of it)."""
        return Block(tuple(t.shape), t.dtype, [((0,) * t.ndim, t)])

    @staticmethod
    def of(x: torch.Tensor) -> "Block":
        """A DTensor's local block at its global offsets (the whole tensor for a plain one)."""
        if not isinstance(x, DTensor):
            return Block.whole(x)
        from hpfunc.sharding import local_block, sharding_of

        sh = sharding_of(x)
        starts, _ = local_block(tuple(x.shape), sh.mesh, sh.spec, sh.mesh.coordinate())
        local = x.to_local()
        return Block(tuple(x.shape), x.dtype, [(starts, local)] if local.numel() else [])

    def size(self) -> torch.Size:  # DCP compares it with the saved global size
        return torch.Size(self.shape)

    def piece(self, offsets: Sequence[int]) -> torch.Tensor:
        want = _ints(offsets)
        for off, t in self.pieces:
            if _ints(off) == want:
                return t
        raise KeyError(f"no piece at offsets {want} (pieces at {[_ints(o) for o, _ in self.pieces]})")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        items = []
        for off, t in self.pieces:
            chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape)
            items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk,
                                                               properties=TensorProperties.create_from_tensor(t),
                                                               size=self.size())))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in self.pieces]


class _BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which finds a Block's piece by the offsets of the write item.

    The state dict is flat already (tensor names); DCP's flattening would not keep a Block."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Block):
            # a contiguous CPU copy only when needed (the safetensors writer wants CPU tensors)
            return obj.piece(index.offset).detach().cpu()
        return super().lookup_object(index)


class _BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which reads into a Block's piece (in place: views fill their base)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # the default's first step materialises meta tensors and maps every other value to None (a Block
        # is neither); the state dict here is flat and allocated, which is all the rest needs
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Block):
            return obj.piece(index.offset)
        return super().lookup_tensor(index)


@contextlib.contextmanager
def _quiet():
    # DCP warns on calls without a process group (one process is a supported case) and the HF storage
    # classes are marked experimental
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
        log = logging.getLogger("torch.distributed.checkpoint._consolidate_hf_safetensors")
        level = log.level
        log.setLevel(logging.ERROR)  # "Distributed environment not initialized": one process is fine
        try:
            yield
        finally:
            log.setLevel(level)


def _agree(fn: Callable[[], Any], group: Any, what: str) -> Any:
    """Run ``fn`` on rank 0; its result, or its error, on every rank."""
    out: Any = None
    if _ranks.rank(group) == 0:
        try:
            out = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - handed to every rank
            out = ("err", f"{type(e).__name__}: {e}")
    out = _ranks.from_rank0(out, group)
    if out[0] == "err":
        raise CheckpointError(f"{what}: rank 0 failed: {out[1]}")
    return out[1]


def _check_blocks(blocks: Mapping[str, Block], files: Mapping[str, int]) -> None:
    if set(blocks) != set(files):
        raise CheckpointError(f"save_safetensors: every tensor needs a file index and every index a tensor; "
                              f"without an index: {sorted(set(blocks) - set(files))[:8]}, "
                              f"without a tensor: {sorted(set(files) - set(blocks))[:8]}")
    for name, b in blocks.items():
        if not isinstance(b, Block):
            raise TypeError(f"save_safetensors: tensor {name!r} must be a Block (Block.of(x)), found {type(b).__name__}")
        bad = [off for off, t in b.pieces if len(off) != len(b.shape) or t.ndim != len(b.shape)]
        if bad:
            raise CheckpointError(f"save_safetensors: tensor {name!r} of shape {b.shape}: pieces at offsets {bad} "
                                  f"have another number of dimensions")
        if len(b.pieces) > 1:
            # the safetensors writer keeps one entry per name and file: a rank's pieces of one tensor
            # must form one block (merge adjacent ones before)
            raise CheckpointError(f"save_safetensors: tensor {name!r}: this rank holds {len(b.pieces)} separate "
                                  f"pieces of it; DCP's safetensors writer stores one per rank and file; give one "
                                  f"block per rank (reshard so that its pieces are adjacent)")


def save_safetensors(path: str | os.PathLike, blocks: Mapping[str, Block], *, files: Mapping[str, int],
                     extra: Mapping[str, bytes] | None = None, process_group: Any = None) -> None:
    """Write the folder ``path`` of Hugging Face safetensors files from every rank's blocks (collective).

    Args:
        blocks: ``{tensor name: Block}``; the same names on every rank (a rank may hold no piece).
        files: ``{tensor name: file index}``, indices ``1..N``: tensor ``name`` goes to
            ``model-{index:05d}-of-{N:05d}.safetensors``; the same on every rank.
        extra: other files of the folder, written by rank 0 (``{"config.json": bytes}``).

    The folder appears whole or not at all (written in ``.NAME.partial``, synced, renamed); an old one
    is replaced. No rank holds more than its own pieces plus, while consolidating, one whole tensor.
    """
    _check_blocks(blocks, files)
    final = pathlib.Path(path).absolute()
    tmp = partial_name(final)
    sharded = tmp / _SHARDED

    def prepare() -> None:
        if tmp.exists():  # left by a killed export
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _agree(prepare, process_group, f"export to {os.fspath(final)!r}")
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    index = {k: int(v) for k, v in files.items()}
    with _quiet():
        writer = dcp.HuggingFaceStorageWriter(os.fspath(sharded), fqn_to_index_mapping=index, save_distributed=True)
        dcp.save(dict(blocks), storage_writer=writer, planner=_BlockSavePlanner(), process_group=process_group,
                 no_dist=not _ranks.active())
        consolidate_safetensors_files_on_every_rank(os.fspath(sharded), os.fspath(tmp), index,
                                                    process_group=process_group)
    # DCP's consolidation does not sync: each rank syncs the files it wrote, rank 0 the index
    n, r, w = max(index.values()), _ranks.rank(process_group), _ranks.world(process_group)
    for i in sorted(set(index.values())):
        if i % w == r:
            fsync_file(tmp / f"model-{i:05d}-of-{n:05d}{SUFFIX}")
    _ranks.barrier(process_group)

    def finish() -> None:
        shutil.rmtree(sharded)
        # the index from the names (DCP writes one only with a process group; this one is sorted)
        weight_map = {k: f"model-{i:05d}-of-{n:05d}{SUFFIX}" for k, i in sorted(index.items())}
        total = sum(nbytes(b.shape, b.dtype) for b in blocks.values())
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
            fsync_file(tmp / name)
        fsync_file(tmp / INDEX_FILE)
        publish(tmp, final)

    _agree(finish, process_group, f"export to {os.fspath(final)!r}")


def header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{tensor name: (shape, dtype)}`` of every ``*.safetensors`` file of a folder (headers only)."""
    from safetensors import safe_open

    folder = pathlib.Path(path)
    names = sorted(p for p in folder.glob(f"*{SUFFIX}") if p.is_file())
    if not names:
        raise FileNotFoundError(f"no *{SUFFIX} file in {os.fspath(folder)!r}")
    from safetensors.torch import _getdtype

    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in names:
        with safe_open(os.fspath(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in out:
                    raise CheckpointError(f"{os.fspath(folder)!r}: tensor {key!r} is in two files (one is {file.name})")
                out[key] = (tuple(sl.get_shape()), _getdtype(sl.get_dtype()))
    return out


def check_names(folder: str | os.PathLike, found: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                want: Mapping[str, tuple[int, ...]], *, hint: str = "") -> None:
    """Every tensor accounted for: the same names as ``want`` and the same shapes, or an error naming them."""
    missing = sorted(set(want) - set(found))
    unexpected = sorted(set(found) - set(want))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) the model needs: {listed(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {listed(unexpected)}")
        raise CheckpointMismatchError(f"safetensors folder {os.fspath(folder)!r}: " + "; ".join(parts) +
                                      (f". {hint}" if hint else ""))
    for name, shape in want.items():
        if tuple(found[name][0]) != tuple(shape):
            raise CheckpointMismatchError(f"safetensors folder {os.fspath(folder)!r}, tensor {name!r}: expected shape "
                                          f"{tuple(shape)}, found {tuple(found[name][0])}" + (f"; {hint}" if hint else ""))


def load_safetensors(path: str | os.PathLike, blocks: Mapping[str, Block], *, process_group: Any = None) -> None:
    """Fill every rank's Block pieces (in place) from the safetensors folder ``path`` (collective).

    Each rank reads only the slices of the files its pieces cover (DCP's ``HuggingFaceStorageReader``),
    casting to the pieces' dtype. The folder's tensors must be exactly ``blocks``' names and shapes
    (:class:`CheckpointMismatchError` naming the tensors, on every rank, before anything is read).
    """
    folder = pathlib.Path(path)
    found = header(folder)
    check_names(folder, found, {k: b.shape for k, b in blocks.items()})
    with _quiet():
        dcp.load(dict(blocks), storage_reader=dcp.HuggingFaceStorageReader(os.fspath(folder)),
                 planner=_BlockLoadPlanner(), process_group=process_group, no_dist=not _ranks.active())


def file_indices(sizes: Mapping[str, int], limit: int) -> dict[str, int]:
    """``{name: file index}``: names in order, a new file when the next tensor would pass ``limit`` bytes.

    >>> file_indices({"a": 4, "b": 4, "c": 9}, 8)
    {'a': 1, 'b': 1, 'c': 2}
    """
    out, index, used = {}, 1, 0
    for name, nbytes in sizes.items():
        if used and used + nbytes > limit:
            index, used = index + 1, 0
        out[name] = index
        used += nbytes
    return out


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def mmap_safetensors(file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as zero-copy views of a memory map (nothing is read until used).

    A private (copy-on-write) mapping: the views can be written without touching the file. Memory a
    view occupies is page cache, which the kernel reclaims, not the process's own.

    >>> import tempfile, os, torch
    >>> from safetensors.torch import save_file
    >>> f = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> save_file({"x": torch.arange(4.).to(torch.bfloat16)}, f)
    >>> mmap_safetensors(f)["x"]
    tensor([0., 1., 2., 3.], dtype=torch.bfloat16)
    """
    import mmap

    with open(file, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{os.fspath(file)!r} is not a safetensors file ({size} bytes)")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    (hlen,) = __import__("struct").unpack("<Q", mm[:8])
    head = json.loads(mm[8:8 + hlen])
    out: dict[str, torch.Tensor] = {}
    for name, entry in head.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{os.fspath(file)!r}, tensor {name!r}: dtype {entry['dtype']} is not supported")
        start, end = entry["data_offsets"]
        count = math.prod(entry["shape"])
        t = (torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + hlen + start) if count
             else torch.empty(0, dtype=dtype))
        if t.numel() * t.element_size() != end - start:
            raise CheckpointError(f"{os.fspath(file)!r}, tensor {name!r}: {end - start} bytes for shape "
                                  f"{entry['shape']} {entry['dtype']}")
        out[name] = t.view(entry["shape"])
    return out


def write_folder(path: str | os.PathLike, tensors: "Iterable[tuple[str, torch.Tensor]]", *, limit: int,
                 extra: Mapping[str, bytes] | None = None) -> dict[str, str]:
    """Write a safetensors folder from a stream of ``(name, tensor)`` in one process, file by file.

    A file is written as soon as the next tensor would take it past ``limit`` bytes, so at most one
    file's tensors are held (plus the one that opens the next). Files are named ``model-0000i-of-0000N``
    (renamed once ``N`` is known), with an index; the folder is atomic (a hidden sibling, synced,
    renamed). Returns the weight map.
    """
    from safetensors.torch import save_file

    final = pathlib.Path(path).absolute()
    tmp = partial_name(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    written: list[list[str]] = []
    total = 0

    def flush(batch: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous() for k, v in batch.items()}, os.fspath(tmp / f"part-{len(written):05d}"),
                  metadata={"format": "pt"})
        written.append(list(batch))

    try:
        batch: dict[str, torch.Tensor] = {}
        used = 0
        for name, t in tensors:
            size = t.numel() * t.element_size()
            if batch and used + size > limit:
                flush(batch)
                batch, used = {}, 0
            if name in batch or any(name in w for w in written):
                raise CheckpointError(f"write_folder: tensor {name!r} given twice")
            batch[name] = t
            used += size
            total += size
        if batch or not written:
            flush(batch)
        batch = {}
        n = len(written)
        weight_map = {}
        for i, names in enumerate(written):
            fname = f"model-{i + 1:05d}-of-{n:05d}{SUFFIX}"
            os.replace(tmp / f"part-{i:05d}", tmp / fname)
            fsync_file(tmp / fname)
            weight_map.update(dict.fromkeys(names, fname))
        weight_map = dict(sorted(weight_map.items()))
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
        fsync_file(tmp / INDEX_FILE)
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
            fsync_file(tmp / name)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return weight_map


def block_planner() -> DefaultSavePlanner:
    """A DCP save planner for flat state dicts whose values may be :class:`Block` (for ``dcp.save``)."""
    return _BlockSavePlanner()
