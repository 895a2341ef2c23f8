"""Rank-side helpers for test_registry.py: a small model calling the ops of examples/ops/registry.yaml
(loaded from the YAML), trained on DTensors (the global view, where the rules decide the layouts) and
through ``hpfunc.parallelize`` (fsdp) with AdamW, against the same model on one device."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import hpfunc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ops"


def load_example():
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import example_ops

    if not getattr(example_ops, "_registered", False):  # once per rank process: torch's registry is global
        from hpfunc.ops import load_registry

        load_registry(EXAMPLE / "registry.yaml")
        example_ops._registered = True
    return example_ops


def loss(params, batch):
    ops = load_example()
    h = ops.linear_silu(batch["x"], params["w1"])
    p = ops.row_softmax(torch.nn.functional.linear(h, params["w2"]))
    return ((p - batch["y"]) ** 2).sum(-1).mean()


def init(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w1": 0.5 * torch.randn(8, 6, generator=g), "w2": 0.5 * torch.randn(8, 8, generator=g)}


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    return {"x": torch.randn(8, 6, generator=g), "y": torch.softmax(torch.randn(8, 8, generator=g), -1)}


def one_device(seed: int, steps: int, lr: float, shards: int = 1):
    params = init(seed)
    b = batch(seed)
    losses = []
    for _ in range(steps):
        def ref(p):
            return torch.stack([loss(p, {"x": x, "y": y}) for x, y in zip(b["x"].chunk(shards),
                                                                            b["y"].chunk(shards))]).mean()
        v, g = hpfunc.value_and_grad(ref)(params)
        params = {k: params[k] - lr * g[k] for k in params}
        losses.append(float(v))
    return losses, params


def run_global_view(seed: int, steps: int = 3, lr: float = 0.5) -> float:
    """SGD on DTensors on a 2 x 2 mesh: w1 split by output features on 'a' and by input features on 'b'
    (the rule gathers those: whole k), w2 split by rows on 'b' (the softmax's row dimension: the impl),
    the batch split on 'a'. Returns the largest gap to one device (<= 1: equal at 1e-5)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    load_example()
    mesh = hpfunc.Mesh({"a": 2, "b": 2}).device_mesh
    params = init(seed)
    lay = {"w1": [Shard(0), Shard(1)], "w2": [Replicate(), Shard(0)]}
    dp = {k: distribute_tensor(v, mesh, lay[k]) for k, v in params.items()}
    b = {k: distribute_tensor(v, mesh, [Shard(0), Replicate()]) for k, v in batch(seed).items()}
    losses = []
    for _ in range(steps):
        v, g = hpfunc.value_and_grad(loss)(dp, b)
        dp = {k: (dp[k] - lr * g[k]).redistribute(mesh, lay[k]) for k in dp}
        losses.append(float(v.full_tensor()))
    ref_losses, ref = one_device(seed, steps, lr)
    gaps = [abs(a - r) / (1e-5 + 1e-5 * abs(r)) for a, r in zip(losses, ref_losses)]
    gaps += [float(((dp[k].full_tensor() - ref[k]).abs() / (1e-5 + 1e-5 * ref[k].abs())).max()) for k in ref]
    return max(gaps)


def run_parallelize(seed: int, steps: int = 3, lr: float = 1e-2) -> float:
    """The same model through ``hpfunc.parallelize`` with fsdp on 2 ranks (the ops run on this rank's
    blocks inside the step), SGD; the gap to one device over the losses and the parameters."""
    from hpfunc import optim
    from hpfunc.testing import to_full
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    load_example()
    mesh = hpfunc.Mesh({"fsdp": 2})
    opt = optim.adamw(lr)
    step = parallel_train_step(loss, opt, mesh, plans.fsdp("fsdp"))
    params = step.shard_params(init(seed))
    state = step.init_opt_state(params)
    b = batch(seed)
    losses = []
    for _ in range(steps):
        params, state, metrics = step(params, state, b)[:3]
        losses.append(float(metrics["loss"]))
    # one device, the same optimizer
    full = init(seed)
    ost = opt.init(full)
    ref_losses = []
    for _ in range(steps):
        def ref(p):
            return torch.stack([loss(p, {"x": x, "y": y}) for x, y in zip(b["x"].chunk(2), b["y"].chunk(2))]).mean()
        v, g = hpfunc.value_and_grad(ref)(full)
        u, ost = opt.update(g, ost, full)
        full = optim.apply_updates(full, u)
        ref_losses.append(float(v))
    got = to_full(params)
    gaps = [abs(a - r) / (1e-5 + 1e-5 * abs(r)) for a, r in zip(losses, ref_losses)]
    gaps += [float(((got[k] - full[k]).abs() / (1e-5 + 1e-5 * full[k].abs())).max()) for k in full]
    return max(gaps)
