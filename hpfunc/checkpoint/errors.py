"""The errors of :mod:`hpfunc.checkpoint`: each says what was expected, what was found, where, and the fix.

>>> issubclass(CorruptCheckpointError, CheckpointError) and issubclass(CheckpointError, ValueError)
True
"""

from __future__ import annotations

__all__ = ["CheckpointError", "IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError",
           "listed"]


def listed(names: list[str], limit: int = 8) -> str:
    """The first ``limit`` names, quoted, for an error message, and how many more there are.

    >>> listed(["a", "b", "c"], limit=2)
    "'a', 'b', ... (1 more)"
    """
    shown = ", ".join(repr(k) for k in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked."""


class IncompleteCheckpointError(CheckpointError):
    """The folder holds no completion marker: its save never finished (the process was killed, a rank
    failed) or it is not a checkpoint at all."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, has another size, or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the target: keys missing or unexpected, or a shape, dtype or kind differs."""
