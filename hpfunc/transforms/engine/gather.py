"""Gather on use, and re-gather in the backward instead of keeping the full parameter (FSDP).

A parameter stored sharded over some mesh axes is all-gathered to its compute block when the model
reads it. The first read of a layer's parameter gathers every parameter of that layer (those under
the same list element ``layers.3``, with the same gather axes and dtype) in one packed collective and
hands the others out on their first read; top-level parameters are gathered alone (the embedding is
used first, the head last). The all-gather's transpose is a reduce-scatter, so the gradient comes back
summed over the FSDP axes and sharded like the storage.

:class:`ParamLayer` is the step's say over saved tensors (:mod:`hpfunc.saved_tensors`): it owns every
parameter storage of the step -- the storage blocks, the gathered parameters and the mixed-precision
copies -- whatever transform is nested inside (an ``offload`` of a layer never copies a parameter).
With reshard after forward it keeps a marker instead of each gathered parameter autograd saves, and
the backward gathers that group again when it first needs one of them (dropping it after the last);
everything else it owns is kept as it is.

    >>> group_key("layers.3.attn.wq", ((0, ("fsdp",)),), "f32"), group_key("embed", ((0, ("fsdp",)),), "f32")
    (('group', 'layers.3', ('fsdp',), 'f32'), ('leaf', 'embed'))
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hpfunc import saved_tensors
from hpfunc.transforms.engine.mixed import all_gather
from hpfunc.transforms.engine.packing import packed_all_gather

__all__ = ["group_key", "gather_group", "ParamLayer"]


def layer_of(path: str) -> str:
    """The list element a parameter path runs through (``layers.3`` of ``layers.3.attn.wq``), or ``""`` for a
    top-level parameter.

    >>> layer_of("layers.3.attn.wq"), layer_of("embed")
    ('layers.3', '')
    """
    parts = path.split(".")
    return next((".".join(parts[: i + 1]) for i, p in enumerate(parts) if p.isdigit()), "")


def group_key(path: str, gather: tuple, dtype: Any) -> tuple:
    """Parameters gathered together: those under the same list element (``layers.3``) with the same gather
    axes and dtype; top-level parameters (and those gathered on several dimensions) each alone."""
    prefix = layer_of(path)
    if not prefix or len(gather) != 1:
        return ("leaf", path)
    return ("group", prefix, gather[0][1], dtype)


def gather_group(blocks: list[torch.Tensor], gathers: list[tuple], mp: tuple | None) -> list[torch.Tensor]:
    """The compute blocks of several storage blocks, gathered by one collective when they share one
    gather (the grouping guarantees it for groups of more than one). ``gathers[k] = ((dim, axes), ...)``;
    ``mp``: mixed precision (:mod:`~hpfunc.transforms.engine.mixed`)."""
    if len(blocks) == 1:
        return [all_gather(blocks[0], tuple((d, axes, True) for d, axes in gathers[0]), mp)]
    return packed_all_gather(blocks, [g[0][0] for g in gathers], gathers[0][0][1], mp)


def _key(t: torch.Tensor) -> int:
    # the storage's address: equal for all views of it, and cheap (this runs for every saved tensor); a
    # freed storage's address can be reused, so every hit is checked against a weak reference
    return t.untyped_storage()._cdata


class _Marker:
    """What autograd keeps instead of a gathered parameter: how to find it again."""

    __slots__ = ("gid", "k", "size", "stride", "offset")

    def __init__(self, gid: int, k: int, t: torch.Tensor):
        self.gid, self.k = gid, k
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class ParamLayer(saved_tensors.Layer):
    """The saved tensors a parallelized step owns (see the module docstring)."""

    name = "hpfunc.parallelize"

    def __init__(self, mesh: Any, *, reshard: bool, any_gather: bool):
        self.mesh, self.reshard = mesh, reshard
        self.needs_hooks = reshard and any_gather  # otherwise it only claims tensors, never changes one
        self._owned: dict[int, tuple[StorageWeakRef, Any]] = {}  # storage -> (ref, (gid, k) or None)
        # claims are registered on the first question (most steps ask none), held weakly until then
        self._claims: list[tuple[weakref.ref, Any]] = []
        self._blocks: list[torch.Tensor] = []  # the storage blocks (alive for the whole differentiation)
        self._groups: dict[int, Callable[[], list[torch.Tensor]]] = {}  # gid -> gather it again
        self._pending: dict[int, list] = {}  # gid -> [markers not yet unpacked, regathered tensors]
        self._last: tuple | None = None  # (tensor, its lookup): the last tensor asked about

    @contextlib.contextmanager
    def keeping_gathered(self) -> Iterator[None]:
        """Inside: gathered parameters saved by autograd are kept as they are (a pipeline holds its
        stages' gathered parameters for the whole schedule, and its split backward unpacks them twice)."""
        reshard, self.reshard = self.reshard, False
        try:
            yield
        finally:
            self.reshard = reshard

    def own(self, t: torch.Tensor) -> None:
        """Claim ``t``'s storage (a cast copy): kept as it is, never moved."""
        self._claims.append((weakref.ref(t), None))

    def own_blocks(self, blocks: list[torch.Tensor]) -> None:
        """Claim the storage blocks of the parameters (the caller keeps ``blocks`` alive meanwhile)."""
        self._blocks = blocks

    def own_gathered(self, fulls: list[torch.Tensor], gid: int, regather: Callable[[], list[torch.Tensor]], *,
                     keep: bool = False) -> None:
        """Claim a gathered group; with reshard after forward, ``regather()`` makes it again in the backward
        (``keep``: kept as gathered instead, a group the backward needs as soon as it starts)."""
        if keep:
            self._claims.extend((weakref.ref(f), None) for f in fulls)
            return
        self._groups[gid] = regather
        self._claims.extend((weakref.ref(f), (gid, k)) for k, f in enumerate(fulls))

    def _info(self, t: torch.Tensor) -> tuple | None:
        if self._last is not None and self._last[0] is t:  # asked by owns() and then by pack() for one tensor
            return self._last[1]
        if self._blocks:
            for b in self._blocks:
                self._owned[_key(b)] = (StorageWeakRef(b.untyped_storage()), None)
            self._blocks = []
        if self._claims:
            for ref, info in self._claims:
                c = ref()
                if c is None:  # freed before anyone asked: nothing to own
                    continue
                k = _key(c)
                if k not in self._owned or self._owned[k][0].expired():
                    self._owned[k] = (StorageWeakRef(c.untyped_storage()), info)
            self._claims.clear()
        hit = self._owned.get(_key(t))
        if hit is not None and hit[0].expired():  # a freed storage whose address was reused
            hit = None
        self._last = (t, hit)
        return hit

    def owns(self, t: torch.Tensor) -> bool:
        if self._info(t) is None:
            self._last = None  # keep no reference to a tensor another layer may move
            return False
        return True

    def pack(self, t: torch.Tensor, outer: saved_tensors.Outer) -> Any:
        hit = self._info(t)
        self._last = None  # the tensor is in autograd's hands now; do not keep it
        if hit is None:  # not a parameter: an activation, for the layers outward (autograd keeps it)
            return outer.pack(t)
        if hit[1] is None or not self.reshard:
            return t.detach()
        gid, k = hit[1]
        entry = self._pending.setdefault(gid, [0, None])
        entry[0] += 1
        return _Marker(gid, k, t)

    def unpack(self, packed: Any, outer: saved_tensors.Outer) -> torch.Tensor:
        if not isinstance(packed, _Marker):
            return packed if isinstance(packed, torch.Tensor) else outer.unpack(packed)
        entry = self._pending[packed.gid]
        if entry[1] is None:
            with torch.no_grad(), self.mesh:
                entry[1] = self._groups[packed.gid]()
        root = entry[1][packed.k]
        entry[0] -= 1
        if entry[0] == 0:
            del self._pending[packed.gid]
        return torch.as_strided(root, packed.size, packed.stride, packed.offset)
