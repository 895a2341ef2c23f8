"""The training loop, in pieces a reader can follow: :class:`TrainingRun` opens a run, steps it, evaluates,
saves and finishes it; :class:`hpfunc.train.trainer.Trainer` drives it (``step()``, ``run(n)``,
``evaluate()``, ``save()``).

:meth:`TrainingRun.open` builds and checks the model config, claims the output folder
(:class:`hpfunc.train.output.RunFolder`: a lock held for the run; a folder holding another run is refused
unless ``overwrite``), reads and checks the data, ``init``\\ s the params from ``key(seed)`` (or loads a
checkpoint), builds the optimizer and writes ``config.yaml``. :meth:`TrainingRun.step` samples a batch
(a pure function of seed and step), calls the pure ``train_step``, logs and tells the callbacks;
:meth:`TrainingRun.evaluate` computes the validation loss; :meth:`TrainingRun.save` a checkpoint;
:meth:`TrainingRun.finish` the end of the run. Every output file is written by a built-in callback
(:mod:`hpfunc.train.callbacks.defaults`): ``metrics.jsonl``, ``loss.png`` and, last, ``summary.json``
(``sample.txt`` by the run's end). A non-finite loss or gradient norm, a non-finite validation loss, or
non-finite parameters after the last update stop the run with :class:`TrainingDiverged` naming the step
(no ``summary.json`` is written: the run did not finish).

With a ``parallel.mesh`` of more than one process, it runs in every rank of a launch
(``hpfunc train`` starts them, or a rank pool calls it in each rank): each rank builds the same global
batch, the step is ``hpfunc.parallelize(train_step, mesh, plan)`` on parameters created sharded
(:mod:`hpfunc.train.distributed`), and only rank 0 prints and writes. Evaluation runs on the sharded
state (under ``pp``: on a gathered copy on rank 0, its value sent to every rank); sampling gathers the
parameters to full tensors (every rank takes part in the gather) and runs on rank 0.

On a CUDA mesh the batch goes to the device pinned and ``non_blocking`` (the next one prefetched on a copy
stream: :mod:`hpfunc.train.batch_feed`), and each step's loss, gradient norm and lr stay on the device
until the logging step reads every pending step in one transfer (:mod:`hpfunc.train.readout`; with
``train.on_nonfinite: skip``, and on the CPU, every step is read at once: :func:`reads_each_step`).

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
from typing import Any, Callable, Iterator

import attrs
import torch
import yaml

from hpfunc import random
from hpfunc.checkpoint import latest
from hpfunc.faults import is_comm_failure, pop_failure, record_failure
from hpfunc.host_to_device import put
from hpfunc.train.batch_feed import BatchFeed
from hpfunc.train.build import build_optimizer, build_schedule, check_buildable, model_dtype
from hpfunc.train.checkpointing import (ResumePlan, TrainCheckpoints, checkpoint_root, clear_checkpoints, plan_resume,
                                        restore_state, truncate_metrics)
from hpfunc.train.config import Config, ConfigError, config_to_dict
from hpfunc.train.data import check_data, data_inputs, eval_batches, load_data, sample_batch
from hpfunc.train.output import RunFolder
from hpfunc.train.precision_probe import steps_done
from hpfunc.train.readout import StepReadout
from hpfunc.train.distributed import is_distributed
from hpfunc.train.fault_hooks import FaultHooks
from hpfunc.train.last_words import LastWords, StopSignals, Stopped, stop_message
from hpfunc.train.step_transforms import train_loss
from hpfunc.train.step import TrainState, make_eval_step, make_grad_check_step

__all__ = ["RunResult", "TrainingDiverged", "Stopped", "TrainingRun", "execute", "data_keys", "reads_each_step"]


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm, the validation loss or the parameters became NaN or infinite; the
    message names the step. The metrics logged so far are kept."""


_DIVERGED_FIX = ("lower optimizer.lr, add warmup (schedule.warmup_steps) or clipping (optimizer.clip_norm); "
                 "the metrics logged before are kept in metrics.jsonl")


@attrs.frozen
class RunResult:
    """What :meth:`Trainer.run <hpfunc.train.trainer.Trainer.run>` returns: the state, the logged records
    and the summary (None while the run is not finished: ``run(n)`` short of ``train.steps``)."""

    state: TrainState
    records: list
    summary: dict | None
    out_dir: pathlib.Path


def data_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(init_key, train_data_key, val_data_key)`` derived from the run's seed."""
    root = random.key(seed)
    return random.fold_in(root, 0), random.fold_in(root, 1), random.fold_in(root, 2)


def execute(trainer: Any) -> RunResult:
    """The whole run of a :class:`~hpfunc.train.trainer.Trainer` in this process (one rank of a launch, or
    the only process): open, step to ``train.steps``, finish."""
    trainer._run = run = TrainingRun(trainer)
    run.open()
    run.advance(trainer.cfg.train.steps - run.done)
    return run.finish()


class Tally:
    """What a run counts between metrics lines and carries across a resume (saved in each checkpoint's
    metadata as ``loop``): the losses for the summary, the window of steps since the last metrics line,
    the training time and the skipped steps.

    >>> t = Tally({})
    >>> t.add(5.0, {"ce_loss": 5.0, "aux_loss": 0.0}, grad_norm=1.0, seconds=0.5)
    >>> t.add(4.0, {"ce_loss": 4.0, "aux_loss": 0.0}, grad_norm=3.0, seconds=0.5)
    >>> t.line(2, lr=0.1, tokens_per_step=8)["grad_norm"], t.window
    (2.0, [])
    """

    def __init__(self, loop: dict[str, Any]):
        self.losses: list[float] = list(loop.get("recent", []))  # the last ones before a resume: the summary's mean
        self.first_loss: float | None = loop.get("first_loss")
        self.min_loss: float | None = loop.get("min_loss")
        self.train_time = float(loop.get("train_time_s", 0.0))
        self.window: list[float] = list(loop.get("window", []))
        self.window_time = float(loop.get("window_time_s", 0.0))
        # the window's other per-step values: a record logs every loss and the gradient norm the same way,
        # as the mean over the steps since the previous record
        self.window_parts: dict[str, list[float]] = {k: list(v) for k, v in loop.get("window_parts", {}).items()}
        self.skipped = int(loop.get("skipped", 0))
        self.in_a_row = int(loop.get("in_a_row", 0))

    def saved(self) -> dict[str, Any]:
        """The checkpoint's ``loop`` metadata."""
        return {"first_loss": self.first_loss, "recent": self.losses[-10:], "min_loss": self.min_loss,
                "train_time_s": self.train_time, "window": self.window, "window_time_s": self.window_time,
                "window_parts": self.window_parts, "skipped": self.skipped, "in_a_row": self.in_a_row}

    def add(self, loss: float, metrics: dict[str, Any], *, grad_norm: float, seconds: float) -> None:
        """An applied step."""
        self.in_a_row = 0
        self.window_time += seconds
        self.losses.append(loss)
        self.window.append(loss)
        for key, value in (("ce_loss", metrics["ce_loss"]), ("aux_loss", metrics["aux_loss"]), ("grad_norm", grad_norm)):
            self.window_parts.setdefault(key, []).append(float(value))
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.min_loss = loss if self.min_loss is None else min(self.min_loss, loss)

    def line(self, step: int, *, lr: float, tokens_per_step: int) -> dict[str, Any]:
        """The metrics line of ``step``: the window's means (the window starts afresh)."""
        record = {
            "step": step,
            # means over the window (the steps since the previous record), all four alike
            "loss": sum(self.window) / len(self.window),
            **{k: sum(v) / len(v) for k, v in self.window_parts.items()},
            "lr": lr,  # the record's step's, as the expert statistics
            "tokens_per_s": tokens_per_step * len(self.window) / max(self.window_time, 1e-9),
            "elapsed_s": self.train_time,
        }
        self.window, self.window_time, self.window_parts = [], 0.0, {}
        return record


def _step_extras(metrics: dict[str, Any], ep_size: int) -> dict[str, Any]:
    """The MoE entries of a metrics line: expert load and imbalance, dropped pairs."""
    return {**(_expert_stats(metrics["expert_load"], ep_size) if "expert_load" in metrics else {}),
            **(_dropped_stats(metrics["dropped_pairs"]) if "dropped_pairs" in metrics else {})}


class TrainingRun:
    """One run in this process, open between :meth:`open` and :meth:`finish` (or :meth:`close`).

    Every method is a collective on a mesh (every rank calls it, in the same order). An error in any of
    them tells the callbacks (``on_exception``), closes the run (the folder's lock, the checkpoints, the
    background writer; on a mesh the process group it created) and is raised; the run is then ended.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.cfg: Config = trainer.cfg
        self.tc = self.cfg.train
        self.spec = trainer.spec
        self._stack = contextlib.ExitStack()
        self._told = False  # the callbacks were started: they hear of a failure
        self.ended = False
        self.finished = False
        self.done = 0
        self.signals: Any = None
        self.saved_step: int | None = None
        self._depth = 0  # nested _failing (a save from a callback within a step): the outermost one handles

    # ---------------------------------------------------------------------------------------------
    # opening

    def open(self) -> None:
        """Build the run (see the module docstring) and start the callbacks."""
        with self._failing():
            self._open()

    def _open(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        threads = torch.get_num_threads()
        if self.tc.num_threads is not None:
            # Process-wide in torch; restored on close. On a shared or small machine one thread is often
            # much faster than oversubscribed ones for a tiny model.
            torch.set_num_threads(self.tc.num_threads)
        self._stack.callback(torch.set_num_threads, threads)
        self.mesh = None
        if is_distributed(cfg.parallel):
            from hpfunc.train.distributed import start_mesh

            self.mesh = self._stack.enter_context(start_mesh(cfg.parallel))
        self.main = self.mesh is None or torch.distributed.get_rank() == 0  # the rank that prints and writes
        self.rank = torch.distributed.get_rank() if self.mesh is not None else 0
        self.model_cfg = check_buildable(cfg)  # config errors first: nothing is created for a config that cannot run
        if self.mesh is None:  # one process on parallel.device: cuda where there is none is a config error, here
            from hpfunc.train.device import resolve_device

            self.device = resolve_device(cfg.parallel)
        self._claim_folder()
        self.quiet = not trainer.options["echo"] or (cfg.output.progress if self.main else "none") == "none"
        self._build()
        self._restore()
        self._start_outputs()
        self._start_checkpoints()
        trainer._bind_run(self)
        self.calls = trainer._callback_list(main=self.main)
        self._told = True
        self.calls.train_start(trainer)

    def say(self, text: str) -> None:
        """A line of the run's console output (rank 0, unless ``echo=False`` or ``output.progress: none``)."""
        if not self.quiet:
            print(text, file=self.trainer.options["stream"], flush=True)

    def _claim_folder(self) -> None:
        """Where the run starts (rank 0 decides), and on rank 0 the output folder, held to the run's end."""
        o = self.trainer.options
        self.out = pathlib.Path(self.cfg.output.dir if o["out_dir"] is None else o["out_dir"])
        claim = {"overwrite": o["overwrite"], "inputs": o["inputs"], "lock_token": o["lock_token"], "resume": o["resume"]}
        self.plan: ResumePlan = _plan_on_rank0(self.cfg, self.out, claim, self.mesh)  # before any file is written
        self.folder: RunFolder | None = None
        if not self.main:
            return
        for line in self.plan.skipped:  # damaged newer checkpoints, renamed: said once, before the run starts
            print(f"hpfunc train: {line}", file=sys.stderr, flush=True)
        hint = ("; or continue it from its newest checkpoint with --resume auto"
                if latest(checkpoint_root(self.cfg, self.out)) is not None else "")
        folder = RunFolder(self.out, overwrite=claim["overwrite"] and not self.plan.restart,
                           inputs=[*claim["inputs"], *data_inputs(self.cfg.data)], inherited=claim["lock_token"],
                           resume=self.plan.resume, hint=hint)
        self.folder = self._stack.enter_context(folder)  # a second run into the folder is refused meanwhile

    def _build(self) -> None:
        """The schedule, optimizer, data, model state and the steps (one process, or parallelized)."""
        cfg, tc, spec = self.cfg, self.tc, self.spec
        if tc.aux_loss_coef is not None and spec.with_aux_loss_coef is not None:
            self.model_cfg = spec.with_aux_loss_coef(self.model_cfg, tc.aux_loss_coef)
        model_cfg = self.model_cfg
        optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, tc.steps), spec)

        t0 = time.perf_counter()
        data = self.data = load_data(cfg.data)
        check_data(data, cfg, spec.vocab_size(model_cfg))  # before the first write: a bad corpus leaves the folder alone
        self.say(f"data: {data.description} ({data.train.numel():,} train / {data.val.numel():,} val) "
                 f"in {time.perf_counter() - t0:.1f} s")
        init_key, self.train_key, val_key = data_keys(cfg.seed)
        self.n_params = spec.count_params(model_cfg)
        self.say(f"model: {cfg.model.preset}, {spec.describe(model_cfg)}")
        self.say(f"train: {tc.steps} steps of {tc.batch_size} x {tc.seq_len} tokens, {cfg.optimizer.name}, "
                 f"{cfg.schedule.name} schedule")

        from hpfunc.train.callbacks.precision_monitor import probe_of

        probe = probe_of(self.trainer.callbacks)  # the precision monitor's measurements, made inside the step
        if self.mesh is None:  # one process, on parallel.device (hpfunc.train.single_device)
            from hpfunc.train.device import local_device
            from hpfunc.train.single_device import build_single_step

            self.state, self.train_step = build_single_step(cfg, model_cfg, spec, optimizer, lr, init_key,
                                                            local_device(self.device), monitor=probe)
            self.full_params: Callable[[Any], Any] = lambda p: p  # noqa: E731
            self.sharded_eval = None
            self.check_step = functools.partial(make_grad_check_step, model_cfg, num_microbatches=tc.microbatches,
                                                loss_fn=train_loss(cfg, spec, on_mesh=False))
        else:
            from hpfunc.train.distributed import (build_eval_step, build_grad_check_step, build_parallel_step,
                                                  parallel_summary)

            self.say(parallel_summary(cfg))
            self.state, self.train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, init_key, self.mesh,
                                                              model_dtype(cfg.model), monitor=probe)
            self.full_params = self.train_step.full_params  # a collective (a pipeline's stages come from their ranks)
            self.check_step = functools.partial(build_grad_check_step, cfg, model_cfg, self.mesh)
            self.sharded_eval = build_eval_step(cfg, model_cfg, self.mesh)
            self.device = self.mesh.device_type
        self.eval_step = make_eval_step(model_cfg, loss_fn=spec.loss)
        self.val_batches = (
            eval_batches(data.val, val_key, tc.eval_batches, tc.batch_size, tc.seq_len, data.val_docs)
            if data.val.numel() > tc.seq_len and tc.eval_batches
            else []
        )
        if self.mesh is None:  # on the device once, for every evaluation (a mesh copies each rank's block)
            self.val_batches = put(self.val_batches, self.device)
        self.ep_size = next((cfg.parallel.mesh[e.axes[0]] for e in cfg.parallel.plan if e.kind == "ep"), 1)
        self.tokens_per_step = tc.batch_size * tc.seq_len
        # each step's batch on the device (pinned, non_blocking, the next one prefetched on CUDA) and its
        # scalars kept there until a read: every step where reading waits for no device or must decide
        # whether to apply the step (on_nonfinite: skip), else at the logging steps (docs/gpu.md)
        # (on a mesh only this rank's block of it: the step's put_batch)
        self.feed = BatchFeed(self._host_batch, self.device,
                              place=None if self.mesh is None else self.train_step.put_batch)
        self.readout = StepReadout()
        self.each_step = reads_each_step(self.device, tc.on_nonfinite)

    def _host_batch(self, n: int) -> dict[str, torch.Tensor]:
        """Step ``n``'s batch on the host (a pure function of the seed and ``n``; the fault hooks' planted
        bad batch included)."""
        return self.hooks.batch(n, sample_batch(self.data.train, self.train_key, n - 1, self.tc.batch_size,
                                                self.tc.seq_len, self.data.train_docs), self.spec.ignore_index)

    def _restore(self) -> None:
        """Where the run starts: step 0, or a checkpoint loaded into this run's layout (resharded)."""
        loop: dict[str, Any] = {}
        self.start = 0
        # the state's optimizer steps (state.step) counted on the host, so that no step reads the counter
        # (read once from a checkpoint; the steps skipped as not finite are not among them)
        self.applied = 0
        if self.plan.path is not None:
            from hpfunc import checkpoint

            t = time.perf_counter()
            loop = dict(checkpoint.info(self.plan.path)["metadata"]["loop"])
            self.state, self.start = restore_state(self.plan.path, self.state)
            self.applied = int(self.state.step)
            notes = f"; changed: {', '.join(self.plan.notes)}" if self.plan.notes else ""
            self.say(f"resume: from {self.plan.path} (step {self.start} of {self.tc.steps}, {self.applied} "
                     f"optimizer steps) in {time.perf_counter() - t:.2f} s{notes}")
        elif self.plan.restart:
            self.say(f"resume: no checkpoint yet under {checkpoint_root(self.cfg, self.out)}; attempt "
                     f"{self.plan.restart + 1} starts over")
        self.done = self.start
        self.tally = Tally(loop)
        self.last: dict[str, float] = {}  # the last applied step's loss, gradient norm and lr (for messages)
        self.failure = pop_failure() if self.main and self.plan.restart else None
        self.failure_seen = time.time()
        self.recovery_s: float | None = None

    def _start_outputs(self) -> None:
        """Rank 0's first writes: a previous run's files go now (with overwrite), not before; config.yaml."""
        from hpfunc.train.callbacks.writer import BackgroundWriter

        self.root = checkpoint_root(self.cfg, self.out)
        self.records: list[dict[str, Any]] = []
        self.writer = BackgroundWriter()
        self._stack.callback(lambda: self.writer.close(raise_errors=self.finished))
        if not self.main:
            return
        folder = self.folder
        folder.start()
        if not self.plan.resume and folder.overwrite:
            clear_checkpoints(self.root)
        if self.plan.resume:
            self.records = truncate_metrics(folder.file("metrics.jsonl"), self.start)  # no step twice
        folder.write_text("config.yaml", yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))

    def _start_checkpoints(self) -> None:
        """The checkpoints and the last words (collective on a mesh: their process groups, in this order)."""
        cc = self.cfg.checkpoint
        self.ckpts = TrainCheckpoints(self.cfg, self.root) if cc.every > 0 else None
        self.words = LastWords(self.ckpts, distributed=self.mesh is not None, timeout_s=cc.last_words_timeout_s)
        # the flags the ranks agree on between steps (a signal, a failed save) are host values: on a
        # backend of device tensors (NCCL) they go over a gloo group of their own (a collective: every rank)
        self.host_group = _host_group(self.mesh, self.cfg.parallel.timeout_s)
        self.use_words = self.ckpts is not None and cc.last_words
        self.hooks = FaultHooks.from_env()
        self._stack.callback(self._close_checkpoints)

    def _close_checkpoints(self) -> None:
        try:
            if self.ckpts is not None:
                self.ckpts.close()
        except Exception:
            if self.finished:  # an error of the checkpoints' closing must not hide the error that ends the run
                raise
        finally:
            self.words.close()
            if self.host_group is not None:
                torch.distributed.destroy_process_group(self.host_group)
                self.host_group = None

    # ---------------------------------------------------------------------------------------------
    # failing and closing

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Within: an error ends the run (callbacks told, everything closed) and is raised."""
        if self.ended:
            raise RuntimeError("this run has ended (it finished, failed or was closed); make a new Trainer to "
                               "train again, or continue from a checkpoint with resume='auto'")
        self._depth += 1
        try:
            yield
        except BaseException as e:
            if self._depth > 1:
                raise
            self.ended = True
            if self._told:
                self.calls.exception(self.trainer, e)
            # the exception goes through the contexts (start_mesh names a lost peer) and is raised
            if not self._stack.__exit__(type(e), e, e.__traceback__):
                raise
        finally:
            self._depth -= 1

    def close(self) -> None:
        """End a run that is not finished: the callbacks' files flushed and closed, the folder released
        (no summary.json: the run did not finish)."""
        if self.ended:
            return
        self.ended = True
        self._stack.close()

    # ---------------------------------------------------------------------------------------------
    # steps

    def advance(self, steps: int) -> list[dict[str, Any]]:
        """``steps`` more steps (each one :meth:`step`), with SIGTERM / SIGINT turned into a stop after the
        step (last words); the metrics each step returned."""
        if steps < 0 or self.done + steps > self.tc.steps:
            raise ValueError(f"steps: expected 0 to {self.tc.steps - self.done} more steps ({self.done} of "
                             f"train.steps {self.tc.steps} are done), found {steps}; raise train.steps to train "
                             f"longer")
        out = []
        with self._failing():
            signals = StopSignals() if self.use_words or self.mesh is None else contextlib.nullcontext()
            with signals as self.signals:
                for _ in range(steps):
                    out.append(self._step())
            self.signals = None
        return out

    def step(self) -> dict[str, Any]:
        """One step: the metrics the step returned (local tensors; on a skipped step too)."""
        return self.advance(1)[0]

    def _step(self) -> dict[str, Any]:
        n = self.done + 1
        self.hooks.maybe_kill(n, rank=self.rank, attempt=self.plan.restart)
        batch = self.feed.take(n)  # on CUDA the copy is queued (prefetched behind the step before): no wait
        t = time.perf_counter()
        try:
            with steps_done(self.applied):  # the precision monitor's due() counts on the host, reads no tensor
                new_state, metrics = self.train_step(self.state, batch)  # pure: `state` stays the last completed step's
            if self.mesh is not None:
                metrics = _local_metrics(metrics)
            logs = self._logs_at(n)
            entry = self.readout.add(n, metrics, keep=("expert_load", "dropped_pairs") if logs else ())
            if n < self.tc.steps:
                self.feed.prefetch(n + 1)  # queued behind the step: the copy overlaps it
            read = self.readout.read() if self.each_step or logs else []  # the host read also ends the steps' work
        except Exception as e:
            if is_comm_failure(e):
                record_failure(f"rank {self.rank} lost a peer in step {n}")
            self.last_words(f"step {n} failed: {type(e).__name__}")
            raise
        entry.seconds = seconds = time.perf_counter() - t
        self.tally.train_time += seconds
        if self.each_step and not _finite_step(entry.loss, entry.grad_norm):  # every rank holds the same values
            self._skip(n, batch, loss=entry.loss, grad_norm=entry.grad_norm, lr=entry.lr)
            return metrics
        self._apply(n, new_state, metrics, read)
        self._between_steps()
        return metrics

    def _logs_at(self, n: int) -> bool:
        """Whether step ``n`` writes a metrics line: every ``train.log_every``, the first and the last."""
        return n % self.tc.log_every == 0 or n == 1 or n == self.tc.steps

    def _settle(self, read: list, *, at: int) -> dict[str, Any] | None:
        """The host's part of the steps just read (in order): their losses into the tally, and the metrics
        line of a logging step among them (returned). A step held on the device (not read at once) that
        came out non-finite was applied already: the run stops naming it (found at step ``at``)."""
        record = None
        for e in read:
            if not _finite_step(e.loss, e.grad_norm):
                raise TrainingDiverged(
                    f"step {e.step}: {_nonfinite_text(e.loss, e.grad_norm, e.lr)}; on {self.device} the loss "
                    f"and gradient norm stay on the device until the logging interval (train.log_every: "
                    f"{self.tc.log_every}) reads them, so this was found at step {at}, and the steps up to it were "
                    f"applied (the state is not finite; no last words are saved); set train.on_nonfinite: skip to "
                    f"check each step before applying it (one host read per step); {_DIVERGED_FIX}")
            self.last = {"loss": e.loss, "grad_norm": e.grad_norm, "lr": e.lr}
            self.tally.add(e.loss, e.values, grad_norm=e.grad_norm, seconds=e.seconds)
            if self._logs_at(e.step) and e.step == at:
                record = {**self.tally.line(e.step, lr=e.lr, tokens_per_step=self.tokens_per_step),
                          **_step_extras(e.extras, self.ep_size)}
                if self.tally.skipped:
                    record["skipped_steps"] = self.tally.skipped
        return record

    def _flush(self) -> None:
        """Read the steps still held on the device (before what needs the tally or the last values: a
        save, an evaluation, the end of the run)."""
        if self.readout.pending:
            self._settle(self.readout.read(), at=-1)

    def _skip(self, n: int, batch: Any, *, loss: float, grad_norm: float, lr: float) -> None:
        """A step that is not finite: not applied; logged as skipped, or the run stops (train.on_nonfinite)."""
        tc, tally = self.tc, self.tally
        tally.skipped += 1
        tally.in_a_row += 1
        what = _nonfinite_text(loss, grad_norm, lr)
        if tc.on_nonfinite == "stop" or tally.in_a_row > tc.max_skips:
            grad = _first_nonfinite_grad(self.check_step(), self.state, batch, on_mesh=self.mesh is not None)
            cap = (f"; {tally.in_a_row} steps in a row were not finite, more than train.max_skips "
                   f"({tc.max_skips})" if tc.on_nonfinite == "skip" else "")
            saved = self.last_words(f"step {n} not finite")
            raise TrainingDiverged(
                f"step {n}: {what}{grad}{cap}; the step was not applied (the state is that "
                f"of step {self.done}{f'; last words: {saved}' if saved else ''}); {_DIVERGED_FIX}")
        self.done = n
        self._log({"step": n, "skipped": True, "reason": f"{what}; the step was not applied",
                   "skipped_steps": tally.skipped})

    def _apply(self, n: int, state: Any, metrics: dict[str, Any], read: list) -> None:
        """An applied step: the new state, the steps just read (``read``: this one, or at a logging step
        those held on the device since the last read) and its metrics line (every ``log_every``), the
        callbacks, and the validation when it is due."""
        tc, trainer = self.tc, self.trainer
        self.state, self.done = state, n
        self.applied += 1
        record = self._settle(read, at=n)
        self._say_recovery()
        if record is not None:
            self._log(record)
        trainer.state, trainer.record = self.state, record
        self.calls.step_end(trainer, n, metrics)
        if tc.eval_every and n % tc.eval_every == 0 and n != tc.steps and self.val_batches:
            self._validate()

    def _say_recovery(self) -> None:
        """After an elastic restart, at the first resumed step: how long the run was down."""
        if self.recovery_s is not None or not self.plan.restart or not self.main:
            return
        failure = self.failure
        self.recovery_s = time.time() - (failure["time"] if failure else self.failure_seen)
        since = (f"{self.recovery_s:.1f} s from the failure ({failure['what']}) to the first resumed step" if failure
                 else f"{self.recovery_s:.1f} s from this attempt's start to its first step (no rank noted the "
                      f"failure's time)")
        out = sys.stdout if self.trainer.options["stream"] is None else self.trainer.options["stream"]
        print(f"hpfunc train: elastic restart {self.plan.restart} of {self.cfg.parallel.max_restarts}: resumed at "
              f"step {self.start}; {since}", file=out, flush=True)

    def _log(self, record: dict[str, Any]) -> None:
        """A line of the run's record (metrics.jsonl, through the ``metrics_file`` callback)."""
        self.records.append(record)
        self.calls.log(self.trainer, record)

    def _between_steps(self) -> None:
        """After an applied step, on every rank alike: a signal (any rank's) or a failed asynchronous save
        stops the run here, after saving the last words."""
        done, signals, ckpts = self.done, self.signals, self.ckpts
        save_failed = ckpts is not None and ckpts.failed()  # an async save: known at the next step
        if signals is not None:
            self.hooks.maybe_term(done, handled=signals.signum is None and signals.installed)
        if self.use_words:
            try:
                signum, save_failed = self.words.any_stop(signals.signum, save_failed, group=self.host_group)
            except Exception as e:  # a peer lost between two steps: the state of `done` is whole
                if is_comm_failure(e):
                    record_failure(f"rank {self.rank} lost a peer after step {done}")
                self.last_words(f"a peer was lost after step {done}: {type(e).__name__}")
                raise
            if signum is not None and done != self.tc.steps:
                raise Stopped(stop_message(signum, done, self.last_words(_sig_name(signum))), signum)
        elif self.mesh is not None and ckpts is not None and ckpts.in_flight():
            save_failed = _any_rank(save_failed, self.host_group)  # every rank stops at the same step
        elif signals is not None and signals.signum is not None and done != self.tc.steps:
            # one process without last words: still a message and 128 + the signal, after the step
            why = ("checkpoints are off (checkpoint.every: 0), so the run cannot be continued" if ckpts is None
                   else "no checkpoint on the way out (checkpoint.last_words: false); continue from the "
                        "newest one with `hpfunc train CONFIG --resume auto`")
            raise Stopped(f"stopped by {_sig_name(signals.signum)} after step {done}; {why}; the metrics up "
                          f"to step {done} are kept", signals.signum)
        if save_failed:
            with _save_errors(self.root, done):
                ckpts.wait()  # raises the save's error, the same on every rank

    def last_words(self, why: str) -> str:
        """Save the state of the last completed step on the way out; the message says what happened."""
        if not self.use_words:
            return ""
        try:
            self._flush()  # the checkpoint keeps the tally
        except Exception as e:  # noqa: BLE001 - a device that failed, or a state found not finite: not saved
            message = f"no checkpoint: the steps held on the device could not be read ({type(e).__name__}: {str(e)[:200]})"
            print(f"hpfunc train: last words ({why}): {message}", file=sys.stderr, flush=True)
            return message
        _, message = self.words.save(self.state, self.done, self.tally.saved(), why=why)
        if self.main or message.startswith("no checkpoint"):
            where = f" [rank {self.rank}]" if self.mesh is not None else ""
            print(f"hpfunc train{where}: last words ({why}): {message}", file=sys.stderr, flush=True)
        return message

    # ---------------------------------------------------------------------------------------------
    # evaluation and checkpoints

    def evaluate(self) -> float | None:
        """The validation loss of the current state (None without validation batches), logged and told
        to the callbacks (``on_eval``, on every rank that asks)."""
        with self._failing():
            return self._validate()

    def _validate(self, full: Any = None) -> float | None:
        if not self.val_batches:
            return None
        self._flush()  # its messages name the last step's loss
        if self.sharded_eval is not None:  # every rank, on its shards: no gathered copy
            val = _evaluate_sharded(self.sharded_eval, self.state, self.val_batches)
        else:
            full = self.full_params(self.state.params) if full is None else full  # a collective: every rank
            val = _evaluate(self.eval_step, full, self.val_batches) if self.main else None
            if self.mesh is not None:
                from hpfunc.checkpoint import _ranks

                val = _ranks.from_rank0(val, None)  # every rank holds the value
        _check_val_finite(self.done, val, self.last)
        self._log({"step": self.done, "val_loss": val})
        self.calls.eval(self.trainer, self.done, val)
        return val

    def save(self, *, wait: bool = True) -> pathlib.Path:
        """Save the state of the last completed step (once per step) through the run's checkpoints; the
        background writer is flushed first. ``wait``: return once it is written (else an asynchronous
        save may still be writing). The checkpoint's folder."""
        from hpfunc.checkpoint import step_dir

        with self._failing():
            if self.ckpts is None:  # checkpoint.every: 0, and asked for one (a collective on a mesh)
                self.ckpts = self.trainer.checkpoints = TrainCheckpoints(self.cfg, self.root)
            self.writer.flush()
            self._flush()  # the checkpoint keeps the tally
            with _save_errors(self.root, self.done):
                if self.saved_step != self.done:
                    self.ckpts.save(self.state, self.done, self.tally.saved())
                    self.saved_step = self.done
                    if wait:
                        self.ckpts.wait()
                    self.calls.save(self.trainer, self.done, self.root)
                elif wait:
                    self.ckpts.wait()
            return step_dir(self.root, self.done)

    # ---------------------------------------------------------------------------------------------
    # the end

    def finish(self) -> RunResult:
        """The end of the run (after ``train.steps``): the last update checked, the final validation, the
        summary, the sample, ``on_train_end`` (the built-in plot and summary.json among them); then
        everything is closed."""
        if self.done != self.tc.steps and not self.ended:
            raise ValueError(f"the run is at step {self.done} of train.steps {self.tc.steps}; run the remaining "
                             f"steps first (or close() it unfinished)")
        with self._failing():
            self._flush()
            final_params = self.full_params(self.state.params)  # a collective: every rank
            self._check_final(final_params)
            val = self._validate(final_params)
            summary = self._summary(val)
            self.trainer.state, self.trainer.summary = self.state, summary
            if self.main:
                self._sample(final_params, summary)
            self.calls.train_end(self.trainer, summary)  # a failing callback leaves no summary.json
            self.finished = True
        self.ended = True
        self._stack.close()
        return RunResult(state=self.state, records=self.records, summary=summary, out_dir=self.out)

    def _check_final(self, final_params: Any) -> None:
        bad = _first_nonfinite(final_params)  # the last update has no later loss to show it
        if bad is None:
            return
        path, n_bad, n = bad
        last = self.last
        raise TrainingDiverged(
            f"step {self.tc.steps} (the last): its update left non-finite parameters ({n_bad} of the {n} values "
            f"of {path!r} are NaN or infinite) although the step's loss ({last.get('loss', math.nan):.4f}) "
            f"and gradient norm ({last.get('grad_norm', math.nan):.3g}) were finite "
            f"(lr {last.get('lr', math.nan):.3g}); {_DIVERGED_FIX}")

    def _summary(self, val: float | None) -> dict[str, Any]:
        tc, tally, ckpts = self.tc, self.tally, self.ckpts
        last_window = min(10, len(tally.losses))
        summary = {
            "steps": tc.steps,
            "tokens": self.tokens_per_step * tc.steps,
            "train_time_s": tally.train_time,
            "tokens_per_s": self.tokens_per_step * tc.steps / max(tally.train_time, 1e-9),
            "first_loss": tally.first_loss,
            "last_loss": sum(tally.losses[-last_window:]) / last_window if last_window else None,
            "last_window": last_window,
            "min_loss": tally.min_loss,
            "val_loss": val if self.main else None,
            "params": self.n_params,
            "out_dir": str(self.out),
        }
        if tally.skipped:
            summary["skipped_steps"] = tally.skipped
        if self.plan.path is not None:
            summary["resumed_from_step"] = self.start
        if self.plan.restart:
            summary["restarts"] = self.plan.restart
            summary["recovery_s"] = self.recovery_s
        if ckpts is not None:
            summary["checkpoints"] = {"dir": str(self.root), "saves": len(ckpts.blocked_s),
                                      "blocked_s_per_save": sum(ckpts.blocked_s) / max(len(ckpts.blocked_s), 1),
                                      "write_s_per_save": sum(ckpts.write_s) / max(len(ckpts.write_s), 1),
                                      "async": ckpts.asynchronous}
        if self.mesh is not None:
            summary["processes"] = self.cfg.parallel.size
            summary["mesh"] = dict(self.cfg.parallel.mesh)
        return summary

    def _sample(self, final_params: Any, summary: dict[str, Any]) -> None:
        """``sample.txt``: text generated from the prompt by the final parameters (byte-level data only)."""
        cfg, oc = self.cfg, self.cfg.output
        byte_level = cfg.data.source != "ids" and not cfg.data.tokenizer
        if oc.sample_tokens and byte_level and oc.sample_prompt:
            from hpfunc.train.sample import sample_text

            text = sample_text(final_params, self.model_cfg, oc.sample_prompt, oc.sample_tokens,
                               random.fold_in(random.key(cfg.seed), 3), temperature=oc.sample_temperature,
                               apply=self.spec.apply)
            folder = self.folder
            self.writer.submit(lambda: folder.write_text("sample.txt", text), label="the run (sample.txt)")
            summary["sample"] = text
            self.say(f"sample (temperature {oc.sample_temperature}):\n{'-' * 60}\n{text}\n{'-' * 60}")
        elif oc.sample_tokens and oc.sample_prompt:  # said, not silently skipped
            what = f"data.tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else "data.source: ids"
            self.say(f"sample: none written: output.sample_tokens generates bytes, and this run's data is token ids "
                     f"({what}); set output.sample_tokens: 0 to silence this")


# ---------------------------------------------------------------------------------------------
# helpers


def reads_each_step(device: str, on_nonfinite: str) -> bool:
    """Whether the loop reads each step's loss and gradient norm at that step (else at the logging steps,
    in one transfer: :class:`~hpfunc.train.readout.StepReadout`): on the CPU, where a read waits for no
    device, and under ``train.on_nonfinite: skip``, which must know before applying a step whether it is
    finite.

    >>> reads_each_step("cpu", "stop"), reads_each_step("cuda", "stop"), reads_each_step("cuda", "skip")
    (True, False, True)
    """
    return device == "cpu" or on_nonfinite == "skip"


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


def _local_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Replicated metrics of a parallel step as plain tensors (DTensors hold the value on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}


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


def _any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank (one all-reduce of one host integer, over ``group``: a gloo
    group, default the default one)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t[0])


def _host_group(mesh: Any, timeout_s: float) -> Any:
    """``None`` (the default group takes host tensors: gloo, or no mesh), else a new gloo group of every
    rank with the collective timeout, for the loop's host flags (NCCL takes device tensors only)."""
    if mesh is None or torch.distributed.get_backend() == "gloo":
        return None
    import datetime

    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


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
