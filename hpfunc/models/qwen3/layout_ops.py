"""The pieces of Qwen3 that depend on the layout a parallelized step binds, read only through
:mod:`hpfunc.layout` (the model takes no parallel hook parameters: one way to be tensor-parallel).

* tensor / sequence / vocabulary parallelism (:func:`hpfunc.layout.tp_axis`,
  :func:`~hpfunc.layout.sequence_parallel`, :func:`~hpfunc.layout.vocab_parallel`): the embedding
  lookup (:func:`embed_tokens`), the head (:func:`head`), the cross-entropy of the logits it returns
  (:func:`cross_entropy`) and the final norm, head and loss together (:func:`head_loss`, a compiled
  region where no collective is inside it); the decoder layers call :func:`hpfunc.layout.gather_sequence`
  and :func:`hpfunc.layout.reduce_partial` themselves (:mod:`hpfunc.models.qwen3.model`);
* context parallelism (:func:`hpfunc.layout.cp_binding`): :func:`context_split` takes this rank's tokens
  of every sequence and gives what attends across the ranks; :func:`head_loss` averages over the whole
  sequences.

With nothing bound every function here is the single-device one:

    >>> import torch
    >>> from hpfunc.models import qwen3
    >>> cfg = qwen3.preset("qwen3-dense-tiny")
    >>> table = torch.randn(cfg.vocab_size, cfg.hidden_size)
    >>> tokens = torch.tensor([[1, 2, 3]])
    >>> bool(torch.equal(embed_tokens(tokens, table, cfg), F.embedding(tokens, table)))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hpfunc import lax, layout
from hpfunc.layout import gather_sequence, reduce_partial, scatter_sequence
from hpfunc.models.config import Qwen3Config
from hpfunc.models.context_attention import context_attention
from hpfunc.models.layers import rms_norm
from hpfunc.models.qwen3.tokens import IGNORE_INDEX, check_doc_ids, shift_labels
from hpfunc.models.sequence_split import ContextParallelError, SequenceSplit
from hpfunc.regions import Regions

__all__ = ["embed_tokens", "head", "cross_entropy", "head_loss", "check_batch", "context_split", "REMOVED_HOOKS",
           "reject_hooks"]

# the parallel hook parameters qwen3.apply / loss / decoder_layer took before they read hpfunc.layout
REMOVED_HOOKS = ("embed", "gather_input", "reduce_partial", "head", "cross_entropy")


def reject_hooks(where: str, removed: dict[str, Any]) -> None:
    """A ``TypeError`` for keyword arguments ``where`` does not take: a migration message for the parallel
    hooks Qwen3 no longer takes, Python's own message otherwise."""
    if not removed:
        return
    hooks = sorted(k for k in removed if k in REMOVED_HOOKS)
    if hooks:
        raise TypeError(
            f"{where}: the parallel hook parameter{'s' if len(hooks) > 1 else ''} {', '.join(hooks)} "
            f"{'were' if len(hooks) > 1 else 'was'} removed; Qwen3 reads its tensor-, sequence- and "
            f"vocabulary-parallel layout from hpfunc.layout. Run the model inside hpfunc.parallelize (the plan's "
            f"tp layer binds it), or bind it by hand: `with hpfunc.Mesh({{'tp': n}}), "
            f"hpfunc.layout.tensor_parallel('tp'): qwen3.loss(local_params, batch, cfg)`")
    raise TypeError(f"{where}() got an unexpected keyword argument {sorted(removed)[0]!r}")


def _vocab_split(table: torch.Tensor, cfg: Qwen3Config) -> bool:
    """Whether ``table`` (the embedding or head) is this rank's block of vocabulary rows."""
    return layout.vocab_parallel() and table.shape[0] != cfg.vocab_size


def _lookup(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens, table)


def embed_tokens(tokens: torch.Tensor, table: torch.Tensor, cfg: Qwen3Config,
                 regions: Regions | None = None) -> torch.Tensor:
    """Embedding lookup: a replicated table looks up this rank's sequence block (no communication; a
    compiled region ``qwen3.embed`` with ``regions``); a table split by vocabulary rows looks up its own
    ids and sums over the axis (reduce-scatters along the sequence under sequence parallelism)."""
    if not _vocab_split(table, cfg):
        tokens = scatter_sequence(tokens)
        return _lookup(tokens, table) if regions is None else regions("qwen3.embed", _lookup, tokens, table)
    rows = table.shape[0]
    local = tokens - lax.axis_index(layout.tp_axis()) * rows
    mine = (local >= 0) & (local < rows)
    h = F.embedding(local.clamp(0, rows - 1), table) * mine.unsqueeze(-1).to(table.dtype)
    return reduce_partial(h)


def head(h: torch.Tensor, weight: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Logits; a head split by vocabulary rows needs every position, gathered under sequence parallelism
    (then these are this rank's vocabulary columns of the logits)."""
    if _vocab_split(weight, cfg):
        h = gather_sequence(h)
    return F.linear(h, weight)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets, for logits that are whole, this rank's sequence block
    (one scalar all-reduce of the summed losses) or this rank's vocabulary columns (three small
    all-reduces of [tokens]: a max, a sum of exponentials and the target logit)."""
    if logits.shape[1] == labels.shape[1] and logits.shape[-1] == cfg.vocab_size:  # whole sequence and vocabulary
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)
    return _nll_sum(logits, labels, cfg) / (labels != IGNORE_INDEX).sum()


def _head_ce(h: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, eps: float,
             reduction: str) -> torch.Tensor:
    """The final norm, the head and the cross-entropy (``reduction`` ``mean`` or ``sum`` over the
    non-ignored targets) of hidden states whose head needs no collective: one compiled region."""
    logits = F.linear(rms_norm(h, norm, eps), weight).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def head_loss(h: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config,
              regions: Regions | None = None) -> torch.Tensor:
    """The mean cross-entropy over every target (of the whole sequences under context parallelism) of the
    last decoder layer's output ``h``: final norm ``norm``, head ``weight``, loss. With ``regions`` and a
    head that needs no collective (not vocabulary-parallel) the three are one compiled region
    ``qwen3.head_loss``: it returns the mean, or under sequence or context parallelism this rank's sum,
    which the scalar all-reduces then complete eagerly as :func:`cross_entropy` does.

    >>> import torch
    >>> from hpfunc.models import qwen3
    >>> cfg = qwen3.preset("qwen3-dense-tiny")
    >>> h, w = torch.randn(1, 4, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    >>> y = torch.tensor([[3, 4, 5, -100]])
    >>> want = F.cross_entropy(F.linear(rms_norm(h, torch.ones(cfg.hidden_size), cfg.rms_norm_eps), w)[0, :3], y[0, :3])
    >>> bool(torch.allclose(head_loss(h, torch.ones(cfg.hidden_size), w, y, cfg), want))
    True
    """
    cp = layout.cp_binding()
    if regions is not None and not _vocab_split(weight, cfg):
        sp = layout.sequence_parallel()
        if cp is None and not sp:
            return regions("qwen3.head_loss", _head_ce, h, norm, weight, labels, cfg.rms_norm_eps, "mean")
        nll = regions("qwen3.head_loss", _head_ce, h, norm, weight, scatter_sequence(labels), cfg.rms_norm_eps,
                      "sum")
        if sp:
            nll = lax.psum(nll, layout.tp_axis())
    else:
        logits = head(rms_norm(h, norm, cfg.rms_norm_eps), weight, cfg)
        if cp is None:
            return cross_entropy(logits, labels, cfg)
        nll = _nll_sum(logits, labels, cfg)
    if cp is None:
        return nll / (labels != IGNORE_INDEX).sum()
    return _context_mean(nll, labels, cp.axes)


def check_batch(batch: dict[str, torch.Tensor]) -> None:
    """Under sequence parallelism, a :class:`~hpfunc.layout.PlanError` naming the first batch leaf whose
    sequence does not divide over the tensor-parallel axis (before any collective)."""
    if not layout.sequence_parallel():
        return
    axis = layout.tp_axis()
    n = lax.axis_size(axis)
    for name, x in batch.items():
        if isinstance(x, torch.Tensor):
            layout.check_sequence(x, name, axis, n)


# ---- Context parallelism (and the summed cross-entropy it shares with sequence parallelism) ----------------------------------------------------------------------


def _nll_sum(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """The summed cross-entropy of this rank's targets (the same on every tensor-parallel rank), for the
    logits :func:`_head` returns in the bound tensor-parallel layout."""
    axis, ignore = layout.tp_axis(), IGNORE_INDEX
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


def _context_mean(nll: torch.Tensor, labels: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """The mean over every target of the whole sequences from this rank's summed losses ``nll`` and its
    count of targets, each summed over the context-parallel axes (two scalar all-reduces)."""
    with torch.no_grad():
        count = lax.psum((labels != IGNORE_INDEX).sum(), axes)
    return lax.psum(nll, axes) / count


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
    """Under a bound context-parallel layout, ``(local batch, parts)``: this rank's tokens and labels of every
    sequence (padded to ``2 P`` chunks, causally balanced; :class:`SequenceSplit`), and what the model's
    forward uses for them (:func:`qwen3.loss <hpfunc.models.qwen3.model.loss>` calls this itself when a
    context-parallel layout is bound): their global ``positions`` (RoPE), ``attend``
    (:func:`~hpfunc.models.context_attention.context_attention` by the bound strategy) and ``counted``
    (padding is left out of the MoE statistics); :func:`head_loss` averages over every target of the
    whole sequences. ``batch["doc_ids"]`` (packed sequences) keeps attention within
    documents of any length (no alignment with the chunks needed). The labels are made from the whole
    sequence first (``labels[s]`` is ``tokens[s + 1]``), so the targets at the chunks' edges are the
    single-device ones. No communication; a Ulysses degree the heads cannot take is an error here,
    before the step's first collective.

    >>> import torch
    >>> from hpfunc.models import qwen3
    >>> from hpfunc import Mesh
    >>> with Mesh({"cp": 1}), layout.context_parallel(layout.ContextParallel("cp")):
    ...     local, parts = context_split(qwen3.preset("qwen3-dense-tiny"), {"tokens": torch.arange(3)[None]})
    >>> local["tokens"].tolist(), local["labels"].tolist(), parts["positions"].tolist()
    ([[0, 1, 2, 0]], [[1, 2, -100, -100]], [0, 1, 2, 3])
    """
    cp = layout.cp_binding()
    tokens = batch["tokens"]
    labels = batch.get("labels")
    labels = shift_labels(tokens) if labels is None else labels
    if tokens.dim() != 2 or labels.shape != tokens.shape:
        raise ContextParallelError(f"context parallelism: expected tokens [batch, seq] and labels of the same shape, "
                                   f"found tokens {tuple(tokens.shape)}, labels {tuple(labels.shape)}")
    _check_heads(cfg, cp)
    S = tokens.shape[1]
    n, r = cp.size(), cp.rank()
    split = SequenceSplit(S, n, balanced=cp.balanced, pad=cp.pad)
    positions = split.positions(r).to(tokens.device)
    local = {"tokens": split.local(tokens, r, dim=1, fill=0),
             "labels": split.local(labels, r, dim=1, fill=IGNORE_INDEX)}
    docs = batch.get("doc_ids")  # the whole sequences' documents, held by every cp rank (no id travels)
    kw = {"impl": cp.impl, "replicate_kv": cp.replicate_kv, "overlap": cp.overlap,
          "doc_ids": None if docs is None else check_doc_ids(docs, tokens.shape)}
    if cp.impl == "hybrid":
        kw["ulysses_axis"] = cp.ulysses_axis
    parts = {"positions": positions,
             "attend": lambda q, k, v: context_attention(q, k, v, split, axis=cp.axis, **kw),
             "counted": (positions < S).expand(tokens.shape[0], -1)}
    return local, parts
