"""Simulate a schedule under per-action costs: makespan, bubbles, peak in-flight activations.

Every rank runs its list in order; an action starts when the previous action of its rank has
finished and every producer it depends on (see :func:`hpfunc.schedules.validate.dependencies`)
has finished, and occupies its rank for ``cost(action)``. A send costs its rank the send time; a
receive starts when both its rank and the matching send are done.

Measures, per rank:

* ``bubble_ratio``: idle / useful, where useful is the time spent in ``F``, ``B``, ``W``, ``BW``
  and idle is the makespan minus it. This is the figure of the pipeline literature.
* ``steady_bubble_ratio``: the same with the makespan replaced by the period at which identical
  steps can follow one another when each rank starts its next step as soon as it is free (the
  "post-validation" of Qi et al. 2024): the longest span from a rank's first start to its last end.
  It removes the unavoidable fill and drain triangles and is the figure the zero-bubble schedules
  drive to zero.
* ``peak_inflight``: the most stage-microbatches whose ``F`` has finished but whose ``B``/``BW`` has
  not; ``peak_inflight_mb`` divides it by the number of stages on the rank, i.e. counts
  microbatches of a full rank's worth of layers (what the schedule tables quote for interleaved
  and V schedules). ``peak_resident`` is the same count minus activations swapped out to host.
  ``peak_until_w`` counts until the ``W`` (or ``BW``) instead: what a split backward keeps alive.
  ``peak_resident_until_w`` is ``peak_until_w`` minus swapped-out activations: what
  :func:`hpfunc.transforms.pipeline.pipeline_map` keeps on the device, since its ``B`` retains the
  microbatch's graph (the ``W`` re-runs the weight side of it) and only ``W``/``BW`` frees it. For
  schedules without a ``B``/``W`` split it equals ``peak_resident``.

Costs: the defaults (``F = B = W = 1``, ``BW = B + W``) describe ``pipeline_map``'s split, whose
``W`` computes the weight gradients only (a matmul's ``dw``; measured with torch's flop counter:
``B + W`` equals the fused backward's FLOPs on an MLP and on Qwen3 stages). One case costs more: a
parameter used twice in a chain inside one stage (``(x @ w) @ w``) has its ``W`` taken from the
stage outputs again; price such a stage with ``costs`` (e.g. ``{"W": 2}``).

Example:
    >>> from hpfunc.schedules import one_f_one_b, simulate
    >>> r = simulate(one_f_one_b(4, 8))
    >>> r.makespan, r.bubble_ratio[0], r.peak_inflight[0]
    (33.0, 0.375, 4)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Union

import attrs

from .ir import Action, ActionKind, Schedule
from .validate import dependencies, execution_order

__all__ = ["Costs", "Event", "SimResult", "simulate", "cost_function"]

K = ActionKind
Costs = Union[None, Mapping[Union[str, ActionKind], float], Callable[[Action], float]]


def cost_function(costs: Costs = None) -> Callable[[Action], float]:
    """Turn ``costs`` into ``action -> seconds``.

    ``None`` means ``F = B = W = 1``, ``BW = B + W``, everything else 0. A mapping overrides
    kinds by name (``{"F": 1.0, "B": 2.0}``); ``BW`` defaults to the resulting ``B + W``. A callable
    is used as is.

    Example:
        >>> c = cost_function({"B": 2})
        >>> c(Action("BW", 0, 0)), c(Action("SEND_F", 0, 0))
        (3.0, 0.0)
    """
    if callable(costs):
        return costs
    table = {k: 0.0 for k in ActionKind}
    table.update({K.F: 1.0, K.B: 1.0, K.W: 1.0})
    given: dict[ActionKind, float] = {}
    if costs is not None:
        if not isinstance(costs, Mapping):
            raise TypeError(f"costs must be None, a mapping kind -> cost, or a callable; got {type(costs).__name__}")
        for key, value in costs.items():
            try:
                kind = ActionKind(key)
            except ValueError:
                names = ", ".join(k.value for k in ActionKind)
                raise ValueError(f"costs: unknown action kind {key!r}; expected one of {names}") from None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"costs[{kind.value!r}] must be a finite number >= 0, got {value!r}")
            given[kind] = float(value)
    table.update(given)
    if K.BW not in given:
        table[K.BW] = table[K.B] + table[K.W]
    return lambda a: table[a.kind]


@attrs.frozen
class Event:
    """One executed action: where it ran and when."""

    rank: int
    step: int
    action: Action
    start: float
    end: float


@attrs.frozen(repr=False)
class SimResult:
    """What :func:`simulate` measured. Per-rank values are dicts keyed by rank."""

    schedule: Schedule
    events: tuple[Event, ...]
    makespan: float
    useful: dict[int, float]
    idle: dict[int, float]
    bubble_ratio: dict[int, float]
    steady_bubble_ratio: dict[int, float]
    peak_inflight: dict[int, int]
    peak_inflight_mb: dict[int, float]
    peak_resident: dict[int, int]
    peak_until_w: dict[int, int]
    peak_resident_until_w: dict[int, int]

    @property
    def max_bubble_ratio(self) -> float:
        return max(self.bubble_ratio.values())

    def summary(self) -> str:
        """A short per-rank table."""
        lines = [f"{self.schedule.name or 'schedule'}: makespan {self.makespan:g}",
                 "rank  useful    idle  bubble  steady  peak(stage-mb)  peak(mb)"]
        for r in self.schedule.ranks:
            lines.append(
                f"{r:4d}  {self.useful[r]:6g}  {self.idle[r]:6g}  {self.bubble_ratio[r]:6.3f}  "
                f"{self.steady_bubble_ratio[r]:6.3f}  {self.peak_inflight[r]:14d}  {self.peak_inflight_mb[r]:8.3f}"
            )
        return "\n".join(lines)

    def timeline(self, *, tick: float | None = None, cell: int | None = None) -> str:
        """The run as text: one row per rank, one cell per ``tick`` of time (default: the smallest
        positive action time), ``.`` where the rank is idle.

        Example:
            >>> from hpfunc.schedules import gpipe, simulate
            >>> print(simulate(gpipe(2, 1)).timeline())
            rank 0 | 0F0  .    .    .    0BW0 0BW0
            rank 1 | .    1F0  1BW0 1BW0 .    .
        """
        positive = [e.end - e.start for e in self.events if e.end > e.start]
        if tick is None:
            tick = min(positive) if positive else 1.0
        if tick <= 0:
            raise ValueError(f"tick must be > 0, got {tick}")
        n = max(1, math.ceil(self.makespan / tick - 1e-9))
        width = cell or max([len(str(e.action)) for e in self.events] + [1])
        lines = []
        for r in self.schedule.ranks:
            cells = ["."] * n
            for e in self.events:
                if e.rank != r or e.end <= e.start:
                    continue
                first = int(math.floor(e.start / tick + 1e-9))
                last = max(first, int(math.ceil(e.end / tick - 1e-9)) - 1)
                for c in range(first, min(last, n - 1) + 1):
                    cells[c] = str(e.action)
            lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in cells).rstrip())
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], *, title: str | None = None) -> str:
        """Write a Gantt chart (PNG, rendered by matplotlib's Agg canvas) to ``path``; return the path."""
        # The object API renders PNG with the Agg canvas without touching the global backend
        # (pyplot state), so plotting never interferes with the caller's matplotlib setup.
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        colors = {K.F: "#4c78a8", K.B: "#f58518", K.W: "#54a24b", K.BW: "#e45756"}
        ranks = self.schedule.ranks
        fig = Figure(figsize=(max(6.0, min(24.0, self.makespan / 3)), 0.6 * len(ranks) + 1.2))
        ax = fig.add_subplot(1, 1, 1)
        for e in self.events:
            if e.end <= e.start:
                continue
            y = ranks.index(e.rank)
            # Later chunks of a rank (interleaved, V) are drawn lighter.
            chunks = self.schedule.stages_of(e.rank)
            alpha = 1.0 - 0.45 * chunks.index(e.action.stage) / max(1, len(chunks) - 1)
            ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8), alpha=alpha,
                           facecolors=colors.get(e.action.kind, "#bab0ac"), edgecolor="white", linewidth=0.5)
            if e.action.microbatch is not None:
                ax.text((e.start + e.end) / 2, y, str(e.action.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlim(0, self.makespan)
        ax.set_xlabel("time")
        ax.set_title(title or f"{self.schedule.name}: makespan {self.makespan:g}, "
                              f"max bubble {self.max_bubble_ratio:.3f}")
        handles = [Patch(color=c, label=k.value) for k, c in colors.items()]
        ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=120)
        return os.fspath(path)

    def __repr__(self) -> str:
        return (f"SimResult({self.schedule.name!r}, makespan={self.makespan:g}, "
                f"max_bubble_ratio={self.max_bubble_ratio:.4f}, peak_inflight={self.peak_inflight})")


def simulate(
    schedule: Schedule,
    costs: Costs = None,
    *,
    stage_scale: Mapping[int, float] | None = None,
) -> SimResult:
    """Validate ``schedule`` and play it under ``costs`` (see :func:`cost_function`).

    ``stage_scale[s]`` multiplies the cost of every compute action of stage ``s`` (for stages of
    uneven size, e.g. ``dict(enumerate(stage_costs(layer_costs, schedule.stage_layers)))``).

    Example:
        >>> from hpfunc.schedules import gpipe
        >>> r = simulate(gpipe(2, 4))
        >>> r.makespan, r.bubble_ratio[1], r.peak_inflight[0]
        (15.0, 0.25, 4)
    """
    cost = cost_function(costs)
    scale = dict(stage_scale or {})
    bad = [s for s in scale if not 0 <= s < schedule.num_stages]
    if bad:
        raise ValueError(f"stage_scale names stage(s) {bad}, but the schedule has {schedule.num_stages} stages")
    deps = dependencies(schedule)
    order = execution_order(schedule, deps)
    end: dict[tuple[int, int], float] = {}
    events = []
    for rank, step in order:
        action = schedule.actions[rank][step]
        c = float(cost(action))
        if action.is_compute and action.stage in scale:
            c *= float(scale[action.stage])
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of {action} (rank {rank} step {step}) must be a finite number >= 0, got {c}")
        start = max((end[p] for p in deps[(rank, step)]), default=0.0)
        end[(rank, step)] = start + c
        events.append(Event(rank, step, action, start, start + c))
    events.sort(key=lambda e: (e.rank, e.step))
    makespan = max((e.end for e in events), default=0.0)

    useful, idle, ratio, steady, peak, peak_mb, resident, until_w, res_until_w = {}, {}, {}, {}, {}, {}, {}, {}, {}
    spans = {}
    for r in schedule.ranks:
        mine = [e for e in events if e.rank == r]
        useful[r] = sum(e.end - e.start for e in mine if e.action.is_compute)
        idle[r] = makespan - useful[r]
        spans[r] = (max(e.end for e in mine) - min(e.start for e in mine)) if mine else 0.0
        held = best = on_device = most_on_device = stash = most_stash = kept = most_kept = 0
        for e in mine:  # in step order: F adds an activation, the first backward frees it
            kind = e.action.kind
            if kind is K.F:
                stash += 1
                kept += 1
            elif kind in (K.W, K.BW):
                stash -= 1
                kept -= 1
            elif kind is K.SWAP_OUT:
                kept -= 1
            elif kind is K.SWAP_IN:
                kept += 1
            most_stash = max(most_stash, stash)
            most_kept = max(most_kept, kept)
            if kind is K.F:
                held += 1
                on_device += 1
            elif kind in (K.B, K.BW):
                held -= 1
                on_device -= 1
            elif kind is K.SWAP_OUT:
                on_device -= 1
            elif kind is K.SWAP_IN:
                on_device += 1
            best = max(best, held)
            most_on_device = max(most_on_device, on_device)
        peak[r] = best
        resident[r] = most_on_device
        until_w[r] = most_stash
        res_until_w[r] = most_kept
        peak_mb[r] = best / max(1, len(schedule.stages_of(r)))
    period = max(spans.values(), default=0.0)
    for r in schedule.ranks:
        ratio[r] = idle[r] / useful[r] if useful[r] else math.inf
        steady[r] = (period - useful[r]) / useful[r] if useful[r] else math.inf
    return SimResult(schedule, tuple(events), makespan, useful, idle, ratio, steady, peak, peak_mb, resident, until_w,
                     res_until_w)
