"""``hpfunc train`` with context parallelism, run in the session's rank pools (``hpfunc.train.run`` in every
rank, as a launch would): per-step losses equal ``parallel=null`` on a cp 2 mesh and an fsdp x cp 2 x 2
mesh (a sequence length that needs padding, a MoE model whose load statistics leave the padding out), and
the ``cp`` entry's options are checked before launch, naming the key; with ``data.document_mask`` (packed
short documents) the losses equal ``parallel=null`` too, and differ from the unmasked run's."""

from __future__ import annotations

import pytest
from _train_helpers import TINY, write_corpus

pytestmark = pytest.mark.multirank


def _raw(tmp_path, *, parallel, seq: int, steps: int = 2) -> dict:
    """A tiny MoE run (load-balancing loss and expert-bias updates on) on the generated corpus."""
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return {**TINY, "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
            "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
            "train": {**TINY["train"], "steps": steps, "seq_len": seq, "log_every": 1, "eval_every": 0,
                      "eval_batches": 0, "expert_bias_rate": 1e-2, "aux_loss_coef": 0.1},
            "output": {**TINY["output"], "dir": str(tmp_path / "out"), "progress": "none", "plot": False,
                       "sample_tokens": 0},
            "parallel": parallel}


def _with_documents(raw: dict, tmp_path) -> dict:
    """``raw`` reading a JSONL corpus of short documents (every window crosses several) with the mask on."""
    import json

    file = tmp_path / "docs.jsonl"
    if not file.exists():
        file.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}"}) + "\n" for i in range(300)))
    return {**raw, "data": {"source": "jsonl", "paths": [str(file)], "val_fraction": 0.1, "document_mask": True}}


def train_in_rank(raw: dict) -> list[dict]:
    """``hpfunc.train.run`` in this rank of the pool (the process group is the pool's)."""
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.trainer import run

    return run(load_config_dict(raw), echo=False).records


def _single(raw: dict, where) -> list[dict]:
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.trainer import run

    return run(load_config_dict({**raw, "parallel": None, "output": {**raw["output"], "dir": str(where)}}),
               echo=False).records


@pytest.mark.parametrize("mesh,plan,seq", [
    ({"cp": 2}, [{"cp": {"impl": "ring"}}], 30),
    ({"fsdp": 2, "cp": 2}, ["fsdp", {"cp": {"impl": "ulysses"}}], 32),
])
def test_cp_train_matches_parallel_null(pools, tmp_path, mesh, plan, seq):
    raw = _raw(tmp_path, parallel={"mesh": mesh, "plan": plan}, seq=seq)
    world = 1
    for size in mesh.values():
        world *= size
    par = pools(world).run(train_in_rank, raw)[0]
    want = _single(raw, tmp_path / "single")
    assert len(par) == len(want) == 2
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in par] == pytest.approx([r[key] for r in want], rel=1e-5), (mesh, key)
    assert [r["expert_load"] for r in par] == [r["expert_load"] for r in want], mesh


def test_cp_train_with_document_masks_matches_parallel_null(pools, tmp_path):
    raw = _with_documents(_raw(tmp_path, parallel={"mesh": {"cp": 2}, "plan": [{"cp": {"impl": "ring"}}]}, seq=30),
                          tmp_path)
    par = pools(2).run(train_in_rank, raw)[0]
    want = _single(raw, tmp_path / "single")
    unmasked = _single({**raw, "data": {**raw["data"], "document_mask": False}}, tmp_path / "unmasked")
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in par] == pytest.approx([r[key] for r in want], rel=1e-5), key
    # the mask reaches the model: the same windows without it give other losses
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(want, unmasked)), (want, unmasked)


@pytest.mark.parametrize("parallel,seq,expected", [
    ({"mesh": {"cp": 4}, "plan": [{"cp": {"impl": "ulysses"}}]}, 32,
     "parallel.mesh.cp: Ulysses (parallel.plan[0].cp.impl: ulysses) over 4 ranks is above"),
    ({"mesh": {"cp": 2, "tp": 2}, "plan": [{"cp": {"impl": "ulysses"}}, "tp"]}, 32,
     "parallel.mesh.cp: Ulysses (parallel.plan[0].cp.impl: ulysses) over 2 ranks is above (or does not divide) the "
     "1 key/value heads per tensor-parallel rank (2 ranks)"),
    ({"mesh": {"cp": 2}, "plan": [{"cp": {"pad": False}}]}, 30,
     "train.seq_len: context parallelism (parallel.plan[0].cp, pad: false) splits the sequence of 30 into 2 x 2"),
    ({"mesh": {"cp": 2, "cpu": 2}, "plan": [{"cp": {"impl": "hybrid"}}, "ddp"]}, 32,
     "parallel.plan[0].cp.ulysses_axis: cp('cp', impl='hybrid'): ulysses_axis= is required"),
    ({"mesh": {"cp": 2}, "plan": [{"cp": {"impl": "hybrid", "ulysses_axis": "cpu"}}]}, 32,
     "parallel.plan[0].cp.ulysses_axis: 'cpu' is not an axis of parallel.mesh {cp: 2}"),
    ({"mesh": {"cp": 2}, "plan": [{"cp": {"impl": "rng"}}]}, 32,
     "parallel.plan[0].cp.impl: expected one of 'allgather', 'ring', 'ulysses', 'hybrid', found string 'rng'; "
     "did you mean 'ring'?"),
])
def test_cp_config_is_checked_before_launch(tmp_path, parallel, seq, expected):
    from hpfunc.train.build import build_model_config
    from hpfunc.train.config import ConfigError, load_config_dict
    from hpfunc.train.distributed import check_parallel

    raw = _raw(tmp_path, parallel=parallel, seq=seq)
    with pytest.raises(ConfigError) as info:
        cfg = load_config_dict(raw)
        check_parallel(cfg, build_model_config(cfg.model))
    assert str(info.value).startswith(expected), str(info.value)
