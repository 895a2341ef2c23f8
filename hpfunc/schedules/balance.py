"""Layer balancing: split a model's layers into contiguous pipeline stages of even cost.

The layers are the costed items in model order, embedding and head included (a head over a
large vocabulary often costs several decoder layers). :func:`balance_layers` returns how many
layers each stage gets, minimising the most expensive stage exactly (dynamic programming over
prefix sums); the counts go into :attr:`Schedule.stage_layers`, and :func:`stage_costs` turns them
into per-stage costs for :func:`hpfunc.schedules.simulate` (``stage_scale``).

Example:
    >>> balance_layers([3, 1, 1, 1, 1, 1, 1, 4], 3)
    (2, 4, 2)
    >>> stage_costs([3, 1, 1, 1, 1, 1, 1, 4], (2, 4, 2))
    (4.0, 4.0, 5.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .ir import _require_int

__all__ = ["balance_layers", "stage_costs", "stage_bounds", "recompute_under_limit"]


def _check_costs(costs: Sequence[float]) -> list[float]:
    values = list(costs)
    for i, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"layer cost [{i}] must be a finite number >= 0, got {c!r}")
    return [float(c) for c in values]


def balance_layers(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Split layers with ``costs`` (in model order) into ``num_stages`` contiguous, non-empty
    stages minimising the largest stage cost. Returns the number of layers per stage.

    Among optimal splits the most even one (least sum of squared stage costs) is returned, ties
    going to the split with fewer layers in the earlier stages, so the result is deterministic.
    O(num_stages * L^2) time: fine for hundreds of layers.

    Raises:
        ValueError: fewer layers than stages, ``num_stages < 1``, or a negative/non-finite cost.

    Example:
        >>> balance_layers([1] * 10, 4)
        (2, 2, 3, 3)
    """
    _require_int("num_stages", num_stages, minimum=1)
    values = _check_costs(costs)
    n = len(values)
    if n < num_stages:
        raise ValueError(f"balance_layers: {n} layers cannot fill {num_stages} non-empty stages")
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)

    # best[k][j]: the smallest possible maximum stage cost for the first j layers in k stages.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            row = best[k - 1]
            best[k][j] = min(max(row[i], prefix[j] - prefix[i]) for i in range(k - 1, j))
    target = best[num_stages][n]
    # Among the splits reaching the optimum, take the most even one (least sum of squared stage
    # costs, then fewest layers in early stages): a second DP restricted to stages <= target.
    eps = 1e-9 * max(1.0, abs(target))
    even = [[(inf, 0)] * (n + 1) for _ in range(num_stages + 1)]  # (sum of squares, tie) ; choice
    choice = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    even[0][0] = (0.0, 0)
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                c = prefix[j] - prefix[i]
                if c > target + eps or even[k - 1][i][0] == inf:
                    continue
                cand = (even[k - 1][i][0] + c * c, even[k - 1][i][1] + (j - i) * (num_stages - k))
                if cand < even[k][j]:
                    even[k][j] = cand
                    choice[k][j] = i
    counts = []
    j = n
    for k in range(num_stages, 0, -1):
        i = choice[k][j]
        counts.append(j - i)
        j = i
    counts.reverse()
    return tuple(counts)


def stage_bounds(layers: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` layer ranges of stages with ``layers`` layers each.

    Example:
        >>> stage_bounds((3, 3, 2))
        ((0, 3), (3, 6), (6, 8))
    """
    bounds = []
    start = 0
    for s, n in enumerate(layers):
        _require_int(f"layers[{s}]", n, minimum=1)
        bounds.append((start, start + n))
        start += n
    return tuple(bounds)


def stage_costs(costs: Sequence[float], layers: Sequence[int]) -> tuple[float, ...]:
    """Total cost of each stage when ``costs`` (per layer) are split into stages of ``layers``.

    Raises:
        ValueError: the layer counts do not add up to the number of costed layers.
    """
    values = _check_costs(costs)
    if sum(layers) != len(values):
        raise ValueError(f"layer counts {tuple(layers)} add up to {sum(layers)}, but {len(values)} layers are costed")
    return tuple(float(sum(values[a:b])) for a, b in stage_bounds(layers))


def recompute_under_limit(schedule, stage_bytes: Sequence[float], limit_bytes: float, *,
                          recompute_bytes: Sequence[float] | None = None,
                          policy: str = "nothing_saveable") -> tuple[str | None, ...]:
    """Which stages to recompute so that each rank's activations fit ``limit_bytes``: a remat policy
    name or ``None`` per stage, for ``plans.pp(..., remat=...)``.

    ``stage_bytes[s]``: what one microbatch of stage ``s`` keeps for its backward without recompute;
    ``recompute_bytes[s]``: what it keeps with ``policy`` (default: a tenth, roughly the stage input of a
    transformer stage; measure it with :mod:`hpfunc.memory` for a real choice). A rank holds at most
    ``simulate(schedule).peak_resident_until_w[rank]`` stage-microbatches at once; the bound used is
    that count times the largest per-microbatch bytes of its stages. Stages are switched to recompute
    greedily, the largest first, on every rank over the limit.

    Raises:
        ValueError: a rank does not fit even with every one of its stages recomputed.

    Example:
        >>> from hpfunc.schedules import one_f_one_b
        >>> recompute_under_limit(one_f_one_b(2, 4), [100.0, 100.0], 150.0)  # rank 0 holds 2 microbatches
        ('nothing_saveable', None)
    """
    from .simulate import simulate

    n = schedule.num_stages
    kept = [float(b) for b in stage_bytes]
    if len(kept) != n:
        raise ValueError(f"recompute_under_limit: {len(kept)} stage sizes for {n} stages")
    small = [b / 10 for b in kept] if recompute_bytes is None else [float(b) for b in recompute_bytes]
    peak = simulate(schedule).peak_resident_until_w
    chosen: list[str | None] = [None] * n
    for rank in schedule.ranks:
        stages = schedule.stages_of(rank)

        def need() -> float:
            return peak[rank] * max((small[s] if chosen[s] else kept[s]) for s in stages)

        for s in sorted(stages, key=lambda s: -kept[s]):
            if need() <= limit_bytes:
                break
            chosen[s] = policy
        if need() > limit_bytes:
            raise ValueError(f"recompute_under_limit: rank {rank} holds up to {peak[rank]} stage-microbatches; even "
                             f"recomputing its stages {list(stages)} it needs {need():.4g} bytes > the limit "
                             f"{limit_bytes:.4g}; use more microbatches of fewer rows, more stages or a larger limit")
    return tuple(chosen)
