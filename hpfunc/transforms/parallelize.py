"""``parallel_train_step``: a single-device loss + optimizer, run data / fully-sharded / tensor parallel.

    plan = plans.fsdp("fsdp") + plans.tp("tp")
    step = parallel_train_step(lambda p, b: parallel.loss(p, b, cfg), optim.adamw(1e-3), mesh, plan)
    params = init_sharded(functools.partial(parallel.init, cfg=cfg), mesh, plan, key,
                          shapes=qwen3.param_shapes(cfg))        # or step.shard_params(full_params)
    opt_state = step.init_opt_state(params)
    params, opt_state, metrics = step(params, opt_state, batch)  # same specs in and out

One ``shard_map`` runs the whole step on local blocks, and every byte it moves is an
:mod:`hpfunc.lax` collective (so :func:`hpfunc.comm_stats` sees all of it):

* **use** (FSDP / ZeRO-3): the loss receives the parameters as a lazy tree; reading a leaf
  ``all_gather`` s its storage block to its compute block at that moment, i.e. per layer, in the order
  the model uses them. The all-gather's transpose is a reduce-scatter, so the gradient comes out
  already summed over the FSDP axis and sharded like the storage.
  ``reshard_after_forward=True``: saved-tensor hooks replace every gathered parameter autograd would
  keep for the backward by a marker, and the backward gathers it again (once per parameter) when it
  needs it: 3 Psi (n-1)/n bytes per rank per step instead of 2 Psi (n-1)/n, without the full
  parameters alive between forward and backward.
* **reduce**: a gradient still replicated along a mesh axis (DDP, the replicate axis of HSDP,
  parameters replicated over TP) is summed over it with ``psum``; ZeRO-1/2 use ``psum_scatter`` over
  their axis instead and keep the block their optimizer-state shard needs.
* **update**: the optimizer runs on local blocks (elementwise transforms are exact on blocks);
  optional ``clip_norm`` clips by the true global norm (one scalar ``psum``). ZeRO-1/2 ``all_gather``
  the updated blocks back to replicated parameters.

The loss sees the local batch (dimension 0 split over the plan's data axes) and the gradient is
seeded with ``1 / mesh.size``: the mean over data shards and, on replicated (e.g. TP) axes, the
per-rank split that :mod:`hpfunc.lax` semantics prescribe. The loss must therefore be a mean over
the batch with the same number of counted targets on each data shard (so that the mean of shard
means is the global mean); ``metrics["loss"]`` is that mean.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import attrs
import optree
import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from hpfunc import lax
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.sharding import NamedSharding, P, shard, sharding_of, spec_to_placements
from hpfunc.transforms import plan_context
from hpfunc.transforms.plans import Plan, PlanError, ResolvedLeaf
from hpfunc.transforms.shard_map import shard_map

__all__ = ["parallel_train_step", "parallelize", "ParallelStep", "init_sharded", "PlanError"]


# ---------------------------------------------------------------------------------------------
# Gather on use, and re-gather in the backward instead of keeping the full parameter


class _Regather:
    """Saved-tensor hooks that store gathered parameters as markers (group, slot, how to gather).

    A gathered parameter (or a view of it, e.g. ``w.t()`` saved by ``F.linear``) is identified by its
    root tensor. The backward gathers a group (a layer's parameters) once, when the first of its saved
    parameters is needed, and drops it after the last.
    """

    _MARK = object()

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.roots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.pending: dict[int, list] = {}  # group instance -> [remaining unpacks, regathered roots]

    @staticmethod
    def _root(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    def register(self, fulls: list[torch.Tensor], gid: int, regather: Callable[[], list[torch.Tensor]]) -> None:
        for k, full in enumerate(fulls):
            self.roots[self._root(full)] = (gid, k, regather)

    def pack(self, t: torch.Tensor) -> Any:
        info = self.roots.get(self._root(t))
        if info is None:
            return t
        entry = self.pending.setdefault(info[0], [0, None])
        entry[0] += 1
        return (self._MARK, info, t.size(), t.stride(), t.storage_offset())

    def unpack(self, obj: Any) -> torch.Tensor:
        if not (isinstance(obj, tuple) and len(obj) == 5 and obj[0] is self._MARK):
            return obj
        _, (gid, k, regather), size, stride, offset = obj
        entry = self.pending[gid]
        if entry[1] is None:
            with torch.no_grad(), self.mesh:
                entry[1] = [self._root(f) for f in regather()]
        root = entry[1][k]
        entry[0] -= 1
        if entry[0] == 0:
            del self.pending[gid]
        return torch.as_strided(root, size, stride, offset)


class _MixedGather(torch.autograd.Function):
    """All-gather in the compute dtype; the transpose reduce-scatters in the reduce dtype and returns
    the gradient in the storage dtype (mixed precision: the gather moves bf16, the reduction sums fp32)."""

    @staticmethod
    def forward(x: torch.Tensor, steps: tuple, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.Tensor:
        y = x.to(param_dtype)
        for d, axes, tiled in steps:
            y = lax.all_gather(y, _axis_arg(axes), axis=d, tiled=tiled)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, steps, _, reduce_dtype = inputs
        ctx.steps, ctx.reduce_dtype, ctx.dtype = steps, reduce_dtype, x.dtype

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        g = g.to(ctx.reduce_dtype)
        for d, axes, tiled in reversed(ctx.steps):
            g = lax.psum_scatter(g, _axis_arg(axes), scatter_dimension=d, tiled=tiled)
        return g.to(ctx.dtype), None, None, None


def _all_gather(x: torch.Tensor, steps: tuple, mp: tuple | None) -> torch.Tensor:
    """``steps`` = ((dim, axes, tiled), ...) all-gathers; ``mp`` = (param_dtype, reduce_dtype) or None."""
    if mp is not None and x.is_floating_point():
        return _MixedGather.apply(x, steps, mp[0], mp[1])
    for d, axes, tiled in steps:
        x = lax.all_gather(x, _axis_arg(axes), axis=d, tiled=tiled)
    return x


def _gather_block(x: torch.Tensor, gather: tuple, mp: tuple | None = None) -> torch.Tensor:
    return _all_gather(x, tuple((d, axes, True) for d, axes in gather), mp)


def _gather_group(blocks: list[torch.Tensor], gathers: list[tuple], mp: tuple | None = None) -> list[torch.Tensor]:
    """Gather several parameters with one collective: their blocks packed in one flat buffer.

    Every member gathers one dimension over the same axes (the grouping guarantees it); a single
    member, or one gathering several dimensions, uses its own ``all_gather``. The transpose is one
    ``psum_scatter`` of the packed gradients. ``mp``: mixed precision, see :class:`_MixedGather`.
    """
    if len(blocks) == 1:
        return [_gather_block(blocks[0], gathers[0], mp)]
    axes = gathers[0][0][1]
    n = lax.axis_size(axes)
    full = _all_gather(torch.cat([b.reshape(-1) for b in blocks]), ((0, axes, False),), mp)  # (n, sum of sizes)
    outs = []
    for b, g, part in zip(blocks, gathers, full.split([b.numel() for b in blocks], dim=1)):
        d = g[0][0]
        shape = list(b.shape)
        x = part.reshape([n] + shape).movedim(0, d)
        shape[d] *= n
        outs.append(x.reshape(shape))
    return outs


def _group_key(path: str, r: ResolvedLeaf, dtype: torch.dtype) -> tuple:
    """Parameters gathered together: those under the same list element (``layers.3``), with the same
    gather axes and dtype; top-level parameters each alone (the embedding is used first, the head last)."""
    parts = path.split(".")
    prefix = next((".".join(parts[: i + 1]) for i, p in enumerate(parts) if p.isdigit()), None)
    if prefix is None or len(r.gather) != 1:
        return ("leaf", path)
    return ("group", prefix, r.gather[0][1], dtype)


class _LazyDict(Mapping):
    """A read-only view of a dict of parameters that gathers each leaf when it is read.

    Registered as a pytree node whose children are the *ungathered* values, so structural tree
    operations (``merge_params``, ``tree_map`` picking leaves) keep the view lazy.
    """

    __slots__ = ("_d", "_get")

    def __init__(self, d: Mapping, get: Callable):
        self._d, self._get = d, get

    def __getitem__(self, k: Any) -> Any:
        return _view(self._d[k], self._get)

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, k: Any) -> bool:  # without gathering
        return k in self._d

    def __repr__(self) -> str:
        return f"LazyParams({list(self._d)})"


class _LazyList(Sequence):
    __slots__ = ("_l", "_get")

    def __init__(self, seq: Sequence, get: Callable):
        self._l, self._get = seq, get

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [_view(v, self._get) for v in self._l[i]]
        return _view(self._l[i], self._get)

    def __len__(self) -> int:
        return len(self._l)


def _view(v: Any, gather_leaf: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        return gather_leaf(v)
    if isinstance(v, (_LazyDict, _LazyList)):
        return v
    if isinstance(v, Mapping):
        return _LazyDict(v, gather_leaf)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return _LazyList(v, gather_leaf)
    return v


def _lazy(tree: Any, gather_leaf: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return _view(tree, gather_leaf)


_GLOBAL = getattr(optree.registry, "__GLOBAL_NAMESPACE")
optree.register_pytree_node(
    _LazyDict, lambda x: (list(x._d.values()), (tuple(x._d), x._get), tuple(x._d)),
    lambda meta, children: _LazyDict(dict(zip(meta[0], children)), meta[1]), namespace=_GLOBAL)
optree.register_pytree_node(
    _LazyList, lambda x: (list(x._l), x._get, None),
    lambda get, children: _LazyList(list(children), get), namespace=_GLOBAL)


# ---------------------------------------------------------------------------------------------
# Spec trees


def _spec_tree(tree: Any, by_path: Mapping[str, P]) -> Any:
    return _tree.map_with_path(lambda p, x: by_path[p], tree)


def _state_specs(state: Any, params_treedef: Any, param_specs: Any) -> Any:
    """Specs for an optimizer state: subtrees shaped like the params take the params' opt specs,
    scalar leaves are replicated."""

    def like_params(x: Any) -> bool:
        return not isinstance(x, torch.Tensor) and optree.tree_structure(x, none_is_leaf=True) == params_treedef

    leaves, treedef = optree.tree_flatten(state, is_leaf=like_params, none_is_leaf=True)
    paths = optree.tree_paths(state, is_leaf=like_params, none_is_leaf=True)
    specs = []
    for path, leaf in zip(paths, leaves):
        if like_params(leaf):
            specs.append(param_specs)
        elif isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            raise PlanError(f"optimizer state leaf {_tree.path_str(path)!r} of shape {tuple(leaf.shape)} is not "
                            f"part of a subtree shaped like the parameters; its sharding cannot be inferred")
        else:
            specs.append(P())
    return optree.tree_unflatten(treedef, specs)


def _narrow_blocks(x: torch.Tensor, extra: tuple) -> torch.Tensor:
    for d, axes in extra:
        n = lax.axis_size(axes)
        i = lax.axis_index(axes)
        k = x.shape[d] // n
        x = x.narrow(d, i * k, k)
    return x


# ---------------------------------------------------------------------------------------------
# The step


class _Engine:
    """One step's parameters on this rank: gather them on use, re-gather in the backward, reduce grads.

    ``value_and_grad(blocks, call, ...)`` runs ``call(ws, gather_leaf)`` where ``ws`` are fresh leaves
    (storage blocks that require grad) and ``gather_leaf(w)`` returns the compute block of ``w``
    (gathered with its layer on first read); it returns the per-rank loss, the aux and the gradients
    of the ``wanted`` leaves, reduced and laid out like their optimizer blocks.
    """

    def __init__(self, mesh: Mesh, plan: Plan, leaves_plan: list[ResolvedLeaf], dtypes: list[torch.dtype]):
        self.mesh, self.plan, self.leaves_plan = mesh, plan, leaves_plan
        groups: dict[tuple, list[int]] = {}
        for i, (r, dt) in enumerate(zip(leaves_plan, dtypes)):
            if r.gather:
                groups.setdefault(_group_key(r.path, r, dt), []).append(i)
        self.group_of = {i: members for members in groups.values() for i in members}
        self.any_gather = any(r.gather for r in leaves_plan)
        pd = plan.param_dtype
        self.mixed = None if pd is None else (pd, plan.reduce_dtype or pd)
        self.needs_view = self.any_gather or self.mixed is not None  # parameters go through gather_leaf
        # the loss's gradient seed: factor * (data ranks) / (all ranks) -- with the default factor
        # 1 / data ranks, 1 / mesh.size: the mean over data shards, and on replicated (TP) axes the
        # per-rank split of hpfunc.lax's semantics
        n_data = math.prod(mesh.axis_size(a) for a in mesh.axis_names if a in plan.data_axes)
        factor = plan.gradient_scaling_factor
        self.seed_scale = (1.0 / mesh.size) if factor is None else factor * n_data / mesh.size

    def value_and_grad(self, blocks: list[torch.Tensor], call: Callable[[list[torch.Tensor], Callable], Any],
                       has_aux: bool, wanted: list[int] | None = None, where: str = "parallel_train_step",
                       reduce: bool = True):
        from hpfunc.models.parallel import tensor_parallel

        mesh, plan, leaves_plan = self.mesh, self.plan, self.leaves_plan
        mp = self.mixed
        ws = [x.detach().requires_grad_(x.is_floating_point()) for x in blocks]
        index = {id(w): i for i, w in enumerate(ws)}
        regather = _Regather(mesh) if plan.reshard_after_forward else None
        ready: dict[int, torch.Tensor] = {}  # gathered with their group, not yet read
        gathered: set[int] = set()  # leaves whose group was gathered in this forward
        gids = itertools.count()

        def gather(members: list[int]) -> list[torch.Tensor]:
            group_blocks = [ws[j] for j in members]
            specs = [leaves_plan[j].gather for j in members]
            fulls = _gather_group(group_blocks, specs, mp)
            if regather is not None:
                detached = [b.detach() for b in group_blocks]
                regather.register(fulls, next(gids), lambda: _gather_group(detached, specs, mp))
            return fulls

        def gather_leaf(w: torch.Tensor) -> torch.Tensor:
            i = index.get(id(w))
            if i is None:
                return w
            if not leaves_plan[i].gather:  # used as stored (cast for use under mixed precision)
                return w.to(mp[0]) if mp is not None and w.is_floating_point() else w
            if i in ready:
                return ready.pop(i)
            if i in gathered:  # read a second time: gather it alone again
                return gather([i])[0]
            members = self.group_of[i]
            fulls = gather(members)
            for j, f in zip(members, fulls):
                gathered.add(j)
                if j != i:
                    ready[j] = f
            return fulls[members.index(i)]

        hooks = (torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack)
                 if regather is not None and self.any_gather else _nullcontext())
        with torch.enable_grad(), hooks, tensor_parallel(plan.tp_axis, vocab_parallel=plan.tp_vocab_parallel,
                                                       sequence_parallel=plan.tp_sequence_parallel):
            out = call(ws, gather_leaf)
        ready.clear()  # gathered with a layer but never read: free now
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"{where}: with has_aux=True the function must return (loss, aux)")
            loss, aux = out
        else:
            loss, aux = out, None
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise TypeError(f"{where}: the loss must be a floating 0-d tensor"
                            f"{' (as the first element, has_aux=True)' if has_aux else ''}; found {loss!r}")
        wanted = list(range(len(ws))) if wanted is None else wanted
        diff = [i for i in wanted if ws[i].requires_grad]
        seed = torch.full_like(loss, self.seed_scale)
        gs = (torch.autograd.grad(loss, [ws[i] for i in diff], grad_outputs=seed, allow_unused=True)
              if diff and loss.requires_grad else [None] * len(diff))
        by_leaf = dict(zip(diff, gs))
        grads = [by_leaf.get(i) if by_leaf.get(i) is not None else torch.zeros_like(ws[i]) for i in wanted]
        if not reduce:  # the caller accumulates and calls reduce_grads once
            return loss, aux, grads
        return loss, aux, self.reduce_grads(grads, wanted)

    def reduce_grads(self, grads: list[torch.Tensor], wanted: list[int]) -> list[torch.Tensor]:
        """Per-rank gradients of the leaves ``wanted`` (storage layout) -> reduced, optimizer layout."""
        with torch.no_grad():
            return _reduce_grads(grads, [self.leaves_plan[i] for i in wanted], self.plan.reduce_dtype)

    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a in self.plan.data_axes and self.mesh.axis_size(a) > 1)


def _maybe_lazy(tree: Any, get: Callable, engine: _Engine) -> Any:
    return _lazy(tree, get) if engine.needs_view else tree


@attrs.frozen(eq=False)
class ParallelStep:
    """``params, opt_state, metrics = step(params, opt_state, batch)`` (see the module docstring)."""

    loss_fn: Callable
    optimizer: Any
    mesh: Mesh
    plan: Plan
    has_aux: bool = False
    clip_norm: float | None = None
    return_grads: bool = False
    _cache: dict = attrs.field(factory=dict, init=False, repr=False)

    # -- planning (no communication) ------------------------------------------------------------
    def resolve(self, params: Any) -> dict[str, ResolvedLeaf]:
        """``{path: ResolvedLeaf}``; raises :class:`PlanError` for a plan that does not fit."""
        return self.plan.resolve(params, self.mesh)

    def param_specs(self, params: Any, which: str = "storage") -> Any:
        res = self.resolve(params)
        return _spec_tree(params, {p: getattr(r.spec, which) for p, r in res.items()})

    def shard_params(self, params: Any) -> Any:
        """Full parameters (identical on every rank) -> DTensors with the plan's storage specs."""
        return shard(params, self.mesh, self.param_specs(params))

    def init_opt_state(self, params: Any) -> Any:
        """``optimizer.init`` on the optimizer blocks (no communication): DTensors with the opt specs."""
        res = self.resolve(params)
        _check_params(params, res, self.mesh)

        opt_specs = self.param_specs(params, "opt")
        storage = self.param_specs(params)
        treedef = optree.tree_structure(params, none_is_leaf=True)
        extra = {p: r.opt_extra for p, r in res.items()}

        def body(p):
            blocks = _tree.map_with_path(lambda path, x: _narrow_blocks(x, extra[path]).clone(), p)
            return self.optimizer.init(blocks)

        shapes = _tree.map_with_path(lambda path, x: torch.empty(x.shape, dtype=x.dtype, device="meta"), params)
        state_specs = _state_specs(self.optimizer.init(shapes), treedef, opt_specs)
        return shard_map(body, mesh=self.mesh, in_specs=(storage,), out_specs=state_specs)(params)

    # -- the step -----------------------------------------------------------------------------
    def _plan_for(self, params: Any, opt_state: Any) -> tuple:
        """``(res, storage specs, opt specs, treedef, state specs)``, cached by structure and shapes."""
        p_leaves, p_def = optree.tree_flatten(params, none_is_leaf=True)
        s_leaves, s_def = optree.tree_flatten(opt_state, none_is_leaf=True)
        shapes = lambda xs: tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in xs)  # noqa: E731
        key = (p_def, shapes(p_leaves), s_def, shapes(s_leaves))
        cache = self._cache
        hit = cache.get(key)
        if hit is None:
            res = self.resolve(params)
            storage = _spec_tree(params, {p: r.spec.storage for p, r in res.items()})
            opt_specs = _spec_tree(params, {p: r.spec.opt for p, r in res.items()})
            treedef = optree.tree_structure(params, none_is_leaf=True)
            hit = (res, storage, opt_specs, treedef, _state_specs(opt_state, treedef, opt_specs))
            cache[key] = hit
        return hit

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict]:
        mesh, plan = self.mesh, self.plan
        res, storage, opt_specs, treedef, state_specs = self._plan_for(params, opt_state)
        _check_params(params, res, mesh)
        batch_spec = plan.batch_spec(mesh)
        plan.check_batch(batch, mesh)
        out_specs = (storage, state_specs, P()) if not self.return_grads else (storage, state_specs, P(), opt_specs)
        body = functools.partial(self._local_step, [res[p] for p, _ in _tree.leaves_with_paths(params)], treedef)
        return shard_map(body, mesh=mesh, in_specs=(storage, state_specs, batch_spec),
                         out_specs=out_specs)(params, opt_state, batch)

    def _local_step(self, leaves_plan: list[ResolvedLeaf], treedef: Any, params: Any, opt_state: Any,
                    batch: Any):
        from hpfunc.optim import apply_updates

        mesh = self.mesh
        leaves = optree.tree_leaves(params, none_is_leaf=True)
        engine = _Engine(mesh, self.plan, leaves_plan, [x.dtype for x in leaves])
        loss, aux, red = engine.value_and_grad(
            leaves, lambda ws, get: self.loss_fn(_maybe_lazy(optree.tree_unflatten(treedef, ws), get, engine), batch),
            self.has_aux)
        ws = leaves
        with torch.no_grad():
            data_axes = engine.data_axes()
            gnorm = plan_context.blocks_sq_norm(mesh, [r.spec.opt for r in leaves_plan], red).sqrt()
            reduced = optree.tree_unflatten(treedef, red)  # returned (before clipping) with return_grads
            if self.clip_norm is not None:
                scale = torch.clamp(self.clip_norm / (gnorm + 1e-6), max=1.0)
                red = [(g * scale).to(g.dtype) for g in red]
            p_opt = [_narrow_blocks(w.detach(), r.opt_extra) for w, r in zip(ws, leaves_plan)]
            g_tree = optree.tree_unflatten(treedef, red)
            p_tree = optree.tree_unflatten(treedef, p_opt)
            updates, new_state = self.optimizer.update(g_tree, opt_state, p_tree)
            new_p = optree.tree_leaves(apply_updates(p_tree, updates), none_is_leaf=True)
            new_p = _gather_params(new_p, leaves_plan)
            metrics = {"loss": lax.pmean(loss.detach(), data_axes) if data_axes else loss.detach(),
                       "grad_norm": gnorm.float()}
            if aux is not None:
                metrics.update(_reduce_aux(aux, data_axes))
        out = (optree.tree_unflatten(treedef, new_p), new_state, metrics)
        if self.return_grads:
            out = out + (reduced,)
        return out


def _axis_arg(axes: tuple[str, ...]) -> Any:
    return axes if len(axes) > 1 else axes[0]


def _blocks_first(g: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """``g`` with dimension ``d`` split into ``n`` blocks, as an ``(n, block numel)`` matrix."""
    shape = list(g.shape)
    split = shape[:d] + [n, shape[d] // n] + shape[d + 1:]
    return g.reshape(split).movedim(d, 0).reshape(n, -1)


def _reduce_grads(grads: list[torch.Tensor], plan: list[ResolvedLeaf],
                  reduce_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """See :func:`_reduce_grads_as`; ``reduce_dtype``: the collectives run in it (results in the grads' dtypes)."""
    if reduce_dtype is None:
        return _reduce_grads_as(grads, plan)
    cast = [g.to(reduce_dtype) if g.is_floating_point() else g for g in grads]
    return [r.to(g.dtype) for r, g in zip(_reduce_grads_as(cast, plan), grads)]


def _reduce_grads_as(grads: list[torch.Tensor], plan: list[ResolvedLeaf]) -> list[torch.Tensor]:
    """Sum every gradient over the axes its storage is replicated on; ZeRO axes by reduce-scatter.

    Gradients that need the same collective are packed into one flat buffer (one call per bucket, the
    same bytes as one call per parameter): ``psum`` buckets by (axes, dtype); ``psum_scatter`` buckets
    by (axes, remaining axes, dtype), each gradient laid out blocks-first so that the flat scatter hands
    every rank its block of each gradient.
    """
    out: list[torch.Tensor | None] = [None] * len(grads)
    buckets: dict[tuple, list[int]] = {}
    for i, (r, g) in enumerate(zip(plan, grads)):
        done = {a for _, axes in r.opt_extra for a in axes}
        rest = tuple(a for a in r.replicated if a not in done)
        if len(r.opt_extra) > 1:  # rare (two ZeRO dims): one collective per dimension
            for d, axes in r.opt_extra:
                g = lax.psum_scatter(g, _axis_arg(axes), scatter_dimension=d, tiled=True)
            out[i] = lax.psum(g, rest) if rest else g
        elif r.opt_extra:
            buckets.setdefault(("rs", r.opt_extra[0][1], rest, g.dtype), []).append(i)
        elif rest:
            buckets.setdefault(("ar", (), rest, g.dtype), []).append(i)
        else:
            out[i] = g
    for (kind, axes, rest, _), idx in buckets.items():
        if kind == "ar":
            flat = lax.psum(torch.cat([grads[i].reshape(-1) for i in idx]), rest)
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx])):
                out[i] = part.view(grads[i].shape)
            continue
        n = lax.axis_size(axes)
        mats = [_blocks_first(grads[i], plan[i].opt_extra[0][0], n) for i in idx]
        flat = lax.psum_scatter(torch.cat(mats, dim=1), _axis_arg(axes), scatter_dimension=0, tiled=False)
        if rest:
            flat = lax.psum(flat, rest)
        for i, m, part in zip(idx, mats, flat.split([m.shape[1] for m in mats])):
            d = plan[i].opt_extra[0][0]
            shape = list(grads[i].shape)
            shape[d] //= n
            out[i] = part.reshape(shape)
    return out


def _gather_params(blocks: list[torch.Tensor], plan: list[ResolvedLeaf]) -> list[torch.Tensor]:
    """All-gather ZeRO-updated parameter blocks back to their storage layout, bucketed like the grads."""
    out: list[torch.Tensor | None] = [None] * len(blocks)
    buckets: dict[tuple, list[int]] = {}
    for i, (r, x) in enumerate(zip(plan, blocks)):
        if len(r.opt_extra) == 1:
            buckets.setdefault((r.opt_extra[0][1], x.dtype), []).append(i)
        else:
            out[i] = _gather_back(x, r.opt_extra)
    for (axes, _), idx in buckets.items():
        n = lax.axis_size(axes)
        full = lax.all_gather(torch.cat([blocks[i].reshape(-1) for i in idx]), _axis_arg(axes), axis=0, tiled=False)
        for i, part in zip(idx, full.split([blocks[i].numel() for i in idx], dim=1)):
            d = plan[i].opt_extra[0][0]
            bshape = list(blocks[i].shape)
            x = part.reshape([n] + bshape).movedim(0, d)
            bshape[d] *= n
            out[i] = x.reshape(bshape)
    return out


def _gather_back(x: torch.Tensor, extra: tuple) -> torch.Tensor:
    for d, axes in reversed(extra):
        x = lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=d, tiled=True)
    return x


def _reduce_aux(aux: Any, data_axes: tuple[str, ...]) -> dict:
    out = {}
    if not isinstance(aux, Mapping):
        return out
    for k, v in aux.items():
        if not isinstance(v, torch.Tensor):
            continue
        v = v.detach()
        if data_axes:
            v = lax.pmean(v, data_axes) if v.is_floating_point() else lax.psum(v, data_axes)
        out[k] = v
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _check_params(params: Any, res: Mapping[str, ResolvedLeaf], mesh: Mesh) -> None:
    for path, x in _tree.leaves_with_paths(params):
        r = res[path]
        if isinstance(x, DTensor):
            # placements, not sharding_of(): this runs every step and must stay cheap
            want = spec_to_placements(r.spec.storage, mesh, x.ndim, where=path)
            same_mesh = x.device_mesh is mesh.device_mesh or x.device_mesh == mesh.device_mesh
            if not same_mesh or list(x.placements) != list(want):
                raise PlanError(f"parameter {path!r} is stored as {sharding_of(x).spec!r} but the plan stores it "
                                f"as {r.spec.storage!r}; use step.shard_params / hpfunc.reshard first")


def _norm(spec: P) -> tuple:
    s = list(spec)
    while s and s[-1] is None:
        s.pop()
    return tuple(s)


def parallel_train_step(loss_fn: Callable, optimizer: Any, mesh: Mesh, plan: Plan, *, has_aux: bool = False,
                        clip_norm: float | None = None, return_grads: bool = False) -> ParallelStep:
    """A training step ``(params, opt_state, batch) -> (params, opt_state, metrics)`` on ``mesh``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) written for one
            device: a mean over the batch. For a ``tp`` plan use the tensor-parallel-aware model
            (:mod:`hpfunc.models.parallel`), which reduces row-parallel outputs over the bound axis.
        optimizer: an :mod:`hpfunc.optim` transformation whose update is elementwise per parameter
            (adamw, sgd, scale, ...). Do not chain ``clip_by_global_norm`` into it under a sharded
            plan (it would see local blocks); pass ``clip_norm`` here instead.
        mesh, plan: where and how (:mod:`hpfunc.transforms.plans`).
        clip_norm: clip gradients by their true global L2 norm (``torch.nn.utils.clip_grad_norm_``'s
            formula) before the optimizer.
        return_grads: also return the reduced gradients (DTensors with the plan's opt specs).

    ``metrics``: ``loss`` (mean over the global batch), ``grad_norm`` (global, before clipping) and,
    with ``has_aux``, the aux tensors (floats averaged, integers summed over data shards).
    """
    return ParallelStep(loss_fn, optimizer, mesh, plan, has_aux, clip_norm, return_grads)


def parallelize(step: Callable, mesh: Mesh, plan: Plan, *, params: str = "params") -> Any:
    """``hpfunc.parallelize(step, mesh, plan)``: see :func:`hpfunc.transforms.state_step.parallelize`."""
    from hpfunc.transforms.state_step import parallelize as _parallelize

    return _parallelize(step, mesh, plan, params=params)


def init_sharded(init_fn: Callable, mesh: Mesh, plan: Plan, key: torch.Tensor, *, shapes: Any) -> Any:
    """Parameters created directly with the plan's storage specs: ``init_fn(key, shardings)`` must create
    each leaf with ``sharding=shardings[...]`` (a tree of :class:`NamedSharding` shaped like
    ``shapes``); with counter-based :mod:`hpfunc.random` each rank samples only its block, and the
    values equal single-device ``init(key)``. See :func:`hpfunc.models.parallel.init`.
    """
    res = plan.resolve(shapes, mesh)
    shardings = _tree.map_with_path(lambda p, s: NamedSharding(mesh, res[p].spec.storage), shapes,
                                    is_leaf=lambda x: isinstance(x, torch.Size))
    return init_fn(key, shardings=shardings)
