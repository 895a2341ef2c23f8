"""``Trainer``: one training run as an object, from a YAML path, a mapping or a :class:`Config`; the loop
of :mod:`hpfunc.train.loop` calls its callbacks. ``hpfunc train`` and :func:`hpfunc.train.run` are thin
layers over it.

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
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, Sequence, TextIO

from hpfunc.train.config import Config, load_config, load_config_dict

__all__ = ["Trainer"]


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
    """A training run: the config, the model's spec and config, the callbacks; :meth:`run` trains.

    Args:
      config: a YAML path, a plain mapping (as read from YAML) or a :class:`Config`.
      overrides: ``key.path=value`` strings applied on top (as ``--set``).
      callbacks: callback objects run after those of the config's ``callbacks:``.
      out_dir, stream, echo, overwrite, inputs, lock_token, resume: as :func:`hpfunc.train.run`.

    While and after it runs: ``state`` (the last applied step's :class:`~hpfunc.train.step.TrainState`),
    ``metrics`` (the records written to metrics.jsonl), ``record`` (the last step's record or None),
    ``summary``, ``out_dir``, ``main`` (rank 0), ``rank``, ``mesh``, ``start_step``, ``checkpoint_root``,
    ``checkpoints``.
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

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The records logged so far (the lines of metrics.jsonl, validation lines included)."""
        return self.records

    def run(self) -> Any:
        """Train for ``train.steps`` steps; return the :class:`~hpfunc.train.loop.RunResult`."""
        from hpfunc.train.loop import execute

        self.result = execute(self)
        return self.result

    def output_file(self, name: str) -> pathlib.Path:
        """The path of ``name`` in the run's output folder (for a callback's own file, on rank 0)."""
        return self.out_dir / name

    def _bind_run(self, *, state: Any, model_cfg: Any, out_dir: pathlib.Path, main: bool, rank: int, mesh: Any,
                  checkpoint_root: pathlib.Path, folder: Any, start_step: int, checkpoints: Any) -> None:
        """Called by the loop once the run's state is built: what the callbacks read."""
        self.state, self.model_cfg, self.out_dir = state, model_cfg, out_dir
        self.start_step, self.checkpoints = start_step, checkpoints
        self.main, self.rank, self.mesh, self.checkpoint_root, self.folder = main, rank, mesh, checkpoint_root, folder
