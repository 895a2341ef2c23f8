"""What the fault guards cost a training step: the heartbeat thread and the non-finite checks, on vs off.

One process runs the trainer's step (``hpfunc.train.step.make_train_step``) on the default config's
model (qwen3-moe-tiny, the main job's batch and sequence length) and times it, interleaved block by
block in rotating order, under four settings:

- ``off``: no heartbeat, no checks (the bare step and its host read of the loss);
- ``checks``: the loop's per-step check (``hpfunc.train.loop._finite_step``, run on the floats
  the loop reads anyway) and, once per block, the last-step parameter scan (``_first_nonfinite``);
- ``heartbeat``: a :class:`hpfunc.faults.Heartbeat` beating at the interval a launch uses for the
  default 300 s timeout (1 s), plus the checks: what every rank of ``hpfunc train`` runs;
- ``heartbeat_1ms``: the same with a beat every millisecond (1000x the real rate): an upper bound.

The table reports the median step time of each setting and its ratio to ``off``, with the load
average, and beside it the median process CPU time per step (all threads: the heartbeat's included),
which other processes on a loaded machine disturb far less than the wall clock; the JSON lands in
``--out``.

    .venv/bin/python bench/faults_overhead.py
    .venv/bin/python bench/faults_overhead.py --blocks 12 --steps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from _report import print_medians, write_json


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-moe-tiny")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (the main job: 8 per data shard)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per setting")
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "faults_overhead.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import hpfunc
    from hpfunc import faults, optim
    from hpfunc.models import qwen3
    from hpfunc.train import loop
    from hpfunc.train.step import init_train_state, make_train_step

    cfg = qwen3.preset(args.preset)
    params = qwen3.init(hpfunc.random.key(0), cfg)
    opt = optim.adamw(1e-3)
    train_step = make_train_step(cfg, opt)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens}
    state = init_train_state(params, opt)

    def block(checks: bool) -> tuple[list[float], list[float]]:
        nonlocal state
        times, cpu = [], []
        for i in range(args.steps):
            c0 = time.process_time()
            t0 = time.perf_counter()
            state, metrics = train_step(state, batch)
            loss = float(metrics["loss"])  # the loop's host read (every setting does it)
            if checks:
                assert loop._finite_step(loss, float(metrics["grad_norm"]))
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
        if checks:  # the loop scans the parameters once, after the last step
            c0 = time.process_time()
            t0 = time.perf_counter()
            assert loop._first_nonfinite(state.params) is None
            times[-1] += (time.perf_counter() - t0) * 1e3
            cpu[-1] += (time.process_time() - c0) * 1e3
        return times, cpu

    settings = {"off": (None, False), "checks": (None, True),
                "heartbeat": (faults.heartbeat_interval(300.0), True), "heartbeat_1ms": (1e-3, True)}
    samples: dict[str, list[float]] = {k: [] for k in settings}
    cpu_samples: dict[str, list[float]] = {k: [] for k in settings}
    beats: dict[str, int] = {}
    block(False)  # warm up
    with tempfile.TemporaryDirectory() as d:
        names = list(settings)
        for b in range(args.blocks):
            for name in names[b % len(names):] + names[:b % len(names)]:  # rotate the order
                interval, checks = settings[name]
                beat = faults.Heartbeat(d, rank=0, interval=interval).start() if interval else None
                try:
                    wall, cpu = block(checks)
                    samples[name] += wall
                    cpu_samples[name] += cpu
                finally:
                    if beat is not None:
                        beat.stop()
    load = os.getloadavg()
    med = {k: statistics.median(v) for k, v in samples.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_samples.items()}
    result = {
        "preset": args.preset, "batch": args.batch, "seq": args.seq, "blocks": args.blocks, "steps": args.steps,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "load_average": load, "heartbeat_interval_s": faults.heartbeat_interval(300.0),
        "median_ms": med, "ratio_to_off": {k: v / med["off"] for k, v in med.items()}, "samples_ms": samples,
        "median_cpu_ms": cpu_med, "cpu_ratio_to_off": {k: v / cpu_med["off"] for k, v in cpu_med.items()},
        "cpu_samples_ms": cpu_samples,
    }
    print(f"{args.preset}: batch {args.batch} x seq {args.seq}, train step (fwd+bwd+adamw), "
          f"{args.blocks} blocks x {args.steps} steps per setting, load average {load[0]:.2f} {load[1]:.2f}")
    print_medians(med, settings, width=16)
    print("process CPU time per step:")
    print_medians(cpu_med, settings, width=16)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
