"""Training FLOPs of a model description: per token, per step, per rank.

Forward FLOPs per token are ``2 x`` the parameters a token multiplies with (the routed experts at
``top_k / E``, the head in full, the embedding lookup none) plus attention, ``4 x query width x``
the positions attended (``s / 2`` on average with causal halving, ``s`` without). Training is
``3 x`` forward (backward = 2 x forward); recompute adds forward work (:func:`recompute_flops_per_token`).
For Qwen3-30B-A3B at ``s = 4096`` this is 23.08 GFLOP per token (docs/reference.md,
"Qwen3-30B-A3B: derived and published figures"), 27.9 without the causal halving.

    >>> from hpfunc.models.qwen3.describe import describe
    >>> from hpfunc.models.qwen3.model import preset
    >>> d = describe(preset("qwen3-30b-a3b"))
    >>> round(train_flops_per_token(d, 4096) / 1e9, 2), round(train_flops_per_token(d, 4096, causal=False) / 1e9, 1)
    (23.08, 27.9)
"""

from __future__ import annotations

from typing import Iterable

from hpfunc.models.description import LayerDescription, ModelDescription

__all__ = ["layer_forward_flops_per_token", "forward_flops_per_token", "train_flops_per_token",
           "recompute_flops_per_token", "attention_positions"]


def attention_positions(seq_len: int, causal: bool = True) -> float:
    """Positions each query attends on average: ``s / 2`` causal (the convention of the published
    MFU figures), ``s`` otherwise."""
    return seq_len / 2 if causal else float(seq_len)


def layer_forward_flops_per_token(layer: LayerDescription, seq_len: int, *, causal: bool = True) -> tuple[float, float]:
    """``(matmul, attention)`` forward FLOPs per token of one layer."""
    return layer.matmul_flops_per_token, layer.attention_flops_per_token_per_position * attention_positions(seq_len, causal)


def forward_flops_per_token(desc: ModelDescription, seq_len: int, *, causal: bool = True,
                            layers: Iterable[int] | None = None, head: bool = True) -> float:
    """Forward FLOPs per token of ``layers`` (all by default) plus the head."""
    idx = range(desc.num_layers) if layers is None else layers
    total = sum(sum(layer_forward_flops_per_token(desc.layers[i], seq_len, causal=causal)) for i in idx)
    return total + (desc.head_flops_per_token if head else 0.0)


def train_flops_per_token(desc: ModelDescription, seq_len: int, *, causal: bool = True) -> float:
    """Forward + backward FLOPs per token (``3 x`` forward), without recompute."""
    return 3.0 * forward_flops_per_token(desc, seq_len, causal=causal)


def recompute_flops_per_token(layer: LayerDescription, remat: str, seq_len: int, *, causal: bool = True) -> float:
    """Extra forward FLOPs per token a layer's backward spends recomputing under ``remat``: the whole
    forward for ``full``; for ``selective`` the attention (its output is not a kept matmul) and every
    value that is not a cached matmul output (grouped expert GEMMs included; elementwise values cost
    memory traffic only); 0 for ``none``."""
    if remat == "none":
        return 0.0
    mm, attn = layer_forward_flops_per_token(layer, seq_len, causal=causal)
    if remat == "full":
        return mm + attn
    return attn + sum(v.recompute_flops_per_token for v in layer.saved if not v.matmul)
