"""Mixed-precision use of parameters: cast to the compute dtype before the FSDP all-gather, reduce the
gradient in the reduce dtype, hand it back in the storage dtype (FSDP2's ``MixedPrecisionPolicy``).

``all_gather(x, steps, mp)`` runs the all-gathers ``steps = ((dim, axes, tiled), ...)`` of a storage
block; with ``mp = (param_dtype, reduce_dtype)`` the gather moves ``param_dtype`` bytes and its
transpose reduce-scatters in ``reduce_dtype``. :func:`cast_for_use` is the same policy for a parameter
that is not gathered (replicated or tensor-parallel): cast per use, the gradient comes back in the
storage dtype through the cast's own backward.

    >>> import torch
    >>> cast_for_use(torch.ones(2), (torch.bfloat16, torch.float32)).dtype
    torch.bfloat16
    >>> cast_for_use(torch.ones(2), None).dtype
    torch.float32
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import forward_context, lax

__all__ = ["MixedGather", "all_gather", "cast_for_use", "axis_arg"]

def axis_arg(axes: tuple[str, ...]) -> Any:
    """One axis name as itself, several as a tuple (the form :mod:`hpfunc.lax` takes)."""
    return axes if len(axes) > 1 else axes[0]


class MixedGather(torch.autograd.Function):
    """All-gather in the compute dtype; the transpose reduce-scatters in the reduce dtype and returns
    the gradient in the storage dtype (the gather moves bf16, the reduction sums fp32)."""

    @staticmethod
    def forward(x: torch.Tensor, steps: tuple, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.Tensor:
        y = x.to(param_dtype)
        for d, axes, tiled in steps:
            y = lax.all_gather(y, axis_arg(axes), axis=d, tiled=tiled)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, steps, _, reduce_dtype = inputs
        ctx.steps, ctx.reduce_dtype, ctx.dtype = steps, reduce_dtype, x.dtype
        ctx.forward = forward_context.capture()  # the mesh, for a backward on CUDA's autograd thread

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return forward_context.run(ctx.forward, MixedGather._transpose, ctx, g)

    @staticmethod
    def _transpose(ctx: Any, g: torch.Tensor) -> tuple:
        g = g.to(ctx.reduce_dtype)
        for d, axes, tiled in reversed(ctx.steps):
            g = lax.psum_scatter(g, axis_arg(axes), scatter_dimension=d, tiled=tiled)
        return g.to(ctx.dtype), None, None, None


def all_gather(x: torch.Tensor, steps: tuple, mp: tuple | None) -> torch.Tensor:
    """``steps = ((dim, axes, tiled), ...)`` all-gathers of ``x``; ``mp = (param_dtype, reduce_dtype)``
    or ``None`` (gathered as stored; the transpose reduce-scatters in the gradient's dtype)."""
    if mp is not None and x.is_floating_point():
        return MixedGather.apply(x, steps, mp[0], mp[1])
    for d, axes, tiled in steps:
        x = lax.all_gather(x, axis_arg(axes), axis=d, tiled=tiled)
    return x


def cast_for_use(w: torch.Tensor, mp: tuple | None) -> torch.Tensor:
    """A parameter used as stored, in the compute dtype of ``mp`` (floating parameters only)."""
    return w.to(mp[0]) if mp is not None and w.is_floating_point() else w
