"""The callback protocol and its dispatch: what a callback is told, on which ranks, and what its failure does.

A callback is an object with any of the methods below (a subclass of :class:`Callback` gets the others
as no-ops). The trainer calls them on rank 0 only, unless the callback sets ``every_rank = True``
(a callback that takes part in a collective, such as the per-layer norm monitor, must); each gets the
:class:`~hpfunc.train.trainer.Trainer`, which holds the run's ``cfg``, ``spec``, ``model_cfg``,
``state``, ``records``, ``out_dir``, ``main`` and ``rank``.

====================================================  ==================================================
``on_train_start(trainer)``                           the state is built (or resumed), the folder claimed
``on_step_end(trainer, step, metrics)``               after each applied step; ``metrics`` as the step
                                                      returned them (0-d tensors; ``expert_load``
                                                      ``[moe_layers, E]``), ``trainer.record`` the line
                                                      written to metrics.jsonl at this step (or None)
``on_log(trainer, record)``                           a line the run logs to metrics.jsonl (a training
                                                      line, a skipped step, a validation loss), before
                                                      the other hooks of its step
``on_eval(trainer, step, val_loss)``                  after a validation (on every rank that asks)
``on_save(trainer, step, path)``                      after a checkpoint of ``step`` was started
``on_train_end(trainer, summary)``                    the run finished (before summary.json)
``on_exception(trainer, error)``                      the run is failing with ``error``
====================================================  ==================================================

A callback never blocks the step on a disk: its file writes go to the run's background writer
(``trainer.writer``, :mod:`hpfunc.train.callbacks.writer`; :func:`open_lines` gives JSON lines written
there), one thread per run, flushed when a checkpoint is saved, at the end of the run and on a failure.
A write that fails is reported naming the callback that handed it over.

The run's own outputs are built-in callbacks too, always on (:mod:`hpfunc.train.callbacks.defaults`):
the progress bar, metrics.jsonl, the checkpoints, the loss plot and summary.json; the config's
``callbacks:`` and the ``callbacks=`` objects run between the first three and the last two.

A callback that raises stops the run with :class:`CallbackError` naming it (``callbacks[1]
(moe_monitor) failed in on_step_end at step 5: ...``); the files the run wrote so far (metrics.jsonl, a
callback's own lines) stay whole, and no summary.json is written.

    >>> class Count(Callback):
    ...     def __init__(self):
    ...         self.steps = []
    ...     def on_step_end(self, trainer, step, metrics):
    ...         self.steps.append(step)
    >>> class Broken(Callback):
    ...     def on_step_end(self, trainer, step, metrics):
    ...         raise OSError("disk full")
    >>> calls = CallbackList([("callbacks[0] (count)", Count()), ("callbacks[1] (broken)", Broken())], main=True)
    >>> calls.step_end(None, 1, {})
    Traceback (most recent call last):
    ...
    hpfunc.train.callbacks.base.CallbackError: callbacks[1] (broken) failed in on_step_end at step 1: OSError: disk full
    >>> calls.callbacks[0][1].steps
    [1]
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any, Sequence

from hpfunc.train.output import OutputWriteError

__all__ = ["BackgroundWriteError", "CALLER", "Callback", "CallbackError", "CallbackList", "open_lines", "scalars"]

# The label of the callback whose hook is running (``callbacks[1] (moe_monitor)``), set by the dispatch
# for the duration of one hook call: a write handed to the background writer then is reported under it.
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("hpfunc_train_callback", default="the run")


def open_lines(trainer: Any, name: str) -> Any:
    """A writer of whole JSON lines on ``name`` in the run's folder, for a callback's own file, whose
    writes run on the run's background writer (:meth:`hpfunc.train.trainer.Trainer.open_lines`: afresh
    from step 0, cut back to the checkpoint's step on a resume)."""
    return trainer.open_lines(name)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The 0-d entries of a step's metrics as floats (``loss``, ``grad_norm``, ``lr``, ...)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "dim") and value.dim() == 0:
            out[key] = float(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class Callback:
    """Base class of callbacks: every hook is a no-op; override those you need."""

    every_rank: bool = False  # True: called on every rank (a callback that joins a collective)
    run_part: bool = False  # True: one of the run's own outputs, whose errors are the run's (not wrapped)

    def on_train_start(self, trainer: Any) -> None:
        del trainer

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        del trainer, step, metrics

    def on_log(self, trainer: Any, record: dict[str, Any]) -> None:
        del trainer, record

    def on_eval(self, trainer: Any, step: int, val_loss: float) -> None:
        del trainer, step, val_loss

    def on_save(self, trainer: Any, step: int, path: Any) -> None:
        del trainer, step, path

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        del trainer, summary

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        del trainer, error


class WriterCallback(Callback):
    """A callback that writes to one open writer (``self._writer``, opened by the subclass): closed at
    the end of the run and when it fails, so the file is complete either way."""

    _writer: Any = None

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        del trainer, summary
        self._close()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        del trainer, error
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CallbackError(RuntimeError):
    """A callback raised; the message names it (its ``callbacks[i]`` entry), the hook and the step."""


class BackgroundWriteError(OutputWriteError):
    """A file write handed to the run's background writer failed; the message names the file and the
    callback that handed the write over (``label``)."""

    def __init__(self, message: str, path: Any, label: str):
        super().__init__(message, path)
        self.label = label


class CallbackList:
    """The run's callbacks as ``(label, callback)`` pairs, called in order on the ranks they run on.

    ``main``: whether this process is rank 0 (the others call only ``every_rank`` callbacks).
    """

    def __init__(self, callbacks: Sequence[tuple[str, Any]], *, main: bool):
        self.callbacks = list(callbacks)
        self.main = main

    def _here(self) -> list[tuple[str, Any]]:
        return [(label, cb) for label, cb in self.callbacks if self.main or getattr(cb, "every_rank", False)]

    def _call(self, hook: str, at: str, *args: Any) -> None:
        for label, cb in self._here():
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            token = CALLER.set(label)
            try:
                fn(*args)
            except CallbackError:
                raise  # named already (a background write's failure names the callback that handed it over)
            except Exception as e:
                if getattr(cb, "run_part", False) or _named(e):
                    raise  # the run's own outputs raise the run's errors (OutputWriteError, CheckpointError, ...)
                raise CallbackError(f"{label} failed in {hook}{at}: {type(e).__name__}: {e}") from e
            finally:
                CALLER.reset(token)

    def train_start(self, trainer: Any) -> None:
        self._call("on_train_start", "", trainer)

    def step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self._call("on_step_end", f" at step {step}", trainer, step, metrics)

    def log(self, trainer: Any, record: dict[str, Any]) -> None:
        self._call("on_log", f" at step {record.get('step')}", trainer, record)

    def eval(self, trainer: Any, step: int, val_loss: float) -> None:
        self._call("on_eval", f" at step {step}", trainer, step, val_loss)

    def save(self, trainer: Any, step: int, path: Any) -> None:
        self._call("on_save", f" at step {step}", trainer, step, path)

    def train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        self._call("on_train_end", "", trainer, summary)

    def exception(self, trainer: Any, error: BaseException) -> None:
        """Tell every callback the run is failing; a callback that fails here too is reported on stderr
        (the run's own error is the one raised)."""
        for label, cb in self._here():
            fn = getattr(cb, "on_exception", None)
            if fn is None:
                continue
            token = CALLER.set(label)
            try:
                fn(trainer, error)
            except Exception as e:  # noqa: BLE001 - the original error wins; this one is said
                print(f"hpfunc train: {label} failed in on_exception: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                CALLER.reset(token)


def _named(error: BaseException) -> bool:
    """A failed background write, which names its callback already."""
    return isinstance(error, BackgroundWriteError)
