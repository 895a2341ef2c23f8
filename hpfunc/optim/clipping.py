"""Gradient clipping by the global norm of the whole update tree."""

from __future__ import annotations

import torch

from hpfunc import layout
from hpfunc.optim import _ops, _tree
from hpfunc.optim.base import EmptyState, GradientTransformation, Params, Updates

__all__ = ["global_norm", "clip_by_global_norm"]


def _local(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the global value of a (scalar) DTensor; plain tensors pass through."""
    full_tensor = getattr(x, "full_tensor", None)
    return full_tensor() if full_tensor is not None else x


@torch.no_grad()
def global_norm(updates: Updates) -> torch.Tensor:
    """The L2 norm of all leaves of ``updates`` taken together, as an fp32 (or fp64) scalar tensor.

    Each leaf's norm is computed in at least fp32. For a DTensor leaf ``torch.linalg.vector_norm``
    reduces across the mesh, so the result is the norm of the global tensor whatever its sharding;
    the returned value is always a plain tensor (identical on every rank). Inside a step run by
    :func:`hpfunc.parallelize` the leaves are this rank's blocks and the norm is that of the global
    tensors (``updates`` must be shaped like the parameters).

    Args:
      updates: a pytree of tensors (plain or DTensor).

    Returns:
      A 0-d tensor; ``0.`` for a tree without leaves.

    Example:
        >>> import torch
        >>> global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]})
        tensor(5.)
    """
    leaves = _tree.flatten(updates)[0]
    sq = layout.global_sq_norm(updates, "global_norm", leaves=leaves)
    if sq is not None:  # inside hpfunc.parallelize: the leaves are blocks of sharded tensors
        return sq.sqrt().to(torch.promote_types(leaves[0].dtype, torch.float32) if leaves else torch.float32)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = [
        _local(torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32)))
        for x in leaves
    ]
    device = norms[0].device
    dtype = max((n.dtype for n in norms), key=lambda d: torch.finfo(d).bits)
    return torch.linalg.vector_norm(torch.stack([n.to(device=device, dtype=dtype) for n in norms]))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (global_norm + 1e-6))``.

    The formula, including the ``1e-6``, is that of ``torch.nn.utils.clip_grad_norm_``, so the
    two agree to rounding. Updates keep their dtype; the scale is applied even when it is 1 (no
    data-dependent branch, hence no host synchronisation).

    ``optax.clip_by_global_norm`` (same name and argument) differs: it leaves the updates untouched
    when ``norm < max_norm`` and otherwise multiplies by ``max_norm / norm``, without the ``1e-6``.
    Above the threshold the two differ by the factor ``norm / (norm + 1e-6)``; at or barely below
    it (``norm`` in ``(max_norm - 1e-6, max_norm)``) hpfunc scales by slightly less than 1.

    Args:
      max_norm: the largest global L2 norm let through.

    Example:
        >>> import torch
        >>> tx = clip_by_global_norm(1.0)
        >>> u, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(None))
        >>> torch.allclose(u["w"], torch.tensor([0.6, 0.8]))
        True
    """
    max_norm = float(max_norm)
    if not max_norm > 0.0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    @torch.no_grad()
    def update(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        leaves, spec = _tree.flatten(updates)
        if not leaves:
            return updates, state
        coef = torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0)
        return _tree.unflatten(spec, _ops.mul_tensor(leaves, coef)), state

    return GradientTransformation(init, update)
