"""SDC check (``plan.with_sdc_check``): a single bit flipped in one replica's reduced gradient is found in
the same step, naming the step, the parameter and the rank, on every rank; replicas are bitwise equal
by construction (no false positive over seeds, plans and steps); no replica at all is said once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _sdc_helpers as H
from hpfunc.transforms import plans

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("plan,rank,path,bit", [("ddp", 2, "w_in", 3), ("hsdp", 1, "w_out", 31),
                                                ("ddp", 0, "b_in", 30)])
def test_a_flipped_bit_is_found_in_the_same_step_naming_the_rank(pools, plan, rank, path, bit):
    out = pools(4).run(H.train, plan, 4, 0, {"rank": rank, "path": path, "bit": bit, "step": 2})
    errors = [o["error"] for o in out]
    assert len(set(errors)) == 1 and errors[0] is not None, errors  # the same error on every rank
    assert all(len(o["losses"]) == 2 for o in out)  # steps 0 and 1 ran; step 2 raised
    msg = errors[0]
    assert msg.startswith("SDC check, step 2: 1 replicated gradient block(s) are not bitwise equal"), msg
    if plan == "hsdp":  # two replicas (over dp): no majority, both named
        assert f"parameter '{path}'" in msg and "rank(s) [1, 3]" in msg and "['dp']" in msg, msg
    else:
        assert f"parameter '{path}': the reduced gradient differs on rank(s) [{rank}]" in msg, msg


@settings(max_examples=4)
@given(plan=st.sampled_from(["ddp", "hsdp"]), seed=st.integers(0, 2**16))
def test_replicas_are_bitwise_equal_no_false_positive(pools, plan, seed):
    out = pools(4).run(H.train, plan, 6, seed)
    assert all(o["error"] is None and not o["warnings"] for o in out), out
    assert len({tuple(o["losses"]) for o in out}) == 1


def test_warn_policy_and_no_replicas(pools):
    out = pools(4).run(H.train, "ddp", 2, 1, {"rank": 0, "path": "w_in", "bit": 5, "step": 1}, "warn")
    assert all(o["error"] is None and len(o["warnings"]) == 1 and "step 1" in o["warnings"][0] for o in out)
    # fsdp over every rank, ZeRO-1 over every rank: every reduced block is a different one, said once
    for plan in ("fsdp", "zero1"):
        out = pools(4).run(H.train, plan, 3, 1, {"rank": 0, "path": "w_in", "bit": 5})
        assert all(o["error"] is None and len(o["warnings"]) == 1 and "no replicas to compare" in o["warnings"][0]
                   for o in out), out


def test_bad_policy_is_named():
    with pytest.raises(plans.PlanError, match=r"with_sdc_check: policy must be one of 'raise', 'warn' or None"):
        plans.ddp("dp").with_sdc_check("abort")
