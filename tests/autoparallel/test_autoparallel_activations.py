"""The cost model's saved activations per layer against storage liveness on Qwen3's real decoder layer.

Measured with :func:`hpfunc.transforms.remat.saved_activations` (weak references on storages), bf16: a dense
layer at Qwen3-30B-A3B's attention shapes (h 2048, 32 x 128 query heads, 4 KV heads, SwiGLU 6144,
s 4096) on fake tensors, and an MoE layer of ``qwen3-moe-small`` (32 experts, top-4) on real tensors
(routing is data-dependent). Full and selective recompute are exact; without recompute the table is
within 2% (it leaves out a few small float32 statistics and counts the routing indices as one block).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hpfunc import tree
from hpfunc.autoparallel.configuration import Layout, Workload
from hpfunc.autoparallel.memory_model import layer_activation_bytes_per_token
from hpfunc.transforms.remat import saved_activations
from hpfunc.models.qwen3 import model as M
from hpfunc.models.qwen3.describe import describe
from hpfunc.transforms import remat as R

POLICIES = {"none": None, "full": R.nothing_saveable, "selective": R.dots_with_no_batch_dims_saveable}


def _measure(cfg, seq_len: int, fake: bool) -> dict:
    shapes = M.param_shapes(cfg)["layers"][0]
    g = torch.Generator().manual_seed(0)
    out = {}
    with FakeTensorMode() if fake else contextlib.nullcontext():
        params = tree.tree_map(lambda s: (torch.randn(tuple(s), generator=None if fake else g) * 0.02).bfloat16(),
                               shapes, is_leaf=lambda x: isinstance(x, torch.Size))
        h = torch.randn(1, seq_len, cfg.hidden_size, generator=None if fake else g).bfloat16()
        cos, sin = M.rope_for(h, torch.arange(seq_len)[None], cfg)
        for kind, policy in POLICIES.items():
            r = saved_activations(lambda p, x: M.decoder_layer(p, x, cos, sin, cfg)[0], params, h, policy=policy,
                                  state_argnums=(0,))
            out[kind] = r.device_bytes
    return out


@pytest.mark.parametrize("name, seq_len, fake", [("dense-30b-a3b-shapes", 4096, True), ("qwen3-moe-small", 256, False)])
def test_layer_activations_match_storage_liveness(name, seq_len, fake):
    if name == "dense-30b-a3b-shapes":
        cfg = M.preset("qwen3-30b-a3b", num_experts=0, moe_intermediate_size=0, num_experts_per_tok=0,
                       num_hidden_layers=1)
    else:
        cfg = M.preset(name)
    measured = _measure(cfg, seq_len, fake)
    layer = describe(cfg, act_bytes=2).layers[0]
    work = Workload(global_batch=1, seq_len=seq_len)
    est = {k: layer_activation_bytes_per_token(layer, k, Layout(), work) * seq_len for k in POLICIES}
    assert est["full"] == measured["full"] == 2 * seq_len * cfg.hidden_size  # Korthikanti: 2 s b h
    assert est["selective"] == measured["selective"]
    assert est["none"] == pytest.approx(measured["none"], rel=0.02)
