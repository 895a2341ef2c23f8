"""Backward code runs in the context variables of its forward, whichever thread the autograd engine uses.

hpfunc scopes its state with :mod:`contextvars` (the current mesh, the layout binding of a step, the
saved-tensor layers, the communication counters). On the CPU the autograd engine runs a backward on
the thread that called it, inside that context. On CUDA it runs the backward of CUDA tensors on its
own per-device thread, where none of these variables is set: a collective issued from a backward (a
mixed-precision gradient's reduce-scatter, an FSDP re-gather in a saved tensor's unpack) would find
no mesh. Code that runs inside a backward therefore captures the forward's context
(:func:`capture`, cheap: a copy-on-write snapshot) and runs in a copy of it (:func:`run`) when it
finds itself on another thread; on the forward's own thread it runs as is, so the CPU path is
unchanged. (``hpfunc.transforms.remat`` does the same for its recompute.)

>>> import contextvars
>>> v = contextvars.ContextVar("v", default=None)
>>> token = v.set("forward")
>>> captured = capture()
>>> v.reset(token)
>>> import threading
>>> seen = []
>>> t = threading.Thread(target=lambda: seen.append(run(captured, v.get)))
>>> t.start(); t.join()
>>> seen, run(captured, v.get)  # another thread sees the forward's value; this one runs as is
(['forward'], None)
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, NamedTuple

__all__ = ["Captured", "capture", "run"]


class Captured(NamedTuple):
    """The forward's context and the thread it ran on."""

    context: contextvars.Context
    thread: int


def capture() -> Captured:
    """The context of the code running now (to run its backward in)."""
    return Captured(contextvars.copy_context(), threading.get_ident())


def run(captured: Captured | None, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: as is on the captured thread (or with nothing captured), else in a copy
    of the captured context (a copy: two backward threads may run code of one forward at once)."""
    if captured is None or captured.thread == threading.get_ident():
        return fn(*args, **kwargs)
    return captured.context.copy().run(fn, *args, **kwargs)
