"""FSDP's gradient reduce-scatters issued without waiting: the backward goes on while they run.

The transpose of a group's packed all-gather is a packed reduce-scatter. Run synchronously, the
backward stops at every layer until that layer's gradients are reduced. Here the gather of a group
(in the forward, not in a recompute) is an autograd op of a *packed leaf* of its own: the group's
storage blocks concatenated, detached, requiring grad (:meth:`Scatters.gather`). Its backward issues
the reduce-scatter with ``async_op=True`` and returns the output buffer, not yet filled, as the packed
leaf's gradient. Nothing reads it during the backward: the packed leaf is used by that gather alone,
so autograd hands the buffer to ``torch.autograd.grad`` as it is (the leaf is one of its inputs). After
the backward, :meth:`Scatters.finish` waits for every reduce-scatter in the order issued and splits the
buffers into the members' gradients (a group gathered twice in one forward, a tied weight, has two
packed leaves: their gradients are summed then). The bytes and calls are the synchronous ones; the comm
counter records each when issued, in the ``backward`` phase, tagged ``async``. At most
:data:`IN_FLIGHT` are in flight at once: issuing one more first waits for the oldest, whose send buffer
(the layer's full-size gradient) is then freed, so the backward's memory stays that of the synchronous
reduce-scatters plus two layers' gradients.

Under mixed precision (``(param_dtype, reduce_dtype)``) the gather moves the blocks cast to
``param_dtype`` and the reduce-scatter sums in ``reduce_dtype``, as the synchronous
:class:`~hpfunc.transforms.engine.mixed.MixedGather` does. A gradient handed to autograd in another dtype
than its leaf's would be cast by autograd, i.e. read before the reduce-scatter fills it; so where the
reduce dtype is not the storage dtype, the packed leaves are *carriers*: zero-strided tensors of the
reduce dtype shaped like the blocks (no memory), whose only role is to receive the buffer; the values
gathered are read from the blocks, and :meth:`Scatters.finish` casts the reduced gradients to the
storage dtype after the wait.

Used for the groups :func:`~hpfunc.transforms.engine.prefetch.eligible` admits (one gather step) whose
every member the differentiation wants; under a pipeline too (``plans.pp``), whose schedule runs inside
the forward: there the reduce-scatters start in the step's backward after it, overlapping each other and
the packing of the next group's gradients.

    >>> s = Scatters()
    >>> s.entries, s.works
    ([], [])
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import comm as _comm
from hpfunc import lax

__all__ = ["Scatters", "IN_FLIGHT"]

IN_FLIGHT = 2  # reduce-scatters in flight at once in a backward (each holds a full-size send buffer)


class Scatters:
    """The gather leaves of one differentiation and their reduce-scatters in flight."""

    __slots__ = ("entries", "works")

    def __init__(self) -> None:
        self.entries: list[tuple[list[torch.Tensor], list[int], torch.dtype]] = []  # (leaves, members, dtype)
        # (work, send buffer kept alive, axes, (collectors, comm record) to note its wait)
        self.works: list[tuple[Any, torch.Tensor, Any, tuple]] = []

    def gather(self, mesh: Any, blocks: list[torch.Tensor], members: list[int], axes: tuple[str, ...],
               flight: Any = None, mixed: Any = None, carriers: bool = False) -> torch.Tensor:
        """The ``(n, total)`` packed gather of ``blocks`` (waiting for ``flight`` if it was prefetched),
        differentiable with respect to new aliases of the blocks (or carriers, see the module docstring)
        whose reduce-scatter is not waited for. ``mixed``: ``(param_dtype, reduce_dtype)`` or ``None``.
        ``carriers``: the packed leaves are carriers whatever the dtypes (the blocks are device copies of
        offloaded parameters, which an alias would keep alive until the backward ends)."""
        mp = mixed if mixed is not None and blocks[0].is_floating_point() else None
        values = tuple(b.detach() for b in blocks)
        if not carriers and (mp is None or mp[1] == blocks[0].dtype):
            leaves = [v.detach().requires_grad_(True) for v in values]
        else:
            dtype = blocks[0].dtype if mp is None else mp[1]
            leaves = [blocks[0].new_zeros((), dtype=dtype).expand(b.shape).requires_grad_(True) for b in blocks]
        self.entries.append((leaves, members, blocks[0].dtype))
        return _GatherScatterAsync.apply(mesh, axes, flight, self.works, mp, values, *leaves)

    @property
    def leaves(self) -> list[torch.Tensor]:
        return [x for e in self.entries for x in e[0]]

    def finish(self, grads: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """Wait for the reduce-scatters; ``grads``: what the backward returned for :attr:`leaves` (``None``
        where it did not reach one). Returns each member's reduced gradient (storage block shape)."""
        for work, _, ax, note in self.works:
            _wait(work, ax, note)
        self.works.clear()
        out: dict[int, torch.Tensor] = {}
        members = [(j, e[2]) for e in self.entries for j in e[1]]
        for (j, dtype), g in zip(members, grads):
            if g is not None:
                g = g.to(dtype)
                out[j] = g if j not in out else out[j] + g
        self.entries.clear()
        return out


class _GatherScatterAsync(torch.autograd.Function):
    @staticmethod
    def forward(mesh: Any, axes: tuple[str, ...], flight: Any, works: list, mixed: Any, values: tuple,
                *leaves: torch.Tensor) -> torch.Tensor:
        if flight is not None:
            return flight.wait()
        flat = torch.cat([x.reshape(-1) for x in values])
        if mixed is not None:
            flat = flat.to(mixed[0])
        with mesh:
            ax = lax._axes_of(mesh, axes if len(axes) > 1 else axes[0])
            return lax._gather(flat, ax, 0, False, _comm.active(), "all_gather")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.mesh, ctx.axes, _, ctx.works, ctx.mixed = inputs[:5]
        ctx.shapes = [x.shape for x in inputs[6:]]
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        ax = lax._axes_of(ctx.mesh, ctx.axes if len(ctx.axes) > 1 else ctx.axes[0])
        x = g.detach()
        if ctx.mixed is not None:
            x = x.to(ctx.mixed[1])
        if ax.n == 1 or not x.numel():
            return (None, None, None, None, None, None, *_parts(x[0].clone(), ctx.shapes))
        if not ax.identity_order:
            x = x[torch.tensor(ax.g2l)]  # group rank g must receive logical chunk g2l[g]
        flat = x.reshape(-1).clone()
        rec = _comm.record(ctx.collectors, op="reduce_scatter", name="all_gather", axes=ax.names, n=ax.n,
                           payload_bytes=flat.numel() * flat.element_size(), phase="backward", tag="async")
        out = flat.new_empty(flat.numel() // ax.n)
        try:
            work = lax._REDUCE_SCATTER(out, flat, group=ax.group, async_op=True)
        except RuntimeError as e:
            from hpfunc import faults as _faults

            _faults.raise_collective_error(e, "all_gather", ax.names, ax.n)
            raise
        ctx.works.append((work, flat, ax, (ctx.collectors, rec)))
        # a bounded number in flight: the oldest is waited for (and its send buffer, a full-size gradient,
        # freed) when a new one would exceed it, as FSDP2 does
        _wait_older(ctx.works)
        return (None, None, None, None, None, None, *_parts(out, ctx.shapes))


def _wait_older(works: list) -> None:
    """Wait for the oldest reduce-scatters until at most :data:`IN_FLIGHT` still hold their send buffers,
    and free those buffers."""
    in_flight = [k for k, (_, flat, _, _) in enumerate(works) if flat is not None]
    for k in in_flight[: max(len(in_flight) - IN_FLIGHT, 0)]:
        work, _, ax, note = works[k]
        _wait(work, ax, note)
        works[k] = (None, None, ax, note)


def _wait(work: Any, ax: Any, note: tuple) -> None:
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as e:
        from hpfunc import faults as _faults

        _faults.raise_collective_error(e, "all_gather", ax.names, ax.n)
        raise
    _comm.waited(*note)


def _parts(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as each leaf (nothing is read: the buffer may still be being written)."""
    return [p.view(s) for p, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
