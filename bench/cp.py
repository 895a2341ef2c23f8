"""Context-parallel attention on 2 and 4 gloo ranks: all-gather, ring (with and without overlap), Ulysses
and the 2-D hybrid, at two sequence lengths, side by side in one run.

Each rank runs one attention layer's core (``hpfunc.models.context_attention`` on its causally balanced
share of the sequence; q ``[B, Hq, S/P, D]``, GQA k, v ``[B, Hkv, S/P, D]``, fp32), forward and backward,
the strategies interleaved iteration by iteration. Per strategy the table gives:

- tokens/s: the global sequence (``B S`` tokens) over the median step time (forward + backward; the
  ranks share the machine's cores, so on a CPU host this measures the algorithm's overheads, not a
  cluster's scaling);
- bytes per layer: what rank 0 sends per call (``hpfunc.comm_stats``, forward + backward), next to the
  formula of docs/reference.md#context-parallel-attention;
- saved: the activation bytes the forward keeps for the backward on rank 0 (storage liveness,
  :func:`hpfunc.memory.saved_activations`; inputs included), next to the same measure for the unsplit
  sequence on one rank with the same blocks (``axis=None``) and with ``scaled_dot_product_attention``.

The unsplit rows run on rank 0 alone (the others wait). The load average is printed; the JSON lands in
``--out`` (default ``bench/results/cp.json``).

    python bench/cp.py                         # S = 1024 and 2048, 2 and 4 ranks
    python bench/cp.py --seqs 256,512 --iters 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


def formula_bytes(impl: str, world: int, pu: int, B: int, S: int, hq: int, hkv: int, D: int) -> float:
    """Bytes one rank sends per call, forward + backward (fp32), by docs/reference.md."""
    import math

    N = B * S
    h, h_kv = hq * D * 4, hkv * D * 4
    deg = world if impl == "ulysses" else pu  # Ulysses above the KV heads repeats them (replicate_kv)
    h_kv_a2a = hkv * (deg // math.gcd(hkv, deg)) * D * 4
    if impl == "allgather":  # all-gather of K, V forward, reduce-scatter of dK, dV backward
        return 2 * (world - 1) / world * 2 * N * h_kv
    if impl.startswith("ring"):  # P - 1 transfers of K, V each way
        return 2 * (world - 1) * 2 * N * h_kv / world
    if impl == "ulysses":  # q, out (h) and k, v (h_kv): N h / P per rank, (P-1)/P leaves, twice
        return 2 * (world - 1) / world * (2 * N * h + 2 * N * h_kv_a2a) / world
    pr = world // pu  # hybrid: Ulysses over pu of the group's tokens, ring over pr of the group's heads
    return (2 * (pu - 1) / pu * (2 * N * h + 2 * N * h_kv_a2a) / world
            + 2 * (pr - 1) * 2 * N * h_kv_a2a / pu / pr)


def rank_bench(args: dict) -> dict:
    import time

    import hpfunc
    from hpfunc.memory import saved_activations
    from hpfunc.models.attention_blocks import dense_attention
    from hpfunc.models.context_attention import context_attention
    from hpfunc.models.sequence_split import SequenceSplit

    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    pu = 2 if world >= 4 else 1
    mesh = hpfunc.Mesh({"ring": world // pu, "uly": pu})
    axes = ("ring", "uly")
    B, hq, hkv, D = args["batch"], args["q_heads"], args["kv_heads"], args["head_dim"]
    impls = ["allgather", "ring", "ring (no overlap)", "ulysses"] + (["hybrid"] if pu > 1 else [])
    out: dict = {}
    for S in args["seqs"]:
        split = SequenceSplit(S, world)
        g = torch.Generator().manual_seed(S)
        q = torch.randn(B, hq, split.local_len, D, generator=g)
        k = torch.randn(B, hkv, split.local_len, D, generator=g)
        v = torch.randn(B, hkv, split.local_len, D, generator=g)

        def call(impl: str, q, k, v):
            kw = dict(axis=axes, impl=impl.split(" ")[0], overlap="no overlap" not in impl, replicate_kv=True)
            if impl == "hybrid":
                kw.update(axis="ring", ulysses_axis="uly")
            return context_attention(q, k, v, split, **kw)

        times: dict = {i: [] for i in impls}
        sent: dict = {}
        with mesh:
            for it in range(args["iters"] + 1):
                for impl in impls:
                    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                    torch.distributed.barrier()
                    with hpfunc.comm_stats() as stats:
                        t0 = time.perf_counter()
                        call(impl, qq, kk, vv).sum().backward()
                        dt = time.perf_counter() - t0
                    if it:  # the first round warms up
                        times[impl].append(dt)
                    sent[impl] = float(stats.total_sent_bytes())
            saved = {impl: saved_activations(lambda a, b, c, i=impl: call(i, a, b, c), q, k, v).device_bytes
                     for impl in impls}
        res = {}
        for impl in impls:
            ms = statistics.median(times[impl]) * 1e3
            res[impl] = {"ms": ms, "tokens_per_s": B * S / (ms / 1e3), "sent_bytes": sent[impl],
                         "formula_bytes": formula_bytes(impl, world, pu, B, split.padded_len, hq, hkv, D),
                         "saved_bytes": saved[impl]}
        torch.distributed.barrier()
        if rank == 0:  # the unsplit sequence on one rank
            qf = torch.randn(B, hq, S, D, generator=g)
            kf, vf = torch.randn(B, hkv, S, D, generator=g), torch.randn(B, hkv, S, D, generator=g)
            whole = SequenceSplit(S, 1)
            kernels = {  # the same blocks on one rank (axis=None: no communication), and torch's kernel
                "unsplit (same blocks)": lambda a, b, c: context_attention(
                    whole.permute(a, 2), whole.permute(b, 2), whole.permute(c, 2), whole, axis=None, impl="allgather"),
                "unsplit (sdpa)": lambda a, b, c: dense_attention(a, b, c, causal=True),
            }
            for name, fn in kernels.items():
                ts = []
                for it in range(args["iters"] + 1):
                    a, b, c = (t.clone().requires_grad_(True) for t in (qf, kf, vf))
                    t0 = time.perf_counter()
                    fn(a, b, c).sum().backward()
                    if it:
                        ts.append(time.perf_counter() - t0)
                ms = statistics.median(ts) * 1e3
                res[name] = {"ms": ms, "tokens_per_s": B * S / (ms / 1e3), "sent_bytes": 0.0, "formula_bytes": 0.0,
                             "saved_bytes": saved_activations(fn, qf, kf, vf).device_bytes}
        torch.distributed.barrier()
        out[S] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048", help="sequence lengths (comma-separated)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cp.json"))
    a = ap.parse_args(argv)
    from hpfunc.testing import RankPool
    from hpfunc.train.output import to_json

    args = {"seqs": [int(s) for s in a.seqs.split(",")], "batch": a.batch, "q_heads": a.q_heads,
            "kv_heads": a.kv_heads, "head_dim": a.head_dim, "iters": a.iters}
    out: dict = {"args": args, "worlds": {}, "load_average": []}
    for world in [int(w) for w in a.worlds.split(",")]:
        with RankPool(world, timeout=3600) as pool:
            res = pool.run(rank_bench, args)[0]
        load = os.getloadavg()
        out["worlds"][world] = res
        out["load_average"].append(load)
        for S, rows in res.items():
            print(f"\n{world} ranks, S = {S}, B = {a.batch}, Hq {a.q_heads}, Hkv {a.kv_heads}, D {a.head_dim}, fp32, "
                  f"forward + backward; load average {load[0]:.2f}")
            print(f"{'strategy':<28}{'ms':>9}{'tokens/s':>10}{'KiB/layer':>11}{'formula':>9}{'saved KiB':>11}")
            for name, r in rows.items():
                print(f"{name:<28}{r['ms']:>9.1f}{r['tokens_per_s']:>10.0f}{r['sent_bytes'] / 1024:>11.1f}"
                      f"{r['formula_bytes'] / 1024:>9.1f}{r['saved_bytes'] / 1024:>11.1f}")
    print("\nKiB/layer: bytes rank 0 sends per call (forward + backward) by hpfunc.comm_stats; formula: "
          "docs/reference.md#context-parallel-attention; saved: activation bytes rank 0's forward keeps for the "
          "backward (storage liveness, inputs included); unsplit rows: the whole sequence on rank 0 alone")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(to_json(out, where=a.out, indent=2))
    print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
