"""Parameters of chosen layers at rest in host memory (``plan.with_state_offload("params", layers=...)``):
equal to the plan without it on real gloo ranks, and on fake CUDA devices no offloaded parameter byte stays
on the device between steps and about two layers' blocks are there during the step (storage liveness)."""

from __future__ import annotations

import pytest

from tests.gpu import _offload_pieces as op

LAYERS = r"layers\.[01]\."  # both layers of the tiny model (and only theirs: the embedding, norm and head stay)


@pytest.mark.multirank
@pytest.mark.parametrize("name, world, kinds", [("fsdp", 2, ("params",)), ("fsdp bf16", 2, ("params",)),
                                               ("ddp", 2, ("params",)), ("fsdp x tp", 4, ("params", "optimizer"))])
def test_offloaded_parameters_equal_the_plan_without(pools, name, world, kinds):
    """Two steps of ``parallel_train_step`` (AdamW, a clip, a schedule; fp32, and bf16 compute over fp32
    storage; under ddp nothing is gathered: every block is copied in for its use and again for the
    backward): losses, gradients, updates and the optimizer state bit for bit."""
    outs = pools(world).run(op.run_offload_parity, name, 2, None, 0, kinds, LAYERS)
    for out in outs:
        for i, e in enumerate(out["errors"]):
            assert e["loss"] <= 1e-5 and e["grads"] <= 1e-5 and e["updates"] <= 1e-5 and e["opt"] <= 1e-5, (i, e)
            assert e["bitwise"], (i, e)


@pytest.mark.multirank
@pytest.mark.parametrize("bug", ["stale", "forward", "backward"])
def test_planted_faults_are_caught(pools, bug):
    """A copy back to host memory that returns the previous parameters; the last layer's blocks not brought in
    for its forward gather, or for its backward re-gather."""
    out = pools(2).run(op.run_offload_parity, "fsdp", 2, bug, 0, ("params",), LAYERS)[0]
    worst = max(max(e["loss"], e["grads"], e["updates"]) for e in out["errors"])
    assert worst > 1e-3, out["errors"]


@pytest.fixture(scope="module")
def fake_runs() -> dict:
    """One isolated fake-CUDA process for the liveness tests: the baseline, the offload, the planted fault."""
    from hpfunc.testing.fake_devices import run_on_fake_devices

    return run_on_fake_devices(op.fake_param_liveness, 2, 3, world_size=8, rank=5, mesh={"fsdp": 8},
                               isolated=True).result


def test_no_offloaded_parameter_byte_stays_on_the_device_between_steps(fake_runs):
    """Storage liveness on fake CUDA (3 decoder layers offloaded, fsdp 8, rank 5; the baseline offloads the
    optimizer state only): after each step the live device bytes the state holds are the baseline's less
    exactly the offloaded blocks' bytes, none of them an offloaded block, and no more device bytes are alive
    outside the state than in the baseline; during the step (forward, backward re-gathers, update) the device
    copies of offloaded blocks alive at once never exceed two layers' blocks (the first step, before the
    read order is known: one)."""
    out = fake_runs
    for k, (plain, off) in enumerate(zip(out["plain"], out["params"])):
        assert plain["chosen_rest"] == ["cuda"] and off["chosen_rest"] == ["cpu"], (plain, off)
        assert off["other_rest"] == plain["other_rest"] == ["cuda"]
        assert plain["chosen_bytes"] == off["chosen_bytes"] > 0
        assert plain["chosen_device_bytes"] == plain["chosen_bytes"]
        assert off["chosen_device_bytes"] == 0
        held = [r["device_bytes"] - r["orphan_bytes"] for r in (plain, off)]
        assert held[0] - held[1] == plain["chosen_bytes"], (plain, off)
        assert off["orphan_bytes"] <= plain["orphan_bytes"], (plain, off)
        assert plain["step_peak"] == 0
        one, two = off["layer_bytes"][-1], sum(off["layer_bytes"][-2:])
        assert 0 < off["step_peak"] <= (one if k == 0 else two), (off, two)
        assert off["step_peak"] < off["chosen_bytes"]


def test_a_device_copy_kept_alive_is_caught(fake_runs):
    """A planted fault that keeps every device copy of an offloaded block referenced: the peak grows to every
    layer's blocks (and more: each re-gather copies in again), and the copies stay on the device after the step."""
    off = fake_runs["keep"][1]
    assert off["step_peak"] > sum(off["layer_bytes"][-2:]), off
    assert off["orphan_bytes"] > fake_runs["plain"][1]["orphan_bytes"], off


def test_the_yaml_form_builds_the_plan_option():
    from hpfunc.models import qwen3
    from hpfunc.train.config import ConfigError, load_config_dict
    from hpfunc.train.distributed import build_plan

    raw = {"mesh": {"fsdp": 2}, "plan": ["fsdp"], "offload_state": ["optimizer", {"params": r"layers\.[01]\."}]}
    cfg = load_config_dict({"parallel": raw})
    assert cfg.parallel.offload_state == ("optimizer", "params") and cfg.parallel.offload_layers == r"layers\.[01]\."
    assert cfg.parallel.to_data()["offload_state"] == raw["offload_state"]
    plan = build_plan(cfg.parallel, qwen3.preset("qwen3-dense-tiny"))
    assert plan.state_offload == ("optimizer", "params") and plan.offload_layers == r"layers\.[01]\."
    every = load_config_dict({"parallel": {**raw, "offload_state": "params"}}).parallel
    assert every.offload_state == ("params",) and every.offload_layers is None
    with pytest.raises(ConfigError, match=r"parallel\.offload_state\[1\]\.params: 'layers\[' is not a regular"):
        load_config_dict({"parallel": {**raw, "offload_state": ["optimizer", {"params": "layers["}]}})
    with pytest.raises(ConfigError, match=r"parallel\.offload_state\[0\]: expected optimizer or params"):
        load_config_dict({"parallel": {**raw, "offload_state": [{"param": "layers"}]}})


def test_bad_selections_are_named_before_anything_runs():
    import torch

    import hpfunc
    from hpfunc.transforms import plans

    with pytest.raises(plans.PlanError, match="add 'params'"):
        plans.fsdp("fsdp").with_state_offload("optimizer", layers="layers")
    with pytest.raises(plans.PlanError, match="layers must be a regular expression"):
        plans.fsdp("fsdp").with_state_offload("params", layers=3)
    with pytest.raises(plans.PlanError, match="not a regular expression"):
        plans.fsdp("fsdp").with_state_offload("params", layers="(")

    def step(state, batch):
        return state, {}

    full = {"embed": torch.ones(4, 2), "layers": [{"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)}]}
    mesh = hpfunc.Mesh({"fsdp": 1})
    bad = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp").with_state_offload("params", layers="blocks"))
    with pytest.raises(plans.PlanError, match=r"layers='blocks'.*selects none of the 3 parameters"):
        bad.shard_params(full)
    params = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp")).shard_params(full)
    with pytest.raises(plans.PlanError, match=r"layers='blocks'.*selects none of the 3 parameters"):
        bad.lower({"params": params})
    chosen = plans.fsdp("fsdp").with_state_offload("params", layers=lambda path: path.startswith("layers.1"))
    assert "1 state leaves at rest in host memory (params: 1 parameters)" in repr(
        hpfunc.parallelize(step, mesh, chosen).lower({"params": params}))


@pytest.mark.multirank
def test_a_zero_narrowed_parameter_is_refused(pools):
    msg = pools(2).run(op.zero_offload_error)[0]
    assert "parameter 'w' has an optimizer block narrower than its storage" in msg, msg
