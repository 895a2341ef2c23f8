"""``hpfunc.parallelize(step, mesh, plan)``: a pure single-device ``step(state, batch) -> (state, metrics)``
run data / fully-sharded / tensor parallel.

    from hpfunc.train.step import init_train_state, make_train_step
    step = make_train_step(cfg, optim.adamw(1e-3), loss_fn=hpfunc.models.parallel.loss)
    train_step = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp") + plans.tp("tp"))
    params = init_sharded(functools.partial(parallel.init, cfg=cfg), mesh, plan, key,
                          shapes=qwen3.param_shapes(cfg))       # each rank creates only its blocks
    state = train_step.init_state(lambda p: init_train_state(p, tx), params)
    state, metrics = train_step(state, batch)                  # the global batch, on every rank

The step runs once per rank inside one :func:`shard_map`, on this rank's blocks, with the plan bound
(:mod:`hpfunc.transforms.plan_context`) so that the library calls a step makes give the
single-device result:

* the parameters (found at ``state.<params>``) are shown to the step as their *optimizer blocks*:
  the storage block, narrowed further on ZeRO-1/2's axes; the optimizer state arrives as the matching
  blocks, the batch split along dimension 0 over the plan's data axes;
* :func:`hpfunc.value_and_grad` / :func:`hpfunc.grad` on (a subtree of) those parameters runs the
  plan's engine: the function receives the parameters gathered on use (per layer, re-gathered in
  the backward with ``reshard_after_forward``), the gradient is reduced over the data and replicated
  axes and returned as optimizer blocks, the value is the mean over data shards, and ``aux`` tensors
  are averaged (floats) or summed (integers) over data shards;
* :func:`hpfunc.optim.global_norm` / ``clip_by_global_norm`` use the norm of the global tensors,
  Muon gathers a sharded matrix before Newton-Schulz, and
  :func:`hpfunc.transforms.plan_context.local_block` cuts a global value to a leaf's block;
* elementwise code (AdamW, ``apply_updates``, weight decay, schedules) is exact on blocks as it is.

The parameters the step returns (optimizer blocks) are put back to storage (ZeRO-1/2 all-gather the
updated blocks). Every other state leaf shaped like a parameter, at a path ending in that
parameter's path (``opt_state.0.mu.layers.0.attn.wq``), is laid out like that parameter's optimizer
block; any other leaf is replicated, and so must be every metric the step returns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import attrs
import optree
import torch

from hpfunc import lax
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.sharding import P
from hpfunc.transforms import plan_context
from hpfunc.transforms.parallelize import (_check_params, _Engine, _gather_params, _lazy,
                                            _narrow_blocks)
from hpfunc.transforms.plans import Plan, PlanError, ResolvedLeaf
from hpfunc.transforms.shard_map import shard_map

__all__ = ["parallelize", "ParallelizedStep"]


# ---------------------------------------------------------------------------------------------
# Reading and replacing the parameters inside a state


def _get(state: Any, path: str) -> Any:
    x = state
    for part in path.split(".") if path else []:
        if isinstance(x, Mapping):
            if part not in x:
                raise PlanError(f"parallelize: the state has no {path!r} (no key {part!r} in {sorted(map(str, x))})")
            x = x[part]
        elif isinstance(x, Sequence) and not hasattr(x, "_fields") and part.isdigit():
            x = x[int(part)]
        elif hasattr(x, part):
            x = getattr(x, part)
        else:
            raise PlanError(f"parallelize: the state has no {path!r} ({type(x).__name__} has no {part!r}); "
                            f"pass params= the path of the parameters in the state")
    return x


def _replace(state: Any, path: str, value: Any) -> Any:
    if not path:
        return value
    part, _, rest = path.partition(".")
    if isinstance(state, Mapping):
        out = dict(state)
        out[part] = _replace(state[part], rest, value)
        return type(state)(out) if type(state) is not dict else out
    if hasattr(state, "_fields"):  # NamedTuple
        return state._replace(**{part: _replace(getattr(state, part), rest, value)})
    if attrs.has(type(state)):
        return attrs.evolve(state, **{part: _replace(getattr(state, part), rest, value)})
    if isinstance(state, (list, tuple)) and part.isdigit():
        items = list(state)
        items[int(part)] = _replace(items[int(part)], rest, value)
        return type(state)(items)
    raise PlanError(f"parallelize: cannot replace {path!r} in a {type(state).__name__}")


def _opt_block_shape(r: ResolvedLeaf, mesh: Mesh) -> tuple[int, ...]:
    shape = list(r.shape)
    for d in range(len(shape)):
        axes = r.spec.opt.dim_axes(d)
        if axes:
            shape[d] //= mesh.axis_size(axes)
    return tuple(shape)


def _param_suffix(path: str, res: Mapping[str, ResolvedLeaf]) -> str | None:
    parts = path.split(".")
    for k in range(1, len(parts)):
        suffix = ".".join(parts[k:])
        if suffix in res:
            return suffix
    return None


# ---------------------------------------------------------------------------------------------
# The context a step sees on each rank


class _StepContext:
    """The plan bound while the user's step runs on one rank (see :mod:`plan_context`)."""

    def __init__(self, mesh: Mesh, plan: Plan, paths: list[str], leaves_plan: list[ResolvedLeaf],
                 storage: list[torch.Tensor], opt_blocks: list[torch.Tensor]):
        self.mesh, self.plan = mesh, plan
        self.paths, self.leaves_plan = paths, leaves_plan
        self.by_path = dict(zip(paths, leaves_plan))
        self.storage, self.opt_blocks = storage, opt_blocks
        self.index = {id(x): i for i, x in enumerate(opt_blocks)}
        self.engine = _Engine(mesh, plan, leaves_plan, [x.dtype for x in storage])
        self.block_shapes = {p: _opt_block_shape(r, mesh) for p, r in self.by_path.items()}
        self.deferred: list | None = None  # inside hpfunc.microbatch: [the leaves differentiated]

    # -- micro-batches: reduce once ---------------------------------------------------------------
    def start_deferred(self) -> None:
        if self.deferred is not None:
            raise PlanError("hpfunc.microbatch: micro-batching inside micro-batching is not supported")
        self.deferred = []

    def finish_deferred(self, grads: Any) -> Any:
        """Reduce a gradient tree summed over micro-batches (shaped like each micro-batch's)."""
        order, self.deferred = (self.deferred or [None])[0], None
        if order is None:  # no value_and_grad ran under the plan
            return grads
        leaves, treedef = optree.tree_flatten(grads)
        if len(leaves) != len(order):
            raise PlanError(f"hpfunc.microbatch: the accumulated gradient has {len(leaves)} leaves, each "
                            f"micro-batch's had {len(order)}")
        at = [k for k, i in enumerate(order) if i is not None]
        red = self.engine.reduce_grads([leaves[k] for k in at], [order[k] for k in at])
        for k, r in zip(at, red):
            leaves[k] = r
        return optree.tree_unflatten(treedef, leaves)

    def leaf(self, path: str, x: torch.Tensor | None, where: str) -> ResolvedLeaf:
        r = self.by_path.get(path)
        if r is None:
            raise PlanError(f"{where} inside hpfunc.parallelize: {path!r} is not a parameter path of the plan; "
                            f"this works on trees shaped like the parameters (paths relative to their root, e.g. "
                            f"{self.paths[0]!r})" if self.paths else f"{where}: the plan has no parameters")
        if x is not None and tuple(x.shape) != self.block_shapes[path]:
            raise PlanError(f"{where} inside hpfunc.parallelize: the leaf at {path!r} has shape {tuple(x.shape)}, "
                            f"but this rank's block of that parameter is {self.block_shapes[path]} (global "
                            f"{tuple(r.shape)}, optimizer spec {r.spec.opt!r})")
        return r

    # -- value_and_grad -----------------------------------------------------------------------
    def value_and_grad(self, fn: Callable, argnums: tuple[int, ...], multi: bool, has_aux: bool, args: tuple,
                       kwargs: dict) -> Any:
        args = list(args)
        for a in argnums:
            if a >= len(args) or a < -len(args):
                raise ValueError(f"value_and_grad: argnums {a} but the function got {len(args)} positional arguments")
        argnums = tuple(a % len(args) for a in argnums)
        with_params: list[int] = []
        wanted: list[int] = []
        for a, arg in enumerate(args):
            found = False
            for path, x in _tree.leaves_with_paths(arg):
                i = self.index.get(id(x)) if isinstance(x, torch.Tensor) else None
                if i is not None:
                    found = True
                    if a in argnums:
                        wanted.append(i)
                elif a in argnums and isinstance(x, torch.Tensor):
                    raise PlanError(
                        f"value_and_grad inside hpfunc.parallelize: argument {a} leaf {path or '<root>'!r} is not one "
                        f"of the state's parameters; differentiate the parameters parallelize passed to the step "
                        f"(or a subtree of them) and compute other values inside the function")
            if found:
                with_params.append(a)
        if not wanted:
            raise PlanError("value_and_grad inside hpfunc.parallelize: the differentiated arguments hold none of the "
                            "state's parameters (the tensors parallelize passed to the step); a gradient of anything "
                            "else would be per-rank, not the single-device one")
        wanted = sorted(set(wanted))
        # an argument shaped like a parameter-holding one (e.g. the `frozen` half of a split with no
        # leaves) is wrapped too, so that structural tree operations between them still line up
        shapes = {optree.tree_structure(args[a], none_is_leaf=True) for a in with_params}
        with_params += [a for a, arg in enumerate(args) if a not in with_params and isinstance(arg, (Mapping, list))
                        and optree.tree_structure(arg, none_is_leaf=True) in shapes]

        def call(ws: list[torch.Tensor], get: Callable) -> Any:
            new_args = list(args)
            for a in with_params:
                swapped = _tree.tree_map(
                    lambda x: ws[self.index[id(x)]] if isinstance(x, torch.Tensor) and id(x) in self.index else x,
                    args[a])
                new_args[a] = _lazy(swapped, get) if self.engine.needs_view else swapped
            with plan_context.bind(None):
                return fn(*new_args, **kwargs)

        deferred = self.deferred is not None
        loss, aux, red = self.engine.value_and_grad(self.storage, call, has_aux, wanted, where="value_and_grad",
                                                    reduce=not deferred)
        grad_of = dict(zip(wanted, red))
        data_axes = self.engine.data_axes()
        with torch.no_grad():
            value = lax.pmean(loss.detach(), data_axes) if data_axes else loss.detach()
            if has_aux:
                aux = _reduce_tree(aux, data_axes)
        results = [_tree.tree_map(lambda x: grad_of[self.index[id(x)]] if isinstance(x, torch.Tensor) else x,
                                  args[a]) for a in argnums]
        g_out = tuple(results) if multi else results[0]
        if deferred:  # inside hpfunc.microbatch: per-rank gradients, reduced once by finish_deferred
            order = [self.index.get(id(x)) if isinstance(x, torch.Tensor) else None
                     for a in argnums for x in optree.tree_leaves(args[a])]
            if self.deferred and self.deferred[0] != order:
                raise PlanError("hpfunc.microbatch inside hpfunc.parallelize: every micro-batch must differentiate "
                                "the same parameters")
            self.deferred[:] = [order]
        return ((value, aux) if has_aux else value), g_out

    # -- back to storage ------------------------------------------------------------------------
    def to_storage(self, new: list[Any]) -> list[torch.Tensor]:
        out: list[Any] = list(self.storage)
        changed = []
        for i, x in enumerate(new):
            if x is self.opt_blocks[i]:
                continue
            path = self.paths[i]
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != self.block_shapes[path]:
                found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise PlanError(f"parallelize: the step returned parameter {path!r} as {found}; it must keep the "
                                f"shape of the block it was given, {self.block_shapes[path]}")
            changed.append(i)
        if changed:
            with torch.no_grad():
                back = _gather_params([new[i].detach() for i in changed], [self.leaves_plan[i] for i in changed])
            for i, x in zip(changed, back):
                out[i] = x
        return out


def _reduce_tree(tree: Any, data_axes: tuple[str, ...]) -> Any:
    """Batch statistics over the data shards: floats averaged, integers summed."""

    def red(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        if not data_axes:
            return x
        return lax.pmean(x, data_axes) if (x.is_floating_point() or x.is_complex()) else lax.psum(x, data_axes)

    return _tree.tree_map(red, tree)


# ---------------------------------------------------------------------------------------------
# The transform


@attrs.frozen(eq=False)
class ParallelizedStep:
    """``state, metrics = train_step(state, batch)`` on ``mesh`` (see the module docstring)."""

    step: Callable
    mesh: Mesh
    plan: Plan
    params: str = "params"
    _cache: dict = attrs.field(factory=dict, init=False, repr=False)

    # -- planning (no communication) ------------------------------------------------------------
    def resolve(self, state_or_params: Any, *, is_params: bool = False) -> dict[str, ResolvedLeaf]:
        """``{path: ResolvedLeaf}`` of the parameters; raises :class:`PlanError` for a plan that does not fit."""
        params = state_or_params if is_params else _get(state_or_params, self.params)
        return self.plan.resolve(params, self.mesh)

    def state_specs(self, state: Any) -> Any:
        """The spec of every state leaf: parameters by storage, parameter-shaped leaves by optimizer
        spec, everything else replicated."""
        return self._specs(state)[1]

    def _specs(self, state: Any) -> tuple[dict[str, ResolvedLeaf], Any]:
        leaves, treedef = optree.tree_flatten(state)
        key = (treedef, tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        res = self.resolve(state)
        # the parameters' leaves, by identity (paths inside a NamedTuple state are positional)
        param_of = {id(x): p for p, x in _tree.leaves_with_paths(_get(state, self.params)) if isinstance(x, torch.Tensor)}

        def spec(path: str, x: Any) -> P:
            if isinstance(x, torch.Tensor) and id(x) in param_of:
                return res[param_of[id(x)]].spec.storage
            if not isinstance(x, torch.Tensor) or x.ndim == 0:
                return P()
            suffix = _param_suffix(path, res)
            if suffix is None:
                return P()  # not parameter-like: replicated (an RNG key, a global buffer)
            if tuple(x.shape) != res[suffix].shape:
                raise PlanError(f"state leaf {path!r} of shape {tuple(x.shape)} ends with the parameter path "
                                f"{suffix!r} but not with its shape {res[suffix].shape}; its sharding cannot be "
                                f"inferred (optimizer state must be shaped like the parameters)")
            return res[suffix].spec.opt

        specs = _tree.map_with_path(spec, state)
        self._cache[key] = (res, specs)
        return res, specs

    # -- running ----------------------------------------------------------------------------------
    def _run(self, fn: Callable, state_in: Any, in_specs: Any, args: tuple, arg_specs: tuple, out_specs: Any,
             res: Mapping[str, ResolvedLeaf]) -> Any:
        mesh, plan, pp = self.mesh, self.plan, self.params

        def body(state: Any, *rest: Any) -> Any:
            params = _get(state, pp)
            pairs = _tree.leaves_with_paths(params)
            _, treedef = _tree.flatten(params)
            paths = [p for p, _ in pairs]
            storage = [x for _, x in pairs]
            leaves_plan = [res[p] for p in paths]
            opt_blocks = [_narrow_blocks(x, r.opt_extra) for x, r in zip(storage, leaves_plan)]
            ctx = _StepContext(mesh, plan, paths, leaves_plan, storage, opt_blocks)
            user_state = _replace(state, pp, _tree.unflatten(treedef, opt_blocks))
            with plan_context.bind(ctx):
                new_state, *extra = fn(user_state, *rest)
            new_params = _get(new_state, pp)
            new_leaves, new_def = _tree.flatten(new_params)
            if new_def != treedef:
                raise PlanError(f"parallelize: the step changed the structure of the parameters "
                                f"({_tree.structure(new_params)} instead of {treedef})")
            new_state = _replace(new_state, pp, _tree.unflatten(treedef, ctx.to_storage(new_leaves)))
            return (new_state, *extra)

        return shard_map(body, mesh=mesh, in_specs=(in_specs, *arg_specs), out_specs=out_specs)(state_in, *args)

    def init_state(self, init_fn: Callable[[Any], Any], params: Any) -> Any:
        """``init_fn(params) -> state`` run on every rank's blocks (e.g. ``lambda p: init_train_state(p, tx)``).

        ``params`` are the sharded parameters (:func:`init_sharded`, or ``shard_params``); the returned
        state holds them unchanged and optimizer state laid out like their optimizer blocks.
        """
        res = self.plan.resolve(params, self.mesh)
        _check_params(params, res, self.mesh)
        pp = self.params
        meta = _tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                              if isinstance(x, torch.Tensor) else x, params)
        abstract = init_fn(meta)
        _get(abstract, pp)  # the state must hold the parameters where `params=` says
        _, out_specs = self._specs(abstract)
        storage = _tree.map_with_path(lambda p, x: res[p].spec.storage, params)
        holder = _replace_root(pp, params)

        def first(state: Any) -> tuple:
            return (init_fn(_get(state, pp)),)

        return self._run(first, holder, _replace_root(pp, storage), (), (), (out_specs,), res)[0]

    def shard_params(self, params: Any) -> Any:
        """Full parameters (identical on every rank) -> DTensors with the plan's storage specs."""
        from hpfunc.sharding import shard

        res = self.plan.resolve(params, self.mesh)
        return shard(params, self.mesh, _tree.map_with_path(lambda p, x: res[p].spec.storage, params))

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        res, specs = self._specs(state)
        _check_params(_get(state, self.params), res, self.mesh)
        batch_spec = self.plan.batch_spec(self.mesh)
        self.plan.check_batch(batch, self.mesh)

        def fn(user_state: Any, b: Any) -> tuple:
            out = self.step(user_state, b)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"parallelize: the step must return (state, metrics); found {type(out).__name__}")
            return out

        return self._run(fn, state, specs, (batch,), (batch_spec,), (specs, P()), res)


def _replace_root(path: str, value: Any) -> Any:
    """A minimal state holding ``value`` at ``path`` (nested dicts)."""
    for part in reversed(path.split(".")) if path else []:
        value = {part: value}
    return value


def parallelize(step: Callable, mesh: Mesh, plan: Plan, *, params: str = "params") -> ParallelizedStep:
    """Distribute a pure single-device ``step(state, batch) -> (state, metrics)`` over ``mesh`` by ``plan``.

    Args:
        step: written for one device. It differentiates with :func:`hpfunc.value_and_grad` (or
            :func:`hpfunc.grad`) with respect to the state's parameters and updates them with an
            :mod:`hpfunc.optim` optimizer. Under a ``tp`` plan its model must be the tensor-parallel
            aware one (:mod:`hpfunc.models.parallel`).
        mesh, plan: where and how (:mod:`hpfunc.transforms.plans`).
        params: the dotted path of the parameters in the state (``"params"`` finds ``state["params"]``
            and ``state.params``).

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
    return ParallelizedStep(step, mesh, plan, params)
