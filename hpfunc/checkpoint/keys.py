"""The DCP keys of a state's leaves: dotted paths that name every field, NamedTuple fields by name.

``hpfunc.tree`` paths number a NamedTuple's fields (``0.layers.0.attn.wq`` for ``TrainState.params``);
a checkpoint's keys are what a reader without hpfunc sees (plain ``torch.distributed.checkpoint``), so
they name them: ``params.layers.0.attn.wq``, ``opt_state.mu.embed``. Lists, tuples and dicts keep their
indices and keys. Checkpoints written before keys were names (positional) still load: :func:`key_paths`
gives both and :mod:`hpfunc.checkpoint.dcp_io` picks the ones the checkpoint holds.

>>> from typing import NamedTuple
>>> import torch
>>> class State(NamedTuple):
...     params: dict
...     step: int
>>> key_paths(State({"w": torch.ones(1)}, 3))
['params.w', 'step']
>>> key_paths(State({"w": torch.ones(1)}, 3), named=False)
['0.w', '1']
"""

from __future__ import annotations

from typing import Any, Callable

import optree

from hpfunc import tree as _tree

__all__ = ["key_paths"]


def _entry(e: Any, named: bool) -> str:
    if named and isinstance(e, (optree.NamedTupleEntry, optree.StructSequenceEntry)):
        return str(e.field)
    return str(e.entry)


def key_paths(state: Any, *, is_leaf: Callable[[Any], bool] | None = None, named: bool = True) -> list[str]:
    """The key of each leaf of ``state`` in flattening order (``named=False``: the positional keys that
    checkpoints of hpfunc before named keys hold)."""
    accessors, _, _ = optree.tree_flatten_with_accessor(state, is_leaf=is_leaf, none_is_leaf=_tree.NONE_IS_LEAF,
                                                        namespace=_tree.NAMESPACE)
    return [".".join(_entry(e, named) for e in acc) for acc in accessors]
