"""Tensor-parallel styles: how one parameter is split over the tensor-parallel axis, chosen by path.

The declarative counterpart of torch's ``parallelize_module`` for functional models: a mapping from
dotted parameter paths (globs such as ``layers.*.attn.wq``, or ``re:<regex>``; first match wins) to a
style, turned into a plan layer by :func:`hpfunc.transforms.plans.tp_styles`::

    from hpfunc.transforms import plans
    from hpfunc.transforms.styles import ColwiseParallel, RowwiseParallel

    plan = plans.fsdp("fsdp") + plans.tp_styles("tp", {
        "w_in": ColwiseParallel(),    # [hidden, in]: output features split (dim 0)
        "b_in": ColwiseParallel(),    # [hidden]: split like the features it is added to
        "w_out": RowwiseParallel(),   # [out, hidden]: input features split (dim 1); the partial outputs
    })                                # are summed by the model (hpfunc.models.parallel.reduce_partial)

A style only decides the parameter's layout (its storage, compute and optimizer specs, like
``plans.tp``); the model adds the collectives that the layout implies, through
:mod:`hpfunc.models.parallel` (``gather_sequence``, ``reduce_partial``, ``scatter_sequence``), which
read the axis and the modes that the step binds from the plan.

Weights are ``[out, in]`` as in ``nn.Linear``; a stacked-experts weight ``[E, out, in]`` keeps its
expert dimension whole (splitting experts is expert parallelism, another plan).

=====================  ===============================  =========================================
style                  parameter split                  activations (done by the model)
=====================  ===============================  =========================================
``ColwiseParallel``    ``[out, in]`` dim 0, bias dim 0,  input replicated (or gathered along the
                       ``[E, out, in]`` dim 1           sequence), output split by features
``RowwiseParallel``    ``[out, in]`` dim 1,             input split by features, partial output
                       ``[E, out, in]`` dim 2; a bias   summed (``psum``) or reduce-scattered
                       ``[out]`` stays replicated       along the sequence
``SequenceParallel``   replicated (norm weights)        input and output split along the sequence:
                                                        turns on sequence parallelism for the model
``VocabParallel``      ``[V, H]`` dim 0 (vocabulary)    masked lookup summed over the axis;
                                                        vocabulary-parallel cross-entropy
``Replicate``          replicated                       (stops later patterns from matching)
=====================  ===============================  =========================================

:func:`qwen3_styles` is the table behind ``plans.tp`` for :mod:`hpfunc.models.qwen3`.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Style", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallel", "Replicate",
           "qwen3_styles"]


class Style:
    """How one parameter is split over the tensor-parallel axis."""

    #: what the style accepts, for error messages
    accepts: str = "any tensor"

    def shard_dim(self, ndim: int) -> int | None:
        """The dimension split over the axis for a parameter of rank ``ndim`` (``None``: replicated);
        raises ``ValueError`` for a rank the style does not apply to."""
        return None


def _check_rank(style: Style, ndim: int, allowed: tuple[int, ...]) -> None:
    if ndim not in allowed:
        raise ValueError(f"{type(style).__name__} expects {style.accepts}; found a tensor of rank {ndim}")


@attrs.frozen
class ColwiseParallel(Style):
    """Column parallel (Megatron): output features split, so each rank computes its slice of the output
    from the whole input. Weight ``[out, in]`` dim 0, bias ``[out]`` dim 0, experts ``[E, out, in]`` dim 1."""

    accepts = "a weight [out, in], a bias [out] or stacked experts [E, out, in]"

    def shard_dim(self, ndim: int) -> int | None:
        _check_rank(self, ndim, (1, 2, 3))
        return 1 if ndim == 3 else 0


@attrs.frozen
class RowwiseParallel(Style):
    """Row parallel (Megatron): input features split, each rank's output is a partial sum that the model
    reduces. Weight ``[out, in]`` dim 1, experts ``[E, out, in]`` dim 2; a bias ``[out]`` stays replicated
    (the model adds it once, after the reduction)."""

    accepts = "a weight [out, in], a bias [out] or stacked experts [E, out, in]"

    def shard_dim(self, ndim: int) -> int | None:
        _check_rank(self, ndim, (1, 2, 3))
        return None if ndim == 1 else ndim - 1


@attrs.frozen
class SequenceParallel(Style):
    """A parameter used where activations are split along the sequence (Megatron-SP's norms): replicated
    over the axis, its gradient summed over it. Any ``SequenceParallel`` in a plan turns on sequence
    parallelism for the whole model (the plan's ``tp_sequence_parallel``): the residual stream between
    blocks is split along the sequence, gathered before each column-parallel block and reduce-scattered
    after each row-parallel one."""


@attrs.frozen
class VocabParallel(Style):
    """An embedding table or output head ``[V, H]`` split by vocabulary rows (dim 0). Turns on the
    vocabulary-parallel lookup and cross-entropy of :mod:`hpfunc.models.parallel` (the plan's
    ``tp_vocab_parallel``)."""

    accepts = "an embedding table or head [V, H]"

    def shard_dim(self, ndim: int) -> int | None:
        _check_rank(self, ndim, (2,))
        return 0


@attrs.frozen
class Replicate(Style):
    """Replicated over the axis (gradients summed over it); useful to exempt a path from a later glob."""


def qwen3_styles(*, vocab_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, Any]:
    """The Megatron styles for :mod:`hpfunc.models.qwen3`'s parameter paths (what ``plans.tp`` applies).

    >>> sorted(qwen3_styles(sequence_parallel=True))[:3]
    ['final_norm', 'layers.*.attn.b[qkv]', 'layers.*.attn.w[qkv]']
    """
    col, row = ColwiseParallel(), RowwiseParallel()
    styles: dict[str, Any] = {
        "layers.*.attn.w[qkv]": col,     # [heads * D, H]: split by heads
        "layers.*.attn.b[qkv]": col,
        "layers.*.attn.wo": row,         # [H, heads * D]
        "layers.*.w_gate": col,          # mlp, shared expert [I, H]; routed experts [E, I, H]
        "layers.*.w_up": col,
        "layers.*.w_down": row,          # [H, I]; routed experts [E, H, I]
    }
    if sequence_parallel:
        sp = SequenceParallel()
        styles.update({"layers.*.attn_norm": sp, "layers.*.mlp_norm": sp, "final_norm": sp})
    if vocab_parallel:
        styles.update({"embed": VocabParallel(), "lm_head": VocabParallel()})
    return styles
