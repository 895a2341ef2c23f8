"""A transformer-like block for remat/offload tests: RMSNorm, GQA attention via SDPA, SwiGLU MLP, residuals."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from hpfunc.transforms.remat import checkpoint_name

NAMES = ("attn_in", "q", "k", "v", "attn_out", "mlp_in", "mlp_hidden", "mlp_out")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    hidden: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 32
    eps: float = 1e-6


def init_block(cfg: BlockConfig, *, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def w(*shape):
        if device == "meta" or str(device) == "fake":
            return torch.empty(*shape, dtype=dtype, device="meta")
        return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(dtype)

    return {
        "attn_norm": torch.ones(h, dtype=dtype) if device != "meta" else torch.empty(h, dtype=dtype, device="meta"),
        "wq": w(h, q), "wk": w(h, kv), "wv": w(h, kv), "wo": w(q, h),
        "mlp_norm": torch.ones(h, dtype=dtype) if device != "meta" else torch.empty(h, dtype=dtype, device="meta"),
        "w_gate": w(h, cfg.ffn), "w_up": w(h, cfg.ffn), "w_down": w(cfg.ffn, h),
    }


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def block(params: dict, x: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    b, s, _ = x.shape
    a = checkpoint_name(rms_norm(x, params["attn_norm"], cfg.eps), "attn_in")
    q = checkpoint_name(a @ params["wq"], "q").view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
    k = checkpoint_name(a @ params["wk"], "k").view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    v = checkpoint_name(a @ params["wv"], "v").view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o = checkpoint_name(o.transpose(1, 2).reshape(b, s, cfg.heads * cfg.head_dim), "attn_out")
    x = x + o @ params["wo"]
    m = checkpoint_name(rms_norm(x, params["mlp_norm"], cfg.eps), "mlp_in")
    hidden = checkpoint_name(F.silu(m @ params["w_gate"]) * (m @ params["w_up"]), "mlp_hidden")
    return x + checkpoint_name(hidden @ params["w_down"], "mlp_out")


def stack_loss(layers: list, x: torch.Tensor, cfg: BlockConfig, layer_fn=None) -> torch.Tensor:
    layer_fn = layer_fn or block
    for p in layers:
        x = layer_fn(p, x, cfg)
    return (x.float() ** 2).mean()


def assert_equal_trees(a, b):
    """Bit-for-bit equal trees (same number of leaves)."""
    import hpfunc

    la, lb = hpfunc.tree.leaves(a), hpfunc.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x - y).abs().max()
