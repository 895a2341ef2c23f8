"""The ``cp`` plan layer: each sequence split over context-parallel ranks.

``plans.cp(axis, impl="ring")`` (the factory in :mod:`hpfunc.transforms.plans`) makes one small class with the
interface every plan layer is to have (DESIGN.md, "plan layers, one class per parallelism"):

* what it does to each parameter's layout: nothing; parameters are replicated over the cp axes (their
  gradients, partial per rank, are summed over them like any replica's); another layer on a cp axis is
  refused (give fsdp its own axis: ``fsdp("fsdp") + cp("cp")``);
* what it checks against the mesh (:meth:`ContextParallelLayer.check_mesh`) and the batch
  (:meth:`ContextParallelLayer.check_batch`, before any communication);
* which axes it adds: :attr:`token_axes`, over which batch statistics (the loss's token count, the MoE
  load) are pooled; the batch's dimension 0 is *not* split over them, and the loss is the same on every
  rank of the cp axes (the global token mean), so the gradient seed counts them as replicas;
* the binding it gives the step: a :class:`hpfunc.layout.ContextParallel`, read by the model's hooks
  (for Qwen3 :func:`hpfunc.models.qwen3.layout_ops.context_split`), which take this rank's tokens of every
  sequence (balanced chunks, padded), their positions and labels, and call
  :func:`hpfunc.models.context_attention.context_attention` in each attention layer.

    >>> layer = ContextParallelLayer(ContextParallel("cp", impl="ring"))
    >>> layer.token_axes, layer.describe()
    (('cp',), "cp('cp', impl='ring')")
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from hpfunc import tree as _tree
from hpfunc.layout import ContextParallel, PlanError

__all__ = ["ContextParallelLayer"]


@attrs.frozen
class ContextParallelLayer:
    """A plan's context-parallel layer (see the module docstring); ``binding`` is what the step binds."""

    binding: ContextParallel

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes each sequence's tokens are split over."""
        return self.binding.axes

    def describe(self) -> str:
        b = self.binding
        extra = "".join(f", {k}={getattr(b, k)!r}" for k in ("ulysses_axis", "balanced", "pad", "replicate_kv",
                                                               "overlap")
                        if getattr(b, k) != attrs.fields_dict(ContextParallel)[k].default)
        return f"cp({b.axis!r}, impl={b.impl!r}{extra})"

    def check_mesh(self, mesh: Any, other_axes: dict[str, str]) -> None:
        """Every cp axis is a mesh axis that no other layer of the plan uses (``other_axes``: axis -> kind)."""
        for a in self.token_axes:
            if a not in mesh.axis_names:
                raise PlanError(f"plan layer {self.describe()} names mesh axis {a!r}, which the mesh does not "
                                f"have; mesh axes are {mesh.axis_names}")
            if a in other_axes:
                raise PlanError(f"mesh axis {a!r} is used by both {other_axes[a]} and cp; give context "
                                f"parallelism its own axis (e.g. mesh {{fsdp: 2, cp: 2}}, plan fsdp + cp)")

    def check_batch(self, batch: Any, mesh: Any, sequence_parallel: str | None = None) -> None:
        """A :class:`PlanError` naming the leaf, before any communication, for a batch leaf of rank >= 2
        whose dimension 1 (the sequence) does not split: without padding into ``2 P`` chunks; with a
        sequence-parallel axis ``sequence_parallel`` (Megatron-SP inside each cp rank), each cp rank's
        tokens (two chunks of the padded sequence) over it."""
        n = mesh.axis_size(self.token_axes)
        for path, x in _tree.leaves_with_paths(batch):
            if not (isinstance(x, torch.Tensor) and x.ndim >= 2):
                continue
            if not self.binding.pad and x.shape[1] % (2 * n):
                raise PlanError(
                    f"batch leaf {path!r} of shape {tuple(x.shape)}: {self.describe()} splits dimension 1 (the "
                    f"sequence, {x.shape[1]} tokens) into 2 x {n} chunks over {self.token_axes} ({n} ranks); use a "
                    f"sequence length that is a multiple of {2 * n}, or pad=True")
            if sequence_parallel is not None:
                k = mesh.axis_size(sequence_parallel)
                local = 2 * -(-x.shape[1] // (2 * n))
                if local % k:
                    raise PlanError(
                        f"batch leaf {path!r} of shape {tuple(x.shape)}: each of the {n} ranks of {self.describe()} "
                        f"holds {local} tokens of the padded sequence, which the sequence-parallel axis "
                        f"{sequence_parallel!r} ({k} ranks) must split evenly; use a sequence length that is a "
                        f"multiple of {n * math.lcm(2, k)}")
