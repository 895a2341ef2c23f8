"""Rank-side helpers: a Qwen3 train state saved on one plan and loaded on another, a pipeline among them."""

from __future__ import annotations

import torch


def _setup(mesh_axes: dict, roles: list[str]):
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = qwen3.preset("qwen3-dense-tiny", num_hidden_layers=4)
    plan = plans.Plan()
    for axis, role in zip(mesh_axes, roles):
        plan = plan + (plans.pp(axis, parallel_plan.pipeline_stages(cfg, mesh_axes[axis]), microbatches=2)
                       if role == "pp" else plans.fsdp(axis))
    mesh = hpfunc.Mesh(mesh_axes)
    tx = optim.adamw(1e-2)
    step = parallel_train_step(lambda p, b: parallel_plan.loss(p, b, cfg), tx, mesh, plan, has_aux=True)
    return cfg, mesh, plan, tx, step


def save_after_a_step(path: str, mesh_axes: dict, roles: list[str]) -> float:
    """One step on the plan, then save ``{params, opt, step}``; returns the step's loss."""
    import hpfunc
    from hpfunc import checkpoint
    from hpfunc.models import qwen3

    cfg, mesh, plan, tx, step = _setup(mesh_axes, roles)
    params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    opt = step.init_opt_state(params)
    b = {"tokens": torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))}
    params, opt, metrics = step(params, opt, b)
    checkpoint.save(path, {"params": params, "opt": opt, "step": 1}, step=1)
    # what was saved, whole, for the loading side to compare with (every stage, from its pipeline rank)
    whole = {k: step.train_step.full_params(v) for k, v in (("params", params), ("mu", opt[0].mu), ("nu", opt[0].nu))}
    if torch.distributed.get_rank() == 0:
        torch.save(whole, path + ".whole.pt")
    torch.distributed.barrier()
    return float(hpfunc.testing.to_full(metrics["loss"]))


def load_and_compare(path: str, mesh_axes: dict, roles: list[str]) -> dict:
    """Load onto the plan's layout (this rank's stages only under pp) and compare every tensor, bit for
    bit, with what was saved (gathered whole at save time)."""
    import hpfunc
    from hpfunc import checkpoint
    from hpfunc.models import qwen3
    from hpfunc.testing import assert_trees_close, to_full

    cfg, mesh, plan, tx, step = _setup(mesh_axes, roles)
    meta = plan.local_params(qwen3.init(hpfunc.random.key(0), cfg, device="meta"), mesh)
    abstract_state = {"params": meta, "opt": tx.init(meta), "step": 0}
    specs = step.train_step.state_specs({"params": meta, "opt": tx.init(meta)})
    target = checkpoint.abstract_like({**specs, "step": None}, mesh, abstract_state)
    got = checkpoint.load(path, target)
    whole = torch.load(path + ".whole.pt")
    assert got["step"] == 1
    for name, tree in (("params", got["params"]), ("mu", got["opt"][0].mu), ("nu", got["opt"][0].nu)):
        mine = to_full(tree)
        want = plan.local_params(whole[name], mesh)
        assert_trees_close(mine, want, rtol=0, atol=0, what=name)  # bit for bit
    keys = [p for p, _ in hpfunc.tree.leaves_with_paths(got["params"])]
    return {"keys": keys, "n": len(keys)}
