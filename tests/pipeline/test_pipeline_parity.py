"""pipeline_map equals single-device training: every generator, 2 and 4 pp ranks, dense and MoE Qwen3."""

from __future__ import annotations

import pytest
import torch

import _pipeline_qwen3 as Q
import hpfunc
from hpfunc import random as R
from hpfunc.models import qwen3
from hpfunc.schedules import GENERATORS, Schedule
from hpfunc.testing import assert_trees_close
from hpfunc.transforms.pipeline import pipeline_map, shard_stage_params, unshard_stage_grads

RTOL, ATOL = 1e-5, 2e-6
SEQ = 8


def make_schedule(name: str, p: int, m: int) -> Schedule:
    if name == "interleaved_1f1b":
        return GENERATORS[name](p, m, 2)
    return GENERATORS[name](p, m)


def setup(model: str, counts, batch_size: int, seed: int = 0):
    cfg = qwen3.preset(model, num_hidden_layers=sum(counts))
    params = qwen3.init(R.key(seed), cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return cfg, params, {"tokens": tokens}


def run_pipeline(model, schedule, counts, batch_size, mesh_axes, kwargs=None):
    """Rank function: run the schedule on this rank's stages; return (loss, {stage: grads})."""
    cfg, params, batch = setup(model, counts, batch_size)
    mesh = hpfunc.Mesh(mesh_axes)
    step = pipeline_map(Q.stage_fns(cfg, counts), schedule, mesh, loss_fn=Q.make_loss_fn(cfg), **(kwargs or {}))
    stage_params = Q.split_params(params, cfg, counts)
    local = {s: stage_params[s] for s in step.local_stages}
    if kwargs and kwargs.get("fsdp_axis"):
        local = shard_stage_params(local, mesh, kwargs["fsdp_axis"])
    loss, grads = step(local, batch)
    if kwargs and kwargs.get("fsdp_axis"):
        grads = unshard_stage_grads(grads, mesh, kwargs["fsdp_axis"])
    return loss, grads


def reference(model, counts, batch_size, m):
    """Single device: value_and_grad of qwen3.loss on the full batch (dense), or of the mean of
    qwen3.loss over the microbatches (MoE: its load-balancing term is not additive over tokens)."""
    cfg, params, batch = setup(model, counts, batch_size)
    if cfg.moe_layers:
        def f(p):
            mbs = torch.chunk(batch["tokens"], m)
            return torch.stack([qwen3.loss(p, {"tokens": t}, cfg)[0] for t in mbs]).mean()
    else:
        def f(p):
            return qwen3.loss(p, batch, cfg)[0]
    return cfg, hpfunc.value_and_grad(f)(params)


def check(results, model, counts, batch_size, m):
    cfg, (ref_loss, ref_grads) = reference(model, counts, batch_size, m)
    stage_grads = {}
    for loss, grads in results:
        assert_trees_close(loss, ref_loss, rtol=RTOL, atol=ATOL, what="loss")
        for s, g in grads.items():
            if s in stage_grads:   # same stage on another data-parallel rank: identical
                assert_trees_close(g, stage_grads[s], rtol=0, atol=0, what=f"stage {s} across dp ranks")
            stage_grads[s] = g
    assert sorted(stage_grads) == list(range(len(counts)))
    merged = Q.merge_grads([stage_grads[s] for s in range(len(counts))], cfg, counts)
    assert_trees_close(merged, ref_grads, rtol=RTOL, atol=ATOL, what="grads")


# (generator, p) -> decoder layers per stage (uneven); m = 4 for p = 2, 8 for p = 4.
CASES_2 = {"gpipe": (2, 1), "1f1b": (1, 2), "zb_h1": (2, 1), "zb_h2": (1, 2),
           "interleaved_1f1b": (2, 1, 1, 1), "zbv": (1, 1, 2, 1), "dualpipev": (2, 1, 1, 1)}
CASES_4 = {"gpipe": (2, 1, 1, 1), "1f1b": (1, 1, 2, 1), "zb_h1": (1, 2, 1, 1), "zb_h2": (2, 1, 1, 1),
           "interleaved_1f1b": (2, 1, 1, 1, 1, 1, 1, 1), "zbv": (1, 1, 1, 1, 2, 1, 1, 1),
           "dualpipev": (2, 1, 1, 1, 1, 1, 1, 1)}


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["qwen3-dense-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("gen", list(CASES_2))
def test_parity_2_ranks(pool2, gen, model):
    counts, m, bs = CASES_2[gen], 4, 8
    sched = make_schedule(gen, 2, m)
    assert sched.num_stages == len(counts)
    check(pool2.run(run_pipeline, model, sched, counts, bs, {"pp": 2}), model, counts, bs, m)


@pytest.mark.multirank
@pytest.mark.parametrize("gen", list(CASES_4))
def test_parity_4_ranks_dense(pool4, gen):
    model, counts, m, bs = "qwen3-dense-tiny", CASES_4[gen], 8, 8
    sched = make_schedule(gen, 4, m)
    assert sched.num_stages == len(counts)
    check(pool4.run(run_pipeline, model, sched, counts, bs, {"pp": 4}), model, counts, bs, m)


@pytest.mark.multirank
@pytest.mark.parametrize("gen", ["1f1b", "zbv"])
def test_parity_4_ranks_moe(pool4, gen):
    model, counts, m, bs = "qwen3-moe-tiny", CASES_4[gen], 8, 8
    check(pool4.run(run_pipeline, model, make_schedule(gen, 4, m), counts, bs, {"pp": 4}), model, counts, bs, m)
