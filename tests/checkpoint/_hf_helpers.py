"""Rank-side helpers of the Hugging Face export / import tests: a tiny Qwen3-MoE sharded by a plan,
exported by every rank, read back into another layout."""

from __future__ import annotations

import torch

CFG = "qwen3-moe-tiny"


def _cfg():
    from hpfunc.models import preset

    return preset(CFG)


def full_params(seed: int = 1, bias: bool = True) -> dict:
    """The global parameters (with ``bias``, a nonzero expert bias in layer 1, so that it is published;
    transformers has no expert bias)."""
    import hpfunc
    from hpfunc.models import qwen3

    cfg = _cfg()
    params = qwen3.init(hpfunc.random.key(seed), cfg)
    if bias:
        params["layers"][1]["moe"]["expert_bias"] = torch.arange(cfg.num_experts, dtype=torch.float32) / 7
    return params


def plan_for(name: str):
    from hpfunc.models import qwen3
    from hpfunc.transforms import plans

    if name == "fsdp":
        return plans.fsdp("fsdp")
    if name == "ep_fsdp":
        return plans.fsdp("fsdp") + plans.ep("ep", qwen3.parallel_plan.ep_experts(_cfg()))
    if name == "dp_tp":
        return plans.ddp("dp") + plans.tp("tp", qwen3.parallel_plan.tp_styles(_cfg()))
    raise ValueError(name)


def _train_step(mesh_axes: dict, plan: str):
    import hpfunc

    return hpfunc.parallelize(lambda s, b: (s, {}), hpfunc.Mesh(mesh_axes), plan_for(plan))


def export_sharded(path: str, mesh_axes: dict, plan: str, fused: bool, max_shard_size: str, bias: bool = True,
                   expert_bias: str = "keep") -> dict:
    """Shard the parameters by ``plan`` on ``mesh_axes`` and export them; returns the layouts used."""
    import hpfunc
    from hpfunc.models.qwen3 import hf_sharded

    ts = _train_step(mesh_axes, plan)
    params = ts.shard_params(full_params(bias=bias))
    hf_sharded.export_pretrained(params, _cfg(), path, fused_experts=fused, max_shard_size=max_shard_size,
                                 expert_bias=expert_bias)
    return hpfunc.typeof(params)


def export_outcome(path: str, mesh_axes: dict, plan: str, expert_bias: str) -> str:
    """Export the parameters with a nonzero expert bias under ``expert_bias``: ``"written"`` or the error."""
    try:
        export_sharded(path, mesh_axes, plan, False, "100KB", bias=True, expert_bias=expert_bias)
    except Exception as e:  # the test compares every rank's outcome
        return f"{type(e).__name__}: {e}"
    return "written"


def import_sharded(path: str, mesh_axes: dict | None, plan: str | None) -> dict:
    """Read the folder into ``plan``'s storage layout (``None``: plain tensors); returns the gathered
    parameters and their layouts."""
    import hpfunc
    from hpfunc import checkpoint
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import hf_sharded

    shapes = qwen3.model.param_shapes(_cfg())
    if mesh_axes is None:
        target = shapes
    else:
        ts = _train_step(mesh_axes, plan)
        meta = hpfunc.tree.tree_map(lambda s: torch.empty(s, device="meta"), shapes,
                                    is_leaf=lambda x: isinstance(x, torch.Size))
        target = checkpoint.abstract_like(ts.state_specs({"params": meta})["params"], ts.mesh, meta)
    params = hf_sharded.import_pretrained(path, target, _cfg())
    layouts = hpfunc.typeof(params)
    full = hpfunc.tree.tree_map(lambda x: x.full_tensor() if hasattr(x, "full_tensor") else x, params)
    return {"params": full, "layouts": layouts}


def import_error(path: str, mesh_axes: dict, plan: str) -> str:
    from hpfunc import checkpoint

    try:
        import_sharded(path, mesh_axes, plan)
    except checkpoint.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"
