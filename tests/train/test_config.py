"""Config parsing: strict keys, types and choices, with errors that name the key path."""

from __future__ import annotations

import pathlib

import pytest

from hpfunc.train.build import build_model_config, build_schedule, check_buildable
from hpfunc.train.config import (
    ConfigError,
    ParallelConfig,
    PlanEntry,
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
    assert cfg.optimizer.name == "adamw" and cfg.data.source == "stdlib"
    assert cfg.parallel == ParallelConfig() and cfg.parallel.size == 1
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


def test_parallel_section_trivial_and_empty():
    assert load_config_dict({"parallel": {}}).parallel == ParallelConfig()
    assert load_config_dict({"parallel": None}).parallel == ParallelConfig()
    trivial = load_config_dict({"parallel": {"mesh": {"dp": 1, "tp": 1}}}).parallel
    assert trivial.mesh == {"dp": 1, "tp": 1} and trivial.size == 1 and trivial.plan == ()


def test_parallel_plan_binds_mesh_axes_in_order():
    pc = load_config_dict({"parallel": {"mesh": {"fsdp": 2, "tp": 2},
                                        "plan": ["fsdp", {"tp": {"vocab_parallel": True}}]}}).parallel
    assert pc.size == 4 and pc.data_axes == ("fsdp",) and pc.data_size == 2
    assert pc.plan == (PlanEntry("fsdp", ("fsdp",), {"reshard_after_forward": True}),
                       PlanEntry("tp", ("tp",), {"vocab_parallel": True, "sequence_parallel": False}))
    # positional: the names of the entries need not be the axis names
    pc = load_config_dict({"parallel": {"mesh": {"data": 2, "model": 2}, "plan": ["zero1", "tp"]}}).parallel
    assert [(e.kind, e.axes) for e in pc.plan] == [("zero1", ("data",)), ("tp", ("model",))]
    # hsdp takes two axes; an explicit axis is claimed first, the others go to entries without one
    pc = load_config_dict({"parallel": {"mesh": {"dp": 2, "fsdp": 2, "tp": 2},
                                        "plan": [{"tp": {"axis": "tp"}}, "hsdp"]}}).parallel
    assert [(e.kind, e.axes) for e in pc.plan] == [("tp", ("tp",)), ("hsdp", ("dp", "fsdp"))]
    assert pc.data_axes == ("dp", "fsdp") and pc.data_size == 4
    # a single entry may be written without a list; size-1 axes need no entry
    pc = load_config_dict({"parallel": {"mesh": {"dp": 2, "tp": 1}, "plan": "ddp"}}).parallel
    assert [(e.kind, e.axes) for e in pc.plan] == [("ddp", ("dp",))]


def test_parallel_plan_builds_the_plans_factories():
    from hpfunc.train.distributed import build_plan

    pc = load_config_dict({"parallel": {"mesh": {"dp": 2, "fsdp": 2, "tp": 2},
                                        "plan": ["ddp", {"fsdp": {"reshard_after_forward": False}}, "tp"]}}).parallel
    model = build_model_config(load_config_dict({}).model)
    plan = build_plan(pc, model)
    assert plan.data_axes == ("dp", "fsdp") and plan.tp_axis == "tp" and not plan.reshard_after_forward
    assert [layer.kind for layer in plan.layers] == ["ddp", "fsdp", "tp"]
    # entries compose in mesh-axis order, whatever order they are written in
    pc = load_config_dict({"parallel": {"mesh": {"fsdp": 2, "tp": 2},
                                        "plan": [{"tp": {"axis": "tp"}}, {"zero3": {"axis": "fsdp"}}]}}).parallel
    assert [layer.axis for layer in build_plan(pc, model).layers] == ["fsdp", "tp"]


MESH = {"fsdp": 2, "tp": 2}


@pytest.mark.parametrize(
    "parallel, expected",
    [
        ({"mehs": {}}, "parallel.mehs: unknown key; did you mean 'mesh'?"),
        ({"mesh": {"dp": "x"}}, "parallel.mesh.dp: expected an integer axis size >= 1, found string 'x'"),
        ({"mesh": {"dp": 0}}, "parallel.mesh.dp: expected an integer axis size >= 1"),
        ({"mesh": [2, 2]}, "parallel.mesh: expected a mapping of axis name to size"),
        ({"mesh": MESH, "plan": ["fsdp", "tpp"]}, "parallel.plan[1]: unknown plan 'tpp'; did you mean 'tp'?"),
        ({"mesh": MESH}, "parallel.plan: missing; the mesh {fsdp: 2, tp: 2} (4 processes) needs a plan"),
        ({"mesh": MESH, "plan": ["fsdp"]}, "parallel.mesh.tp: the axis has size 2 but no entry of parallel.plan"),
        ({"mesh": MESH, "plan": ["fsdp", "tp", "ddp"]}, "parallel.plan[2]: no mesh axis left for 'ddp'"),
        ({"mesh": MESH, "plan": ["fsdp", {"tp": {"axis": "model"}}]},
         "parallel.plan[1].tp.axis: 'model' is not an axis of parallel.mesh {fsdp: 2, tp: 2}"),
        ({"mesh": MESH, "plan": [{"fsdp": {"axis": "tp"}}, {"tp": {"axis": "tp"}}]},
         "parallel.plan[1].tp.axis: mesh axis 'tp' is already used by parallel.plan[0] (fsdp)"),
        ({"mesh": MESH, "plan": ["fsdp", {"tp": {"vocab_paralel": True}}]},
         "parallel.plan[1].tp.vocab_paralel: unknown option of tp; did you mean 'vocab_parallel'?"),
        ({"mesh": MESH, "plan": ["fsdp", {"tp": {"vocab_parallel": "yes"}}]},
         "parallel.plan[1].tp.vocab_parallel: expected true or false"),
        ({"mesh": MESH, "plan": [{"hsdp": {"axes": ["fsdp"]}}]}, "parallel.plan[0].hsdp.axes: expected 2 mesh axis"),
        ({"mesh": MESH, "plan": [{"fsdp": 2}, "tp"]}, "parallel.plan[0].fsdp: expected a mapping of options"),
        ({"mesh": MESH, "plan": [{"fsdp": None, "tp": None}]}, "parallel.plan[0]: expected a plan name (fsdp) or one"),
        ({"mesh": {"a": 2, "b": 2}, "plan": ["tp", "tp"]}, "parallel.plan[1]: a second tp entry"),
        ({"plan": ["ddp"]}, "parallel.mesh: parallel.plan needs a mesh of named axes"),
        ({"mesh": MESH, "plan": {"layers.*": "fsdp"}}, "parallel.plan[0]: unknown plan 'layers.*'"),
    ],
)
def test_parallel_syntax_errors_name_the_key(parallel, expected):
    assert expected in error_of({"parallel": parallel})


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"train": {"batch_size": 6}, "parallel": {"mesh": {"dp": 2, "fsdp": 2}, "plan": ["ddp", "fsdp"]}},
         "train.batch_size: the global batch of 6 does not split evenly over the 4 data-parallel ranks "
         "(parallel.mesh dp: 2 x fsdp: 2); use a multiple of 4"),
        ({"parallel": {"mesh": {"fsdp": 1, "tp": 4}, "plan": ["fsdp", "tp"]}},
         "parallel.mesh.tp: tensor parallelism over 4 ranks must divide the 2 key/value heads of the model "
         "(model.num_key_value_heads)"),
        ({"model": {"vocab_size": 257}, "parallel": {"mesh": {"tp": 2}, "plan": [{"tp": {"vocab_parallel": True}}]}},
         "parallel.mesh.tp: tensor parallelism over 2 ranks must divide the 257 vocabulary rows (vocab_parallel)"),
        ({"model": {"moe_intermediate_size": 33}, "parallel": {"mesh": MESH, "plan": ["fsdp", "tp"]}},
         "parallel.mesh.tp: tp('tp') of size 2 must divide dimension 2 of 'layers.0.moe.experts.w_down' (size 33)"),
        ({"train": {"seq_len": 15}, "parallel": {"mesh": {"tp": 2}, "plan": [{"tp": {"sequence_parallel": True}}]}},
         "train.seq_len: sequence parallelism (parallel.plan[0]) splits the sequence of 15 over 2 ranks"),
    ],
)
def test_parallel_plan_is_checked_against_model_and_batch(data, expected):
    assert expected in error_of(data)


def test_parallel_config_round_trips_through_yaml(tmp_path):
    import yaml

    cfg = load_config_dict({"parallel": {"mesh": {"dp": 2, "fsdp": 2, "tp": 2},
                                         "plan": ["hsdp", {"tp": {"vocab_parallel": True}}]}})
    data = config_to_dict(cfg)
    assert data["parallel"] == {"mesh": {"dp": 2, "fsdp": 2, "tp": 2}, "plan": [
        {"hsdp": {"axes": ["dp", "fsdp"], "reshard_after_forward": True}},
        {"tp": {"axis": "tp", "vocab_parallel": True, "sequence_parallel": False}}]}
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(path) == cfg
    assert config_to_dict(load_config_dict({}))["parallel"] == {}


def test_parallel_overrides_from_the_command_line():
    base = {"parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}}
    assert load_config_dict(base, ["parallel.mesh.tp=1"]).parallel.size == 2
    assert load_config_dict(base, ["parallel=null"]).parallel == ParallelConfig()
    pc = load_config_dict(base, ["parallel.plan=[zero2, {tp: {vocab_parallel: true}}]"]).parallel
    assert [e.kind for e in pc.plan] == ["zero2", "tp"] and pc.plan[1].options["vocab_parallel"]


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


def test_microbatches_must_split_the_batch():
    assert load_config_dict({"train": {"batch_size": 8, "microbatches": 4}}).train.microbatches == 4
    with pytest.raises(ConfigError, match=r"train.microbatches: the batch of 8 does not split into 3"):
        load_config_dict({"train": {"batch_size": 8, "microbatches": 3}})
    with pytest.raises(ConfigError, match=r"the batch of 8 \(4 per data shard\) does not split into 8"):
        load_config_dict({"train": {"batch_size": 8, "microbatches": 8},
                          "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}})
    with pytest.raises(ConfigError, match="train.microbatches: expected an integer >= 1"):
        load_config_dict({"train": {"microbatches": 0}})
