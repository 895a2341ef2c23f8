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
