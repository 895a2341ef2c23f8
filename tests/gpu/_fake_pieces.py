"""Functions run on fake CUDA devices by tests/gpu (importable, so an isolated process can run them)."""

from __future__ import annotations

import torch

SHAPES = {"normal": (64, 48), "uniform": (33,), "randint": (5, 7), "bernoulli": (16, 4), "bits": (9,),
          "truncated_normal": (12,), "permutation": (20,)}


def sample_all(device: str) -> dict:
    """Every sampler of hpfunc.random on ``device`` from one key: name -> (shape, dtype, device[, values])."""
    from hpfunc import random

    k = random.key(1234, device=device)
    k1, k2 = random.split(k).unbind(0)
    k3 = random.fold_in(k2, torch.tensor(7, device=device))
    out = {
        "normal": random.normal(k1, SHAPES["normal"], torch.bfloat16),
        "uniform": random.uniform(k3, SHAPES["uniform"], minval=-1.0, maxval=2.0),
        "randint": random.randint(k3, SHAPES["randint"], 3, 11),
        "bernoulli": random.bernoulli(k1, 0.3, SHAPES["bernoulli"]),
        "bits": random.bits(k2, SHAPES["bits"]),
        "truncated_normal": random.truncated_normal(k3, SHAPES["truncated_normal"], torch.float64),
        "permutation": random.permutation(k2, SHAPES["permutation"][0]),
        "dropout": random.dropout(k1, torch.ones(8, 8, device=device), 0.25),
    }
    return {n: (tuple(t.shape), t.dtype, t.device.type) for n, t in out.items()}, (
        {n: t.cpu() for n, t in out.items()} if device == "cpu" else None)


def random_on_fake(mesh) -> dict:
    return sample_all(mesh.device_type)[0]


def adamw_update(mesh) -> tuple:
    """One fused AdamW update (weight decay, bias correction) of cuda parameters and moments."""
    from hpfunc import optim, random

    k = random.key(0, device=mesh.device_type)
    params = {"w": random.normal(k, (64, 32)), "b": random.normal(random.fold_in(k, 1), (32,))}
    opt = optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)
    grads = {"w": torch.ones(64, 32, device=mesh.device_type), "b": torch.ones(32, device=mesh.device_type)}
    new, state = optim.update_and_apply(opt, grads, state, params)
    return {n: (tuple(t.shape), t.device.type) for n, t in new.items()}


def lax_collectives(mesh) -> tuple:
    """psum, tiled all_gather and psum_scatter of hpfunc.lax over the fake process group."""
    from hpfunc import lax

    x = torch.ones(8, 4, device=mesh.device_type)
    with mesh:
        s = lax.psum(x, "tp")
        g = lax.all_gather(x, "fsdp", tiled=True)
        r = lax.psum_scatter(g, "fsdp", tiled=True)
    return tuple(s.shape), tuple(g.shape), tuple(r.shape), r.device.type


def lax_collectives_no_scatter(mesh) -> tuple:
    """psum and tiled all_gather (psum_scatter indexes with ``x[:n]``: see docs/gpu.md)."""
    from hpfunc import lax

    x = torch.ones(8, 4, device=mesh.device_type)
    with mesh:
        s = lax.psum(x, "tp")
        g = lax.all_gather(x, "fsdp", tiled=True)
    return tuple(s.shape), tuple(g.shape), g.device.type


def tiny_moe_forward_backward(mesh) -> tuple:
    """The tiny MoE's loss and its gradient on one (fake) device, no parallelize."""
    from hpfunc import random, tree
    from hpfunc.models import preset, qwen3

    cfg = preset("qwen3-moe-tiny")
    k = random.key(0, device=mesh.device_type)
    params = qwen3.init(k, cfg)
    tokens = random.randint(random.fold_in(k, 9), (2, 16), 0, cfg.vocab_size)
    leaves = [p.requires_grad_(True) for p in tree.leaves(params) if p.is_floating_point()]
    loss, _ = qwen3.loss(params, {"tokens": tokens}, cfg)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return loss.device.type, sum(g is not None for g in grads)


def front_door_step(mesh, plan_name: str = "fsdp") -> dict:
    """The trainer's step of the tiny MoE under ``hpfunc.parallelize`` (AdamW) on the mesh: what the front
    door does on fake devices today (used by the lead's probe, and by docs/gpu.md's status)."""
    import functools

    from hpfunc import optim, random
    from hpfunc.models import preset, qwen3
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import init_sharded, parallelize

    cfg = preset("qwen3-moe-tiny")
    plan = {"fsdp": plans.fsdp("fsdp")}[plan_name]
    tx = optim.adamw(1e-3, weight_decay=0.1)
    step = make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss)
    train_step = parallelize(step, mesh, plan, params="params")
    key = random.key(0, device=mesh.device_type)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, key, shapes=qwen3.param_shapes(cfg))
    state = train_step.init_state(lambda p: init_train_state(p, tx), params)
    tokens = random.randint(random.fold_in(key, 1), (mesh.size * 2, 16), 0, cfg.vocab_size)
    state, metrics = train_step(state, {"tokens": tokens})
    return {k: (tuple(v.shape), v.device.type) for k, v in metrics.items()}
