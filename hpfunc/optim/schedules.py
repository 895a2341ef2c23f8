"""Learning-rate schedules: pure functions ``step -> float``, named and ordered as optax's.

A schedule is any callable taking the number of steps already taken (``0`` for the first update)
and returning a float. ``scale_by_learning_rate`` calls it with a Python ``int`` read from the
optimizer state when the state's counter is on the host. The schedules here are :class:`Tabled`:
constant after a last step, so that a step whose counter lives on a GPU reads the value there, from
a table of the Python function's own values (:meth:`Tabled.at`), without a host sync; any other
callable is read on the host (``int(count)``, a host sync on a GPU).

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
from typing import Any, Callable, Literal

import torch

__all__ = [
    "Schedule",
    "Tabled",
    "value_at",
    "constant",
    "linear",
    "linear_warmup_cosine_decay",
    "warmup_stable_decay",
]

Schedule = Callable[[int], float]

# A schedule is tabled on a device up to this many steps (16 MiB of float64); a longer one is read on the host.
MAX_TABLE = 1 << 21


class Tabled:
    """A schedule ``step -> float`` that is constant from step ``horizon`` on, readable on a device.

    ``sched(step)`` is the Python function, as before. ``sched.at(count)`` takes the step as a tensor
    (a counter held on a GPU) and returns the value as a float64 0-dim tensor on its device without
    reading it on the host: the values of steps ``0 .. horizon`` are computed once by the Python function
    itself and put on the device as a table, which ``count`` (clamped to ``horizon``) indexes. The
    values are therefore the Python function's, bit for bit. Every schedule of this module is one;
    :meth:`map` keeps a function of one tabled (a peak rate times a factor) tabled.

    >>> import torch
    >>> f = linear(1.0, 0.0, 4)
    >>> float(f.at(torch.tensor(2))), float(f.at(torch.tensor(99))), f(2)
    (0.5, 0.0, 0.5)
    """

    __slots__ = ("fn", "horizon", "_tables", "_bound")

    def __init__(self, fn: Callable[[int], float], horizon: int) -> None:
        self.fn, self.horizon = fn, int(horizon)
        self._tables: dict = {}  # device -> the table on it (this schedule's own, built on first use)
        self._bound: float | None = None

    def __call__(self, step: int) -> float:
        return self.fn(step)

    def __repr__(self) -> str:
        return f"Tabled({getattr(self.fn, '__qualname__', self.fn)}, horizon={self.horizon})"

    def map(self, fn: Callable[[float], float]) -> "Tabled":
        """``step -> fn(self(step))``, tabled with the same horizon."""
        return Tabled(lambda step: fn(self.fn(step)), self.horizon)

    @property
    def tabled(self) -> bool:
        """Whether :meth:`at` reads a device table (a horizon of at most :data:`MAX_TABLE` steps)."""
        return self.horizon < MAX_TABLE

    @property
    def bound(self) -> float:
        """The largest ``|value|`` of any step (from the table's values, computed on the host once)."""
        if self._bound is None:
            self._bound = max(abs(float(self.fn(i))) for i in range(self.horizon + 1))
        return self._bound

    def at(self, count: torch.Tensor) -> torch.Tensor:
        """The value at step ``count`` (an integer tensor) as a float64 0-dim tensor on its device."""
        from torch._subclasses.fake_tensor import FakeTensor

        table = self._tables.get(count.device)
        if table is None or isinstance(count, FakeTensor) != isinstance(table, FakeTensor):
            values = [float(self.fn(i)) for i in range(self.horizon + 1)]
            table = torch.tensor(values, dtype=torch.float64, device=count.device)
            if not isinstance(table, FakeTensor):  # a fake table belongs to its fake mode: not kept
                self._tables[count.device] = table
        index = count.reshape(1).clamp(0, self.horizon).to(torch.int64)
        return table.index_select(0, index).reshape(())


def value_at(schedule: Callable[[int], float], count: torch.Tensor) -> torch.Tensor:
    """``schedule`` at step ``count`` as a float64 0-dim tensor on ``count``'s device.

    A count on a device with a :class:`Tabled` schedule is read there (no host sync); otherwise the
    count is read on the host (``int(count)``: a host sync when the count is on a GPU) and the value
    lifted to its device.

    >>> import torch
    >>> value_at(lambda s: 0.5 * s, torch.tensor(3)).item()
    1.5
    """
    if count.device.type != "cpu" and isinstance(schedule, Tabled) and schedule.tabled:
        return schedule.at(count)
    return torch.tensor(float(schedule(int(count))), dtype=torch.float64, device=count.device)


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

    return Tabled(schedule, 0)


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

    return Tabled(schedule, transition_begin + transition_steps)


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

    return Tabled(schedule, decay_steps)


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

    return Tabled(schedule, end)
