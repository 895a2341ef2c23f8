"""Policies: what a transform does with each value backward needs -- keep it, recompute it, or move it
to host memory.

A :class:`Policy` answers ``decide(op, name, tensor) -> Decision`` for one value: ``op`` is the aten
op that produced it, ``name`` its ``checkpoint_name`` tag (or ``None``), ``tensor`` the value. The
same policies drive :func:`hpfunc.transforms.remat.remat` (which saves or recomputes op outputs, and
may offload cached ones) and :func:`hpfunc.transforms.offload.offload` (which offloads saved tensors
or keeps them). The names are JAX's (``jax.checkpoint_policies``); ``remat`` and ``offload`` re-export
the ones they document.

    >>> import torch
    >>> pol = save_and_offload_only_these_names(names_which_can_be_saved=["q"],
    ...                                         names_which_can_be_offloaded=["mlp_hidden"])
    >>> [pol.decide(None, n, None).value for n in ("q", "mlp_hidden", None)]
    ['save', 'offload', 'recompute']
    >>> offload_dots().decide(torch.ops.aten.mm.default, None, None) is Decision.OFFLOAD
    True
"""

from __future__ import annotations

import enum
import warnings
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "Decision", "Policy", "UnknownNameWarning", "as_policy", "warn_unknown_names",
    "nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
    "save_only_these_names", "save_any_names_but_these", "save_and_offload_only_these_names",
    "save_from_both_policies", "checkpoint_policies",
    "offload_everything", "offload_only_these_names", "offload_dots", "as_offload_policy",
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


def warn_unknown_names(policy: Policy, tagged: set, fn: Callable, *, stacklevel: int = 3) -> None:
    """Warn (:class:`UnknownNameWarning`) if ``policy`` names values that no ``checkpoint_name`` in
    ``fn`` tagged (``tagged``: the names that were tagged)."""
    missing = policy.names - tagged
    if missing:
        known = ", ".join(sorted(tagged)) or "none"
        warnings.warn(
            f"remat/offload policy {policy} refers to {sorted(missing)} but no checkpoint_name in "
            f"{getattr(fn, '__qualname__', fn)} tagged them; names tagged: {known}",
            UnknownNameWarning, stacklevel=stacklevel + 1)


# ---------------------------------------------------------------------------------------------
# Offload policies: OFFLOAD moves a saved tensor to host memory, anything else keeps it on device


offload_everything = Policy(lambda op, name, t: Decision.OFFLOAD, label="offload_everything", needs_op=False)
"""Whole-layer swap: every saved tensor goes to host memory."""


def offload_only_these_names(*names: str) -> Policy:
    """Offload the saved tensors tagged with one of ``names``; keep the rest on device."""
    keep = _names(names)
    return Policy(lambda op, name, t: Decision.OFFLOAD if name in keep else Decision.SAVE,
                  label=f"offload_only_these_names{tuple(sorted(keep))}", names=keep, needs_op=False)


def offload_dots() -> Policy:
    """Offload saved outputs of matmuls and fused attention; keep the rest on device."""
    return Policy(lambda op, name, t: Decision.OFFLOAD if op in _DOTS else Decision.SAVE, label="offload_dots")


def as_offload_policy(policy: Any) -> Policy:
    """``None`` -> :data:`offload_everything`; a :class:`Policy` as is (its ``OFFLOAD`` decisions move);
    a predicate ``(op, name, tensor) -> bool`` wrapped with True = offload."""
    if policy is None:
        return offload_everything
    if isinstance(policy, Policy):
        return policy
    if callable(policy):
        user = policy
        return Policy(lambda op, name, t: Decision.OFFLOAD if user(op, name, t) else Decision.SAVE,
                      label=getattr(user, "__name__", repr(user)))
    raise TypeError(f"offload policy: expected None, a Policy or a callable (op, name, tensor) -> bool, "
                    f"found {type(policy).__name__}")
