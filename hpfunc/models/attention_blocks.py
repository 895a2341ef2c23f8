"""Attention on blocks of a sequence with its log-sum-exp, and the online-softmax merge of blocks.

A context-parallel rank attends its queries to one block of keys at a time; the blocks' results
combine exactly by their log-sum-exp (``lse``)::

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

:func:`block_attention` masks by *global* positions and document ids, so a block may be any set of
keys: ``allowed(q, k) = (k_pos <= q_pos if causal) and doc(q) == doc(k) and (k_pos < seq_len or
k_pos == q_pos)`` (a padded key is seen only by itself). A query row with no allowed key gives
``out = 0, lse = -inf``, which the merge weighs by zero (no NaN in value or gradient).
Grouped-query attention runs on the key/value heads as they are (query heads grouped), never
repeating them. The backward recomputes each block's probabilities from its ``lse`` (only q, k, v, out
and lse are kept, as flash attention does) and includes the gradient that flows into ``lse`` through the
merge.

>>> q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
>>> pos = torch.arange(6)
>>> out, lse = block_attention(q, k, v, pos, pos, causal=True, seq_len=6)
>>> bool(torch.allclose(out, dense_attention(q, k, v, causal=True), atol=1e-5))
True
>>> o1, l1 = block_attention(q, k[:, :, :3], v[:, :, :3], pos, pos[:3], causal=True, seq_len=6)
>>> o2, l2 = block_attention(q, k[:, :, 3:], v[:, :, 3:], pos, pos[3:], causal=True, seq_len=6)
>>> bool(torch.allclose(merge_blocks(o1, l1, o2, l2)[0], out, atol=1e-5))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["block_attention", "merge_blocks", "allowed_mask", "dense_attention"]

_TINY = 1e-30


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, seq_len: int,
                 q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """``[B or 1, Sq, Sk]`` bool: which key each query may attend (see the module docstring)."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    mask = (kp < seq_len) | (kp == qp)
    if causal:
        mask = mask & (kp <= qp)
    mask = mask[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``[B, Hkv, g, Sq, Sk]`` scaled scores of the grouped queries, masked to ``-inf``."""
    B, hq, sq, d = q.shape
    hkv = k.shape[1]
    s = torch.matmul(q.reshape(B, hkv, hq // hkv, sq, d), k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


class _BlockAttention(torch.autograd.Function):
    """``(out, lse)`` of one block; the backward recomputes the probabilities from ``lse`` (flash-attention
    style: only q, k, v, out and lse are kept) and takes the gradient of ``lse`` too (the merge needs it):
    ``dS = P (dP - rowsum(dO O) + dlse)``, ``P = exp(S - lse)``."""

    @staticmethod
    def forward(q, k, v, mask, scale):
        s = _scores(q, k, mask, scale)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no key shifts by 0
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        out = torch.matmul(p, v.unsqueeze(2)) / l.clamp_min(_TINY)
        lse = torch.where(l > 0, torch.log(l.clamp_min(_TINY)) + m, torch.full_like(l, float("-inf")))
        return out.reshape(q.shape), lse.reshape(q.shape[:3])

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        B, hq, sq, d = q.shape
        hkv = k.shape[1]
        shape = (B, hkv, hq // hkv, sq)
        lse = lse.reshape(shape).unsqueeze(-1)
        p = torch.exp(_scores(q, k, mask, ctx.scale) - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
        g_out = g_out.reshape(shape + (d,))
        dv = torch.matmul(p.transpose(-1, -2), g_out).sum(2)
        dp = torch.matmul(g_out, v.unsqueeze(2).transpose(-1, -2))
        delta = (g_out * out.reshape(shape + (d,))).sum(-1, keepdim=True)
        ds = p * (dp - delta + g_lse.reshape(shape).unsqueeze(-1))
        dq = torch.matmul(ds, k.unsqueeze(2)).reshape(q.shape) * ctx.scale
        dk = torch.matmul(ds.transpose(-1, -2), q.reshape(shape + (d,))).sum(2) * ctx.scale
        return dq, dk, dv, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    *, causal: bool, seq_len: int, q_doc: torch.Tensor | None = None,
                    k_doc: torch.Tensor | None = None, scale: float | None = None,
                    masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, Sq, D]`` to ``k, v [B, Hkv, Sk, D]`` at global positions ``q_pos [Sq]``,
    ``k_pos [Sk]`` (documents ``q_doc [B, Sq]``, ``k_doc [B, Sk]`` or None): ``(out [B, Hq, Sq, D],
    lse [B, Hq, Sq])``, both differentiable. ``masked=False`` skips building the mask (the caller knows
    every key is allowed). The backward keeps q, k, v, out and lse and recomputes the probabilities.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = (allowed_mask(q_pos, k_pos, causal=causal, seq_len=seq_len, q_doc=q_doc, k_doc=k_doc) if masked
            else None)
    return _BlockAttention.apply(q, k, v, mask, scale)


def merge_blocks(out_1: torch.Tensor, lse_1: torch.Tensor, out_2: torch.Tensor,
                 lse_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two key blocks from each block's ``(out, lse)``; one of each
    row's two ``lse`` must be finite (a rank's own block always is: every query sees itself)."""
    lse = torch.logaddexp(lse_1, lse_2)
    w1, w2 = torch.exp(lse_1 - lse).unsqueeze(-1), torch.exp(lse_2 - lse).unsqueeze(-1)
    return w1 * out_1 + w2 * out_2, lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    doc_ids: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Single-device reference: ``scaled_dot_product_attention`` over the whole sequence ``[B, H, S, D]``
    (GQA by ``enable_gqa``), causal and/or within documents ``doc_ids [B, S]``."""
    S = q.shape[2]
    mask = None
    if doc_ids is not None:
        if doc_ids.dim() == 1:
            doc_ids = doc_ids[None]
        pos = torch.arange(S, device=q.device)
        mask = allowed_mask(pos, pos, causal=causal, seq_len=S, q_doc=doc_ids, k_doc=doc_ids)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
