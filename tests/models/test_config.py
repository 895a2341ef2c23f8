"""Qwen3Config: HF config.json in and out, presets, errors, and the full Qwen3-30B-A3B on the meta device."""

from __future__ import annotations

import time

import pytest
import torch

import hpfunc
from hpfunc.models import ConfigError, Qwen3Config, RopeScaling, preset, qwen3
from hpfunc.models.config import PRESETS

# The published Qwen/Qwen3-30B-A3B config.json (hub layout, transformers 4.51).
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_published_config_is_the_preset() -> None:
    assert Qwen3Config.from_hf_dict(QWEN3_30B_A3B_CONFIG) == preset("qwen3-30b-a3b")


def test_param_counts_of_qwen3_30b_a3b() -> None:
    cfg = preset("qwen3-30b-a3b")
    assert abs(qwen3.count_params(cfg) / 1e9 - 30.53) < 0.01
    assert abs(qwen3.active_params(cfg) / 1e9 - 3.35) < 0.01
    shapes = qwen3.param_shapes(cfg)
    layer = shapes["layers"][0]
    attn = sum(s.numel() for s in layer["attn"].values())
    assert abs(attn / 1e6 - 18.87) < 0.01  # docs/reference.md#qwen3-30b-a3b-configuration-and-parameter-counts
    assert abs(3 * 768 * 2048 / 1e6 - 4.72) < 0.01 and layer["moe"]["experts"]["w_gate"] == (128, 768, 2048)


def test_full_model_builds_on_meta_quickly() -> None:
    cfg = preset("qwen3-30b-a3b")
    t0 = time.perf_counter()
    params = qwen3.init(hpfunc.random.key(0), cfg, dtype=torch.bfloat16, device="meta")
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"meta init took {elapsed:.2f}s"
    leaves = hpfunc.tree.leaves_with_paths(params)
    assert all(t.device.type == "meta" for _, t in leaves)
    assert sum(t.numel() for p, t in leaves if not p.endswith("expert_bias")) == qwen3.count_params(cfg)
    assert params["layers"][47]["moe"]["experts"]["w_down"].shape == (128, 2048, 768)
    assert params["layers"][0]["moe"]["expert_bias"].dtype == torch.float32


@pytest.mark.parametrize("name", PRESETS)
def test_presets_round_trip_through_hf_dict(name: str) -> None:
    cfg = preset(name)
    assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_byte_level_presets_cover_bytes() -> None:
    for name in ("qwen3-moe-tiny", "qwen3-dense-tiny", "qwen3-moe-small"):
        assert preset(name).vocab_size >= 256
    small = preset("qwen3-moe-small")
    assert (small.num_hidden_layers, small.hidden_size, small.num_experts, small.num_experts_per_tok) == (4, 256, 32, 4)


def test_transformers_v5_rope_parameters_are_read() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = preset("qwen3-moe-tiny", rope_scaling=RopeScaling(rope_type="yarn", factor=4.0,
                                                            original_max_position_embeddings=512))
    d = cfg.to_hf_dict()
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    written = hf.to_dict()
    assert "rope_parameters" in written
    assert Qwen3Config.from_hf_dict({**written, "architectures": ["Qwen3MoeForCausalLM"]}) == cfg


def test_other_architecture_is_rejected_by_name() -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    with pytest.raises(ConfigError, match=r"architectures=\['LlamaForCausalLM'\].*|model_type='llama'"):
        Qwen3Config.from_hf_dict(llama)
    with pytest.raises(ConfigError, match="architectures"):
        Qwen3Config.from_hf_dict({**QWEN3_30B_A3B_CONFIG, "architectures": ["Qwen3ForCausalLM"]})


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
])
def test_unsupported_or_invalid_fields_raise(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Qwen3Config.from_hf_dict({**QWEN3_30B_A3B_CONFIG, **change})


def test_linear_and_yarn_rope_scaling_are_read_from_hub_layout() -> None:
    d = {**QWEN3_30B_A3B_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}}
    cfg = Qwen3Config.from_hf_dict(d)
    assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    lin = Qwen3Config.from_hf_dict({**QWEN3_30B_A3B_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert lin.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)


def test_dense_layers_inside_moe_model() -> None:
    cfg = preset("qwen3-moe-tiny", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert cfg.moe_layers == (1,)
    shapes = qwen3.param_shapes(cfg)
    assert "mlp" in shapes["layers"][0] and "moe" in shapes["layers"][1] and "mlp" in shapes["layers"][3]


def test_full_model_forward_backward_under_fake_tensors() -> None:
    # Dry runs (FLOP / memory accounting) trace the real model without values or memory.
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = preset("qwen3-30b-a3b", num_hidden_layers=2)  # real shapes, fewer layers to keep the test short
    with FakeTensorMode():
        params = hpfunc.tree.tree_map(lambda s: torch.empty(s, dtype=torch.bfloat16), qwen3.param_shapes(cfg))
        tokens = torch.zeros(1, 8, dtype=torch.long)
        (value, aux), grads = hpfunc.value_and_grad(qwen3.loss, has_aux=True)(params, {"tokens": tokens}, cfg)
        assert value.shape == () and aux["expert_load"].shape == (2, 128)
        assert grads["layers"][1]["moe"]["experts"]["w_up"].shape == (128, 768, 2048)
