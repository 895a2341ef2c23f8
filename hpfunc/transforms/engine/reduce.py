"""Gradient reduction and ZeRO's gather of updated blocks, bucketed.

A per-rank gradient (what the loss's backward gives this rank for its storage block) becomes the
gradient of the single-device step by a sum over every mesh axis the stored block is replicated on
(DDP, the replicate axis of HSDP, parameters replicated over TP); ZeRO-1/2 axes take a reduce-scatter
instead, leaving each rank the block its optimizer state covers (the FSDP axes were reduce-scattered
already, by the transpose of the all-gather that gathered the parameter for use).

Gradients that need the same collective go in one flat buffer (:mod:`~hpfunc.transforms.engine.packing`):
all-reduces bucket by (axes, dtype), reduce-scatters by (axes, remaining axes, dtype). After the
optimizer, ZeRO's updated blocks are all-gathered back to the storage layout, bucketed the same way.

    >>> import torch
    >>> narrow_to_opt(torch.arange(4.0), ()).tolist()    # no ZeRO axis: the storage block itself
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import torch

from hpfunc import lax
from hpfunc.layout import LeafLayout
from hpfunc.transforms.engine.mixed import axis_arg
from hpfunc.transforms.engine.packing import packed_all_gather, packed_psum, packed_psum_scatter

__all__ = ["reduce_gradients", "gather_updated", "narrow_to_opt", "needs_reduction", "reduction_bucket"]


def narrow_to_opt(x: torch.Tensor, extra: tuple) -> torch.Tensor:
    """This rank's optimizer block of a storage block: narrowed on ZeRO's ``(dim, axes)`` (no communication)."""
    for d, axes in extra:
        n = lax.axis_size(axes)
        k = x.shape[d] // n
        x = x.narrow(d, lax.axis_index(axes) * k, k)
    return x


def reduce_gradients(grads: list[torch.Tensor], leaves: list[LeafLayout],
                     reduce_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Per-rank gradients of storage blocks -> reduced, laid out like the optimizer blocks. The
    collectives run in ``reduce_dtype`` (the results come back in each gradient's dtype)."""
    if reduce_dtype is None:
        return _reduce(grads, leaves)
    cast = [g.to(reduce_dtype) if g.is_floating_point() else g for g in grads]
    return [r.to(g.dtype) for r, g in zip(_reduce(cast, leaves), grads)]


def needs_reduction(lay: LeafLayout) -> bool:
    """Whether a gradient of this leaf needs a collective: a replicated or ZeRO-split optimizer block
    (a pipeline's or a pure-FSDP plan's gradients come out of the backward already reduced)."""
    return bool(lay.opt_extra or lay.replicated)


def reduction_bucket(lay: LeafLayout, dtype: torch.dtype) -> tuple | None:
    """The bucket a gradient of this leaf (of ``dtype``) is reduced in: ``("ar", (), axes, dtype)`` (a
    packed ``psum`` over the replicated axes), ``("rs", zero_axes, rest, dtype)`` (a packed
    ``psum_scatter`` on ZeRO's axes, then a ``psum`` over the other replicated axes), ``("rs2", dims,
    rest, dtype)`` (two ZeRO dimensions: its own collectives), or ``None`` (no collective).

    >>> from hpfunc.layout import LeafLayout, LeafSpec
    >>> reduction_bucket(LeafLayout("w", (4,), LeafSpec.of(()), replicated=("dp",)), torch.float32)
    ('ar', (), ('dp',), torch.float32)
    """
    if not needs_reduction(lay):
        return None
    done = {a for _, axes in lay.opt_extra for a in axes}
    rest = tuple(a for a in lay.replicated if a not in done)
    if len(lay.opt_extra) > 1:
        return ("rs2", lay.opt_extra, rest, dtype)
    if lay.opt_extra:
        return ("rs", lay.opt_extra[0][1], rest, dtype)
    return ("ar", (), rest, dtype) if rest else None


def _reduce(grads: list[torch.Tensor], leaves: list[LeafLayout]) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(grads)
    buckets: dict[tuple, list[int]] = {}
    for i, (lay, g) in enumerate(zip(leaves, grads)):
        bucket = reduction_bucket(lay, g.dtype)
        if bucket is None:
            out[i] = g
        elif bucket[0] == "rs2":  # rare (two ZeRO dims): one collective per dimension
            for d, axes in lay.opt_extra:
                g = lax.psum_scatter(g, axis_arg(axes), scatter_dimension=d, tiled=True)
            out[i] = lax.psum(g, bucket[2]) if bucket[2] else g
        else:
            buckets.setdefault(bucket, []).append(i)
    for (kind, axes, rest, _), idx in buckets.items():
        members = [grads[i] for i in idx]
        if kind == "ar":
            reduced = packed_psum(members, rest)
        else:
            reduced = packed_psum_scatter(members, [leaves[i].opt_extra[0][0] for i in idx], axes, then_psum=rest)
        for i, r in zip(idx, reduced):
            out[i] = r
    return out


def gather_updated(blocks: list[torch.Tensor], leaves: list[LeafLayout]) -> list[torch.Tensor]:
    """ZeRO-updated optimizer blocks -> their storage layout (all-gathered on ZeRO's axes, bucketed);
    blocks without a ZeRO axis come back as they are."""
    out: list[torch.Tensor | None] = [None] * len(blocks)
    buckets: dict[tuple, list[int]] = {}
    for i, (lay, x) in enumerate(zip(leaves, blocks)):
        if len(lay.opt_extra) == 1:
            buckets.setdefault((lay.opt_extra[0][1], x.dtype), []).append(i)
        else:
            for d, axes in reversed(lay.opt_extra):
                x = lax.all_gather(x, axis_arg(axes), axis=d, tiled=True)
            out[i] = x
    for (axes, _), idx in buckets.items():
        fulls = packed_all_gather([blocks[i] for i in idx], [leaves[i].opt_extra[0][0] for i in idx], axes)
        for i, f in zip(idx, fulls):
            out[i] = f
    return out
