"""``Trainer``: one training run as an object, from a YAML path, a mapping or a :class:`Config`, driven
whole (``run()``) or a piece at a time (``step()``, ``run(n)``, ``evaluate()``, ``save()``) over the
:class:`~hpfunc.train.loop.TrainingRun` of :mod:`hpfunc.train.loop`. ``hpfunc train`` and
:func:`hpfunc.train.run` are thin layers over it.

The model is reached through its :class:`~hpfunc.models.spec.ModelSpec` (``trainer.spec``), and
config errors (the model, the plan, the callbacks and their options) are raised by the constructor,
before any file is written or any rank joins a collective.

Example (a run of two steps with a callback of one's own beside the built-in MoE monitor):
    >>> import tempfile
    >>> from hpfunc.train.callbacks import Callback
    >>> class Losses(Callback):
    ...     def __init__(self):
    ...         self.losses = []
    ...     def on_step_end(self, trainer, step, metrics):
    ...         self.losses.append(float(metrics["loss"]))
    >>> losses = Losses()
    >>> trainer = Trainer({"train": {"steps": 2, "batch_size": 1, "seq_len": 8, "num_threads": 1, "log_every": 1},
    ...                    "data": {"max_bytes": 20000}, "callbacks": ["moe_monitor"],
    ...                    "output": {"progress": "none", "plot": False, "dir": tempfile.mkdtemp()}},
    ...                   callbacks=[losses], echo=False)
    >>> result = trainer.run()
    >>> [r["loss"] for r in trainer.metrics if "loss" in r] == losses.losses, int(trainer.state.step)
    (True, 2)
    >>> sorted(p.name for p in trainer.out_dir.iterdir())
    ['config.yaml', 'metrics.jsonl', 'moe.jsonl', 'moe_load.png', 'summary.json']

A piece at a time: two steps, a validation, the rest (``run()`` finishes the run):
    >>> trainer = Trainer({"train": {"steps": 3, "batch_size": 1, "seq_len": 8, "num_threads": 1, "eval_batches": 1},
    ...                    "data": {"max_bytes": 20000},
    ...                    "output": {"progress": "none", "plot": False, "dir": tempfile.mkdtemp()}}, echo=False)
    >>> first = float(trainer.step()["loss"]); second = float(trainer.step()["loss"])
    >>> val = trainer.evaluate()
    >>> result = trainer.run()
    >>> trainer.done, [r["step"] for r in trainer.metrics]
    (3, [1, 2, 3, 3])
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, Sequence, TextIO


from hpfunc.train.config import Config, load_config, load_config_dict
from hpfunc.train.loop import RunResult

__all__ = ["Trainer", "run"]


def _as_config(config: Any, overrides: Sequence[str]) -> Config:
    if isinstance(config, Config):
        if overrides:
            from hpfunc.train.config import config_to_dict

            return load_config_dict(config_to_dict(config), overrides)
        return config
    if isinstance(config, Mapping):
        return load_config_dict(config, overrides)
    if isinstance(config, (str, pathlib.Path)):
        return load_config(config, overrides)
    raise TypeError(f"Trainer: expected a YAML path, a mapping or a hpfunc.train.Config, found {type(config).__name__}")


class Trainer:
    """A training run: the config, the model's spec and config, the callbacks; :meth:`run` trains, or
    :meth:`step`, :meth:`run` with a number of steps, :meth:`evaluate` and :meth:`save` drive it a piece
    at a time (the first of them opens the run: claims the folder, builds the state, starts the callbacks).

    Args:
      config: a YAML path, a plain mapping (as read from YAML) or a :class:`Config`.
      overrides: ``key.path=value`` strings applied on top (as ``--set``).
      callbacks: callback objects run after those of the config's ``callbacks:``.
      out_dir, stream, echo, overwrite, inputs, lock_token, resume: as :func:`hpfunc.train.run`.

    While and after it runs: ``state`` (the last applied step's :class:`~hpfunc.train.step.TrainState`),
    ``metrics`` (the records written to metrics.jsonl), ``record`` (the last step's record or None),
    ``done`` (the steps done), ``summary`` (once finished), ``out_dir``, ``main`` (rank 0), ``rank``,
    ``mesh``, ``start_step``, ``checkpoint_root``, ``checkpoints``, ``writer`` (the background writer of
    the callbacks' files). ``callbacks`` are the config's and the ``callbacks=`` ones as ``(label,
    callback)``; the run calls them between the built-in ones (:mod:`hpfunc.train.callbacks.defaults`).

    On a mesh every method that trains, evaluates or saves is a collective: call it in every rank, in the
    same order. A trainer stepped by hand that does not reach the end is ended with :meth:`close` (or
    ``with Trainer(...) as trainer:``), which releases the output folder without a summary.json.
    """

    def __init__(self, config: Any, *, overrides: Sequence[str] = (), callbacks: Sequence[Any] = (),
                 out_dir: str | pathlib.Path | None = None, stream: TextIO | None = None, echo: bool = True,
                 overwrite: bool = False, inputs: Sequence[tuple[str, str | pathlib.Path]] = (),
                 lock_token: str | None = None, resume: str = "never"):
        from hpfunc.train.build import check_buildable, model_spec
        from hpfunc.train.callbacks import build_callbacks

        self.cfg = _as_config(config, overrides)
        self.spec = model_spec(self.cfg.model)
        self.model_cfg = check_buildable(self.cfg)  # config errors first
        self.callbacks = [*build_callbacks(self.cfg),
                          *((f"callbacks argument {i} ({type(cb).__name__})", cb) for i, cb in enumerate(callbacks))]
        self.options = {"out_dir": out_dir, "stream": stream, "echo": echo, "overwrite": overwrite,
                        "inputs": tuple(inputs), "lock_token": lock_token, "resume": resume}
        self.out_dir = pathlib.Path(self.cfg.output.dir if out_dir is None else out_dir)
        self.state: Any = None
        self.records: list[dict[str, Any]] = []
        self.record: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.main, self.rank, self.mesh = True, 0, None
        self.checkpoint_root: pathlib.Path | None = None
        self.checkpoints: Any = None  # the run's TrainCheckpoints (None without checkpoint.every)
        self.start_step = 0  # the step the run starts after (a resumed run's checkpoint step)
        self.folder: Any = None
        self.result: Any = None
        self.all_callbacks: list[tuple[str, Any]] = []
        self._run: Any = None  # the open TrainingRun

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The records logged so far (the lines of metrics.jsonl, validation lines included)."""
        return self.records

    @property
    def done(self) -> int:
        """The steps done (a resumed run starts at its checkpoint's step)."""
        return self.start_step if self._run is None else self._run.done

    @property
    def writer(self) -> Any:
        """The run's :class:`~hpfunc.train.callbacks.writer.BackgroundWriter` (the callbacks' file writes)."""
        return self._opened().writer

    @property
    def tally(self) -> Any:
        """The run's :class:`~hpfunc.train.loop.Tally` (windows, skipped steps; what a checkpoint carries)."""
        return self._opened().tally

    def _opened(self) -> Any:
        if self._run is None:
            from hpfunc.train.loop import TrainingRun

            self._run = TrainingRun(self)
            self._run.open()
        return self._run

    def step(self) -> dict[str, Any]:
        """One training step; the metrics it returned (``loss``, ``grad_norm``, ``lr``, ... as 0-d tensors).
        A step that is not finite is skipped or stops the run (``train.on_nonfinite``)."""
        return self._opened().step()

    def run(self, steps: int | None = None) -> RunResult:
        """Train ``steps`` more steps; without ``steps``, up to ``train.steps`` and finish the run (the final
        validation, the last checkpoint, sample.txt, loss.png, summary.json). The
        :class:`~hpfunc.train.loop.RunResult` (its ``summary`` is None until the run finished)."""
        run = self._opened()
        run.advance(self.cfg.train.steps - run.done if steps is None else steps)
        if steps is not None:
            return RunResult(state=run.state, records=run.records, summary=None, out_dir=run.out)
        self.result = run.finish()
        return self.result

    def evaluate(self) -> float | None:
        """The validation loss of the current state (``train.eval_batches`` batches; on a mesh through the
        parallelized forward on the sharded state, its value on every rank), logged to metrics.jsonl and
        told to the callbacks (``on_eval``). None when the data has no validation batches."""
        return self._opened().evaluate()

    def save(self, *, wait: bool = True) -> pathlib.Path:
        """A checkpoint of the current state (the state after :attr:`done` steps) in the run's checkpoint
        folder (``checkpoint.dir``), as the periodic ones: a new Trainer of the same config with
        ``resume="auto"`` (or this path) continues from it exactly. ``wait``: return once it is written.
        Returns the checkpoint's folder."""
        return self._opened().save(wait=wait)

    def close(self) -> None:
        """End the run where it is (nothing when it finished): the callbacks' files flushed and closed, the
        output folder released; no summary.json is written (the run did not finish)."""
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def say(self, text: str) -> None:
        """A line of the run's console output (rank 0; silent with ``echo=False`` or ``output.progress: none``)."""
        self._opened().say(text)

    def output_file(self, name: str) -> pathlib.Path:
        """The path of ``name`` in the run's output folder (for a callback's own file, on rank 0)."""
        return self.out_dir / name

    def open_lines(self, name: str) -> Any:
        """Whole JSON lines on ``name`` in the run's folder for a callback's own file, written on the run's
        background writer (:class:`~hpfunc.train.callbacks.writer.BackgroundLines` over a
        :class:`~hpfunc.train.output.MetricsWriter`): a run from step 0 starts it afresh (a previous run's
        file is replaced), a resumed run keeps the lines up to its checkpoint's step (no step twice), as
        metrics.jsonl."""
        from hpfunc.train.callbacks.writer import BackgroundLines
        from hpfunc.train.checkpointing import truncate_metrics
        from hpfunc.train.output import MetricsWriter

        path = self.output_file(name)
        if self.start_step == 0:
            path.unlink(missing_ok=True)
        elif path.exists():
            truncate_metrics(path, self.start_step)
        return BackgroundLines(self.writer, MetricsWriter(path))

    def _bind_run(self, run: Any) -> None:
        """Called by the run once its state is built: what the callbacks read."""
        self.state, self.model_cfg, self.out_dir, self.records = run.state, run.model_cfg, run.out, run.records
        self.start_step, self.checkpoints, self.checkpoint_root = run.start, run.ckpts, run.root
        self.main, self.rank, self.mesh, self.folder = run.main, run.rank, run.mesh, run.folder

    def _callback_list(self, *, main: bool) -> Any:
        from hpfunc.train.callbacks import CallbackList
        from hpfunc.train.callbacks.defaults import run_callbacks

        self.all_callbacks = run_callbacks(self.callbacks)
        return CallbackList(self.all_callbacks, main=main)


def run(
    cfg: Config,
    *,
    out_dir: str | pathlib.Path | None = None,
    stream: TextIO | None = None,
    echo: bool = True,
    overwrite: bool = False,
    inputs: Sequence[tuple[str, str | pathlib.Path]] = (),
    lock_token: str | None = None,
    resume: str = "never",
    callbacks: Sequence[Any] = (),
) -> RunResult:
    """Train for ``cfg.train.steps`` steps and write the outputs: ``Trainer(cfg, ...).run()``
    (:class:`hpfunc.train.trainer.Trainer`).

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
      resume: ``"never"`` (start from step 0), ``"auto"`` (the newest complete checkpoint of the run's
        ``checkpoint.dir``, if any) or the path of a checkpoint (:mod:`hpfunc.train.checkpointing`).
        A restarted attempt of an elastic launch always resumes ``auto``.
      callbacks: callback objects run after those of ``cfg.callbacks`` (:mod:`hpfunc.train.callbacks`).
    """
    return Trainer(cfg, out_dir=out_dir, stream=stream, echo=echo, overwrite=overwrite, inputs=inputs,
                   lock_token=lock_token, resume=resume, callbacks=callbacks).run()
