"""Simulated bubbles and peak in-flight activations against the formulas of
docs/reference.md#pipeline-schedules.

Unit costs: F = B = W = 1, BW = B + W. p pipeline ranks, m microbatches, v chunks per rank.
"""

from __future__ import annotations

import pytest

from hpfunc.schedules import (
    dualpipev,
    gpipe,
    insert_comms,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
    zb_h2,
    zbv,
)

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p, 8 * p)]


def _approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe(p: int, m: int) -> None:
    r = simulate(gpipe(p, m))
    for rank in range(p):
        assert r.bubble_ratio[rank] == _approx((p - 1) / m)
    assert r.peak_inflight[0] == m


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b(p: int, m: int) -> None:
    r = simulate(one_f_one_b(p, m))
    for rank in range(p):
        assert r.bubble_ratio[rank] == _approx((p - 1) / m)
    assert r.peak_inflight[0] == min(p, m)
    assert max(r.peak_inflight.values()) == min(p, m)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved(p: int, m: int, v: int) -> None:
    r = simulate(interleaved_1f1b(p, m, v))
    for rank in range(p):
        assert r.bubble_ratio[rank] == _approx((p - 1) / (v * m))
    # Peak on rank 0, counted in microbatches of a full rank (v chunk activations make one):
    # the warm-up 2(p-1) + (v-1)p chunk-forwards plus the one before the first backward,
    # i.e. p (1 + (p-1)/(p v)) -- capped by m v when the warm-up would exceed all the work.
    chunks = min(2 * (p - 1) + (v - 1) * p + 1, m * v)
    assert r.peak_inflight[0] == chunks
    assert r.peak_inflight_mb[0] == _approx(chunks / v)
    if m * v > 2 * (p - 1) + (v - 1) * p:
        assert r.peak_inflight_mb[0] == _approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1(p: int, m: int) -> None:
    r = simulate(zb_h1(p, m))
    F = B = W = 1
    for rank in range(p):
        assert r.idle[rank] == _approx((p - 1) * (F + B - W))
    assert r.peak_inflight[0] == min(p, m)
    assert max(r.peak_until_w.values()) == min(p, m)  # the memory of 1F1B, even counted until W
    # "about 1/3 of 1F1B when F = B = W"
    assert r.idle[0] * 3 == _approx(simulate(one_f_one_b(p, m)).idle[0])


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h2(p: int, m: int) -> None:
    r = simulate(zb_h2(p, m))
    if m >= 2 * p:
        # (p-1)(F + B - 2W) = 0: with steps overlapped (post-validation) no rank ever idles.
        assert max(r.steady_bubble_ratio.values()) == 0
        assert r.peak_inflight[0] == 2 * p - 1
        # Within one isolated step only the fill/drain triangle remains; it vanishes as m grows.
        assert r.bubble_ratio[0] == _approx((p - 1) / (3 * m))
    # 2p - 1 activations at most on every rank, counted until W (F..B plus B..W).
    assert max(r.peak_until_w.values()) == min(2 * p - 1, m)


@pytest.mark.parametrize("p,m", GRID)
def test_zbv(p: int, m: int) -> None:
    r = simulate(zbv(p, m))
    if m >= 2 * p:
        assert max(r.steady_bubble_ratio.values()) == 0
        # p microbatches of a full rank = 2p activations of its half-size chunks.
        assert r.peak_inflight_mb[0] == p
        assert r.peak_inflight[0] == 2 * p
        assert r.bubble_ratio[0] == _approx((p - 1) / (6 * m))
    # the W passes stay close to their B: 2p chunk activations even counted until W
    assert max(r.peak_until_w.values()) <= 2 * p


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= 2 * p])
def test_dualpipev(p: int, m: int) -> None:
    # The DualPipeV row of docs/reference.md#pipeline-schedules is DualPipe's table: its "p" counts
    # pipeline stages (DualPipe's PP; DualPipeV puts 2 per rank, so stages = 2 * ranks) and its
    # memory is in stage activations.
    # Bubble (stages/2 - 1)(F&B + B - 3W) with F&B = F + B + W (no overlap modelled) -> p - 1 idle.
    stages = 2 * p
    F = B = W = 1
    r = simulate(dualpipev(p, m))
    for rank in range(p):
        assert r.idle[rank] == _approx((stages / 2 - 1) * ((F + B + W) + B - 3 * W))
    assert r.peak_inflight[0] == stages + 1
    assert r.peak_inflight_mb[0] == _approx(p + 0.5)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_formulas_survive_lowering(p: int, m: int) -> None:
    # Communication at zero cost changes nothing.
    for make in (one_f_one_b, zb_h1, zbv):
        s = make(p, m)
        a, b = simulate(s), simulate(validate(insert_comms(s)))
        assert a.makespan == b.makespan
        assert a.peak_inflight == b.peak_inflight
