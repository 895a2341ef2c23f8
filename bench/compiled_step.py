"""A parallelized step compiled (``hpfunc.parallelize(..., compile=backend)``, ``Lowered.compile``) against
the same step eager: step time, compile time, the share of the compiled step spent inside the compiled
regions, recompilations, loss parity.

On gloo ranks on CPU (``--ranks``, plan ``fsdp`` over all of them, or ``fsdp x tp`` with ``--tp 2``), the
front door's step (``make_train_step`` of Qwen3 with AdamW, ``hpfunc.parallelize``) runs eager and
compiled, interleaved step by step on the same batches from the same parameters. Per rank it records:

* the first step's time of each (the compiled one holds the compilation: ``compile s`` is its excess
  over the compiled step's median);
* the median step after the first (the slowest rank's, over ``--steps``);
* the share of the compiled step inside the regions: ``--profile`` more steps under ``torch.profiler``,
  the summed time of the ``Torch-Compiled Region`` events (the regions' forwards) and of the
  ``CompiledFunctionBackward`` autograd nodes (their backwards) over the profiled steps' wall time
  (the profiler's own overhead is in both, so this is an estimate);
* the graphs dynamo compiled after the first step (``torch._dynamo.utils.counters``) and the regions'
  own count (``regions.compilations``): 0 more expected;
* the largest relative loss difference.

Prints a table with the load average; JSON to ``--out``.

    python bench/compiled_step.py                                 # 2 ranks fsdp, dense tiny, inductor
    python bench/compiled_step.py --ranks 4 --tp 2 --backend aot_eager
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def _rank(preset: str, ranks: int, tp: int, backend: str, steps: int, profile: int, batch: int, seq: int) -> dict:
    import functools

    import torch
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.testing import to_full
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import init_sharded

    torch.set_num_threads(1)
    cfg = qwen3.preset(preset)
    if tp > 1:
        mesh = hpfunc.Mesh({"fsdp": ranks // tp, "tp": tp})
        plan = plans.fsdp("fsdp") + plans.tp("tp", qwen3.parallel_plan.tp_styles(cfg))
    else:
        mesh, plan = hpfunc.Mesh({"fsdp": ranks}), plans.fsdp("fsdp")
    tx = optim.adamw(1e-3)
    step = make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss)
    eager = hpfunc.parallelize(step, mesh, plan)
    compiled = hpfunc.parallelize(step, mesh, plan, compile=backend)
    init = functools.partial(qwen3.init, cfg=cfg)
    states = [s.init_state(lambda p: init_train_state(p, tx),
                           init_sharded(init, mesh, plan, hpfunc.random.key(0), shapes=qwen3.param_shapes(cfg)))
              for s in (eager, compiled)]
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    graphs: list[int] = []
    start = counters["stats"]["unique_graphs"]
    for _ in range(steps):
        b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
        for k, (name, fn) in enumerate((("eager", eager), ("compiled", compiled))):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            states[k], m = fn(states[k], b)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(float(to_full(m["loss"])))
        graphs.append(counters["stats"]["unique_graphs"] - start)
    after_first = dict(compiled.regions.compilations)
    b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(profile):
            states[1], _m = compiled(states[1], b)
        wall = time.perf_counter() - t0
    fwd = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("Torch-Compiled Region"))
    bwd = sum(e.cpu_time_total for e in prof.events()
              if e.name == "autograd::engine::evaluate_function: CompiledFunctionBackward")
    return {"times": times, "losses": losses, "graphs_after_step": graphs, "regions": after_first,
            "regions_end": dict(compiled.regions.compilations), "in_regions_fwd_s": fwd / 1e6,
            "in_regions_bwd_s": bwd / 1e6, "profiled_wall_s": wall, "printed": repr(compiled.lower(states[1]))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-dense-tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "compiled_step.json"))
    args = ap.parse_args(argv)
    from hpfunc.launch import spmd
    from hpfunc.train.output import to_json

    per_rank = spmd(_rank, args.ranks, args.preset, args.ranks, args.tp, args.backend, args.steps, args.profile,
                    args.batch_size, args.seq_len, return_all=True, timeout=3600.0)
    slowest = {name: [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
               for name in ("eager", "compiled")}
    med = {name: statistics.median(t[1:]) for name, t in slowest.items()}
    r0 = per_rank[0]
    rel = max(abs(a - b) / abs(b) for a, b in zip(r0["losses"]["compiled"], r0["losses"]["eager"]))
    share = [(r["in_regions_fwd_s"] + r["in_regions_bwd_s"]) / r["profiled_wall_s"] for r in per_rank]
    result = {
        "preset": args.preset, "ranks": args.ranks, "tp": args.tp, "backend": args.backend, "steps": args.steps,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "load_average": os.getloadavg(),
        "median_ms": {k: v * 1e3 for k, v in med.items()}, "ratio": med["compiled"] / med["eager"],
        "first_step_s": {k: v[0] for k, v in slowest.items()},
        "compile_s": slowest["compiled"][0] - med["compiled"],
        "share_in_regions": share, "in_regions_fwd_s": [r["in_regions_fwd_s"] for r in per_rank],
        "in_regions_bwd_s": [r["in_regions_bwd_s"] for r in per_rank],
        "profiled_wall_s": [r["profiled_wall_s"] for r in per_rank],
        "graphs_after_first_step": [r["graphs_after_step"][-1] - r["graphs_after_step"][0] for r in per_rank],
        "graphs_first_step": [r["graphs_after_step"][0] for r in per_rank],
        "regions_after_first_step": r0["regions"], "regions_end": r0["regions_end"],
        "max_rel_loss_diff": rel, "per_rank": per_rank}
    plan = f"fsdp {args.ranks // args.tp} x tp {args.tp}" if args.tp > 1 else f"fsdp {args.ranks}"
    print(f"{args.preset}, {plan}, batch {args.batch_size} x {args.seq_len}, compile {args.backend!r} vs eager, "
          f"{args.steps} steps; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'step':<10}{'first s':>9}{'median ms':>11}{'ratio':>7}")
    for name in ("eager", "compiled"):
        print(f"{name:<10}{slowest[name][0]:>9.2f}{med[name] * 1e3:>11.1f}{med[name] / med['eager']:>7.2f}")
    print(f"compile time (first compiled step less its median): {result['compile_s']:.1f} s")
    print(f"share of the compiled step inside the regions (profiled, per rank): "
          f"{', '.join(f'{x:.0%}' for x in share)}")
    print(f"graphs compiled in the first step: {result['graphs_first_step']}; after it: "
          f"{result['graphs_after_first_step']}; regions {r0['regions_end']}")
    print(f"largest relative loss difference: {rel:.1e}")
    print(r0["printed"].splitlines()[0])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(to_json(result, where=str(args.out), indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
