"""A parallelized step lowered for one structure of its state: ``train_step.lower(state, batch)``.

Everything a :class:`~hpfunc.transforms.parallelize.ParallelizedStep` does that depends only on the
*structure* of the state (its tree, shapes and dtypes) and not on its values is decided once, here,
into one explicit object: each parameter's layout (storage, compute and optimizer specs), the gather
group it is all-gathered with, the bucket its gradient is reduced in, the specs of every state leaf,
the flat in/out specs ``shard_map`` pairs the leaves with, and the layout every input leaf must have
to enter without a check. ``print(lowered)`` shows it, one line per parameter; ``lowered(state,
batch)`` runs it. ``train_step(state, batch)`` finds the :class:`Lowered` of the state's structure
with one dict lookup and runs it (JAX's ``jax.jit(f).lower(*args)``); :meth:`Lowered.compile` makes the
compiled program of the same structure (``.compile()``: the model's compute as ``torch.compile``'d
regions between the collectives, :mod:`hpfunc.regions`), as ``train_step.compile(mode)`` and
``hpfunc.parallelize(..., compile=mode)`` do for every structure.

What the step builds *inside* (the metrics it returns, the trees its library calls hand the layout
seam, a pipeline's stage uses) is known only once it ran: the first run of each such structure
records it in the :class:`Lowered` (:attr:`Lowered.traced` counts them), so later runs replay it.

A state whose every tensor leaf is a DTensor laid out as planned (mesh, placements, global shape and
dtype: compared leaf by leaf, :meth:`Lowered.fits`) enters as its local blocks without any further
check; any other state of the same structure is checked (and redistributed where ``shard_map``
can), and one of other shapes or dtypes is lowered again.

    >>> import torch, hpfunc
    >>> from hpfunc.transforms import plans
    >>> def step(state, batch):
    ...     loss, g = hpfunc.value_and_grad(lambda p: (batch @ p["w"]).mean())(state["params"])
    ...     return {"params": {"w": state["params"]["w"] - 0.1 * g["w"]}}, {"loss": loss}
    >>> train_step = hpfunc.parallelize(step, hpfunc.Mesh({"fsdp": 1}), plans.fsdp("fsdp"))
    >>> state = {"params": train_step.shard_params({"w": torch.ones(3, 2)})}
    >>> print(train_step.lower(state, torch.ones(4, 3)))  # doctest: +NORMALIZE_WHITESPACE
    Lowered(fsdp=1; plan fsdp('fsdp'); batch P('fsdp'); 1 parameter, 1 state leaf)
      param  shape   storage  compute  opt  gather  reduce  bucket
      w      (3, 2)  P()      P()      P()  -       -       -
    >>> lowered = train_step.lower(state)
    >>> state, metrics = lowered(state, torch.ones(4, 3))       # train_step(state, batch) runs the same
    >>> train_step.lower(state) is lowered                      # its output has the planned layout
    True
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch
from torch.distributed.tensor import DTensor

from hpfunc import layout
from hpfunc import tree as _tree
from hpfunc.layout import LeafLayout, PlanError
from hpfunc.optim.base import streaming_state
from hpfunc.regions import Regions, backend_of
from hpfunc.sharding import P, _contiguous_stride, _DTensorSpec, _TensorMeta, sharding_of, spec_to_placements
from hpfunc.transforms.engine.differentiate import EngineConfig
from hpfunc.transforms.engine.gather import group_key
from hpfunc.transforms.engine.reduce import reduction_bucket
from hpfunc.transforms.engine.state import get_path, param_suffix, positions_of, replace_path
from hpfunc.transforms.engine.step_layout import RankStep
from hpfunc.transforms.shard_map import Flat, FlatSpecs, flat_checks, flat_specs, shard_map
from hpfunc.transforms.state_offload import GROUP_BYTES, offloaded_params, rest_paths, to_rest

if TYPE_CHECKING:
    from hpfunc.transforms.parallelize import ParallelizedStep

__all__ = ["Lowered", "check_params"]

# what Lowered.fits says of a state
RELOWER, CHECK, LAID_OUT = 0, 1, 2


class Lowered:
    """One parallelized step lowered for one state structure (see the module docstring).

    ``print`` shows per parameter: its global shape; storage, compute and optimizer specs; the group it
    is all-gathered with (``layers.0 (11)``: one packed collective for the layer's 11 parameters); the
    collective its gradient is reduced by (``psum dp``, ``psum_scatter dp``, ``-``: none); and the bucket
    whose all-reduce starts during the backward (``0: layers.1``: the first issued).

    Attributes decided at lowering: ``res`` (``{path: LeafLayout}``), ``paths`` (the parameters in
    flattening order), ``specs`` (the spec of every state leaf), ``engine`` (the
    :class:`~hpfunc.transforms.engine.differentiate.EngineConfig` facts: gather groups, reductions,
    mixed precision, gradient seed), ``in_specs`` / ``in_laid_out`` (the state's flat specs),
    ``expected`` (per position of the state, ``None`` as a leaf: ``None`` where no tensor is, else the
    DTensor placements, global shape and dtype planned there), ``batch_spec``.
    """

    def __init__(self, owner: "ParallelizedStep", state: Any, positions: list | None = None, treedef: Any = None):
        mesh, plan = owner.mesh, owner.plan
        if positions is None:
            positions, treedef = _tree.flatten(state, none_is_leaf=True)
        self.owner, self.mesh, self.plan, self.treedef = owner, mesh, plan, treedef
        params = get_path(state, owner.params)
        self.res: Mapping[str, LeafLayout] = plan.resolve(params, mesh)
        res = self.res
        pairs = _tree.leaves_with_paths(params)
        self.paths = [p for p, _ in pairs]
        self.dtypes = [x.dtype for _, x in pairs]
        leaves, state_def = _tree.flatten(state)
        # the parameters' positions in the state, by structure (paths inside a NamedTuple are positional)
        is_param = positions_of(state, owner.params, len(self.paths))
        state_pairs = _tree.leaves_with_paths(state)
        self.specs = _tree.unflatten(state_def, [
            res[self.paths[is_param[k]]].spec.storage if k in is_param else _state_leaf_spec(path, x, res)
            for k, (path, x) in enumerate(state_pairs)])
        self.n_state_leaves = len(state_pairs)
        # the state leaves that rest in host memory between steps (plan.with_state_offload)
        # the parameters at rest there too (with_state_offload("params", layers=...)), checked before anything runs
        self.offloaded = offloaded_params(plan.state_offload, plan.offload_layers, self.paths)
        if self.offloaded and plan.pipeline is not None:
            raise PlanError(f"with_state_offload('params'): parameters at rest in host memory are not brought in by "
                            f"the pipeline's stages yet; drop the pp layer on {plan.pipeline.axis!r} or offload "
                            f"only 'optimizer'")
        zero = [p for p in sorted(self.offloaded) if res[p].opt_extra]
        if zero:
            raise PlanError(f"with_state_offload('params'): parameter {zero[0]!r} has an optimizer block narrower than "
                            f"its storage (a ZeRO layer), whose update re-gathers it on the device; offload "
                            f"parameters under fsdp / ddp / tp layers, or select other layers")
        self.rest_paths = rest_paths(plan.state_offload, state_pairs, is_param, res, self.offloaded, self.paths)
        self.state_paths: list[str] = []  # every position's path (None leaves too): where a held leaf's layout is
        if self.rest_paths:
            _tree.map_with_path(lambda path, x: self.state_paths.append(path), state, none_is_leaf=True)
        self.engine = EngineConfig(mesh, plan, [res[p] for p in self.paths], self.dtypes,
                                   frozenset(i for i, p in enumerate(self.paths) if p in self.offloaded))
        self.placements = [tuple(spec_to_placements(res[p].spec.storage, mesh, len(res[p].shape), where=p))
                           for p in self.paths]
        self.checks: Any = "trusted"  # the replication check of the state's leaves (a tree under a pp layer)
        if plan.pipeline is not None:
            # a leaf of one pipeline stage exists on that stage's ranks only: nothing to compare across
            # the pipeline axis (the replication check runs over whole axes), so it is not checked
            self.checks = _tree.unflatten(state_def, [
                False if _stage_local(path, k, is_param, self.paths, res) else "trusted"
                for k, (path, _) in enumerate(state_pairs)])
        self.in_specs: FlatSpecs = flat_specs(self.specs, Flat(positions, treedef), "in_specs", mesh)
        self.in_laid_out = self.in_specs.vouched()
        self.expected = tuple(
            (tuple(spec_to_placements(s, mesh, x.ndim)), x.shape, x.dtype) if isinstance(x, torch.Tensor) else None
            for x, s in zip(positions, self.in_specs.leaves))
        # per position, how the step's output leaf there leaves as a DTensor (shard_map's FlatSpecs.wraps:
        # block shape, dtype, the DTensorSpec each output gets a copy of, replicated): the next call's
        # state then fits by identity of those specs' parts (fits), without comparing shapes and placements
        self.wraps = [None if e is None else _wrap_of(s, e, mesh) for s, e in zip(self.in_specs.leaves, self.expected)]
        self.batches: set = set()  # the batch structures and shapes checked against the plan
        self.batch_spec = plan.batch_spec(mesh)
        self.donate = owner.donate_state
        # the layout seam's two bindings: the step's body (its StepLayout, bound per call; the model's
        # parameter paths) and the function it differentiates (the data, tensor-, expert-parallel axes)
        model_paths = None if plan.pipeline is None else tuple(plan.pipeline.stages.paths)
        self.outer_binding = layout.Binding(model_paths=model_paths)
        self.inner_binding = layout.Binding(
            data_axes=self.engine.data_axes, tp_axis=plan.tp_axis, vocab_parallel=bool(plan.tp_vocab_parallel)
            and plan.tp_axis is not None, sequence_parallel=bool(plan.tp_sequence_parallel) and plan.tp_axis is not None,
            ep_axis=plan.ep_axis, context_parallel=plan.cp_binding, model_paths=model_paths)
        # the compiled regions the model runs its compute in (a compiled step: compile() below), None: eager
        self.regions: Regions | None = None
        if owner.regions is not None:
            self._bind_regions(owner.regions)
        # Found by the first run of each structure the step builds inside, replayed after:
        self.out_specs: dict = {}  # metrics structure and shapes -> FlatSpecs of (state, metrics)
        self.out_checks: dict = {}  # metrics structure -> FlatSpecs of the checks (a pp layer)
        self.layouts_of: dict = {}  # a parameter-shaped tree's structure -> its paths, layouts, block shapes
        self.alike_args: dict = {}  # value_and_grad's argument structures -> arguments shaped like the params
        self.stage_uses: dict = {}  # parameter tree structure -> per local pipeline stage, the leaves it uses
        self.aux_templates: dict = {}  # batch structure and shapes -> the pipeline's aux template (zeros)
        self._executor: Any = None  # the pipeline's schedule executor (a pp layer), built on first use
        # per differentiation of the step (its position in the step, the leaves it wants), the order in which
        # the model first read the gather groups (by first member): recorded by its first run, the order of
        # the forward's prefetches after it (engine/prefetch.py)
        self.gather_orders: dict[tuple, tuple[int, ...]] = {}
        # the same for the backward's re-gathers of resharded groups (engine/backward_prefetch.py)
        self.regather_orders: dict[tuple, tuple[int, ...]] = {}
        # the groups the forward reads last (from the last layer's on), kept gathered for the backward, which
        # needs them first: not resharded after the forward (as FSDP2 keeps its root and torchtitan its last block)
        self.kept_groups: dict[tuple, frozenset[int]] = {}
        # the differentiations (keyed as the gather orders) whose gradients the step asked the global norm of:
        # later runs reduce that norm with the loss and statistics, in one collective (engine/step_scalars.py)
        self.sq_norm_wanted: set[tuple] = set()
        self.sdc_checks = 0  # gradient reductions checked so far (the "step" an SDC report names)

    # -- compiling ------------------------------------------------------------------------------------
    def compile(self, mode: bool | str = True, *, regions: Regions | None = None) -> "Lowered":
        """This program compiled (动转静): the same lowered step, its model's compute run as compiled regions
        (:mod:`hpfunc.regions`) with the collectives eager between them; ``lowered.compile(mode)(state,
        batch)`` runs it. ``mode`` as ``train.compile``: ``True`` (``inductor``) or a backend of
        :data:`hpfunc.regions.BACKENDS` (``aot_eager`` traces forward and backward and runs them eagerly;
        ``eager`` only captures); ``False`` is this eager program. ``regions``: share the compiled
        graphs of another compiled step (default a new :class:`~hpfunc.regions.Regions`).

        The regions are bound for the function the step differentiates (:func:`hpfunc.layout.regions`);
        a model that declares regions reads them there (Qwen3: its embedding, each decoder layer between
        its tensor-parallel collectives, an MoE block's router and shared expert, and the final norm, head
        and loss). Why regions and not one graph, with measurements: docs/parallel.md, "Compiling the
        per-rank program". The compiled program shares everything decided at lowering, and what the
        runs record, with this one; its graphs compile on its first run and then stay (static shapes:
        another sequence length recompiles, as ``regions.compilations`` shows). Not under a ``pp`` plan
        layer yet (a :class:`~hpfunc.layout.PlanError`)."""
        backend = backend_of(mode, "Lowered.compile")
        if backend is None:
            return self
        if self.plan.pipeline is not None:
            raise PlanError(f"Lowered.compile: the compiled regions are not passed to the pipeline's stages yet; "
                            f"under the pp plan layer on {self.plan.pipeline.axis!r} run the step eagerly "
                            f"(train.compile: false)")
        if regions is not None and regions.backend != backend:
            raise ValueError(f"Lowered.compile: mode {mode!r} asks for the {backend!r} backend but the regions given "
                             f"compile with {regions.backend!r}")
        out = copy.copy(self)
        out._bind_regions(Regions(backend) if regions is None else regions)
        return out

    def _bind_regions(self, regions: Regions) -> None:
        if self.plan.pipeline is not None:
            raise PlanError(f"hpfunc.parallelize(compile=...): the compiled regions are not passed to the pipeline's "
                            f"stages yet; under the pp plan layer on {self.plan.pipeline.axis!r} run the step "
                            f"eagerly (train.compile: false)")
        self.regions = regions
        self.inner_binding = attrs.evolve(self.inner_binding, regions=regions)

    # -- what a state fits --------------------------------------------------------------------------
    def fits(self, positions: list) -> int:
        """``LAID_OUT``: every tensor of ``positions`` (the state flattened with ``None`` as a leaf) is a
        DTensor laid out as planned and needing no gradient; ``CHECK``: shapes and dtypes are those
        planned, the layout must be checked; ``RELOWER``: another structure of shapes or dtypes."""
        return self.fit(positions)[0]

    def fit(self, positions: list) -> tuple[int, list | None]:
        """:meth:`fits`, and with ``LAID_OUT`` the local block of every position (what ``shard_map``
        hands the step). A DTensor this step returned (its spec a copy of the one planned for its
        position) is recognised by the identity of its spec's parts; any other is compared."""
        if len(positions) != len(self.expected):
            return RELOWER, None
        dm, tensor, dtensor = self.mesh.device_mesh, torch.Tensor, DTensor
        out = LAID_OUT
        local: list | None = []
        for x, e, w in zip(positions, self.expected, self.wraps):
            if e is None:
                if isinstance(x, tensor):
                    return RELOWER, None
                if local is not None:
                    local.append(x)
                continue
            if type(x) is dtensor and w is not None:
                sp = x._spec
                if sp.tensor_meta is w[2].tensor_meta and sp.placements is w[2].placements and sp.mesh is dm \
                        and not x.requires_grad:
                    if local is not None:
                        local.append(x._local_tensor)
                    continue
            if not isinstance(x, tensor) or x.shape != e[1] or x.dtype != e[2]:
                return RELOWER, None
            if out is LAID_OUT and (type(x) is not dtensor or x.requires_grad or x._spec.mesh is not dm
                                    or x._spec.placements != e[0]):
                out, local = CHECK, None
            elif local is not None:
                local.append(x._local_tensor)
        return out, local

    # -- the pipeline executor, the SDC counter (engine reads) -----------------------------------------
    def pipeline_executor(self) -> Any:
        """The plan's pipeline executor on this mesh (built once: it validates the schedule)."""
        if self._executor is None:
            from hpfunc.transforms.engine.pipelined import build_executor

            self._executor = build_executor(self.engine)
        return self._executor

    def next_sdc_step(self) -> int:
        step, self.sdc_checks = self.sdc_checks, self.sdc_checks + 1
        return step

    @property
    def traced(self) -> dict[str, int]:
        """How many structures built inside the step the runs so far have recorded, by kind."""
        return {"metrics": len(self.out_specs), "param trees": len(self.layouts_of),
                "value_and_grad args": len(self.alike_args), "stage uses": len(self.stage_uses),
                "gather orders": len(self.gather_orders), "regather orders": len(self.regather_orders),
                "gradient norms": len(self.sq_norm_wanted)}

    # -- running ------------------------------------------------------------------------------------
    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """Run the step on a state of this structure (its layout checked unless it is as planned)."""
        positions, treedef = _tree.flatten(state, none_is_leaf=True)
        fit, local = self.fit(positions) if treedef == self.treedef else (RELOWER, None)
        if fit == RELOWER:
            raise PlanError(f"Lowered: this step was lowered for a state of structure {self.treedef} with the "
                            f"shapes and dtypes it had; call train_step(state, batch) (which lowers again) or "
                            f"train_step.lower(state, batch) for this one")
        return self.run(state, positions, batch, laid_out=fit == LAID_OUT, local=local)

    def run(self, state: Any, positions: list, batch: Any, *, laid_out: bool,
            local: list | None = None) -> tuple[Any, Any]:
        """Run on a state of this structure flattened to ``positions``; ``laid_out`` and ``local`` as
        :meth:`fit` found them."""
        owner = self.owner
        if not laid_out:
            check_params(get_path(state, owner.params), self.res, self.mesh, self.paths, self.placements)
        self.check_batch(batch)
        step = owner.step

        def fn(user_state: Any, b: Any) -> tuple:
            out = step(user_state, b)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"parallelize: the step must return (state, metrics); found {type(out).__name__}")
            return out

        return self._run(fn, Flat(positions, self.treedef, local if laid_out else None), (batch,), (self.batch_spec,),
                         self._step_out_specs, donate=self.donate, laid_out=laid_out)

    def check_batch(self, batch: Any) -> None:
        """The plan's check of the batch (:meth:`Plan.check_batch`), once per batch structure and shapes."""
        leaves, treedef = _tree.flatten(batch)
        key = (treedef, tuple(x.shape if isinstance(x, torch.Tensor) else None for x in leaves))
        if key not in self.batches:
            self.plan.check_batch(batch, self.mesh)
            self.batches.add(key)

    def _step_out_specs(self, out: tuple) -> FlatSpecs:
        """The flat out specs of ``(state, metrics)``, once per metrics structure and shapes."""
        metrics = out[1]
        leaves, treedef = _tree.flatten(metrics)
        key = (treedef, tuple(x.shape if isinstance(x, torch.Tensor) else None for x in leaves))
        hit = self.out_specs.get(key)
        if hit is None:
            metric_specs = _tree.map_with_path(lambda path, x: _metric_spec(path, x, self.res, self.mesh), metrics)
            hit = self.out_specs[key] = flat_specs((self.specs, metric_specs), out, "out_specs", self.mesh)
            # the state's positions leave as planned (fit recognises them next call); the metrics' are
            # found by their first output
            hit.wraps = self.wraps + [None] * (len(hit.leaves) - len(self.wraps))
        return hit

    def _run(self, fn: Callable, state_in: Any, args: tuple, arg_specs: tuple, out_specs: Any, *,
             donate: bool = False, laid_out: bool = False, out: "Lowered | None" = None) -> Any:
        """``fn(state, *args)`` in a ``shard_map`` over the state's blocks; its output's first element is a
        state lowered as ``out`` (default: this one)."""
        out_lowered = self if out is None else out
        pp, outer = self.owner.params, self.outer_binding
        # state offload: the update streams the state at rest through the device (optim.streaming_state) and
        # returns it in host memory; such leaves leave the shard_map as None (wrapping would copy them back to
        # the device) and are put back at rest after it, with the layout of the state the step received
        at_rest = self.rest_paths if out is None else frozenset()
        held: dict[str, torch.Tensor] = {}
        group_bytes = self.plan.offload_group_bytes
        group_bytes = GROUP_BYTES if group_bytes is None else group_bytes

        def hold(path: str, x: Any) -> Any:
            if path in at_rest and isinstance(x, torch.Tensor) and x.device.type == "cpu":
                held[path] = x
                return None
            return x

        def body(state: Any, *rest: Any) -> Any:
            params = get_path(state, pp)
            storage, treedef = _tree.flatten(params)
            ctx = RankStep(self, storage, donate_state=donate)
            user_state = replace_path(state, pp, _tree.unflatten(treedef, ctx.opt_blocks))
            with layout.binding(attrs.evolve(outer, step=ctx)), \
                    (streaming_state(group_bytes, state="optimizer" in self.plan.state_offload,
                                     params=bool(self.offloaded)) if at_rest else contextlib.nullcontext()):
                new_state, *extra = fn(user_state, *rest)
            new_leaves, new_def = _tree.flatten(get_path(new_state, pp))
            if new_def != treedef:
                raise PlanError(f"parallelize: the step changed the structure of the parameters "
                                f"({new_def} instead of {treedef})")
            new_state = replace_path(new_state, pp, _tree.unflatten(treedef, ctx.to_storage(new_leaves)))
            if at_rest:
                new_state = _tree.map_with_path(hold, new_state, none_is_leaf=True)
            return (new_state, *extra)

        # replicated by construction (the state: reduced gradients, identical updates; the metrics: the
        # engine's reductions): checked only when HPFUNC_CHECK_REP asks (the test suite: exact), so that the
        # hot path pays no collective for it
        check: Any = "trusted"
        if not isinstance(out_lowered.checks, str):
            # a pipeline: neither state nor metrics leaves of one stage (its gradients) are compared over it
            def check(result: Any) -> FlatSpecs:
                key = _tree.structure(tuple(result[1:]))
                hit = out_lowered.out_checks.get(key)
                if hit is None:
                    rest = tuple(_tree.map_with_path(lambda path, x: False if _laid_out_like_a_stage_leaf(
                        path, out_lowered.res) else "trusted", o) for o in result[1:])
                    hit = out_lowered.out_checks[key] = flat_checks((out_lowered.checks, *rest), result)
                return hit

        in_specs = self.in_laid_out if laid_out else self.in_specs
        result = shard_map(body, mesh=self.mesh, in_specs=(in_specs, *arg_specs), out_specs=out_specs,
                           check_rep=check)(state_in, *args)
        if out_lowered.rest_paths:  # the offloaded state back to host memory (its device copy goes with it)
            like = None
            if held:
                like = {path: x for path, x in zip(self.state_paths, state_in.leaves) if path in held}
            result = (to_rest(result[0], out_lowered.rest_paths, held, like), *result[1:])
        return result

    # -- printing -----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        eng = self.engine
        mesh = ", ".join(f"{a}={self.mesh.axis_size(a)}" for a in self.mesh.axis_names)
        plan = " + ".join([f"{lay.kind}({lay.axis!r})" for lay in self.plan.layers]
                          + ([self.plan.context.describe()] if self.plan.context is not None else []))
        head = (f"Lowered({mesh}; plan {plan}; batch {self.batch_spec!r}; {len(self.paths)} parameter"
                f"{'s' if len(self.paths) != 1 else ''}, {self.n_state_leaves} state "
                f"{'leaves' if self.n_state_leaves != 1 else 'leaf'}")
        extras = []
        if eng.mixed is not None:
            extras.append(f"param dtype {str(eng.mixed[0]).removeprefix('torch.')}, reduce dtype "
                          f"{str(eng.mixed[1]).removeprefix('torch.')}")
        if eng.any_gather:
            extras.append(f"reshard after forward {eng.reshard}")
        if self.plan.pipeline is not None:
            extras.append(f"pipeline on {self.plan.pipeline.axis!r}")
        if self.rest_paths:
            extras.append(f"{len(self.rest_paths)} state leaves at rest in host memory "
                          f"({', '.join(self.plan.state_offload)}"
                          f"{f': {len(self.offloaded)} parameters' if self.offloaded else ''})")
        if self.regions is not None:
            extras.append(f"compiled regions ({self.regions.backend})")
        if eng.overlap_buckets:
            extras.append(f"{len(eng.overlap_buckets)} all-reduce bucket{'s' if len(eng.overlap_buckets) != 1 else ''} "
                          f"started in the backward")
        bucket_of = {i: (path_of_bucket(self.paths, members), k) for k, (_, members) in enumerate(eng.overlap_buckets)
                     for i in members}
        rows = [("param", "shape", "storage", "compute", "opt", "gather", "reduce", "bucket")]
        for i, (path, dt) in enumerate(zip(self.paths, self.dtypes)):
            lay = self.res[path]
            members = eng.group_of.get(i)
            if members is None:
                gather = "-"
            else:
                g = group_key(path, lay.gather, dt)
                gather = (f"{g[1]}" if g[0] == "group" else "alone") + f" ({len(members)})"
            bucket = reduction_bucket(lay, eng.plan.reduce_dtype or dt)
            reduce = "-" if bucket is None else _bucket_str(bucket)
            b = bucket_of.get(i)
            rows.append((path, str(tuple(lay.shape)), repr(lay.spec.storage), repr(lay.spec.compute),
                         repr(lay.spec.opt), gather, reduce, "-" if b is None else f"{b[1]}: {b[0]}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head + ("; " + "; ".join(extras) if extras else "") + ")"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)


def path_of_bucket(paths: list[str], members: list[int]) -> str:
    """A bucket's name: the layer its members share (``layers.3``), ``top`` for the top-level
    parameters, and for a bucket of several layers (under the bucket cap) its first and last
    (``layers.1..top``)."""
    names = list(dict.fromkeys(_layer_name(paths[i]) for i in members))
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _layer_name(path: str) -> str:
    parts = path.split(".")
    return next((".".join(parts[: i + 1]) for i, p in enumerate(parts) if p.isdigit()), "top")


def _bucket_str(bucket: tuple) -> str:
    kind, axes, rest, dtype = bucket
    dt = str(dtype).removeprefix("torch.")
    if kind == "ar":
        return f"psum {','.join(rest)} [{dt}]"
    if kind == "rs":
        return f"psum_scatter {','.join(axes)}{' + psum ' + ','.join(rest) if rest else ''} [{dt}]"
    return f"{kind} {axes} [{dt}]"


def check_params(params: Any, res: Mapping[str, LeafLayout], mesh: Any, paths: list[str] | None = None,
                 placements: list[tuple] | None = None) -> None:
    """:class:`PlanError` naming the first parameter DTensor not stored as the plan says (``paths``, and
    ``placements`` the storage placements of each, in flattening order, when known)."""
    pairs = _tree.leaves_with_paths(params) if paths is None else zip(paths, _tree.leaves(params))
    for k, (path, x) in enumerate(pairs):
        r = res[path]
        if isinstance(x, DTensor):
            want = (placements[k] if placements is not None
                    else tuple(spec_to_placements(r.spec.storage, mesh, x.ndim, where=path)))
            same_mesh = x.device_mesh is mesh.device_mesh or x.device_mesh == mesh.device_mesh
            if not same_mesh or tuple(x.placements) != want:
                raise PlanError(f"parameter {path!r} is stored as {sharding_of(x).spec!r} but the plan stores it "
                                f"as {r.spec.storage!r}; use train_step.shard_params / hpfunc.reshard first")


def _stage_local(path: str, k: int, is_param: Mapping[int, int], paths: list[str],
                 res: Mapping[str, LeafLayout]) -> bool:
    """Whether state leaf ``k`` (at ``path``) belongs to one pipeline stage: a parameter of one stage, or
    a leaf laid out like one (its optimizer state)."""
    if k in is_param:
        return res[paths[is_param[k]]].stage_axis is not None
    return _laid_out_like_a_stage_leaf(path, res)


def _laid_out_like_a_stage_leaf(path: str, res: Mapping[str, LeafLayout]) -> bool:
    """Whether the leaf at ``path`` (not a parameter: optimizer state, a metric such as a gradient) ends
    with the path of a parameter of one pipeline stage."""
    suffix = param_suffix(path, res)
    return suffix is not None and res[suffix].stage_axis is not None


def _state_leaf_spec(path: str, x: Any, res: Mapping[str, LeafLayout]) -> P:
    """A state leaf that is not a parameter: laid out like the parameter whose path ends its path (and
    whose shape it has), replicated otherwise."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return P()
    suffix = param_suffix(path, res)
    if suffix is None:
        return P()  # not parameter-like: replicated (an RNG key, a global buffer)
    if tuple(x.shape) != res[suffix].shape:
        raise PlanError(f"state leaf {path!r} of shape {tuple(x.shape)} ends with the parameter path "
                        f"{suffix!r} but not with its shape {res[suffix].shape}; its sharding cannot be "
                        f"inferred (optimizer state must be shaped like the parameters)")
    return res[suffix].spec.opt


def _wrap_of(spec: P, expected: tuple, mesh: Any) -> tuple | None:
    """How a state leaf planned as ``expected`` (placements, global shape, dtype) leaves ``shard_map``:
    its block shape, dtype, the DTensorSpec its DTensors get copies of, and whether it is replicated on
    some mesh axis (:attr:`hpfunc.transforms.shard_map.FlatSpecs.wraps`)."""
    if _DTensorSpec is None:  # (a torch without DTensorSpec: every output takes shard_map's own path)
        return None
    placements, shape, dtype = expected
    block = torch.Size(s // mesh.axis_size(spec.dim_axes(d)) for d, s in enumerate(shape))
    dspec = _DTensorSpec(mesh.device_mesh, placements,
                         tensor_meta=_TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype))
    replicated = any(a not in spec.axes and mesh.axis_size(a) > 1 for a in mesh.axis_names)
    return block, dtype, dspec, replicated


def _metric_spec(path: str, x: Any, res: Mapping[str, LeafLayout], mesh: Any) -> P:
    """A metric is replicated, unless it is laid out like a parameter's optimizer block (a gradient)."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return P()
    suffix = param_suffix(path, res)
    if suffix is not None and tuple(x.shape) == res[suffix].block_shape(mesh):
        return res[suffix].spec.opt
    return P()
