"""The run's background writer: the callbacks' file writes go to one thread through one queue, so that a
step never waits for a disk.

One :class:`BackgroundWriter` per run (``trainer.writer``), started on the first write. A callback
hands it a write (:meth:`BackgroundWriter.submit`, or the JSON lines of :func:`open_lines`); the writes
run in the order they were handed over. The run flushes it (waits for every write handed over) when a
checkpoint is saved, at the end of the run and when the run fails, and closes it with the run.

A write that fails is reported naming the callback that handed it over, at the next write or flush:
:class:`BackgroundWriteError` (an :class:`~hpfunc.train.output.OutputWriteError`, which names the file)
for a file that could not be written, :class:`~hpfunc.train.callbacks.base.CallbackError` for any other
error. The writes handed over after a failed one are not run, so no file gets lines past a line that is
missing.

    >>> import pathlib, tempfile
    >>> from hpfunc.train.output import MetricsWriter, read_metrics
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.jsonl"
    >>> writer = BackgroundWriter()
    >>> lines = BackgroundLines(writer, MetricsWriter(path))
    >>> lines.write({"step": 1, "loss": 2.5})
    >>> writer.close()
    >>> read_metrics(path)
    [{'step': 1, 'loss': 2.5}]
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any, Callable

from hpfunc.train.callbacks.base import CALLER, BackgroundWriteError, CallbackError
from hpfunc.train.output import OutputWriteError

__all__ = ["BackgroundWriter", "BackgroundLines", "BackgroundWriteError", "CALLER"]

class BackgroundWriter:
    """One writer thread and its queue (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failure: tuple[str, BaseException] | None = None
        self._reported = False
        self._closed = False
        self._files: list[BackgroundLines] = []  # their files are closed when the writer closes

    def submit(self, fn: Callable[[], Any], label: str | None = None) -> None:
        """Run ``fn()`` on the writer thread, after every write handed over before it. ``label`` names
        the callback in a failure's message (default: the callback whose hook is running). Raises the
        failure of an earlier write."""
        if self._closed:
            raise RuntimeError("the run's background writer is closed (the run ended)")
        self.check()
        self._put(CALLER.get() if label is None else label, fn, always=False)

    def _put(self, label: str, fn: Callable[[], Any], *, always: bool) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="hpfunc-train-writer", daemon=True)
            self._thread.start()
        self._queue.put((label, fn, always))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                label, fn, always = item
                if self._failure is None or always:  # after a failed write only files are closed
                    try:
                        fn()
                    except BaseException as e:  # noqa: BLE001 - reported to the loop's thread
                        if self._failure is None:
                            self._failure = (label, e)
            finally:
                self._queue.task_done()

    def check(self) -> None:
        """Raise the failure of a write that ran already (once)."""
        if self._failure is not None and not self._reported:
            self._reported = True
            label, e = self._failure
            if isinstance(e, OutputWriteError):
                raise BackgroundWriteError(f"{e} (written in the background for {label})", e.path, label) from e
            raise CallbackError(f"{label} failed in a background write: {type(e).__name__}: {e}") from e

    def flush(self) -> None:
        """Wait for every write handed over so far; raise a failure among them."""
        if self._thread is not None:
            self._queue.join()
        self.check()

    def close(self, *, raise_errors: bool = True) -> None:
        """Flush, close the files of :class:`BackgroundLines` and stop the thread. ``raise_errors=False``
        (the run is failing with another error): a failure is said on stderr instead."""
        if self._closed:
            return
        for lines in self._files:
            lines.close()
        self._files.clear()
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001
            if raise_errors:
                raise
            print(f"hpfunc train: {e}", file=sys.stderr, flush=True)
        finally:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()


class BackgroundLines:
    """A :class:`~hpfunc.train.output.MetricsWriter` whose writes run on the background writer: ``write``
    hands the record over and returns; ``close`` closes the file after the lines handed over."""

    def __init__(self, writer: BackgroundWriter, lines: Any):
        self.writer, self.lines = writer, lines
        self.path = lines.path
        self._open = True
        writer._files.append(self)

    def write(self, record: dict[str, Any]) -> None:
        """Hand ``record`` over (it must not change afterwards: it is serialised on the writer thread)."""
        self.writer.submit(lambda: self.lines.write(record))

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self.writer._closed:
            self.lines.close()
        else:
            self.writer._put(CALLER.get(), self.lines.close, always=True)
