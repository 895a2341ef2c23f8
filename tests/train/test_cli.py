"""End to end through ``hpfunc train``: outputs are written and the loss falls on a tiny model."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from _train_helpers import TINY, write_corpus

from hpfunc.cli import main as hpfunc_main
from hpfunc.train.cli import main as train_main
from hpfunc.train.config import load_config
from hpfunc.train.output import read_metrics

@pytest.fixture
def tiny_config(tmp_path):
    write_corpus(tmp_path / "corpus")
    cfg = dict(TINY, output={**TINY["output"], "dir": str(tmp_path / "out")})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_no_args_is_a_usage_error_exit_2(capsys):
    for run in (train_main, lambda argv: hpfunc_main(["train", *argv])):
        with pytest.raises(SystemExit) as info:
            run([])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "usage: hpfunc train CONFIG.yaml" in err
    train_main(["--help"])
    assert capsys.readouterr().out.startswith("usage: hpfunc train CONFIG.yaml")


def test_config_error_exits_2_naming_key(tiny_config, capsys):
    with pytest.raises(SystemExit) as info:
        train_main([str(tiny_config), "--set", "optimizer.lr_warmup=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "optimizer.lr_warmup: unknown key; did you mean 'warmup_steps'" in err
    with pytest.raises(SystemExit):
        train_main([str(tiny_config), "--set", "model.preset=nope"])
    assert "model.preset: unknown preset 'nope'" in capsys.readouterr().err


def test_check_prints_resolved_config(tiny_config, capsys):
    train_main([str(tiny_config), "--check", "--steps", "7"])
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["train"]["steps"] == 7 and resolved["model"]["hidden_size"] == 32


def test_train_end_to_end_loss_falls(tiny_config, tmp_path, capsys):
    hpfunc_main(["train", str(tiny_config)])  # through the top-level dispatcher
    out = tmp_path / "out"
    printed = capsys.readouterr().out
    assert "step 30/30" in printed and "loss: first" in printed
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20, 25, 30]
    assert {"ce_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "expert_load", "expert_imbalance"} <= set(train[0])
    assert len(train[0]["expert_load"]) == 2 and len(train[0]["expert_load"][0]) == 4
    # the losses of a line are logged the same way (window means): loss = ce_loss + coef * aux_loss
    from hpfunc.train.build import build_model_config

    coef = build_model_config(load_config(tiny_config).model).router_aux_loss_coef
    for r in train:
        assert abs(r["loss"] - (r["ce_loss"] + coef * r["aux_loss"])) <= 1e-5 * r["loss"], r
    assert [r["step"] for r in records if "val_loss" in r] == [15, 30]
    first, last = train[0]["loss"], train[-1]["loss"]
    assert first > 5.0  # about ln(256) at init
    assert last < first - 1.5, (first, last)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("def ") and "sample (temperature 0.8)" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 32
    assert summary["last_loss"] < summary["first_loss"]
    # The saved config is the resolved one and loads back to the same run.
    assert load_config(out / "config.yaml") == load_config(tiny_config)


def test_divergence_stops_with_a_clear_message(tiny_config, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_main([str(tiny_config), "--set", "optimizer.lr=1e30", "--set", "optimizer.clip_norm=null",
                    "--set", "schedule.warmup_steps=0", "--set", "optimizer.weight_decay=0.0"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "lower optimizer.lr" in err
    assert (tmp_path / "out" / "metrics.jsonl").exists()


def test_ids_beyond_the_model_vocabulary_name_the_fix(tmp_path, capsys):
    import numpy as np

    np.save(tmp_path / "ids.npy", np.arange(1000) % 300)
    cfg = {"data": {"source": "ids", "paths": ["ids.npy"]}, "train": {"steps": 1},
           "output": {"dir": str(tmp_path / "out"), "progress": "none"}}
    (tmp_path / "ids.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as info:
        train_main([str(tmp_path / "ids.yaml")])
    assert info.value.code == 2
    assert "set model.vocab_size: 300" in capsys.readouterr().err
    train_main([str(tmp_path / "ids.yaml"), "--set", "model.vocab_size=300", "--set", "train.num_threads=1",
                "--set", "train.seq_len=16", "--set", "train.batch_size=2"])
    assert read_metrics(tmp_path / "out" / "metrics.jsonl")[0]["step"] == 1
