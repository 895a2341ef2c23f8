"""The parameter view of a parallelized step: parameter blocks that know which parameter they are, and
the lazy tree a differentiated function reads them through.

Inside a step every parameter is this rank's block: a plain tensor (an alias of the block, no copy)
that the step handed out in a :class:`Blocks` list. Whatever an op makes from it is a new tensor, so a
tensor is a parameter of the step exactly when it *is* one of those blocks (identity, asked of the
list: nothing is attached to the tensor). That is how the step recognises the parameters a function
differentiates, whatever tree operations (``split_params``, ``merge_params``) built the argument.
Reading through the view also accepts an exact alias of a block (same storage, offset, shape, strides
and dtype: the same values), because autograd hands a saved input back as a new tensor object when
saved-tensor hooks are installed: a ``remat`` region whose argument is the view replays its forward
from such aliases (:meth:`Blocks.param_of`). (A
plain tensor, not a subclass: a subclass would cost every op it enters about a microsecond of
dispatch, and keep the optimizers off their fused ``foreach`` path.)

The function being differentiated receives the parameters as a :func:`lazy` view: indexing it returns
the leaf *as used* (``read(block)``: gathered over FSDP axes, cast under mixed precision), at the
moment it is read, i.e. per layer and in the order the model uses them. The view is a pytree node in
hpfunc's namespace (:data:`hpfunc.tree.NAMESPACE`) whose children are the blocks, so structural tree
operations through :mod:`hpfunc.tree` keep it lazy.

    >>> import torch
    >>> blocks = Blocks([torch.zeros(1), torch.ones(2, 2)])
    >>> w = blocks[1]
    >>> blocks.index_of(w), blocks.index_of(w + 1), Blocks([torch.ones(2, 2)]).index_of(w)
    (1, None, None)
    >>> blocks.index_of(w.detach()), blocks.param_of(w.detach()), blocks.param_of(w[:1]), blocks.param_of(w.t())
    (None, 1, None, None)
    >>> v = lazy({"layer": {"w": w}}, lambda b: b * 10)
    >>> float(v["layer"]["w"][0, 0]), "w" in v["layer"]
    (10.0, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch

from hpfunc import tree as _tree

__all__ = ["Blocks", "lazy", "materialize"]


class Blocks(Sequence):
    """Aliases of parameter blocks (``x.detach()``: the same storage, tensors of their own, requiring
    grad where ``requires_grad``) that know their index by identity: ``blocks.index_of(x)``."""

    __slots__ = ("_tensors", "_at", "_by_storage")

    def __init__(self, tensors: Sequence[torch.Tensor], *, requires_grad: Sequence[bool] | bool = False):
        flags = [requires_grad] * len(tensors) if isinstance(requires_grad, bool) else list(requires_grad)
        self._tensors = [x.detach().requires_grad_(True) if g else x.detach() for x, g in zip(tensors, flags)]
        # an identity map of this list's own tensors (it keeps them alive, so no id is reused meanwhile)
        self._at = {id(t): i for i, t in enumerate(self._tensors)}
        self._by_storage: dict[tuple, int] | None = None  # made on the first alias asked about

    def param_of(self, x: Any) -> int | None:
        """The index of the block ``x`` is or exactly aliases (same storage, offset, shape, strides, dtype),
        else ``None``. An exact alias has the block's values: autograd hands a saved input back as such a
        tensor (a new object) when saved-tensor hooks are installed, e.g. to a ``remat`` recompute."""
        i = self.index_of(x)
        if i is not None or not isinstance(x, torch.Tensor):
            return i
        if self._by_storage is None:  # the blocks are alive while this list is: no storage address is reused
            self._by_storage = {_alias_key(t): i for i, t in enumerate(self._tensors)}
        i = self._by_storage.get(_alias_key(x))
        if i is None:
            return None
        t = self._tensors[i]
        return i if x.dtype == t.dtype and x.shape == t.shape and x.stride() == t.stride() else None

    def index_of(self, x: Any) -> int | None:
        """The index of ``x`` if it is one of these very tensors, else ``None``."""
        i = self._at.get(id(x))
        return i if i is not None and self._tensors[i] is x else None

    def __getitem__(self, i: Any) -> Any:
        return self._tensors[i]

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self):
        return iter(self._tensors)

    def __repr__(self) -> str:
        return f"Blocks({len(self._tensors)})"


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset())


class _LazyDict(Mapping):
    """A read-only mapping of parameters that hands out each leaf as used when it is read."""

    __slots__ = ("_d", "_read")

    def __init__(self, d: Mapping, read: Callable):
        self._d, self._read = d, read

    def __getitem__(self, k: Any) -> Any:
        return _view(self._d[k], self._read)

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, k: Any) -> bool:  # without reading
        return k in self._d

    def __repr__(self) -> str:
        return f"LazyParams({list(self._d)})"


class _LazyList(Sequence):
    __slots__ = ("_l", "_read")

    def __init__(self, seq: Sequence, read: Callable):
        self._l, self._read = seq, read

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [_view(v, self._read) for v in self._l[i]]
        return _view(self._l[i], self._read)

    def __len__(self) -> int:
        return len(self._l)

    def __repr__(self) -> str:
        return f"LazyParams[{len(self._l)}]"


def _view(v: Any, read: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        return read(v)
    if isinstance(v, (_LazyDict, _LazyList)):
        return v
    if isinstance(v, Mapping):
        return _LazyDict(v, read)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return _LazyList(v, read)
    return v


def lazy(tree: Any, read: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` (dicts and lists of tensors) as a view whose leaves are ``read(leaf)`` when indexed."""
    return _view(tree, read)


def _is_view(x: Any) -> bool:
    return isinstance(x, (_LazyDict, _LazyList))


def materialize(tree: Any) -> Any:
    """Every leaf of ``tree`` read now (a view's leaves as used), in a tree of the same structure made of
    plain containers; leaves that are not tensors (``None``) stay.

    >>> materialize(lazy({"a": [torch.ones(1)], "b": None}, lambda b: b * 2))
    {'a': [tensor([2.])], 'b': None}
    """
    if isinstance(tree, _LazyDict):
        base, read = tree._d, tree._read
    elif isinstance(tree, _LazyList):
        base, read = tree._l, tree._read
    else:
        base, read = tree, None
    # one flatten of the plain tree under the view; a view nested in it (a tree built of several) is read
    # by its own function
    leaves, treedef = _tree.flatten(base, is_leaf=_is_view)
    return _tree.unflatten(treedef, [materialize(x) if _is_view(x) else
                                     read(x) if read is not None and isinstance(x, torch.Tensor) else x
                                     for x in leaves])


_tree.register_node(
    _LazyDict, lambda x: (list(x._d.values()), (tuple(x._d), x._read), tuple(x._d)),
    lambda meta, children: _LazyDict(dict(zip(meta[0], children)), meta[1]))
_tree.register_node(
    _LazyList, lambda x: (list(x._l), x._read, None),
    lambda read, children: _LazyList(list(children), read))
