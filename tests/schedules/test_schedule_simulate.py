"""simulate: costs, measures, timeline and chart."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpfunc.schedules import (
    Action,
    Schedule,
    ScheduleError,
    cost_function,
    gpipe,
    insert_comms,
    one_f_one_b,
    simulate,
    zb_h1,
    zbv,
)


def test_costs_dict_and_callable_agree() -> None:
    s = zb_h1(4, 8)
    table = {"F": 2.0, "B": 3.0, "W": 1.5}
    a = simulate(s, table)
    b = simulate(s, lambda act: {"F": 2.0, "B": 3.0, "W": 1.5}.get(act.kind.value, 0.0))
    assert a.makespan == b.makespan and a.bubble_ratio == b.bubble_ratio
    assert a.useful[0] == 8 * (2 + 3 + 1.5)


def test_bw_defaults_to_b_plus_w() -> None:
    c = cost_function({"B": 2, "W": 5})
    assert c(Action("BW", 0, 0)) == 7
    assert cost_function({"B": 2, "BW": 1})(Action("BW", 0, 0)) == 1
    assert cost_function()(Action("SEND_F", 0, 0)) == 0


@pytest.mark.parametrize("costs,exc,match", [
    ({"Q": 1}, ValueError, "unknown action kind 'Q'"),
    ({"F": -1}, ValueError, r"costs\['F'\] must be a finite number >= 0"),
    ({"F": float("nan")}, ValueError, "finite"),
    ([1, 2], TypeError, "costs must be None, a mapping"),
])
def test_bad_costs(costs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        simulate(gpipe(2, 2), costs)


def test_bad_callable_cost_names_the_action() -> None:
    with pytest.raises(ValueError, match=r"cost of 0F0 \(rank 0 step 0\)"):
        simulate(gpipe(2, 2), lambda a: -1.0)


def test_simulate_validates() -> None:
    s = gpipe(2, 2)
    broken = s.replace(actions={0: s[0][1:], 1: s[1]})
    with pytest.raises(ScheduleError):
        simulate(broken)


def test_zb_h1_formula_with_uneven_costs() -> None:
    # (p-1)(F + B - W) idle per rank holds beyond unit costs while W <= F and W <= B.
    p, m = 4, 16
    F, B, W = 1.0, 1.5, 0.5
    r = simulate(zb_h1(p, m), {"F": F, "B": B, "W": W})
    assert r.makespan == pytest.approx(m * (F + B + W) + (p - 1) * (F + B - W))


def test_communication_cost_is_counted() -> None:
    s = insert_comms(one_f_one_b(2, 4))
    assert simulate(s, {"SEND_F": 0.5}).makespan > simulate(s).makespan
    r = simulate(s, {"RECV_F": 0.25, "RECV_B": 0.25})
    assert r.idle[1] > simulate(s).idle[1]


def test_stage_scale() -> None:
    s = one_f_one_b(2, 4)
    even = simulate(s)
    uneven = simulate(s, stage_scale={0: 2.0})
    assert uneven.makespan > even.makespan
    assert uneven.useful[0] == 2 * even.useful[0]
    with pytest.raises(ValueError, match="stage_scale names stage"):
        simulate(s, stage_scale={5: 1.0})


def test_events_and_summary() -> None:
    r = simulate(gpipe(2, 2))
    assert len(r.events) == 8
    assert all(e.end - e.start == (1 if e.action.kind.value == "F" else 2) for e in r.events)
    text = r.summary()
    assert "makespan 9" in text and "rank" in text
    assert "SimResult('gpipe'" in repr(r)


def test_timeline_text() -> None:
    r = simulate(one_f_one_b(2, 2))
    lines = r.timeline().splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0 | 0F0")
    assert lines[1].split("|")[1].split()[0] == "."  # rank 1 idles while rank 0 runs F0
    assert len(r.timeline(tick=0.5).splitlines()[0]) > len(lines[0])
    with pytest.raises(ValueError, match="tick must be > 0"):
        r.timeline(tick=0)


def test_png_chart(tmp_path: Path) -> None:
    path = tmp_path / "zbv.png"
    out = simulate(zbv(2, 4)).plot(path)
    assert out == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_stages_on_one_rank() -> None:
    s = Schedule({0: [Action("F", 0, 0), Action("F", 1, 0), Action("BW", 1, 0), Action("BW", 0, 0)]}, (0, 0), 1)
    r = simulate(s)
    assert r.makespan == 6 and r.bubble_ratio[0] == 0
    assert r.peak_inflight[0] == 2 and r.peak_inflight_mb[0] == 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"])
def test_peak_resident_until_w(name) -> None:
    # What pipeline_map keeps on the device: F until W (or BW), minus swapped out.
    from hpfunc.schedules import GENERATORS, insert_comms, insert_swaps, merge_backward

    base = insert_comms(GENERATORS[name](2, 6))
    plain, swapped = simulate(base), simulate(insert_swaps(base, max_resident=1, prefetch=1))
    assert plain.peak_resident_until_w == plain.peak_until_w                 # nothing swapped
    fused = simulate(merge_backward(base))
    assert fused.peak_resident_until_w == fused.peak_resident                # BW frees where B did
    for r in (0, 1):
        assert swapped.peak_resident[r] <= swapped.peak_resident_until_w[r] <= plain.peak_until_w[r]
    if name == "zbv":  # the numbers tests/pipeline/test_pipeline_swaps.py measures in bytes
        assert (plain.peak_until_w, swapped.peak_resident_until_w) == ({0: 4, 1: 4}, {0: 2, 1: 3})
