"""Errors raised by ``hpfunc.optim``; each names the pytree path it is about."""

from __future__ import annotations

__all__ = ["OptimError", "TreeMismatchError", "UnknownLabelError", "UnsupportedLeafError"]


class OptimError(ValueError):
    """Base class of the errors raised by ``hpfunc.optim``."""


class TreeMismatchError(OptimError):
    """Two trees that must line up leaf for leaf (updates, state, params, masks) do not."""


class UnknownLabelError(OptimError, KeyError):
    """``partition`` met a label that has no transformation."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedLeafError(OptimError):
    """A transformation was given a leaf it cannot handle (wrong ndim, sharded layout, ...)."""
