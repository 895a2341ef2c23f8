"""``shard_map``: run a function on local blocks, talking across ranks only through ``hpfunc.lax``.

``shard_map(f, mesh=mesh, in_specs=..., out_specs=...)`` returns a function of *global* arrays
(DTensors, or plain tensors holding the same full value on every rank). Each input is split by its
spec; ``f`` sees this rank's blocks as plain tensors; each output is assembled into a DTensor by its
out_spec. A mesh axis absent from an out_spec is a promise that the output is replicated along it;
in checked mode (``check_rep=True``, or the environment variable ``HPFUNC_CHECK_REP=1``, which the
test suite sets) the promise is verified and a broken promise raises :class:`ReplicationError`.

Gradients flow through it: the gradient of an input replicated along an axis is summed over that
axis, and the cotangent of an output replicated along an axis is split among its replicas (see
:mod:`hpfunc.lax` for the per-rank semantics this completes).

Example (2 ranks)::

    mesh = hpfunc.Mesh({"dp": 2})

    @hpfunc.shard_map(mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    def loss(x, w):
        return hpfunc.lax.psum(((x @ w) ** 2).sum(), "dp")

    value = loss(torch.randn(8, 4), torch.randn(4, 2))   # a replicated scalar DTensor
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate

from hpfunc import lax as _lax
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh, current_mesh
from hpfunc.sharding import P, SpecError, _wrap_local, as_spec, spec_to_placements

__all__ = ["shard_map", "ReplicationError"]


class ReplicationError(ValueError):
    """An output promised replicated along an axis differs between the ranks of that axis."""


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _pair_specs(specs: Any, values: Any, what: str) -> tuple[list[Any], list[P], Any, Callable[[int], str]]:
    """Flatten ``values`` and pair each leaf with its spec from the prefix tree ``specs``.

    Returns the leaves, their specs, the treedef and ``path(i)``, the dotted path of leaf ``i`` (built
    only when asked: only errors need it).
    """
    leaves, treedef = optree.tree_flatten(values, none_is_leaf=True, namespace=_tree.NAMESPACE)
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True, namespace=_tree.NAMESPACE)
    if spec_def != treedef:  # a proper prefix: one spec stands for a whole subtree
        try:
            spec_leaves = optree.broadcast_prefix(specs, values, is_leaf=_is_spec, none_is_leaf=True,
                                                  namespace=_tree.NAMESPACE)
        except (ValueError, TypeError) as e:
            raise SpecError(
                f"{what} must be a spec P(...) or a tree prefix of the {what.split('_')[0]}puts; got {specs!r}: {e}"
            ) from None

    def path(i: int) -> str:
        return _tree.path_str(optree.tree_paths(values, none_is_leaf=True, namespace=_tree.NAMESPACE)[i])

    return leaves, [s if isinstance(s, P) else as_spec(s) for s in spec_leaves], treedef, path


class _SumReplicaGrads(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the axes the input is replicated on."""

    @staticmethod
    def forward(x, mesh, axes):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.mesh, ctx.axes = inputs

    @staticmethod
    def backward(ctx, g):
        with ctx.mesh:
            return _lax.psum(g, ctx.axes), None, None


class _SplitReplicaCotangent(torch.autograd.Function):
    """Identity forward; backward splits the cotangent evenly among the replicas."""

    @staticmethod
    def forward(x, count):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.count = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g / ctx.count, None


_SUM_REPLICA_GRADS = (_SumReplicaGrads, _lax._ctx_first(_SumReplicaGrads))
_SPLIT_REPLICA_COTANGENT = (_SplitReplicaCotangent, _lax._ctx_first(_SplitReplicaCotangent))


def _checked_default() -> bool:
    return os.environ.get("HPFUNC_CHECK_REP", "0").lower() in ("1", "true", "yes")


def _replicated_axes(spec: P, mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a not in spec.axes and mesh.axis_size(a) > 1)


def _in_layout(x: torch.Tensor, spec: P, mesh: Mesh, where: Callable[[], str]) -> tuple:
    """``(placements, splits, replicated axes)`` of an input of ``x``'s shape under ``spec``, checked
    (rank, axes, even division) once per mesh, spec and shape; ``splits`` are ``(dim, axes, block)``."""

    def make() -> tuple:
        path = where()
        spec.check(mesh, x.ndim, where=path)
        splits = []
        for d in range(x.ndim):
            axes = spec.dim_axes(d)
            n = mesh.axis_size(axes)
            if x.shape[d] % n:
                raise SpecError(
                    f"shard_map input {path} has dimension {d} of size {x.shape[d]}, not divisible by {n} "
                    f"(mesh axes {axes}); shard_map needs equal blocks"
                )
            if n > 1:
                splits.append((d, axes, x.shape[d] // n))
        placements = tuple(spec_to_placements(spec, mesh, x.ndim, where=path))
        return placements, tuple(splits), _replicated_axes(spec, mesh)

    return mesh._cached(("shard_map.in", spec, tuple(x.shape)), make)


def _enter(path: Callable[[], str], x: Any, spec: P, mesh: Mesh, argname: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    where = lambda: f"{argname}.{path()}" if path() else argname  # noqa: E731
    placements, splits, replicated = _in_layout(x, spec, mesh, where)
    if isinstance(x, DTensor):
        if x.device_mesh != mesh.device_mesh and tuple(x.device_mesh.mesh.flatten().tolist()) != tuple(
            mesh.ranks.flatten().tolist()
        ):
            raise SpecError(f"shard_map input {where()} lives on another mesh {x.device_mesh}")
        if not x.requires_grad and tuple(x.placements) == placements:
            # already laid out as the spec says: this rank's block is the DTensor's local tensor (what
            # to_local returns, without its autograd function); a fresh alias, as to_local gives
            return x._local_tensor.detach()
        dt = x.redistribute(mesh.device_mesh, list(placements)) if tuple(x.placements) != placements else x
    elif not x.requires_grad and x.device.type == mesh.device_type:
        # the same full value on every rank: this rank's block is a slice (no communication)
        local = x.detach()
        for d, axes, k in splits:
            local = local.narrow(d, mesh.axis_index(axes) * k, k)
        return local.contiguous() if splits else local
    else:
        dt = DTensor.from_local(x, mesh.device_mesh, [Replicate()] * len(mesh.axis_names), run_check=False)
        dt = dt.redistribute(mesh.device_mesh, list(placements))
    local = dt.to_local()
    if replicated and local.requires_grad:
        local = _lax._call(_SUM_REPLICA_GRADS, local, mesh, replicated)
    return local


def _check_replicated(path: str, y: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], rtol: float) -> None:
    from hpfunc.lax import _axes_of, _gather_dim0

    for a in axes:
        ax = _axes_of(mesh, a)
        with torch.no_grad():
            allv = _gather_dim0(y.detach(), ax, (), "check")
        ref = allv[0]
        for i in range(1, ax.n):
            if allv[i].is_floating_point() or allv[i].is_complex():  # NaN in the same places is the same
                same = torch.allclose(allv[i], ref, rtol=rtol, atol=rtol, equal_nan=True)
            else:
                same = torch.equal(allv[i], ref)
            if not same:
                diff = (allv[i].double() - ref.double()).abs().max().item() if allv[i].is_floating_point() else "n/a"
                raise ReplicationError(
                    f"shard_map output {path or '<root>'!r}: out_spec promises replication along mesh axis {a!r}, "
                    f"but rank {i} along {a!r} holds a different value than rank 0 (max abs diff {diff}); "
                    f"reduce it (e.g. hpfunc.lax.psum/pmean over {a!r}) or name {a!r} in the out_spec"
                )


def _out_layout(y: torch.Tensor, spec: P, mesh: Mesh, where: Callable[[], str]) -> tuple:
    """``(placements, replicated axes, global shape)`` of an output block, checked once per mesh, spec and shape."""

    def make() -> tuple:
        path = where()
        spec.check(mesh, y.ndim, where=f"out.{path}" if path else "out")
        placements = tuple(spec_to_placements(spec, mesh, y.ndim, where=path))
        gshape = tuple(int(s) * mesh.axis_size(spec.dim_axes(d)) for d, s in enumerate(y.shape))
        return placements, _replicated_axes(spec, mesh), gshape

    return mesh._cached(("shard_map.out", spec, tuple(y.shape)), make)


def _exit(path: Callable[[], str], y: Any, spec: P, mesh: Mesh, check: bool, rtol: float) -> Any:
    if not isinstance(y, torch.Tensor):
        return y
    if isinstance(y, DTensor):
        raise SpecError(f"shard_map function returned a DTensor at {path() or '<root>'!r}; return local tensors")
    placements, replicated, gshape = _out_layout(y, spec, mesh, path)
    if check and replicated:
        _check_replicated(path(), y, mesh, replicated, rtol)
    if replicated and y.requires_grad:
        y = _lax._call(_SPLIT_REPLICA_COTANGENT, y, mesh.axis_size(replicated))
    return _wrap_local(y, mesh, placements, gshape)


def shard_map(
    f: Callable | None = None,
    *,
    mesh: Mesh | None = None,
    in_specs: Any,
    out_specs: Any,
    check_rep: bool | None = None,
    check_rtol: float = 0.0,
) -> Callable:
    """Map ``f`` over the blocks of its inputs (see the module docstring).

    Args:
        f: the per-rank function; it receives plain tensors (local blocks). Omit it to use
            ``shard_map`` as a decorator factory.
        mesh: the mesh; defaults to the current mesh (``with mesh:``) at call time.
        in_specs: a spec, or a tuple with one spec tree (a prefix of the argument's pytree) per
            positional argument.
        out_specs: a spec or a spec tree that is a prefix of ``f``'s output (or a function of this rank's
            output returning one, for outputs whose structure is known only after ``f`` ran).
        check_rep: verify replication promised by out_specs (default: ``HPFUNC_CHECK_REP``).
        check_rtol: tolerance of that check (0 = bitwise equal).
    """
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_rep=check_rep, check_rtol=check_rtol)

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        m = mesh if mesh is not None else current_mesh(required=True, what="shard_map without mesh=")
        specs = in_specs
        if isinstance(specs, P) or specs is None:
            specs = tuple(specs for _ in args)
        if not isinstance(specs, tuple) or len(specs) != len(args):
            raise SpecError(
                f"shard_map of {getattr(f, '__name__', f)!r}: in_specs must be a spec or a tuple with one entry "
                f"per positional argument ({len(args)}), found {in_specs!r}"
            )
        local_args = []
        for i, (spec_i, arg) in enumerate(zip(specs, args)):
            leaves, leaf_specs, treedef, path = _pair_specs(spec_i, arg, "in_specs")
            new = [_enter(functools.partial(path, j), x, s, m, f"args[{i}]")
                   for j, (x, s) in enumerate(zip(leaves, leaf_specs))]
            local_args.append(optree.tree_unflatten(treedef, new))
        with m:
            out = f(*local_args)
        check = _checked_default() if check_rep is None else check_rep
        specs_out = out_specs(out) if callable(out_specs) else out_specs
        leaves, leaf_specs, treedef, path = _pair_specs(specs_out, out, "out_specs")
        new = [_exit(functools.partial(path, j), y, s, m, check, check_rtol)
               for j, (y, s) in enumerate(zip(leaves, leaf_specs))]
        return optree.tree_unflatten(treedef, new)

    return mapped
