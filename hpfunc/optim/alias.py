"""Ready-made optimizers: ``adamw``, ``muon`` and the ``muon_adamw`` split.

Argument names and positional order follow optax (``optax.adamw``, ``optax.contrib.muon``); where
the semantics differ the docstrings say so, and ``docs/optim.md`` has the table.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hpfunc.optim.adam import scale_by_adam
from hpfunc.optim.adamw_apply import adamw_apply
from hpfunc.optim.base import FusedUpdate, GradientTransformation
from hpfunc.optim.combine import chain, partition
from hpfunc.optim.muon import NS_COEFFICIENTS, scale_by_muon
from hpfunc.optim.scale import ScalarOrSchedule, scale_by_learning_rate
from hpfunc.optim.weight_decay import add_decayed_weights

__all__ = ["adamw", "muon", "is_not_matrix", "muon_adamw"]


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    weight_decay: float = 1e-2,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019) with the semantics of ``torch.optim.AdamW``.

    ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, i.e. per step ``t`` (1-based) with
    ``lr_t = learning_rate(t - 1)``::

        param <- param - lr_t * weight_decay * param - lr_t * m_hat / (sqrt(v_hat) + eps)

    Bias correction, ``eps`` outside the square root and the scheduled rate on the decay term are as
    in torch (a ``LambdaLR`` whose lambda returns ``learning_rate(step) / base_lr``, stepped after
    each ``optimizer.step()``) and as in ``optax.adamw``, which builds the same chain. Differences
    from ``optax.adamw``: ``weight_decay`` defaults to torch's 1e-2 (optax: 1e-4) and must be a
    float (optax also takes a schedule); ``weight_decay`` and ``mask`` are keyword-only, because
    optax's sixth positional argument, ``mu_dtype``, does not exist here (moments are fp32); no
    ``nesterov``.

    Args:
      learning_rate: a float or a schedule ``step -> float`` (see ``hpfunc.optim.schedules``).
      b1, b2: moment decays.
      eps: denominator epsilon (outside the square root, as in torch and optax).
      eps_root: epsilon inside the square root (0 in torch).
      weight_decay: decoupled decay coefficient, multiplied by the (scheduled) learning rate.
      mask: which leaves to decay (a tree of bools, or a callable; see :func:`masked`).

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"w": torch.ones(3)}
        >>> tx = optim.adamw(learning_rate=1e-1, weight_decay=0.0)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 0.9000, 0.9000])
    """
    tx = chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
    apply = adamw_apply(tx.update, b1=float(b1), b2=float(b2), eps=float(eps), eps_root=float(eps_root),
                        weight_decay=float(weight_decay), mask=mask, learning_rate=learning_rate)
    return GradientTransformation(tx.init, FusedUpdate(tx.update, apply))


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-7,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    *,
    nesterov: bool = True,
    consistent_rms: float | None = None,
    ns_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Muon (Jordan et al., 2024) alone: orthogonalised momentum for 2-D (and stacked 3-D) weights.

    ``chain(scale_by_muon(...), add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``::

        param <- param - lr_t * weight_decay * param - lr_t * scale * NS5(nesterov(momentum(g)))

    Every leaf must be a matrix ``[rows, cols]`` or a stack ``[n, rows, cols]``; anything else raises
    an error naming its path. Use :func:`muon_adamw` (or :func:`partition`) for a whole model.

    This is ``torch.optim.Muon(params, lr=learning_rate, weight_decay=weight_decay, momentum=beta,
    nesterov=nesterov, ns_coefficients=ns_coeffs, eps=eps, ns_steps=ns_steps)`` with
    ``adjust_lr_fn="original"`` (``consistent_rms=None``) or ``"match_rms_adamw"``
    (``consistent_rms=0.2``), except that torch always iterates in bf16 (here: ``ns_dtype``, fp32
    by default), clamps the norm (``max(norm, eps)``) where this adds ``eps``, takes only 2-D
    parameters, and defaults to ``lr=1e-3, weight_decay=0.1``. The arguments are those of
    ``optax.contrib.muon``'s Muon half, in its positional order; that function is
    :func:`muon_adamw` here. See :func:`scale_by_muon` for the differences from optax.

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"w": torch.zeros(4, 8)}
        >>> tx = optim.muon(learning_rate=0.02, beta=0.95)
        >>> updates, state = tx.update({"w": torch.randn(4, 8)}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"].shape
        torch.Size([4, 8])
    """
    return chain(
        scale_by_muon(ns_coeffs, ns_steps, beta, eps, nesterov=nesterov, consistent_rms=consistent_rms,
                      ns_dtype=ns_dtype),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(learning_rate),
    )


def is_not_matrix(path: str, leaf: torch.Tensor) -> bool:
    """The default routing of :func:`muon_adamw`: True (AdamW) unless ``leaf`` is a matrix
    ``[rows, cols]`` or a stack of matrices ``[n, rows, cols]`` (Muon). The path is not read.

    This is optax.contrib.muon's rule (Muon for 2-D leaves) extended to stacks. It cannot know which
    matrices a model wants under AdamW (embeddings, output head, router): a model supplies its own
    predicate, e.g. ``hpfunc.models.qwen3.parallel_plan.adamw_when``.

    >>> import torch
    >>> is_not_matrix("wq", torch.zeros(4, 4)), is_not_matrix("experts", torch.zeros(2, 4, 4))
    (False, False)
    >>> is_not_matrix("norm", torch.zeros(4)), is_not_matrix("conv", torch.zeros(2, 2, 3, 3))
    (True, True)
    """
    del path
    return leaf.ndim not in (2, 3)


def muon_adamw(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-7,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    *,
    nesterov: bool = True,
    consistent_rms: float | None = None,
    ns_dtype: torch.dtype | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float | None = None,
    adam_learning_rate: ScalarOrSchedule | None = None,
    adamw_when: Callable[[str, torch.Tensor], bool] = is_not_matrix,
) -> GradientTransformation:
    """Muon for matrices, AdamW for the rest: hpfunc's ``optax.contrib.muon``.

    ``partition({"muon": muon(...), "adamw": adamw(...)}, labels)`` where a leaf is labelled
    ``"adamw"`` when ``adamw_when(path, leaf)`` is true and ``"muon"`` otherwise. The default,
    :func:`is_not_matrix`, looks at the leaf only: every matrix and stack of matrices goes to Muon,
    embeddings and output heads included. A model should pass its own routing, e.g.
    ``adamw_when=hpfunc.models.qwen3.parallel_plan.adamw_when`` (embeddings, norms, router, head and
    biases to AdamW).

    Arguments are optax.contrib.muon's, in its positional order, with these differences:
    ``eps`` is Muon's only (default 1e-7) and AdamW has its own ``adam_eps`` (optax shares one
    ``eps``, default 1e-8); ``adam_b2`` defaults to 0.95 (optax: 0.999); ``adam_weight_decay``
    defaults to ``weight_decay`` (optax: 0.0); ``weight_decay_mask`` applies to both halves (optax:
    to Muon's leaves only); routing is a predicate (optax: ``muon_weight_dimension_numbers``) and
    3-D leaves go to Muon as stacks (optax: to Adam unless dimension numbers are given); the shape
    factor assumes torch's ``[out, in]`` orientation (see :func:`muon_scale`); no ``mu_dtype``,
    ``adaptive`` or ``preconditioning``.

    Args:
      learning_rate: Muon's learning rate (float or schedule).
      ns_coeffs, ns_steps, beta, eps, nesterov, consistent_rms, ns_dtype: see :func:`scale_by_muon`.
      weight_decay: decoupled decay for Muon's leaves (and AdamW's unless ``adam_weight_decay``).
      weight_decay_mask: which leaves to decay, in both halves (see :func:`masked`).
      adam_b1, adam_b2, adam_eps, adam_eps_root: AdamW's moment decays and epsilons.
      adam_weight_decay: AdamW's decay; defaults to ``weight_decay``.
      adam_learning_rate: AdamW's learning rate; defaults to ``learning_rate`` (natural with
        ``consistent_rms=0.2``; with the default width scaling Muon usually wants a larger rate,
        e.g. 0.02 vs 3e-4).
      adamw_when: ``(path, leaf) -> bool`` routing predicate.

    Example:
        >>> import torch
        >>> from hpfunc import optim
        >>> params = {"embed": torch.randn(10, 4), "layers": [{"wq": torch.randn(4, 4)}],
        ...           "norm": torch.ones(4)}
        >>> tx = optim.muon_adamw(0.02, adam_learning_rate=3e-4,
        ...                       adamw_when=lambda path, x: path == "embed" or x.ndim != 2)
        >>> state = tx.init(params)
        >>> grads = {k: v for k, v in params.items()}  # any tree shaped like params
        >>> updates, state = tx.update(grads, state, params)
        >>> sorted(state.inner_states)
        ['adamw', 'muon']
    """
    if not callable(adamw_when):
        raise TypeError(
            f"muon_adamw: adamw_when must be a callable (path, leaf) -> bool, got {type(adamw_when).__name__}"
        )
    wd_adam = weight_decay if adam_weight_decay is None else adam_weight_decay
    transforms = {
        "muon": muon(learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, weight_decay_mask,
                     nesterov=nesterov, consistent_rms=consistent_rms, ns_dtype=ns_dtype),
        "adamw": adamw(learning_rate if adam_learning_rate is None else adam_learning_rate, adam_b1, adam_b2,
                       adam_eps, adam_eps_root, weight_decay=wd_adam, mask=weight_decay_mask),
    }

    def label(path: str, leaf: torch.Tensor) -> str:
        return "adamw" if adamw_when(path, leaf) else "muon"

    return partition(transforms, label)
