"""from_pretrained / save_pretrained: exact round trips (single file and sharded), the fused expert layout,
and errors that name keys, shapes and token ids."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hpfunc
from hpfunc.models import ConfigError, preset, qwen3
from hpfunc.models.qwen3.hf import CheckpointError


def _params(name: str = "qwen3-moe-tiny", **overrides):
    cfg = preset(name, **overrides)
    return cfg, qwen3.init(hpfunc.random.key(1), cfg)


def _assert_same(a, b) -> None:
    la, lb = hpfunc.tree.leaves_with_paths(a), hpfunc.tree.leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), p


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "qwen3-dense-tiny"])
def test_single_file_round_trip_is_exact(tmp_path, name: str) -> None:
    cfg, params = _params(name)
    qwen3.save_pretrained(params, cfg, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    cfg2, params2 = qwen3.from_pretrained(tmp_path)
    assert cfg2 == cfg
    _assert_same(params, params2)


def test_sharded_round_trip_with_expert_bias(tmp_path) -> None:
    cfg, params = _params()
    params["layers"][1]["moe"]["expert_bias"] = torch.arange(cfg.num_experts, dtype=torch.float32) / 10
    qwen3.save_pretrained(params, cfg, tmp_path, max_shard_size="60KB", expert_bias="keep")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(os.path.exists(tmp_path / s) for s in shards)
    keys = set(index["weight_map"])
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in keys  # zero bias is not written
    _, params2 = qwen3.from_pretrained(tmp_path)
    _assert_same(params, params2)


def test_fused_expert_layout_is_read(tmp_path) -> None:
    cfg, params = _params()
    qwen3.save_pretrained(params, cfg, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in cfg.moe_layers:
        pre = f"model.layers.{layer}.mlp.experts."
        gate = [tensors.pop(f"{pre}{e}.gate_proj.weight") for e in range(cfg.num_experts)]
        up = [tensors.pop(f"{pre}{e}.up_proj.weight") for e in range(cfg.num_experts)]
        down = [tensors.pop(f"{pre}{e}.down_proj.weight") for e in range(cfg.num_experts)]
        tensors[pre + "gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        tensors[pre + "down_proj"] = torch.stack(down)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, params2 = qwen3.from_pretrained(tmp_path)
    _assert_same(params, params2)


def _rewrite(tmp_path, edit) -> None:
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path) -> None:
    cfg, params = _params()
    qwen3.save_pretrained(params, cfg, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        qwen3.from_pretrained(tmp_path)

    qwen3.save_pretrained(params, cfg, tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 64)}))
    with pytest.raises(CheckpointError, match=r"unexpected .*shared_expert_gate"):
        qwen3.from_pretrained(tmp_path)

    qwen3.save_pretrained(params, cfg, tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*expected shape \(64, 64\), found \(64, 32\)"):
        qwen3.from_pretrained(tmp_path)


def test_config_of_another_architecture_is_rejected(tmp_path) -> None:
    cfg, params = _params()
    qwen3.save_pretrained(params, cfg, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"config\.json.*model_type='mixtral'.*MixtralForCausalLM"):
        qwen3.from_pretrained(tmp_path)


def test_missing_files_are_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        qwen3.from_pretrained(tmp_path)


def test_token_ids_outside_vocabulary_are_named() -> None:
    cfg, params = _params()
    with pytest.raises(ValueError, match=r"token id 300 .*vocab_size=256"):
        qwen3.apply(params, torch.tensor([[1, 300, 2]]), cfg)
    with pytest.raises(ValueError, match=r"token id -1"):
        qwen3.apply(params, torch.tensor([[-1, 3]]), cfg)


def test_dtype_cast_on_load(tmp_path) -> None:
    cfg, params = _params("qwen3-dense-tiny")
    qwen3.save_pretrained(params, cfg, tmp_path)
    _, p16 = qwen3.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert p16["embed"].dtype == torch.bfloat16
    logits = qwen3.apply(p16, torch.tensor([[1, 2, 3]]), cfg)
    assert logits.dtype == torch.bfloat16


def test_transformers_sharded_checkpoint_is_read(tmp_path) -> None:
    pytest.importorskip("transformers")
    from ._hf import hf_model

    cfg = preset("qwen3-moe-tiny")
    ref = hf_model(cfg, seed=3)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg2, params = qwen3.from_pretrained(tmp_path)
    assert cfg2 == cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, 7))
    assert (qwen3.apply(params, tokens, cfg) - ref(input_ids=tokens).logits).abs().max().item() <= 1e-5
