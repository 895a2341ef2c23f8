"""Functions run on fake CUDA devices by tests/gpu (importable, so an isolated process can run them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def raise_boom() -> None:
    raise ValueError("boom")


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


def trainer_steps(runs: list, *, steps: int = 2, preset: str = "qwen3-moe-tiny", device_type: str = "cuda") -> dict:
    """The trainer's parallel step (``make_train_step`` under ``hpfunc.parallelize``, the trainer's AdamW and
    cosine schedule, bf16 compute over fp32 storage) for each ``(name, parallel section[, model section
    overrides])`` of ``runs``, as
    this process's rank of the fake world; per run and step: the host syncs (answered with a stand-in),
    the tensors made off the device (op, source line), the metrics' shapes and devices.

    Each step is recorded by its own :class:`DeviceRecorder` (inside the caller's): making the first
    state is not part of a step. A run that raises reports its error instead of stopping the others.
    """
    import os
    import time
    import traceback

    from hpfunc import random
    from hpfunc.testing.fake_devices import DeviceRecorder, answer_host_syncs

    # The production default: parallelize's outputs unchecked (the suite's exact replication check reads
    # values, which fake tensors do not have). This runs in the isolated child process only.
    os.environ.pop("HPFUNC_CHECK_REP", None)
    out = {}
    for name, parallel, *model in runs:
        try:
            train_step, state, key, cfg, model_cfg = _fake_trainer_step(parallel, model[0] if model else {}, preset,
                                                                        device_type)
            per_step = []
            for i in range(steps):
                tokens = random.randint(random.fold_in(key, 100 + i), (cfg.train.batch_size, cfg.train.seq_len + 1),
                                        0, model_cfg.vocab_size)
                rec = DeviceRecorder(device_type, on_host_sync=answer_host_syncs(1))
                t0 = time.perf_counter()
                with rec:
                    state, metrics = train_step(state, {"tokens": tokens})
                per_step.append({"host_syncs": [(s.kind, s.op, s.where) for s in rec.host_syncs],
                                 "off_device": sorted({(c.op, c.where) for c in rec.off_device}),
                                 "metrics": {k: (tuple(v.shape), v.device.type) for k, v in metrics.items()},
                                 "on_device": rec.devices.get(device_type, 0),
                                 "seconds": time.perf_counter() - t0})
            out[name] = {"ok": True, "steps": per_step, "state_devices": sorted({x.device.type for x in _state_leaves(state)})}
        except Exception as e:  # noqa: BLE001 -- reported per run
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    return out


def _state_leaves(state):
    from hpfunc import tree

    return [x for x in tree.leaves(state) if hasattr(x, "device")]


def _fake_trainer_step(parallel: dict, model: dict, preset: str, device_type: str, monitor: Any = None) -> tuple:
    """``(train_step, state, key, cfg, model_cfg)``: the trainer's step under ``hpfunc.parallelize`` (AdamW
    with a global-norm clip, the cosine schedule, bf16 compute over fp32 storage) and its first state, on
    a mesh of fake ``device_type`` devices (the fake process group must be the default one)."""
    import functools
    import itertools

    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from hpfunc import random
    from hpfunc.mesh import Mesh
    from hpfunc.models import qwen3
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule, model_dtype
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.distributed import build_plan
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import init_sharded, parallelize

    size = 1
    for n in parallel["mesh"].values():
        size *= n
    raw = {"model": {"preset": preset, "dtype": "float32", **model},
           "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "clip_norm": 1.0},
           "schedule": {"name": "cosine", "warmup_steps": 1},
           "train": {"steps": 10, "batch_size": 2 * size, "seq_len": 16},
           "parallel": {**parallel, "device": "cpu"}}  # cpu: the config's check of this machine
    cfg = load_config_dict(raw)
    with _disable_current_modes():  # a DeviceMesh is made of real rank tensors
        mesh = Mesh(dict(parallel["mesh"]), device_type=device_type)
        # and so are the groups of several axes, flattened at first use (host bookkeeping that
        # would compute on fake rank tensors inside the step): made here
        names = list(parallel["mesh"])
        for r in range(2, len(names)):
            for axes in itertools.combinations(names, r):
                mesh.group(axes)
    model_cfg = build_model_config(cfg.model)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps))
    plan = build_plan(cfg.parallel, model_cfg).with_mixed_precision(torch.bfloat16)
    step = make_train_step(model_cfg, optimizer, expert_bias_rate=cfg.train.expert_bias_rate,
                           lr_schedule=lr, loss_fn=qwen3.parallel_plan.loss,
                           num_microbatches=cfg.train.microbatches, monitor=monitor)
    train_step = parallelize(step, mesh, plan, params="params")
    key = random.key(0, device=device_type)
    init = functools.partial(qwen3.init, cfg=model_cfg, dtype=model_dtype(cfg.model))
    params = init_sharded(init, mesh, plan, key, shapes=qwen3.param_shapes(model_cfg))
    state = train_step.init_state(lambda p: init_train_state(p, optimizer), params)
    return train_step, state, key, cfg, model_cfg


def _fake_single_step(model: dict, preset: str, device_type: str, monitor: Any = None) -> tuple:
    """``(train_step, state, key, cfg, model_cfg)``: the single-process trainer's step and first state on
    one fake ``device_type`` device, built as the loop builds them without a mesh
    (:func:`hpfunc.train.single_device.build_single_step`)."""
    from hpfunc import random
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.single_device import build_single_step

    raw = {"model": {"preset": preset, "dtype": "float32", **model},
           "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "clip_norm": 1.0},
           "schedule": {"name": "cosine", "warmup_steps": 1},
           "train": {"steps": 10, "batch_size": 2, "seq_len": 16}}
    cfg = load_config_dict(raw)
    spec, model_cfg = model_spec(cfg.model), build_model_config(cfg.model)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps), spec)
    key = random.key(0)  # on the host, as the loop's data_keys: build_single_step places it
    state, step = build_single_step(cfg, model_cfg, spec, optimizer, lr, key, device_type, monitor=monitor)
    return step, state, key, cfg, model_cfg


def _caller_file() -> str:
    """The innermost source file on the stack outside torch, the fake-device recorder and this file."""
    import os
    import traceback

    from hpfunc.testing import fake_devices

    skip = (os.path.dirname(torch.__file__), os.path.abspath(fake_devices.__file__), os.path.abspath(__file__),
            os.path.dirname(os.__file__))
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if not f.startswith(skip):
            return os.path.relpath(f)
    return "<unknown>"


class _CopyRecorder(TorchDispatchMode):
    """The host-to-device copies made inside: ``(source device, target device, non_blocking, bytes)`` (a
    blocking one from pageable memory makes a GPU's host wait; the recorder of fake_devices counts only
    copies to the host); the bytes are the source tensor's, as the dispatcher sees it."""

    def __init__(self):
        super().__init__()
        self.copies = []
        self.blocking = []  # the source file of each blocking host-to-device copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            src = args[0]
            self.copies.append((src.device.type, torch.device(kwargs["device"]).type,
                                bool(kwargs.get("non_blocking", False)), src.numel() * src.element_size()))
            if self.copies[-1][:3] == ("cpu", "cuda", False):
                self.blocking.append(_caller_file())
        elif func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
            src = args[1]
            self.copies.append((src.device.type, args[0].device.type,
                                bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)),
                                src.numel() * src.element_size()))
        return func(*args, **kwargs)


def fed_and_read_steps(parallel: dict | None, *, steps: int = 4, log_every: int = 2, preset: str = "qwen3-moe-tiny",
                       monitor_every: int | None = None, blocks: bool = True) -> dict:
    """The trainer loop's device side on fake CUDA: each step's host batch through
    :class:`hpfunc.train.batch_feed.BatchFeed` (made on the host before the recording; on a mesh with
    the step's ``put_batch``, each rank's block, unless ``blocks=False``: the whole batch, as before it),
    the step (the parallel one of ``parallel``, or with ``parallel=None`` the single-process trainer's),
    told the loop's count of applied steps (``steps_done``, as the loop does), its scalars into
    :class:`hpfunc.train.readout.StepReadout`, read at the logging steps (every ``log_every``, as the
    loop does on CUDA). ``monitor_every``: the precision monitor's probe in the step. Per step: the host
    syncs and host reads (kind, op, file), the host-to-device copies, the tensors made off the device
    after the feed (op, file) and by it (op, shape), the files of the step's blocking host-to-device copies,
    the batch's devices and, at a logging step, the steps read; the state's devices; on a mesh, the host-to-device copies of one more step handed the global host
    batch itself (``direct_copies``: shard_map's input path)."""
    import os

    from hpfunc import random
    from hpfunc import tree as _tree
    from hpfunc.testing.fake_devices import DeviceRecorder, answer_host_syncs
    from hpfunc.train.batch_feed import BatchFeed
    from hpfunc.train.loop import _local_metrics
    from hpfunc.train.precision_probe import SQ, PrecisionProbe, steps_done
    from hpfunc.train.readout import StepReadout

    os.environ.pop("HPFUNC_CHECK_REP", None)
    monitor = None if monitor_every is None else PrecisionProbe(monitor_every)
    if parallel is None:
        train_step, state, key, cfg, model_cfg = _fake_single_step({}, preset, "cuda", monitor)
        place = None
    else:
        train_step, state, key, cfg, model_cfg = _fake_trainer_step(parallel, {}, preset, "cuda", monitor)
        place = train_step.put_batch if blocks else None
    host = {n: {"tokens": random.randint(random.fold_in(random.key(0), n), (cfg.train.batch_size, cfg.train.seq_len + 1),
                                         0, model_cfg.vocab_size)} for n in range(1, steps + 1)}
    assert {x["tokens"].device.type for x in host.values()} == {"cpu"}
    feed, readout = BatchFeed(host.__getitem__, "cuda", place=place), StepReadout()
    per_step = []
    for n in range(1, steps + 1):
        rec = DeviceRecorder("cuda", on_host_sync=answer_host_syncs(1))
        with _CopyRecorder() as in_step, rec:  # (below the recorder: it sees the ops after it, with their lines)
            with _CopyRecorder() as copies:
                batch = feed.take(n)
            fed = len(rec.off_device)  # made by the feed: the host block's view
            with steps_done(n - 1):  # the loop's own count of applied steps
                state, metrics = train_step(state, batch)
            metrics = _local_metrics(metrics)
            entry = readout.add(n, metrics, keep=("expert_load",) if n % log_every == 0 else ())
            feed.prefetch(n + 1)
            read = readout.read() if n % log_every == 0 else []
        local = [getattr(x, "_local_tensor", x) for x in _tree.leaves(batch)]
        per_step.append({"syncs": [(s.kind, s.op, s.where.split(":")[0]) for s in rec.host_syncs],
                         "host_reads": [(s.kind, s.op, s.where.split(":")[0]) for s in rec.host_reads],
                         "off_device": sorted({(c.op, c.where.split(":")[0]) for c in rec.off_device[fed:]}),
                         "fed_off_device": sorted({(c.op, c.shape) for c in rec.off_device[:fed]}),
                         "batch": batch["tokens"].device.type, "copies": copies.copies, "read": [e.step for e in read],
                         "blocking_in_step": sorted(set(in_step.blocking)),
                         "block": [tuple(x.shape) for x in local], "measured": SQ in metrics,
                         "row": (tuple(entry.row.shape), entry.row.device.type) if entry.row is not None else None,
                         "extras": {k: (tuple(v.shape), v.dtype, v.device.type) for e in read
                                    for k, v in e.extras.items()}})
    direct = None
    if parallel is not None:  # the global host batch handed to the step itself (as evaluation does)
        with steps_done(0), _CopyRecorder() as copies:  # (a step the precision monitor does not measure)
            train_step(state, host[1])
        direct = [c for c in copies.copies if c[0] == "cpu"]
    return {"steps": per_step, "whole": tuple(host[1]["tokens"].shape), "direct_copies": direct,
            "state_devices": sorted({x.device.type for x in _state_leaves(state)})}


class _C10dOps(TorchDispatchMode):
    """The torch.distributed collectives that reach the dispatcher (``c10d.*`` ops), in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "c10d" in name:
            self.ops.append(name.split(".")[-1])
        return func(*args, **(kwargs or {}))


def native_collectives(mesh, axis: str = "fsdp") -> dict:
    """``hpfunc.lax``'s two backend-chosen paths over ``axis`` of ``mesh``, with the collectives each one
    called: a tiled ``psum_scatter`` under ``torch.func.grad`` (gloo: an all-reduce in place, its
    workaround; NCCL and the fake group: the reduce-scatter) and an uneven ``all_to_all`` whose receive
    sizes are exchanged first (gloo: host tensors; else device tensors). Values too (real on gloo)."""
    from hpfunc import lax

    n, me, dev = mesh.axis_size(axis), mesh.axis_index(axis), mesh.device_type
    x = torch.arange(2 * n * 3, dtype=torch.float32, device=dev).view(2 * n, 3) + me
    split = [1] * (n - 1) + [2]  # the last rank gets two rows of each
    y = torch.arange(n + 1, dtype=torch.float32, device=dev).view(n + 1, 1) + 10 * me
    with mesh:
        with _C10dOps() as rs:
            grad = torch.func.grad(lambda t: (lax.psum_scatter(t, axis, tiled=True) ** 2).sum())(x)
        with _C10dOps() as a2a:
            out = lax.all_to_all(y, axis, 0, 0, split_sizes=split)
    real = not (dev != "cpu" and not torch.cuda.is_available())
    return {"psum_scatter_ops": rs.ops, "all_to_all_ops": a2a.ops,
            "grad": (tuple(grad.shape), grad.device.type, grad.tolist() if real else None),
            "all_to_all": (tuple(out.shape), out.device.type, out.reshape(-1).tolist() if real else None)}
