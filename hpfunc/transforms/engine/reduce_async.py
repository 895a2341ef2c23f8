"""Packed gradient reductions issued without waiting and finished later (an executor's explicit reductions).

The lowered step starts its reductions from inside its backward (:mod:`~hpfunc.transforms.engine.overlap`'s
bucket hooks, :mod:`~hpfunc.transforms.engine.scatter_async`'s gather transposes). A pipeline's schedule
says itself when a stage's gradients are final (its ``REDUCE_GRAD``, or its last weight-gradient action),
so its executor starts them there: :func:`start_psum_scatter` issues one packed reduce-scatter of a gather
group's gradients (the transpose of :func:`~hpfunc.transforms.engine.prefetch.start`'s packed all-gather,
packed blocks first as :func:`~hpfunc.transforms.engine.packing.packed_psum_scatter` packs them) and
:func:`start_psum` one packed all-reduce of an all-reduce bucket (as
:func:`~hpfunc.transforms.engine.packing.packed_psum`), both with ``async_op=True``; the schedule goes on
computing while they run, and :meth:`InFlight.wait` returns the reduced tensors. The comm counter records
each when issued (tagged ``async``) and notes its wait, so a trace shows the compute that ran between;
the bytes are those of the synchronous packed collectives.

    >>> import torch
    >>> f = InFlight(None, torch.arange(4.0), [(2,), (2,)], None, (), None, "psum")
    >>> [t.tolist() for t in f.wait()]
    [[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpfunc import comm as _comm
from hpfunc import lax
from hpfunc.transforms.engine.packing import blocks_first

__all__ = ["InFlight", "start_psum", "start_psum_scatter"]


class InFlight:
    """A packed reduction in flight: :meth:`wait` waits for it and returns the reduced members, shaped
    ``shapes``. ``send`` (the packed send buffer) is kept alive until then."""

    __slots__ = ("work", "out", "shapes", "ax", "collectors", "rec", "name", "send")

    def __init__(self, work: Any, out: torch.Tensor, shapes: list[tuple[int, ...]], ax: Any, collectors: tuple,
                 rec: Any, name: str, send: torch.Tensor | None = None):
        self.work, self.out, self.shapes, self.ax = work, out, shapes, ax
        self.collectors, self.rec, self.name, self.send = collectors, rec, name, send

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                from hpfunc import faults as _faults

                _faults.raise_collective_error(e, self.name, self.ax.names, self.ax.n)
                raise
            self.work = None
            _comm.waited(self.collectors, self.rec)
        self.send = None
        sizes = [_numel(s) for s in self.shapes]
        return [p.view(s) for p, s in zip(self.out.split(sizes), self.shapes)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def start_psum(mesh: Any, tensors: list[torch.Tensor], axes: tuple[str, ...]) -> InFlight:
    """Issue the all-reduce (sum) of ``tensors`` over ``axes`` in one packed collective, without waiting."""
    ax = lax._axes_of(mesh, axes if len(axes) > 1 else axes[0])
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    shapes = [tuple(t.shape) for t in tensors]
    collectors = _comm.active()
    work = rec = None
    if ax.n > 1 and flat.numel():
        rec = _comm.record(collectors, op="all_reduce", name="psum", axes=ax.names, n=ax.n,
                           payload_bytes=flat.numel() * flat.element_size(), phase=lax._phase(), tag="async")
        try:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ax.group, async_op=True)
        except RuntimeError as e:
            from hpfunc import faults as _faults

            _faults.raise_collective_error(e, "psum", ax.names, ax.n)
            raise
    return InFlight(work, flat, shapes, ax, collectors, rec, "psum")


def start_psum_scatter(mesh: Any, grads: list[torch.Tensor], dims: list[int], axes: tuple[str, ...]) -> InFlight:
    """Issue the reduce-scatter of each of ``grads`` along its dimension in ``dims`` over ``axes`` in one
    packed collective, without waiting; :meth:`InFlight.wait` returns this rank's block of each sum."""
    ax = lax._axes_of(mesh, axes if len(axes) > 1 else axes[0])
    n = ax.n
    shapes = []
    for g, d in zip(grads, dims):
        shape = list(g.shape)
        shape[d] //= n
        shapes.append(tuple(shape))
    x = torch.cat([blocks_first(g.detach(), d, n) for g, d in zip(grads, dims)], dim=1)  # (n, total)
    if not ax.identity_order:
        x = x[torch.tensor(ax.g2l)]  # group rank g must receive logical chunk g2l[g]
    flat = x.reshape(-1).contiguous()
    collectors = _comm.active()
    work = rec = None
    if n == 1 or not flat.numel():
        out = flat.clone()
    else:
        out = flat.new_empty(flat.numel() // n)
        rec = _comm.record(collectors, op="reduce_scatter", name="psum_scatter", axes=ax.names, n=n,
                           payload_bytes=flat.numel() * flat.element_size(), phase=lax._phase(), tag="async")
        try:
            work = lax._REDUCE_SCATTER(out, flat, group=ax.group, async_op=True)
        except RuntimeError as e:
            from hpfunc import faults as _faults

            _faults.raise_collective_error(e, "psum_scatter", ax.names, n)
            raise
    return InFlight(work, out, shapes, ax, collectors, rec, "psum_scatter", send=flat)
