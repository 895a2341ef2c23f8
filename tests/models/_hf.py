"""Helpers: build the transformers reference model for a Qwen3Config and map names and gradients."""

from __future__ import annotations

import torch

from hpfunc import tree
from hpfunc.models import Qwen3Config
from hpfunc.models.qwen3.hf import hf_name


def hf_model(cfg: Qwen3Config, *, seed: int = 0, std: float = 0.1):
    """A transformers Qwen3 / Qwen3-MoE CausalLM (fp32, eager attention) with every parameter random
    (norm weights around 1, so that the norms are exercised)."""
    import transformers

    d = cfg.to_hf_dict()
    cls_cfg = transformers.Qwen3MoeConfig if cfg.is_moe else transformers.Qwen3Config
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
    hf_cfg = cls_cfg(**d)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_cls = transformers.Qwen3MoeForCausalLM if cfg.is_moe else transformers.Qwen3ForCausalLM
    model = model_cls(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def hf_grad_tree(model, params_like: dict) -> dict:
    """The reference model's gradients arranged like our parameter tree."""
    grads = {n: p.grad for n, p in model.named_parameters()}

    def pick(path: str, leaf: torch.Tensor) -> torch.Tensor:
        if path.endswith("moe.expert_bias"):
            return torch.zeros_like(leaf)
        if ".moe.experts." in path:
            layer = path.split(".")[1]
            pre = f"model.layers.{layer}.mlp.experts."
            if path.endswith("w_down"):
                return grads[pre + "down_proj"]
            gu = grads[pre + "gate_up_proj"]
            I = leaf.shape[1]
            return gu[:, :I] if path.endswith("w_gate") else gu[:, I:]
        return grads[hf_name(path)]
        return grads[name]

    return tree.map_with_path(pick, params_like)


def max_abs_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest absolute difference between two trees of the same structure, and where."""
    worst, where = 0.0, ""
    for (p, x), (_, y) in zip(tree.leaves_with_paths(a), tree.leaves_with_paths(b)):
        d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
        if d > worst:
            worst, where = d, p
    return worst, where
