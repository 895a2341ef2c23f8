"""Rank functions of test_lowered.py: ``train_step.lower(state, batch)`` printed on a real mesh."""

from __future__ import annotations

import torch


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(8, 4, generator=g),
            "layers": [{"wq": torch.randn(4, 4, generator=g) / 2, "wo": torch.randn(4, 4, generator=g) / 2}
                       for _ in range(2)],
            "bias": torch.randn(3, generator=g)}


def _step(state, batch):
    import hpfunc

    def loss(p):
        h = p["embed"][batch]
        for layer in p["layers"]:
            h = h @ layer["wq"] @ layer["wo"]
        return (h[..., :3] + p["bias"]).pow(2).mean()

    value, g = hpfunc.value_and_grad(loss)(state["params"])
    new = hpfunc.tree.tree_map(lambda w, d: w - 0.01 * d, state["params"], g)
    return {"params": new}, {"loss": value}


def run_printed(plan_name: str) -> dict:
    """``str(train_step.lower(state, batch))`` under ``plan_name`` on 2 ranks, whether the step found it
    (the same object) after running, and the loss of two steps run by the Lowered and the step."""
    import hpfunc
    from hpfunc.transforms import plans

    axis = {"fsdp": "fsdp", "ddp": "dp", "zero2": "dp"}[plan_name]
    plan = getattr(plans, plan_name)(axis)
    ts = hpfunc.parallelize(_step, hpfunc.Mesh({axis: 2}), plan)
    state = {"params": ts.shard_params(_params())}
    batch = torch.arange(8).reshape(4, 2) % 8
    lowered = ts.lower(state, batch)
    text = str(lowered)
    state, m1 = lowered(state, batch)
    state, m2 = ts(state, batch)
    return {"text": text, "same": ts.lower(state) is lowered,
            "losses": [float(m1["loss"].full_tensor()), float(m2["loss"].full_tensor())]}
