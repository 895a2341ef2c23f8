"""The automatic recompute/swap policy meets its budget when measured on storage liveness."""

from __future__ import annotations

import pytest
import torch

from hpfunc.autoparallel.recompute_policy import PolicyBudgetError, choose_policy, policies_from_config
from hpfunc.memory import saved_activations
from hpfunc.models.description import LayerDescription, SavedValue
from hpfunc.transforms.remat import checkpoint_name, remat

H, F, L, B, S = 16, 64, 3, 2, 8
TOKENS = B * S


def layer(p, x):
    up = checkpoint_name(x @ p["w1"], "up")
    act = checkpoint_name(torch.tanh(up), "act")
    return x + checkpoint_name(act @ p["w2"], "down")


# the layer's tagged values, fp32: what each keeps per token and costs to recompute
DESCRIPTION = LayerDescription(hidden=H, dense_params=2 * H * F, act_bytes=4, matmul_flops_per_token=4.0 * H * F,
                               saved=(SavedValue("up", 4.0 * F, matmul=True, recompute_flops_per_token=2.0 * H * F),
                                      SavedValue("act", 4.0 * F),
                                      SavedValue("down", 4.0 * H, autograd=False, matmul=True,
                                                 recompute_flops_per_token=2.0 * F * H)))


def _params():
    g = torch.Generator().manual_seed(0)
    return [{"w1": torch.randn(H, F, generator=g) / 4, "w2": torch.randn(F, H, generator=g) / 8} for _ in range(L)]


def _measure(config):
    policies = policies_from_config(config)
    regions = [remat(layer, policy=pol) for pol in policies]

    def stack(params, x):
        for region, p in zip(regions, params):
            x = region(p, x)
        return x.sum()  # keeps nothing for backward

    return saved_activations(stack, _params(), torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)),
                             state_argnums=(0,))


@pytest.mark.parametrize("hw", ["h100", "cpu"])
@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.3])
def test_policy_meets_its_budget_measured(hw, fraction):
    everything = L * TOKENS * (4 * H + 4 * F + 4 * F + 4 * H)  # inputs + up + act + down
    budget = fraction * everything
    plan = choose_policy([DESCRIPTION] * L, tokens=TOKENS, seq_len=S, budget_bytes=budget, hardware=hw, dtype="float32")
    report = _measure(plan.to_config())
    assert report.device_bytes <= budget
    assert report.device_bytes == plan.device_bytes  # the plan's own count is what stays alive
    assert report.host_bytes >= plan.host_bytes
    assert plan.extra_seconds <= plan.full_recompute_seconds  # never estimated slower than full recompute


def test_tight_budget_swaps_on_an_async_device_and_recomputes_on_the_cpu():
    inputs = L * TOKENS * 4 * H
    gpu = choose_policy([DESCRIPTION] * L, tokens=TOKENS, seq_len=S, budget_bytes=inputs, hardware="h100",
                        dtype="float32")
    assert all(set(d.values()) <= {"recompute", "offload"} for d in gpu.decisions)
    assert _measure(gpu.to_config()).device_bytes == inputs  # only the region inputs stay on the device
    with pytest.raises(PolicyBudgetError, match=r"budget_bytes: .* is below the layer inputs"):
        choose_policy([DESCRIPTION] * L, tokens=TOKENS, seq_len=S, budget_bytes=inputs - 1, hardware="cpu",
                      dtype="float32")
    with pytest.raises(ValueError, match=r"layers\[0\]: expected \{save: \[names\], offload: \[names\]\}"):
        policies_from_config({"layers": [{"keep": ["up"]}]})
