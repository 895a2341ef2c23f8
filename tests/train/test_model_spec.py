"""A model plugs into the trainer by one :class:`~hpfunc.models.spec.ModelSpec`: ``hpfunc/train`` names no
model, a second model (``_tiny_mlp_lm``, named by import path) trains through ``hpfunc train`` on a 2x2
mesh equal to one process, and bad model names are config errors naming the key."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from _train_helpers import TINY, write_corpus

import hpfunc
from hpfunc.train.build import build_model_config, check_buildable, model_spec
from hpfunc.train.config import ConfigError, load_config, load_config_dict
from hpfunc.train.output import read_metrics

HERE = pathlib.Path(__file__).parent
TINY_MLP = {"name": "_tiny_mlp_lm:SPEC", "preset": "mlp-tiny"}


def test_the_trainer_names_no_model():
    """The brief's check, ``grep -rn qwen3 hpfunc/train``, as a test: every model-specific piece comes
    through the spec."""
    train = pathlib.Path(hpfunc.__file__).parent / "train"
    hits = [f"{p.relative_to(train)}:{i}" for p in sorted(train.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if "qwen" in line.lower()]
    assert hits == []


def _config(tmp_path, **sections):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "model": TINY_MLP, "output": {**TINY["output"], "dir": str(tmp_path / "out"), "plot": False},
           **sections}
    path = tmp_path / "mlp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env():
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONWARNINGS"] = "ignore"
    # the ranks import the spec by its path: this folder must be importable there (as a user's package is)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")]), *sys.path])
    return env


@pytest.mark.slow
def test_a_second_model_trains_through_hpfunc_train_on_a_2x2_mesh_equal_to_one_process(tmp_path):
    from hpfunc.train.trainer import run

    steps = 4
    path = _config(tmp_path, parallel={"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]},
                   train={**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0},
                   callbacks=[{"layer_norms": {"every": 2}}])
    proc = subprocess.run([sys.executable, "-m", "hpfunc.cli", "train", str(path)], capture_output=True, text=True,
                          env=_env(), timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model: mlp-tiny, 10,240 params" in proc.stdout
    assert "plan fsdp('fsdp') + tp('tp')" in proc.stdout
    single = run(load_config(path, ["parallel=null", f"output.dir={tmp_path / 'single'}"]), echo=False)
    par = read_metrics(tmp_path / "out" / "metrics.jsonl")
    want = [r["loss"] for r in single.records if "loss" in r]
    got = [r["loss"] for r in par if "loss" in r]
    assert len(got) == len(want) == steps
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]  # it trains
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["params"] == 10240
    # the per-layer norms, each rank summing the squares of its blocks (sharded over fsdp, tp or both, or
    # replicated over tp) and one all-reduce, equal one device's
    got = read_metrics(tmp_path / "out" / "norms.jsonl")
    want = read_metrics(tmp_path / "single" / "norms.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 4]
    for g, w in zip(got, want):
        assert set(g["param_norm"]) == {"embed", "layers.0", "layers.1", "head"}
        assert g["param_norm"] == pytest.approx(w["param_norm"], rel=1e-5)
        assert g["total"] == pytest.approx(w["total"], rel=1e-5)


def test_a_model_by_import_path_builds_and_checks_its_plan():
    cfg = load_config_dict({"model": {**TINY_MLP, "hidden_size": 8}, "train": {"batch_size": 4},
                            "parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}})
    assert model_spec(cfg.model).name == "tiny_mlp_lm"
    assert build_model_config(cfg.model).hidden_size == 8
    check_buildable(cfg)


@pytest.mark.parametrize("model, needle", [
    ({"name": "qwen3-moe"}, "model.name: unknown model 'qwen3-moe'; did you mean 'qwen3_moe'? registered: qwen3, "
                            "qwen3_moe"),
    ({"name": "no_such_pkg.models:SPEC"}, "model.name: cannot import the module 'no_such_pkg.models' of "
                                          "'no_such_pkg.models:SPEC'"),
    ({"name": "_tiny_mlp_lm:SPECS"}, "model.name: the module '_tiny_mlp_lm' has no attribute 'SPECS'"),
    ({"name": "_tiny_mlp_lm:NOT_A_SPEC"}, "model.name: '_tiny_mlp_lm:NOT_A_SPEC' is a int, expected a "
                                          "hpfunc.models.spec.ModelSpec"),
    ({"name": "_tiny_mlp_lm:SPEC", "preset": "mlp-tin"}, "model.preset: unknown preset 'mlp-tin' of model "
                                                         "'tiny_mlp_lm'; did you mean 'mlp-tiny'?"),
    ({**TINY_MLP, "hiden_size": 8}, "model.hiden_size: unknown key; did you mean 'hidden_size'?"),
    ({**TINY_MLP, "hidden_size": "big"}, "model.hidden_size: expected an integer, found string 'big'"),
])
def test_bad_model_names_are_config_errors_naming_the_key(model, needle):
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict({"model": model}))
    assert needle in str(info.value)


def test_a_plan_entry_the_model_has_no_piece_for_is_a_config_error():
    cfg = load_config_dict({"model": TINY_MLP, "parallel": {"mesh": {"ep": 2}, "plan": ["ep"]}})
    with pytest.raises(ConfigError, match=r"parallel.plan\[0\]: ep \(expert parallelism over 'ep'\) needs a "
                                          r"mixture-of-experts model.*model 'tiny_mlp_lm'"):
        check_buildable(cfg)
    cfg = load_config_dict({"model": TINY_MLP, "train": {"batch_size": 4},
                            "parallel": {"mesh": {"pp": 2}, "plan": ["pp"]}})
    with pytest.raises(ConfigError, match="pp over 'pp' needs the model's pipeline_stages, and the model "
                                          "'tiny_mlp_lm' has none"):
        check_buildable(cfg)


def test_a_checkpoint_of_another_model_is_refused_by_name():
    from hpfunc.train.checkpointing import check_compatible
    from hpfunc.train.config import config_to_dict

    saved = config_to_dict(load_config_dict({}))
    with pytest.raises(ConfigError, match="model.name: the checkpoint ck was saved with the model 'qwen3_moe', "
                                          "this run trains 'tiny_mlp_lm'"):
        check_compatible(saved, load_config_dict({"model": TINY_MLP}), "ck")
