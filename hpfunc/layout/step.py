"""The layout a parallelized step binds, and the questions library code asks it.

A step run by :func:`hpfunc.parallelize` sees every parameter, gradient and optimizer-state leaf as
this rank's block. The transform binds a :class:`StepLayout` for the step (in the one
:class:`~hpfunc.layout.binding.Binding`); code that is not elementwise asks it how a value is laid out and so gives the single-device
answer on blocks. Outside a step :func:`current` is ``None`` and every query answers for one device:

    >>> import torch
    >>> current() is None, data_axes(), local_block("w", torch.arange(4)).tolist()
    (True, (), [0, 1, 2, 3])
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager, Iterator, Protocol

import attrs
import torch

from hpfunc.host_to_device import literal
from hpfunc.layout.binding import bound, rebind
from hpfunc.sharding import P, as_spec

__all__ = ["PlanError", "LeafSpec", "LeafLayout", "StepLayout", "Accumulation", "current", "bind", "leaf",
           "data_axes", "varying_axes", "local_block", "gather_block", "global_sq_norm", "blocks_sq_norm",
           "sq_norm_table"]


class PlanError(ValueError):
    """A plan does not fit the model, the mesh or the batch, or a step broke a rule of parallelize."""


@attrs.frozen
class LeafSpec:
    """Storage (at rest), compute (in use) and optimizer-state specs of one parameter.

    On every dimension ``compute`` is a prefix of ``storage`` (the rest is all-gathered before use,
    FSDP) and ``storage`` a prefix of ``opt`` (the extra axes are ZeRO's).
    """

    storage: P = attrs.field(converter=as_spec, factory=P)
    compute: P = attrs.field(converter=as_spec, default=attrs.Factory(lambda self: self.storage, takes_self=True))
    opt: P = attrs.field(converter=as_spec, default=attrs.Factory(lambda self: self.storage, takes_self=True))

    @classmethod
    def of(cls, storage: Any, compute: Any = None, opt: Any = None) -> "LeafSpec":
        """``LeafSpec.of(P("fsdp"), P())``: compute / opt default to the storage spec.

        >>> LeafSpec.of(P("fsdp"), P()).opt
        P('fsdp')
        """
        s = as_spec(storage)
        return cls(s, s if compute is None else compute, s if opt is None else opt)


@attrs.frozen
class LeafLayout:
    """How one parameter is laid out on the mesh: its specs checked against its global shape.

    ``gather``: the ``(dim, axes)`` all-gathered before use (storage -> compute); ``opt_extra``: the
    ``(dim, axes)`` the optimizer block is split on beyond storage (ZeRO); ``replicated``: the mesh axes
    (of size > 1) the stored block is replicated on; ``stage_axis``: the pipeline axis when the
    parameter belongs to one stage (held by that stage's ranks only; a parameter shared by several
    stages, such as a tied embedding, is held by every pipeline rank and has none).
    """

    path: str
    shape: tuple[int, ...]
    spec: LeafSpec
    gather: tuple[tuple[int, tuple[str, ...]], ...] = ()
    opt_extra: tuple[tuple[int, tuple[str, ...]], ...] = ()
    replicated: tuple[str, ...] = ()
    stage_axis: str | None = None  # a pipeline axis: the leaf is held by the ranks of one stage only

    def opt_axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split dimension ``dim`` of the optimizer block (gradients, moments)."""
        return self.spec.opt.dim_axes(dim)

    def block_shape(self, mesh: Any) -> tuple[int, ...]:
        """This rank's optimizer block: the global shape divided along every split dimension."""
        return tuple(s // mesh.axis_size(self.opt_axes(d)) if self.opt_axes(d) else s
                     for d, s in enumerate(self.shape))

    @property
    def varying_axes(self) -> tuple[str, ...]:
        """The mesh axes along which this leaf's optimizer block differs between ranks."""
        return tuple(self.spec.opt.axes)


class Accumulation(Protocol):
    """Micro-batches inside a step (:func:`hpfunc.microbatch`): gradients stay per rank until ``reduce``."""

    def reduce(self, grads: Any) -> Any:
        """The accumulated per-rank gradient tree reduced once, laid out like the optimizer blocks."""


class StepLayout(Protocol):
    """What a parallelized step tells shard-unaware library code (implemented by the transform).

    This is *the* extension point of hpfunc: a new parallelism (expert, context, pipeline parallel)
    is a plan layer plus the hooks that read this context; a user's own layer reads it too.
    """

    mesh: Any

    def leaf(self, path: str, x: torch.Tensor | None, where: str) -> LeafLayout:
        """The layout of the parameter at ``path`` (relative to the parameters' root), after checking
        that ``x`` (if given) has the shape of that parameter's block here; :class:`PlanError` naming
        ``where`` otherwise."""

    def leaf_layouts(self, tree: Any, where: str) -> list[LeafLayout]:
        """:meth:`leaf` of every leaf of ``tree`` (shaped like the parameters or a subtree of them, its
        paths relative to their root), in flattening order."""

    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes (size > 1) the batch is split over: values computed from the batch vary
        over them."""

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], multi: bool, has_aux: bool, args: tuple,
                       kwargs: dict) -> Any:
        """:func:`hpfunc.value_and_grad` of ``fn`` under the plan (gather on use, reduced gradients)."""

    def value(self, fn: Any, has_aux: bool, args: tuple, kwargs: dict) -> Any:
        """:func:`hpfunc.value` of ``fn`` under the plan: the parameters gathered on use as for
        :meth:`value_and_grad`, no gradient, the value the mean over the data shards."""

    def accumulate(self) -> ContextManager[Accumulation]:
        """A block inside which ``value_and_grad`` returns per-rank gradients, reduced once at the end."""

    def known_sq_norm(self, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        """The global sum of squares of exactly these gradient blocks when the step already has it (a
        pipeline reduces it together with its loss), else ``None``: :func:`global_sq_norm` computes it."""

    donate_state: bool
    """The step was handed its state to reuse (``parallelize(..., donate_state=True)``)."""

    pipeline_axis: str | None
    """The pipeline axis of a step with a ``pp`` layer (each pipeline rank holds some stages: norms
    sum over it), else ``None``."""


def current() -> StepLayout | None:
    """The layout of the parallelized step running now; ``None`` outside one, and inside the function
    being differentiated (where the model computes on gathered blocks, as on one device)."""
    return bound().step


@contextlib.contextmanager
def bind(ctx: StepLayout | None) -> Iterator[None]:
    """Make ``ctx`` current for the ``with`` block (``None`` hides an outer one)."""
    with rebind(step=ctx):
        yield


def donated() -> bool:
    """Whether the step running now owns its state's buffers: ``hpfunc.parallelize(..., donate_state=True)``
    (JAX's buffer donation). An optimizer may then write the new moments and parameters into the old
    ones (``optim.update_and_apply(..., donate=layout.donated())``); ``False`` outside a step.

    >>> donated()
    False
    """
    ctx = current()
    return ctx is not None and bool(ctx.donate_state)


def leaf(path: str, x: torch.Tensor | None = None, *, where: str = "layout.leaf") -> LeafLayout | None:
    """The :class:`LeafLayout` of the parameter at ``path`` in the step running now (``None`` outside).

    >>> leaf("layers.0.attn.wq") is None
    True
    """
    ctx = current()
    return None if ctx is None else ctx.leaf(path, x, where)


@contextlib.contextmanager
def data_parallel(axes: tuple[str, ...]) -> Iterator[None]:
    """Bind the mesh axes the batch is split over for the function being differentiated (where
    :func:`current` is ``None``): batch statistics that must be those of the whole step's batch (the
    MoE load) sum over them. ``hpfunc.parallelize`` binds its data axes around the loss."""
    with rebind(data_axes=tuple(axes)):
        yield


def data_axes() -> tuple[str, ...]:
    """The mesh axes the batch is split over in the step running now, also inside the function it
    differentiates (``()`` outside a step).

    >>> data_axes()
    ()
    >>> with data_parallel(("dp",)):
    ...     data_axes()
    ('dp',)
    """
    b = bound()
    return b.data_axes if b.step is None else b.step.data_axes()


def varying_axes(path: str) -> tuple[str, ...]:
    """The mesh axes along which the block of the parameter at ``path`` differs (``()`` outside a step)."""
    found = leaf(path, where="layout.varying_axes")
    return () if found is None else found.varying_axes


def _split_dims(lay: LeafLayout, ndim: int, dims: Any) -> list[tuple[int, tuple[str, ...]]]:
    chosen = range(ndim) if dims is None else [d % ndim for d in dims]
    return [(d, lay.opt_axes(d)) for d in chosen if lay.opt_axes(d)]


def local_block(path: str, full: torch.Tensor, *, dims: Any = None) -> torch.Tensor:
    """The block of ``full`` (shaped like the whole parameter at ``path``, or like it on ``dims``) that
    this rank's optimizer block of that parameter covers; ``full`` itself outside a parallelized step.
    No communication.

    >>> local_block("layers.0.moe.expert_bias", torch.zeros(8)).shape
    torch.Size([8])
    """
    lay = leaf(path, where="local_block")
    if lay is None:
        return full
    from hpfunc import lax

    want = tuple(lay.shape) if dims is None else tuple(lay.shape[d % len(lay.shape)] for d in dims)
    have = tuple(full.shape) if dims is None else tuple(full.shape[d % full.ndim] for d in dims)
    if have != want:
        raise PlanError(f"local_block: {path!r} has global shape {tuple(lay.shape)}, the value has "
                        f"{tuple(full.shape)}")
    for d, axes in _split_dims(lay, full.ndim, dims):
        k = full.shape[d] // lax.axis_size(axes)
        full = full.narrow(d, lax.axis_index(axes) * k, k)
    return full


def gather_block(path: str, block: torch.Tensor, *, dims: Any = None) -> torch.Tensor:
    """The inverse of :func:`local_block`: all-gather this rank's optimizer block of the parameter at
    ``path`` (or a value laid out like it) along ``dims`` (default: every split dimension) into the
    global tensor. ``block`` itself outside a parallelized step.

    >>> gather_block("w", torch.ones(2, 3)).shape
    torch.Size([2, 3])
    """
    ctx = current()
    if ctx is None:
        return block
    from hpfunc import lax

    lay = ctx.leaf(path, block, "gather_block")
    for d, axes in _split_dims(lay, block.ndim, dims):
        block = lax.all_gather(block, axes if len(axes) > 1 else axes[0], axis=d, tiled=True)
    return block


def global_sq_norm(tree: Any, where: str = "global_sq_norm", *, leaves: list | None = None) -> torch.Tensor | None:
    """Sum of squares (fp64) of the global tensors whose blocks here are the leaves of ``tree`` (shaped
    like the parameters, or a subtree of them), or ``None`` outside a parallelized step. ``leaves``: the
    caller's ``hpfunc.tree.leaves(tree)``, when it has them.

    >>> global_sq_norm({"w": torch.ones(2)}) is None
    True
    """
    ctx = current()
    if ctx is None:
        return None
    from hpfunc import tree as _tree

    leaves = _tree.leaves(tree) if leaves is None else leaves
    hit = ctx.known_sq_norm(leaves)  # the step's own gradient blocks, whose norm it has
    if hit is not None:
        return hit
    layouts = ctx.leaf_layouts(tree, where)
    stage = ctx.pipeline_axis
    return blocks_sq_norm(ctx.mesh, [lay.spec.opt for lay in layouts], leaves, stage_axis=stage,
                          stage_local=[lay.stage_axis is not None for lay in layouts] if stage else None)


def _block_sq_sums(xs: list[torch.Tensor]) -> torch.Tensor:
    """Each block's sum of squares as an fp64 vector. On an accelerator one fused fp64 norm kernel for
    all blocks; on CPU, where that kernel's fp64 conversion costs 4-5x an fp32 pass, each block's
    squares summed in (at least) fp32 by torch's cascade summation (relative error ~1e-8 on 1e6
    elements, against ~1e-5 for a plain fp32 norm), then widened."""
    if all(x.device == xs[0].device for x in xs) and xs[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(xs, 2, dtype=torch.float64)).square()
    return torch.stack([(x if x.dtype in (torch.float32, torch.float64) else x.float()).square().sum()
                        for x in xs]).double()


def blocks_sq_sum(blocks: list[torch.Tensor]) -> torch.Tensor:
    """This rank's sum of squares (fp64) of ``blocks``, each block's squares summed as
    :func:`blocks_sq_norm` sums them (at least fp32, torch's cascade summation, then widened), with no
    weights and no collective (a pipeline reduces it with its loss).

    >>> float(blocks_sq_sum([torch.ones(3), torch.full((2,), 2.0)]))
    11.0
    """
    return _block_sq_sums([x.detach() if x.requires_grad else x for x in blocks]).sum()


def blocks_sq_norm(mesh: Any, opt_specs: list[P], blocks: list[torch.Tensor], *, stage_axis: str | None = None,
                   stage_local: list[bool] | None = None) -> torch.Tensor:
    """Sum of squares (fp64) of global tensors given as this rank's blocks laid out by ``opt_specs``
    (inside ``shard_map`` on ``mesh``): one scalar ``psum`` of :func:`sq_norm_part`."""
    from hpfunc import lax

    total, split = sq_norm_part(mesh, opt_specs, blocks, stage_axis=stage_axis, stage_local=stage_local)
    return lax.psum(total, split) if split else total


def sq_norm_part(mesh: Any, opt_specs: list[P], blocks: list[torch.Tensor], *, stage_axis: str | None = None,
                 stage_local: list[bool] | None = None) -> tuple[torch.Tensor, tuple[str, ...]]:
    """This rank's part of :func:`blocks_sq_norm` and the axes to sum it over (fp64, no collective).
    Each block counts once: a block replicated on ``k`` ranks adds ``1/k`` of its square on each. Under
    a pipeline (``stage_axis``) the sum runs over the pipeline ranks too: ``stage_local[k]`` leaves are
    held by one stage (they add whole), the others by every pipeline rank (they add ``1/p`` each).

    >>> import hpfunc
    >>> sq_norm_part(hpfunc.Mesh({"fsdp": 1}), [hpfunc.P("fsdp")], [torch.ones(3)])
    (tensor(3., dtype=torch.float64), ())
    """
    local = tuple(stage_local) if stage_local else (False,) * len(opt_specs)

    def weights() -> tuple:
        # only the axes some block is split on need a sum (on the others every block is whole on every rank)
        split = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1 and (
            any(a in s.axes for s in opt_specs) or a == stage_axis))
        reps = [math.prod(mesh.axis_size(a) for a in split if a not in spec.axes and not (mine and a == stage_axis))
                for spec, mine in zip(opt_specs, local)]
        return split, (reps if any(r != 1 for r in reps) else None)

    # once per mesh and layout of the blocks (a step's gradient norm asks the same every step)
    split, reps = mesh._cached(("blocks_sq_norm", tuple(opt_specs), local, stage_axis), weights)
    if not blocks:
        total = torch.zeros((), dtype=torch.float64)
    else:
        sq = _block_sq_sums([x.detach() if x.requires_grad else x for x in blocks])
        if reps is not None:
            sq = sq / torch.tensor(reps, dtype=torch.float64, device=sq.device)
        total = sq.sum()
    return total, split


def sq_norm_table(trees: Any, *, per_rank: torch.Tensor | None = None,
                  where: str = "sq_norm_table") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global sum of squares (fp64) of every leaf of each tree in ``trees`` and the per-rank values
    ``per_rank`` of every data rank, in one reduction.

    ``trees``: a sequence of trees shaped like the parameters (or one subtree of them), all with the
    same structure and the same ``None`` leaves (a frozen leaf, another pipeline stage's: they count 0);
    leaves in :func:`hpfunc.tree.leaves` order with ``None`` as a leaf. ``per_rank``: a 1-d tensor of
    this rank's own values computed from its data shard (a local loss), or ``None``.

    Returns ``(table, rows)``: ``table[t, k]`` is the squared norm of the global tensor whose block here
    is leaf ``k`` of ``trees[t]``; ``rows[d]`` is ``per_rank`` of the rank with data index ``d``
    (:func:`hpfunc.lax.axis_index` over :func:`data_axes`), ``[data ranks, len(per_rank)]``. Inside a
    parallelized step every rank adds its blocks' squares, each divided by the number of ranks holding
    that block (as :func:`blocks_sq_norm`), and places ``per_rank`` at its data index when it is the
    first of the ranks sharing that data shard (index 0 on every other axis), and one ``psum`` over the
    mesh sums it all: no value is gathered, and every rank gets the same global table. Outside a step:
    the leaves' own squares and ``per_rank`` as one row.

    >>> table, rows = sq_norm_table([{"a": torch.ones(2), "b": None}, {"a": torch.full((2,), 2.0), "b": None}],
    ...                             per_rank=torch.tensor([0.5]))
    >>> table.tolist(), rows.tolist()
    ([[2.0, 0.0], [8.0, 0.0]], [[0.5]])
    """
    from hpfunc import tree as _tree

    trees = list(trees)
    if not trees:
        raise ValueError(f"{where}: expected at least one tree, found none")
    flat = [_tree.flatten(t, none_is_leaf=True) for t in trees]
    n = len(flat[0][0])
    present = [x is not None for x in flat[0][0]]
    for t, (leaves, treedef) in enumerate(flat[1:], 1):
        if treedef != flat[0][1] or [x is not None for x in leaves] != present:
            raise ValueError(f"{where}: trees[{t}] does not have the structure (and the None leaves) of trees[0]: "
                             f"{treedef} against {flat[0][1]}; pass trees shaped like the same parameters")
    xs = [x.detach() for leaves, _ in flat for x in leaves if x is not None]
    device = xs[0].device if xs else (per_rank.device if per_rank is not None else torch.device("cpu"))
    at = [t * n + k for t in range(len(trees)) for k in range(n) if present[k]]
    sq = torch.zeros(len(trees) * n, dtype=torch.float64, device=device)
    ctx = current()
    if xs:
        local = _block_sq_sums(xs)
        if ctx is not None:
            reps = _replicas(ctx, trees[0], where)
            if reps is not None:
                # host numbers onto the device pinned and non_blocking (a pageable copy would make the host wait)
                local = local / literal(reps * len(trees), torch.float64, device)
        if len(at) == sq.numel():  # no None leaf: the squares in order
            sq = local
        else:
            sq[literal(at, torch.int64, device)] = local
    mine = None if per_rank is None else per_rank.detach().reshape(-1).to(device=device, dtype=torch.float64)
    if ctx is None:
        return sq.view(len(trees), n), (None if mine is None else mine.view(1, -1))
    from hpfunc import lax

    mesh = ctx.mesh
    axes = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
    parts = [sq]
    if mine is not None:
        data = tuple(a for a in ctx.data_axes() if mesh.axis_size(a) > 1)
        rows = torch.zeros(math.prod(mesh.axis_size(a) for a in data), mine.numel(), dtype=torch.float64,
                           device=device)
        if all(lax.axis_index(a) == 0 for a in axes if a not in data):  # one rank per data shard adds it
            rows[lax.axis_index(data) if data else 0] = mine
        parts.append(rows.reshape(-1))
    packed = torch.cat(parts)
    packed = lax.psum(packed, axes) if axes else packed
    table = packed[:sq.numel()].view(len(trees), n)
    return table, (None if mine is None else packed[sq.numel():].view(-1, mine.numel()))


def _replicas(ctx: StepLayout, tree: Any, where: str) -> list[float] | None:
    """Per present leaf of ``tree`` (in order): the number of ranks of the whole mesh holding its block (the
    axes of size > 1 its optimizer block is not split on; a pipeline stage's leaf is not held across the
    pipeline axis); ``None`` when every block is held once."""
    mesh = ctx.mesh
    axes = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
    reps = [float(math.prod(mesh.axis_size(a) for a in axes
                            if a not in lay.spec.opt.axes and not (lay.stage_axis is not None and a == lay.stage_axis)))
            for lay in ctx.leaf_layouts(tree, where)]
    return reps if any(r != 1.0 for r in reps) else None
