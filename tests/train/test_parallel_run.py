"""``hpfunc train`` on a mesh: checks before launch, the launcher's failure path, and a 2x2 run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc.train.cli import main as train_main
from hpfunc.train.output import read_metrics

MESH_2X2 = {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}


def _config(tmp_path, name="tiny.yaml", **sections):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "output": {**TINY["output"], "dir": str(tmp_path / "out")}, **sections}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env():
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the command must launch its own ranks
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run_in_ranks(cfg_path, parallel):
    """``trainer.run`` of the config on a pool rank, as ``hpfunc train`` runs it on a launched one (the
    launch itself is tested above): rank 0's console lines, every warning logged or raised meanwhile (the
    pool silences torch.distributed's log otherwise; DTensor's once-per-mesh memory of its warnings is
    cleared first), and the training records."""
    import io
    import logging
    import warnings

    from torch.distributed.tensor import _redistribute

    from hpfunc.train.config import load_config
    from hpfunc.train.trainer import run

    cfg = load_config(cfg_path, [f"parallel={json.dumps(parallel)}"])
    _redistribute._warned_flatten_issues.clear()
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    # torch's logging setup stops some loggers' propagation: the handler goes on each one on the way down
    loggers = [logging.getLogger(n) for n in ("torch.distributed", "torch.distributed.tensor",
                                              "torch.distributed.tensor._redistribute")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
    stream = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(cfg, stream=stream, echo=True)
    finally:
        for log, level in zip(loggers, levels):
            log.removeHandler(handler)
            log.setLevel(level)
    return stream.getvalue(), "\n".join(said + [str(w.message) for w in caught])


def test_a_plan_that_does_not_fit_fails_before_any_process_starts(tmp_path, capsys):
    path = _config(tmp_path, parallel={"mesh": {"fsdp": 1, "tp": 4}, "plan": ["fsdp", "tp"]})
    with pytest.raises(SystemExit) as info:
        train_main([str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error: parallel.mesh.tp: tensor parallelism over 4 ranks must divide the 2 key/value heads" in err
    with pytest.raises(SystemExit):
        train_main([str(path), "--set", "parallel.mesh={fsdp: 4, tp: 1}", "--set", "train.batch_size=6"])
    assert "train.batch_size: the global batch of 6 does not split evenly over the 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_launch_whose_size_differs_from_the_mesh_is_refused(tmp_path, capsys, monkeypatch):
    # a single-process config under a 4-process launcher would have 4 copies write one folder
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as info:
        train_main([str(_config(tmp_path))])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "hpfunc train [rank 0]: config error: parallel.mesh: this launch has 4 processes (WORLD_SIZE)" in err
    assert not (tmp_path / "out").exists()


def test_check_prints_the_resolved_plan_per_parameter(tmp_path, capsys):
    path = _config(tmp_path, parallel=MESH_2X2)
    train_main([str(path), "--check"])
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)  # the plan is in comments: the output is still the config
    assert resolved["parallel"]["plan"][1] == {"tp": {"axis": "tp", "vocab_parallel": False,
                                                      "sequence_parallel": False}}
    assert "# mesh {fsdp: 2, tp: 2} (4 processes), plan fsdp('fsdp') + tp('tp')" in out
    line = next(x for x in out.splitlines() if x.startswith("# layers.0.attn.wq "))
    assert "P('tp', 'fsdp') -> P('tp') | opt P('tp', 'fsdp')" in line


@pytest.mark.slow
def test_a_failing_rank_ends_the_launch_with_its_status_and_message(tmp_path):
    # rank 1 fails at once; rank 0 would sleep for ten minutes unless the launcher stops it
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("boom on rank 1", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(600)
    """))
    code = f"from hpfunc.train.launch import launch; raise SystemExit(launch([{str(script)!r}], 2))"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "boom on rank 1" in proc.stderr
    assert "hpfunc: rank 1 of 2 failed (exit status 3)" in proc.stderr
    assert time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_train_on_a_2x2_mesh_matches_one_device(tmp_path):
    """``hpfunc train`` launches 4 ranks (fsdp 2 x tp 2, gloo); rank 0 alone writes the outputs; the
    per-step losses equal a single-device run of the same config (same global batches)."""
    from hpfunc.train.config import load_config
    from hpfunc.train.trainer import run

    steps = 6
    path = _config(tmp_path, parallel=MESH_2X2, optimizer={"name": "muon_adamw", "lr": 1e-2},
                   train={**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0})
    proc = subprocess.run([sys.executable, "-m", "hpfunc.cli", "train", str(path)], capture_output=True, text=True,
                          env=_env(), timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    printed = proc.stdout
    assert "parallel: 4 processes (gloo), mesh {fsdp: 2, tp: 2}, plan fsdp('fsdp') + tp('tp')" in printed
    for k in range(1, steps + 1):
        assert printed.count(f"step {k}/{steps} ") == 1, printed  # rank 0 alone prints
    assert printed.count("done: ") == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "loss.png", "metrics.jsonl", "sample.txt",
                                                    "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 4 and summary["mesh"] == {"fsdp": 2, "tp": 2} and summary["steps"] == steps
    assert (out / "sample.txt").read_text().startswith("def ")
    assert load_config(out / "config.yaml") == load_config(path)

    single = run(load_config(path, ["parallel=null", f"output.dir={tmp_path / 'single'}"]), echo=False)
    par = read_metrics(out / "metrics.jsonl")
    want = [r["loss"] for r in single.records if "loss" in r]
    got = [r["loss"] for r in par if "loss" in r]
    assert len(got) == len(want) == steps
    assert got == pytest.approx(want, rel=1e-5), (got, want)  # the load-balancing term of the whole batch too
    # evaluation ran on the gathered parameters: it agrees too
    val = [r["val_loss"] for r in par if "val_loss" in r]
    assert val == pytest.approx([single.summary["val_loss"]], rel=1e-4)
    assert par[0]["expert_load"] == single.records[0]["expert_load"]  # summed over the data shards


@pytest.mark.parametrize("parallel", [{"mesh": {"fsdp": 2, "ep": 2}, "plan": [{"fsdp": {"axis": "fsdp"}}, {"ep": {"axis": "ep"}}]},
                                      {"mesh": {"ep": 4}, "plan": ["ep"]}])
@pytest.mark.multirank
def test_expert_parallel_train_matches_one_device(tmp_path, pools, parallel):
    """The trainer with experts split over ``ep`` (with fsdp, and alone on 4 ranks; on the pool's ranks:
    the launch is test_train_on_a_2x2_mesh_matches_one_device's): every per-step loss, the load-balancing
    loss (the load of the whole batch) and the expert load equal the single-device run of the same config,
    with the expert bias moving every step."""
    from hpfunc.train.config import load_config
    from hpfunc.train.trainer import run

    steps = 5
    path = _config(tmp_path, parallel=parallel, optimizer={"name": "adamw", "lr": 1e-2},
                   train={**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0, "expert_bias_rate": 1e-2,
                          "aux_loss_coef": 0.1})
    printed, warned = pools(4).run(_run_in_ranks, str(path), parallel)[0]
    assert "ep('ep')" in printed and "redistributing" not in printed + warned, printed + warned
    single = run(load_config(path, ["parallel=null", f"output.dir={tmp_path / 'single'}"]), echo=False)
    par = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    want = [r for r in single.records if "loss" in r]
    assert len(par) == len(want) == steps
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in par] == pytest.approx([r[key] for r in want], rel=1e-5), key
    assert [r["expert_load"] for r in par] == [r["expert_load"] for r in want]
    n = parallel["mesh"]["ep"]
    assert all(len(r["ep_rank_load"][0]) == n and sum(r["ep_rank_load"][0]) == sum(r["expert_load"][0]) for r in par)


def test_expert_parallel_that_does_not_divide_the_experts_fails_before_launch(tmp_path, capsys):
    path = _config(tmp_path, parallel={"mesh": {"ep": 3}, "plan": ["ep"]}, train={**TINY["train"], "batch_size": 6})
    with pytest.raises(SystemExit) as e:
        train_main([str(path), "--check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "parallel.mesh.ep" in err and "4 experts" in err and "model.num_experts" in err, err


@pytest.mark.parametrize("model,parallel,reference", [
    # MoE: the pipeline's load-balancing loss is per microbatch, as single-device gradient accumulation's
    ({"num_hidden_layers": 4}, {"mesh": {"pp": 2}, "plan": [{"pp": {"schedule": "1f1b", "microbatches": 2}}]},
     ["train.microbatches=2"]),
    # dense, pp x fsdp with a V schedule and an uneven split: the whole batch's loss
    ({"preset": "qwen3-dense-tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5},
     {"mesh": {"pp": 2, "fsdp": 2},
      "plan": [{"pp": {"axis": "pp", "schedule": "zbv", "microbatches": 2, "layers_per_stage": [1, 2, 1, 1]}},
               {"fsdp": {"axis": "fsdp"}}]}, []),
], ids=["moe-pp2-1f1b", "dense-pp2-fsdp2-zbv"])
@pytest.mark.multirank
def test_pipeline_parallel_train_matches_one_device(tmp_path, pools, model, parallel, reference):
    """The trainer with ``pp`` in the plan (on the pool's ranks): every per-step loss equals the
    single-device run of the same config (rtol 1e-5), evaluation and sampling see the whole model gathered
    from the stages."""
    from hpfunc.train.config import load_config
    from hpfunc.train.trainer import run

    steps = 4
    path = _config(tmp_path, model=model if "preset" in model else {**TINY["model"], **model}, parallel=parallel,
                   train={**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0, "expert_bias_rate": 1e-2,
                          "aux_loss_coef": 0.1})
    world = 1
    for size in parallel["mesh"].values():
        world *= size
    printed, _ = pools(world).run(_run_in_ranks, str(path), parallel)[0]
    assert "pp('pp'" in printed, printed
    single = run(load_config(path, ["parallel=null", f"output.dir={tmp_path / 'single'}", *reference]), echo=False)
    par = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    want = [r for r in single.records if "loss" in r]
    assert len(par) == len(want) == steps
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in par] == pytest.approx([r[key] for r in want], rel=1e-5), key
    val = [r["val_loss"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "val_loss" in r]
    assert val == pytest.approx([single.summary["val_loss"]], rel=1e-4)


@pytest.mark.parametrize("parallel,train,needle", [
    ({"mesh": {"pp": 2}, "plan": [{"pp": {"microbatches": 3}}]}, {}, "parallel.plan[0].pp.microbatches"),
    ({"mesh": {"pp": 4}, "plan": ["pp"]}, {}, "model.num_hidden_layers"),
    ({"mesh": {"pp": 2}, "plan": [{"pp": {"layers_per_stage": [2, 1]}}]}, {},
     "parallel.plan[0].pp.layers_per_stage"),
    ({"mesh": {"pp": 2}, "plan": [{"pp": {"schedule": "1f2b"}}]}, {}, "parallel.plan[0].pp.schedule"),
    ({"mesh": {"pp": 2}, "plan": [{"pp": {"microbatches": 2}}]}, {"microbatches": 2}, "train.microbatches"),
], ids=["microbatches", "stages-vs-layers", "layers_per_stage", "schedule", "accumulation"])
def test_a_pipeline_that_does_not_fit_fails_before_launch(tmp_path, capsys, parallel, train, needle):
    path = _config(tmp_path, parallel=parallel, train={**TINY["train"], **train})
    with pytest.raises(SystemExit) as e:
        train_main([str(path), "--check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err
