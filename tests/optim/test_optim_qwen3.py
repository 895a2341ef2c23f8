"""muon_adamw trains the tiny Qwen3-MoE end to end with Qwen3's own routing
(``qwen3.parallel_plan.adamw_when``), the expert bias frozen by a nested partition."""

from __future__ import annotations

import torch

import hpfunc
from hpfunc import optim

from _optim_helpers import one_intra_op_thread  # noqa: F401 (autouse fixture)


def test_muon_adamw_trains_qwen3_moe_tiny():
    from hpfunc.models import preset, qwen3

    cfg = preset("qwen3-moe-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))}

    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.partition(
            {"train": optim.muon_adamw(0.02, weight_decay=0.01, adam_learning_rate=3e-3,
                                       adamw_when=qwen3.parallel_plan.adamw_when),
             "frozen": optim.set_to_zero()},
            lambda path, x: "frozen" if path.endswith("expert_bias") else "train",
        ),
    )
    state = tx.init(params)
    routes = state[1].inner_states["train"].inner_states
    muon_paths = {p for p, _ in hpfunc.tree.leaves_with_paths(routes["muon"][0].momentum)}
    assert "layers.0.moe.experts.w_gate" in muon_paths and "layers.0.attn.wq" in muon_paths
    assert not any(("norm" in p or "embed" in p or "router" in p or "bias" in p) for p in muon_paths)

    def loss_fn(p):
        return qwen3.loss(p, batch, cfg)[0]

    losses = []
    bias0 = params["layers"][0]["moe"]["expert_bias"].clone()
    for _ in range(8):
        loss, grads = hpfunc.value_and_grad(loss_fn)(params)
        losses.append(loss.item())
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    assert losses[-1] < losses[0] - 0.5, losses
    assert torch.equal(params["layers"][0]["moe"]["expert_bias"], bias0)
