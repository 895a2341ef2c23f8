"""The cost model against real runs: peak memory and step-time ranking of five small plans on 4 gloo ranks.

For each plan of hpfunc.autoparallel.estimator_check (the tiny Qwen3 MoE in fp32: fsdp 4, fsdp 2 x tp 2,
fsdp 2 x ep 2, pp 2 x fsdp 2 1F1B with and without full recompute) and each workload (``--workloads``,
batch x sequence), the real step runs on a pool of 4 gloo ranks (``estimator_check.measure``): the first
step measures the peak (storage liveness: the state at rest plus the most bytes the step's storages hold
at once, the busiest rank) and its operator count, then ``--steps`` steps are timed. The time compared is
the **CPU seconds of a step summed over the 4 ranks** (the median over the steps): the machine has 2 cores
shared with other work, so wall time is mostly the load's; the summed CPU time is what the step costs the
cores. Beside them the cost model's peak (no reserve) and its ranks' busy time summed
(``TimeEstimate.busy_seconds``) and step time on ``--hardware`` (default: this machine calibrated now, as
``hpfunc dryrun --calibrate`` does). Prints the table, the two rankings and whether they agree, and the
load average; writes JSON.

Usage:
    python bench/estimator.py [--steps 7] [--hardware cpu|PATH.json] [--workloads 8x32 8x64 16x64]
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

from hpfunc.autoparallel.estimator_check import PLANS, WORLD, config, estimate, measure  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--hardware", default=None, help="a preset or a profile PATH.json (default: calibrate now)")
    parser.add_argument("--workloads", nargs="+", default=["8x32", "8x64", "16x64"])
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
        for wl in args.workloads:
            batch, seq = (int(x) for x in wl.split("x"))
            for name in PLANS:
                raw = config(name, batch_size=batch, seq_len=seq)
                t0 = time.perf_counter()
                res = pool.run(measure, raw, timed_steps=args.steps)
                peak = max(r["peak_bytes"] for r in res)
                cpu = statistics.median(sum(r["cpu_seconds"][i] for r in res) for i in range(args.steps))
                wall = statistics.median(max(r["step_seconds"][i] for r in res) for i in range(args.steps))
                est = estimate(raw, hw)
                rows.append({"workload": wl, "plan": name, "measured_peak_bytes": peak,
                             "estimated_peak_bytes": est["memory_total_bytes"],
                             "peak_ratio": est["memory_total_bytes"] / peak, "measured_cpu_seconds": cpu,
                             "measured_wall_seconds": wall, "estimated_busy_seconds": est["busy_seconds"],
                             "estimated_step_seconds": est["step_seconds"], "ops": [r["ops"] for r in res],
                             "estimate": est, "per_rank_peak_bytes": [r["peak_bytes"] for r in res],
                             "loss": res[0]["loss"], "wall_seconds": time.perf_counter() - t0,
                             "load_average": os.getloadavg()[0]})
    finally:
        pool.close()
    load1 = os.getloadavg()
    print(f"tiny Qwen3 MoE, fp32, 4 gloo ranks; hardware {hw.name} (op overhead {hw.op_overhead_s * 1e6:.1f} us, "
          f"collective latency {hw.latency_s * 1e6:.0f} us); load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'workload':8} {'plan':28} {'meas. MiB':>9} {'est. MiB':>9} {'est/meas':>8} {'ops/rank':>10} "
          f"{'CPU ms (sum)':>12} {'est. busy ms':>12} {'wall ms':>8} {'load':>5}")
    agree = {}
    for wl in args.workloads:
        sub = [r for r in rows if r["workload"] == wl]
        for r in sub:
            print(f"{wl:8} {r['plan']:28} {r['measured_peak_bytes'] / 2**20:9.3f} {r['estimated_peak_bytes'] / 2**20:9.3f} "
                  f"{r['peak_ratio']:8.3f} {max(r['ops']):10d} {r['measured_cpu_seconds'] * 1e3:12.1f} "
                  f"{r['estimated_busy_seconds'] * 1e3:12.1f} {r['measured_wall_seconds'] * 1e3:8.1f} "
                  f"{r['load_average']:5.1f}")
        measured = [r["plan"] for r in sorted(sub, key=lambda r: r["measured_cpu_seconds"])]
        estimated = [r["plan"] for r in sorted(sub, key=lambda r: r["estimated_busy_seconds"])]
        agree[wl] = {"measured_ranking": measured, "estimated_ranking": estimated, "agree": measured == estimated}
        print(f"  {wl} measured (CPU, summed): ", " < ".join(measured))
        print(f"  {wl} estimated (busy, summed):", " < ".join(estimated), "" if measured == estimated else "  (differs)")
    from hpfunc.autoparallel.hardware import to_json

    write_json(args.out, {"steps": args.steps, "hardware": to_json(hw),
                          "load_average": {"before": load0, "after": load1}, "rows": rows, "rankings": agree})


if __name__ == "__main__":
    main()
