"""MoE building blocks: grouped experts vs a per-token reference, router + expert bias, aux loss vs the
transformers function, and the bias update rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfunc
from hpfunc.models import qwen3
from hpfunc.models.moe import (expert_counts, grouped_experts, is_expert_bias, load_balancing_loss, moe_block,
                               route_topk, update_expert_bias)


def _per_token_reference(x, indices, weights, w_gate, w_up, w_down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            h = torch.nn.functional.silu(w_gate[e] @ x[t]) * (w_up[e] @ x[t])
            out[t] = out[t] + weights[t, j] * (w_down[e] @ h)
    return out


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 12), E=st.integers(1, 6), k=st.integers(1, 3), impl=st.sampled_from(["bmm", "grouped_mm"]),
       seed=st.integers(0, 1000))
def test_grouped_experts_match_per_token_loop(T: int, E: int, k: int, impl: str, seed: int) -> None:
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    H, I = 8, 4
    x = torch.randn(T, H, generator=g, requires_grad=True)
    ws = [torch.randn(E, I, H, generator=g, requires_grad=True), torch.randn(E, I, H, generator=g, requires_grad=True),
          torch.randn(E, H, I, generator=g, requires_grad=True)]
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # distinct per token
    weights = torch.rand(T, k, generator=g, requires_grad=True)
    y = grouped_experts(x, indices, weights, *ws, impl=impl)
    ref = _per_token_reference(x, indices, weights, *ws)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn(T, H, generator=g)
    got = torch.autograd.grad((y * cot).sum(), [x, weights, *ws])
    want = torch.autograd.grad((ref * cot).sum(), [x, weights, *ws])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_expert_bias_changes_selection_not_combine_weights() -> None:
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(16, 8, generator=g), torch.randn(6, 8, generator=g)
    plain = route_topk(x, router, top_k=2, norm_topk_prob=False)
    bias = torch.zeros(6)
    bias[5] = 10.0  # forces expert 5 into every token's top-2
    biased = route_topk(x, router, top_k=2, norm_topk_prob=False, expert_bias=bias)
    assert (biased.indices == 5).any(-1).all()
    assert not torch.equal(biased.indices, plain.indices)
    # Combine weights are the unbiased probabilities of whatever was selected.
    torch.testing.assert_close(biased.weights, plain.probs.gather(-1, biased.indices))
    torch.testing.assert_close(biased.probs, plain.probs)
    normed = route_topk(x, router, top_k=2, norm_topk_prob=True, expert_bias=bias)
    p = plain.probs.gather(-1, normed.indices)
    torch.testing.assert_close(normed.weights, p / p.sum(-1, keepdim=True))


def test_expert_bias_gets_no_gradient_and_is_tagged() -> None:
    cfg = qwen3.preset("qwen3-moe-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    params["layers"][0]["moe"]["expert_bias"] = torch.linspace(-1, 1, cfg.num_experts)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 8))}
    (_, aux), grads = hpfunc.value_and_grad(qwen3.loss, has_aux=True)(params, batch, cfg)
    tagged = [p for p, _ in hpfunc.tree.leaves_with_paths(params) if is_expert_bias(p)]
    assert tagged == [f"layers.{i}.moe.expert_bias" for i in cfg.moe_layers]
    for path, g in hpfunc.tree.leaves_with_paths(grads):
        if is_expert_bias(path):
            assert torch.count_nonzero(g) == 0, path
    params = hpfunc.tree.tree_map(lambda t: t.detach().requires_grad_(), params)
    bias = params["layers"][0]["moe"]["expert_bias"]
    assert torch.autograd.grad(qwen3.loss(params, batch, cfg)[0], bias, allow_unused=True)[0] is None
    assert aux["expert_load"].shape == (len(cfg.moe_layers), cfg.num_experts)


def test_update_rule_moves_load_toward_uniform() -> None:
    # A router that prefers expert 0 strongly (about 4x the mean load); the sign rule must spread it.
    g = torch.Generator().manual_seed(0)
    E, H, T = 8, 16, 512
    x = torch.randn(T, H, generator=g) + 1.0
    router = 0.3 * torch.randn(E, H, generator=g)
    router[0] += 0.25
    params = {"layers": [{"moe": {"expert_bias": torch.zeros(E)}}]}

    def load_of(p):
        r = route_topk(x, router, top_k=2, norm_topk_prob=True, expert_bias=p["layers"][0]["moe"]["expert_bias"])
        return expert_counts(r.indices, E)[None].float()

    def imbalance(load):
        return (load.max() / load.mean()).item()

    first = imbalance(load_of(params))
    for _ in range(60):
        params = update_expert_bias(params, load_of(params), 0.01)
    last = imbalance(load_of(params))
    assert first > 3.5
    assert last < 0.5 * first and last < 2.0


def test_update_expert_bias_sign_rule_and_errors() -> None:
    params = {"layers": [{"moe": {"expert_bias": torch.zeros(4)}}, {"mlp": {}},
                         {"moe": {"expert_bias": torch.ones(4)}}], "embed": torch.ones(2)}
    load = torch.tensor([[4, 4, 0, 0], [1, 2, 3, 2]])
    out = update_expert_bias(params, load, 0.5)
    assert out["layers"][0]["moe"]["expert_bias"].tolist() == [-0.5, -0.5, 0.5, 0.5]
    assert out["layers"][2]["moe"]["expert_bias"].tolist() == [1.5, 1.0, 0.5, 1.0]
    assert out["embed"] is params["embed"]
    with pytest.raises(ValueError, match=r"n_moe_layers=2"):
        update_expert_bias(params, load[:1], 0.5)


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(1, 3), E=st.integers(2, 8), k=st.integers(1, 4), seed=st.integers(0, 100))
def test_load_balancing_loss_matches_transformers(layers: int, E: int, k: int, seed: int) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    H = 8
    xs = [torch.randn(10, H, generator=g) for _ in range(layers)]
    routers = [torch.randn(E, H, generator=g) for _ in range(layers)]
    routings = [route_topk(x, r, top_k=k, norm_topk_prob=False) for x, r in zip(xs, routers)]
    ours = load_balancing_loss(routings, E)
    ref = load_balancing_loss_func(tuple(r.logits for r in routings), E, k)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)


def test_moe_block_shared_expert_adds_gated_swiglu() -> None:
    g = torch.Generator().manual_seed(0)
    E, H, I, Is = 4, 8, 4, 6
    x = torch.randn(2, 3, H, generator=g)
    ws = dict(router=torch.randn(E, H, generator=g), w_gate=torch.randn(E, I, H, generator=g),
              w_up=torch.randn(E, I, H, generator=g), w_down=torch.randn(E, H, I, generator=g))
    shared = {"w_gate": torch.randn(Is, H, generator=g), "w_up": torch.randn(Is, H, generator=g),
              "w_down": torch.randn(H, Is, generator=g), "gate": torch.randn(1, H, generator=g)}
    base, _ = moe_block(x, *ws.values(), top_k=2, norm_topk_prob=True)
    both, _ = moe_block(x, *ws.values(), top_k=2, norm_topk_prob=True, shared=shared)
    from hpfunc.models import swiglu_mlp
    extra = torch.sigmoid(x @ shared["gate"].T) * swiglu_mlp(x, shared["w_gate"], shared["w_up"], shared["w_down"])
    torch.testing.assert_close(both, base + extra)
