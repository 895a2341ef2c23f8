"""The planner's estimates for the published Qwen3-30B-A3B configurations, next to the published figures.

For each row of docs/reference.md's published-throughput table that hpfunc's plans can express (EP8 x
FSDP8 on 8 x H100, NeMo AutoModel; EP16 on 16 x H100, Megatron-Bridge, BF16), the cost model
(hpfunc.autoparallel) searches that family's layouts (remat and microbatches) on 8 or 16 H100s under
80 GiB, and prints the fastest one's peak memory, step time, tokens/s per GPU and TFLOPS (23.08 GFLOP
per token) beside the published tokens/s per GPU. Also the planner's overall best layout on the same
devices. The estimates are a model, not measurements (docs/autoparallel.md says what they leave out);
the global batch (8 sequences of 4096 tokens per GPU) is this script's assumption.

Usage:
    python bench/autoparallel.py [--out bench/results/autoparallel.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from hpfunc.autoparallel.configuration import Workload  # noqa: E402
from hpfunc.autoparallel.flops import train_flops_per_token  # noqa: E402
from hpfunc.autoparallel.search import search  # noqa: E402
from hpfunc.models import qwen3  # noqa: E402
from hpfunc.models.qwen3.describe import describe  # noqa: E402

PUBLISHED = [  # (system, family, devices, tokens/s/GPU, TFLOPS) -- docs/reference.md#published-throughput
    ("NeMo AutoModel (FSDP2 + EP + DeepEP), EP8 x FSDP8, BF16", "ep8", 8, 12040, 277),
    ("Megatron-Bridge, EP16, BF16, HybridEP, EP overlap, forced balance", "ep16", 16, 13011, 299),
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "autoparallel.json"))
    args = parser.parse_args(argv)
    d = describe(qwen3.preset("qwen3-30b-a3b"))
    fpt = train_flops_per_token(d, 4096)
    rows = []
    print(f"Qwen3-30B-A3B, seq 4096, bf16, mixed-precision AdamW; {fpt / 1e9:.2f} GFLOP/token; H100 80 GiB")
    print(f"{'published configuration':66} {'layout (estimated best of family)':36} {'peak GiB':>8} {'step s':>7} "
          f"{'est. tok/s':>10} {'pub. tok/s':>10} {'est. TFLOPS':>11} {'pub.':>5}")
    for system, family, n, tok, tflops in PUBLISHED:
        t0 = time.perf_counter()
        r = search(d, n, Workload(global_batch=8 * n, seq_len=4096), "h100", memory_limit=80 * 2**30)
        seconds = time.perf_counter() - t0
        fam = [c for c in r.feasible if c.layout.family == family and c.time is not None]
        c = fam[0]
        est = c.time.tokens_per_second_per_device
        print(f"{system:66} {c.layout.name:36} {c.memory.total / 2**30:8.1f} {c.time.total:7.3f} {est:10.0f} "
              f"{tok:10d} {est * fpt / 1e12:11.0f} {tflops:5d}")
        best = r.best
        print(f"{'  planner best on the same ' + str(n) + ' GPUs':66} {best.layout.name:36} "
              f"{best.memory.total / 2**30:8.1f} {best.time.total:7.3f} {best.time.tokens_per_second_per_device:10.0f}")
        rows.append({"system": system, "devices": n, "family": family, "layout": c.layout.name,
                     "peak_bytes": c.memory.total, "memory_bytes": dict(c.memory.terms), "step_seconds": c.time.total,
                     "time_seconds": dict(c.time.terms), "estimated_tokens_per_second_per_gpu": est,
                     "published_tokens_per_second_per_gpu": tok, "estimated_tflops": est * fpt / 1e12,
                     "published_tflops": tflops, "planner_best": best.layout.name,
                     "planner_best_tokens_per_second_per_gpu": best.time.tokens_per_second_per_device,
                     "feasible_layouts": len(r.feasible), "search_seconds": seconds})
    from _report import write_json

    write_json(args.out, {"model": "qwen3-30b-a3b", "flops_per_token": fpt, "rows": rows})


if __name__ == "__main__":
    main()
