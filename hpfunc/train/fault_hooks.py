"""Test hooks that inject faults into a training run: a rank killed mid-run, a batch whose loss is NaN.

They exist so that the recovery paths (elastic restart, the non-finite guard) are tested on real runs
of ``hpfunc train``; nothing sets them but a test. The environment variable :data:`ENV` holds
comma-separated hooks:

- ``kill@STEP`` or ``kill@STEP:rRANK``: the rank (default 0) sends itself SIGKILL when step STEP
  begins (its peers are then inside that step's collectives), in the first attempt of an elastic
  worker group only (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted group runs through.
- ``term@STEP``: the process sends itself SIGTERM when step STEP has finished, as a scheduler's
  preemption would (only while the loop's last-words handler is installed; ignored otherwise, so
  that it never kills a process that would not save).
- ``nan@STEP``: every label of step STEP's batch is the ignore index, so the step's mean cross-entropy
  is 0 / 0 = NaN (and so is its gradient), as an all-padding batch would make it.

>>> hooks = FaultHooks.parse("kill@7:r1,nan@3")
>>> hooks.kill_step(rank=1, attempt=0), hooks.kill_step(rank=1, attempt=1), hooks.kill_step(rank=0, attempt=0)
(7, None, None)
>>> import torch
>>> hooks.batch(3, {"tokens": torch.zeros(1, 2), "labels": torch.ones(1, 2, dtype=torch.int64)})["labels"].tolist()
[[-100, -100]]
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any, Mapping

import attrs

__all__ = ["ENV", "FaultHooks"]

ENV = "HPFUNC_TRAIN_TEST_FAULTS"
_HOOK = re.compile(r"(kill|nan|term)@(\d+)(?::r(\d+))?")


@attrs.frozen
class FaultHooks:
    """The parsed hooks of :data:`ENV` (empty: none)."""

    kill: tuple[tuple[int, int], ...] = ()  # (step, rank)
    nan: tuple[int, ...] = ()
    term: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> "FaultHooks":
        kill, nan, term = [], [], []
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            m = _HOOK.fullmatch(part)
            if m is None:
                raise ValueError(f"{ENV}: cannot read the hook {part!r}; expected kill@STEP[:rRANK], term@STEP or "
                                 f"nan@STEP")
            if m.group(1) == "kill":
                kill.append((int(m.group(2)), int(m.group(3) or 0)))
            else:
                (nan if m.group(1) == "nan" else term).append(int(m.group(2)))
        return cls(tuple(kill), tuple(nan), tuple(term))

    @classmethod
    def from_env(cls) -> "FaultHooks":
        return cls.parse(os.environ.get(ENV))

    def kill_step(self, *, rank: int, attempt: int) -> int | None:
        """The step at which this rank kills itself, if any (first attempt only)."""
        if attempt:
            return None
        return next((s for s, r in self.kill if r == rank), None)

    def maybe_kill(self, step: int, *, rank: int, attempt: int) -> None:
        """SIGKILL this process if a hook says so for ``step`` (1-based, the step about to run)."""
        if self.kill_step(rank=rank, attempt=attempt) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_term(self, step: int, *, handled: bool) -> None:
        """SIGTERM this process after ``step`` if a hook says so and ``handled`` (the loop catches it)."""
        if handled and step in self.term:
            os.kill(os.getpid(), signal.SIGTERM)

    def batch(self, step: int, batch: Mapping[str, Any], ignore_index: int = -100) -> Mapping[str, Any]:
        """``batch`` with every label set to ``ignore_index`` (the model's, from its spec) when a ``nan`` hook
        names ``step`` (1-based)."""
        if step not in self.nan:
            return batch
        import torch

        return {**batch, "labels": torch.full_like(batch["labels"], ignore_index)}
