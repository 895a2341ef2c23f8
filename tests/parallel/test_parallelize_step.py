"""``hpfunc.parallelize(step, mesh, plan)``: the trainer's single-device ``step(state, batch)``,
distributed, equals the same step on one device (metrics and parameters after every step), with
AdamW or Muon + AdamW, clipping by the global norm inside the optimizer chain, and the MoE expert bias.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _parallel_helpers as H
import _state_helpers as S

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("name", ["fsdp", "zero1", "ddp", "tp"])
def test_step_matches_single_device_2_ranks(pools, name):
    pools(2).run(S.run_state_parity, name, "qwen3-dense-tiny", 0, "adamw", 0.5)


def test_main_job_setup_fsdp_x_tp(pools):
    # what `hpfunc train` runs by default: MoE, Muon + AdamW, clipping, expert-bias balancing, 2x2 mesh
    pools(4).run(S.run_state_parity, "fsdp_tp", "qwen3-moe-tiny", 1, "muon_adamw", 0.5, 3, 1e-3)


def test_zero2_x_tp_with_muon(pools):
    # ZeRO shards Muon's matrices on the data axis and TP on another: both gathered for Newton-Schulz
    pools(4).run(S.run_state_parity, "zero2_tp", "qwen3-moe-tiny", 2, "muon_adamw", None, 2)


@settings(max_examples=4)
@given(name=st.sampled_from(sorted(k for k, v in H.PLANS.items() if v[0] <= 4)),
       model=st.sampled_from(["qwen3-dense-tiny", "qwen3-moe-tiny"]), seed=st.integers(0, 2**16),
       opt=st.sampled_from(["adamw", "muon_adamw"]), clip=st.sampled_from([None, 0.5]))
def test_random_plans_optimizers_seeds(pools, name, model, seed, opt, clip):
    pools(H.PLANS[name][0]).run(S.run_state_parity, name, model, seed, opt, clip, 2, 1e-3)


@pytest.mark.parametrize("name", ["fsdp", "zero2", "tp", "fsdp_tp"])
def test_same_bytes_as_parallel_train_step(pools, name):
    counts = pools(H.PLANS[name][0]).run(S.run_comm_equal, name)
    assert all(c > 0 for c in counts)


def test_misuse_is_a_clear_error(pools):
    msgs = pools(2).run(S.run_errors)
    assert len(msgs[0]) == 4


@pytest.mark.parametrize("role", ["fsdp", "zero2", "tp"])
def test_one_rank_mesh_is_the_single_device_step(pools, role):
    axis = "tp" if role == "tp" else "dp"
    pools(1).run(S.run_state_parity, ({axis: 1}, (role,)), "qwen3-moe-tiny", 3, "muon_adamw", 0.5, 2, 1e-3)


@pytest.mark.slow
def test_three_axis_mesh_8_ranks(pools):
    # dp x fsdp x tp with vocabulary-parallel TP, MoE, Muon + AdamW, clipping, expert bias
    pools(8).run(S.run_state_parity, "hsdp_tp8", "qwen3-moe-tiny", 4, "muon_adamw", 0.5, 2, 1e-3)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2_tp"])
def test_microbatches_match_the_whole_batch(pools, name):
    # 2 micro-batches per data shard, dense model: equals the one-device step on the whole batch
    pools(H.PLANS[name][0]).run(S.run_state_parity, name, "qwen3-dense-tiny", 6, "adamw", 0.5, 2, 0.0, 2)


@pytest.mark.parametrize("name", ["ddp", "zero2_tp", "tp"])
def test_microbatches_reduce_once(pools, name):
    # no FSDP gathers: 2 micro-batches move exactly the bytes of one whole-batch step
    pools(H.PLANS[name][0]).run(S.run_comm_equal, name, 2)


def test_a_state_laid_out_as_lowered_skips_the_layout_check(pools):
    """A state laid out as the lowered step planned (its own output, or DTensors made elsewhere alike)
    goes in unchecked; a leaf laid out otherwise is checked and redistributed (same result), and
    another plan checks and refuses the layout."""
    for out in pools(2).run(S.run_marked_state):
        assert out["marked"] == 0 and out["after_fresh"] == 0 and out["after_other"] == 1, out
        assert out["fresh"] == out["same"] == out["other"] and out["losses"][1] < out["losses"][0], out
        assert "'w' is stored as" in out["wrong"] and "P('fsdp')" in out["wrong"], out["wrong"]


def test_aux_statistics_reduced_in_one_collective(pools):
    for out in pools(2).run(S.run_aux_stats_packed):
        batch = torch.arange(12.0).reshape(4, 3)
        y = batch @ torch.arange(3.0)
        # the mean over the 2 data shards of each shard's statistic; integers summed
        assert out["s"].item() == y.sum().item() / 2 and out["d"].item() == batch.sum().item() / 2, out
        torch.testing.assert_close(out["v"], batch.mean(0), rtol=0, atol=0)
        assert out["n"].item() == 4 and out["m"].tolist() == [4, 2], out
        # the loss (the mean of the shards' losses) and every statistic in one all-reduce (engine/riders.py):
        # a float64 statistic cannot ride the fp32 gradient bucket, so they travel apart, in fp64: the loss, s,
        # v and d (1 + 1 + 3 + 1 values), the integers n and m as two 32-bit limbs each (2 + 4)
        assert out["loss"].item() == y.pow(2).mean().item(), out
        assert out["records"] == [("psum", 12, ""), ("psum", 96, "scalars")], out  # the gradient's 3 floats, then these
        # without the float64 statistic they ride the gradients' all-reduce (one collective in all): the 3
        # gradient floats, the loss, s and v, then n and m as 12-bit limbs (six each)
        assert out["records_fp32"] == [("psum", 4 * (3 + 1 + 3 + 1 + 3 * 6), "")], out
        assert out["fp32"]["n"].item() == 4 and out["fp32"]["m"].tolist() == [4, 2], out
        torch.testing.assert_close(out["fp32"]["v"], batch.mean(0), rtol=0, atol=0)
