"""Loading a config: YAML (strict: a key given twice is an error), ``--set key.path=value`` overrides,
structuring into :class:`~hpfunc.train.config.schema.Config`, the checks across keys, and the way back
to plain data.

    >>> cfg = load_config_dict({"train": {"steps": 10}}, ["activations.remat=dots_saveable"])
    >>> cfg.train.steps, cfg.activations.remat
    (10, 'dots_saveable')
    >>> config_to_dict(cfg)["activations"]
    {'remat': 'dots_saveable', 'offload': None}
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping, Sequence

import attrs
import yaml

from hpfunc.train.config.errors import ConfigError, found
from hpfunc.train.config.grammars import parse_callbacks, parse_layer_policies
from hpfunc.train.config.parallel_grammar import parse_parallel
from hpfunc.train.config.schema import (
    OFFLOAD_POLICIES, OPEN_SECTIONS, RANGES, REMAT_POLICIES, ActivationsConfig, Config, PrecisionConfig,
)
from hpfunc.train.config.structure import Structurer

__all__ = ["STRUCTURER", "load_config", "load_config_dict", "apply_overrides", "config_to_dict"]

# The whole config's structurer: the sections with grammars of their own by key path.
STRUCTURER = Structurer(
    Config,
    hooks={
        "parallel": parse_parallel,
        "callbacks": parse_callbacks,
        "activations.remat": lambda v, path: parse_layer_policies(v, path, REMAT_POLICIES),
        "activations.offload": lambda v, path: parse_layer_policies(v, path, OFFLOAD_POLICIES),
    },
    open_fields=OPEN_SECTIONS,
    moved={"precision.param_dtype": "the parameters' own dtype (storage, gradients, optimizer state) is model.dtype"},
)


def _check_ranges(cfg: Config) -> None:
    for path, ok, expected in RANGES:
        obj: Any = cfg
        for part in path.split("."):
            obj = getattr(obj, part)
        if not ok(obj):
            raise ConfigError(f"{path}: expected {expected}, found {found(obj)}")
    dp = cfg.parallel.data_size if cfg.parallel.plan else 1
    if cfg.train.batch_size % dp == 0 and (cfg.train.batch_size // dp) % cfg.train.microbatches:
        raise ConfigError(f"train.microbatches: the batch of {cfg.train.batch_size}"
                          f"{f' ({cfg.train.batch_size // dp} per data shard)' if dp > 1 else ''} does not split "
                          f"into {cfg.train.microbatches} equal micro-batches")
    if cfg.data.source in ("text", "jsonl", "ids") and not cfg.data.paths:
        raise ConfigError(f"data.paths: data.source is {cfg.data.source!r}, which needs file paths (globs); found none")
    if cfg.data.source == "ids" and cfg.data.tokenizer is not None:
        raise ConfigError("data.tokenizer: pre-tokenised ids (data.source: ids) take no tokenizer; remove it")



class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, str) and key in seen:
            raise ConfigError(
                f"line {key_node.start_mark.line + 1}: key {key!r} is given twice in the same section "
                f"(first on line {seen[key]})"
            )
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of the raw config mapping with ``key.path=value`` overrides applied.

    Values are read as YAML (``3``, ``0.1``, ``null``, ``[0.9, 0.95]``, ``cosine``). Missing
    sections are created; the strict check afterwards rejects keys that do not exist.

    >>> apply_overrides({"train": {"steps": 5}}, ["train.steps=7", "optimizer.betas=[0.9, 0.99]"])
    {'train': {'steps': 7}, 'optimizer': {'betas': [0.9, 0.99]}}
    """
    import copy

    out: dict[str, Any] = copy.deepcopy(dict(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, text = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: the key path {key!r} has an empty part")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"--set {item!r}: {'.'.join(parts[: i + 1])} is {found(child)}, not a section"
                )
            node = child
        node[parts[-1]] = _parse_override_value(text)
    return out


def load_config_dict(data: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Build a checked :class:`Config` from a plain mapping (as read from YAML) and overrides."""
    data = apply_overrides(data or {}, overrides)
    cfg = STRUCTURER.structure(data)
    _check_ranges(cfg)
    return cfg


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply ``key.path=value`` overrides and check every key.

    Relative ``data.paths``, ``data.tokenizer``, ``model.pretrained`` and a pipeline's CSV
    ``schedule`` file are resolved against the config file's folder.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, found {found(data)}")
    cfg = load_config_dict(data, overrides)
    return _resolve_paths(cfg, path.parent)


def _resolve_paths(cfg: Config, base: pathlib.Path) -> Config:
    def resolve(p: str) -> str:
        q = pathlib.Path(p).expanduser()
        return str(q if q.is_absolute() else base / q)

    data = cfg.data
    paths = [resolve(p) for p in data.paths] if data.paths else data.paths
    tok = resolve(data.tokenizer) if data.tokenizer else data.tokenizer
    model = cfg.model if not cfg.model.pretrained else attrs.evolve(cfg.model, pretrained=_pretrained_folder(
        cfg.model.pretrained, resolve(cfg.model.pretrained)))
    plan = tuple(attrs.evolve(e, options={**e.options, "schedule": resolve(e.options["schedule"])})
                 if e.kind == "pp" and _is_schedule_file(e.options.get("schedule")) else e for e in cfg.parallel.plan)
    return attrs.evolve(cfg, data=attrs.evolve(data, paths=paths, tokenizer=tok), model=model,
                        parallel=attrs.evolve(cfg.parallel, plan=plan))


def _pretrained_folder(raw: str, resolved: str) -> str:
    """``model.pretrained`` as a local folder: the path (relative to the config file) when it exists,
    else a hub repository id (``owner/name[@revision]``) resolved through huggingface_hub's cache."""
    from hpfunc.models import hub

    if os.path.exists(resolved) or not hub.is_repo_id(raw):
        return resolved
    try:
        return hub.local_folder(raw)
    except hub.HubError as e:
        raise ConfigError(f"model.pretrained: {e}") from None


def _is_schedule_file(schedule: Any) -> bool:
    """:func:`hpfunc.transforms.pipeline_plan.is_schedule_file`, imported here only when a ``pp`` entry
    asks (the config module does not load the transforms for every config it reads)."""
    from hpfunc.transforms.pipeline_plan import is_schedule_file

    return is_schedule_file(schedule)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (model overrides folded back under ``model:``), ready for YAML."""
    d = attrs.asdict(cfg, recurse=True)
    model = d["model"]
    overrides = model.pop("overrides")
    model.update(overrides)
    d["optimizer"]["betas"] = list(d["optimizer"]["betas"])
    d["parallel"] = cfg.parallel.to_data()
    if cfg.callbacks:
        d["callbacks"] = [e.to_data() for e in cfg.callbacks]
    else:
        del d["callbacks"]  # a config without callbacks reads as before
    # written only when set, so that a config without them reads as before
    if cfg.precision == PrecisionConfig():
        del d["precision"]
    if cfg.activations == ActivationsConfig():
        del d["activations"]
    else:
        d["activations"] = {k: _policies_data(v) for k, v in d["activations"].items()}
    return d


def _policies_data(value: Any) -> Any:
    """A per-layer policy key as YAML writes it (a list for one per layer)."""
    return list(value) if isinstance(value, tuple) else value
