"""Named-axis collectives with exact transposes, for code running in the local view (``shard_map``).

Every function takes an axis name or a tuple of names of the current mesh (set by ``shard_map`` or
``with mesh:``). A tuple means the flattened group, row-major in the order given.

Differentiation semantics (the *per-rank* view). Inside ``shard_map`` every value is a per-rank
value, and the transpose of each collective is exact for per-rank values:

=================  ===============================  ==========================================
collective         forward                          backward (transpose)
=================  ===============================  ==========================================
``psum``           all-reduce (sum)                 all-reduce (sum) of the cotangents
``pmean``          all-reduce / n                   all-reduce / n
``pmax``/``pmin``  all-reduce (max/min)             summed cotangent routed to the arg-max
``all_gather``     all-gather                       ``psum_scatter`` (reduce-scatter)
``psum_scatter``   reduce-scatter                   ``all_gather``
``all_to_all``     all-to-all                       the reverse all-to-all
``ppermute``       send along ``perm``              send along the inverse permutation
=================  ===============================  ==========================================

``all_to_all_start`` issues the row all-to-all without waiting (its ``.wait()`` gives the result); its
transpose is the reverse all-to-all, issued without waiting too. ``ppermute_start`` does the same for
``ppermute`` (transpose: the inverse permutation, issued without waiting in the backward).

``shard_map`` completes this at its boundary: the gradient of an input that is replicated along an
axis is summed over that axis (the gradients of all replicas of one value), and the cotangent of an
output replicated along an axis is split evenly among its replicas. With that, no gradient is ever
reduced twice or never, without the user inserting ``pvary`` anywhere; the property tests in
``tests/core`` prove it against single-device autograd. (JAX's invariant/varying type system gives
``psum`` an identity transpose instead and needs ``pvary`` where an invariant value meets a varying
one; the communication volume per layer is the same.)

All collectives are ``torch.autograd.Function`` s with ``setup_context``, so ``torch.autograd.grad``
and ``torch.func.grad``/``vjp`` both differentiate through them. (Outside torch.func a collective runs
in the equivalent ctx-first form, and one with no gradient to track runs as its bare forward: the same
values, less host time.)

A collective that times out (the process group's timeout: ``parallel.timeout_s``, ``hpfunc launch
--timeout``, 300 s by default; see :func:`hpfunc.mesh.init_distributed`) or whose peer's connection
closes raises :class:`hpfunc.faults.CollectiveError` naming the rank, the collective, its mesh axes
and the line that issued it (the backend's error is its ``__cause__``).

Example (in a 2-rank program)::

    @hpfunc.shard_map(mesh=mesh, in_specs=P("dp"), out_specs=P())
    def total(x):
        return hpfunc.lax.psum(x.sum(), "dp")
"""

from __future__ import annotations

from fractions import Fraction

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpfunc import comm as _comm
from hpfunc import faults as _faults
from hpfunc.mesh import AxisName, Mesh, current_mesh, normalize_axes

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "all_to_all_start",
    "PendingAllToAll",
    "ppermute",
    "ppermute_start",
    "PendingPPermute",
    "axis_index",
    "axis_size",
]


# ---------------------------------------------------------------------------------------------
# Axis resolution


class _Axes:
    """A resolved axis argument: the process group and the logical <-> group rank maps."""

    __slots__ = ("mesh", "names", "group", "n", "g2l", "l2g", "me", "identity_order", "_peers")

    def __init__(self, mesh: Mesh, axes: AxisName | Sequence[str]):
        names = normalize_axes(axes)
        if not names:
            raise ValueError("a collective needs at least one mesh axis name")
        if len(set(names)) != len(names):
            raise ValueError(f"axis {names} names a mesh axis twice")
        dims = [mesh._dim(a) for a in names]  # raises ValueError naming an unknown axis
        self.mesh = mesh
        self.names = names
        order = sorted(range(len(names)), key=lambda i: dims[i])
        mesh_order = tuple(names[i] for i in order)
        self.n = mesh.axis_size(names)
        self.group = mesh.group(mesh_order) if self.n > 1 else None
        sizes = [mesh.axis_size(a) for a in names]
        # group rank g enumerates mesh-order coordinates row-major; logical rank l enumerates the
        # coordinates in the order the user gave.
        self.identity_order = list(order) == sorted(order) and order == list(range(len(names)))
        if self.identity_order:
            self.g2l = self.l2g = list(range(self.n))
        else:
            ms = [sizes[i] for i in order]
            g2l = []
            for g in range(self.n):
                coord_m = []
                r = g
                for s in reversed(ms):
                    coord_m.append(r % s)
                    r //= s
                coord_m.reverse()
                coord = [0] * len(names)
                for j, i in enumerate(order):
                    coord[i] = coord_m[j]
                li = 0
                for c, s in zip(coord, sizes):
                    li = li * s + c
                g2l.append(li)
            self.g2l = g2l
            self.l2g = [0] * self.n
            for g, li in enumerate(g2l):
                self.l2g[li] = g
        self.me = mesh.axis_index(names)
        self._peers: list[int] | None = None

    def peer(self, logical: int) -> int:
        """The global rank of the rank at logical index ``logical`` along these axes."""
        if self._peers is None:  # asked once: dist.get_global_rank scans the group's rank table
            self._peers = [dist.get_global_rank(self.group, self.l2g[li]) for li in range(self.n)]
        return self._peers[logical]


def _axes_of(mesh: Mesh, axes: AxisName | Sequence[str]) -> _Axes:
    """The resolved axes, built once per mesh and axis tuple (a process-group lookup and rank maps
    that every collective and its transpose would otherwise rebuild)."""
    names = normalize_axes(axes)
    return mesh._cached(("lax.axes", names), lambda: _Axes(mesh, names))


def _resolve(axes: AxisName | Sequence[str]) -> _Axes:
    mesh = current_mesh(required=True, what=f"a collective over axis {axes!r}")
    return _axes_of(mesh, axes)


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _host_backend(group: Any) -> bool:
    """The group's backend is gloo (host tensors, its own workarounds); else (NCCL, the fake group of the
    fake-device runs) the native device collectives: :func:`_scatter_dim0`'s reduce-scatter, the split
    sizes of an uneven all-to-all exchanged as device tensors."""
    return dist.get_backend(group) == "gloo"


def _is_func_wrapped(x: torch.Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(x))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


# ---------------------------------------------------------------------------------------------
# Raw collectives on plain tensors (no autograd), in logical rank order


def _all_reduce(x: torch.Tensor, ax: _Axes, op: dist.ReduceOp, collectors, name: str, tag: str = "") -> torch.Tensor:
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if ax.n > 1 and out.numel():  # an empty tensor has nothing to send (a gloo round trip saved)
        if collectors:
            _comm.record(collectors, op="all_reduce", name=name, axes=ax.names, n=ax.n, payload_bytes=_nbytes(out),
                         phase=_phase(), tag=tag)
        try:
            dist.all_reduce(out, op=op, group=ax.group)
        except RuntimeError as e:  # a timeout or a lost peer: name this collective (no cost otherwise)
            _faults.raise_collective_error(e, name, ax.names, ax.n)
            raise
    return out


def _gather_dim0(x: torch.Tensor, ax: _Axes, collectors, name: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along a new leading dim, in logical order: shape (n, *x.shape)."""
    x = x.detach()
    shape = (ax.n,) + tuple(x.shape)
    if ax.n == 1:
        return x.clone().reshape(shape)
    if not x.numel():  # nothing to send
        return x.new_empty(shape)
    flat = x.reshape(-1).contiguous()
    out = flat.new_empty(ax.n * flat.numel())  # new_empty: same torch.func level as the input
    if collectors:
        _comm.record(collectors, op="all_gather", name=name, axes=ax.names, n=ax.n, payload_bytes=_nbytes(out),
                     phase=_phase())
    try:
        _ALL_GATHER(out, flat, group=ax.group)
    except RuntimeError as e:
        _faults.raise_collective_error(e, name, ax.names, ax.n)
        raise
    out = out.view(shape)
    if not ax.identity_order:
        out = out[torch.tensor(ax.g2l).argsort()]  # row g holds logical rank g2l[g]
    return out


def _scatter_dim0(x: torch.Tensor, ax: _Axes, collectors, name: str) -> torch.Tensor:
    """Reduce-scatter of ``x`` of shape (n, ...): logical rank l receives sum over ranks of x[l]."""
    x = x.detach()
    if ax.n == 1 or not x.numel():  # one rank, or nothing to send
        return x[0].clone()
    if not ax.identity_order:
        x = x[torch.tensor(ax.g2l)]  # group rank g must receive logical chunk g2l[g]
    # the input is only read (gloo and NCCL both leave it as it was): no copy of it, a fresh output
    flat = x.reshape(-1).contiguous()
    if collectors:
        _comm.record(collectors, op="reduce_scatter", name=name, axes=ax.names, n=ax.n, payload_bytes=_nbytes(flat),
                     phase=_phase())
    try:
        if _is_func_wrapped(flat) and _host_backend(ax.group):
            # gloo's reduce-scatter copies its result into the output on a worker thread, which fails for
            # tensors wrapped by torch.func transforms: all-reduce a copy in place and keep this rank's block.
            flat = flat.clone()
            dist.all_reduce(flat, group=ax.group)
            out = flat.view(ax.n, -1)[ax.l2g[ax.me]].clone()  # row g goes to group rank g
        else:
            out = flat.new_empty(flat.numel() // ax.n)  # new_empty: same torch.func level as the input
            _REDUCE_SCATTER(out, flat, group=ax.group)
    except RuntimeError as e:
        _faults.raise_collective_error(e, name, ax.names, ax.n)
        raise
    return out.view(tuple(x.shape[1:]))


# ---------------------------------------------------------------------------------------------
# Calling the autograd functions


def _ctx_first(fn: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``fn`` (written with ``setup_context``, as torch.func needs) in the ctx-first form.

    ``Function.apply`` binds a ``setup_context``-style ``forward``'s default arguments through
    ``inspect.signature`` on every call (50-200 us, more than a small collective); the ctx-first
    form skips that and runs the same forward, context setup and backward.
    """

    def forward(ctx, *args):
        out = fn.forward(*args)
        fn.setup_context(ctx, args, out)
        return out

    return type(f"{fn.__name__}CtxFirst", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)})


def _call(fns: tuple[type[torch.autograd.Function], type[torch.autograd.Function]], *args):
    """Run ``fns = (fn, _ctx_first(fn))`` on ``args`` (``args[0]`` the tensor): through ``fn.apply``
    under torch.func transforms and forward-mode AD, through the ctx-first twin when autograd must
    record it, and as the bare forward when there is no gradient to track (a graph node costs more
    than the small collectives of a training step's bookkeeping)."""
    fn, twin = fns
    x = args[0]
    if (torch._C._are_functorch_transforms_active() or _is_func_wrapped(x)
            or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0):
        return fn.apply(*args)
    if x.requires_grad and torch.is_grad_enabled():
        return twin.apply(*args)
    return fn.forward(*args)


# ---------------------------------------------------------------------------------------------
# psum / pmean / pmax / pmin


class _PSum(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, scale):
        ax = _resolve(axes)
        out = _all_reduce(x, ax, dist.ReduceOp.SUM, _comm.active(), "psum" if scale == 1 else "pmean")
        return out * scale if scale != 1 else out

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, axes, scale = inputs
        ctx.axes, ctx.scale = axes, scale
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            out = _all_reduce(g, ax, dist.ReduceOp.SUM, ctx.collectors, "psum" if ctx.scale == 1 else "pmean")
        return (out * ctx.scale if ctx.scale != 1 else out), None, None


_PSUM_FNS = (_PSum, _ctx_first(_PSum))


def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Sum of ``x`` over the ranks along ``axis_name`` (every rank gets the sum)."""
    return _call(_PSUM_FNS, x, axis_name, 1)


def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Mean of ``x`` over the ranks along ``axis_name``."""
    n = axis_size(axis_name)
    return _call(_PSUM_FNS, x, axis_name, 1.0 / n)


class _PExtreme(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, is_max):
        ax = _resolve(axes)
        op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.MIN
        return _all_reduce(x, ax, op, _comm.active(), "pmax" if is_max else "pmin")

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, axes, is_max = inputs
        ctx.axes, ctx.is_max = axes, is_max
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()
        ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            name = "pmax" if ctx.is_max else "pmin"
            total = _all_reduce(g, ax, dist.ReduceOp.SUM, ctx.collectors, name)
            hit = (x == y).to(g.dtype)
            ties = _all_reduce(hit, ax, dist.ReduceOp.SUM, ctx.collectors, name)
        return total * hit / ties.clamp_min(1), None, None


_PEXTREME_FNS = (_PExtreme, _ctx_first(_PExtreme))


def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise max over the ranks along ``axis_name``; the gradient goes to the arg-max ranks
    (split evenly between ties, as ``torch.amax`` does)."""
    return _call(_PEXTREME_FNS, x, axis_name, True)


def pmin(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise min over the ranks along ``axis_name`` (gradient as in :func:`pmax`)."""
    return _call(_PEXTREME_FNS, x, axis_name, False)


# ---------------------------------------------------------------------------------------------
# all_gather / psum_scatter


def _gather(x: torch.Tensor, ax: _Axes, dim: int, tiled: bool, collectors, name: str) -> torch.Tensor:
    stacked = _gather_dim0(x, ax, collectors, name)  # (n, *x.shape)
    if tiled:
        # (n, ..., d_k, ...) -> (..., n*d_k, ...)
        moved = stacked.movedim(0, dim)  # (..., n, d_k, ...)
        shape = list(x.shape)
        shape[dim] = shape[dim] * ax.n
        return moved.reshape(shape)
    return stacked.movedim(0, dim).contiguous()


def _scatter(x: torch.Tensor, ax: _Axes, dim: int, tiled: bool, collectors, name: str) -> torch.Tensor:
    if tiled:
        if x.shape[dim] % ax.n:
            raise ValueError(
                f"psum_scatter over {ax.names} (size {ax.n}) needs dimension {dim} of size {x.shape[dim]} "
                f"to be divisible by {ax.n}"
            )
        shape = list(x.shape)
        shape[dim : dim + 1] = [ax.n, x.shape[dim] // ax.n]
        stacked = x.reshape(shape).movedim(dim, 0)
    else:
        if x.shape[dim] != ax.n:
            raise ValueError(
                f"psum_scatter(tiled=False) over {ax.names} needs dimension {dim} of size {ax.n}, "
                f"found {x.shape[dim]}; use tiled=True to split a larger dimension"
            )
        stacked = x.movedim(dim, 0)
    return _scatter_dim0(stacked, ax, collectors, name)


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{what}: dimension {dim} is out of range for a tensor of rank {ndim}")
    return dim % max(ndim, 1)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, dim, tiled):
        ax = _resolve(axes)
        return _gather(x, ax, dim, tiled, _comm.active(), "all_gather")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axes, ctx.dim, ctx.tiled = inputs
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            return _scatter(g, ax, ctx.dim, ctx.tiled, ctx.collectors, "all_gather"), None, None, None


_ALL_GATHER_FNS = (_AllGather, _ctx_first(_AllGather))


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """Gather ``x`` from every rank along ``axis_name``.

    ``tiled=False`` stacks the blocks on a new dimension ``axis``; ``tiled=True`` concatenates them
    along the existing dimension ``axis``. Transpose: :func:`psum_scatter`.
    """
    axis = _norm_dim(axis, x.ndim + (0 if tiled else 1), "all_gather")
    return _call(_ALL_GATHER_FNS, x, axis_name, axis, tiled)


class _PSumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, dim, tiled):
        ax = _resolve(axes)
        return _scatter(x, ax, dim, tiled, _comm.active(), "psum_scatter")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axes, ctx.dim, ctx.tiled = inputs
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            return _gather(g, ax, ctx.dim, ctx.tiled, ctx.collectors, "psum_scatter"), None, None, None


_PSUM_SCATTER_FNS = (_PSumScatter, _ctx_first(_PSumScatter))


def psum_scatter(x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False) -> torch.Tensor:
    """Sum over ranks along ``axis_name`` and keep only this rank's block of ``scatter_dimension``.

    ``tiled=True`` splits the dimension into ``n`` equal blocks; ``tiled=False`` needs the dimension
    to have size ``n`` and removes it. Transpose: :func:`all_gather`.
    """
    dim = _norm_dim(scatter_dimension, x.ndim, "psum_scatter")
    return _call(_PSUM_SCATTER_FNS, x, axis_name, dim, tiled)


# ---------------------------------------------------------------------------------------------
# all_to_all


def _a2a(x: torch.Tensor, ax: _Axes, split_dim: int, concat_dim: int, split_sizes, recv_sizes, collectors,
         name: str):
    """Returns (output, split_sizes, recv_sizes) with sizes in logical order along the split dim."""
    n = ax.n
    if split_sizes is None:
        if x.shape[split_dim] % n:
            raise ValueError(
                f"all_to_all over {ax.names} (size {n}) needs split dimension {split_dim} of size "
                f"{x.shape[split_dim]} to be divisible by {n}, or explicit split_sizes"
            )
        if n > 1 and split_dim == 0 and concat_dim == 0 and ax.identity_order:
            # fast path (e.g. MoE token dispatch): rows already go to ranks in order; no layout copies
            send = x.contiguous()
            out = send.new_empty(send.shape)
            if collectors:
                _comm.record(collectors, op="all_to_all", name=name, axes=ax.names, n=n, payload_bytes=_nbytes(send),
                             phase=_phase())
            try:
                dist.all_to_all_single(out, send, group=ax.group)
            except RuntimeError as e:
                _faults.raise_collective_error(e, name, ax.names, ax.n)
                raise
            return out, split_sizes, [send.shape[0] // n] * n
        chunks = list(torch.chunk(x, n, dim=split_dim)) if n > 1 else [x]
        even = True
    else:
        split_sizes = [int(s) for s in split_sizes]
        if len(split_sizes) != n or sum(split_sizes) != x.shape[split_dim]:
            raise ValueError(
                f"all_to_all split_sizes {split_sizes} must have {n} entries summing to dimension "
                f"{split_dim} of size {x.shape[split_dim]}"
            )
        chunks = list(torch.split(x, split_sizes, dim=split_dim))
        even = False
    if n == 1:
        return torch.cat(chunks, dim=concat_dim).clone(), split_sizes, recv_sizes if recv_sizes else split_sizes
    # Move the split dim to the front so each chunk is contiguous rows; concat happens after.
    chunks = [c.movedim(split_dim, 0).contiguous() for c in chunks]
    rest = tuple(chunks[0].shape[1:])
    rows_per = [c.shape[0] for c in chunks]
    if even:
        recv_sizes = rows_per[:]  # every rank sends the same shape
    elif recv_sizes is None:
        recv_sizes = _exchange_sizes(split_sizes, ax, x.device)
    # order send chunks by destination group rank
    send = torch.cat([chunks[ax.g2l[g]] for g in range(n)], dim=0)
    in_split = [rows_per[ax.g2l[g]] for g in range(n)]
    out_split = [int(recv_sizes[ax.g2l[g]]) for g in range(n)]
    out = send.new_empty((sum(out_split),) + rest)
    if collectors:
        # unequal splits: exactly the rows that leave this rank (its own block stays); equal: (n-1)/n
        row = _nbytes(send) // max(send.shape[0], 1)
        off = None if even else Fraction((send.shape[0] - rows_per[ax.me]) * row)
        _comm.record(collectors, op="all_to_all", name=name, axes=ax.names, n=n, payload_bytes=_nbytes(send),
                     phase=_phase(), sent_bytes=off)
    try:
        if even:
            dist.all_to_all_single(out, send, group=ax.group)
        else:
            dist.all_to_all_single(out, send, out_split, in_split, group=ax.group)
    except RuntimeError as e:
        _faults.raise_collective_error(e, name, ax.names, ax.n)
        raise
    recv_chunks = list(torch.split(out, out_split, dim=0))  # by source group rank
    by_logical = [recv_chunks[ax.l2g[li]].movedim(0, split_dim) for li in range(n)]
    return torch.cat(by_logical, dim=concat_dim), split_sizes, recv_sizes


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, split_dim, concat_dim, split_sizes, recv_sizes):
        ax = _resolve(axes)
        out, _, _ = _a2a(x, ax, split_dim, concat_dim, split_sizes, recv_sizes, _comm.active(), "all_to_all")
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.axes, ctx.split_dim, ctx.concat_dim, ctx.split_sizes, ctx.recv_sizes = inputs
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            if ctx.split_sizes is None:
                out, _, _ = _a2a(g, ax, ctx.concat_dim, ctx.split_dim, None, None, ctx.collectors, "all_to_all")
            else:
                out, _, _ = _a2a(g, ax, ctx.concat_dim, ctx.split_dim, ctx.recv_sizes, ctx.split_sizes,
                                 ctx.collectors, "all_to_all")
        return out, None, None, None, None, None


_ALL_TO_ALL_FNS = (_AllToAll, _ctx_first(_AllToAll))


def all_to_all(
    x: torch.Tensor,
    axis_name: AxisName,
    split_axis: int,
    concat_axis: int,
    *,
    split_sizes: Sequence[int] | None = None,
    recv_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Split ``x`` along ``split_axis`` into one block per rank, send block ``j`` to rank ``j``, and
    concatenate the received blocks along ``concat_axis`` in rank order.

    Equal splits by default (the dimension must divide by the axis size). Unequal splits: pass
    ``split_sizes`` (rows sent to each rank) and, if known, ``recv_sizes`` (rows received from each
    rank; otherwise they are exchanged first); unequal splits need ``split_axis == concat_axis``.
    Transpose: the reverse all-to-all (sizes swapped).
    """
    split_axis = _norm_dim(split_axis, x.ndim, "all_to_all")
    concat_axis = _norm_dim(concat_axis, x.ndim, "all_to_all")
    if split_sizes is not None and split_axis != concat_axis:
        raise ValueError("all_to_all with unequal split_sizes needs split_axis == concat_axis")
    if split_sizes is not None and recv_sizes is None:
        ax = _resolve(axis_name)
        recv_sizes = _exchange_sizes(split_sizes, ax, x.device)
    return _call(_ALL_TO_ALL_FNS, x, axis_name, split_axis, concat_axis,
                           None if split_sizes is None else tuple(int(s) for s in split_sizes),
                           None if recv_sizes is None else tuple(int(s) for s in recv_sizes))


# ---------------------------------------------------------------------------------------------
# all_to_all_start: the row all-to-all issued without waiting (overlap with compute)


class _Flight:
    """One exchange in flight (the forward's, then its transpose's): the work, the send buffer it reads
    until done, and how to put the received rows in logical rank order."""

    __slots__ = ("work", "send", "finish", "name")

    def __init__(self, work: object, send: torch.Tensor | None, finish, name: str = "all_to_all") -> None:
        self.work, self.send, self.finish, self.name = work, send, finish, name

    def wait(self, out: torch.Tensor, axes: tuple[str, ...], n: int) -> torch.Tensor:
        if self.work is not None:
            try:
                for w in (self.work if isinstance(self.work, list) else [self.work]):
                    w.wait()
            except RuntimeError as e:
                _faults.raise_collective_error(e, self.name, axes, n)
                raise
        self.work = self.send = None  # the send buffer is free now
        return self.finish(out)


def _a2a_issue(x: torch.Tensor, ax: _Axes, split_sizes: Sequence[int], recv_sizes: Sequence[int], collectors,
               ) -> tuple[torch.Tensor, _Flight]:
    """Issue the all-to-all of the rows of ``x`` (``split_sizes[l]`` rows to logical rank ``l``,
    ``recv_sizes[l]`` from it) with ``async_op=True``: the output buffer (filled when the work is done)
    and the flight to wait on."""
    n = ax.n
    x = x.detach()
    if n == 1:
        return x.clone(memory_format=torch.contiguous_format), _Flight(None, None, lambda out: out)
    if ax.identity_order:
        send = x.contiguous()
    else:  # send blocks in group-rank order
        chunks = torch.split(x, list(split_sizes), dim=0)
        send = torch.cat([chunks[ax.g2l[g]] for g in range(n)], dim=0)
    in_split = [int(split_sizes[ax.g2l[g]]) for g in range(n)]
    out_split = [int(recv_sizes[ax.g2l[g]]) for g in range(n)]
    out = send.new_empty((sum(out_split),) + tuple(send.shape[1:]))
    if collectors:
        row = _nbytes(send) // max(send.shape[0], 1)
        _comm.record(collectors, op="all_to_all", name="all_to_all_start", axes=ax.names, n=n,
                     payload_bytes=_nbytes(send), phase=_phase(),
                     sent_bytes=Fraction((send.shape[0] - int(split_sizes[ax.me])) * row))
    try:
        work = dist.all_to_all_single(out, send, out_split, in_split, group=ax.group, async_op=True)
    except RuntimeError as e:
        _faults.raise_collective_error(e, "all_to_all", ax.names, ax.n)
        raise

    def finish(o: torch.Tensor) -> torch.Tensor:
        if ax.identity_order:
            return o
        by_group = torch.split(o, out_split, dim=0)
        return torch.cat([by_group[ax.l2g[li]] for li in range(n)], dim=0)

    return out, _Flight(work, send, finish)


class PendingAllToAll:
    """A row all-to-all in flight (:func:`all_to_all_start`); :meth:`wait` returns its result, a
    differentiable tensor. The transpose is the reverse all-to-all, itself issued without waiting in the
    backward (by the wait's transpose) and waited for by the start's transpose, so the backward overlaps
    the same way as the forward."""

    __slots__ = ("axes", "split_sizes", "recv_sizes", "mesh", "collectors", "flight", "grad_flight", "grad_out",
                 "_buf", "_done")

    def __init__(self, axes: AxisName, split_sizes: tuple[int, ...], recv_sizes: tuple[int, ...]) -> None:
        self.axes, self.split_sizes, self.recv_sizes = axes, split_sizes, recv_sizes
        self.mesh = current_mesh()
        self.collectors = _comm.active()
        self.flight: _Flight | None = None
        self.grad_flight: _Flight | None = None
        self.grad_out: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        """Block until this rank's rows have arrived; the received rows in logical rank order."""
        if self._done:
            raise RuntimeError("PendingAllToAll.wait: this all-to-all was already waited for; wait once and "
                               "keep the result")
        self._done = True
        buf, self._buf = self._buf, None
        return _A2AWait.apply(buf, self)


class _A2AStart(torch.autograd.Function):
    @staticmethod
    def forward(x, pending):
        ax = _axes_of(pending.mesh, pending.axes)
        out, pending.flight = _a2a_issue(x, ax, pending.split_sizes, pending.recv_sizes, pending.collectors)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pending = inputs[1]

    @staticmethod
    def backward(ctx, g):  # g: only the edge from the wait's transpose; the rows come in p.grad_out
        p = ctx.pending
        out, p.grad_out = p.grad_out, None
        return p.grad_flight.wait(out, normalize_axes(p.axes), _pending_size(p)), None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(buf, pending):
        return pending.flight.wait(buf, normalize_axes(pending.axes), _pending_size(pending))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pending = inputs[1]

    @staticmethod
    def backward(ctx, g):
        # Issue the reverse exchange and return at once; the start's transpose waits for it. Its buffer
        # (the start input's shape) cannot travel on the autograd edge, which must carry this output's
        # shape: it waits in the pending object, and the edge carries g itself (never read).
        p = ctx.pending
        with p.mesh:
            ax = _axes_of(p.mesh, p.axes)
            p.grad_out, p.grad_flight = _a2a_issue(g, ax, p.recv_sizes, p.split_sizes, p.collectors)
        return g, None


def _pending_size(p: "PendingAllToAll") -> int:
    return p.mesh.axis_size(normalize_axes(p.axes))


def all_to_all_start(x: torch.Tensor, axis_name: AxisName, *, split_sizes: Sequence[int] | None = None,
                     recv_sizes: Sequence[int] | None = None) -> PendingAllToAll:
    """:func:`all_to_all` of the rows of ``x`` (``split_axis = concat_axis = 0``) issued without waiting
    (``async_op=True``): compute runs while the rows travel; ``.wait()`` gives the result. The counter
    (:func:`hpfunc.comm_stats`) records it when issued (``name="all_to_all_start"``); the transpose is
    the reverse all-to-all, issued in the backward without waiting too.

    Equal splits by default; ``split_sizes`` (rows to each rank) with ``recv_sizes`` (rows from each;
    exchanged first when not given) for unequal ones. The caller keeps ``x`` unmodified until the wait.

    Example (in a 2-rank program)::

        pending = lax.all_to_all_start(rows, "ep", split_sizes=send, recv_sizes=recv)
        other = expert_compute(previous_rows)     # overlaps the exchange
        received = pending.wait()
    """
    ax = _resolve(axis_name)
    n = ax.n
    if split_sizes is None:
        if x.shape[0] % n:
            raise ValueError(f"all_to_all_start over {ax.names} (size {n}) needs dimension 0 of size {x.shape[0]} "
                             f"to be divisible by {n}, or explicit split_sizes")
        split_sizes = recv_sizes = [x.shape[0] // n] * n
    else:
        split_sizes = [int(v) for v in split_sizes]
        if len(split_sizes) != n or sum(split_sizes) != x.shape[0]:
            raise ValueError(f"all_to_all_start split_sizes {split_sizes} must have {n} entries summing to "
                             f"dimension 0 of size {x.shape[0]} (axis {ax.names})")
        if recv_sizes is None:
            recv_sizes = _exchange_sizes(split_sizes, ax, x.device)
    pending = PendingAllToAll(axis_name, tuple(int(v) for v in split_sizes), tuple(int(v) for v in recv_sizes))
    pending._buf = _A2AStart.apply(x, pending)
    return pending


def _exchange_sizes(split_sizes: Sequence[int], ax: _Axes, device: torch.device | None = None) -> list[int]:
    """What every rank sends this one (logical order), from its ``split_sizes``; ``device``: where the
    sizes travel on a backend that takes no host tensor (NCCL), the data's device."""
    n = ax.n
    if len(split_sizes) != n:
        raise ValueError(f"all_to_all split_sizes {list(split_sizes)} must have {n} entries (axis {ax.names})")
    if n == 1:
        return [int(split_sizes[0])]
    # gloo exchanges host tensors (read back without a device wait); NCCL only device ones: the sizes go
    # over the group's device and their read below is the layer's documented host sync (docs/gpu.md)
    sizes_in = torch.tensor([int(split_sizes[ax.g2l[g]]) for g in range(n)], dtype=torch.int64,
                            device=None if _host_backend(ax.group) else device)
    sizes_out = torch.empty_like(sizes_in)
    try:
        dist.all_to_all_single(sizes_out, sizes_in, group=ax.group)
    except RuntimeError as e:
        _faults.raise_collective_error(e, "all_to_all (split sizes)", ax.names, ax.n)
        raise
    recv_g = sizes_out.tolist()
    return [recv_g[ax.l2g[li]] for li in range(n)]


# ---------------------------------------------------------------------------------------------
# ppermute


def _permute(x: torch.Tensor, ax: _Axes, perm: Sequence[tuple[int, int]], collectors, name: str) -> torch.Tensor:
    x = x.detach().contiguous()
    out = torch.zeros_like(x)
    ops = []
    dst = [d for s, d in perm if s == ax.me]
    src = [s for s, d in perm if d == ax.me]
    for d in dst:
        if d == ax.me:
            out.copy_(x)
            continue
        peer = ax.peer(d)
        ops.append(dist.P2POp(dist.isend, x, peer, group=ax.group))
        if collectors:
            _comm.record(collectors, op="ppermute", name=name, axes=ax.names, n=ax.n, payload_bytes=_nbytes(x),
                         phase=_phase())
    for s in src:
        if s == ax.me:
            continue
        peer = ax.peer(s)
        ops.append(dist.P2POp(dist.irecv, out, peer, group=ax.group))
    if ops:
        try:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        except RuntimeError as e:
            _faults.raise_collective_error(e, name, ax.names, ax.n)
            raise
    return out


def _check_perm(perm: Sequence[tuple[int, int]], n: int, axes) -> tuple[tuple[int, int], ...]:
    perm = tuple((int(s), int(d)) for s, d in perm)
    srcs = [s for s, _ in perm]
    dsts = [d for _, d in perm]
    for s, d in perm:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"ppermute pair {(s, d)} is out of range for axis {axes!r} of size {n}")
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute perm {perm} must send from and to each rank at most once")
    return perm


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x, axes, perm):
        ax = _resolve(axes)
        return _permute(x, ax, perm, _comm.active(), "ppermute")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axes, ctx.perm = inputs
        ctx.mesh = current_mesh()
        ctx.collectors = _comm.active()

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            ax = _axes_of(ctx.mesh, ctx.axes)
            inv = tuple((d, s) for s, d in ctx.perm)
            return _permute(g, ax, inv, ctx.collectors, "ppermute"), None, None


_PPERMUTE_FNS = (_PPermute, _ctx_first(_PPermute))


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` for each ``(src, dst)`` in ``perm`` (indices along
    ``axis_name``); ranks that receive nothing get zeros. Transpose: the inverse permutation.

    Example: a ring shift ``perm=[(i, (i + 1) % n) for i in range(n)]``.

    Over a tuple of axes, devices are numbered row-major over the axes *in the order given* (as by
    :func:`axis_index`), even when that is not the mesh's order: on a mesh ``{"x": 2, "y": 2}``,
    index 1 along ``("y", "x")`` is the device at ``x=1, y=0``. JAX numbers a tuple's devices in mesh
    order whatever the order given (there, index 1 along ``("y", "x")`` is ``x=0, y=1``): when porting
    JAX code that passes such a tuple, pass it in mesh order (``("x", "y")``) to keep its numbering.
    """
    n = axis_size(axis_name)
    return _call(_PPERMUTE_FNS, x, axis_name, _check_perm(perm, n, axis_name))


# ---------------------------------------------------------------------------------------------
# ppermute_start: the permutation issued without waiting (a ring's next transfer under compute)


def _permute_issue(x: torch.Tensor, ax: _Axes, perm: Sequence[tuple[int, int]], collectors,
                   ) -> tuple[torch.Tensor, _Flight]:
    """Post the sends and receives of ``ppermute(x, perm)`` (``batch_isend_irecv``) without waiting: the
    output buffer (zeros where nothing arrives; filled when the works are done) and the flight."""
    x = x.detach().contiguous()
    out = torch.zeros_like(x)
    ops = []
    for s, d in perm:
        if s == ax.me and d == ax.me:
            out.copy_(x)
        elif s == ax.me:
            ops.append(dist.P2POp(dist.isend, x, ax.peer(d), group=ax.group))
            if collectors:
                _comm.record(collectors, op="ppermute", name="ppermute_start", axes=ax.names, n=ax.n,
                             payload_bytes=_nbytes(x), phase=_phase())
    for s, d in perm:
        if d == ax.me and s != ax.me:
            ops.append(dist.P2POp(dist.irecv, out, ax.peer(s), group=ax.group))
    works: list = []
    if ops:
        try:
            works = list(dist.batch_isend_irecv(ops))
        except RuntimeError as e:
            _faults.raise_collective_error(e, "ppermute_start", ax.names, ax.n)
            raise
    return out, _Flight(works, x, lambda o: o, "ppermute_start")


class PendingPPermute:
    """A :func:`ppermute_start` in flight; :meth:`wait` returns the received tensor (differentiable).

    The transpose mirrors it: the wait's transpose posts the inverse permutation of the cotangent
    without waiting, and the start's transpose waits for it, so the backward overlaps as the forward.
    """

    __slots__ = ("axes", "perm", "mesh", "collectors", "flight", "grad_flight", "grad_out", "_buf", "_done")

    def __init__(self, axes: AxisName, perm: tuple[tuple[int, int], ...]) -> None:
        self.axes, self.perm = axes, perm
        self.mesh = current_mesh()
        self.collectors = _comm.active()
        self.flight: _Flight | None = None
        self.grad_flight: _Flight | None = None
        self.grad_out: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        """Block until this rank's tensor has arrived (zeros if no rank sends to it); the result."""
        if self._done:
            raise RuntimeError("PendingPPermute.wait: this ppermute was already waited for; wait once and keep "
                               "the result")
        self._done = True
        buf, self._buf = self._buf, None
        return _PermuteWait.apply(buf, self)


class _PermuteStart(torch.autograd.Function):
    @staticmethod
    def forward(x, pending):
        ax = _axes_of(pending.mesh, pending.axes)
        out, pending.flight = _permute_issue(x, ax, pending.perm, pending.collectors)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pending = inputs[1]

    @staticmethod
    def backward(ctx, g):  # g: the edge from the wait's transpose (never read); the rows come in p.grad_out
        p = ctx.pending
        out, p.grad_out = p.grad_out, None
        return p.grad_flight.wait(out, normalize_axes(p.axes), _pending_size(p)), None


class _PermuteWait(torch.autograd.Function):
    @staticmethod
    def forward(buf, pending):
        return pending.flight.wait(buf, normalize_axes(pending.axes), _pending_size(pending))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pending = inputs[1]

    @staticmethod
    def backward(ctx, g):
        # Post the inverse permutation of the cotangent and return at once; the start's transpose waits.
        p = ctx.pending
        with p.mesh:
            ax = _axes_of(p.mesh, p.axes)
            p.grad_out, p.grad_flight = _permute_issue(g, ax, tuple((d, s) for s, d in p.perm), p.collectors)
        return g, None


def ppermute_start(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> PendingPPermute:
    """:func:`ppermute` posted without waiting: compute runs while ``x`` travels; ``.wait()`` gives the
    result. The counter records it when posted (``name="ppermute_start"``); the transpose is the inverse
    permutation, posted in the backward without waiting too. The caller keeps ``x`` unmodified until the
    wait.

    Example (a ring, in an ``n``-rank program)::

        pending = lax.ppermute_start(kv, "cp", [(i, (i + 1) % n) for i in range(n)])
        partial = attend(q, kv)          # overlaps the transfer
        kv = pending.wait()
    """
    n = axis_size(axis_name)
    pending = PendingPPermute(axis_name, _check_perm(perm, n, axis_name))
    pending._buf = _PermuteStart.apply(x, pending)
    return pending


# ---------------------------------------------------------------------------------------------
# axis_index / axis_size


def axis_index(axis_name: AxisName) -> int:
    """This rank's index along ``axis_name`` (row-major over a tuple of axes, in the order given)."""
    mesh = current_mesh(required=True, what=f"axis_index({axis_name!r})")
    return mesh.axis_index(axis_name)


def axis_size(axis_name: AxisName) -> int:
    """Number of ranks along ``axis_name`` (product over a tuple)."""
    mesh = current_mesh(required=True, what=f"axis_size({axis_name!r})")
    return mesh.axis_size(axis_name)
