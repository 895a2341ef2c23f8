"""Exact communication volume per step, measured by hpfunc.comm_stats, against the formulas of
docs/reference.md#communication-volumes.

Psi = parameter count, 4 bytes each (fp32), n = data-parallel degree; bytes are what one rank sends
under the ring algorithm (all-reduce 2 (n-1)/n M, all-gather / reduce-scatter (n-1)/n M).
The untied dense tiny Qwen3 is used (all dimensions divide by 2 and 4, so every leaf shards).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

import _parallel_helpers as H
import _state_helpers as S

pytestmark = pytest.mark.multirank


def _sent(out, op, axes, phase):
    return out.get((op, axes, phase), [0, 0])[1]


@pytest.mark.parametrize("name", ["ddp", "ddp4"])
def test_ddp_all_reduces_2psi(pools, name):
    out = pools(H.PLANS[name][0]).run(H.run_comm, name)[0]
    n = H.PLANS[name][0]
    psi_bytes = 4 * out["psi"]
    # the gradient all-reduces run in buckets started during the backward (engine/overlap.py): the bytes
    # of one all-reduce of every gradient; the tiny model's gradients fit one bucket under the default
    # bucket cap (25 MiB, Plan.with_bucket_cap), so one call (with cap 0: one per layer and one for the top)
    assert _sent(out, "all_reduce", ("dp",), "backward") == Fraction(2 * (n - 1), n) * psi_bytes
    assert set(k for k in out if isinstance(k, tuple)) == {("all_reduce", ("dp",), "backward")}
    assert out[("all_reduce", ("dp",), "backward")][0] == 1
    # the loss pmean rides that bucket (4 bytes: one fp32 scalar, engine/riders.py); the grad norm needs no
    # psum (every gradient block is whole on every rank)
    assert out["scalars"] == 1 and out["rider_bytes"] == 4


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero12_reduce_scatter_plus_all_gather_2psi(pools, name):
    out = pools(2).run(H.run_comm, name)[0]
    n, psi_bytes = 2, 4 * out["psi"]
    assert _sent(out, "reduce_scatter", ("dp",), "forward") == Fraction(n - 1, n) * psi_bytes
    assert _sent(out, "all_gather", ("dp",), "forward") == Fraction(n - 1, n) * psi_bytes
    assert set(k for k in out if isinstance(k, tuple)) == {("reduce_scatter", ("dp",), "forward"),
                                                           ("all_gather", ("dp",), "forward")}


@pytest.mark.parametrize("name", ["fsdp", "fsdp4"])
def test_fsdp_reshard_after_forward_3psi(pools, name):
    out = pools(H.PLANS[name][0]).run(H.run_comm, name)[0]
    n, psi_bytes = H.PLANS[name][0], 4 * out["psi"]
    f = Fraction(n - 1, n)
    assert _sent(out, "all_gather", ("fsdp",), "forward") == f * psi_bytes
    assert _sent(out, "reduce_scatter", ("fsdp",), "backward") == f * psi_bytes
    # the backward gathers again every parameter autograd saved: all but the embedding table
    # (an embedding lookup saves the indices, not the table), so 3 Psi less the embedding
    assert _sent(out, "all_gather", ("fsdp",), "backward") == f * (psi_bytes - 4 * out["embed"])
    # one gather per layer (its parameters packed in one buffer) and per top-level parameter, each pass
    groups = out["gather_groups"]
    assert groups == out["layers"] + 3  # layers.0, layers.1, embed, final_norm, lm_head
    assert out[("all_gather", ("fsdp",), "forward")][0] == groups
    assert out[("all_gather", ("fsdp",), "backward")][0] == groups - 1
    assert out[("reduce_scatter", ("fsdp",), "backward")][0] == groups
    # from the second step on the groups the forward reads last (the last layer, the final norm and the
    # head) stay gathered for the backward, which needs them first (differentiate.kept_after_forward):
    # 3 Psi less the embedding and those
    later = pools(H.PLANS[name][0]).run(H.run_comm, name, 4, 6, 1)[0]
    assert _sent(later, "all_gather", ("fsdp",), "backward") == f * (psi_bytes - 4 * out["embed"] - 4 * out["kept"])
    assert later[("all_gather", ("fsdp",), "backward")][0] == groups - 4
    for key in (("all_gather", ("fsdp",), "forward"), ("reduce_scatter", ("fsdp",), "backward")):
        assert later[key] == out[key], key


def test_fsdp_without_reshard_2psi(pools):
    out = pools(2).run(H.run_comm, "fsdp_keep")[0]
    f, psi_bytes = Fraction(1, 2), 4 * out["psi"]
    assert _sent(out, "all_gather", ("fsdp",), "forward") == f * psi_bytes
    assert _sent(out, "reduce_scatter", ("fsdp",), "backward") == f * psi_bytes
    assert ("all_gather", ("fsdp",), "backward") not in out


def test_tp_two_all_reduces_per_layer_each_way(pools):
    out = pools(2).run(H.run_comm, "tp")[0]
    L = out["layers"]
    assert out["act_psum"] == {"forward": 2 * L, "backward": 2 * L}
    act_sent = 2 * L * Fraction(2 * 1, 2) * out["act_bytes"]
    # backward: the activations plus the gradient all-reduces of the parameters replicated over tp
    # (embedding, lm_head, norms, router), started in buckets during the backward
    assert _sent(out, "all_reduce", ("tp",), "backward") == act_sent + Fraction(2, 2) * 4 * out["tp_replicated_numel"]
    assert _sent(out, "all_reduce", ("tp",), "forward") == act_sent


def test_fsdp_x_tp_counts(pools):
    out = pools(4).run(H.run_comm, "fsdp_tp")[0]
    L = out["layers"]
    assert out["act_psum"] == {"forward": 2 * L, "backward": 2 * L}
    # every layer is gathered once forward over fsdp (its tp blocks), reduce-scattered once backward
    assert out[("all_gather", ("fsdp",), "forward")][0] == out["gather_groups"]
    assert out[("reduce_scatter", ("fsdp",), "backward")][0] == out["gather_groups"]
    assert _sent(out, "all_gather", ("fsdp",), "forward") == _sent(out, "reduce_scatter", ("fsdp",), "backward")


@pytest.mark.parametrize("name,formula", [
    ("fsdp4", lambda psi, n: 16 * psi / n),              # params, grads, m, v all sharded: 16 Psi / n (fp32)
    ("zero2", lambda psi, n: 4 * psi + 12 * psi / n),    # params replicated, grads + m + v sharded
    ("ddp", lambda psi, n: 16 * psi),
])
def test_model_state_bytes_per_rank(pools, name, formula):
    outs = pools(H.PLANS[name][0]).run(H.run_state_bytes, name)
    for o in outs:
        assert o["params"] + o["grads"] + o["opt"] == formula(o["psi"], o["n"]), o


def test_tp_vocab_parallel_one_more_all_reduce_each_way(pools):
    out = pools(2).run(H.run_comm, "tp_vocab")[0]
    L = out["layers"]
    # the embedding lookup adds one all-reduce of b s h each way; embed and lm_head are no longer
    # replicated, so their gradients need no all-reduce
    assert out["act_psum"] == {"forward": 2 * L + 1, "backward": 2 * L + 1}
    act_sent = (2 * L + 1) * out["act_bytes"]  # n = 2: an all-reduce sends M
    tokens_bytes = 4 * 4 * 6  # one fp32 per token (batch 4 x 6)
    # cross-entropy: max, sum of exponentials and target logit forward; the last two backward
    grads_sent = 4 * out["tp_replicated_numel"]  # norms only, reduced in buckets during the backward
    assert _sent(out, "all_reduce", ("tp",), "backward") == act_sent + 2 * tokens_bytes + grads_sent
    assert _sent(out, "all_reduce", ("tp",), "forward") == act_sent + 3 * tokens_bytes


@pytest.mark.parametrize("name", ["fsdp", "fsdp_keep"])
def test_reshard_after_forward_frees_gathered_params(pools, name):
    # measured on tensors: after the forward, which gathered full parameters does autograd still hold?
    out = pools(2).run(H.run_alive_after_forward, name)[0]
    assert out["read"] == out["psi_bytes"]  # the model read every parameter, full size
    if name == "fsdp":
        assert out["alive"] == 0  # all replaced by markers, regathered in the backward
    else:
        # kept until the backward ends, as FSDP2 does without resharding: every gathered parameter, the
        # embedding table too (which autograd alone would not keep: a lookup saves only the ids), so that a
        # second read (a tied head) or a recompute in the backward uses it without gathering it again
        assert out["alive"] == out["psi_bytes"]


def test_front_door_scalars_in_one_collective(pools):
    """The trainer's step reduces its loss, aux statistics (ce and aux loss, the token count) and gradient
    norm together (engine/step_scalars.py): under fsdp one fp64 all-reduce of 6 values (3 floats, the
    count as two 32-bit limbs, the norm) from the second step on (the first finds that the step asks for
    the norm: its statistics in fp32, the norm in a separate psum); under ddp they ride the gradient bucket (3 floats and the count as six
    12-bit limbs, 36 bytes) and the norm needs none: one collective per step in all."""
    for out in pools(2).run(S.run_front_scalars, "fsdp"):
        assert out[0]["scalars"] == [("all_reduce", ("fsdp",), 36)], out[0]  # fp32: 3 floats, 6 limbs
        assert out[0]["small"] == [("all_reduce", "psum", 8)], out[0]  # the first step's norm psum
        for step in out[1:]:
            assert step["scalars"] == [("all_reduce", ("fsdp",), 48)] and step["small"] == [], step
    for out in pools(2).run(S.run_front_scalars, "ddp"):
        for step in out:
            assert step["scalars"] == [] and step["small"] == [] and step["riders"] == [36], step
            assert step["collectives"] == 1, step
    # the same metrics as one device: test_parallelize_step's parity tests (loss, ce, aux, grad norm)
