"""``hpfunc convert``: every direction between dcp, hf and torch gives the same parameters; the fused
expert layout both ways; every tensor accounted for (errors name the tensor); streamed: the process's
own memory stays far below the model's size; the 30B-A3B export on meta lists every published tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import hpfunc
from hpfunc import checkpoint
from hpfunc.checkpoint import CheckpointError
from hpfunc.models import preset, qwen3
from hpfunc.models.qwen3 import convert as cv
from hpfunc.models.qwen3.hf_sharded import expected_tensors


def _assert_same(a, b) -> None:
    la, lb = hpfunc.tree.leaves_with_paths(a), hpfunc.tree.leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), p


@pytest.fixture
def moe(tmp_path):
    cfg = preset("qwen3-moe-tiny")
    params = qwen3.init(hpfunc.random.key(3), cfg, dtype=torch.bfloat16)
    params["layers"][1]["moe"]["expert_bias"] = torch.arange(cfg.num_experts, dtype=torch.float32) / 3
    qwen3.save_pretrained(params, cfg, tmp_path / "hf", max_shard_size="80KB", expert_bias="keep")
    return cfg, params


def test_every_direction_gives_the_same_parameters(tmp_path, moe):
    cfg, params = moe
    d = str(tmp_path)
    assert cv.detect_format(d + "/hf") == "hf"
    steps = [("hf", "/hf", "/a.pt", {}), ("torch", "/a.pt", "/ckpt", {"to": "dcp"}),
             ("dcp", "/ckpt", "/b.pt", {"to": "torch"}), ("torch", "/b.pt", "/hf2", {"to": "hf"}),
             ("hf", "/hf2", "/ckpt2", {"to": "dcp", "fused_experts": True}),
             ("dcp", "/ckpt2", "/fused", {"to": "hf", "fused_experts": True}),
             ("hf", "/fused", "/c.pt", {}),            # fused in, per-expert out
             ("torch", "/c.pt", "/hf3", {"to": "hf"})]
    for fmt, src, dst, kw in steps:
        assert cv.detect_format(d + src) == fmt
        r = cv.convert(d + src, d + dst, cfg=cfg, max_shard_size="80KB", expert_bias="keep", **kw)
        assert r.source == fmt and r.parameters == qwen3.count_params(cfg) + cfg.num_experts  # one bias published
    # the DCP checkpoint is an ordinary hpfunc checkpoint of {"params": ...}
    meta = hpfunc.tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), params)
    _assert_same(checkpoint.load(d + "/ckpt", checkpoint.abstract({"params": meta}))["params"], params)
    fused = load_file(d + "/fused/" + json.loads(open(d + "/fused/model.safetensors.index.json").read())
                      ["weight_map"]["model.layers.0.mlp.experts.gate_up_proj"])
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    for folder in ("/hf2", "/fused", "/hf3"):
        _assert_same(qwen3.from_pretrained(d + folder)[1], params)
    assert torch.load(d + "/c.pt")["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)


def test_the_cli_converts_and_names_a_bad_tensor(tmp_path, moe, capsys):
    from hpfunc.cli import main

    cfg, params = moe
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.pt"), "--expert-bias", "keep"])
    assert "hf -> torch: 70 tensors" in capsys.readouterr().out
    sd = torch.load(tmp_path / "m.pt")
    sd.pop("model.layers.0.mlp.experts.5.gate_proj.weight")
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "out"), "--to", "hf", "--config", "qwen3-moe-tiny"])
    err = capsys.readouterr().err
    assert "missing 1 tensor(s)" in err and "'model.layers.0.mlp.experts.5.gate_proj.weight'" in err
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_mismatches_are_named_before_writing(tmp_path, moe):
    cfg, _ = moe
    tensors = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        tensors.update(load_file(f))
    cases = [
        (lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}),
         r"1 unexpected tensor.*experts\.8\.up_proj"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(65)}), r"'model\.norm\.weight': expected shape \(64,\), found \(65,\)"),
        (lambda t: t.pop("lm_head.weight"), r"missing 1 tensor.*'lm_head\.weight'"),
    ]
    for i, (edit, pattern) in enumerate(cases):
        t = dict(tensors)
        edit(t)
        torch.save(t, tmp_path / f"case{i}.pt")
        with pytest.raises(CheckpointError, match=pattern):
            cv.convert(tmp_path / f"case{i}.pt", tmp_path / f"out{i}", to="dcp", cfg=cfg)
        assert not (tmp_path / f"out{i}").exists()
    with pytest.raises(CheckpointError, match=r"no model config; pass --config"):
        cv.convert(tmp_path / "case0.pt", tmp_path / "x", to="hf")
    with pytest.raises(CheckpointError, match=r"is hf already"):
        cv.convert(tmp_path / "hf", tmp_path / "x", to="hf")
    with pytest.raises(CheckpointError, match=r"--to must be one of dcp, hf, torch, found None"):
        cv.convert(tmp_path / "hf", tmp_path / "x")


_PEAK = textwrap.dedent("""
    import sys, threading, time, torch
    from hpfunc.models import preset
    from hpfunc.models.qwen3 import convert as cv
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    base, peak, done = anon(), [0], []
    def watch():
        while not done:
            peak[0] = max(peak[0], anon()); time.sleep(0.002)
    th = threading.Thread(target=watch); th.start()
    cfg = preset("qwen3-dense-tiny", **{CFG})
    r = cv.convert(sys.argv[1], sys.argv[2], to=sys.argv[3], cfg=cfg, max_shard_size="16MB")
    done.append(1); th.join()
    print(r.bytes, max(peak[0], anon()) - base)
""")


def test_conversions_stream_a_few_hundred_mb(tmp_path):
    # 171 MB of fp32 in 8 layers; the largest tensor (an MLP matrix) is 6.3 MB
    over = dict(vocab_size=4096, hidden_size=512, intermediate_size=3072, num_hidden_layers=8,
                tie_word_embeddings=False)
    cfg = preset("qwen3-dense-tiny", **over)
    g = torch.Generator().manual_seed(0)  # values do not matter here; qwen3.init's counter-based sampling is slower
    params = hpfunc.tree.tree_map(lambda s: torch.randn(s, generator=g), qwen3.model.param_shapes(cfg),
                                  is_leaf=lambda x: isinstance(x, torch.Size))
    qwen3.save_pretrained(params, cfg, tmp_path / "hf", max_shard_size="64MB")
    largest = max(x.numel() * 4 for x in hpfunc.tree.leaves(params))
    del params
    script = _PEAK.replace("{CFG}", repr(over))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {}
    for src, dst, to in (("hf", "ckpt", "dcp"), ("ckpt", "hf2", "hf")):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", script, str(tmp_path / src), str(tmp_path / dst), to],
                             capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        total, peak = map(int, res.stdout.split()[-2:])
        out[to] = (total, peak)
        print(to, round(time.perf_counter() - t0, 1), "s")
    total = out["dcp"][0]
    assert total > 160e6 and largest == 4096 * 512 * 4  # the embedding
    print({k: (t / 1e6, p / 1e6) for k, (t, p) in out.items()})
    # hf -> dcp maps the source: the process's own memory grows by a few tensors at most (DCP's staging)
    assert out["dcp"][1] < 4 * largest, out
    # dcp -> hf: one parameter at a time (DCP reads it through a buffer: x3) plus one 16 MB file's tensors
    assert out["hf"][1] < 3 * largest + 2 * 16e6 < total / 2, out


def test_qwen3_30b_a3b_names_and_shapes_on_meta():
    # Qwen3-30B-A3B (docs/reference.md): 48 layers x (4 attention projections + q/k norms + 2 layer norms
    # + router + 128 experts x 3 projections) + embedding, final norm, lm_head = 48 x 393 + 3 tensors,
    # 30.53 B parameters (REFERENCE.md: 30.53 B total).
    cfg = preset("qwen3-30b-a3b")
    names = expected_tensors(cfg)
    assert len(names) == 48 * 393 + 3 == 18867
    total = sum(torch.Size(s).numel() for s, _ in names.values())
    assert round(total / 1e9, 2) == 30.53 and total == qwen3.count_params(cfg)
    assert names["model.layers.47.mlp.experts.127.down_proj.weight"] == ((2048, 768), torch.bfloat16)
    assert names["model.layers.0.self_attn.q_proj.weight"][0] == (4096, 2048)
    assert names["model.embed_tokens.weight"][0] == names["lm_head.weight"][0] == (151936, 2048)
    fused = expected_tensors(cfg, fused_experts=True)
    assert len(fused) == 48 * (393 - 384 + 2) + 3
    assert fused["model.layers.0.mlp.experts.gate_up_proj"][0] == (128, 1536, 2048)
