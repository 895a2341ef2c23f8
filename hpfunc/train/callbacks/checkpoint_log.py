"""``checkpoint_log``: one JSON line per checkpoint the run saves (``checkpoints.jsonl``): the step, the
checkpoint folder root, the seconds the loop waited for it and whether it was written in the background.

    checkpoint: {every: 50}
    callbacks: [checkpoint_log]
"""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import WriterCallback, open_lines

__all__ = ["CheckpointLog"]


class CheckpointLog(WriterCallback):
    """Write a line to ``file`` for every checkpoint saved (``checkpoint.every``)."""

    def __init__(self, *, file: str = "checkpoints.jsonl"):
        self.file = file
        self._writer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        self._writer = open_lines(trainer, self.file)

    def on_save(self, trainer: Any, step: int, path: Any) -> None:
        ckpts = trainer.checkpoints
        self._writer.write({"step": step, "dir": str(path), "blocked_s": ckpts.blocked_s[-1],
                            "async": bool(ckpts.asynchronous)})
