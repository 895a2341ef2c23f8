"""Ready-made optimizers: ``adamw``, ``muon`` and the ``muon_adamw`` split."""

from __future__ import annotations

from typing import Any, Callable

import torch

from hpfunc.optim.adam import scale_by_adam
from hpfunc.optim.base import GradientTransformation
from hpfunc.optim.combine import chain, partition
from hpfunc.optim.muon import NS_COEFFICIENTS, MuonScaling, scale_by_muon
from hpfunc.optim.scale import ScalarOrSchedule, scale_by_learning_rate
from hpfunc.optim.weight_decay import add_decayed_weights

__all__ = ["adamw", "muon", "ADAMW_PATH_KEYWORDS", "ADAMW_PATH_COMPONENTS", "use_adamw", "muon_adamw"]


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    eps_root: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019) with the semantics of ``torch.optim.AdamW``.

    ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(lr))``, i.e. per step ``t`` (1-based) with ``lr_t = lr(t - 1)``::

        param <- param - lr_t * weight_decay * param - lr_t * m_hat / (sqrt(v_hat) + eps)

    Bias correction and the scheduled rate on the decay term are as in torch (a ``LambdaLR`` whose
    lambda returns ``lr(step) / base_lr``, stepped after each ``optimizer.step()``).

    Args:
      lr: learning rate, a float or a schedule ``step -> float`` (see ``hpfunc.optim.schedules``).
      b1, b2: moment decays.
      eps: denominator epsilon (outside the square root, as in torch).
      weight_decay: decoupled decay coefficient (torch's default 1e-2).
      eps_root: epsilon inside the square root (0 in torch).
      mask: which leaves to decay (a tree of bools, or a callable; see :func:`masked`).

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"w": torch.ones(3)}
        >>> tx = optim.adamw(1e-1, weight_decay=0.0)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 0.9000, 0.9000])
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
    )


def muon(
    lr: ScalarOrSchedule,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    *,
    scaling: MuonScaling = "sqrt_aspect",
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Muon (Jordan et al., 2024): orthogonalised momentum for 2-D (and stacked 3-D) weights.

    ``chain(scale_by_muon(...), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``::

        param <- param - lr_t * weight_decay * param - lr_t * scale * NS5(nesterov(momentum(g)))

    Every leaf must be a matrix ``[rows, cols]`` or a stack ``[n, rows, cols]``; anything else raises
    an error naming its path. Use :func:`muon_adamw` (or :func:`partition`) for a whole model.
    See :func:`scale_by_muon` for the arguments and the DTensor support.

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"w": torch.zeros(4, 8)}
        >>> tx = optim.muon(0.02)
        >>> updates, state = tx.update({"w": torch.randn(4, 8)}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"].shape
        torch.Size([4, 8])
    """
    return chain(
        scale_by_muon(
            momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            ns_dtype=ns_dtype,
            scaling=scaling,
        ),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )


ADAMW_PATH_KEYWORDS = ("embed", "lm_head", "norm", "router")
"""A leaf whose dotted path contains one of these goes to AdamW in :func:`muon_adamw`."""

ADAMW_PATH_COMPONENTS = ("gate", "head", "output", "bias")
"""A leaf with one of these as a whole path component goes to AdamW (``mlp.gate`` is the Qwen3-MoE
router in the Hugging Face layout; ``gate_proj`` is not matched)."""


def use_adamw(path: str, leaf: torch.Tensor) -> bool:
    """The default routing of :func:`muon_adamw`: True for leaves that AdamW should update.

    AdamW takes embeddings, norms, the router, the output head, biases and every leaf that is not a
    matrix or a stack of matrices (``ndim`` not 2 or 3); Muon takes the rest (hidden matrices and
    stacked expert weights ``[E, out, in]``).

    >>> import torch
    >>> use_adamw("layers.0.attn.wq", torch.zeros(4, 4)), use_adamw("embed_tokens", torch.zeros(9, 4))
    (False, True)
    >>> use_adamw("layers.0.mlp.gate", torch.zeros(8, 4)), use_adamw("layers.0.mlp.gate_proj", torch.zeros(8, 4))
    (True, False)
    """
    if leaf.ndim not in (2, 3):
        return True
    lowered = path.lower()
    if any(k in lowered for k in ADAMW_PATH_KEYWORDS):
        return True
    return any(c in ADAMW_PATH_COMPONENTS for c in lowered.split("."))


def muon_adamw(
    lr: ScalarOrSchedule,
    *,
    adamw_lr: ScalarOrSchedule | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    scaling: MuonScaling = "sqrt_aspect",
    ns_dtype: torch.dtype | None = None,
    adamw_b1: float = 0.9,
    adamw_b2: float = 0.95,
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    adamw_when: Callable[[str, torch.Tensor], bool] = use_adamw,
) -> GradientTransformation:
    """Muon for hidden matrices, AdamW for everything else, routed by path.

    ``partition({"muon": muon(...), "adamw": adamw(...)}, labels)`` where a leaf is labelled
    ``"adamw"`` when ``adamw_when(path, leaf)`` is true (default :func:`use_adamw`: embeddings,
    norms, router, output head, biases and non-matrix leaves) and ``"muon"`` otherwise.

    Args:
      lr: Muon's learning rate (float or schedule).
      adamw_lr: AdamW's learning rate; defaults to ``lr`` (natural with
        ``scaling="match_adamw_rms"``; with the default scaling Muon usually wants a larger rate,
        e.g. 0.02 vs 3e-4).
      momentum, nesterov, ns_steps, scaling, ns_dtype: see :func:`scale_by_muon`.
      weight_decay: decoupled decay for Muon's leaves (and AdamW's unless ``adamw_weight_decay``).
      adamw_b1, adamw_b2, adamw_eps: AdamW's moment decays and epsilon.
      adamw_weight_decay: AdamW's decay; defaults to ``weight_decay``.
      adamw_when: ``(path, leaf) -> bool`` routing predicate; override to change the split.

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"embed": torch.randn(10, 4), "layers": [{"wq": torch.randn(4, 4)}],
        ...           "norm": torch.ones(4)}
        >>> tx = optim.muon_adamw(0.02, adamw_lr=3e-4)
        >>> state = tx.init(params)
        >>> grads = {k: v for k, v in params.items()}  # any tree shaped like params
        >>> updates, state = tx.update(grads, state, params)
        >>> sorted(state.inner_states)
        ['adamw', 'muon']
    """
    wd_adamw = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    transforms = {
        "muon": muon(
            lr, momentum, nesterov, ns_steps, weight_decay, scaling=scaling, ns_dtype=ns_dtype
        ),
        "adamw": adamw(lr if adamw_lr is None else adamw_lr, adamw_b1, adamw_b2, adamw_eps, wd_adamw),
    }

    def label(path: str, leaf: torch.Tensor) -> str:
        return "adamw" if adamw_when(path, leaf) else "muon"

    return partition(transforms, label)
