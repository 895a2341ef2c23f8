"""The IR: Action, Schedule, placements, and generator argument errors."""

from __future__ import annotations

import pytest

from hpfunc.schedules import (
    GENERATORS,
    Action,
    ActionKind,
    Schedule,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    one_f_one_b,
    v_placement,
    zb_h1,
    zb_h2,
    zbv,
)


def test_action_basics() -> None:
    a = Action("F", 2, 3)
    assert a.kind is ActionKind.F and (a.stage, a.microbatch, a.peer) == (2, 3, None)
    assert str(a) == "2F3" and a.is_compute and not a.is_comm
    assert Action.parse("2BW3") == Action(ActionKind.BW, 2, 3)
    send = Action.parse("1SEND_B4@r0")
    assert send.peer == 0 and send.is_send and send.is_comm and repr(send) == "Action('1SEND_B4@r0')"
    assert Action.parse("0REDUCE_GRAD").microbatch is None
    assert hash(a) == hash(Action("F", 2, 3))  # frozen, usable as a key
    with pytest.raises(AttributeError):
        a.stage = 1  # type: ignore[misc]


@pytest.mark.parametrize("text", ["F0", "0X1", "0F-1", "", "0BW", "0UNSHARD1x"])
def test_parse_errors(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    (("Q", 0, 0), {}, ValueError, "unknown action kind 'Q'"),
    (("F", -1, 0), {}, ValueError, "stage must be >= 0"),
    (("F", 0, None), {}, ValueError, "needs a microbatch"),
    (("F", 0, -2), {}, ValueError, "microbatch must be >= 0"),
    (("F", 0, 1.0), {}, TypeError, "microbatch must be an int"),
    (("UNSHARD", 0, 1), {}, ValueError, "takes no microbatch"),
    (("F", 0, 0), {"peer": 1}, ValueError, "only send/recv"),
    (("SEND_F", 0, 0), {"peer": -1}, ValueError, "peer must be >= 0"),
])
def test_action_errors(args, kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        Action(*args, **kwargs)


def test_schedule_basics() -> None:
    s = one_f_one_b(3, 4)
    assert (s.num_stages, s.num_ranks, s.num_microbatches) == (3, 3, 4)
    assert s.stages_of(1) == (1,) and s.rank_of(2) == 2 and s[0] == s.actions[0]
    text = str(s)
    assert text.splitlines()[1].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    assert "0BW3" in text and "1f1b" in text
    assert "stages=3" in repr(s) or "stages=3" in str(s)
    # equality ignores the name; placements and actions matter
    assert s.replace(name="other") == s
    assert s.replace(stage_layers=(1, 2, 3)) != s


@pytest.mark.parametrize("args,kwargs,exc,match", [
    (({0: []}, (), 1), {}, ValueError, "stage_to_rank is empty"),
    (({0: []}, (0,), 0), {}, ValueError, "num_microbatches must be >= 1"),
    (({0: [], 1: []}, (0,), 1), {}, ValueError, r"rank\(s\) \[1\] that hold no stage"),
    (({0: ["0F0"]}, (0,), 1), {}, TypeError, "rank 0 step 0: expected an Action"),
    (({0: []}, (0, 0), 1), {"stage_layers": (1,)}, ValueError, "stage_layers has 1 entries but there are 2"),
    (({0: []}, (0,), 1), {"stage_layers": (0,)}, ValueError, r"stage_layers\[0\] must be >= 1"),
    (([], (0,), 1), {}, TypeError, "mapping rank"),
])
def test_schedule_errors(args, kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        Schedule(*args, **kwargs)


def test_missing_ranks_get_empty_lists() -> None:
    s = Schedule({}, (0, 1), 1)
    assert s.actions == {0: (), 1: ()}


def test_placements() -> None:
    assert loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert interleaved_1f1b(3, 3, 2).stage_to_rank == loop_placement(3, 2)
    assert zbv(3, 6).stage_to_rank == dualpipev(3, 6).stage_to_rank == v_placement(3)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zb_h1, zb_h2, zbv, dualpipev, interleaved_1f1b])
@pytest.mark.parametrize("p,m,exc,match", [
    (2, 0, ValueError, r"m \(microbatches\) must be >= 1"),
    (2, -3, ValueError, r"m \(microbatches\) must be >= 1"),
    (0, 2, ValueError, r"p \(pipeline ranks\) must be >= "),
    (2.0, 2, TypeError, "must be an int"),
    (2, True, TypeError, "must be an int"),
])
def test_generator_bad_sizes(make, p, m, exc, match) -> None:
    with pytest.raises(exc, match=match) as info:
        make(p, m)
    assert make.__name__ in str(info.value)


@pytest.mark.parametrize("v,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_interleaved_bad_v(v, exc) -> None:
    with pytest.raises(exc, match=r"v \(chunks per rank\)"):
        interleaved_1f1b(2, 4, v)


def test_interleaved_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of p=4.*try m=8"):
        interleaved_1f1b(4, 6, 2)


def test_dualpipev_limits() -> None:
    with pytest.raises(ValueError, match=r"p \(pipeline ranks\) must be >= 2"):
        dualpipev(1, 4)
    with pytest.raises(ValueError, match="m >= 2p"):
        dualpipev(4, 7)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_single_rank_degenerate_cases(name: str) -> None:
    if name == "dualpipev":
        return  # needs p >= 2 (checked above)
    s = GENERATORS[name](1, 2)
    assert s.num_ranks == 1


def test_generators_are_deterministic() -> None:
    for name, make in GENERATORS.items():
        assert make(4, 8) == make(4, 8), name


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 9)])
def test_interleaved_with_one_chunk_is_1f1b(p: int, m: int) -> None:
    assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


def test_from_strings_names_the_bad_cell() -> None:
    with pytest.raises(ValueError, match="rank 1 step 2: cannot parse action 'X'"):
        Schedule.from_strings({0: ["0F0"], 1: ["1F0", "1BW0", "X"]}, (0, 1), 1)
