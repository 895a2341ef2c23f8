"""``hpfunc.ops.register(op, rule=..., impl=None)``: how an op the global view does not know shards.

The rule (:mod:`hpfunc.ops.rule`) is turned into DTensor sharding strategies and registered with
torch's own registry, ``torch.distributed.tensor.experimental.register_sharding``: plain DTensor code
then runs the op on each rank's blocks, DTensor's propagator choosing the layout and redistributing
inputs, and the op's own autograd formula (``torch.library.register_autograd``) differentiating it on
DTensors. No second dispatcher: the op goes through torch's.

When the rule alone cannot say it (a softmax over a sharded dimension needs a max and a sum across
ranks), ``impl`` runs on the local blocks instead of the op's kernel; it is registered for DTensor with
``torch.library.register_torch_dispatch``. It receives the op's arguments with every tensor replaced by
this rank's block and ``axes``: for each dimension name of the rule, the mesh axes it is sharded over
in this call (``()`` when whole). The mesh is bound, so :mod:`hpfunc.lax` collectives by axis name
work. It returns this rank's block of each result, as the rule lays it out (a partial value for a
sharded ``sum`` dimension). The layout is chosen per mesh axis among the rule's: the one that moves the
fewest inputs (the inputs' own layout when the rule allows it).

At registration the rule is checked against the op's shapes: the op runs once on small tensors whose
dimensions the rule names (each name its own size; ``static=`` gives values for non-tensor arguments
without a default) and a result whose shape contradicts the rule is a :class:`RuleError` naming the
result, the dimension and both sizes.

    >>> import torch, hpfunc.ops
    >>> @torch.library.custom_op("hpfunc_doc::scale_rows", mutates_args=())
    ... def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    ...     return x * s[:, None]
    >>> hpfunc.ops.register(scale_rows, rule="i j, i -> i j").rule.factors
    ('i', 'j')
    >>> hpfunc.ops.register(scale_rows, rule="i j, i -> j i")
    Traceback (most recent call last):
    ...
    hpfunc.ops.rule.RuleError: op hpfunc_doc::scale_rows, rule 'i j, i -> j i': result 0 dimension 0 is named 'j' (size 3 in the check) but the op gives size 2, the size the rule gave dimension 'i'; name result dimensions after the operand dimensions they come from
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hpfunc.ops.rule import REDUCTIONS, Rule, RuleError, parse

__all__ = ["register", "Registration", "resolve_op", "tensor_args"]


@attrs.frozen
class Registration:
    """What :func:`register` registered: the op overload, its parsed rule and the impl (or ``None``)."""

    op: Any
    rule: Rule
    impl: Callable | None = None

    def strategies(self, ranks: Sequence[int]) -> list[tuple[list, list]]:
        """The rule's single-mesh-axis layouts for tensor operands of the given ranks, as
        ``(result placements, operand placements)`` pairs (operands are tensor arguments only)."""
        return _strategies(self.rule, ranks)


def resolve_op(op: Any) -> torch._ops.OpOverload:
    """An ``OpOverload`` from an overload, a packet (its ``default``), a ``torch.library.custom_op``
    object or a name ``"ns::name"`` / ``"ns::name.overload"``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    inner = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(inner, torch._ops.OpOverload):
        return inner
    if isinstance(op, str) and "::" in op:
        ns, _, rest = op.partition("::")
        name, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), name)
            return getattr(packet, overload or "default")
        except (AttributeError, RuntimeError):
            raise ValueError(f"unknown op {op!r}: no torch.ops.{ns}.{name}.{overload or 'default'}; define it with "
                             f"torch.library.custom_op (and import the module that does) before registering "
                             f"a rule for it") from None
    raise TypeError(f"expected an op (an OpOverload such as torch.ops.aten.mm.default, a torch.library.custom_op, "
                    f"or a name 'ns::name'), found {type(op).__name__} {op!r}")


def _is_tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def tensor_args(op: torch._ops.OpOverload) -> tuple[list[int], int]:
    """The positions of the tensor arguments in ``op``'s schema and the number of tensor results."""
    schema = op._schema
    for a in schema.arguments:
        if isinstance(a.type, torch.ListType) and _is_tensor_type(a.type.getElementType()):
            raise RuleError(f"op {schema.name}: argument {a.name!r} is a list of tensors; rules name single tensors")
    for r in schema.returns:
        if not _is_tensor_type(r.type):
            raise RuleError(f"op {schema.name}: result {r.name or ''!r} of type {r.type} is not a tensor; rules "
                            f"describe ops returning tensors")
    return [i for i, a in enumerate(schema.arguments) if _is_tensor_type(a.type)], len(schema.returns)


def _result_names(rule: Rule, operand_names: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    k = max((sum(n.startswith("...") for n in names) for names in operand_names), default=0)
    return tuple(names[: names.index("...")] + tuple(f"...{k - 1 - j}" for j in range(k)) + names[names.index("...") + 1:]
                 if "..." in names else names for names in rule.results)


def _strategies(rule: Rule, ranks: Sequence[int]) -> list[tuple[list, list]]:
    ins = rule.expand(ranks)
    outs = _result_names(rule, ins)
    # The all-replicated layout first: expand_to_full_mesh_op_strategy keeps the order, and DTensor picks
    # the cheapest (ties: the first) so this is only taken when nothing cheaper fits.
    found = [([Replicate()] * len(outs), [Replicate()] * len(ins))]
    for f in dict.fromkeys(n for t in ins for n in t if n != "1"):  # '...k' dimensions pass through
        if f in rule.whole:
            continue
        in_pl = [Shard(t.index(f)) if f in t else Replicate() for t in ins]
        if f in rule.reduced:
            out_pl = [Partial(REDUCTIONS[rule.reduced[f]]) for _ in outs]
        else:
            out_pl = [Shard(t.index(f)) if f in t else Replicate() for t in outs]
        found.append((out_pl, in_pl))
    return found


def ruled_args(op: torch._ops.OpOverload, rule: Rule) -> list[int]:
    """The positions of the tensor arguments the rule names: all of them, or all but trailing optional
    ones (``Tensor?``, e.g. an attention mask), which must then be ``None`` when the op is called."""
    positions, _ = tensor_args(op)
    args = op._schema.arguments
    n = len(rule.operands)
    if n < len(positions) and all(isinstance(args[i].type, torch.OptionalType) for i in positions[n:]):
        return positions[:n]
    return positions


def _check_shapes(op: torch._ops.OpOverload, rule: Rule, static: Mapping[str, Any]) -> None:
    positions = ruled_args(op, rule)
    _, n_out = tensor_args(op)
    schema = op._schema
    where = f"op {schema.name}, rule {rule.text!r}"
    if len(rule.operands) != len(positions):
        raise RuleError(f"{where}: the rule names {len(rule.operands)} operand(s) but the op has {len(positions)} tensor "
                        f"argument(s) ({', '.join(schema.arguments[i].name for i in positions)}); only trailing "
                        f"optional ones may be left out")
    if len(rule.results) != n_out:
        raise RuleError(f"{where}: the rule names {len(rule.results)} result(s) but the op returns {n_out}")
    sizes = {f: 2 + i for i, f in enumerate(rule.factors)}
    ell = (13,)  # '...' stands for one dimension in the check
    shapes = []
    for names in rule.operands:
        shape: list[int] = []
        for n in names:
            shape.extend(ell if n == "..." else (1,) if n == "1" else (sizes[n],))
        shapes.append(tuple(shape))
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    it = iter(shapes)
    gen = torch.Generator().manual_seed(0)  # never the global stream: registering must not shift a user's samples
    for i, a in enumerate(schema.arguments):
        if i in positions:
            value: Any = torch.randn(next(it), generator=gen)
        elif a.name in static:
            value = static[a.name]
        elif a.has_default_value():
            continue
        else:
            raise RuleError(f"{where}: argument {a.name!r} ({a.type}) has no default; give a value for checking the "
                            f"rule against the op's shapes, e.g. static={{{a.name!r}: ...}}")
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    try:
        with torch.no_grad():
            out = op(*args, **kwargs)
    except Exception as e:  # the op's own message says which dimension it could not match
        named = ", ".join(f"{f}={s}" for f, s in sizes.items())
        raise RuleError(f"{where}: the op rejects inputs shaped as the rule names them (operand shapes {shapes}, "
                        f"each dimension name its own size: {named}): {str(e).splitlines()[0]}; a dimension the "
                        f"rule names alike in two operands must be the same dimension of the op") from None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for r, (names, y) in enumerate(zip(rule.results, outs)):
        expect: list[tuple[str, int]] = []
        for n in names:
            expect.extend([("...", ell[0])] if n == "..." else [(n, 1 if n == "1" else sizes[n])])
        if y.ndim != len(expect):
            raise RuleError(f"{where}: result {r} is named {' '.join(names) or '(a scalar)'} ({len(expect)} "
                            f"dimensions) but the op returns rank {y.ndim} (shape {tuple(y.shape)})")
        for d, ((n, want), got) in enumerate(zip(expect, y.shape)):
            if want != got:
                other = [f for f, s in sizes.items() if s == got]
                hint = f", the size the rule gave dimension {other[0]!r}" if other else ""
                raise RuleError(f"{where}: result {r} dimension {d} is named {n!r} (size {want} in the check) but "
                                f"the op gives size {got}{hint}; name result dimensions after the operand "
                                f"dimensions they come from")


def _placement_cost(current: Sequence, target: Sequence) -> int:
    return sum(1 for c, t in zip(current, target) if c != t)


def _impl_handler(reg: Registration) -> Callable:
    from hpfunc.mesh import Mesh  # the mesh binding the impl's collectives read

    positions = ruled_args(reg.op, reg.rule)

    def handler(cls: Any, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        flat = list(args) + [kwargs[a.name] for a in func._schema.arguments[len(args):] if a.name in kwargs]
        tensors = [flat[i] if i < len(flat) else None for i in positions]
        dts = [t for t in tensors if isinstance(t, DTensor)]
        mesh = dts[0].device_mesh
        for i, t in zip(positions, tensors):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                raise TypeError(f"op {func._schema.name}: argument {func._schema.arguments[i].name!r} is a plain tensor "
                                f"among DTensors; distribute it (hpfunc.shard) so that its layout is known")
            if isinstance(t, DTensor) and t.device_mesh != mesh:
                raise ValueError(f"op {func._schema.name}: arguments on different meshes")
        ranks = [t.ndim for t in tensors]
        choices = reg.strategies(ranks)
        ins = reg.rule.expand(ranks)
        outs = _result_names(reg.rule, ins)
        in_pl: list[list] = [[] for _ in tensors]
        out_pl: list[list] = [[] for _ in outs]
        axes: dict[str, list[str]] = {}
        names = mesh.mesh_dim_names
        for m in range(mesh.ndim):
            current = [t.placements[m] for t in tensors]
            best = min(choices, key=lambda c: _placement_cost(current, c[1]))
            for k, p in enumerate(best[1]):
                in_pl[k].append(p)
                if isinstance(p, Shard):
                    axes.setdefault(ins[k][p.dim], [])
                    if names[m] not in axes[ins[k][p.dim]]:
                        axes[ins[k][p.dim]].append(names[m])
            for k, p in enumerate(best[0]):
                out_pl[k].append(p)
        local = list(flat)
        for i, t, pl in zip(positions, tensors, in_pl):
            local[i] = t.redistribute(mesh, pl).to_local()
        # a global size for every named dimension, from the inputs' global shapes
        size: dict[str, int] = {}
        for t, n in zip(tensors, ins):
            for name, s in zip(n, t.shape):
                size.setdefault(name, s)
        factor_axes = {f: tuple(axes.get(f, ())) for f in dict.fromkeys(x for t in ins for x in t)}
        with Mesh.from_device_mesh(mesh):
            res = reg.impl(*local[: len(args)], **{k: local[len(args) + j] for j, k in
                                                    enumerate(a.name for a in func._schema.arguments[len(args):]
                                                              if a.name in kwargs)}, axes=factor_axes)
        res_t = res if isinstance(res, (tuple, list)) else (res,)
        wrapped = []
        for k, (y, n, pl) in enumerate(zip(res_t, outs, out_pl)):
            shape = tuple(1 if d == "1" else size[d] for d in n)
            stride = tuple(math.prod(shape[j + 1:]) for j in range(len(shape)))
            wrapped.append(DTensor.from_local(y, mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride))
        return tuple(wrapped) if isinstance(res, (tuple, list)) else wrapped[0]

    return handler


def register(op: Any, rule: str, impl: Callable | None = None, *, static: Mapping[str, Any] | None = None,
             check: bool = True) -> Registration:
    """Register how ``op`` shards, with torch's DTensor registry.

    Args:
        op: a ``torch.library.custom_op`` (or its ``OpOverload``), an aten op the global view lacks, or
            a name ``"ns::name[.overload]"``.
        rule: an einsum-like rule over the op's tensor arguments and results (:mod:`hpfunc.ops.rule`).
        impl: optional ``impl(*args, axes=...)`` run on local blocks instead of the op's kernel (see the
            module docstring).
        static: values of non-tensor arguments without a default, for the shape check.
        check: run the op once on small tensors to check the rule against its shapes.

    Returns:
        a :class:`Registration` (the op overload, the parsed rule, the impl).

    Raises:
        RuleError: a malformed rule, or one that contradicts the op's shapes (naming the dimension).
    """
    overload = resolve_op(op)
    parsed = parse(rule)
    positions = ruled_args(overload, parsed)
    _, n_out = tensor_args(overload)
    if len(parsed.operands) != len(positions) or len(parsed.results) != n_out:
        _check_shapes(overload, parsed, static or {})  # raises, naming the counts
    if check:
        _check_shapes(overload, parsed, static or {})
    reg = Registration(op=overload, rule=parsed, impl=impl)
    if impl is not None:
        torch.library.register_torch_dispatch(overload, DTensor, _impl_handler(reg))
        return reg

    from torch.distributed.tensor.experimental import register_sharding

    def sharding(*args: Any, **kwargs: Any) -> list[tuple[list, list]]:
        flat = list(args)
        specs = [flat[i] if i < len(flat) else kwargs.get(overload._schema.arguments[i].name) for i in positions]
        ranks = [s.ndim for s in specs]
        pairs = []
        for out_pl, in_pl in reg.strategies(ranks):
            full: list[Any] = [None] * len(flat)
            for i, p in zip(positions, in_pl):
                if i < len(full):
                    full[i] = p
            pairs.append((out_pl, full))
        return pairs

    register_sharding(overload)(sharding)
    return reg
