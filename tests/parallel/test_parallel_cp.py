"""Context parallelism through ``hpfunc.parallelize`` (``plans.cp(axis, impl=...)``): single-device parity
and clear errors.

Parity as in test_parallel_parity.py: loss, every reduced gradient, grad norm and the update at the same
parameters equal single-device autograd of ``qwen3.loss`` on the whole sequences (fp32, rtol 1e-5), and the
independent single-device trajectory, over 2 AdamW steps. Drawn: the strategy, the model (dense, MoE: its
load-balancing statistics leave the padding out), the sequence length (lengths that divide into ``2 P``
chunks and lengths that need padding), packed documents of random lengths or none, the seed; alone on 2
and 4 ranks, hybrid on 2 x 2, and composed with fsdp, tp (also sequence- and vocabulary-parallel), ep and
pp. A deliberate bug (the ring's last K, V block skipped; the causal mask one position late; RoPE at the
wrong positions) makes the same comparison fail.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import _cp_helpers as C

pytestmark = pytest.mark.multirank

MODELS = st.sampled_from(["qwen3-dense-tiny", "qwen3-moe-tiny"])


# three drawn examples and two pinned ones: a length that divides into 2 P chunks and one that needs padding
@settings(max_examples=3)
@given(impl=st.sampled_from(["allgather", "ring", "ulysses"]), model=MODELS, seq=st.integers(5, 12),
       seed=st.integers(0, 2**16), docs=st.booleans())
@example(impl="ring", model="qwen3-moe-tiny", seq=8, seed=1, docs=False)
@example(impl="ulysses", model="qwen3-dense-tiny", seq=7, seed=2, docs=True)
def test_cp2_matches_single_device(pool2, impl, model, seq, seed, docs):
    pool2.run(C.run_cp_parity, "cp2", impl, model, seed, seq, 2, 2, None, docs)


# (plan, impl, options): cp over 4 ranks by each strategy (Ulysses above the 2 KV heads replicates them),
# hybrid 2 x 2, and cp composed with fsdp (batch split too), tp (heads split by tp first; with
# sequence-parallel norms and a vocabulary-parallel embedding and head too) and ep
CASES_4 = [("cp4", "ring", {}), ("cp4", "allgather", {}), ("cp4", "ulysses", {"replicate_kv": True}),
           ("cp2x2_hybrid", "hybrid", {}), ("fsdp_cp", "ring", {}), ("fsdp_cp", "ulysses", {}),
           ("cp_tp", "ring", {}), ("cp_tp", "allgather", {}), ("cp_tp_sp", "ring", {}),
           ("cp_tp_vocab", "allgather", {}),
           ("ep_cp", "ring", {})]


@settings(max_examples=3)
@given(case=st.sampled_from(CASES_4), model=MODELS, seq=st.integers(6, 17), seed=st.integers(0, 2**16),
       docs=st.booleans())
@example(case=CASES_4[3], model="qwen3-moe-tiny", seq=16, seed=3, docs=True)
@example(case=CASES_4[4], model="qwen3-dense-tiny", seq=13, seed=4, docs=False)
def test_cp4_and_composed_match_single_device(pool4, case, model, seq, seed, docs):
    name, impl, kw = case
    if name == "ep_cp":
        model = "qwen3-moe-tiny"
    batch = 4 if name in ("fsdp_cp", "ep_cp") else 2
    pool4.run(C.run_cp_parity, name, impl, model, seed, seq, batch, 2, None, docs, **kw)


@pytest.mark.parametrize("roles,kind,schedule,remat,seq", [(["pp", "cp"], "moe", "1f1b", "nothing_saveable", 11),
                                                          (["pp", "cp_ulysses"], "dense", "zbv", None, 8)])
def test_pp_x_cp_matches_single_device(pool4, roles, kind, schedule, remat, seq):
    # pipeline stages over pp, each stage's activations this rank's tokens of every sequence; the loss,
    # aux loss, expert load, gradients of this rank's stages and updates equal one device's (2 microbatches);
    # with every stage recomputed in its backward (its attention's collectives repeated), and with zbv's
    # split backward
    import _pp_helpers as PP

    pool4.run(PP.run_pp_parity, {"pp": 2, "cp": 2}, roles, kind=kind, schedule=schedule, m=2, batch=4, seq=seq,
              remat=remat)


@pytest.mark.parametrize("impl,policy,docs", [("ring", "nothing_saveable", False), ("ulysses", "dots_saveable", True)])
def test_cp_under_remat_matches_single_device(pool2, impl, policy, docs):
    # the loss recomputed in the backward (hpfunc.remat inside the differentiated function): the recompute
    # repeats the attention's collectives (the ring's posted transfers included) on every rank alike
    pool2.run(C.run_cp_parity, "cp2", impl, "qwen3-moe-tiny", 5, 11, 2, 2, None, docs, policy)


def test_remat_recomputes_the_ring_in_the_backward(pool2):
    # without remat: L (P - 1) transfers forward and their transposes backward; with nothing_saveable the
    # backward also repeats the forward's transfers (the recompute), so the parity above covers them
    plain, again = pool2.run(C.run_ring_transfers, None)[0], pool2.run(C.run_ring_transfers, "nothing_saveable")[0]
    L = plain["layers"]
    assert (plain["forward"], plain["backward"]) == (L, L)
    assert (again["forward"], again["backward"]) == (L, 2 * L)


@pytest.mark.parametrize("pool_n,name,impl,bug,seq", [
    (2, "cp2", "ring", "skip_rotation", 8),
    (4, "cp4", "allgather", "causal_offset", 13),
    (2, "cp2", "ulysses", "rope_offset", 7),
])
def test_a_deliberate_bug_fails_the_parity(pools, pool_n, name, impl, bug, seq):
    with pytest.raises(Exception, match="exceed rtol"):
        pools(pool_n).run(C.run_cp_parity, name, impl, "qwen3-dense-tiny", 3, seq, 2, 1, bug)


@pytest.mark.parametrize("n,case,needles", [
    (2, "no_pad", ["'tokens'", "(2, 6)", "pad=False", "multiple of 4"]),
    (4, "ulysses_heads", ["Ulysses degree 4", "2 key/value heads", "replicate_kv=True"]),
    (4, "ulysses_heads_tp", ["Ulysses degree 2", "1 key/value heads", "2 tensor-parallel ranks"]),
    (2, "axis_twice", ["mesh axis 'cp' is used by both fsdp and cp"]),
    (2, "no_axis", ["cp('cp', impl='ring')", "mesh axes are ('dp',)"]),
])
def test_bad_input_is_a_clear_error_before_any_collective(pools, n, case, needles):
    msg = pools(n).run(C.run_bad_input, case)[0]
    for needle in needles:
        assert needle in msg, msg
    assert msg.endswith("COLLECTIVES 0"), msg


def test_the_model_reads_a_bound_cp_layout_itself():
    """qwen3.loss takes no hook for context parallelism: under a bound cp layout (one rank here, so the
    ring is the whole sequence) it splits the batch and attends through the layout itself, and equals
    one device; qwen3.apply gives the logits of this rank's tokens."""
    import torch

    import hpfunc
    from hpfunc import layout, random
    from hpfunc.models import qwen3

    cfg = qwen3.preset("qwen3-dense-tiny")
    params = qwen3.init(random.key(0), cfg)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))}
    with hpfunc.Mesh({"cp": 1}), layout.context_parallel(layout.ContextParallel("cp")):
        value = qwen3.loss(params, batch, cfg)[0]
        logits = qwen3.apply(params, batch["tokens"], cfg)
    torch.testing.assert_close(value, qwen3.loss(params, batch, cfg)[0], rtol=1e-5, atol=1e-6)
    assert logits.shape == (2, 6, cfg.vocab_size)  # padded to 2 P chunks


@pytest.mark.parametrize("n,name,impl,seq", [(2, "cp2", "ring", 13), (4, "cp4", "allgather", 13),
                                             (2, "cp2", "ulysses", 13), (4, "fsdp_cp", "ring", 16)])
def test_attention_communication_per_layer_matches_the_formulas(pools, n, name, impl, seq):
    """Per layer and rank, with N = batch x padded sequence (docs/reference.md, context-parallel attention):
    ring P - 1 transfers of 2 N h_kv / P each way; all-gather one all-gather of 2 N h_kv forward (sends
    (P-1)/P of it) and one reduce-scatter backward; Ulysses 4 all-to-alls each way, q and out N h / P, k and v
    N h_kv / P. Besides attention the cp axes carry only the loss's scalars and the gradient all-reduce."""
    from fractions import Fraction

    out = pools(n).run(C.run_cp_comm, name, impl, seq)[0]
    L, P, B, h, h_kv = out["layers"], out["P"], out["B"], out["h"], out["h_kv"]
    N = B * (-(-seq // (2 * P)) * 2 * P)
    f32 = 4
    recs = out["records"]

    def of(op, phase):
        return [(r[3], r[4]) for r in recs if r[0] == op and r[2] == phase]

    if impl == "ring":
        for phase in ("forward", "backward"):
            assert of("ppermute", phase) == [(2 * N * h_kv // P * f32, 2 * N * h_kv // P * f32)] * (L * (P - 1))
        attention = {"ppermute"}
    elif impl == "allgather":
        full = 2 * N * h_kv * f32
        assert of("all_gather", "forward") == [(full, Fraction(P - 1, P) * full)] * L
        assert of("reduce_scatter", "backward") == [(full, Fraction(P - 1, P) * full)] * L
        attention = {"all_gather", "reduce_scatter"}
    else:
        q, kv = N * h // P * f32, N * h_kv // P * f32
        for phase in ("forward", "backward"):
            assert sorted(of("all_to_all", phase)) == sorted([(q, Fraction(P - 1, P) * q)] * 2 * L
                                                             + [(kv, Fraction(P - 1, P) * kv)] * 2 * L)
        attention = {"all_to_all"}
    rest = [r for r in recs if r[0] not in attention]
    assert {r[0] for r in rest} == {"all_reduce"}, rest  # the loss's scalars and the gradients' all-reduce
