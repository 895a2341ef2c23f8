"""Context-parallel attention blocks (all-gather, ring, Ulysses, hybrid) on real gloo ranks.

Parity: every strategy's output and the gradients of q, k, v equal single-device attention over the
whole sequence (fp32, 1e-5), causal or not, with and without document masks, for lengths that divide
into ``2 P`` chunks and lengths that need padding, on 2 and 4 ranks. Deliberate bugs (a skipped ring
rotation, a causal mask off by one chunk) fail the same check. Communication per call equals the
formulas of docs/reference.md#context-parallel-attention; causal balancing equalises the attention
FLOPs per rank; bad input fails before any communication; the ring's next transfer is posted before
the current block's compute.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.models.attention_blocks import dense_attention
from hpfunc.models.sequence_split import ContextParallelError, SequenceSplit

pytestmark = pytest.mark.multirank

AXES = ("ring", "uly")


def make_problem(seed: int, B: int, hq: int, hkv: int, S: int, D: int, docs: int) -> dict:
    """Global q, k, v, the output cotangent and (``docs`` > 0) packed-document ids, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    t = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).float()  # noqa: E731
    prob = {"q": t(B, hq, S, D), "k": t(B, hkv, S, D), "v": t(B, hkv, S, D), "cot": t(B, hq, S, D), "doc_ids": None}
    if docs:
        # boundaries anywhere (documents need not divide into chunks); ids ascend along the sequence
        cuts = torch.rand(B, S, generator=g) < docs / S
        cuts[:, 0] = False
        prob["doc_ids"] = cuts.long().cumsum(1)
    return prob


def reference(prob: dict, causal: bool) -> tuple[torch.Tensor, ...]:
    q, k, v = (prob[n].double().requires_grad_(True) for n in ("q", "k", "v"))
    out = dense_attention(q, k, v, causal=causal, doc_ids=prob["doc_ids"])
    grads = torch.autograd.grad((out * prob["cot"].double()).sum(), (q, k, v))
    return (out.detach(),) + grads


def run_cp(mesh_shape: dict, case: dict, impls: list[str], mutate: str | None = None) -> dict:
    """On every rank: each strategy's local output and local dq, dk, dv, and its communication records."""
    import hpfunc
    from hpfunc.models import attention_blocks, context_attention as ca

    mesh = hpfunc.Mesh(mesh_shape)
    prob = make_problem(case["seed"], case["B"], case["hq"], case["hkv"], case["S"], case["D"], case["docs"])
    P = mesh.size
    split = SequenceSplit(case["S"], P, balanced=case.get("balanced", True))
    saved = (ca._ring_perm, attention_blocks.allowed_mask)
    if mutate == "skip_rotation":  # every rank passes its keys to itself: the ring never rotates
        ca._ring_perm = lambda n: [(i, i) for i in range(n)]
    elif mutate == "causal_offset":  # keys placed one chunk later than they are
        orig = saved[1]
        attention_blocks.allowed_mask = lambda q_pos, k_pos, **kw: orig(q_pos, k_pos + split.chunk_len, **kw)
    results = {}
    try:
        with mesh:
            me = mesh.axis_index(AXES)
            local = {n: split.local(prob[n], me, dim=2) for n in ("q", "k", "v", "cot")}
            for impl in impls:
                q, k, v = (local[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
                kw = dict(impl=impl, causal=case["causal"], doc_ids=prob["doc_ids"], overlap=case.get("overlap", True),
                          replicate_kv=case.get("replicate_kv", False))
                if impl == "hybrid":
                    kw.update(axis="ring", ulysses_axis="uly")
                else:
                    kw.update(axis=AXES)
                with hpfunc.comm_stats() as stats:
                    out = ca.context_attention(q, k, v, split, **kw)
                    grads = torch.autograd.grad((out * local["cot"]).sum(), (q, k, v))
                results[impl] = (out.detach(),) + grads + (
                    [(r.op, r.name, r.axes, r.phase, r.payload_bytes, r.sent_bytes) for r in stats.records],)
    finally:
        ca._ring_perm, attention_blocks.allowed_mask = saved
    return results


def impls_for(mesh_shape: dict, hq: int, hkv: int, degenerate_hybrid: bool = False) -> list[str]:
    """The strategies the heads allow; the hybrid on a 2-D mesh (or, ``degenerate_hybrid``, also with one
    axis of size 1: a ring or Ulysses through the hybrid's path)."""
    P = mesh_shape["ring"] * mesh_shape["uly"]
    impls = ["allgather", "ring"]
    if hq % P == 0:
        impls.append("ulysses")
    if hq % mesh_shape["uly"] == 0 and (degenerate_hybrid or (mesh_shape["ring"] > 1 and mesh_shape["uly"] > 1)):
        impls.append("hybrid")
    return impls


def check_parity(pools, mesh_shape: dict, case: dict, mutate: str | None = None) -> None:
    world = mesh_shape["ring"] * mesh_shape["uly"]
    prob = make_problem(case["seed"], case["B"], case["hq"], case["hkv"], case["S"], case["D"], case["docs"])
    ref = reference(prob, case["causal"])
    impls = impls_for(mesh_shape, case["hq"], case["hkv"], degenerate_hybrid=True)
    per_rank = pools(world).run(run_cp, mesh_shape, case, impls, mutate)
    split = SequenceSplit(case["S"], world, balanced=case.get("balanced", True))
    for impl in impls:
        for i, what in enumerate(("output", "dq", "dk", "dv")):
            got = split.unshard([per_rank[r][impl][i] for r in range(world)], dim=2)
            torch.testing.assert_close(got.double(), ref[i], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{impl} {what} on {mesh_shape}, case {case}: {m}")


@st.composite
def cases(draw, world: int) -> tuple[dict, dict]:
    ring = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    mesh_shape = {"ring": ring, "uly": world // ring}
    hkv = draw(st.sampled_from([1, 2, 4]))
    hq = hkv * draw(st.sampled_from([1, 2]))
    divides = draw(st.booleans())
    S = 2 * world * draw(st.integers(1, 3)) if divides else draw(st.integers(3, 6 * world).filter(
        lambda s: s % (2 * world)))
    case = dict(seed=draw(st.integers(0, 2**31 - 1)), B=draw(st.sampled_from([1, 2])), hq=hq, hkv=hkv, S=S,
                D=draw(st.sampled_from([4, 8])), causal=draw(st.booleans()), docs=draw(st.sampled_from([0, 1, 3])),
                overlap=draw(st.booleans()), replicate_kv=hkv % world != 0 or hkv % mesh_shape["uly"] != 0,
                balanced=draw(st.sampled_from([True, True, False])))
    return mesh_shape, case


@settings(max_examples=10)
@given(data=st.data())
def test_parity_2_ranks(pools, data):
    check_parity(pools, *data.draw(cases(2)))


@settings(max_examples=10)
@given(data=st.data())
def test_parity_4_ranks(pools, data):
    check_parity(pools, *data.draw(cases(4)))


FIXED = dict(seed=3, B=1, hq=4, hkv=2, S=13, D=4, causal=True, docs=3, overlap=True, replicate_kv=True)


@pytest.mark.parametrize("world,shape", [(2, {"ring": 2, "uly": 1}), (4, {"ring": 2, "uly": 2})])
def test_parity_fixed_padded_documents(pools, world, shape):
    """A fixed case every run: padding (13 tokens), documents across chunk edges, GQA, every strategy."""
    check_parity(pools, shape, FIXED)


@pytest.mark.parametrize("mutate", ["skip_rotation", "causal_offset"])
def test_deliberate_bugs_fail_parity(pools, mutate):
    case = dict(FIXED, docs=0, S=16)
    with pytest.raises(AssertionError, match=r"(ring|allgather) (output|dq|dk|dv)"):
        check_parity(pools, {"ring": 2, "uly": 2}, case, mutate=mutate)


# ---- communication per call against docs/reference.md


def expected_records(impl: str, mesh_shape: dict, case: dict) -> list[tuple[str, str, int, int]]:
    """``(op, phase, count, payload bytes each)`` by the formulas (fp32, 4 bytes)."""
    P, pr, pu = mesh_shape["ring"] * mesh_shape["uly"], mesh_shape["ring"], mesh_shape["uly"]
    split = SequenceSplit(case["S"], P)
    N = case["B"] * split.padded_len  # tokens (batch x padded sequence)
    h, hkv = case["hq"] * case["D"], case["hkv"] * case["D"]
    out = []
    for phase in ("forward", "backward"):
        if impl == "allgather":
            out.append(("all_gather" if phase == "forward" else "reduce_scatter", phase, 1, 4 * 2 * N * hkv))
        elif impl == "ring":
            out.append(("ppermute", phase, P - 1, 4 * 2 * N * hkv // P))
        elif impl == "ulysses":
            out += [("all_to_all", phase, 2, 4 * N * h // P), ("all_to_all", phase, 2, 4 * N * hkv // P)]
        else:
            out += [("all_to_all", phase, 2, 4 * N * h // P), ("all_to_all", phase, 2, 4 * N * hkv // P),
                    ("ppermute", phase, pr - 1, 4 * 2 * N * hkv // pu // pr)]
    return out


@pytest.mark.parametrize("world,shape", [(2, {"ring": 2, "uly": 1}), (4, {"ring": 2, "uly": 2})])
def test_communication_matches_formulas(pools, world, shape):
    case = dict(FIXED, docs=0, S=16, hkv=4, hq=8, replicate_kv=False)
    per_rank = pools(world).run(run_cp, shape, case, impls_for(shape, case["hq"], case["hkv"]))
    for impl, res in per_rank[0].items():
        records = res[4]
        got: dict = {}
        for op, name, axes, phase, payload, sent in records:
            got.setdefault((op, phase, payload), []).append(sent)
        want = {}
        for op, phase, count, payload in expected_records(impl, shape, case):
            want[(op, phase, payload)] = want.get((op, phase, payload), 0) + count
        assert {k: len(v) for k, v in got.items()} == want, (impl, got, want)
        for (op, phase, payload), sents in got.items():  # bytes sent: the ring formulas of comm.py
            n = world if impl != "hybrid" else shape["uly"] if op == "all_to_all" else shape["ring"]
            expect = payload if op == "ppermute" else payload * (n - 1) / n
            assert all(s == expect for s in sents), (impl, op, sents, expect)


# ---- load balance by the FLOP counter


def run_flops(world: int, S: int, balanced: bool) -> dict:
    import hpfunc
    from hpfunc.models.context_attention import context_attention
    from torch.utils.flop_counter import FlopCounterMode

    mesh = hpfunc.Mesh({"cp": world})
    split = SequenceSplit(S, world, balanced=balanced)
    out = {}
    with mesh:
        q = torch.randn(1, 2, split.local_len, 4)
        k = v = torch.randn(1, 2, split.local_len, 4)
        for impl in ("allgather", "ring"):
            with FlopCounterMode(display=False) as counter:
                context_attention(q, k, v, split, axis="cp", impl=impl)
            out[impl] = counter.get_total_flops()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_split_equalises_attention_flops(pools, world):
    S = 8 * world
    c = S // (2 * world)
    block = 2 * (2 * 1 * 2 * c * c * 4)  # one chunk-pair block: two matmuls of 2 B Hq c c D
    bal = pools(world).run(run_flops, world, S, True)
    unbal = pools(world).run(run_flops, world, S, False)
    for impl in ("allgather", "ring"):
        flops = [r[impl] for r in bal]
        assert max(flops) - min(flops) <= block, (impl, flops)
        skew = [r[impl] for r in unbal]  # the contiguous split: the last rank does the most
        assert max(skew) - min(skew) > block, (impl, skew)


# ---- bad input: clear errors before any communication


def run_bad_inputs() -> list[str]:
    import hpfunc
    from hpfunc.models.context_attention import context_attention

    mesh = hpfunc.Mesh({"cp": 2})
    msgs = []
    with mesh, hpfunc.comm_stats() as stats:
        split = SequenceSplit(13, 2)  # padded to 16: 8 tokens per rank
        q, kv = torch.randn(1, 4, 8, 4), torch.randn(1, 1, 8, 4)
        for call in (
            lambda: context_attention(torch.randn(1, 4, 7, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4),
                                      split, axis="cp", impl="ring"),
            lambda: context_attention(q, kv, kv, SequenceSplit(13, 4), axis="cp", impl="allgather"),
            lambda: context_attention(q, kv, kv, split, axis="cp", impl="ulysses"),
            lambda: context_attention(q, kv, kv, split, axis="cp", impl="ring", doc_ids=torch.zeros(12, dtype=torch.long)),
            lambda: SequenceSplit(13, 2, pad=False),
        ):
            try:
                call()
            except ContextParallelError as e:
                msgs.append(str(e))
            else:
                msgs.append("no error")
        assert not stats.records, stats.records
    return msgs


def test_bad_input_fails_before_communication(pools):
    msgs = pools(2).run0(run_bad_inputs)
    assert "must hold 8 tokens" in msgs[0] and "'cp'" in msgs[0]
    assert "split is for 4 ranks but the mesh has 2" in msgs[1]
    assert "above the 1 key/value heads" in msgs[2] and "replicate_kv=True" in msgs[2]
    assert "expected 13 tokens" in msgs[3]
    assert "pad=True" in msgs[4]


# ---- overlap: the next transfer is posted before the current block's compute


def run_trace(world: int) -> list:
    import hpfunc
    from hpfunc.models.context_attention import ring_attention, trace_ring

    mesh = hpfunc.Mesh({"cp": world})
    split = SequenceSplit(8 * world, world)
    with mesh, trace_ring() as events:
        q = torch.randn(1, 2, split.local_len, 4, requires_grad=True)
        k = torch.randn(1, 1, split.local_len, 4, requires_grad=True)
        ring_attention(q, k, k, split, axis="cp").sum().backward()
    return events


def test_ring_overlap_trace(pools):
    for events in pools(4).run(run_trace, 4):
        at = {(name, step): t for t, name, step in events}
        for step in range(3):
            assert at[("send posted", step)] <= at[("compute start", step)] < at[("compute end", step)]
            assert at[("compute end", step)] <= at[("wait start", step)] <= at[("arrived", step)]
        assert ("send posted", 3) not in at  # the last step sends nothing


# ---- the split alone (one process)


@settings(max_examples=25)
@given(S=st.integers(1, 40), P=st.integers(1, 5), balanced=st.booleans())
def test_split_permutation_round_trip(S, P, balanced):
    split = SequenceSplit(S, P, balanced=balanced)
    x = torch.arange(S).view(1, S)
    parts = split.shard(x, dim=1, fill=-1)
    assert torch.equal(split.unshard(parts, dim=1), x)
    for r, part in enumerate(parts):
        pos = split.positions(r)
        real = pos < S
        assert torch.equal(part[0][real], pos[real])  # the positions are the tokens' global indices
        assert bool((part[0][~real] == -1).all())
        assert torch.equal(split.local(x, r, dim=1, fill=-1), part)
    assert sorted(split.order().tolist()) == list(range(split.padded_len))
    assert split.padded_len % (2 * P) == 0 and split.padded_len - S < 2 * P


# ---- the docs page's example and the bench


def test_guide_example_runs(pools):
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "context_parallel.md")
    with open(path) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/context_parallel.md", "exec"), scope)
    assert pools(2).run(scope["main"]) == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


def test_bench_smoke(tmp_path):
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cp.py")
    spec = importlib.util.spec_from_file_location("cp_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cp.json"
    bench.main(["--worlds", "2", "--seqs", "12", "--iters", "1", "--q-heads", "2", "--kv-heads", "2",
                "--head-dim", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["worlds"]["2"]["12"]
    for impl in ("allgather", "ring", "ring (no overlap)", "ulysses"):
        assert rows[impl]["sent_bytes"] == rows[impl]["formula_bytes"] > 0, impl


def test_block_attention_gradcheck_with_lse_and_empty_rows():
    """The block kernel's own backward (probabilities recomputed from lse, the lse's gradient included)
    against finite differences, through a merge where some rows see no key in a block (documents)."""
    from hpfunc.models.attention_blocks import block_attention, merge_blocks

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    pos, doc = torch.arange(6), torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])

    def f(q, k, v):
        blocks = [block_attention(q, k[:, :, sl], v[:, :, sl], pos, pos[sl], causal=True, seq_len=6, q_doc=doc,
                                  k_doc=doc[:, sl]) for sl in (slice(0, 3), slice(3, 6))]
        return merge_blocks(*blocks[0], *blocks[1])

    assert torch.autograd.gradcheck(f, (q, k, v))
    torch.testing.assert_close(f(q, k, v)[0], dense_attention(q, k, v, doc_ids=doc))
