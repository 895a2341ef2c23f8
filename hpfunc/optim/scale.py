"""Scaling transformations: a constant factor and the (scheduled) learning rate."""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch

from hpfunc.optim import _ops, _tree
from hpfunc.optim.base import EmptyState, GradientTransformation, Params, Updates, identity, new_count
from hpfunc.optim.schedules import Tabled

__all__ = [
    "scale", "set_to_zero", "ScaleByScheduleState", "scale_by_schedule", "scale_by_learning_rate", "ScalarOrSchedule"
]

ScalarOrSchedule = Union[float, Callable[[int], float]]


def _scaled(updates: Updates, factor: float) -> Updates:
    leaves, spec = _tree.flatten(updates)
    return _tree.unflatten(spec, _ops.mul(leaves, factor))


def _scaled_by_tensor(updates: Updates, factor: torch.Tensor) -> Updates:
    """:func:`_scaled` by a float64 0-dim tensor ``factor`` (a schedule's value on the device), with the
    arithmetic of a Python-number factor: the factor rounded to float32 (the computation type of fp32,
    bf16 and fp16 leaves; float64 leaves take it whole), the product rounded to the leaf's dtype.

    >>> import torch
    >>> u = {"w": torch.tensor([1.0, 3.0]), "h": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}
    >>> f = 0.1
    >>> all(torch.equal(a, b) for a, b in zip(_scaled_by_tensor(u, torch.tensor(f, dtype=torch.float64)).values(),
    ...                                        _scaled(u, f).values()))
    True
    """
    leaves, spec = _tree.flatten(updates)
    out = []
    for x in leaves:
        if x.dtype is torch.float64:
            out.append(x * factor.to(x.device))
        elif x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            f = factor.to(device=x.device, dtype=torch.float32)
            out.append(x * f if x.dtype is torch.float32 else (x.float() * f).to(x.dtype))
        else:
            out.append(x * factor.to(x.device))
    return _tree.unflatten(spec, out)


def scale(step_size: float) -> GradientTransformation:
    """Multiply every update by a constant ``step_size`` (optax's name for the factor).

    Args:
      step_size: a Python number (for example ``1 / grad_accum_steps``).

    Example:
        >>> import torch
        >>> tx = scale(0.5)
        >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]
        {'w': tensor([0.5000, 0.5000])}
    """
    step_size = float(step_size)

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    @torch.no_grad()
    def update(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        return _scaled(updates, step_size), state

    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros: freezes the leaves it is applied to.

    Use it under :func:`partition` for leaves that must not move with the gradient (e.g. the MoE
    ``expert_bias``, which has its own update rule and must not be weight-decayed).

    Example:
        >>> import torch
        >>> from hpfunc.optim import partition, adamw
        >>> tx = partition({"train": adamw(1e-2), "frozen": set_to_zero()},
        ...                lambda path, x: "frozen" if path.endswith("expert_bias") else "train")
        >>> params = {"w": torch.ones(2), "expert_bias": torch.ones(2)}
        >>> u, _ = tx.update(params, tx.init(params), params)
        >>> u["expert_bias"]
        tensor([0., 0.])
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    @torch.no_grad()
    def update(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        leaves, spec = _tree.flatten(updates)
        return _tree.unflatten(spec, [torch.zeros_like(u) for u in leaves]), state

    return GradientTransformation(init, update)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates done (int64 CPU scalar)."""

    count: torch.Tensor


def scale_by_schedule(step_size_fn: Callable[[int], float]) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, ``count`` being the number of earlier updates.

    The first update uses ``step_size_fn(0)``, matching ``optax.scale_by_schedule`` and
    ``torch.optim.lr_scheduler.LambdaLR`` stepped after each ``optimizer.step()``. The count is an
    int64 CPU tensor (optax: int32) and the schedule is called with a Python ``int``.

    Example:
        >>> import torch
        >>> tx = scale_by_schedule(lambda step: 1.0 / (step + 1))
        >>> state = tx.init(None)
        >>> u, state = tx.update({"w": torch.ones(1)}, state)
        >>> u, state = tx.update({"w": torch.ones(1)}, state)
        >>> u["w"], int(state.count)
        (tensor([0.5000]), 2)
    """
    if not callable(step_size_fn):
        raise TypeError(
            f"scale_by_schedule: step_size_fn must be a callable step -> float, got {type(step_size_fn).__name__}; "
            "for a constant factor use scale(step_size)"
        )

    def init(params: Params) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(count=new_count())

    on_device = isinstance(step_size_fn, Tabled) and step_size_fn.tabled

    @torch.no_grad()
    def update(updates: Updates, state: ScaleByScheduleState, params: Params | None = None):
        del params
        if on_device and state.count.device.type != "cpu":
            # a count held on a GPU is not read on the host: the schedule's table is indexed there
            return _scaled_by_tensor(updates, step_size_fn.at(state.count)), ScaleByScheduleState(count=state.count + 1)
        factor = float(step_size_fn(int(state.count)))
        return _scaled(updates, factor), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule | None = None, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (a descent step); a float or a schedule ``step -> float``.

    As ``optax.scale_by_learning_rate``: ``None`` is no scaling (:func:`identity`), a callable is
    called with the number of earlier updates.

    Args:
      learning_rate: the learning rate, a schedule, or ``None``.
      flip_sign: negate the rate (default), so that ``apply_updates`` descends.

    Example:
        >>> import torch
        >>> tx = scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]
        {'w': tensor([-0.1000])}
    """
    if learning_rate is None:
        return identity()
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        schedule = learning_rate
        if isinstance(schedule, Tabled):  # read on the device where its count lives (no host sync)
            return scale_by_schedule(schedule.map(lambda v: sign * float(v)))
        return scale_by_schedule(lambda step: sign * float(schedule(step)))
    return scale(sign * float(learning_rate))
