"""``pipeline_map``: execute a pipeline schedule (:mod:`hpfunc.schedules`) over torch.distributed.

Every rank runs the same program. It builds a step function from the full list of stage functions,
a :class:`~hpfunc.schedules.Schedule` and a :class:`~hpfunc.Mesh`; the step walks
``schedule.actions[pp_index]`` front to back:

==============  ==========================================================================
``F``           ``y = stage_fns[s](params[s], x)``; on the last stage ``loss_fn(y, microbatch)``
``B``           input gradient (:func:`~hpfunc.transforms.backward_split.backward_input`): ``dx``, keeping
                the gradient flowing into each parameter's use site (the matmul with the weight)
``W``           weight gradient only (:func:`~hpfunc.transforms.backward_split.backward_weight`): re-runs
                the use sites towards the parameters from what ``B`` kept; accumulated
``BW``          both in one ``torch.autograd.backward`` call: the weight gradients accumulate over
                microbatches in the stage's parameter leaves' ``.grad`` inside autograd, as torch's
                ``PipelineStage`` does (no Python-side sum per parameter and microbatch)
``SEND_*``      posted asynchronously (``dist.batch_isend_irecv``); a finished one is let go at the next
                send (its buffer with it), the rest are waited for at the end
``RECV_*``      received (and waited for) right where the schedule puts it
``UNSHARD``     all-gather the stage's parameter shards over the FSDP axis
``RESHARD``     drop the gathered parameters (graphs still pending keep what they saved)
``REDUCE_GRAD`` reduce the stage's accumulated gradients over the FSDP axis, keep this rank's shard
``SWAP_OUT``    move the stage-microbatch's saved activations to host memory
                (:class:`~hpfunc.transforms.activation_swap.ActivationSwap` on the saved-tensor stack)
``SWAP_IN``     bring them back into device memory (before the backward that needs them)
==============  ==========================================================================

A microbatch's graph (every tensor it saved) stays until its ``W`` or ``BW``: the weight side of a
split backward needs the saved layer inputs. :attr:`SimResult.peak_resident_until_w
<hpfunc.schedules.SimResult>` counts exactly that (minus what is swapped out); the activation bytes
resident per rank, measured by storage liveness, equal it times the bytes of one stage-microbatch
(``tests/pipeline/test_pipeline_swaps.py``).

Stages placed on the same rank (the turn of a V, or interleaved stages) hand activations and
gradients to each other in memory. The loss returned is the mean over microbatches (equal to the
full-batch loss for a loss that is a mean over equally sized microbatches); gradients are those of
that mean.

Example (2 ranks, run under ``hpfunc launch --nproc 2``)::

    import torch, hpfunc
    from hpfunc.schedules import one_f_one_b
    from hpfunc.transforms.pipeline import pipeline_map

    mesh = hpfunc.Mesh({"pp": 2})
    stage_fns = [lambda p, x: torch.tanh(x @ p["w"]), lambda p, x: x @ p["w"]]
    loss_fn = lambda y, mb: ((y - mb["y"]) ** 2).mean()
    step = pipeline_map(stage_fns, one_f_one_b(2, 4), mesh, loss_fn=loss_fn,
                        first_input=lambda mb: mb["x"])
    params = {s: {"w": torch.randn(4, 4)} for s in step.local_stages}
    loss, grads = step(params, {"x": torch.randn(8, 4), "y": torch.randn(8, 4)})
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from hpfunc import comm, saved_tensors
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.schedules import ActionKind, Schedule, insert_comms, validate
from hpfunc.transforms.activation_swap import ActivationSwap
from hpfunc.transforms.backward_split import BackwardState, backward_input, backward_weight

__all__ = ["PipelineError", "PipelineStep", "pipeline_map", "record_timeline", "shard_stage_params",
           "split_microbatches", "unshard_stage_grads"]

K = ActionKind

# Forward messages carry a header describing the tensors that follow (the receiver cannot know
# the shapes of another stage's output); backward messages mirror the receiver's own outputs.
_MAX_TENSORS = 8
_MAX_NDIM = 6
_HEADER = 1 + _MAX_TENSORS * (2 + _MAX_NDIM)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_KIND_TAG = {K.SEND_F: 0, K.RECV_F: 0, K.SEND_B: 1, K.RECV_B: 1}


class PipelineError(ValueError):
    """A pipeline program that cannot run: mismatched schedule, stages, mesh or batch."""


def _as_tuple(y: Any, where: Any) -> tuple[torch.Tensor, ...]:
    ys = (y,) if isinstance(y, torch.Tensor) else tuple(y) if isinstance(y, (tuple, list)) else None
    if ys is None or not all(isinstance(t, torch.Tensor) for t in ys):
        raise PipelineError(f"{where}: a stage that is not the last must return a tensor or a tuple of tensors; "
                            f"found {type(y).__name__}")
    if len(ys) > _MAX_TENSORS:
        raise PipelineError(f"{where}: at most {_MAX_TENSORS} tensors can pass between stages, found {len(ys)}")
    return ys


def _is_diff(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` into ``m`` equal chunks along dim 0.

    Example:
        >>> [mb["x"].tolist() for mb in split_microbatches({"x": torch.arange(4)}, 2)]
        [[0, 1], [2, 3]]

    Raises:
        PipelineError: a leaf's batch dimension is not divisible by ``m``.
    """
    leaves = _tree.leaves_with_paths(batch)
    chunks: dict[str, tuple[torch.Tensor, ...]] = {}
    for path, x in leaves:
        if not isinstance(x, torch.Tensor):
            continue
        if x.dim() == 0 or x.shape[0] % m:
            n = "a scalar" if x.dim() == 0 else f"batch size {x.shape[0]}"
            raise PipelineError(
                f"cannot split batch leaf {path or '<root>'!r} ({n}) into {m} microbatches; the batch size "
                f"must be a multiple of schedule.num_microbatches={m}")
        chunks[path] = torch.chunk(x, m, dim=0)
    return [_tree.map_with_path(lambda p, x: chunks[p][i] if p in chunks else x, batch) for i in range(m)]


def _chunk_dim0(x: torch.Tensor, n: int, i: int, path: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[0] % n:
        raise PipelineError(f"FSDP: parameter {path!r} of shape {tuple(x.shape)} cannot be split into {n} equal "
                            f"shards along dim 0; make dim 0 a multiple of the FSDP axis size {n}")
    return x.chunk(n, dim=0)[i].clone()


def shard_stage_params(params: Any, mesh: Mesh, axis: str) -> Any:
    """This rank's dim-0 shard of every leaf (the storage layout ``UNSHARD`` expects).

    Example:
        >>> shards = shard_stage_params({0: {"w": w0}}, mesh, "fsdp")   # doctest: +SKIP
    """
    n, i = mesh.axis_size(axis), mesh.axis_index(axis)
    return _tree.map_with_path(lambda p, x: _chunk_dim0(x, n, i, p), params)


def unshard_stage_grads(grads: Any, mesh: Mesh, axis: str) -> Any:
    """All-gather dim-0 shards (the inverse of :func:`shard_stage_params`), e.g. to compare with a reference."""
    group, n = mesh.group(axis), mesh.axis_size(axis)

    def gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    return _tree.tree_map(gather, grads)


class _Where:
    """``pp rank R step K (action)``, the place an error names; formatted only when one is raised."""

    __slots__ = ("rank", "step", "action")

    def __init__(self, rank: int, step: int, action: Any):
        self.rank, self.step, self.action = rank, step, action

    def __str__(self) -> str:
        return f"pp rank {self.rank} step {self.step} ({self.action})"


class _Saved:
    """What a stage's forward on one microbatch leaves for its backward."""

    __slots__ = ("inputs", "outputs", "params", "param_pos", "out_grads", "done_b", "weight_state", "swap")

    def __init__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], params: list[torch.Tensor],
                 param_pos: list[int], swap: ActivationSwap | None = None):
        self.inputs = inputs        # differentiable inputs (requires_grad leaves), [] for stage 0
        self.outputs = outputs      # differentiable outputs, or [scaled loss] on the last stage
        self.params = params        # the parameter leaves this forward used
        self.param_pos = param_pos  # the positions of the differentiable ones among them
        self.out_grads: list[torch.Tensor] | None = None
        self.done_b = False
        self.weight_state: BackwardState | None = None  # what B kept for W (the gradients at the use sites)
        self.swap = swap            # the saved tensors, when the schedule swaps this stage-microbatch


_TIMELINE: contextvars.ContextVar[list | None] = contextvars.ContextVar("hpfunc_pipeline_timeline", default=None)


@contextlib.contextmanager
def record_timeline() -> Iterator[list]:
    """Record this rank's pipeline events while inside: a list of ``(what, action text, seconds)``
    with ``what`` one of ``"start"``/``"end"`` (a compute action: F, B, W, BW), ``"post"`` (a receive
    posted), ``"arrived"`` (a receive waited for and complete) and ``"send"`` (a send posted); times
    from ``time.perf_counter()``. ``bench/pipeline.py`` draws the timelines and measures the bubble
    from them; the tests check that receives are posted ahead of the compute that waits for them."""
    events: list = []
    token = _TIMELINE.set(events)
    try:
        yield events
    finally:
        _TIMELINE.reset(token)


def _drop_finished(works: list) -> None:
    """Remove the finished works from ``works`` (in place), raising the error of a failed one."""
    keep = []
    for w in works:
        if w.is_completed():
            w.wait()  # returns at once; raises if the send failed
        else:
            keep.append(w)
    works[:] = keep


def _event(what: str, action: Any) -> None:
    events = _TIMELINE.get()
    if events is not None:
        events.append((what, str(action), time.perf_counter()))


class _PendingRecv:
    """A posted receive: its header (forward messages name their shapes) and payload works."""

    __slots__ = ("step", "action", "peer", "header", "header_ops", "works", "bufs")

    def __init__(self, step: "PipelineStep", action: Any, peer: int):
        self.step, self.action, self.peer = step, action, peer
        self.header: torch.Tensor | None = None
        self.header_ops: list = []
        self.works: list = []
        self.bufs: list[torch.Tensor] | None = None

    def post_payload(self, bufs: list[torch.Tensor]) -> None:
        a, st = self.action, self.step
        self.bufs = bufs
        ops = self.header_ops + [dist.P2POp(dist.irecv, b, self.peer, st._pp_group,
                                            st._tag(a.kind, a.stage, a.microbatch, j + 1)) for j, b in enumerate(bufs)]
        self.header_ops = []
        if ops:
            self.works += dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        if self.bufs is None:  # the header told the shapes: receive the payload now
            h = self.header.tolist()
            bufs = []
            for j in range(h[0]):
                base = 1 + j * (2 + _MAX_NDIM)
                nd = h[base + 1]
                bufs.append(torch.empty(tuple(h[base + 2: base + 2 + nd]), dtype=_DTYPES[h[base]], device=self.step.device))
            self.post_payload(bufs)
            for w in self.works:
                w.wait()
            self.works = []
        elif self.header is not None:  # posted early with the first microbatch's shapes: the header must agree
            h = self.header.tolist()
            for j, b in enumerate(self.bufs):
                base = 1 + j * (2 + _MAX_NDIM)
                shape = tuple(h[base + 2: base + 2 + h[base + 1]])
                if h[0] != len(self.bufs) or shape != tuple(b.shape) or _DTYPES[h[base]] != b.dtype:
                    raise PipelineError(f"{self.action}: stage input {j} arrived as {shape} but the first "
                                        f"microbatch's was {tuple(b.shape)}; microbatches of one step must "
                                        f"give every stage inputs of one shape")
        _event("arrived", self.action)
        return self.bufs


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
        self.device = torch.device(mesh.device_type)  # headers and received buffers live there (NCCL)
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
        self._swapped = {(a.stage, a.microbatch) for a in self.actions if a.kind is K.SWAP_OUT}
        self._pp_group = mesh.group(axis)
        # (sending stage, microbatch, the microbatch's shapes) -> the shapes and dtypes the stage sent: a
        # forward message carries a header naming them the first time only. Both ends know the key (every
        # rank splits the same batch), so both drop the header from the second step on, as torch's
        # PipelineStage infers shapes once; a stage whose outputs then change shape is an error.
        self._boundary: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}

    # -- helpers ----------------------------------------------------------------------------------
    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self._pp_group, pp_rank)

    def _tag(self, kind: ActionKind, stage: int, mb: int, part: int) -> int:
        # Named by the sending stage: a RECV_F names the receiving stage (sender s - 1), a RECV_B
        # too (sender s + 1). Distinct tags let transfers between one pair of ranks (both
        # directions of a V, several interleaved stages) arrive in any order.
        if kind is K.RECV_F:
            stage -= 1
        elif kind is K.RECV_B:
            stage += 1
        m, n = self.schedule.num_microbatches, self.schedule.num_stages
        return ((_KIND_TAG[kind] * n + stage) * m + mb) * (_MAX_TENSORS + 1) + part

    def _boundary_key(self, sender: int, i: int, mb: Any) -> tuple:
        return (sender, i, tuple((tuple(x.shape), x.dtype) for x in _tree.leaves(mb) if isinstance(x, torch.Tensor)))

    def _forward_header(self, tensors: Sequence[torch.Tensor], action: Any, mb: Any) -> bool:
        """Whether this forward message carries a header: the first time its key is sent (see ``_boundary``)."""
        key = self._boundary_key(action.stage, action.microbatch, mb)
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        known = self._boundary.get(key)
        if known is None:
            self._boundary[key] = shapes
            return True
        if known != shapes:
            raise PipelineError(f"{action}: stage {action.stage} now outputs {shapes} for microbatch "
                                f"{action.microbatch}, but output {known} for a microbatch of the same shapes in an "
                                f"earlier step; the receiving rank posts its buffers from those, so a stage's output "
                                f"shapes must follow from its microbatch's shapes")
        return False

    def _send(self, tensors: Sequence[torch.Tensor], action: Any, pending: list, *, header: bool) -> None:
        peer = self._global(action.peer)
        ops = []
        if header:
            # built as a list and made a tensor once (item assignments into a tensor cost a dispatch each)
            fields = [0] * _HEADER
            fields[0] = len(tensors)
            for j, t in enumerate(tensors):
                if t.dim() > _MAX_NDIM or t.dtype not in _DTYPES:
                    raise PipelineError(f"stage {action.stage}: cannot send a {t.dtype} tensor of shape "
                                        f"{tuple(t.shape)} (at most {_MAX_NDIM} dims, dtypes {_DTYPES})")
                base = 1 + j * (2 + _MAX_NDIM)
                fields[base] = _DTYPES.index(t.dtype)
                fields[base + 1] = t.dim()
                fields[base + 2: base + 2 + t.dim()] = t.shape
            h = torch.tensor(fields, dtype=torch.int64, device=self.device)  # on the device: NCCL sends no host tensor
            ops.append(dist.P2POp(dist.isend, h, peer, self._pp_group, self._tag(action.kind, action.stage, action.microbatch, 0)))
        for j, t in enumerate(tensors):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, self._pp_group,
                                  self._tag(action.kind, action.stage, action.microbatch, j + 1)))
        _event("send", action)
        collectors = comm.active()
        if collectors:  # the counter sees pipeline traffic: each message's bytes (the header apart)
            phase = "forward" if action.kind is K.SEND_F else "backward"
            n = self.mesh.axis_size(self.axis)
            if header:
                comm.record(collectors, op="send", name="pipeline_header", axes=(self.axis,), n=n,
                            payload_bytes=_HEADER * 8, phase=phase, tag="header", sent_bytes=Fraction(_HEADER * 8))
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            comm.record(collectors, op="send", name="pipeline_" + ("activations" if phase == "forward" else "grads"),
                        axes=(self.axis,), n=n, payload_bytes=nbytes, phase=phase, sent_bytes=Fraction(nbytes))
        if ops:
            _drop_finished(pending)  # a finished send's work holds its buffer: let it go now, not at the end
            pending.extend(dist.batch_isend_irecv(ops))

    def _post_recv(self, action: Any, like: Sequence[Any] | None, *, header: bool = True) -> "_PendingRecv":
        """Post the receive of ``action`` now (non-blocking): the payload into buffers shaped like
        ``like`` (tensors, or ``(shape, dtype)`` pairs), or, with ``like=None``, its header first (then
        the payload is posted once the header has arrived, at :meth:`_PendingRecv.wait`). ``header=False``:
        a forward message whose sender sends no header (its shapes are known from an earlier step)."""
        peer = self._global(action.peer)
        kind, s, i = action.kind, action.stage, action.microbatch
        pending = _PendingRecv(self, action, peer)
        if like is None:
            pending.header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            pending.works = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, pending.header, peer, self._pp_group, self._tag(kind, s, i, 0))])
        else:
            if header and self.with_microbatch and kind is K.RECV_F:  # the sender's header still comes: take it too
                pending.header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                pending.header_ops = [dist.P2POp(dist.irecv, pending.header, peer, self._pp_group,
                                                 self._tag(kind, s, i, 0))]
            pending.post_payload([torch.empty_like(t) if isinstance(t, torch.Tensor) else torch.empty(t[0], dtype=t[1], device=self.device)
                                  for t in like])
        _event("post", action)
        return pending

    def _post_forward_recv(self, action: Any, like: Sequence[Any] | None, mb: Any) -> "_PendingRecv":
        """Post a forward receive: into buffers of the shapes the sender told in an earlier step (no
        header comes, see ``_boundary``), else shaped ``like`` with the header checked against them, or
        (``like=None``) header first."""
        known = self._boundary.get(self._boundary_key(action.stage - 1, action.microbatch, mb))
        return self._post_recv(action, like) if known is None else self._post_recv(action, known, header=False)

    # -- FSDP ----------------------------------------------------------------------------------------
    def _unshard(self, shards: Any) -> Any:
        group, n = self.mesh.group(self.fsdp_axis), self.mesh.axis_size(self.fsdp_axis)

        def gather(x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x.detach().contiguous(), group=group)
            return torch.cat(parts, dim=0)

        return _tree.tree_map(gather, shards)

    def _reduce_grad_shard(self, g: torch.Tensor) -> torch.Tensor:
        # all_reduce + slice rather than reduce_scatter: gloo lacks a reduce_scatter on CPU.
        n, i = self.mesh.axis_size(self.fsdp_axis), self.mesh.axis_index(self.fsdp_axis)
        g = g.contiguous().clone()
        dist.all_reduce(g, group=self.mesh.group(self.fsdp_axis))
        return g.chunk(n, dim=0)[i].div_(n)

    # -- the step ------------------------------------------------------------------------------------
    def __call__(self, params: Mapping[int, Any], batch: Any) -> tuple[torch.Tensor, dict[int, Any]]:
        losses, _, out = self.execute(params, batch)
        # The loss lives on the last stage's rank; every rank returns it.
        sched = self.schedule
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.detach().to(torch.float32).clone()
        holder = sched.stage_to_rank[sched.num_stages - 1]
        dist.broadcast(loss, src=self._global(holder), group=self._pp_group)
        if self.data_axis is not None:
            dist.all_reduce(loss, group=self.mesh.group(self.data_axis))
            loss.div_(self.mesh.axis_size(self.data_axis))
        return loss, out

    def execute(self, params: Mapping[int, Any], batch: Any) -> tuple[list[torch.Tensor], list[Any], dict[int, Any]]:
        """Run this rank's actions: ``(losses, auxes, grads)`` -- the last stage's loss (and, in the
        microbatch mode, its aux) per microbatch on the rank holding it (empty lists elsewhere), and the
        gradients of the local stages' parameters (see :meth:`__call__`)."""
        sched = self.schedule
        m = sched.num_microbatches
        last = sched.num_stages - 1
        if not isinstance(params, Mapping):
            raise TypeError(f"pipeline step: params must map stage index -> parameter tree, found {type(params).__name__}")
        missing = [s for s in self.local_stages if s not in params]
        if missing:
            raise PipelineError(f"pipeline step: pp rank {self.pp_index} holds stages {self.local_stages} but params has "
                                f"no entry for stage(s) {missing} (keys: {sorted(params)})")
        if self.data_axis is not None:
            n, j = self.mesh.axis_size(self.data_axis), self.mesh.axis_index(self.data_axis)
            batch = split_microbatches(batch, n)[j]
        mbs = split_microbatches(batch, m)
        # Closed stages: in the front door's mode the stage functions are the model's pure stage functions
        # of (parameters, carry, microbatch). Their parameters and carries are fresh leaves made here, so
        # a stage's backward can reach nothing else unless the microbatch itself carries gradients; then
        # (and always for pipeline_map's own stage functions, which may close over tensors that require
        # grad) a full backward names its targets, so that no gradient leaks out of the stage.
        closed = self.with_microbatch and not any(
            t.requires_grad for t in _tree.leaves(batch) if isinstance(t, torch.Tensor))

        # Parameter leaves as fresh differentiable leaves; the caller's tensors are never touched.
        specs, stored = {}, {}
        for s in self.local_stages:
            leaves, spec = _tree.flatten(params[s])
            specs[s], stored[s] = spec, leaves
        live: dict[int, list[torch.Tensor]] = {}

        diff_pos: dict[int, list[int]] = {}  # per stage: the positions of its differentiable leaves

        # Every set of differentiable leaves a stage's forwards used (one per UNSHARD under FSDP, else one):
        # a full backward (BW) accumulates into their ``.grad`` inside autograd, as torch's own stages do.
        generations: dict[int, list[list[torch.Tensor]]] = {s: [] for s in self.local_stages}

        live_trees: dict[int, Any] = {}  # the parameter tree of live[s], made once per UNSHARD

        def make_live(s: int, leaves: list[torch.Tensor]) -> None:
            live[s] = [x.detach().requires_grad_(_is_diff(x)) if isinstance(x, torch.Tensor) else x for x in leaves]
            diff_pos[s] = [k for k, t in enumerate(live[s]) if isinstance(t, torch.Tensor) and t.requires_grad]
            generations[s].append(live[s])
            live_trees[s] = _tree.unflatten(specs[s], live[s])

        if not self.fsdp:
            for s in self.local_stages:
                make_live(s, stored[s])
        # The weight gradients of split backwards (W) over microbatches: the first is kept as autograd
        # returned it (it may alias another tensor, e.g. an incoming gradient), the second sum is a fresh
        # tensor, and later ones are added into it in place (the values of out-of-place sums, fewer
        # allocations). A BW's go to the leaves' ``.grad`` instead (autograd's AccumulateGrad, which steals
        # or copies by the same rule); ``collect`` adds the two.
        grads: dict[int, list[torch.Tensor | None]] = {s: [None] * len(stored[s]) for s in self.local_stages}
        owned: dict[int, list[bool]] = {s: [False] * len(stored[s]) for s in self.local_stages}

        def collect(s: int) -> list[torch.Tensor | None]:
            out = list(grads[s])
            for gen in generations[s]:
                for k, t in enumerate(gen):
                    g = t.grad if isinstance(t, torch.Tensor) else None
                    if g is not None:
                        out[k] = g if out[k] is None else out[k] + g
                        t.grad = None
            return out
        reduced: set[int] = set()

        inputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        outbox: dict[tuple[ActionKind, int, int], list[torch.Tensor]] = {}
        saved: dict[tuple[int, int], _Saved] = {}
        losses: list[torch.Tensor] = []
        auxes: list[Any] = []
        pending: list = []

        def backward(s: int, i: int, *, want_dx: bool, want_dw: bool) -> None:
            sv = saved[(s, i)]
            outs, gouts = [], []
            for k, y in enumerate(sv.outputs):
                if y.requires_grad:
                    outs.append(y)
                    gouts.append(None if sv.out_grads is None else sv.out_grads[k])
            dx_inputs = sv.inputs if want_dx else []
            ks = sv.param_pos
            p_inputs = [sv.params[k] for k in ks]
            dx: list[torch.Tensor | None] = []
            dw: Sequence[torch.Tensor | None] = []
            if want_dx and want_dw:  # BW: one pass; the weight gradients accumulate in the leaves' .grad
                targets = dx_inputs + p_inputs
                if outs and targets:
                    # A closed stage's graph ends at its own fresh leaves (parameters and inputs, every one a
                    # target), so naming them changes nothing but costs the engine a marking pass over the
                    # graph and a lookup per node (1-2% of a Qwen3 stage's backward); see ``closed`` above.
                    torch.autograd.backward(outs, grad_tensors=gouts, inputs=None if closed else targets)
                    dx = [x.grad for x in dx_inputs]
            elif want_dx:  # B: dx, keeping the gradients at the parameters' use sites for W
                dx, sv.weight_state = backward_input(outs, gouts, dx_inputs, p_inputs)
            elif sv.weight_state is not None:  # W: weight gradients only, from what B kept
                dw = backward_weight(sv.weight_state)
                sv.weight_state = None
            if want_dx and s > 0:
                dx = [torch.zeros_like(x) if g is None else g for x, g in zip(sv.inputs, dx)]
                if sched.stage_to_rank[s - 1] == self.pp_index:
                    saved[(s - 1, i)].out_grads = dx
                else:
                    outbox[(K.SEND_B, s, i)] = dx
            if want_dw:
                if p_inputs:
                    acc, own = grads[s], owned[s]
                    for k, g in zip(ks, dw):
                        if g is None:
                            continue
                        if acc[k] is None:
                            acc[k] = g
                        elif own[k]:
                            acc[k].add_(g)
                        else:
                            acc[k], own[k] = acc[k] + g, True
                del saved[(s, i)]
            else:
                sv.done_b = True

        def forward(s: int, i: int, where: Any) -> None:
            # A function, so that no local (the outputs, the inputs) outlives the action: a
            # loop variable would keep this microbatch's graph alive until the next forward.
            if s not in live:
                raise PipelineError(f"{where}: stage {s} is used while its parameters are not gathered (UNSHARD)")
            if s == 0:
                x = mbs[i] if self.first_input is None else self.first_input(mbs[i])
                diff_inputs: list[torch.Tensor] = []
            else:
                raw = inputs.pop((s, i))
                xs = tuple(t.detach().requires_grad_(_is_diff(t)) for t in raw)
                diff_inputs = [t for t in xs if _is_diff(t)]
                x = xs[0] if len(xs) == 1 else xs
            p_tree = live_trees[s]
            swap = None
            if (s, i) in self._swapped:
                # Parameters, the batch and the stage inputs are held by the step: never copied.
                swap = ActivationSwap(list(live[s]) + _tree.leaves(mbs[i]) +
                                      (list(xs) if s > 0 else []))
            with torch.enable_grad(), (saved_tensors.layer(swap) if swap is not None else contextlib.nullcontext()):
                if self.with_microbatch:
                    y = self.stage_fns[s](p_tree, None if s == 0 else x, mbs[i])
                else:
                    y = self.stage_fns[s](p_tree, x)
                if s == last:
                    if self.with_microbatch:
                        value, aux = self.loss_fn(p_tree, y, mbs[i])
                        auxes.append(aux)
                    else:
                        value = self.loss_fn(y, mbs[i])
                    if not isinstance(value, torch.Tensor) or value.numel() != 1:
                        raise PipelineError(f"{where}: loss_fn must return a scalar tensor, found "
                                            f"{type(value).__name__}")
                    value = value.reshape(())
                    losses.append(value.detach())
                    outs = [value * (self.loss_scale / m)]
            if s != last:
                ys = _as_tuple(y, where)
                outs = [t for t in ys if _is_diff(t)]
                if sched.stage_to_rank[s + 1] == self.pp_index:
                    inputs[(s + 1, i)] = tuple(t.detach() for t in ys)
                else:
                    outbox[(K.SEND_F, s, i)] = [t.detach() for t in ys]
            saved[(s, i)] = _Saved(diff_inputs, outs, live[s], diff_pos[s], swap)

        # Receives are posted as early as their buffers are known, so that the transfer runs while this
        # rank computes other microbatches: a gradient's as soon as the forward made the outputs it
        # mirrors; in the front door's mode (microbatches of one shape) every later forward input of a
        # stage once the first one told the shapes. Each is waited for where the schedule puts it.
        recv_b = {(a.stage, a.microbatch): a for a in self.actions if a.kind is K.RECV_B}
        recv_f: dict[int, list] = {}
        for a in self.actions:
            if a.kind is K.RECV_F:
                recv_f.setdefault(a.stage, []).append(a)
        posted: dict[tuple, _PendingRecv] = {}
        computes = (K.F, K.B, K.W, K.BW)

        for step, a in enumerate(self.actions):
            kind, s, i = a.kind, a.stage, a.microbatch
            where = _Where(self.pp_index, step, a)
            if kind in computes:
                _event("start", a)
            if kind is K.F:
                forward(s, i, where)
                rb = recv_b.get((s, i))
                if rb is not None and (s, i) in saved:
                    posted[(K.RECV_B, s, i)] = self._post_recv(rb, saved[(s, i)].outputs)
            elif kind is K.SEND_F:
                tensors = outbox.pop((K.SEND_F, s, i))
                self._send(tensors, a, pending, header=self._forward_header(tensors, a, mbs[i]))
                del tensors
            elif kind is K.RECV_F:
                got = posted.pop((K.RECV_F, s, i), None) or self._post_forward_recv(a, None, mbs[i])
                got = tuple(got.wait())
                inputs[(s, i)] = got
                like = [(tuple(t.shape), t.dtype) for t in got]
                self._boundary.setdefault(self._boundary_key(s - 1, i, mbs[i]), like)
                if self.with_microbatch and recv_f.get(s) and recv_f[s][0] is a:
                    for later in recv_f[s][1:]:
                        j = later.microbatch
                        posted[(K.RECV_F, s, j)] = self._post_forward_recv(later, like, mbs[j])
            elif kind is K.SEND_B:
                self._send(outbox.pop((K.SEND_B, s, i)), a, pending, header=False)
            elif kind is K.RECV_B:
                got = posted.pop((K.RECV_B, s, i), None)
                saved[(s, i)].out_grads = (got or self._post_recv(a, saved[(s, i)].outputs)).wait()
            elif kind is K.B:
                if saved[(s, i)].done_b:
                    raise PipelineError(f"{where}: second B for stage {s} microbatch {i}")
                backward(s, i, want_dx=True, want_dw=False)
            elif kind is K.W:
                # (no local names the record: it would keep the graph alive after W deletes it)
                if (s, i) not in saved or not saved[(s, i)].done_b:
                    raise PipelineError(f"{where}: W before the B of stage {s} microbatch {i}")
                backward(s, i, want_dx=False, want_dw=True)
            elif kind is K.BW:
                backward(s, i, want_dx=True, want_dw=True)
            elif kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD) and not self.fsdp:
                pass
            elif kind is K.UNSHARD:
                make_live(s, _tree.leaves(self._unshard(_tree.unflatten(specs[s], stored[s]))))
            elif kind is K.RESHARD:
                live.pop(s, None)
                live_trees.pop(s, None)
            elif kind is K.REDUCE_GRAD:
                grads[s] = [None if g is None else self._reduce_grad_shard(g) for g in collect(s)]
                reduced.add(s)
            elif kind in (K.SWAP_OUT, K.SWAP_IN):
                rec = saved.get((s, i))
                if rec is None or rec.swap is None:
                    raise PipelineError(f"{where}: nothing to swap: stage {s} microbatch {i} has no forward pending "
                                        f"on this rank (SWAP_OUT/SWAP_IN go between F and its backward)")
                if kind is K.SWAP_OUT:
                    # The outputs stay: the step holds them (backward roots, send buffers) anyway.
                    rec.swap.swap_out(keep=rec.outputs)
                else:
                    rec.swap.swap_in()
                del rec
            else:  # pragma: no cover - every kind is handled above
                raise PipelineError(f"{where}: unsupported action kind {kind}")
            if kind in computes:
                _event("end", a)
        if posted:  # pragma: no cover - every posted receive has its RECV action
            raise PipelineError(f"pp rank {self.pp_index}: receives posted but never waited for: {sorted(posted)}")
        for w in pending:
            w.wait()
        if saved:
            left = ", ".join(f"{s}:{i}" for s, i in sorted(saved))
            raise PipelineError(f"pp rank {self.pp_index}: schedule ended with backward work left for (stage:mb) {left}")

        # Gradients: zeros where unused; data-parallel mean for stages not reduced by REDUCE_GRAD.
        out: dict[int, Any] = {}
        for s in self.local_stages:
            ref = stored[s]
            if self.fsdp and s not in reduced:
                raise PipelineError(f"pp rank {self.pp_index}: stage {s} never got its REDUCE_GRAD")
            gs = []
            for x, g in zip(ref, grads[s] if s in reduced else collect(s)):
                if not isinstance(x, torch.Tensor):
                    gs.append(x)
                    continue
                if g is None:
                    g = torch.zeros_like(x)
                if self.data_axis is not None and s not in reduced:
                    g = g.contiguous().clone()
                    dist.all_reduce(g, group=self.mesh.group(self.data_axis))
                    g.div_(self.mesh.axis_size(self.data_axis))
                gs.append(g)
            out[s] = _tree.unflatten(specs[s], gs)
        return losses, auxes, out


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
