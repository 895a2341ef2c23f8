"""The training config's schema: one attrs class per YAML section, with the defaults and the checks on values.

Field comments are what users read in docs/train.md. The ``parallel:`` and ``callbacks:`` sections and the
per-layer ``activations:`` policies have grammars of their own (:mod:`.parallel_grammar`, :mod:`.grammars`);
:mod:`.structure` turns plain data into these classes.

    >>> Config().train.steps, PLAN_KINDS["hsdp"][0]
    (100, 2)
"""

from __future__ import annotations

from typing import Any, Literal, Union

import attrs

from hpfunc.faults import DEFAULT_TIMEOUT_S
from hpfunc.models.registry import DEFAULT_PRESET
from hpfunc.train.config.errors import flow

__all__ = ["ModelConfig", "OptimizerConfig", "ScheduleConfig", "DataConfig", "TrainConfig", "OutputConfig",
           "CheckpointConfig", "PlanEntry", "ParallelConfig", "PLAN_KINDS", "OPTION_TYPES", "DATA_KINDS",
           "CallbackEntry", "PrecisionConfig", "ActivationsConfig", "DTYPES", "REMAT_POLICIES", "OFFLOAD_POLICIES",
           "Config", "OPEN_SECTIONS", "RANGES"]


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
    compile: Union[bool, Literal["inductor", "aot_eager", "eager"]] = False  # true: inductor; see docs/parallel.md


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
OPTION_TYPES: dict[tuple[str, str], Any] = {("pp", "virtual_stages"): Union[int, None],
                                             ("pp", "layers_per_stage"): Union[tuple[int, ...], None],
                                             # a policy name for every stage, or one per stage (null: none)
                                             ("pp", "remat"): Union[str, tuple[Union[str, None], ...], None],
                                             ("pp", "max_resident"): Union[int, None],
                                             ("cp", "impl"): Literal["allgather", "ring", "ulysses", "hybrid"],
                                             ("cp", "ulysses_axis"): Union[str, None]}
DATA_KINDS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp", "ep")


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
    offload_state: tuple = ()  # state kept in host memory between steps: (optimizer, params) (Plan.with_state_offload)
    offload_layers: str | None = None  # with params: the regex of the parameter paths kept there (None: all)

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
        axes = {a for e in self.plan if e.kind in DATA_KINDS for a in e.axes}
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
        return flow(self.mesh)

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
            timeout["offload_state"] = [{"params": self.offload_layers} if k == "params" and self.offload_layers
                                        is not None else k for k in self.offload_state]
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


# The dtypes ``precision:`` names (model.dtype, the parameters' own, is one of float32, bfloat16, float64).
DTYPES = ("float32", "bfloat16", "float16", "float64")
Dtype = Literal["float32", "bfloat16", "float16", "float64"]


@attrs.frozen
class DryrunConfig:
    """``dryrun:``: read by ``hpfunc dryrun`` alone (``hpfunc train`` accepts and ignores it).

    ``reserve``: bytes added to the measured peak for what a dry run never models (allocator reserve
    and fragmentation, NCCL buffers, the CUDA context), e.g. ``4GiB`` or a number of bytes. ``moe``: the
    routing assumptions an MoE model's dry run steps under (``worst``, ``balanced`` or ``both``; checked by
    ``hpfunc dryrun``).
    """

    reserve: Union[str, int, None] = None
    moe: Union[str, None] = None


@attrs.frozen
class PrecisionConfig:
    """``precision:``: mixed precision, the plan's :meth:`~hpfunc.transforms.plans.Plan.with_mixed_precision`.

    The parameters' own dtype (storage, gradients, optimizer state: the master weights) is
    ``model.dtype``; ``compute_dtype`` is the dtype they are cast to for use (before the FSDP all-gather,
    which then moves it); ``reduce_dtype`` the dtype gradient reductions run in (null: the compute dtype
    for the FSDP reduce-scatter, the gradient's own for the rest). Null: as stored.
    """

    compute_dtype: Union[Dtype, None] = None
    reduce_dtype: Union[Dtype, None] = None


# Per-layer policies of ``activations:`` (hpfunc.transforms.remat / offload), by name.
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
                  "none")
OFFLOAD_POLICIES = ("everything", "dots", "none")


@attrs.frozen
class ActivationsConfig:
    """``activations:``: what each layer of the model keeps for its backward, for every plan.

    ``remat``: recompute (:func:`hpfunc.transforms.remat.remat`) by a policy of
    :data:`REMAT_POLICIES`; ``offload``: saved activations kept in host memory
    (:func:`hpfunc.transforms.offload.offload`) by a policy of :data:`OFFLOAD_POLICIES` (``everything``
    is the whole-layer swap, ``dots`` the outputs of matrix products). Each is a policy name for every
    layer, a list with one per layer (null or ``none``: that layer as is), or a mapping
    ``{layer index: policy}`` (the layers not named as is). Null: no layer is changed.
    """

    remat: Any = None  # str | tuple of (str | None) | dict[int, str | None] | None (parsed by the grammar)
    offload: Any = None


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
    precision: PrecisionConfig = attrs.field(factory=PrecisionConfig)
    activations: ActivationsConfig = attrs.field(factory=ActivationsConfig)
    dryrun: DryrunConfig = attrs.field(factory=DryrunConfig)


# Sections whose unknown keys are collected rather than rejected (checked later against the model).
OPEN_SECTIONS = {ModelConfig: "overrides"}

# Positive-integer and range checks: (path, predicate, what was expected).
RANGES: list[tuple[str, Any, str]] = [
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
