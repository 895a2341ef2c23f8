"""Measure this machine into a hardware profile for the cost model (``hpfunc dryrun --calibrate PATH``).

:func:`calibrate` times, on this CPU with torch's current thread setting:

* ``flops[dtype]``: a square matmul (``torch.mm``) in float32 and bfloat16, FLOP/s achieved (the
  profile's peak, so ``matmul_efficiency`` is 1);
* ``attention_efficiency``: ``F.scaled_dot_product_attention`` (causal) at a small model's shapes,
  FLOP/s achieved over the float32 matmul's;
* ``moe_efficiency``: ``torch._grouped_mm`` of a few experts' rows, the same ratio;
* ``hbm_bw``: a 1 MiB tensor copy (bytes read + written per second; the working set of the small
  models a CPU runs stays in its caches);
* ``op_overhead_s``: the CPU seconds per dispatched operator of hpfunc's training step (the tiny
  Qwen3 MoE's trainer step over 2 gloo ranks, whose FLOPs are negligible:
  :func:`measure_step_op_overhead`), the cost that dominates a small model's step on a CPU (a bare
  aten op under autograd, :func:`measure_op_overhead`, costs an order of magnitude less: the step's
  per-op path is Python, the layout's dispatch and autograd);
* ``intra_node_bw``, ``inter_node_bw``, ``latency_s``: a 2-rank gloo ``all_reduce`` on loopback
  (:class:`hpfunc.testing.RankPool`), bytes one rank sends per second (ring: ``2 (n-1)/n M``) of a
  16 MiB array and half the time of a 4-byte one (the latency per ring message: a 2-rank all-reduce
  waits for two); on one machine both links are that one.

The numbers are the median of a few repeats; on a loaded machine they are what the load leaves.

    >>> p = measure_compute(size=64, repeats=1)
    >>> sorted(p)[:3], p["flops"]["float32"] > 0
    (['attention_efficiency', 'flops', 'hbm_bw'], True)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["calibrate", "measure_compute", "measure_gloo", "measure_op_overhead", "measure_step_op_overhead"]


def _seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure_compute(size: int = 1024, repeats: int = 5) -> dict:
    """Matmul FLOP/s by dtype, attention and grouped-GEMM efficiencies, memory bandwidth (see the module)."""
    import torch
    import torch.nn.functional as F

    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        flops[str(dtype).replace("torch.", "")] = 2.0 * size**3 / _seconds(lambda: torch.mm(a, b), repeats)
    peak = flops["float32"]
    # attention at a small model's shapes: 4 heads of 64, causal (half the positions)
    s, h, d = max(64, size // 2), 4, 64
    q, k, v = (torch.randn(2, h, s, d) for _ in range(3))
    t = _seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
    attention = 4.0 * 2 * h * s * s / 2 * d / t / peak
    # grouped GEMM: 8 experts, rows split evenly
    e, rows, hid, inter = 8, size, max(64, size // 4), max(32, size // 8)
    x = torch.randn(rows, hid)
    w = torch.randn(e, hid, inter)
    offs = torch.arange(1, e + 1, dtype=torch.int32) * (rows // e)
    t = _seconds(lambda: torch._grouped_mm(x, w, offs=offs), repeats)
    moe = 2.0 * rows * hid * inter / t / peak
    # a 1 MiB copy: the small models planned on a CPU keep their activations in its caches (a 32 MiB
    # copy here measured 0.6 GB/s at a load average of 50, the 1 MiB one 50 GB/s)
    big = torch.empty(2**20 // 4)
    t = _seconds(lambda: big.clone(), max(repeats, 20))
    return {"flops": flops, "attention_efficiency": min(1.0, attention), "moe_efficiency": min(1.0, moe),
            "hbm_bw": 2.0 * big.numel() * 4 / t, "op_overhead_s": measure_op_overhead(repeats=repeats)}


def measure_op_overhead(repeats: int = 5) -> float:
    """Seconds per dispatched aten operator of a tiny SwiGLU MLP's forward and backward under autograd
    (its FLOPs are negligible: what is timed is the framework's per-op path)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    w1, w2, w3 = (torch.randn(16, 16, requires_grad=True) for _ in range(3))
    x = torch.randn(8, 16, requires_grad=True)

    def step() -> None:
        for _ in range(10):
            h = F.silu(x @ w1) * (x @ w2)
            (h @ w3).sum().backward()

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        step()
    return _seconds(step, repeats) / max(1, _Count.ops)


def _allreduce_seconds(nbytes: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(max(1, nbytes // 4))
    dist.all_reduce(x)
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure_step_op_overhead(pool: Any, repeats: int = 5) -> float:
    """CPU seconds per dispatched operator of hpfunc's training step: the tiny Qwen3 MoE's trainer step
    (fp32, AdamW, fsdp over the 2 ranks of ``pool``, 2 x 32 tokens per rank, where FLOPs are negligible),
    the median step's CPU time summed over the ranks over its operator count summed over the ranks (the
    framework's per-op path: Python, the layout's tensor dispatch, autograd, the collectives' bookkeeping)."""
    from hpfunc.autoparallel.estimator_check import measure

    raw = {"model": {"preset": "qwen3-moe-tiny", "dtype": "float32", "moe_dispatcher": "padded"},
           "optimizer": {"name": "adamw", "lr": 1e-3}, "train": {"steps": 10, "batch_size": 4, "seq_len": 32},
           "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"], "device": "cpu"}}
    res = pool.run(measure, raw, timed_steps=repeats)
    cpu = statistics.median(sum(r["cpu_seconds"][i] for r in res) for i in range(repeats))
    return cpu / sum(r["ops"] for r in res)


def measure_gloo(nbytes: int = 16 * 2**20, repeats: int = 5, pool: Any = None) -> dict:
    """Bytes per second one rank sends in a 2-rank gloo all-reduce of ``nbytes``, and the latency of a
    4-byte one (``pool``: a running 2-rank :class:`~hpfunc.testing.RankPool`, else one is started)."""
    from hpfunc.testing import RankPool

    own = pool is None
    pool = pool or RankPool(2, timeout=300).start()
    try:
        big = max(pool.run(_allreduce_seconds, nbytes, repeats))
        small = max(pool.run(_allreduce_seconds, 4, repeats))
    finally:
        if own:
            pool.close()
    n = 2
    sent = 2.0 * (n - 1) / n * nbytes
    # a 2-rank ring all-reduce waits for 2 messages (hpfunc.autoparallel.step_time.ring_steps)
    return {"link_bw": sent / max(big - small, 1e-9), "latency_s": small / 2}


def calibrate(name: str = "cpu-measured", *, size: int = 1024, repeats: int = 5, pool: Any = None) -> Any:
    """A :class:`~hpfunc.autoparallel.hardware.Hardware` measured on this machine (see the module):
    efficiencies of matmul and links 1 (their figures are what was achieved); host copies synchronous."""
    import os

    from hpfunc.autoparallel.hardware import HARDWARE, Hardware

    c = measure_compute(size=size, repeats=repeats)
    from hpfunc.testing import RankPool

    own = pool is None
    pool = pool or RankPool(2, timeout=300).start()
    try:
        g = measure_gloo(repeats=repeats, pool=pool)
        c["op_overhead_s"] = measure_step_op_overhead(pool, repeats=repeats)
    finally:
        if own:
            pool.close()
    cpu = HARDWARE["cpu"]
    return Hardware(name=name, flops=c["flops"], hbm_bytes=cpu.hbm_bytes, hbm_bw=c["hbm_bw"],
                    intra_node_bw=g["link_bw"], inter_node_bw=g["link_bw"], host_bw=c["hbm_bw"],
                    ranks_per_node=max(2, os.cpu_count() or 2), latency_s=g["latency_s"], matmul_efficiency=1.0,
                    attention_efficiency=c["attention_efficiency"], moe_efficiency=c["moe_efficiency"],
                    link_efficiency=1.0, async_copy=False, op_overhead_s=c["op_overhead_s"], host_overlap=False)
