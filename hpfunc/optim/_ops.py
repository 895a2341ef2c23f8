"""Element-wise maths over lists of leaves: one fused ``torch._foreach_*`` call for plain tensors,
a per-leaf loop otherwise (DTensors, mixed devices or dtypes).

Every function returns new tensors and leaves its inputs untouched (in-place foreach variants are
only applied to tensors created here). A per-leaf loop costs one kernel launch per leaf and op; the
foreach form batches them, which matters for models with hundreds of parameter tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

def _plain(cls: type) -> bool:
    """A tensor type that computes as a plain tensor: ``torch.Tensor`` or a subclass that overrides
    neither dispatch (``nn.Parameter``, a parallelized step's parameter blocks); not a DTensor."""
    return cls is torch.Tensor or (
        issubclass(cls, torch.Tensor) and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and cls.__torch_function__ is torch._C._disabled_torch_function_impl)


def plain_type(cls: type) -> bool:
    """``cls`` computes as a plain tensor (``torch.Tensor`` itself, or a subclass that overrides no dispatch)."""
    return cls is torch.Tensor or _plain(cls)


def foreach_type(cls: type) -> bool:
    """``cls`` can take the ``torch._foreach_*`` path: a plain type, or torch's ``FakeTensor``, which stands
    for one in a dry run (its step then holds the same temporaries as the real one; the fused AdamW
    kernel, which has no shape-only form, stays for :func:`plain_type`)."""
    if plain_type(cls):
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return issubclass(cls, FakeTensor)


def foreachable(*lists: Sequence[torch.Tensor]) -> bool:
    """True when all leaves are plain tensors of one device and dtype (the fast foreach path)."""
    first = lists[0][0] if lists and lists[0] else None
    if first is None:
        return False
    return all(
        foreach_type(type(x)) and x.device == first.device and x.dtype == first.dtype
        for xs in lists for x in xs
    )


def cast(xs: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``x.to(y.dtype)`` per leaf (no copy when the dtype already matches)."""
    return [x.to(y.dtype) for x, y in zip(xs, like)]


def mul(xs: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    if foreachable(xs):
        return list(torch._foreach_mul(list(xs), factor))
    return [x * factor for x in xs]


def mul_tensor(xs: Sequence[torch.Tensor], factor: torch.Tensor) -> list[torch.Tensor]:
    """Multiply by a 0-d tensor without changing the leaves' dtype."""
    if foreachable(xs) and factor.device == xs[0].device:
        return list(torch._foreach_mul(list(xs), factor.to(xs[0].dtype)))
    return [x * factor.to(x.device) for x in xs]


def add(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], alpha: float = 1.0) -> list[torch.Tensor]:
    """``x + alpha * y`` per leaf, in the promoted dtype."""
    if foreachable(xs, ys):
        return list(torch._foreach_add(list(xs), list(ys), alpha=alpha))
    return [torch.add(x, y, alpha=alpha) for x, y in zip(xs, ys)]


def lerp(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
    if foreachable(xs, ys):
        return list(torch._foreach_lerp(list(xs), list(ys), weight))
    return [torch.lerp(x, y, weight) for x, y in zip(xs, ys)]


def adam_moments(
    m: Sequence[torch.Tensor], v: Sequence[torch.Tensor], g: Sequence[torch.Tensor], b1: float, b2: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``m <- lerp(m, g, 1 - b1)``, ``v <- b2 v + (1 - b2) g^2`` (torch.optim.Adam's arithmetic)."""
    if foreachable(m, v, g):
        new_m = list(torch._foreach_lerp(list(m), list(g), 1.0 - b1))
        new_v = list(torch._foreach_mul(list(v), b2))
        torch._foreach_addcmul_(new_v, list(g), list(g), value=1.0 - b2)
        return new_m, new_v
    new_m = [torch.lerp(a, x, 1.0 - b1) for a, x in zip(m, g)]
    new_v = [torch.addcmul(b * b2, x, x, value=1.0 - b2) for b, x in zip(v, g)]
    return new_m, new_v


def bias_corrections(count: torch.Tensor, b1: float, b2: float) -> tuple[Any, Any]:
    """Adam's ``(1 - b1^t, 1 - b2^t)`` for the step count ``t``.

    A count on the host (``optim.base.new_count``) is read at no cost: Python floats. A count on a
    device (a parallel step's state on a GPU mesh holds it there, replicated) is never read: 0-dim
    float64 tensors on its device, computed there (reading it would wait for the device every step).

    >>> bias_corrections(torch.tensor(2), 0.5, 0.75)
    (0.75, 0.4375)
    """
    if count.device.type == "cpu":
        t = int(count)
        return 1.0 - b1**t, 1.0 - b2**t
    t = count.to(torch.float64)
    return 1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t)


def adam_denominator(v: Sequence[torch.Tensor], *, bias_correction2: float, eps: float,
                     eps_root: float) -> list[torch.Tensor]:
    """``sqrt(v / bc2 + eps_root) + eps`` as new tensors, foreach; with ``eps_root == 0``
    ``sqrt(v) / sqrt(bc2) + eps``, torch's rounding (``v`` foreachable)."""
    if eps_root == 0.0:
        denom = list(torch._foreach_sqrt(list(v)))
        torch._foreach_div_(denom, bias_correction2**0.5)
    else:
        denom = list(torch._foreach_div(list(v), bias_correction2))
        torch._foreach_add_(denom, eps_root)
        torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    return denom


def adam_direction(
    m: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    *,
    bias_correction1: float,
    bias_correction2: float,
    eps: float,
    eps_root: float,
) -> list[torch.Tensor]:
    """``(m / bc1) / (sqrt(v / bc2 + eps_root) + eps)``; with ``eps_root == 0`` the denominator is
    ``sqrt(v) / sqrt(bc2) + eps`` as in torch."""
    bc2_sqrt = bias_correction2**0.5
    if foreachable(m, v):
        denom = adam_denominator(v, bias_correction2=bias_correction2, eps=eps, eps_root=eps_root)
        out = list(torch._foreach_div(list(m), denom))
        torch._foreach_div_(out, bias_correction1)
        return out
    out = []
    for a, b in zip(m, v):
        if eps_root == 0.0:
            denom = b.sqrt() / bc2_sqrt + eps
        else:
            denom = (b / bias_correction2 + eps_root).sqrt() + eps
        out.append(a / denom / bias_correction1)
    return out
