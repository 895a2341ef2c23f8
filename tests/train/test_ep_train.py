"""``hpfunc train`` with expert parallelism, run in the session's rank pools (``hpfunc.train.run`` called in
every rank, as a launch would): per-step losses equal ``parallel=null`` for random tiny MoE configs and
plans (with and without the chunked, overlapped dispatch), and the dispatcher of the model config
(``model.moe_dispatcher`` / ``moe_capacity_factor`` / ``moe_buffer_factor`` / ``moe_dispatch_chunks``) is
checked and reports its drops in ``metrics.jsonl``."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import TINY, write_corpus
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multirank

CASES = [({"ep": 2}, ["ep"]), ({"ep": 4}, ["ep"]), ({"fsdp": 2, "ep": 2}, ["fsdp", "ep"]),
         ({"ep": 2, "tp": 2}, ["ep", "tp"])]


def _raw(tmp_path, *, parallel, model=None, steps=3) -> dict:
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return {**TINY, "model": {**TINY["model"], **(model or {})}, "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
            "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
            "train": {**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0, "eval_batches": 0,
                      "expert_bias_rate": 1e-2, "aux_loss_coef": 0.1},
            "output": {**TINY["output"], "dir": str(tmp_path / "out"), "progress": "none", "plot": False,
                       "sample_tokens": 0},
            "parallel": parallel}


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


def _world(mesh: dict) -> int:
    n = 1
    for s in mesh.values():
        n *= s
    return n


# Two drawn examples (the same two on every run: derandomized, no database) and two pinned ones, so that
# every run covers ep with fsdp and ep over 4 ranks at top-4; about 4-8 s per example on 2 shared cores.
@settings(max_examples=2, deadline=None, derandomize=True, database=None)
@given(case=st.sampled_from(CASES), experts=st.sampled_from([4, 8]), top_k=st.integers(1, 4),
       hidden=st.sampled_from([32, 64]), chunks=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
@example(case=CASES[2], experts=8, top_k=3, hidden=32, chunks=2, seed=5)
@example(case=CASES[1], experts=4, top_k=4, hidden=64, chunks=1, seed=11)
def test_ep_train_matches_parallel_null(pools, tmp_path_factory, case, experts, top_k, hidden, chunks, seed):
    mesh, roles = case
    tmp = tmp_path_factory.mktemp("ep")
    raw = {**_raw(tmp, parallel={"mesh": mesh, "plan": roles},
                  model={"num_experts": experts, "num_experts_per_tok": top_k, "hidden_size": hidden,
                         "moe_dispatch_chunks": chunks}), "seed": seed}
    par = pools(_world(mesh)).run(train_in_rank, raw)[0]
    want = _single(raw, tmp / "single")
    what = f"{mesh} E{experts} top{top_k} hidden {hidden} chunks {chunks} seed {seed}"
    assert len(par) == len(want) == raw["train"]["steps"], what
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in par] == pytest.approx([r[key] for r in want], rel=1e-5), f"{what} {key}"
    assert [r["expert_load"] for r in par] == [r["expert_load"] for r in want], what


def test_capacity_drops_reach_metrics_jsonl(pools, tmp_path):
    """ep 2 with a capacity factor: each rank caps every expert at ``ceil(c T k / E)`` of its own pairs, so
    the first step's drops equal those of one device running each rank's half of the batch on its own."""
    from hpfunc.models import qwen3
    from hpfunc.train.build import build_model_config
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.data import load_data, sample_batch
    from hpfunc.train.loop import data_keys
    from hpfunc.train.output import read_metrics

    raw = _raw(tmp_path, parallel={"mesh": {"ep": 2}, "plan": ["ep"]}, model={"moe_capacity_factor": 0.5}, steps=2)
    records = pools(2).run(train_in_rank, raw)[0]
    written = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["dropped_pairs_per_layer"] for r in written] == [r["dropped_pairs_per_layer"] for r in records]
    cfg = load_config_dict(raw)
    model_cfg = build_model_config(cfg.model)
    init_key, train_key, _ = data_keys(cfg.seed)
    batch = sample_batch(load_data(cfg.data).train, train_key, 0, cfg.train.batch_size, cfg.train.seq_len)
    params = qwen3.init(init_key, model_cfg)
    per_shard = sum(qwen3.loss(params, {"tokens": half}, model_cfg)[1]["dropped_pairs"]
                    for half in batch["tokens"].chunk(2))
    assert written[0]["dropped_pairs_per_layer"] == per_shard.tolist()
    assert written[0]["dropped_pairs"] == sum(per_shard.tolist()) > 0


@pytest.mark.parametrize("model,expected", [
    ({"moe_capacity_factor": 0}, "model.moe_capacity_factor: "),
    ({"moe_capacity_factor": -1.5}, "model.moe_capacity_factor: "),
    ({"moe_buffer_factor": 0}, "model.moe_buffer_factor: "),
    ({"moe_dispatcher": "paded"}, "model.moe_dispatcher: expected one of 'alltoall', 'padded', found string 'paded'; "
                                  "did you mean 'padded'?"),
    ({"moe_dispatcher": "padded", "moe_capacity_factor": 1.0}, "model.moe_capacity_factor: "),
    ({"moe_dispatch_chunks": 0}, "model.moe_dispatch_chunks: "),
    ({"moe_dispatch_chunks": 2, "moe_capacity_factor": 1.0}, "model.moe_dispatch_chunks: "),
])
def test_dispatcher_keys_are_checked_naming_the_key(tmp_path, model, expected):
    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import ConfigError, load_config_dict

    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict(_raw(tmp_path, parallel=None, model=model)))
    assert str(info.value).startswith(expected), str(info.value)


def test_dispatcher_keys_reach_the_model_config(tmp_path):
    from hpfunc.models.dispatch import PaddedAllToAll
    from hpfunc.models.qwen3 import model
    from hpfunc.train.build import build_model_config
    from hpfunc.train.config import load_config_dict

    cfg = load_config_dict(_raw(tmp_path, parallel=None), ["model.moe_dispatcher=padded", "model.moe_buffer_factor=2"])
    assert model.moe_dispatcher(build_model_config(cfg.model)) == PaddedAllToAll(buffer_factor=2.0)
