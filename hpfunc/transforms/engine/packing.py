"""Bucketing: several tensors moved by one collective, packed in one flat buffer.

Every member is split (or gathered) along its own dimension over the same mesh axes; packing each one
"blocks first" (its ``n`` blocks as the rows of an ``(n, numel / n)`` matrix) and concatenating the
matrices along the columns makes one untiled collective hand every rank its block of each member: the
same bytes as one call per member, one round trip instead of many.

    >>> import torch
    >>> blocks_first(torch.arange(8).reshape(2, 4), 1, 2).tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
"""

from __future__ import annotations

import torch

from hpfunc import lax
from hpfunc.transforms.engine.mixed import all_gather, axis_arg

__all__ = ["blocks_first", "packed_all_gather", "packed_psum_scatter", "packed_psum"]


def blocks_first(g: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """``g`` with dimension ``d`` split into ``n`` blocks, as an ``(n, block numel)`` matrix."""
    shape = list(g.shape)
    split = shape[:d] + [n, shape[d] // n] + shape[d + 1:]
    return g.reshape(split).movedim(d, 0).reshape(n, -1)


def _unpack_gathered(full: torch.Tensor, blocks: list[torch.Tensor], dims: list[int], n: int) -> list[torch.Tensor]:
    """The ``(n, total)`` result of gathering packed ``blocks`` -> each block gathered along its dim."""
    outs = []
    buffer = full.untyped_storage()._cdata  # the storage itself (no data pointer: fake tensors have none)
    for b, d, part in zip(blocks, dims, full.split([b.numel() for b in blocks], dim=1)):
        shape = list(b.shape)
        x = part.reshape([n] + shape).movedim(0, d)
        shape[d] *= n
        x = x.reshape(shape)
        # each member gets storage of its own (a copy-out, as FSDP2 does), also where the reshape happens
        # to be a view: a member viewing the packed buffer would keep all of it alive
        outs.append(x.clone() if x.untyped_storage()._cdata == buffer else x)
    return outs


def packed_all_gather(blocks: list[torch.Tensor], dims: list[int], axes: tuple[str, ...],
                      mp: tuple | None = None) -> list[torch.Tensor]:
    """All-gather each of ``blocks`` along its dimension in ``dims`` over ``axes``, in one collective.
    ``mp``: mixed precision (see :mod:`~hpfunc.transforms.engine.mixed`); differentiable (the transpose
    is one packed reduce-scatter)."""
    n = lax.axis_size(axis_arg(axes))
    flat = torch.cat([b.reshape(-1) for b in blocks])
    full = all_gather(flat, ((0, axes, False),), mp)  # (n, sum of sizes)
    return _unpack_gathered(full, blocks, dims, n)


def packed_psum_scatter(grads: list[torch.Tensor], dims: list[int], axes: tuple[str, ...],
                        then_psum: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """Reduce-scatter each of ``grads`` along its dimension in ``dims`` over ``axes``, in one collective
    (then all-reduce the scattered buffer over ``then_psum``, one more)."""
    n = lax.axis_size(axis_arg(axes))
    mats = [blocks_first(g, d, n) for g, d in zip(grads, dims)]
    flat = lax.psum_scatter(torch.cat(mats, dim=1), axis_arg(axes), scatter_dimension=0, tiled=False)
    if then_psum:
        flat = lax.psum(flat, then_psum)
    outs = []
    for g, d, m, part in zip(grads, dims, mats, flat.split([m.shape[1] for m in mats])):
        shape = list(g.shape)
        shape[d] //= n
        outs.append(part.reshape(shape))
    return outs


def packed_psum(tensors: list[torch.Tensor], axes: tuple[str, ...]) -> list[torch.Tensor]:
    """All-reduce (sum) ``tensors`` over ``axes`` in one collective."""
    flat = lax.psum(torch.cat([t.reshape(-1) for t in tensors]), axes)
    return [part.view(t.shape) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]))]
