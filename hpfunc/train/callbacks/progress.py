"""``progress``: the console view of a run (always on, rank 0): a tqdm bar on a terminal, plain lines
otherwise, or nothing (``output.progress``: auto, bar, lines, none), through
:class:`hpfunc.train.output.Progress`.

Each training line of metrics.jsonl is shown as it is logged (``step  5/30  loss 5.1234  grad_norm ...``),
a validation loss and a skipped step as a message; the bar advances every step.
"""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import Callback

__all__ = ["ProgressBar"]

_NOT_APPLIED = "; the step was not applied"


class ProgressBar(Callback):
    """Show the run's progress on ``trainer.stream`` (stdout by default)."""

    run_part = True

    def __init__(self) -> None:
        self._progress: Any = None

    def on_train_start(self, trainer: Any) -> None:
        from hpfunc.train.output import Progress

        self._progress = Progress(trainer.cfg.train.steps, trainer.cfg.output.progress, trainer.options["stream"])
        self._progress.update(trainer.start_step)

    def on_log(self, trainer: Any, record: dict[str, Any]) -> None:
        step = record["step"]
        if record.get("skipped"):
            what = record["reason"].removesuffix(_NOT_APPLIED)
            self._progress.message(
                f"step {step}: {what}; skipped (not applied; {record['skipped_steps']} skipped so far, "
                f"{trainer.tally.in_a_row} in a row of at most {trainer.cfg.train.max_skips})")
            self._progress.update(step)
        elif "val_loss" in record:
            if step != trainer.cfg.train.steps:  # the last one is in the summary's lines
                self._progress.message(f"step {step}: validation loss {record['val_loss']:.4f}")
        else:
            self._progress.update(step, record)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self._progress.update(step)

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
