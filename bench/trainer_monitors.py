"""What the trainer's monitors cost: the tiny MoE through ``hpfunc.train.Trainer`` (one process), with the
callbacks off, and with ``moe_monitor`` + ``layer_norms`` + ``metrics_log`` at every step and every 10th.

Two measures: the wall-clock of the whole run (interleaved repetitions, medians; includes start-up, the
same for every setting), and the time spent inside the callbacks' hooks (each callback wrapped in a
timer), per logging step and per step in between, against the median training step.

    python bench/trainer_monitors.py
    python bench/trainer_monitors.py --steps 60 --reps 3 --preset qwen3-moe-small
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

from _report import write_json


class Timed:
    """Delegates every hook to ``inner`` and adds the seconds each call took, per step."""

    def __init__(self, inner, per_step: dict):
        self.inner, self.per_step = inner, per_step
        self.every_rank = getattr(inner, "every_rank", False)

    def __getattr__(self, hook):
        fn = getattr(self.inner, hook)

        def timed(*args):
            t = time.perf_counter()
            out = fn(*args)
            step = args[1] if hook in ("on_step_end", "on_eval", "on_save") else hook
            self.per_step[step] = self.per_step.get(step, 0.0) + time.perf_counter() - t
            return out

        return timed


def one_run(preset: str, steps: int, every: int | None) -> dict:
    from hpfunc.train import Trainer
    from hpfunc.train.callbacks import make_callback
    from hpfunc.train.config import CallbackEntry

    per_step: dict = {}
    callbacks = []
    if every is not None:
        for name, opts in (("moe_monitor", {"every": every}), ("layer_norms", {"every": every}),
                           ("metrics_log", {"every": every})):
            callbacks.append(Timed(make_callback(CallbackEntry(name, opts), name), per_step))
    cfg = {"model": {"preset": preset}, "data": {"max_bytes": 400_000},
           "train": {"steps": steps, "batch_size": 8, "seq_len": 128, "log_every": 10, "num_threads": 1,
                     "eval_batches": 0},
           "schedule": {"name": "constant"},
           "output": {"dir": tempfile.mkdtemp(), "progress": "none", "plot": False}}
    t = time.perf_counter()
    result = Trainer(cfg, callbacks=callbacks, echo=False).run()
    wall = time.perf_counter() - t
    step_s = result.summary["train_time_s"] / steps
    logging = [v for k, v in per_step.items() if isinstance(k, int) and every and k % every == 0]
    between = [v for k, v in per_step.items() if isinstance(k, int) and every and k % every]
    return {"wall_s": wall, "step_s": step_s,
            "callbacks_at_logging_step_s": statistics.median(logging) if logging else 0.0,
            "callbacks_between_s": statistics.median(between) if between else 0.0,
            "callbacks_end_s": per_step.get("on_train_end", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "trainer_monitors.json"))
    args = ap.parse_args()
    settings = {"off": None, "every 1": 1, "every 10": 10}
    load = os.getloadavg()
    runs: dict = {name: [] for name in settings}
    for rep in range(args.reps):  # interleaved, rotating order: drift in the machine's load hits all alike
        names = list(settings)[rep % len(settings):] + list(settings)[:rep % len(settings)]
        for name in names:
            runs[name].append(one_run(args.preset, args.steps, settings[name]))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{args.preset}, {args.steps} steps of 8 x 128, {args.reps} reps; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    print(f"{'setting':<10}{'run wall s':>11}{'vs off':>8}{'step ms':>9}{'cb ms at log':>14}{'% of step':>10}"
          f"{'cb ms between':>15}")
    for name in settings:
        m = med[name]
        print(f"{name:<10}{m['wall_s']:>11.2f}{m['wall_s'] / med['off']['wall_s']:>8.3f}{1e3 * m['step_s']:>9.1f}"
              f"{1e3 * m['callbacks_at_logging_step_s']:>14.2f}"
              f"{100 * m['callbacks_at_logging_step_s'] / m['step_s']:>10.1f}{1e3 * m['callbacks_between_s']:>15.3f}")
    write_json(args.out, {"preset": args.preset, "steps": args.steps, "reps": args.reps, "load_average": load,
                          "machine": platform.machine(), "cpus": os.cpu_count(), "medians": med, "runs": runs})


if __name__ == "__main__":
    main()
