"""remat and offload compose with hpfunc.parallelize: every policy of each, of a layer, nested either way,
inside fsdp (reshard after forward on and off), fsdp x tp and ddp steps on 2 and 4 ranks. Gradients and
the AdamW update equal one device, and what stays alive after the forward (storage liveness) is exactly
what the policy keeps on one device with this rank's shapes: no gathered parameter is copied to the host,
and gathered parameters are kept only without reshard after forward."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _compose_helpers as C

pytestmark = pytest.mark.multirank


def _check(results):
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("names", [["ddp2", "fsdp2", "fsdp2_keep"], ["ddp4", "fsdp4", "fsdp4_keep"],
                                   ["fsdp_tp", "fsdp_keep_tp"]])
def test_every_policy_and_nesting_inside_every_plan(pools, names):
    _check(pools(C.world(names[0])).run(C.run_matrix, names)[0])


@settings(max_examples=8)
@given(name=st.sampled_from(sorted(C.PLANS)), kind=st.sampled_from(C.WRAPS), seed=st.integers(0, 2**16),
       dim=st.sampled_from([4, 8]), hidden=st.sampled_from([8, 16]), seq=st.sampled_from([1, 3]))
def test_random_shapes_and_seeds(pools, name, kind, seed, dim, hidden, seq):
    _check(pools(C.world(name)).run(C.run_matrix, [name], [kind], seed=seed, dim=dim, hidden=hidden, seq=seq)[0])


@pytest.mark.parametrize("name", ["fsdp2", "fsdp_tp"])
def test_remat_of_a_layer_called_with_the_parameter_view(pools, name):
    # the layer reads p["norm"] (gathered over fsdp) from the view it is called with; the recompute gets
    # the storage blocks back from autograd as new tensors, and once read them as stored (4 wide, not 8)
    problems = pools(C.world(name)).run(C.run_remat_of_view, name)
    assert not any(problems), "\n".join(p for rank in problems for p in rank)


def test_orders_that_make_no_sense_are_refused(pool2):
    # remat around a step's value_and_grad, a parallelized step inside offload or remat, one step inside
    # another: PlanErrors naming both transforms, before any communication
    assert len(pool2.run(C.run_refused_orders)[0]) == 4
