"""Dense building blocks as pure functions on plain tensors: RMSNorm, linear, SwiGLU MLP.

Linear weights use the Hugging Face / ``torch.nn.Linear`` orientation ``[out, in]`` (``y = x @ w.T``),
so "column parallel" means sharding dim 0 of a weight and "row parallel" dim 1. Sizes come from the
weight shapes, never from a config, so a tensor-parallel transform can hand these functions local shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32 as in the Qwen3 reference.

    ``weight * (x / sqrt(mean(x^2) + eps))``; the normalised value is cast back to ``x.dtype`` before the
    scale is applied (the reference's order, which matters in bf16).

    >>> x = torch.randn(2, 8)
    >>> rms_norm(x, torch.ones(8), 1e-6).shape
    torch.Size([2, 8])
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with ``weight`` stored ``[out, in]``.

    >>> linear(torch.ones(3, 4), torch.ones(5, 4)).shape
    torch.Size([3, 5])
    """
    return F.linear(x, weight, bias)


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward ``w_down(silu(w_gate x) * w_up x)``; weights ``[I, H]``, ``[I, H]``, ``[H, I]``.

    Under tensor parallelism ``w_gate``/``w_up`` are column shards (dim 0) and ``w_down`` a row shard
    (dim 1); the output is then a partial sum to be reduced by the caller.

    >>> h, i = 8, 16
    >>> swiglu_mlp(torch.randn(2, h), torch.randn(i, h), torch.randn(i, h), torch.randn(h, i)).shape
    torch.Size([2, 8])
    """
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
