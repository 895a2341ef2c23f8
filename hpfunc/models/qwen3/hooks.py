"""The hooks of :func:`qwen3.apply <hpfunc.models.qwen3.model.apply>` / ``loss`` for the layout a
parallelized step binds (tensor, sequence and vocabulary parallelism), shared by the parallel plan
(:mod:`hpfunc.models.qwen3.parallel_plan`) and the pipeline stages (:mod:`hpfunc.models.qwen3.stages`).
With no tensor-parallel axis bound :func:`layout_hooks` gives none, and the model is the single-device one.
Under context parallelism :func:`context_split` takes this rank's tokens of every sequence and gives the
hooks that attend across the ranks and average the loss over the whole sequences.

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
from hpfunc.models.context_attention import context_attention
from hpfunc.models.sequence_split import ContextParallelError, SequenceSplit
from hpfunc.models.qwen3 import model as _model

__all__ = ["layout_hooks", "cross_entropy", "context_split"]



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
    if logits.shape[1] == labels.shape[1] and logits.shape[-1] == cfg.vocab_size:  # whole sequence and vocabulary
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1),
                               ignore_index=_model.IGNORE_INDEX)
    return _nll_sum(logits, labels, cfg) / (labels != _model.IGNORE_INDEX).sum()


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


# ---- Context parallelism --------------------------------------------------------------------------


def _nll_sum(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """The summed cross-entropy of this rank's targets (the same on every tensor-parallel rank), for the
    logits :func:`_head` returns in the bound tensor-parallel layout."""
    axis, ignore = layout.tp_axis(), _model.IGNORE_INDEX
    x = logits.float()
    cols = x.shape[-1]
    if x.shape[1] != labels.shape[1]:  # this rank's sequence block of the sequence-parallel axis
        y = scatter_sequence(labels)
        return lax.psum(F.cross_entropy(x.reshape(-1, cols), y.reshape(-1), ignore_index=ignore, reduction="sum"),
                        axis)
    x, y = x.reshape(-1, cols), labels.reshape(-1)
    if cols == cfg.vocab_size:
        return F.cross_entropy(x, y, ignore_index=ignore, reduction="sum")
    valid = y != ignore
    # log-sum-exp is shift invariant: the max needs no gradient
    m = lax.pmax(x.detach().amax(-1), axis)
    sumexp = lax.psum(torch.exp(x - m[:, None]).sum(-1), axis)
    local = y - lax.axis_index(axis) * cols
    mine = (local >= 0) & (local < cols) & valid
    target = lax.psum(x.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1) * mine, axis)
    return ((torch.log(sumexp) + m - target) * valid).sum()


def _context_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config,
                           axes: tuple[str, ...]) -> torch.Tensor:
    """The mean over every target of the whole sequences: this rank's summed losses and its count of
    targets, each summed over the context-parallel axes (two scalar all-reduces)."""
    with torch.no_grad():
        count = lax.psum((labels != _model.IGNORE_INDEX).sum(), axes)
    return lax.psum(_nll_sum(logits, labels, cfg), axes) / count


def _check_heads(cfg: Qwen3Config, cp: layout.ContextParallel) -> None:
    """Ulysses splits the heads this rank holds (after tensor parallelism took its share)."""
    axis = cp.heads_axis
    if axis is None:
        return
    tp = layout.tp_axis()
    n_tp = 1 if tp is None else lax.axis_size(tp)
    hq, hkv, deg = cfg.num_attention_heads // n_tp, cfg.num_key_value_heads // n_tp, lax.axis_size(axis)
    where = f"cp impl={cp.impl!r} over {axis!r} ({deg} ranks)"
    after = f" ({n_tp} tensor-parallel ranks took their share)" if n_tp > 1 else ""
    if hq % deg:
        raise ContextParallelError(f"{where}: the {hq} query heads per rank{after} do not split {deg} ways; choose a "
                                   f"Ulysses degree that divides {hq}, or impl='ring' / 'hybrid'")
    if hkv % deg and not cp.replicate_kv:
        raise ContextParallelError(
            f"{where}: the Ulysses degree {deg} is above (or does not divide) the {hkv} key/value heads per rank"
            f"{after}; pass replicate_kv=True (the KV heads are repeated, more bytes travel), or use impl='hybrid' "
            f"with a Ulysses degree that divides {hkv}")


def context_split(cfg: Qwen3Config, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Under a bound context-parallel layout, ``(local batch, hooks)``: this rank's tokens and labels of every
    sequence (padded to ``2 P`` chunks, causally balanced; :class:`SequenceSplit`), and the hooks of
    :func:`qwen3.loss <hpfunc.models.qwen3.model.loss>` for them: their global ``positions`` (RoPE),
    ``attend`` (:func:`~hpfunc.models.context_attention.context_attention` by the bound strategy),
    ``counted`` (padding is left out of the MoE statistics) and ``cross_entropy`` (the mean over every
    target of the whole sequences). ``batch["doc_ids"]`` (packed sequences) keeps attention within
    documents of any length (no alignment with the chunks needed). The labels are made from the whole
    sequence first (``labels[s]`` is ``tokens[s + 1]``), so the targets at the chunks' edges are the
    single-device ones. No communication; a Ulysses degree the heads cannot take is an error here,
    before the step's first collective.

    >>> import torch
    >>> from hpfunc.models import qwen3
    >>> from hpfunc import Mesh
    >>> with Mesh({"cp": 1}), layout.context_parallel(layout.ContextParallel("cp")):
    ...     local, hooks = context_split(qwen3.preset("qwen3-dense-tiny"), {"tokens": torch.arange(3)[None]})
    >>> local["tokens"].tolist(), local["labels"].tolist(), hooks["positions"].tolist()
    ([[0, 1, 2, 0]], [[1, 2, -100, -100]], [0, 1, 2, 3])
    """
    cp = layout.cp_binding()
    tokens = batch["tokens"]
    labels = batch.get("labels")
    labels = _model.shift_labels(tokens) if labels is None else labels
    if tokens.dim() != 2 or labels.shape != tokens.shape:
        raise ContextParallelError(f"context parallelism: expected tokens [batch, seq] and labels of the same shape, "
                                   f"found tokens {tuple(tokens.shape)}, labels {tuple(labels.shape)}")
    _check_heads(cfg, cp)
    S = tokens.shape[1]
    n, r = cp.size(), cp.rank()
    split = SequenceSplit(S, n, balanced=cp.balanced, pad=cp.pad)
    positions = split.positions(r).to(tokens.device)
    local = {"tokens": split.local(tokens, r, dim=1, fill=0),
             "labels": split.local(labels, r, dim=1, fill=_model.IGNORE_INDEX)}
    docs = batch.get("doc_ids")  # the whole sequences' documents, held by every cp rank (no id travels)
    kw = {"impl": cp.impl, "replicate_kv": cp.replicate_kv, "overlap": cp.overlap,
          "doc_ids": None if docs is None else _model.check_doc_ids(docs, tokens.shape)}
    if cp.impl == "hybrid":
        kw["ulysses_axis"] = cp.ulysses_axis
    hooks = {"positions": positions,
             "attend": lambda q, k, v: context_attention(q, k, v, split, axis=cp.axis, **kw),
             "counted": (positions < S).expand(tokens.shape[0], -1),
             "cross_entropy": functools.partial(_context_cross_entropy, cfg=cfg, axes=cp.axes)}
    return local, hooks
