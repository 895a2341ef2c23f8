"""The training loop: config -> data, model, optimizer -> steps -> outputs.

:func:`execute` (what :meth:`hpfunc.train.Trainer.run` and :func:`hpfunc.train.run` call) does, in order:
build and check the model config, claim the output folder (:class:`hpfunc.train.output.RunFolder`: a lock
held for the run; a folder holding another run is refused unless ``overwrite``), read and check the data, ``init`` the params from ``key(seed)``, build
the optimizer, then for each step sample a batch (a pure function of seed and step), call the pure
``train_step`` and log. It writes into ``output.dir`` (each file atomically, ``metrics.jsonl`` a whole
line at a time): ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``sample.txt``, ``loss.png``
and, last, ``summary.json``. A non-finite loss or gradient norm, a non-finite validation loss, or
non-finite parameters after the last update stop the run with :class:`TrainingDiverged` naming the
step (no ``summary.json`` is written: the run did not finish).

With a ``parallel.mesh`` of more than one process, it runs in every rank of a launch
(``hpfunc train`` starts them): each rank builds the same global batch, the step is
``hpfunc.parallelize(train_step, mesh, plan)`` on parameters created sharded
(:mod:`hpfunc.train.distributed`), and only rank 0 prints and writes. Evaluation and sampling gather
the parameters to full tensors (every rank takes part in the gather) and run the single-device
code on rank 0.

Example:
    >>> from hpfunc.train.config import load_config_dict
    >>> cfg = load_config_dict({"train": {"steps": 2, "batch_size": 1, "seq_len": 8, "num_threads": 1},
    ...                         "data": {"max_bytes": 20000}, "output": {"progress": "none", "plot": False,
    ...                         "dir": __import__("tempfile").mkdtemp()}})
    >>> from hpfunc.train.trainer import Trainer
    >>> result = execute(Trainer(cfg, echo=False))
    >>> result.summary["steps"]
    2
"""

from __future__ import annotations

import contextlib
import functools
import math
import pathlib
import sys
import time
from typing import Any, Callable, Sequence, TextIO

import attrs
import torch
import yaml

from hpfunc import random
from hpfunc.checkpoint import latest
from hpfunc.faults import is_comm_failure, pop_failure, record_failure
from hpfunc.train.build import build_optimizer, build_schedule, check_buildable, model_dtype
from hpfunc.train.checkpointing import (ResumePlan, TrainCheckpoints, checkpoint_root, clear_checkpoints, plan_resume,
                                        restore_state, truncate_metrics)
from hpfunc.train.config import Config, ConfigError, config_to_dict
from hpfunc.train.data import check_data, data_inputs, eval_batches, load_data, sample_batch
from hpfunc.train.output import MetricsWriter, Progress, RunFolder, format_summary, plot_losses
from hpfunc.train.distributed import is_distributed
from hpfunc.train.fault_hooks import FaultHooks
from hpfunc.train.last_words import LastWords, StopSignals, Stopped, stop_message
from hpfunc.train.step import TrainState, init_train_state, make_eval_step, make_grad_check_step, make_train_step

__all__ = ["RunResult", "TrainingDiverged", "Stopped", "execute", "data_keys"]


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm, the validation loss or the parameters became NaN or infinite; the
    message names the step. The metrics logged so far are kept."""


_DIVERGED_FIX = ("lower optimizer.lr, add warmup (schedule.warmup_steps) or clipping (optimizer.clip_norm); "
                 "the metrics logged before are kept in metrics.jsonl")


def _finite_step(loss: float, grad_norm: float) -> bool:
    """The guard every step passes before it is applied: its loss and gradient norm are finite."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


def _nonfinite_text(loss: float, grad_norm: float, lr: float) -> str:
    """``the loss is nan (grad norm nan, lr 0.01)`` / ``the gradient norm is inf while the loss is 5.5 (lr 1e+10)``."""
    if not math.isfinite(loss):
        return f"the loss is {loss} (grad norm {grad_norm:.3g}, lr {lr:.3g})"
    return f"the gradient norm is {grad_norm} while the loss is {loss:.4f} (lr {lr:.3g})"


def _first_nonfinite(params: Any) -> tuple[str, int, int] | None:
    """``(path, non-finite values, values)`` of the first parameter holding NaN or infinity."""
    from hpfunc import tree

    for path, x in tree.leaves_with_paths(params):
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            bad = int((~torch.isfinite(x)).sum())
            if bad:
                return path, bad, x.numel()
    return None


@attrs.frozen
class RunResult:
    """What :func:`run` returns: the final state, the logged records and the summary."""

    state: TrainState
    records: list
    summary: dict
    out_dir: pathlib.Path


def data_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(init_key, train_data_key, val_data_key)`` derived from the run's seed."""
    root = random.key(seed)
    return random.fold_in(root, 0), random.fold_in(root, 1), random.fold_in(root, 2)


def _expert_stats(load: torch.Tensor, ep_size: int = 1) -> dict[str, Any]:
    """The step's MoE load (the whole batch): per layer the max / mean expert load, its mean over the
    layers, and with expert parallelism over ``ep_size`` ranks the pairs each rank's experts received
    per layer and their max / mean.

    >>> s = _expert_stats(torch.tensor([[4, 0, 2, 2]]), ep_size=2)
    >>> s["expert_imbalance_per_layer"], s["ep_rank_load"], s["ep_imbalance_per_layer"]
    ([2.0], [[4, 4]], [1.0])
    """
    if load.numel() == 0:
        return {}
    load = load.to(torch.float64)
    per_layer = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)
    out = {"expert_imbalance": float(per_layer.mean()), "expert_imbalance_per_layer": per_layer.tolist(),
           "expert_load": load.to(torch.int64).tolist()}
    if ep_size > 1 and load.shape[1] % ep_size == 0:
        ranks = load.view(load.shape[0], ep_size, -1).sum(-1)  # rank r holds experts [r E/n, (r+1) E/n)
        out["ep_rank_load"] = ranks.to(torch.int64).tolist()
        out["ep_imbalance_per_layer"] = (ranks.max(dim=1).values / ranks.mean(dim=1).clamp_min(1e-12)).tolist()
    return out


def _dropped_stats(dropped: torch.Tensor) -> dict[str, Any]:
    """The pairs of the step's batch that no expert computed (over capacity, or past a padded buffer):
    per MoE layer and in all.

    >>> _dropped_stats(torch.tensor([3, 0]))
    {'dropped_pairs': 3, 'dropped_pairs_per_layer': [3, 0]}
    """
    per_layer = dropped.to(torch.int64).reshape(-1).tolist()
    return {"dropped_pairs": sum(per_layer), "dropped_pairs_per_layer": per_layer}


def _check_val_finite(step: int, val: float, last: dict[str, float]) -> None:
    if not math.isfinite(val):
        raise TrainingDiverged(f"step {step}: the validation loss is {val} (the training loss of step {step} was "
                               f"{last.get('loss', float('nan')):.4f}, lr {last.get('lr', float('nan')):.3g}); "
                               f"{_DIVERGED_FIX}")


def _evaluate(eval_step: Callable, params: Any, batches: list) -> float | None:
    if not batches:
        return None
    return float(torch.stack([eval_step(params, b) for b in batches]).mean())


def _evaluate_sharded(eval_step: Callable, state: Any, batches: list) -> float | None:
    """The mean validation loss through the parallelized eval step (a collective: every rank calls it)."""
    if not batches:
        return None
    return float(torch.stack([eval_step(state, b)[1]["ce_loss"] for b in batches]).mean())


class _NoWriter:
    """Stands in for the metrics file on ranks other than 0."""

    def write(self, record: dict[str, Any]) -> None:
        del record

    def __enter__(self) -> "_NoWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _local_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Replicated metrics of a parallel step as plain tensors (DTensors hold the value on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}


def execute(trainer: Any) -> RunResult:
    """The run of a :class:`~hpfunc.train.trainer.Trainer` (its config and options), in this process (one
    rank of a launch, or the only process)."""
    cfg, o = trainer.cfg, trainer.options
    out_dir, stream, echo = o["out_dir"], o["stream"], o["echo"]
    overwrite, inputs, lock_token, resume = o["overwrite"], o["inputs"], o["lock_token"], o["resume"]
    threads = torch.get_num_threads()
    if cfg.train.num_threads is not None:
        # Process-wide in torch; restored on exit. On a shared or small machine one thread is often
        # much faster than oversubscribed ones for a tiny model.
        torch.set_num_threads(cfg.train.num_threads)
    try:
        claim = {"overwrite": overwrite, "inputs": inputs, "lock_token": lock_token, "resume": resume}
        if not is_distributed(cfg.parallel):
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo, claim=claim, trainer=trainer)
        from hpfunc.train.distributed import start_mesh

        with start_mesh(cfg.parallel) as mesh:
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo, mesh=mesh, claim=claim, trainer=trainer)
    finally:
        torch.set_num_threads(threads)


def _plan_on_rank0(cfg: Config, out: pathlib.Path, claim: dict[str, Any], mesh: Any) -> ResumePlan:
    """:func:`plan_resume` on rank 0, its answer (or its error) on every rank."""
    if mesh is None:
        return plan_resume(cfg, out, claim["resume"], overwrite=claim["overwrite"])
    from hpfunc.checkpoint import _ranks

    answer: Any = None
    if torch.distributed.get_rank() == 0:
        try:
            answer = plan_resume(cfg, out, claim["resume"], overwrite=claim["overwrite"])
        except ConfigError as e:
            answer = e
    answer = _ranks.from_rank0(answer, None)
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _run(cfg: Config, *, out_dir: str | pathlib.Path | None, stream: TextIO | None, echo: bool,
         mesh: Any = None, claim: dict[str, Any], trainer: Any) -> RunResult:
    main = mesh is None or torch.distributed.get_rank() == 0  # the rank that prints and writes
    model_cfg = check_buildable(cfg)  # config errors first: nothing is created for a config that cannot run
    out = pathlib.Path(cfg.output.dir if out_dir is None else out_dir)
    plan = _plan_on_rank0(cfg, out, claim, mesh)  # before any file is written
    if main:
        for line in plan.skipped:  # damaged newer checkpoints, renamed: said once, before the run starts
            print(f"hpfunc train: {line}", file=sys.stderr, flush=True)
    if not main:
        return _train(cfg, model_cfg, out, None, stream=stream, echo=echo, mesh=mesh, plan=plan, trainer=trainer)
    hint = ("; or continue it from its newest checkpoint with --resume auto"
            if latest(checkpoint_root(cfg, out)) is not None else "")
    folder = RunFolder(out, overwrite=claim["overwrite"] and not plan.restart,
                       inputs=[*claim["inputs"], *data_inputs(cfg.data)], inherited=claim["lock_token"],
                       resume=plan.resume, hint=hint)
    with folder:  # held to the last write; a second run into the folder is refused meanwhile
        return _train(cfg, model_cfg, out, folder, stream=stream, echo=echo, mesh=mesh, plan=plan, trainer=trainer)


def _first_nonfinite_grad(check_step: Callable, state: Any, batch: Any, *, on_mesh: bool) -> str:
    """The message part naming the first parameter whose gradient on ``batch`` is not finite: the
    failure path recomputes the step's gradient once (one more forward and backward; on a mesh every
    rank joins it, and the counts are summed over the ranks that hold each block, so only one process
    gives an exact count)."""
    from hpfunc import tree

    _, out = check_step(state, batch)
    out = _local_metrics(out) if on_mesh else out
    leaves = tree.leaves(tree.map_with_path(lambda p, x: (p, x), state.params, none_is_leaf=True),
                         is_leaf=lambda x: isinstance(x, tuple))
    for (path, x), count in zip(leaves, out["nonfinite"].tolist()):
        if count:
            of = ("its gradient has non-finite values on the ranks that hold it" if on_mesh else
                  f"{count} of {x.numel()} values")
            return f"; the first parameter whose gradient is not finite: {path!r} ({of})"
    return "; every parameter's gradient is finite"


def _train(cfg: Config, model_cfg: Any, out: pathlib.Path, folder: RunFolder | None, *, stream: TextIO | None,
           echo: bool, mesh: Any, plan: ResumePlan, trainer: Any) -> RunResult:
    from hpfunc.train.callbacks import CallbackList

    spec = trainer.spec
    main = folder is not None  # the rank that prints and writes
    calls = CallbackList(trainer.callbacks, main=main)
    progress_mode = cfg.output.progress if main else "none"
    quiet = not echo or progress_mode == "none"
    out_stream = sys.stdout if stream is None else stream

    def say(text: str) -> None:
        if not quiet:
            print(text, file=stream, flush=True)

    tc = cfg.train
    cc = cfg.checkpoint

    if tc.aux_loss_coef is not None and spec.with_aux_loss_coef is not None:
        model_cfg = spec.with_aux_loss_coef(model_cfg, tc.aux_loss_coef)
    factor = build_schedule(cfg.schedule, tc.steps)
    optimizer, lr = build_optimizer(cfg.optimizer, factor, spec)

    t0 = time.perf_counter()
    data = load_data(cfg.data)
    check_data(data, cfg, spec.vocab_size(model_cfg))  # before the first write: a bad corpus leaves the folder alone
    say(f"data: {data.description} ({data.train.numel():,} train / {data.val.numel():,} val) "
        f"in {time.perf_counter() - t0:.1f} s")

    init_key, train_key, val_key = data_keys(cfg.seed)
    n_params = spec.count_params(model_cfg)
    say(f"model: {cfg.model.preset}, {spec.describe(model_cfg)}")
    say(f"train: {tc.steps} steps of {tc.batch_size} x {tc.seq_len} tokens, {cfg.optimizer.name}, "
        f"{cfg.schedule.name} schedule")

    if mesh is None:
        if cfg.model.pretrained is not None:  # the Hugging Face folder's weights, checked against the config
            params = spec.hf.load_params(cfg.model.pretrained, model_cfg, dtype=model_dtype(cfg.model))
        else:
            params = spec.init(init_key, model_cfg, dtype=model_dtype(cfg.model))
        state = init_train_state(params, optimizer)
        train_step = make_train_step(model_cfg, optimizer, expert_bias_rate=tc.expert_bias_rate, lr_schedule=lr,
                                     num_microbatches=tc.microbatches,
                                     loss_fn=spec.compiled_loss(spec.loss, tc.compile))
        full_params: Callable[[Any], Any] = lambda p: p  # noqa: E731
        sharded_eval = None
        check_step = functools.partial(make_grad_check_step, model_cfg, num_microbatches=tc.microbatches,
                                       loss_fn=spec.loss)
    else:
        from hpfunc.train.distributed import (build_eval_step, build_grad_check_step, build_parallel_step,
                                              parallel_summary)

        say(parallel_summary(cfg))
        state, train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, init_key, mesh,
                                                model_dtype(cfg.model))
        full_params = train_step.full_params  # a collective (a pipeline's stages come from their ranks)
        check_step = functools.partial(build_grad_check_step, cfg, model_cfg, mesh)
        sharded_eval = build_eval_step(cfg, model_cfg, mesh)
    eval_step = make_eval_step(model_cfg, loss_fn=spec.loss)

    # where the run starts: step 0, or a checkpoint loaded into this run's layout (resharded)
    start = 0
    loop: dict[str, Any] = {}
    if plan.path is not None:
        from hpfunc import checkpoint

        t = time.perf_counter()
        loop = dict(checkpoint.info(plan.path)["metadata"]["loop"])
        state, start = restore_state(plan.path, state)
        say(f"resume: from {plan.path} (step {start} of {tc.steps}, {int(state.step)} optimizer steps) in "
            f"{time.perf_counter() - t:.2f} s" + (f"; changed: {', '.join(plan.notes)}" if plan.notes else ""))
    elif plan.restart:
        say(f"resume: no checkpoint yet under {checkpoint_root(cfg, out)}; attempt {plan.restart + 1} starts over")
    failure = pop_failure() if main and plan.restart else None
    failure_seen = time.time()

    root = checkpoint_root(cfg, out)
    kept: list[dict[str, Any]] = []
    if main:  # the first write: a previous run's files go now (with overwrite), not before
        folder.start()
        if not plan.resume and folder.overwrite:
            clear_checkpoints(root)
        if plan.resume:
            kept = truncate_metrics(folder.file("metrics.jsonl"), start)  # no step twice
        folder.write_text("config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    val_batches = (
        eval_batches(data.val, val_key, tc.eval_batches, tc.batch_size, tc.seq_len, data.val_docs)
        if data.val.numel() > tc.seq_len and tc.eval_batches
        else []
    )

    # collective on a mesh (process groups of the async saver and of the last words), in this order
    ckpts = TrainCheckpoints(cfg, root) if cc.every > 0 else None
    words = LastWords(ckpts, distributed=mesh is not None, timeout_s=cc.last_words_timeout_s)
    use_words = ckpts is not None and cc.last_words
    hooks = FaultHooks.from_env()
    rank = torch.distributed.get_rank() if mesh is not None else 0
    trainer._bind_run(state=state, model_cfg=model_cfg, out_dir=out, main=main, rank=rank, mesh=mesh,
                      checkpoint_root=root, folder=folder, start_step=start, checkpoints=ckpts)

    ep_size = next((cfg.parallel.mesh[e.axes[0]] for e in cfg.parallel.plan if e.kind == "ep"), 1)
    records: list[dict[str, Any]] = list(kept)
    trainer.records = records
    losses: list[float] = list(loop.get("recent", []))  # the last ones before a resume: the summary's mean
    first_loss = loop.get("first_loss")
    min_loss = loop.get("min_loss")
    tokens_per_step = tc.batch_size * tc.seq_len
    train_time = float(loop.get("train_time_s", 0.0))
    window: list[float] = list(loop.get("window", []))
    window_time = float(loop.get("window_time_s", 0.0))
    # the window's other per-step values: a record logs every loss and the gradient norm the same way,
    # as the mean over the steps since the previous record
    window_parts: dict[str, list[float]] = {k: list(v) for k, v in loop.get("window_parts", {}).items()}
    skipped = int(loop.get("skipped", 0))
    in_a_row = int(loop.get("in_a_row", 0))
    recovery_s: float | None = None
    last: dict[str, float] = {}
    progress = Progress(tc.steps, progress_mode, stream)
    progress.update(start)

    def loop_state() -> dict[str, Any]:
        return {"first_loss": first_loss, "recent": losses[-10:], "min_loss": min_loss, "train_time_s": train_time,
                "window": window, "window_time_s": window_time, "window_parts": window_parts, "skipped": skipped,
                "in_a_row": in_a_row}

    def last_words(done: int, why: str) -> str:
        """Save the state after ``done`` steps on the way out; the message says what happened."""
        if not use_words:
            return ""
        _, message = words.save(state, done, loop_state(), why=why)
        if main or message.startswith("no checkpoint"):
            print(f"hpfunc train{f' [rank {rank}]' if mesh is not None else ''}: last words ({why}): {message}",
                  file=sys.stderr, flush=True)
        return message

    done = start
    finished = False  # an error of the checkpoints' closing must not hide the error that ends the run
    try:
        calls.train_start(trainer)
        with MetricsWriter(folder.file("metrics.jsonl")) if main else _NoWriter() as writer, \
                StopSignals() if use_words or mesh is None else contextlib.nullcontext() as signals:
            for step in range(start, tc.steps):
                hooks.maybe_kill(step + 1, rank=rank, attempt=plan.restart)
                batch = hooks.batch(step + 1, sample_batch(data.train, train_key, step, tc.batch_size, tc.seq_len, data.train_docs),
                                    spec.ignore_index)
                t = time.perf_counter()
                try:
                    new_state, metrics = train_step(state, batch)  # pure: `state` stays the last completed step's
                    if mesh is not None:
                        metrics = _local_metrics(metrics)
                    loss = float(metrics["loss"])  # the host read also ends the step's work
                except Exception as e:
                    if is_comm_failure(e):
                        record_failure(f"rank {rank} lost a peer in step {step + 1}")
                    last_words(done, f"step {step + 1} failed: {type(e).__name__}")
                    raise
                grad_norm, step_lr = float(metrics["grad_norm"]), float(metrics["lr"])
                dt = time.perf_counter() - t
                train_time += dt
                if not _finite_step(loss, grad_norm):  # every rank holds the same values
                    skipped += 1
                    in_a_row += 1
                    what = _nonfinite_text(loss, grad_norm, step_lr)
                    if tc.on_nonfinite == "stop" or in_a_row > tc.max_skips:
                        grad = _first_nonfinite_grad(check_step(), state, batch, on_mesh=mesh is not None)
                        cap = (f"; {in_a_row} steps in a row were not finite, more than train.max_skips "
                               f"({tc.max_skips})" if tc.on_nonfinite == "skip" else "")
                        saved = last_words(done, f"step {step + 1} not finite")
                        raise TrainingDiverged(
                            f"step {step + 1}: {what}{grad}{cap}; the step was not applied (the state is that "
                            f"of step {done}{f'; last words: {saved}' if saved else ''}); {_DIVERGED_FIX}")
                    done = step + 1
                    vrec = {"step": done, "skipped": True, "reason": f"{what}; the step was not applied",
                            "skipped_steps": skipped}
                    writer.write(vrec)
                    records.append(vrec)
                    progress.message(f"step {done}: {what}; skipped (not applied; {skipped} skipped so far, "
                                     f"{in_a_row} in a row of at most {tc.max_skips})")
                    progress.update(done)
                    continue
                state, in_a_row = new_state, 0
                last = {"loss": loss, "grad_norm": grad_norm, "lr": step_lr}
                window_time += dt
                losses.append(loss)
                window.append(loss)
                for key, value in (("ce_loss", metrics["ce_loss"]), ("aux_loss", metrics["aux_loss"]),
                                   ("grad_norm", grad_norm)):
                    window_parts.setdefault(key, []).append(float(value))
                first_loss = loss if first_loss is None else first_loss
                min_loss = loss if min_loss is None else min(min_loss, loss)
                done = step + 1
                if recovery_s is None and plan.restart and main:
                    recovery_s = time.time() - (failure["time"] if failure else failure_seen)
                    since = (f"{recovery_s:.1f} s from the failure ({failure['what']}) to the first resumed step"
                             if failure else f"{recovery_s:.1f} s from this attempt's start to its first step (no "
                             f"rank noted the failure's time)")
                    print(f"hpfunc train: elastic restart {plan.restart} of {cfg.parallel.max_restarts}: resumed at "
                          f"step {start}; {since}", file=out_stream, flush=True)
                record = None
                if done % tc.log_every == 0 or done == 1 or done == tc.steps:
                    record = {
                        "step": done,
                        # means over the window (the steps since the previous record), all four alike
                        "loss": sum(window) / len(window),
                        **{k: sum(v) / len(v) for k, v in window_parts.items()},
                        "lr": step_lr,  # the record's step's, as the expert statistics below
                        "tokens_per_s": tokens_per_step * len(window) / max(window_time, 1e-9),
                        "elapsed_s": train_time,
                        **(_expert_stats(metrics["expert_load"], ep_size) if "expert_load" in metrics else {}),
                        **(_dropped_stats(metrics["dropped_pairs"]) if "dropped_pairs" in metrics else {}),
                    }
                    if skipped:
                        record["skipped_steps"] = skipped
                    writer.write(record)
                    records.append(record)
                    window, window_time, window_parts = [], 0.0, {}
                trainer.state, trainer.record = state, record
                calls.step_end(trainer, done, metrics)
                if tc.eval_every and done % tc.eval_every == 0 and done != tc.steps and val_batches:
                    if sharded_eval is not None:  # every rank, on its shards: no gathered copy
                        val = _evaluate_sharded(sharded_eval, state, val_batches)
                        val = val if main else None
                    else:
                        full = full_params(state.params)  # a collective: every rank
                        val = _evaluate(eval_step, full, val_batches) if main else None
                    if val is not None:
                        _check_val_finite(done, val, last)
                        vrec = {"step": done, "val_loss": val}
                        writer.write(vrec)
                        records.append(vrec)
                        progress.message(f"step {done}: validation loss {val:.4f}")
                        calls.eval(trainer, done, val)
                progress.update(done, record)
                if ckpts is not None and ckpts.due(done) and done != tc.steps:
                    with _save_errors(root, done):
                        ckpts.save(state, done, loop_state())
                    calls.save(trainer, done, root)
                save_failed = ckpts is not None and ckpts.failed()  # an async save: known at the next step
                if signals is not None:
                    hooks.maybe_term(done, handled=signals.signum is None and signals.installed)
                if use_words:
                    try:
                        signum, save_failed = words.any_stop(signals.signum, save_failed)
                    except Exception as e:  # a peer lost between two steps: the state of `done` is whole
                        if is_comm_failure(e):
                            record_failure(f"rank {rank} lost a peer after step {done}")
                        last_words(done, f"a peer was lost after step {done}: {type(e).__name__}")
                        raise
                    if signum is not None and done != tc.steps:
                        raise Stopped(stop_message(signum, done, last_words(done, _sig_name(signum))), signum)
                elif mesh is not None and ckpts is not None and ckpts.in_flight():
                    save_failed = _any_rank(save_failed)  # every rank stops at the same step
                elif signals is not None and signals.signum is not None and done != tc.steps:
                    # one process without last words: still a message and 128 + the signal, after the step
                    why = ("checkpoints are off (checkpoint.every: 0), so the run cannot be continued" if ckpts is None
                           else "no checkpoint on the way out (checkpoint.last_words: false); continue from the "
                                "newest one with `hpfunc train CONFIG --resume auto`")
                    raise Stopped(f"stopped by {_sig_name(signals.signum)} after step {done}; {why}; the metrics up "
                                  f"to step {done} are kept", signals.signum)
                if save_failed:
                    with _save_errors(root, done):
                        ckpts.wait()  # raises the save's error, the same on every rank
            if ckpts is not None and done == tc.steps and start < tc.steps:
                with _save_errors(root, done):
                    ckpts.save(state, done, loop_state())  # the last step's state: a run can be extended from it
                    ckpts.wait()
                calls.save(trainer, done, root)
            final_val = _evaluate_sharded(sharded_eval, state, val_batches) if sharded_eval is not None else None
            final_params = full_params(state.params)  # a collective: every rank
            bad = _first_nonfinite(final_params)  # the last update has no later loss to show it
            if bad is not None:
                path, n_bad, n = bad
                raise TrainingDiverged(
                    f"step {tc.steps} (the last): its update left non-finite parameters ({n_bad} of the {n} values "
                    f"of {path!r} are NaN or infinite) although the step's loss ({last.get('loss', math.nan):.4f}) "
                    f"and gradient norm ({last.get('grad_norm', math.nan):.3g}) were finite "
                    f"(lr {last.get('lr', math.nan):.3g}); {_DIVERGED_FIX}")
            if sharded_eval is not None:
                val = final_val if main else None
            else:
                val = _evaluate(eval_step, final_params, val_batches) if main else None
            if val is not None:
                _check_val_finite(tc.steps, val, last)
                vrec = {"step": tc.steps, "val_loss": val}
                writer.write(vrec)
                records.append(vrec)
                calls.eval(trainer, tc.steps, val)
        finished = True
    except BaseException as e:
        calls.exception(trainer, e)
        raise
    finally:
        progress.close()
        if ckpts is not None:
            try:
                ckpts.close()
            except Exception:
                if finished:
                    raise
            finally:
                words.close()

    last_window = min(10, len(losses))
    summary = {
        "steps": tc.steps,
        "tokens": tokens_per_step * tc.steps,
        "train_time_s": train_time,
        "tokens_per_s": tokens_per_step * tc.steps / max(train_time, 1e-9),
        "first_loss": first_loss,
        "last_loss": sum(losses[-last_window:]) / last_window if last_window else None,
        "last_window": last_window,
        "min_loss": min_loss,
        "val_loss": val,
        "params": n_params,
        "out_dir": str(out),
    }
    if skipped:
        summary["skipped_steps"] = skipped
    if plan.path is not None:
        summary["resumed_from_step"] = start
    if plan.restart:
        summary["restarts"] = plan.restart
        summary["recovery_s"] = recovery_s
    if ckpts is not None:
        summary["checkpoints"] = {"dir": str(root), "saves": len(ckpts.blocked_s),
                                  "blocked_s_per_save": sum(ckpts.blocked_s) / max(len(ckpts.blocked_s), 1),
                                  "write_s_per_save": sum(ckpts.write_s) / max(len(ckpts.write_s), 1),
                                  "async": ckpts.asynchronous}
    if mesh is not None:
        summary["processes"] = cfg.parallel.size
        summary["mesh"] = dict(cfg.parallel.mesh)
    trainer.state, trainer.summary = state, summary
    if not main:
        calls.train_end(trainer, summary)  # the callbacks that run on every rank
        return RunResult(state=state, records=records, summary=summary, out_dir=out)
    oc = cfg.output
    byte_level = cfg.data.source != "ids" and not cfg.data.tokenizer
    if oc.sample_tokens and byte_level and oc.sample_prompt:
        from hpfunc.train.sample import sample_text

        text = sample_text(final_params, model_cfg, oc.sample_prompt, oc.sample_tokens,
                           random.fold_in(random.key(cfg.seed), 3), temperature=oc.sample_temperature,
                           apply=spec.apply)
        folder.write_text("sample.txt", text)
        summary["sample"] = text
        say(f"sample (temperature {oc.sample_temperature}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    elif oc.sample_tokens and oc.sample_prompt:  # said, not silently skipped
        what = f"data.tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else "data.source: ids"
        say(f"sample: none written: output.sample_tokens generates bytes, and this run's data is token ids ({what}); "
            f"set output.sample_tokens: 0 to silence this")
    if cfg.output.plot:
        title = f"{cfg.model.preset} on {cfg.data.source} ({tc.steps} steps, batch {tc.batch_size}x{tc.seq_len})"
        if mesh is not None:
            title += "\nmesh " + " x ".join(f"{a} {n}" for a, n in cfg.parallel.mesh.items())
        plot_losses(records, folder.file("loss.png"), title=title)
    calls.train_end(trainer, summary)  # a failing callback leaves no summary.json: the run did not finish
    folder.write_json("summary.json", summary)  # last: its presence means the run finished
    say(format_summary(summary))
    return RunResult(state=state, records=records, summary=summary, out_dir=out)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (one all-reduce of one integer)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t[0])


@contextlib.contextmanager
def _save_errors(root: pathlib.Path, done: int):
    """A checkpoint that could not be saved stops the run: its error (the same on every rank) says
    which checkpoint stays the newest and how to continue. Nothing is trained after it."""
    from hpfunc.checkpoint import CheckpointError

    try:
        yield
    except CheckpointError as e:
        newest = latest(root)
        keep = (f"the newest complete checkpoint is still {newest} (continue from it with --resume auto once the "
                f"cause is fixed)" if newest is not None else "no complete checkpoint was written before")
        raise CheckpointError(f"checkpoint.dir: {e}; the run stopped after step {done}; {keep}") from None


def _sig_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
