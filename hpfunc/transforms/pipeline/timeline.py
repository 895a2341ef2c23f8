"""The executor's timeline: when each compute action started and ended, when receives were posted and
arrived, when sends were posted, on this rank (``bench/pipeline.py`` draws it; tests read it).

    >>> with record_timeline() as events:
    ...     event("start", "0F0"); event("end", "0F0")
    >>> [(what, action) for what, action, _ in events]
    [('start', '0F0'), ('end', '0F0')]
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["record_timeline", "event"]

_TIMELINE: contextvars.ContextVar[list | None] = contextvars.ContextVar("hpfunc_pipeline_timeline", default=None)


@contextlib.contextmanager
def record_timeline() -> Iterator[list]:
    """Record this rank's pipeline events while inside: a list of ``(what, action text, seconds)``
    with ``what`` one of ``"start"``/``"end"`` (a compute action: F, B, W, BW), ``"post"`` (a receive
    posted), ``"arrived"`` (a receive waited for and complete) and ``"send"`` (a send posted); times
    from ``time.perf_counter()``. ``bench/pipeline.py`` draws the timelines and measures the bubble
    from them; the tests check that receives are posted ahead of the compute that waits for them."""
    events: list = []
    token = _TIMELINE.set(events)
    try:
        yield events
    finally:
        _TIMELINE.reset(token)


def event(what: str, action: Any) -> None:
    """Note ``what`` happened to ``action`` now, if a timeline is being recorded."""
    events = _TIMELINE.get()
    if events is not None:
        events.append((what, str(action), time.perf_counter()))
