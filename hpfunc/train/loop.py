"""The training loop: config -> data, model, optimizer -> steps -> outputs.

``run(cfg)`` does, in order: build and check the model config, claim the output folder
(:class:`hpfunc.train.output.RunFolder`: a lock held for the run; a folder holding another run is
refused unless ``overwrite``), read and check the data, ``init`` the params from ``key(seed)``, build
the optimizer, then for each step sample a batch (a pure function of seed and step), call the pure
``train_step`` and log. It writes into ``output.dir`` (each file atomically, ``metrics.jsonl`` a whole
line at a time): ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``sample.txt``, ``loss.png``
and, last, ``summary.json``. A non-finite loss or gradient norm, a non-finite validation loss, or
non-finite parameters after the last update stop the run with :class:`TrainingDiverged` naming the
step (no ``summary.json`` is written: the run did not finish).

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

import math
import pathlib
import time
from typing import Any, Callable, Sequence, TextIO

import attrs
import torch
import yaml

from hpfunc import random
from hpfunc.train.build import build_optimizer, build_schedule, check_buildable, model_dtype
from hpfunc.train.config import Config, config_to_dict
from hpfunc.train.data import check_data, data_inputs, eval_batches, load_data, sample_batch
from hpfunc.train.output import MetricsWriter, Progress, RunFolder, format_summary, plot_losses
from hpfunc.train.distributed import is_distributed
from hpfunc.train.step import TrainState, init_train_state, make_eval_step, make_train_step

__all__ = ["RunResult", "TrainingDiverged", "run", "data_keys"]


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm, the validation loss or the parameters became NaN or infinite; the
    message names the step. The metrics logged so far are kept."""


_DIVERGED_FIX = ("lower optimizer.lr, add warmup (schedule.warmup_steps) or clipping (optimizer.clip_norm); "
                 "the metrics logged before are kept in metrics.jsonl")


def _check_step_finite(step: int, loss: float, metrics: dict[str, Any]) -> None:
    grad_norm, lr = float(metrics["grad_norm"]), float(metrics["lr"])
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = (f"the loss is {loss} (grad norm {grad_norm:.3g}" if not math.isfinite(loss)
            else f"the gradient norm is {grad_norm} while the loss is {loss:.4f} (")
    raise TrainingDiverged(f"step {step}: {what}{', ' if not math.isfinite(loss) else ''}lr {lr:.3g}); "
                           f"{_DIVERGED_FIX}")


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
    overwrite: bool = False,
    inputs: Sequence[tuple[str, str | pathlib.Path]] = (),
    lock_token: str | None = None,
) -> RunResult:
    """Train for ``cfg.train.steps`` steps and write the outputs.

    With a ``parallel.mesh`` of more than one process this must run in every rank of a launch
    (``hpfunc train CONFIG`` starts them); rank 0 prints and writes, the others only compute.

    Args:
      cfg: a checked config (:func:`hpfunc.train.config.load_config`).
      out_dir: overrides ``cfg.output.dir``.
      stream: where progress and the summary are printed (stdout by default).
      echo: print the start lines and the final summary.
      overwrite: replace a previous run's files in the output folder (otherwise such a folder is
        refused with :class:`hpfunc.train.output.OutputError`).
      inputs: ``(what, path)`` of input files besides the data (``hpfunc train`` passes its config
        file): the run refuses to write over any of them.
      lock_token: the token of the output folder's lock when the launching process holds it
        (``hpfunc train`` on a mesh claims the folder before it starts the ranks).
    """
    threads = torch.get_num_threads()
    if cfg.train.num_threads is not None:
        # Process-wide in torch; restored on exit. On a shared or small machine one thread is often
        # much faster than oversubscribed ones for a tiny model.
        torch.set_num_threads(cfg.train.num_threads)
    try:
        claim = {"overwrite": overwrite, "inputs": inputs, "lock_token": lock_token}
        if not is_distributed(cfg.parallel):
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo, claim=claim)
        from hpfunc.train.distributed import start_mesh

        with start_mesh(cfg.parallel) as mesh:
            return _run(cfg, out_dir=out_dir, stream=stream, echo=echo, mesh=mesh, claim=claim)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Config, *, out_dir: str | pathlib.Path | None, stream: TextIO | None, echo: bool,
         mesh: Any = None, claim: dict[str, Any]) -> RunResult:
    main = mesh is None or torch.distributed.get_rank() == 0  # the rank that prints and writes
    model_cfg = check_buildable(cfg)  # config errors first: nothing is created for a config that cannot run
    out = pathlib.Path(cfg.output.dir if out_dir is None else out_dir)
    if not main:
        return _train(cfg, model_cfg, out, None, stream=stream, echo=echo, mesh=mesh)
    folder = RunFolder(out, overwrite=claim["overwrite"], inputs=[*claim["inputs"], *data_inputs(cfg.data)],
                       inherited=claim["lock_token"])
    with folder:  # held to the last write; a second run into the folder is refused meanwhile
        return _train(cfg, model_cfg, out, folder, stream=stream, echo=echo, mesh=mesh)


def _train(cfg: Config, model_cfg: Any, out: pathlib.Path, folder: RunFolder | None, *, stream: TextIO | None,
           echo: bool, mesh: Any) -> RunResult:
    from hpfunc.models import qwen3

    main = folder is not None  # the rank that prints and writes
    progress_mode = cfg.output.progress if main else "none"
    quiet = not echo or progress_mode == "none"

    def say(text: str) -> None:
        if not quiet:
            print(text, file=stream, flush=True)

    tc = cfg.train

    if tc.aux_loss_coef is not None:
        model_cfg = attrs.evolve(model_cfg, router_aux_loss_coef=tc.aux_loss_coef)
    factor = build_schedule(cfg.schedule, tc.steps)
    optimizer, lr = build_optimizer(cfg.optimizer, factor)

    t0 = time.perf_counter()
    data = load_data(cfg.data)
    check_data(data, cfg, model_cfg.vocab_size)  # before the first write: a bad corpus leaves the folder alone
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
        from hpfunc.train.distributed import build_parallel_step, parallel_summary

        say(parallel_summary(cfg))
        state, train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, init_key, mesh,
                                                model_dtype(cfg.model))
        full_params = train_step.full_params  # a collective (a pipeline's stages come from their ranks)
    eval_step = make_eval_step(model_cfg)
    if main:  # the first write: a previous run's files go now (with overwrite), not before
        folder.start()
        folder.write_text("config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    val_batches = (
        eval_batches(data.val, val_key, tc.eval_batches, tc.batch_size, tc.seq_len)
        if data.val.numel() > tc.seq_len and tc.eval_batches
        else []
    )

    ep_size = next((cfg.parallel.mesh[e.axes[0]] for e in cfg.parallel.plan if e.kind == "ep"), 1)
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    tokens_per_step = tc.batch_size * tc.seq_len
    train_time = 0.0
    window: list[float] = []
    window_time = 0.0
    last: dict[str, float] = {}
    progress = Progress(tc.steps, progress_mode, stream)
    try:
        with MetricsWriter(folder.file("metrics.jsonl")) if main else _NoWriter() as writer:
            for step in range(tc.steps):
                batch = sample_batch(data.train, train_key, step, tc.batch_size, tc.seq_len)
                t = time.perf_counter()
                state, metrics = train_step(state, batch)
                if mesh is not None:
                    metrics = _local_metrics(metrics)
                loss = float(metrics["loss"])  # the host read also ends the step's work
                _check_step_finite(step + 1, loss, metrics)  # every rank holds the same values
                last = {"loss": loss, "grad_norm": float(metrics["grad_norm"]), "lr": float(metrics["lr"])}
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
                        **(_expert_stats(metrics["expert_load"], ep_size) if "expert_load" in metrics else {}),
                        **(_dropped_stats(metrics["dropped_pairs"]) if "dropped_pairs" in metrics else {}),
                    }
                    writer.write(record)
                    records.append(record)
                    window, window_time = [], 0.0
                if tc.eval_every and done % tc.eval_every == 0 and done != tc.steps and val_batches:
                    full = full_params(state.params)  # a collective: every rank
                    val = _evaluate(eval_step, full, val_batches) if main else None
                    if val is not None:
                        _check_val_finite(done, val, last)
                        vrec = {"step": done, "val_loss": val}
                        writer.write(vrec)
                        records.append(vrec)
                        progress.message(f"step {done}: validation loss {val:.4f}")
                progress.update(done, record)
            final_params = full_params(state.params)  # a collective: every rank
            bad = _first_nonfinite(final_params)  # the last update has no later loss to show it
            if bad is not None:
                path, n_bad, n = bad
                raise TrainingDiverged(
                    f"step {tc.steps} (the last): its update left non-finite parameters ({n_bad} of the {n} values "
                    f"of {path!r} are NaN or infinite) although the step's loss ({last['loss']:.4f}) and gradient "
                    f"norm ({last['grad_norm']:.3g}) were finite (lr {last['lr']:.3g}); {_DIVERGED_FIX}")
            val = _evaluate(eval_step, final_params, val_batches) if main else None
            if val is not None:
                _check_val_finite(tc.steps, val, last)
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
        folder.write_text("sample.txt", text)
        summary["sample"] = text
        say(f"sample (temperature {oc.sample_temperature}):\n{'-' * 60}\n{text}\n{'-' * 60}")
    if cfg.output.plot:
        title = f"{cfg.model.preset} on {cfg.data.source} ({tc.steps} steps, batch {tc.batch_size}x{tc.seq_len})"
        if mesh is not None:
            title += "\nmesh " + " x ".join(f"{a} {n}" for a, n in cfg.parallel.mesh.items())
        plot_losses(records, folder.file("loss.png"), title=title)
    folder.write_json("summary.json", summary)  # last: its presence means the run finished
    say(format_summary(summary))
    return RunResult(state=state, records=records, summary=summary, out_dir=out)
