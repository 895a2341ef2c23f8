"""The B/W split costs what the fused backward costs (FLOPs by torch's flop counter) and gives the same
gradients: on a 4-layer MLP, on Qwen3 stages (dense and MoE), and through pipeline_map on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import _pipeline_qwen3 as Q
import hpfunc
from hpfunc import random as R
from hpfunc import tree as T
from hpfunc.models import qwen3
from hpfunc.schedules import GENERATORS, merge_backward
from hpfunc.transforms.backward_split import backward_input, backward_weight
from hpfunc.transforms.pipeline import pipeline_map

TOL = 0.05   # B + W within 5% of the fused backward


def flops(fn):
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return counter.get_total_flops(), out


def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def compare(outs, gouts, inputs, params):
    """(fused, B, W, W asked of the outputs) FLOPs; asserts split grads == fused grads bitwise."""
    fused, ref = flops(lambda: torch.autograd.grad(outs, inputs + params, gouts, retain_graph=True, allow_unused=True))
    # The W of before: the parameters' gradients asked of the outputs again (re-traverses the dx chain).
    naive_w, _ = flops(lambda: torch.autograd.grad(outs, params, gouts, retain_graph=True, allow_unused=True))
    b, (dx, state) = flops(lambda: backward_input(outs, gouts, inputs, params))
    w, dw = flops(lambda: backward_weight(state))
    assert state.entangled == 0
    assert all(same(g, r) for g, r in zip(list(dx) + list(dw), ref))
    return fused, b, w, naive_w


def test_mlp_flops_and_grads():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(32, 32, generator=g).requires_grad_() for _ in range(4)]
    x = torch.randn(8, 32, generator=g).requires_grad_()
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    fused, b, w, naive_w = compare([h], [torch.randn(h.shape, generator=g)], [x], ws)
    mm = 2 * 8 * 32 * 32
    assert fused == 8 * mm                      # dx and dw of 4 layers
    assert abs((b + w) - fused) <= TOL * fused  # measured: equal (4 + 4 matmuls)
    assert b + naive_w == 11 * mm               # before: W recomputed 3 of the dx matmuls


@pytest.mark.parametrize("model", ["qwen3-dense-tiny", "qwen3-moe-tiny"])
def test_qwen3_stage_flops_and_grads(model):
    counts = (1, 2, 1)
    cfg = qwen3.preset(model, num_hidden_layers=sum(counts))
    stage_params = Q.split_params(qwen3.init(R.key(0), cfg), cfg, counts)
    fns = Q.stage_fns(cfg, counts)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = fns[0](stage_params[0], {"tokens": tokens})
    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in ((h,) if isinstance(h, torch.Tensor) else h)]
    leaves, spec = T.flatten(stage_params[1])
    leaves = [p.detach().requires_grad_() for p in leaves]
    y = fns[1](T.unflatten(spec, leaves), xs[0] if len(xs) == 1 else tuple(xs))
    outs = [t for t in ((y,) if isinstance(y, torch.Tensor) else y) if t.requires_grad]
    gen = torch.Generator().manual_seed(2)
    gouts = [torch.randn(t.shape, generator=gen) for t in outs]
    fused, b, w, naive_w = compare(outs, gouts, [x for x in xs if x.requires_grad], leaves)
    assert abs((b + w) - fused) <= TOL * fused, (fused, b, w)
    assert b + naive_w >= 1.4 * fused           # before: +50% on these stages


def test_parameter_used_twice_in_a_chain():
    # (x @ w) @ w: the later use site reaches the earlier one through the input side; W takes w's
    # gradient from the outputs (counted in state.entangled) and is still right.
    g = torch.Generator().manual_seed(0)
    w, v = torch.randn(4, 4, generator=g).requires_grad_(), torch.randn(4, 4, generator=g).requires_grad_()
    x = torch.randn(3, 4, generator=g).requires_grad_()
    y = torch.tanh((x @ w) @ w) @ v
    gy = torch.randn(y.shape, generator=g)
    ref = torch.autograd.grad(y, [x, w, v], gy, retain_graph=True)
    (dx,), state = backward_input([y], [gy], [x], [w, v])
    dw, dv = backward_weight(state)
    assert state.entangled == 1
    for got, want in zip((dx, dw, dv), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_outputs_without_the_input_and_unused_params():
    # A second output that depends on a parameter only, a parameter nobody uses, and stage 0 (no input).
    g = torch.Generator().manual_seed(0)
    w, u, unused = (torch.randn(4, 4, generator=g).requires_grad_() for _ in range(3))
    x = torch.randn(3, 4, generator=g).requires_grad_()
    y1, y2 = torch.tanh(x @ w) * u.sum(), (w * u).sum()
    gs = [torch.randn(y1.shape, generator=g), torch.tensor(0.7)]
    ref = torch.autograd.grad([y1, y2], [x, w, u], gs, retain_graph=True)
    (dx,), state = backward_input([y1, y2], gs, [x], [w, u, unused])
    dw, du, dn = backward_weight(state)
    assert dn is None
    for got, want in zip((dx, dw, du), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dxs, state = backward_input([y2], [None], [], [w, u])
    assert dxs == [] and all(same(a, b) for a, b in zip(backward_weight(state), torch.autograd.grad(y2, [w, u])))


def mlp_stage(p, x):
    for w in p["ws"]:
        x = torch.tanh(x @ w)
    return x


def run_counted(schedule):
    """Rank function: FLOPs of one step (F, B, W on this rank) and its (loss, grads); 2-layer MLP stages."""
    g = torch.Generator().manual_seed(0)
    params = [{"ws": [torch.randn(16, 16, generator=g) / 4 for _ in range(2)]} for _ in range(schedule.num_stages)]
    batch = {"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 16, generator=g)}
    step = pipeline_map([mlp_stage] * schedule.num_stages, schedule, hpfunc.Mesh({"pp": 2}),
                        loss_fn=lambda y, mb: ((y - mb["y"]) ** 2).mean(), first_input=lambda mb: mb["x"])
    return flops(lambda: step({s: params[s] for s in step.local_stages}, batch))


@pytest.mark.multirank
def test_pipeline_split_equals_fused(pool2):
    """zbv with its B/W split vs the same order with each B and W fused: the same FLOPs per rank (within
    5%; measured equal) and bitwise the same loss and gradients."""
    split = GENERATORS["zbv"](2, 4)
    fused = merge_backward(split)
    a, b = pool2.run(run_counted, split), pool2.run(run_counted, fused)
    for r in range(2):
        (n_split, (loss_s, g_s)), (n_fused, (loss_f, g_f)) = a[r], b[r]
        assert abs(n_split - n_fused) <= TOL * n_fused, (r, n_split, n_fused)
        assert torch.equal(loss_s, loss_f)
        assert sorted(g_s) == sorted(g_f)
        for s in g_s:
            for (path, x), (_, y) in zip(T.leaves_with_paths(g_s[s]), T.leaves_with_paths(g_f[s])):
                assert torch.equal(x, y), (r, s, path)
