"""Malformed Hugging Face folders: a valid folder mutated one way (config.json: a required key missing,
an unknown key added, a key of the wrong JSON type or out of range, the file not JSON; tensors missing,
extra, of another shape or dtype; a shard or the index missing, truncated or disagreeing) is either
refused by ``from_pretrained`` with a ``ConfigError`` / ``CheckpointError`` / ``FileNotFoundError`` that
names the file (or folder) and the key, or — an unknown config key, which transformers' configs carry
many of — loads the very same model. Never another exception, never a different model. 200 generated
cases on two tiny folders, one process."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import hpfunc
from hpfunc.models import ConfigError, preset, qwen3
from hpfunc.models.qwen3.hf import _CONFIG_KEYS, CheckpointError

_WRONG = {  # kind: values of the wrong type or out of range
    "an int >= 1": ["12", 1.5, True, [1], 0, -3, None],
    "an int >= 0": ["12", 2.5, False, {"a": 1}, -1],
    "a number > 0": ["x", True, [1.0], 0, -1e-6, None],
    "a number >= 0": ["0.1", False, -0.5],
    "a bool": ["false", 0, 1, None, []],
    "a string": [5, ["qwen3"], None],
    "a list of strings": ["Qwen3ForCausalLM", 5, [5]],
    "a list of layer indices": ["0", 5, [99], [-1], [0.5]],
    "a token id": ["1", -1, 1.5, [True]],
    "an object": [5, "yarn", [1]],
}
_NULL_OK = {k for k, (kind, req) in _CONFIG_KEYS.items() if not req and kind != "a bool"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_bases")
    out = {}
    for name, cfg, shard in (("moe_sharded", preset("qwen3-moe-tiny"), "60KB"),
                             ("dense_single", preset("qwen3-dense-tiny", num_hidden_layers=1), "5GB")):
        params = qwen3.init(hpfunc.random.key(0), cfg)
        qwen3.save_pretrained(params, cfg, root / name, max_shard_size=shard)
        out[name] = (root / name, cfg, params)
    assert os.path.exists(root / "moe_sharded" / "model.safetensors.index.json")
    return out


def _files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _edit_config(folder, edit):
    d = json.loads((folder / "config.json").read_text())
    edit(d)
    (folder / "config.json").write_text(json.dumps(d))


def _edit_tensors(folder, file, edit):
    t = load_file(folder / file)
    edit(t)
    save_file(t, folder / file, metadata={"format": "pt"})


def _edit_index(folder, edit):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    edit(index["weight_map"])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@st.composite
def mutations(draw, sharded: bool):
    """``(what, apply(folder), words the error must name)``; words None: the same model must load."""
    kinds = ["config_missing", "config_extra", "config_wrong", "config_not_json", "tensor_missing",
             "tensor_extra", "tensor_shape", "tensor_dtype"]
    if sharded:
        kinds += ["shard_missing", "shard_truncated", "index_missing", "index_moved", "index_dropped",
                  "index_added"]
    kind = draw(st.sampled_from(kinds))
    if kind == "config_missing":
        key = draw(st.sampled_from(sorted(k for k, (_, req) in _CONFIG_KEYS.items() if req)))
        return kind, lambda f: _edit_config(f, lambda d: d.pop(key)), ["config.json", repr(key)]
    if kind == "config_extra":
        key = draw(st.from_regex(r"[a-z_]{3,12}", fullmatch=True).filter(lambda k: k not in _CONFIG_KEYS
                                                                          and k != "torch_dtype"))
        value = draw(st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none(),
                               st.lists(st.integers(), max_size=3)))
        return kind, lambda f: _edit_config(f, lambda d: d.__setitem__(key, value)), None
    if kind == "config_wrong":
        key = draw(st.sampled_from(sorted(_CONFIG_KEYS)))
        kind_of = _CONFIG_KEYS[key][0]
        value = draw(st.sampled_from([v for v in _WRONG[kind_of] if not (v is None and key in _NULL_OK)]))
        return f"{kind} {key}={value!r}", lambda f: _edit_config(f, lambda d: d.__setitem__(key, value)), \
            ["config.json", repr(key)]
    if kind == "config_not_json":
        cut = draw(st.integers(1, 40))
        return kind, lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:-cut]), \
            ["config.json", "not valid JSON"]
    if kind == "shard_missing":
        i = draw(st.integers(0, 2))
        return kind, lambda f: os.remove(f / _files(f)[i]), ["model.safetensors.index.json", "-of-"]
    if kind == "shard_truncated":
        i, cut = draw(st.integers(0, 2)), draw(st.integers(1, 5000))

        def truncate(f):
            data = (f / _files(f)[i]).read_bytes()
            (f / _files(f)[i]).write_bytes(data[:max(0, len(data) - cut)])
        return kind, truncate, ["-of-", "safetensors"]
    if kind == "index_missing":
        return kind, lambda f: os.remove(f / "model.safetensors.index.json"), ["model.safetensors.index.json"]
    if kind.startswith("index_"):
        n = draw(st.integers(0, 10**6))

        def edit_index(f):
            def edit(wm):
                name = sorted(wm)[n % len(wm)]
                if kind == "index_moved":
                    others = sorted(set(wm.values()) - {wm[name]})
                    wm[name] = others[n % len(others)]
                elif kind == "index_dropped":
                    del wm[name]
                else:
                    wm["model.layers.0.mlp.gate.extra"] = wm[name]
            _edit_index(f, edit)
        return kind, edit_index, ["model.safetensors.index.json"]
    # tensor mutations: one tensor of one file
    pick = draw(st.integers(0, 10**6))

    def tensor_edit(f):
        file = _files(f)[pick % len(_files(f))]
        names = sorted(load_file(f / file))
        name = names[pick % len(names)]
        tensor_edit.name = name

        def edit(t):
            if kind == "tensor_missing":
                del t[name]
            elif kind == "tensor_extra":
                t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
            elif kind == "tensor_shape":
                x = t[name]
                dim = pick % x.ndim
                t[name] = torch.zeros([s + (1 if d == dim else 0) for d, s in enumerate(x.shape)], dtype=x.dtype)
            else:
                t[name] = t[name].to(torch.float16 if pick % 2 else torch.int32)
        _edit_tensors(f, file, edit)
    words = {"tensor_extra": ["model.layers.0.self_attn.extra.weight"]}.get(kind)
    return kind, tensor_edit, words or [lambda: repr(tensor_edit.name)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_malformed_folder_is_refused_naming_file_and_key_or_loads_the_same_model(bases, tmp_path_factory, data):
    base = data.draw(st.sampled_from(sorted(bases)))
    src, cfg, params = bases[base]
    what, apply, words = data.draw(mutations(base == "moe_sharded"))
    folder = tmp_path_factory.mktemp("case")
    shutil.copytree(src, folder, dirs_exist_ok=True)
    apply(folder)
    try:
        cfg2, params2 = qwen3.from_pretrained(folder)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        msg = str(e)
        assert words is not None, f"{base} {what}: the same model should load, got {type(e).__name__}: {msg}"
        assert str(folder) in msg, f"{base} {what}: the error does not name the folder or file: {msg}"
        for w in words:
            w = w() if callable(w) else w
            assert w in msg, f"{base} {what}: the error does not name {w}: {msg}"
        return
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert words is None, f"{base} {what}: loaded instead of refused"
    assert cfg2 == cfg, f"{base} {what}: another config"
    assert all(torch.equal(a, b) and a.dtype == b.dtype
               for a, b in zip(hpfunc.tree.leaves(params2), hpfunc.tree.leaves(params))), f"{base} {what}"
