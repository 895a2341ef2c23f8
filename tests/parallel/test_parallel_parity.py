"""parallel_train_step equals single-device AdamW training: loss, reduced grads, grad norm, params.

Multi-rank model tests are expensive (a few hundred ms per step on 2 shared cores): the two property
tests run 6 and 8 examples (``max_examples``) instead of the profile's 50; the fixed cases cover every
named plan once on both tiny models.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _parallel_helpers as H
from hpfunc.testing import strategies as hst

pytestmark = pytest.mark.multirank

PLANS_2 = [k for k, v in H.PLANS.items() if v[0] == 2]
PLANS_4 = [k for k, v in H.PLANS.items() if v[0] == 4]
PLANS_SMALL = sorted(k for k, v in H.PLANS.items() if v[0] <= 4)


@pytest.mark.parametrize("name", PLANS_2)
def test_plan_matches_single_device_dense_2(pools, name):
    pools(2).run(H.run_parity, name, "qwen3-dense-tiny", 0)


@pytest.mark.parametrize("name", PLANS_4)
def test_plan_matches_single_device_dense_4(pools, name):
    pools(4).run(H.run_parity, name, "qwen3-dense-tiny", 1)


@pytest.mark.parametrize("name", ["fsdp", "zero2", "tp", "fsdp_tp", "tp_vocab"])
def test_plan_matches_single_device_moe(pools, name):
    pools(H.PLANS[name][0]).run(H.run_parity, name, "qwen3-moe-tiny", 2)


@settings(max_examples=6)
@given(name=st.sampled_from(PLANS_SMALL), model=st.sampled_from(["qwen3-dense-tiny", "qwen3-moe-tiny"]),
       seed=st.integers(0, 2**16), clip=st.sampled_from([None, 0.5]), tie=st.sampled_from([None, True, False]))
def test_random_plans_models_seeds(pools, name, model, seed, clip, tie):
    pools(H.PLANS[name][0]).run(H.run_parity, name, model, seed, 2, clip, tie)


def test_loss_is_full_batch_mean_for_dense(pools):
    pools(2).run(H.run_dense_loss_is_full_batch_loss, 3)


@pytest.mark.parametrize("name", ["fsdp", "zero2_tp"])
def test_clip_norm_uses_the_global_norm(pools, name):
    # the grad norm is over all shards (clip active: the tiny model's norm is above 0.5)
    pools(H.PLANS[name][0]).run(H.run_parity, name, "qwen3-dense-tiny", 4, 2, 0.5)


@pytest.mark.parametrize("name", ["tp_vocab", "fsdp_tp"])
def test_untied_embeddings(pools, name):
    # qwen3-dense-tiny ties embed and lm_head; this covers a separate, vocabulary-parallel head
    pools(H.PLANS[name][0]).run(H.run_parity, name, "qwen3-dense-tiny", 5, 2, None, False)


@pytest.mark.slow
def test_three_axis_mesh_8_ranks(pools):
    # hsdp x tp (vocabulary-parallel) on dp=2, fsdp=2, tp=2: one case, 8 ranks on 2 cores is slow
    pools(8).run(H.run_parity, "hsdp_tp8", "qwen3-moe-tiny", 6)


DATA_ROLES = ["ddp", "fsdp", "fsdp_keep", "zero1", "zero2"]


@st.composite
def meshes_and_roles(draw):
    """A mesh of 2 or 4 ranks (1-3 axes) and a role per axis: at most one tensor-parallel axis, of
    size 2 (the tiny models have 2 key/value heads)."""
    shape = draw(hst.mesh_shapes((2, 4)))
    roles = []
    for size in shape.values():
        options = DATA_ROLES + (["tp", "tp_vocab"] if size == 2 and not any(r.startswith("tp") for r in roles)
                                else [])
        roles.append(draw(st.sampled_from(options)))
    return shape, tuple(roles)


@settings(max_examples=8)
@given(mesh_roles=meshes_and_roles(), model=st.sampled_from(["qwen3-dense-tiny", "qwen3-moe-tiny"]),
       seed=st.integers(0, 2**16))
def test_random_meshes_and_plan_compositions(pools, mesh_roles, model, seed):
    shape, roles = mesh_roles
    world = 1
    for s in shape.values():
        world *= s
    pools(world).run(H.run_parity, (shape, roles), model, seed, 2)


@pytest.mark.parametrize("roles", [("zero2", "fsdp"), ("zero1", "fsdp_keep")])
def test_zero_axis_before_fsdp_axis(pools, roles):
    # ZeRO first in mesh order: FSDP shards another dimension than ZeRO's (tests/parallel/test_plan_layouts.py)
    pools(4).run(H.run_parity, ({"dp": 2, "fsdp": 2}, roles), "qwen3-moe-tiny", 7, 2)
