"""Grouped-query causal self-attention with per-head q/k RMSNorm (Qwen3), on plain tensors.

Head counts come from the weight shapes: ``q_heads = wq.shape[0] // head_dim`` with
``head_dim = q_norm.shape[0]``, so a tensor-parallel transform can pass column shards of
``wq/wk/wv`` (dim 0) and row shards of ``wo`` (dim 1) and get the local heads' partial output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import Callable

from hpfunc.models.layers import rms_norm
from hpfunc.models.rope import apply_rope


def gqa_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    bv: torch.Tensor | None = None,
    bo: torch.Tensor | None = None,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal GQA attention ``[B, S, H] -> [B, S, H_out]``.

    ``wq [Hq*D, H]``, ``wk/wv [Hkv*D, H]``, ``wo [H_out, Hq*D]`` (``[out, in]``); ``q_norm/k_norm [D]``
    are RMSNorm weights applied per head before RoPE; ``cos, sin`` are ``[S, D]`` or ``[B, S, D]`` tables.
    Softmax scale ``D ** -0.5``; the causal mask is by sequence index. ``attend(q, k, v) -> out``
    (``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` after RoPE) replaces the causal attention core: context
    parallelism passes :func:`hpfunc.models.context_attention.context_attention` over its ranks.

    >>> B, S, H, D = 1, 4, 16, 4
    >>> cos, sin = torch.ones(S, D), torch.zeros(S, D)
    >>> y = gqa_attention(torch.randn(B, S, H), torch.randn(4 * D, H), torch.randn(2 * D, H),
    ...                   torch.randn(2 * D, H), torch.randn(H, 4 * D), torch.ones(D), torch.ones(D),
    ...                   cos, sin, eps=1e-6)
    >>> y.shape
    torch.Size([1, 4, 16])
    """
    B, S, _ = x.shape
    D = q_norm.shape[0]
    if wq.shape[0] % D or wk.shape[0] % D or wk.shape[0] != wv.shape[0]:
        raise ValueError(
            f"gqa_attention: wq/wk/wv rows must be multiples of head_dim {D} (from q_norm) and wk, wv equal; "
            f"found wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, wv {tuple(wv.shape)}")
    hq, hkv = wq.shape[0] // D, wk.shape[0] // D
    if hq % hkv:
        raise ValueError(f"gqa_attention: query heads {hq} must be a multiple of key/value heads {hkv}")
    # Heads split and merged with view/transpose, not einops.rearrange: that costs about 4 us more host time
    # per rearrangement, 10% of this function's forward at the tiny models' sizes.
    q = rms_norm(F.linear(x, wq, bq).view(B, S, hq, D), q_norm, eps).transpose(1, 2)
    k = rms_norm(F.linear(x, wk, bk).view(B, S, hkv, D), k_norm, eps).transpose(1, 2)
    v = F.linear(x, wv, bv).view(B, S, hkv, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if attend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
    else:
        out = attend(q, k, v)
    return F.linear(out.transpose(1, 2).reshape(B, S, hq * D), wo, bo)
