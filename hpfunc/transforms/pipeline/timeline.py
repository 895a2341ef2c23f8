"""The executor's timeline: when each compute action started and ended, when receives were posted and
arrived, when sends were posted, on this rank (``bench/pipeline.py`` draws it; tests read it).

    >>> with record_timeline() as events:
    ...     event("start", "0F0"); event("end", "0F0")
    >>> [(what, action) for what, action, _ in events]
    [('start', '0F0'), ('end', '0F0')]
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from hpfunc import layout

__all__ = ["record_timeline", "event"]


@contextlib.contextmanager
def record_timeline() -> Iterator[list]:
    """Record this rank's pipeline events while inside: a list of ``(what, action text, seconds)``
    with ``what`` one of ``"start"``/``"end"`` (a compute action: F, B, W, BW), ``"post"`` (a receive
    posted), ``"arrived"`` (a receive waited for and complete) and ``"send"`` (a send posted); times
    from ``time.perf_counter()``. ``bench/pipeline.py`` draws the timelines and measures the bubble
    from them; the tests check that receives are posted ahead of the compute that waits for them. The
    list is bound in the layout binding's scopes, which a step's own bindings keep: around a step call it
    records the step's pipeline."""
    events: list = []
    with layout.scoped(pipeline_timeline=events):
        yield events


def event(what: str, action: Any) -> None:
    """Note ``what`` happened to ``action`` now, if a timeline is being recorded."""
    events = layout.scopes().pipeline_timeline
    if events is not None:
        events.append((what, str(action), time.perf_counter()))
