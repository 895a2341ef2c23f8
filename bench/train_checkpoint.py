"""What checkpoints cost the main job: ``hpfunc train examples/configs/qwen3_moe_tiny.yaml`` with
``checkpoint.every`` off, asynchronous and synchronous.

Each setting runs the whole job (4 processes, the 2x2 mesh of the config) into its own temporary
folder; the table reports, from the run's ``summary.json``, the number of saves, the time the loop
was held per save (async: the staging copy; sync: the whole write), the write time per save, the
training time and the wall-clock time of the command, with the load average. The JSON lands in
``--out``.

    .venv/bin/python bench/train_checkpoint.py
    .venv/bin/python bench/train_checkpoint.py --steps 60 --every 20
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "configs" / "qwen3_moe_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_checkpoint.json"))
    args = ap.parse_args(argv)

    settings = [("off", ["checkpoint.every=0"]),
                ("async", [f"checkpoint.every={args.every}", "checkpoint.async_save=true"]),
                ("sync", [f"checkpoint.every={args.every}", "checkpoint.async_save=false"])]
    rows = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONWARNINGS"] = "ignore"
    for name, sets in settings:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "hpfunc.cli", "train", args.config, "--out", tmp, "--steps", str(args.steps),
                   "--set", "output.progress=none", "--set", "output.sample_tokens=0", "--set", "output.plot=false",
                   *[x for s in sets for x in ("--set", s)]]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            if proc.returncode:
                raise SystemExit(f"{name}: hpfunc train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            summary = json.loads((pathlib.Path(tmp) / "summary.json").read_text())
        ck = summary.get("checkpoints", {})
        rows.append({"setting": name, "saves": ck.get("saves", 0), "blocked_s_per_save": ck.get("blocked_s_per_save"),
                     "write_s_per_save": ck.get("write_s_per_save"), "train_time_s": summary["train_time_s"],
                     "wall_s": wall, "last_loss": summary["last_loss"], "load_avg": os.getloadavg()[0]})
    print(f"{'setting':8s} {'saves':>5s} {'blocked/save':>13s} {'write/save':>11s} {'train s':>8s} {'wall s':>7s} "
          f"{'last loss':>9s} {'load':>5s}")
    for r in rows:
        b = "-" if r["blocked_s_per_save"] is None else f"{r['blocked_s_per_save']:.3f} s"
        w = "-" if r["write_s_per_save"] is None else f"{r['write_s_per_save']:.3f} s"
        print(f"{r['setting']:8s} {r['saves']:5d} {b:>13s} {w:>11s} {r['train_time_s']:8.1f} {r['wall_s']:7.1f} "
              f"{r['last_loss']:9.4f} {r['load_avg']:5.1f}")
    result = {"config": args.config, "steps": args.steps, "every": args.every, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
