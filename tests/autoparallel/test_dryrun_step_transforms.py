"""``hpfunc dryrun`` runs the trainer's ``precision:`` and ``activations:`` sections as ``hpfunc train`` does:
the step it measures on fake tensors is the trainer's own (``hpfunc.train.distributed.parallel_train_step``).

The tiny Qwen3 MoE (fp32 storage, bf16 compute, fsdp 4, 4 x 128 tokens) with no policy, layer 1
recomputed (``activations: {remat: {1: nothing_saveable}}``) and every layer recomputed: the dry run's
step peak (fake CPU tensors, one process) equals the peak of the real step on 4 gloo ranks (storage
liveness, ``measure_step``) byte for byte where the peak is the activations' (no policy, layer 1), and
within 0.2% where it is the optimizer's (every layer recomputed: the real CPU step's fused AdamW kernel
has no shape-only form, the fake one runs the foreach path), so the per-layer policy moves the reported
peak as it moves the measured one. And ``precision: {compute_dtype: bfloat16}`` over ``model.dtype:
float32`` keeps the fp32 state while the FSDP all-gathers move bf16; ``model.dtype: bfloat16`` stores
the parameters in bf16.

(In fp32 compute the two differ: on fake tensors the MoE's grouped GEMMs take a bf16 detour, torch's
shape-only kernel insisting on bf16, whose casts the real fp32 step does not make.)

Deliberate bug tried: the dry run building its step without the trainer's loss transforms (the old
``make_train_step(loss_fn=qwen3.parallel_plan.loss)``): the remat variants report the no-policy peak and
the equality fails. Also found by this test: the fake step's AdamW took the per-leaf path (a FakeTensor
was not a "plain" tensor for ``hpfunc.optim``'s foreach check), so its peak was 7-20% above the real one;
``hpfunc.optim._ops.foreach_type`` now lets it take the foreach path.
"""

from __future__ import annotations

import pytest

from hpfunc.autoparallel.dryrun import dry_runs, measure_step

pytestmark = pytest.mark.multirank


def _config(**extra) -> dict:
    return {"model": {"preset": "qwen3-moe-tiny", "dtype": "float32", "moe_dispatcher": "padded"},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"steps": 10, "batch_size": 4, "seq_len": 128},
            "parallel": {"mesh": {"fsdp": 4}, "plan": ["fsdp"], "device": "cpu"}, **extra}


MIXED = {"compute_dtype": "bfloat16", "reduce_dtype": "float32"}
POLICIES = {"none": _config(precision=MIXED),
            "layer 1 remat": _config(precision=MIXED, activations={"remat": {1: "nothing_saveable"}}),
            "every layer remat": _config(precision=MIXED, activations={"remat": "nothing_saveable"})}


@pytest.fixture(scope="module")
def dry() -> dict:
    # fake CPU tensors in this process; the worst MoE case is the config's own padded buffers (1.5 x)
    reports = dry_runs(list(POLICIES.values()), rank=0, device="cpu", hardware="cpu", moe="worst")
    return dict(zip(POLICIES, reports))


def test_activation_policy_moves_the_reported_peak_as_the_measured_one(dry, pool4):
    for name, raw in POLICIES.items():
        measured = pool4.run(measure_step, raw, timed_steps=0)[0]["step_peak_bytes"]  # rank 0, as the dry run
        if name == "every layer remat":
            # this peak is the optimizer's: the real CPU step runs torch's fused AdamW kernel, which has no
            # shape-only form, so the fake one runs the foreach path (1,403 B more of temporaries here)
            assert measured <= dry[name]["step_peak_bytes"] <= 1.002 * measured, name
        else:  # the activations' peak: byte for byte
            assert dry[name]["step_peak_bytes"] == measured, name
    peaks = [dry[name]["step_peak_bytes"] for name in POLICIES]
    assert peaks[0] > peaks[1] > peaks[2]  # each recomputed layer keeps less for the backward


def test_precision_section_is_applied():
    mixed = _config(precision=MIXED)
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
