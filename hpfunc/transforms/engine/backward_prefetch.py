"""FSDP backward prefetch: the backward's re-gather of the next layer runs while this layer's backward computes.

With reshard after forward, a layer's gathered parameters are dropped after its forward and gathered
again when the backward first needs them: by :class:`~hpfunc.transforms.engine.gather.ParamLayer` when
autograd unpacks a saved parameter, or by the recompute of a ``remat`` region, which reads the
parameters again. Every such re-gather of one differentiation goes through :meth:`Regathers.gather`.
The first run of a differentiation of a lowered step records their order (by group, first member; a
group re-gathered twice appears twice); the
:class:`~hpfunc.transforms.lowered.Lowered` keeps it per differentiation
(:attr:`Lowered.regather_orders`). From then on, the re-gather at position ``k`` of that order issues
the packed all-gathers of positions ``k + 1 .. k + AHEAD`` with ``async_op=True``
(:func:`~hpfunc.transforms.engine.prefetch.start`), so they run on the process group's thread while
layer ``k``'s backward computes, and position ``k + 1`` lands the buffer instead of gathering. At most
:data:`AHEAD` groups are in flight beyond the one in use.

The bytes and calls are exactly those of the synchronous re-gathers (the same collectives, earlier;
the comm counter records each when issued, in the ``backward`` phase); a recompute neither gathers
again what was prefetched for it nor prefetches what is already in flight (the position in the
recorded order says which). A backward whose re-gathers leave the recorded order (a model whose
reads depend on the data) stops prefetching there; what it prefetched and did not use is waited for
and dropped when the backward ends (extra bytes, the one case where they differ).

Groups :func:`~hpfunc.transforms.engine.prefetch.eligible` rejects (gathers in several steps) are
gathered synchronously in their turn; under mixed precision the prefetch moves the compute dtype, as
the synchronous gather does.

    >>> r = Regathers(None, None, order=None, record=True)
    >>> r.seen, r.finish()  # nothing re-gathered: an empty order
    ([], ())
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc.transforms.engine import prefetch
from hpfunc.transforms.engine.gather import gather_group
from hpfunc.transforms.engine.outside_checkpoint import outside
from hpfunc.transforms.engine.packing import _unpack_gathered

__all__ = ["Regathers", "AHEAD"]

AHEAD = 1  # groups gathered ahead of the one the backward uses (each holds one layer's full parameters)


class Regathers:
    """The backward re-gathers of one differentiation (see the module docstring). ``cfg``: the step's
    :class:`~hpfunc.transforms.engine.differentiate.EngineConfig`; ``ws``: the parameter blocks;
    ``order``: the recorded order, or ``None`` (record it if ``record``, else gather synchronously)."""

    __slots__ = ("cfg", "ws", "order", "seen", "pos", "issued", "flights", "host")

    def __init__(self, cfg: Any, ws: Any, *, order: tuple[int, ...] | None, record: bool, host: Any = None):
        self.cfg, self.ws, self.order = cfg, ws, order
        # the offloaded parameters (engine/param_offload.py): their blocks copied in before each gather
        self.host = host
        self.seen: list[int] | None = [] if record and order is None else None
        self.pos = 0  # the position in the order of the next re-gather
        self.issued = 1  # positions below this were issued (position 0 is gathered in its turn)
        self.flights: dict[int, prefetch.Flight] = {}  # position -> its gather in flight

    def gather(self, members: list[int], blocks: list[torch.Tensor], specs: list[tuple], mixed: Any
               ) -> list[torch.Tensor]:
        """The gathered group ``members`` (of ``blocks``, storage blocks, differentiable through them when
        they require grad), landed if it was prefetched, and the next groups issued."""
        first = members[0]
        if self.seen is not None:
            self.seen.append(first)
        with outside() as clear:
            flight = self._arrive(first) if clear else None
            if flight is None:
                host = self.host
                fulls = gather_group(host.fill(members, blocks) if host is not None else blocks, specs, mixed)
                if clear:
                    self._ahead()
                return fulls
            self._ahead()  # queued behind the landing one: both run while this layer computes
            grad = torch.is_grad_enabled() and any(b.requires_grad for b in blocks)
            full = flight.land(blocks) if grad else flight.wait()
            return _unpack_gathered(full, blocks, [g[0][0] for g in specs], full.shape[0])

    def _arrive(self, first: int) -> prefetch.Flight | None:
        """The flight prefetched for this re-gather (``None``: none); leaves the order on a mismatch."""
        order = self.order
        if order is None:
            return None
        k = self.pos
        if k >= len(order) or order[k] != first:
            self.order = None  # not the recorded order: synchronous from here on
            return None
        self.pos = k + 1
        return self.flights.pop(k, None)

    def begin(self) -> None:
        """Before the backward: issue the first re-gather, which then runs while the backward computes the
        groups the forward kept gathered (:func:`~hpfunc.transforms.engine.differentiate.kept_after_forward`)."""
        if self.order and self.issued == 1 and self.pos == 0 and 0 not in self.flights:
            self._issue(0)

    def _ahead(self) -> None:
        order = self.order
        if order is None:
            return
        last = min(self.pos + AHEAD, len(order))  # positions pos .. pos + AHEAD - 1 come next
        while self.issued < last:
            p = self.issued
            self.issued += 1
            self._issue(p)

    def _issue(self, p: int) -> None:
        order, cfg = self.order, self.cfg
        members = cfg.group_of[order[p]]
        specs = [cfg.leaves[j].gather for j in members]
        if prefetch.eligible(specs):
            blocks = [self.ws[j] for j in members]
            host = self.host
            if host is not None:
                blocks = host.fill(members, [b.detach() for b in blocks])
                if p + 1 < len(order):  # the next one's blocks copied in while this layer's backward runs
                    host.start(cfg.group_of[order[p + 1]])
            self.flights[p] = prefetch.start(cfg.mesh, blocks, specs[0][0][1], cfg.mixed, phase="backward")

    def finish(self) -> tuple[int, ...]:
        """After the backward: wait for and drop what was prefetched and not used; the order seen."""
        for flight in self.flights.values():
            flight.wait()
        self.flights.clear()
        seen, self.seen = tuple(self.seen or ()), None
        return seen
