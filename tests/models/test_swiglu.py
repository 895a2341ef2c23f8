"""``hpfunc.models.swiglu``: the fused SwiGLU's gradients against autograd of the plain ops (gradcheck in
float64), with and without a per-row scale broadcast over one or two dimensions, and what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpfunc.memory import saved_activations
from hpfunc.models.swiglu import swiglu


@pytest.mark.parametrize("scale_shape", [None, (5, 1), (2, 5, 1)])
def test_swiglu_gradients_equal_autograd_of_the_plain_ops(scale_shape):
    shape = (5, 3) if scale_shape is None or len(scale_shape) == 2 else (2, 5, 3)
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    args = (gate, up)
    if scale_shape is not None:
        args += (torch.rand(scale_shape, generator=g, dtype=torch.float64, requires_grad=True),)
    assert torch.autograd.gradcheck(lambda *a: swiglu(*a), args)
    plain = F.silu(gate) * up * (args[2] if len(args) == 3 else 1.0)
    assert torch.equal(swiglu(*args), plain)  # the forward is the same ops in the same order
    cot = torch.randn(shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((swiglu(*args) * cot).sum(), args)
    want = torch.autograd.grad((plain * cot).sum(), args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_swiglu_keeps_its_inputs_only():
    gate, up, scale = torch.randn(64, 32), torch.randn(64, 32), torch.rand(64, 1)
    fused = saved_activations(lambda g, u, s: swiglu(g, u, s).sum(), gate, up, scale)
    plain = saved_activations(lambda g, u, s: (F.silu(g) * u * s).sum(), gate, up, scale)
    assert fused.device_bytes == 4 * (2 * 64 * 32 + 64)  # gate, up, scale
    assert plain.device_bytes == fused.device_bytes + 2 * 4 * 64 * 32  # + silu(gate) and the unscaled product


def test_swiglu_scale_must_match_the_dimensions():
    with pytest.raises(ValueError, match=r"scale must have the 2 dimensions of gate \(4, 3\).*found shape \(4,\)"):
        swiglu(torch.ones(4, 3), torch.ones(4, 3), torch.ones(4))
