"""The cost model against real runs: peak memory and step-time ranking of five small plans on 4 gloo ranks.

For each plan of hpfunc.autoparallel.estimator_check (the tiny Qwen3 MoE in fp32: fsdp 4, fsdp 2 x tp 2,
fsdp 2 x ep 2, pp 2 x fsdp 2 1F1B with and without full recompute), the real step runs on a pool of 4
gloo ranks: the first step measures the peak (storage liveness: the state at rest plus the most bytes
the step's storages hold at once, the busiest rank), then ``--steps`` steps are timed (the median of the
slowest rank's steps). Beside them the cost model's peak (no reserve) and step time on ``--hardware``
(default: this machine calibrated now, as ``hpfunc dryrun --calibrate`` does). Prints the table, the two
rankings by time and whether they agree, and the load average (2 cores shared: times move with it);
writes JSON.

Usage:
    python bench/estimator.py [--steps 5] [--hardware cpu|PATH.json] [--batch 8 --seq 64]
                              [--out bench/results/estimator.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from _report import write_json  # noqa: E402

from hpfunc.autoparallel.dryrun import measure_step  # noqa: E402
from hpfunc.autoparallel.estimator_check import PLANS, WORLD, config, estimate  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hardware", default=None, help="a preset or a profile PATH.json (default: calibrate now)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "estimator.json"))
    args = parser.parse_args(argv)
    import torch

    from hpfunc.testing import RankPool

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    pool = RankPool(WORLD, timeout=900, env={"PYTHONWARNINGS": "ignore"}).start()
    try:
        if args.hardware is None:
            from hpfunc.autoparallel.calibrate import calibrate

            pool2 = RankPool(2, timeout=300).start()
            try:
                hw = calibrate(name="cpu-calibrated", pool=pool2)
            finally:
                pool2.close()
        else:
            from hpfunc.autoparallel.hardware import hardware

            hw = hardware(args.hardware)
        rows = []
        for name in PLANS:
            raw = config(name, batch_size=args.batch, seq_len=args.seq)
            t0 = time.perf_counter()
            res = pool.run(measure_step, raw, timed_steps=args.steps)
            peak = max(r["peak_bytes"] for r in res)
            step = statistics.median(max(r["step_seconds"][i] for r in res) for i in range(args.steps))
            est = estimate(raw, hw)
            rows.append({"plan": name, "measured_peak_bytes": peak, "estimated_peak_bytes": est["memory_total_bytes"],
                         "peak_ratio": est["memory_total_bytes"] / peak, "measured_step_seconds": step,
                         "estimated_step_seconds": est["step_seconds"], "estimate": est,
                         "per_rank_peak_bytes": [r["peak_bytes"] for r in res],
                         "loss": res[0]["loss"], "wall_seconds": time.perf_counter() - t0})
    finally:
        pool.close()
    load1 = os.getloadavg()
    measured_rank = [r["plan"] for r in sorted(rows, key=lambda r: r["measured_step_seconds"])]
    estimated_rank = [r["plan"] for r in sorted(rows, key=lambda r: r["estimated_step_seconds"])]
    print(f"tiny Qwen3 MoE, fp32, batch {args.batch} x {args.seq}, 4 gloo ranks; hardware {hw.name}; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'plan':28} {'meas. peak MiB':>14} {'est. MiB':>9} {'est/meas':>8} {'meas. step ms':>13} "
          f"{'est. ms':>8}")
    for r in rows:
        print(f"{r['plan']:28} {r['measured_peak_bytes'] / 2**20:14.3f} {r['estimated_peak_bytes'] / 2**20:9.3f} "
              f"{r['peak_ratio']:8.3f} {r['measured_step_seconds'] * 1e3:13.1f} "
              f"{r['estimated_step_seconds'] * 1e3:8.1f}")
    agree = measured_rank == estimated_rank
    print("ranking by measured step time: ", " < ".join(measured_rank))
    print("ranking by estimated step time:", " < ".join(estimated_rank))
    print(f"rankings agree: {agree}")
    from hpfunc.autoparallel.hardware import to_json

    write_json(args.out, {"batch": args.batch, "seq_len": args.seq, "steps": args.steps, "hardware": to_json(hw),
                          "load_average": {"before": load0, "after": load1}, "rows": rows,
                          "measured_ranking": measured_rank, "estimated_ranking": estimated_rank,
                          "rankings_agree": agree})


if __name__ == "__main__":
    main()
