"""The trainer with ``train.compile`` against eager: step time side by side, loss parity, recompilations.

Two runs of ``hpfunc.train.Trainer`` on one process with the same config, seed and data (a generated
Python-like corpus), one with ``train.compile: false`` and one with the backend given; the step time
is the difference of consecutive ``elapsed_s`` in ``metrics.jsonl`` (every step logged), median over the
steps after the first (the first holds the compilation, reported apart). Dynamo's graph counter
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``) is read after every step: the graphs
compiled after the first step should be 0. Prints a table with the load average; JSON to ``--out``.

    python bench/trainer_compile.py                                  # qwen3-dense-tiny, inductor, 20 steps
    python bench/trainer_compile.py --backend aot_eager --seq-len 64
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
from typing import Any

import torch
from torch._dynamo.utils import counters

from hpfunc.train.callbacks import Callback


class _Graphs(Callback):
    def __init__(self) -> None:
        self.start = counters["stats"]["unique_graphs"]
        self.after_step: list[int] = []

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        self.after_step.append(counters["stats"]["unique_graphs"] - self.start)


def _corpus(folder: pathlib.Path) -> None:
    folder.mkdir()
    for i in range(4):
        (folder / f"m{i}.py").write_text("".join(f"def function_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n"
                                                 for j in range(200)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-dense-tiny")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "trainer_compile.json"))
    args = ap.parse_args(argv)
    from hpfunc.train import Trainer
    from hpfunc.train.output import read_metrics, to_json

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        _corpus(tmp / "corpus")
        for compile in (False, args.backend):
            raw = {"seed": 0, "model": {"preset": args.preset},
                   "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"name": "constant", "warmup_steps": 0},
                   "data": {"source": "text", "paths": [str(tmp / "corpus" / "*.py")], "val_fraction": 0.1},
                   "train": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                             "log_every": 1, "eval_every": 0, "eval_batches": 0, "num_threads": args.threads,
                             "compile": compile},
                   "output": {"dir": str(tmp / str(compile)), "progress": "none", "plot": False, "sample_tokens": 0}}
            trainer = Trainer(raw, echo=False, callbacks=[_Graphs()])
            trainer.run()
            (graphs,) = [cb for _, cb in trainer.callbacks if isinstance(cb, _Graphs)]
            recs = [r for r in read_metrics(tmp / str(compile) / "metrics.jsonl") if "loss" in r and "step" in r]
            elapsed = [r["elapsed_s"] for r in recs]
            step_ms = [(b - a) * 1e3 for a, b in zip(elapsed, elapsed[1:])]
            runs["compiled" if compile else "eager"] = {
                "losses": [r["loss"] for r in recs], "first_step_s": elapsed[0], "step_ms": step_ms,
                "median_ms": statistics.median(step_ms), "min_ms": min(step_ms),
                "graphs_after_step": graphs.after_step}
    e, c = runs["eager"], runs["compiled"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(c["losses"], e["losses"]))
    result = {"preset": args.preset, "backend": args.backend, "steps": args.steps, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "threads": args.threads, "torch": torch.__version__,
              "load_average": os.getloadavg(), "max_rel_loss_diff": rel,
              "graphs_after_first_step": c["graphs_after_step"][-1] - c["graphs_after_step"][0],
              "ratio": c["median_ms"] / e["median_ms"], **runs}
    print(f"{args.preset}: trainer, {args.steps} steps of {args.batch_size} x {args.seq_len}, "
          f"{args.threads} thread(s), compile {args.backend!r} vs false; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'run':<10}{'first step s':>13}{'median ms':>11}{'min ms':>9}{'ratio':>7}{'graphs after step 1':>21}")
    for name, r in (("eager", e), ("compiled", c)):
        print(f"{name:<10}{r['first_step_s']:>13.2f}{r['median_ms']:>11.1f}{r['min_ms']:>9.1f}"
              f"{r['median_ms'] / e['median_ms']:>7.2f}{r['graphs_after_step'][-1] - r['graphs_after_step'][0]:>21}")
    print(f"largest relative loss difference over {args.steps} steps: {rel:.1e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(to_json(result, where=str(args.out), indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
