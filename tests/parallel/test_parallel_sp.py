"""Megatron sequence parallelism (``plans.tp(axis, tp_styles(cfg, sequence_parallel=True))``): single-device parity and
exact communication.

Parity as in test_parallel_parity.py (loss, every reduced gradient, grad norm and update against
single-device autograd at the same parameters; rtol 1e-5). Communication: per layer, 2 all-gathers and
2 reduce-scatters of ``b s h`` activations forward and the same backward, each ``b s h (n-1)/n`` bytes
sent per rank, and no activation all-reduce.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _parallel_helpers as H

pytestmark = pytest.mark.multirank

SP_2 = [k for k, v in H.SP_PLANS.items() if v[0] == 2]
SP_4 = [k for k, v in H.SP_PLANS.items() if v[0] == 4]


@pytest.mark.parametrize("name", SP_2)
def test_sp_matches_single_device_dense_2(pools, name):
    pools(2).run(H.run_parity, name, "qwen3-dense-tiny", 10)


@pytest.mark.parametrize("name", SP_4)
def test_sp_matches_single_device_dense_4(pools, name):
    pools(4).run(H.run_parity, name, "qwen3-dense-tiny", 11)


@pytest.mark.parametrize("name", ["tp_sp", "fsdp_tp_sp", "tp_sp_vocab"])
def test_sp_matches_single_device_moe(pools, name):
    pools(H.SP_PLANS[name][0]).run(H.run_parity, name, "qwen3-moe-tiny", 12)


@pytest.mark.parametrize("name", ["tp_sp", "fsdp_tp_sp_vocab"])
def test_sp_untied_embeddings(pools, name):
    # the dense tiny model ties embed and lm_head; this covers a separate head (local-sequence loss for
    # a replicated head, gathered sequence for a vocabulary-parallel one)
    pools(H.SP_PLANS[name][0]).run(H.run_parity, name, "qwen3-dense-tiny", 13, 2, None, False)


@pytest.mark.parametrize("name", ["tp_sp", "fsdp_tp_sp_vocab"])
def test_sp_every_parameter_family(pools, name):
    # attention biases (bo added once, on the sequence block, after the reduce-scatter), a dense and a
    # MoE layer with a shared expert, an untied head
    overrides = dict(attention_bias=True, decoder_sparse_step=2, shared_expert_intermediate_size=32)
    pools(H.SP_PLANS[name][0]).run(H.run_parity, name, "qwen3-moe-tiny", 14, 2, None, False, overrides)


@settings(max_examples=6)
@given(name=st.sampled_from(sorted(H.SP_PLANS)), model=st.sampled_from(["qwen3-dense-tiny", "qwen3-moe-tiny"]),
       seed=st.integers(0, 2**16), clip=st.sampled_from([None, 0.5]), tie=st.sampled_from([None, True, False]))
def test_random_sp_plans_models_seeds(pools, name, model, seed, clip, tie):
    pools(H.SP_PLANS[name][0]).run(H.run_parity, name, model, seed, 2, clip, tie)


def _tp_records(out, op, phase, payload=None):
    return [r for r in out["tp_records"] if r[0] == op and r[1] == phase and (payload is None or r[2] == payload)]


def _check_sp_activations(out, n, extra=0):
    """Exactly 2 all-gathers and 2 reduce-scatters of b s h per layer (+ ``extra``) in each direction."""
    L, act = out["layers"], out["act_bytes"]
    for phase in ("forward", "backward"):
        for op in ("all_gather", "reduce_scatter"):
            recs = _tp_records(out, op, phase)
            assert len(recs) == 2 * L + extra, (op, phase, recs)
            for r in recs:
                assert r[2] == act and r[3] == Fraction(n - 1, n) * act, r
    # and no activation all-reduce, in either direction (TP's 4 per layer are gone)
    assert not [r for r in out["tp_records"] if r[0] == "all_reduce" and r[2] == act]
    assert out["act_psum"] == {"forward": 0, "backward": 0}


def test_sp_two_all_gathers_two_reduce_scatters_per_layer_each_way(pools):
    out = pools(2).run(H.run_comm, "tp_sp")[0]
    n, L, act = 2, out["layers"], out["act_bytes"]
    _check_sp_activations(out, n)
    # the same bytes as TP's 2 all-reduces per layer each way (an all-reduce = reduce-scatter + all-gather)
    sp_bytes = sum(r[3] for r in out["tp_records"] if r[2] == act)
    assert sp_bytes == 2 * 2 * L * Fraction(2 * (n - 1), n) * act
    # the rest on tp: the all-reduce of the tp-replicated parameters' gradients (embedding, head, norms),
    # the local-sequence loss (one fp32 sum forward, its transpose backward) and the grad-norm (fp64)
    # (the gradients' all-reduces start in buckets during the backward)
    grads = [r for r in _tp_records(out, "all_reduce", "backward") if r[2] > 8]
    assert sum(r[3] for r in grads) == Fraction(2 * (n - 1), n) * 4 * out["tp_replicated_numel"]
    assert sorted(r[2] for r in _tp_records(out, "all_reduce", "forward")) == [4, 8]
    assert [r[2] for r in _tp_records(out, "all_reduce", "backward") if r[2] <= 8] == [4]
    assert len(out["tp_records"]) == 8 * L + len(grads) + 3


def test_sp_vocab_parallel_reduce_scatters_the_lookup_and_gathers_before_the_head(pools):
    out = pools(2).run(H.run_comm, "tp_sp_vocab")[0]
    # one more reduce-scatter forward (the masked lookup) and all-gather (before the head), each
    # transposed backward
    _check_sp_activations(out, 2, extra=1)
    tokens_bytes = 4 * 4 * 6  # cross-entropy over the gathered sequence: one fp32 per token (batch 4 x 6)
    ce_f = [r for r in _tp_records(out, "all_reduce", "forward") if r[2] == tokens_bytes]
    ce_b = [r for r in _tp_records(out, "all_reduce", "backward") if r[2] == tokens_bytes]
    assert (len(ce_f), len(ce_b)) == (3, 2)  # max, sum of exponentials, target logit; the last two back


def test_fsdp_x_tp_sp_counts(pools):
    out = pools(4).run(H.run_comm, "fsdp_tp_sp")[0]
    _check_sp_activations(out, 2)
    # FSDP as without sequence parallelism: one gather per layer forward, one reduce-scatter backward
    assert out[("all_gather", ("fsdp",), "forward")][0] == out["gather_groups"]
    assert out[("reduce_scatter", ("fsdp",), "backward")][0] == out["gather_groups"]
    assert out[("all_gather", ("fsdp",), "forward")][1] == out[("reduce_scatter", ("fsdp",), "backward")][1]


@pytest.mark.parametrize("case,needles", [
    ("sp_sequence", ["'tokens'", "(4, 7)", "dimension 1", "'tp'", "2 ranks"]),
    ("sp_sequence_plan", ["'tokens'", "(4, 7)", "dimension 1", "'tp'", "2 ranks"]),
    ("sp_sequence_model", ["'tokens'", "(4, 7)", "dimension 1", "'tp'", "2 ranks"]),
    ("two_tp_layers", ["one tensor-parallel layer", "tp('tp'), tp('tp')"]),
])
def test_sp_bad_input_is_a_clear_plan_error(pool2, case, needles):
    msg = pool2.run(H.run_bad_input, case)[0]
    for n in needles:
        assert n in msg, msg
