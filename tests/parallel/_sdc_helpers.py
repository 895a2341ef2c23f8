"""Rank-side helpers of the SDC-check tests: a two-layer MLP trained with AdamW under a plan with the
check on, optionally with a bit flipped in one rank's reduced gradient."""

from __future__ import annotations

import torch


def _plan(name: str, policy: str):
    from hpfunc.transforms import plans

    base = {"ddp": plans.ddp("dp"), "hsdp": plans.hsdp("dp", "fsdp"), "fsdp": plans.fsdp("fsdp"),
            "zero1": plans.zero1("dp")}[name]
    return base.with_sdc_check(policy)


MESHES = {"ddp": {"dp": 4}, "hsdp": {"dp": 2, "fsdp": 2}, "fsdp": {"fsdp": 4}, "zero1": {"dp": 4}}


def train(plan: str, steps: int, seed: int, flip: dict | None = None, policy: str = "raise") -> dict:
    """``steps`` AdamW steps; returns the losses, or the error (or warnings) the check gave."""
    import warnings

    import hpfunc
    from hpfunc import optim
    from hpfunc.transforms.engine import sdc

    tx = optim.adamw(0.05)

    def step(state, batch):
        def loss(p):
            h = torch.tanh(batch["x"] @ p["w_in"].T + p["b_in"])
            return ((h @ p["w_out"].T - batch["y"]) ** 2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], u), "opt": opt}, {"loss": value}

    ts = hpfunc.parallelize(step, hpfunc.Mesh(MESHES[plan]), _plan(plan, policy))
    g = torch.Generator().manual_seed(seed)
    full = {"w_in": torch.randn(16, 8, generator=g), "b_in": torch.randn(16, generator=g),
            "w_out": torch.randn(4, 16, generator=g)}
    state = ts.init_state(lambda p: {"params": p, "opt": tx.init(p)}, ts.shard_params(full))
    losses = []
    ctx = sdc.inject_bit_flip(**flip) if flip else __import__("contextlib").nullcontext()
    import os

    # with "warn" the corrupted gradient reaches the optimizer and the replicas drift apart; the suite's
    # checked mode (HPFUNC_CHECK_REP) would then stop the step itself: off for that run
    saved = os.environ.get("HPFUNC_CHECK_REP")
    if policy == "warn" and flip:
        os.environ["HPFUNC_CHECK_REP"] = "0"
    try:
        return _run(ts, state, g, steps, ctx, losses)
    finally:
        if saved is not None:
            os.environ["HPFUNC_CHECK_REP"] = saved


def _run(ts, state, g, steps, ctx, losses) -> dict:
    import warnings

    from hpfunc.transforms.engine import sdc

    with warnings.catch_warnings(record=True) as caught, ctx:
        warnings.simplefilter("always")
        try:
            for _ in range(steps):
                batch = {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)}
                state, m = ts(state, batch)
                losses.append(float(m["loss"]))
        except sdc.SDCError as e:
            return {"error": str(e), "losses": losses}
    return {"error": None, "losses": losses, "warnings": [str(w.message) for w in caught if "SDC" in str(w.message)]}
