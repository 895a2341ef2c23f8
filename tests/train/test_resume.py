"""Checkpoints in ``hpfunc train``: resume (one process, a mesh, a mesh change), last words, config checks.

The reference is an uninterrupted run of the same config; a resumed run must log the same per-step
losses and learning rates, bit for bit on the same layout (fp32), to rtol 1e-5 across a mesh change.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc import checkpoint
from hpfunc.train.cli import main as train_main
from hpfunc.train.fault_hooks import ENV as FAULTS
from hpfunc.train.output import read_metrics

STEPS = 20
FSDP2 = {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}
FSDP2_TP2 = {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}
FSDP4 = {"mesh": {"fsdp": 4}, "plan": ["fsdp"]}


def _cfg(tmp_path, **over):
    """TINY for 20 steps with a cosine schedule (the learning rate depends on the step counter), one
    metrics line per step, checkpoints every 5 steps (all kept), no sample or plot."""
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "schedule": {"name": "cosine", "warmup_steps": 3},
           "train": {**TINY["train"], "steps": STEPS, "log_every": 1, "eval_every": 0},
           "output": {**TINY["output"], "dir": str(tmp_path / "out"), "sample_tokens": 0, "plot": False,
                      "progress": "none"},
           "checkpoint": {"every": 5, "keep_last": None}}
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) and key != "parallel" else value
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(folder):
    """``[(step, loss, lr)]`` of a run's metrics, in order."""
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(folder / "metrics.jsonl") if "loss" in r]


def test_sigterm_then_resume_auto_on_one_process_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    path = _cfg(tmp_path)
    train_main([str(path), "--out", str(tmp_path / "ref")])
    ref = _losses(tmp_path / "ref")
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))

    # a real SIGTERM (sent by the process to itself after step 10, through the test hook) stops the run
    # after that step: exit status 143 and a checkpoint of step 10 written on the way out
    monkeypatch.setenv(FAULTS, "term@10")
    with pytest.raises(SystemExit) as stop:
        train_main([str(path)])
    monkeypatch.delenv(FAULTS)
    assert stop.value.code == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after step 10; saved the checkpoint of step 10" in err, err
    out = tmp_path / "out"
    assert checkpoint.complete_steps(out / "checkpoints") == [5, 10]
    assert not (out / "summary.json").exists()

    # a run into that folder without --resume is refused (it holds a run), and says how to continue it
    with pytest.raises(SystemExit) as refused:
        train_main([str(path)])
    assert refused.value.code == 2
    assert "holds checkpoints of a previous run (steps 5 to 10); continue that run with --resume auto" in \
        capsys.readouterr().err

    train_main([str(path), "--resume", "auto"])
    assert _losses(out) == ref  # every step once, bit for bit, learning rates included (the schedule's position)
    summary = json.loads((out / "summary.json").read_text())
    want = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10
    for key in ("first_loss", "last_loss", "min_loss", "val_loss", "steps", "tokens"):
        assert summary[key] == want[key], key
    # the resumed run's own checkpoints continue the series
    assert checkpoint.complete_steps(out / "checkpoints") == [5, 10, 15, 20]


def test_resume_refuses_another_model_naming_the_key(tmp_path, capsys):
    path = _cfg(tmp_path, train={"steps": 5})
    train_main([str(path)])
    with pytest.raises(SystemExit) as e:
        train_main([str(path), "--resume", "auto", "--set", "model.hidden_size=48"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "config error: model.hidden_size: the checkpoint" in err and "was saved with 32, this run has 48" in err
    assert "--set model.hidden_size=32" in err
    with pytest.raises(SystemExit):
        train_main([str(path), "--resume", "auto", "--set", "optimizer.name=muon_adamw"])
    assert "optimizer.name: the checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main([str(path), "--resume", "auto", "--overwrite"])
    assert "--resume: a resumed run continues the run in its folder, --overwrite replaces it" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main([str(path), "--resume", str(tmp_path / "nowhere")])
    assert f"--resume: {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    # --overwrite starts over: the old checkpoints go too, so a later --resume auto cannot pick them
    train_main([str(path), "--overwrite", "--set", "checkpoint.every=2"])
    assert checkpoint.complete_steps(tmp_path / "out" / "checkpoints") == [2, 4, 5]


def _run_in_ranks(cfg_path, out, resume, parallel):
    from hpfunc.train.config import load_config
    from hpfunc.train.trainer import run

    cfg = load_config(cfg_path, [f"parallel={json.dumps(parallel)}", f"output.dir={out}"])
    result = run(cfg, resume=resume, echo=False)
    return [(r["step"], r["loss"], r["lr"]) for r in result.records if "loss" in r], result.summary


@pytest.mark.multirank
def test_resume_on_a_mesh_and_across_a_mesh_change(tmp_path, pool4):
    """20 steps on {fsdp: 2, tp: 2}; from its checkpoint of step 10: 10 more on the same mesh (bitwise)
    and on {fsdp: 4} (another world layout: the tp-split matrices loaded whole-row sharded through the
    abstract target, no rank holding the whole model: rtol 1e-5)."""
    path = _cfg(tmp_path)
    ref, _ = pool4.run(_run_in_ranks, str(path), str(tmp_path / "ref"), "never", FSDP2_TP2)[0]
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))
    step10 = tmp_path / "ref" / "checkpoints" / "step_00000010"
    marker = checkpoint.info(step10)
    assert marker["keys"]["params.embed"]["saved_as"] == "P('fsdp') on {'fsdp': 2, 'tp': 2}"
    assert marker["keys"]["data_step"] == {"kind": "object", "type": "int"}
    assert marker["metadata"]["config"]["parallel"]["mesh"] == {"fsdp": 2, "tp": 2}
    assert marker["world_size"] == 4

    for name, parallel in (("same", FSDP2_TP2), ("fsdp4", FSDP4)):
        out = tmp_path / name
        out.mkdir()
        shutil.copy(tmp_path / "ref" / "metrics.jsonl", out / "metrics.jsonl")  # cut back to step 10 by the run
        records, summary = pool4.run(_run_in_ranks, str(path), str(out), str(step10), parallel)[0]
        assert summary["resumed_from_step"] == 10
        assert [s for s, _, _ in records] == list(range(1, STEPS + 1))
        if name == "same":
            assert records == ref
        else:
            assert records[:10] == ref[:10]  # the kept lines of the first 10 steps
            assert [lr for *_, lr in records] == [lr for *_, lr in ref]
            assert [x for _, x, _ in records] == pytest.approx([x for _, x, _ in ref], rel=1e-5)
            # the resumed run trained on {fsdp: 4}: its own checkpoints say so
            assert checkpoint.info(out / "checkpoints" / "step_00000015")["keys"]["params.embed"]["saved_as"] == \
                "P('fsdp') on {'fsdp': 4}"
        assert _losses(out) == records  # the file: steps 1-10 kept, 11-20 appended once
