"""``hpfunc.dfunction``: a distributed function whose forward and backward are written on local blocks
(JAX's ``custom_vjp`` inside ``shard_map``).

    @hpfunc.dfunction(in_specs=(P(), P("tp", None), P(None, "tp")), out_specs=P())
    def mlp(x, w_in, w_out):                      # this rank's blocks; the primal
        return lax.psum(F.linear(F.silu(F.linear(x, w_in)), w_out), "tp")

    def mlp_fwd(x, w_in, w_out):                  # -> (output, residuals)
        return mlp(x, w_in, w_out), (x, w_in, w_out)

    def mlp_bwd(res, g):                          # -> one cotangent per argument
        x, w_in, w_out = res
        pre = F.linear(x, w_in)                   # recomputed, never saved
        ...
    mlp.defvjp(mlp_fwd, mlp_bwd)

Semantics: those of :mod:`hpfunc.lax` and :func:`~hpfunc.transforms.shard_map.shard_map`, per rank.
``fwd`` returns this rank's output block and the residuals ``bwd`` needs (any pytree; its tensors are
saved through autograd's saved tensors, so ``remat`` and ``offload`` see them). ``bwd(residuals, g)``
receives the cotangent of this rank's output block and returns the cotangent of each of this rank's
argument blocks (a tuple, one pytree per argument; ``None`` for no gradient): the exact per-rank
transpose, as autograd of the forward would give it (the transpose of ``psum`` is a ``psum`` of the
cotangents; the sum over the replicas of a replicated argument is done by the enclosing ``shard_map``
boundary or ``parallelize``, not by ``bwd``).

Calling it:

* with DTensor arguments (the global view): it runs as ``shard_map(..., in_specs, out_specs)``, which
  splits the arguments by ``in_specs``, checks them, and checks the outputs' replication promises;
* with plain tensors while a mesh is bound (inside ``shard_map``, ``hpfunc.parallelize``'s step, or
  ``with mesh:``): the arguments are this rank's blocks. The specs are checked against the bound mesh
  (every axis named exists, no spec longer than its block's rank) and ``bwd``'s cotangents against the
  blocks (one per argument, each of its block's shape and dtype); :class:`DFunctionError` names the
  argument's path otherwise;
* without a mesh: :class:`DFunctionError` (the blocks of which mesh?).

It composes with :func:`hpfunc.value_and_grad`, :func:`hpfunc.remat` (the forward, collectives
included, runs again in the backward on every rank) and :func:`hpfunc.parallelize` (tested in
``tests/ops/test_dfunction.py``). The ``autograd.Function`` underneath has the ``setup_context`` form
that ``torch.func`` needs; only ``torch.autograd`` (what ``value_and_grad`` uses) is tested.

    >>> import torch, hpfunc
    >>> from hpfunc import P
    >>> f = hpfunc.dfunction(lambda x: x * 2, in_specs=P("dp"), out_specs=P("dp"))
    >>> f.defvjp(lambda x: (x * 2, None), lambda res, g: (g * 2,)) is f
    True
    >>> f(torch.ones(2))
    Traceback (most recent call last):
    ...
    hpfunc.ops.dfunction.DFunctionError: dfunction '<lambda>' called on plain tensors with no mesh bound: pass DTensors (the global view), or call it inside shard_map / hpfunc.parallelize / `with mesh:` (the local view, on this rank's blocks)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor

from hpfunc import tree as _tree
from hpfunc.mesh import current_mesh
from hpfunc.sharding import P, SpecError, as_spec

__all__ = ["dfunction", "DFunction", "DFunctionError"]


class DFunctionError(ValueError):
    """A distributed function misused: specs that do not fit, a backward whose cotangents do not match."""


def _leaves(x: Any) -> tuple[list, Any]:
    return optree.tree_flatten(x, none_is_leaf=False, namespace=_tree.NAMESPACE)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


class _Call:
    """One call's bookkeeping, handed to the autograd function (it carries what is not a tensor)."""

    __slots__ = ("fn", "args_def", "n_args", "out_def", "n_out", "res_def", "res_kinds", "res_consts", "where", "mesh")

    def __init__(self, fn: "DFunction", args_def: Any, n_args: list[int], where: str, mesh: Any):
        self.fn, self.args_def, self.n_args, self.where, self.mesh = fn, args_def, n_args, where, mesh


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *leaves: torch.Tensor) -> tuple:
        args = optree.tree_unflatten(call.args_def, list(leaves))
        out, res = call.fn._fwd(*args)
        out_leaves, call.out_def = _leaves(out)
        for i, y in enumerate(out_leaves):
            if not isinstance(y, torch.Tensor):
                raise DFunctionError(f"{call.where}: output leaf {i} is a {type(y).__name__}, not a tensor")
        call.n_out = len(out_leaves)
        res_leaves, call.res_def = _leaves(res)
        kinds, consts, tensors = [], [], []
        ids = {id(x): k for k, x in enumerate(leaves)}
        for r in res_leaves:
            if isinstance(r, torch.Tensor) and id(r) in ids:
                kinds.append(("input", ids[id(r)]))
            elif isinstance(r, torch.Tensor):
                kinds.append(("saved", len(tensors)))
                tensors.append(r)
            else:
                kinds.append(("const", len(consts)))
                consts.append(r)
        call.res_kinds, call.res_consts = kinds, consts
        # an output that is an input block unchanged is returned as a copy (autograd tracks it as new)
        outs = [y.clone() if id(y) in ids else y for y in out_leaves]
        return tuple(outs) + tuple(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        call, leaves = inputs[0], inputs[1:]
        saved = output[call.n_out:]
        ctx.mark_non_differentiable(*saved)
        ctx.save_for_backward(*leaves, *saved)
        ctx.call = call
        ctx.shapes = [(x.shape, x.dtype) for x in leaves]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor | None) -> tuple:
        call: _Call = ctx.call
        stored = ctx.saved_tensors
        leaves, saved = stored[: len(ctx.shapes)], stored[len(ctx.shapes):]
        res_leaves = [leaves[k] if kind == "input" else saved[k] if kind == "saved" else call.res_consts[k]
                      for kind, k in call.res_kinds]
        res = optree.tree_unflatten(call.res_def, res_leaves)
        out_shapes = [g for g in gs[: call.n_out]]
        g = optree.tree_unflatten(call.out_def, list(out_shapes))
        with call.mesh:  # the backward runs outside the caller's `with mesh:`; its collectives need it
            cts = call.fn._bwd(res, g)
        n = len(call.n_args)
        if not isinstance(cts, (tuple, list)) or len(cts) != n:
            raise DFunctionError(f"{call.where}: bwd must return a tuple with one cotangent per argument ({n}), "
                                 f"found {type(cts).__name__}"
                                 f"{f' of length {len(cts)}' if isinstance(cts, (tuple, list)) else ''}")
        flat: list[torch.Tensor | None] = []
        k = 0
        for i, (ct, count) in enumerate(zip(cts, call.n_args)):
            if ct is None:
                flat.extend([None] * count)
                k += count
                continue
            ct_leaves, _ = optree.tree_flatten(ct, none_is_leaf=True, namespace=_tree.NAMESPACE)
            if len(ct_leaves) != count:
                raise DFunctionError(f"{call.where}: bwd's cotangent of args[{i}] has {len(ct_leaves)} leaves, the "
                                     f"argument has {count}")
            for j, c in enumerate(ct_leaves):
                shape, dtype = ctx.shapes[k]
                if c is not None and (tuple(c.shape) != tuple(shape) or c.dtype != dtype):
                    raise DFunctionError(
                        f"{call.where}: bwd's cotangent of args[{i}] (leaf {j}) is {c.dtype} {tuple(c.shape)}, but "
                        f"this rank's block of the argument is {dtype} {tuple(shape)}; return the cotangent of the "
                        f"block (what autograd of the forward would give)")
                flat.append(c)
                k += 1
        return (None, *flat)


class DFunction:
    """A function on local blocks with in/out specs and (after :meth:`defvjp`) its own backward; see
    the module docstring."""

    def __init__(self, fn: Callable, *, in_specs: Any, out_specs: Any, mesh: Any = None, check_rep: Any = None):
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.check_rep = check_rep
        self._vjp: tuple[Callable, Callable] | None = None
        functools.update_wrapper(self, fn)
        self._name = getattr(fn, "__name__", repr(fn))

    def defvjp(self, fwd: Callable, bwd: Callable) -> "DFunction":
        """Give the forward ``fwd(*blocks) -> (out, residuals)`` and the backward ``bwd(residuals, g) ->
        tuple of cotangents`` (see the module docstring). Returns this function."""
        if not callable(fwd) or not callable(bwd):
            raise TypeError(f"dfunction {self._name!r}: defvjp(fwd, bwd) takes two functions")
        self._vjp = (fwd, bwd)
        return self

    def _fwd(self, *args: Any) -> tuple[Any, Any]:
        return self._vjp[0](*args)

    def _bwd(self, res: Any, g: Any) -> Any:
        return self._vjp[1](res, g)

    def _check_specs(self, args: Sequence[Any], mesh: Any) -> None:
        specs = self.in_specs
        if _is_spec(specs):
            specs = tuple(specs for _ in args)
        if not isinstance(specs, tuple) or len(specs) != len(args):
            raise DFunctionError(f"dfunction {self._name!r}: in_specs must be a spec or a tuple with one entry per "
                                 f"argument ({len(args)}), found {self.in_specs!r}")
        for i, (spec, arg) in enumerate(zip(specs, args)):
            self._check_tree(spec, arg, f"args[{i}]", mesh)

    def _check_tree(self, spec: Any, value: Any, where: str, mesh: Any) -> None:
        try:
            pairs = optree.tree_flatten_with_path(
                optree.tree_broadcast_prefix(spec, value, is_leaf=_is_spec, none_is_leaf=True,
                                             namespace=_tree.NAMESPACE),
                is_leaf=_is_spec, none_is_leaf=True, namespace=_tree.NAMESPACE)
        except ValueError as e:
            raise DFunctionError(f"dfunction {self._name!r}: the spec of {where} does not fit its structure: {e}") from None
        paths, specs, _ = pairs
        leaves, _ = _leaves(value)
        for path, spec, x in zip(paths, specs, leaves):
            name = where + "".join(f".{p}" for p in path)
            p = as_spec(spec) if spec is not None else P()
            if isinstance(x, torch.Tensor) and len(p) > x.ndim:
                raise DFunctionError(f"dfunction {self._name!r}: {name} has spec {p} with {len(p)} entries but its "
                                     f"block has rank {x.ndim}")
            for axis in p.axes:
                if axis not in mesh.axis_names:
                    raise DFunctionError(f"dfunction {self._name!r}: {name} has spec {p} naming mesh axis {axis!r}, "
                                         f"but the bound mesh has axes {mesh.axis_names}")

    def local(self, *blocks: Any) -> Any:
        """Run on this rank's blocks (the local view; a mesh must be bound)."""
        mesh = current_mesh()
        if mesh is None:
            raise DFunctionError(f"dfunction {self._name!r} called on plain tensors with no mesh bound: pass DTensors "
                                 f"(the global view), or call it inside shard_map / hpfunc.parallelize / `with mesh:` "
                                 f"(the local view, on this rank's blocks)")
        self._check_specs(blocks, mesh)
        if self._vjp is None:
            out = self.fn(*blocks)
        else:
            flat: list = []
            counts = []
            for a in blocks:
                leaves, _ = _leaves(a)
                counts.append(len(leaves))
                flat.extend(leaves)
            for i, x in enumerate(flat):
                if not isinstance(x, torch.Tensor):
                    raise DFunctionError(f"dfunction {self._name!r}: argument leaf {i} is a {type(x).__name__}; "
                                         f"with a custom backward every argument leaf must be a tensor (close over "
                                         f"constants instead)")
            _, args_def = _leaves(tuple(blocks))
            call = _Call(self, args_def, counts, f"dfunction {self._name!r}", mesh)
            outs = _Apply.apply(call, *flat)
            out = optree.tree_unflatten(call.out_def, list(outs[: call.n_out]))
        self._check_tree(self.out_specs, out, "output", mesh)
        return out

    def __call__(self, *args: Any) -> Any:
        dts = [x for x in _leaves(args)[0] if isinstance(x, DTensor)]
        if dts:
            from hpfunc.mesh import Mesh
            from hpfunc.transforms.shard_map import shard_map  # the global view's boundary

            mesh = self.mesh or current_mesh() or Mesh.from_device_mesh(dts[0].device_mesh)
            return shard_map(self.local, mesh=mesh, in_specs=self.in_specs, out_specs=self.out_specs,
                             check_rep=self.check_rep)(*args)
        return self.local(*args)

    def __repr__(self) -> str:
        return f"dfunction({self._name}, in_specs={self.in_specs!r}, out_specs={self.out_specs!r})"


def dfunction(fn: Callable | None = None, *, in_specs: Any, out_specs: Any, mesh: Any = None,
              check_rep: Any = None) -> Any:
    """A distributed function on local blocks (see the module docstring); a decorator when ``fn`` is
    omitted. ``mesh`` defaults to the DTensor arguments' mesh bound at call time; ``check_rep`` is
    ``shard_map``'s check of replicated outputs in the global view."""
    for what, s in (("in_specs", in_specs), ("out_specs", out_specs)):
        for leaf in optree.tree_leaves(s, is_leaf=_is_spec, none_is_leaf=True, namespace=_tree.NAMESPACE):
            if not _is_spec(leaf):
                raise SpecError(f"dfunction: {what} holds {leaf!r}; expected P(...) specs (or None), e.g. P('dp')")
    if fn is None:
        return functools.partial(dfunction, in_specs=in_specs, out_specs=out_specs, mesh=mesh, check_rep=check_rep)
    return DFunction(fn, in_specs=in_specs, out_specs=out_specs, mesh=mesh, check_rep=check_rep)
