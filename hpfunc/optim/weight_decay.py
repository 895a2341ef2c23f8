"""Decoupled weight decay: ``updates + weight_decay * params``."""

from __future__ import annotations

from typing import Any

import torch

from hpfunc.optim import _ops, _tree
from hpfunc.optim.base import EmptyState, GradientTransformation, Params, Updates
from hpfunc.optim.errors import OptimError

__all__ = ["add_decayed_weights"]


def add_decayed_weights(weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (decoupled weight decay, Loshchilov & Hutter).

    Placed before ``scale_by_learning_rate(lr)`` in a chain it gives the torch ``AdamW`` step
    ``param <- param - lr * weight_decay * param - lr * direction``.

    Args:
      weight_decay: the decay coefficient.
      mask: optional; which leaves to decay: a tree of bools shaped like the params (or a prefix of
        it), or a callable ``(path, leaf) -> bool``, or a callable ``params -> tree of bools``.
        Leaves outside the mask pass through unchanged. See :func:`hpfunc.optim.masked`.

    Example:
        >>> import torch
        >>> tx = add_decayed_weights(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> tx.update({"w": torch.zeros(2)}, tx.init(params), params)[0]
        {'w': tensor([0.1000, 0.1000])}
    """
    weight_decay = float(weight_decay)
    if mask is not None:
        from hpfunc.optim.combine import masked  # combine builds on this module's siblings

        return masked(add_decayed_weights(weight_decay), mask)

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    @torch.no_grad()
    def update(updates: Updates, state: EmptyState, params: Params | None = None):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise OptimError(
                "add_decayed_weights: update() needs the params to decay; "
                "call tx.update(grads, state, params)"
            )
        (u_leaves, p_leaves), spec = _tree.flatten_aligned(
            [updates, params], ["updates", "params"], "add_decayed_weights"
        )
        return _tree.unflatten(spec, _ops.add(u_leaves, p_leaves, alpha=weight_decay)), state

    return GradientTransformation(init, update)
