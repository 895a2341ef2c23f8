"""Measure this machine into a hardware profile for the cost model (``hpfunc dryrun --calibrate PATH``).

:func:`calibrate` times, on this CPU with torch's current thread setting:

* ``flops[dtype]``: a square matmul (``torch.mm``) in float32 and bfloat16, FLOP/s achieved (the
  profile's peak, so ``matmul_efficiency`` is 1);
* ``attention_efficiency``: ``F.scaled_dot_product_attention`` (causal) at a small model's shapes,
  FLOP/s achieved over the float32 matmul's;
* ``moe_efficiency``: ``torch._grouped_mm`` of a few experts' rows, the same ratio;
* ``hbm_bw``: a large tensor copy (bytes read + written per second);
* ``intra_node_bw``, ``inter_node_bw``, ``latency_s``: a 2-rank gloo ``all_reduce`` on loopback
  (:class:`hpfunc.testing.RankPool`), bytes one rank sends per second (ring: ``2 (n-1)/n M``) of a
  16 MiB array and the time of a 4-byte one; on one machine both links are that one.

The numbers are the median of a few repeats; on a loaded machine they are what the load leaves.

    >>> p = measure_compute(size=64, repeats=1)
    >>> sorted(p)[:3], p["flops"]["float32"] > 0
    (['attention_efficiency', 'flops', 'hbm_bw'], True)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["calibrate", "measure_compute", "measure_gloo"]


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
    big = torch.empty(8 * 2**20 // 4 * max(1, size // 256))
    t = _seconds(lambda: big.clone(), repeats)
    return {"flops": flops, "attention_efficiency": min(1.0, attention), "moe_efficiency": min(1.0, moe),
            "hbm_bw": 2.0 * big.numel() * 4 / t}


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
    return {"link_bw": sent / max(big - small, 1e-9), "latency_s": small}


def calibrate(name: str = "cpu-measured", *, size: int = 1024, repeats: int = 5, pool: Any = None) -> Any:
    """A :class:`~hpfunc.autoparallel.hardware.Hardware` measured on this machine (see the module):
    efficiencies of matmul and links 1 (their figures are what was achieved); host copies synchronous."""
    import os

    from hpfunc.autoparallel.hardware import HARDWARE, Hardware

    c = measure_compute(size=size, repeats=repeats)
    g = measure_gloo(repeats=repeats, pool=pool)
    cpu = HARDWARE["cpu"]
    return Hardware(name=name, flops=c["flops"], hbm_bytes=cpu.hbm_bytes, hbm_bw=c["hbm_bw"],
                    intra_node_bw=g["link_bw"], inter_node_bw=g["link_bw"], host_bw=c["hbm_bw"],
                    ranks_per_node=max(2, os.cpu_count() or 2), latency_s=g["latency_s"], matmul_efficiency=1.0,
                    attention_efficiency=c["attention_efficiency"], moe_efficiency=c["moe_efficiency"],
                    link_efficiency=1.0, async_copy=False)
