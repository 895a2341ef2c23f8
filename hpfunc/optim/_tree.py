"""Private pytree plumbing shared by the optimizer transforms.

Every transform maps a function over several trees that must line up leaf for leaf (updates,
moments, params). The fast path compares treespecs only; paths are computed when something is
wrong, so that the error can name the first leaf that differs (``layers.3.attn.wq``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import optree

from hpfunc.tree import NAMESPACE, path_str

from hpfunc.optim.errors import TreeMismatchError

# None is an empty subtree (as in JAX and hpfunc.tree), never a leaf. `masked` and `partition`
# rely on this: a leaf hidden from an inner transform is replaced by None.
_NONE_IS_LEAF = False
# Every optree call names hpfunc's registry namespace, so that hpfunc's own node types (registered
# there by hpfunc.tree.register_node, never globally) flatten here as in the rest of hpfunc.
# (tree_unflatten takes no namespace: the treespec carries it.)
_NS = NAMESPACE


def flatten(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NS)


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    return optree.tree_unflatten(spec, list(leaves))


def structure(tree: Any) -> Any:
    return optree.tree_structure(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NS)


def paths(tree: Any) -> list[str]:
    """Dotted paths of the leaves of ``tree`` in flattening order."""
    raw, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NS)
    return [path_str(p) for p in raw]


def paths_and_leaves(tree: Any) -> tuple[list[str], list[Any], Any]:
    raw, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NS)
    return [path_str(p) for p in raw], leaves, spec


def mismatch_message(expected: Any, found: Any, expected_name: str, found_name: str, where: str) -> str:
    """Explain how ``found`` differs from ``expected``, naming the first differing path."""
    p_exp, p_found = paths(expected), paths(found)
    s_exp, s_found = set(p_exp), set(p_found)
    missing = [p for p in p_exp if p not in s_found]
    extra = [p for p in p_found if p not in s_exp]
    head = f"{where}: {found_name} and {expected_name} have different tree structures"
    if missing:
        detail = (
            f"{expected_name} has a leaf at '{missing[0]}' that {found_name} lacks"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    elif extra:
        detail = (
            f"{found_name} has a leaf at '{extra[0]}' that {expected_name} lacks"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    else:
        detail = (
            f"same leaf paths but different containers: expected {structure(expected)}, "
            f"found {structure(found)}"
        )
    hint = (
        " The optimizer state must be created by init() on a tree shaped like the updates "
        "(the params); did the model's parameter tree change after init()?"
    )
    return f"{head}: {detail}.{hint}"


def flatten_aligned(
    trees: Sequence[Any], names: Sequence[str], where: str
) -> tuple[list[list[Any]], Any]:
    """Flatten ``trees`` that must share the structure of ``trees[0]``.

    Returns the leaf lists (one per tree) and the treespec of the first tree. Raises
    :class:`TreeMismatchError` naming the first differing path.
    """
    first_leaves, spec = flatten(trees[0])
    out = [first_leaves]
    for tree, name in zip(trees[1:], names[1:]):
        leaves, other = flatten(tree)
        if other != spec:
            raise TreeMismatchError(mismatch_message(trees[0], tree, names[0], name, where))
        out.append(leaves)
    return out, spec


def resolve_leafwise(
    spec_or_fn: Any, tree: Any, *, what: str, where: str, check: Callable[[str, Any], None]
) -> list[Any]:
    """Turn a per-leaf specification into one value per leaf of ``tree`` (flattening order).

    ``spec_or_fn`` is either a tree (a prefix of ``tree`` is enough: ``{"embed": False,
    "layers": True}`` covers every leaf below ``layers``), a callable ``fn(tree) -> tree``, or a
    callable ``fn(path: str, leaf) -> value``. ``check(path, value)`` validates each value.
    """
    leaf_paths, leaves, spec = paths_and_leaves(tree)
    if callable(spec_or_fn):
        if _positional_arity(spec_or_fn) >= 2:
            values = [spec_or_fn(p, x) for p, x in zip(leaf_paths, leaves)]
        else:
            return resolve_leafwise(spec_or_fn(tree), tree, what=what, where=where, check=check)
    else:
        try:
            full = optree.tree_broadcast_prefix(spec_or_fn, tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NS)
        except ValueError as err:
            raise TreeMismatchError(
                f"{where}: {what} must be a tree shaped like the params (or a prefix of it), "
                f"or a callable (path, leaf) -> value; {_prefix_mismatch(spec_or_fn, leaf_paths) or err}"
            ) from None
        values, full_spec = flatten(full)
        if full_spec != spec:  # None in the spec where params have leaves hides them
            raise TreeMismatchError(mismatch_message(tree, full, "params", what, where))
    for p, v in zip(leaf_paths, values):
        check(p, v)
    return values


def _prefix_mismatch(prefix: Any, leaf_paths: list[str]) -> str:
    """Name a path of ``prefix`` that covers no leaf, or a leaf that ``prefix`` does not cover."""
    prefix_paths = paths(prefix)

    def covers(p: str, leaf: str) -> bool:
        return p == "" or leaf == p or leaf.startswith(p + ".")

    for p in prefix_paths:
        if not any(covers(p, leaf) for leaf in leaf_paths):
            return f"it has an entry at '{p}' but the params have no leaf there or below"
    for leaf in leaf_paths:
        if not any(covers(p, leaf) for p in prefix_paths):
            return f"the params have a leaf at '{leaf}' that it does not cover"
    return ""


def _positional_arity(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without signatures: assume fn(tree)
        return 1
    n = 0
    for prm in sig.parameters.values():
        if prm.kind is prm.VAR_POSITIONAL:
            return 2
        if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD) and prm.default is prm.empty:
            n += 1
    return n


def select(tree: Any, keep: Sequence[bool]) -> Any:
    """Replace the leaves of ``tree`` where ``keep`` is False by None (an empty subtree)."""
    leaves, spec = flatten(tree)
    return unflatten(spec, [x if k else None for x, k in zip(leaves, keep)]) if leaves else tree


def check_shapes(
    found: Sequence[Any], expected: Sequence[Any], tree: Any, found_name: str, expected_name: str, where: str
) -> None:
    """Raise :class:`TreeMismatchError` naming the first leaf whose shapes differ."""
    for i, (a, b) in enumerate(zip(found, expected)):
        if a.shape != b.shape:
            path = paths(tree)[i]
            raise TreeMismatchError(
                f"{where}: at '{path}' {found_name} has shape {tuple(a.shape)} but {expected_name} "
                f"has shape {tuple(b.shape)}; was the state created by init() for these params?"
            )
