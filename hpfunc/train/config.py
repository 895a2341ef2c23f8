"""The training config: strict attrs classes read from YAML, with ``--set key.path=value`` overrides.

Every key is checked. An unknown key, a value of the wrong type or an unknown choice raises a
:class:`ConfigError` that names the dotted key path and, where it can, suggests the fix::

    optimizer.lr_warmup: unknown key; did you mean 'warmup_steps' (in schedule)? expected one of ...

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

import difflib
import os
import pathlib
import types
import typing
from typing import Any, Literal, Mapping, Sequence, Union

import attrs
import yaml

from hpfunc.faults import DEFAULT_TIMEOUT_S
from hpfunc.models.registry import DEFAULT_PRESET

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
    "Config",
    "load_config",
    "load_config_dict",
    "apply_overrides",
    "config_to_dict",
]


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type or an invalid value. The message names its path."""


# ---------------------------------------------------------------------------------------------
# The schema. Field docs are the comments users read in docs/train.md.


@attrs.frozen
class ModelConfig:
    """Which model: a registered model (or a spec's import path), one of its presets, field overrides.

    ``name``: a name of :data:`hpfunc.models.registry.BUILTIN` or the import path
    ``package.module:SPEC`` of a :class:`hpfunc.models.spec.ModelSpec`; null: the registered model
    that has ``preset``. Any other key under ``model:`` is an override of a field of the model's
    config class (``hidden_size: 64``); such keys are checked against it when the model is built.
    """

    name: Union[str, None] = None
    preset: str = DEFAULT_PRESET
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # a Hugging Face folder (config.json + safetensors) to start from: its config.json is the model (the
    # overrides apply on top, the preset is not used) and each rank reads its blocks of the weights
    pretrained: Union[str, None] = None
    overrides: dict = attrs.field(factory=dict)


@attrs.frozen
class OptimizerConfig:
    """``adamw`` for every parameter, or ``muon_adamw`` (Muon on hidden matrices, AdamW on the rest)."""

    name: Literal["adamw", "muon_adamw"] = "adamw"
    lr: float = 3e-3  # AdamW's peak learning rate
    muon_lr: float = 0.02  # Muon's peak learning rate (muon_adamw only)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_momentum: float = 0.95
    clip_norm: Union[float, None] = 1.0  # global-norm clipping of gradients; null disables


@attrs.frozen
class ScheduleConfig:
    """Learning-rate shape (multiplies each peak rate): ``constant``, ``cosine`` or ``wsd``."""

    name: Literal["constant", "cosine", "wsd"] = "cosine"
    warmup_steps: int = 0
    end_factor: float = 0.1  # final rate as a fraction of the peak (cosine, wsd)
    decay_fraction: float = 0.2  # wsd: fraction of all steps spent decaying
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"  # wsd only


@attrs.frozen
class DataConfig:
    """Where tokens come from. ``stdlib`` needs nothing: it reads this Python's own standard library."""

    source: Literal["stdlib", "text", "jsonl", "ids"] = "stdlib"
    paths: Union[list[str], None] = None  # glob patterns (text, jsonl, ids); relative to the config file
    text_field: str = "text"  # jsonl: the field holding each document
    tokenizer: Union[str, None] = None  # a tokenizer.json (``tokenizers`` package); null = bytes (vocab 256)
    val_fraction: float = 0.05  # the tail of the token stream kept for validation
    max_bytes: Union[int, None] = None  # read at most this many bytes of text (stdlib, text, jsonl)
    document_mask: bool = False  # batches carry doc_ids: a token attends only within its own document


@attrs.frozen
class TrainConfig:
    """The loop: steps, batch shape and the MoE balancing knobs."""

    steps: int = 100
    batch_size: int = 8
    microbatches: int = 1  # gradient accumulation: the (per-shard) batch in this many equal slices
    seq_len: int = 128
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 4
    aux_loss_coef: Union[float, None] = None  # load-balancing loss weight; null: model.router_aux_loss_coef
    expert_bias_rate: float = 1e-3  # aux-loss-free balancing: bias += rate * sign(mean_load - load)
    num_threads: Union[int, None] = None  # torch intra-op threads; null keeps torch's default
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a step whose loss or grad norm is NaN/inf is not applied
    max_skips: int = 5  # on_nonfinite: skip stops the run after this many non-finite steps in a row


@attrs.frozen
class OutputConfig:
    dir: str = "runs/train"  # relative to the current directory
    plot: bool = True  # write loss.png at the end
    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: a bar on a terminal, lines otherwise
    sample_tokens: int = 0  # byte-level data: print (and save as sample.txt) this many generated bytes
    sample_prompt: str = "def "
    sample_temperature: float = 0.8


@attrs.frozen
class CheckpointConfig:
    """``checkpoint:``: whole train states saved every ``every`` steps under ``dir`` (see docs/train.md)."""

    every: int = 0  # save every this many steps (and after the last); 0: no checkpoints
    dir: Union[str, None] = None  # null: <output.dir>/checkpoints
    keep_last: Union[int, None] = 3  # keep the newest this many (null: all)
    keep_every: Union[int, None] = None  # also keep every step that is a multiple of this
    async_save: bool = True  # write in a background thread; the loop waits only for the staging copy
    last_words: bool = True  # on SIGTERM / SIGINT / a failed step: save the last completed step, then exit
    last_words_timeout_s: float = 20.0  # the ranks must agree and save within this; else the save is skipped
    timeout_s: float = 600.0  # an asynchronous write waiting longer for a peer fails (gloo's default: 30 min)


# Plan entries of ``parallel.plan``: name -> (mesh axes it takes, its options with their defaults).
# Each maps to the factory of the same name in ``hpfunc.transforms.plans``.
PLAN_KINDS: dict[str, tuple[int, dict[str, Any]]] = {
    "ddp": (1, {}),
    "fsdp": (1, {"reshard_after_forward": True}),
    "zero1": (1, {}),
    "zero2": (1, {}),
    "zero3": (1, {"reshard_after_forward": True}),
    "hsdp": (2, {"reshard_after_forward": True}),  # (replicate axis, shard axis)
    "tp": (1, {"vocab_parallel": False, "sequence_parallel": False}),
    "ep": (1, {"reshard_after_forward": True}),  # experts split; a data axis, the rest sharded as fsdp
    # each sequence split over the axis (hybrid: Ulysses over ulysses_axis, a second mesh axis it takes)
    "cp": (1, {"impl": "ring", "ulysses_axis": None, "balanced": True, "pad": True, "replicate_kv": False,
               "overlap": True}),
    # pipeline stages over the axis (not a data axis): a schedule name or a torch-format CSV file
    "pp": (1, {"schedule": "1f1b", "microbatches": 1, "virtual_stages": None, "layers_per_stage": None,
               "remat": None, "max_resident": None}),
}
# option types where the default (None) does not say
_OPTION_TYPES: dict[tuple[str, str], Any] = {("pp", "virtual_stages"): Union[int, None],
                                             ("pp", "layers_per_stage"): Union[tuple[int, ...], None],
                                             # a policy name for every stage, or one per stage (null: none)
                                             ("pp", "remat"): Union[str, tuple[Union[str, None], ...], None],
                                             ("pp", "max_resident"): Union[int, None],
                                             ("cp", "impl"): Literal["allgather", "ring", "ulysses", "hybrid"],
                                             ("cp", "ulysses_axis"): Union[str, None]}
_DATA_KINDS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp", "ep")


@attrs.frozen
class PlanEntry:
    """One entry of ``parallel.plan``: a plan factory, the mesh axes it runs over, its options.

    ``axes`` are always resolved (one axis, two for ``hsdp``); ``options`` hold every option of the
    kind with its default filled in.
    """

    kind: str
    axes: tuple[str, ...]
    options: dict = attrs.field(factory=dict)

    def to_data(self) -> Any:
        """The YAML form: ``{kind: {axis: name, option: value, ...}}`` (``axes: [a, b]`` for hsdp)."""
        where = {"axes": list(self.axes)} if len(self.axes) > 1 else {"axis": self.axes[0]}
        return {self.kind: {**where, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()}}}


@attrs.frozen
class ParallelConfig:
    """``parallel:``: the mesh (``{axis: size}``, in order) and the plan (one entry per mesh axis).

    Empty, or a mesh whose sizes are all 1, is a single-device run.
    """

    mesh: dict = attrs.field(factory=dict)
    plan: tuple = ()  # of PlanEntry
    timeout_s: float = DEFAULT_TIMEOUT_S  # a collective waiting longer fails, naming rank and collective
    sdc_check: str = "off"  # off | raise | warn: replicas of each reduced gradient compared every step
    max_restarts: int = 0  # elastic: restart the whole group this many times after a rank fails (resume auto)
    device: str = "auto"  # auto | cpu | cuda: the ranks' device (auto: cuda when available); NCCL on cuda, gloo on cpu
    offload_state: tuple = ()  # state kept in host memory between steps: (optimizer,) (Plan.with_state_offload)

    @property
    def size(self) -> int:
        """Number of processes the mesh needs."""
        n = 1
        for s in self.mesh.values():
            n *= s
        return n

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the batch (every ddp / fsdp / zero / hsdp / ep axis), in mesh order."""
        axes = {a for e in self.plan if e.kind in _DATA_KINDS for a in e.axes}
        return tuple(a for a in self.mesh if a in axes)

    @property
    def data_size(self) -> int:
        """Number of batch shards: the product of the data axes' sizes."""
        n = 1
        for a in self.data_axes:
            n *= self.mesh[a]
        return n

    @property
    def mesh_text(self) -> str:
        """The mesh as written in YAML: ``{fsdp: 2, tp: 2}``."""
        return _flow(self.mesh)

    def to_data(self) -> dict[str, Any]:
        # written only when set to something other than the default (300 s)
        timeout = {} if self.timeout_s == DEFAULT_TIMEOUT_S else {"timeout_s": self.timeout_s}
        if self.sdc_check != "off":
            timeout["sdc_check"] = self.sdc_check
        if self.max_restarts:
            timeout["max_restarts"] = self.max_restarts
        if self.device != "auto":
            timeout["device"] = self.device
        if self.offload_state:
            timeout["offload_state"] = list(self.offload_state)
        if not self.mesh and not self.plan:
            return timeout
        return {"mesh": dict(self.mesh), "plan": [e.to_data() for e in self.plan], **timeout}


@attrs.frozen
class CallbackEntry:
    """One entry of ``callbacks:``: a built-in name (``moe_monitor``) or an import path
    (``my_pkg.module:MyCallback``), and its options (checked against the callback's signature when the
    callbacks are built, :func:`hpfunc.train.callbacks.build_callbacks`)."""

    name: str
    options: dict = attrs.field(factory=dict)

    def to_data(self) -> Any:
        return {self.name: dict(self.options)} if self.options else self.name


@attrs.frozen
class Config:
    """A whole training run."""

    seed: int = 0
    model: ModelConfig = attrs.field(factory=ModelConfig)
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    schedule: ScheduleConfig = attrs.field(factory=ScheduleConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    output: OutputConfig = attrs.field(factory=OutputConfig)
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    callbacks: tuple = ()  # of CallbackEntry: what runs beside the loop (hpfunc.train.callbacks)


# Sections whose unknown keys are collected rather than rejected (checked later against the model).
_OPEN_SECTIONS = {ModelConfig: "overrides"}

# Positive-integer and range checks: (path, predicate, what was expected).
_RANGES: list[tuple[str, Any, str]] = [
    ("seed", lambda v: 0 <= v < 2**64, "an integer in [0, 2**64) (the random key holds 64 bits: 2**64 would be 0)"),
    ("train.steps", lambda v: v >= 1, "an integer >= 1"),
    ("train.batch_size", lambda v: v >= 1, "an integer >= 1"),
    ("train.microbatches", lambda v: v >= 1, "an integer >= 1"),
    ("train.seq_len", lambda v: v >= 1, "an integer >= 1"),
    ("train.log_every", lambda v: v >= 1, "an integer >= 1"),
    ("train.eval_every", lambda v: v >= 0, "an integer >= 0"),
    ("train.eval_batches", lambda v: v >= 0, "an integer >= 0"),
    ("train.num_threads", lambda v: v is None or v >= 1, "null or an integer >= 1"),
    ("train.max_skips", lambda v: v >= 1, "an integer >= 1"),
    ("checkpoint.every", lambda v: v >= 0, "an integer >= 0 (0: no checkpoints)"),
    ("checkpoint.keep_last", lambda v: v is None or v >= 1, "null or an integer >= 1"),
    ("checkpoint.keep_every", lambda v: v is None or v >= 1, "null or an integer >= 1"),
    ("checkpoint.last_words_timeout_s", lambda v: 0 < v < float("inf"), "a number of seconds > 0"),
    ("checkpoint.timeout_s", lambda v: 0 < v < float("inf"), "a number of seconds > 0"),
    ("output.sample_tokens", lambda v: v >= 0, "an integer >= 0"),
    ("output.sample_temperature", lambda v: v >= 0, "a number >= 0"),
    ("train.aux_loss_coef", lambda v: v is None or v >= 0, "null or a number >= 0"),
    ("train.expert_bias_rate", lambda v: v >= 0, "a number >= 0"),
    ("schedule.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("schedule.end_factor", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("schedule.decay_fraction", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("data.val_fraction", lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    ("data.max_bytes", lambda v: v is None or v >= 1, "null or an integer >= 1"),
    ("optimizer.lr", lambda v: v > 0, "a number > 0"),
    ("optimizer.muon_lr", lambda v: v > 0, "a number > 0"),
    ("optimizer.eps", lambda v: v > 0, "a number > 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("optimizer.clip_norm", lambda v: v is None or v > 0, "null or a number > 0"),
    ("optimizer.betas", lambda v: all(0.0 <= b < 1.0 for b in v), "two numbers in [0, 1)"),
]


# ---------------------------------------------------------------------------------------------
# Strict conversion of plain data (from YAML) into the attrs classes.


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple:
            return f"a list of {len(args)} numbers" if all(a is float for a in args) else "a list"
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if attrs.has(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _found(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )
    return "null" if value is None else f"{kind} {value!r}"


def _schema_keys(cls: type | None = None, prefix: str = "") -> list[tuple[str, str]]:
    """Every ``(section_path, key)`` of the schema, for suggestions across sections."""
    cls = Config if cls is None else cls
    out = []
    hints = typing.get_type_hints(cls)
    for f in attrs.fields(cls):
        if f.name == _OPEN_SECTIONS.get(cls):
            continue
        out.append((prefix, f.name))
        if attrs.has(hints[f.name]):
            out.extend(_schema_keys(hints[f.name], _join(prefix, f.name)))
    return out


def _word_score(key: str, candidate: str) -> int:
    words = set(key.lower().replace("-", "_").split("_")) - {""}
    return sum(len(w) for w in words & set(candidate.split("_")))


def _unknown_key_message(path: str, key: str, allowed: Sequence[str]) -> str:
    hint = ""
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]!r}? "
    else:
        # The key may belong to another section (optimizer.warmup_steps) or share a word with the
        # intended one (lr_warmup -> warmup_steps): search the whole schema, longest shared words first.
        elsewhere = [(s, k) for s, k in _schema_keys() if s != path]
        exact = [(s, k) for s, k in elsewhere if k == key and s]
        if exact:
            hint = f"did you mean {_join(*exact[0])!r}? "
        else:
            scored = [(_word_score(key, k), s == path, s, k) for s, k in _schema_keys()]
            scored = [t for t in scored if t[0] > 0]
            if scored:
                best, same, s, k = max(scored, key=lambda t: (t[0], t[1]))
                where = "" if same else f" (in {s or 'the top level'}: {_join(s, k)})"
                hint = f"did you mean {k!r}{where}? "
    return f"{_join(path, key)}: unknown key; {hint}expected one of {', '.join(sorted(allowed))}"


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert it; raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if tp is ParallelConfig:
        return _parse_parallel(value, path)
    if path == "callbacks":
        return _parse_callbacks(value, path)
    if attrs.has(tp):
        return _from_mapping(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {_type_name(tp)}, found {_found(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: expected {_type_name(tp)}, found {_found(value)}{hint}")
        return value
    if tp is Any:
        return value
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        (arg, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list of {_type_name(arg)}, found {_found(value)}")
        return tuple(_convert(v, arg, f"{path}.{i}") for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, found {_found(value)}")
        return tuple(_convert(v, a, f"{path}.{i}") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if isinstance(value, str) and arg is str:  # a single glob is a list of one
            return [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, found {_found(value)}")
        return [_convert(v, arg, f"{path}.{i}") for i, v in enumerate(value)]
    if tp is dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, found {_found(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, found {_found(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                return int(value)  # 1e4 in YAML
            raise ConfigError(f"{path}: expected an integer, found {_found(value)}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, found {_found(value)}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, found {_found(value)}")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, found {_found(value)}")
        return value
    raise TypeError(f"config schema: unsupported annotation {tp!r} at {path}")  # a bug in this module


def _from_mapping(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or '<top level>'}: expected a mapping, found {_found(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    open_field = _OPEN_SECTIONS.get(cls)
    allowed = [n for n in fields if n != open_field]
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{_join(path, key)}: keys must be strings, found {_found(key)}")
        if key not in allowed:
            if open_field is not None:
                extra[key] = value
                continue
            raise ConfigError(_unknown_key_message(path, key, allowed))
        kwargs[key] = _convert(value, hints[key], _join(path, key))
    if open_field is not None:
        kwargs[open_field] = extra
    return cls(**kwargs)


def _check_ranges(cfg: Config) -> None:
    for path, ok, expected in _RANGES:
        obj: Any = cfg
        for part in path.split("."):
            obj = getattr(obj, part)
        if not ok(obj):
            raise ConfigError(f"{path}: expected {expected}, found {_found(obj)}")
    dp = cfg.parallel.data_size if cfg.parallel.plan else 1
    if cfg.train.batch_size % dp == 0 and (cfg.train.batch_size // dp) % cfg.train.microbatches:
        raise ConfigError(f"train.microbatches: the batch of {cfg.train.batch_size}"
                          f"{f' ({cfg.train.batch_size // dp} per data shard)' if dp > 1 else ''} does not split "
                          f"into {cfg.train.microbatches} equal micro-batches")
    if cfg.data.source in ("text", "jsonl", "ids") and not cfg.data.paths:
        raise ConfigError(f"data.paths: data.source is {cfg.data.source!r}, which needs file paths (globs); found none")
    if cfg.data.source == "ids" and cfg.data.tokenizer is not None:
        raise ConfigError("data.tokenizer: pre-tokenised ids (data.source: ids) take no tokenizer; remove it")


def _parse_callbacks(data: Any, path: str) -> tuple:
    """``[name, {name: {option: value}}, ...]`` -> a tuple of :class:`CallbackEntry` (syntax only)."""
    if data is None:
        return ()
    if isinstance(data, (str, Mapping)):
        data = [data]
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of callbacks (e.g. [moe_monitor, {{tensorboard: {{every: 10}}}}]), "
                          f"found {_found(data)}")
    out = []
    for i, item in enumerate(data):
        where = f"{path}[{i}]"
        if isinstance(item, str):
            out.append(CallbackEntry(item))
            continue
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ConfigError(f"{where}: expected a callback name or a mapping of one name to its options "
                              f"({{moe_monitor: {{every: 5}}}}), found {_found(item)}")
        (name, options), = item.items()
        if not isinstance(name, str):
            raise ConfigError(f"{where}: the callback's name must be a string, found {_found(name)}")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}.{name}: expected a mapping of options, found {_found(options)}")
        for key in options:
            if not isinstance(key, str):
                raise ConfigError(f"{where}.{name}: option names must be strings, found {_found(key)}")
        out.append(CallbackEntry(name, dict(options)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The parallel section: a mesh and a plan (syntax only; hpfunc.train.distributed checks it against the
# model and builds the hpfunc.transforms.plans.Plan).


SDC_CHECKS = ("off", "raise", "warn")
DEVICES = ("auto", "cpu", "cuda")  # parallel.device; resolved on the machine by hpfunc.train.device
_PARALLEL_KEYS = ("mesh", "plan", "timeout_s", "sdc_check", "max_restarts", "device", "offload_state")
OFFLOAD_STATE = ("optimizer",)  # parallel.offload_state: what may rest in host memory between steps


def _parse_parallel(data: Any, path: str) -> ParallelConfig:
    """``{mesh: {axis: size}, plan: [entry, ...]}`` -> :class:`ParallelConfig` with every axis bound.

    Entries without ``axis:`` take the mesh axes that no entry names explicitly, in mesh order
    (``hsdp`` takes two). A mesh axis of size > 1 left without an entry is an error.
    """
    if data is None:
        return ParallelConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with mesh and plan, found {_found(data)}")
    for key in data:
        if key not in _PARALLEL_KEYS:
            raise ConfigError(_unknown_key_message(path, key, list(_PARALLEL_KEYS)))
    device = data.get("device", "auto")
    if device not in DEVICES:
        close = difflib.get_close_matches(str(device), DEVICES, n=1)
        raise ConfigError(f"{path}.device: expected one of {', '.join(DEVICES)} (auto: cuda when available), found "
                          f"{_found(device)}{f'; did you mean {close[0]!r}?' if close else ''}")
    offload_state = data.get("offload_state") or ()
    offload_state = (offload_state,) if isinstance(offload_state, str) else offload_state
    if not isinstance(offload_state, (list, tuple)) or any(w not in OFFLOAD_STATE for w in offload_state):
        raise ConfigError(f"{path}.offload_state: expected {' or '.join(OFFLOAD_STATE)} (or a list of them: the state "
                          f"kept in host memory between steps), found {_found(data.get('offload_state'))}")
    timeout_s = _parse_timeout(data.get("timeout_s", DEFAULT_TIMEOUT_S), f"{path}.timeout_s")
    sdc_check = data.get("sdc_check", "off")
    if sdc_check is False:  # YAML reads a bare off as false
        sdc_check = "off"
    if sdc_check not in SDC_CHECKS:
        raise ConfigError(f"{path}.sdc_check: expected one of {', '.join(SDC_CHECKS)} (compare the replicas of "
                          f"every reduced gradient each step; raise or warn on a mismatch), found {_found(sdc_check)}")
    max_restarts = data.get("max_restarts", 0)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"{path}.max_restarts: expected an integer >= 0 (how many times the group of ranks is "
                          f"restarted after a rank fails; 0: never), found {_found(max_restarts)}")
    mesh = _parse_mesh(data.get("mesh"), f"{path}.mesh")
    raw_plan = data.get("plan")
    if raw_plan is None:
        raw_plan = []
    elif isinstance(raw_plan, (str, Mapping)):
        raw_plan = [raw_plan]
    elif not isinstance(raw_plan, (list, tuple)):
        raise ConfigError(f"{path}.plan: expected a list of plan entries (e.g. [fsdp, tp]), found {_found(raw_plan)}")
    parsed = [_parse_plan_entry(e, f"{path}.plan[{i}]") for i, e in enumerate(raw_plan)]
    size = 1
    for s in mesh.values():
        size *= s
    if parsed and not mesh:
        raise ConfigError(f"{path}.mesh: {path}.plan needs a mesh of named axes, e.g. mesh: {{fsdp: 2, tp: 2}}")
    if size > 1 and not parsed:
        example = ", ".join(a if a in PLAN_KINDS else "ddp" for a, s in mesh.items())
        raise ConfigError(f"{path}.plan: missing; the mesh {_flow(mesh)} ({size} processes) needs a plan with one "
                          f"entry per mesh axis, in mesh order, e.g. plan: [{example}]")
    return ParallelConfig(mesh=mesh, plan=_bind_axes(parsed, mesh, path), timeout_s=timeout_s, sdc_check=sdc_check,
                          max_restarts=max_restarts, device=device, offload_state=tuple(offload_state))


def _parse_timeout(value: Any, path: str) -> float:
    """``parallel.timeout_s``: seconds (> 0) a collective may wait for its peers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{path}: expected a number of seconds > 0 that a collective may wait for the other "
                          f"ranks (default {DEFAULT_TIMEOUT_S:g}), found {_found(value)}")
    return float(value)


def _flow(mesh: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{a}: {s}" for a, s in mesh.items()) + "}"


def _parse_mesh(data: Any, path: str) -> dict[str, int]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of axis name to size (e.g. {{fsdp: 2, tp: 2}}), "
                          f"found {_found(data)}")
    mesh = {}
    for axis, size in data.items():
        if not isinstance(axis, str) or not axis:
            raise ConfigError(f"{path}: axis names must be non-empty strings, found {_found(axis)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{path}.{axis}: expected an integer axis size >= 1, found {_found(size)}")
        mesh[axis] = size
    return mesh


def _parse_plan_entry(entry: Any, path: str) -> tuple[str, tuple[str, ...] | None, dict[str, Any], str]:
    """``(kind, explicit axes or None, options with defaults, path of the entry's options)``."""
    if isinstance(entry, str):
        kind, opts = entry, {}
    elif isinstance(entry, Mapping) and len(entry) == 1:
        ((kind, opts),) = entry.items()
        if opts is None:
            opts = {}
        if not isinstance(kind, str):
            raise ConfigError(f"{path}: expected a plan name, found {_found(kind)}")
    else:
        raise ConfigError(f"{path}: expected a plan name (fsdp) or one name with its options "
                          f"({{tp: {{vocab_parallel: true}}}}), found {_found(entry)}")
    if kind not in PLAN_KINDS:
        close = difflib.get_close_matches(kind, list(PLAN_KINDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{path}: unknown plan {kind!r}; {hint}expected one of {', '.join(PLAN_KINDS)}")
    if not isinstance(opts, Mapping):
        raise ConfigError(f"{path}.{kind}: expected a mapping of options (e.g. {{{kind}: {{axis: {kind}}}}}), "
                          f"found {_found(opts)}")
    n_axes, defaults = PLAN_KINDS[kind]
    where = f"{path}.{kind}"
    axis_key = "axes" if n_axes > 1 else "axis"
    allowed = [axis_key, *defaults]
    options = dict(defaults)
    axes = None
    for key, value in opts.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}.{key}: unknown option of {kind}; {hint}expected one of {', '.join(allowed)}")
        if key == "axis":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}.axis: expected a mesh axis name, found {_found(value)}")
            axes = (value,)
        elif key == "axes":
            if (not isinstance(value, (list, tuple)) or len(value) != n_axes
                    or not all(isinstance(a, str) and a for a in value)):
                raise ConfigError(f"{where}.axes: expected {n_axes} mesh axis names (replicate, shard), "
                                  f"found {_found(value)}")
            axes = tuple(value)
        else:
            options[key] = _convert(value, _OPTION_TYPES.get((kind, key), type(defaults[key])), f"{where}.{key}")
    return kind, axes, options, where


def _bind_axes(parsed: list, mesh: Mapping[str, int], path: str) -> tuple[PlanEntry, ...]:
    owner: dict[str, str] = {}
    for i, (kind, axes, options, where) in enumerate(parsed):
        extra = options.get("ulysses_axis") if kind == "cp" else None  # hybrid cp takes a second axis
        if extra is not None:
            if extra not in mesh:
                close = difflib.get_close_matches(extra, list(mesh), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{where}.ulysses_axis: {extra!r} is not an axis of {path}.mesh {_flow(mesh)}{hint}")
            if extra in owner:
                raise ConfigError(f"{where}.ulysses_axis: mesh axis {extra!r} is already used by {owner[extra]}")
            owner[extra] = f"{path}.plan[{i}] ({kind})"
        for a in axes or ():
            key = f"{where}.{'axes' if len(axes) > 1 else 'axis'}"
            if a not in mesh:
                close = difflib.get_close_matches(a, list(mesh), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{key}: {a!r} is not an axis of {path}.mesh {_flow(mesh)}{hint}")
            if a in owner:
                raise ConfigError(f"{key}: mesh axis {a!r} is already used by {owner[a]}")
            owner[a] = f"{path}.plan[{i}] ({kind})"
    free = [a for a in mesh if a not in owner]
    entries = []
    for i, (kind, axes, options, where) in enumerate(parsed):
        if axes is None:
            n = PLAN_KINDS[kind][0]
            if len(free) < n:
                raise ConfigError(
                    f"{path}.plan[{i}]: no mesh axis left for {kind!r} (it takes {n}); entries take the axes of "
                    f"{path}.mesh {_flow(mesh)} in order, one each (hsdp two); add an axis or name one with axis:"
                )
            axes, free = tuple(free[:n]), free[n:]
            for a in axes:
                owner[a] = f"{path}.plan[{i}] ({kind})"
        entries.append(PlanEntry(kind, axes, options))
    for a in free:
        if mesh[a] > 1:
            raise ConfigError(f"{path}.mesh.{a}: the axis has size {mesh[a]} but no entry of {path}.plan runs "
                              f"over it; add one (one entry per mesh axis, in mesh order) or set its size to 1")
    for kind, what in (("tp", "tensor"), ("ep", "expert"), ("cp", "context")):
        found = [i for i, e in enumerate(entries) if e.kind == kind]
        if len(found) > 1:
            raise ConfigError(f"{path}.plan[{found[1]}]: a second {kind} entry; {what} parallelism runs over one "
                              f"mesh axis")
    return tuple(entries)


# ---------------------------------------------------------------------------------------------
# Overrides and loading.


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
                    f"--set {item!r}: {'.'.join(parts[: i + 1])} is {_found(child)}, not a section"
                )
            node = child
        node[parts[-1]] = _parse_override_value(text)
    return out


def load_config_dict(data: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Build a checked :class:`Config` from a plain mapping (as read from YAML) and overrides."""
    data = apply_overrides(data or {}, overrides)
    cfg = _from_mapping(Config, data, "")
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
        raise ConfigError(f"{path}: the top level must be a mapping of sections, found {_found(data)}")
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
    return d
