"""Single-card cluster simulation (``hpfunc.autoparallel.simulate``, ``hpfunc simulate``): the 4 ranks of a
trainer config run as threads of this process equal the real 4-rank gloo run, rank for rank.

The real run is the trainer in each rank of the session's pool of 4 gloo processes
(:func:`~hpfunc.autoparallel.simulate.rank_run`, what ``hpfunc train`` runs in each rank); the
simulation runs the same function in 4 threads. Compared per rank: the mesh coordinate, every step's
loss, gradient norm and auxiliary loss (rtol 1e-5), the norm of each local parameter block after the
last step (rtol 1e-5) and the collectives issued (exact: count and bytes per collective, axes and phase).
A single-device run would give the same losses but not the blocks or the collectives.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import yaml

from hpfunc.autoparallel.simulate import (SimulationError, SimulationInputError, compare_records, rank_run,
                                          simulate)
from hpfunc.autoparallel.simulate_cli import main as simulate_main

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "train"))
from _train_helpers import TINY, write_corpus  # noqa: E402

STEPS = 3
PLANS = {
    "fsdp_tp": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]},
    "fsdp_ep": {"mesh": {"fsdp": 2, "ep": 2}, "plan": [{"fsdp": {"axis": "fsdp"}}, {"ep": {"axis": "ep"}}]},
}


def _config(folder: pathlib.Path, name: str) -> pathlib.Path:
    """The tiny MoE of the trainer tests for 3 steps on ``PLANS[name]``, a metrics line per step."""
    if not (folder / "corpus").exists():
        write_corpus(folder / "corpus")
    cfg = {**TINY, "parallel": PLANS[name], "optimizer": {"name": "adamw", "lr": 1e-2},
           "data": {**TINY["data"], "paths": [str(folder / "corpus" / "*.py")]},
           "train": {**TINY["train"], "steps": STEPS, "log_every": 1, "eval_every": 0, "expert_bias_rate": 1e-2,
                     "aux_loss_coef": 0.1},
           "output": {**TINY["output"], "dir": str(folder / "unused"), "progress": "none", "plot": False,
                      "sample_tokens": 0}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory, pool4):
    """Per plan: (config path, the real run's per-rank records, its rank 0 output folder), computed once."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            path = _config(folder, name)
            out = folder / "real"
            cache[name] = (path, pool4.run(rank_run, str(path), out_dir=str(out)), out)
        return cache[name]

    return get


def _as_dict(run) -> dict:
    return run if isinstance(run, dict) else run.to_dict()


def assert_same_ranks(simulated, real) -> None:
    """Rank for rank: coordinates, per-step scalars, local parameter blocks (rtol 1e-5), collectives (exact)."""
    assert len(simulated) == len(real) == 4
    for s, r in zip(map(_as_dict, simulated), map(_as_dict, real)):
        where = f"rank {r['rank']}"
        assert s["rank"] == r["rank"] and s["coordinate"] == r["coordinate"], where
        assert [x["step"] for x in s["steps"]] == [x["step"] for x in r["steps"]] == [1, 2, 3], where
        for key in ("loss", "grad_norm", "aux_loss"):
            assert [x[key] for x in s["steps"]] == pytest.approx([x[key] for x in r["steps"]], rel=1e-5), (where, key)
        assert s["param_norms"].keys() == r["param_norms"].keys(), where
        for path, norm in r["param_norms"].items():
            assert s["param_norms"][path] == pytest.approx(norm, rel=1e-5), (where, path)
        assert list(s["comm"]) == list(r["comm"]), where


@pytest.mark.multirank
def test_simulated_fsdp_x_tp_equals_the_real_4_rank_run(real_runs, tmp_path, capsys):
    path, real, _ = real_runs("fsdp_tp")
    sim = simulate(path, progress=True)
    assert_same_ranks(sim.ranks, real)
    assert sim.disagreements() == []
    assert [r.coordinate for r in sim.ranks] == [{"fsdp": 0, "tp": 0}, {"fsdp": 0, "tp": 1}, {"fsdp": 1, "tp": 0},
                                                 {"fsdp": 1, "tp": 1}]
    # the ranks hold different blocks (the comparison is per rank, not of one replicated model)
    assert sim.ranks[0].param_norms["layers.0.attn.wq"] != sim.ranks[1].param_norms["layers.0.attn.wq"]
    assert {c["axes"] for c in sim.ranks[0].comm} >= {"fsdp", "tp"}
    # rank 0's outputs, as hpfunc train writes them
    assert [r["loss"] for r in sim.records if "loss" in r] == sim.losses
    assert sim.summary["steps"] == STEPS and sim.summary["processes"] == 4
    err = capsys.readouterr().err
    assert f"step {STEPS}/{STEPS}: loss {sim.losses[-1]:.6f} (the same on all 4 ranks)" in err


@pytest.mark.multirank
def test_hpfunc_simulate_of_fsdp_x_ep_equals_the_real_4_rank_run(real_runs, tmp_path, capsys):
    path, real, out = real_runs("fsdp_ep")
    simulate_main([str(path), "--json", str(tmp_path / "sim.json"), "--compare", str(out / "metrics.jsonl")])
    printed = capsys.readouterr().out
    assert "the simulation's losses equal the real run's" in printed
    assert "simulated 4 ranks of mesh {'fsdp': 2, 'ep': 2} in one process" in printed
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert_same_ranks(sim["ranks"], real)
    assert {c["axes"] for c in sim["ranks"][0]["comm"]} >= {"ep", "fsdp+ep"}


@pytest.mark.multirank
def test_a_simulated_rank_given_another_ranks_data_shard_fails_the_comparison(real_runs, monkeypatch):
    """The deliberate bug: the simulated ranks of fsdp shard 1 (ranks 2 and 3, one tp group) train on the rows
    of shard 0 (ranks 0 and 1). (Given to rank 3 alone, the replication check of the test environment,
    HPFUNC_CHECK_REP, stops the run: rank 3's tp peer holds another value.)"""
    import torch.distributed as dist

    import hpfunc.train.loop as loop

    path, real, out = real_runs("fsdp_tp")
    sample = loop.sample_batch

    def shard0_rows_on_shard1(*args, **kwargs):
        batch = sample(*args, **kwargs)
        if dist.get_rank() in (2, 3):  # the batch of 4 splits 2 per fsdp shard: rows 2:4 are shard 1's
            batch = {k: v.clone() for k, v in batch.items()}
            for v in batch.values():
                v[2:4] = v[0:2]
        return batch

    monkeypatch.setattr(loop, "sample_batch", shard0_rows_on_shard1)
    sim = simulate(path)
    with pytest.raises(AssertionError):
        assert_same_ranks(sim.ranks, real)
    from hpfunc.train.output import read_metrics

    _, _, problems = compare_records(sim.records, read_metrics(out / "metrics.jsonl"))
    assert problems and problems[0].startswith("step 1: loss")


def test_bad_requests_name_the_key_before_anything_starts(tmp_path, capsys):
    path = _config(tmp_path, "fsdp_tp")
    with pytest.raises(SimulationInputError, match=r"parallel.mesh: the mesh \{'fsdp': 2, 'tp': 2\} has 4 ranks, "
                                                   r"the world is 8; .*simulate --world 4"):
        simulate(path, world=8)
    with pytest.raises(SimulationInputError, match="parallel.mesh: .* is one process; there is nothing to simulate"):
        simulate(path, overrides=["parallel=null"])
    with pytest.raises(SimulationInputError, match="--steps: expected an integer >= 1, found 0"):
        simulate(path, steps=0)
    with pytest.raises(SystemExit) as e:
        simulate_main([str(path), "--world", "6"])
    assert e.value.code == 2
    assert "hpfunc simulate: parallel.mesh: the mesh {'fsdp': 2, 'tp': 2} has 4 ranks, the world is 6; the mesh " \
           "must fill the world exactly" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main([str(path), "--set", "parallel.mesh.tp=4"])
    assert "parallel.mesh.tp: tensor parallelism over 4 ranks must divide the 2 key/value heads" in \
        capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


def test_a_failing_rank_is_named_as_the_cause(tmp_path, monkeypatch):
    """Rank 2 raises before its first step; the others, waiting in collectives for it, fail after it (their
    peer's connections close when its gloo groups are freed, or, should something still hold them, on
    the collective timeout, 10 s here), and the error names rank 2 with its own error."""
    import torch.distributed as dist

    import hpfunc.train.loop as loop

    sample = loop.sample_batch

    def fail_on_rank2(*args, **kwargs):
        if dist.get_rank() == 2:
            raise OSError("the disk of rank 2 is gone")
        return sample(*args, **kwargs)

    monkeypatch.setattr(loop, "sample_batch", fail_on_rank2)
    with pytest.raises(SimulationError, match=r"simulated rank 2 of 4 failed: OSError: the disk of rank 2 is gone; "
                                              r"ranks \[.*\] failed after it") as e:
        simulate(_config(tmp_path, "fsdp_tp"), overrides=["parallel.timeout_s=10"])
    assert sorted(r for r, _, _ in e.value.failures) == [0, 1, 2, 3]
    assert e.value.failures[0][0] == 2 and "fail_on_rank2" in e.value.failures[0][2]  # the cause's traceback
    for rank, text, _ in e.value.failures[1:]:
        assert text.startswith(f"CollectiveError: rank {rank}: "), text
