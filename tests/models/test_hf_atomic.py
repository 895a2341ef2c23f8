"""save_pretrained is atomic: a write that fails half-way (here: the second safetensors shard) leaves the
folder exactly as it was, never a mix of old and new files; a write that succeeds replaces the model files
whole, drops stale shards and keeps the folder's other files."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

import hpfunc
from hpfunc.models import preset, qwen3


def _snapshot(folder) -> dict[str, bytes]:
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))}


def test_a_failed_write_leaves_the_old_folder_whole(tmp_path, monkeypatch) -> None:
    cfg = preset("qwen3-dense-tiny")
    old, new = qwen3.init(hpfunc.random.key(1), cfg), qwen3.init(hpfunc.random.key(2), cfg)
    folder = tmp_path / "model"
    qwen3.save_pretrained(old, cfg, folder, max_shard_size="60KB")
    (folder / "tokenizer.json").write_text("{}")
    before = _snapshot(folder)
    assert sum(name.startswith("model-") for name in before) > 2

    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="No space left"):
        qwen3.save_pretrained(new, cfg, folder, max_shard_size="60KB")
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert len(calls) == 2 and _snapshot(folder) == before
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary folder left behind
    _, loaded = qwen3.from_pretrained(folder)
    assert torch.equal(loaded["embed"], old["embed"])

    # the same write without the failure: new weights in one file, old shards gone, the tokenizer kept
    qwen3.save_pretrained(new, cfg, folder)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["model"]
    _, loaded = qwen3.from_pretrained(folder)
    assert torch.equal(loaded["embed"], new["embed"])
