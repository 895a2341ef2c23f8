"""The training config: strict attrs classes read from YAML, with ``--set key.path=value`` overrides.

Every key is checked. An unknown key, a value of the wrong type or an unknown choice raises a
:class:`ConfigError` that names the dotted key path and, where it can, suggests the fix::

    optimizer.lr_warmup: unknown key; did you mean 'warmup_steps' (in schedule)? expected one of ...

The package's modules, one idea each: :mod:`.schema` (the sections, their defaults and value checks),
:mod:`.structure` (the strict structurer from plain data to the classes), :mod:`.parallel_grammar` (the
``parallel:`` section), :mod:`.grammars` (``callbacks:`` and the per-layer ``activations:`` policies),
:mod:`.load` (YAML, overrides, cross-key checks, back to plain data), :mod:`.errors`.

Example:
    >>> cfg = load_config_dict({"train": {"steps": 10}, "model": {"hidden_size": 32}})
    >>> cfg.train.steps, cfg.optimizer.name
    (10, 'adamw')
    >>> try:
    ...     load_config_dict({"train": {"stpes": 10}})
    ... except ConfigError as e:
    ...     print(str(e)[:47])
    train.stpes: unknown key; did you mean 'steps'?
"""

from __future__ import annotations

from typing import Any, Sequence

from hpfunc.train.config.errors import ConfigError
from hpfunc.train.config.load import STRUCTURER, apply_overrides, config_to_dict, load_config, load_config_dict
from hpfunc.train.config.schema import (
    DTYPES, OFFLOAD_POLICIES, PLAN_KINDS, REMAT_POLICIES, ActivationsConfig, CallbackEntry, CheckpointConfig, Config,
    DataConfig, ModelConfig, OptimizerConfig, OutputConfig, ParallelConfig, PlanEntry, PrecisionConfig,
    ScheduleConfig, TrainConfig,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "DataConfig",
    "TrainConfig",
    "OutputConfig",
    "CheckpointConfig",
    "PlanEntry",
    "ParallelConfig",
    "PLAN_KINDS",
    "CallbackEntry",
    "PrecisionConfig",
    "ActivationsConfig",
    "DTYPES",
    "REMAT_POLICIES",
    "OFFLOAD_POLICIES",
    "Config",
    "load_config",
    "load_config_dict",
    "apply_overrides",
    "config_to_dict",
    "convert",
    "unknown_key_message",
]


def convert(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against the annotation ``tp`` and converted, as the config's own keys are
    (:meth:`.structure.Structurer.convert`); :class:`ConfigError` naming ``path``.

    >>> convert(3, float, "model.rope_theta")
    3.0
    """
    return STRUCTURER.convert(value, tp, path)


def unknown_key_message(path: str, key: str, allowed: Sequence[str]) -> str:
    """The message for an unknown ``key`` of the section at ``path`` (suggestions from the whole schema)."""
    return STRUCTURER.unknown_key_message(path, key, allowed)


_convert = convert  # the name hpfunc.train.callbacks imports (kept while that package is being restructured)
