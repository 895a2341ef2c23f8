"""Rank-side helpers of the checkpoint tests: states built the same way on every rank from a description,
saved on one layout and loaded on another."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


def full_state(leaves: list[tuple[str, tuple[int, ...], str]], seed: int) -> dict:
    """The global values of a train-state-like tree: tensors from ``leaves`` under ``params``, an RNG key,
    an int step and a config dict."""
    import hpfunc

    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, dtype in leaves:
        x = torch.randn(shape, generator=g) * 100
        params[name] = x.to(DTYPES[dtype])
    return {"params": params, "rng": hpfunc.random.key(seed), "step": seed % 1000,
            "config": {"name": f"model-{seed}", "lr": 0.5, "layers": [1, 2]}}


def world(mesh_axes: dict | None) -> int:
    """The number of ranks of a mesh (1: one process)."""
    import math

    return 1 if mesh_axes is None else math.prod(mesh_axes.values())


def _specs(state: dict, param_specs: dict | None):
    from hpfunc import P

    return {"params": {k: P(*param_specs[k]) for k in state["params"]} if param_specs else
            {k: P() for k in state["params"]},
            "rng": P(), "step": P(), "config": {"name": P(), "lr": P(), "layers": [P(), P()]}}


def save_sharded(path: str, leaves, seed: int, mesh_axes: dict, param_specs: dict) -> list[str]:
    """Shard the state on ``mesh_axes`` by ``param_specs`` (the RNG key stays a plain tensor) and save it."""
    import hpfunc
    from hpfunc import checkpoint

    mesh = hpfunc.Mesh(mesh_axes)
    state = full_state(leaves, seed)
    state["params"] = hpfunc.shard(state["params"], mesh, _specs(state, param_specs)["params"])
    checkpoint.save(path, state, step=seed, metadata={"mesh": mesh_axes})
    return sorted(hpfunc.typeof(state["params"]).values())


def load_sharded(path: str, leaves, seed: int, mesh_axes: dict | None, param_specs: dict | None):
    """Load into the layout ``param_specs`` on ``mesh_axes`` (``None``: plain tensors on one process);
    returns the state (DTensors come back gathered) and the layout of every loaded parameter."""
    import hpfunc
    from hpfunc import checkpoint

    shapes = hpfunc.tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                                  if isinstance(x, torch.Tensor) else x, full_state(leaves, seed))
    if mesh_axes is None:
        target = checkpoint.abstract_like(None, None, shapes)
    else:
        mesh = hpfunc.Mesh(mesh_axes)
        target = checkpoint.abstract_like(_specs(shapes, param_specs), mesh, shapes)
    state = checkpoint.load(path, target)
    layouts = {k: hpfunc.typeof(v) for k, v in state["params"].items()}
    return state, layouts


# -- a real train state through hpfunc.parallelize ----------------------------------------------------------

def _mlp_setup(mesh_axes: dict):
    import hpfunc
    from hpfunc import optim
    from hpfunc.transforms import plans

    tx = optim.adamw(0.05, eps=1e-5)

    def step(state, batch):
        def loss(p):
            h = torch.tanh(batch["x"] @ p["w_in"].T)
            return ((h @ p["w_out"].T - batch["y"]) ** 2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], u), "opt": opt, "step": state["step"] + 1}, \
            {"loss": value}

    mesh = hpfunc.Mesh(mesh_axes)
    train_step = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp"))
    g = torch.Generator().manual_seed(0)
    full = {"w_in": torch.randn(12, 6, generator=g), "w_out": torch.randn(6, 12, generator=g)}
    batch = {"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 6, generator=g)}
    init = lambda p: {"params": p, "opt": tx.init(p), "step": 0}  # noqa: E731
    return train_step, full, batch, init, mesh


def train_and_save(path: str) -> dict:
    """fsdp over 4 ranks: init_state, one AdamW step, save; then one more step (the reference to resume to)."""
    from hpfunc import checkpoint

    train_step, full, batch, init, _ = _mlp_setup({"fsdp": 4})
    state = train_step.init_state(init, train_step.shard_params(full))
    state, _ = train_step(state, batch)
    checkpoint.save(path, state, step=1)
    saved = state
    state, metrics = train_step(state, batch)
    return {"saved": saved, "next": state, "loss": metrics["loss"]}


def restore_and_step(path: str, mesh_axes: dict) -> dict:
    """The same step on another mesh, restored from the checkpoint into that plan's layout, then one step."""
    import hpfunc
    from hpfunc import checkpoint

    train_step, full, batch, init, mesh = _mlp_setup(mesh_axes)
    meta = hpfunc.tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), full)
    meta_state = init(meta)
    target = checkpoint.abstract_like(train_step.state_specs(meta_state), mesh, meta_state)
    restored = checkpoint.load(path, target)
    from hpfunc.sharding import sharding_of

    specs_ok = all(str(sharding_of(x).spec) == str(s) for x, s in zip(
        hpfunc.tree.leaves(restored["params"]), hpfunc.tree.leaves(train_step.state_specs(meta_state)["params"],
                                                                  is_leaf=lambda s: isinstance(s, hpfunc.P))))
    state, metrics = train_step(restored, batch)
    return {"restored": restored, "next": state, "loss": metrics["loss"], "specs_ok": specs_ok}


# -- asynchronous saves on ranks ------------------------------------------------------------------------------

def async_roundtrip(root: str) -> dict:
    """Two async saves back to back (the second waits for the first) of a state changed in place after
    each call: each checkpoint holds the values at its call."""
    import hpfunc
    from hpfunc import P, checkpoint

    mesh = hpfunc.Mesh({"fsdp": 4})
    w = hpfunc.shard(torch.arange(64.0).reshape(16, 4), mesh, P("fsdp"))
    state = {"w": w, "step": 1}
    with checkpoint.CheckpointManager(root, keep_last=1, async_save=True) as manager:
        first = manager.save(state, 1)
        w.to_local().add_(1000.0)  # training goes on: the staged copy must not see it
        second = manager.save({"w": w, "step": 2}, 2)
        blocked = [first.blocked_s, second.blocked_s]
        first_result = first.wait()
        w.to_local().add_(1000.0)
        result = manager.wait()
    target = checkpoint.abstract({"w": w, "step": 0})
    loaded = checkpoint.load(checkpoint.latest(root), target)
    return {"loaded": loaded, "steps": checkpoint.complete_steps(root), "blocked": blocked,
            "first_step": first_result.step, "second_step": result.step}


def corrupt_is_named_on_every_rank(path: str) -> str:
    """A checksum problem found by one rank is the error of every rank."""
    import hpfunc
    from hpfunc import P, checkpoint

    mesh = hpfunc.Mesh({"fsdp": 2})
    state = {"w": hpfunc.shard(torch.arange(8.0), mesh, P("fsdp"))}
    checkpoint.save(path, state, step=1)
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        import pathlib

        victim = pathlib.Path(path) / "__1_0.distcp"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        checkpoint.load(path, checkpoint.abstract(state))
    except checkpoint.CorruptCheckpointError as e:
        return str(e)
    return "loaded"


def save_failure_is_every_ranks(path: str) -> str:
    """Rank 0 cannot create the folder: every rank raises the same error (none waits forever)."""
    import hpfunc
    from hpfunc import P, checkpoint

    mesh = hpfunc.Mesh({"fsdp": 2})
    try:
        checkpoint.save(path, {"w": hpfunc.shard(torch.arange(4.0), mesh, P("fsdp"))}, step=1)
    except checkpoint.CheckpointError as e:
        return str(e)
    return "saved"


# -- a Qwen3-MoE train state (the trainer's step under hpfunc.parallelize) --------------------------------------

MOE_CONFIG = {"model": {"preset": "qwen3-moe-tiny"}, "train": {"batch_size": 4, "seq_len": 16}}


def _moe_step(mesh_axes: dict | None, plan: list | None):
    import hpfunc
    from hpfunc.train.build import build_optimizer, build_schedule, check_buildable, model_dtype
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.distributed import build_parallel_step

    data = dict(MOE_CONFIG)
    if mesh_axes is not None:
        data["parallel"] = {"mesh": mesh_axes, "plan": plan}
    cfg = load_config_dict(data)
    model_cfg = check_buildable(cfg)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps))
    mesh = hpfunc.Mesh(mesh_axes or {"dp": 1})
    return build_parallel_step(cfg, model_cfg, optimizer, lr, hpfunc.random.key(0), mesh, model_dtype(cfg.model))


def _fill(x, k: int) -> None:
    """Write position-dependent values into this rank's block of ``x`` (a misplaced block shows)."""
    from torch.distributed.tensor import DTensor

    from hpfunc.sharding import local_block, sharding_of

    full = (torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape) * 1e-3 + k).to(x.dtype)
    if isinstance(x, DTensor):
        sh = sharding_of(x)
        starts, sizes = local_block(tuple(x.shape), sh.mesh, sh.spec, sh.mesh.coordinate())
        for d, (a, n) in enumerate(zip(starts, sizes)):
            full = full.narrow(d, a, n)
        x.to_local().copy_(full)
    else:
        x.copy_(full)


def moe_train_and_save(path: str, step: int) -> dict:
    """The trainer's Qwen3-MoE state on fsdp 4 (``init_state`` of its step), every parameter and AdamW
    moment filled with position-dependent values, saved as step ``step``; returns it gathered."""
    from hpfunc import checkpoint
    from hpfunc import tree as _tree
    from hpfunc.testing import to_full

    state, _ = _moe_step({"fsdp": 4}, ["fsdp"])
    for k, x in enumerate(_tree.leaves(state)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            _fill(x, k)
    state = state._replace(step=torch.tensor(step, dtype=state.step.dtype))
    checkpoint.save(path, state, step=step)
    return to_full(state)


def moe_restore(path: str, mesh_axes: dict | None, plan: list | None) -> dict:
    """Restore into the layout the plan gives the same state on ``mesh_axes``: a fresh state from
    ``init_state`` (laid out by the step's ``state_specs``) is the target (its values are not read).

    (``abstract_like(train_step.state_specs(meta), ...)`` refuses this state: its optimizer state has
    ``None`` at the untrained expert bias, which the spec tree names and the value tree does not.)"""
    import hpfunc
    from hpfunc import checkpoint
    from hpfunc.testing import to_full

    fresh, _ = _moe_step(mesh_axes, plan)
    restored = checkpoint.load(path, checkpoint.abstract(fresh))
    return {"state": to_full(restored), "layouts": hpfunc.typeof(restored.params)}


def async_save_without_a_peer(root):
    """Rank 0 starts an asynchronous save on a saver with a 2 s timeout; rank 1 never joins it.
    ``(seconds until rank 0's wait() raised, its message)`` from rank 0; ``None`` from rank 1."""
    import time

    import torch.distributed as dist

    from hpfunc import checkpoint

    saver = checkpoint.AsyncSaver(timeout_s=2)
    out = None
    if dist.get_rank() == 0:
        start = time.monotonic()
        pending = saver.save(f"{root}/step_1", {"w": torch.ones(4)}, step=1)
        try:
            pending.wait()
            out = (time.monotonic() - start, "no error")
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out = (time.monotonic() - start, f"{type(e).__name__}: {e}")
    dist.barrier()  # on the training group: rank 1 waits here while rank 0's save times out
    saver.close()
    return out
