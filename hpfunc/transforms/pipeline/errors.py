"""What a pipeline program that cannot run raises, and where in the schedule it stopped.

    >>> str(Where(1, 7, "0F3"))
    'pp rank 1 step 7 (0F3)'
"""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineError", "Where"]


class PipelineError(ValueError):
    """A pipeline program that cannot run: mismatched schedule, stages, mesh or batch."""


class Where:
    """``pp rank R step K (action)``, the place an error names; formatted only when one is raised."""

    __slots__ = ("rank", "step", "action")

    def __init__(self, rank: int, step: int, action: Any):
        self.rank, self.step, self.action = rank, step, action

    def __str__(self) -> str:
        return f"pp rank {self.rank} step {self.step} ({self.action})"
