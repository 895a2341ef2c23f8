"""FSDP forward prefetch: the next layer's all-gather runs while this layer computes.

A step's first differentiation records the order in which the model first reads its gather groups
(:class:`~hpfunc.transforms.engine.differentiate._Reads`; the :class:`~hpfunc.transforms.lowered.Lowered`
keeps it per differentiation of the step, :attr:`Lowered.gather_orders`). From then on, when the forward gathers group ``k`` it also
issues the packed all-gather of group ``k + 1`` with ``async_op=True`` (:func:`start`): one group in
flight ahead, so the collective runs on the process group's thread while layer ``k`` computes; the
first read of group ``k + 1`` waits for it (:meth:`Flight.land`). The landed buffer enters autograd
through :class:`_Landed`, whose transpose is the same packed reduce-scatter as a synchronous gather's,
so gradients and bytes are unchanged: the comm counter records the prefetched gather as the
``all_gather`` it replaces, at the moment it is issued.

Under mixed precision (``mixed = (param_dtype, reduce_dtype)``) the prefetch gathers the blocks cast
to ``param_dtype`` and the transpose reduce-scatters in ``reduce_dtype`` and returns the storage dtype,
as :class:`~hpfunc.transforms.engine.mixed.MixedGather` does: the same bytes.

Not prefetched here: a recompute in the backward (a ``remat`` region, or a resharded group gathered
again for the backward) re-gathers in its turn, prefetched by the backward's own order
(:mod:`~hpfunc.transforms.engine.backward_prefetch`), so nothing is gathered twice; groups gathered in
several steps (a parameter split on two dimensions, e.g. a dense weight under ``fsdp + ep``) gather
synchronously; a prefetched group the forward never reads is waited for and dropped when the forward ends.

    >>> eligible([((0, ("fsdp",)),), ((1, ("fsdp",)),)]), eligible([((0, ("fsdp",)), (1, ("ep",)))])
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import comm as _comm
from hpfunc import lax

__all__ = ["eligible", "mixed_of", "start", "Flight"]


def eligible(gathers: list[tuple]) -> bool:
    """Whether a group of leaves with these gathers (``((dim, axes), ...)`` each) can be prefetched: one
    gather step over the same axes for all."""
    if not gathers:
        return False
    first = gathers[0]
    return len(first) == 1 and all(len(g) == 1 and g[0][1] == first[0][1] for g in gathers)


def mixed_of(block: torch.Tensor, mixed: Any) -> tuple | None:
    """``mixed`` (``(param_dtype, reduce_dtype)``) where it applies to ``block`` (a floating one), else ``None``."""
    return mixed if mixed is not None and block.is_floating_point() else None


class Flight:
    """A packed all-gather in flight: ``land(blocks)`` waits and returns the ``(n, total)`` gathered buffer
    in logical rank order, differentiable with respect to ``blocks`` (the storage blocks it packed)."""

    __slots__ = ("mesh", "axes", "ax", "out", "work", "collectors", "mixed", "rec")

    def __init__(self, mesh: Any, axes: tuple[str, ...], ax: Any, out: torch.Tensor, work: Any, collectors: tuple,
                 mixed: tuple | None = None, rec: Any = None):
        self.mesh, self.axes, self.ax, self.out, self.work, self.collectors = mesh, axes, ax, out, work, collectors
        self.mixed, self.rec = mixed, rec  # rec: its comm record (the wait is noted against it)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                from hpfunc import faults as _faults

                _faults.raise_collective_error(e, "all_gather", self.ax.names, self.ax.n)
                raise
            self.work = None
            _comm.waited(self.collectors, self.rec)
        full = self.out.view(self.ax.n, -1)
        if not self.ax.identity_order:
            full = full[torch.tensor(self.ax.g2l).argsort()]  # row g holds logical rank g2l[g]
        return full

    def land(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        # the blocks are the autograd inputs (the transpose's targets): their values are not read (an
        # offloaded parameter's is its anchor, engine/param_offload.py)
        return _Landed.apply(self, *blocks)


def start(mesh: Any, blocks: list[torch.Tensor], axes: tuple[str, ...], mixed: Any = None, *,
          phase: str | None = None) -> Flight:
    """Issue the packed all-gather of ``blocks`` over ``axes`` without waiting (see the module docstring);
    ``mixed``: ``(param_dtype, reduce_dtype)`` or ``None``; ``phase``: the phase the comm counter records
    (default: the one running; the backward's first re-gather is issued just before it starts)."""
    ax = lax._axes_of(mesh, axes if len(axes) > 1 else axes[0])
    mp = mixed_of(blocks[0], mixed)
    flat = torch.cat([b.detach().reshape(-1) for b in blocks])
    if mp is not None:
        flat = flat.to(mp[0])
    out = flat.new_empty(ax.n * flat.numel())
    collectors = _comm.active()
    rec = _comm.record(collectors, op="all_gather", name="all_gather", axes=ax.names, n=ax.n,
                       payload_bytes=out.numel() * out.element_size(), phase=phase or lax._phase())
    work = None
    if ax.n == 1:
        out.copy_(flat)
    else:
        try:
            work = lax._ALL_GATHER(out, flat, group=ax.group, async_op=True)
        except RuntimeError as e:
            from hpfunc import faults as _faults

            _faults.raise_collective_error(e, "all_gather", ax.names, ax.n)
            raise
    return Flight(mesh, axes, ax, out, work, collectors, mp, rec)


class _Landed(torch.autograd.Function):
    """The prefetched gather as an autograd op of the packed blocks: forward waits for the flight,
    backward reduce-scatters (the transpose of an untiled all-gather on dimension 0, as ``lax.all_gather``'s;
    in the reduce dtype under mixed precision, returned in the storage dtype)."""

    @staticmethod
    def forward(flight: Flight, *blocks: torch.Tensor) -> torch.Tensor:
        return flight.wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        flight, *blocks = inputs
        ctx.mesh, ctx.axes, ctx.collectors, ctx.mixed = flight.mesh, flight.axes, flight.collectors, flight.mixed
        ctx.dtype = blocks[0].dtype
        ctx.shapes = [b.shape for b in blocks]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        if ctx.mixed is not None:
            g = g.to(ctx.mixed[1])
        with ctx.mesh:
            ax = lax._axes_of(ctx.mesh, ctx.axes if len(ctx.axes) > 1 else ctx.axes[0])
            out = lax._scatter(g, ax, 0, False, ctx.collectors, "all_gather").to(ctx.dtype)
        parts = out.split([s.numel() for s in ctx.shapes])
        return (None, *(p.view(s) for p, s in zip(parts, ctx.shapes)))
