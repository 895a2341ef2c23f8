"""Hot-expert replicas: copies of the most-loaded experts on other expert-parallel ranks, which take a
share of those experts' tokens.

Under expert parallelism rank ``r`` of ``n`` owns experts ``[r E/n, (r+1) E/n)``. A skewed router sends
most pairs to a few experts, so their ranks compute (and receive) far more rows than the mean. A
:class:`Placement` (plain data, the same on every rank) names, per rank, the experts it holds a *copy*
of besides its own; :class:`ReplicatedAllToAll` is the dropless all-to-all dispatcher that splits each
expert's pairs among its holders and derives the copies' weights from the owner inside the step:

1. **weights**: one ``lax.all_to_all`` over the expert-parallel axis sends each owner's hot experts'
   ``w_gate, w_up, w_down`` (packed in one row per copy) to the ranks holding their copies. Its
   transpose, the reverse all-to-all, brings the copies' weight gradients back to the owner, where the
   row gather's transpose (an ``index_add``) sums them with the owner's own gradient. So the copies'
   gradients are summed by autograd, the optimizer state stays with the owner, nothing persists on the
   copy ranks, and a new placement moves nothing but the next step's exchange;
2. **tokens**: a source rank sends the ``p``-th of its pairs for expert ``e`` (in token order) to the
   holder ``(p + source rank) % copies(e)`` of ``e`` (the owner first, then the copy ranks in rank
   order): deterministic, each holder gets ``1 / copies(e)`` of every source's pairs up to one row, and
   the rotation by source rank spreads the remainders. Then the count exchange, the unequal-split
   all-to-all of the rows, grouped compute of this rank's experts and copies, and the reverse, as
   :class:`hpfunc.models.dispatch.AllToAll` does.

A placement is a pure function of the observed global load (:func:`place_hot_experts` of the
``expert_load`` a step reports, summed over the data shards, so identical on every rank); re-decide it
every ``N`` steps and pass the new dispatcher to the next steps. The cost: every step sends each copy's
weights once forward and its gradient once backward (:func:`replica_bytes`).

    >>> load = [40, 2, 1, 1, 2, 1, 1, 0]                    # expert 0 is hot; 2 ranks own 4 experts each
    >>> p = place_hot_experts(load, ranks=2, slots=1)
    >>> p.copies, p.holders(0)                              # rank 1 holds a copy of expert 0
    (((), (0,)), (0, 1))
    >>> expected_rank_rows(load, no_replicas(8, 2)), expected_rank_rows(load, p)
    ([44.0, 4.0], [24.0, 24.0])
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple, Sequence

import attrs
import torch

from hpfunc import lax
from hpfunc.layout import PlanError
from hpfunc.models.moe import expert_ffn

__all__ = ["Placement", "no_replicas", "place_hot_experts", "expected_rank_rows", "replica_bytes",
           "route_pairs", "ReplicatedAllToAll", "ReplicatedDispatched"]


def _check_copies(self: "Placement", _attr: object, copies: tuple[tuple[int, ...], ...]) -> None:
    E, n = self.num_experts, len(copies)
    if n < 1 or E < 1 or E % n:
        raise PlanError(f"Placement: {E} experts must split evenly over the {n} ranks of the copies table "
                        f"(one tuple of copied expert ids per expert-parallel rank)")
    local = E // n
    for r, held in enumerate(copies):
        for e in held:
            if not 0 <= e < E:
                raise PlanError(f"Placement: rank {r} holds a copy of expert {e}, outside [0, {E})")
            if e // local == r:
                raise PlanError(f"Placement: rank {r} owns expert {e} (experts [{r * local}, {(r + 1) * local}) "
                                f"are its own); a copy goes on another rank")
        if list(held) != sorted(set(held)):
            raise PlanError(f"Placement: rank {r}'s copies {held} must be distinct and in increasing order")


def _tuples(copies: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(e) for e in held) for held in copies)


@attrs.frozen
class Placement:
    """Which expert-parallel rank holds a copy of which expert: ``copies[r]`` the (increasing) ids of
    the experts rank ``r`` holds besides its own ``[r E/n, (r+1) E/n)``. Plain data: compare, hash, log
    it; every rank must use the same one.

    >>> p = Placement(4, ((), (0,)))
    >>> p.ranks, p.holders(0), p.holders(1), p.experts_on(1)
    (2, (0, 1), (0,), (2, 3, 0))
    >>> Placement(4, ((1,), ()))
    Traceback (most recent call last):
      ...
    hpfunc.layout.step.PlanError: Placement: rank 0 owns expert 1 (experts [0, 2) are its own); a copy goes on another rank
    """

    num_experts: int
    copies: tuple[tuple[int, ...], ...] = attrs.field(converter=_tuples, validator=_check_copies)

    @property
    def ranks(self) -> int:
        """The size of the expert-parallel axis."""
        return len(self.copies)

    @property
    def local(self) -> int:
        """Experts each rank owns."""
        return self.num_experts // self.ranks

    @property
    def num_copies(self) -> int:
        """Copies over all ranks (each copy's weights travel once per step forward, once backward)."""
        return sum(len(held) for held in self.copies)

    def owner(self, expert: int) -> int:
        """The rank that owns ``expert`` (holds its weights and optimizer state)."""
        return expert // self.local

    def holders(self, expert: int) -> tuple[int, ...]:
        """The ranks computing ``expert``: its owner first, then the ranks holding a copy, in rank order."""
        return (self.owner(expert),) + tuple(r for r, held in enumerate(self.copies) if expert in held)

    def experts_on(self, rank: int) -> tuple[int, ...]:
        """The experts ``rank`` computes, in its compute order: its own, then its copies."""
        return tuple(range(rank * self.local, (rank + 1) * self.local)) + self.copies[rank]


def no_replicas(num_experts: int, ranks: int) -> Placement:
    """The placement without copies (plain expert parallelism).

    >>> no_replicas(8, 4).copies
    ((), (), (), ())
    """
    return Placement(num_experts, ((),) * ranks)


def _rank_loads(load: Sequence[Fraction], holders: list[list[int]], ranks: int) -> list[Fraction]:
    out = [Fraction(0)] * ranks
    for e, hs in enumerate(holders):
        for r in hs:
            out[r] += load[e] / len(hs)
    return out


def place_hot_experts(load: Sequence[float] | torch.Tensor, *, ranks: int, slots: int) -> Placement:
    """A placement with up to ``slots`` copies per rank, decided from one MoE layer's global expert
    load ``load [E]`` (pairs per expert, e.g. a row of a step's ``expert_load``).

    Greedy and exact (rational arithmetic, ties to the lowest expert and rank), so a pure function of
    the load. The expected rows of a rank are its experts' loads, each shared equally by the expert's
    holders (as :class:`ReplicatedAllToAll` splits it). Repeatedly, of the copies of an expert the
    most-loaded rank computes onto a rank with a free slot, add the one that leaves the ranks' rows
    smallest (sorted largest first, compared lexicographically); stop when none lowers them. Uniform load
    gets no copies.

    >>> place_hot_experts([9, 1, 1, 1], ranks=2, slots=1).copies   # rank loads 10, 2 -> 6, 6
    ((2,), (0,))
    >>> place_hot_experts([1, 1, 1, 1], ranks=2, slots=2).copies
    ((), ())
    """
    values = [float(v) for v in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    E = len(values)
    if ranks < 1 or E % ranks:
        raise PlanError(f"place_hot_experts: {E} experts (the length of the load) must split evenly over "
                        f"ranks={ranks}")
    if slots < 0:
        raise ValueError(f"place_hot_experts: slots must be >= 0 (copies per rank), found {slots}")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"place_hot_experts: the load must be finite counts >= 0, found {values}")
    exact = [Fraction(v) for v in values]
    local = E // ranks
    holders = [[e // local] for e in range(E)]
    copies: list[list[int]] = [[] for _ in range(ranks)]
    loads = _rank_loads(exact, holders, ranks)
    while True:
        hot = loads.index(max(loads))
        best, best_key = None, sorted(loads, reverse=True)
        for e in range(E):
            if hot not in holders[e] or exact[e] == 0:
                continue
            c = len(holders[e])
            for target in range(ranks):
                if len(copies[target]) >= slots or target in holders[e]:
                    continue
                new = list(loads)
                for r in holders[e]:  # each holder's share drops from load / c to load / (c + 1)
                    new[r] -= exact[e] / c - exact[e] / (c + 1)
                new[target] += exact[e] / (c + 1)
                key = sorted(new, reverse=True)
                if key < best_key:  # strictly better ranks' loads, largest first: terminates
                    best, best_key = (e, target, new), key
        if best is None:
            return Placement(E, tuple(tuple(sorted(held)) for held in copies))
        e, target, loads = best
        holders[e].append(target)
        copies[target].append(e)


def expected_rank_rows(load: Sequence[float] | torch.Tensor, placement: Placement) -> list[float]:
    """The rows each rank computes when every expert's ``load`` is shared equally by its holders (the
    split of :func:`route_pairs` up to one row per source rank and expert).

    >>> expected_rank_rows([6, 0, 2, 2], Placement(4, ((), (0,))))
    [3.0, 7.0]
    """
    values = load.tolist() if isinstance(load, torch.Tensor) else list(load)
    if len(values) != placement.num_experts:
        raise ValueError(f"expected_rank_rows: the load has {len(values)} experts, the placement "
                         f"{placement.num_experts}")
    holders = [list(placement.holders(e)) for e in range(placement.num_experts)]
    return [float(x) for x in _rank_loads([Fraction(float(v)) for v in values], holders, placement.ranks)]


def replica_bytes(placement: Placement, expert_bytes: int) -> tuple[list[int], list[int]]:
    """Bytes each rank sends per step for the copies: ``(forward, backward)``. Forward, the owners send
    their hot experts' weights; backward, the copy ranks send the copies' gradients back to the owners.
    ``expert_bytes``: one expert's ``w_gate, w_up, w_down`` on a rank (``3 I H`` elements; ``3 I H / t``
    under expert-tensor parallelism ``t``). A new placement costs nothing more: no copy outlives a step.

    >>> replica_bytes(Placement(8, ((4,), (0, 1))), 100)
    ([200, 100], [100, 200])
    """
    forward = [0] * placement.ranks
    for held in placement.copies:
        for e in held:
            forward[placement.owner(e)] += expert_bytes
    return forward, [len(held) * expert_bytes for held in placement.copies]


class _Slots(NamedTuple):
    """The placement as lookup tables on a device: each (expert, copy) -> global compute slot."""

    table: torch.Tensor      # [E, max copies] int64: slot of the c-th holder of e (unused: 0)
    num_holders: torch.Tensor  # [E] int64
    rank_of_slot: torch.Tensor  # [S] int64
    per_rank: tuple[int, ...]   # slots (experts computed) per rank


def _slots(placement: Placement, device: torch.device) -> _Slots:
    offsets, total = [], 0
    for r in range(placement.ranks):
        offsets.append(total)
        total += len(placement.experts_on(r))
    rows = []
    for e in range(placement.num_experts):
        row = []
        for r in placement.holders(e):
            row.append(offsets[r] + placement.experts_on(r).index(e))
        rows.append(row)
    width = max(len(row) for row in rows)
    table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64, device=device)
    per_rank = tuple(len(placement.experts_on(r)) for r in range(placement.ranks))
    rank_of_slot = torch.repeat_interleave(torch.arange(placement.ranks, device=device),
                                           torch.tensor(per_rank, device=device))
    return _Slots(table, torch.tensor([len(row) for row in rows], dtype=torch.int64, device=device),
                  rank_of_slot, per_rank)


def route_pairs(indices: torch.Tensor, placement: Placement, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a source rank's pairs go: ``(order, slot)``, the ``T k`` pairs of ``indices [T, k]`` sorted
    by compute slot (so by destination rank, then by the expert or copy there) and each sorted pair's
    slot. The ``p``-th pair of expert ``e`` (token order) goes to holder ``(p + source) % copies(e)``.

    >>> order, slot = route_pairs(torch.tensor([[0], [0], [0], [1]]), Placement(4, ((), (0,))), source=0)
    >>> slot.tolist()                  # slots: rank 0 computes experts 0, 1 (slots 0, 1); rank 1: 2, 3, copy of 0
    [0, 0, 1, 4]
    """
    return _route(indices, placement, _slots(placement, indices.device), source)


def _route(indices: torch.Tensor, placement: Placement, slots: _Slots, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = indices.reshape(-1)
    with torch.no_grad():
        by_expert = torch.argsort(flat, stable=True)
        expert = flat[by_expert]
        counts = torch.bincount(flat, minlength=placement.num_experts)
        pos = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
        copy = (pos + source) % slots.num_holders[expert]
        slot = slots.table[expert, copy]
        by_slot = torch.argsort(slot, stable=True)
    return by_expert[by_slot], slot[by_slot]


class ReplicatedDispatched(NamedTuple):
    """What :meth:`ReplicatedAllToAll.dispatch` hands to the experts and keeps for the combine."""

    tokens: torch.Tensor          # [N, H] received rows grouped by this rank's compute slot
    counts: torch.Tensor          # [experts_on(rank)] int64: rows per own expert, then per copy
    order: torch.Tensor           # [T k] the pairs sorted by destination slot
    regroup: torch.Tensor         # [N] received (by source rank) -> grouped by slot
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    k: int
    axis: str | None
    own_rows: int                 # rows for this rank's own experts (the first ones); the copies' follow


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@attrs.frozen
class ReplicatedAllToAll:
    """Dropless all-to-all dispatch with hot-expert copies (see the module docstring): pass it to
    :func:`hpfunc.models.moe.moe_block` as ``dispatcher=``; the block asks :meth:`expert_outputs` for
    the received rows' outputs (this rank's experts and its copies). With
    :func:`no_replicas` it routes exactly as :class:`hpfunc.models.dispatch.AllToAll`.

    >>> d = ReplicatedAllToAll(no_replicas(2, 1))
    >>> x, idx, w = torch.randn(3, 4), torch.tensor([[0, 1], [1, 1], [0, 0]]), torch.rand(3, 2)
    >>> sent = d.dispatch(x, idx, num_experts=2, axis=None)
    >>> sent.counts.tolist()
    [3, 3]
    >>> bool(torch.allclose(d.combine(sent.tokens * 2.0, sent, w), 2.0 * x * w.sum(-1, keepdim=True)))
    True
    """

    placement: Placement

    def _check(self, num_experts: int, axis: str | None) -> tuple[int, int]:
        n = lax.axis_size(axis) if axis is not None else 1
        p = self.placement
        if p.ranks != n or p.num_experts != num_experts:
            raise PlanError(
                f"ReplicatedAllToAll: the placement is for {p.num_experts} experts over {p.ranks} ranks, but the "
                f"layer has {num_experts} experts over the expert-parallel axis {axis!r} of size {n}; decide the "
                f"placement with place_hot_experts(load, ranks={n}, slots=...) for this layer")
        return n, lax.axis_index(axis) if axis is not None else 0

    def copy_weights(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                     axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights of this rank's copies (``[len(copies[rank]), ...]`` each), received from their
        owners in one all-to-all of packed rows; its transpose sums the copies' gradients into the
        owners' gradients. Every rank of the axis must call it (an owner sends even if it holds no copy)."""
        p = self.placement
        n, me = self._check(p.num_experts, axis)
        if w_gate.shape[0] != p.local:
            raise PlanError(f"ReplicatedAllToAll: this rank holds {w_gate.shape[0]} experts, the placement "
                            f"expects {p.local} per rank on {axis!r}")
        mine = [e - me * p.local for q in range(n) for e in p.copies[q] if p.owner(e) == me]
        send_sizes = [sum(p.owner(e) == me for e in p.copies[q]) for q in range(n)]
        recv_sizes = [sum(p.owner(e) == q for e in p.copies[me]) for q in range(n)]
        stacks = (w_gate, w_up, w_down)
        index = torch.tensor(mine, dtype=torch.int64, device=w_gate.device)
        # one exchange for the three stacks: each copy travels as one packed row
        packed = torch.cat([w.index_select(0, index).flatten(1) for w in stacks], dim=1)
        got = lax.all_to_all(packed, axis, 0, 0, split_sizes=send_sizes, recv_sizes=recv_sizes)
        parts = got.split([w[0].numel() for w in stacks], dim=1)
        return tuple(part.reshape(-1, *w.shape[1:]) for w, part in zip(stacks, parts))  # type: ignore[return-value]

    def expert_outputs(self, sent: ReplicatedDispatched, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
        """The outputs of the received rows: this rank's own experts on their rows, then the copies
        (weights from :meth:`copy_weights`) on theirs. Two grouped computes rather than one over the
        concatenated stacks, which would keep a copy of all the rank's expert weights for the backward."""
        p = self.placement
        if sent.axis is None or p.num_copies == 0:
            return expert_ffn(sent.tokens, sent.counts, w_gate, w_up, w_down, impl=impl)
        copies = self.copy_weights(w_gate, w_up, w_down, axis=sent.axis)
        own = expert_ffn(sent.tokens[: sent.own_rows], sent.counts[: p.local], w_gate, w_up, w_down, impl=impl)
        # A rank holding no copy still computes its (empty) copies, so that every rank's backward runs the
        # exchange's transpose: the owners receive their copies' gradients through it. grouped_mm's
        # backward rejects zero experts; bmm over none costs nothing.
        held = expert_ffn(sent.tokens[sent.own_rows:], sent.counts[p.local:], *copies,
                          impl=impl if copies[0].shape[0] else "bmm")
        return torch.cat((own, held))

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, *, num_experts: int,
                 axis: str | None) -> ReplicatedDispatched:
        """Send each pair of ``x [T, H]`` / ``indices [T, k]`` to one holder of its expert."""
        T, k = indices.shape
        n, me = self._check(num_experts, axis)
        slots = _slots(self.placement, x.device)
        order, slot = _route(indices, self.placement, slots, me)
        with torch.no_grad():
            per_slot = torch.bincount(slot, minlength=sum(slots.per_rank))
            # recv[j, s]: rows rank j sends for this rank's slot s (the counts travel, split by slots per rank)
            if n > 1:
                recv = lax.all_to_all(per_slot, axis, 0, 0, split_sizes=slots.per_rank,
                                      recv_sizes=[slots.per_rank[me]] * n).view(n, -1)
            else:
                recv = per_slot.view(1, -1)
            send = torch.zeros(n, dtype=torch.int64, device=x.device).index_add_(0, slots.rank_of_slot, per_slot)
            own = recv[:, : self.placement.local].sum().reshape(1)
            sizes = torch.cat((send, recv.sum(1), own)).tolist()  # the layer's one host read
            send_sizes, recv_sizes, own_rows = tuple(sizes[:n]), tuple(sizes[n:2 * n]), sizes[-1]
            local = slots.per_rank[me]
            slot_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv.reshape(-1),
                                              output_size=sum(recv_sizes))  # no second read of the device
            regroup = torch.argsort(slot_of, stable=True)
        rows = x[order // k]
        if n > 1:
            rows = lax.all_to_all(rows, axis, 0, 0, split_sizes=send_sizes, recv_sizes=recv_sizes)
        return ReplicatedDispatched(rows[regroup], recv.sum(0), order, regroup, send_sizes, recv_sizes, k, axis,
                                    own_rows)

    def combine(self, y: torch.Tensor, sent: ReplicatedDispatched, weights: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum_j weights[t, j] * (output of pair (t, j))``, ``[T, H']``."""
        rows = y[_inverse(sent.regroup)]
        if sent.axis is not None and len(sent.send_sizes) > 1:
            rows = lax.all_to_all(rows, sent.axis, 0, 0, split_sizes=sent.recv_sizes, recv_sizes=sent.send_sizes)
        w = weights.reshape(-1)[sent.order].unsqueeze(-1).to(rows.dtype)
        return rows.new_zeros(weights.shape[0], rows.shape[-1]).index_add(0, sent.order // sent.k, rows * w)
