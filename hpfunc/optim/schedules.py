"""Learning-rate schedules: pure functions ``step -> float``, named and ordered as optax's.

A schedule is any callable taking the number of steps already taken (``0`` for the first update)
and returning a float. ``scale_by_learning_rate`` calls it with a Python ``int`` read from the
optimizer state, so schedules are plain Python (no tensors, no host-device synchronisation).

Each schedule mirrors an optax one, with optax's argument names and positional order (only the
function names differ; ``docs/optim.md`` lists every difference):

* :func:`constant` is ``optax.constant_schedule``;
* :func:`linear` is ``optax.linear_schedule``;
* :func:`linear_warmup_cosine_decay` is ``optax.warmup_cosine_decay_schedule`` (``decay_steps``
  includes the warmup, as there);
* :func:`warmup_stable_decay` (WSD) has no optax counterpart and follows the same naming.

Example:
    >>> from hpfunc.optim import schedules
    >>> lr = schedules.linear_warmup_cosine_decay(0.0, 1e-3, warmup_steps=10, decay_steps=100)
    >>> lr(0), lr(10), lr(100)
    (0.0, 0.001, 0.0)
"""

from __future__ import annotations

import math
from typing import Callable, Literal

__all__ = [
    "Schedule",
    "constant",
    "linear",
    "linear_warmup_cosine_decay",
    "warmup_stable_decay",
]

Schedule = Callable[[int], float]


def _check_steps(name: str, value: int, *, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def constant(value: float) -> Schedule:
    """``step -> value`` for every step (``optax.constant_schedule``).

    >>> constant(0.1)(12345)
    0.1
    """
    value = float(value)

    def schedule(step: int) -> float:
        del step
        return value

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` (``optax.linear_schedule``).

    ``f(step) = init_value`` for ``step <= transition_begin``, ``end_value`` for
    ``step >= transition_begin + transition_steps``, linear in between. With ``transition_steps=0``
    the value jumps to ``end_value`` at ``transition_begin`` (optax holds ``init_value`` forever);
    a negative ``transition_begin`` is an error (optax: treated as 0).

    >>> f = linear(1.0, 0.0, 4)
    >>> f(0), f(2), f(4), f(9)
    (1.0, 0.5, 0.0, 0.0)
    """
    transition_steps = _check_steps("transition_steps", transition_steps, where="linear")
    transition_begin = _check_steps("transition_begin", transition_begin, where="linear")
    init_value, end_value = float(init_value), float(end_value)

    def schedule(step: int) -> float:
        if transition_steps == 0:
            return init_value if step < transition_begin else end_value
        frac = min(max(step - transition_begin, 0), transition_steps) / transition_steps
        if frac >= 1.0:  # hit the end value exactly (no rounding residue)
            return end_value
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup_cosine_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup to ``peak_value``, then a half-cosine down to ``end_value``
    (``optax.warmup_cosine_decay_schedule``, same arguments in the same order).

    ``decay_steps`` is the total length of the schedule, warmup included (as in optax). Values::

        f(0) = init_value, f(warmup_steps) = peak_value, f(step >= decay_steps) = end_value
        f(s) = end + (peak - end) * ((1 + cos(pi * (s - warmup) / (decay_steps - warmup))) / 2) ** exponent

    Unlike optax, ``decay_steps == warmup_steps`` is allowed (no decay phase: ``end_value`` from the
    end of the warmup), and the formula above is used as written, also for ``peak_value == 0``
    (optax then returns 0 after the warmup, whatever ``end_value``).

    >>> f = linear_warmup_cosine_decay(0.0, 1.0, warmup_steps=2, decay_steps=6, end_value=0.1)
    >>> f(0), f(1), f(2), f(4), f(6), f(7)
    (0.0, 0.5, 1.0, 0.55, 0.1, 0.1)
    """
    where = "linear_warmup_cosine_decay"
    warmup_steps = _check_steps("warmup_steps", warmup_steps, where=where)
    decay_steps = _check_steps("decay_steps", decay_steps, where=where)
    if decay_steps < warmup_steps:
        raise ValueError(
            f"{where}: decay_steps ({decay_steps}) is the total length, warmup included (as in optax), "
            f"and must be >= warmup_steps ({warmup_steps})"
        )
    peak_value, end_value, init_value = float(peak_value), float(end_value), float(init_value)
    exponent = float(exponent)
    warmup = linear(init_value, peak_value, warmup_steps)
    cosine_steps = decay_steps - warmup_steps

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return warmup(step)
        if step >= decay_steps:
            return end_value
        progress = (step - warmup_steps) / cosine_steps
        return end_value + (peak_value - end_value) * (0.5 * (1.0 + math.cos(math.pi * progress))) ** exponent

    return schedule


def warmup_stable_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    *,
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear",
) -> Schedule:
    """Warmup-stable-decay ("WSD", trapezoidal): linear warmup, a constant plateau, a final decay.

    optax has no WSD schedule; the arguments follow :func:`linear_warmup_cosine_decay`'s names, but
    each ``*_steps`` is the length of its own phase (``decay_steps`` is the decay phase only, as in
    ``optax.cosine_decay_schedule``). Phases, in steps: ``[0, warmup)`` linear from ``init_value``
    to ``peak_value``; ``[warmup, warmup + stable)`` constant ``peak_value``;
    ``[warmup + stable, warmup + stable + decay)`` decay to ``end_value``; afterwards ``end_value``.
    With ``p`` the decay progress in ``[0, 1]`` the decay factor is ``1 - p`` (linear),
    ``(1 + cos(pi p)) / 2`` (cosine) or ``1 - sqrt(p)`` (1-sqrt, Hägele et al. 2024).

    >>> f = warmup_stable_decay(0.0, 1.0, warmup_steps=2, stable_steps=3, decay_steps=4)
    >>> f(0), f(1), f(2), f(4), f(5), f(7), f(9), f(20)
    (0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0)
    """
    where = "warmup_stable_decay"
    warmup = _check_steps("warmup_steps", warmup_steps, where=where)
    stable = _check_steps("stable_steps", stable_steps, where=where)
    decay = _check_steps("decay_steps", decay_steps, where=where)
    shapes: dict[str, Callable[[float], float]] = {
        "linear": lambda p: 1.0 - p,
        "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
        "1-sqrt": lambda p: 1.0 - math.sqrt(p),
    }
    if decay_shape not in shapes:
        raise ValueError(f"{where}: decay_shape must be one of {sorted(shapes)}, got {decay_shape!r}")
    shape = shapes[decay_shape]
    peak_value, end_value, init_value = float(peak_value), float(end_value), float(init_value)
    ramp = linear(init_value, peak_value, warmup)
    decay_begin, end = warmup + stable, warmup + stable + decay

    def schedule(step: int) -> float:
        if step < warmup:
            return ramp(step)
        if step < decay_begin:
            return peak_value
        if step >= end:
            return end_value
        return end_value + (peak_value - end_value) * shape((step - decay_begin) / decay)

    return schedule
