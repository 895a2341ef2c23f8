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
import enum
import functools
import warnings
from typing import Any, Callable, Iterable

import optree
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hpfunc.memory import _record

__all__ = [
    "Decision", "Policy", "UnknownNameWarning", "remat", "checkpoint_name", "as_policy",
    "nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
    "save_only_these_names", "save_any_names_but_these", "save_and_offload_only_these_names",
    "save_from_both_policies", "checkpoint_policies",
]

aten = torch.ops.aten


class Decision(str, enum.Enum):
    """What happens to a value needed by backward."""

    SAVE = "save"  # kept in device memory
    RECOMPUTE = "recompute"  # dropped, recomputed in backward (inside remat); kept by offload()
    OFFLOAD = "offload"  # kept in host memory, brought back for backward


class UnknownNameWarning(UserWarning):
    """A policy names a value that no ``checkpoint_name`` in the function tagged."""


def _ops(*names: str) -> frozenset:
    found = []
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None:
            found.extend(getattr(packet, o) for o in packet.overloads())
    return frozenset(found)


# Contractions without batch dimensions (a linear layer's matmul lands on mm/addmm after the view).
_DOTS_NO_BATCH = _ops("mm", "addmm", "mv", "addmv", "dot", "vdot", "_int_mm", "_addmm_activation")
# Contractions with batch dimensions, and fused attention (two batched contractions per op).
_DOTS_BATCHED = _ops(
    "bmm", "baddbmm", "addbmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)
_DOTS = _DOTS_NO_BATCH | _DOTS_BATCHED


class Policy:
    """A remat/offload policy: ``decide(op, name, tensor) -> Decision``.

    Build one from a predicate ``fn(op, name, tensor)`` returning a bool (True = save) or a
    :class:`Decision`. ``op`` is the aten ``OpOverload`` (``torch.ops.aten.mm.default``), ``name`` the
    ``checkpoint_name`` tag or ``None``, ``tensor`` the op's output (the first output of a
    multi-output op such as fused attention). ``names`` lists the names the policy refers to (checked against the names
    actually tagged, see :class:`UnknownNameWarning`). ``needs_op`` says whether the policy looks
    at ``op`` (offload then tracks which op produced each saved tensor).
    """

    def __init__(self, fn: Callable[[Any, str | None, torch.Tensor], Any], *, label: str,
                 names: Iterable[str] = (), needs_op: bool = True, saves_everything: bool = False,
                 saves_nothing: bool = False) -> None:
        self.fn = fn
        self.label = label
        self.names = frozenset(names)
        self.needs_op = needs_op
        self.saves_everything = saves_everything
        self.saves_nothing = saves_nothing

    def decide(self, op: Any, name: str | None, tensor: torch.Tensor | None) -> Decision:
        d = self.fn(op, name, tensor)
        if isinstance(d, Decision):
            return d
        if isinstance(d, str):
            return Decision(d)
        return Decision.SAVE if d else Decision.RECOMPUTE

    def __call__(self, op: Any, name: str | None, tensor: torch.Tensor | None) -> Decision:
        return self.decide(op, name, tensor)

    def __repr__(self) -> str:
        return self.label


def as_policy(policy: Any) -> Policy:
    """``None`` -> :data:`nothing_saveable`; a :class:`Policy` as is; a callable ``(op, name, tensor)`` wrapped."""
    if policy is None:
        return nothing_saveable
    if isinstance(policy, Policy):
        return policy
    if callable(policy):
        return Policy(policy, label=getattr(policy, "__name__", repr(policy)))
    raise TypeError(f"remat policy: expected None, a Policy or a callable (op, name, tensor) -> bool, "
                    f"found {type(policy).__name__}")


nothing_saveable = Policy(lambda op, name, t: False, label="nothing_saveable", needs_op=False, saves_nothing=True)
"""Full recompute: only the region's inputs are kept."""

everything_saveable = Policy(lambda op, name, t: True, label="everything_saveable", needs_op=False,
                             saves_everything=True)
"""No recompute: the region runs as if not wrapped (what autograd saves, it keeps)."""

dots_saveable = Policy(lambda op, name, t: op in _DOTS, label="dots_saveable")
"""Save the outputs of matmuls and fused attention; recompute the rest (norms, activations...)."""

dots_with_no_batch_dims_saveable = Policy(lambda op, name, t: op in _DOTS_NO_BATCH,
                                          label="dots_with_no_batch_dims_saveable")
"""Save linear-layer matmul outputs only; attention (batched contractions) is recomputed."""


def _names(names: tuple) -> frozenset:
    flat = []
    for n in names:
        if isinstance(n, str):
            flat.append(n)
        else:
            flat.extend(n)
    for n in flat:
        if not isinstance(n, str):
            raise TypeError(f"checkpoint names must be strings, found {n!r}")
    return frozenset(flat)


def save_only_these_names(*names: str) -> Policy:
    """Save the values tagged with one of ``names``; recompute everything else."""
    keep = _names(names)
    return Policy(lambda op, name, t: name in keep, label=f"save_only_these_names{tuple(sorted(keep))}",
                  names=keep, needs_op=False)


def save_any_names_but_these(*names: str) -> Policy:
    """Save every tagged value except those tagged with one of ``names``; recompute untagged values."""
    drop = _names(names)
    return Policy(lambda op, name, t: name is not None and name not in drop,
                  label=f"save_any_names_but_these{tuple(sorted(drop))}", names=drop, needs_op=False)


def save_and_offload_only_these_names(*, names_which_can_be_saved: Iterable[str] = (),
                                      names_which_can_be_offloaded: Iterable[str] = ()) -> Policy:
    """Keep ``names_which_can_be_saved`` on device, move ``names_which_can_be_offloaded`` to host,
    recompute everything else (JAX's selective activation swap)."""
    save, off = frozenset(names_which_can_be_saved), frozenset(names_which_can_be_offloaded)
    both = save & off
    if both:
        raise ValueError(f"save_and_offload_only_these_names: {sorted(both)} listed both to save and to offload")

    def decide(op: Any, name: str | None, t: Any) -> Decision:
        if name in save:
            return Decision.SAVE
        if name in off:
            return Decision.OFFLOAD
        return Decision.RECOMPUTE

    return Policy(decide, label=f"save_and_offload_only_these_names(save={sorted(save)}, offload={sorted(off)})",
                  names=save | off, needs_op=False)


def save_from_both_policies(a: Any, b: Any) -> Policy:
    """Save what either policy saves (offload wins over recompute, save wins over offload)."""
    pa, pb = as_policy(a), as_policy(b)
    rank = {Decision.RECOMPUTE: 0, Decision.OFFLOAD: 1, Decision.SAVE: 2}

    def decide(op: Any, name: str | None, t: Any) -> Decision:
        return max(pa.decide(op, name, t), pb.decide(op, name, t), key=rank.__getitem__)

    return Policy(decide, label=f"save_from_both_policies({pa}, {pb})", names=pa.names | pb.names,
                  needs_op=pa.needs_op or pb.needs_op)


class checkpoint_policies:  # noqa: N801 - mirrors ``jax.checkpoint_policies``
    """Namespace with JAX's policy names (``checkpoint_policies.dots_saveable`` ...)."""

    nothing_saveable = nothing_saveable
    everything_saveable = everything_saveable
    dots_saveable = dots_saveable
    dots_with_no_batch_dims_saveable = dots_with_no_batch_dims_saveable
    save_only_these_names = staticmethod(save_only_these_names)
    save_any_names_but_these = staticmethod(save_any_names_but_these)
    save_and_offload_only_these_names = staticmethod(save_and_offload_only_these_names)
    save_from_both_policies = staticmethod(save_from_both_policies)


# ---------------------------------------------------------------------------------------------
# checkpoint_name

_TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("hpfunc_checkpoint_name", default=None)
# Which transform's saved-tensor handling is innermost here: "remat" inside a recomputed region
# (torch.utils.checkpoint's hooks own saved tensors), "offload" inside an offload region.
INNERMOST: contextvars.ContextVar[str | None] = contextvars.ContextVar("hpfunc_innermost_transform", default=None)


def current_tag() -> str | None:
    """The name being tagged right now (set only while ``checkpoint_name`` dispatches its alias)."""
    return _TAG.get()


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
    scope = _record.current_scope()

    def tag(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        token = _TAG.set(name)
        try:
            y = aten.alias.default(t)
        finally:
            _TAG.reset(token)
        if scope is not None:
            scope.record(name, y)
        return y

    return optree.tree_map(tag, x, none_is_leaf=False)


# ---------------------------------------------------------------------------------------------
# Selective checkpoint glue


def _op_name(op: Any) -> str:
    return str(op)


def _first_tensor(out: Any) -> Any:
    # Policies see one tensor: the output, or the first one of a multi-output op (SDPA's output).
    if isinstance(out, torch.Tensor):
        return out
    ts = _record.tensors_in(out)
    return ts[0] if ts else None


@functools.lru_cache(maxsize=None)
def _never_cache(op: Any) -> bool:
    # Collectives and other in-place ops write their buffers; caching them would let a recompute
    # mutate (or reduce again) a cached value.
    try:
        return op._schema.is_mutable or op.namespace == "c10d"
    except AttributeError:
        return False


class _Slots(dict):
    """SAC storage for one op: intercepts cache writes to apply offload decisions and record bytes."""

    def __init__(self, pending: list, recorder: Any, offloader: Any) -> None:
        super().__init__()
        self._pending, self._recorder, self._offloader = pending, recorder, offloader

    def __setitem__(self, idx: int, value: Any) -> None:
        if self._pending:  # a forward-time write (backward marks entries consumed with nothing pending)
            decision, name, op, index = self._pending.pop()
            if decision is not Decision.RECOMPUTE:
                value = self._keep(value, decision, name, op)
                for t in _record.tensors_in([getattr(v, "val", None) for v in _wrappers(value)]):
                    index.setdefault(_record.storage_key(t), []).append((self, idx))
        super().__setitem__(idx, value)

    def evict(self, idx: int) -> None:
        from torch.utils.checkpoint import _RECOMPUTE

        super().__setitem__(idx, _RECOMPUTE)

    def _keep(self, value: Any, decision: Decision, name: str | None, op: Any) -> Any:
        from torch.utils._pytree import tree_map

        def one(w: Any) -> Any:
            val = getattr(w, "val", None)
            if not isinstance(val, torch.Tensor):
                return w
            if decision is Decision.OFFLOAD:
                return self._offloader.cache_entry(w, name=name, op=_op_name(op))
            if self._recorder is not None:
                self._recorder.record(val, kind="cached", where="device", name=name, op=_op_name(op))
            return w

        return tree_map(one, value)


def _wrappers(value: Any) -> list:
    from torch.utils._pytree import tree_leaves

    return [v for v in tree_leaves(value) if hasattr(v, "get_val")]


class _Storage(dict):
    def __init__(self, pending: list, recorder: Any, offloader: Any) -> None:
        super().__init__()
        self._args = (pending, recorder, offloader)

    def __missing__(self, key: Any) -> _Slots:
        slots = _Slots(*self._args)
        self[key] = slots
        return slots


def _sac_context(policy: Policy, offload_options: dict) -> Callable[[], tuple]:
    def context_fn() -> tuple:
        pending: list = []
        recorder = _record.current_recorder()
        cached_by_storage: dict[int, list] = {}

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            name = _TAG.get() if op is aten.alias.default else None
            if _never_cache(op):
                decision = Decision.RECOMPUTE
                # An in-place op (a collective's all_reduce_) just changed tensors that may be
                # cached; the recompute replays that op, so those must be recomputed too, or the
                # replay would apply it twice (a cached buffer reduced again).
                for t in _record.tensors_in((args, kwargs)):
                    for slots, idx in cached_by_storage.pop(_record.storage_key(t), ()):
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
                f"(torch {torch.__version__}); the cache hook that applies offload decisions and reports "
                "cached bytes needs updating for this torch version")
        from hpfunc.transforms.offload import CacheOffloader

        offloader = CacheOffloader(recorder=recorder, **offload_options)
        storage = _Storage(pending, recorder, offloader)
        # Both modes share one storage dict (torch creates them that way); ours applies offload.
        caching.storage = storage
        cached.storage = storage
        return caching, cached

    return context_fn


def _warn_unknown(policy: Policy, scope: _record.NameScope, fn: Callable) -> None:
    missing = policy.names - scope.names
    if missing:
        known = ", ".join(sorted(scope.names)) or "none"
        warnings.warn(
            f"remat/offload policy {policy} refers to {sorted(missing)} but no checkpoint_name in "
            f"{getattr(fn, '__qualname__', fn)} tagged them; names tagged: {known}",
            UnknownNameWarning, stacklevel=3)


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
    offload_options = {"memory_kind": memory_kind}

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _record.name_scope() as scope:
            if pol.saves_everything or not torch.is_grad_enabled():
                out = f(*args, **kwargs)
            else:
                out = _run_checkpointed(f, pol, offload_options, preserve_rng_state, args, kwargs)
        _warn_unknown(pol, scope, f)
        return out

    wrapped.policy = pol  # type: ignore[attr-defined]
    return wrapped


def _run_checkpointed(f: Callable, pol: Policy, offload_options: dict, preserve_rng_state: bool,
                      args: tuple, kwargs: dict) -> Any:
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    # The recompute runs inside backward, where the forward's context variables (current mesh of a
    # shard_map, comm accounting, ...) are not set, possibly on another thread: replay it in a copy
    # of the forward's context.
    forward_context = contextvars.copy_context()
    runs = [0]

    def run(*flat: Any) -> Any:
        a, kw = optree.tree_unflatten(spec, list(flat))
        token = INNERMOST.set("remat")
        try:
            return f(*a, **kw)
        finally:
            INNERMOST.reset(token)

    def body(*flat: Any) -> Any:
        runs[0] += 1
        if runs[0] == 1:
            return run(*flat)
        return forward_context.copy().run(run, *flat)

    rec = _record.current_recorder()
    if rec is not None:
        # The region keeps its inputs for the recompute (torch.utils.checkpoint stores them as saved
        # tensors under the hooks active here, so an enclosing offload moves them).
        scope = _record.current_scope()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                rec.record(x, kind="remat_input", where="device", name=scope.name_of(x) if scope else None)
    if pol.saves_nothing:
        return checkpoint(body, *leaves, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return checkpoint(body, *leaves, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                      context_fn=_sac_context(pol, offload_options))
