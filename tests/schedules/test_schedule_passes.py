"""Passes: communication, backward split/merge, FSDP, swap."""

from __future__ import annotations

from collections import Counter

import pytest

from hpfunc.schedules import (
    GENERATORS,
    Action,
    ActionKind,
    gpipe,
    insert_comms,
    insert_fsdp,
    insert_swaps,
    interleaved_1f1b,
    merge_backward,
    one_f_one_b,
    simulate,
    split_backward,
    validate,
    zb_h1,
    zbv,
)

K = ActionKind


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p", [2, 4])
def test_insert_comms_pairs_and_peers(name: str, p: int) -> None:
    s = GENERATORS[name](p, 2 * p)
    c = validate(insert_comms(s))
    sends = Counter()
    recvs = Counter()
    for rank, row in c.actions.items():
        for a in row:
            if a.is_send:
                sends[(a.kind, a.stage, a.microbatch, rank, a.peer)] += 1
            elif a.is_recv:
                recvs[(a.kind, a.stage, a.microbatch, a.peer, rank)] += 1
    # every SEND_F(s) meets a RECV_F(s+1) going the other way, and so on; nothing unmatched
    flipped = Counter({((K.RECV_F if k is K.SEND_F else K.RECV_B), st + (1 if k is K.SEND_F else -1), i, src, dst): n
                       for (k, st, i, src, dst), n in sends.items()})
    assert flipped == recvs
    # compute order untouched
    for rank in s.ranks:
        assert [a for a in c[rank] if a.is_compute] == list(s[rank])
    # the V turn (stage p-1 -> p on the same rank) needs no transfer
    if name in ("zbv", "dualpipev"):
        assert not any(a.is_comm and a.stage in (p - 1, p) and a.peer == p - 1 for a in c[p - 1])


def test_insert_comms_example() -> None:
    c = insert_comms(one_f_one_b(2, 1))
    assert [repr(a) for a in c[0]] == ["Action('0F0')", "Action('0SEND_F0@r1')", "Action('0RECV_B0@r1')",
                                       "Action('0BW0')"]
    with pytest.raises(ValueError, match="already has send/recv"):
        insert_comms(c)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_split_then_merge(name: str) -> None:
    s = GENERATORS[name](3, 6)
    split = validate(split_backward(s))
    assert not any(a.kind is K.BW for row in split.actions.values() for a in row)
    merged = validate(merge_backward(split))
    assert not any(a.kind in (K.B, K.W) for row in merged.actions.values() for a in row)
    if all(a.kind is not K.B for row in s.actions.values() for a in row):
        assert merged == s  # BW-only schedules come back exactly
    # with zero-cost W the split schedule is as fast as the fused one
    assert simulate(split, {"W": 0}).makespan <= simulate(s, {"W": 0}).makespan


def test_split_keeps_send_next_to_backward() -> None:
    c = split_backward(insert_comms(one_f_one_b(2, 1)))
    assert [str(a) for a in c[1]] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1W0"]
    validate(c)


def test_merge_backward_costs_zero_bubble_its_gain() -> None:
    s = zb_h1(4, 8)
    assert simulate(merge_backward(s)).makespan > simulate(s).makespan


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_fsdp(name: str) -> None:
    s = insert_comms(GENERATORS[name](3, 6))
    f = validate(insert_fsdp(s))
    for rank, row in f.actions.items():
        kinds = Counter((a.kind, a.stage) for a in row if a.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD))
        for stage in f.stages_of(rank):
            assert kinds[(K.UNSHARD, stage)] == kinds[(K.RESHARD, stage)] == kinds[(K.REDUCE_GRAD, stage)] == 1
    with pytest.raises(ValueError, match="already has FSDP"):
        insert_fsdp(f)


def test_fsdp_limited_unsharded_stages() -> None:
    s = interleaved_1f1b(2, 4, 3)  # three stages per rank
    f = validate(insert_fsdp(s, max_unsharded=1))
    for row in f.actions.values():
        live = set()
        for a in row:
            if a.kind is K.UNSHARD:
                live.add(a.stage)
            elif a.kind is K.RESHARD:
                live.discard(a.stage)
            assert len(live) <= 1
    assert sum(a.kind is K.UNSHARD for a in f[0]) > 3  # re-gathered when switching chunks
    with pytest.raises(ValueError, match="max_unsharded must be >= 1"):
        insert_fsdp(s, max_unsharded=0)


def test_fsdp_example() -> None:
    assert [str(a) for a in insert_fsdp(split_backward(gpipe(1, 2)))[0]] == [
        "0UNSHARD", "0F0", "0F1", "0B0", "0W0", "0B1", "0W1", "0REDUCE_GRAD", "0RESHARD"]


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("keep", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_swaps_bound_resident_activations(name: str, keep: int, prefetch: int) -> None:
    s = insert_comms(GENERATORS[name](3, 6))
    w = validate(insert_swaps(s, max_resident=keep, prefetch=prefetch))
    r0, r = simulate(s), simulate(w)
    assert r.peak_inflight == r0.peak_inflight  # swapping does not change what is in flight
    for rank in w.ranks:
        # kept + the one just computed (until its SWAP_OUT) + those prefetched ahead of their backward
        assert r.peak_resident[rank] <= keep + 1 + prefetch
        assert r.peak_resident[rank] <= r0.peak_resident[rank]
    if prefetch == 0:
        assert max(r.peak_resident.values()) <= keep + 1


def test_swaps_example_and_errors() -> None:
    w = insert_swaps(gpipe(1, 3), max_resident=1, prefetch=0)
    assert [str(a) for a in w[0]] == ["0F0", "0F1", "0SWAP_OUT1", "0F2", "0SWAP_OUT2", "0BW0", "0SWAP_IN1",
                                      "0BW1", "0SWAP_IN2", "0BW2"]
    with pytest.raises(ValueError, match="already has swap"):
        insert_swaps(w, max_resident=1)
    with pytest.raises(ValueError, match="max_resident must be >= 1"):
        insert_swaps(gpipe(1, 3), max_resident=0)
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        insert_swaps(gpipe(1, 3), max_resident=1, prefetch=-1)


def test_passes_do_not_mutate_inputs() -> None:
    s = zbv(2, 4)
    before = {r: tuple(row) for r, row in s.actions.items()}
    insert_fsdp(insert_swaps(insert_comms(split_backward(merge_backward(s))), max_resident=1))
    assert before == dict(s.actions)
    assert isinstance(s[0][0], Action)


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("prefetch", [1, 2])
def test_fsdp_prefetch(name: str, prefetch: int) -> None:
    s = insert_comms(GENERATORS[name](3, 6))
    for limit in (None, 1):
        plain = insert_fsdp(s, max_unsharded=limit)
        early = validate(insert_fsdp(s, max_unsharded=limit, prefetch=prefetch))
        assert Counter(early[0]) == Counter(plain[0])  # same actions, UNSHARDs earlier
        for rank in s.ranks:
            def first_unshard_step(row):
                return [i for i, a in enumerate(row) if a.kind is K.UNSHARD]
            assert all(e <= p for e, p in zip(first_unshard_step(early[rank]), first_unshard_step(plain[rank])))


def test_fsdp_prefetch_example() -> None:
    s = insert_fsdp(interleaved_1f1b(1, 1, 2), prefetch=1)
    assert [str(a) for a in s[0]] == ["0UNSHARD", "1UNSHARD", "0F0", "1F0", "1BW0", "1REDUCE_GRAD", "1RESHARD",
                                      "0BW0", "0REDUCE_GRAD", "0RESHARD"]
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        insert_fsdp(s.replace(actions={0: []}), prefetch=-1)
