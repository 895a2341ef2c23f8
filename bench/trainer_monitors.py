"""What the trainer's monitors cost: the tiny MoE through ``hpfunc.train.Trainer`` (one process), with the
callbacks off, with ``moe_monitor`` + ``layer_norms`` + ``metrics_log`` at every step and every 10th, and
with ``precision_monitor`` alone at every step and every 10th (its measurements run inside the train step
on its logging steps, so its cost shows in the step time, not only in the callback's).

Measures: the wall-clock and the CPU time of the whole run (interleaved repetitions, medians; includes
start-up, the same for every setting), the time spent inside the callbacks' hooks (each callback wrapped
in a timer), and the training step's own time (from metrics.jsonl's ``elapsed_s``, written every step
here), each per logging step and per step in between, against the median step with everything off.

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
        if not hook.startswith("on_"):  # not a hook (the precision monitor's step_probe): as it is
            return fn

        def timed(*args):
            t = time.perf_counter()
            out = fn(*args)
            step = args[1] if hook in ("on_step_end", "on_eval", "on_save") else hook
            self.per_step[step] = self.per_step.get(step, 0.0) + time.perf_counter() - t
            return out

        return timed


MONITORS = ("moe_monitor", "layer_norms", "metrics_log")


def one_run(preset: str, steps: int, every: int | None, names: tuple[str, ...] = MONITORS) -> dict:
    from hpfunc.train import Trainer
    from hpfunc.train.callbacks import make_callback
    from hpfunc.train.config import CallbackEntry

    per_step: dict = {}
    callbacks = []
    if every is not None:
        for name in names:
            callbacks.append(Timed(make_callback(CallbackEntry(name, {"every": every}), name), per_step))
    cfg = {"model": {"preset": preset}, "data": {"max_bytes": 400_000},
           "train": {"steps": steps, "batch_size": 8, "seq_len": 128, "log_every": 1, "num_threads": 1,
                     "eval_batches": 0},
           "schedule": {"name": "constant"},
           "output": {"dir": tempfile.mkdtemp(), "progress": "none", "plot": False}}
    t, c = time.perf_counter(), time.process_time()
    result = Trainer(cfg, callbacks=callbacks, echo=False).run()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    step_s = result.summary["train_time_s"] / steps
    # each step's own time (the train step and its host read), from the records' cumulative elapsed_s
    elapsed = {r["step"]: r["elapsed_s"] for r in result.records if "elapsed_s" in r}
    dts = {k: elapsed[k] - elapsed.get(k - 1, 0.0) for k in elapsed if k > 1}  # step 1 lowers the step
    at = every or 1
    logging = [v for k, v in per_step.items() if isinstance(k, int) and every and k % every == 0]
    between = [v for k, v in per_step.items() if isinstance(k, int) and every and k % every]
    step_log = [v for k, v in dts.items() if k % at == 0]
    step_between = [v for k, v in dts.items() if k % at]
    return {"wall_s": wall, "cpu_s": cpu, "step_s": step_s,
            "step_at_logging_s": statistics.median(step_log) if step_log else 0.0,
            "step_between_s": statistics.median(step_between) if step_between else 0.0,
            "callbacks_at_logging_step_s": statistics.median(logging) if logging else 0.0,
            "callbacks_between_s": statistics.median(between) if between else 0.0,
            "callbacks_end_s": per_step.get("on_train_end", 0.0)}


def paired_steps(preset: str, pairs: int) -> dict:
    """The train step alone (one process, one thread), with the precision monitor's probe measuring (``on``),
    carrying a probe that is not due (``between``) and without one (``off``), called in rotating order on
    the same state and batch, ``pairs`` times: per call the thread's CPU time and the wall-clock; the
    medians of the per-round ratios against ``off`` (paired, so a load change hits both sides alike)."""
    import torch

    from hpfunc import random
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.precision_probe import PrecisionProbe
    from hpfunc.train.step import init_train_state, make_train_step

    torch.set_num_threads(1)
    cfg = load_config_dict({"model": {"preset": preset}, "train": {"batch_size": 8, "seq_len": 128}})
    model_cfg = build_model_config(cfg.model)
    spec = model_spec(cfg.model)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps), spec)
    state = init_train_state(spec.init(random.key(0), model_cfg), optimizer)
    probes = {"off": None, "on": PrecisionProbe(1), "between": PrecisionProbe(10 ** 9)}
    steps = {name: make_train_step(model_cfg, optimizer, lr_schedule=lr, loss_fn=spec.loss, monitor=probe)
             for name, probe in probes.items()}
    tokens = torch.randint(0, model_cfg.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    for fn in steps.values():  # warm
        fn(state, batch)
    cpu: dict = {name: [] for name in steps}
    wall: dict = {name: [] for name in steps}
    names = list(steps)
    for k in range(pairs):
        for name in names[k % 3:] + names[:k % 3]:
            t, c = time.perf_counter(), time.thread_time()
            steps[name](state, batch)
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    out = {}
    for name in ("on", "between"):
        out[name] = {"cpu_ratio": statistics.median(a / b for a, b in zip(cpu[name], cpu["off"])),
                     "wall_ratio": statistics.median(a / b for a, b in zip(wall[name], wall["off"]))}
    out["off"] = {"cpu_ms": 1e3 * statistics.median(cpu["off"]), "wall_ms": 1e3 * statistics.median(wall["off"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "trainer_monitors.json"))
    args = ap.parse_args()
    settings = {"off": (None, MONITORS), "every 1": (1, MONITORS), "every 10": (10, MONITORS),
                "prec 1": (1, ("precision_monitor",)), "prec 10": (10, ("precision_monitor",))}
    load = os.getloadavg()
    runs: dict = {name: [] for name in settings}
    for rep in range(args.reps):  # interleaved, rotating order: drift in the machine's load hits all alike
        names = list(settings)[rep % len(settings):] + list(settings)[:rep % len(settings)]
        for name in names:
            runs[name].append(one_run(args.preset, args.steps, *settings[name]))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{args.preset}, {args.steps} steps of 8 x 128, {args.reps} reps; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    print("settings: monitors = moe_monitor + layer_norms + metrics_log; prec = precision_monitor alone; N = every N "
          "steps. 'step ms log/betw': the step's own median time at logging steps / between them; 'vs off': against "
          "the median step with everything off; 'cb': time inside the callbacks")
    print(f"{'setting':<10}{'wall s':>8}{'vs off':>8}{'cpu s':>8}{'vs off':>8}{'step ms log':>12}{'vs off':>8}"
          f"{'step ms betw':>13}{'vs off':>8}{'cb ms log':>10}{'cb ms betw':>11}")
    off = med["off"]
    for name in settings:
        m = med[name]
        between = f"{1e3 * m['step_between_s']:>13.1f}{m['step_between_s'] / off['step_at_logging_s']:>8.3f}" \
            if m["step_between_s"] else f"{'-':>13}{'-':>8}"
        print(f"{name:<10}{m['wall_s']:>8.2f}{m['wall_s'] / off['wall_s']:>8.3f}{m['cpu_s']:>8.2f}"
              f"{m['cpu_s'] / off['cpu_s']:>8.3f}{1e3 * m['step_at_logging_s']:>12.1f}"
              f"{m['step_at_logging_s'] / off['step_at_logging_s']:>8.3f}{between}"
              f"{1e3 * m['callbacks_at_logging_step_s']:>10.2f}{1e3 * m['callbacks_between_s']:>11.3f}")
    before = os.getloadavg()
    paired = paired_steps(args.preset, args.pairs)
    end = os.getloadavg()
    print(f"the train step alone, precision monitor's probe on / between / off, {args.pairs} rotating rounds "
          f"(load average {before[0]:.2f} at the start): off {paired['off']['cpu_ms']:.1f} ms CPU, "
          f"{paired['off']['wall_ms']:.1f} ms wall; median ratio to off, CPU / wall: measuring "
          f"{paired['on']['cpu_ratio']:.3f} / {paired['on']['wall_ratio']:.3f}, between "
          f"{paired['between']['cpu_ratio']:.3f} / {paired['between']['wall_ratio']:.3f}")
    print(f"load average at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    write_json(args.out, {"preset": args.preset, "steps": args.steps, "reps": args.reps, "load_average": load,
                          "load_average_end": os.getloadavg(),
                          "machine": platform.machine(), "cpus": os.cpu_count(), "medians": med, "runs": runs, "paired_steps": paired})


if __name__ == "__main__":
    main()
