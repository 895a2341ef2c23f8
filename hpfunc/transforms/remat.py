"""``remat``: recompute activations in backward instead of keeping them, chosen by a policy.

``remat(f, policy=...)`` returns a function with the same inputs, outputs and gradients as ``f``
whose forward keeps only what the policy saves; everything else is recomputed from the region's
inputs when backward needs it. Policies carry JAX's names (``jax.checkpoint_policies``) and see
each value as ``(op, name, tensor)``: the aten op that produced it, the name given by
:func:`checkpoint_name` (or ``None``) and the tensor itself.

Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with
``create_selective_checkpoint_contexts``: the policy is asked once per op in forward; outputs it
saves are cached, the rest are recomputed. ``checkpoint_name`` is an ``aten.alias`` (a free view)
dispatched while the name sits in a context variable, so the policy sees the name exactly on the
op whose output carries it.

Example:
    >>> import torch, hpfunc
    >>> from hpfunc.transforms.remat import remat, checkpoint_name, save_only_these_names
    >>> def mlp(w1, w2, x):
    ...     h = checkpoint_name(torch.relu(x @ w1), "hidden")
    ...     return (h @ w2).sum()
    >>> w1, w2, x = torch.randn(4, 8), torch.randn(8, 2), torch.randn(3, 4)
    >>> g1 = hpfunc.grad(mlp, argnums=(0, 1))(w1, w2, x)
    >>> g2 = hpfunc.grad(remat(mlp, policy=save_only_these_names("hidden")), argnums=(0, 1))(w1, w2, x)
    >>> all(torch.equal(a, b) for a, b in zip(g1, g2))
    True

Collectives inside a region (``hpfunc.lax`` autograd Functions) are recomputed like any op: the
recompute issues them again during backward. Backward is SPMD (every rank runs the same graph in
the same order), so every rank re-issues the same collectives in the same order and nothing
deadlocks; the cost is one extra collective per recomputed one. Policies never cache the outputs
of mutating ops (a collective writes its buffer in place), so a cached buffer is never reduced twice.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import _RECOMPUTE as _SAC_RECOMPUTE
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hpfunc import layout, saved_tensors
from hpfunc import tree as _tree
from hpfunc.memory._names import NameScope, current_scope, name_scope
from hpfunc.memory._recorder import Recorder, current_recorder
from hpfunc.memory._storage import storage_key, tensors_in
from hpfunc.transforms.host_copy import CacheOffloader
from hpfunc.transforms.policies import (
    Decision, Policy, UnknownNameWarning, as_policy, checkpoint_policies, dots_saveable,
    dots_with_no_batch_dims_saveable, everything_saveable, nothing_saveable, save_and_offload_only_these_names,
    save_any_names_but_these, save_from_both_policies, save_only_these_names, warn_unknown_names,
)

__all__ = [
    "Decision", "Policy", "UnknownNameWarning", "remat", "checkpoint_name", "as_policy", "saved_activations",
    "nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
    "save_only_these_names", "save_any_names_but_these", "save_and_offload_only_these_names",
    "save_from_both_policies", "checkpoint_policies",
]

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# checkpoint_name

def current_tag() -> str | None:
    """The name being tagged right now (bound, in the layout binding's scopes, only while
    ``checkpoint_name`` dispatches its alias)."""
    return layout.scopes().checkpoint_tag


def checkpoint_name(x: Any, name: str) -> Any:
    """Tag ``x`` (a tensor or a pytree of tensors) with ``name`` for remat/offload policies.

    Returns a view of ``x`` (``aten.alias``: no copy, identity gradient). The name is visible to
    policies at the alias op and, by storage, to offload hooks and memory reports.

    >>> import torch
    >>> y = checkpoint_name(torch.ones(2), "h")
    >>> y.tolist()
    [1.0, 1.0]
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a string, found {type(name).__name__}")
    scope = current_scope()

    def tag(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with layout.scoped(checkpoint_tag=name):
            y = aten.alias.default(t)
        if scope is not None:
            scope.record(name, y)
        return y

    return _tree.tree_map(tag, x)


# ---------------------------------------------------------------------------------------------
# Selective checkpoint glue


def _op_name(op: Any) -> str:
    return str(op)


def _first_tensor(out: Any) -> Any:
    # Policies see one tensor: the output, or the first one of a multi-output op (SDPA's output).
    if isinstance(out, torch.Tensor):
        return out
    ts = tensors_in(out)
    return ts[0] if ts else None


@functools.lru_cache(maxsize=None)
def _never_cache(op: Any) -> bool:
    # Collectives and other in-place ops write their buffers; caching them would let a recompute
    # mutate (or reduce again) a cached value.
    try:
        return op._schema.is_mutable or op.namespace == "c10d"
    except AttributeError:
        return False


def _wrappers(value: Any) -> list:
    # A cache entry is a pytree (tuple/list, for multi-output ops) of torch's wrapper objects, not of
    # tensors: the wrappers are its leaves (they have ``get_val``; the tensor is their ``val``).
    return [v for v in _tree.leaves(value) if hasattr(v, "get_val")]


class _Slots(dict):
    """SAC storage for one op: intercepts cache writes to apply offload decisions and label cached values."""

    def __init__(self, pending: list, recorder: Recorder | None, offloader: CacheOffloader) -> None:
        super().__init__()
        self._pending, self._recorder, self._offloader = pending, recorder, offloader

    def __setitem__(self, idx: int, value: Any) -> None:
        if self._pending:  # a forward-time write (backward marks entries consumed with nothing pending)
            decision, name, op, index = self._pending.pop()
            if decision is not Decision.RECOMPUTE:
                value = self._keep(value, decision, name, op)
                for t in tensors_in([getattr(v, "val", None) for v in _wrappers(value)]):
                    index.setdefault(storage_key(t), []).append((self, idx))
        super().__setitem__(idx, value)

    def evict(self, idx: int) -> None:
        super().__setitem__(idx, _SAC_RECOMPUTE)

    def _keep(self, value: Any, decision: Decision, name: str | None, op: Any) -> Any:
        def one(w: Any) -> Any:
            val = getattr(w, "val", None)
            if not hasattr(w, "get_val") or not isinstance(val, torch.Tensor):
                return w
            if decision is Decision.OFFLOAD:
                return self._offloader.cache_entry(w, name=name, op=_op_name(op))
            if self._recorder is not None:
                self._recorder.note(val, kind="cached", name=name, op=_op_name(op))
            return w

        return _tree.tree_map(one, value)


class _Storage(dict):
    def __init__(self, pending: list, recorder: Recorder | None, offloader: CacheOffloader) -> None:
        super().__init__()
        self._args = (pending, recorder, offloader)

    def __missing__(self, key: Any) -> _Slots:
        slots = _Slots(*self._args)
        self[key] = slots
        return slots


def _sac_context(policy: Policy, memory_kind: str | None) -> Callable[[], tuple]:
    def context_fn() -> tuple:
        pending: list = []
        recorder = current_recorder()
        cached_by_storage: dict[int, list] = {}

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            name = current_tag() if op is aten.alias.default else None
            if _never_cache(op):
                decision = Decision.RECOMPUTE
                # An in-place op (a collective's all_reduce_) just changed tensors that may be
                # cached; the recompute replays that op, so those must be recomputed too, or the
                # replay would apply it twice (a cached buffer reduced again).
                for t in tensors_in((args, kwargs)):
                    for slots, idx in cached_by_storage.pop(storage_key(t), ()):
                        slots.evict(idx)
            else:
                decision = policy.decide(op, name, _first_tensor(ctx.op_output))
            pending.append((decision, name, op, cached_by_storage))
            if decision is Decision.RECOMPUTE:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE

        caching, cached = create_selective_checkpoint_contexts(policy_fn)
        if not all(isinstance(getattr(m, "storage", None), dict) for m in (caching, cached)):
            raise RuntimeError(
                "hpfunc.remat: torch's selective checkpoint modes no longer expose a `storage` dict "
                f"(torch {torch.__version__}); the cache hook that applies offload decisions and labels "
                "cached bytes needs updating for this torch version")
        storage = _Storage(pending, recorder, CacheOffloader(memory_kind=memory_kind, recorder=recorder))
        # Both modes share one storage dict (torch creates them that way); ours applies offload.
        caching.storage = storage
        cached.storage = storage
        return caching, cached

    return context_fn


# ---------------------------------------------------------------------------------------------
# remat


def remat(f: Callable | None = None, *, policy: Any = None, preserve_rng_state: bool = True,
          memory_kind: str | None = None) -> Callable:
    """Return ``f`` with activations recomputed in backward except those ``policy`` saves.

    Args:
        f: any function over pytrees of tensors (one layer, a stack, a whole loss). Usable as a
            decorator with or without arguments: ``@remat`` or ``@remat(policy=dots_saveable)``.
        policy: ``None`` or :data:`nothing_saveable` (full recompute: only the inputs of ``f``
            are kept), a JAX-named policy from this module, or a predicate ``(op, name, tensor)``
            returning a bool (True = save) or a :class:`Decision` (``OFFLOAD`` moves the value to
            host memory, see :func:`save_and_offload_only_these_names`).
        preserve_rng_state: replay the RNG state in the recompute (dropout gives the same mask).
        memory_kind: where offloaded values go: ``"pinned_host"`` (default when CUDA is present) or
            ``"unpinned_host"`` (default otherwise).

    Returns:
        A function with the signature, outputs and gradients of ``f``. Remats nest, and compose
        with ``shard_map`` and ``offload`` in either order.

    Example:
        >>> import torch, hpfunc
        >>> @remat(policy=dots_saveable)
        ... def layer(w, x):
        ...     return torch.tanh(x @ w).sum()
        >>> hpfunc.grad(layer)(torch.ones(3, 3), torch.ones(2, 3)).shape
        torch.Size([3, 3])
    """
    if f is None:
        return functools.partial(remat, policy=policy, preserve_rng_state=preserve_rng_state,
                                 memory_kind=memory_kind)
    if not callable(f):
        raise TypeError(f"remat: expected a function, found {type(f).__name__}")
    pol = as_policy(policy)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with name_scope() as scope:
            if pol.saves_everything or not torch.is_grad_enabled():
                out = f(*args, **kwargs)
            else:
                out = _run_checkpointed(f, pol, memory_kind, preserve_rng_state, args, kwargs, scope)
        warn_unknown_names(pol, scope.names, f)
        return out

    wrapped.policy = pol  # type: ignore[attr-defined]
    return wrapped


def _run_checkpointed(f: Callable, pol: Policy, memory_kind: str | None, preserve_rng_state: bool,
                      args: tuple, kwargs: dict, scope: NameScope) -> Any:
    leaves, spec = _tree.flatten((args, kwargs))
    # The recompute runs inside backward, where the forward's context variables (current mesh of a
    # shard_map, comm accounting, the saved-tensor stack, ...) are not set, possibly on another
    # thread: replay it in a copy of the forward's context.
    forward_context = contextvars.copy_context()
    runs = [0]

    def run(*flat: Any) -> Any:
        a, kw = _tree.unflatten(spec, flat)
        # torch's checkpoint owns what the body saves (dropped now, recomputed in backward): layers
        # pushed inside (an offload of a sub-layer) install no hooks and move nothing.
        with saved_tensors.recompute_region("hpfunc.remat"):
            return f(*a, **kw)

    def body(*flat: Any) -> Any:
        runs[0] += 1
        if runs[0] == 1:
            return run(*flat)
        return forward_context.copy().run(run, *flat)

    rec = current_recorder()
    if rec is not None:
        # The region keeps its inputs for the recompute (torch.utils.checkpoint stores them as saved
        # tensors under the layers active here, so an enclosing offload moves them).
        for x in leaves:
            if isinstance(x, torch.Tensor):
                rec.note(x, kind="remat_input", name=scope.name_of(x))
    if pol.saves_nothing:
        return checkpoint(body, *leaves, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return checkpoint(body, *leaves, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                      context_fn=_sac_context(pol, memory_kind))


def saved_activations(fn: Callable, *args: Any, policy: Any = None, state_argnums: Any = (), **kwargs: Any) -> Any:
    """:func:`hpfunc.memory.saved_activations` of ``remat(fn, policy=policy)`` (of ``fn`` when ``policy`` is
    ``None``), the report labelled with the policy: what a remat policy keeps alive.

    >>> import torch
    >>> r = saved_activations(lambda x: x.sin().sin().sum(), torch.ones(256), policy=nothing_saveable)
    >>> r.policy, r.device_bytes
    ('nothing_saveable', 1024)
    """
    from hpfunc.memory import saved_activations as measure

    if policy is None:
        return measure(fn, *args, state_argnums=state_argnums, **kwargs)
    return measure(remat(fn, policy=policy), *args, state_argnums=state_argnums, label=str(as_policy(policy)),
                   **kwargs)
