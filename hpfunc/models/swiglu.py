"""The SwiGLU product ``silu(gate) * up (* scale)`` as one autograd function that keeps only its inputs.

Written with plain ops, autograd keeps ``gate``, ``up``, ``silu(gate)`` (for the product's gradient) and,
with a per-row ``scale``, the unscaled product too (for the scale's gradient): four ``[N, I]`` tensors
where the backward needs two. :func:`swiglu` keeps ``gate``, ``up`` and ``scale`` and recomputes the
sigmoid in the backward (elementwise, the cost of one more pass over ``[N, I]``); the down projection
then keeps the scaled product, its own input. The MoE experts (:func:`hpfunc.models.moe.expert_ffn`)
use it: their hidden rows are the largest activations of an MoE layer.

    >>> gate, up = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    >>> scale = torch.rand(3, 1, requires_grad=True)
    >>> h = swiglu(gate, up, scale)
    >>> bool(torch.equal(h, torch.nn.functional.silu(gate) * up * scale))
    True
    >>> g = torch.autograd.grad(h.sum(), (gate, up, scale))
    >>> ref = torch.autograd.grad((torch.nn.functional.silu(gate) * up * scale).sum(), (gate, up, scale))
    >>> all(torch.allclose(a, b) for a, b in zip(g, ref))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["swiglu"]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        h = F.silu(gate) * up  # the same ops, in the same order, as the unfused forward: equal bits
        return h if scale is None else h * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        gate, up, scale = inputs
        ctx.has_scale = scale is not None
        ctx.save_for_backward(gate, up, *(() if scale is None else (scale,)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, *rest = ctx.saved_tensors
        scale = rest[0] if rest else None
        s = torch.sigmoid(gate)
        silu = gate * s
        d_scale = None
        if scale is not None:
            if ctx.needs_input_grad[2]:  # summed over the dimensions the scale was broadcast along
                d_scale = grad * silu * up
                dims = [i for i in range(d_scale.dim()) if scale.shape[i] == 1 and d_scale.shape[i] != 1]
                d_scale = d_scale.sum(dims, keepdim=True) if dims else d_scale
            grad = grad * scale
        d_up = grad * silu if ctx.needs_input_grad[1] else None
        d_gate = grad * up * (s * (1 + gate * (1 - s))) if ctx.needs_input_grad[0] else None
        return d_gate, d_up, d_scale


def swiglu(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, times ``scale`` (broadcast, e.g. ``[N, 1]`` per-row weights) when given; the
    backward keeps ``gate``, ``up`` and ``scale`` only (see the module docstring). ``scale`` must have
    the dimensions of ``gate``.

    >>> swiglu(torch.zeros(2, 3), torch.ones(2, 3)).tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    if scale is not None and scale.dim() != gate.dim():
        raise ValueError(f"swiglu: scale must have the {gate.dim()} dimensions of gate {tuple(gate.shape)} "
                         f"(size 1 where it broadcasts), found shape {tuple(scale.shape)}")
    return _SwiGLU.apply(gate, up, scale)
