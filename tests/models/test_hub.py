"""Hub repository ids and tokenizer files: ``model.pretrained`` / ``from_pretrained`` take ``owner/name``
resolved through huggingface_hub's own cache (offline here: a cache laid out as huggingface_hub
writes it), and an HF export carries the source folder's tokenizer files."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from hpfunc import random
from hpfunc.models import hub, preset, qwen3
from hpfunc.models.qwen3 import convert as qconvert

hf_constants = pytest.importorskip("huggingface_hub.constants")

TOKENIZER = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
             "tokenizer_config.json": '{"model_max_length": 2048}',
             "generation_config.json": '{"do_sample": false}'}


@pytest.fixture(scope="module")
def model():
    cfg = preset("qwen3-moe-tiny")
    return cfg, qwen3.init(random.key(0), cfg)


def _hf_folder(folder: pathlib.Path, cfg, params) -> pathlib.Path:
    qwen3.save_pretrained(params, cfg, folder)
    for name, text in TOKENIZER.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, model):
    """A huggingface_hub cache holding ``acme/tiny-moe`` at revision ``main`` (refs/main -> a snapshot)."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-moe"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _hf_folder(repo / "snapshots" / commit, *model)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / commit


def test_from_pretrained_reads_a_repository_id_from_the_cache(offline_cache, model):
    cfg, params = model
    cfg2, params2 = qwen3.from_pretrained("acme/tiny-moe")
    assert cfg2 == cfg
    assert torch.equal(params2["layers"][1]["moe"]["experts"]["w_down"], params["layers"][1]["moe"]["experts"]["w_down"])
    assert hub.local_folder("acme/tiny-moe") == str(offline_cache)


def test_a_repository_id_not_in_the_cache_is_a_clear_error_offline(offline_cache):
    with pytest.raises(hub.HubError, match=r"'acme/other'.*not in the local cache.*huggingface-cli download"):
        qwen3.from_pretrained("acme/other")


def test_the_trainer_config_resolves_model_pretrained_as_a_repository_id(offline_cache, tmp_path):
    from hpfunc.train.config import ConfigError, load_config

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("model:\n  pretrained: acme/tiny-moe\n")
    assert load_config(yaml_file).model.pretrained == str(offline_cache)
    # a folder next to the config wins over a repository id of the same spelling
    local = tmp_path / "acme" / "tiny-moe"
    local.mkdir(parents=True)
    assert load_config(yaml_file).model.pretrained == str(local)
    yaml_file.write_text("model:\n  pretrained: acme/missing\n")
    with pytest.raises(ConfigError, match=r"^model\.pretrained: 'acme/missing' is not a folder"):
        load_config(yaml_file)


def test_convert_to_hf_carries_the_tokenizer_files(tmp_path, model):
    cfg, params = model
    src = _hf_folder(tmp_path / "src", cfg, params)
    qconvert.convert(src, tmp_path / "dcp", to="dcp")
    qconvert.convert(tmp_path / "dcp", tmp_path / "plain", to="hf")  # converted dcp: no trainer config
    assert not (tmp_path / "plain" / "tokenizer.json").exists()
    # a trainer checkpoint records the folder it started from (config.model.pretrained)
    from hpfunc import checkpoint

    state = {"params": params}
    checkpoint.save(tmp_path / "trained", state, step=3,
                    metadata={"model": cfg.to_hf_dict(), "config": {"model": {"pretrained": str(src)}}})
    qconvert.convert(tmp_path / "trained", tmp_path / "out", to="hf")
    for name, text in TOKENIZER.items():
        assert (tmp_path / "out" / name).read_text() == text, name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == cfg.hidden_size
    _, back = qwen3.from_pretrained(tmp_path / "out")
    assert torch.equal(back["embed"], params["embed"])
