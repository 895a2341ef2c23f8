"""A step's scalars kept where the step made them, read to the host for many steps in one transfer.

Reading a CUDA tensor's value (``float(loss)``) makes the host wait for the device: once per step it
would stall the queue of kernels at every step. :class:`StepReadout` keeps each step's ``loss``,
``ce_loss``, ``aux_loss``, ``grad_norm`` and ``lr`` on the device (one float64 row of five, stacked
there) and, when the loop reads them (a logging step, a save, an evaluation, the end), moves every
pending row and the logging step's MoE counters (``expert_load``, ``dropped_pairs``) with one
``torch.cat(...).cpu()`` (then read on the host). The values are those of ``float(metrics[k])`` bit for bit (each one is cast
to float64 on the device, exactly).

    >>> import torch
    >>> r = StepReadout()
    >>> for n in (1, 2):
    ...     _ = r.add(n, {"loss": torch.tensor(5.0 - n), "ce_loss": torch.tensor(4.0), "aux_loss": torch.tensor(0.0),
    ...                   "grad_norm": torch.tensor(0.5), "lr": torch.tensor(1e-3, dtype=torch.float64),
    ...                   "expert_load": torch.tensor([[3, 1]])}, keep=("expert_load",) if n == 2 else ())
    >>> steps = r.read()
    >>> [(s.step, s.loss) for s in steps], steps[1].extras["expert_load"].tolist(), r.read()
    ([(1, 4.0), (2, 3.0)], [[3, 1]], [])
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["SCALARS", "ReadStep", "StepReadout"]

SCALARS = ("loss", "ce_loss", "aux_loss", "grad_norm", "lr")
"""The per-step scalars of the trainer's metrics, in the order of a row."""


class ReadStep:
    """One step's values once read: ``values`` (the five scalars as Python floats), ``extras`` (the
    kept counters as host tensors of their own dtype and shape) and ``seconds`` (set by the loop)."""

    __slots__ = ("step", "row", "kept", "values", "extras", "seconds")

    def __init__(self, step: int, row: torch.Tensor, kept: dict[str, torch.Tensor]):
        self.step, self.row, self.kept = step, row, kept
        self.values: dict[str, float] = {}
        self.extras: dict[str, torch.Tensor] = {}
        self.seconds = 0.0

    @property
    def loss(self) -> float:
        return self.values["loss"]

    @property
    def grad_norm(self) -> float:
        return self.values["grad_norm"]

    @property
    def lr(self) -> float:
        return self.values["lr"]


class StepReadout:
    """The steps whose scalars are still on the device, in order (see the module)."""

    def __init__(self) -> None:
        self.pending: list[ReadStep] = []

    def add(self, step: int, metrics: dict[str, Any], *, keep: Sequence[str] = ()) -> ReadStep:
        """Keep step ``step``'s scalars (device ops only: nothing is read); ``keep``: the metrics that
        also come along at the read (when the step has them)."""
        row = torch.stack([torch.as_tensor(metrics[k]).detach().reshape(()).to(torch.float64) for k in SCALARS])
        entry = ReadStep(step, row, {k: metrics[k].detach() for k in keep if metrics.get(k) is not None})
        self.pending.append(entry)
        return entry

    def read(self) -> list[ReadStep]:
        """Every pending step's values, in one device-to-host transfer; the pending list starts afresh."""
        steps, self.pending = self.pending, []
        if not steps:
            return []
        parts = [e.row for e in steps]
        for e in steps:
            parts += [x.reshape(-1).to(torch.float64) for x in e.kept.values()]
        # the one transfer: a device-to-host copy of every value (the host waits for the device here, once),
        # then read on the host
        flat = torch.cat(parts).cpu().tolist()
        at = 0
        for e in steps:
            e.values = dict(zip(SCALARS, flat[at: at + len(SCALARS)]))
            at += len(SCALARS)
        for e in steps:
            for k, x in e.kept.items():
                e.extras[k] = torch.tensor(flat[at: at + x.numel()], dtype=torch.float64).to(x.dtype).view(x.shape)
                at += x.numel()
            e.row, e.kept = None, {}  # the device tensors go
        return steps
