"""Partition specs, named shardings, and sharded state as DTensors.

``P`` says, per tensor dimension, which mesh axes split it (JAX's ``PartitionSpec``):
``P("fsdp", "tp")``, ``P(("dp", "fsdp"), None)``, ``P()`` (replicated). Uneven dimensions split like
``torch.chunk`` (the first chunks get ``ceil(n / k)`` elements, trailing ones may be smaller or empty),
which is also what DTensor does.

Example (in a 4-rank program)::

    mesh = hpfunc.Mesh({"dp": 2, "tp": 2})
    x = hpfunc.shard(torch.arange(32.).reshape(8, 4), mesh, P("dp", "tp"))
    hpfunc.typeof(x)                               # 'f32[8@dp,4@tp]'
    y = hpfunc.reshard(x, P(("dp", "tp"), None))   # 'f32[8@(dp,tp),4]'
"""

from __future__ import annotations

import copy
import fnmatch
import math
import re
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

try:  # DTensor's own spec types: building a DTensor from them skips from_local's autograd function
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as _DTensorSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as _TensorMeta
except ImportError:  # another torch release: always use DTensor.from_local
    _DTensorSpec = _TensorMeta = None

from hpfunc import tree as _tree
from hpfunc.mesh import Mesh, current_mesh, normalize_axes

__all__ = [
    "P",
    "NamedSharding",
    "SpecError",
    "shard",
    "reshard",
    "typeof",
    "spec_to_placements",
    "placements_to_spec",
    "logical_to_spec",
    "local_block",
    "from_local",
    "full",
    "sharding_of",
    "is_dtensor",
    "as_spec",
    "resolve_specs",
    "current_mesh",
]


class SpecError(ValueError):
    """A partition spec that does not fit its tensor or mesh."""


class P(tuple):
    """A partition spec: one entry per leading tensor dimension (``None``, an axis, or a tuple of axes).

    Trailing dimensions not mentioned are replicated.

    >>> P("dp", None)
    P('dp', None)
    >>> P(("dp", "tp"),).axes
    ('dp', 'tp')
    """

    def __new__(cls, *parts: Any) -> "P":
        norm = []
        for part in parts:
            if part is None or isinstance(part, str):
                norm.append(part)
            elif isinstance(part, (tuple, list)):
                axes = tuple(part)
                for a in axes:
                    if not isinstance(a, str):
                        raise SpecError(f"spec entries are None, an axis name or a tuple of names; found {part!r}")
                norm.append(None if len(axes) == 0 else axes[0] if len(axes) == 1 else axes)
            else:
                raise SpecError(f"spec entries are None, an axis name or a tuple of names; found {part!r}")
        return super().__new__(cls, norm)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec uses, in order of appearance."""
        out: list[str] = []
        for part in self:
            out.extend(normalize_axes(part))
        return tuple(out)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Axes that split dimension ``dim`` (``()`` when replicated or beyond the spec)."""
        return normalize_axes(self[dim]) if dim < len(self) else ()

    def check(self, mesh: Mesh, ndim: int, *, where: str = "") -> None:
        """Raise :class:`SpecError` unless the spec fits a tensor of rank ``ndim`` on ``mesh``."""
        at = f" at {where!r}" if where else ""
        if len(self) > ndim:
            raise SpecError(f"spec {self!r}{at} has {len(self)} entries but the tensor has rank {ndim}")
        seen: set[str] = set()
        for a in self.axes:
            if a not in mesh.axis_names:
                import difflib

                close = difflib.get_close_matches(a, list(mesh.axis_names), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise SpecError(f"spec {self!r}{at} names unknown mesh axis {a!r}; mesh axes are {mesh.axis_names}{hint}")
            if a in seen:
                raise SpecError(f"spec {self!r}{at} uses mesh axis {a!r} twice; an axis can split one dimension only")
            seen.add(a)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(p) for p in self) + ")"

    def __reduce__(self):  # pickle as P(*entries), not P(entries)
        return (P, tuple(self))


def as_spec(spec: Any) -> P:
    """Coerce ``None`` (replicated), a tuple or a ``P`` into a ``P``."""
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, (tuple, list)):
        return P(*spec)
    if isinstance(spec, str):
        raise SpecError(f"a spec is a P(...), found the string {spec!r}; did you mean P({spec!r})?")
    raise SpecError(f"expected a partition spec P(...), found {type(spec).__name__}: {spec!r}")


@attrs.frozen
class NamedSharding:
    """A mesh plus a spec: where every block of a global tensor lives."""

    mesh: Mesh
    spec: P = attrs.field(converter=as_spec)

    def placements(self, ndim: int) -> list[Placement]:
        return spec_to_placements(self.spec, self.mesh, ndim)


# ---------------------------------------------------------------------------------------------
# Spec <-> DTensor placements


def spec_to_placements(spec: P, mesh: Mesh, ndim: int, *, where: str = "") -> list[Placement]:
    """DTensor placements (one per mesh axis) for ``spec`` on a tensor of rank ``ndim``.

    Several mesh axes on one dimension must appear in mesh order (DTensor splits them outer to
    inner in mesh order).
    """
    spec = as_spec(spec)
    # every step asks this for every leaf: checked and built once per mesh, spec and rank
    return list(mesh._cached(("placements", spec, ndim), lambda: tuple(_placements(spec, mesh, ndim, where))))


def _placements(spec: P, mesh: Mesh, ndim: int, where: str) -> list[Placement]:
    spec.check(mesh, ndim, where=where)
    placements: list[Placement] = [Replicate() for _ in mesh.axis_names]
    for d, part in enumerate(spec):
        axes = normalize_axes(part)
        dims = [mesh.axis_names.index(a) for a in axes]
        if dims != sorted(dims):
            at = f" at {where!r}" if where else ""
            raise SpecError(
                f"spec {spec!r}{at} splits dimension {d} over {axes} but DTensor needs mesh order "
                f"{tuple(a for a in mesh.axis_names if a in axes)}"
            )
        for md in dims:
            placements[md] = Shard(d)
    return placements


def placements_to_spec(placements: Sequence[Placement], mesh: Mesh, ndim: int) -> tuple[P, tuple[str, ...]]:
    """``(spec, partial_axes)`` for DTensor placements; ``partial_axes`` lists axes holding partial sums."""
    parts: list[list[str]] = [[] for _ in range(ndim)]
    partial: list[str] = []
    for name, pl in zip(mesh.axis_names, placements):
        if isinstance(pl, Shard) and type(pl) is Shard:
            parts[pl.dim % ndim].append(name)
        elif isinstance(pl, Partial):
            partial.append(name)
        elif isinstance(pl, Replicate):
            pass
        else:
            raise SpecError(f"placement {pl} on mesh axis {name!r} has no partition-spec equivalent")
    while parts and not parts[-1]:
        parts.pop()
    return P(*[tuple(p) if p else None for p in parts]), tuple(partial)


# ---------------------------------------------------------------------------------------------
# Local blocks (torch.chunk semantics, identical to DTensor's Shard)


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """(offset, length) of chunk ``i`` of ``n`` of a dimension of ``size`` (torch.chunk semantics)."""
    full = -(-size // n) if size > 0 else 0
    start = full * i
    if start >= size:
        return size, 0
    return start, min(size, start + full) - start


def local_block(shape: Sequence[int], mesh: Mesh, spec: P, coords: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(starts, sizes)`` of the block of a global ``shape`` held by the rank at ``coords``."""
    spec = as_spec(spec)
    starts = [0] * len(shape)
    sizes = list(shape)
    for d in range(len(shape)):
        for a in spec.dim_axes(d):
            md = mesh.axis_names.index(a)
            off, sizes[d] = _chunk(sizes[d], mesh.axis_size(a), coords[md])
            starts[d] += off
    return tuple(starts), tuple(sizes)


def global_shape_of_block(local_shape: Sequence[int], mesh: Mesh, spec: P) -> tuple[int, ...]:
    """Global shape of evenly split blocks of ``local_shape``."""
    spec = as_spec(spec)
    return tuple(int(s) * mesh.axis_size(spec.dim_axes(d)) for d, s in enumerate(local_shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _wrap_local(local: torch.Tensor, mesh: Mesh, placements: Sequence[Placement], global_shape: Sequence[int]) -> DTensor:
    """``DTensor.from_local(local, ..., run_check=False)`` with a contiguous global stride, for a small
    fraction of its host cost when ``local`` needs no gradient: ``from_local`` is an autograd function
    that builds its spec from scratch, ~0.3 ms a call, paid for every leaf of every ``shard_map`` output.
    Here the spec is built once per mesh, placements, shape and dtype and each DTensor gets a copy of it
    (as DTensor's own backward does, so no two tensors share a mutable spec)."""
    if local.requires_grad or _DTensorSpec is None or local.device.type != mesh.device_type:
        return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(global_shape),
                                  stride=_contiguous_stride(global_shape))
    key = ("dtensor spec", tuple(placements), tuple(global_shape), local.dtype)
    spec = mesh._cached(key, lambda: _DTensorSpec(mesh.device_mesh, tuple(placements), tensor_meta=_TensorMeta(
        torch.Size(global_shape), _contiguous_stride(global_shape), local.dtype)))
    # __new__ alone: DTensor.__init__ does nothing but sits behind torch._disable_dynamo (~50 us a call)
    return DTensor.__new__(DTensor, local, _copy_spec(spec), requires_grad=False)


def _copy_spec(spec: Any) -> Any:
    """``copy.copy`` of a DTensorSpec (a plain dataclass) without the reduce protocol: ~1 us, not ~13."""
    if not hasattr(spec, "__dict__"):
        return copy.copy(spec)
    out = object.__new__(type(spec))
    out.__dict__.update(spec.__dict__)
    return out


def from_local(local: torch.Tensor, sharding: NamedSharding, *, global_shape: Sequence[int]) -> DTensor:
    """Wrap this rank's block as a DTensor of ``global_shape`` (no communication)."""
    placements = sharding.placements(len(global_shape))
    return DTensor.from_local(
        local,
        sharding.mesh.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_stride(global_shape),
    )


def full(shape: Sequence[int], fill_value: float, *, dtype: torch.dtype = torch.float32,
         sharding: NamedSharding | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.full(shape, fill_value, device=device)``, or with ``sharding`` a DTensor of that global
    value in which every rank allocates only its own block on the mesh's device (no communication).

    >>> full((2, 3), 1.0).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    if sharding is None:
        return torch.full(tuple(shape), fill_value, dtype=dtype, device=device)
    _, sizes = local_block(tuple(shape), sharding.mesh, sharding.spec, sharding.mesh.coordinate())
    # allocated on the mesh's device (a block made on the host would be copied there)
    local = torch.full(sizes, fill_value, dtype=dtype, device=sharding.mesh.device_type)
    return from_local(local, sharding, global_shape=tuple(shape))


def is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def sharding_of(x: DTensor) -> NamedSharding:
    """The :class:`NamedSharding` of a DTensor (raises for partial placements)."""
    mesh = Mesh.from_device_mesh(x.device_mesh)
    spec, partial = placements_to_spec(x.placements, mesh, x.ndim)
    if partial:
        raise SpecError(f"DTensor holds partial sums over {partial}; reduce it first (x.redistribute or full_tensor)")
    return NamedSharding(mesh, spec)


# ---------------------------------------------------------------------------------------------
# Spec trees: a tree of specs, one spec for all, a callable, or path rules


SpecsLike = Any  # P | tree of P | Callable[[str, Tensor], P] | Sequence[tuple[str, P]] | Mapping[str, P]


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _rule_matches(pattern: str, path: str) -> bool:
    if any(c in pattern for c in "*?[") and not pattern.startswith("re:"):
        return fnmatch.fnmatchcase(path, pattern)
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], path) is not None
    return pattern == path


def resolve_specs(tree: Any, specs: SpecsLike, *, strict_rules: bool = False) -> Any:
    """A tree of ``P`` shaped like ``tree`` from any of the accepted spec forms.

    ``specs`` may be a single ``P`` (every tensor leaf), a tree of ``P`` matching ``tree``, a
    callable ``(path, leaf) -> P``, or a list of ``(pattern, P)`` rules on dotted paths (glob such
    as ``layers.*.attn.wq`` or ``re:<regex>``; the first match wins; unmatched leaves are
    replicated unless ``strict_rules``).
    """
    if isinstance(specs, P) or specs is None:
        spec = as_spec(specs)
        return _tree.map_with_path(lambda p, x: spec, tree)
    if callable(specs) and not isinstance(specs, Mapping):
        return _tree.map_with_path(lambda p, x: as_spec(specs(p, x)), tree)
    if isinstance(specs, (list, tuple)) and specs and all(
        isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) for r in specs
    ) and not isinstance(specs, P):
        rules = [(pat, as_spec(sp)) for pat, sp in specs]

        def pick(path: str, x: Any) -> P:
            for pat, sp in rules:
                if _rule_matches(pat, path):
                    return sp
            if strict_rules:
                raise SpecError(f"no sharding rule matches path {path!r}; rules: {[r[0] for r in rules]}")
            return P()

        return _tree.map_with_path(pick, tree)
    # a tree of specs: must match the structure of `tree` (spec leaves are P or None)
    spec_paths = dict(_tree.leaves_with_paths(specs, is_leaf=_is_spec_leaf))
    out = {}

    def pick_tree(path: str, x: Any) -> P:
        if path not in spec_paths:
            raise SpecError(f"no spec for path {path!r}: the spec tree does not match the value tree")
        out[path] = True
        return as_spec(spec_paths[path])

    res = _tree.map_with_path(pick_tree, tree)
    # a None spec where the value tree has no leaf (None: e.g. a pipeline rank's other stages) is no spec
    extra = sorted(p for p in set(spec_paths) - set(out) if spec_paths[p] is not None)
    if extra:
        raise SpecError(f"spec tree names paths that the value tree does not have: {extra[:5]}")
    return res


# ---------------------------------------------------------------------------------------------
# shard / reshard / typeof


def _shard_leaf(path: str, x: Any, spec: P, mesh: Mesh) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    placements = spec_to_placements(spec, mesh, x.ndim, where=path)
    if isinstance(x, DTensor):
        return _reshard_leaf(path, x, spec, mesh)
    starts, sizes = local_block(tuple(x.shape), mesh, spec, mesh.coordinate())
    local = x
    for d, (s, n) in enumerate(zip(starts, sizes)):
        if n != x.shape[d]:
            local = local.narrow(d, s, n)
    return DTensor.from_local(
        local.clone(memory_format=torch.contiguous_format) if local is not x else local,  # own storage only
        mesh.device_mesh,
        placements,
        run_check=False,
        shape=x.shape,
        stride=_contiguous_stride(x.shape),
    )


def shard(tree: Any, mesh: Mesh, specs: SpecsLike = None) -> Any:
    """Turn full tensors (identical on every rank) into DTensors split by ``specs``; no communication.

    DTensor leaves are resharded; non-tensor leaves pass through. Errors name the offending path.
    """
    spec_tree = resolve_specs(tree, specs)
    spec_by_path = dict(_tree.leaves_with_paths(spec_tree, is_leaf=_is_spec_leaf))
    return _tree.map_with_path(lambda p, x: _shard_leaf(p, x, spec_by_path[p], mesh), tree)


def _uneven_over_several_axes(x: DTensor, spec: P, mesh: Mesh) -> bool:
    """Whether the source or target layout splits a dimension over several axes unevenly."""
    src, _ = placements_to_spec(x.placements, mesh, x.ndim)
    for sp in (src, spec):
        for d in range(x.ndim):
            axes = sp.dim_axes(d)
            if len(axes) > 1 and x.shape[d] % math.prod(mesh.axis_size(a) for a in axes):
                return True
    return False


def _reshard_leaf(path: str, x: Any, spec: P, mesh: Mesh | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        if mesh is None:
            raise SpecError(f"reshard of the plain tensor at {path!r} needs mesh=")
        return _shard_leaf(path, x, spec, mesh)
    src_mesh = Mesh.from_device_mesh(x.device_mesh)
    target = mesh or src_mesh
    placements = spec_to_placements(spec, target, x.ndim, where=path)
    if target == src_mesh and not _uneven_over_several_axes(x, spec, target):
        return x.redistribute(src_mesh.device_mesh, placements)
    if target == src_mesh:
        # DTensor's redistribute of a dimension split unevenly over two or more axes can move the wrong
        # elements (seen: P('x') -> P(('x', 'z')) of a (2,) tensor on {x: 2, y: 2, z: 2}); gather, then cut
        return _shard_leaf(path, x.full_tensor(), spec, target)
    if sorted(target.ranks.flatten().tolist()) != sorted(src_mesh.ranks.flatten().tolist()):
        raise SpecError(f"reshard of {path!r} from {src_mesh!r} to {target!r}: the meshes cover different ranks")
    # Across meshes over the same ranks: gather the global value, then take the target block.
    return _shard_leaf(path, x.full_tensor(), spec, target)


def reshard(tree: Any, specs: SpecsLike, *, mesh: Mesh | None = None) -> Any:
    """Move DTensors to new specs (and optionally to another mesh over the same ranks).

    The global value never changes; only which rank holds which block.
    """
    spec_tree = resolve_specs(tree, specs)
    spec_by_path = dict(_tree.leaves_with_paths(spec_tree, is_leaf=_is_spec_leaf))
    return _tree.map_with_path(lambda p, x: _reshard_leaf(p, x, spec_by_path[p], mesh), tree)


_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}


def typeof(x: Any) -> str:
    """A short type string: dtype, global shape, and the mesh axes splitting each dimension.

    >>> typeof(torch.zeros(8, 4))
    'f32[8,4]'

    A DTensor split over ``dp`` on dim 0 prints ``f32[8@dp,4]``; over two axes ``f32[8@(dp,tp),4]``;
    partial sums add ``{partial:dp}``. Trees print as a tree of strings.
    """
    if isinstance(x, torch.Tensor):
        dt = _DTYPE_SHORT.get(x.dtype, str(x.dtype).replace("torch.", ""))
        if isinstance(x, DTensor):
            mesh = Mesh.from_device_mesh(x.device_mesh)
            spec, partial = placements_to_spec(x.placements, mesh, x.ndim)
            dims = []
            for d, s in enumerate(x.shape):
                axes = spec.dim_axes(d)
                if not axes:
                    dims.append(str(s))
                elif len(axes) == 1:
                    dims.append(f"{s}@{axes[0]}")
                else:
                    dims.append(f"{s}@({','.join(axes)})")
            out = f"{dt}[{','.join(dims)}]"
            if partial:
                out += "{partial:" + ",".join(partial) + "}"
            return out
        return f"{dt}[{','.join(str(s) for s in x.shape)}]"
    if isinstance(x, (dict, list, tuple)) and not isinstance(x, P):
        return _tree.tree_map(typeof, x, is_leaf=lambda v: isinstance(v, torch.Tensor))
    return type(x).__name__


# ---------------------------------------------------------------------------------------------
# Logical axes


def logical_to_spec(logical_axes: Sequence[str | None], rules: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> P:
    """Resolve logical dimension names to a spec with ``rules`` such as ``{"embed": "fsdp", "mlp": "tp"}``.

    Logical names without a rule are replicated. A mesh axis that two dimensions would both use is
    an error naming both logical axes.

    >>> logical_to_spec(("embed", "mlp"), {"embed": "fsdp", "mlp": "tp"})
    P('fsdp', 'tp')
    """
    table = dict(rules)
    parts: list[Any] = []
    used: dict[str, str] = {}
    for name in logical_axes:
        target = table.get(name) if name is not None else None
        axes = normalize_axes(target)
        for a in axes:
            if a in used:
                raise SpecError(
                    f"logical axes {used[a]!r} and {name!r} both map to mesh axis {a!r} in {tuple(logical_axes)}"
                )
            used[a] = name  # type: ignore[assignment]
        parts.append(axes if axes else None)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)
