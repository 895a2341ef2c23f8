"""Rank-side helpers for tests/ops: three custom ops (a matmul, a row-wise softmax, a row reduction) with
their autograd formulas, their rules, and the property check: each op on DTensors laid out on a mesh
equals the op on one device, in values and gradients.

The ops are defined once per process (torch.library refuses a second definition); rules are registered
once per rank process (torch's registry is the registry; a test names its op, never re-registers it with
another rule, so DTensor's propagation caches never hold a stale rule).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hpfunc
from hpfunc import lax
from hpfunc.ops import register


def _mm_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _define_matmul(name: str):
    op = torch.library.custom_op(f"hpfunc_test::{name}", mutates_args=())(_mm_kernel)

    @op.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return op(g, w.t()), op(x.t(), g)

    op.register_autograd(backward, setup_context=setup)
    return op


matmul = _define_matmul("matmul")
matmul_unmarked = _define_matmul("matmul_unmarked")  # the same op under a wrong rule (k not marked)


@torch.library.custom_op("hpfunc_test::row_softmax", mutates_args=())
def row_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


@row_softmax.register_fake
def _(x):
    return torch.empty_like(x)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, g):
    (y,) = ctx.saved_tensors
    return y * (g - (g * y).sum(-1, keepdim=True))  # torch ops: DTensor reduces a sharded last dim itself


row_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def row_softmax_impl(x: torch.Tensor, *, axes: dict) -> torch.Tensor:
    """The softmax of this rank's block when the row may be split over ``axes['j']``: the max and the
    sum of exponentials completed across the row's ranks."""
    j = axes["j"]
    m = x.amax(-1, keepdim=True)
    if j:
        m = lax.pmax(m, j)
    e = torch.exp(x - m)
    s = e.sum(-1, keepdim=True)
    if j:
        s = lax.psum(s, j)
    return e / s


@torch.library.custom_op("hpfunc_test::row_sumsq", mutates_args=())
def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1)


@row_sumsq.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


def _sumsq_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sumsq_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return 2 * x * g.unsqueeze(-1)


row_sumsq.register_autograd(_sumsq_backward, setup_context=_sumsq_setup)

RULES = {
    "matmul": (matmul, "i k, k n -> i n | sum k", None),
    "matmul_unmarked": (matmul_unmarked, "i k, k n -> i n", None),
    "row_softmax": (row_softmax, "... j -> ... j", row_softmax_impl),
    "row_sumsq": (row_sumsq, "... j -> ... | sum j", None),
}


def ensure_registered(name: str) -> None:
    op, rule, impl = RULES[name]
    if not getattr(op, "_hpfunc_test_registered", False):
        register(op, rule, impl)
        op._hpfunc_test_registered = True


def _placements(layout, ndim):
    return [Replicate() if d is None else Shard(d) for d in layout]


def closeness(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5) -> float:
    """max |a - b| / (atol + rtol |b|): at most 1 when ``torch.allclose(a, b, rtol, atol)``."""
    return float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0


def op_parity(name: str, mesh_shape: dict, shapes: list, layouts: list, seed: int) -> tuple[float, str]:
    """How far the op on DTensors (inputs laid out per mesh axis by ``layouts[k][m]``: a tensor
    dimension or None) is from the op on one device, over the output and every input gradient (the
    loss: the output against fixed weights), as :func:`closeness` (<= 1: equal at fp32 1e-5), and the
    output's placements (the layout the rule gave it)."""
    ensure_registered(name)
    op = RULES[name][0]
    mesh = hpfunc.Mesh(mesh_shape)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g, dtype=torch.float64).float() for s in shapes]
    ref_in = [x.clone().requires_grad_() for x in xs]
    ref = op(*ref_in)
    c = torch.randn(ref.shape, generator=g, dtype=torch.float64).float()
    (ref * c).sum().backward()
    dts = [distribute_tensor(x, mesh.device_mesh, _placements(lay, x.ndim)).requires_grad_()
           for x, lay in zip(xs, layouts)]
    out = op(*dts)
    full = out.full_tensor()
    (full * c).sum().backward()
    pairs = [(full, ref)] + [(d.grad.full_tensor(), r.grad) for d, r in zip(dts, ref_in)]
    return max(closeness(a.detach(), b.detach()) for a, b in pairs), str(tuple(out.placements))
