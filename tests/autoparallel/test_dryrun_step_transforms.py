"""``hpfunc dryrun`` runs the trainer's ``precision:`` and ``activations:`` sections as ``hpfunc train`` does:
the step it measures on fake tensors is the trainer's own (``hpfunc.train.distributed.parallel_train_step``).

The tiny Qwen3 MoE (fp32, fsdp 4, 4 x 32 tokens) with no policy, layer 1 recomputed
(``activations: {remat: {1: nothing_saveable}}``) and every layer recomputed: the dry run's step peak
(fake CPU tensors, one process) falls with each recomputed layer as the peak of the real step on 4 gloo
ranks does (storage liveness, ``measure_step``), and stays within 25% above it (the fake step holds more
at its peak: 1.20, 1.12 and 1.20 x here, a gap listed in docs/autoparallel.md). And ``precision: {compute_dtype: bfloat16}`` over ``model.dtype: float32`` keeps the fp32
state while the FSDP all-gathers move bf16; ``model.dtype: bfloat16`` stores everything in bf16.

Deliberate bug tried: the dry run building its step without the trainer's loss transforms (the old
``make_train_step(loss_fn=qwen3.parallel_plan.loss)``): the remat variants report the no-policy peak and
the ordering fails.
"""

from __future__ import annotations

import pytest

from hpfunc.autoparallel.dryrun import dry_runs, measure_step

pytestmark = pytest.mark.multirank


def _config(**extra) -> dict:
    return {"model": {"preset": "qwen3-moe-tiny", "dtype": "float32", "moe_dispatcher": "padded"},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"steps": 10, "batch_size": 4, "seq_len": 32},
            "parallel": {"mesh": {"fsdp": 4}, "plan": ["fsdp"], "device": "cpu"}, **extra}


POLICIES = {"none": _config(),
            "layer 1 remat": _config(activations={"remat": {1: "nothing_saveable"}}),
            "every layer remat": _config(activations={"remat": "nothing_saveable"})}


@pytest.fixture(scope="module")
def dry() -> dict:
    # fake CPU tensors in this process; the worst MoE case is the config's own padded buffers (1.5 x)
    reports = dry_runs(list(POLICIES.values()), rank=0, device="cpu", hardware="cpu", moe="worst")
    return dict(zip(POLICIES, reports))


def test_activation_policy_moves_the_reported_peak_as_the_measured_one(dry, pool4):
    measured = {name: pool4.run(measure_step, raw, timed_steps=0)[0]["step_peak_bytes"] for name, raw in POLICIES.items()}
    reported = {name: dry[name]["step_peak_bytes"] for name in POLICIES}
    order = list(POLICIES)
    # each recomputed layer keeps less for the backward, in the dry run as in the real step
    assert [reported[n] for n in order] == sorted(reported.values(), reverse=True)
    assert [measured[n] for n in order] == sorted(measured.values(), reverse=True)
    assert len(set(reported.values())) == len(set(measured.values())) == 3
    # not equal: the fake step holds more at its peak (measured here: 1.20, 1.12, 1.20 x the real one;
    # docs/autoparallel.md, what is left)
    for name in order:
        assert 1.0 <= reported[name] / measured[name] <= 1.25, (name, reported[name], measured[name])


def test_precision_section_is_applied():
    mixed = _config(precision={"compute_dtype": "bfloat16", "reduce_dtype": "float32"})
    bf16 = _config(model={**_config()["model"], "dtype": "bfloat16"})
    r_mixed, r_bf16 = dry_runs([mixed, bf16], rank=0, device="cpu", hardware="cpu", moe="worst")
    assert set(r_mixed["state_bytes"]["params"]) == {"float32"}  # fp32 master weights ...
    gathers = {e["phase"]: e for e in r_mixed["comm"] if e["collective"] == "all_gather" and e["axes"] == "fsdp"}
    rs = next(e for e in r_mixed["comm"] if e["collective"] == "reduce_scatter")
    # ... gathered in bf16 (2 bytes per parameter), reduced in fp32: twice the gather's payload
    assert rs["payload_bytes"] == pytest.approx(2 * gathers["forward"]["payload_bytes"], rel=0.01)
    assert r_mixed["estimate"]["memory_bytes"]["master"] > 0
    # model.dtype bfloat16: the parameters and gradients in bf16, no fp32 master; hpfunc's AdamW keeps its
    # two moments in fp32 (8 bytes per 2-byte parameter)
    p = r_bf16["state_bytes"]["params"]
    assert p["float32"] < p["bfloat16"] / 100  # only the frozen expert bias stays fp32
    assert r_bf16["state_bytes"]["grads"] == {"bfloat16": p["bfloat16"]}
    assert r_bf16["state_bytes"]["optimizer"]["float32"] == 4 * p["bfloat16"]
    assert r_bf16["estimate"]["memory_bytes"]["master"] == 0
