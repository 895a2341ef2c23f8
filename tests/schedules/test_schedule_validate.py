"""validate: hand-broken schedules, every rule, and a mutation property test."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpfunc.schedules import (
    GENERATORS,
    Action,
    Schedule,
    ScheduleError,
    insert_comms,
    insert_fsdp,
    insert_swaps,
    interleaved_1f1b,
    one_f_one_b,
    split_backward,
    validate,
    zb_h1,
)

A = Action.parse


def sched(rows: dict[int, list[str]], placement: tuple[int, ...], m: int) -> Schedule:
    return Schedule.from_strings(rows, placement, m)


def raises_at(s: Schedule, rank: int, step: int, action: str, match: str | None = None) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(s)
    err = info.value
    assert (err.rank, err.step, str(err.action)) == (rank, step, action), str(err)
    assert f"rank {rank}" in str(err) and f"step {step}" in str(err) and action in str(err)
    return err


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_generator_and_lowering_validates(name: str, p: int) -> None:
    m = 2 * p
    s = GENERATORS[name](p, m)
    for lowered in (s, insert_comms(s), split_backward(s), insert_comms(split_backward(s)),
                    insert_fsdp(insert_comms(s)), insert_fsdp(s, max_unsharded=1),
                    insert_swaps(insert_comms(s), max_resident=1)):
        assert validate(lowered) is lowered


# -- the three hand-broken schedules of the brief -----------------------------------------------


def test_missing_w() -> None:
    s = zb_h1(2, 2)
    row = list(s[0])
    step_b = row.index(A("0B1"))
    row.remove(A("0W1"))
    err = raises_at(s.replace(actions={0: row, 1: s[1]}), 0, step_b, "0W1", match="never runs its weight gradient")
    assert "B is at step" in str(err)


def test_recv_without_send() -> None:
    s = insert_comms(one_f_one_b(2, 2))
    row0 = [a for a in s[0] if str(a) != "0SEND_F0"]
    raises_at(s.replace(actions={0: row0, 1: s[1]}), 1, 0, "1RECV_F0", match="recv without send")


def test_cyclic_wait_with_comms() -> None:
    s = sched(
        {
            0: ["0F0", "0RECV_B0", "0SEND_F0", "0F1", "0SEND_F1", "0BW0", "0RECV_B1", "0BW1"],
            1: ["1RECV_F0", "1F0", "1BW0", "1SEND_B0", "1RECV_F1", "1F1", "1BW1", "1SEND_B1"],
        },
        (0, 1),
        2,
    )
    err = raises_at(s, 0, 1, "0RECV_B0", match="deadlock")
    assert "rank 1 step 0 (1RECV_F0) waits for 0SEND_F0 at rank 0 step 2" in str(err)


def test_cyclic_wait_compute_only() -> None:
    s = sched({0: ["0F0", "0BW0", "0F1", "0BW1"], 1: ["1F1", "1BW1", "1F0", "1BW0"]}, (0, 1), 2)
    raises_at(s, 0, 1, "0BW0", match="deadlock")


# -- one test per remaining rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,placement,m,where,match",
    [
        ({0: ["0F0", "0F0", "0BW0"]}, (0,), 1, (0, 1, "0F0"), "duplicate"),
        ({0: ["0F0", "0BW0"], 1: ["0F1"]}, (0, 1), 1, (1, 0, "0F1"), "placed on rank 0"),
        ({0: ["0F0", "0BW0", "0F1"]}, (0,), 1, (0, 2, "0F1"), "microbatch 1 out of range"),
        ({0: ["0F0", "2F0"]}, (0,), 1, (0, 1, "2F0"), "stage 2 out of range"),
        ({0: ["0F0", "0W0", "0B0"]}, (0,), 1, (0, 1, "0W0"), "comes later"),
        ({0: ["0B0", "0F0", "0W0"]}, (0,), 1, (0, 0, "0B0"), "comes later"),
        ({0: ["0F0", "0BW0", "0W0"]}, (0,), 1, (0, 2, "0W0"), "already has a weight gradient"),
        ({0: ["0F0", "0B0", "0BW0"]}, (0,), 1, (0, 2, "0BW0"), "already has a backward"),
        ({0: ["0F0"]}, (0,), 1, (0, 1, "0BW0"), "never runs its backward"),
        ({0: ["0BW0"]}, (0,), 1, (0, 0, "0BW0"), "missing"),
        ({0: []}, (0,), 1, (0, 0, "0F0"), "never runs its forward"),
        # communication
        ({0: ["0F0", "0SEND_F0@r1", "0RECV_B0", "0BW0"], 1: ["1RECV_F0", "1F0", "1BW0"]}, (0, 1), 1,
         (0, 2, "0RECV_B0"), "recv without send"),
        ({0: ["0F0", "0SEND_F0", "0BW0"], 1: ["1F0", "1BW0"]}, (0, 1), 1, (0, 1, "0SEND_F0"), "no matching 1RECV_F0"),
        ({0: ["0SEND_F0", "0F0"], 1: []}, (0, 1), 1, (0, 0, "0SEND_F0"), "comes later|missing"),
        ({0: ["0F0", "0SEND_F0@r2"]}, (0, 1, 2), 1, (0, 1, "0SEND_F0"), "peer is rank 2"),
        ({0: ["0F0", "0SEND_F0", "1F0"]}, (0, 0), 1, (0, 1, "0SEND_F0"), "same rank"),
        ({0: ["0RECV_F0", "0F0"]}, (0,), 1, (0, 0, "0RECV_F0"), "no neighbour"),
        ({0: ["0F0", "0SEND_F0", "0BW0"], 1: ["1F0", "1BW0"]}, (0, 1), 1, (0, 1, "0SEND_F0"), "no matching"),
        # FSDP
        ({0: ["0UNSHARD", "0F0", "0RESHARD", "0BW0"]}, (0,), 1, (0, 3, "0BW0"), "sharded here"),
        ({0: ["0UNSHARD", "0UNSHARD", "0F0", "0BW0"]}, (0,), 1, (0, 1, "0UNSHARD"), "already unsharded"),
        ({0: ["0RESHARD", "0F0", "0BW0"]}, (0,), 1, (0, 0, "0RESHARD"), "not unsharded"),
        ({0: ["0F0", "0B0", "0REDUCE_GRAD", "0W0"]}, (0,), 1, (0, 2, "0REDUCE_GRAD"), "0 of 1 weight gradients"),
        ({0: ["0F0", "0F1", "0BW0", "0REDUCE_GRAD", "0BW1"]}, (0,), 2, (0, 3, "0REDUCE_GRAD"), "1 of 2"),
        ({0: ["0UNSHARD", "0F0", "0BW0", "0REDUCE_GRAD"], 1: ["1UNSHARD", "1F0", "1BW0"]}, (0, 1), 1,
         (1, 3, "1REDUCE_GRAD"), "never reduces its gradients"),
        ({0: ["0UNSHARD", "0F0", "0BW0", "0REDUCE_GRAD", "0REDUCE_GRAD"]}, (0,), 1, (0, 4, "0REDUCE_GRAD"),
         "duplicate"),
        # swap
        ({0: ["0F0", "0SWAP_OUT0", "0BW0"]}, (0,), 1, (0, 2, "0BW0"), "swapped out"),
        ({0: ["0F0", "0SWAP_IN0", "0BW0"]}, (0,), 1, (0, 1, "0SWAP_IN0"), "not swapped out"),
        ({0: ["0SWAP_OUT0", "0F0", "0BW0"]}, (0,), 1, (0, 0, "0SWAP_OUT0"), "comes later"),
        ({0: ["0F0", "0BW0", "0SWAP_OUT0"]}, (0,), 1, (0, 2, "0SWAP_OUT0"), "already ran"),
    ],
)
def test_rules(rows, placement, m, where, match) -> None:
    raises_at(sched(rows, placement, m), *where, match=match)


def test_mixed_compute_only_and_comms_needs_recv() -> None:
    # Once a schedule has communication, every cross-rank input must arrive through a RECV.
    s = sched({0: ["0F0", "0RECV_B0", "0BW0"], 1: ["1F0", "1BW0", "1SEND_B0"]}, (0, 1), 1)
    raises_at(s, 1, 0, "1F0", match="received activations")


def test_validate_rejects_non_schedules() -> None:
    with pytest.raises(TypeError, match="expects a Schedule"):
        validate({0: []})  # type: ignore[arg-type]


# -- property: mutations ---------------------------------------------------------------------------


def _prereqs(s: Schedule, a: Action, comms: bool) -> list[tuple[str, int, int | None]]:
    """What an action needs, by name: an independent, deliberately naive restatement."""
    S, at = s.num_stages, s.stage_to_rank
    k, st_, i = a.kind.value, a.stage, a.microbatch
    here = at[st_]
    out: list[tuple[str, int, int | None]] = []
    if k == "F" and st_ > 0:
        out.append(("RECV_F", st_, i) if comms and at[st_ - 1] != here else ("F", st_ - 1, i))
    if k in ("B", "BW"):
        out.append(("F", st_, i))
        if st_ < S - 1:
            out.append(("RECV_B", st_, i) if comms and at[st_ + 1] != here else ("BWANY", st_ + 1, i))
    if k == "W":
        out.append(("B", st_, i))
    if k == "SEND_F":
        out.append(("F", st_, i))
    if k == "SEND_B":
        out.append(("BWANY", st_, i))
    if k == "RECV_F":
        out.append(("SEND_F", st_ - 1, i))
    if k == "RECV_B":
        out.append(("SEND_B", st_ + 1, i))
    return out


def naive_ok(original: Schedule, mutated: Schedule) -> bool:
    """Valid iff the same multiset of actions per rank (the original is valid) and every rank can
    run to the end when an action fires only after everything it needs has fired."""
    for r in original.ranks:
        if Counter(original[r]) != Counter(mutated[r]):
            return False
    comms = original.has_comms
    fired: set[tuple[str, int, int | None]] = set()
    heads = dict.fromkeys(mutated.ranks, 0)
    progress = True
    while progress:
        progress = False
        for r in mutated.ranks:
            row = mutated[r]
            while heads[r] < len(row):
                a = row[heads[r]]
                need = _prereqs(mutated, a, comms)
                if not all(
                    (("B", st_, i) in fired or ("BW", st_, i) in fired) if k == "BWANY" else (k, st_, i) in fired
                    for k, st_, i in need
                ):
                    break
                fired.add((a.kind.value, a.stage, a.microbatch))
                heads[r] += 1
                progress = True
    return all(heads[r] == len(mutated[r]) for r in mutated.ranks)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(sorted(GENERATORS)))
    p = draw(st.integers(2, 4))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, 2 * p + 1))
    if name == "interleaved_1f1b":
        s = interleaved_1f1b(p, p * draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    else:
        s = GENERATORS[name](p, m)
    if draw(st.booleans()):
        s = split_backward(s)
    if draw(st.booleans()):
        s = insert_comms(s)
    return s


@st.composite
def mutations(draw: st.DrawFn) -> tuple[Schedule, Schedule, str]:
    s = draw(schedules())
    rank = draw(st.sampled_from([r for r in s.ranks if s[r]]))
    row = list(s[rank])
    kind = draw(st.sampled_from(["drop", "duplicate", "swap", "swap_far"]))
    i = draw(st.integers(0, len(row) - 1))
    if kind == "drop":
        del row[i]
    elif kind == "duplicate":
        row.insert(draw(st.integers(0, len(row))), row[i])
    elif kind == "swap" and i + 1 < len(row):
        row[i], row[i + 1] = row[i + 1], row[i]
    else:
        j = draw(st.integers(0, len(row) - 1))
        row[i], row[j] = row[j], row[i]
    mutated = s.replace(actions={**s.actions, rank: row})
    return s, mutated, kind


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_validate_agrees_with_naive_checker_on_mutations(case: tuple[Schedule, Schedule, str]) -> None:
    original, mutated, kind = case
    expected = naive_ok(original, mutated)
    try:
        validate(mutated)
        accepted = True
    except ScheduleError as err:
        accepted = False
        assert err.rank is not None and err.step is not None and err.action is not None, str(err)
    assert accepted == expected, (kind, str(mutated))
    if kind in ("drop", "duplicate"):
        assert not accepted  # always breaks exactly-once (or a send/recv pair)


def test_blocking_sends_find_the_classic_1f1b_deadlock() -> None:
    # With isend semantics the lowering is deadlock-free; with blocking sends the steady state of
    # 1F1B deadlocks (rank 0 sends F while rank 1 sends B), which is why executors post sends
    # asynchronously (or pair them with the next receive, as Megatron does).
    s = insert_comms(one_f_one_b(2, 4))
    validate(s)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(s, blocking_sends=True)
    assert "SEND" in str(info.value)
    # GPipe has no crossing sends: fine either way.
    g = insert_comms(GENERATORS["gpipe"](3, 4))
    assert validate(g, blocking_sends=True) is g


def test_blocking_sends_accepts_a_hand_paired_order() -> None:
    s = sched(
        {
            0: ["0F0", "0SEND_F0", "0F1", "0RECV_B0", "0SEND_F1", "0BW0", "0RECV_B1", "0BW1"],
            1: ["1RECV_F0", "1F0", "1BW0", "1SEND_B0", "1RECV_F1", "1F1", "1BW1", "1SEND_B1"],
        },
        (0, 1),
        2,
    )
    validate(s, blocking_sends=True)
