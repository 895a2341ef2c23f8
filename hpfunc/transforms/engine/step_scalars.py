"""A differentiation's scalars over the data shards, in one collective: the loss, ``aux``'s batch
statistics and, when the step asks for it, the gradients' global sum of squares.

Inside a parallelized step :meth:`~hpfunc.transforms.engine.step_layout.RankStep.value_and_grad`
returns the loss as the mean over the data shards, ``aux``'s floating tensors averaged and its integer
ones summed (:func:`reduce_batch_stats`), and a step that clips or
logs the gradient norm asks :func:`hpfunc.layout.global_sq_norm` for the global sum of squares of the
gradients it got (a ``psum`` over the axes the gradient blocks are split on). Made apart these are
two to three collectives, each a round trip on gloo. :class:`StepScalars` makes them one
(:class:`~hpfunc.transforms.engine.riders.Riders`):

- under DDP (the gradients all-reduced in buckets while the backward runs) the statistics ride the
  last bucket's all-reduce when its axes hold the data axes; the gradients are then whole on every rank
  and their norm needs no collective;
- otherwise one all-reduce after the backward carries the statistics and, when the first run of the
  lowered step saw the step ask for the norm of exactly the gradients it returned
  (``Lowered.sq_norm_wanted``, keyed like the gather orders), this rank's weighted sum of squares of
  them; the total is remembered for :func:`hpfunc.layout.global_sq_norm` (no second collective).

The values are those the separate collectives gave (floating sums in a carrier at least as wide, so
equal to rounding; integers exactly).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpfunc import comm as _comm
from hpfunc import lax
from hpfunc import tree as _tree
from hpfunc.transforms.engine.riders import Riders

__all__ = ["StepScalars", "reduce_batch_stats"]


def reduce_batch_stats(tree: Any, data_axes: tuple[str, ...]) -> Any:
    """Batch statistics over the data shards: floating tensors averaged, integer ones summed. The
    tensors of one dtype travel in one collective (a ``pmean`` of the floating ones, a ``psum`` of the
    integer ones): on gloo each call is a round trip that costs more host time than its bytes.

    >>> import torch
    >>> reduce_batch_stats({"tokens": torch.tensor(3), "ce": torch.tensor(0.5)}, ())
    {'tokens': tensor(3), 'ce': tensor(0.5000)}
    """
    leaves, treedef = _tree.flatten(tree)
    out = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    if data_axes:
        groups: dict[torch.dtype, list[int]] = {}
        for k, x in enumerate(out):
            if isinstance(x, torch.Tensor):
                groups.setdefault(x.dtype, []).append(k)
        for dtype, idx in groups.items():
            mean = dtype.is_floating_point or dtype.is_complex
            members = [out[k] for k in idx]
            flat = members[0].reshape(-1) if len(idx) == 1 else torch.cat([x.reshape(-1) for x in members])
            red = lax.pmean(flat, data_axes) if mean else lax.psum(flat, data_axes)
            for k, x, part in zip(idx, members, red.split([x.numel() for x in members])):
                out[k] = part.view(x.shape)
    return _tree.unflatten(treedef, out)


def _weight(mesh: Any, own: tuple[str, ...], over: tuple[str, ...]) -> float:
    """1.0 on the ranks at coordinate 0 of the axes in ``over`` but not in ``own``, else 0.0."""
    extra = [a for a in over if a not in own]
    return 1.0 if all(mesh.axis_index(a) == 0 for a in extra) else 0.0


class StepScalars:
    """The loss and ``aux`` of one differentiation, reduced over ``data_axes`` (see the module docstring)."""

    def __init__(self, mesh: Any, data_axes: tuple[str, ...], loss: torch.Tensor, aux: Any, has_aux: bool):
        self.mesh, self.data_axes, self.has_aux = mesh, data_axes, has_aux
        leaves, self.treedef = _tree.flatten((loss, aux) if has_aux else loss)
        self.at = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.n = mesh.axis_size(data_axes) if data_axes else 1
        self.reduced: tuple[torch.Tensor, Any] | None = None

    def _riders(self, carrier: torch.dtype, over: tuple[str, ...]) -> Riders:
        values = [self.leaves[k] for k in self.at]
        kinds = ["mean" if x.is_floating_point() else "sum" for x in values]
        return Riders(values, kinds, carrier, n=self.n, ranks=self.mesh.axis_size(over) if over else 1,
                      weight=_weight(self.mesh, self.data_axes, over))

    def riders_for(self, carrier: torch.dtype, over: tuple[str, ...]) -> Riders | None:
        """The statistics as riders of an all-reduce over ``over`` in ``carrier``, or ``None`` when they
        cannot ride it (``over`` misses a data axis, a dtype the carrier cannot hold exactly)."""
        if not self.data_axes or not set(self.data_axes) <= set(over):
            return None
        riders = self._riders(carrier, over)
        return riders if riders.fits() else None

    def rode(self, riders: Riders, summed: torch.Tensor) -> None:
        """The riders came back summed: the reduced loss and ``aux``."""
        self._set(riders.unpack(summed))

    def _set(self, values: list[torch.Tensor]) -> None:
        out = list(self.leaves)
        for k, v in zip(self.at, values):
            out[k] = v
        tree = _tree.unflatten(self.treedef, out)
        self.reduced = tree if self.has_aux else (tree, None)

    def reduce(self, sq_norm: tuple[torch.Tensor, tuple[str, ...]] | None = None) -> torch.Tensor | None:
        """Reduce the statistics (unless they rode a bucket) and ``sq_norm`` -- ``(this rank's weighted
        sum of squares, fp64; the axes it sums over)`` -- in one all-reduce; returns the global sum of
        squares (or ``None`` without ``sq_norm``)."""
        if self.reduced is not None:  # rode the gradients' last bucket
            return _norm_apart(sq_norm)
        norm_axes = sq_norm[1] if sq_norm is not None else ()
        over = tuple(a for a in self.mesh.axis_names if a in self.data_axes or a in norm_axes)
        if not over:  # one rank holds everything
            self._set([self.leaves[k] for k in self.at])
            return None if sq_norm is None else sq_norm[0]
        stats = self._riders(torch.float32, over)
        carrier = torch.float32 if sq_norm is None and stats.fits() else torch.float64
        if carrier is torch.float64:
            stats = self._riders(carrier, over)
        if not stats.fits():  # apart (an exotic dtype): as reduce_batch_stats does, then the norm
            self._set(reduce_batch_stats([self.leaves[k] for k in self.at], self.data_axes))
            return _norm_apart(sq_norm)
        flat = stats.pack()
        if sq_norm is not None:
            part = sq_norm[0].reshape(1) * _weight(self.mesh, norm_axes, over)
            flat = torch.cat([flat, part.to(carrier)])
        # tagged "scalars": a reader of the comm counter tells the step's scalars from gradients by it
        summed = lax._all_reduce(flat, lax._axes_of(self.mesh, over), dist.ReduceOp.SUM, _comm.active(), "psum",
                                 tag="scalars")
        self._set(stats.unpack(summed[:stats.numel]))
        return summed[stats.numel] if sq_norm is not None else None


def _norm_apart(sq_norm: tuple[torch.Tensor, tuple[str, ...]] | None) -> torch.Tensor | None:
    """The global sum of squares from this rank's part, in a collective of its own (none when its axes are
    empty: the gradient blocks are whole on every rank)."""
    if sq_norm is None:
        return None
    part, axes = sq_norm
    return lax.psum(part, axes) if axes else part
