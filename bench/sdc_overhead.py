"""What the SDC check costs a training step: ddp over 2 gloo ranks, the trainer's Qwen3 step, check off vs on.

Each rank builds the same step twice under ``hpfunc.parallelize`` (``plans.ddp("dp")`` and
``plans.ddp("dp").with_sdc_check("raise")``) and times them in interleaved blocks (rotating order); the
table gives the median step time of each, the ratio, and what the check adds per step: one all_gather of
8 bytes per parameter leaf per rank (and the checksums: one pass over the reduced gradients).

    .venv/bin/python bench/sdc_overhead.py
    .venv/bin/python bench/sdc_overhead.py --preset qwen3-moe-small --blocks 6
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from _report import print_medians, write_json


def _rank_main(preset: str, batch: int, seq: int, blocks: int, steps: int) -> dict:
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans

    torch.set_num_threads(1)
    cfg = qwen3.preset(preset)
    opt = optim.adamw(1e-3)
    step = make_train_step(cfg, opt, loss_fn=qwen3.parallel_plan.loss)
    mesh = hpfunc.Mesh({"dp": 2})
    runs = {}
    for name, plan in (("off", plans.ddp("dp")), ("sdc_check", plans.ddp("dp").with_sdc_check("raise"))):
        ts = hpfunc.parallelize(step, mesh, plan, params="params")
        params = ts.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
        runs[name] = [ts, ts.init_state(lambda p: init_train_state(p, opt), params)]
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    samples: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for b in range(blocks + 1):
        for name in names[b % 2:] + names[:b % 2]:
            ts, state = runs[name]
            for _ in range(steps):
                t0 = time.perf_counter()
                state, m = ts(state, {"tokens": tokens})
                float(m["loss"])
                if b:  # block 0 warms up
                    samples[name].append((time.perf_counter() - t0) * 1e3)
            runs[name][1] = state
    leaves = len(hpfunc.tree.leaves(runs["off"][1].params))
    return {"samples_ms": samples, "leaves": leaves}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (4 per rank)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "sdc_overhead.json"))
    args = ap.parse_args(argv)
    from hpfunc.launch import spmd

    out = spmd(_rank_main, 2, args.preset, args.batch, args.seq, args.blocks, args.steps)
    med = {k: statistics.median(v) for k, v in out["samples_ms"].items()}
    load = os.getloadavg()
    result = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "blocks": args.blocks,
              "steps": args.steps, "ranks": 2, "plan": "ddp", "leaves": out["leaves"],
              "all_gather_bytes_per_step": 8 * out["leaves"] * 2, "torch": torch.__version__,
              "machine": platform.machine(), "load_average": load, "median_ms": med,
              "ratio": med["sdc_check"] / med["off"], "samples_ms": out["samples_ms"]}
    print(f"{args.preset}: ddp over 2 gloo ranks, batch {args.batch} x seq {args.seq}, {args.blocks} blocks x "
          f"{args.steps} steps each, load average {load[0]:.2f} {load[1]:.2f}")
    print_medians(med, ("off", "sdc_check"), width=12)
    print(f"the check's all_gather: {out['leaves']} leaves x 8 bytes x 2 ranks = {8 * out['leaves'] * 2} bytes a step")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
