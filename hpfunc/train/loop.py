"""The training loop: config -> data, model, optimizer -> steps -> outputs.

``run(cfg)`` does, in order: build and check the model config, read the data, ``init`` the params
from ``key(seed)``, build the optimizer, then for each step sample a batch (a pure function of seed
and step), call the pure ``train_step`` and log. It writes into ``output.dir``: ``config.yaml``
(the resolved config), ``metrics.jsonl``, ``loss.png`` and ``summary.json``.

With a ``parallel.mesh`` of more than one process, ``run`` is called in every rank of a launch
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
    >>> result = run(cfg, echo=False)
    >>> result.summary["steps"]
    2
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any, Callable, TextIO

import attrs
import torch
import yaml

from hpfunc import random
from hpfunc.train.build import build_model_config, build_optimizer, build_schedule, model_dtype
from hpfunc.train.config import Config, ConfigError, config_to_dict
from hpfunc.train.data import TokenData, eval_batches, load_data, sample_batch
from hpfunc.train.output import MetricsWriter, Progress, format_summary, plot_losses
from hpfunc.train.distributed import is_distributed
from hpfunc.train.step import TrainState, init_train_state, make_eval_step, make_train_step

__all__ = ["RunResult", "TrainingDiverged", "run", "data_keys"]


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the metrics logged so far are kept."""


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


def _check_vocab(data: TokenData, model_cfg: Any) -> None:
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the data has token ids up to {data.vocab_size - 1} but the model's vocabulary "
            f"is {model_cfg.vocab_size}; set model.vocab_size: {data.vocab_size} (or more)"
        )


def _expert_stats(load: torch.Tensor) -> dict[str, Any]:
    if load.numel() == 0:
        return {}
    load = load.to(torch.float64)
    imbalance = (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)).mean()
    return {"expert_imbalance": float(imbalance), "expert_load": load.to(torch.int64).tolist()}


def _evaluate(eval_step: Callable, params: Any, batches: list) -> float | None:
    if not batches:
        return None
    return float(torch.stack([eval_step(params, b) for b in batches]).mean())


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


def run(
    cfg: Config,
    *,
    out_dir: str | pathlib.Path | None = None,
    stream: TextIO | None = None,
    echo: bool = True,
) -> RunResult:
    """Train for ``cfg.train.steps`` steps and write the outputs.

    With a ``parallel.mesh`` of more than one process this must run in every rank of a launch
    (``hpfunc train CONFIG`` starts them); rank 0 prints and writes, the others only compute.

    Args:
      cfg: a checked config (:func:`hpfunc.train.config.load_config`).
      out_dir: overrides ``cfg.output.dir``.
      stream: where progress and the summary are printed (stdout by default).
      echo: print the start lines and the final summary.
    """
    threads = torch.get_num_threads()
    if cfg.train.num_threads is not None:
        # Process-wide in torch; restored on exit. On a shared or small machine one thread is often
        # much faster than oversubscribed ones for a tiny model.
        torch.set_num_threads(cfg.train.num_threads)
    try:
        if not is_distributed(cfg.parallel):
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo)
        from hpfunc.train.distributed import start_mesh

        with start_mesh(cfg.parallel) as mesh:
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo, mesh=mesh)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Config, *, out_dir: str | pathlib.Path | None, stream: TextIO | None, echo: bool,
         mesh: Any = None) -> RunResult:
    from hpfunc.models import qwen3

    main = mesh is None or torch.distributed.get_rank() == 0  # the rank that prints and writes
    progress_mode = cfg.output.progress if main else "none"
    quiet = not echo or progress_mode == "none"

    def say(text: str) -> None:
        if not quiet:
            print(text, file=stream, flush=True)

    out = pathlib.Path(cfg.output.dir if out_dir is None else out_dir)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    tc = cfg.train

    model_cfg = build_model_config(cfg.model)
    if tc.aux_loss_coef is not None:
        model_cfg = attrs.evolve(model_cfg, router_aux_loss_coef=tc.aux_loss_coef)
    factor = build_schedule(cfg.schedule, tc.steps)
    optimizer, lr = build_optimizer(cfg.optimizer, factor)
    if main:
        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

    t0 = time.perf_counter()
    data = load_data(cfg.data)
    _check_vocab(data, model_cfg)
    say(f"data: {data.description} ({data.train.numel():,} train / {data.val.numel():,} val) "
        f"in {time.perf_counter() - t0:.1f} s")

    init_key, train_key, val_key = data_keys(cfg.seed)
    n_params, active = qwen3.count_params(model_cfg), qwen3.active_params(model_cfg)
    moe = f", {model_cfg.num_experts} experts top-{model_cfg.num_experts_per_tok}" if model_cfg.is_moe else ""
    act = f" ({active:,} active)" if active != n_params else ""
    say(f"model: {cfg.model.preset}, {model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}"
        f"{moe}: {n_params:,} params{act}")
    say(f"train: {tc.steps} steps of {tc.batch_size} x {tc.seq_len} tokens, {cfg.optimizer.name}, "
        f"{cfg.schedule.name} schedule")

    if mesh is None:
        params = qwen3.init(init_key, model_cfg, dtype=model_dtype(cfg.model))
        state = init_train_state(params, optimizer)
        train_step = make_train_step(model_cfg, optimizer, expert_bias_rate=tc.expert_bias_rate, lr_schedule=lr,
                                     num_microbatches=tc.microbatches)
        full_params: Callable[[Any], Any] = lambda p: p  # noqa: E731
    else:
        from hpfunc.train.distributed import build_parallel_step, gather_params, parallel_summary

        say(parallel_summary(cfg))
        state, train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, init_key, mesh,
                                                model_dtype(cfg.model))
        full_params = gather_params
    eval_step = make_eval_step(model_cfg)
    val_batches = (
        eval_batches(data.val, val_key, tc.eval_batches, tc.batch_size, tc.seq_len)
        if data.val.numel() > tc.seq_len and tc.eval_batches
        else []
    )

    records: list[dict[str, Any]] = []
    losses: list[float] = []
    tokens_per_step = tc.batch_size * tc.seq_len
    train_time = 0.0
    window: list[float] = []
    window_time = 0.0
    progress = Progress(tc.steps, progress_mode, stream)
    try:
        with MetricsWriter(out / "metrics.jsonl") if main else _NoWriter() as writer:
            for step in range(tc.steps):
                batch = sample_batch(data.train, train_key, step, tc.batch_size, tc.seq_len)
                t = time.perf_counter()
                state, metrics = train_step(state, batch)
                if mesh is not None:
                    metrics = _local_metrics(metrics)
                loss = float(metrics["loss"])  # the host read also ends the step's work
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        f"step {step + 1}: the loss is {loss} (grad norm {float(metrics['grad_norm']):.3g}, "
                        f"lr {float(metrics['lr']):.3g}); lower optimizer.lr, add warmup "
                        f"(schedule.warmup_steps) or clipping (optimizer.clip_norm)"
                    )
                dt = time.perf_counter() - t
                train_time += dt
                window_time += dt
                losses.append(loss)
                window.append(loss)
                done = step + 1
                record = None
                if done % tc.log_every == 0 or done == 1 or done == tc.steps:
                    record = {
                        "step": done,
                        "loss": sum(window) / len(window),
                        "ce_loss": float(metrics["ce_loss"]),
                        "aux_loss": float(metrics["aux_loss"]),
                        "grad_norm": float(metrics["grad_norm"]),
                        "lr": float(metrics["lr"]),
                        "tokens_per_s": tokens_per_step * len(window) / max(window_time, 1e-9),
                        "elapsed_s": train_time,
                        **(_expert_stats(metrics["expert_load"]) if "expert_load" in metrics else {}),
                    }
                    writer.write(record)
                    records.append(record)
                    window, window_time = [], 0.0
                if tc.eval_every and done % tc.eval_every == 0 and done != tc.steps and val_batches:
                    full = full_params(state.params)  # a collective: every rank
                    val = _evaluate(eval_step, full, val_batches) if main else None
                    if val is not None:
                        vrec = {"step": done, "val_loss": val}
                        writer.write(vrec)
                        records.append(vrec)
                        progress.message(f"step {done}: validation loss {val:.4f}")
                progress.update(done, record)
            final_params = full_params(state.params)  # a collective: every rank
            val = _evaluate(eval_step, final_params, val_batches) if main else None
            if val is not None:
                vrec = {"step": tc.steps, "val_loss": val}
                writer.write(vrec)
                records.append(vrec)
    finally:
        progress.close()

    last_window = min(10, len(losses))
    summary = {
        "steps": tc.steps,
        "tokens": tokens_per_step * tc.steps,
        "train_time_s": train_time,
        "tokens_per_s": tokens_per_step * tc.steps / max(train_time, 1e-9),
        "first_loss": losses[0],
        "last_loss": sum(losses[-last_window:]) / last_window,
        "last_window": last_window,
        "min_loss": min(losses),
        "val_loss": val,
        "params": n_params,
        "out_dir": str(out),
    }
    if mesh is not None:
        summary["processes"] = cfg.parallel.size
        summary["mesh"] = dict(cfg.parallel.mesh)
    if not main:
        return RunResult(state=state, records=records, summary=summary, out_dir=out)
    oc = cfg.output
    byte_level = cfg.data.source != "ids" and not cfg.data.tokenizer
    if oc.sample_tokens and byte_level and oc.sample_prompt:
        from hpfunc.train.sample import sample_text

        text = sample_text(final_params, model_cfg, oc.sample_prompt, oc.sample_tokens,
                           random.fold_in(random.key(cfg.seed), 3), temperature=oc.sample_temperature)
        (out / "sample.txt").write_text(text)
        summary["sample"] = text
        say(f"sample (temperature {oc.sample_temperature}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.output.plot:
        title = f"{cfg.model.preset} on {cfg.data.source} ({tc.steps} steps, batch {tc.batch_size}x{tc.seq_len})"
        if mesh is not None:
            title += "\nmesh " + " x ".join(f"{a} {n}" for a, n in cfg.parallel.mesh.items())
        plot_losses(records, out / "loss.png", title=title)
    say(format_summary(summary))
    return RunResult(state=state, records=records, summary=summary, out_dir=out)
