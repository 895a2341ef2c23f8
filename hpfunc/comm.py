"""Communication accounting: every collective hpfunc issues, counted per call.

Inside ``with hpfunc.comm_stats() as stats:`` each :mod:`hpfunc.lax` collective (forward and the
transposes run in backward) appends a :class:`CommRecord`: the operation, the mesh axes, the group
size ``n``, the payload ``M`` (bytes of the full array, as in docs/reference.md#ring-collectives),
the bytes each rank sends under the ring algorithm, and the user source line that issued it.

Example::

    with hpfunc.comm_stats() as stats:
        loss, grads = train_step(state, batch)
    print(stats.table())
    stats.total_sent_bytes(op="all_gather")

Each record carries the time it was issued (``issued_at``, ``time.perf_counter``); a collective issued
without waiting (``async_op``: the engine's overlapped reductions and prefetched gathers) is also noted
in ``stats.waits`` when something waits for it (:func:`waited`), so a trace shows what ran between.

Ring formulas (bytes each rank sends): all-reduce ``2 (n-1)/n M``; all-gather, reduce-scatter and
all-to-all ``(n-1)/n M`` (M = full array); ppermute: the bytes it sends.
"""

from __future__ import annotations

import contextvars
import os
import sys
import time
from fractions import Fraction
from typing import Iterator

import attrs

__all__ = ["CommRecord", "CommWait", "CommStats", "comm_stats", "record", "waited", "ring_sent_bytes"]

_ACTIVE: contextvars.ContextVar[tuple["CommStats", ...]] = contextvars.ContextVar("hpfunc_comm_stats", default=())

_HPFUNC_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_MARKERS = (os.sep + "torch" + os.sep,)


def ring_sent_bytes(op: str, payload_bytes: int, n: int) -> Fraction:
    """Bytes one rank sends for ``op`` on ``n`` ranks with a full-array payload of ``payload_bytes``."""
    if n <= 1:
        return Fraction(0)
    if op in ("all_reduce",):
        return Fraction(2 * (n - 1) * payload_bytes, n)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction((n - 1) * payload_bytes, n)
    if op in ("send", "ppermute"):
        return Fraction(payload_bytes)
    raise ValueError(f"no ring formula for collective {op!r}")


@attrs.frozen
class CommRecord:
    """One collective call."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | ppermute
    name: str  # the hpfunc.lax function (psum, pmean, all_gather, psum_scatter, ...)
    axes: tuple[str, ...]
    n: int
    payload_bytes: int
    sent_bytes: Fraction
    phase: str  # "forward" | "backward"
    source: str
    tag: str = ""
    issued_at: float = attrs.field(default=0.0, eq=False)  # time.perf_counter() when issued
    # of payload_bytes, those of the step's scalars (loss, batch statistics) riding this collective
    # (transforms/engine/riders.py): a DDP step's last gradient bucket carries them
    rider_bytes: int = 0


@attrs.frozen
class CommWait:
    """The wait for a collective issued without waiting: its record and when the wait returned."""

    record: CommRecord
    waited_at: float


@attrs.define
class CommStats:
    """Records collected inside :func:`comm_stats` (``waits``: when asynchronous ones were waited for)."""

    records: list[CommRecord] = attrs.field(factory=list)
    waits: list[CommWait] = attrs.field(factory=list)

    def filter(self, *, op: str | None = None, name: str | None = None, axes: tuple[str, ...] | str | None = None,
               phase: str | None = None, tag: str | None = None) -> list[CommRecord]:
        if isinstance(axes, str):
            axes = (axes,)
        return [
            r for r in self.records
            if (op is None or r.op == op) and (name is None or r.name == name)
            and (axes is None or tuple(r.axes) == tuple(axes)) and (phase is None or r.phase == phase)
            and (tag is None or r.tag == tag)
        ]

    def count(self, **kw) -> int:
        return len(self.filter(**kw))

    def total_sent_bytes(self, **kw) -> Fraction:
        return sum((r.sent_bytes for r in self.filter(**kw)), Fraction(0))

    def total_payload_bytes(self, **kw) -> int:
        return sum(r.payload_bytes for r in self.filter(**kw))

    def by_collective(self) -> list[dict]:
        """One row per (collective, mesh axes, group size, phase): ``count``, ``payload_bytes`` and
        ``sent_bytes`` (float) summed, sorted by axes, collective, phase and group (the dry run's and the
        simulation's ``comm`` report)."""
        rows: dict[tuple, dict] = {}
        for r in self.records:
            axes = "+".join(r.axes)
            e = rows.setdefault((r.op, axes, r.n, r.phase), {"collective": r.op, "axes": axes, "group": r.n,
                                                             "phase": r.phase, "count": 0, "payload_bytes": 0,
                                                             "sent_bytes": 0.0})
            e["count"] += 1
            e["payload_bytes"] += int(r.payload_bytes)
            e["sent_bytes"] += float(r.sent_bytes)
        return sorted(rows.values(), key=lambda e: (e["axes"], e["collective"], e["phase"], e["group"]))

    def table(self) -> str:
        """A per-(op, axes, phase, source) summary table."""
        rows: dict[tuple, list] = {}
        for r in self.records:
            k = (r.name, ",".join(r.axes), r.phase, r.source)
            row = rows.setdefault(k, [0, 0, Fraction(0)])
            row[0] += 1
            row[1] += r.payload_bytes
            row[2] += r.sent_bytes
        lines = [f"{'collective':<14} {'axes':<12} {'phase':<9} {'calls':>6} {'payload B':>12} {'sent B/rank':>12}  source"]
        for (name, axes, phase, src), (c, pb, sb) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
            lines.append(f"{name:<14} {axes:<12} {phase:<9} {c:>6} {pb:>12} {float(sb):>12.0f}  {src}")
        tot = self.total_sent_bytes()
        lines.append(f"total: {len(self.records)} calls, {float(tot):.0f} bytes sent per rank")
        return "\n".join(lines)


class comm_stats:
    """Context manager collecting :class:`CommRecord` s of every hpfunc collective issued inside it."""

    def __init__(self) -> None:
        self.stats = CommStats()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> CommStats:
        self._token = _ACTIVE.set(_ACTIVE.get() + (self.stats,))
        return self.stats

    def __exit__(self, *exc) -> None:
        assert self._token is not None
        _ACTIVE.reset(self._token)


def active() -> tuple[CommStats, ...]:
    """The collectors active in this context (captured by collectives for their backward)."""
    return _ACTIVE.get()


def _source() -> str:
    f = sys._getframe(2)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_HPFUNC_DIR + os.sep + "lax") and not fn.startswith(_HPFUNC_DIR + os.sep + "comm") \
                and not any(m in fn for m in _TORCH_MARKERS):
            rel = os.path.relpath(fn, os.path.dirname(_HPFUNC_DIR)) if fn.startswith(os.path.dirname(_HPFUNC_DIR)) else fn
            return f"{rel}:{f.f_lineno}"
        f = f.f_back
    return "?"


def record(collectors: tuple[CommStats, ...], *, op: str, name: str, axes: tuple[str, ...], n: int,
           payload_bytes: int, phase: str, tag: str = "", sent_bytes: Fraction | None = None,
           rider_bytes: int = 0) -> CommRecord | None:
    """Append one record to every active collector and return it (``None`` when none is active)."""
    if not collectors:
        return None
    rec = CommRecord(
        op=op, name=name, axes=tuple(axes), n=n, payload_bytes=int(payload_bytes),
        sent_bytes=ring_sent_bytes(op, payload_bytes, n) if sent_bytes is None else sent_bytes,
        phase=phase, source=_source(), tag=tag, issued_at=time.perf_counter(), rider_bytes=int(rider_bytes),
    )
    for c in collectors:
        c.records.append(rec)
    return rec


def waited(collectors: tuple[CommStats, ...], rec: CommRecord | None) -> None:
    """Note that the asynchronous collective ``rec`` (what :func:`record` returned) was just waited for."""
    if rec is None or not collectors:
        return
    w = CommWait(rec, time.perf_counter())
    for c in collectors:
        c.waits.append(w)


def iter_records(stats: CommStats) -> Iterator[CommRecord]:
    return iter(stats.records)
