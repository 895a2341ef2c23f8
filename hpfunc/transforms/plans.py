"""Parallelism plans: per parameter, where it is stored, how it is used, and where its optimizer state lives.

A :class:`Plan` resolves, for every parameter path of a model, a :class:`~hpfunc.layout.LeafLayout`: a
:class:`~hpfunc.layout.LeafSpec` of three partition specs (the haliax/levanter "parameter mapping vs
compute mapping", plus ZeRO's optimizer mapping) checked against the parameter's shape:

``storage``  the parameter at rest (the DTensor the step takes and returns);
``compute``  the block the model sees inside the step; on every dimension it is a *prefix* of
             ``storage`` and the remaining axes are all-gathered before use (FSDP / ZeRO-3);
``opt``      the optimizer-state block; on every dimension ``storage`` is a prefix of it and the extra
             axes are those ZeRO-1/2 shard the optimizer state (and the reduced gradient) over.

Plans are built from layers that compose left to right on N-D meshes::

    plan = fsdp("fsdp") + tp("tp", qwen3.parallel_plan.tp_styles(cfg))  # FSDP x Megatron TP
    plan = hsdp("dp", "fsdp")                                   # = ddp("dp") + fsdp("fsdp")
    plan = zero2("dp")                                          # params replicated, grads/opt sharded
    plan = fsdp("fsdp") + ep("ep", qwen3.parallel_plan.ep_experts(cfg))  # experts split over ep
    plan = fsdp("fsdp") + cp("cp", impl="ring")                 # each sequence split over cp

and explicit rules on dotted paths (glob or ``re:``) that override the layers::

    plan = fsdp("fsdp").with_rules([("embed", LeafSpec(P("fsdp"), P(), P("fsdp")))])

The batch is split along dimension 0 over the plan's data axes (every ``ddp``/``fsdp``/``zero``/``ep``
axis, in mesh order); a ``cp`` layer splits each sequence along its length inside the model
(:mod:`hpfunc.transforms.context_parallel_plan`). Errors are ``PlanError`` (a ``ValueError``) naming the path, axis or size.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import torch

from hpfunc import tree as _tree
from hpfunc.layout import (ColwiseParallel, ContextParallel, LeafLayout, LeafSpec, PlanError, Replicate,
                           RowwiseParallel, SequenceParallel, Style, VocabParallel, check_sequence)
from hpfunc.mesh import Mesh
from hpfunc.sharding import P, _rule_matches
from hpfunc.transforms.context_parallel_plan import ContextParallelLayer

__all__ = ["PlanError", "LeafSpec", "LeafLayout", "Plan", "ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp", "tp", "ep", "pp",
           "cp",
           "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallel", "Replicate", "Style"]


def _dims(spec: P, ndim: int) -> list[tuple[str, ...]]:
    return [spec.dim_axes(d) for d in range(ndim)]


def _to_spec(dims: Sequence[tuple[str, ...]]) -> P:
    dims = list(dims)
    while dims and not dims[-1]:
        dims.pop()
    return P(*[d if d else None for d in dims])


# ---------------------------------------------------------------------------------------------
# Layers


@attrs.frozen
class _Layer:
    kind: str  # "ddp" | "fsdp" | "zero" | "tp" | "ep"
    axis: str
    stage: int = 3  # zero stage for kind == "zero" (1 or 2) / fsdp (3)
    styles: tuple[tuple[str, Style], ...] = ()  # tp: (path pattern, style), first match wins
    experts: tuple[str, ...] = ()  # ep: path patterns of the expert stacks [E, ...]

    @property
    def is_data(self) -> bool:
        return self.kind in ("ddp", "fsdp", "zero", "ep")

    def is_expert(self, path: str) -> bool:
        """ep: ``path`` is an expert stack, split on dimension 0 (in storage and in use)."""
        return self.kind == "ep" and any(_rule_matches(pat, path) for pat in self.experts)

    def fixes_compute(self, path: str) -> bool:
        """The layer decides how ``path`` is used (its compute spec), so it applies before the data layers."""
        return self.kind == "tp" or self.is_expert(path)

    @property
    def vocab(self) -> bool:
        """tp: the embedding / head are split by vocabulary rows (the model's lookup and loss change)."""
        return any(isinstance(st, VocabParallel) for _, st in self.styles)

    @property
    def sequence(self) -> bool:
        """tp: activations between blocks are split along the sequence (Megatron-SP)."""
        return any(isinstance(st, SequenceParallel) for _, st in self.styles)

    def describe(self) -> str:
        return f"{self.kind}({self.axis!r})"

    def style_for(self, path: str) -> tuple[str, Style] | None:
        for pat, st in self.styles:
            if _rule_matches(pat, path):
                return pat, st
        return None


def _free_dim(shape: tuple[int, ...], dims: list[tuple[str, ...]], axis: str, mesh: Mesh) -> int | None:
    """The dimension to shard over one more axis: first an unsharded dim that divides, then a sharded dim
    whose blocks still divide and whose axes all precede ``axis`` in the mesh (DTensor splits a
    dimension over several axes in mesh order only)."""
    n = mesh.axis_size(axis)
    for d, size in enumerate(shape):
        if not dims[d] and size % n == 0 and size >= n:
            return d
    order = mesh.axis_names
    for d, size in enumerate(shape):
        k = mesh.axis_size(dims[d]) if dims[d] else 1
        if dims[d] and size % (k * n) == 0 and all(order.index(a) < order.index(axis) for a in dims[d]):
            return d
    return None


def _apply_layer(layer: _Layer, path: str, shape: tuple[int, ...], spec: LeafSpec, mesh: Mesh) -> LeafSpec:
    n = mesh.axis_size(layer.axis)
    nd = len(shape)
    st, cp, op = _dims(spec.storage, nd), _dims(spec.compute, nd), _dims(spec.opt, nd)
    if layer.kind == "ddp" or n == 1:
        return spec
    if layer.is_expert(path):  # expert parallelism: this rank holds and computes E / n experts
        if not shape or shape[0] % n:
            raise PlanError(f"{layer.describe()} splits the experts of {path!r} (dimension 0, "
                            f"{shape[0] if shape else 0} experts) {n} ways; the number of experts must be a "
                            f"multiple of the {layer.axis!r} axis size {n}")
        for dims in (st, cp, op):
            dims[0] = dims[0] + (layer.axis,)
        return LeafSpec(_to_spec(st), _to_spec(cp), _to_spec(op))
    if layer.kind == "tp":
        found = layer.style_for(path)
        if found is None:
            return spec
        pattern, style = found
        try:
            d = style.shard_dim(nd)
        except ValueError as e:
            raise PlanError(f"{layer.describe()} style for {pattern!r} does not fit {path!r} of shape "
                            f"{shape}: {e}") from None
        if d is None:
            return spec
        # a style may split in whole units (attention projections by heads: the model derives head
        # counts from the shapes)
        unit = style.unit
        if shape[d] % (n * unit):
            what = f"{shape[d] // unit} {style.unit_name} of {unit}" if unit > 1 else f"size {shape[d]}"
            raise PlanError(f"{layer.describe()} of size {n} must divide dimension {d} of {path!r} "
                            f"({what}); choose a tp degree that divides it")
        for dims in (st, cp, op):
            dims[d] = dims[d] + (layer.axis,)
        return LeafSpec(_to_spec(st), _to_spec(cp), _to_spec(op))
    # the dim must be free in the optimizer layout (a superset of storage): after a zero layer, fsdp then
    # shards another dimension, or stacks on the zero one only in storage-first order (opt extends storage)
    d = _free_dim(shape, op, layer.axis, mesh)
    if d is None:
        return spec  # nothing divides: this leaf stays replicated on the axis (listed by Plan.describe)
    if layer.kind in ("fsdp", "ep"):  # ep shards the parameters that are not experts as fsdp does
        if any(a not in st[d] for a in op[d]):
            return spec  # only a zero-sharded dim left: stacking fsdp under it breaks "opt extends storage"
        st[d] = st[d] + (layer.axis,)
        op[d] = st[d]
        return LeafSpec(_to_spec(st), _to_spec(cp), _to_spec(op))
    op[d] = op[d] + (layer.axis,)  # zero 1/2: only the optimizer state (and reduced grads)
    return LeafSpec(spec.storage, spec.compute, _to_spec(op))


# ---------------------------------------------------------------------------------------------
# Plan


@attrs.frozen
class Plan:
    """Layers (applied in order) plus explicit path rules (first match wins, override the layers).

    Args:
        layers: from the factories :func:`ddp`, :func:`fsdp`, :func:`zero1`, :func:`zero2`, :func:`tp`.
        rules: ``(pattern, LeafSpec | P)`` pairs; a bare ``P`` is used for storage, compute and opt.
        reshard_after_forward: FSDP frees each gathered parameter after its use in the forward and
            gathers it again in the backward (3 Psi communication instead of 2 Psi, lower peak memory).
        param_dtype: mixed precision: floating parameters are cast to this dtype for use (before the
            FSDP all-gather, which then moves half the bytes for bf16); storage, gradients and optimizer
            state keep the storage dtype. ``None``: used as stored. See :meth:`with_mixed_precision`.
        reduce_dtype: the dtype gradient reductions run in (reduce-scatter and all-reduce); ``None``:
            ``param_dtype`` for the FSDP reduce-scatter (its all-gather's transpose), the gradient's
            dtype for the rest.
        gradient_scaling_factor: the gradient is ``factor * sum over data shards`` of the per-shard
            loss's gradient; ``None`` is ``1 / data ranks``, the mean (see
            :meth:`with_gradient_scaling_factor`).
    """

    layers: tuple[_Layer, ...] = ()
    rules: tuple[tuple[str, LeafSpec], ...] = ()
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    gradient_scaling_factor: float | None = None
    pipeline: Any = None  # a PipelineLayer (hpfunc.transforms.pipeline_plan), from pp(...)
    sdc_check: str | None = None
    context: Any = None  # a ContextParallelLayer (hpfunc.transforms.context_parallel_plan), from cp(...)
    state_offload: tuple[str, ...] = ()  # what is kept in host memory between steps ("optimizer")
    offload_group_bytes: int | None = None  # the optimizer state an update streams at once (None: the default)
    offload_layers: Any = None  # with "params": the parameters kept in host memory (a regex or a predicate; None: all)
    bucket_cap_bytes: int | None = None  # the gradient all-reduce buckets' cap (None: overlap.BUCKET_CAP_BYTES)

    def __add__(self, other: "Plan") -> "Plan":
        def one(name: str) -> Any:
            a, b = getattr(self, name), getattr(other, name)
            if a is not None and b is not None and a != b:
                raise PlanError(f"plans combined with +: {name} {a} on the left, {b} on the right; set it once")
            return a if a is not None else b

        if self.pipeline is not None and other.pipeline is not None:
            raise PlanError(f"a plan takes one pipeline layer; found pp({self.pipeline.axis!r}) and "
                            f"pp({other.pipeline.axis!r})")
        if self.context is not None and other.context is not None:
            raise PlanError(f"a plan takes one context-parallel layer; found {self.context.describe()} and "
                            f"{other.context.describe()} (for two axes use impl='hybrid' with ulysses_axis=)")
        return Plan(self.layers + other.layers, self.rules + other.rules,
                    self.reshard_after_forward and other.reshard_after_forward,
                    one("param_dtype"), one("reduce_dtype"), one("gradient_scaling_factor"),
                    self.pipeline if self.pipeline is not None else other.pipeline, one("sdc_check"),
                    self.context if self.context is not None else other.context,
                    tuple(dict.fromkeys(self.state_offload + other.state_offload)), one("offload_group_bytes"),
                    one("offload_layers"), one("bucket_cap_bytes"))

    def with_mixed_precision(self, param_dtype: torch.dtype | None = torch.bfloat16,
                             reduce_dtype: torch.dtype | None = torch.float32) -> "Plan":
        """Compute in ``param_dtype`` (the FSDP all-gather moves it), reduce gradients in ``reduce_dtype``;
        parameters, gradients and optimizer state stay in their storage dtype (fp32 master weights).

        >>> fsdp("fsdp").with_mixed_precision().param_dtype
        torch.bfloat16
        """
        for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise PlanError(f"with_mixed_precision: {name} must be a floating torch.dtype or None, found {dt!r}")
        return attrs.evolve(self, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def with_gradient_scaling_factor(self, factor: float | None) -> "Plan":
        """Gradients are ``factor`` times the sum over data shards of each shard loss's gradient
        (``None``: the mean, ``1 / data ranks``). ``1.0`` sums, for losses that are per-shard sums
        normalised elsewhere (e.g. by a global token count).

        >>> fsdp("fsdp").with_gradient_scaling_factor(1.0).gradient_scaling_factor
        1.0
        """
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise PlanError(f"with_gradient_scaling_factor: factor must be a finite number > 0 or None, found {factor!r}")
        return attrs.evolve(self, gradient_scaling_factor=None if factor is None else float(factor))

    def with_sdc_check(self, policy: str | None = "raise") -> "Plan":
        """Check every step that the replicas of each reduced gradient block are bitwise equal (silent data
        corruption): one all_gather of an int64 checksum per parameter; a mismatch names the step, the
        parameter and the rank(s) and raises :class:`~hpfunc.transforms.engine.sdc.SDCError`
        (``"raise"``) or warns (``"warn"``); ``None`` turns it off. See :mod:`hpfunc.transforms.engine.sdc`.

        >>> ddp("dp").with_sdc_check().sdc_check
        'raise'
        """
        from hpfunc.transforms.engine.sdc import POLICIES

        if policy is not None and policy not in POLICIES:
            raise PlanError(f"with_sdc_check: policy must be one of {', '.join(map(repr, POLICIES))} or None, "
                            f"found {policy!r}")
        return attrs.evolve(self, sdc_check=policy)

    def with_state_offload(self, *what: str, group_bytes: int | None = None, layers: Any = None) -> "Plan":
        r"""Keep the named state in host memory between steps (selective state offload).

        ``"optimizer"``: every optimizer-state leaf laid out like a parameter (AdamW's moments, Muon's
        momentum) rests in host memory (pinned where the device is CUDA) between steps and reaches the
        step there; :func:`hpfunc.optim.update_and_apply` streams it through the device for the update
        by groups of leaves of at most ``group_bytes`` bytes (default
        :data:`hpfunc.transforms.state_offload.GROUP_BYTES`, 64 MiB; ``0``: leaf by leaf), the next group
        copied in while one is updated and each copied back as soon as it is, so that about two groups
        are on the device at once (AdamW's kernel path; another update brings the whole state in). The
        values are those of the same plan without offload, bit for bit; the forward and backward run
        without the optimizer state on the device. Scalar counters stay on the device.

        ``"params"``: the parameters ``layers`` selects (a regular expression matched at the start of the
        dotted parameter path, ``r"layers\.[0-3]\."``, or a predicate on that path; ``None``: every
        parameter) rest in host memory between steps, as DTensors of their planned layout with host
        blocks. The step brings each layer's blocks to the device right before its all-gather (one layer
        copied ahead, in the order the first run recorded), drops the device copy after the gather, copies
        it in again for the backward's re-gather, and the update streams them through the device with the
        moments (the new parameters leave the step in host memory). Not under a ``pp`` or ZeRO layer.
        See :mod:`hpfunc.transforms.state_offload`.

        >>> fsdp("fsdp").with_state_offload("optimizer").state_offload
        ('optimizer',)
        >>> fsdp("fsdp").with_state_offload("params", layers=r"layers\.0\.").offload_layers
        'layers\\.0\\.'
        """
        from hpfunc.transforms.state_offload import check_group_bytes, check_kinds, check_layers

        kinds = check_kinds(what, "with_state_offload")
        return attrs.evolve(self, state_offload=kinds,
                            offload_group_bytes=check_group_bytes(group_bytes, "with_state_offload"),
                            offload_layers=check_layers(layers, kinds, "with_state_offload"))

    def with_bucket_cap(self, cap_bytes: int | None) -> "Plan":
        """Pack the gradient all-reduces started during the backward (DDP, HSDP's replicate axis, parameters
        replicated over TP) into buckets of whole layers of up to ``cap_bytes`` bytes each (DDP's
        ``bucket_cap_mb``): consecutive layers, in the order the backward finishes them, share one bucket
        while their gradients fit; a layer larger than the cap is a bucket of its own (a layer is never
        split). ``None``: :data:`hpfunc.transforms.engine.overlap.BUCKET_CAP_BYTES` (25 MiB, DDP's
        default); ``0``: one bucket per layer. Fewer buckets are fewer collectives (each a round trip,
        host time on gloo); smaller ones start earlier in the backward. The bytes sent and the values are
        the same for every cap. See :mod:`hpfunc.transforms.engine.overlap`.

        >>> ddp("dp").with_bucket_cap(0).bucket_cap_bytes
        0
        """
        if cap_bytes is not None and not (isinstance(cap_bytes, int) and not isinstance(cap_bytes, bool)
                                          and cap_bytes >= 0):
            raise PlanError(f"with_bucket_cap: cap_bytes must be an int >= 0 (bytes; 0: one bucket per layer) or "
                            f"None (the default, 25 MiB), found {cap_bytes!r}")
        return attrs.evolve(self, bucket_cap_bytes=cap_bytes)

    def with_rules(self, rules: Sequence[tuple[str, Any]]) -> "Plan":
        conv = tuple((pat, sp if isinstance(sp, LeafSpec) else LeafSpec.of(sp)) for pat, sp in rules)
        return attrs.evolve(self, rules=self.rules + conv)

    @property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(l.axis for l in self.layers if l.is_data))

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every axis the step's tokens are split over: the data axes (along the batch) and the
        context-parallel axes (along the sequence). Batch statistics are pooled over them."""
        return self.data_axes + (() if self.context is None else self.context.token_axes)

    @property
    def cp_binding(self) -> Any:
        """The :class:`hpfunc.layout.ContextParallel` of the plan's ``cp`` layer, or ``None``."""
        return None if self.context is None else self.context.binding

    @property
    def tp_axis(self) -> str | None:
        axes = [l.axis for l in self.layers if l.kind == "tp"]
        return axes[0] if axes else None

    @property
    def ep_axis(self) -> str | None:
        """The expert-parallel axis (experts split over it; it is a data axis too), or ``None``."""
        axes = [l.axis for l in self.layers if l.kind == "ep"]
        return axes[0] if axes else None

    @property
    def pp_axis(self) -> str | None:
        """The pipeline axis (stages placed over it), or ``None``."""
        return None if self.pipeline is None else self.pipeline.axis

    def pipeline_schedule(self, mesh: Mesh) -> Any:
        """The pipeline's :class:`~hpfunc.schedules.Schedule` on ``mesh`` (``None`` without a ``pp`` layer)."""
        return None if self.pipeline is None else self.pipeline.schedule(mesh.axis_size(self.pipeline.axis))

    def local_stages(self, mesh: Mesh) -> tuple[int, ...] | None:
        """The pipeline stages this process's rank holds (``None`` without a ``pp`` layer)."""
        if self.pipeline is None:
            return None
        return self.pipeline_schedule(mesh).stages_of(mesh.axis_index(self.pipeline.axis))

    def local_params(self, tree: Any, mesh: Mesh) -> Any:
        """``tree`` (parameters or their shapes) with the leaves this rank's pipeline stages do not hold
        set to ``None``; ``tree`` itself without a ``pp`` layer."""
        if self.pipeline is None:
            return tree
        return self.pipeline.local(tree, self.local_stages(mesh))

    @property
    def tp_vocab_parallel(self) -> bool:
        """The embedding and head are split by vocabulary rows over :attr:`tp_axis`."""
        return any(l.kind == "tp" and l.vocab for l in self.layers)

    @property
    def tp_sequence_parallel(self) -> bool:
        """Activations between blocks are split along the sequence over :attr:`tp_axis` (Megatron-SP)."""
        return any(l.kind == "tp" and l.sequence for l in self.layers)

    def check_batch(self, batch: Any, mesh: Mesh) -> None:
        """Raise :class:`PlanError`, before any communication, for a batch the plan cannot split evenly:
        dimension 0 of every tensor leaf over the data axes and, with sequence parallelism, dimension 1
        (the sequence) of every leaf of rank >= 2 over the tensor-parallel axis."""
        axes = self.batch_spec(mesh).dim_axes(0)
        n = mesh.axis_size(axes) if axes else 1
        # under context parallelism the sequence-parallel axis splits each cp rank's tokens (checked by the cp layer)
        tp = self.tp_axis if self.tp_sequence_parallel and self.context is None else None
        for path, x in _tree.leaves_with_paths(batch):
            if not isinstance(x, torch.Tensor):
                continue
            if x.ndim == 0 or x.shape[0] % n:
                raise PlanError(f"batch leaf {path!r} of shape {tuple(x.shape)}: dimension 0 must divide evenly "
                                f"over the data axes {axes} ({n} ranks)")
            if tp is not None:
                check_sequence(x, path, tp, mesh.axis_size(tp))
            if self.context is not None:
                self.context.check_batch({path: x}, mesh, self.tp_axis if self.tp_sequence_parallel else None)
            m = 1 if self.pipeline is None else self.pipeline.microbatches
            if m > 1 and (x.shape[0] // n) % m:
                raise PlanError(f"batch leaf {path!r} of shape {tuple(x.shape)}: each data shard's {x.shape[0] // n} "
                                f"rows do not split into pp microbatches={m}; make the batch size a multiple of "
                                f"{n * m} (data ranks x microbatches)")

    def batch_spec(self, mesh: Mesh) -> P:
        """Dimension 0 of every batch leaf split over the data axes (mesh order)."""
        axes = tuple(a for a in mesh.axis_names if a in self.data_axes)
        return P(axes) if axes else P()

    def check_mesh(self, mesh: Mesh) -> None:
        if self.pipeline is not None:
            pa = self.pipeline.axis
            if pa not in mesh.axis_names:
                raise PlanError(f"plan layer pp({pa!r}) names mesh axis {pa!r}, which the mesh does not have; mesh "
                                f"axes are {mesh.axis_names}")
            if any(l.axis == pa for l in self.layers):
                raise PlanError(f"mesh axis {pa!r} is the pipeline axis and also used by "
                                f"{next(l.kind for l in self.layers if l.axis == pa)}; give each its own axis")
            self.pipeline.schedule(mesh.axis_size(pa))  # the schedule fits the axis and the stages
            if self.sdc_check is not None:
                raise PlanError("with_sdc_check and a pp layer: the SDC check gathers one checksum per parameter "
                                "over the whole mesh, and pipeline ranks hold different parameters; not supported "
                                "yet (drop the SDC check for pipelined runs)")
        for l in self.layers:
            if l.axis not in mesh.axis_names:
                raise PlanError(f"plan layer {l.kind}({l.axis!r}) names mesh axis {l.axis!r}, which the mesh "
                                f"does not have; mesh axes are {mesh.axis_names}")
        tps = [l for l in self.layers if l.kind == "tp"]
        if len(tps) > 1:
            raise PlanError(f"a plan takes one tensor-parallel layer; found {', '.join(l.describe() for l in tps)} "
                            f"(options such as vocab_parallel / sequence_parallel go on the one layer)")
        eps = [l for l in self.layers if l.kind == "ep"]
        if len(eps) > 1:
            raise PlanError(f"a plan takes one expert-parallel layer; found {', '.join(l.describe() for l in eps)} "
                            f"(split the experts over one mesh axis)")
        seen: dict[str, str] = {}
        for l in self.layers:
            if l.axis in seen and seen[l.axis] != l.kind:
                raise PlanError(f"mesh axis {l.axis!r} is used by both {seen[l.axis]} and {l.kind}")
            seen[l.axis] = l.kind
        if self.context is not None:
            if self.pipeline is not None:
                seen.setdefault(self.pipeline.axis, "pp")
            self.context.check_mesh(mesh, seen)
        for pat, ls in self.rules:
            for sp in (ls.storage, ls.compute, ls.opt):
                for a in sp.axes:
                    if a not in mesh.axis_names:
                        raise PlanError(f"plan rule {pat!r} names mesh axis {a!r}, which the mesh does not "
                                        f"have; mesh axes are {mesh.axis_names}")

    def resolve(self, params: Any, mesh: Mesh) -> dict[str, LeafLayout]:
        """``{path: LeafLayout}`` for every tensor leaf of ``params`` (tensors or shapes)."""
        self.check_mesh(mesh)
        shapes = {p: tuple(x.shape if isinstance(x, torch.Tensor) else x)
                  for p, x in _tree.leaves_with_paths(params, is_leaf=lambda x: isinstance(x, torch.Size))}
        if self.pipeline is not None:
            self.pipeline.check_paths(list(shapes))
        used = {pat: False for pat, _ in self.rules}
        out = {}
        for path, shape in shapes.items():
            explicit = None
            for pat, ls in self.rules:
                if _rule_matches(pat, path):
                    used[pat] = True
                    explicit = ls
                    break
            if explicit is None:
                spec = LeafSpec()
                # tensor and expert parallelism fix the compute layout first; data layers shard what is left
                for layer in sorted(self.layers, key=lambda l: not l.fixes_compute(path)):
                    spec = _apply_layer(layer, path, shape, spec, mesh)
            else:
                spec = explicit
            out[path] = _check_leaf(path, shape, spec, mesh)
            if self.pipeline is not None and not self.pipeline.is_shared(path):
                # held by one stage's ranks: not a replica over the pipeline axis (a shared leaf is one,
                # and its per-stage gradients are summed over it like any replica's)
                pa = self.pipeline.axis
                out[path] = attrs.evolve(out[path], stage_axis=pa,
                                         replicated=tuple(a for a in out[path].replicated if a != pa))

        for layer in self.layers:  # a style pattern that matches nothing is a typo (or the wrong model's table)
            for pat in [pat for pat, _ in layer.styles] + list(layer.experts):
                used.setdefault(pat, any(_rule_matches(pat, p) for p in shapes))
        unused = [pat for pat, u in used.items() if not u]
        if unused:
            import difflib

            close = difflib.get_close_matches(unused[0], list(shapes), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PlanError(f"plan rule or style {unused[0]!r} matches no parameter path{hint}; "
                            f"paths look like {list(shapes)[:3]}")
        return out

    def describe(self, params: Any, mesh: Mesh) -> str:
        """One line per parameter: ``path shape storage -> compute | opt``."""
        rows = []
        for path, r in self.resolve(params, mesh).items():
            rows.append(f"{path:40s} {list(r.shape)!s:16s} {r.spec.storage!r} -> {r.spec.compute!r} | opt "
                        f"{r.spec.opt!r}")
        return "\n".join(rows)


def _check_leaf(path: str, shape: tuple[int, ...], spec: LeafSpec, mesh: Mesh) -> LeafLayout:
    nd = len(shape)
    for name in ("storage", "compute", "opt"):
        sp = getattr(spec, name)
        try:
            sp.check(mesh, nd, where=path)
        except ValueError as e:
            raise PlanError(f"{name} spec of {path!r}: {e}") from None
        for d in range(nd):
            k = mesh.axis_size(sp.dim_axes(d)) if sp.dim_axes(d) else 1
            if shape[d] % k:
                raise PlanError(f"{name} spec {sp!r} of {path!r} splits dimension {d} of size {shape[d]} over "
                                f"{k} ranks (axes {sp.dim_axes(d)}); it must divide evenly")
    st, cp, op = _dims(spec.storage, nd), _dims(spec.compute, nd), _dims(spec.opt, nd)
    gather, extra = [], []
    for d in range(nd):
        if st[d][: len(cp[d])] != cp[d]:
            raise PlanError(f"compute spec {spec.compute!r} of {path!r} must be a prefix of its storage spec "
                            f"{spec.storage!r} on dimension {d} (compute blocks are gathered from storage blocks)")
        if op[d][: len(st[d])] != st[d]:
            raise PlanError(f"opt spec {spec.opt!r} of {path!r} must extend its storage spec {spec.storage!r} "
                            f"on dimension {d}")
        if len(st[d]) > len(cp[d]):
            gather.append((d, st[d][len(cp[d]):]))
        if len(op[d]) > len(st[d]):
            extra.append((d, op[d][len(st[d]):]))
    if set(spec.storage.axes) - set(spec.opt.axes):
        raise PlanError(f"opt spec of {path!r} drops axes of its storage spec")
    replicated = tuple(a for a in mesh.axis_names if a not in spec.storage.axes and mesh.axis_size(a) > 1)
    return LeafLayout(path, shape, spec, tuple(gather), tuple(extra), replicated)


# ---------------------------------------------------------------------------------------------
# Ready-made plans


def ddp(axis: str = "dp") -> Plan:
    """Data parallel: parameters, gradients and optimizer state replicated; gradients all-reduced."""
    return Plan((_Layer("ddp", axis),))


def fsdp(axis: str = "fsdp", *, reshard_after_forward: bool = True) -> Plan:
    """Fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state sharded on
    ``axis`` (first dimension that divides), all-gathered per use in the forward."""
    return Plan((_Layer("fsdp", axis, 3),), reshard_after_forward=reshard_after_forward)


zero3 = fsdp


def zero1(axis: str = "dp") -> Plan:
    """ZeRO-1: parameters replicated, optimizer state sharded; gradients reduce-scattered (each rank
    keeps the block its optimizer shard needs) and updated parameters all-gathered."""
    return Plan((_Layer("zero", axis, 1),))


def zero2(axis: str = "dp") -> Plan:
    """ZeRO-2: as :func:`zero1` with the gradients stored sharded too. Without gradient accumulation
    (one backward per step) ZeRO-1 and ZeRO-2 run the same collectives here."""
    return Plan((_Layer("zero", axis, 2),))


def hsdp(replicate_axis: str = "dp", shard_axis: str = "fsdp", *, reshard_after_forward: bool = True) -> Plan:
    """Hybrid sharded: FSDP within ``shard_axis``, replicas across ``replicate_axis``."""
    return ddp(replicate_axis) + fsdp(shard_axis, reshard_after_forward=reshard_after_forward)


def tp(axis: str, styles: Mapping[str, Style] | Sequence[tuple[str, Style]]) -> Plan:
    """Tensor parallelism over ``axis``, declared per parameter path like torch's ``parallelize_module``.

    Args:
        axis: the mesh axis.
        styles: ``{pattern: style}`` (or ``(pattern, style)`` pairs): dotted-path globs
            (``layers.*.attn.wq``) or ``re:<regex>``; the first match wins; paths that match nothing are
            replicated over ``axis``; a pattern that matches no parameter is a :class:`PlanError`. The
            styles are core vocabulary (:mod:`hpfunc.layout.styles`, re-exported here:
            :class:`ColwiseParallel`, :class:`RowwiseParallel`, :class:`SequenceParallel`,
            :class:`VocabParallel`, :class:`Replicate`). A model ships its own table beside it, e.g.
            ``hpfunc.models.qwen3.parallel_plan.tp_styles(cfg)``.

    The layout composes with data layers (``fsdp("fsdp") + tp("tp", styles)``); the model adds the
    collectives the layout implies (:func:`hpfunc.layout.reduce_partial` on row-parallel outputs, and with
    sequence parallelism :func:`~hpfunc.layout.scatter_sequence` / :func:`~hpfunc.layout.gather_sequence`).
    A :class:`VocabParallel` style turns on the plan's ``tp_vocab_parallel``, a :class:`SequenceParallel`
    one its ``tp_sequence_parallel`` (the model keeps the residual stream split along the sequence; the
    sequence length must divide by the axis size).

    Example, a two-layer MLP whose hidden features are split over ``tp``::

        plan = tp("tp", {"w_in": ColwiseParallel(), "b_in": ColwiseParallel(), "w_out": RowwiseParallel()})
        # on a {"tp": 2} mesh: w_in [F, D] -> P("tp"), b_in [F] -> P("tp"), w_out [D, F] -> P(None, "tp"),
        # b_out (no pattern) replicated; the loss adds layout.reduce_partial(F.linear(h, w_out)) + b_out

    >>> tp("tp", {"w": ColwiseParallel(), "norm": SequenceParallel()}).tp_sequence_parallel
    True
    """
    pairs = list(styles.items()) if isinstance(styles, Mapping) else list(styles)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"tp({axis!r}): expected (pattern, style) pairs or a dict; found {item!r}")
        if not isinstance(item[1], Style):
            raise TypeError(f"tp({axis!r}): the style for {item[0]!r} must be a ColwiseParallel(), "
                            f"RowwiseParallel(), SequenceParallel(), VocabParallel() or Replicate(); "
                            f"found {item[1]!r}" + (" (call it: add ())" if isinstance(item[1], type) else ""))
    if not pairs:
        raise PlanError(f"tp({axis!r}): no styles; pass the model's table, e.g. "
                        f"hpfunc.models.qwen3.parallel_plan.tp_styles(cfg)")
    return Plan((_Layer("tp", axis, styles=tuple(pairs)),))


def ep(axis: str = "ep", experts: Sequence[str] = (), *, reshard_after_forward: bool = True) -> Plan:
    """Expert parallelism over ``axis``: each rank holds and computes ``E / n`` experts of every MoE layer.

    Args:
        axis: the mesh axis. It borrows its ranks from data parallelism (as torchtitan and Megatron
            do): the batch is split over it too, and the parameters that are not experts are sharded
            over it as :func:`fsdp` shards them (all-gathered per use).
        experts: dotted-path patterns (globs or ``re:``) of the expert stacks ``[E, ...]``, split on
            dimension 0 in storage and in use; a model ships its own, e.g.
            ``hpfunc.models.qwen3.parallel_plan.ep_experts(cfg)``. A pattern that matches no parameter
            is a :class:`PlanError`; ``E`` must be a multiple of the axis size.

    Inside the step the model's MoE blocks read the bound axis (:func:`hpfunc.layout.ep_axis`) and send
    each (token, expert) pair to the rank holding its expert and back (:mod:`hpfunc.models.dispatch`:
    two all-to-alls forward, two backward). The gradient of an expert block is summed over the data
    axes that hold the same experts (the transposes of the all-to-alls bring every rank's contribution
    to the expert's rank). Composes with ``fsdp`` (experts FSDP-sharded on another dimension) and
    ``tp`` (expert-tensor parallelism: the experts' hidden features split over ``tp`` too).

    >>> plan = fsdp("fsdp") + ep("ep", ["layers.*.moe.experts.w_*"])
    >>> plan.ep_axis, plan.data_axes
    ('ep', ('fsdp', 'ep'))
    """
    pats = (experts,) if isinstance(experts, str) else tuple(experts)
    if not pats or not all(isinstance(p, str) and p for p in pats):
        raise PlanError(f"ep({axis!r}): experts must name the expert stacks by path patterns, found {experts!r}; "
                        f"pass the model's, e.g. hpfunc.models.qwen3.parallel_plan.ep_experts(cfg)")
    return Plan((_Layer("ep", axis, experts=pats),), reshard_after_forward=reshard_after_forward)


def pp(axis: str, stages: Any, *, schedule: Any = "1f1b", microbatches: int, virtual_stages: int | None = None,
       remat: Any = None, max_resident: int | None = None) -> Plan:
    """Pipeline parallelism over ``axis``: the model's stages placed on its ranks by ``schedule``.

    Args:
        axis: the mesh axis; the batch is *not* split over it (every pipeline rank sees the same data
            shard; the first stage reads the tokens, the last the labels).
        stages: the model split into stages, from its parallel plan:
            ``hpfunc.models.qwen3.parallel_plan.pipeline_stages(cfg, num_stages, layers=...)``. Its stage
            count must be the schedule's (pp size, x2 for ``zbv``/``dualpipev``, x ``virtual_stages`` for
            ``interleaved``).
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` (with ``virtual_stages``), ``zb_h1``, ``zb_h2``,
            ``zbv``, ``dualpipev``, a CSV file in torch's format, or an :class:`hpfunc.schedules.Schedule`.
        microbatches: the number of microbatches each data shard's batch is cut into.
        remat: recompute per stage: a policy of :mod:`hpfunc.transforms.policies` (``nothing_saveable``,
            ``dots_saveable``, ...) for every stage, or ``{stage: policy}`` / a list with one per stage
            (``None``: that stage keeps its activations). A stage's forward (on the last stage its loss
            too, as a region of its own) then keeps only what its policy saves until its backward,
            which recomputes the rest.
        max_resident: swap activations to host memory so that at most this many stage-microbatches stay
            on the device between forward and backward on each rank (``schedules.insert_swaps``; the
            schedule's ``SWAP_OUT`` / ``SWAP_IN`` are executed through ``offload``'s host copies).

    Inside the step the model's loss (for Qwen3, :func:`hpfunc.models.qwen3.parallel_plan.loss`) runs the
    schedule: forwards, input-gradient and weight-gradient passes per microbatch, activations and their
    gradients sent between pipeline ranks by counted point-to-point transfers. The loss is the mean
    over microbatches (equal to the whole batch's for a mean loss with equal targets per microbatch);
    a mixture-of-experts load-balancing loss is that of each microbatch, as with gradient accumulation.

    >>> from hpfunc.models import qwen3
    >>> from hpfunc.models.qwen3 import parallel_plan
    >>> plan = pp("pp", parallel_plan.pipeline_stages(qwen3.preset("qwen3-dense-tiny"), 2), microbatches=4) + fsdp("fsdp")
    >>> plan.pp_axis, plan.data_axes
    ('pp', ('fsdp',))
    """
    from hpfunc.transforms.pipeline_plan import PipelineLayer

    return Plan(pipeline=PipelineLayer(axis, stages, schedule, microbatches, virtual_stages, remat, max_resident))


def cp(axis: str = "cp", *, impl: str = "ring", ulysses_axis: str | None = None, balanced: bool = True,
       pad: bool = True, replicate_kv: bool = False, overlap: bool = True) -> Any:
    """Context parallelism over ``axis``: every sequence of the batch split along its length.

    Args:
        axis: the mesh axis (for ``impl="hybrid"`` the ring's).
        impl: ``"allgather"`` (K, V gathered, KV heads only), ``"ring"`` (K, V passed around the ring with
            online softmax), ``"ulysses"`` (all-to-alls between sequence- and head-sharded q, k, v; the
            degree must divide the KV heads left after tensor parallelism unless ``replicate_kv``) or
            ``"hybrid"`` (Ulysses over ``ulysses_axis`` inside, the ring across ``axis``).
        balanced: causal load balancing (rank ``r`` holds chunks ``r`` and ``2P - 1 - r``).
        pad: pad sequences to a multiple of ``2 P`` (the padding is masked, its labels ignored); else such
            a length is a :class:`PlanError` before any communication.
        replicate_kv, overlap: see :class:`hpfunc.layout.ContextParallel`.

    The batch is split along dimension 0 over the plan's data axes only; every cp rank gets its data shard's
    whole sequences and the model takes its own tokens (no communication). Parameters are replicated over
    the cp axes; the loss is the mean over every target of the data shard, counted across the cp axes.
    Composes with ``fsdp`` / ``ddp`` / ``zero`` on other axes, ``tp`` (heads split by tp first) and ``ep``.

    >>> from hpfunc.transforms import plans
    >>> plan = plans.fsdp("fsdp") + plans.cp("cp", impl="ulysses")
    >>> plan.data_axes, plan.token_axes, plan.cp_binding.impl
    (('fsdp',), ('fsdp', 'cp'), 'ulysses')
    """
    return Plan(context=ContextParallelLayer(ContextParallel(axis, impl=impl, ulysses_axis=ulysses_axis,
                                                             balanced=balanced, pad=pad, replicate_kv=replicate_kv,
                                                             overlap=overlap)))


def total_numel(resolved: Mapping[str, LeafLayout]) -> int:
    return sum(math.prod(r.shape) for r in resolved.values())
