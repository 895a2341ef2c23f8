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
from hpfunc.regions import Regions, backend_of
from hpfunc.sharding import NamedSharding, shard
from hpfunc.transforms.engine.state import get_path, holder
from hpfunc.transforms.lowered import LAID_OUT, RELOWER, Lowered, check_params
from hpfunc.transforms.plans import Plan
from hpfunc.transforms.shard_map import Flat

__all__ = ["parallelize", "ParallelizedStep", "Lowered", "init_sharded", "parallel_train_step",
           "ParallelTrainStep", "PlanError", "check_params"]


@attrs.frozen(eq=False)
class ParallelizedStep:
    """``state, metrics = train_step(state, batch)`` on ``mesh`` (see the module docstring)."""

    step: Callable
    mesh: Mesh
    plan: Plan
    params: str = "params"
    donate_state: bool = False
    # the compiled regions every structure's program runs the model's compute in (compile()); None: eager
    regions: Regions | None = None
    # the state's structure (None as a leaf) -> the step lowered for it (the last shapes and dtypes seen)
    _lowered: dict = attrs.field(factory=dict, init=False, repr=False)

    def compile(self, mode: bool | str = True) -> "ParallelizedStep":
        """This step compiled (``train.compile``, 动转静): the same step whose every lowered program is
        :meth:`Lowered.compile <hpfunc.transforms.lowered.Lowered.compile>`'d, all with one
        :class:`~hpfunc.regions.Regions` (``regions.compilations`` counts the graphs compiled, per region).
        ``mode``: ``True`` (``inductor``), a backend of :data:`hpfunc.regions.BACKENDS`, or ``False`` (this
        step, eager). A step made by ``parallelize(..., compile=mode)`` is this."""
        backend = backend_of(mode, "ParallelizedStep.compile")
        if backend is None:
            return self
        if self.plan.pipeline is not None:
            raise PlanError(f"ParallelizedStep.compile: the compiled regions are not passed to the pipeline's stages "
                            f"yet; under the pp plan layer on {self.plan.pipeline.axis!r} run the step eagerly "
                            f"(train.compile: false)")
        return attrs.evolve(self, regions=Regions(backend))

    # -- planning (no communication) ------------------------------------------------------------
    def resolve(self, state_or_params: Any, *, is_params: bool = False) -> dict[str, LeafLayout]:
        """``{path: LeafLayout}`` of the parameters; raises :class:`PlanError` for a plan that does not fit."""
        params = state_or_params if is_params else get_path(state_or_params, self.params)
        return self.plan.resolve(params, self.mesh)

    def state_specs(self, state: Any) -> Any:
        """The spec of every state leaf: parameters by storage, parameter-shaped leaves by optimizer
        spec, everything else replicated."""
        return self.lower(state).specs

    def put_batch(self, batch: Any, *, stream: Any = None) -> Any:
        """The global host ``batch`` (the same on every rank) as this step takes it: DTensors split by the
        plan's batch spec, of which only this rank's block is copied to the mesh's device (pinned,
        ``non_blocking``, on ``stream`` when given: :func:`hpfunc.host_to_device.put_blocks`). Checked
        against the plan's data axes first. ``train_step(state, train_step.put_batch(batch))`` computes
        what ``train_step(state, batch)`` does; the latter slices the rank's block out of the host batch
        in the step's input path (and copies only it too), the former can run ahead on a copy stream."""
        from hpfunc.host_to_device import put_blocks

        self.plan.check_batch(batch, self.mesh)
        return put_blocks(batch, self.mesh, self.plan.batch_spec(self.mesh), stream=stream)

    def lower(self, state: Any, batch: Any = None) -> Lowered:
        """This step for ``state``'s structure (tree, shapes, dtypes): a :class:`~hpfunc.transforms.lowered.Lowered`
        that ``print`` shows leaf by leaf (storage, compute and optimizer specs, gather group, gradient
        reduction) and that runs as ``lowered(state, batch)``. No communication; ``batch`` (optional) is
        checked against the plan's data axes. ``train_step(state, batch)`` lowers on first sight of a
        structure and keeps the result, so calling this first only moves that work earlier."""
        positions, treedef = _tree.flatten(state, none_is_leaf=True)
        hit = self._lowered.get(treedef)
        if hit is None or hit.fits(positions) == RELOWER:
            hit = self._lowered[treedef] = Lowered(self, state, positions, treedef)
        if batch is not None:
            self.plan.check_batch(batch, self.mesh)
        return hit

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
        out_lowered = self.lower(abstract)  # the state's structure: its first step finds it lowered
        first_state = holder(pp, params)
        lowered = Lowered(self, first_state)

        def first(state: Any) -> tuple:
            return (init_fn(get_path(state, pp)),)

        return lowered._run(first, Flat(*_tree.flatten(first_state, none_is_leaf=True)), (), (),
                            (out_lowered.specs,), out=out_lowered)[0]

    def shard_params(self, params: Any) -> Any:
        """Full parameters (identical on every rank) -> DTensors with the plan's storage specs (under a
        ``pp`` layer: those of this rank's stages; the others become ``None``)."""
        from hpfunc.transforms.state_offload import params_to_rest

        params = self.plan.local_params(params, self.mesh)
        res = self.plan.resolve(params, self.mesh)
        return params_to_rest(shard(params, self.mesh, lambda p, x: res[p].spec.storage), self.plan)

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
        positions, treedef = _tree.flatten(state, none_is_leaf=True)
        lowered = self._lowered.get(treedef)  # one lookup by structure
        fit, local = (RELOWER, None) if lowered is None else lowered.fit(positions)
        if fit == RELOWER:  # first sight of this structure, or other shapes or dtypes in it
            lowered = self._lowered[treedef] = Lowered(self, state, positions, treedef)
            fit, local = lowered.fit(positions)
        return lowered.run(state, positions, batch, laid_out=fit == LAID_OUT, local=local)


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


def parallelize(step: Callable, mesh: Mesh, plan: Plan, *, params: str = "params",
                donate_state: bool = False, compile: bool | str = False) -> ParallelizedStep:
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
        compile: as ``train.compile``: ``False`` (eager), ``True`` (``inductor``) or a backend of
            :data:`hpfunc.regions.BACKENDS`; the step runs its model's compiled regions
            (:meth:`ParallelizedStep.compile`, :meth:`Lowered.compile <hpfunc.transforms.lowered.Lowered.compile>`).

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
    return ParallelizedStep(step, mesh, plan, params, bool(donate_state)).compile(compile)


def init_sharded(init_fn: Callable, mesh: Mesh, plan: Plan, key: torch.Tensor, *, shapes: Any) -> Any:
    """Parameters created directly with the plan's storage specs: ``init_fn(key, shardings=...)`` must create
    each leaf with the :class:`~hpfunc.sharding.NamedSharding` given for it (a tree shaped like
    ``shapes``); with counter-based :mod:`hpfunc.random` each rank samples only its block, and the
    values equal the unsharded ``init_fn(key)`` (``functools.partial(qwen3.init, cfg=cfg)`` does this).
    Under a ``pp`` layer the leaves of other pipeline ranks' stages get ``None`` and must come back ``None``.
    Parameters the plan keeps in host memory (``with_state_offload("params")``) are returned there.
    """
    shapes = plan.local_params(shapes, mesh)  # a pipeline rank creates only its stages' parameters
    res = plan.resolve(shapes, mesh)
    shardings = _tree.map_with_path(lambda p, s: NamedSharding(mesh, res[p].spec.storage), shapes,
                                    is_leaf=lambda x: isinstance(x, torch.Size))
    from hpfunc.transforms.state_offload import params_to_rest

    # parameters the plan keeps in host memory (with_state_offload("params")) leave here at rest
    return params_to_rest(init_fn(key, shardings=shardings), plan)


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
                        clip_norm: float | None = None, return_grads: bool = False,
                        compile: bool | str = False) -> ParallelTrainStep:
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
        compile: :func:`parallelize`'s (the model's compiled regions).

    ``metrics``: ``loss`` (mean over the global batch), ``grad_norm`` (global, before clipping) and,
    with ``has_aux``, the aux tensors (floats averaged, integers summed over data shards).
    """
    step = functools.partial(_loss_step, loss_fn, optimizer, has_aux, clip_norm, return_grads)
    return ParallelTrainStep(parallelize(step, mesh, plan, params="params", compile=compile), optimizer, return_grads)
