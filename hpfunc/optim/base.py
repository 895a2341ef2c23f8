"""The optimizer contract: ``GradientTransformation(init, update)`` and ``apply_updates``.

A transformation is a pair of pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

or, in one call, ``params, state = update_and_apply(tx, grads, state, params)``: the same new state
and params, computed in one fused pass where the transformation has one (``adamw``, and a ``chain``
that ends in it: its ``update`` is a :class:`FusedUpdate`).

``init`` builds a state shaped like the params (a pytree of tensors, so it checkpoints like the
params); ``update`` returns new updates and a new state and never mutates its inputs. Updates follow
the optax sign convention: they are *added* to the params, so a descent step is ``-lr * direction``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Protocol

import torch

from hpfunc import layout
from hpfunc.optim import _ops, _tree

__all__ = [
    "Params",
    "Updates",
    "OptState",
    "InitFn",
    "UpdateFn",
    "GradientTransformation",
    "EmptyState",
    "identity",
    "apply_updates",
    "ApplyFn",
    "FusedUpdate",
    "update_and_apply",
    "new_count",
    "stream_state_in",
    "streaming_state",
    "stream_group_bytes",
]

Params = Any
"""A pytree of tensors (dicts, lists, tuples, NamedTuples; ``None`` is an empty subtree)."""
Updates = Any
"""A pytree shaped like the params: gradients on the way in, parameter deltas on the way out."""
OptState = Any
"""A pytree of tensors (NamedTuples of trees shaped like the params, int64 step counts)."""


class InitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class ApplyFn(Protocol):
    def __call__(self, updates: Updates, state: OptState, params: Params, *,
                 donate: bool = False) -> tuple[Params, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer building block: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, new_state)``.

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
        >>> params = {"w": torch.ones(2, 2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.full((2, 2), 0.5)}, state, params)
        >>> params = optim.apply_updates(params, updates)
    """

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transformation (a pytree with no leaves)."""


def identity() -> GradientTransformation:
    """A transformation that returns the updates unchanged.

    >>> import torch
    >>> tx = identity()
    >>> identity().update({"w": torch.ones(1)}, tx.init(None))[0]
    {'w': tensor([1.])}
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        return updates, state

    return GradientTransformation(init, update)


def new_count() -> torch.Tensor:
    """A fresh step counter: an int64 scalar tensor on the CPU.

    Counts live on the CPU so that reading them (``int(count)`` for bias corrections and
    schedules) never waits for an accelerator.
    """
    return torch.zeros((), dtype=torch.int64)


@torch.no_grad()
def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates`` leaf by leaf, in each param's own dtype.

    The sum is formed in the promoted dtype (an fp32 update on a bf16 param is added in fp32) and
    cast back to the param's dtype. Inputs are not modified.

    Args:
      params: a pytree of tensors.
      updates: a pytree with the same structure (as returned by ``update``).

    Returns:
      The new params, a new pytree with the structure of ``params``.

    Example:
        >>> import torch
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    (p_leaves, u_leaves), spec = _tree.flatten_aligned(
        [params, updates], ["params", "updates"], "apply_updates"
    )
    summed = _ops.add(p_leaves, u_leaves)
    return _tree.unflatten(spec, [s.to(p.dtype) for s, p in zip(summed, p_leaves)])


class FusedUpdate:
    """An ``update`` function that can also apply itself in one pass.

    ``fused(updates, state, params)`` is the plain ``update`` (updates out, optax's contract);
    ``fused.apply(updates, state, params, donate=False) -> (new_params, new_state)`` returns the same
    state and the params ``apply_updates(params, update(...)[0])`` would give, up to rounding, without
    materialising the updates; with ``donate=True`` it may write them into the buffers of ``state`` and
    ``params``. A transformation whose arithmetic fuses (AdamW: the new moments and params in a
    handful of foreach passes, as ``torch.optim.AdamW`` does in place) puts one in its
    ``GradientTransformation``; :func:`update_and_apply` uses it, and the pair stays
    ``(init, update)`` for everything else (``chain``, ``masked``, checkpoints of the state).

    >>> import torch
    >>> from hpfunc import optim
    >>> tx = optim.adamw(0.1, weight_decay=0.0)
    >>> isinstance(tx.update, FusedUpdate)
    True
    """

    __slots__ = ("update", "apply", "__wrapped__")

    def __init__(self, update: UpdateFn, apply: ApplyFn):
        self.update, self.apply = update, apply
        self.__wrapped__ = update

    def __call__(self, updates: Updates, state: OptState, params: Params | None = None) -> tuple[Updates, OptState]:
        return self.update(updates, state, params)

    def __repr__(self) -> str:
        return f"FusedUpdate({getattr(self.update, '__qualname__', self.update)!r})"


def update_and_apply(tx: GradientTransformation, updates: Updates, state: OptState,
                     params: Params, *, donate: bool = False) -> tuple[Params, OptState]:
    """``(new_params, new_state)``: ``tx.update`` then :func:`apply_updates`, in one fused pass where
    ``tx.update`` is a :class:`FusedUpdate` (``adamw``, a ``chain`` ending in it).

    ``donate=True`` hands over ``state`` and ``params``: a fused transformation then writes the new
    moments and parameters into their buffers, in place as ``torch.optim`` does, with the same values
    (bit for bit), and the caller must not read the old ``state`` and ``params`` again (they hold the
    new values, or some of them). It is a permission, not a promise: what cannot be updated in place
    (a tensor that requires grad, two leaves sharing memory, the unfused path) gets new tensors. Inside
    :func:`hpfunc.parallelize` pass :func:`hpfunc.layout.donated` (``parallelize(..., donate_state=True)``).

    The fused AdamW computes torch's arithmetic: on contiguous fp32 or fp64 leaves with torch's fused
    AdamW kernel (``torch.optim.AdamW(fused=True)``, bit for bit: one pass over memory), otherwise as
    ``torch.optim.AdamW``'s foreach step (bit for bit, on plain tensors of one dtype) in 4 new tensors
    instead of 7 and 8 passes instead of 11; leaves it cannot fuse (DTensors, bf16 params with fp32
    moments) take the two-call path.

    >>> import torch
    >>> from hpfunc import optim
    >>> tx = optim.adamw(0.1, weight_decay=0.0)
    >>> params = {"w": torch.ones(2)}
    >>> params, state = update_and_apply(tx, {"w": torch.ones(2)}, tx.init(params), params)
    >>> params["w"]
    tensor([0.9000, 0.9000])
    """
    apply = getattr(tx.update, "apply", None)
    if apply is not None and getattr(apply, "streams_state", False) and layout.scopes().state_streaming is not None:
        return apply(updates, state, params, donate=donate)  # it streams the host-held state itself, by groups
    state = stream_state_in(state, params, updates)
    params = stream_params_in(params, updates)
    if apply is not None:
        return apply(updates, state, params, donate=donate)
    new_updates, new_state = tx.update(updates, state, params)
    return apply_updates(params, new_updates), new_state


def stream_state_in(state: OptState, params: Params, updates: Updates = None) -> OptState:
    """``state`` with the leaves held in host memory brought to the parameters' device for an update.

    A plan with state offload (:meth:`hpfunc.transforms.plans.Plan.with_state_offload`) keeps the
    optimizer state (the leaves shaped like parameters: moments, momenta) in host memory between
    steps and hands it to the step there; :func:`update_and_apply` brings it to the device when the
    update needs it, on a copy stream (:func:`hpfunc.copy_stream.to_device`), so it does not occupy
    the device during the forward and backward. The new state comes back on the device; the plan's
    step copies it back to host memory. Scalars (step counts) are left where they are: a count on the
    device is read there (bias corrections, the schedule's table) and a fresh count lives on the host.
    Parameters on the CPU: nothing moves (host and device are one memory).

    >>> import torch
    >>> state = {"mu": torch.zeros(2)}
    >>> stream_state_in(state, {"w": torch.ones(2)}) is state
    True
    """
    # the device: the parameters' (those not held in host memory themselves), else the updates'
    p_leaves = _tree.flatten(params)[0] + ([] if updates is None else _tree.flatten(updates)[0])
    device = next((x.device for x in p_leaves if isinstance(x, torch.Tensor) and x.device.type != "cpu"), None)
    if device is None:
        return state
    leaves, spec = _tree.flatten(state)
    held = [k for k, x in enumerate(leaves)
            if isinstance(x, torch.Tensor) and x.ndim > 0 and x.device.type == "cpu"]
    if not held:
        return state
    from hpfunc.copy_stream import to_device

    moved = to_device([leaves[k] for k in held], device)
    for k, x in zip(held, moved):
        leaves[k] = x
    return _tree.unflatten(spec, leaves)


@contextlib.contextmanager
def streaming_state(group_bytes: int, *, state: bool = True, params: bool = False) -> Iterator[None]:
    """Inside, :func:`update_and_apply` streams the optimizer state held in host memory through the device
    in groups of leaves of at most ``group_bytes`` bytes (one leaf at least): the next group is copied in on
    a copy stream while this one is updated, then copied back to fresh host buffers and released, so that
    about two groups of the state are on the device at once instead of all of it. Only a transformation
    whose fused apply can stream (``adamw``'s kernel path, a ``chain`` ending in it) does; the others bring
    the whole state in (:func:`stream_state_in`). Inside, the new state of a streamed update is in host
    memory. A plan with ``with_state_offload("optimizer")`` runs its step inside this. ``state``: the
    moments are held in host memory (the default); ``params``: parameters held in host memory stream with
    them (``with_state_offload("params")``: each group's parameter blocks copied in, updated, copied back,
    and the new parameters are in host memory too); on the CPU, where every tensor is in host memory,
    these say what to stream (real copies, as on a device). Bound in the layout binding's scopes
    (:class:`hpfunc.layout.StateStreaming`), so a step's own layout bindings keep it.

    >>> with streaming_state(1 << 20):
    ...     stream_group_bytes()
    1048576
    >>> stream_group_bytes() is None
    True
    """
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes < 0:
        raise ValueError(f"streaming_state: group_bytes must be an int >= 0 (0: one leaf per group), found {group_bytes!r}")
    with layout.scoped(state_streaming=layout.StateStreaming(group_bytes, bool(state), bool(params))):
        yield


def stream_group_bytes() -> int | None:
    """The group size of :func:`streaming_state` in force (``None`` outside)."""
    hit = layout.scopes().state_streaming
    return None if hit is None else hit.group_bytes


def streamed_kinds() -> tuple[bool, bool]:
    """``(moments, params)``: what :func:`streaming_state` in force says is held in host memory."""
    hit = layout.scopes().state_streaming
    return (False, False) if hit is None else (hit.moments, hit.params)


def stream_params_in(params: Params, updates: Updates) -> Params:
    """``params`` with the leaves held in host memory (``with_state_offload("params")``) brought to the
    device of their updates (the gradients), on a copy stream, for an update that cannot stream them by
    groups; on the CPU nothing moves. Outside :func:`streaming_state` with ``params=True`` (no parameter
    is held in host memory) it returns ``params`` at once.

    >>> import torch
    >>> p = {"w": torch.ones(2)}
    >>> stream_params_in(p, {"w": torch.zeros(2)}) is p
    True
    """
    hit = layout.scopes().state_streaming
    if hit is None or not hit.params:
        return params
    p_leaves, spec = _tree.flatten(params)
    u_leaves = _tree.flatten(updates)[0]
    if len(u_leaves) != len(p_leaves):
        return params
    held = [k for k, (x, u) in enumerate(zip(p_leaves, u_leaves)) if isinstance(x, torch.Tensor)
            and isinstance(u, torch.Tensor) and x.device.type == "cpu" and u.device.type != "cpu"]
    if not held:
        return params
    from hpfunc.copy_stream import to_device

    moved = to_device([p_leaves[k] for k in held], u_leaves[held[0]].device)
    for k, x in zip(held, moved):
        p_leaves[k] = x
    return _tree.unflatten(spec, p_leaves)
