"""``model.pretrained: DIR`` (a Hugging Face folder, read by each rank in its plan's layout) and
``parallel.sdc_check`` in the trainer's config: parsed, checked with errors naming the key, and wired
into the parallel step."""

from __future__ import annotations

import pytest
import torch
from _pretrained_helpers import build_from_config

import hpfunc
from hpfunc.models import preset, qwen3
from hpfunc.train.build import check_buildable
from hpfunc.train.config import ConfigError, config_to_dict, load_config_dict

MODEL = {"preset": "qwen3-moe-tiny", "num_hidden_layers": 1}


def test_sdc_check_is_parsed_and_checked():
    cfg = load_config_dict({"parallel": {"mesh": {"dp": 2}, "plan": ["ddp"], "sdc_check": "raise"}})
    assert cfg.parallel.sdc_check == "raise" and config_to_dict(cfg)["parallel"]["sdc_check"] == "raise"
    assert load_config_dict({"parallel": {"sdc_check": False}}).parallel.sdc_check == "off"  # YAML's bare off
    assert "sdc_check" not in config_to_dict(load_config_dict({})).get("parallel", {})
    with pytest.raises(ConfigError, match=r"parallel\.sdc_check: expected one of off, raise, warn .*found string 'abort'"):
        load_config_dict({"parallel": {"sdc_check": "abort"}})


def test_pretrained_folder_is_the_model_and_errors_name_the_key(tmp_path):
    cfg = preset("qwen3-moe-tiny", num_hidden_layers=1)
    qwen3.save_pretrained(qwen3.init(hpfunc.random.key(2), cfg), cfg, tmp_path / "hf")
    base = {"model": {"pretrained": str(tmp_path / "hf"), "rope_theta": 5000.0},
            "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}, "train": {"batch_size": 2, "seq_len": 16}}
    got = check_buildable(load_config_dict(base))
    assert got.num_hidden_layers == 1 and got.rope_theta == 5000.0  # config.json, then the overrides
    with pytest.raises(ConfigError, match=r"model\.pretrained: '.*nothing' holds no config\.json"):
        check_buildable(load_config_dict({**base, "model": {"pretrained": str(tmp_path / "nothing")}}))


def test_a_one_process_run_starts_from_the_pretrained_weights(tmp_path):
    from hpfunc.models.qwen3.hf import load_params
    from hpfunc.train.trainer import run

    cfg = preset("qwen3-moe-tiny", num_hidden_layers=1)
    params = qwen3.init(hpfunc.random.key(2), cfg)
    qwen3.save_pretrained(params, cfg, tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(hpfunc.tree.leaves(load_params(tmp_path / "hf", cfg)),
                                                  hpfunc.tree.leaves(params)))
    data = {"model": {"pretrained": str(tmp_path / "hf")}, "train": {"steps": 1, "batch_size": 2, "seq_len": 16,
                                                                      "eval_batches": 1},
            "data": {"max_bytes": 20000}, "output": {"progress": "none", "plot": False, "dir": str(tmp_path / "o")}}
    first = run(load_config_dict(data), echo=False).records[0]["loss"]
    # the loss of those weights on the run's first batch differs from a fresh init's
    other = run(load_config_dict({**data, "model": {"preset": "qwen3-moe-tiny", "num_hidden_layers": 1},
                                  "output": {**data["output"], "dir": str(tmp_path / "p")}}), echo=False)
    assert first != other.records[0]["loss"]


@pytest.mark.multirank
def test_a_parallel_run_starts_from_the_pretrained_weights_with_the_sdc_check(pools, tmp_path):
    cfg = preset("qwen3-moe-tiny", num_hidden_layers=1)
    params = qwen3.init(hpfunc.random.key(2), cfg)
    qwen3.save_pretrained(params, cfg, tmp_path / "hf")
    data = {"model": {"pretrained": str(tmp_path / "hf")}, "train": {"batch_size": 2, "seq_len": 16},
            "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"], "sdc_check": "warn"}}
    out = pools(2).run0(build_from_config, data)
    assert out["sdc"] == "warn" and out["model"] == cfg
    assert out["layouts"]["layers"][0]["moe"]["experts"]["w_up"] == "f32[8@fsdp,32,64]"
    for (p, a), (_, b) in zip(hpfunc.tree.leaves_with_paths(out["params"]), hpfunc.tree.leaves_with_paths(params)):
        assert torch.equal(a, b), p
