"""Mixed precision (``plan.with_mixed_precision``) and the gradient scaling factor
(``plan.with_gradient_scaling_factor``): bf16 parity with single-device autograd through a bf16 cast,
and exact communication bytes (the FSDP all-gather moves bf16, the reductions the reduce dtype)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import _parallel_helpers as H
import _precision_helpers as M
from hpfunc.transforms import plans

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("name,model", [("fsdp", "qwen3-dense-tiny"), ("ddp", "qwen3-moe-tiny"),
                                        ("zero2", "qwen3-dense-tiny"), ("tp", "qwen3-moe-tiny")])
def test_bf16_compute_matches_single_device_2(pools, name, model):
    pools(2).run(M.run_mixed_parity, name, model, 0)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_fsdp_x_tp_4(pools, reduce_dtype):
    pools(4).run(M.run_mixed_parity, "fsdp_tp", "qwen3-moe-tiny", 1, reduce_dtype)


@pytest.mark.parametrize("reduce_dtype,rs_bytes", [(torch.float32, 4), (None, 2), (torch.bfloat16, 2)])
def test_fsdp_gathers_bf16_and_reduces_in_the_reduce_dtype(pools, reduce_dtype, rs_bytes):
    r = pools(2).run(M.run_mixed_comm, "fsdp", reduce_dtype)[0]
    f = Fraction(r["n"] - 1, r["n"])
    psi, embed = r["psi"], r["embed"]
    assert r["all_gather/forward"] == 2 * psi * f                      # bf16: half of fp32's Psi (n-1)/n
    assert r["all_gather/backward"] == 2 * (psi - embed) * f           # the re-gather, bf16 too
    assert r["reduce_scatter/backward"] == rs_bytes * psi * f          # the transpose, in the reduce dtype


@pytest.mark.parametrize("reduce_dtype,ar_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_ddp_all_reduces_in_the_reduce_dtype(pools, reduce_dtype, ar_bytes):
    r = pools(2).run(M.run_mixed_comm, "ddp", reduce_dtype)[0]
    f = Fraction(r["n"] - 1, r["n"])
    # (the gradient all-reduce runs after autograd, so comm_stats files it under "forward")
    assert sum(v for k, v in r.items() if k.startswith("all_reduce/")) == 2 * ar_bytes * r["psi"] * f


@pytest.mark.parametrize("name,factor", [("fsdp", 1.0), ("ddp", 0.25), ("zero2_tp", 1.0)])
def test_gradient_scaling_factor(pools, name, factor):
    pools(H.PLANS[name][0]).run(M.run_scaling_factor, name, factor)


TP = plans.tp("tp", {"w": plans.ColwiseParallel()})


def test_policy_errors():
    with pytest.raises(plans.PlanError, match="param_dtype must be a floating"):
        plans.fsdp("fsdp").with_mixed_precision(torch.int8)
    with pytest.raises(plans.PlanError, match="factor must be a finite number > 0"):
        plans.fsdp("fsdp").with_gradient_scaling_factor(0.0)
    with pytest.raises(plans.PlanError, match="param_dtype"):
        plans.fsdp("fsdp").with_mixed_precision(torch.bfloat16) + TP.with_mixed_precision(torch.float16)
    both = plans.fsdp("fsdp").with_mixed_precision() + TP
    assert (both.param_dtype, both.reduce_dtype) == (torch.bfloat16, torch.float32)
