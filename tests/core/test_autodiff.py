"""value_and_grad over pytrees against torch autograd on full tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hpfunc
from hpfunc.testing import assert_trees_close


def model(params, x):
    h = torch.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
    h = h @ params["layers"][1]["w"]
    return (h**2).mean() + params["scale"] * h.sum()


@given(
    d_in=st.integers(1, 5), d_h=st.integers(1, 5), d_out=st.integers(1, 4), batch=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_value_and_grad_matches_autograd(d_in, d_h, d_out, batch, seed):
    g = torch.Generator().manual_seed(seed)
    params = {
        "layers": [{"w": torch.randn(d_in, d_h, generator=g), "b": torch.randn(d_h, generator=g)},
                   {"w": torch.randn(d_h, d_out, generator=g)}],
        "scale": torch.randn((), generator=g),
    }
    x = torch.randn(batch, d_in, generator=g)
    before = {k: v for k, v in hpfunc.tree.leaves_with_paths(params)}
    value, grads = hpfunc.value_and_grad(model)(params, x)
    leaves = [p.clone().requires_grad_(True) for _, p in hpfunc.tree.leaves_with_paths(params)]
    ref_params = hpfunc.tree.unflatten(hpfunc.tree.structure(params), leaves)
    ref = model(ref_params, x)
    ref_grads = torch.autograd.grad(ref, leaves)
    assert_trees_close(value, ref.detach(), rtol=0, atol=0)
    assert_trees_close(grads, hpfunc.tree.unflatten(hpfunc.tree.structure(params), ref_grads), rtol=0, atol=0)
    for p, v in hpfunc.tree.leaves_with_paths(params):
        assert v is before[p] and not v.requires_grad, "inputs must not be modified"


def test_argnums_has_aux_and_grad():
    def f(a, b, c):
        return (a * b).sum() + c, {"prod": a * b}

    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    (v, aux), (ga, gb) = hpfunc.value_and_grad(f, argnums=(0, 1), has_aux=True)(a, b, 1.0)
    assert float(v) == 12.0 and torch.equal(aux["prod"], a * b) and not aux["prod"].requires_grad
    assert torch.equal(ga, b) and torch.equal(gb, a)
    g, aux2 = hpfunc.grad(f, argnums=0, has_aux=True)(a, b, 0.0)
    assert torch.equal(g, b)
    # an unused leaf gets a zero gradient
    gz = hpfunc.grad(lambda p: p["used"].sum())({"used": torch.ones(2), "unused": torch.ones(3)})
    assert torch.equal(gz["unused"], torch.zeros(3))


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"leaf 'step' has dtype torch.int64"):
        hpfunc.value_and_grad(lambda p: p["w"].sum())({"w": torch.ones(2), "step": torch.tensor(3)})
    with pytest.raises(TypeError, match="scalar"):
        hpfunc.value_and_grad(lambda w: w * 2)(torch.ones(2))
    with pytest.raises(TypeError, match=r"\(value, aux\)"):
        hpfunc.value_and_grad(lambda w: w.sum(), has_aux=True)(torch.ones(2))
    with pytest.raises(ValueError, match="argnums 2"):
        hpfunc.value_and_grad(lambda w: w.sum(), argnums=2)(torch.ones(2))
