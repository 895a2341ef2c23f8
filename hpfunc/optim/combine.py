"""Combinators: ``chain`` transformations, apply one to a ``masked`` subset, ``partition`` by label."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, NamedTuple


from hpfunc.optim import _tree
from hpfunc.optim.base import (
    FusedUpdate, GradientTransformation, OptState, Params, Updates, stream_group_bytes, stream_state_in,
)
from hpfunc.optim.errors import OptimError, TreeMismatchError, UnknownLabelError

__all__ = ["chain", "MaskedState", "masked", "PartitionState", "partition"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Example:
        >>> import torch
        >>> from hpfunc.optim import scale, clip_by_global_norm
        >>> tx = chain(clip_by_global_norm(1.0), scale(-0.1))
        >>> u, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(None))
        >>> torch.allclose(u["w"], torch.tensor([-0.06, -0.08]))
        True
    """
    for i, t in enumerate(transforms):
        if not (isinstance(t, tuple) and len(t) == 2 and callable(t[0]) and callable(t[1])):
            raise TypeError(
                f"chain: argument {i} must be a GradientTransformation(init, update), got {type(t).__name__}"
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, state: tuple[OptState, ...], params: Params | None = None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            found = f"a {type(state).__name__} of length {len(state)}" if isinstance(state, tuple) else type(state).__name__
            raise TreeMismatchError(
                f"chain: expected a state tuple with one entry per transformation ({len(transforms)}), "
                f"found {found}; pass the state returned by this chain's init()"
            )
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    last = getattr(transforms[-1].update, "apply", None) if transforms else None
    if last is None:
        return GradientTransformation(init, update)

    def apply(updates: Updates, state: tuple[OptState, ...], params: Params, *,
              donate: bool = False) -> tuple[Params, tuple[OptState, ...]]:
        # the transformations before the last one as in update, then the last one's fused apply
        if not isinstance(state, tuple) or len(state) != len(transforms):
            update(updates, state, params)  # raises the chain's error
        new_states = []
        streamed = apply.streams_state and stream_group_bytes() is not None  # type: ignore[attr-defined]
        for t, s in zip(transforms[:-1], state[:-1]):
            # under streaming the last one streams its own state in; the others' state comes in whole
            updates, s = t.update(updates, stream_state_in(s, params, updates) if streamed else s, params)
            new_states.append(s)
        params, s = last(updates, state[-1], params, donate=donate)
        return params, (*new_states, s)

    apply.streams_state = getattr(last, "streams_state", False)  # type: ignore[attr-defined]
    return GradientTransformation(init, FusedUpdate(update, apply))


def _check_bool(where: str, what: str) -> Callable[[str, Any], None]:
    def check(path: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {what} at '{path}' must be a Python bool, got {value!r}")

    return check


def mask_flags(mask: Any, tree: Any) -> list[bool]:
    """Which leaves of ``tree`` a :func:`masked` mask selects, in flattening order."""
    return _tree.resolve_leafwise(mask, tree, what="mask", where="masked", check=_check_bool("masked", "the mask"))


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transformation's state over the selected leaves only."""

    inner_state: OptState


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply ``inner`` to the leaves selected by ``mask``; other leaves pass through unchanged.

    ``inner`` sees the tree with unselected leaves replaced by ``None`` (an empty subtree), so its
    state holds nothing for them and paths inside it are the paths of the full tree.

    Args:
      inner: the transformation to apply to the selected leaves.
      mask: which leaves to select, one of

        * a tree of Python bools shaped like the params, or a prefix of it
          (``{"embed": False, "layers": True}`` selects every leaf under ``layers``);
        * a callable ``(path: str, leaf) -> bool`` (two positional parameters);
        * a callable ``params -> tree of bools`` (one positional parameter).

        Callables are evaluated on the params in ``init`` and on the updates in ``update``, so they
        must decide from the path, shape and ndim only (not the values or dtype).

    Example:
        >>> import torch
        >>> from hpfunc.optim import add_decayed_weights
        >>> no_decay_1d = masked(add_decayed_weights(0.1), lambda path, x: x.ndim >= 2)
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> zeros = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> u, _ = no_decay_1d.update(zeros, no_decay_1d.init(params), params)
        >>> u["b"], u["w"][0]
        (tensor([0., 0.]), tensor([0.1000, 0.1000]))
    """

    def keep(tree: Any) -> list[bool]:
        return mask_flags(mask, tree)

    def init(params: Params) -> MaskedState:
        return MaskedState(inner.init(_tree.select(params, keep(params))))

    def update(updates: Updates, state: MaskedState, params: Params | None = None):
        selected = keep(updates)
        sub_params = None if params is None else _subtree_for(params, updates, selected, "masked")
        new_sub, inner_state = inner.update(_tree.select(updates, selected), state.inner_state, sub_params)
        leaves, spec = _tree.flatten(updates)
        merged = _merge(leaves, [selected], [new_sub], ["masked"])
        return _tree.unflatten(spec, merged), MaskedState(inner_state)

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``{label: state of that label's transformation}``."""

    inner_states: dict[Hashable, OptState]


def partition(
    transforms: Mapping[Hashable, GradientTransformation], param_labels: Any
) -> GradientTransformation:
    """Route each leaf to the transformation of its label.

    Every leaf gets exactly one label; each ``transforms[label]`` sees the tree restricted to its
    leaves (others replaced by ``None``), with the paths of the full tree.

    Args:
      transforms: ``{label: transformation}``.
      param_labels: the label of each leaf (optax's name), one of

        * a tree of labels shaped like the params, or a prefix of it;
        * a callable ``(path: str, leaf) -> label`` (two positional parameters), for routing by
          path or predicate, e.g. ``lambda path, x: "adamw" if "embed" in path else "muon"``;
        * a callable ``params -> tree of labels`` (one positional parameter).

        Callables are evaluated on the params in ``init`` and on the updates in ``update``, so they
        must decide from the path, shape and ndim only.

    Raises:
      UnknownLabelError: a leaf's label has no entry in ``transforms`` (the error names the path).

    Example:
        >>> import torch
        >>> from hpfunc.optim import adamw, scale_by_learning_rate
        >>> tx = partition(
        ...     {"adamw": adamw(1e-3), "sgd": scale_by_learning_rate(0.1)},
        ...     lambda path, x: "sgd" if path.startswith("head") else "adamw",
        ... )
        >>> params = {"body": torch.ones(2), "head": torch.ones(2)}
        >>> grads = {"body": torch.ones(2), "head": torch.ones(2)}
        >>> u, state = tx.update(grads, tx.init(params), params)
        >>> u["head"]
        tensor([-0.1000, -0.1000])
    """
    transforms = dict(transforms)
    if not transforms:
        raise ValueError("partition: transforms must name at least one label")
    known = sorted(map(repr, transforms))

    def check(path: str, label: Any) -> None:
        try:
            ok = label in transforms
        except TypeError:  # unhashable
            ok = False
        if not ok:
            raise UnknownLabelError(
                f"partition: the leaf at '{path}' has label {label!r}, which has no transformation; "
                f"known labels: {', '.join(known)}. Add it to `transforms` or change `param_labels`."
            )

    def route(tree: Any) -> dict[Hashable, list[bool]]:
        values = _tree.resolve_leafwise(param_labels, tree, what="param_labels", where="partition", check=check)
        return {label: [v == label for v in values] for label in transforms}

    def init(params: Params) -> PartitionState:
        selected = route(params)
        return PartitionState(
            {label: t.init(_tree.select(params, selected[label])) for label, t in transforms.items()}
        )

    def update(updates: Updates, state: PartitionState, params: Params | None = None):
        if not isinstance(state, PartitionState) or set(state.inner_states) != set(transforms):
            found = sorted(map(repr, state.inner_states)) if isinstance(state, PartitionState) else type(state).__name__
            raise TreeMismatchError(
                f"partition: expected a PartitionState with labels {', '.join(known)}, found {found}; "
                "pass the state returned by this partition's init()"
            )
        selected = route(updates)
        new_subs, new_states, masks, names = [], {}, [], []
        for label, t in transforms.items():
            sub_params = None if params is None else _subtree_for(params, updates, selected[label], "partition")
            sub, new_states[label] = t.update(
                _tree.select(updates, selected[label]), state.inner_states[label], sub_params
            )
            new_subs.append(sub)
            masks.append(selected[label])
            names.append(f"partition label {label!r}")
        leaves, spec = _tree.flatten(updates)
        return _tree.unflatten(spec, _merge(leaves, masks, new_subs, names)), PartitionState(new_states)

    return GradientTransformation(init, update)


def _subtree_for(params: Params, updates: Updates, selected: list[bool], where: str) -> Params:
    p_spec = _tree.flatten(params)[1]
    if p_spec != _tree.flatten(updates)[1]:
        raise TreeMismatchError(_tree.mismatch_message(updates, params, "updates", "params", where))
    return _tree.select(params, selected)


def _merge(
    leaves: list[Any], masks: list[list[bool]], subs: list[Any], names: list[str]
) -> list[Any]:
    """Put each sub-result's leaves back at the positions its mask selected."""
    out = list(leaves)
    for mask, sub, name in zip(masks, subs, names):
        sub_leaves, _ = _tree.flatten(sub)
        positions = [i for i, k in enumerate(mask) if k]
        if len(sub_leaves) != len(positions):
            raise OptimError(
                f"{name}: the inner transformation returned {len(sub_leaves)} leaves for "
                f"{len(positions)} selected leaves; an inner update must keep the tree structure"
            )
        for i, x in zip(positions, sub_leaves):
            out[i] = x
    return out
