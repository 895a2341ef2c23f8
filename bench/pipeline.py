"""Pipeline parallelism on CPU with gloo: measured timelines vs ``simulate``, and hpfunc vs
``torch.distributed.pipelining`` on the same model, weights and schedule.

For each schedule (gpipe, 1f1b, interleaved 1F1B with v = 2, zbv) on 2 and 4 pipeline ranks it builds
the pipelined step through the front door,
``hpfunc.parallelize(make_train_step(cfg, adamw, loss_fn=qwen3.parallel_plan.loss), mesh, plans.pp(...))``
over ``qwen3.parallel_plan.pipeline_stages``, and its PyTorch twin: one ``PipelineStage`` per stage over
an ``nn.Module`` that holds copies of the same weights and calls the same stage functions
(``Stages.forward``; the last stage's ``Stages.loss`` is the schedule's ``loss_fn``), driven by
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble`` and
``torch.optim.AdamW`` (hpfunc's ``adamw`` has torch's semantics and defaults; the front door is built
with ``donate_state=True``, so its fused AdamW writes into the old state's memory as torch's in-place
step does, with the values of a step without donation). They are timed side by side, step by step in
alternating order after a warm-up, a barrier before each step; a step's time is the slowest rank's, the
table shows medians. All see the same batch every step and start from the same weights, so their
per-step losses agree to rounding (checked and shown; with the same AdamW kernel, ``torch+mf`` below,
bit for bit): the comparison is of the same work.

Every timed hpfunc step records the per-rank timeline (``hpfunc.transforms.pipeline.record_timeline``:
start and end of each F, B, W, BW; ``time.perf_counter`` is the system-wide monotonic clock, so the
ranks' times compare). From it:

  span        the schedule's wall time: first compute start to last compute end over all ranks
  busy        per rank, the summed duration of its compute actions
  bubble      per rank, the idle fraction ``1 - busy / span`` (and ``1 - busy / step`` over the whole step,
              which also holds the optimizer update, the parameters' gather and the loss's psum)
  costs       mean duration of F, B, W and BW per stage (over microbatches and steps)
  predicted   ``simulate(schedule, costs)`` fed those measured costs per stage (communication priced 0):
              its makespan and each rank's idle fraction ``1 - useful / makespan`` (not ``bubble_ratio``,
              which is idle / useful), and the ratio measured span / predicted makespan

Beside wall time the table shows each framework's CPU time per step summed over the ranks
(``time.process_time``, gloo's threads included): on a machine whose cores other jobs share, wall times
stretch with the load, CPU time much less, so its ratio hpfunc / torch is the steadier measure of the
work each framework does for the same step. hpfunc's training step does more than the schedule: it
reports the global gradient norm (an all-reduce over the pipeline ranks) and returns the loss and aux
on every rank (``lax.psum``), which the bare twin does not. A second twin, ``torch+m``
(``torch_step(..., metrics=True)``), does that work too (the norm of its gradients, all-reduced, and the
loss all-reduced to every rank). Both use ``torch.optim.AdamW``'s defaults (one tensor at a time on CPU),
as a user writes it; hpfunc's ``adamw`` runs torch's fused AdamW kernel (``AdamW(fused=True)``'s), so a
third twin, ``torch+mf`` (``metrics=True, fused=True``), is ``torch+m`` with that same kernel: the strict
comparison of the two frameworks' steps, the optimizer's arithmetic taken out. The table gives the ratio
against each: paired (the median over rounds of the ratio within a round: every framework runs once a
round, back to back, so the load's drift cancels), of the median steps, and of the least steps (other jobs
only ever add time, so the least is the step they disturbed least).

The gap between span and prediction is what the model leaves out: transfers and their waits, the
executor's own work between actions, and on an oversubscribed CPU the ranks competing for cores (4
ranks on 2 cores: a rank's compute stretches while another rank runs, so ``busy`` is wall time, not
CPU time). The machine is shared and noisy: compare the ratios of one run, not times across runs.

Usage:
    python bench/pipeline.py [--ranks 2,4] [--schedules gpipe,1f1b,interleaved,zbv] [--iters 3]
                             [--quick] [--out bench/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}
COMPUTE = ("F", "B", "W", "BW")
# the torch twins (see the module docstring): bare with AdamW's defaults, + the metrics, + the fused kernel
TWINS = {"torch": {}, "torch_metrics": {"metrics": True}, "torch_fused": {"metrics": True, "fused": True}}
TWIN_LABELS = {"torch": "torch", "torch_metrics": "torch+m", "torch_fused": "torch+mf"}
LR = 1e-3


def model_cfg(layers: int, hidden: int):
    """The tiny dense Qwen3 (untied: a tied embedding would make the torch twin sum two stages' grads)."""
    from hpfunc.models import qwen3

    return qwen3.preset("qwen3-dense-tiny", num_hidden_layers=layers, hidden_size=hidden,
                        intermediate_size=3 * hidden, tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------
# hpfunc: the front door


def hpfunc_step(cfg, name: str, p: int, m: int, full: Any):
    """``(step() -> loss, compute-only schedule)``: the pipelined training step of ``parallelize``."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans

    mesh = hpfunc.Mesh({"pp": p})
    stages = parallel_plan.pipeline_stages(cfg, p * STAGES_PER_RANK[name])
    plan = plans.pp("pp", stages, schedule=name, microbatches=m,
                    virtual_stages=2 if name == "interleaved" else None)
    tx = optim.adamw(LR)
    # donated: the optimizer writes the new state into the old one's memory, as torch's in-place AdamW does
    front = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=parallel_plan.loss), mesh, plan, donate_state=True)
    box = {"s": front.init_state(lambda params: init_train_state(params, tx), front.shard_params(full))}

    def run(batch: dict) -> float:
        box["s"], metrics = front(box["s"], batch)
        return float(metrics["loss"])

    return run, plan.pipeline_schedule(mesh)


# ---------------------------------------------------------------------------------------------
# PyTorch: torch.distributed.pipelining over the same stage functions


def _stage_module(stages, s: int, full: Any):
    """An ``nn.Module`` for stage ``s``: copies of the stage's weights as parameters; its forward is the
    model's own ``Stages.forward``, its ``tree()`` the parameter tree that function reads."""
    from torch import nn

    import hpfunc

    named = hpfunc.tree.leaves_with_paths(full)
    _, spec = hpfunc.tree.flatten(full)
    slots = [k for k, (path, _) in enumerate(named) if s in stages.stage_of(path)]

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(named[k][1].detach().clone()) for k in slots])

        def tree(self) -> Any:
            leaves: list = [None] * len(named)  # other stages' leaves: absent, as on an hpfunc pp rank
            for k, w in zip(slots, self.weights):
                leaves[k] = w
            return hpfunc.tree.unflatten(spec, leaves)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if s == 0:
                return stages.forward(0, self.tree(), None, {"tokens": x})[0]
            # later stages read only the token grid's shape (rope positions) from the microbatch
            grid = torch.empty(x.shape[:2], dtype=torch.long)
            return stages.forward(s, self.tree(), (x,), {"tokens": grid})[0]

    return Stage()


def torch_step(cfg, name: str, p: int, m: int, full: Any, *, metrics: bool = False, fused: bool = False):
    """``step(batch) -> loss or None`` (the loss on the rank of the last stage) of the torch twin.

    With ``metrics`` the twin also does the reporting work hpfunc's training step does besides the
    schedule: the global gradient norm (each rank's sum of squares, all-reduced over the pipeline ranks)
    and the loss on every rank (an all-reduce from the last stage's rank); it then returns the loss on
    every rank, as hpfunc does. With ``fused`` its AdamW is ``fused=True``: the kernel hpfunc's runs."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.schedules import loop_placement, v_placement

    rank = dist.get_rank()
    v = STAGES_PER_RANK[name]
    n = p * v
    placement = v_placement(p) if name == "zbv" else loop_placement(p, v)
    stages = parallel_plan.pipeline_stages(cfg, n)
    mine = [s for s in range(n) if placement[s] == rank]
    modules = {s: _stage_module(stages, s, full) for s in mine}
    pstages = [pipelining.PipelineStage(modules[s], s, n, torch.device("cpu")) for s in mine]
    last = n - 1

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return stages.loss(modules[last].tree(), (out,), {"tokens": target})[0]

    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    sched = cls(pstages[0], m, loss_fn=loss_fn) if v == 1 else cls(pstages, m, loss_fn=loss_fn)
    params = [w for mod in modules.values() for w in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, **({"fused": True} if fused else {}))

    def run(batch: dict) -> float | None:
        opt.zero_grad(set_to_none=True)
        tokens = batch["tokens"]
        args = (tokens,) if 0 in modules else ()
        losses: list = []
        if last in modules:
            sched.step(*args, target=tokens, losses=losses)
        else:
            sched.step(*args)
        if metrics:
            with torch.no_grad():
                grads = [w.grad for w in params if w.grad is not None]
                sq = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros(())
                dist.all_reduce(sq)
                grad_norm = sq.sqrt()  # noqa: F841 - computed as hpfunc's metrics["grad_norm"] is
                loss = torch.stack(losses).detach().mean() if losses else torch.zeros(())
                dist.all_reduce(loss)
        opt.step()
        if metrics:
            return float(loss)
        return float(torch.stack(losses).detach().mean()) if losses else None

    return run


# ---------------------------------------------------------------------------------------------
# On every rank


def bench_on_rank(name: str, m: int, layers: int, hidden: int, batch: int, seq: int, iters: int,
                  warmup: int) -> dict:
    """Warm-up, then ``iters`` rounds of one hpfunc and one torch step (alternating order), the hpfunc
    steps' timelines recorded. Returns this rank's times, losses, timelines and schedule."""
    import torch.distributed as dist

    import hpfunc
    from hpfunc.models import qwen3
    from hpfunc.transforms.pipeline import record_timeline

    torch.set_num_threads(1)  # one core per rank: the ranks share the machine's few cores
    p = dist.get_world_size()
    cfg = model_cfg(layers, hidden)
    full = qwen3.init(hpfunc.random.key(0), cfg)
    data = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))}
    hp, schedule = hpfunc_step(cfg, name, p, m, full)
    steps: dict[str, Any] = {"hpfunc": hp}
    out: dict = {"torch_error": None, "losses": {"hpfunc": [], **{k: [] for k in TWINS}}}
    try:
        for k, options in TWINS.items():
            steps[k] = torch_step(cfg, name, p, m, full, **options)
    except Exception as err:  # noqa: BLE001 - reported in the table: that torch schedule does not run here
        out["torch_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    timelines, times, cpu, main = [], {k: [] for k in steps}, {k: [] for k in steps}, {k: [] for k in steps}

    def call(k: str, *, timed: bool, record: bool) -> None:
        dist.barrier()
        t, c, c1 = time.perf_counter(), time.process_time(), time.thread_time()
        if record:
            with record_timeline() as events:
                loss = steps[k](data)
            timelines.append(list(events))
        else:
            loss = steps[k](data)
        dt, dc, dc1 = time.perf_counter() - t, time.process_time() - c, time.thread_time() - c1
        out["losses"][k].append(loss)
        if timed:
            times[k].append(dt)
            cpu[k].append(dc)
            main[k].append(dc1)

    for _ in range(warmup):
        for k in list(steps):
            try:
                call(k, timed=False, record=False)
            except Exception:  # noqa: BLE001 - torch's schedule failed on CPU/gloo: report it
                if not k.startswith("torch"):
                    raise
                out["torch_error"] = traceback.format_exc().strip().splitlines()[-1][:200]
                for twin in TWINS:
                    steps.pop(twin, None)
                    times.pop(twin, None)
                    cpu.pop(twin, None)
                    main.pop(twin, None)
                break
    names = list(steps)
    for i in range(iters):
        for k in (names if i % 2 == 0 else names[::-1]):
            call(k, timed=True, record=k == "hpfunc")
    out.update(times=times, cpu=cpu, main=main, timelines=timelines, rank=dist.get_rank(),
               schedule=[str(a) for a in schedule.actions[dist.get_rank()]])
    return out


# ---------------------------------------------------------------------------------------------
# Summaries


def _intervals(events: list) -> list[tuple[str, float, float]]:
    """``(action, start, end)`` of each compute action of one rank's timeline."""
    open_: dict[str, float] = {}
    spans = []
    for what, action, t in events:
        if what == "start":
            open_[action] = t
        elif what == "end":
            spans.append((action, open_.pop(action), t))
    return spans


def measured(per_rank: list[dict]) -> dict:
    """Step time, span, busy time, bubbles and per-(kind, stage) costs from the ranks' results."""
    from hpfunc.schedules import Action

    n_steps = len(per_rank[0]["timelines"])
    costs: dict[tuple[str, int], list[float]] = {}
    span, bubble, bubble_step = [], {r: [] for r in range(len(per_rank))}, {r: [] for r in range(len(per_rank))}
    step = [max(pr["times"]["hpfunc"][j] for pr in per_rank) for j in range(n_steps)]
    for j in range(n_steps):
        per = [_intervals(pr["timelines"][j]) for pr in per_rank]
        t0 = min(iv[0][1] for iv in per if iv)
        t1 = max(iv[-1][2] for iv in per if iv)
        span.append(t1 - t0)
        for r, iv in enumerate(per):
            busy = sum(e - s for _, s, e in iv)
            bubble[r].append(1 - busy / (t1 - t0))
            bubble_step[r].append(1 - busy / step[j])
            for action, s, e in iv:
                a = Action.parse(action)
                costs.setdefault((a.kind.value, a.stage), []).append(e - s)
    med = statistics.median
    return {"step_s": med(step), "span_s": med(span), "bubble": {r: med(v) for r, v in bubble.items()},
            "bubble_step": {r: med(v) for r, v in bubble_step.items()},
            "costs": {k: statistics.mean(v) for k, v in sorted(costs.items())}}


def predicted(schedule, costs: dict[tuple[str, int], float]) -> dict:
    """``simulate`` under the measured costs per (kind, stage); communication priced 0."""
    from hpfunc.schedules import insert_comms, simulate

    def cost(a) -> float:
        return costs.get((a.kind.value, a.stage), 0.0) if a.is_compute else 0.0

    r = simulate(insert_comms(schedule), cost)
    return {"makespan_s": r.makespan, "bubble": {k: 1 - r.useful[k] / r.makespan for k in schedule.ranks}}


def summarise(name: str, p: int, m: int, per_rank: list[dict], schedule) -> dict:
    """One table row: measured, predicted, their ratios, and the torch twin's time and losses."""
    meas = measured(per_rank)
    pred = predicted(schedule, meas["costs"])
    row = {"schedule": name, "ranks": p, "microbatches": m, "measured": meas, "predicted": pred,
           "span_over_predicted": meas["span_s"] / pred["makespan_s"],
           "step_over_predicted": meas["step_s"] / pred["makespan_s"]}
    err = next((pr["torch_error"] for pr in per_rank if pr["torch_error"]), None)
    hp_losses = per_rank[0]["losses"]["hpfunc"]
    row["hpfunc_losses"] = hp_losses
    if err is None:
        torch_ms = statistics.median(max(pr["times"]["torch"][j] for pr in per_rank)
                                     for j in range(len(per_rank[0]["times"]["torch"])))
        hp_cpu, hp_main = _cpu_per_step(per_rank, "hpfunc"), _cpu_per_step(per_rank, "hpfunc", "main")
        hp_min = _cpu_per_step(per_rank, "hpfunc", how="min")
        for k in TWINS:
            losses = next(pr["losses"][k] for pr in per_rank if pr["losses"][k][0] is not None)
            cpu, main = _cpu_per_step(per_rank, k), _cpu_per_step(per_rank, k, "main")
            row[k] = {"cpu_s": cpu, "hpfunc_cpu_s": hp_cpu, "cpu_ratio": hp_cpu / cpu, "losses": losses,
                      "cpu_ratio_paired": _paired_ratio(per_rank, k),
                      "cpu_ratio_min": hp_min / _cpu_per_step(per_rank, k, how="min"),
                      "main_thread_s": main, "hpfunc_main_thread_s": hp_main, "main_thread_ratio": hp_main / main,
                      "main_thread_ratio_paired": _paired_ratio(per_rank, k, "main"),
                      "max_loss_diff": max(abs(a - b) for a, b in zip(hp_losses, losses))}
        row["torch"].update(step_s=torch_ms, ratio=meas["step_s"] / torch_ms)
    else:
        row["torch"] = {"error": err}
    return row


def _per_step(per_rank: list[dict], k: str, clock: str = "cpu") -> list[float]:
    """Framework ``k``'s CPU seconds of each timed step, summed over the ranks."""
    return [sum(pr[clock][k][j] for pr in per_rank) for j in range(len(per_rank[0][clock][k]))]


def _paired_ratio(per_rank: list[dict], k: str, clock: str = "cpu") -> float:
    """The median over rounds of hpfunc's CPU time in a round over twin ``k``'s in the same round (each
    summed over the ranks). A round runs every framework once, back to back (in alternating order), so
    each ratio compares steps that saw the same machine: the load's drift, which moves both, cancels."""
    return statistics.median(a / b for a, b in zip(_per_step(per_rank, "hpfunc", clock), _per_step(per_rank, k, clock)))


def _cpu_per_step(per_rank: list[dict], k: str, clock: str = "cpu", how: str = "median") -> float:
    """CPU seconds of one step summed over the ranks (median over steps, or with ``how="min"`` the
    least): the work each framework does, which other jobs on the machine do not stretch as they
    stretch wall time. ``clock="main"``: the main thread's CPU time only (without gloo's threads, whose
    time depends on how long transfers wait, so on the load). The minimum is the step least disturbed
    by other jobs (they only ever add time: contention for the cores and their caches)."""
    per_step = _per_step(per_rank, k, clock)
    return min(per_step) if how == "min" else statistics.median(per_step)


def _costs_text(costs: dict) -> str:
    """``s0: F 1.2 BW 2.3; s1: ...`` in ms."""
    by_stage: dict[int, list[str]] = {}
    for (kind, s), c in costs.items():
        by_stage.setdefault(s, []).append(f"{kind} {1e3 * c:.1f}")
    return "; ".join(f"s{s}: " + " ".join(v) for s, v in sorted(by_stage.items()))


def print_tables(rows: list[dict]) -> None:
    """The three tables: measured vs simulate, costs per stage, hpfunc vs torch."""
    print("\nmeasured vs simulate (ms; bubble = idle fraction of the span per rank, measured / predicted)")
    print(f"{'p':>2} {'schedule':<12} {'m':>2} {'step':>7} {'span':>7} {'pred':>7} {'span/pred':>9} "
          f"{'step/pred':>9}  bubble per rank (measured/predicted)")
    for r in rows:
        me, pr = r["measured"], r["predicted"]
        bub = " ".join(f"{me['bubble'][k]:.2f}/{pr['bubble'][k]:.2f}" for k in sorted(pr["bubble"]))
        print(f"{r['ranks']:>2} {r['schedule']:<12} {r['microbatches']:>2} {1e3 * me['step_s']:7.1f} "
              f"{1e3 * me['span_s']:7.1f} {1e3 * pr['makespan_s']:7.1f} {r['span_over_predicted']:9.2f} "
              f"{r['step_over_predicted']:9.2f}  {bub}")
    print("\nmeasured mean cost per stage (ms)")
    for r in rows:
        print(f"{r['ranks']:>2} {r['schedule']:<12} {_costs_text(r['measured']['costs'])}")
    print("\nhpfunc vs torch.distributed.pipelining (same model, weights, batch and schedule; ms = median step "
          "of the slowest rank; wall time)")
    twins = [TWIN_LABELS[k] for k in TWINS]
    ratios = " ".join(f"{'hp/' + t:>11}" for t in twins)
    print(f"{'p':>2} {'schedule':<12} {'hpfunc':>7} {'torch':>7} {'hp/torch':>8}  {'loss hpfunc':>11} "
          f"{'loss torch':>11} {'max |diff|':>10} | {'cpu hp':>6} | paired {ratios} | median {ratios} | "
          f"main thread {'hp/torch+mf':>11} | min {'hp/torch+mf':>11}")
    for r in rows:
        t = r["torch"]
        if "error" in t:
            print(f"{r['ranks']:>2} {r['schedule']:<12} {1e3 * r['measured']['step_s']:7.1f} {'-':>7} {'-':>8}  "
                  f"torch {TORCH_SCHEDULES[r['schedule']]} did not run: {t['error']}")
            continue
        f = r["torch_fused"]
        print(f"{r['ranks']:>2} {r['schedule']:<12} {1e3 * r['measured']['step_s']:7.1f} {1e3 * t['step_s']:7.1f} "
              f"{t['ratio']:8.2f}  {r['hpfunc_losses'][0]:11.6f} {t['losses'][0]:11.6f} {f['max_loss_diff']:10.1e} | "
              f"{1e3 * t['hpfunc_cpu_s']:6.0f} |        " + " ".join(f"{r[k]['cpu_ratio_paired']:11.2f}" for k in TWINS)
              + " |        " + " ".join(f"{r[k]['cpu_ratio']:11.2f}" for k in TWINS)
              + f" |             {f['main_thread_ratio_paired']:11.2f} |     {f['cpu_ratio_min']:11.2f}")
    print("loss = first step's (same weights, same batch); max |diff| = the largest difference of the per-step "
          "losses from torch+mf's, which runs hpfunc's AdamW kernel (0: bit for bit; the twins with AdamW's default "
          "arithmetic differ by its rounding, in the JSON), over all steps (warm-up included); "
          "cpu hp = hpfunc's CPU ms of one step summed over the ranks (process time: gloo's threads included); "
          "paired = the median over rounds of hp's CPU time over the twin's in the same round (every framework runs "
          "once a round, back to back: the machine's drift cancels); median = the ratio of the median steps; "
          "torch = torch.optim.AdamW's defaults; torch+m = that twin also computing the global gradient norm and "
          "handing the loss to every rank, as hpfunc's step does; torch+mf = torch+m with AdamW(fused=True), the "
          "kernel hpfunc's adamw runs (the strict comparison); main thread = the paired ratio on the main threads' "
          "CPU time (gloo's threads left out); min = the ratio of each framework's least CPU time per step (the "
          "step other jobs disturbed least)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 ranks only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks = "2"
    names = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown:
        ap.error(f"--schedules: unknown {unknown}; use a subset of {','.join(SCHEDULES)}")
    from hpfunc.testing import RankPool
    from hpfunc.transforms.pipeline_plan import build_schedule
    from hpfunc.train.output import to_json  # strict JSON: a non-finite number is written as null

    load = [os.getloadavg()[0]]
    print(f"load average (1 min) at start: {load[0]:.1f} on {os.cpu_count()} cores")
    rows = []
    t_start = time.perf_counter()
    for p in [int(x) for x in args.ranks.split(",")]:
        with RankPool(p, timeout=600) as pool:
            for name in names:
                per_rank = pool.run(bench_on_rank, name, args.microbatches, args.layers, args.hidden, args.batch,
                                    args.seq, args.iters, args.warmup)
                per_rank.sort(key=lambda pr: pr["rank"])
                schedule = build_schedule(name, p, args.microbatches, 2 if name == "interleaved" else None)
                ran = {pr["rank"]: pr["schedule"] for pr in per_rank}
                if any([str(a) for a in schedule.actions[r]] != ran[r] for r in ran):
                    # simulate must play what the executor ran, or the comparison means nothing
                    raise RuntimeError(f"bench/pipeline.py: p={p} {name}: the front door ran another schedule than "
                                       f"build_schedule({name!r}, {p}, {args.microbatches}); compare them")
                rows.append(summarise(name, p, args.microbatches, per_rank, schedule))
                load.append(os.getloadavg()[0])
                print(f"  p={p} {name}: done ({time.perf_counter() - t_start:.0f} s, load {load[-1]:.1f})", flush=True)
    print_tables(rows)
    print(f"\nload average (1 min) during the run: {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores "
          f"(other jobs share them); model: dense Qwen3 tiny, {args.layers} layers, hidden {args.hidden}, "
          f"batch {args.batch} x {args.seq} tokens, {args.microbatches} microbatches; "
          f"{args.iters} timed steps after {args.warmup} warm-up; {time.perf_counter() - t_start:.0f} s in all")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("ranks", "microbatches", "layers", "hidden", "batch", "seq", "iters",
                                            "warmup")}
    Path(args.out).write_text(to_json({"rows": _jsonable(rows), "config": config, "load_average": load,
                                       "cores": os.cpu_count()}, where=args.out, indent=2))
    print(f"wrote {args.out}")
    return 0


def _jsonable(x: Any) -> Any:
    """Tuple keys (kind, stage) as "kind:stage" strings, int keys as strings."""
    if isinstance(x, dict):
        return {(f"{k[0]}:{k[1]}" if isinstance(k, tuple) else str(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
