"""The makespan of a generated pipeline schedule under per-(kind, stage) costs, replayed fast.

:func:`hpfunc.schedules.simulate` validates the schedule and works out its dependencies on every
call; the planner prices thousands of layouts on a few dozen schedules, so the dependencies and the
execution order are computed once per ``(schedule, p, m, v)`` (:func:`compiled`) and only the
replay (start = max(end of the producers), end = start + cost) runs per layout. It returns what
``simulate(schedule, costs).makespan`` returns for costs that depend on kind and stage only.

    >>> from hpfunc.schedules import one_f_one_b, simulate
    >>> makespan("1f1b", 4, 8, 1, lambda kind, stage: {"F": 1.0, "BW": 2.0}.get(kind, 0.0))
    33.0
    >>> simulate(one_f_one_b(4, 8)).makespan
    33.0
"""

from __future__ import annotations

import functools
from typing import Callable

__all__ = ["compiled", "makespan", "peak_inflight"]


@functools.lru_cache(maxsize=128)
def compiled(schedule: str, p: int, m: int, v: int = 1) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """``(kind, stage, producer indices)`` per action, in an execution order."""
    from hpfunc.schedules import GENERATORS
    from hpfunc.schedules.validate import dependencies, execution_order

    gen = GENERATORS[schedule]
    s = gen(p, m, v) if schedule == "interleaved_1f1b" else gen(p, m)
    deps = dependencies(s)
    order = execution_order(s, deps)
    index = {key: i for i, key in enumerate(order)}
    out = []
    for rank, step in order:
        a = s.actions[rank][step]
        kind = a.kind.value if hasattr(a.kind, "value") else str(a.kind)
        out.append((kind, a.stage if a.is_compute else -1, tuple(index[d] for d in deps[(rank, step)])))
    return tuple(out)


def makespan(schedule: str, p: int, m: int, v: int, cost: Callable[[str, int], float]) -> float:
    """The makespan with ``cost(kind, stage)`` seconds per compute action (communication actions 0)."""
    actions = compiled(schedule, p, m, v)
    table: dict[tuple[str, int], float] = {}
    end = [0.0] * len(actions)
    for i, (kind, stage, deps) in enumerate(actions):
        key = (kind, stage)
        c = table.get(key)
        if c is None:
            c = table[key] = float(cost(kind, stage)) if stage >= 0 else 0.0
        start = max((end[j] for j in deps), default=0.0)
        end[i] = start + c
    return max(end, default=0.0)


@functools.lru_cache(maxsize=256)
def peak_inflight(schedule: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """``simulate(...).peak_resident_until_w`` per rank: the stage-microbatches a rank keeps (an ``F``
    adds one, its ``W`` or ``BW`` frees it; generated schedules swap nothing). The count follows each
    rank's own order, so no timing (and no dependency analysis) is needed.

    >>> peak_inflight("1f1b", 4, 8)
    (4, 3, 2, 1)
    """
    from hpfunc.schedules import GENERATORS

    gen = GENERATORS[schedule]
    s = gen(p, m, v) if schedule == "interleaved_1f1b" else gen(p, m)
    out = []
    for rank in range(p):
        kept = most = 0
        for a in s.actions[rank]:
            kind = a.kind.value if hasattr(a.kind, "value") else str(a.kind)
            if kind == "F":
                kept += 1
            elif kind in ("W", "BW"):
                kept -= 1
            elif kind == "SWAP_OUT":
                kept -= 1
            elif kind == "SWAP_IN":
                kept += 1
            most = max(most, kept)
        out.append(most)
    return tuple(out)
