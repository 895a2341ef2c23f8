"""Abstract states: what a loaded state should look like (shapes, dtypes, shardings), without its values.

:func:`hpfunc.checkpoint.load` restores into an abstract target, as orbax restores into an abstract
pytree and JAX describes arrays by ``jax.ShapeDtypeStruct``: each tensor leaf is an :class:`Abstract`
(global shape, dtype, and a :class:`~hpfunc.sharding.NamedSharding` or ``None`` for a plain tensor);
any other leaf (an int, a config string) is a placeholder for the saved value. Loading allocates only
this rank's block of each leaf (:func:`empty`), so no rank ever holds the full model.

>>> import torch
>>> a = abstract({"w": torch.zeros(4, 2), "step": 3})
>>> a["w"]
Abstract(shape=(4, 2), dtype=torch.float32, sharding=None)
>>> empty(a["w"]).shape
torch.Size([4, 2])
>>> abstract_like(None, None, {"w": torch.Size([8, 2])})["w"].shape
(8, 2)
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.sharding import NamedSharding, P, from_local, local_block, resolve_specs, sharding_of

__all__ = ["Abstract", "abstract", "abstract_like", "empty", "is_abstract_leaf"]


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value)


@attrs.frozen
class Abstract:
    """A tensor's global ``shape``, ``dtype`` and ``sharding`` (``None``: a plain, unsharded tensor)."""

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype
    sharding: NamedSharding | None = None

    @property
    def spec(self) -> P | None:
        return None if self.sharding is None else self.sharding.spec

    def describe(self) -> str:
        """``f32[8,4]`` and, when sharded, ``@ P('fsdp') on {'fsdp': 4}``."""
        name = str(self.dtype).removeprefix("torch.")
        where = "" if self.sharding is None else f" @ {self.sharding.spec!r} on {self.sharding.mesh.shape}"
        return f"{name}{list(self.shape)}{where}"


def is_abstract_leaf(x: Any) -> bool:
    """Leaves of a target tree: :class:`Abstract`, tensors, and ``torch.Size`` (a shape, not a tuple of ints)."""
    return isinstance(x, (Abstract, torch.Tensor, torch.Size))


def _of(x: Any) -> Any:
    if isinstance(x, DTensor):
        return Abstract(tuple(x.shape), x.dtype, sharding_of(x))
    if isinstance(x, torch.Tensor):
        return Abstract(tuple(x.shape), x.dtype, None)
    return x


def abstract(state: Any) -> Any:
    """The abstract twin of a real (or meta-device) state: each tensor becomes an :class:`Abstract` with
    its shape, dtype and sharding; other leaves stay as they are.

    >>> import torch
    >>> abstract([torch.ones(2, dtype=torch.bfloat16)])
    [Abstract(shape=(2,), dtype=torch.bfloat16, sharding=None)]
    """
    return _tree.tree_map(_of, state, is_leaf=is_abstract_leaf)


def abstract_like(specs: Any, mesh: Mesh | None, shapes: Any, *, dtype: torch.dtype = torch.float32) -> Any:
    """An abstract state laid out by ``specs`` on ``mesh``: the target for loading into another layout.

    Args:
        specs: anything :func:`hpfunc.sharding.resolve_specs` accepts for ``shapes`` (a tree of ``P``,
            one ``P``, path rules), e.g. ``train_step.state_specs(meta_state)``; ``None`` with ``mesh``
            ``None`` gives plain tensors (one process).
        mesh: the mesh to load onto.
        shapes: a tree whose tensor leaves are ``torch.Size``, :class:`Abstract` or tensors (meta-device
            tensors are free: ``init_fn`` applied to meta parameters gives a whole train state's shapes).
        dtype: the dtype of ``torch.Size`` leaves.

    >>> import torch
    >>> abstract_like(None, None, {"mu": torch.empty(3, device="meta", dtype=torch.bfloat16)})
    {'mu': Abstract(shape=(3,), dtype=torch.bfloat16, sharding=None)}
    """
    def to_abstract(x: Any) -> Any:
        if isinstance(x, torch.Size):
            return Abstract(tuple(x), dtype, None)
        if isinstance(x, torch.Tensor):
            return Abstract(tuple(x.shape), x.dtype, None)
        return x

    base = _tree.tree_map(to_abstract, shapes, is_leaf=is_abstract_leaf)
    if mesh is None:
        if specs is not None:
            raise TypeError("abstract_like: specs were given without a mesh; pass the mesh to load onto")
        return base
    # resolve_specs sees tensors; give it meta tensors of the right rank in place of Abstract leaves
    proxy = _tree.tree_map(lambda a: torch.empty(a.shape, device="meta") if isinstance(a, Abstract) else a,
                           base, is_leaf=is_abstract_leaf)
    spec_tree = resolve_specs(proxy, specs)
    spec_by_path = dict(_tree.leaves_with_paths(spec_tree, is_leaf=lambda s: s is None or isinstance(s, P)))

    def place(path: str, a: Any) -> Any:
        if not isinstance(a, Abstract):
            return a
        spec = spec_by_path[path]
        spec.check(mesh, len(a.shape), where=path)
        return attrs.evolve(a, sharding=NamedSharding(mesh, spec))

    return _tree.map_with_path(place, base, is_leaf=is_abstract_leaf)


def empty(a: Abstract) -> torch.Tensor:
    """An uninitialised tensor of ``a``'s layout: this rank's block only (a DTensor) when it is sharded."""
    if a.sharding is None:
        return torch.empty(a.shape, dtype=a.dtype)
    mesh = a.sharding.mesh
    _, sizes = local_block(a.shape, mesh, a.sharding.spec, mesh.coordinate())
    return from_local(torch.empty(sizes, dtype=a.dtype, device=mesh.device_type), a.sharding, global_shape=a.shape)
