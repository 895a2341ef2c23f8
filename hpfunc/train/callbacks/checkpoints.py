"""``checkpoints``: the run's checkpoints (always on, every rank: a save is a collective). After every
``checkpoint.every``-th step, :meth:`Trainer.save <hpfunc.train.trainer.Trainer.save>` without waiting
(asynchronous with ``checkpoint.async_save``), and after the last step of the run a save it waits for
(a run can be extended from it). Nothing with ``checkpoint.every: 0``. The save on the way out of a
failing run (last words) is the run's, not this callback's (its result is part of the run's error).
"""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import Callback

__all__ = ["Checkpoints"]


class Checkpoints(Callback):
    """Save the state every ``checkpoint.every`` steps and after the last step."""

    every_rank = True
    run_part = True

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if trainer.cfg.checkpoint.every <= 0:
            return
        last = step == trainer.cfg.train.steps
        if last or step % trainer.cfg.checkpoint.every == 0:
            trainer.save(wait=last)

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        # a last step that was skipped (not finite) had no on_step_end: its state (that of the step
        # before) is still saved as the last step's, so the run can be extended (once per step: a no-op
        # after the save above)
        if trainer.cfg.checkpoint.every > 0 and trainer.done > trainer.start_step:
            trainer.save()
