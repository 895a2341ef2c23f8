"""SAPP-ND: enumerate the parallel layouts of a model on ``N`` devices, keep those that fit, rank them.

Every combination of pipeline degree (schedules ``1f1b``, ``interleaved_1f1b`` with 2 virtual
stages, ``zb_h1``, ``zbv``; microbatches of 1, 2, 4 or 8 sequences), tensor parallelism (within a node; with and without sequence
parallelism), expert parallelism (dividing the experts), the remaining ranks as ddp, fsdp / ZeRO-1/2
or hsdp, gradient accumulation, and remat (none / selective / full) is estimated with
:func:`~hpfunc.autoparallel.memory_model.memory`; those under the memory limit are ranked by
:func:`~hpfunc.autoparallel.step_time.step_time`. Families (mesh and plan kinds) without a single
layout that fits are reported with the term that overflows in their smallest layout. The fastest
pipelines are then rebalanced (:mod:`hpfunc.autoparallel.stage_balance`: layers and remat per stage).

    >>> from hpfunc.models.qwen3.describe import describe
    >>> from hpfunc.models.qwen3.model import preset
    >>> from hpfunc.autoparallel.configuration import Workload
    >>> r = search(describe(preset("qwen3-moe-tiny")), 4, Workload(global_batch=8, seq_len=128, reserve_bytes=0),
    ...            "cpu", memory_limit=2**30)
    >>> r.best.layout.world, len(r.feasible) > 10
    (4, True)
"""

from __future__ import annotations

from typing import Iterator

import attrs

from hpfunc.autoparallel.configuration import Layout, Workload
from hpfunc.autoparallel.hardware import Hardware, format_bytes, hardware
from hpfunc.autoparallel.memory_model import MemoryEstimate, memory
from hpfunc.autoparallel.step_time import TimeEstimate, step_time
from hpfunc.models.description import REMAT_KINDS, ModelDescription

__all__ = ["Candidate", "Rejection", "PlanResult", "PlanError", "layouts", "search", "evaluate", "overflow"]

# memory terms in the order they are checked against the limit (model states first)
TERM_ORDER = (("model states", ("params", "grads", "master", "optimizer")), ("gathered", ("gathered",)),
              ("activations", ("activations",)), ("recompute", ("recompute",)), ("backward", ("backward",)),
              ("loss", ("loss",)),
              ("reserve", ("reserve",)))


class PlanError(ValueError):
    """No layout can run: the devices cannot be filled, or nothing fits in the memory limit."""


@attrs.frozen
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate | None


@attrs.frozen
class Rejection:
    """A family none of whose layouts fits: its smallest layout, the term at which the running sum
    of the terms passes the limit, and by how much the total exceeds it."""

    family: str
    layout: Layout
    memory: MemoryEstimate
    term: str
    over_bytes: float

    def reason(self, limit: float) -> str:
        return (f"{self.family}: the smallest ({self.layout.name}) needs {format_bytes(self.memory.total)} > "
                f"{format_bytes(limit)}; the limit is passed at the {self.term} term (over by "
                f"{format_bytes(self.over_bytes)}; " + ", ".join(
                    f"{name} {format_bytes(v)}" for name, v in grouped_terms(self.memory).items()) + ")")


@attrs.frozen
class PlanResult:
    feasible: tuple[Candidate, ...]  # fastest first; those with time None (not simulated) last
    rejected: tuple[Rejection, ...]
    memory_limit: float
    world: int
    hardware: Hardware

    @property
    def best(self) -> Candidate:
        return self.feasible[0]


def grouped_terms(m: MemoryEstimate) -> dict[str, float]:
    """The memory terms grouped as :data:`TERM_ORDER` names them."""
    return {name: float(sum(m.terms.get(k, 0.0) for k in keys)) for name, keys in TERM_ORDER}


def overflow(m: MemoryEstimate, limit: float) -> tuple[str, float] | None:
    """``(term, bytes over)`` when ``m`` exceeds ``limit``: the term at which the running sum (model
    states, gathered, activations, recompute, loss, reserve) first passes it; ``None`` if it fits."""
    if m.total <= limit:
        return None
    running = 0.0
    for name, value in grouped_terms(m).items():
        running += value
        if running > limit:
            return name, m.total - limit
    return "reserve", m.total - limit  # pragma: no cover - the loop always passes the limit


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(desc: ModelDescription, world: int, work: Workload, hw: Hardware, *,
            remats: tuple[str, ...] = REMAT_KINDS, max_microbatch_size: int = 8) -> Iterator[Layout]:
    """Every layout that can run ``work`` on ``world`` devices (before the memory check)."""
    L = desc.num_layers
    divides = tuple(sorted({d for l in desc.layers for d in l.tp_divides}))
    E = desc.num_experts
    for pp in _divisors(world):
        if pp > L:
            continue
        for tp in _divisors(world // pp):
            if tp > hw.ranks_per_node or any(d % tp for d in divides):
                continue
            for ep in _divisors(world // (pp * tp)):
                if ep > 1 and (E == 0 or E % ep):
                    continue
                rest = world // (pp * tp * ep)
                data = [(rest, 1, 3)] + [(1, rest, z) for z in (3, 2, 1) if rest > 1]
                data += [(r, rest // r, 3) for r in _divisors(rest) if 1 < r < rest]
                for dp, fsdp, zero in data:
                    shards = dp * fsdp * ep
                    if work.global_batch % shards:
                        continue
                    local = work.global_batch // shards
                    for sp in ((False, True) if tp > 1 else (False,)):
                        yield from _timed(pp, tp, sp, ep, dp, fsdp, zero, local, L, remats, max_microbatch_size)


def _timed(pp, tp, sp, ep, dp, fsdp, zero, local, L, remats, max_mbs) -> Iterator[Layout]:
    base = dict(pp=pp, tp=tp, sp=sp, ep=ep, dp=dp, fsdp=fsdp, zero=zero)
    # microbatches of 1, 2, 4, ... max_mbs sequences
    sizes = sorted({local // b for b in (1, 2, 4, 8, 16, 32) if b <= max_mbs and local % b == 0})
    if pp == 1:
        for m in sizes:
            for r in remats:
                yield Layout(**base, microbatches=m, remat=r)
        return
    for sched, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 1)):
        stages = pp * (2 if sched in ("interleaved_1f1b", "zbv") else 1)
        if stages > L:
            continue
        for m in sizes:
            if m < pp or (sched == "interleaved_1f1b" and m % pp):
                continue
            for r in remats:
                if r == "selective" and sched in ("zb_h1", "zbv"):
                    continue  # a split backward allows one backward per selectively recomputed region
                yield Layout(**base, schedule=sched, virtual_stages=v, microbatches=m, remat=r)


def evaluate(desc: ModelDescription, layout: Layout, work: Workload, hw: str | Hardware, *,
             memory_limit: float | None = None) -> Candidate:
    """Memory and (when it fits, or no limit is given) time of one layout."""
    hw = hardware(hw)
    mem = memory(desc, layout, work)
    limit = hw.hbm_bytes if memory_limit is None else memory_limit
    t = step_time(desc, layout, work, hw) if mem.total <= limit else None
    return Candidate(layout, mem, t)


def search(desc: ModelDescription, world: int, work: Workload, hw: str | Hardware, *,
           memory_limit: float | None = None, remats: tuple[str, ...] = REMAT_KINDS, exact: int = 50) -> PlanResult:
    """Enumerate, check memory, rank by estimated step time (see the module docstring).

    Pipelined layouts are simulated only while they can enter the ``exact`` fastest; the others are
    returned last with ``time=None`` (they fit, but are slower than the ``exact``-th by their bound).

    Raises:
        PlanError: ``world`` cannot be filled by any layout (names ``--devices`` and
            ``train.batch_size``), or even the smallest layout exceeds ``memory_limit`` (names
            ``--memory`` and the term that overflows).
    """
    hw = hardware(hw)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise PlanError(f"--devices: expected an integer >= 1, found {world!r}")
    limit = float(hw.hbm_bytes if memory_limit is None else memory_limit)
    feasible: list[Candidate] = []
    smallest: dict[str, tuple[Layout, MemoryEstimate]] = {}
    fits: set[str] = set()
    bounded: list[tuple[float, Layout, MemoryEstimate]] = []
    for lay in layouts(desc, world, work, hw, remats=remats):
        mem = memory(desc, lay, work)
        if mem.total <= limit:
            fits.add(lay.family)
            if lay.pp == 1:
                feasible.append(Candidate(lay, mem, step_time(desc, lay, work, hw)))
            else:
                bounded.append((step_time(desc, lay, work, hw, pipeline_bubble=False).total, lay, mem))
        elif lay.family not in smallest or mem.total < smallest[lay.family][1].total:
            smallest[lay.family] = (lay, mem)
    if not feasible and not smallest:
        raise PlanError(f"--devices: no layout fills {world} devices with train.batch_size={work.global_batch} "
                        f"sequences: the batch must split over the data-parallel ranks (dp x fsdp x ep) of some "
                        f"layout; use a batch size with a factor in common with {world}, or another device count")
    rejected = []
    for family, (lay, mem) in smallest.items():
        if family in fits:
            continue
        term, over = overflow(mem, limit)  # type: ignore[misc]
        rejected.append(Rejection(family, lay, mem, term, over))
    rejected.sort(key=lambda r: r.memory.total)
    if not feasible:
        low = rejected[0]
        raise PlanError(f"--memory: the limit {format_bytes(limit)} is below the smallest footprint of any layout on "
                        f"{world} devices: {low.layout.name} needs {format_bytes(low.memory.total)}; the limit "
                        f"is passed at the {low.term} term (over by {format_bytes(low.over_bytes)}; "
                        + ", ".join(f"{n} {format_bytes(v)}" for n, v in grouped_terms(low.memory).items()) + ")")
    # pipelines: simulate the schedule (the bubble) in order of the bound without it, while the bound
    # can still beat the `exact`-th best step; the rest keep no time (they rank below every timed one)
    feasible.sort(key=lambda c: c.time.total)  # type: ignore[union-attr]
    bounded.sort(key=lambda x: x[0])
    unranked = []
    for bound, lay, mem in bounded:
        if len(feasible) >= exact and bound > feasible[exact - 1].time.total:  # type: ignore[union-attr]
            unranked.append(Candidate(lay, mem, None))
            continue
        feasible.append(Candidate(lay, mem, step_time(desc, lay, work, hw)))
        feasible.sort(key=lambda c: c.time.total)  # type: ignore[union-attr]
    feasible = _balanced(desc, feasible, work, hw, limit)
    return PlanResult(tuple(feasible) + tuple(unranked), tuple(rejected), limit, world, hw)


def _balanced(desc: ModelDescription, ranked: list[Candidate], work: Workload, hw: Hardware, limit: float,
              count: int = 20) -> list[Candidate]:
    """The fastest ``count`` pipelines rebalanced (SAPP-PPB: layers and remat per stage), kept when faster."""
    from hpfunc.autoparallel.stage_balance import BalanceError, balance_layout

    out = list(ranked)
    for i, c in enumerate(ranked[:count]):
        if c.layout.pp == 1:
            continue
        try:
            lay = balance_layout(desc, c.layout, work, hw, memory_limit=limit)
        except BalanceError:
            continue
        mem = memory(desc, lay, work)
        if mem.total > limit:
            continue
        t = step_time(desc, lay, work, hw)
        if t.total < c.time.total:  # type: ignore[union-attr]
            out[i] = Candidate(lay, mem, t)
    out.sort(key=lambda c: c.time.total)  # type: ignore[union-attr]
    return out

