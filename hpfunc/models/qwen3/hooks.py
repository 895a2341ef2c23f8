"""The hooks of :func:`qwen3.apply <hpfunc.models.qwen3.model.apply>` / ``loss`` for the layout a
parallelized step binds (tensor, sequence and vocabulary parallelism), shared by the parallel plan
(:mod:`hpfunc.models.qwen3.parallel_plan`) and the pipeline stages (:mod:`hpfunc.models.qwen3.stages`).
With no tensor-parallel axis bound :func:`layout_hooks` gives none, and the model is the single-device one.

    >>> from hpfunc.models import qwen3
    >>> layout_hooks(qwen3.preset("qwen3-dense-tiny"), {})
    {}
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from hpfunc import lax, layout
from hpfunc.layout import gather_sequence, reduce_partial, scatter_sequence
from hpfunc.models.config import Qwen3Config
from hpfunc.models.qwen3 import model as _model

__all__ = ["layout_hooks", "cross_entropy"]



def _embed(tokens: torch.Tensor, table: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Embedding lookup: a replicated table looks up this rank's sequence block (no communication); a
    table split by vocabulary rows looks up its own ids and sums over the axis (reduce-scatters along the
    sequence under sequence parallelism)."""
    rows = table.shape[0]
    if not layout.vocab_parallel() or rows == cfg.vocab_size:
        return F.embedding(scatter_sequence(tokens), table)
    local = tokens - lax.axis_index(layout.tp_axis()) * rows
    mine = (local >= 0) & (local < rows)
    h = F.embedding(local.clamp(0, rows - 1), table) * mine.unsqueeze(-1).to(table.dtype)
    return reduce_partial(h)


def _head(h: torch.Tensor, weight: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Logits; a head split by vocabulary rows needs every position, gathered under sequence parallelism
    (then these are this rank's vocabulary columns of the logits)."""
    if layout.vocab_parallel() and weight.shape[0] != cfg.vocab_size:
        h = gather_sequence(h)
    return F.linear(h, weight)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets, for logits that are this rank's sequence block
    (one scalar all-reduce of the summed losses) or this rank's vocabulary columns (three small
    all-reduces of [tokens]: a max, a sum of exponentials and the target logit)."""
    axis = layout.tp_axis()
    ignore = _model.IGNORE_INDEX
    x = logits.float()
    cols = x.shape[-1]
    if x.shape[1] != labels.shape[1]:  # this rank's sequence block, full vocabulary
        count = (labels != ignore).sum()
        y = scatter_sequence(labels)
        nll = F.cross_entropy(x.reshape(-1, cols), y.reshape(-1), ignore_index=ignore, reduction="sum")
        return lax.psum(nll, axis) / count
    x, y = x.reshape(-1, cols), labels.reshape(-1)
    if cols == cfg.vocab_size:
        return F.cross_entropy(x, y, ignore_index=ignore)
    valid = y != ignore
    # log-sum-exp is shift invariant: the max needs no gradient
    m = lax.pmax(x.detach().amax(-1), axis)
    sumexp = lax.psum(torch.exp(x - m[:, None]).sum(-1), axis)
    local = y - lax.axis_index(axis) * cols
    mine = (local >= 0) & (local < cols) & valid
    target = lax.psum(x.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1) * mine, axis)
    nll = torch.log(sumexp) + m - target
    return (nll * valid).sum() / valid.sum()


def layout_hooks(cfg: Qwen3Config, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """qwen3's hooks for the bound layout (none without an axis), after checking the sequence length."""
    axis = layout.tp_axis()
    if axis is None:
        return {}
    if layout.sequence_parallel():
        n = lax.axis_size(axis)
        for name, x in batch.items():
            if isinstance(x, torch.Tensor):
                layout.check_sequence(x, name, axis, n)
    return {"embed": functools.partial(_embed, cfg=cfg), "gather_input": gather_sequence,
            "reduce_partial": reduce_partial, "head": functools.partial(_head, cfg=cfg)}
