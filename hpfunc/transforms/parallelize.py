"""``hpfunc.parallelize(step, mesh, plan)``: a pure single-device ``step(state, batch) -> (state, metrics)``
run data / fully-sharded / tensor / sequence parallel. The engine's one front door.

    from hpfunc.models import qwen3
    from hpfunc.train.step import init_train_state, make_train_step
    step = make_train_step(cfg, optim.adamw(1e-3), loss_fn=qwen3.parallel_plan.loss)
    plan = plans.fsdp("fsdp") + plans.tp("tp", qwen3.parallel_plan.tp_styles(cfg))
    train_step = hpfunc.parallelize(step, mesh, plan)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, key,
                          shapes=qwen3.param_shapes(cfg))       # each rank creates only its blocks
    state = train_step.init_state(lambda p: init_train_state(p, tx), params)
    state, metrics = train_step(state, batch)                  # the global batch, on every rank

The step runs once per rank inside one :func:`~hpfunc.transforms.shard_map.shard_map`, on this rank's
blocks, with the plan bound through the layout seam (:mod:`hpfunc.layout`), so that the library calls
a step makes give the single-device result:

* the parameters (found at ``state.<params>``) are shown to the step as their *optimizer blocks*:
  the storage block, narrowed further on ZeRO-1/2's axes; the optimizer state arrives as the matching
  blocks, the batch split along dimension 0 over the plan's data axes;
* :func:`hpfunc.value_and_grad` / :func:`hpfunc.grad` on (a subtree of) those parameters runs the
  plan's differentiation: the function receives the parameters gathered on use (per layer,
  re-gathered in the backward with ``reshard_after_forward``), the gradient is reduced over the data
  and replicated axes and returned as optimizer blocks, the value is the mean over data shards, and
  ``aux`` tensors are averaged (floats) or summed (integers) over data shards;
* :func:`hpfunc.optim.global_norm` / ``clip_by_global_norm`` use the norm of the global tensors,
  Muon gathers a sharded matrix before Newton-Schulz, and :func:`hpfunc.layout.local_block` cuts a
  global value to a leaf's block;
* elementwise code (AdamW, ``apply_updates``, weight decay, schedules) is exact on blocks as it is.

The parameters the step returns (optimizer blocks) are put back to storage (ZeRO-1/2 all-gather the
updated blocks). Every other state leaf shaped like a parameter, at a path ending in that
parameter's path (``opt_state.0.mu.layers.0.attn.wq``), is laid out like that parameter's optimizer
block; any other leaf is replicated, and so must be every metric the step returns, except metrics
laid out the same way (a tree of gradients under ``metrics["grads"]``).

The engine, one idea per module, under :mod:`hpfunc.transforms.engine`: ``view`` (parameter blocks
that know their leaf, the lazy view a differentiated function reads), ``gather`` (gather on use,
re-gather in the backward), ``mixed`` (mixed-precision gather), ``packing`` (bucketed collectives),
``reduce`` (gradient reduction, ZeRO's gather of updated blocks), ``differentiate`` (one
differentiation under the plan), ``step_layout`` (the layout seam's implementation for one rank),
``state`` (finding the parameters in a state).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import attrs
import torch
from torch.distributed.tensor import DTensor

from hpfunc import layout, saved_tensors
from hpfunc import tree as _tree
from hpfunc.layout import LeafLayout, PlanError
from hpfunc.mesh import Mesh
from hpfunc.sharding import NamedSharding, P, shard, sharding_of, spec_to_placements
from hpfunc.transforms.engine.differentiate import EngineConfig
from hpfunc.transforms.engine.state import get_path, holder, param_suffix, positions_of, replace_path
from hpfunc.transforms.engine.step_layout import RankStep
from hpfunc.transforms.plans import Plan
from hpfunc.transforms.shard_map import Flat, FlatSpecs, flat_checks, flat_specs, layout_mark, shard_map

__all__ = ["parallelize", "ParallelizedStep", "init_sharded", "parallel_train_step", "ParallelTrainStep",
           "PlanError"]


@attrs.frozen
class _Planned:
    """What a state's structure decides, once: the parameters' layouts, the specs of every state leaf,
    the engine configuration."""

    res: Mapping[str, LeafLayout]
    specs: Any
    paths: list[str]
    cfg: EngineConfig
    placements: list[tuple]  # the storage placements of the parameters, in flattening order
    checks: Any = "trusted"  # the replication check of the state's leaves (a tree under a pp layer)
    # per position of the state as shard_map flattens it (None as a leaf): None where no tensor is, else the
    # mark this step puts on the DTensor it returns there and the global shape planned for it (shard_map's
    # out marks); a state whose DTensors all carry their marks is this step's output, laid out as planned
    marks: tuple = ()


@attrs.frozen(eq=False)
class ParallelizedStep:
    """``state, metrics = train_step(state, batch)`` on ``mesh`` (see the module docstring)."""

    step: Callable
    mesh: Mesh
    plan: Plan
    params: str = "params"
    donate_state: bool = False
    _cache: dict = attrs.field(factory=dict, init=False, repr=False)

    # -- planning (no communication) ------------------------------------------------------------
    def resolve(self, state_or_params: Any, *, is_params: bool = False) -> dict[str, LeafLayout]:
        """``{path: LeafLayout}`` of the parameters; raises :class:`PlanError` for a plan that does not fit."""
        params = state_or_params if is_params else get_path(state_or_params, self.params)
        return self.plan.resolve(params, self.mesh)

    def state_specs(self, state: Any) -> Any:
        """The spec of every state leaf: parameters by storage, parameter-shaped leaves by optimizer
        spec, everything else replicated."""
        return self._planned(state).specs

    def _planned(self, state: Any) -> _Planned:
        return self._plan_of(state)[0]

    def _plan_of(self, state: Any) -> tuple[_Planned, bool, Flat]:
        """The plan of ``state``'s structure, and whether the state is this step's own output, unchanged in
        layout (every DTensor leaf carries the mark this step put on it: its spec, mesh and shape are
        those planned, so they need no check), and the state flattened as shard_map takes it."""
        # every position shard_map pairs with a spec, None included (the leaves of other pipeline stages)
        positions, full_def = _tree.flatten(state, none_is_leaf=True)
        hit = self._cache.get(("marked", full_def))
        if hit is not None and _marked(positions, hit.marks):
            return hit, True, Flat(positions, full_def)
        leaves, treedef = _tree.flatten(state)
        key = (treedef, tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._make_planned(state, leaves, treedef, positions)
        self._cache[("marked", full_def)] = hit
        return hit, False, Flat(positions, full_def)

    def _make_planned(self, state: Any, leaves: list, treedef: Any, positions: list) -> _Planned:
        params = get_path(state, self.params)
        res = self.resolve(params, is_params=True)
        pairs = _tree.leaves_with_paths(params)
        paths = [p for p, _ in pairs]
        # the parameters' positions in the state, by structure (paths inside a NamedTuple are positional)
        is_param = positions_of(state, self.params, len(paths))
        specs = _tree.unflatten(treedef, [
            res[paths[is_param[k]]].spec.storage if k in is_param else _state_leaf_spec(path, x, res)
            for k, (path, x) in enumerate(_tree.leaves_with_paths(state))])
        cfg = EngineConfig(self.mesh, self.plan, [res[p] for p in paths], [x.dtype for _, x in pairs])
        placements = [tuple(spec_to_placements(res[p].spec.storage, self.mesh, len(res[p].shape), where=p))
                      for p in paths]
        checks: Any = "trusted"
        if self.plan.pipeline is not None:
            # a leaf of one pipeline stage exists on that stage's ranks only: nothing to compare across
            # the pipeline axis (the replication check runs over whole axes), so it is not checked
            checks = _tree.unflatten(treedef, [
                False if _stage_local(path, k, is_param, paths, res) else "trusted"
                for k, (path, _) in enumerate(_tree.leaves_with_paths(state))])
        return _Planned(res, specs, paths, cfg, placements, checks,
                        tuple((object(), x.shape) if isinstance(x, torch.Tensor) else None for x in positions))

    def _metrics_specs(self, metrics: Any, res: Mapping[str, LeafLayout]) -> Any:
        """The out specs of this rank's metrics (once per metrics structure)."""
        leaves, treedef = _tree.flatten(metrics)
        key = ("metrics", treedef, tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = _tree.map_with_path(lambda path, x: _metric_spec(path, x, res, self.mesh),
                                                          metrics)
        return hit

    # -- running ----------------------------------------------------------------------------------
    def _run(self, fn: Callable, state_in: Any, planned: _Planned, args: tuple, arg_specs: tuple,
             out_specs: Any, state_checks: Any = "trusted", *, donate: bool = False, vouched: bool = False,
             out_planned: _Planned | None = None) -> Any:
        """``fn(state, *args)`` in a ``shard_map`` over the state's blocks; its output's first element is a
        state planned as ``out_planned`` (default ``planned``), whose DTensors leave marked by it."""
        out_planned = planned if out_planned is None else out_planned
        mesh, pp = self.mesh, self.params

        def body(state: Any, *rest: Any) -> Any:
            params = get_path(state, pp)
            storage, treedef = _tree.flatten(params)
            ctx = RankStep(planned.cfg, planned.paths, storage, donate_state=donate)
            user_state = replace_path(state, pp, _tree.unflatten(treedef, ctx.opt_blocks))
            model_paths = None if self.plan.pipeline is None else self.plan.pipeline.stages.paths
            with layout.bind(ctx), layout.model_parameter_paths(model_paths):
                new_state, *extra = fn(user_state, *rest)
            new_leaves, new_def = _tree.flatten(get_path(new_state, pp))
            if new_def != treedef:
                raise PlanError(f"parallelize: the step changed the structure of the parameters "
                                f"({new_def} instead of {treedef})")
            new_state = replace_path(new_state, pp, _tree.unflatten(treedef, ctx.to_storage(new_leaves)))
            return (new_state, *extra)

        # replicated by construction (the state: reduced gradients, identical updates; the metrics: the
        # engine's reductions): checked only when HPFUNC_CHECK_REP asks (the test suite: exact), so that the
        # hot path pays no collective for it
        if isinstance(state_checks, str):
            check: Any = "trusted"
        else:  # a pipeline: neither state nor metrics leaves of one stage (its gradients) are compared over it

            def check(out: Any) -> FlatSpecs:
                # once per structure of the extra outputs (the metrics): the checks depend on paths only
                key = ("pipeline checks", id(planned), _tree.structure(tuple(out[1:])))
                hit = self._cache.get(key)
                if hit is None:
                    rest = tuple(_tree.map_with_path(lambda path, x: False if _laid_out_like_a_stage_leaf(
                        path, planned.res) else "trusted", o) for o in out[1:])
                    hit = self._cache[key] = flat_checks((state_checks, *rest), out)
                return hit

        def flat_out(out: Any) -> FlatSpecs:
            # the output specs flattened once per (state plan, spec trees): shard_map then pairs the outputs'
            # leaves with them without flattening and broadcasting the spec tree again (the metrics' specs are
            # one cached object per metrics structure; an output of another structure is a SpecError there)
            specs = out_specs(out) if callable(out_specs) else out_specs
            key = ("out specs", id(planned), id(out_planned), tuple(id(x) for x in specs))
            hit = self._cache.get(key)
            if hit is None or hit[0] != specs:
                flat = flat_specs(specs, out, "out_specs", mesh)
                marks = out_planned.marks + (None,) * (len(flat.leaves) - len(out_planned.marks))
                hit = self._cache[key] = (specs, flat.marked(marks))
            return hit[1]

        key = ("in specs", id(planned), vouched)
        hit = self._cache.get(key)
        if hit is None:
            hit = flat_specs(planned.specs, state_in, "in_specs", mesh)
            hit = self._cache[key] = hit.vouched() if vouched else hit
        return shard_map(body, mesh=mesh, in_specs=(hit, *arg_specs), out_specs=flat_out,
                         check_rep=check)(state_in, *args)

    def _check_context(self) -> None:
        """Refuse orders of transforms that cannot make sense, naming both."""
        outer = saved_tensors.in_recompute_region() or next((lay.name for lay in saved_tensors.layers()), None)
        if outer is not None:
            raise PlanError(f"hpfunc.parallelize: the step was called inside {outer}; a parallelized step computes "
                            f"its own gradients and updates its state, so there is nothing for {outer} to keep or "
                            f"recompute around it. Apply {outer} to layers inside the function the step "
                            f"differentiates")
        if layout.current() is not None:
            raise PlanError("hpfunc.parallelize: a parallelized step was called inside another one; compose the "
                            "plans instead (plans add with +)")

    def init_state(self, init_fn: Callable[[Any], Any], params: Any) -> Any:
        """``init_fn(params) -> state`` run on every rank's blocks (e.g. ``lambda p: init_train_state(p, tx)``).

        ``params`` are the sharded parameters (:func:`init_sharded`, or :meth:`shard_params`); the returned
        state holds them unchanged and optimizer state laid out like their optimizer blocks.
        """
        self._check_context()
        res = self.plan.resolve(params, self.mesh)
        check_params(params, res, self.mesh)
        pp = self.params
        meta = _tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                              if isinstance(x, torch.Tensor) else x, params)
        abstract = init_fn(meta)
        get_path(abstract, pp)  # the state must hold the parameters where `params=` says
        out_planned = self._planned(abstract)
        out_specs = out_planned.specs
        first_state = holder(pp, params)
        planned = self._planned(first_state)

        def first(state: Any) -> tuple:
            return (init_fn(get_path(state, pp)),)

        return self._run(first, first_state, planned, (), (), (out_specs,), out_planned.checks,
                         out_planned=out_planned)[0]

    def shard_params(self, params: Any) -> Any:
        """Full parameters (identical on every rank) -> DTensors with the plan's storage specs (under a
        ``pp`` layer: those of this rank's stages; the others become ``None``)."""
        params = self.plan.local_params(params, self.mesh)
        res = self.plan.resolve(params, self.mesh)
        return shard(params, self.mesh, lambda p, x: res[p].spec.storage)

    def full_params(self, params: Any) -> Any:
        """Full tensors of the (sharded) parameters on every rank: a collective, every rank calls it.
        Under a ``pp`` layer every leaf comes from the pipeline rank that holds it (a broadcast over the
        pipeline axis), so each rank gets the whole model."""
        import logging

        # a dimension split over two axes (fsdp x ep) gathers in two steps; DTensor warns (once per rank)
        # that the reduction order may differ between ranks, which cannot happen here: a gather reduces nothing
        log = logging.getLogger("torch.distributed.tensor._redistribute")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            local = _tree.tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, params)
        finally:
            log.setLevel(level)
        if self.plan.pipeline is None:
            return local
        return _broadcast_stages(local, self.plan, self.mesh)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        self._check_context()
        planned, vouched, flat = self._plan_of(state)
        if not vouched:  # a state this step returned is laid out as planned: its marks say so
            check_params(get_path(state, self.params), planned.res, self.mesh, planned.paths, planned.placements)
        batch_spec = self.plan.batch_spec(self.mesh)
        self.plan.check_batch(batch, self.mesh)

        def fn(user_state: Any, b: Any) -> tuple:
            out = self.step(user_state, b)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"parallelize: the step must return (state, metrics); found {type(out).__name__}")
            return out

        return self._run(fn, flat, planned, (batch,), (batch_spec,),
                         lambda out: (planned.specs, self._metrics_specs(out[1], planned.res)),
                         planned.checks, donate=self.donate_state, vouched=vouched)


def _marked(leaves: list, marks: tuple) -> bool:
    """Whether every tensor leaf of a state is a DTensor this step returned at that position, laid out as
    planned there (it carries the plan's mark for the position, which shard_map put only on a DTensor of
    the planned shape; spec and mesh are the plan's, and a DTensor's layout does not change in place),
    needing no gradient, and no other leaf is a tensor. A mark is one object per plan and position, so a
    state made by another step, or another plan of this one, is checked as usual."""
    if len(leaves) != len(marks):
        return False
    tensor, mark_of = torch.Tensor, layout_mark
    for x, ms in zip(leaves, marks):
        if ms is None:
            if isinstance(x, tensor):
                return False
        elif mark_of(x) is not ms[0] or x.requires_grad:
            return False
    return True


def _broadcast_stages(local: Any, plan: Plan, mesh: Mesh) -> Any:
    """Every pipeline rank's full parameters, from the tree of this rank's (``None`` for other stages')."""
    import torch.distributed as dist

    layer = plan.pipeline
    sched = plan.pipeline_schedule(mesh)
    group = mesh.group(layer.axis)
    held = dict(_tree.leaves_with_paths(local))
    metas: list = [None] * mesh.axis_size(layer.axis)
    dist.all_gather_object(metas, {p: (tuple(x.shape), str(x.dtype).removeprefix("torch.")) for p, x in held.items()},
                           group=group)
    found = {}
    for path in layer.stages.paths:
        owner = sched.stage_to_rank[layer.stages.stage_of(path)[0]]
        shape, dtype = metas[owner][path]
        x = held[path] if path in held else torch.empty(shape, dtype=getattr(torch, dtype))
        x = x.contiguous()
        dist.broadcast(x, src=dist.get_global_rank(group, owner), group=group)
        found[path] = x
    return _tree.map_with_path(lambda path, x: found[path], local, none_is_leaf=True)


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


def _metric_spec(path: str, x: Any, res: Mapping[str, LeafLayout], mesh: Mesh) -> P:
    """A metric is replicated, unless it is laid out like a parameter's optimizer block (a gradient)."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return P()
    suffix = param_suffix(path, res)
    if suffix is not None and tuple(x.shape) == res[suffix].block_shape(mesh):
        return res[suffix].spec.opt
    return P()


def check_params(params: Any, res: Mapping[str, LeafLayout], mesh: Mesh, paths: list[str] | None = None,
                 placements: list[tuple] | None = None) -> None:
    """:class:`PlanError` naming the first parameter DTensor not stored as the plan says (``paths``, and
    ``placements`` the storage placements of each, in flattening order, when known)."""
    pairs = _tree.leaves_with_paths(params) if paths is None else zip(paths, _tree.leaves(params))
    for k, (path, x) in enumerate(pairs):
        r = res[path]
        if isinstance(x, DTensor):
            # placements, not sharding_of(): this runs every step and must stay cheap
            want = (placements[k] if placements is not None
                    else tuple(spec_to_placements(r.spec.storage, mesh, x.ndim, where=path)))
            same_mesh = x.device_mesh is mesh.device_mesh or x.device_mesh == mesh.device_mesh
            if not same_mesh or tuple(x.placements) != want:
                raise PlanError(f"parameter {path!r} is stored as {sharding_of(x).spec!r} but the plan stores it "
                                f"as {r.spec.storage!r}; use train_step.shard_params / hpfunc.reshard first")


def parallelize(step: Callable, mesh: Mesh, plan: Plan, *, params: str = "params",
                donate_state: bool = False) -> ParallelizedStep:
    """Distribute a pure single-device ``step(state, batch) -> (state, metrics)`` over ``mesh`` by ``plan``.

    Args:
        step: written for one device. It differentiates with :func:`hpfunc.value_and_grad` (or
            :func:`hpfunc.grad`) with respect to the state's parameters and updates them with an
            :mod:`hpfunc.optim` optimizer. Under a ``tp`` plan its model must add the collectives its
            layout implies (for Qwen3, :func:`hpfunc.models.qwen3.parallel_plan.loss`).
        mesh, plan: where and how (:mod:`hpfunc.transforms.plans`).
        params: the dotted path of the parameters in the state (``"params"`` finds ``state["params"]``
            and ``state.params``).
        donate_state: hand each call's state over to it (JAX's buffer donation): the optimizer may write
            the new moments and parameters into the old ones' memory (:func:`hpfunc.layout.donated`,
            ``optim.update_and_apply(..., donate=...)``), as ``torch.optim`` updates in place, so the
            step allocates no second copy of them. The old state must not be read after the call (write
            ``state, metrics = train_step(state, batch)``); the values are those of ``donate_state=False``,
            bit for bit.

    Returns:
        A :class:`ParallelizedStep`: ``state, metrics = train_step(state, batch)`` with the global batch
        on every rank; ``train_step.init_state(init_fn, params)`` builds the first state from sharded
        parameters. The loss it reports is the mean over data shards of the per-shard loss.

    Example (one process, a 1-rank mesh; docs/parallel.md runs it on 2-8 ranks):
        >>> import torch, hpfunc
        >>> from hpfunc import optim
        >>> from hpfunc.transforms import plans
        >>> tx = optim.adamw(0.1)
        >>> def step(state, batch):
        ...     loss, g = hpfunc.value_and_grad(lambda p: ((batch @ p["w"]) ** 2).mean())(state["params"])
        ...     u, opt = tx.update(g, state["opt"], state["params"])
        ...     return {"params": optim.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}
        >>> mesh = hpfunc.Mesh({"fsdp": 1})
        >>> train_step = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp"))
        >>> params = train_step.shard_params({"w": torch.ones(3, 2)})
        >>> state = train_step.init_state(lambda p: {"params": p, "opt": tx.init(p)}, params)
        >>> state, metrics = train_step(state, torch.ones(4, 3))
        >>> float(metrics["loss"].full_tensor())
        9.0
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"parallelize: plan must be a hpfunc.transforms.plans.Plan, found {type(plan).__name__}")
    plan.check_mesh(mesh)
    return ParallelizedStep(step, mesh, plan, params, bool(donate_state))


def init_sharded(init_fn: Callable, mesh: Mesh, plan: Plan, key: torch.Tensor, *, shapes: Any) -> Any:
    """Parameters created directly with the plan's storage specs: ``init_fn(key, shardings=...)`` must create
    each leaf with the :class:`~hpfunc.sharding.NamedSharding` given for it (a tree shaped like
    ``shapes``); with counter-based :mod:`hpfunc.random` each rank samples only its block, and the
    values equal the unsharded ``init_fn(key)`` (``functools.partial(qwen3.init, cfg=cfg)`` does this).
    Under a ``pp`` layer the leaves of other pipeline ranks' stages get ``None`` and must come back ``None``.
    """
    shapes = plan.local_params(shapes, mesh)  # a pipeline rank creates only its stages' parameters
    res = plan.resolve(shapes, mesh)
    shardings = _tree.map_with_path(lambda p, s: NamedSharding(mesh, res[p].spec.storage), shapes,
                                    is_leaf=lambda x: isinstance(x, torch.Size))
    return init_fn(key, shardings=shardings)


# ---------------------------------------------------------------------------------------------
# A loss and an optimizer: the common case, over the front door


@attrs.frozen(eq=False)
class ParallelTrainStep:
    """``params, opt_state, metrics = step(params, opt_state, batch)`` (and the reduced gradients with
    ``return_grads``): :func:`parallelize` of a step that differentiates a loss and applies an optimizer."""

    train_step: ParallelizedStep
    optimizer: Any
    return_grads: bool = False

    @property
    def mesh(self) -> Mesh:
        return self.train_step.mesh

    @property
    def plan(self) -> Plan:
        return self.train_step.plan

    def resolve(self, params: Any) -> dict[str, LeafLayout]:
        return self.train_step.resolve(params, is_params=True)

    def param_specs(self, params: Any, which: str = "storage") -> Any:
        res = self.resolve(params)
        return _tree.map_with_path(lambda p, x: getattr(res[p].spec, which), params)

    def shard_params(self, params: Any) -> Any:
        return self.train_step.shard_params(params)

    def init_opt_state(self, params: Any) -> Any:
        """``optimizer.init`` on the optimizer blocks (no communication): DTensors with the opt specs."""
        return self.train_step.init_state(lambda p: {"params": p, "opt": self.optimizer.init(p)}, params)["opt"]

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple:
        state, metrics = self.train_step({"params": params, "opt": opt_state}, batch)
        if self.return_grads:
            grads = metrics.pop("grads")
            return state["params"], state["opt"], metrics, grads
        return state["params"], state["opt"], metrics


def _loss_step(loss_fn: Callable, optimizer: Any, has_aux: bool, clip_norm: float | None, return_grads: bool,
               state: Any, batch: Any) -> tuple[Any, dict]:
    from hpfunc import optim
    from hpfunc.autodiff import value_and_grad

    params = state["params"]
    out, grads = value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = out if has_aux else (out, None)
    gnorm = optim.global_norm(grads)
    metrics = {"loss": loss, "grad_norm": gnorm.float()}
    if return_grads:
        metrics["grads"] = grads  # before clipping
    if clip_norm is not None:
        scale = torch.clamp(clip_norm / (gnorm + 1e-6), max=1.0)
        grads = _tree.tree_map(lambda g: (g * scale).to(g.dtype), grads)
    new_params, opt_state = optim.update_and_apply(optimizer, grads, state["opt"], params, donate=layout.donated())
    if isinstance(aux, Mapping):
        metrics.update({k: v for k, v in aux.items() if isinstance(v, torch.Tensor)})
    return {"params": new_params, "opt": opt_state}, metrics


def parallel_train_step(loss_fn: Callable, optimizer: Any, mesh: Mesh, plan: Plan, *, has_aux: bool = False,
                        clip_norm: float | None = None, return_grads: bool = False) -> ParallelTrainStep:
    """A training step ``(params, opt_state, batch) -> (params, opt_state, metrics)`` on ``mesh``:
    :func:`parallelize` of ``value_and_grad(loss_fn)`` plus ``optimizer``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) written for one
            device: a mean over the batch.
        optimizer: any :mod:`hpfunc.optim` transformation.
        mesh, plan: where and how (:mod:`hpfunc.transforms.plans`).
        clip_norm: clip gradients by their global L2 norm (``torch.nn.utils.clip_grad_norm_``'s formula)
            before the optimizer.
        return_grads: also return the reduced gradients (DTensors with the plan's opt specs).

    ``metrics``: ``loss`` (mean over the global batch), ``grad_norm`` (global, before clipping) and,
    with ``has_aux``, the aux tensors (floats averaged, integers summed over data shards).
    """
    step = functools.partial(_loss_step, loss_fn, optimizer, has_aux, clip_norm, return_grads)
    return ParallelTrainStep(parallelize(step, mesh, plan, params="params"), optimizer, return_grads)
