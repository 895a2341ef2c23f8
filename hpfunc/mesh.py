"""``Mesh``: named axes over ``torch.distributed.DeviceMesh``, and the current-mesh context.

A mesh lays the ranks of the process group out on named axes. Collectives in :mod:`hpfunc.lax`
name the axes they run over; specs (:class:`hpfunc.P`) name the axes a dimension is split over.

Example (inside a 4-rank program, e.g. ``hpfunc launch --nproc 4 script.py`` or
``hpfunc.launch.spmd(fn, 4)``)::

    mesh = hpfunc.Mesh({"dp": 2, "tp": 2})       # or hpfunc.make_mesh((2, 2), ("dp", "tp"))
    mesh.shape                                    # {'dp': 2, 'tp': 2}
    mesh.axis_index("tp")                         # this rank's coordinate on 'tp'
    with mesh:                                    # the current mesh, for code that needs one
        ...
    mesh.submesh("tp")                            # the 1-D mesh of this rank's 'tp' row
"""

from __future__ import annotations

import contextvars
import datetime
import itertools
import math
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpfunc import faults as _faults

__all__ = ["Mesh", "make_mesh", "current_mesh", "AxisName", "normalize_axes", "init_distributed",
           "forget_process_group"]

AxisName = str | tuple[str, ...]

_CURRENT: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar("hpfunc_current_mesh", default=None)

# DeviceMeshes are cached per process group and layout: building one creates process groups, and
# tests and notebooks build the same mesh many times. The cache never changes what a Mesh means.
# Keys start with id(default group): forget_process_group drops a group's entries before it is
# destroyed, so that a later group Python gives the same id never finds them.
_DEVICE_MESH_CACHE: dict[tuple, DeviceMesh] = {}
_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}


def default_device_type() -> str:
    """``"cuda"`` when the default process group uses NCCL, else ``"cpu"``."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> None:
    """Initialise the default process group from the torchrun environment if not yet initialised.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (as set by ``torchrun`` or
    ``hpfunc launch``). Without them, starts a one-rank group so single-process programs and
    notebooks can build a mesh of size 1.

    ``timeout_s`` is how long a collective waits for its peers before it fails (then
    :mod:`hpfunc.lax` raises :class:`hpfunc.faults.CollectiveError` naming the rank and the
    collective); by default the one an hpfunc launcher set (``hpfunc launch --timeout``,
    ``parallel.timeout_s``), else 300 s (:data:`hpfunc.faults.DEFAULT_TIMEOUT_S`; torch's own
    default for gloo is 30 minutes). A :class:`Mesh` gives its axis groups the same timeout.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("HPFUNC_BACKEND") != "gloo" else "gloo"
        if os.environ.get("HPFUNC_BACKEND"):
            backend = os.environ["HPFUNC_BACKEND"]
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # each rank on its own GPU
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        seconds = _faults.timeout_from_env() if timeout_s is None else _faults.check_timeout(timeout_s, "timeout_s")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
        return
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def forget_process_group() -> None:
    """Drop the DeviceMeshes and axis groups cached for the current default process group; call it
    before destroying that group. A later default group may get the same ``id`` (the cache's key), and
    must not find meshes whose groups are gone: the single-card simulation
    (:mod:`hpfunc.autoparallel.simulate`) makes and destroys one default group per simulated rank.

    >>> forget_process_group()  # no default group: nothing is cached for it
    """
    world_id = id(dist.group.WORLD)
    for cache in (_DEVICE_MESH_CACHE, _GROUP_CACHE):
        for key in [k for k in list(cache) if k[0] == world_id]:
            cache.pop(key, None)


def _same_timeout_as_world(group: dist.ProcessGroup) -> None:
    """Give ``group`` the collective timeout of the default group: torch creates a DeviceMesh's axis
    groups with its own default (30 minutes for gloo), not the one the default group started with."""
    world = dist.group.WORLD
    if group is world or world is None:
        return
    try:
        dev = torch.device("cuda" if dist.get_backend(world) == "nccl" else "cpu")
        timeout = world._get_backend(dev).options._timeout
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    except (AttributeError, RuntimeError, ValueError):  # a backend without options: it keeps its own
        pass


class Mesh:
    """A named mesh of ranks.

    Args:
        axes: ordered mapping ``{axis_name: size}``; the product must equal the world size.
        device_type: ``"cpu"`` or ``"cuda"``; defaults to the process group's backend.

    Raises:
        ValueError: when names repeat, a size is < 1, or the product differs from the world size.
    """

    def __init__(self, axes: Mapping[str, int] | None = None, *, device_type: str | None = None,
                 device_mesh: DeviceMesh | None = None):
        if device_mesh is None:
            if axes is None:
                raise ValueError("Mesh needs axes, e.g. Mesh({'dp': 2, 'tp': 2})")
            names = tuple(axes.keys())
            sizes = tuple(int(s) for s in axes.values())
            _check_names(names)
            for n, s in zip(names, sizes):
                if s < 1:
                    raise ValueError(f"mesh axis {n!r} has size {s}; sizes must be >= 1")
            total = 1
            for s in sizes:
                total *= s
            if not dist.is_initialized() and (total == 1 or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)):
                init_distributed()  # from the torchrun environment, or a one-rank group
            if not dist.is_initialized():
                raise ValueError(
                    f"Mesh({dict(axes)}) needs {total} ranks but no process group is running; start the "
                    f"program with `hpfunc launch --nproc {total} script.py` or hpfunc.launch.spmd(fn, {total})"
                )
            world = dist.get_world_size()
            if total != world:
                raise ValueError(
                    f"Mesh({dict(axes)}) has {total} ranks but the world size is {world}; "
                    f"the product of the axis sizes must equal the number of ranks"
                )
            dtype = device_type or default_device_type()
            key = (id(dist.group.WORLD), dtype, names, sizes)
            device_mesh = _DEVICE_MESH_CACHE.get(key)
            if device_mesh is None:
                device_mesh = init_device_mesh(dtype, sizes, mesh_dim_names=names)
                for n in names:
                    _same_timeout_as_world(device_mesh.get_group(n))
                _DEVICE_MESH_CACHE[key] = device_mesh
        if device_mesh.mesh_dim_names is None:
            raise ValueError("Mesh needs a DeviceMesh with mesh_dim_names")
        self._dm = device_mesh
        self._names: tuple[str, ...] = tuple(device_mesh.mesh_dim_names)
        self._sizes: tuple[int, ...] = tuple(int(s) for s in device_mesh.mesh.shape)
        self._token: list[contextvars.Token] = []
        # Facts derived from this mesh alone that hot paths ask for on every call (a collective's
        # group and rank maps, a spec's DTensor placements): computed once, never changed.
        self._memo: dict = {}

    # -- construction helpers -------------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> "Mesh":
        """Wrap an existing named ``DeviceMesh``."""
        return cls(device_mesh=device_mesh)

    # -- properties -----------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        """The underlying ``torch.distributed.DeviceMesh``."""
        return self._dm

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` in mesh order."""
        return dict(zip(self._names, self._sizes))

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        n = 1
        for s in self._sizes:
            n *= s
        return n

    @property
    def ranks(self) -> torch.Tensor:
        """The global ranks laid out on the mesh (an int tensor of the mesh's shape)."""
        return self._dm.mesh

    @property
    def device_type(self) -> str:
        return self._dm.device_type

    def axis_size(self, axes: AxisName | Sequence[str] | None) -> int:
        """Size of one axis or the product over a tuple of axes (``None`` or ``()`` gives 1)."""
        n = 1
        for a in normalize_axes(axes):
            n *= self._sizes[self._dim(a)]
        return n

    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on every axis, in mesh order."""
        c = self._dm.get_coordinate()
        if c is None:
            raise ValueError(f"rank {dist.get_rank()} is not part of {self!r}")
        return tuple(int(x) for x in c)

    def axis_index(self, axes: AxisName | Sequence[str]) -> int:
        """This rank's index along an axis, or row-major over a tuple of axes."""
        coord = self.coordinate()
        idx = 0
        for a in normalize_axes(axes):
            d = self._dim(a)
            idx = idx * self._sizes[d] + coord[d]
        return idx

    def submesh(self, *axes: str) -> "Mesh":
        """The mesh over ``axes`` (in the order given) that contains this rank."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        for a in axes:
            self._dim(a)
        if tuple(axes) == self._names:
            return self
        return Mesh(device_mesh=self._dm[tuple(axes)] if len(axes) > 1 else self._dm[axes[0]])

    def group(self, axes: AxisName | Sequence[str]) -> dist.ProcessGroup:
        """The process group of this rank's slice along ``axes`` (given in mesh order)."""
        names = normalize_axes(axes)
        if not names:
            raise ValueError("group() needs at least one axis")
        for a in names:
            self._dim(a)
        if list(names) != sorted(names, key=self._dim):
            raise ValueError(f"axes {names} are not in mesh order {self._names}")
        if len(names) == 1:
            return self._dm.get_group(names[0])
        if len(names) == len(self._names) and self._dm.mesh.numel() == dist.get_world_size():
            return dist.group.WORLD
        # the sizes belong in the key: meshes (2, 4, 1) and (2, 2, 2) over the same ranks and names
        # flatten ('x', 'z') to different groups
        key = (id(dist.group.WORLD), self._names, self._sizes, self._rank_list(), names)
        group = _GROUP_CACHE.get(key)
        if group is None:
            # A group of this rank's slice, NOT DeviceMesh._flatten: once a flattened mesh over these
            # axes exists, DTensor's redistribute gathers a dimension split over them in one all_gather
            # on it, which is wrong when the split is uneven (torch 2.13: a (5,) tensor split over
            # y then z of a 2x2x2 mesh reads back [0, 1, 2, 0, 3]); without one it gathers axis by axis,
            # which is right. Only the slice's ranks take part in creating it.
            ranks = self._slice_ranks(dist.get_rank(), [self._dim(a) for a in names])
            group = dist.new_group(ranks, use_local_synchronization=True)
            _same_timeout_as_world(group)
            _GROUP_CACHE[key] = group
        return group

    def _rank_list(self) -> tuple[int, ...]:
        """The mesh's ranks in row-major order, read with ``tolist`` and Python alone: no tensor op, so
        a fake-tensor mode (a dry run) sees nothing and the answer is the real table."""
        ranks = self._memo.get("ranks")
        if ranks is None:
            flat: list[int] = []
            pending = [self._dm.mesh.tolist()]
            while pending:
                v = pending.pop()
                if isinstance(v, list):
                    pending.extend(reversed(v))
                else:
                    flat.append(int(v))
            ranks = self._memo["ranks"] = tuple(flat)
        return ranks

    def _slice_ranks(self, rank: int, dims: Sequence[int]) -> list[int]:
        """The ranks that share ``rank``'s coordinates on every mesh dimension but ``dims``, in
        row-major order over ``dims``: the members of ``rank``'s group over those axes."""
        table = self._rank_list()
        strides = [math.prod(self._sizes[d + 1:]) for d in range(len(self._sizes))]
        where = table.index(rank)
        coords = [(where // strides[d]) % self._sizes[d] for d in range(len(self._sizes))]
        out = []
        for var in itertools.product(*(range(self._sizes[d]) for d in dims)):
            c = list(coords)
            for d, i in zip(dims, var):
                c[d] = i
            out.append(table[sum(ci * st for ci, st in zip(c, strides))])
        return out

    def _dim(self, axis: str) -> int:
        try:
            return self._names.index(axis)
        except ValueError:
            hint = _did_you_mean(axis, self._names)
            raise ValueError(f"unknown mesh axis {axis!r}; this mesh has axes {self._names}{hint}") from None

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "Mesh":
        self._token.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token.pop())

    # -- identity --------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        return (
            isinstance(other, Mesh)
            and self._names == other._names
            and self._sizes == other._sizes
            and torch.equal(self._dm.mesh, other._dm.mesh)
        )

    def __hash__(self) -> int:
        h = self._memo.get("hash")
        if h is None:  # the rank layout never changes; reading it from the tensor costs ~0.2 ms
            h = self._memo["hash"] = hash((self._names, self._sizes, self._rank_list()))
        return h

    def _cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` computed once per mesh and ``key`` (a fact that depends only on the mesh and the
        key, e.g. a spec's placements); a ``make`` that raises caches nothing."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def __repr__(self) -> str:
        return f"Mesh({self.shape})"


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, device_type: str | None = None) -> Mesh:
    """JAX-style constructor: ``make_mesh((2, 2), ("dp", "tp"))``."""
    if len(axis_shapes) != len(axis_names):
        raise ValueError(f"make_mesh got {len(axis_shapes)} sizes for {len(axis_names)} names {tuple(axis_names)}")
    _check_names(axis_names)
    return Mesh(dict(zip(axis_names, axis_shapes)), device_type=device_type)


def current_mesh(required: bool = False, what: str = "this call") -> Mesh | None:
    """The mesh set by the innermost ``with mesh:`` (or ``shard_map``), or ``None``."""
    m = _CURRENT.get()
    if m is None and required:
        raise ValueError(f"{what} needs a current mesh: call it inside `with mesh:` or hpfunc.shard_map")
    return m


def normalize_axes(axes: AxisName | Iterable[str] | None) -> tuple[str, ...]:
    """``'dp'`` -> ``('dp',)``; ``('dp', 'tp')`` stays; ``None`` -> ``()``."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    out = tuple(axes)
    for a in out:
        if not isinstance(a, str):
            raise TypeError(f"mesh axis names are strings, found {a!r} in {axes!r}")
    return out


def _check_names(names: Sequence[str]) -> None:
    seen = set()
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"mesh axis names must be non-empty strings, found {n!r}")
        if n in seen:
            raise ValueError(f"mesh axis {n!r} appears twice in {tuple(names)}")
        seen.add(n)


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
