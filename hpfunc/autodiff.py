"""``grad`` and ``value_and_grad`` over pytrees.

Built on ``torch.autograd.grad`` rather than ``torch.func.grad``: it composes with activation
checkpointing (remat), saved-tensor hooks (offload) and DTensors, and costs less per call on small
graphs. The function is still pure from the caller's view: inputs are never modified and no
``.grad`` attribute is read or written.

Example:
    >>> import torch, hpfunc
    >>> def loss(params, x):
    ...     return ((x @ params["w"]) ** 2).sum()
    >>> params = {"w": torch.ones(3, 2)}
    >>> value, grads = hpfunc.value_and_grad(loss)(params, torch.ones(4, 3))
    >>> float(value), grads["w"].shape
    (72.0, torch.Size([3, 2]))
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from hpfunc import layout
from hpfunc import tree as _tree

__all__ = ["grad", "value", "value_and_grad"]


def _prepare(arg: Any, argnum: int) -> tuple[Any, list[torch.Tensor]]:
    leaves: list[torch.Tensor] = []

    def prep(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not (x.is_floating_point() or x.is_complex()):
            raise TypeError(
                f"value_and_grad: argument {argnum} leaf {path or '<root>'!r} has dtype {x.dtype}; only "
                f"floating-point leaves can be differentiated (move integer state out of the differentiated argument)"
            )
        y = x.detach().requires_grad_(True)
        leaves.append(y)
        return y

    return _tree.map_with_path(prep, arg), leaves


def _detach(tree: Any) -> Any:
    return _tree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Return a function computing ``(fn(*args), grad)``, or ``((value, aux), grad)`` with ``has_aux``.

    ``grad`` has the structure of ``args[argnums]`` (a tuple of such trees when ``argnums`` is a
    tuple). ``fn`` must return a scalar tensor (or DTensor). Leaves the output does not depend on
    get zero gradients.

    Inside a step run by :func:`hpfunc.parallelize` the differentiated arguments must be (subtrees
    of) the state's parameters: ``fn`` then sees them gathered as the plan says, the gradient comes
    back reduced and laid out like the optimizer blocks, and the value is the mean over data shards.
    """
    multi = not isinstance(argnums, int)
    nums = tuple(argnums) if multi else (argnums,)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ctx = layout.current()
        if ctx is not None:  # inside hpfunc.parallelize: gather on use, reduce the gradient
            return ctx.value_and_grad(fn, nums, multi, has_aux, args, kwargs)
        for a in nums:
            if a >= len(args) or a < -len(args):
                raise ValueError(f"value_and_grad: argnums {a} but the function got {len(args)} positional arguments")
        args = list(args)
        per_arg: list[list[torch.Tensor]] = []
        for a in nums:
            args[a], leaves = _prepare(args[a], a)
            per_arg.append(leaves)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("value_and_grad(has_aux=True) needs the function to return (value, aux)")
            value, aux = out
        else:
            value, aux = out, None
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(
                f"value_and_grad needs a scalar tensor output, found "
                f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}"
            )
        flat = [x for leaves in per_arg for x in leaves]
        if flat and value.requires_grad:
            grads = torch.autograd.grad(value, flat, allow_unused=True)
        else:
            grads = (None,) * len(flat)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(flat, grads)]
        it = iter(grads)
        results = []
        for a in nums:
            results.append(_tree.tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) and x.requires_grad else x,
                                          args[a]))
        g_out = tuple(results) if multi else results[0]
        v = value.detach()
        return ((v, _detach(aux)) if has_aux else v), g_out

    return wrapped


def grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Like :func:`value_and_grad` but returns only the gradient (and ``aux`` with ``has_aux``)."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        (out, g) = vg(*args, **kwargs)
        if has_aux:
            return g, out[1]
        return g

    return wrapped


def value(fn: Callable, has_aux: bool = False) -> Callable:
    """``fn(*args)`` as :func:`value_and_grad` computes its value, without a gradient: the forward of
    an evaluation.

    Inside a step run by :func:`hpfunc.parallelize` every argument holding the state's parameters is
    seen as the plan lays it out for use (FSDP gathers a layer on first use and lets it go after, so no
    rank holds more than its blocks and one layer gathered), nothing is recorded for a backward, and
    the value is the mean over the data shards (``aux``'s batch statistics reduced as for
    :func:`value_and_grad`). Elsewhere it is ``fn`` under ``torch.no_grad()``.

    >>> import torch
    >>> value(lambda w, x: ((w * x) ** 2).mean())(torch.ones(3), torch.arange(3.0))
    tensor(1.6667)
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ctx = layout.current()
        if ctx is not None:
            return ctx.value(fn, has_aux, args, kwargs)
        with torch.no_grad():
            out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("value(has_aux=True) needs the function to return (value, aux)")
            return out[0].detach(), _detach(out[1])
        return out.detach() if isinstance(out, torch.Tensor) else out

    return wrapped
