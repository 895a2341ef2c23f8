"""The errors of :mod:`hpfunc.checkpoint`: each says what was expected, what was found, where, and the fix.

>>> issubclass(CorruptCheckpointError, CheckpointError) and issubclass(CheckpointError, ValueError)
True
"""

from __future__ import annotations

__all__ = ["CheckpointError", "IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked."""


class IncompleteCheckpointError(CheckpointError):
    """The folder holds no completion marker: its save never finished (the process was killed, a rank
    failed) or it is not a checkpoint at all."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, has another size, or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the target: keys missing or unexpected, or a shape, dtype or kind differs."""
