"""Selective state offload (``plan.with_state_offload("optimizer")``): equal to the plan without it on real
gloo ranks, and on fake CUDA devices no optimizer-state byte stays on the device between steps (storage
liveness: weak references to every storage the run made)."""

from __future__ import annotations

import pytest

from tests.gpu import _offload_pieces as op


@pytest.mark.multirank
@pytest.mark.parametrize("name, world", [("fsdp", 2), ("fsdp x tp", 4)])
def test_offloaded_optimizer_state_equals_the_plan_without(pools, name, world):
    outs = pools(world).run(op.run_offload_parity, name)
    for out in outs:
        for i, e in enumerate(out["errors"]):
            assert e["loss"] <= 1e-5 and e["grads"] <= 1e-5 and e["updates"] <= 1e-5 and e["opt"] <= 1e-5, (i, e)
            assert e["bitwise"], (i, e)  # the same arithmetic on the same numbers
        assert out["rest"] == [["cpu"]] * 3


@pytest.mark.multirank
def test_a_stale_copy_back_is_caught(pools):
    outs = pools(2).run(op.run_offload_parity, "fsdp", 3, "stale")
    assert any(e["opt"] > 1e-5 for e in outs[0]["errors"][1:]), outs[0]["errors"]
