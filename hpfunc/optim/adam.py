"""Adam's update direction: bias-corrected first and second moments."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hpfunc.optim import _ops, _tree
from hpfunc.optim._dtypes import zeros_state
from hpfunc.optim.base import GradientTransformation, OptState, Params, Updates, new_count

__all__ = ["ScaleByAdamState", "scale_by_adam"]


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
      count: number of updates done, an int64 scalar tensor (on the CPU as made by ``init``).
      mu: first moments, a tree shaped like the params, fp32 (fp64 for fp64 params).
      nu: second moments, same shape and dtype as ``mu``.
    """

    count: torch.Tensor
    mu: Updates
    nu: Updates


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moment estimates (Kingma & Ba, 2015).

    With ``g`` the incoming update and ``t`` the 1-based step::

        m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
        out = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t) + eps_root) + eps)

    The arithmetic follows ``torch.optim.Adam`` (``m`` by ``lerp``, ``sqrt(v) / sqrt(1 - b2^t)``
    when ``eps_root`` is 0), so ``chain(scale_by_adam(), scale_by_learning_rate(lr))`` tracks torch's
    Adam to rounding. Moments are kept in fp32 even for bf16 gradients; the returned updates are
    fp32 too (``apply_updates`` casts to each param's dtype).

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root (keeps the output differentiable at ``v = 0``).

    Returns:
      A :class:`GradientTransformation` with state :class:`ScaleByAdamState`.

    Example:
        >>> import torch
        >>> tx = scale_by_adam()
        >>> params = {"w": torch.zeros(3)}
        >>> u, state = tx.update({"w": torch.tensor([1.0, -2.0, 0.0])}, tx.init(params))
        >>> torch.allclose(u["w"], torch.tensor([1.0, -1.0, 0.0]))  # first step: g / (|g| + eps)
        True
    """
    b1, b2, eps, eps_root = float(b1), float(b2), float(eps), float(eps_root)
    for name, b in (("b1", b1), ("b2", b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"scale_by_adam: {name} must be in [0, 1), got {b}")

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=new_count(),
            mu=zeros_state(params, "scale_by_adam.init"),
            nu=zeros_state(params, "scale_by_adam.init"),
        )

    @torch.no_grad()
    def update(updates: Updates, state: OptState, params: Params | None = None):
        del params
        (g_leaves, m_leaves, v_leaves), spec = _tree.flatten_aligned(
            [updates, state.mu, state.nu], ["updates", "state.mu", "state.nu"], "scale_by_adam"
        )
        count = state.count + 1
        bc1, bc2 = _ops.bias_corrections(count, b1, b2)  # no host read of a count that lives on a device
        _tree.check_shapes(g_leaves, m_leaves, updates, "updates", "state.mu", "scale_by_adam")
        mu, nu = _ops.adam_moments(m_leaves, v_leaves, _ops.cast(g_leaves, m_leaves), b1, b2)
        out = _ops.adam_direction(mu, nu, bias_correction1=bc1, bias_correction2=bc2, eps=eps, eps_root=eps_root)
        new_state = ScaleByAdamState(
            count=count, mu=_tree.unflatten(spec, mu), nu=_tree.unflatten(spec, nu)
        )
        return _tree.unflatten(spec, out), new_state

    return GradientTransformation(init, update)
