"""Optax-style optimizers: pure ``(init, update)`` transformations over pytrees of tensors.

Functions that mirror an optax one take optax's argument names in optax's positional order
(``adamw(learning_rate, b1, b2, eps, eps_root, ...)``, ``muon_adamw(learning_rate, ns_coeffs,
ns_steps, beta, eps, ...)``); each docstring, and the table in ``docs/optim.md``, says where the
semantics differ (torch's AdamW defaults, torch's clipping formula, Muon without bias correction in
torch's ``[out, in]`` orientation, ...). Build an optimizer from pieces or take a ready one, then run
it as pure functions::

    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule, weight_decay=0.1))
    state = tx.init(params)                           # a pytree of tensors (checkpointable)
    updates, state = tx.update(grads, state, params)  # nothing is mutated
    params = optim.apply_updates(params, updates)
    params, state = optim.update_and_apply(tx, grads, state, params)  # the same, fused where tx can

Paths are dotted strings (``layers.3.attn.wq``); errors name them. See ``docs/optim.md``.
"""

from hpfunc.optim import schedules
from hpfunc.optim.adam import ScaleByAdamState, scale_by_adam
from hpfunc.optim.alias import adamw, is_not_matrix, muon, muon_adamw
from hpfunc.optim.base import (
    EmptyState,
    FusedUpdate,
    GradientTransformation,
    OptState,
    Params,
    Updates,
    apply_updates,
    identity,
    streaming_state,
    update_and_apply,
)
from hpfunc.optim.clipping import clip_by_global_norm, global_norm
from hpfunc.optim.combine import MaskedState, PartitionState, chain, masked, partition
from hpfunc.optim.errors import OptimError, TreeMismatchError, UnknownLabelError, UnsupportedLeafError
from hpfunc.optim.muon import NS_COEFFICIENTS, ScaleByMuonState, muon_scale, newton_schulz, scale_by_muon
from hpfunc.optim.scale import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule, set_to_zero
from hpfunc.optim.schedules import constant, linear, linear_warmup_cosine_decay, warmup_stable_decay
from hpfunc.optim.weight_decay import add_decayed_weights

__all__ = [
    # contract
    "GradientTransformation",
    "EmptyState",
    "Params",
    "Updates",
    "OptState",
    "identity",
    "apply_updates",
    "update_and_apply",
    "streaming_state",
    "FusedUpdate",
    # building blocks
    "scale",
    "set_to_zero",
    "scale_by_schedule",
    "ScaleByScheduleState",
    "scale_by_learning_rate",
    "scale_by_adam",
    "ScaleByAdamState",
    "add_decayed_weights",
    "global_norm",
    "clip_by_global_norm",
    "scale_by_muon",
    "ScaleByMuonState",
    "newton_schulz",
    "muon_scale",
    "NS_COEFFICIENTS",
    # combinators
    "chain",
    "masked",
    "MaskedState",
    "partition",
    "PartitionState",
    # ready optimizers
    "adamw",
    "muon",
    "muon_adamw",
    "is_not_matrix",
    # schedules
    "schedules",
    "constant",
    "linear",
    "linear_warmup_cosine_decay",
    "warmup_stable_decay",
    # errors
    "OptimError",
    "TreeMismatchError",
    "UnknownLabelError",
    "UnsupportedLeafError",
]
