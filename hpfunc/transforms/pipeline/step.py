"""The pipeline step: a schedule's actions for this rank, checked once, run on every call.

:class:`PipelineStep` checks the stage functions, the schedule and the mesh once (and adds the
transfers to a compute-only schedule); each call splits the batch into microbatches and runs this rank's
actions (:class:`~hpfunc.transforms.pipeline.executor.Run`). :func:`pipeline_map` builds one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.schedules import ActionKind, Schedule, insert_comms, validate
from hpfunc.transforms.pipeline.errors import PipelineError
from hpfunc.transforms.pipeline.executor import Run
from hpfunc.transforms.pipeline.microbatches import split_microbatches
from hpfunc.transforms.pipeline.stage_params import StageParams
from hpfunc.transforms.pipeline.wire import Wire

__all__ = ["PipelineStep", "pipeline_map"]

K = ActionKind


class PipelineStep:
    """The step built by :func:`pipeline_map`; call it as ``step(params, batch) -> (loss, grads)``.

    ``params`` maps each local stage (``step.local_stages``) to its parameter tree (a mapping with
    more stages is accepted; others are ignored). ``grads`` has the same structure restricted to
    the local stages. ``loss`` (a detached scalar, identical on every rank) is the mean over
    microbatches (and over the data axis, if any).
    """

    def __init__(self, stage_fns: Sequence[Callable], schedule: Schedule, mesh: Mesh, *, axis: str,
                 loss_fn: Callable, data_axis: str | None, fsdp_axis: str | None, first_input: Callable | None,
                 check: bool, with_microbatch: bool = False, loss_scale: float = 1.0):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"pipeline_map: schedule must be an hpfunc.schedules.Schedule, found {type(schedule).__name__}")
        stage_fns = list(stage_fns)
        if len(stage_fns) != schedule.num_stages:
            raise PipelineError(
                f"pipeline_map: got {len(stage_fns)} stage functions but schedule {schedule.name!r} has "
                f"{schedule.num_stages} stages (stage_to_rank={schedule.stage_to_rank}); pass one function per stage")
        for s, fn in enumerate(stage_fns):
            if not callable(fn):
                raise TypeError(f"pipeline_map: stage_fns[{s}] is not callable ({type(fn).__name__})")
        if axis not in mesh.axis_names:
            raise PipelineError(f"pipeline_map: mesh {mesh!r} has no pipeline axis {axis!r}; its axes are "
                                f"{mesh.axis_names} (pass axis=... or build the mesh with a {axis!r} axis)")
        for name, a in (("data_axis", data_axis), ("fsdp_axis", fsdp_axis)):
            if a is not None and a not in mesh.axis_names:
                raise PipelineError(f"pipeline_map: {name}={a!r} is not an axis of {mesh!r}")
            if a == axis:
                raise PipelineError(f"pipeline_map: {name} must differ from the pipeline axis {axis!r}")
        p = mesh.axis_size(axis)
        if schedule.num_ranks != p or schedule.ranks != tuple(range(p)):
            raise PipelineError(
                f"pipeline_map: schedule {schedule.name!r} runs on ranks {schedule.ranks} but mesh axis {axis!r} "
                f"has size {p}")
        has_fsdp_actions = any(a.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD)
                               for row in schedule.actions.values() for a in row)
        if not schedule.has_comms:
            schedule = insert_comms(schedule)
        if check:
            validate(schedule)
        self.schedule = schedule
        self.stage_fns = stage_fns
        self.mesh = mesh
        self.axis = axis
        self.loss_fn = loss_fn
        self.data_axis = data_axis
        self.fsdp_axis = fsdp_axis
        # Without an FSDP axis the FSDP actions are no-ops (parameters are whole), as in torch's
        # runtime for stages that are not FSDP-wrapped; torch's own lowering always contains them.
        self.fsdp = has_fsdp_actions and fsdp_axis is not None
        self.first_input = first_input
        # the front door's mode (hpfunc.parallelize with a pp layer): stage_fns[s](params, x, microbatch),
        # loss_fn(params, y, microbatch) -> (loss, aux), the last stage's loss seeded with loss_scale / m
        self.with_microbatch = with_microbatch
        self.loss_scale = float(loss_scale)
        self.pp_index = mesh.axis_index(axis)
        self.local_stages = schedule.stages_of(self.pp_index)
        self.actions = schedule.actions[self.pp_index]
        self.swapped = {(a.stage, a.microbatch) for a in self.actions if a.kind is K.SWAP_OUT}
        # the receives the executor posts ahead (see executor.Run): by stage and microbatch, by stage in order
        self.recv_b = {(a.stage, a.microbatch): a for a in self.actions if a.kind is K.RECV_B}
        self.recv_f: dict[int, list] = {}
        for a in self.actions:
            if a.kind is K.RECV_F:
                self.recv_f.setdefault(a.stage, []).append(a)
        # where each local stage's gradients are final (its last W or BW): its data-parallel reduction starts
        # there (stage_params.StageParams.gradients_final); with FSDP, REDUCE_GRAD says it
        last_weight = {a.stage: k for k, a in enumerate(self.actions) if a.kind in (K.W, K.BW)}
        self.grads_final_at = ({k: s for s, k in last_weight.items()}
                               if data_axis is not None and not self.fsdp else {})
        self.stage_layouts: dict[tuple, Any] = {}  # (stage, structure) -> its StageLayout (stage_params.py)
        self.wire = Wire(mesh, axis, schedule.num_stages, schedule.num_microbatches, early_headers=with_microbatch)

    @property
    def device(self) -> torch.device:
        """Where headers and received buffers live (the mesh's device type)."""
        return self.wire.device

    def _forward_header(self, tensors: Sequence[torch.Tensor], action: Any, mb: Any) -> bool:
        """Whether this forward message carries a header (:meth:`Wire.forward_header`)."""
        return self.wire.forward_header(tensors, action, mb)

    # -- the step ------------------------------------------------------------------------------------
    def __call__(self, params: Mapping[int, Any], batch: Any) -> tuple[torch.Tensor, dict[int, Any]]:
        losses, _, out = self.execute(params, batch)
        # The loss lives on the last stage's rank; every rank returns it.
        sched = self.schedule
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.detach().to(torch.float32).clone()
        holder = sched.stage_to_rank[sched.num_stages - 1]
        dist.broadcast(loss, src=self.wire.global_rank(holder), group=self.wire.group)
        if self.data_axis is not None:
            dist.all_reduce(loss, group=self.mesh.group(self.data_axis))
            loss.div_(self.mesh.axis_size(self.data_axis))
        return loss, out

    def execute(self, params: Mapping[int, Any], batch: Any,
                deferred: Mapping[int, Any] | None = None) -> tuple[list[torch.Tensor], list[Any], dict[int, Any]]:
        """Run this rank's actions: ``(losses, auxes, grads)`` -- the last stage's loss (and, in the
        microbatch mode, its aux) per microbatch on the rank holding it (empty lists elsewhere), and the
        gradients of the local stages' parameters (see :meth:`__call__`). ``deferred`` (without an FSDP
        axis): per stage, its leaves read on first use (:meth:`StageParams._make_deferred
        <hpfunc.transforms.pipeline.stage_params.StageParams._make_deferred>`); the gradients then have
        the shapes of the values read."""
        if not isinstance(params, Mapping):
            raise TypeError(f"pipeline step: params must map stage index -> parameter tree, found {type(params).__name__}")
        missing = [s for s in self.local_stages if s not in params]
        if missing:
            raise PipelineError(f"pipeline step: pp rank {self.pp_index} holds stages {self.local_stages} but params has "
                                f"no entry for stage(s) {missing} (keys: {sorted(params)})")
        if self.data_axis is not None:
            n, j = self.mesh.axis_size(self.data_axis), self.mesh.axis_index(self.data_axis)
            batch = split_microbatches(batch, n)[j]
        mbs = split_microbatches(batch, self.schedule.num_microbatches)
        # Closed stages: in the front door's mode the stage functions are the model's pure stage functions
        # of (parameters, carry, microbatch). Their parameters and carries are fresh leaves made here, so
        # a stage's backward can reach nothing else unless the microbatch itself carries gradients; then
        # (and always for pipeline_map's own stage functions, which may close over tensors that require
        # grad) a full backward names its targets, so that no gradient leaks out of the stage.
        closed = self.with_microbatch and not any(
            t.requires_grad for t in _tree.leaves(batch) if isinstance(t, torch.Tensor))
        return Run(self, StageParams(self, params, deferred), mbs, closed).run()


def pipeline_map(stage_fns: Sequence[Callable], schedule: Schedule, mesh: Mesh, *, axis: str = "pp",
                 loss_fn: Callable[[Any, Any], torch.Tensor], data_axis: str | None = None,
                 fsdp_axis: str | None = None, first_input: Callable[[Any], Any] | None = None,
                 check: bool = True) -> PipelineStep:
    """Build ``step(params, batch) -> (loss, grads)`` that runs ``schedule`` on this rank's pp slice.

    Args:
        stage_fns: one function per stage, ``stage_fns[s](params_s, x) -> y``. Stage 0 receives the
            microbatch (or ``first_input(microbatch)``); every other stage receives what the stage
            before it returned: a tensor, or a tuple of up to 8 tensors (floating-point ones carry
            gradients back; a 1-tuple arrives as its tensor).
        schedule: a :class:`~hpfunc.schedules.Schedule` with ``schedule.num_stages == len(stage_fns)``
            and one rank per index of ``mesh`` axis ``axis``. Compute-only schedules get
            :func:`~hpfunc.schedules.insert_comms`; all are validated unless ``check=False``.
        mesh: the mesh; ``axis`` names its pipeline axis.
        loss_fn: ``loss_fn(y_last, microbatch) -> scalar`` on the last stage. The step returns the
            mean over microbatches and its gradients.
        data_axis: optional mesh axis over which the batch is split (dim 0) and gradients and loss
            are averaged (data parallel; parameters replicated).
        fsdp_axis: the mesh axis of the FSDP shards; the schedule must then have
            ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` actions (:func:`~hpfunc.schedules.insert_fsdp`).
            Without it those actions are no-ops (as torch does for stages that are not FSDP-wrapped).
            Parameters are then passed as dim-0 shards (:func:`shard_stage_params`) and gradients
            come back as shards of the mean over ``fsdp_axis``; the batch is split over
            ``fsdp_axis`` too (FSDP is data parallel). Do not pass it as ``data_axis`` as well.
        first_input: maps a microbatch to stage 0's input (default: the microbatch itself).
        check: validate the schedule once here.

    Returns:
        A :class:`PipelineStep`; ``step.local_stages`` lists the stages this rank holds.

    Raises:
        PipelineError (a ValueError): stage count differs from the schedule, the pp axis is not in
            the mesh, the schedule's ranks differ from the axis size, or (at call time) the batch
            does not split into the schedule's microbatches.
    """
    if fsdp_axis is not None and data_axis is not None:
        raise PipelineError("pipeline_map: pass either data_axis or fsdp_axis (FSDP already splits the batch)")
    step = PipelineStep(stage_fns, schedule, mesh, axis=axis, loss_fn=loss_fn,
                        data_axis=data_axis if fsdp_axis is None else fsdp_axis, fsdp_axis=fsdp_axis,
                        first_input=first_input, check=check)
    if fsdp_axis is not None and not step.fsdp:
        raise PipelineError("pipeline_map: fsdp_axis given but the schedule has no UNSHARD/REDUCE_GRAD actions; "
                            "run hpfunc.schedules.insert_fsdp(schedule) or use data_axis=")
    return step
