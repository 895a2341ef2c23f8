"""Tensor-parallel styles: how one parameter is split over the tensor-parallel axis, chosen by path.

The declarative counterpart of torch's ``parallelize_module`` for functional models: a mapping from
dotted parameter paths (globs such as ``layers.*.attn.wq``, or ``re:<regex>``; first match wins) to a
style, turned into a plan layer by ``hpfunc.transforms.plans.tp(axis, styles)``. A model's own table
lives beside the model (``hpfunc.models.qwen3.parallel_plan.tp_styles``); the styles themselves are core
vocabulary, so models declare their layout without importing any transform::

    plan = plans.fsdp("fsdp") + plans.tp("tp", {
        "w_in": ColwiseParallel(),    # [hidden, in]: output features split (dim 0)
        "b_in": ColwiseParallel(),    # [hidden]: split like the features it is added to
        "w_out": RowwiseParallel(),   # [out, hidden]: input features split (dim 1); the partial outputs
    })                                # are summed by the model (hpfunc.layout.reduce_partial)

A style only decides the parameter's layout (its storage, compute and optimizer specs); the model adds
the collectives that the layout implies through :mod:`hpfunc.layout` (``gather_sequence``,
``reduce_partial``, ``scatter_sequence``), which read the axis and the modes the step binds.

Weights are ``[out, in]`` as in ``nn.Linear``; a stacked-experts weight ``[E, out, in]`` keeps its
expert dimension whole (splitting experts is expert parallelism, another plan). ``unit``: the split
dimension is cut in whole units of that many elements, e.g. ``ColwiseParallel(unit=head_dim,
unit_name="heads")`` splits attention projections by whole heads (a degree that does not divide the
heads is a ``PlanError`` that counts them).

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

    >>> ColwiseParallel(unit=128).shard_dim(2), RowwiseParallel().shard_dim(3), Replicate().shard_dim(1)
    (0, 2, None)
"""

from __future__ import annotations

import attrs

__all__ = ["Style", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallel", "Replicate"]


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{type(instance).__name__}: {attribute.name} must be an integer >= 1, found {value!r}")


@attrs.frozen
class Style:
    """How one parameter is split over the tensor-parallel axis.

    ``unit``: the split dimension is cut in whole units of this many elements (1: any even split);
    ``unit_name``: what a unit is called in error messages (``"heads"``).
    """

    #: what the style accepts, for error messages
    accepts = "any tensor"
    unit: int = attrs.field(default=1, kw_only=True, validator=_positive)
    unit_name: str = attrs.field(default="units", kw_only=True)

    def shard_dim(self, ndim: int) -> int | None:
        """The dimension split over the axis for a parameter of rank ``ndim`` (``None``: replicated);
        raises ``ValueError`` for a rank the style does not apply to."""
        return None

    def _check_rank(self, ndim: int, allowed: tuple[int, ...]) -> None:
        if ndim not in allowed:
            raise ValueError(f"{type(self).__name__} expects {self.accepts}; found a tensor of rank {ndim}")


@attrs.frozen
class ColwiseParallel(Style):
    """Column parallel (Megatron): output features split, so each rank computes its slice of the output
    from the whole input. Weight ``[out, in]`` dim 0, bias ``[out]`` dim 0, experts ``[E, out, in]`` dim 1."""

    accepts = "a weight [out, in], a bias [out] or stacked experts [E, out, in]"

    def shard_dim(self, ndim: int) -> int | None:
        self._check_rank(ndim, (1, 2, 3))
        return 1 if ndim == 3 else 0


@attrs.frozen
class RowwiseParallel(Style):
    """Row parallel (Megatron): input features split, each rank's output is a partial sum that the model
    reduces. Weight ``[out, in]`` dim 1, experts ``[E, out, in]`` dim 2; a bias ``[out]`` stays replicated
    (the model adds it once, after the reduction)."""

    accepts = "a weight [out, in], a bias [out] or stacked experts [E, out, in]"

    def shard_dim(self, ndim: int) -> int | None:
        self._check_rank(ndim, (1, 2, 3))
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
    vocabulary-parallel lookup and cross-entropy of the model (the plan's ``tp_vocab_parallel``)."""

    accepts = "an embedding table or head [V, H]"

    def shard_dim(self, ndim: int) -> int | None:
        self._check_rank(ndim, (2,))
        return 0


@attrs.frozen
class Replicate(Style):
    """Replicated over the axis (gradients summed over it); useful to exempt a path from a later glob."""
