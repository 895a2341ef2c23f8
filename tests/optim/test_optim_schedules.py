"""Schedules hit their defined values at the phase boundaries."""

from __future__ import annotations

import math

import pytest

from hpfunc import optim


def test_constant():
    f = optim.constant(3e-4)
    assert f(0) == f(10**9) == 3e-4


def test_linear_boundaries():
    f = optim.linear(1.0, 0.1, 10, transition_begin=5)
    assert f(0) == f(5) == 1.0
    assert f(15) == f(1000) == 0.1
    assert math.isclose(f(10), 0.55)
    assert optim.linear(2.0, 0.0, 0)(0) == 0.0


def test_linear_warmup_cosine_decay_boundaries():
    f = optim.linear_warmup_cosine_decay(0.0, 1e-3, warmup_steps=100, decay_steps=1100, end_value=1e-5)
    assert f(0) == 0.0
    assert math.isclose(f(50), 5e-4)
    assert f(100) == 1e-3
    assert math.isclose(f(600), (1e-3 + 1e-5) / 2)  # half way through the cosine
    assert f(1100) == f(5000) == 1e-5
    assert all(f(s) >= f(s + 1) for s in range(100, 1100))  # monotone decay
    g = optim.linear_warmup_cosine_decay(0.5, 1.0, warmup_steps=0, decay_steps=10)
    assert g(0) == 1.0  # no warmup: starts at the peak


def test_warmup_stable_decay_boundaries():
    for shape in ("linear", "cosine", "1-sqrt"):
        f = optim.warmup_stable_decay(0.0, 2.0, warmup_steps=10, stable_steps=20, decay_steps=10, end_value=0.2,
                                      decay_shape=shape)
        assert f(0) == 0.0 and math.isclose(f(5), 1.0)
        assert f(10) == f(20) == f(29) == f(30) == 2.0
        assert 0.2 < f(35) < 2.0
        assert f(40) == f(100) == 0.2
    assert math.isclose(optim.warmup_stable_decay(0.0, 1.0, 0, 0, 4, decay_shape="1-sqrt")(1), 0.5)


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="decay_steps .* warmup included"):
        optim.linear_warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=5)
    with pytest.raises(ValueError, match="decay_shape"):
        optim.warmup_stable_decay(0.0, 1.0, 1, 1, 1, decay_shape="exp")
    with pytest.raises(ValueError, match="warmup_steps"):
        optim.warmup_stable_decay(0.0, 1.0, -1, 1, 1)


def _all_schedules():
    return [optim.constant(3e-4), optim.linear(1.0, 0.1, 10, transition_begin=5), optim.linear(2.0, 0.0, 0, 3),
            optim.linear_warmup_cosine_decay(0.0, 1e-3, warmup_steps=7, decay_steps=40, end_value=1e-5, exponent=1.5),
            *[optim.warmup_stable_decay(0.0, 2.0, 3, 4, 9, 0.2, decay_shape=s) for s in ("linear", "cosine", "1-sqrt")]]


def test_the_device_table_holds_the_python_values_bit_for_bit():
    """``Tabled.at(count)`` (what a step whose counter lives on a GPU reads, with no host sync) equals the
    Python schedule at every step, before, at and past its horizon; so does a rate scaled from it."""
    import torch

    from hpfunc.optim import schedules

    for f in _all_schedules():
        assert isinstance(f, schedules.Tabled) and f.tabled
        for s in [*range(f.horizon + 3), 10**6]:
            assert f.at(torch.tensor(s)).item() == f(s), (f, s)
        lr = f.map(lambda v: 0.5 * v)
        assert all(lr.at(torch.tensor(s)).item() == 0.5 * f(s) for s in range(f.horizon + 2))
        assert f.bound == max(abs(f(s)) for s in range(f.horizon + 1))


def test_scale_by_schedule_on_a_device_count_equals_the_host_read():
    """The scaling by the table's 0-d value gives the updates of the Python-number factor, bit for bit, in
    float32, bfloat16 and float64."""
    import torch

    import importlib

    scale_mod = importlib.import_module("hpfunc.optim.scale")

    f = optim.linear_warmup_cosine_decay(0.0, 3e-3, warmup_steps=2, decay_steps=9, end_value=1e-4)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        u = {"w": torch.randn(5, 3, generator=g).to(dtype), "b": torch.randn(3, generator=g).to(dtype)}
        for s in range(11):
            got = scale_mod._scaled_by_tensor(u, f.at(torch.tensor(s)))
            want = scale_mod._scaled(u, float(f(s)))
            assert all(torch.equal(got[k], want[k]) for k in u), (dtype, s)
