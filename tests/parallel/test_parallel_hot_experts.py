"""Hot-expert replicas (``hpfunc.models.hot_experts``): the placement rule, the replicated dispatcher
against one device (any skew, ep size and number of copies), the received rows with and without copies,
and Qwen3-MoE training through ``hpfunc.parallelize`` with the placement re-decided from the step's load.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _hot_helpers as HH
from hpfunc.layout import PlanError
from hpfunc.models import hot_experts as hot

# ---- the placement rule (pure, no ranks)


@settings(max_examples=40, deadline=None)
@given(ranks=st.sampled_from([1, 2, 4, 8]), per=st.integers(1, 4), slots=st.integers(0, 3),
       load=st.data())
def test_placement_is_valid_deterministic_and_never_worse(ranks, per, slots, load):
    E = ranks * per
    values = load.draw(st.lists(st.integers(0, 1000), min_size=E, max_size=E), label="load")
    p = hot.place_hot_experts(values, ranks=ranks, slots=slots)
    assert p == hot.place_hot_experts(torch.tensor(values), ranks=ranks, slots=slots)  # a function of the load
    assert all(len(c) <= slots for c in p.copies)
    for r, held in enumerate(p.copies):
        assert all(p.owner(e) != r and values[e] > 0 for e in held)
    before = hot.expected_rank_rows(values, hot.no_replicas(E, ranks))
    after = hot.expected_rank_rows(values, p)
    assert max(after) <= max(before)
    assert sum(after) == pytest.approx(sum(before))  # every pair computed once: copies share, never add
    if p.num_copies:
        assert max(after) < max(before) or sorted(after, reverse=True) < sorted(before, reverse=True)


def test_uniform_load_gets_no_copies_and_a_hot_expert_gets_them():
    assert hot.place_hot_experts([5] * 8, ranks=4, slots=2).num_copies == 0
    p = hot.place_hot_experts([100, 1, 1, 1, 1, 1, 1, 1], ranks=4, slots=1)
    assert p.holders(0) == (0, 1, 2, 3)  # the hot expert on every rank
    rows = hot.expected_rank_rows([100, 1, 1, 1, 1, 1, 1, 1], p)
    assert max(rows) / (sum(rows) / 4) < 1.05  # from 101 / 27 = 3.7x the mean


def test_replica_bytes_are_the_copies_weights_sent_by_their_owners():
    p = hot.Placement(8, ((2,), (0,), (0, 1), ()))
    assert hot.replica_bytes(p, 10) == ([30, 10, 0, 0], [10, 10, 20, 0])


def test_bad_placements_are_plan_errors_naming_the_rank():
    with pytest.raises(PlanError, match="rank 1 holds a copy of expert 9, outside"):
        hot.Placement(8, ((), (9,)))
    with pytest.raises(PlanError, match="must be distinct and in increasing order"):
        hot.Placement(8, ((5, 4), ()))
    with pytest.raises(PlanError, match="must split evenly over the 3 ranks"):
        hot.Placement(8, ((), (), ()))
    with pytest.raises(PlanError, match=r"must split evenly over ranks=3"):
        hot.place_hot_experts([1] * 8, ranks=3, slots=1)
    with pytest.raises(ValueError, match="slots must be >= 0"):
        hot.place_hot_experts([1] * 8, ranks=2, slots=-1)


def test_a_placement_for_another_axis_size_is_refused_before_any_communication():
    import torch.distributed as dist

    import hpfunc

    created = not dist.is_initialized()
    try:
        with hpfunc.Mesh({"ep": 1}):  # one rank: the check runs before the dispatcher would talk
            d = hot.ReplicatedAllToAll(hot.no_replicas(8, 2))
            with pytest.raises(PlanError, match=r"placement is for 8 experts over 2 ranks.*axis 'ep' of size 1"):
                d.dispatch(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), num_experts=8, axis="ep")
    finally:  # the 1-rank process group of this process: later tests start their own
        if created and dist.is_initialized():
            dist.destroy_process_group()


# ---- the dispatcher on real ranks, against one device




def _check_rows(res: list[dict], world: int) -> None:
    for r in res:  # each source's share of a copied expert is within one row of 1 / copies
        assert abs(r["rows"] - r["expected"]) <= world * len(r["replicated"]), r
    assert sum(r["rows"] for r in res) == sum(r["plain_rows"] for r in res)  # dropless either way


@pytest.mark.multirank
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_replicated_dispatch_matches_one_device_for_any_skew_ep_and_copies(pools, data):
    world = data.draw(st.sampled_from([2, 4]), label="ep size")
    E = data.draw(st.sampled_from([world, 2 * world, 4 * world]), label="experts")
    k = data.draw(st.integers(1, min(3, E)), label="top_k")
    slots = data.draw(st.integers(0, 2), label="copies per rank")
    skew = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]), label="skew")
    tokens = data.draw(st.lists(st.integers(0, 6), min_size=world, max_size=world), label="tokens per rank")
    res = pools(world).run(HH.run_replicated_dispatch, world, tokens, k, E, skew, slots,
                           data.draw(st.integers(0, 2**16), label="seed"))
    _check_rows(res, world)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_copies_lower_the_most_loaded_rank(pools, world):
    res = pools(world).run(HH.run_replicated_dispatch, world, [24] * world, 2, 2 * world, 0.9, 1, 5)
    _check_rows(res, world)
    plain, rows = [r["plain_rows"] for r in res], [r["rows"] for r in res]
    mean = sum(rows) / world
    assert max(plain) / mean > 1.3 and max(rows) / mean < 0.8 * max(plain) / mean, (plain, rows)


@pytest.mark.multirank
def test_breaking_the_gradient_sum_over_copies_is_caught(pools):
    with pytest.raises(Exception, match="grad w_"):
        pools(2).run(HH.run_replicated_dispatch, 2, [8, 8], 2, 4, 1.0, 1, 3, True)


# ---- Qwen3-MoE through hpfunc.parallelize, placement re-decided from the step's load


@pytest.mark.multirank
@pytest.mark.parametrize("mesh,roles,skew,slots", [
    ({"ep": 2}, ["ep"], "one_expert", 1),
    ({"ep": 2}, ["ep"], "one_rank", 2),
])
def test_replicas_train_as_one_device_on_2_ranks(pools, mesh, roles, skew, slots):
    out = pools(2).run(HH.run_replica_training, mesh, roles, skew=skew, slots=slots)
    history = out[0]["placements"]
    assert all(p == ((), ()) for p in history[0])  # the first step has no load to decide from
    assert all(sum(map(len, p)) > 0 for p in history[1])  # then the skew gets copies


@pytest.mark.multirank
@pytest.mark.parametrize("mesh,roles", [({"ep": 4}, ["ep"]), ({"ep": 2, "tp": 2}, ["ep", "tp"]),
                                        ({"fsdp": 2, "ep": 2}, ["fsdp", "ep"])])
def test_replicas_compose_and_train_as_one_device_on_4_ranks(pools, mesh, roles):
    out = pools(4).run(HH.run_replica_training, mesh, roles, skew="one_expert", slots=1, every=2, steps=3, seed=2)
    history = out[0]["placements"]
    assert history[0] == history[1] and history[1] != history[2]  # re-decided after step 2 only


def test_qwen3_takes_one_dispatcher_per_moe_layer():
    import hpfunc
    from hpfunc.models import qwen3

    cfg = qwen3.preset("qwen3-moe-tiny")  # two MoE layers
    params = qwen3.init(hpfunc.random.key(0), cfg)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"moe_dispatchers has 1 entries, expected one per MoE layer \(2\)"):
        qwen3.apply(params, tokens, cfg, moe_dispatchers=[hot.ReplicatedAllToAll(hot.no_replicas(8, 1))])
    d = [hot.ReplicatedAllToAll(hot.no_replicas(8, 1))] * 2  # no ep axis: the dispatcher runs over every expert here
    torch.testing.assert_close(qwen3.apply(params, tokens, cfg, moe_dispatchers=d), qwen3.apply(params, tokens, cfg),
                               rtol=1e-6, atol=1e-6)
