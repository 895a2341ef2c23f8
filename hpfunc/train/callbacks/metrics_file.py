"""``metrics_file``: ``metrics.jsonl``, the run's record (always on, rank 0): every line the run logs
(:meth:`on_log <hpfunc.train.callbacks.base.Callback.on_log>`: a training line every ``train.log_every``
steps, a skipped step, a validation loss), one whole JSON line each, written on the run's background
writer (:class:`hpfunc.train.output.MetricsWriter` underneath: a failed write is cut back to the previous
line). A resumed run appends after the lines up to its checkpoint (the run cuts the file back first).
"""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import WriterCallback

__all__ = ["MetricsFile"]


class MetricsFile(WriterCallback):
    """Append each logged record to ``metrics.jsonl`` in the run's folder."""

    run_part = True

    def __init__(self) -> None:
        self._writer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        from hpfunc.train.callbacks.writer import BackgroundLines
        from hpfunc.train.output import MetricsWriter

        self._writer = BackgroundLines(trainer.writer, MetricsWriter(trainer.output_file("metrics.jsonl")))

    def on_log(self, trainer: Any, record: dict[str, Any]) -> None:
        self._writer.write(record)
