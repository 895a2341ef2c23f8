"""Training on a mesh: ``parallel:`` -> a :class:`~hpfunc.transforms.plans.Plan`, checked before launch.

Inside the ranks (:func:`hpfunc.train.run` with such a config): :func:`start_mesh` joins the gloo (or NCCL)
process group and builds the :class:`hpfunc.Mesh`; :func:`build_parallel_step` creates the parameters
directly sharded (``init_sharded``, the same values as the model's ``init``) and wraps the single-device
``make_train_step`` with ``hpfunc.parallelize``; the step's ``full_params`` makes full tensors again
for evaluation and sampling (under ``pp`` each stage's from its rank).

The config's ``parallel.plan`` entries map one to one onto the factories of
:mod:`hpfunc.transforms.plans`, composed in mesh-axis order; a ``tp`` entry takes the model's own
tensor-parallel table (its :class:`~hpfunc.models.spec.ModelSpec`'s ``tp_styles``)::

    parallel:
      mesh: {fsdp: 2, tp: 2}
      plan: [fsdp, {tp: {vocab_parallel: true}}]
      # plans.fsdp("fsdp") + plans.tp("tp", spec.tp_styles(model_cfg, vocab_parallel=True))

Everything that can be checked without processes is checked here, in the launching process, so a
mistake costs no rank start-up: the plan against the model's parameter shapes (tensor parallelism
must divide the heads and the hidden features), the global batch against the data-parallel ranks.
An :class:`AbstractMesh` (axis names and sizes, no process group) stands in for the mesh.

Example:
    >>> from hpfunc.train.config import load_config_dict
    >>> from hpfunc.train.build import build_model_config, model_spec
    >>> cfg = load_config_dict({"parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}})
    >>> plan = build_plan(cfg.parallel, build_model_config(cfg.model), model_spec(cfg.model))
    >>> plan.data_axes, plan.tp_axis
    (('fsdp',), 'tp')
    >>> check_parallel(cfg, build_model_config(cfg.model))  # fits: no error
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, Iterator, Mapping

from hpfunc.models.registry import DEFAULT_PRESET
from hpfunc.train.config import Config, ConfigError, ParallelConfig, PlanEntry

__all__ = [
    "AbstractMesh",
    "build_plan",
    "run_plan",
    "check_parallel",
    "describe_plan",
    "is_distributed",
    "start_mesh",
    "build_parallel_step",
    "parallel_train_step",
    "parallel_summary",
]


class AbstractMesh:
    """The shape of a mesh (ordered axis names and sizes) without processes.

    It answers what a plan asks a mesh while resolving specs (``axis_names``, ``axis_size``), so a plan
    can be checked and described before any rank exists.

    >>> m = AbstractMesh({"fsdp": 2, "tp": 2})
    >>> m.axis_size("tp"), m.axis_size(("fsdp", "tp")), m.size
    (2, 4, 4)
    """

    def __init__(self, axes: Mapping[str, int]):
        self.shape = dict(axes)
        self.axis_names = tuple(self.shape)

    @property
    def size(self) -> int:
        return functools.reduce(operator.mul, self.shape.values(), 1)

    def axis_size(self, axes: Any) -> int:
        if axes is None:
            return 1
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        return functools.reduce(operator.mul, (self.shape[a] for a in names), 1)

    def __repr__(self) -> str:
        return f"AbstractMesh({self.shape})"


def is_distributed(pc: ParallelConfig) -> bool:
    """Whether the config asks for more than one process (a mesh of size > 1)."""
    return pc.size > 1


def _model_piece(spec: Any, piece: str, e: PlanEntry) -> Callable:
    """The spec's ``piece`` (``tp_styles``, ``ep_experts``, ``pipeline_stages``) a plan entry needs; a model
    without it is a config error naming the entry."""
    fn = getattr(spec, piece)
    if fn is None:
        raise ConfigError(f"parallel.plan: {e.kind} over {e.axes[0]!r} needs the model's {piece}, and the model "
                          f"{spec.name!r} has none (its ModelSpec.{piece} is None); use fsdp or ddp for this axis")
    return fn


def _entry_plan(e: PlanEntry, model_cfg: Any, mesh: Mapping[str, int], spec: Any) -> Any:
    from hpfunc.transforms import plans

    o = e.options
    if e.kind == "pp":
        from hpfunc.transforms.pipeline_plan import stages_per_rank

        n = mesh[e.axes[0]] * stages_per_rank(o["schedule"], o["virtual_stages"])
        stages = _model_piece(spec, "pipeline_stages", e)(model_cfg, n, layers=o["layers_per_stage"])
        return plans.pp(e.axes[0], stages, schedule=o["schedule"], microbatches=o["microbatches"],
                        virtual_stages=o["virtual_stages"], remat=o["remat"], max_resident=o["max_resident"])
    if e.kind in ("fsdp", "zero3"):
        return plans.fsdp(e.axes[0], reshard_after_forward=o["reshard_after_forward"])
    if e.kind == "hsdp":
        return plans.hsdp(e.axes[0], e.axes[1], reshard_after_forward=o["reshard_after_forward"])
    if e.kind == "tp":
        return plans.tp(e.axes[0], _model_piece(spec, "tp_styles", e)(
            model_cfg, vocab_parallel=o["vocab_parallel"], sequence_parallel=o["sequence_parallel"]))
    if e.kind == "cp":
        return plans.cp(e.axes[0], **o)
    if e.kind == "ep":
        return plans.ep(e.axes[0], _model_piece(spec, "ep_experts", e)(model_cfg),
                        reshard_after_forward=o["reshard_after_forward"])
    return getattr(plans, e.kind)(e.axes[0])  # ddp, zero1, zero2


def build_plan(pc: ParallelConfig, model_cfg: Any, spec: Any = None) -> Any:
    """The :class:`~hpfunc.transforms.plans.Plan` of ``parallel.plan`` for the model of ``model_cfg`` (whose
    :class:`~hpfunc.models.spec.ModelSpec` is ``spec``; by default the registered model of the default
    preset): its entries in mesh-axis order, composed with ``+``."""
    if spec is None:
        from hpfunc.models import registry

        spec = registry.resolve(None, preset=DEFAULT_PRESET)
    if not pc.plan:
        from hpfunc.transforms import plans

        return plans.Plan()
    order = {a: i for i, a in enumerate(pc.mesh)}
    entries = sorted(pc.plan, key=lambda e: order[e.axes[0]])
    plan = functools.reduce(operator.add, (_entry_plan(e, model_cfg, pc.mesh, spec) for e in entries))
    return (plan.with_state_offload(*pc.offload_state, layers=pc.offload_layers) if pc.offload_state else plan)


def run_plan(cfg: Config, model_cfg: Any, spec: Any) -> Any:
    """The plan the run's steps use: :func:`build_plan` of ``parallel:`` with ``precision:`` applied
    (:func:`hpfunc.train.step_transforms.with_precision`)."""
    from hpfunc.train.step_transforms import with_precision

    return with_precision(build_plan(cfg.parallel, model_cfg, spec), cfg.precision)


def pipeline_splits_backward(cfg: Config, model_cfg: Any, spec: Any, e: PlanEntry) -> bool:
    """Whether the schedule of the ``pp`` entry ``e`` splits the backward into B and W passes (a
    selectively recomputed region allows one backward)."""
    from hpfunc.schedules import ActionKind

    schedule = _entry_plan(e, model_cfg, cfg.parallel.mesh, spec).pipeline.schedule(cfg.parallel.mesh[e.axes[0]])
    return any(a.kind is ActionKind.W for row in schedule.actions.values() for a in row)


def _tp_entry(pc: ParallelConfig) -> tuple[int, PlanEntry] | None:
    for i, e in enumerate(pc.plan):
        if e.kind == "tp":
            return i, e
    return None


def check_parallel(cfg: Config, model_cfg: Any) -> None:
    """Raise :class:`ConfigError` naming the key when the plan does not fit the model or the batch.

    Checked: the global batch (``train.batch_size``) splits evenly over the data-parallel ranks; the
    tensor-parallel degree divides the attention heads, the key/value heads, the MLP / expert hidden
    features (and the vocabulary with ``vocab_parallel``, the sequence with ``sequence_parallel``); an
    expert-parallel entry has an MoE model whose ``num_experts`` its degree divides;
    then the whole plan resolves on every parameter of the model (:meth:`Plan.resolve`), and every
    axis of a sharding entry (fsdp, zero*, the shard axis of hsdp, tp) shards at least one of them.
    """
    pc = cfg.parallel
    if not pc.plan:
        return
    from hpfunc.train.model_spec import model_spec
    from hpfunc.transforms.plans import PlanError

    spec = model_spec(cfg.model)
    dp = pc.data_size
    if dp > 1 and cfg.train.batch_size % dp:
        axes = " x ".join(f"{a}: {pc.mesh[a]}" for a in pc.data_axes)
        raise ConfigError(
            f"train.batch_size: the global batch of {cfg.train.batch_size} does not split evenly over the {dp} "
            f"data-parallel ranks (parallel.mesh {axes}); use a multiple of {dp}"
        )
    found = _tp_entry(pc)
    if found is not None:
        i, e = found
        axis = e.axes[0]
        n = pc.mesh[axis]
        key = f"parallel.mesh.{axis}"
        _model_piece(spec, "tp_styles", e)
        needs = ([] if spec.tp_divides is None else
                 spec.tp_divides(model_cfg, vocab_parallel=bool(e.options.get("vocab_parallel"))))
        for field, what in needs:
            v = getattr(model_cfg, field)
            if v % n:
                raise ConfigError(f"{key}: tensor parallelism over {n} ranks must divide the {v} {what} of the "
                                  f"model (model.{field}); choose a tp size that divides {v}")
        if e.options.get("sequence_parallel") and cfg.train.seq_len % n:
            raise ConfigError(f"train.seq_len: sequence parallelism (parallel.plan[{i}]) splits the sequence of "
                              f"{cfg.train.seq_len} over {n} ranks; use a multiple of {n}")
    for i, e in enumerate(pc.plan):
        if e.kind != "ep":
            continue
        axis = e.axes[0]
        n, E = pc.mesh[axis], spec.num_experts(model_cfg)
        experts = None
        if spec.ep_experts is not None and E:
            try:
                experts = spec.ep_experts(model_cfg)
            except PlanError:
                experts = None
        if not experts:
            field = f"model.{spec.experts_field}: {E}" if spec.experts_field else f"model {spec.name!r}"
            raise ConfigError(f"parallel.plan[{i}]: ep (expert parallelism over {axis!r}) needs a mixture-of-experts "
                              f"model, but the model has no MoE layer ({field}); use fsdp or ddp for "
                              f"this axis, or an MoE model (e.g. model.preset: {DEFAULT_PRESET})")
        if E % n:
            raise ConfigError(f"parallel.mesh.{axis}: expert parallelism over {n} ranks must divide the {E} experts of "
                              f"the model (model.num_experts); choose an ep size that divides {E}")
    _check_pipeline(cfg, model_cfg, spec)
    _check_context(cfg, model_cfg, spec)
    plan = build_plan(pc, model_cfg, spec)
    shapes = spec.param_shapes(model_cfg)
    try:
        layouts = plan.resolve(shapes, AbstractMesh(pc.mesh))
    except PlanError as err:
        msg = str(err)
        where = f"parallel.mesh.{found[1].axes[0]}" if found is not None and msg.startswith("tp") else "parallel.plan"
        raise ConfigError(f"{where}: {msg}") from None
    _check_axes_shard(pc, layouts)


def _check_pipeline(cfg: Config, model_cfg: Any, spec: Any) -> None:
    """A ``pp`` entry: microbatches that split each data shard's batch, stages that fit the layers, a
    schedule that exists for the axis; errors name the config key."""
    from hpfunc.transforms.pipeline_plan import stages_per_rank
    from hpfunc.transforms.plans import PlanError

    pc = cfg.parallel
    for i, e in enumerate(pc.plan):
        if e.kind != "pp":
            continue
        o, key, axis = e.options, f"parallel.plan[{i}].pp", e.axes[0]
        m = o["microbatches"]
        if m < 1:
            raise ConfigError(f"{key}.microbatches: expected an integer >= 1, found {m}")
        per = cfg.train.batch_size // max(pc.data_size, 1)
        if per % m:
            raise ConfigError(f"{key}.microbatches: each data shard's batch of {per} (train.batch_size "
                              f"{cfg.train.batch_size} over {pc.data_size} data ranks) does not split into {m} "
                              f"microbatches; use a train.batch_size that is a multiple of {pc.data_size * m}")
        if cfg.train.microbatches != 1:
            raise ConfigError(f"train.microbatches: {cfg.train.microbatches} with a pipeline ({key}); the pipeline "
                              f"cuts the batch into {key}.microbatches itself: set train.microbatches to 1")
        try:
            n = pc.mesh[axis] * stages_per_rank(o["schedule"], o["virtual_stages"])
        except PlanError as err:  # a schedule file that cannot be read
            raise ConfigError(f"{key}.schedule: {err}") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{key}.virtual_stages: {err}") from None
        _model_piece(spec, "pipeline_stages", e)
        L = spec.num_layers(model_cfg)
        if L is not None and n > L:
            raise ConfigError(f"parallel.mesh.{axis}: {pc.mesh[axis]} pipeline ranks x {n // pc.mesh[axis]} stage(s) "
                              f"per rank ({o['schedule']}) = {n} stages, but the model has {L} layers "
                              f"(model.{spec.layers_field}); every stage needs a layer")
        try:
            _entry_plan(e, model_cfg, pc.mesh, spec).check_mesh(AbstractMesh(pc.mesh))
        except PlanError as err:
            what = ("layers_per_stage" if "layers_per_stage" in str(err) else
                    "remat" if "remat" in str(err) else "schedule")
            raise ConfigError(f"{key}.{what}: {err}") from None
        _check_layer_remat(cfg, model_cfg, spec, e, key)


def _check_layer_remat(cfg: Config, model_cfg: Any, spec: Any, e: PlanEntry, key: str) -> None:
    """``activations.remat`` (per layer) with a ``pp`` entry: not beside the entry's own ``remat`` (per
    stage), and no selective policy when the schedule splits the backward into B and W (a selectively
    recomputed region allows one backward)."""
    from hpfunc.train.step_transforms import policy_names

    remat = cfg.activations.remat
    if remat is None:
        return
    if e.options.get("remat") is not None:
        raise ConfigError(f"activations.remat: {key}.remat recomputes whole stages already; set one of the two "
                          f"(activations.remat per layer, or {key}.remat per stage)")
    selective = sorted(p for p in policy_names(remat) if p not in ("nothing_saveable", "everything_saveable"))
    if selective and pipeline_splits_backward(cfg, model_cfg, spec, e):
        raise ConfigError(f"activations.remat: the selective policy {selective[0]!r} recomputes a layer once, but "
                          f"the schedule {e.options['schedule']!r} ({key}.schedule) splits each backward into B "
                          f"and W; use nothing_saveable, or a schedule without the split (gpipe, 1f1b, "
                          f"interleaved)")


def _check_context(cfg: Config, model_cfg: Any, spec: Any) -> None:
    """A ``cp`` entry: a strategy that fits the heads (Ulysses over no more ranks than the key/value heads
    left after tensor parallelism, unless replicate_kv), a sequence that splits into ``2 P`` chunks when
    padding is off; errors name the config key."""
    from hpfunc.transforms.plans import PlanError

    pc = cfg.parallel
    tp = _tp_entry(pc)
    n_tp = 1 if tp is None else pc.mesh[tp[1].axes[0]]
    for i, e in enumerate(pc.plan):
        if e.kind != "cp":
            continue
        o, key = e.options, f"parallel.plan[{i}].cp"
        try:
            _entry_plan(e, model_cfg, pc.mesh, spec)
        except PlanError as err:
            raise ConfigError(f"{key}.{'ulysses_axis' if 'ulysses_axis' in str(err) else 'impl'}: {err}") from None
        axes = (e.axes[0],) + ((o["ulysses_axis"],) if o["ulysses_axis"] else ())
        n = 1
        for a in axes:
            n *= pc.mesh[a]
        if not o["pad"] and cfg.train.seq_len % (2 * n):
            raise ConfigError(f"train.seq_len: context parallelism ({key}, pad: false) splits the sequence of "
                              f"{cfg.train.seq_len} into 2 x {n} chunks over {n} ranks; use a multiple of {2 * n} "
                              f"or {key}.pad: true")
        heads_axis = {"ulysses": e.axes[0], "hybrid": o["ulysses_axis"]}.get(o["impl"])
        if heads_axis is None:
            continue
        deg = pc.mesh[heads_axis]
        hq, hkv = model_cfg.num_attention_heads // n_tp, model_cfg.num_key_value_heads // n_tp
        after = f" per tensor-parallel rank ({n_tp} ranks)" if n_tp > 1 else ""
        if hq % deg:
            raise ConfigError(f"parallel.mesh.{heads_axis}: Ulysses ({key}.impl: {o['impl']}) over {deg} ranks must "
                              f"divide the {hq} attention heads{after}; choose a size that divides {hq}")
        if hkv % deg and not o["replicate_kv"]:
            raise ConfigError(f"parallel.mesh.{heads_axis}: Ulysses ({key}.impl: {o['impl']}) over {deg} ranks is above "
                              f"(or does not divide) the {hkv} key/value heads{after} (model.num_key_value_heads); "
                              f"set {key}.replicate_kv: true, or impl: hybrid with a Ulysses axis that divides {hkv}")


# What the entries that shard promise to shard over their axis (hsdp: over its second axis only).
_SHARDS = {"fsdp": "parameters", "zero3": "parameters", "hsdp": "parameters", "zero1": "optimizer state",
           "zero2": "optimizer state and gradients", "tp": "parameters", "ep": "experts"}


def _check_axes_shard(pc: ParallelConfig, layouts: Mapping[str, Any]) -> None:
    """A sharding entry whose axis splits no parameter is an error: FSDP over 3 ranks of a model whose
    dimensions are all even would silently be DDP (every rank holding everything), the opposite of
    what the config asks for; nothing is lost by refusing before launch."""
    used: set[str] = set()
    for lay in layouts.values():
        for sp in (lay.spec.storage, lay.spec.compute, lay.spec.opt):
            used.update(sp.axes)
    for i, e in enumerate(pc.plan):
        if e.kind not in _SHARDS:
            continue
        axis = e.axes[-1]  # hsdp: (replicate, shard)
        n = pc.mesh[axis]
        if n == 1 or axis in used:
            continue
        dims = sorted({d for lay in layouts.values() for d in lay.shape})
        sizes = [k for k in range(2, 17) if any(d % k == 0 and d >= k for d in dims)][:4]
        hint = f"a size that divides some of them ({', '.join(map(str, sizes))}, ...)" if sizes else "size 1"
        acts = ("every rank of the axis would compute the whole model (no tensor parallelism)" if e.kind == "tp"
                else f"the {_SHARDS[e.kind]} would stay whole on every rank: the axis would act as ddp")
        raise ConfigError(
            f"parallel.mesh.{axis}: {e.kind} (parallel.plan[{i}]) over {n} ranks would shard nothing: no dimension "
            f"of any parameter of the model divides by {n} (the dimensions are {', '.join(map(str, dims[:8]))}"
            f"{', ...' if len(dims) > 8 else ''}), so {acts}; choose {hint}"
            f"{'' if e.kind == 'tp' else ', or use ddp for this axis'}")


def describe_plan(cfg: Config, model_cfg: Any) -> str:
    """The resolved plan, one line per parameter (``path shape storage -> compute | opt``), after a
    header naming the mesh, the plan and the batch split."""
    from hpfunc.train.model_spec import model_spec

    pc = cfg.parallel
    spec = model_spec(cfg.model)
    plan = build_plan(pc, model_cfg, spec)
    mesh = AbstractMesh(pc.mesh)
    per = cfg.train.batch_size // max(pc.data_size, 1)
    head = [
        f"mesh {pc.mesh_text} ({pc.size} processes), plan {_plan_text(pc)}",
        f"batch {cfg.train.batch_size} x {cfg.train.seq_len} split over {pc.data_axes or 'no axis'}: "
        f"{per} x {cfg.train.seq_len} per data shard{_sequence_split_text(cfg)}",
        f"{'parameter':40s} {'shape':16s} storage -> compute | opt (optimizer state)",
    ]
    return "\n".join(head) + "\n" + plan.describe(spec.param_shapes(model_cfg), mesh)


def _sequence_split_text(cfg: Config) -> str:
    """``; each sequence over ('cp',): padded to 32, 16 tokens per cp rank`` under a ``cp`` entry, else ``""``."""
    for e in cfg.parallel.plan:
        if e.kind == "cp":
            axes = (e.axes[0],) + ((e.options["ulysses_axis"],) if e.options["ulysses_axis"] else ())
            n = functools.reduce(operator.mul, (cfg.parallel.mesh[a] for a in axes), 1)
            padded = -(-cfg.train.seq_len // (2 * n)) * 2 * n
            return f"; each sequence over {axes}: padded to {padded}, {padded // n} tokens per cp rank"
    return ""


def _plan_text(pc: ParallelConfig) -> str:
    """``fsdp('fsdp') + tp('tp', vocab_parallel=True)``: the plan as the factories it is built from."""
    order = list(pc.mesh)
    return " + ".join(_entry_text(e) for e in sorted(pc.plan, key=lambda e: order.index(e.axes[0])))


def _entry_text(e: PlanEntry) -> str:
    args = [repr(a) for a in e.axes]
    defaults = dict(_defaults(e.kind))
    args += [f"{k}={v}" for k, v in e.options.items() if defaults.get(k) != v]
    name = "fsdp" if e.kind == "zero3" else e.kind
    return f"{name}({', '.join(args)})"


def _defaults(kind: str) -> dict:
    from hpfunc.train.config import PLAN_KINDS

    return PLAN_KINDS[kind][1]


# ---------------------------------------------------------------------------------------------
# Inside the ranks


@contextlib.contextmanager
def start_mesh(pc: ParallelConfig) -> Iterator[Any]:
    """Join the launch's process group (NCCL with each rank on ``cuda:LOCAL_RANK`` when ``parallel.device``
    resolves to cuda, gloo on cpu: :mod:`hpfunc.train.device`) with the collective timeout
    ``parallel.timeout_s`` and yield ``hpfunc.Mesh(pc.mesh)`` of that device type; the process group is destroyed on exit
    if this call created it. A collective issued outside hpfunc.lax (a DTensor's ``full_tensor()``)
    that times out or loses a peer is re-raised as :class:`hpfunc.faults.CollectiveError`, naming
    the rank and the source line, like those of hpfunc.lax."""
    import torch.distributed as dist

    from hpfunc.faults import translate
    from hpfunc.mesh import Mesh, init_distributed
    from hpfunc.train.device import backend_for, local_device, resolve_device
    from hpfunc.train.launch import in_launched_rank

    if not dist.is_initialized() and not in_launched_rank():
        raise ConfigError(
            f"parallel.mesh: {pc.mesh_text} needs {pc.size} processes; run it with `hpfunc train CONFIG.yaml`, which "
            f"starts them, or call hpfunc.train.run in every rank of a torchrun launch"
        )
    created = not dist.is_initialized()
    device = resolve_device(pc)
    local_device(device)
    init_distributed(backend_for(device), timeout_s=pc.timeout_s)
    try:
        world = dist.get_world_size()
        if world != pc.size:
            raise ConfigError(f"parallel.mesh: {pc.mesh_text} needs {pc.size} processes but this launch has {world} "
                              f"(WORLD_SIZE); launch {pc.size} or change the mesh")
        try:
            yield Mesh(pc.mesh, device_type=device)
        except RuntimeError as e:
            err = translate(e)
            if err is None or err is e:
                raise
            raise err from e
        # a finished run: the ranks leave together (rank 0 still writes its outputs), so that no rank
        # tears its process group down while a peer's gloo connection to it is still in use (seen once
        # under load: a rank aborting in teardown with "terminate called without an active exception")
        dist.barrier()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def parallel_train_step(cfg: Config, model_cfg: Any, optimizer: Any, lr: Callable[[int], float], mesh: Any, *,
                        monitor: Any = None, compiled: bool = True) -> tuple[Callable, Any]:
    """``(train_step, plan)``: the trainer's single-device step (``make_train_step`` with the model's
    parallel-aware loss, the ``activations:`` policies bound for its layers) under ``hpfunc.parallelize``
    with the run's plan (``parallel:`` with ``precision:`` applied, and the SDC check when asked). What
    :func:`build_parallel_step` runs, and what ``hpfunc dryrun`` measures."""
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import make_train_step
    from hpfunc.train.step_transforms import train_loss
    from hpfunc.transforms.parallelize import parallelize

    spec = model_spec(cfg.model)
    plan = run_plan(cfg, model_cfg, spec)
    if cfg.parallel.sdc_check != "off":
        plan = plan.with_sdc_check(cfg.parallel.sdc_check)
    step = make_train_step(model_cfg, optimizer, expert_bias_rate=cfg.train.expert_bias_rate, lr_schedule=lr,
                           loss_fn=train_loss(cfg, spec, on_mesh=True), num_microbatches=cfg.train.microbatches,
                           monitor=monitor)
    # train.compile: the step's lowered programs compiled (the model's regions, bound through hpfunc.layout);
    # ``compiled=False`` (the dry run): eager whatever the config says (fake tensors measure the eager step)
    mode = cfg.train.compile if compiled and spec.check_compile(cfg.train.compile) else False
    return parallelize(step, mesh, plan, params="params", compile=mode), plan


def build_parallel_step(cfg: Config, model_cfg: Any, optimizer: Any, lr: Callable[[int], float],
                        init_key: Any, mesh: Any, dtype: Any, *, monitor: Any = None) -> tuple[Any, Callable]:
    """``(state, train_step)`` on ``mesh``: the trainer's single-device step (``make_train_step`` with
    the model's parallel-aware loss, :meth:`ModelSpec.step_loss <hpfunc.models.spec.ModelSpec.step_loss>`)
    under ``hpfunc.parallelize``, and its first state, the parameters (of ``dtype``) created sharded
    with the plan's storage specs. ``monitor``: the precision monitor's probe (``make_train_step``'s)."""
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import init_train_state
    from hpfunc.transforms.parallelize import init_sharded

    spec = model_spec(cfg.model)
    train_step, plan = parallel_train_step(cfg, model_cfg, optimizer, lr, mesh, monitor=monitor)
    if cfg.model.pretrained is not None:
        params = _pretrained_params(cfg.model.pretrained, model_cfg, mesh, train_step, dtype, spec)
    else:
        init = functools.partial(spec.init, cfg=model_cfg, dtype=dtype)
        params = init_sharded(init, mesh, plan, init_key, shapes=spec.param_shapes(model_cfg))
    state = train_step.init_state(lambda p: init_train_state(p, optimizer), params)
    return state, train_step


def build_grad_check_step(cfg: Config, model_cfg: Any, mesh: Any) -> Callable:
    """The train step's gradient under the same plan, not applied, as per-parameter counts of
    non-finite values (:func:`hpfunc.train.step.make_grad_check_step`): run after a non-finite step to
    name the parameter. Built on demand, so a run that stays finite never pays for it."""
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import make_grad_check_step
    from hpfunc.train.step_transforms import train_loss
    from hpfunc.transforms.parallelize import parallelize

    spec = model_spec(cfg.model)
    check = make_grad_check_step(model_cfg, loss_fn=train_loss(cfg, spec, on_mesh=True),
                                 num_microbatches=cfg.train.microbatches)
    return parallelize(check, mesh, run_plan(cfg, model_cfg, spec), params="params")


def build_eval_step(cfg: Config, model_cfg: Any, mesh: Any) -> Callable | None:
    """The validation loss on the sharded state (:func:`hpfunc.train.step.make_state_eval_step` under the
    run's plan): every rank evaluates its data shard with the parameters gathered on use, so no rank
    gathers the whole model. ``None`` under a ``pp`` plan (its executor runs forward and backward
    together): the loop then evaluates a gathered copy."""
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import make_state_eval_step
    from hpfunc.transforms.parallelize import parallelize

    if any(e.kind == "pp" for e in cfg.parallel.plan):
        return None
    spec = model_spec(cfg.model)
    return parallelize(make_state_eval_step(model_cfg, loss_fn=spec.step_loss()), mesh,
                       run_plan(cfg, model_cfg, spec), params="params")


def _pretrained_params(folder: str, model_cfg: Any, mesh: Any, train_step: Any, dtype: Any, spec: Any) -> Any:
    """``model.pretrained``: the Hugging Face weights, each rank reading its blocks in the plan's storage
    layout (cast to the run's dtype; the expert bias stays float32)."""
    import torch

    from hpfunc import checkpoint
    from hpfunc import tree as _tree
    meta = _tree.map_with_path(lambda path, s: torch.empty(s, device="meta", dtype=torch.float32 if
                                                           path.endswith("moe.expert_bias") else dtype),
                               spec.param_shapes(model_cfg), is_leaf=lambda x: isinstance(x, torch.Size))
    specs = train_step.state_specs({"params": meta})["params"]
    return spec.hf.import_sharded(folder, checkpoint.abstract_like(specs, mesh, meta), model_cfg)


def parallel_summary(cfg: Config) -> str:
    """The start line of a parallel run: processes, mesh, plan and the batch split."""
    pc = cfg.parallel
    per = cfg.train.batch_size // max(pc.data_size, 1)
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return (f"parallel: {pc.size} processes ({backend}), mesh {pc.mesh_text}, plan {_plan_text(pc)}; "
            f"batch {cfg.train.batch_size} split {per} per data shard")
