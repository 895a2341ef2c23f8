"""Pure Qwen3 models (dense and MoE) and their building blocks.

>>> import torch, hpfunc
>>> from hpfunc.models import qwen3
>>> cfg = qwen3.preset("qwen3-moe-tiny")
>>> params = qwen3.init(hpfunc.random.key(0), cfg)
>>> qwen3.apply(params, torch.zeros(1, 4, dtype=torch.long), cfg).shape
torch.Size([1, 4, 256])
"""

from hpfunc.models import qwen3
from hpfunc.models.attention import gqa_attention
from hpfunc.models.config import ConfigError, Qwen3Config, RopeScaling, preset
from hpfunc.models.layers import linear, rms_norm, swiglu_mlp
from hpfunc.models.dispatch import AllToAll, Dispatched
from hpfunc.models.moe import (Routing, expert_counts, expert_ffn, grouped_experts, is_expert_bias,
                               load_balancing_loss, moe_block, route_topk, update_expert_bias)
from hpfunc.models.rope import apply_rope, rope_inv_freq, rope_tables

__all__ = [
    "qwen3", "Qwen3Config", "RopeScaling", "ConfigError", "preset",
    "rms_norm", "linear", "swiglu_mlp", "gqa_attention", "apply_rope", "rope_inv_freq", "rope_tables",
    "Routing", "route_topk", "expert_counts", "grouped_experts", "expert_ffn", "moe_block", "load_balancing_loss",
    "AllToAll", "Dispatched",
    "is_expert_bias", "update_expert_bias",
]
