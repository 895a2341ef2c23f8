"""Callbacks of a "user" for the trainer's tests, loaded by import path (``_user_callbacks:Recorder``)."""

from __future__ import annotations

import json

import torch

from hpfunc.train.callbacks import Callback


class Recorder(Callback):
    """Keeps what every hook was given; writes the step metrics to ``file`` at the end."""

    def __init__(self, *, tag: str, file: str = "recorded.json"):
        self.tag, self.file = tag, file
        self.steps: list[tuple[int, dict]] = []
        self.evals: list[tuple[int, float]] = []
        self.saves: list[int] = []
        self.events: list[str] = []

    def on_train_start(self, trainer):
        self.events.append("start")

    def on_step_end(self, trainer, step, metrics):
        self.steps.append((step, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}))

    def on_eval(self, trainer, step, val_loss):
        self.evals.append((step, val_loss))

    def on_save(self, trainer, step, path):
        self.saves.append(step)

    def on_train_end(self, trainer, summary):
        self.events.append("end")
        data = {"tag": self.tag, "steps": [[s, {k: v.tolist() for k, v in m.items()}] for s, m in self.steps]}
        trainer.output_file(self.file).write_text(json.dumps(data))

    def on_exception(self, trainer, error):
        self.events.append(f"exception {type(error).__name__}")


class FailAt(Callback):
    """Raises in ``on_step_end`` at ``step``."""

    def __init__(self, *, step: int):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise OSError("the disk of this callback is full")


class EvalRecorder(Callback):
    """Keeps the validation losses it is told of, on every rank (``every_rank``), with the rank."""

    every_rank = True

    def __init__(self):
        self.evals: list[tuple[int, int, float]] = []

    def on_eval(self, trainer, step, val_loss):
        self.evals.append((trainer.rank, step, val_loss))


class Rank0Recorder(Callback):
    """Keeps the validation losses it is told of (rank 0 only: the default)."""

    def __init__(self):
        self.evals: list[tuple[int, int, float]] = []

    def on_eval(self, trainer, step, val_loss):
        self.evals.append((trainer.rank, step, val_loss))
