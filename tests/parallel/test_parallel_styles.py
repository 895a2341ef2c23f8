"""Declarative tensor-parallel styles (``plans.tp(axis, styles)``): Qwen3's own table is exactly the
styles a user would write, and a user's own model trains with a style plan as on one device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _parallel_helpers as H
import _styles_helpers as S
from hpfunc.layout import ColwiseParallel, RowwiseParallel, SequenceParallel
from hpfunc.models import qwen3
from hpfunc.models.qwen3.parallel_plan import tp_styles
from hpfunc.transforms import plans


def test_ready_made_tp_equals_written_out_styles(pool4):
    # every Qwen3 parameter family, alone and under FSDP on fsdp=2 x tp=2, with and without sequence /
    # vocabulary parallelism: plan.resolve(...) is identical leaf by leaf
    checked = pool4.run(S.run_tp_equals_styles)[0]
    assert len(checked) == 3 * 2 * 2 * 2


@pytest.mark.parametrize("mesh,sp", [({"tp": 2}, False), ({"tp": 2}, True)])
def test_user_mlp_with_styles_matches_single_device_2(pool2, mesh, sp):
    pool2.run(S.run_user_mlp, mesh, sp, 0)


@pytest.mark.parametrize("sp", [False, True])
def test_user_mlp_fsdp_x_styles_matches_single_device_4(pool4, sp):
    pool4.run(S.run_user_mlp, {"fsdp": 2, "tp": 2}, sp, 1)


@settings(max_examples=8)
@given(sp=st.booleans(), seed=st.integers(0, 2**16), dim=st.sampled_from([4, 8, 12]),
       hidden=st.sampled_from([2, 8, 24]), seq=st.sampled_from([2, 4, 6]))
def test_random_user_mlps(pool2, sp, seed, dim, hidden, seq):
    pool2.run(S.run_user_mlp, {"tp": 2}, sp, seed, dim, hidden, seq)


def test_styles_turn_on_the_model_modes():
    assert plans.tp("tp", {"w": ColwiseParallel()}).tp_sequence_parallel is False
    plan = plans.tp("tp", [("w", ColwiseParallel()), ("norm", SequenceParallel())])
    assert plan.tp_sequence_parallel and not plan.tp_vocab_parallel and plan.tp_axis == "tp"
    cfg = qwen3.preset("qwen3-dense-tiny")
    assert plans.tp("tp", tp_styles(cfg, vocab_parallel=True)).tp_vocab_parallel
    assert "final_norm" in tp_styles(cfg, sequence_parallel=True) and "embed" not in tp_styles(cfg)
    # the table names only the families the config has: no expert pattern for a dense model
    assert not any("experts" in k for k in tp_styles(cfg)) and "layers.*.moe.experts.w_up" in tp_styles(
        qwen3.preset("qwen3-moe-tiny"))


def test_style_must_be_an_instance():
    with pytest.raises(TypeError, match=r"'w'.*ColwiseParallel.*add \(\)"):
        plans.tp("tp", {"w": ColwiseParallel})
    with pytest.raises(TypeError, match="pairs"):
        plans.tp("tp", [("w", RowwiseParallel(), 1)])
    with pytest.raises(plans.PlanError, match="no styles"):
        plans.tp("tp", {})


@pytest.mark.parametrize("case,needles", [
    ("style_pattern", ["'layers.*.atn.wo'", "matches no parameter path", "did you mean"]),
    ("style_rank", ["tp('tp')", "'final_norm'", "VocabParallel expects", "rank 1"]),
])
def test_bad_styles_are_plan_errors(pool2, case, needles):
    msg = pool2.run(H.run_bad_input, case)[0]
    for n in needles:
        assert n in msg, msg
