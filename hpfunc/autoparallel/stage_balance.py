"""SAPP-PPB: layers per pipeline stage and a remat kind per stage that equalise stage time under a
memory limit.

:func:`balance_stages` is exact: a dynamic program over contiguous splits (as
:func:`hpfunc.schedules.balance.balance_layers`, which it extends with memory and a remat choice per
stage) minimising the most expensive stage, where a stage's cost is its layers' time under the
fastest remat kind whose memory fits: the stage's model states plus the stage-microbatches its rank
keeps in flight (from the schedule) times its layers' activations, plus the embedding on the first
stage and the head and loss on the last. :func:`balance_layout` prices a :class:`Layout`'s layers with
the cost model and returns the balanced layout (``layers_per_stage`` and ``stage_remat``, which the
trainer's ``pp`` entry takes).

    >>> costs = {"none": [1.0] * 6, "full": [1.4] * 6}
    >>> acts = {"none": [10.0] * 6, "full": [1.0] * 6}
    >>> r = balance_stages(costs, acts, num_stages=2, inflight=(2, 1), limit=45.0, first_cost=1.0, last_cost=2.0)
    >>> r.layers, r.remat, round(r.max_cost, 6)
    ((3, 3), ('full', 'none'), 5.2)
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import attrs

__all__ = ["StageSplit", "balance_stages", "balance_layout", "BalanceError"]


class BalanceError(ValueError):
    """No split of the layers fits the memory limit."""


@attrs.frozen
class StageSplit:
    layers: tuple[int, ...]
    remat: tuple[str, ...]
    stage_costs: tuple[float, ...]
    stage_bytes: tuple[float, ...]

    @property
    def max_cost(self) -> float:
        return max(self.stage_costs)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


def balance_stages(costs: Mapping[str, Sequence[float]], acts: Mapping[str, Sequence[float]], *, num_stages: int,
                   inflight: Sequence[int], limit: float, state_bytes: Sequence[float] | None = None,
                   first_cost: float = 0.0, last_cost: float = 0.0, first_bytes: float = 0.0,
                   last_bytes: float = 0.0) -> StageSplit:
    """The split minimising the largest stage cost.

    Args:
        costs: per remat kind, each layer's time (forward + backward, recompute included).
        acts: per remat kind, each layer's activation bytes per microbatch.
        num_stages: contiguous, non-empty stages.
        inflight: per stage, the stage-microbatches its rank keeps at the peak.
        limit: bytes per stage (a rank holding several stages is checked per stage).
        state_bytes: per layer, model-state bytes (default 0).
        first_cost, last_cost, first_bytes, last_bytes: the embedding's (first stage) and the head's
            and loss's (last stage) time and bytes.

    Raises:
        BalanceError: no split fits (names the stage and its smallest footprint).
    """
    kinds = list(costs)
    n = len(next(iter(costs.values())))
    if n < num_stages:
        raise BalanceError(f"balance_stages: {n} layers cannot fill {num_stages} stages")
    if len(inflight) != num_stages:
        raise BalanceError(f"balance_stages: inflight has {len(inflight)} entries for {num_stages} stages")
    pc = {k: _prefix(costs[k]) for k in kinds}
    pa = {k: _prefix(acts[k]) for k in kinds}
    ps = _prefix(state_bytes if state_bytes is not None else [0.0] * n)

    def stage(k: int, i: int, j: int) -> tuple[float, str, float]:
        """(cost, remat kind, bytes) of stage k over layers [i, j): the fastest kind that fits."""
        extra_c = (first_cost if k == 0 else 0.0) + (last_cost if k == num_stages - 1 else 0.0)
        extra_b = (first_bytes if k == 0 else 0.0) + (last_bytes if k == num_stages - 1 else 0.0)
        best = (math.inf, "", math.inf)
        for kind in kinds:
            b = ps[j] - ps[i] + inflight[k] * (pa[kind][j] - pa[kind][i]) + extra_b
            c = pc[kind][j] - pc[kind][i] + extra_c
            if b <= limit and (c, b) < (best[0], best[2]):
                best = (c, kind, b)
        return best

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                c = stage(k - 1, i, j)[0]
                v = max(best[k - 1][i], c)
                if v < best[k][j]:
                    best[k][j], choice[k][j] = v, i
    if best[num_stages][n] == inf:
        smallest = min(stage(0, 0, 1)[2], ps[1] + inflight[0] * min(pa[k][1] for k in kinds) + first_bytes)
        raise BalanceError(f"balance_stages: no split of {n} layers into {num_stages} stages fits {limit:.4g} bytes per "
                           f"stage (stage 0 with one layer needs at least {smallest:.4g}); use more stages, more "
                           f"memory or smaller microbatches")
    bounds = []
    j = n
    for k in range(num_stages, 0, -1):
        i = choice[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    parts = [stage(k, i, j) for k, (i, j) in enumerate(bounds)]
    return StageSplit(tuple(j - i for i, j in bounds), tuple(p[1] for p in parts), tuple(p[0] for p in parts),
                      tuple(p[2] for p in parts))


def balance_layout(desc, layout, work, hw, *, memory_limit: float,
                   remats: Sequence[str] = ("none", "selective", "full")):
    """``layout`` (a pipeline) with ``layers_per_stage`` and ``stage_remat`` from :func:`balance_stages`,
    priced by the cost model (:func:`~hpfunc.autoparallel.step_time.layer_seconds`,
    :mod:`~hpfunc.autoparallel.memory_model`). Stage limits leave room for the rank's other terms
    (gathered parameters, recompute working set, reserve) as estimated for ``layout``.

    Raises:
        BalanceError: nothing fits.
    """
    from hpfunc.autoparallel.hardware import hardware
    from hpfunc.autoparallel.memory_model import (inflight, layer_activation_bytes_per_token, memory, rank_params,
                                                  rank_stages, tokens_per_microbatch)
    from hpfunc.autoparallel.step_time import layer_seconds
    from hpfunc.autoparallel.configuration import STATE_BYTES

    hw = hardware(hw)
    if layout.pp == 1:
        return layout
    if layout.schedule in ("zb_h1", "zbv"):
        remats = [r for r in remats if r != "selective"]
    tokens = tokens_per_microbatch(layout, work)
    L = desc.num_layers
    costs = {r: [sum(layer_seconds(desc.layers[i], layout, work, hw, r, tokens)) for i in range(L)] for r in remats}
    acts = {r: [layer_activation_bytes_per_token(desc.layers[i], r, layout, work) * tokens for i in range(L)]
            for r in remats}
    per_param = sum(STATE_BYTES[work.precision])
    n_dense, n_exp = layout.fsdp * layout.ep, layout.fsdp
    states = []
    for i in range(L):
        d, e = rank_params(desc, layout, [i], False, False)
        states.append(per_param * (d / n_dense + e / n_exp))
    peaks = inflight(layout)
    stage_inflight = [0] * layout.num_stages
    for r in range(layout.pp):
        for s in rank_stages(layout, r):
            stage_inflight[s] = peaks[r]
    base = memory(desc, layout, work).terms
    other = base["gathered"] + base["recompute"] + base["backward"] + base["reserve"]
    first_d, _ = rank_params(desc, layout, [], True, False)
    last_d, _ = rank_params(desc, layout, [], False, True)
    head = tokens * desc.head_flops_per_token / (hw.peak_flops(work.dtype) * hw.matmul_efficiency)
    loss = tokens * desc.vocab * (desc.act_bytes + 8) * 2 / hw.hbm_bw
    split = balance_stages(costs, acts, num_stages=layout.num_stages, inflight=stage_inflight,
                           limit=memory_limit - other, state_bytes=states,
                           first_bytes=per_param * first_d / n_dense,
                           last_cost=3 * head + 2 * loss,
                           last_bytes=per_param * last_d / n_dense + tokens * desc.vocab * (desc.act_bytes + 8))
    return attrs.evolve(layout, layers_per_stage=split.layers, stage_remat=split.remat)
