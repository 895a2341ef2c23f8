"""Token dispatch for expert parallelism: send each (token, expert) pair to the rank holding its expert,
and its output back. Separate from the experts' compute (:func:`hpfunc.models.moe.expert_ffn`), so
another dispatcher (all-gather + reduce-scatter, a ring of experts, a fixed-size buffer) can replace it.

:class:`AllToAll` is dropless: every pair is computed, whatever the routing (an expert with no token,
a rank that receives none, every token on one expert). With ``n`` ranks on the expert-parallel axis
and ``E`` experts, rank ``r`` holds experts ``[r E/n, (r+1) E/n)``. For ``T`` tokens routed top-``k``:

1. **permute**: the ``T k`` pairs sorted by expert id (so by destination rank, then local expert);
2. **count exchange**: one all-to-all of the per-expert counts (``E`` int64 per rank), then one host
   read of the split sizes (the only device-to-host sync of the layer);
3. **dispatch**: one all-to-all of the permuted token rows with unequal splits; the received rows are
   grouped by source rank, and are regrouped by local expert for the grouped compute;
4. **combine**: the inverse regrouping and the reverse all-to-all bring each pair's output back to
   its token's rank in the permuted order; the outputs are weighted by the router's combine weights
   and summed per token (the combine weights never travel: their gradient stays on the token's rank).

The backward is the transpose: two all-to-alls more (the gradient of the combine, then of the
dispatch), so four all-to-alls of ``k h`` elements per token per MoE layer per step, of which the
fraction ``(n - 1) / n`` leaves the rank under uniform routing.

    >>> import torch
    >>> d = AllToAll()
    >>> x, idx, w = torch.randn(3, 4), torch.tensor([[0, 1], [1, 1], [0, 0]]), torch.rand(3, 2)
    >>> sent = d.dispatch(x, idx, num_experts=2, axis=None)   # no axis: one rank holds every expert
    >>> sent.counts.tolist(), tuple(sent.tokens.shape)         # rows per local expert, grouped
    ([3, 3], (6, 4))
    >>> y = d.combine(sent.tokens * 2.0, sent, w)               # an "expert" doubling its rows
    >>> bool(torch.allclose(y, 2.0 * x * w.sum(-1, keepdim=True)))
    True
"""

from __future__ import annotations

import math
import contextlib
import time
from typing import Any, Callable, ClassVar, Iterator, NamedTuple

import attrs
import torch

from hpfunc import lax, layout
from hpfunc.layout import PlanError

__all__ = ["AllToAll", "Dispatched", "PaddedAllToAll", "PaddedDispatched", "count_ids", "inverse_permutation", "sum_pairs",
           "trace_exchange"]


def _split_experts(num_experts: int, axis: str | None) -> tuple[int, int]:
    """``(ranks on the axis, experts per rank)``; :class:`PlanError` unless the experts split evenly."""
    n = lax.axis_size(axis) if axis is not None else 1
    if num_experts % n:
        raise PlanError(f"expert parallelism over {axis!r}: {num_experts} experts do not split over {n} ranks; "
                        f"the number of experts must be a multiple of the axis size")
    return n, num_experts // n


def count_ids(flat: torch.Tensor, n: int) -> torch.Tensor:
    """How often each id in ``[0, n)`` occurs in ``flat``: ``[n]`` int64.

    ``bincount``'s output size depends on the largest id, so on a GPU it waits for the device (a host
    sync) and under FakeTensor it has no shape; ``scatter_add`` into ``n`` slots does neither. bincount is
    kept on the CPU, where it is cheaper.

    >>> count_ids(torch.tensor([0, 2, 2, 1]), 4).tolist()
    [1, 1, 2, 0]
    """
    from torch._subclasses.fake_tensor import is_fake

    if flat.device.type == "cpu" and not is_fake(flat):
        return torch.bincount(flat, minlength=n)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation (no gradient: indices).

    >>> inverse_permutation(torch.tensor([2, 0, 1])).tolist()
    [1, 2, 0]
    """
    with torch.no_grad():
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def sum_pairs(rows: torch.Tensor, position: torch.Tensor, T: int, k: int, *, missing: bool = False) -> torch.Tensor:
    """``out[t] = sum_j rows[position[t k + j]]`` ``[T, H]``: the outputs of each token's ``k`` pairs
    (already weighted), ``rows [M, H]`` in any order. With ``missing``, ``position = M`` marks a pair
    that was not computed (dropped): it adds 0.

    A gather then a sum over the ``k`` slots, whose backward keeps only ``position`` (an ``index_add``
    of the rows would keep the rows themselves, ``T k`` rows of ``H``, for the shape of its gradient).

    >>> rows = torch.tensor([[1.0], [2.0], [4.0]])
    >>> sum_pairs(rows, torch.tensor([2, 0, 3, 1]), T=2, k=2, missing=True).tolist()
    [[5.0], [2.0]]
    """
    if missing:  # the row of the pairs not computed
        rows = torch.cat((rows, rows.new_zeros(1, rows.shape[-1])))
    return rows[position].view(T, k, rows.shape[-1]).sum(1)


def _weighted_sum(rows: torch.Tensor, order: torch.Tensor, k: int, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[pair (t, j)]`` for ``rows`` in the pairs' sorted ``order``."""
    w = weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
    return rows.new_zeros(weights.shape[0], rows.shape[-1]).index_add(0, order // k, rows * w)


class Dispatched(NamedTuple):
    """What :meth:`AllToAll.dispatch` hands to the experts (``tokens``, ``counts``) and keeps for
    :meth:`AllToAll.combine` (the rest)."""

    tokens: torch.Tensor       # [N, H] the received rows, grouped by local expert
    counts: torch.Tensor       # [E_local] int64: rows per local expert (sums to N)
    order: torch.Tensor        # [T k] the permutation of the (token, slot) pairs, sorted by expert id
    regroup: torch.Tensor      # [N] received (by source rank) -> grouped by local expert
    send_sizes: tuple[int, ...]  # rows sent to each rank of the axis
    recv_sizes: tuple[int, ...]  # rows received from each rank
    k: int
    axis: str | None
    dropped: torch.Tensor | None = None  # pairs over capacity (0-d int64), with a capacity factor
    scale: torch.Tensor | None = None  # [N, 1] the received rows' combine weights (dispatched with weights=)
    position: torch.Tensor | None = None  # [T k] each pair's row in the returned order (M: dropped)


def _check_factor(_self: Any, _attr: Any, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"AllToAll: capacity_factor must be a finite number > 0 or None (dropless), found {value!r}")


@attrs.frozen
class AllToAll:
    """All-to-all token dispatch over an expert-parallel mesh axis (see the module docstring).

    ``capacity_factor=None`` (default): dropless. A number ``c > 0``: each expert takes at most
    ``C = ceil(c * T * k / E)`` of the ``T k`` pairs of each source rank's ``T`` tokens, the first ones in
    token order (deterministic); the others are dropped (they contribute nothing to their token's output,
    which keeps its residual) and counted in :attr:`Dispatched.dropped`. The capacity is per source rank,
    so a run on one device (``T`` = every token) drops differently from the same batch split over ranks.

    >>> d = AllToAll(capacity_factor=0.5)   # C = ceil(0.5 * 4 * 1 / 2) = 1 pair per expert
    >>> sent = d.dispatch(torch.ones(4, 2), torch.tensor([[0], [0], [0], [1]]), num_experts=2, axis=None)
    >>> sent.counts.tolist(), int(sent.dropped)
    ([1, 1], 2)
    """

    capacity_factor: float | None = attrs.field(default=None, validator=_check_factor)
    chunks: int = attrs.field(default=1, kw_only=True)

    weights_at_experts: ClassVar[bool] = True  # dispatch(weights=) sends each row's combine weight along

    @chunks.validator
    def _check_chunks(self, _attr: Any, value: int) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"AllToAll: chunks must be an int >= 1, found {value!r}")
        if value > 1 and self.capacity_factor is not None:
            raise ValueError(f"AllToAll: chunks={value} overlaps the dropless dispatch only; found capacity_factor="
                             f"{self.capacity_factor} (a capacity per chunk would drop other pairs): use one of the two")

    def exchange(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor], *,
                 num_experts: int, axis: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole exchange of one MoE layer: ``(out [T, H'], dropped)`` where ``out[t] = sum_j (output of
        pair (t, j))`` and ``experts(tokens, counts, scale)`` computes the local experts' weighted outputs
        (:func:`hpfunc.models.moe.expert_ffn` with ``scale``).

        With ``chunks = c > 1`` the tokens are cut into ``c`` contiguous chunks whose all-to-alls are
        issued without waiting (:func:`hpfunc.lax.all_to_all_start`): chunk ``i + 1``'s dispatch is in
        flight while chunk ``i``'s experts compute, and chunk ``i``'s combine while chunk ``i + 1``'s do;
        the backward overlaps the same way (each transpose is issued without waiting too). One count
        exchange and one host read serve all the chunks. The result equals ``chunks=1`` up to the order
        of the floating-point sums of the expert weights' gradients.

        >>> d = AllToAll(chunks=2)
        >>> x, idx, w = torch.randn(3, 4), torch.tensor([[0, 1], [1, 1], [0, 0]]), torch.rand(3, 2)
        >>> y, _ = d.exchange(x, idx, w, lambda t, c, s: 2.0 * t * s, num_experts=2, axis=None)
        >>> bool(torch.allclose(y, 2.0 * x * w.sum(-1, keepdim=True)))
        True
        """
        n = lax.axis_size(axis) if axis is not None else 1
        if self.chunks == 1 or n == 1:
            sent = self.dispatch(x, indices, num_experts=num_experts, axis=axis, weights=weights)
            return self.combine(experts(sent.tokens, sent.counts, sent.scale), sent), sent.dropped
        return _chunked_exchange(x, indices, weights, experts, num_experts, axis, self.chunks), None

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, *, num_experts: int, axis: str | None,
                 weights: torch.Tensor | None = None) -> Dispatched:
        """Send the rows of ``x [T, H]`` to the ranks of ``axis`` holding the experts ``indices [T, k]``
        (global ids in ``[0, num_experts)``); ``axis=None``: this rank holds every expert.

        ``weights [T, k]`` (the router's combine weights): each travels with its row, one more column,
        and comes out as :attr:`Dispatched.scale` for the experts to apply before their down
        projection (:func:`hpfunc.models.moe.expert_ffn`'s ``scale``); then :meth:`combine` takes no
        weights and the backward keeps no expert output for the weights' gradient."""
        T, k = indices.shape
        n, local = _split_experts(num_experts, axis)
        flat = indices.reshape(-1)
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)
            counts = count_ids(flat, num_experts)
            dropped = None
            if self.capacity_factor is not None:  # keep the first C pairs of each expert (token order)
                cap = math.ceil(self.capacity_factor * T * k / num_experts)
                starts = torch.cumsum(counts, 0) - counts
                pos = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
                keep = pos < cap
                dropped = (~keep).sum()
                order = order[keep]
                counts = counts.clamp(max=cap)
            counts = counts.view(n, local)  # [dest rank, its expert]
            # recv[j, e]: rows rank j sends for this rank's local expert e (one all-to-all of E int64)
            recv = lax.all_to_all(counts, axis, 0, 0) if n > 1 else counts
            sizes = torch.cat((counts.sum(1), recv.sum(1))).tolist()  # the layer's one host read
            send_sizes, recv_sizes = tuple(sizes[:n]), tuple(sizes[n:])
            # output_size from the sizes already on the host: without it the op would read the device again
            expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv.reshape(-1),
                                                output_size=sum(recv_sizes))
            regroup = torch.argsort(expert_of, stable=True)
            position = torch.full((T * k,), order.numel(), dtype=torch.int64, device=x.device)
            position[order] = torch.arange(order.numel(), device=x.device)
        H = x.shape[1]
        rows = x[order // k]  # a gather: its backward keeps the index only
        if weights is not None:
            rows = torch.cat((rows, weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)), 1)
        if n > 1:
            rows = lax.all_to_all(rows, axis, 0, 0, split_sizes=send_sizes, recv_sizes=recv_sizes)
        # one gather per part straight from the received buffer, which is then free: nothing keeps it
        tokens, scale = (rows[regroup], None) if weights is None else (rows[:, :H][regroup], rows[:, H:][regroup])
        return Dispatched(tokens, recv.sum(0), order, regroup, send_sizes, recv_sizes, k, axis, dropped, scale,
                          position)

    def combine(self, y: torch.Tensor, sent: Dispatched, weights: torch.Tensor | None = None) -> torch.Tensor:
        """``out[t] = sum_j weights[t, j] * (output of pair (t, j))`` for the experts' outputs ``y [N, H']``
        (rows as :meth:`dispatch` grouped them); ``[T, H']``. ``weights=None``: the outputs are already
        weighted (dispatched with ``weights=``) and are summed per token."""
        rows = y[inverse_permutation(sent.regroup)]  # grouped by source rank again
        if sent.axis is not None and len(sent.send_sizes) > 1:
            rows = lax.all_to_all(rows, sent.axis, 0, 0, split_sizes=sent.recv_sizes, recv_sizes=sent.send_sizes)
        if weights is not None:
            return _weighted_sum(rows, sent.order, sent.k, weights)
        return sum_pairs(rows, sent.position, sent.position.numel() // sent.k, sent.k, missing=sent.dropped is not None)


@contextlib.contextmanager
def trace_exchange() -> Iterator[list[tuple[float, str, int]]]:
    """Record the chunked exchange's events (``(time.perf_counter(), event, chunk)``: ``"dispatch issued"``,
    ``"dispatch arrived"``, ``"compute start"``, ``"compute end"``, ``"combine issued"``, ``"combine
    arrived"``) into the list it yields, for the calls made inside the ``with`` block, a step's included (a
    member of the layout binding's scopes: other threads and tasks record nothing).

    >>> with trace_exchange() as events:
    ...     _ = AllToAll(chunks=2).exchange(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
    ...                                     lambda t, c, s: t, num_experts=1, axis=None)
    >>> events   # one rank: no exchange, nothing to overlap
    []
    """
    events: list[tuple[float, str, int]] = []
    with layout.scoped(dispatch_trace=events):
        yield events


def _event(name: str, chunk: int) -> None:
    events = layout.scopes().dispatch_trace
    if events is not None:
        events.append((time.perf_counter(), name, chunk))


def _chunked_exchange(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, experts: Callable, E: int,
                      axis: str, chunks: int) -> torch.Tensor:
    """:meth:`AllToAll.exchange` over ``chunks`` contiguous token chunks, overlapping each chunk's
    all-to-alls with another chunk's expert compute."""
    T, k = indices.shape
    H = x.shape[1]
    n, local = _split_experts(E, axis)
    edges = [i * T // chunks for i in range(chunks + 1)]
    with torch.no_grad():
        orders, counts = [], []
        for a, b in zip(edges, edges[1:]):
            flat = indices[a:b].reshape(-1)
            orders.append(torch.argsort(flat, stable=True))
            counts.append(count_ids(flat, E).view(n, local))
        # one count exchange for every chunk: block d = what this rank sends rank d, per chunk and expert
        sending = torch.stack(counts, 1).contiguous()  # [n, chunks, local]
        recv = lax.all_to_all(sending, axis, 0, 0)      # [n (source), chunks, local]
        sizes = torch.cat((sending.sum(-1), recv.sum(-1))).tolist()  # the layer's one host read
        plans = []
        for i, order in enumerate(orders):
            send_sizes, recv_sizes = [sizes[d][i] for d in range(n)], [sizes[n + j][i] for j in range(n)]
            r = recv[:, i]
            expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), r.reshape(-1),
                                                output_size=sum(recv_sizes))
            regroup = torch.argsort(expert_of, stable=True)
            plans.append((order, send_sizes, recv_sizes, r.sum(0), regroup, inverse_permutation(order)))
    dispatched: list[Any] = [None] * chunks

    def issue(i: int) -> None:
        order, send_sizes, recv_sizes = plans[i][:3]
        a, b = edges[i], edges[i + 1]
        rows = torch.cat((x[a:b][order // k], weights[a:b].reshape(-1)[order].unsqueeze(-1).to(x.dtype)), 1)
        dispatched[i] = lax.all_to_all_start(rows, axis, split_sizes=send_sizes, recv_sizes=recv_sizes)
        _event("dispatch issued", i)

    issue(0)
    combined = []
    for i in range(chunks):
        if i + 1 < chunks:
            issue(i + 1)  # in flight while this chunk's experts compute
        _, send_sizes, recv_sizes, local_counts, regroup, _ = plans[i]
        rows = dispatched[i].wait()
        dispatched[i] = None
        _event("dispatch arrived", i)
        _event("compute start", i)
        y = experts(rows[:, :H][regroup], local_counts, rows[:, H:][regroup])
        _event("compute end", i)
        combined.append(lax.all_to_all_start(y[inverse_permutation(regroup)], axis, split_sizes=recv_sizes,
                                             recv_sizes=send_sizes))
        _event("combine issued", i)
    out = []
    for i, pending in enumerate(combined):
        rows = pending.wait()
        _event("combine arrived", i)
        out.append(sum_pairs(rows, plans[i][5], edges[i + 1] - edges[i], k))
    return torch.cat(out)


class PaddedDispatched(NamedTuple):
    """What :meth:`PaddedAllToAll.dispatch` hands to the experts and keeps for its combine."""

    tokens: torch.Tensor       # [n B, H] the received buffer, grouped by local expert (empty slots last)
    counts: torch.Tensor       # [E_local] int64 on the device: real rows per local expert
    valid: torch.Tensor        # [n B] bool: the grouped row is a real pair (not an empty slot)
    order: torch.Tensor        # [T k] the pairs sorted by expert id
    slot: torch.Tensor         # [T k] each sorted pair's row in the send buffer (n B: it did not fit)
    regroup: torch.Tensor      # [n B] received (by source rank) -> grouped by local expert
    k: int
    axis: str | None
    overflow: torch.Tensor     # 0-d int64 on the device: pairs that did not fit (their output is 0)
    scale: torch.Tensor | None = None  # [n B, 1] the rows' combine weights (dispatched with weights=)


def _check_buffer(_self: Any, _attr: Any, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"PaddedAllToAll: buffer_factor must be a finite number > 0, found {value!r}")


@attrs.frozen
class PaddedAllToAll:
    """All-to-all dispatch with fixed-size buffers and **no device-to-host sync**: each rank sends
    ``B = ceil(f T k / n)`` rows to every rank of the axis (``f = buffer_factor``; ``f = 1`` fits uniform
    routing exactly), so both all-to-alls have equal splits known from the shapes alone, the count
    exchange stays on the device, and the grouped expert compute reads its group offsets from the
    device. Where the dropless :class:`AllToAll` reads the split sizes on the host once per layer (a
    stall on an accelerator: HyperParallel measured 8.8 s of a 25 s window blocked on it), this one
    never does.

    Pairs beyond ``B`` for one destination do not fit: their output is 0 (the token keeps its
    residual) and they are counted in :attr:`PaddedDispatched.overflow`, a device tensor the caller
    reads when it reads its metrics (then redoes the step with a larger factor, or reports it). With
    no overflow the result equals :class:`AllToAll`'s. The cost is padding: ``n B`` rows travel and
    are computed instead of the ``T k`` real ones.

    >>> d = PaddedAllToAll(buffer_factor=1.0)
    >>> x, idx, w = torch.randn(3, 4), torch.tensor([[0, 1], [1, 1], [0, 0]]), torch.rand(3, 2)
    >>> sent = d.dispatch(x, idx, num_experts=2, axis=None)
    >>> tuple(sent.tokens.shape), sent.counts.tolist(), int(sent.overflow)
    ((6, 4), [3, 3], 0)
    >>> bool(torch.allclose(d.combine(sent.tokens * 2.0, sent, w), 2.0 * x * w.sum(-1, keepdim=True)))
    True
    """

    buffer_factor: float = attrs.field(default=1.5, validator=_check_buffer)

    weights_at_experts: ClassVar[bool] = True

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, *, num_experts: int,
                 axis: str | None, weights: torch.Tensor | None = None) -> PaddedDispatched:
        """As :meth:`AllToAll.dispatch` (``weights`` too), into fixed-size buffers of ``B`` rows per
        destination rank."""
        T, k = indices.shape
        n, local = _split_experts(num_experts, axis)
        B = max(1, math.ceil(self.buffer_factor * T * k / n))
        flat = indices.reshape(-1)
        dev = flat.device
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)
            expert = flat[order]
            dest = expert // local
            ones = torch.ones_like(flat)
            per_dest = torch.zeros(n, dtype=torch.int64, device=dev).scatter_add_(0, dest, ones)
            pos = torch.arange(flat.numel(), device=dev) - (torch.cumsum(per_dest, 0) - per_dest)[dest]
            fits = pos < B
            slot = torch.where(fits, dest * B + pos, n * B)  # n B: the dump row
            sent = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, expert, fits.long())
            overflow = (~fits).sum()
            recv = lax.all_to_all(sent.view(n, local), axis, 0, 0) if n > 1 else sent.view(n, local)
            rows_at = torch.arange(B, device=dev).expand(n, B).contiguous()
            expert_of = torch.searchsorted(torch.cumsum(recv, 1), rows_at, right=True).reshape(-1)  # local: empty
            regroup = torch.argsort(expert_of, stable=True)
            valid = expert_of[regroup] < local
            # the pair in each row of the send buffer (T k: an empty row), for one gather (its backward
            # keeps the index only; an index_add into the buffer would keep the rows)
            pair_at = torch.full((n * B + 1,), T * k, dtype=torch.int64, device=dev)
            pair_at[slot] = order
            pair_at = pair_at[: n * B]
        H = x.shape[1]
        rows = torch.cat((x, x.new_zeros(1, H)))[torch.where(pair_at < T * k, pair_at // k, T)]
        if weights is not None:
            w = torch.cat((weights.reshape(-1), weights.new_zeros(1)))[pair_at].unsqueeze(-1).to(rows.dtype)
            rows = torch.cat((rows, w), 1)
        if n > 1:
            rows = lax.all_to_all(rows, axis, 0, 0)
        tokens, scale = (rows[regroup], None) if weights is None else (rows[:, :H][regroup], rows[:, H:][regroup])
        return PaddedDispatched(tokens, recv.sum(0), valid, order, slot, regroup, k, axis, overflow, scale)

    def combine(self, y: torch.Tensor, sent: PaddedDispatched, weights: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`AllToAll.combine`; the empty slots' rows (never computed) are zeroed first."""
        buf = torch.where(sent.valid.unsqueeze(-1), y, 0.0)[inverse_permutation(sent.regroup)]
        if sent.axis is not None and lax.axis_size(sent.axis) > 1:
            buf = lax.all_to_all(buf, sent.axis, 0, 0)
        if weights is not None:
            rows = torch.cat((buf, buf.new_zeros(1, buf.shape[-1])))[sent.slot]  # a pair that did not fit: 0
            return _weighted_sum(rows, sent.order, sent.k, weights)
        with torch.no_grad():  # each pair's row in the returned buffer (n B: it did not fit)
            position = torch.empty_like(sent.slot)
            position[sent.order] = sent.slot
        return sum_pairs(buf, position, position.numel() // sent.k, sent.k, missing=True)
