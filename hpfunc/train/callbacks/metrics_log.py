"""``metrics_log``: every ``every``-th step's metrics exactly as the step returned them, one JSON line each
(``steps.jsonl``), where metrics.jsonl holds means over the ``train.log_every`` window.

    callbacks: [{metrics_log: {every: 1, file: steps.jsonl}}]

Each line is ``{"step": n, "loss": ..., "ce_loss": ..., "aux_loss": ..., "grad_norm": ..., "lr": ...}`` (every
0-d value of the step's metrics; NaN and infinity are written as null).
"""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import WriterCallback, open_lines, scalars

__all__ = ["MetricsLog"]


class MetricsLog(WriterCallback):
    """Write the scalar metrics of every ``every``-th step to ``file`` in the run's folder."""

    def __init__(self, *, every: int = 1, file: str = "steps.jsonl"):
        if every < 1:
            raise ValueError(f"every: expected an integer >= 1, found {every}")
        self.every, self.file = every, file
        self._writer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        self._writer = open_lines(trainer, self.file)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if step % self.every == 0:
            self._writer.write({"step": step, **scalars(metrics)})
