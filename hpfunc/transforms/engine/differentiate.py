"""One differentiation under a plan: gather the parameters on use, run the backward, reduce the gradients.

:class:`EngineConfig` is what a step's plan decides for its parameters (which are gathered together,
which gradients take a collective, mixed precision, reshard after forward, the gradient seed): facts,
decided once when the step is lowered (:class:`hpfunc.transforms.lowered.Lowered` holds it) and never
changed. :func:`value_and_grad` runs
``call(ws, read)`` -- ``ws`` are fresh parameter leaves (this rank's storage blocks, requiring grad,
known by identity, :class:`~hpfunc.transforms.engine.view.Blocks`) and ``read(w)`` is the leaf
*as used* -- with the tensor-parallel binding of the plan and the step's saved-tensor layer on the
stack, then differentiates the loss with respect to the wanted leaves.

The gradient seed is ``factor * (data ranks) / (all ranks)``: with the default factor ``1 / data
ranks`` that is ``1 / mesh.size``, the mean over data shards, and on replicated (TP) axes the per-rank
split of :mod:`hpfunc.lax`'s semantics. The loss must be a mean over the batch with the same number of
counted targets on each data shard, so that the mean of shard means is the global mean.

    >>> EngineConfig.seed(mesh_size=4, data_ranks=2, factor=None), EngineConfig.seed(4, 2, 1.0)
    (0.25, 0.5)
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import attrs
import torch

from hpfunc import layout, saved_tensors
from hpfunc.layout import LeafLayout, PlanError
from hpfunc.transforms.engine import sdc
from hpfunc.transforms.engine.gather import ParamLayer, gather_group, group_key, layer_of
from hpfunc.transforms.engine.mixed import cast_for_use
from hpfunc.transforms.engine.overlap import BUCKET_CAP_BYTES, Overlap, buckets_of
from hpfunc.transforms.engine import prefetch
from hpfunc.transforms.engine.backward_prefetch import Regathers
from hpfunc.transforms.engine.outside_checkpoint import outside
from hpfunc.transforms.engine.param_offload import HostParams
from hpfunc.transforms.engine.packing import _unpack_gathered
from hpfunc.transforms.engine.scatter_async import Scatters
from hpfunc.transforms.engine.step_scalars import StepScalars
from hpfunc.transforms.engine.pipelined import StagePipeline, known_gradients
from hpfunc.transforms.engine.reduce import needs_reduction, reduce_gradients
from hpfunc.transforms.engine.view import Blocks

__all__ = ["EngineConfig", "value_and_grad", "reduce_wanted"]


class EngineConfig:
    """What the plan decides for one step's parameters (no communication; read-only after construction)."""

    def __init__(self, mesh: Any, plan: Any, leaves: list[LeafLayout], dtypes: list[torch.dtype],
                 offloaded: frozenset[int] = frozenset()):
        self.mesh, self.plan, self.leaves = mesh, plan, leaves
        # the parameters at rest in host memory (plan.with_state_offload("params")): brought in per group
        self.offloaded = frozenset(offloaded)
        self.by_path = {lay.path: lay for lay in leaves}
        self.block_shapes = {lay.path: lay.block_shape(mesh) for lay in leaves}
        groups: dict[tuple, list[int]] = {}
        for i, (lay, dt) in enumerate(zip(leaves, dtypes)):
            if lay.gather:
                groups.setdefault(group_key(lay.path, lay.gather, dt), []).append(i)
        self.group_of = {i: members for members in groups.values() for i in members}
        self.reduced = [needs_reduction(lay) for lay in leaves]  # which leaves' gradients take a collective
        self.any_zero = any(lay.opt_extra for lay in leaves)  # optimizer blocks narrower than storage (ZeRO)
        self.any_gather = any(lay.gather for lay in leaves)
        pd = plan.param_dtype
        self.mixed = None if pd is None else (pd, plan.reduce_dtype or pd)
        # parameters are read through `read` (gathered, cast, or copied in from host memory)
        self.needs_view = self.any_gather or self.mixed is not None or bool(self.offloaded)
        # the gradients a pipeline hands out are the step's gradients, laid out as they will be returned:
        # nothing gathered, cast or reduced after it (then it can reduce their norm with its loss)
        self.pipeline_grads_final = (plan.pipeline is not None and not self.needs_view and not any(self.reduced)
                                     and plan.sdc_check is None and plan.reduce_dtype is None)
        self.reshard = plan.reshard_after_forward
        n_data = math.prod(mesh.axis_size(a) for a in mesh.axis_names if a in plan.data_axes)
        self.seed_scale = self.seed(mesh.size, n_data, plan.gradient_scaling_factor)
        # batch statistics (the loss's mean, aux counts) pool over every axis the tokens are split on; the
        # seed above counts only the batch's: a context-parallel loss is the same on each of its ranks
        self.data_axes = tuple(a for a in mesh.axis_names if a in plan.token_axes and mesh.axis_size(a) > 1)
        # the all-reduce buckets started during the backward (overlap.py); not under a pipeline (its
        # executor runs its own backward) nor an SDC check (it compares the reduction it runs itself)
        self.overlap_buckets = ([] if plan.pipeline is not None or plan.sdc_check is not None
                                else buckets_of(leaves, dtypes, plan.reduce_dtype, mesh=mesh,
                                                cap_bytes=BUCKET_CAP_BYTES if plan.bucket_cap_bytes is None
                                                else plan.bucket_cap_bytes))

    @staticmethod
    def seed(mesh_size: int, data_ranks: int, factor: float | None) -> float:
        """The loss's gradient seed on each rank (see the module docstring)."""
        return 1.0 / mesh_size if factor is None else factor * data_ranks / mesh_size


def reduce_wanted(program: Any, grads: list[torch.Tensor], wanted: list[int]) -> list[torch.Tensor]:
    """Per-rank gradients of the leaves ``wanted`` (storage layout) -> reduced, optimizer layout.
    ``program``: the lowered step (its ``engine`` facts; an SDC check counts its reductions there)."""
    cfg = program.engine
    plan = cfg.plan
    if plan.sdc_check is None and plan.reduce_dtype is None and not any(cfg.reduced[i] for i in wanted):
        return grads  # nothing to reduce (a pipeline, pure FSDP): the gradients are the optimizer blocks
    leaves = [cfg.leaves[i] for i in wanted]
    with torch.no_grad():
        out = reduce_gradients(grads, leaves, plan.reduce_dtype)
        if plan.sdc_check is not None:
            sdc.check(leaves, out, cfg.mesh, step=program.next_sdc_step(), policy=plan.sdc_check)
    return out


class _Reads:
    """The parameters of one differentiation as used: gathered with their group on first read; from the
    second differentiation of a lowered step on, the forward prefetches the group read next
    (:mod:`~hpfunc.transforms.engine.prefetch`)."""

    def __init__(self, cfg: EngineConfig, ws: Blocks, layer: ParamLayer, program: Any = None,
                 differentiated: set[int] | None = None, order_key: Any = None, host: HostParams | None = None):
        self.cfg, self.ws, self.layer = cfg, ws, layer
        self.host = host  # the offloaded blocks (ws holds their anchors), or None
        # the leaves whose gradients this differentiation computes: a group of them all gathers from a packed
        # leaf of its own whose reduce-scatter the backward does not wait for (scatter_async.py)
        self.differentiated = differentiated
        self.scatters = Scatters() if differentiated else None
        self.ready: dict[int, torch.Tensor] = {}  # gathered with their group, not yet read
        self.kept: dict[int, torch.Tensor] = {}  # without reshard: every gathered leaf until the backward ends
        self.gids = itertools.count()
        # the order of first reads of the groups (by first member): recorded by the first run of this
        # differentiation of the lowered step (order_key), followed by the later runs' prefetches
        self.program, self.order_key = program, order_key
        order = (None if program is None or cfg.plan.pipeline is not None or order_key is None
                 else program.gather_orders.get(order_key))
        self.order = order
        self.seen: list[int] | None = [] if program is not None and order_key is not None and order is None else None
        self.at = {} if order is None else {g: k for k, g in enumerate(order)}
        self.flights: dict[int, prefetch.Flight] = {}  # first member -> its gather in flight
        self.keep = True  # without reshard, keep gathered leaves for the backward (False: a forward only)
        # the backward's re-gathers (resharded groups, a remat's recompute): in the order its first run
        # recorded, each issuing the next one's gather (backward_prefetch.py)
        back = (None if program is None or cfg.plan.pipeline is not None or order_key is None
                else program.regather_orders.get(order_key))
        self.back = Regathers(cfg, ws, order=back, record=program is not None and order_key is not None
                              and cfg.plan.pipeline is None, host=host)
        # from the second run on, the groups the forward reads last stay gathered for the backward
        self.kept_groups = (program.kept_groups.get(order_key, frozenset())
                            if order is not None and cfg.reshard else frozenset())
        self.recomputed: set[int] = set()  # groups a remat's recompute read again in the backward

    def gather(self, members: list[int]) -> list[torch.Tensor]:
        cfg, host = self.cfg, self.host
        blocks = [self.ws[j] for j in members]  # an offloaded member's is its anchor: host.fill copies it in
        specs = [cfg.leaves[j].gather for j in members]
        detached = [b.detach() for b in blocks]
        back, mixed = self.back, cfg.mixed
        if torch._C._current_graph_task_id() != -1:  # a recompute in the backward: a re-gather in its turn
            self.recomputed.add(members[0])  # (re-gathered for its recompute: keeping it would not spare that)
            fulls = back.gather(members, blocks, specs, mixed)
            self.layer.own_gathered(fulls, next(self.gids), lambda: back.gather(members, detached, specs, mixed))
            return fulls
        if self.seen is not None and members[0] not in self.seen:
            self.seen.append(members[0])
        offloaded = host is not None and host.any(members)
        with outside() as clear:  # the same ops in a remat region's forward and its recompute: none
            flight = self.flights.pop(members[0], None)
            if (self.scatters is not None and prefetch.eligible(specs)
                    and all(j in self.differentiated for j in members)):
                # values read only when not prefetched; an offloaded group's packed leaves are carriers
                values = blocks if flight is not None or not offloaded else host.fill(members, detached)
                full = self.scatters.gather(cfg.mesh, values, members, specs[0][0][1], flight, mixed,
                                            carriers=offloaded)
                del values
                fulls = _unpack_gathered(full, blocks, [g[0][0] for g in specs], full.shape[0])
            elif flight is not None:  # prefetched: wait for it, unpack as a synchronous packed gather would
                full = flight.land(blocks)
                fulls = _unpack_gathered(full, blocks, [g[0][0] for g in specs], full.shape[0])
            else:
                fulls = gather_group(host.fill(members, blocks) if offloaded else blocks, specs, mixed)
            if self.order is not None and clear:
                self._prefetch_after(members[0])
        self.layer.own_gathered(fulls, next(self.gids), lambda: back.gather(members, detached, specs, mixed),
                                keep=self.keep and members[0] in self.kept_groups)
        return fulls

    def _prefetch_after(self, first: int) -> None:
        """Issue the gather of the group read after ``first`` (one group in flight ahead), and start copying in
        the offloaded blocks of the group after that."""
        k = self.at.get(first)
        if k is None or k + 1 >= len(self.order):
            return
        if self.issue(self.order[k + 1]) and self.host is not None and k + 2 < len(self.order):
            self.host.start(self.cfg.group_of[self.order[k + 2]])  # copied in while this layer computes

    def issue(self, first: int) -> bool:
        """Issue the packed all-gather of the group whose first member is ``first`` without waiting (its first
        read lands it); ``False`` where it is in flight or gathered already, or not prefetchable. Used by the
        forward prefetch and by a pipeline's stages (:class:`~hpfunc.transforms.engine.pipelined.StagePipeline`)."""
        members = self.cfg.group_of[first]
        if first in self.flights or any(j in self.ready or j in self.kept for j in members):
            return False
        cfg, host = self.cfg, self.host
        specs = [cfg.leaves[j].gather for j in members]
        if not prefetch.eligible(specs):
            return False
        blocks = [self.ws[j] for j in members]
        if host is not None:
            blocks = host.fill(members, [b.detach() for b in blocks])
        self.flights[first] = prefetch.start(cfg.mesh, blocks, specs[0][0][1], cfg.mixed)
        return True

    def end_forward(self) -> None:
        """After the forward: record the order of first reads (the first differentiation), wait for and drop
        a prefetched group the forward never read, free gathered groups not read."""
        if self.seen is not None:
            self.program.gather_orders.setdefault(self.order_key, tuple(self.seen))
            if self.keep and self.cfg.reshard and self.seen:
                self.program.kept_groups.setdefault(self.order_key, kept_after_forward(self.cfg, self.seen))
        self.seen = None
        for flight in self.flights.values():
            flight.wait()
        self.flights.clear()
        self.ready.clear()
        if self.host is not None:
            self.host.finish()

    def end_backward(self, ran: bool) -> None:
        """After the backward (``ran``: whether one ran): drop what it re-gathered ahead and did not use;
        record the order of its re-gathers (the first differentiation)."""
        seen = self.back.finish()
        if ran and self.program is not None and self.order_key is not None and self.cfg.plan.pipeline is None \
                and self.order_key not in self.program.regather_orders:
            # kept gathered from now on (not re-gathered), unless a recompute reads them again
            kept = self.program.kept_groups.get(self.order_key, frozenset()) - self.recomputed
            self.program.kept_groups[self.order_key] = kept
            self.program.regather_orders[self.order_key] = tuple(g for g in seen if g not in kept)
        self.ready.clear()  # gathered again by a recompute in the backward and not read
        self.kept.clear()
        if self.host is not None:
            self.host.finish()

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        i = self.ws.param_of(w)  # the block, or an exact alias of it (a remat recompute's saved input)
        if i is None:
            return w
        cfg = self.cfg
        if not cfg.leaves[i].gather:  # used as stored (cast for use under mixed precision)
            host = self.host
            if host is not None and i in host.hosts:  # copied in from host memory; under reshard copied in
                # again for the backward (claimed like a gathered group)
                out = cast_for_use(host.fill([i], [w])[0], cfg.mixed)
                mixed, dw = cfg.mixed, w.detach()
                self.layer.own_gathered([out], next(self.gids),
                                        lambda: [cast_for_use(host.fill([i], [dw])[0], mixed)])
                return out
            out = cast_for_use(w, cfg.mixed)
            if out is not w:
                self.layer.own(out)
            return out
        if i in self.ready:
            return self.ready.pop(i)
        if i in self.kept:
            return self.kept[i]
        # the whole group, also when read again (a recompute in the backward repeats the forward's
        # collectives exactly, which selective checkpointing requires)
        members = cfg.group_of[i]
        fulls = self.gather(members)
        for j, f in zip(members, fulls):
            if not cfg.reshard and self.keep:
                self.kept[j] = f
            elif j != i:
                self.ready[j] = f
        return fulls[members.index(i)]


def kept_after_forward(cfg: EngineConfig, order: list[int]) -> frozenset[int]:
    """The gather groups (by first member) of a forward's read ``order`` kept gathered for the backward: the
    last layer's (a list element, ``layers.3``) and every group read after it (the top-level parameters the
    forward ends with: a final norm, the head), which the backward needs first -- gathering them again
    right after dropping them would only add collectives. Without layer groups, the last group read.

    >>> from hpfunc.layout import LeafLayout, LeafSpec
    >>> cfg = type("C", (), {"leaves": [LeafLayout(p, (4,), LeafSpec.of(())) for p in
    ...                                 ("embed", "layers.0.w", "layers.1.w", "norm", "head")]})
    >>> sorted(kept_after_forward(cfg, [0, 1, 2, 3, 4]))
    [2, 3, 4]
    """
    layer_at = [k for k, g in enumerate(order) if layer_of(cfg.leaves[g].path)]
    return frozenset(order[layer_at[-1]:] if layer_at else order[-1:])


def value_and_grad(program: Any, blocks: list[torch.Tensor], call: Callable[[list[torch.Tensor], Callable], Any],
                   has_aux: bool, wanted: list[int] | None = None, *, where: str, reduce: bool = True,
                   step: Any = None, order_key: Any = None, record: bool = True, stats: bool = False):
    """``(loss, aux, grads)``: the per-rank loss of ``call(ws, read)`` and the gradients of the leaves
    ``wanted`` (all by default): reduced and laid out like the optimizer blocks, or with
    ``reduce=False`` per rank (the caller reduces an accumulated sum once, :func:`reduce_wanted`).
    ``program``: the lowered step (:class:`~hpfunc.transforms.lowered.Lowered`: its ``engine`` facts,
    its pipeline executor). ``step``: the step's layout, told by a pipeline the global norm of the
    gradients it hands out. ``order_key``: which differentiation of the step this is (its position and
    the leaves it wants): the key of the order of gathers its first run recorded, which later runs
    prefetch by (``None``: no prefetch). ``record=False``: the forward only (``wanted`` empty), nothing
    recorded for a backward, so each gathered layer is freed once read (:func:`hpfunc.value`).
    ``stats``: also return the loss and ``aux`` as :class:`~hpfunc.transforms.engine.step_scalars.StepScalars`
    over the data axes, riding the last overlapped gradient bucket when they can (else reduced by
    the caller, :meth:`StepScalars.reduce`); the fourth element of the result, ``None`` without."""
    cfg = program.engine
    plan = cfg.plan
    layer = ParamLayer(cfg.mesh, reshard=cfg.reshard, any_gather=cfg.any_gather or bool(cfg.offloaded))
    host = None
    if cfg.offloaded:  # the host blocks stay out of autograd: their device anchors take their place
        host = HostParams({i: blocks[i] for i in cfg.offloaded}, torch.device(cfg.mesh.device_type))
        blocks = [host.anchor(i) if i in host.hosts else b for i, b in enumerate(blocks)]
    ws = Blocks(blocks, requires_grad=[x.is_floating_point() for x in blocks])
    wanted = list(range(len(ws))) if wanted is None else wanted
    diff = [i for i in wanted if ws[i].requires_grad]
    reads = _Reads(cfg, ws, layer, program, set(diff), order_key, host)
    reads.keep = record  # a forward only keeps nothing for a backward: each group freed once read
    layer.own_blocks(ws)
    pipe = None if plan.pipeline is None else StagePipeline(program, layer, step if reduce else None)
    # one binding for the differentiated function: its data, tensor- and expert-parallel axes (decided at
    # lowering), the pipeline runner of this differentiation; no step layout (the model runs as on one device)
    inner = program.inner_binding if pipe is None else attrs.evolve(program.inner_binding, pipeline=pipe)
    if not record and (wanted or pipe is not None):
        raise PlanError(f"{where}: a forward without gradients takes no wanted leaves and no pipeline")
    with torch.set_grad_enabled(record), saved_tensors.layer(layer), layout.binding(inner):
        try:
            out = call(ws, reads)
        except (TypeError, KeyError, IndexError, AttributeError) as err:
            if pipe is None or pipe.used:
                raise
            raise PlanError(f"{where} under a pp plan: the differentiated function failed ({type(err).__name__}: "
                            f"{err}) without running the model's pipeline stages; each pipeline rank holds only "
                            f"its stages' parameters (the others are None), so the function must compute the loss "
                            f"through the model's pipelined loss (for Qwen3, qwen3.parallel_plan.loss)") from err
    if pipe is not None and not pipe.used:
        raise PlanError(f"{where} under a pp plan: the differentiated function did not run the model's pipeline "
                        f"stages; compute the loss with the model's pipelined loss (for Qwen3, "
                        f"qwen3.parallel_plan.loss), which the pp layer's stages belong to")
    reads.end_forward()  # gathered with a layer but never read: free now
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{where}: with has_aux=True the function must return (loss, aux)")
        loss, aux = out
    else:
        loss, aux = out, None
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
        raise TypeError(f"{where}: the loss must be a floating 0-d tensor"
                        f"{' (as the first element, has_aux=True)' if has_aux else ''}; found {loss!r}")
    scalars = StepScalars(cfg.mesh, cfg.data_axes, loss, aux, has_aux) if stats else None
    targets = [ws[i] for i in diff]
    # the pipelined loss itself (not a function of it) comes with its gradients already computed
    gs = None if pipe is None or not diff else known_gradients(loss, targets, cfg.seed_scale)
    overlap = None
    if gs is None:
        if reduce and cfg.overlap_buckets and diff and loss.requires_grad:
            # each bucket's all-reduce starts from a gradient hook once its last member is final
            overlap = Overlap(cfg.mesh, ws, wanted, cfg.overlap_buckets, plan.reduce_dtype, scalars)
        packed = reads.scatters.leaves if reads.scatters is not None else []
        if diff and loss.requires_grad:
            reads.back.begin()
        gs = (torch.autograd.grad(loss, targets + packed, grad_outputs=torch.full_like(loss, cfg.seed_scale),
                                  allow_unused=True) if diff and loss.requires_grad else [None] * (len(diff) + len(packed)))
        if packed:  # wait for the reduce-scatters issued during the backward; add what they reduced
            scattered = reads.scatters.finish(list(gs[len(diff):]))
            gs = [g if i not in scattered else scattered[i] if g is None else g + scattered[i]
                  for i, g in zip(diff, gs[:len(diff)])]
    reads.end_backward(bool(diff) and loss.requires_grad and pipe is None)
    by_leaf = dict(zip(diff, gs))
    if overlap is not None and overlap.covered:
        with torch.no_grad():
            done = overlap.finish(by_leaf, blocks)
        rest = [i for i in wanted if i not in done]
        grads = [by_leaf.get(i) if by_leaf.get(i) is not None else torch.zeros_like(blocks[i]) for i in rest]
        red = dict(zip(rest, reduce_wanted(program, grads, rest))) if rest else {}
        return loss, aux, [done[i] if i in done else red[i] for i in wanted], scalars
    if overlap is not None:
        overlap.finish(by_leaf, blocks)  # (no bucket applied: removes its hooks)
    grads = [by_leaf.get(i) if by_leaf.get(i) is not None else torch.zeros_like(blocks[i]) for i in wanted]
    if not reduce:
        return loss, aux, grads, scalars
    return loss, aux, reduce_wanted(program, grads, wanted), scalars
