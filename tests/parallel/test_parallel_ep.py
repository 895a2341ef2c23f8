"""Expert parallelism (``plans.ep``): dropless all-to-all dispatch, global load balancing, parity with one
device through ``hpfunc.parallelize`` (ep alone on 2 and 4 ranks, with fsdp, with tp), the all-to-all
count and bytes against the formula, and the plan's errors before any communication.

Multi-rank model runs cost a few hundred ms per step on 2 shared cores: the fixed cases cover every
skew and composition once, the property tests run a handful of examples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _ep_helpers as H
import _parity_checks as H2
from hpfunc.train.distributed import AbstractMesh
from hpfunc.transforms import plans

pytestmark = pytest.mark.multirank


# ---- the dispatcher alone: any routing, every token's output and gradient as on one device


def run_dispatch(world: int, tokens: list[int], k: int, E: int, pattern: str, seed: int) -> list[str]:
    """Every rank routes its own tokens (``tokens[rank]`` of them, possibly 0) by ``pattern``; the expert
    outputs through ``AllToAll`` and the local experts equal ``grouped_experts`` over all the tokens on
    one device, and so do the gradients of the tokens, the combine weights and the expert weights."""
    import hpfunc
    from hpfunc import lax
    from hpfunc.models.dispatch import AllToAll
    from hpfunc.models.moe import expert_ffn
    from hpfunc.testing import assert_trees_close

    mesh = hpfunc.Mesh({"ep": world})
    g = torch.Generator().manual_seed(seed)
    T = sum(tokens)

    def routing() -> torch.Tensor:
        if pattern == "random":
            return (torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T
                    else torch.zeros(0, k, dtype=torch.long))
        if pattern == "one_expert":  # every token's first pick is expert 0, the rest on rank 0's experts too
            return torch.stack([torch.arange(k) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        local = E // world  # "last_rank": every pick on the last rank's experts (the others receive nothing)
        return (torch.stack([torch.randperm(local, generator=g)[:k] for _ in range(T)]) + E - local
                if T else torch.zeros(0, k, dtype=torch.long))

    prob = H2.experts_problem(g, T, k, E, routing)
    x, idx, w, wg, wu, wd, ref, cot, ref_grads = (prob[n] for n in ("x", "idx", "w", "wg", "wu", "wd", "ref", "cot",
                                                                   "ref_grads"))

    with mesh:
        r = lax.axis_index("ep")
        lo, hi = sum(tokens[:r]), sum(tokens[: r + 1])
        local = E // world
        mine = [t.clone().requires_grad_(True) for t in (x[lo:hi], w[lo:hi], wg[r * local:(r + 1) * local],
                                                          wu[r * local:(r + 1) * local], wd[r * local:(r + 1) * local])]
        d = AllToAll()
        sent = d.dispatch(mine[0], idx[lo:hi], num_experts=E, axis="ep")
        out = d.combine(expert_ffn(sent.tokens, sent.counts, *mine[2:], impl="bmm"), sent, mine[1])
        got = torch.autograd.grad((out * cot[lo:hi]).sum(), mine, allow_unused=True)
    what = f"world {world} tokens {tokens} top{k} E{E} {pattern}"
    assert_trees_close(out, ref[lo:hi], rtol=1e-10, atol=1e-12, what=f"{what} output")
    names = ["x", "weights", "w_gate", "w_up", "w_down"]
    for name, a, b in zip(names[:2], got[:2], ref_grads[:2]):
        assert_trees_close(a, b[lo:hi], rtol=1e-10, atol=1e-12, what=f"{what} grad {name}")
    for name, a, b in zip(names[2:], got[2:], ref_grads[2:]):  # summed over every rank's tokens
        b = b[r * local:(r + 1) * local]
        assert_trees_close(torch.zeros_like(b) if a is None else a, b, rtol=1e-10, atol=1e-12, what=f"{what} grad {name}")
    return [what, str(sent.counts.tolist())]


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_dispatch_is_dropless_for_any_routing(pools, data):
    world = data.draw(st.sampled_from([2, 4]), label="world")
    E = data.draw(st.sampled_from([world, 2 * world, 4 * world]), label="experts")
    k = data.draw(st.integers(1, min(4, E // world)), label="top_k")
    tokens = data.draw(st.lists(st.integers(0, 5), min_size=world, max_size=world), label="tokens per rank")
    pattern = data.draw(st.sampled_from(["random", "one_expert", "last_rank"]), label="pattern")
    pools(world).run(run_dispatch, world, tokens, k, E, pattern, data.draw(st.integers(0, 2**16), label="seed"))


def test_dispatch_with_no_token_anywhere(pools):
    pools(2).run(run_dispatch, 2, [0, 0], 2, 4, "random", 0)


def run_capacity(world: int, T: int, k: int, E: int, factor: float, seed: int) -> tuple[int, int]:
    """With a capacity factor each rank drops, per expert, the pairs past the first ``C = ceil(f T k / E)``
    in token order: the dropped count equals the count by hand, and the output equals one device's
    ``grouped_experts`` with the dropped pairs' weights set to zero."""
    import math

    import hpfunc
    from hpfunc import lax
    from hpfunc.models.dispatch import AllToAll
    from hpfunc.models.moe import expert_ffn, grouped_experts
    from hpfunc.testing import assert_trees_close

    mesh = hpfunc.Mesh({"ep": world})
    with mesh:
        r = lax.axis_index("ep")
    g = torch.Generator().manual_seed(seed * 100 + r)  # each rank its own tokens and routing
    x = torch.randn(T, 4, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[: T // 2, 0] = 0  # expert 0 is hot: it overflows
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    wts = [torch.randn(E, 3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for _ in range(2)]
    wd = torch.randn(E, 4, 3, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    cap = math.ceil(factor * T * k / E)
    seen, mask, by_hand = [0] * E, torch.ones(T, k, dtype=torch.float64), 0
    for t in range(T):  # by hand: the first `cap` pairs of each expert in (token, slot) order are kept
        for j in range(k):
            e = int(idx[t, j])
            seen[e] += 1
            if seen[e] > cap:
                mask[t, j], by_hand = 0.0, by_hand + 1
    local = E // world
    mine = slice(r * local, (r + 1) * local)
    with mesh:
        d = AllToAll(capacity_factor=factor)
        sent = d.dispatch(x, idx, num_experts=E, axis="ep")
        out = d.combine(expert_ffn(sent.tokens, sent.counts, wts[0][mine], wts[1][mine], wd[mine], impl="bmm"), sent, w)
    ref = grouped_experts(x, idx, w * mask, wts[0], wts[1], wd, impl="bmm")
    assert int(sent.dropped) == by_hand, (int(sent.dropped), by_hand)
    assert_trees_close(out, ref, rtol=1e-10, atol=1e-12, what=f"capacity {factor} output")
    return int(sent.dropped), by_hand


@pytest.mark.parametrize("world,factor", [(2, 1.0), (2, 0.5), (4, 1.25)])
def test_capacity_factor_drops_the_count_computed_by_hand(pools, world, factor):
    got = pools(world).run(run_capacity, world, 8, 2, 2 * world, factor, 7)
    assert any(d > 0 for d, _ in got), got  # the hot expert overflowed somewhere


def test_capacity_factor_must_be_positive():
    from hpfunc.models.dispatch import AllToAll

    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            AllToAll(capacity_factor=bad)


def run_padded(world: int, T: int, k: int, E: int, factor: float, seed: int) -> tuple[int, int]:
    """``PaddedAllToAll``: forward and backward make no device-to-host read (no ``aten._local_scalar_dense``,
    the op behind ``.item()`` / ``.tolist()``); pairs past ``B = ceil(f T k / n)`` per destination (in expert
    order) are dropped and counted; the output and the gradients equal one device's ``grouped_experts``
    with the dropped pairs' weights zeroed (all of them kept when nothing overflows)."""
    import math

    from torch.utils._python_dispatch import TorchDispatchMode

    import hpfunc
    from hpfunc import lax
    from hpfunc.models.dispatch import PaddedAllToAll
    from hpfunc.models.moe import expert_ffn, grouped_experts
    from hpfunc.testing import assert_trees_close

    class NoHostRead(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                raise AssertionError(f"a device-to-host read: {func}")
            return func(*args, **(kwargs or {}))

    mesh = hpfunc.Mesh({"ep": world})
    with mesh:
        r = lax.axis_index("ep")
    g = torch.Generator().manual_seed(seed * 100 + r)
    x = torch.randn(T, 8, generator=g, dtype=torch.float32)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[: T // 2, 0] = 0  # rank 0's first expert is hot
    w = torch.rand(T, k, generator=g)
    gw = torch.Generator().manual_seed(seed)
    wg, wu, wd = (torch.randn(E, 4, 8, generator=gw), torch.randn(E, 4, 8, generator=gw), torch.randn(E, 8, 4, generator=gw))
    local, B = E // world, max(1, math.ceil(factor * T * k / world))
    pairs = sorted((int(idx[t, j]), t * k + j) for t in range(T) for j in range(k))  # the stable sort by expert
    mask, seen, by_hand = torch.ones(T, k), [0] * world, 0
    for e, tj in pairs:
        d = e // local
        seen[d] += 1
        if seen[d] > B:
            mask[tj // k, tj % k], by_hand = 0.0, by_hand + 1
    mine = slice(r * local, (r + 1) * local)
    ins = [t.clone().requires_grad_(True) for t in (x, w, wg[mine], wu[mine], wd[mine])]
    cot = torch.randn(T, 8, generator=g)
    with mesh, NoHostRead():
        d = PaddedAllToAll(buffer_factor=factor)
        sent = d.dispatch(ins[0], idx, num_experts=E, axis="ep")
        out = d.combine(expert_ffn(sent.tokens, sent.counts, *ins[2:], impl="grouped_mm"), sent, ins[1])
        grads = torch.autograd.grad((out * cot).sum(), ins[:2])
    ref_in = [t.clone().requires_grad_(True) for t in (x, w)]
    ref = grouped_experts(ref_in[0], idx, ref_in[1] * mask, wg, wu, wd, impl="bmm")
    ref_grads = torch.autograd.grad((ref * cot).sum(), ref_in)
    assert int(sent.overflow) == by_hand, (int(sent.overflow), by_hand)
    assert_trees_close(out, ref, rtol=1e-5, atol=1e-5, what=f"padded {factor} output")
    assert_trees_close(list(grads), list(ref_grads), rtol=1e-5, atol=1e-5, what=f"padded {factor} grads")
    return int(sent.overflow), by_hand


@pytest.mark.parametrize("world,factor", [(2, 4.0), (2, 0.5), (4, 1.0)])
def test_padded_dispatch_never_reads_the_host_and_counts_its_overflow(pools, world, factor):
    got = pools(world).run(run_padded, world, 8, 2, 2 * world, factor, 3)
    if factor >= world:  # a buffer as large as all of a rank's pairs: nothing can overflow
        assert all(o == 0 for o, _ in got), got
    if factor == 0.5:
        assert any(o > 0 for o, _ in got), got


def test_chunks_must_be_a_positive_int_and_dropless():
    from hpfunc.models.dispatch import AllToAll

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be an int >= 1"):
            AllToAll(chunks=bad)
    with pytest.raises(ValueError, match="chunks=2 overlaps the dropless dispatch only; found capacity_factor=1.0"):
        AllToAll(1.0, chunks=2)


def test_buffer_factor_must_be_positive():
    from hpfunc.models.dispatch import PaddedAllToAll

    for bad in (0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="buffer_factor must be a finite number > 0"):
            PaddedAllToAll(buffer_factor=bad)


# ---- overlap: one chunk's all-to-alls in flight while another chunk's experts compute


@pytest.mark.parametrize("world,chunks,top_k", [(2, 2, 2), (2, 3, 4), (4, 2, 1)])
def test_chunked_dispatch_issues_the_next_all_to_all_before_the_compute_and_matches(pools, world, chunks, top_k):
    for r in pools(world).run(H.run_overlap, chunks, top_k):
        ev = r["events"]
        at = {e: i for i, e in enumerate(ev)}
        assert r["times"] == sorted(r["times"])
        for i in range(chunks):
            assert at[("dispatch issued", i)] < at[("dispatch arrived", i)] < at[("compute start", i)]
            if i + 1 < chunks:  # the next chunk's rows travel while this chunk computes
                assert at[("dispatch issued", i + 1)] < at[("compute start", i)], ev
                assert at[("combine issued", i)] < at[("compute start", i + 1)], ev  # and this one's go back
                assert at[("compute end", i)] < at[("compute start", i + 1)]
        # one count exchange; every chunk's dispatch and combine issued without waiting, forward and backward
        assert r["a2a"].count(("all_to_all", "forward")) == 1, r["a2a"]
        for phase in ("forward", "backward"):
            assert r["a2a"].count(("all_to_all_start", phase)) == 2 * chunks, r["a2a"]


# ---- activation memory: what the MoE layer keeps for its backward


@pytest.mark.parametrize("mode", ["ep", "padded", "one"])
def test_moe_layer_keeps_what_its_backward_needs_and_little_more(pools, mode):
    """The permuted rows are kept once (the experts' input), the SwiGLU keeps its inputs only, and no expert
    output is kept for the combine weights' gradient (the weights travel with the rows and scale them
    inside the experts). What remains above the minimum is index tensors and the weights: at most 64 bytes
    per pair and 32 per computed row (a row is H x 4 = 256 bytes here; the older code kept about 2.9 more
    rows per pair)."""
    for r in pools(2).run(H.run_saved_bytes, mode):
        slack = 64 * r["pairs"] + 32 * r["rows"]
        assert r["minimum"] <= r["saved"] <= r["minimum"] + slack, r


# ---- the model config's dispatcher: its drops in the parallelized step's metrics


@pytest.mark.parametrize("mesh,roles,dispatcher,factor", [
    ({"ep": 2}, ["ep"], "alltoall", 0.5), ({"ep": 2}, ["ep"], "padded", 0.5),
    ({"fsdp": 2, "ep": 2}, ["fsdp", "ep"], "alltoall", 1.0), ({"ep": 2, "tp": 2}, ["ep", "tp"], "padded", 0.75)])
def test_dropped_pairs_metric_equals_the_count_by_hand(pools, mesh, roles, dispatcher, factor):
    world = 1
    for s in mesh.values():
        world *= s
    res = pools(world).run(H.run_dropped, mesh, roles, dispatcher, factor)
    layers = len(res[0]["hand"])
    by_hand = [sum(r["hand"][i] for r in res if r["counted"]) for i in range(layers)]
    assert all(r["metric"] == by_hand for r in res), (res, by_hand)  # every rank reports the global count
    assert sum(by_hand) > 0, by_hand  # the hot expert overflowed: the test counts something


def test_dropped_pairs_on_one_device_equal_the_count_by_hand():
    from hpfunc import random
    from hpfunc.models import qwen3

    for knobs, kind, f in [({"moe_capacity_factor": 0.75}, "alltoall", 0.75),
                           ({"moe_dispatcher": "padded", "moe_buffer_factor": 0.6}, "padded", 0.6)]:
        cfg = qwen3.preset("qwen3-moe-tiny", **knobs)
        tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        _, aux = qwen3.apply(qwen3.init(random.key(0), cfg), tokens, cfg, return_aux=True)
        hand = [H.dropped_by_hand(x, torch.zeros(8), 2, 8, dispatcher=kind, factor=f, n=1) for x in aux["router_logits"]]
        assert aux["dropped_pairs"].tolist() == hand and sum(hand) > 0, (kind, aux["dropped_pairs"], hand)
    _, aux = qwen3.apply(qwen3.init(random.key(0), qwen3.preset("qwen3-moe-tiny")), tokens,
                         qwen3.preset("qwen3-moe-tiny"), return_aux=True)
    assert "dropped_pairs" not in aux  # dropless: nothing to count


# ---- the whole model through hpfunc.parallelize


@pytest.mark.parametrize("skew,top_k", [("none", 2), ("one_expert", 1), ("one_expert", 3), ("one_rank", 4),
                                        ("idle_expert", 2)])
def test_ep2_matches_single_device_under_skewed_routing(pools, skew, top_k):
    out = pools(2).run(H.run_ep_parity, {"ep": 2}, ["ep"], top_k=top_k, skew=skew)
    assert out[0]["local_experts"] == 4  # 8 experts split 2 ways
    if skew == "one_rank":  # rank 1's experts get no token: it computes no expert row and still matches
        assert all(load[4:] == [0, 0, 0, 0] for load in out[0]["load"])
    if skew == "idle_expert":
        assert all(load[-1] == 0 for load in out[0]["load"])


@pytest.mark.parametrize("mesh,roles", [({"ep": 4}, ["ep"]), ({"fsdp": 2, "ep": 2}, ["fsdp", "ep"]),
                                        ({"ep": 2, "fsdp": 2}, ["ep", "fsdp"]), ({"ep": 2, "tp": 2}, ["ep", "tp"])])
def test_ep_composes_and_matches_single_device(pools, mesh, roles):
    out = pools(4).run(H.run_ep_parity, mesh, roles, top_k=2, skew="none", seed=3)
    assert out[0]["local_experts"] == 8 // mesh["ep"]


@settings(max_examples=4, deadline=None)
@given(case=st.sampled_from([({"ep": 2}, ["ep"]), ({"ep": 4}, ["ep"]), ({"fsdp": 2, "ep": 2}, ["fsdp", "ep"]),
                             ({"ep": 2, "tp": 2}, ["ep", "tp"])]),
       experts=st.sampled_from([8, 16]), top_k=st.integers(1, 4), skew=st.sampled_from(H.SKEWS),
       seed=st.integers(0, 2**16))
def test_random_ep_plans_routings_seeds(pools, case, experts, top_k, skew, seed):
    mesh, roles = case
    world = 1
    for s in mesh.values():
        world *= s
    out = pools(world).run(H.run_ep_parity, mesh, roles, top_k=top_k, experts=experts, skew=skew, seed=seed, steps=1)
    load, per = out[0]["load"], experts // mesh["ep"]
    if skew == "idle_expert":  # an expert with no token
        assert all(row[-1] == 0 for row in load), load
    if skew == "one_rank" and top_k <= per:  # every rank but the first receives no token
        assert all(sum(row[per:]) == 0 for row in load), load


# ---- the counter: four all-to-alls per MoE layer per step, and the count exchange


def run_ep_comm(world: int, top_k: int = 2) -> dict:
    """One step on {ep: world} under the comm counter, and this rank's routing on one device (the same
    params, its shard of the batch): the pairs whose expert lives on another rank, per layer."""
    import hpfunc
    from hpfunc.models import qwen3

    out = H.run_ep_parity({"ep": world}, ["ep"], top_k=top_k, steps=1, count_comm=True)
    cfg = qwen3.preset("qwen3-moe-tiny", num_experts=8, num_experts_per_tok=top_k, router_aux_loss_coef=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))  # the helper's batch
    r = torch.distributed.get_rank()
    mine = tokens.chunk(world)[r]
    _, aux = qwen3.apply(qwen3.init(hpfunc.random.key(0), cfg), mine, cfg, return_aux=True)
    per = 8 // world
    others = [e for e in range(8) if e // per != r]
    return {"records": out["records"], "pairs": mine.numel() * top_k, "hidden": cfg.hidden_size,
            "off_rank_rows": [int(aux["expert_load"][l, others].sum()) for l in range(aux["expert_load"].shape[0])]}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_all_to_all_count_and_bytes_follow_the_formula(pools, world):
    res = pools(world).run(run_ep_comm, world)
    h = res[0]["hidden"]
    layers = len(res[0]["off_rank_rows"])
    dispatched, combined = [0] * layers, [0] * layers
    for r in res:  # records: (op, name, axes, payload bytes, phase, sent bytes)
        a2a = [rec for rec in r["records"] if rec[0] == "all_to_all"]
        counts = [rec for rec in a2a if rec[3] == 8 * 8]  # the count exchange: E int64 per rank
        rows = [rec for rec in a2a if rec[3] != 8 * 8]
        assert len(counts) == layers and all(rec[4] == "forward" for rec in counts), a2a  # one per MoE layer
        fwd = [rec for rec in rows if rec[4] == "forward"]
        bwd = [rec for rec in rows if rec[4] == "backward"]
        assert len(fwd) == 2 * layers and len(bwd) == 2 * layers, a2a  # 4 all-to-alls per MoE layer per step
        # the dispatch moves every pair of this rank's tokens with its combine weight (tokens x top-k x
        # (hidden + 1) x 4 bytes), and exactly the pairs whose expert lives on another rank leave it
        assert [rec[3] for rec in fwd[0::2]] == [r["pairs"] * (h + 1) * 4] * layers
        assert [rec[5] for rec in fwd[0::2]] == [n * (h + 1) * 4 for n in r["off_rank_rows"]]
        for layer in range(layers):
            dispatched[layer] += fwd[2 * layer][3]
            combined[layer] += fwd[2 * layer + 1][3]
        # the backward runs the same two exchanges reversed: the combine's transpose sends back the rows the
        # combine brought (every pair, hidden wide), the dispatch's the rows it brought (and the weights)
        received = [fwd[2 * layer + 1][3] // (h * 4) for layer in range(layers)]
        assert sorted(rec[3] for rec in bwd) == sorted([r["pairs"] * h * 4] * layers + [m * (h + 1) * 4 for m in received])
    # dropless: every dispatched pair comes back (its weighted output, hidden wide), over all ranks
    # T x k x h x 4 bytes per layer
    assert [d // (h + 1) for d in dispatched] == [c // h for c in combined] == [world * res[0]["pairs"] * 4] * layers


# ---- errors before any communication


def _moe_shapes(E: int = 8):
    from hpfunc.models import qwen3

    cfg = qwen3.preset("qwen3-moe-tiny", num_experts=E)
    return cfg, qwen3.param_shapes(cfg)  # Plan.resolve takes shapes


def test_experts_that_do_not_split_over_ep_are_a_plan_error():
    from hpfunc.models.qwen3 import parallel_plan

    cfg, shapes = _moe_shapes(6)
    with pytest.raises(plans.PlanError, match=r"layers\.0\.moe\.experts\.w_\w+.*6 experts.*multiple of the 'ep' axis size 4"):
        plans.ep("ep", parallel_plan.ep_experts(cfg)).resolve(shapes, AbstractMesh({"ep": 4}))


def test_an_ep_axis_missing_from_the_mesh_is_a_plan_error():
    from hpfunc.models.qwen3 import parallel_plan

    cfg, shapes = _moe_shapes()
    with pytest.raises(plans.PlanError, match=r"ep\('ep'\) names mesh axis 'ep', which the mesh does not have"):
        (plans.fsdp("fsdp") + plans.ep("ep", parallel_plan.ep_experts(cfg))).resolve(shapes, AbstractMesh({"fsdp": 2}))


def test_ep_needs_the_experts_and_they_must_exist():
    cfg, shapes = _moe_shapes()
    with pytest.raises(plans.PlanError, match="experts must name the expert stacks"):
        plans.ep("ep")
    with pytest.raises(plans.PlanError, match="matches no parameter path"):
        plans.ep("ep", ["layers.*.moe.expert.w_up"]).resolve(shapes, AbstractMesh({"ep": 2}))
    from hpfunc.models.qwen3 import parallel_plan

    with pytest.raises(plans.PlanError, match="no MoE layer"):
        parallel_plan.ep_experts(parallel_plan._model.preset("qwen3-dense-tiny"))


def test_ep_layout_experts_split_everything_else_sharded_like_fsdp():
    from hpfunc.models.qwen3 import parallel_plan

    cfg, shapes = _moe_shapes()
    res = (plans.fsdp("fsdp") + plans.ep("ep", parallel_plan.ep_experts(cfg))).resolve(
        shapes, AbstractMesh({"fsdp": 2, "ep": 2}))
    w = res["layers.0.moe.experts.w_gate"].spec  # [E, I, H]: experts over ep (in use too), FSDP on the next dim
    assert (w.storage, w.compute, w.opt) == (plans.P("ep", "fsdp"), plans.P("ep"), plans.P("ep", "fsdp"))
    a = res["layers.0.attn.wq"].spec  # attention: FSDP-sharded over both axes, gathered for use
    assert set(a.storage.axes) == {"fsdp", "ep"} and a.compute == plans.P()
    r = res["layers.0.moe.router"].spec  # the router scores every expert on every rank
    assert r.compute == plans.P()
