"""The layout bound while the user's step runs on one rank: :class:`RankStep` implements
:class:`hpfunc.layout.StepLayout` for :func:`hpfunc.parallelize`.

The step receives its parameters as this rank's *optimizer blocks* (the storage block, narrowed
further on ZeRO-1/2 axes), handed out as :class:`~hpfunc.transforms.engine.view.Blocks`.
:meth:`RankStep.value_and_grad` recognises them in the arguments of a differentiated function by
identity, runs the plan's differentiation (:mod:`~hpfunc.transforms.engine.differentiate`) with the
function seeing them as used, and returns the gradients reduced and laid out like the blocks; the
value is the mean over data shards and ``aux`` tensors are averaged (floats) or summed (integers)
over data shards. :meth:`RankStep.to_storage` puts the parameters the step returns back to storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from hpfunc import lax, layout, saved_tensors
from hpfunc import tree as _tree
from hpfunc.layout import LeafLayout, PlanError
from hpfunc.transforms.engine import differentiate
from hpfunc.transforms.engine.reduce import gather_updated, narrow_to_opt
from hpfunc.transforms.engine.step_scalars import reduce_batch_stats
from hpfunc.transforms.engine.view import Blocks, lazy

__all__ = ["RankStep", "reduce_batch_stats"]


class _Accumulation:
    """Micro-batches: the parameters every micro-batch differentiated, in order (the same each time)."""

    def __init__(self, step: "RankStep"):
        self.step = step
        self.order: list[int | None] | None = None

    def record(self, order: list[int | None]) -> None:
        if self.order is not None and self.order != order:
            raise PlanError("hpfunc.microbatch inside hpfunc.parallelize: every micro-batch must differentiate "
                            "the same parameters")
        self.order = order

    def reduce(self, grads: Any) -> Any:
        if self.order is None:  # no value_and_grad ran under the plan
            return grads
        leaves, treedef = _tree.flatten(grads)
        if len(leaves) != len(self.order):
            raise PlanError(f"hpfunc.microbatch: the accumulated gradient has {len(leaves)} leaves, each "
                            f"micro-batch's had {len(self.order)}")
        at = [k for k, i in enumerate(self.order) if i is not None]
        red = differentiate.reduce_wanted(self.step.program, [leaves[k] for k in at], [self.order[k] for k in at])
        for k, r in zip(at, red):
            leaves[k] = r
        return _tree.unflatten(treedef, leaves)


class RankStep:
    """One rank's view of a parallelized step (see the module docstring)."""

    def __init__(self, program: Any, storage: list[torch.Tensor], *, donate_state: bool = False):
        # program: the lowered step (hpfunc.transforms.lowered.Lowered): its engine facts and parameter
        # paths, and the structures its first runs found
        cfg = program.engine
        self.program, self.cfg, self.mesh = program, cfg, cfg.mesh
        self.donate_state = donate_state
        self.paths, self.leaves = program.paths, cfg.leaves
        self.by_path = cfg.by_path
        self.storage = storage
        self.opt_blocks = Blocks([narrow_to_opt(x, lay.opt_extra) for x, lay in zip(storage, cfg.leaves)])
        self.block_shapes = cfg.block_shapes
        self.pipeline_axis = cfg.plan.pp_axis  # norms sum over it: each pipeline rank holds some stages
        self._acc: _Accumulation | None = None
        self.differentiations = 0  # value_and_grad calls so far in this step (which gather order is theirs)
        self._sq_norm: tuple | None = None  # (gradient blocks, their versions, their global sum of squares)
        self._last_grads: tuple | None = None  # (order key, gradient leaves) of the last value_and_grad

    # -- the StepLayout protocol ------------------------------------------------------------------
    def leaf(self, path: str, x: torch.Tensor | None, where: str) -> LeafLayout:
        lay = self.by_path.get(path)
        if lay is None:
            raise PlanError(f"{where} inside hpfunc.parallelize: {path!r} is not a parameter path of the plan; "
                            f"this works on trees shaped like the parameters (paths relative to their root, e.g. "
                            f"{self.paths[0]!r})" if self.paths else f"{where}: the plan has no parameters")
        if x is not None and tuple(x.shape) != self.block_shapes[path]:
            raise PlanError(f"{where} inside hpfunc.parallelize: the leaf at {path!r} has shape {tuple(x.shape)}, "
                            f"but this rank's block of that parameter is {self.block_shapes[path]} (global "
                            f"{tuple(lay.shape)}, optimizer spec {lay.spec.opt!r})")
        return lay

    def leaf_layouts(self, tree: Any, where: str) -> list[LeafLayout]:
        leaves, treedef = _tree.flatten(tree)
        hit = self.program.layouts_of.get(treedef)
        if hit is None:  # once per tree structure: its paths, their layouts and block shapes
            paths = [p for p, _ in _tree.leaves_with_paths(tree)]
            layouts = [self.leaf(path, None, where) for path in paths]
            hit = self.program.layouts_of[treedef] = (paths, layouts,
                                                [torch.Size(self.block_shapes[path]) for path in paths])
        paths, layouts, shapes = hit
        for path, x, shape in zip(paths, leaves, shapes):
            if x is not None and x.shape != shape:
                self.leaf(path, x, where)  # raises, naming the leaf
        return layouts

    def data_axes(self) -> tuple[str, ...]:
        return self.cfg.data_axes

    def remember_sq_norm(self, grads: list[torch.Tensor], total: torch.Tensor) -> None:
        """Keep the global sum of squares of these gradient blocks (computed with the pipeline's loss)."""
        self._sq_norm = (grads, [g._version for g in grads], total)

    def known_sq_norm(self, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        hit = self._sq_norm
        # the very tensors, not written to since (an in-place op bumps a tensor's version)
        if hit is not None and len(leaves) == len(hit[0]) and all(
                x is g and x._version == v for x, g, v in zip(leaves, hit[0], hit[1])):
            return hit[2].clone()
        last = self._last_grads
        if last is not None and len(leaves) == len(last[1]) and all(x is g for x, g in zip(leaves, last[1])):
            # the step asks the norm of the gradients it got: from the next run on, reduced with the loss
            self.program.sq_norm_wanted.add(last[0])
        return None

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[_Accumulation]:
        if self._acc is not None:
            raise PlanError("hpfunc.microbatch: micro-batching inside micro-batching is not supported")
        if self.pipeline_axis is not None:
            raise PlanError("hpfunc.microbatch inside a step with a pp plan layer: the pipeline already cuts the "
                            "batch into microbatches; set plans.pp(..., microbatches=m) (train.microbatches: 1)")
        self._acc = _Accumulation(self)
        try:
            yield self._acc
        finally:
            self._acc = None

    def value_and_grad(self, fn: Callable, argnums: tuple[int, ...], multi: bool, has_aux: bool, args: tuple,
                       kwargs: dict) -> Any:
        region = saved_tensors.in_recompute_region()
        if region is not None:
            raise PlanError(f"hpfunc.value_and_grad inside {region} in a step run by hpfunc.parallelize: the step "
                            f"gathers parameters and reduces gradients around the differentiation, which a "
                            f"recomputed region cannot hold; apply {region} to layers inside the differentiated "
                            f"function instead")
        args = list(args)
        for a in argnums:
            if a >= len(args) or a < -len(args):
                raise ValueError(f"value_and_grad: argnums {a} but the function got {len(args)} positional arguments")
        argnums = tuple(a % len(args) for a in argnums)
        flat = [_tree.flatten(arg) for arg in args]  # each argument flattened once
        index = [[self.opt_blocks.index_of(x) for x in leaves] for leaves, _ in flat]  # which leaves are parameters
        with_params, wanted = self._find_params(args, argnums, flat, index)
        call = self._call_on_params(fn, args, kwargs, flat, index, with_params)
        acc = self._acc
        order_key = (self.differentiations, tuple(wanted))
        self.differentiations += 1
        loss, aux, red, scalars = differentiate.value_and_grad(
            self.program, self.storage, call, has_aux, wanted, where="value_and_grad", reduce=acc is None, step=self,
            order_key=order_key, stats=acc is None and self.pipeline_axis is None)
        grad_of = dict(zip(wanted, red))
        results = [_tree.unflatten(flat[a][1], [x if i is None else grad_of[i] for x, i in zip(flat[a][0], index[a])])
                   for a in argnums]
        g_out = tuple(results) if multi else results[0]
        if scalars is not None:  # the loss, aux's statistics and (when the step asks for it) the gradient norm
            value, aux = self._reduce_scalars(scalars, order_key, g_out)
        else:
            value, aux = self._over_data(loss, aux, has_aux)
        if acc is not None:  # inside hpfunc.microbatch: per-rank gradients, reduced once by acc.reduce
            acc.record([i for a in argnums for i in index[a]])
        return ((value, aux) if has_aux else value), g_out

    def _reduce_scalars(self, scalars: Any, order_key: tuple, grads: Any) -> tuple[torch.Tensor, Any]:
        """The loss and ``aux`` over the data shards, and the global sum of squares of ``grads`` when the
        first run of this differentiation saw the step ask for it: one collective (step_scalars.py)."""
        leaves = _tree.leaves(grads)
        self._last_grads = (order_key, leaves)
        sq = None
        if order_key in self.program.sq_norm_wanted:
            layouts = self.leaf_layouts(grads, "value_and_grad")
            part, axes = layout.sq_norm_part(self.mesh, [lay.spec.opt for lay in layouts], leaves)
            sq = (part, axes)
        total = scalars.reduce(sq)
        if total is not None:
            self.remember_sq_norm(leaves, total)
        return scalars.reduced

    def value(self, fn: Callable, has_aux: bool, args: tuple, kwargs: dict) -> Any:
        if self.cfg.plan.pipeline is not None:
            raise PlanError("hpfunc.value inside a step run by hpfunc.parallelize with a pp plan: the pipeline "
                            "executor runs forward and backward together; evaluate with hpfunc.value_and_grad "
                            "(and drop the gradient), or outside the pipelined step")
        flat = [_tree.flatten(arg) for arg in args]
        index = [[self.opt_blocks.index_of(x) for x in leaves] for leaves, _ in flat]
        with_params = [a for a in range(len(args)) if any(i is not None for i in index[a])]
        call = self._call_on_params(fn, args, kwargs, flat, index, with_params)
        _, _, _, scalars = differentiate.value_and_grad(self.program, self.storage, call, has_aux, [], where="value",
                                                        reduce=False, step=self, record=False, stats=True)
        scalars.reduce()
        value, aux = scalars.reduced
        return (value, aux) if has_aux else value

    def _over_data(self, loss: torch.Tensor, aux: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
        """The per-rank loss as the mean over the data shards, and ``aux``'s batch statistics reduced."""
        axes = self.cfg.data_axes
        with torch.no_grad():
            if has_aux:  # the loss with aux's statistics: one collective per dtype (the loss rides in its dtype's)
                value, aux = reduce_batch_stats((loss, aux), axes)
            else:
                value = lax.pmean(loss.detach(), axes) if axes else loss.detach()
        return value, aux

    def _call_on_params(self, fn: Callable, args: tuple, kwargs: dict, flat: list, index: list,
                        with_params: list[int]) -> Callable[[list[torch.Tensor], Callable], Any]:
        """``call(ws, read)``: ``fn`` on ``args`` with each argument in ``with_params`` rebuilt on the blocks
        ``ws`` (as the lazy view that gathers on ``read`` where the plan needs one); run by
        :func:`differentiate.value_and_grad` under the lowered step's inner binding (no step layout)."""
        needs_view = self.cfg.needs_view

        def call(ws: list[torch.Tensor], read: Callable) -> Any:
            new_args = list(args)
            for a in with_params:
                leaves, treedef = flat[a]
                swapped = _tree.unflatten(treedef, [x if i is None else ws[i] for x, i in zip(leaves, index[a])])
                new_args[a] = lazy(swapped, read) if needs_view else swapped
            return fn(*new_args, **kwargs)

        return call

    def _find_params(self, args: list, argnums: tuple[int, ...], flat: list, index: list) -> tuple[list[int], list[int]]:
        """The arguments that hold parameters of this step, and the parameters to differentiate."""
        with_params: list[int] = []
        wanted: list[int] = []
        for a, arg in enumerate(args):
            if any(i is not None for i in index[a]):
                with_params.append(a)
            if a not in argnums:
                continue
            for k, (x, i) in enumerate(zip(flat[a][0], index[a])):
                if i is not None:
                    wanted.append(i)
                elif isinstance(x, torch.Tensor):
                    path = _tree.leaves_with_paths(arg)[k][0]
                    raise PlanError(
                        f"value_and_grad inside hpfunc.parallelize: argument {a} leaf {path or '<root>'!r} is not one "
                        f"of the state's parameters; differentiate the parameters parallelize passed to the step "
                        f"(or a subtree of them) and compute other values inside the function")
        if not wanted:
            raise PlanError("value_and_grad inside hpfunc.parallelize: the differentiated arguments hold none of the "
                            "state's parameters (the tensors parallelize passed to the step); a gradient of anything "
                            "else would be per-rank, not the single-device one")
        # an argument shaped like a parameter-holding one (e.g. the `frozen` half of a split with no
        # leaves) is viewed too, so that structural tree operations between them still line up (decided by
        # the arguments' structures: once per structures)
        key = (tuple(treedef for _, treedef in flat), tuple(with_params))
        alike = self.program.alike_args.get(key)
        if alike is None:
            shapes = {_tree.structure(args[a], none_is_leaf=True) for a in with_params}
            alike = self.program.alike_args[key] = [
                a for a, arg in enumerate(args) if a not in with_params and isinstance(arg, (Mapping, list))
                and _tree.structure(arg, none_is_leaf=True) in shapes]
        return with_params + alike, sorted(set(wanted))

    # -- back to storage ------------------------------------------------------------------------
    def to_storage(self, new: list[Any]) -> list[torch.Tensor]:
        """The parameters the step returned (optimizer blocks) -> storage blocks (ZeRO all-gathers)."""
        out: list[Any] = list(self.storage)
        changed = []
        for i, x in enumerate(new):
            if x is self.opt_blocks[i]:
                continue
            if not isinstance(x, torch.Tensor) or x.shape != self.opt_blocks[i].shape:
                path = self.paths[i]
                found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise PlanError(f"parallelize: the step returned parameter {path!r} as {found}; it must keep the "
                                f"shape of the block it was given, {self.block_shapes[path]}")
            changed.append(i)
        if changed and not self.cfg.any_zero:  # the optimizer blocks are the storage blocks
            for i in changed:
                x = new[i]
                out[i] = x.detach() if x.requires_grad else x
            return out
        if changed:
            with torch.no_grad():
                back = gather_updated([new[i].detach() for i in changed], [self.leaves[i] for i in changed])
            for i, x in zip(changed, back):
                out[i] = x
        return out
