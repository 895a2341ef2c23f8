"""Pytree helpers on optree, with dotted path strings: hpfunc's one pytree library.

A *path* names a leaf the way users read parameters: ``layers.3.attn.wq``. Every error hpfunc raises
about a leaf names it by this path. hpfunc's own node types (the lazy parameter view of a
parallelized step) are registered in optree's namespace :data:`NAMESPACE` (:func:`register_node`), never
in optree's global one, and every function here flattens with that namespace.

Example:
    >>> import torch
    >>> from hpfunc import tree
    >>> params = {"layers": [{"w": torch.ones(2)}], "b": torch.zeros(1)}
    >>> [p for p, _ in tree.leaves_with_paths(params)]
    ['b', 'layers.0.w']
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import optree

__all__ = [
    "NAMESPACE",
    "register_node",
    "path_str",
    "leaves_with_paths",
    "map_with_path",
    "tree_map",
    "flatten",
    "unflatten",
    "structure",
    "leaves",
    "check_same_structure",
]

# None is an empty subtree (as in JAX), not a leaf.
NONE_IS_LEAF = False

NAMESPACE = "hpfunc"
"""optree's registry namespace of hpfunc's node types."""


def register_node(cls: type, flatten: Callable[[Any], tuple], unflatten: Callable[[Any, Any], Any]) -> None:
    """Register a node type in hpfunc's namespace: ``flatten(x) -> (children, metadata, keys)``,
    ``unflatten(metadata, children) -> x`` (optree's ``register_pytree_node`` protocol)."""
    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


def path_str(path: Iterable[Any]) -> str:
    """Join an optree path (a tuple of keys and indices) into a dotted string.

    >>> path_str(("layers", 3, "attn", "wq"))
    'layers.3.attn.wq'
    """
    return ".".join(str(p) for p in path)


def leaves_with_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """Return ``[(dotted_path, leaf), ...]`` in optree's flattening order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, none_is_leaf=NONE_IS_LEAF,
                                                     namespace=NAMESPACE)
    return [(path_str(p), leaf) for p, leaf in zip(paths, leaves)]


def map_with_path(
    fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = NONE_IS_LEAF,
) -> Any:
    """``tree_map`` whose function receives the dotted path first: ``fn(path, leaf, *rest_leaves)``
    (``none_is_leaf``: ``None`` positions are visited too, e.g. the leaves a pipeline rank does not hold).

    >>> map_with_path(lambda p, x: p, {"a": {"b": 1}})
    {'a': {'b': 'a.b'}}
    """
    return optree.tree_map_with_path(
        lambda p, *xs: fn(path_str(p), *xs), tree, *rest, is_leaf=is_leaf, none_is_leaf=none_is_leaf,
        namespace=NAMESPACE
    )


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None,
             none_is_leaf: bool = NONE_IS_LEAF) -> Any:
    """``optree.tree_map`` with hpfunc's conventions (``None`` is an empty subtree unless ``none_is_leaf``)."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None,
            none_is_leaf: bool = NONE_IS_LEAF) -> tuple[list[Any], Any]:
    """Return ``(leaves, treespec)``."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def unflatten(treespec: Any, leaves: Iterable[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(treespec, list(leaves))


def structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None, none_is_leaf: bool = NONE_IS_LEAF) -> Any:
    """The treespec of ``tree``."""
    return optree.tree_structure(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None, none_is_leaf: bool = NONE_IS_LEAF) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def check_same_structure(expected: Any, found: Any, *, what: str = "tree") -> None:
    """Raise ``ValueError`` naming the first differing path when two trees differ in structure."""
    s1, s2 = structure(expected), structure(found)
    if s1 == s2:
        return
    p1 = {p for p, _ in leaves_with_paths(expected)}
    p2 = {p for p, _ in leaves_with_paths(found)}
    missing, extra = sorted(p1 - p2), sorted(p2 - p1)
    detail = []
    if missing:
        detail.append(f"missing paths {missing[:5]}")
    if extra:
        detail.append(f"unexpected paths {extra[:5]}")
    if not detail:
        detail.append(f"expected structure {s1}, found {s2}")
    raise ValueError(f"{what} does not match the expected structure: " + "; ".join(detail))
