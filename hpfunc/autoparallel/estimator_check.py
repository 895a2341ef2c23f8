"""The cost model against real runs: five small plans of the tiny Qwen3 MoE on 4 gloo ranks.

:data:`PLANS` are the trainer configs (fsdp, fsdp x tp, fsdp x ep, a 1F1B pipeline over fsdp with and
without full recompute) of one workload (:func:`config`: ``qwen3-moe-tiny`` in fp32, AdamW, the padded
dispatcher, 8 sequences of 64 tokens by default). :func:`measure` runs each one's real step on a real
process group (every rank calls it), measures its peak on storage liveness, counts its dispatched ops
and times its steps in CPU seconds; :func:`estimate` is the cost model's figure for the same config (no reserve: the
measurement has no allocator). ``tests/autoparallel/test_autoparallel_estimator.py`` holds the
estimate within 10% of the busiest rank's measured peak for each plan at :data:`WORKLOADS`, and the
estimated ranking against a recorded measured table; ``bench/estimator.py`` measures that table (CPU
seconds per step summed over the ranks) beside the estimates.

    >>> sorted(PLANS)
    ['fsdp2xep2', 'fsdp2xtp2', 'fsdp4', 'pp2xfsdp2 1f1b', 'pp2xfsdp2 1f1b remat=full']
    >>> e = estimate(config("fsdp4"))
    >>> e["layout"], e["memory_bytes"]["reserve"]
    ('fsdp4 remat=none', 0.0)
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["PLANS", "config", "estimate", "WORLD", "WORKLOADS", "measure"]

# (batch, sequence) workloads the test holds the peak bound at (bench/estimator.py also runs 8 x 32)
WORKLOADS = ((8, 64), (16, 64))

WORLD = 4

_PP = {"schedule": "1f1b", "microbatches": 2}
PLANS: dict[str, dict[str, Any]] = {
    "fsdp4": {"mesh": {"fsdp": 4}, "plan": ["fsdp"]},
    "fsdp2xtp2": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]},
    "fsdp2xep2": {"mesh": {"fsdp": 2, "ep": 2}, "plan": ["fsdp", "ep"]},
    "pp2xfsdp2 1f1b": {"mesh": {"pp": 2, "fsdp": 2}, "plan": [{"pp": dict(_PP)}, "fsdp"]},
    "pp2xfsdp2 1f1b remat=full": {"mesh": {"pp": 2, "fsdp": 2},
                                  "plan": [{"pp": {**_PP, "remat": "nothing_saveable"}}, "fsdp"]},
}


def config(plan: str, *, batch_size: int = 8, seq_len: int = 64) -> dict[str, Any]:
    """The raw trainer config of the plan called ``plan`` (a key of :data:`PLANS`)."""
    if plan not in PLANS:
        raise KeyError(f"plan: expected one of {', '.join(PLANS)}, found {plan!r}")
    return {"model": {"preset": "qwen3-moe-tiny", "dtype": "float32", "moe_dispatcher": "padded"},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"steps": 10, "batch_size": batch_size, "seq_len": seq_len},
            "parallel": {**PLANS[plan], "device": "cpu"}}


def measure(raw: Mapping[str, Any], *, timed_steps: int = 0) -> dict:
    """The trainer's real step of ``raw`` on this process's process group (every rank calls it, e.g.
    through :meth:`hpfunc.testing.RankPool.run`): the peak of the first step on storage liveness (as
    :func:`hpfunc.autoparallel.dryrun.measure_step`: ``peak_bytes`` is the state at rest plus the
    step's peak) and the operators it dispatches (``ops``); then ``timed_steps`` steps, each timed
    in this process's CPU seconds (``cpu_seconds``; a wait in a collective that sleeps is not in it)
    and wall seconds (``step_seconds``)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpfunc.autoparallel.dryrun import PeakTracker, _build, _local_bytes, _sayer

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    b = _build(raw, "cpu", _sayer(False))
    state, train_step = b["state"], b["train_step"]
    at_rest = sum(_local_bytes(state.params).values()) + sum(_local_bytes(state.opt_state).values())
    tracker = PeakTracker()
    with _Count(), tracker:
        state, metrics = train_step(state, b["batch"])
    loss = float(metrics["loss"])
    del metrics
    cpu, wall = [], []
    for _ in range(timed_steps):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        state, metrics = train_step(state, b["batch"])
        float(metrics["loss"])
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return {"rank": dist.get_rank(), "at_rest_bytes": at_rest, "step_peak_bytes": tracker.peak,
            "peak_bytes": at_rest + tracker.peak, "peak_by_op": dict(list(tracker.peak_by_op.items())[:8]),
            "ops": _Count.ops, "loss": loss, "cpu_seconds": cpu, "step_seconds": wall}


def estimate(raw: Mapping[str, Any], hardware: Any = "cpu") -> dict[str, Any]:
    """The cost model's memory (no reserve) and step time of ``raw`` on ``hardware`` (a preset name,
    a :class:`~hpfunc.autoparallel.hardware.Hardware`, e.g. a calibrated profile)."""
    from hpfunc.autoparallel.hardware import hardware as _hardware
    from hpfunc.autoparallel.memory_model import memory
    from hpfunc.autoparallel.step_time import step_time
    from hpfunc.autoparallel.trainer_config import describe_model, layout_of, workload_of
    from hpfunc.train.config import load_config_dict

    cfg = load_config_dict(dict(raw))
    _, desc = describe_model(cfg)
    lay, work = layout_of(cfg), workload_of(cfg, reserve_bytes=0)
    mem = memory(desc, lay, work)
    t = step_time(desc, lay, work, _hardware(hardware))
    return {"layout": lay.name, "memory_bytes": dict(mem.terms), "memory_total_bytes": mem.total,
            "pipeline_rank": mem.rank, "step_seconds": t.total, "time_seconds": dict(t.terms),
            "busy_seconds": t.busy_seconds}
