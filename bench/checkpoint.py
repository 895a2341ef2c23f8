"""Checkpoint throughput and what a save costs the training loop: synchronous vs asynchronous, side by side.

Ranks of a :class:`hpfunc.testing.RankPool` (gloo) hold a train-state-like tree (parameters and two
AdamW-like moments, fp32 DTensors sharded on ``fsdp``, of ``--mb`` MB in all) and measure, in one run:

- ``save``: :func:`hpfunc.checkpoint.save` (DCP write, fsync, CRC-32 of every file, marker, rename): MB/s;
- ``load``: :func:`hpfunc.checkpoint.load` into a target of the same layout, with checksum verification
  and without (``verify=False``): MB/s;
- ``reshard load``: into a replicated layout (every rank reads the whole state);
- a loop of ``--steps`` steps of stand-in compute (matmuls, about ``--step-ms`` ms each) that saves every
  ``--every`` steps, once with synchronous saves and once with :class:`hpfunc.checkpoint.AsyncSaver`:
  the time the loop is blocked per save (the save call; for async, staging plus waiting for the previous
  save) and the loop's wall time.

MB are 10^6 bytes of checkpoint files. The table and the load average go to stdout, the JSON to ``--out``.

    .venv/bin/python bench/checkpoint.py
    .venv/bin/python bench/checkpoint.py --ranks 4 --mb 128
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time


def _rank_bench(root: str, mb: float, steps: int, every: int, step_ms: float, repeats: int) -> dict:
    import torch

    import hpfunc
    from hpfunc import P, checkpoint

    torch.set_num_threads(1)
    mesh = hpfunc.Mesh({"fsdp": torch.distributed.get_world_size()})
    n = int(mb * 1e6 / 4 / 3 / 1024)  # rows of 1024 fp32, three trees
    g = torch.Generator().manual_seed(0)
    tree = lambda: {f"layer{i}": torch.randn(n // 4, 1024, generator=g) for i in range(4)}  # noqa: E731
    state = {"params": tree(), "mu": tree(), "nu": tree(), "step": 0}
    state = hpfunc.shard(state, mesh, P("fsdp"))
    target = checkpoint.abstract(state)
    replicated = checkpoint.abstract_like(P(), mesh, target)
    out: dict = {"save_s": [], "load_s": [], "load_noverify_s": [], "reshard_load_s": []}
    for r in range(repeats):
        path = os.path.join(root, f"bench_{r}")
        torch.distributed.barrier()
        t = time.perf_counter()
        res = checkpoint.save(path, state, step=r)
        out["save_s"].append(time.perf_counter() - t)
        out["bytes"] = res.bytes
        for key, tgt, verify in (("load_s", target, True), ("load_noverify_s", target, False),
                                 ("reshard_load_s", replicated, True)):
            torch.distributed.barrier()
            t = time.perf_counter()
            checkpoint.load(path, tgt, verify=verify)
            out[key].append(time.perf_counter() - t)

    a = torch.randn(256, 256, generator=g)

    def compute() -> None:  # stand-in for a training step of about step_ms
        end = time.perf_counter() + step_ms / 1e3
        while time.perf_counter() < end:
            a.mul_(0.999).add_(a @ a * 1e-6)
        for leaf in hpfunc.tree.leaves(state["params"]):
            leaf.to_local().add_(1e-3)  # the state changes every step (staging must copy)

    for mode in ("sync", "async"):
        saver = checkpoint.AsyncSaver() if mode == "async" else None
        blocked = []
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            compute()
            if s % every == 0:
                path = os.path.join(root, f"{mode}_{s}")
                if saver is None:
                    t = time.perf_counter()
                    checkpoint.save(path, state, step=s)
                    blocked.append(time.perf_counter() - t)
                else:
                    blocked.append(saver.save(path, state, step=s).blocked_s)
        if saver is not None:
            t = time.perf_counter()
            saver.close()
            out["async_final_wait_s"] = time.perf_counter() - t
        out[f"{mode}_loop_s"] = time.perf_counter() - t0
        out[f"{mode}_blocked_s"] = blocked
    out["compute_only_s"] = steps * step_ms / 1e3
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=float, default=48.0, help="checkpoint size in MB (10^6 bytes), all ranks")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=200.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "checkpoint.json"))
    args = ap.parse_args(argv)

    from hpfunc.testing import RankPool
    from hpfunc.train.output import to_json, write_atomic

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as root, RankPool(args.ranks, timeout=900) as pool:
        r = pool.run0(_rank_bench, root, args.mb, args.steps, args.every, args.step_ms, args.repeats)
    load_after = os.getloadavg()
    mb = r["bytes"] / 1e6
    best = {k: min(r[k]) for k in ("save_s", "load_s", "load_noverify_s", "reshard_load_s")}
    rows = [("save (DCP + fsync + crc32 + marker + rename)", best["save_s"], mb / best["save_s"]),
            ("load, same layout, checksums verified", best["load_s"], mb / best["load_s"]),
            ("load, same layout, verify=False", best["load_noverify_s"], mb / best["load_noverify_s"]),
            ("load resharded to replicated (each rank reads all)", best["reshard_load_s"],
             mb * args.ranks / best["reshard_load_s"])]
    print(f"checkpoint of {mb:.1f} MB on {args.ranks} gloo ranks (fsdp), best of {args.repeats}; "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'operation':52s} {'seconds':>8s} {'MB/s':>8s}")
    for name, s, rate in rows:
        print(f"{name:52s} {s:8.3f} {rate:8.1f}")
    saves = len(r["sync_blocked_s"])
    print(f"\nloop of {args.steps} steps of ~{args.step_ms:.0f} ms compute, a save every {args.every} "
          f"({saves} saves); compute alone {r['compute_only_s']:.2f} s")
    print(f"{'mode':8s} {'blocked per save (s)':>22s} {'blocked total (s)':>18s} {'loop wall (s)':>14s}")
    for mode in ("sync", "async"):
        b = r[f"{mode}_blocked_s"]
        print(f"{mode:8s} {sum(b) / len(b):22.3f} {sum(b):18.3f} {r[f'{mode}_loop_s']:14.2f}")
    print(f"(async: the last save's write finished {r['async_final_wait_s']:.2f} s after the loop)")
    result = {"bench": "checkpoint", "ranks": args.ranks, "mb": mb, "repeats": args.repeats,
              "steps": args.steps, "every": args.every, "step_ms": args.step_ms,
              "best_s": best, "mb_per_s": {name: rate for name, _, rate in rows}, "raw": r,
              "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "platform": platform.platform()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_atomic(args.out, to_json(result, where=args.out, indent=1))
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
