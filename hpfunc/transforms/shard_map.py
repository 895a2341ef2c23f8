"""``shard_map``: run a function on local blocks, talking across ranks only through ``hpfunc.lax``.

``shard_map(f, mesh=mesh, in_specs=..., out_specs=...)`` returns a function of *global* arrays
(DTensors, or plain tensors holding the same full value on every rank). Each input is split by its
spec; ``f`` sees this rank's blocks as plain tensors; each output is assembled into a DTensor by its
out_spec. A mesh axis absent from an out_spec is a promise that the output is replicated along it.
The promise is checked, and a broken one raises :class:`ReplicationError` naming the output's path
and the axis (``check_rep=``; the default comes from the environment variable ``HPFUNC_CHECK_REP``):

* ``"checksum"`` (the default): the sum and element count of every replicated output leaf, all of
  them in one all-reduce (max and min over the replicated axes) per call. It catches values that
  differ (a forgotten ``psum``, a per-rank value, a local block), not differences below the sum's
  rounding or a reordering of the same elements.
* ``"exact"`` (or ``True``; ``HPFUNC_CHECK_REP=1``, which the test suite sets): every replicated
  output is gathered over its replicated axes and compared element by element (``check_rtol``).
* ``"trusted"``: outputs replicated by construction (a library's own reductions): no check unless
  ``HPFUNC_CHECK_REP`` is set, then the check it names (the test suite sets exact, so it still verifies
  them). :func:`hpfunc.parallelize` passes it for everything a step returns: the state is replicated by
  construction (reduced gradients, identical updates) and the metrics by the engine's reductions, and a
  per-step collective on the hot path would cost the tiny model's step about 10% (measured: ddp on 2 ranks,
  20.8 ms without, 23.0 ms with the metrics checksum); set ``HPFUNC_CHECK_REP=checksum`` to check a step
  whose own metrics might not be.
* ``False`` (``HPFUNC_CHECK_REP=0``): no check.

``check_rep`` may also be a tree prefix of the outputs, one check per subtree, or a function of the
output returning one (as ``out_specs`` may).

An output that is the very block handed in for an input DTensor of the same spec (the same tensor,
returned unchanged) comes back as that input DTensor itself; every other output is a new DTensor.
Nothing here depends on a tensor's address or on attributes set on tensors (it runs under
``FakeTensorMode``, where every fake tensor has address 0).

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
from typing import Any, Callable, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate

from hpfunc import lax as _lax
from hpfunc.host_to_device import put
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh, current_mesh
from hpfunc.sharding import P, SpecError, _copy_spec, _wrap_local, as_spec, spec_to_placements

__all__ = ["shard_map", "ReplicationError", "Flat", "FlatSpecs"]


class ReplicationError(ValueError):
    """An output promised replicated along an axis differs between the ranks of that axis."""


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


class FlatSpecs:
    """Specs (or replication checks) already paired with a structure: ``leaves[i]`` belongs to leaf ``i``
    of a value whose structure, with ``None`` as a leaf, is ``treedef``. A caller that maps values of the
    same structures call after call (a lowered parallelized step: the state, the metrics) builds it once
    with :func:`flat_specs` and passes it as ``in_specs`` / ``out_specs`` / ``check_rep`` (or returns it
    from the callable form), so that the spec tree is not flattened and broadcast again on every call."""

    __slots__ = ("treedef", "leaves", "laid_out", "_modes", "wraps")

    def __init__(self, treedef: Any, leaves: Sequence[Any], *, laid_out: bool = False,
                 wraps: list | None = None):
        self.treedef, self.leaves = treedef, tuple(leaves)
        self._modes: tuple | None = None  # as checks: (HPFUNC_CHECK_REP, the mode of each leaf) last read
        # as in_specs: the caller vouches that every DTensor leaf of the values is already laid out on the
        # mesh as its spec says (it compared them: a lowered step's Lowered.fits), so that each enters as
        # its local block without the layout being looked up and compared again
        self.laid_out = laid_out
        # as out_specs: per leaf, how an output block of a given shape and dtype leaves (its block shape,
        # dtype, the DTensorSpec each output gets a copy of, whether it is replicated on some axis), or
        # None until the first output of that leaf showed it: facts of the structure, filled once and
        # read by every later call without building a key or looking in the mesh's table
        self.wraps = wraps

    def vouched(self) -> "FlatSpecs":
        """These specs, with the caller's word that the values' DTensors are laid out by them (see above)."""
        return FlatSpecs(self.treedef, self.leaves, laid_out=True)

    def __repr__(self) -> str:
        return f"FlatSpecs({len(self.leaves)} leaves{', laid out' if self.laid_out else ''})"


class Flat:
    """An argument already flattened as ``shard_map`` flattens (``None`` as a leaf), passed in place of the
    tree by a caller that has its leaves at hand (``hpfunc.parallelize``: the state); the function sees
    the tree as usual. ``local``: with in_specs vouched laid out (:meth:`FlatSpecs.vouched`), each leaf's
    local block, which the caller read while comparing the layouts (``None`` where the leaf is not a
    tensor): the function gets these."""

    __slots__ = ("leaves", "treedef", "local")

    def __init__(self, leaves: list, treedef: Any, local: list | None = None):
        self.leaves, self.treedef, self.local = leaves, treedef, local


def flat_specs(specs: Any, values: Any, what: str = "in_specs", mesh: Mesh | None = None) -> FlatSpecs:
    """The :class:`FlatSpecs` of the prefix tree ``specs`` over the structure of ``values`` (checked and
    broadcast as ``shard_map`` does)."""
    _, leaf_specs, treedef, _ = _pair_specs(specs, values, what, mesh)
    return FlatSpecs(treedef, leaf_specs)


def flat_checks(check_rep: Any, values: Any) -> FlatSpecs:
    """The :class:`FlatSpecs` of a tree prefix of replication checks over the structure of ``values``
    (each check validated here, once)."""
    modes = _broadcast_checks(check_rep, values)
    _modes(modes)
    return FlatSpecs(optree.tree_structure(values, none_is_leaf=True, namespace=_tree.NAMESPACE), modes)


def _pair_specs(specs: Any, values: Any, what: str,
                mesh: Mesh | None = None) -> tuple[list[Any], Sequence[P], Any, Callable[[int], str]]:
    """Flatten ``values`` and pair each leaf with its spec from the prefix tree ``specs``.

    Returns the leaves, their specs, the treedef and ``path(i)``, the dotted path of leaf ``i`` (built
    only when asked: only errors need it). A prefix tree is broadcast on every call (a few hundred
    leaves cost milliseconds): a caller mapping one structure call after call passes :class:`FlatSpecs`
    built once instead (a lowered parallelized step does). ``mesh`` is unused (kept for callers).
    """
    if isinstance(values, Flat):
        leaves, treedef = values.leaves, values.treedef
        if not isinstance(specs, FlatSpecs):  # a prefix of specs is broadcast over the tree itself
            values = optree.tree_unflatten(treedef, leaves)
    else:
        leaves, treedef = optree.tree_flatten(values, none_is_leaf=True, namespace=_tree.NAMESPACE)

    def path(i: int) -> str:
        tree = optree.tree_unflatten(treedef, leaves) if isinstance(values, Flat) else values
        return _tree.path_str(optree.tree_paths(tree, none_is_leaf=True, namespace=_tree.NAMESPACE)[i])

    if isinstance(specs, FlatSpecs):
        if specs.treedef != treedef:
            raise SpecError(f"{what}: the specs were built for values of structure {specs.treedef}, found {treedef}")
        return leaves, specs.leaves, treedef, path
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=_is_spec, none_is_leaf=True, namespace=_tree.NAMESPACE)

    def paired() -> tuple[P, ...]:
        found = spec_leaves
        if spec_def != treedef:  # a proper prefix: one spec stands for a whole subtree
            try:
                found = optree.broadcast_prefix(specs, values, is_leaf=_is_spec, none_is_leaf=True,
                                                namespace=_tree.NAMESPACE)
            except (ValueError, TypeError) as e:
                raise SpecError(
                    f"{what} must be a spec P(...) or a tree prefix of the {what.split('_')[0]}puts; got {specs!r}: {e}"
                ) from None
        return tuple(s if isinstance(s, P) else as_spec(s) for s in found)

    if spec_def.num_leaves == 1 and spec_def.num_nodes == 1 and isinstance(spec_leaves[0], P):
        return leaves, (spec_leaves[0],) * len(leaves), treedef, path  # one spec for every leaf
    return leaves, paired(), treedef, path


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


# HPFUNC_CHECK_REP's values (lower-cased) -> the check they select (None: no check)
_ENV_CHECK = {"": "checksum", "checksum": "checksum", "1": "exact", "true": "exact", "yes": "exact", "exact": "exact",
              "0": None, "false": None, "no": None, "off": None}


def _env_check() -> str | None:
    raw = os.environ.get("HPFUNC_CHECK_REP", "")
    try:
        return _ENV_CHECK[raw.strip().lower()]
    except KeyError:
        raise ValueError(
            f"environment variable HPFUNC_CHECK_REP={raw!r}: expected 'checksum' (the default when unset), "
            f"'exact' (or 1/true/yes) or 'off' (or 0/false/no)"
        ) from None


def _is_mode(x: Any) -> bool:
    return x is None or isinstance(x, (bool, str))


def _check_mode(check_rep: bool | str | None) -> str | None:
    """The replication check one ``check_rep`` value selects: ``"checksum"``, ``"exact"`` or ``None`` (off)."""
    if check_rep is None:
        return _env_check()
    if check_rep is False:
        return None
    if check_rep is True or check_rep == "exact":
        return "exact"
    if check_rep == "checksum":
        return "checksum"
    if check_rep == "trusted":  # replicated by construction: verified only when the environment asks for a check
        return _env_check() if os.environ.get("HPFUNC_CHECK_REP", "").strip() else None
    raise ValueError(f"shard_map(check_rep={check_rep!r}): expected None (HPFUNC_CHECK_REP, else 'checksum'), "
                     f"'checksum', 'exact' (or True), 'trusted' or False, or a tree prefix of the outputs of those")


def _broadcast_checks(check_rep: Any, out: Any) -> tuple:
    """The check of every output leaf from a tree prefix of checks."""
    try:
        return tuple(optree.broadcast_prefix(check_rep, out, is_leaf=_is_mode, none_is_leaf=True,
                                             namespace=_tree.NAMESPACE))
    except (ValueError, TypeError) as e:
        raise ValueError(f"shard_map: check_rep must be a check (None, 'checksum', 'exact', 'trusted', True, "
                         f"False) or a tree prefix of the outputs; got {check_rep!r}: {e}") from None


def _modes(checks: Sequence[Any]) -> list[str | None]:
    """:func:`_check_mode` of every leaf's check, read once per distinct check."""
    table: dict = {}
    for m in checks:
        if (type(m), m) not in table:  # (type, value): True == 1 and hash alike, but they are different checks
            table[(type(m), m)] = _check_mode(m)
    return [table[(type(m), m)] for m in checks]


def _leaf_checks(check_rep: Any, out: Any, mesh: Mesh | None = None,
                 treedef: Any = None) -> list[str | None] | str | None:
    """One check for all outputs, or (``check_rep`` a tree prefix of the outputs) one per output leaf;
    ``treedef`` is the outputs' structure (``None`` as a leaf) when the caller has it. With ``mesh``,
    the broadcast of the prefix is computed once per (check tree, output structure); the modes are
    still read per call (``HPFUNC_CHECK_REP`` may change between calls)."""
    if _is_mode(check_rep):
        return _check_mode(check_rep)
    if treedef is None:
        treedef = optree.tree_structure(out, none_is_leaf=True, namespace=_tree.NAMESPACE)
    if isinstance(check_rep, FlatSpecs):
        if check_rep.treedef != treedef:
            raise ValueError(f"shard_map: check_rep was built for outputs of structure {check_rep.treedef}")
        env = os.environ.get("HPFUNC_CHECK_REP")  # the modes follow it: read again when it changed
        if check_rep._modes is None or check_rep._modes[0] != env:
            check_rep._modes = (env, _modes(check_rep.leaves))
        return check_rep._modes[1]
    return _modes(_broadcast_checks(check_rep, out))


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
    elif not x.requires_grad and (x.device.type == mesh.device_type or x.device.type == "cpu"):
        # the same full value on every rank: this rank's block is a slice (no communication); of a host
        # value for a device mesh, sliced on the host and only the block copied (pinned, non_blocking)
        local = x.detach()
        for d, axes, k in splits:
            local = local.narrow(d, mesh.axis_index(axes) * k, k)
        local = local.contiguous() if splits else local
        return local if x.device.type == mesh.device_type else put(local, torch.device(mesh.device_type))
    else:
        dt = DTensor.from_local(x, mesh.device_mesh, [Replicate()] * len(mesh.axis_names), run_check=False)
        dt = dt.redistribute(mesh.device_mesh, list(placements))
    local = dt.to_local()
    if replicated and local.requires_grad:
        local = _lax._call(_SUM_REPLICA_GRADS, local, mesh, replicated)
    return local


def _grid_pair(sizes: tuple[int, ...], axes: tuple[int, ...], differ: Callable[[int, int], bool]):
    """``(d, p, q)``: on a row-major grid of ``sizes`` (a group of ranks), ranks ``p`` and ``q`` whose
    coordinates differ only in dimension ``d`` (one of ``axes``) and that ``differ``; ``None`` if none do."""
    n = 1
    for k in sizes:
        n *= k
    for d in axes:
        stride = 1
        for k in sizes[d + 1:]:
            stride *= k
        for p in range(n):
            if (p // stride) % sizes[d]:
                continue  # p is the first rank of its line along d
            for j in range(1, sizes[d]):
                if differ(p, p + j * stride):
                    return d, p, p + j * stride
    return None


def _global_ranks(mesh: Mesh, group: tuple[str, ...], *members: int) -> list[int]:
    """The global ranks of members of this rank's group over ``group`` (indexed row-major in mesh order)."""
    sizes = [mesh.axis_size(a) for a in group]
    out = []
    for i in members:
        c = list(mesh.coordinate())
        for name, k in reversed(list(zip(group, sizes))):
            c[mesh.axis_names.index(name)] = i % k
            i //= k
        out.append(int(mesh.ranks[tuple(c)]))
    return out


def _mismatch_message(path: str, mesh: Mesh, rep: tuple[str, ...], dim: int | None, gp: int, gq: int, detail: str,
                      how: str) -> str:
    """The error for an output promised replicated along ``rep`` that differs between global ranks ``gp``
    and ``gq``, whose coordinates differ only along mesh dimension ``dim`` (``None``: along several)."""
    where = f"shard_map output {path or '<root>'!r}"
    coords = {int(r): [int(v) for v in (mesh.ranks == r).nonzero()[0]] for r in (gp, gq)}
    if dim is None:
        axes = rep[0] if len(rep) == 1 else rep
        return (f"{where}: out_spec promises replication along mesh axes {axes!r}, but global rank {gq} holds a "
                f"different value than global rank {gp} ({detail}; {how}); reduce it (e.g. hpfunc.lax.psum/pmean) "
                f"or name the axes in the out_spec")
    a = mesh.axis_names[dim]
    cp, cq = coords[gp], coords[gq]
    others = ", ".join(f"{b}={cp[k]}" for k, b in enumerate(mesh.axis_names) if k != dim and mesh.axis_size(b) > 1)
    return (f"{where}: out_spec promises replication along mesh axis {a!r}, but rank {cq[dim]} along {a!r} holds a "
            f"different value than rank {cp[dim]} (global ranks {gq} vs {gp}{', at ' + others if others else ''}: "
            f"{detail}; {how}); reduce it (e.g. hpfunc.lax.psum/pmean over {a!r}) or name {a!r} in the out_spec")


def _check_exact(items: list[tuple[Callable[[], str], torch.Tensor, tuple[str, ...]]], mesh: Mesh,
                 rtol: float) -> None:
    """The exact check: gather each leaf over its replicated axes and compare the blocks; then one
    all-reduce of the findings over the union of the axes, so that every rank of it raises the same
    error or none does (a rank that raised alone would leave the others waiting in a collective)."""
    import torch.distributed as dist

    from hpfunc.lax import _all_reduce, _axes_of, _gather_dim0

    flat_ranks = mesh.ranks.flatten().tolist()  # findings name ranks by their place on the mesh
    world = len(flat_ranks)
    ndim = len(mesh.axis_names)
    top = float((ndim + 1) * world * world)  # findings are scored top - code: the max is the smallest code
    findings = []
    with torch.no_grad():
        for _, y, rep in items:
            allv = _gather_dim0(y.detach(), _axes_of(mesh, rep), (), "check")
            floating = allv.is_floating_point() or allv.is_complex()

            def same(i: int, j: int, allv=allv, floating=floating) -> bool:
                if floating:  # NaN in the same places is the same
                    return torch.allclose(allv[i], allv[j], rtol=rtol, atol=rtol, equal_nan=True)
                return torch.equal(allv[i], allv[j])

            odd = next((i for i in range(1, allv.shape[0]) if not same(i, 0)), None)
            if odd is None:
                findings.append((-1.0, 0.0))
                continue
            pair = _grid_pair(tuple(mesh.axis_size(a) for a in rep), tuple(range(len(rep))),
                              lambda i, j: not same(i, j))
            if pair is None:  # blocks within the tolerance of their neighbours but not of each other
                dim, p, q = ndim, 0, odd
            else:
                d, p, q = pair
                dim = mesh.axis_names.index(rep[d])
            gp, gq = (flat_ranks.index(g) for g in _global_ranks(mesh, rep, p, q))
            diff = (allv[q].to(torch.complex128 if allv.is_complex() else torch.float64)
                    - allv[p].to(torch.complex128 if allv.is_complex() else torch.float64)).abs().max()
            findings.append((top - ((dim * world + gq) * world + gp), float(torch.nan_to_num(diff, nan=float("inf")))))
        union = tuple(a for a in mesh.axis_names if any(a in rep for _, _, rep in items))
        flat = torch.tensor([v for f in findings for v in f], dtype=torch.float64, device=items[0][1].device)
        agreed = _all_reduce(flat, _axes_of(mesh, union), dist.ReduceOp.MAX, (), "check").view(-1, 2).tolist()
    for (path, _, rep), (score, diff) in zip(items, agreed):
        if score < 0:
            continue
        code = int(top - score)
        dim, gq, gp = code // (world * world), flat_ranks[(code // world) % world], flat_ranks[code % world]
        raise ReplicationError(_mismatch_message(path(), mesh, rep, None if dim == ndim else dim, gp, gq,
                                                 f"largest abs difference {diff}", "check_rep='exact'"))


# A NaN sum stands as this number in a checksum (NaN is unequal to itself, and a max over NaNs is
# order-dependent).
_NAN_SUM = 1.0e308


def _checksum_layout(mesh: Mesh, union: tuple[str, ...], reps: tuple[tuple[str, ...], ...], numels: tuple[int, ...],
                     device: torch.device, rtol: bool) -> tuple:
    """Where each leaf's checksum goes in the one all-reduce over ``union`` (built once per structure).

    Leaf ``i``'s entries are its sum (``i``) and its element count (``n + i``). A leaf replicated along
    only some of the union's axes is compared within its own groups: it gets one slot per group (per
    coordinate on the union's other axes), this rank fills its group's slot, the others stay -inf (the
    max's identity). Returns ``(positions or None, buffer length, owner of each position, counts,
    element counts)``: ``positions`` place ``[sums, counts]`` in the buffer (``None``: in order), and
    ``counts`` are the tolerance's element counts per position (only with ``rtol``).
    """
    n = len(reps)
    slots, index = [], []
    for rep in reps:
        rest = tuple(a for a in union if a not in rep)
        slots.append(mesh.axis_size(rest))
        index.append(mesh.axis_index(rest) if rest else 0)
    base, total = [], 0
    for k in slots:
        base.append(total)
        total += k
    owner = [0] * (2 * total)
    for i in range(n):
        for j in range(slots[i]):
            owner[base[i] + j] = owner[total + base[i] + j] = i
    if total == n:  # every leaf is replicated along the whole union: no slots
        pos = None
    else:
        pos = torch.tensor([base[i] + index[i] for i in range(n)] + [total + base[i] + index[i] for i in range(n)],
                           device=device)
    counts = None
    if rtol:
        counts = torch.zeros(2 * total, dtype=torch.float64, device=device)
        for i in range(n):
            counts[base[i]:base[i] + slots[i]] = float(numels[i])
    numel_t = torch.tensor(numels, dtype=torch.float64, device=device)
    return pos, 2 * total, owner, counts, numel_t


def _check_checksums(items: list[tuple[Callable[[], str], torch.Tensor, tuple[str, ...]]], mesh: Mesh,
                     rtol: float) -> None:
    """The cheap check: every replicated leaf's (sum, element count), all leaves in one all-reduce (max
    of ``[v, -v]``: the max and the min over the replicated axes) on the union of their axes."""
    import torch.distributed as dist

    from hpfunc import comm as _comm
    from hpfunc.lax import _all_reduce, _axes_of, _gather_dim0

    reps = tuple(rep for _, _, rep in items)
    union = tuple(a for a in mesh.axis_names if any(a in rep for rep in reps))
    ax = _axes_of(mesh, union)
    with torch.no_grad():
        sums, abs_sums = [], []
        for _, y, _ in items:
            x = y.detach()
            if x.is_complex():
                x = torch.view_as_real(x.resolve_conj())
            # sums in float32 for 16-bit floats, in the leaf's own float type otherwise, float64 for integers
            acc = (torch.float32 if x.element_size() < 4 else None) if x.is_floating_point() else torch.float64
            sums.append(x.sum(dtype=acc))
            if rtol:
                abs_sums.append(x.abs().sum(dtype=acc))
        device = sums[0].device
        numels = tuple(y.numel() for _, y, _ in items)
        pos, length, owner, counts, numel_t = mesh._cached(
            ("shard_map.checksum", union, reps, numels, device, bool(rtol)),
            lambda: _checksum_layout(mesh, union, reps, numels, device, bool(rtol)))
        v = torch.cat([torch.stack(sums).to(torch.float64), numel_t])
        v = torch.nan_to_num(v, nan=_NAN_SUM, posinf=float("inf"), neginf=float("-inf"))
        parts = [v, -v]
        if rtol:
            parts.append(torch.cat([torch.stack(abs_sums).to(torch.float64), torch.zeros_like(numel_t)]))
        if pos is not None:
            parts = [v.new_full((length,), float("-inf")).index_put_((pos,), t) for t in parts]
        out = _all_reduce(torch.cat(parts), ax, dist.ReduceOp.MAX, _comm.active(), "check_rep")
        hi, lo = out[:length], -out[length:2 * length]
        if torch.equal(hi, lo):  # the max is the min everywhere: replicated (one host read of the result)
            return
        bad = hi != lo
        if rtol:
            bad &= ~(hi - lo <= rtol * (counts + out[2 * length:]))
            if not bool(bad.any()):
                return
        # every rank of the union saw the same reduced checksums: all of them are here, for the same leaf
        i = owner[int(bad.nonzero()[0])]
        n = len(items)
        seen = _gather_dim0(torch.stack([v[i], v[n + i]]), ax, (), "check")

    def differ(p: int, q: int) -> bool:
        if not rtol:
            return not torch.equal(seen[p], seen[q])
        bound = rtol * (seen[p, 1] + torch.maximum(seen[p, 0].abs(), seen[q, 0].abs()))  # |sum| <= the abs sum
        return bool(seen[p, 1] != seen[q, 1]) or bool((seen[p, 0] - seen[q, 0]).abs() > bound)

    # the same data on every rank of the union: the same pair, the same message
    pair = _grid_pair(tuple(mesh.axis_size(a) for a in union), tuple(union.index(a) for a in reps[i]), differ)
    if pair is None:  # within the tolerance pairwise along each axis, not overall: name the extremes
        p, q = int(seen[:, 0].argmin()), int(seen[:, 0].argmax())
        dim = None
    else:
        d, p, q = pair
        dim = mesh.axis_names.index(union[d])
    gp, gq = _global_ranks(mesh, union, p, q)
    detail = f"sums {seen[q, 0].item()!r} vs {seen[p, 0].item()!r} of {int(seen[q, 1])} vs {int(seen[p, 1])} elements"
    raise ReplicationError(_mismatch_message(items[i][0](), mesh, reps[i], dim, gp, gq, detail,
                                             "found by check_rep='checksum'; check_rep='exact' compares every element"))


def _out_layout(y: torch.Tensor, spec: P, mesh: Mesh, where: Callable[[], str]) -> tuple:
    """``(placements, replicated axes, global shape)`` of an output block, checked once per mesh, spec and shape."""

    def make() -> tuple:
        path = where()
        spec.check(mesh, y.ndim, where=f"out.{path}" if path else "out")
        placements = tuple(spec_to_placements(spec, mesh, y.ndim, where=path))
        gshape = tuple(int(s) * mesh.axis_size(spec.dim_axes(d)) for d, s in enumerate(y.shape))
        return placements, _replicated_axes(spec, mesh), gshape

    return mesh._cached(("shard_map.out", spec, tuple(y.shape)), make)


def _enter_leaves(leaves: list, leaf_specs: Sequence[P], mesh: Mesh, argname: str, path: Callable[[int], str],
                  entered: dict, laid_out: bool = False, local: list | None = None) -> list:
    """:func:`_enter` of every leaf. A DTensor already laid out as its spec says on this mesh, whose
    layout was checked before for its spec and shape (a parallelized step's state from the second step
    on), is its local tensor at once: the check and the placements are read from the mesh's facts (with
    ``laid_out``, the caller's word for it: not even that). Each such DTensor is noted in ``entered``
    with its spec under the block handed to the function, so that an output that *is* that block (the
    same tensor object) leaves as that DTensor again (:func:`_exit_leaves`). ``local``: the blocks the
    caller already read (:class:`Flat`), used as they are."""
    memo, dm = mesh._memo, mesh.device_mesh
    if laid_out and local is not None:  # the caller read the blocks while comparing the layouts
        for x, s, block in zip(leaves, leaf_specs, local):
            if type(x) is DTensor:
                entered[id(block)] = (x, s, block)
        return local
    out = []
    for j, (x, s) in enumerate(zip(leaves, leaf_specs)):
        if x is None:  # (a pipeline rank's state holds None for other stages' leaves)
            out.append(x)
            continue
        if type(x) is DTensor and not x.requires_grad:
            if not laid_out:
                lay = memo.get(("shard_map.in", s, x.shape))
                xs = x._spec
                if lay is None or xs.mesh is not dm or xs.placements != lay[0]:
                    out.append(_enter(functools.partial(path, j), x, s, mesh, argname))
                    continue
            block = x._local_tensor.detach()  # a fresh alias, as to_local gives
            # an identity map of this call (it holds the blocks, so no id is reused meanwhile); not a cache
            entered[id(block)] = (x, s, block)
            out.append(block)
            continue
        out.append(_enter(functools.partial(path, j), x, s, mesh, argname))
    return out


def _on_device(y: torch.Tensor, device_type: str) -> bool:
    """Whether ``y`` lives on a device of ``device_type`` (for CPU without building a ``torch.device``)."""
    return y.is_cpu if device_type == "cpu" else y.device.type == device_type


def _exit_leaves(leaves: list, leaf_specs: Sequence[P], mesh: Mesh, checks: Any, to_check: list,
                 path: Callable[[int], str], entered: dict | None = None, wraps: list | None = None) -> list:
    """:func:`_exit` of every leaf. A plain tensor that needs no gradient is, when it is the very block
    handed in for an input DTensor of the same spec (``entered``: a state leaf the step returned
    unchanged), that DTensor again; else, of a spec, shape and dtype seen before and with no
    replication check due, it is wrapped at once with a copy of the DTensor spec cached then (with
    ``wraps``, :attr:`FlatSpecs.wraps`, the one of its position)."""
    memo, device_type = mesh._memo, mesh.device_type
    out = []
    for j, (y, s) in enumerate(zip(leaves, leaf_specs)):
        if y is None:
            out.append(y)
            continue
        check = checks[j] if isinstance(checks, list) else checks
        o = None
        if type(y) is torch.Tensor and not y.requires_grad:
            hit = entered.get(id(y)) if entered else None
            if hit is not None and hit[2] is y and (hit[1] is s or hit[1] == s):
                if check is not None:  # the promise of replication is checked all the same
                    _, replicated, _ = _out_layout(y, s, mesh, lambda: path(j))
                    if replicated:
                        to_check.append((check, functools.partial(path, j), y, replicated))
                o = hit[0]
            w = None if wraps is None or o is not None else wraps[j]
            if w is not None and (check is None or not w[3]) and y.shape == w[0] and y.dtype == w[1] \
                    and _on_device(y, device_type):
                o = DTensor.__new__(DTensor, y, _copy_spec(w[2]), requires_grad=False)
            if o is None:
                key = ("shard_map.out wrap", s, y.shape, y.dtype)
                hit = memo.get(key)
                if hit is not None and (check is None or not hit[1]) and _on_device(y, device_type):
                    o = DTensor.__new__(DTensor, y, _copy_spec(hit[0]), requires_grad=False)
                else:
                    o = _exit(functools.partial(path, j), y, s, mesh, check, to_check)
                    if hit is None and type(o) is DTensor and o._local_tensor is y:
                        _, replicated, _ = _out_layout(y, s, mesh, lambda: path(j))  # cached by _exit just now
                        hit = memo[key] = (_copy_spec(o._spec), replicated)
                if wraps is not None and hit is not None and wraps[j] is None:
                    wraps[j] = (y.shape, y.dtype, hit[0], hit[1])
        else:
            o = _exit(functools.partial(path, j), y, s, mesh, check, to_check)
        out.append(o)
    return out


def _exit(path: Callable[[], str], y: Any, spec: P, mesh: Mesh, check: str | None, to_check: list) -> Any:
    if not isinstance(y, torch.Tensor):
        return y
    if isinstance(y, DTensor):
        raise SpecError(f"shard_map function returned a DTensor at {path() or '<root>'!r}; return local tensors")
    placements, replicated, gshape = _out_layout(y, spec, mesh, path)
    if check is not None and replicated:  # checked together after the last output
        to_check.append((check, path, y, replicated))
    if replicated and y.requires_grad:
        y = _lax._call(_SPLIT_REPLICA_COTANGENT, y, mesh.axis_size(replicated))
    return _wrap_local(y, mesh, placements, gshape)


def shard_map(
    f: Callable | None = None,
    *,
    mesh: Mesh | None = None,
    in_specs: Any,
    out_specs: Any,
    check_rep: bool | str | None = None,
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
        check_rep: how to verify the replication out_specs promise: ``"checksum"`` (one small
            all-reduce per call), ``"exact"`` (or ``True``: gather and compare), ``False`` (no check),
            ``"trusted"`` (replicated by construction: checked only when ``HPFUNC_CHECK_REP`` asks for
            exact checks); default ``None``: the environment variable ``HPFUNC_CHECK_REP``
            (``checksum``, ``exact``/``1`` or ``off``/``0``), ``"checksum"`` when unset. Like out_specs,
            also a tree prefix of the outputs (one check per subtree) or a function of the output
            returning one. See the module docstring.
        check_rtol: tolerance of that check (0 = bitwise equal blocks, or equal sums).
    """
    if check_rep is not None and not callable(check_rep) and not isinstance(check_rep, FlatSpecs):  # fails here, not at the first call
        for m in optree.tree_leaves(check_rep, is_leaf=_is_mode, none_is_leaf=True, namespace=_tree.NAMESPACE):
            _check_mode(m)
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
        entered: dict = {}  # id of a block handed in -> (its input DTensor, its spec, the block), this call only
        for i, (spec_i, arg) in enumerate(zip(specs, args)):
            leaves, leaf_specs, treedef, path = _pair_specs(spec_i, arg, "in_specs", m)
            laid_out = isinstance(spec_i, FlatSpecs) and spec_i.laid_out
            local = arg.local if isinstance(arg, Flat) else None
            local_args.append(optree.tree_unflatten(treedef, _enter_leaves(leaves, leaf_specs, m, f"args[{i}]", path,
                                                                           entered, laid_out, local)))
        with m:
            out = f(*local_args)
        specs_out = out_specs(out) if callable(out_specs) else out_specs
        leaves, leaf_specs, treedef, path = _pair_specs(specs_out, out, "out_specs", m)
        checks = _leaf_checks(check_rep(out) if callable(check_rep) else check_rep, out, m, treedef)
        to_check: list = []
        wraps = specs_out.wraps if isinstance(specs_out, FlatSpecs) else None
        new = _exit_leaves(leaves, leaf_specs, m, checks, to_check, path, entered, wraps)
        del entered
        if to_check:
            for mode, run in (("exact", _check_exact), ("checksum", _check_checksums)):
                items = [item[1:] for item in to_check if item[0] == mode]
                if items:
                    run(items, m, check_rtol)
        return optree.tree_unflatten(treedef, new)

    return mapped
