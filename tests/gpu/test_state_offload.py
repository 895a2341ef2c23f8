"""Selective state offload (``plan.with_state_offload("optimizer")``): equal to the plan without it on real
gloo ranks, and on fake CUDA devices no optimizer-state byte stays on the device between steps (storage
liveness: weak references to every storage the run made)."""

from __future__ import annotations

import pytest

from tests.gpu import _offload_pieces as op


@pytest.mark.multirank
@pytest.mark.parametrize("name, world, group_bytes", [("fsdp", 2, 0), ("fsdp x tp", 4, None)])
def test_offloaded_optimizer_state_equals_the_plan_without(pools, name, world, group_bytes):
    """Streamed leaf by leaf (``group_bytes=0``) and in the default groups (the whole tiny state in one)."""
    outs = pools(world).run(op.run_offload_parity, name, 2, None, group_bytes)
    for out in outs:
        for i, e in enumerate(out["errors"]):
            assert e["loss"] <= 1e-5 and e["grads"] <= 1e-5 and e["updates"] <= 1e-5 and e["opt"] <= 1e-5, (i, e)
            assert e["bitwise"], (i, e)  # the same arithmetic on the same numbers
        assert out["rest"] == [["cpu"]] * 2


@pytest.mark.multirank
def test_a_stale_copy_back_is_caught(pools):
    outs = pools(2).run(op.run_offload_parity, "fsdp", 2, "stale")
    assert any(e["opt"] > 1e-5 for e in outs[0]["errors"]), outs[0]["errors"]


def _fake(bug=None) -> dict:
    from hpfunc.testing.fake_devices import run_on_fake_devices

    # on_host_sync="raise": the offloaded step, its copies and the schedule make no host sync either
    return run_on_fake_devices(op.fake_liveness, 2, bug, world_size=8, rank=5, mesh={"fsdp": 8}, isolated=True).result


def test_no_optimizer_state_byte_stays_on_the_device_between_steps():
    """Storage liveness on fake CUDA: with offload the live device bytes after each step are those without
    it less exactly the moments' bytes (2 x the fp32 parameter blocks), and none of them is a moment. During
    the update, streamed leaf by leaf, at most two leaves' moments are on the device at once (the one
    updated and the next, coming in), not the whole state as in one group."""
    out = _fake()
    for run in out.values():  # a checkpoint stages every block in host memory (none back on the device)
        assert run.pop()["staged"] == ["cpu"]
    for plain, off, leafwise in zip(out["plain"], out["offload"], out["leafwise"]):
        assert plain["opt_rest"] == ["cuda"] and off["opt_rest"] == leafwise["opt_rest"] == ["cpu"], (plain, off)
        assert plain["moment_bytes"] == off["moment_bytes"] == 2 * plain["param_bytes"] > 0
        assert plain["opt_device_bytes"] == plain["moment_bytes"]  # without offload: the moments live on cuda
        for o in (off, leafwise):
            assert o["opt_device_bytes"] == 0
            assert plain["device_bytes"] - o["device_bytes"] == plain["moment_bytes"], (plain, o)
        # the update's peak of streamed-in state: nothing without offload, the whole state in one group, and
        # leaf by leaf the largest two consecutive leaves' moments (the double buffer)
        leaves = leafwise["leaf_moment_bytes"]
        assert sum(leaves) == plain["moment_bytes"] and len(leaves) > 2
        assert plain["update_peak"] == 0
        assert off["update_peak"] == plain["moment_bytes"]
        assert leafwise["update_peak"] == max(a + b for a, b in zip(leaves, leaves[1:])), (leafwise, leaves)
        assert leafwise["update_peak"] < plain["moment_bytes"] / 2


def test_the_yaml_key_builds_the_plan_option():
    from hpfunc.models import qwen3
    from hpfunc.train.config import ConfigError, load_config_dict
    from hpfunc.train.distributed import build_plan

    cfg = load_config_dict({"parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"], "offload_state": "optimizer"}})
    assert cfg.parallel.offload_state == ("optimizer",)
    assert cfg.parallel.to_data()["offload_state"] == ["optimizer"]
    assert build_plan(cfg.parallel, qwen3.preset("qwen3-dense-tiny")).state_offload == ("optimizer",)
    with pytest.raises(ConfigError, match=r"parallel\.offload_state\[0\]: expected optimizer or params"):
        load_config_dict({"parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"], "offload_state": ["master"]}})


def test_what_cannot_be_offloaded_is_named():
    from hpfunc.transforms import plans

    with pytest.raises(plans.PlanError, match="cannot offload 'master'"):
        plans.fsdp("fsdp").with_state_offload("master")
    assert (plans.fsdp("fsdp").with_state_offload("optimizer") + plans.ddp("dp")).state_offload == ("optimizer",)
    with pytest.raises(plans.PlanError, match="group_bytes must be an int >= 0"):
        plans.fsdp("fsdp").with_state_offload("optimizer", group_bytes=-1)
    assert plans.fsdp("fsdp").with_state_offload("optimizer", group_bytes=0).offload_group_bytes == 0


def test_the_yaml_and_the_plan_share_one_list_of_what_can_be_offloaded():
    from hpfunc.train.config import parallel_grammar
    from hpfunc.transforms import state_offload

    assert parallel_grammar.OFFLOAD_STATE is state_offload.KINDS
