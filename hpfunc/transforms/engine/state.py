"""Finding the parameters inside a train state, and laying out the rest of the state like them.

The state of a step is any pytree (dicts, NamedTuples, attrs classes, lists); the parameters sit at a
dotted path in it (``"params"`` finds ``state["params"]`` and ``state.params``). Every other state leaf
shaped like a parameter, at a path ending in that parameter's path (``opt_state.0.mu.layers.0.attn.wq``),
is laid out like that parameter's optimizer block; any other leaf is replicated.

    >>> get_path({"a": {"b": 1}}, "a.b"), replace_path({"a": {"b": 1}}, "a.b", 2)
    (1, {'a': {'b': 2}})
    >>> param_suffix("opt.0.mu.layers.0.wq", {"layers.0.wq": None})
    'layers.0.wq'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from hpfunc.layout import PlanError

__all__ = ["get_path", "replace_path", "param_suffix", "holder", "positions_of"]


def get_path(state: Any, path: str) -> Any:
    """The subtree at dotted ``path`` (mapping keys, sequence indices or attributes); :class:`PlanError`
    naming the missing part otherwise."""
    x = state
    for part in path.split(".") if path else []:
        if isinstance(x, Mapping):
            if part not in x:
                raise PlanError(f"parallelize: the state has no {path!r} (no key {part!r} in {sorted(map(str, x))}); "
                                f"pass params= the path of the parameters in the state")
            x = x[part]
        elif isinstance(x, Sequence) and not hasattr(x, "_fields") and part.isdigit():
            x = x[int(part)]
        elif hasattr(x, part):
            x = getattr(x, part)
        else:
            raise PlanError(f"parallelize: the state has no {path!r} ({type(x).__name__} has no {part!r}); "
                            f"pass params= the path of the parameters in the state")
    return x


def replace_path(state: Any, path: str, value: Any) -> Any:
    """A copy of ``state`` with the subtree at ``path`` replaced by ``value`` (the rest shared)."""
    if not path:
        return value
    part, _, rest = path.partition(".")
    if isinstance(state, Mapping):
        out = dict(state)
        out[part] = replace_path(state[part], rest, value)
        return type(state)(out) if type(state) is not dict else out
    if hasattr(state, "_fields"):  # NamedTuple
        return state._replace(**{part: replace_path(getattr(state, part), rest, value)})
    if attrs.has(type(state)):
        return attrs.evolve(state, **{part: replace_path(getattr(state, part), rest, value)})
    if isinstance(state, (list, tuple)) and part.isdigit():
        items = list(state)
        items[int(part)] = replace_path(items[int(part)], rest, value)
        return type(state)(items)
    raise PlanError(f"parallelize: cannot replace {path!r} in a {type(state).__name__}")


def param_suffix(path: str, params: Mapping[str, Any]) -> str | None:
    """The longest proper suffix of ``path`` that is a parameter path, or ``None``."""
    parts = path.split(".")
    for k in range(1, len(parts)):
        suffix = ".".join(parts[k:])
        if suffix in params:
            return suffix
    return None


def holder(path: str, value: Any) -> Any:
    """A minimal state holding ``value`` at ``path`` (nested dicts)."""
    for part in reversed(path.split(".")) if path else []:
        value = {part: value}
    return value


class _Slot:
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def positions_of(state: Any, path: str, n: int) -> dict[int, int]:
    """``{position of a leaf in the flattened state: index of that parameter}`` for the ``n`` parameter
    leaves at ``path``: found by structure (each subtree is a contiguous run of leaves), not by identity."""
    from hpfunc import tree as _tree

    params = get_path(state, path)
    _, treedef = _tree.flatten(params)
    marked = replace_path(state, path, _tree.unflatten(treedef, [_Slot(k) for k in range(n)]))
    return {pos: x.k for pos, x in enumerate(_tree.leaves(marked)) if isinstance(x, _Slot)}
