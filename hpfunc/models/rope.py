"""Rotary position embedding: inverse frequencies (default, linear, yarn), cos/sin tables, rotation.

Matches the Hugging Face ``rotate_half`` convention (the two halves of the head dim form the pairs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: Any = None, *,
                  max_position_embeddings: int | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin magnitude factor.

    Args:
      head_dim: rotated dimension (the full head dim for Qwen3).
      theta: RoPE base.
      scaling: ``None`` or an object/dict with ``rope_type`` in ``("default", "linear", "yarn")``,
        ``factor`` and, for yarn, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
        ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``.
      max_position_embeddings: yarn's ``original_max_position_embeddings`` when the scaling omits it.
      device: where the frequencies are computed (the positions' device: no copy per step).

    >>> inv, scale = rope_inv_freq(8, 10000.0)
    >>> inv.shape, scale
    (torch.Size([4]), 1.0)
    """
    get = (lambda k, d=None: scaling.get(k, d)) if isinstance(scaling, dict) else (
        lambda k, d=None: getattr(scaling, k, d))
    rope_type = "default" if scaling is None else (get("rope_type") or "default")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    pos_freqs = theta ** exponent
    inv_freq = 1.0 / pos_freqs
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(get("factor"))
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "yarn":
        original = get("original_max_position_embeddings") or max_position_embeddings
        if original is None:
            raise ValueError("rope_scaling yarn: original_max_position_embeddings is required")
        attention_factor = get("attention_factor")
        mscale, mscale_all_dim = get("mscale"), get("mscale_all_dim")

        def yarn_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        beta_fast = get("beta_fast") or 32
        beta_slow = get("beta_slow") or 1
        truncate = get("truncate", True)
        truncate = True if truncate is None else truncate

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
        return inv_freq, float(attention_factor)
    raise ValueError(
        f"rope_scaling.rope_type: expected one of {SUPPORTED_ROPE_TYPES}, found {rope_type!r}")


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[*positions.shape, 2 * len(inv_freq)]``, computed in float32, cast to ``dtype``.

    >>> cos, sin = rope_tables(torch.arange(5), rope_inv_freq(8, 1e4)[0])
    >>> cos.shape
    torch.Size([5, 8])
    """
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, S, D]`` by tables ``cos, sin [S, D]`` or ``[B, S, D]``.

    >>> cos, sin = rope_tables(torch.arange(5), rope_inv_freq(8, 1e4)[0])
    >>> apply_rope(torch.randn(1, 2, 5, 8), cos, sin).shape
    torch.Size([1, 2, 5, 8])
    """
    if cos.dim() == 3:  # per-batch positions: broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin
