"""``tensorboard``: the run as TensorBoard events, through the ``tensorboard`` package's writer
(``torch.utils.tensorboard.SummaryWriter``; install the optional extra, ``pip install hpfunc[tensorboard]``).

At every step that writes a line of metrics.jsonl, the same values as scalars under ``train/`` (``loss``,
``ce_loss``, ``aux_loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``expert_imbalance``, ``dropped_pairs``,
whichever the line holds) and, for an MoE model, one histogram per MoE layer of its per-expert token
counts (``moe/expert_load/layer<i>``); each validation loss as ``val/loss``. Events go to
``<output.dir>/<log_dir>``; rank 0 writes.

    callbacks: [tensorboard]          # then: tensorboard --logdir runs/train/tensorboard
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc.train.callbacks.base import WriterCallback

__all__ = ["TensorBoard", "SCALARS"]

SCALARS = ("loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "expert_imbalance", "dropped_pairs")


class TensorBoard(WriterCallback):
    """Write the logged scalars, expert-load histograms and validation losses as TensorBoard events."""

    def __init__(self, *, log_dir: str = "tensorboard", histograms: bool = True):
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("needs the tensorboard package, which is not installed here: pip install tensorboard "
                             "(the optional extra hpfunc[tensorboard]), or remove this callback") from None
        self.log_dir, self.histograms = log_dir, histograms
        self._writer: Any = None

    def on_train_start(self, trainer: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(trainer.output_file(self.log_dir)), purge_step=trainer.start_step + 1
                                     if trainer.start_step else None)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        record = trainer.record
        if record is None:
            return
        for key in SCALARS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"train/{key}", value, step)
        load = metrics.get("expert_load")
        if self.histograms and load is not None:
            for i, row in enumerate(load.detach().to(torch.float64)):
                self._writer.add_histogram(f"moe/expert_load/layer{i}", row, step)

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """Write ``{tag: value}`` at ``step`` (another callback's scalars, e.g. the precision monitor's)."""
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, step)

    def on_eval(self, trainer: Any, step: int, val_loss: float) -> None:
        self._writer.add_scalar("val/loss", val_loss, step)
