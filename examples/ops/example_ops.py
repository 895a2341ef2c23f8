"""Two custom ops for examples/ops/registry.yaml: a fused linear + SiLU (a rule suffices; it keeps the
input features whole, as SiLU of a partial sum is not the SiLU of the sum) and a row-wise softmax whose
rows may be split over ranks (an ``impl`` completes the max and the sum across them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpfunc import lax


@torch.library.custom_op("hpfunc_example::linear_silu", mutates_args=())
def linear_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(x @ w.T)`` for ``x [..., in]``, ``w [out, in]``."""
    return F.silu(F.linear(x, w))


@linear_silu.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _linear_silu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_silu_backward(ctx, g):
    x, w = ctx.saved_tensors
    pre = F.linear(x, w)  # recomputed: only the inputs are kept
    s = torch.sigmoid(pre)
    gpre = g * s * (1 + pre * (1 - s))
    return gpre @ w, gpre.reshape(-1, gpre.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


linear_silu.register_autograd(_linear_silu_backward, setup_context=_linear_silu_setup)


@torch.library.custom_op("hpfunc_example::row_softmax", mutates_args=())
def row_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


@row_softmax.register_fake
def _(x):
    return torch.empty_like(x)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, g):
    (y,) = ctx.saved_tensors
    return y * (g - (g * y).sum(-1, keepdim=True))


row_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def row_softmax_blocks(x: torch.Tensor, *, axes: dict) -> torch.Tensor:
    """This rank's block of the softmax, its rows split over ``axes['j']`` (``()``: whole)."""
    j = axes["j"]
    m = x.amax(-1, keepdim=True)
    m = lax.pmax(m, j) if j else m
    e = torch.exp(x - m)
    s = e.sum(-1, keepdim=True)
    return e / (lax.psum(s, j) if j else s)
