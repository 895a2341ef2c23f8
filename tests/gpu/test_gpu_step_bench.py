"""bench/gpu_step.py on this machine: its FLOP formula against torch's FLOP counter, and a tiny smoke run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import gpu_step  # noqa: E402

from hpfunc import random, tree  # noqa: E402
from hpfunc.models import qwen3  # noqa: E402


def test_flop_formula_equals_torchs_flop_counter_on_a_tiny_moe():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = qwen3.preset("qwen3-moe-tiny")
    B, S = 2, 32
    params = qwen3.init(random.key(0), cfg)
    leaves = [p.requires_grad_() for p in tree.leaves(params)]
    tokens = random.randint(random.key(1), (B, S), 0, cfg.vocab_size)
    # forced balance: every expert gets the same rows, so the padded bmm computes no padding; the math SDPA
    # is plain bmm's the counter sees (it has no formula for the CPU flash kernel nor for grouped_mm)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = qwen3.loss(params, {"tokens": tokens}, cfg, moe_impl="bmm",
                             moe_dispatchers=[gpu_step.ForcedBalance()] * cfg.num_hidden_layers)
        torch.autograd.grad(loss, leaves, allow_unused=True)
    # the formula's 6 x params also counts the norm weights, which multiply rather than matmul
    norms = sum(math.prod(p.shape) for path, p in tree.leaves_with_paths(params) if path.endswith("norm"))
    assert norms > 0
    counted = counter.get_total_flops() + 6 * norms * B * S
    assert counted == gpu_step.flops_per_token(cfg, S, causal=False) * B * S
    # the causal convention halves the attention term only; the 48-layer model at seq 4096: 23.08 GFLOP
    assert gpu_step.flops_per_token(qwen3.preset("qwen3-30b-a3b"), 4096) / 1e9 == pytest.approx(23.08, abs=0.005)


def test_tiny_smoke_run_writes_both_routings(tmp_path):
    out = tmp_path / "gpu_step.json"
    result = gpu_step.main(["--tiny", "--out", str(out)])
    assert [r["routing"] for r in result["runs"]] == ["forced", "real"]
    for r in result["runs"]:
        assert r["tokens_per_s"] > 0 and all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 2
    assert json.loads(out.read_text())["published"][0]["tflops"] == 299


def test_forced_balance_sends_token_t_pair_j_to_expert_t_k_plus_j_mod_e():
    from hpfunc.models import moe

    g = torch.Generator().manual_seed(0)
    T, k, E, H, I = 7, 3, 4, 8, 4
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ws = [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]
    y, dropped = gpu_step.ForcedBalance().exchange(
        x, torch.zeros(T, k, dtype=torch.long), w,
        lambda t, c, s: moe.expert_ffn(t, c, *ws, scale=s, impl="bmm"), num_experts=E, axis=None)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = (t * k + j) % E
            want[t] += w[t, j] * moe.expert_ffn(x[t:t + 1], torch.tensor([1]), *(a[e:e + 1] for a in ws))[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert dropped is None
