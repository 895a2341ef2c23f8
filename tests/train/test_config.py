"""Config parsing: strict keys, types and choices, with errors that name the key path."""

from __future__ import annotations

import pathlib

import pytest

from hpfunc.train.build import build_model_config, build_schedule, check_buildable
from hpfunc.train.config import (
    ConfigError,
    apply_overrides,
    config_to_dict,
    load_config,
    load_config_dict,
)

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "configs"


def error_of(data, overrides=()):
    with pytest.raises(ConfigError) as info:
        cfg = load_config_dict(data, overrides)
        check_buildable(cfg)
    return str(info.value)


def test_defaults_are_valid():
    cfg = load_config_dict({})
    assert cfg.optimizer.name == "adamw" and cfg.data.source == "stdlib" and cfg.parallel == {}
    check_buildable(cfg)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"train": {"stpes": 3}}, "train.stpes: unknown key; did you mean 'steps'?"),
        ({"optimizer": {"lr_warmup": 3}}, "optimizer.lr_warmup: unknown key; did you mean 'warmup_steps'"),
        ({"optimizer": {"warmup_steps": 3}}, "did you mean 'schedule.warmup_steps'?"),
        ({"data": {"soruce": "text"}}, "data.soruce: unknown key; did you mean 'source'?"),
        ({"outptu": {}}, "outptu: unknown key; did you mean 'output'?"),
        ({"model": {"hiden_size": 8}}, "model.hiden_size: unknown key; did you mean 'hidden_size'?"),
    ],
)
def test_unknown_key_names_path_and_suggests(data, expected):
    assert expected in error_of(data)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"train": {"steps": "ten"}}, "train.steps: expected an integer, found string 'ten'"),
        ({"train": {"steps": 1.5}}, "train.steps: expected an integer"),
        ({"train": {"steps": 0}}, "train.steps: expected an integer >= 1, found integer 0"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected a number"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected a list of 2 numbers"),
        ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas.1: expected a number"),
        ({"optimizer": {"name": "adam"}}, "optimizer.name: expected one of 'adamw', 'muon_adamw', found string 'adam'; did you mean 'adamw'?"),
        ({"output": {"plot": "yes"}}, "output.plot: expected true or false"),
        ({"train": []}, "train: expected a mapping, found list"),
        ({"model": {"preset": 3}}, "model.preset: expected a string"),
        ({"model": {"hidden_size": "big"}}, "model.hidden_size: expected an integer, found string 'big'"),
        ({"data": {"source": "text"}}, "data.paths: data.source is 'text', which needs file paths"),
    ],
)
def test_bad_type_names_key(data, expected):
    assert expected in error_of(data)


def test_unknown_preset_names_key_and_lists_presets():
    msg = error_of({"model": {"preset": "qwen3-moe-tiy"}})
    assert msg.startswith("model.preset: unknown preset 'qwen3-moe-tiy'; did you mean 'qwen3-moe-tiny'?")
    assert "qwen3-dense-tiny" in msg


def test_model_overrides_reach_the_model_config():
    cfg = load_config_dict({"model": {"preset": "qwen3-moe-tiny", "hidden_size": 32, "mlp_only_layers": [0]}})
    mc = build_model_config(cfg.model)
    assert mc.hidden_size == 32 and mc.mlp_only_layers == (0,) and mc.num_experts == 8


def test_float_written_without_dot_is_accepted():
    # YAML 1.1 reads `3e-4` as a string; a number field takes it anyway.
    assert load_config_dict({"optimizer": {"lr": "3e-4"}}).optimizer.lr == pytest.approx(3e-4)


def test_overrides():
    raw = apply_overrides({"train": {"steps": 5}}, ["train.steps=7", "optimizer.betas=[0.9, 0.99]", "model.hidden_size=32"])
    assert raw == {"train": {"steps": 7}, "optimizer": {"betas": [0.9, 0.99]}, "model": {"hidden_size": 32}}
    cfg = load_config_dict({}, ["optimizer.clip_norm=null", "schedule.name=wsd"])
    assert cfg.optimizer.clip_norm is None and cfg.schedule.name == "wsd"
    assert "train.stepz: unknown key" in error_of({}, ["train.stepz=3"])
    assert "expected key.path=value" in error_of({}, ["train.steps"])
    assert "train.steps is integer 5, not a section" in error_of({"train": {"steps": 5}}, ["train.steps.x=1"])


def test_parallel_section():
    assert load_config_dict({"parallel": {}}).parallel == {}
    trivial = load_config_dict({"parallel": {"mesh": {"dp": 1, "tp": 1}}})
    assert trivial.parallel == {"mesh": {"dp": 1, "tp": 1}}
    assert "not supported yet in this version" in error_of({"parallel": {"mesh": {"fsdp": 2}}})
    assert "not supported yet in this version" in error_of({"parallel": {"plan": {"layers.*": "fsdp"}}})
    assert "parallel.mesh.dp: expected an integer axis size" in error_of({"parallel": {"mesh": {"dp": "x"}}})
    assert "parallel.mehs: unknown key; did you mean 'mesh'?" in error_of({"parallel": {"mehs": {}}})


def test_schedules():
    cfg = load_config_dict({"schedule": {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.5, "end_factor": 0.0}})
    f = build_schedule(cfg.schedule, 10)
    assert [round(f(s), 3) for s in (0, 1, 2, 4, 5, 10)] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.0]
    cos = build_schedule(load_config_dict({"schedule": {"name": "cosine", "end_factor": 0.1}}).schedule, 11)
    assert cos(0) == 1.0 and cos(10) == pytest.approx(0.1)
    assert "schedule.warmup_steps: expected at most train.steps" in error_of(
        {"train": {"steps": 5}, "schedule": {"warmup_steps": 6}}
    )


def test_yaml_file_round_trip(tmp_path):
    (tmp_path / "docs").mkdir()
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\ndata:\n  source: text\n  paths: docs/*.txt\n")
    cfg = load_config(path)
    assert cfg.data.paths == [str(tmp_path / "docs" / "*.txt")]  # relative to the config file
    import yaml

    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert load_config(again) == cfg


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_example_configs_are_valid():
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "no example config"
    for f in files:
        check_buildable(load_config(f))


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  batch_size: 2\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"line 4: key 'steps' is given twice in the same section \(first on line 2\)"):
        load_config(path)
