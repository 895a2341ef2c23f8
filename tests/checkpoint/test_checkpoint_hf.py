"""Hugging Face folders from and into sharded states through DCP's HuggingFace storage: exported by 4
ranks (fsdp 4; ep 2 x fsdp 2 in the fused expert layout) and read by ``transformers`` with the same
logits; imported back into other layouts with the same parameters; every tensor accounted for."""

from __future__ import annotations

import json

import pytest
import torch

import _hf_helpers as H
import hpfunc
from hpfunc.models import preset, qwen3
from hpfunc.models.qwen3 import hf_sharded

pytestmark = pytest.mark.multirank


def _assert_same(got: dict, want: dict) -> None:
    a, b = hpfunc.tree.leaves_with_paths(got), hpfunc.tree.leaves_with_paths(want)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), p


@pytest.mark.parametrize("plan,axes,fused,shard_size", [
    ("fsdp", {"fsdp": 4}, False, "100KB"),
    ("ep_fsdp", {"ep": 2, "fsdp": 2}, True, "5GB"),
])
def test_sharded_export_loads_in_transformers_with_the_same_logits(pools, tmp_path, plan, axes, fused, shard_size):
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "hf")
    layouts = pools(4).run0(H.export_sharded, path, axes, plan, fused, shard_size, False)
    experts = layouts["layers"][0]["moe"]["experts"]["w_gate"]
    assert experts == ("f32[8@fsdp,32,64]" if plan == "fsdp" else "f32[8@ep,32@fsdp,64]")  # sharded, not gathered
    cfg = preset(H.CFG)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    want = hf_sharded.expected_tensors(cfg, fused_experts=fused, dtype=torch.float32)
    assert set(index["weight_map"]) == set(want)  # every tensor, each once, in the layout asked for
    assert len(set(index["weight_map"].values())) == (1 if fused else 7)
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s, _ in want.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    params = H.full_params(bias=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    torch.testing.assert_close(qwen3.apply(params, tokens, cfg), ref, rtol=1e-5, atol=1e-5)
    # and the one-process reader gets the exact parameters back
    _assert_same(qwen3.from_pretrained(path)[1], params)


def test_import_into_other_layouts_gives_the_exported_parameters(pools, tmp_path):
    path = str(tmp_path / "hf")
    pools(4).run0(H.export_sharded, path, {"fsdp": 4}, "fsdp", False, "60KB")
    want = H.full_params()
    for n, axes, plan in ((4, {"ep": 2, "fsdp": 2}, "ep_fsdp"), (4, {"dp": 2, "tp": 2}, "dp_tp"),
                          (2, {"fsdp": 2}, "fsdp"), (1, None, None)):
        out = pools(n).run0(H.import_sharded, path, axes, plan)
        _assert_same(out["params"], want)
        if plan == "ep_fsdp":
            assert out["layouts"]["layers"][0]["moe"]["experts"]["w_down"] == "f32[8@ep,64@fsdp,32]"
    # the fused layout (transformers 5's) is read too, into a sharded layout
    fused = str(tmp_path / "fused")
    pools(4).run0(H.export_sharded, fused, {"ep": 2, "fsdp": 2}, "ep_fsdp", True, "5GB")
    _assert_same(pools(4).run0(H.import_sharded, fused, {"fsdp": 4}, "fsdp")["params"], want)


def _edit(folder, edit) -> None:
    """Rewrite the one safetensors file of a folder with ``edit`` applied to its tensors."""
    from safetensors.torch import load_file, save_file

    (file,) = sorted(folder.glob("model-*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_missing_extra_or_misshapen_tensor_or_another_expert_count_is_named_on_every_rank(pools, tmp_path):
    src = tmp_path / "hf"
    pools(2).run0(H.export_sharded, str(src), {"fsdp": 2}, "fsdp", False, "5GB")
    cases = [
        (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
         r"missing 1 tensor.*'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"),
        (lambda t: t.update({"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 64)}),
         r"1 unexpected tensor.*'model\.layers\.0\.mlp\.shared_expert_gate\.weight'"),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}),
         r"'model\.layers\.0\.self_attn\.q_proj\.weight': expected shape \(64, 64\), found \(64, 32\)"),
        (lambda t: [t.pop(k) for k in list(t) if ".experts.7." in k],
         r"missing 6 tensor.*experts\.7\..*the checkpoint has 7 experts per MoE layer.*num_experts=8"),
    ]
    import re
    import shutil

    for i, (edit, pattern) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        shutil.copytree(src, folder)
        _edit(folder, edit)
        errors = pools(2).run(H.import_error, str(folder), {"fsdp": 2}, "fsdp")
        assert errors[0] == errors[1], errors  # the same error on both ranks
        assert errors[0].startswith("CheckpointMismatchError") and re.search(pattern, errors[0]), errors[0]


def test_export_is_atomic_and_replaces_an_old_folder(tmp_path):
    cfg = preset(H.CFG)
    params = H.full_params()
    path = tmp_path / "hf"
    path.mkdir()
    (path / "stale.safetensors").write_bytes(b"old")
    hf_sharded.export_pretrained(params, cfg, path, expert_bias="keep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial folder left
    assert not (path / "stale.safetensors").exists() and not (path / "sharded").exists()
    _assert_same(qwen3.from_pretrained(path)[1], params)


def test_sharded_export_of_a_nonzero_expert_bias_refuses_or_drops_knowingly(pools, tmp_path):
    """transformers' Qwen3-MoE drops the expert bias: the 4-rank export refuses on every rank (nothing
    written) unless told; with ``drop`` transformers computes hpfunc's function without the bias."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "hf"
    refused = pools(4).run(H.export_outcome, str(path), {"fsdp": 4}, "fsdp", "refuse")
    assert len(set(refused)) == 1, refused  # the same decision on every rank
    assert refused[0].startswith("ExpertBiasError: export_pretrained: refusing") and "expert_bias='drop'" in refused[0]
    assert "'model.layers.1.mlp.gate.e_score_correction_bias'" in refused[0]
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert pools(4).run(H.export_outcome, str(path), {"fsdp": 4}, "fsdp", "drop") == ["written"] * 4
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if "e_score_correction_bias" in k]
    cfg, params = preset(H.CFG), H.full_params()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    unbiased = hpfunc.tree.map_with_path(lambda p, t: t * 0 if p.endswith("expert_bias") else t, params)
    assert (qwen3.apply(unbiased, tokens, cfg) - ref).abs().max().item() <= 1e-4
    assert (qwen3.apply(params, tokens, cfg) - ref).abs().max().item() > 1e-3  # the bias routed differently
