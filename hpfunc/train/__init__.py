"""Training from a strict YAML config, on one process or on a mesh of processes it launches itself:
token data, a pure ``train_step`` and the loop.

    hpfunc train examples/configs/<a config>.yaml           # the command line
    >>> from hpfunc import train                             # the same pieces from Python
    >>> cfg = train.load_config_dict({"train": {"steps": 5}}, ["optimizer.lr=1e-3"])
    >>> cfg.train.steps, cfg.optimizer.lr
    (5, 0.001)

Modules: ``config`` (schema, YAML, ``--set`` overrides), ``build`` (model config, schedule,
optimizer), ``data`` (corpora, tokenising, seeded batches), ``step`` (``make_train_step``),
``output`` (metrics JSONL, progress, plot), ``loop`` (:class:`~hpfunc.train.loop.TrainingRun`: the run in
pieces: open, step, evaluate, save, finish), ``distributed`` (``parallel:`` -> a plan,
checked against the model; the sharded step inside the ranks), ``launch`` (starting the ranks through
``torch.distributed.run``), ``checkpointing`` (what a run saves, ``--resume``, config compatibility),
``last_words`` (the save on SIGTERM / SIGINT / a failed step), ``fault_hooks`` (test hooks that
inject faults), ``trainer`` (:class:`Trainer`: a run as an object: ``step``, ``run``, ``evaluate``, ``save``),
``callbacks`` (what runs beside the loop: the run's own outputs, metrics log, MoE monitor, per-layer
norms, checkpoint log, TensorBoard, your own; their writes on a background writer), ``cli``
(``hpfunc train``). The model comes from its :class:`~hpfunc.models.spec.ModelSpec` (``model.name``).
See ``docs/train.md``.
"""

from hpfunc.train.build import build_model_config, build_optimizer, build_schedule
from hpfunc.train.config import (
    Config,
    ConfigError,
    ParallelConfig,
    PlanEntry,
    apply_overrides,
    config_to_dict,
    load_config,
    load_config_dict,
)
from hpfunc.train.data import DataError, TokenData, load_data, sample_batch, stdlib_files
from hpfunc.train.loop import RunResult
from hpfunc.train.output import read_metrics
from hpfunc.train.trainer import Trainer, run
from hpfunc.train.step import TrainState, init_train_state, make_eval_step, make_train_step, merge_params, split_params

__all__ = [
    "Config",
    "ConfigError",
    "ParallelConfig",
    "PlanEntry",
    "load_config",
    "load_config_dict",
    "apply_overrides",
    "config_to_dict",
    "build_model_config",
    "build_schedule",
    "build_optimizer",
    "DataError",
    "TokenData",
    "load_data",
    "sample_batch",
    "stdlib_files",
    "TrainState",
    "init_train_state",
    "make_train_step",
    "make_eval_step",
    "split_params",
    "merge_params",
    "RunResult",
    "run",
    "Trainer",
    "read_metrics",
]
