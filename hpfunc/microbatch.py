"""Gradient accumulation: a ``value_and_grad`` function evaluated on micro-batches, averaged.

``hpfunc.microbatch(hpfunc.value_and_grad(loss_fn), 4)(params, batch)`` splits ``batch`` along
dimension 0 into 4 equal micro-batches, runs one forward and backward per micro-batch (so activations
are those of a quarter batch) and returns the mean value and the mean gradient: for a loss that is a mean
over equally sized micro-batches, the value and gradient of the whole batch. Inside a step run by
:func:`hpfunc.parallelize` the gradient reductions over data and replicated axes happen once, after the
last micro-batch, instead of once per micro-batch (FSDP's reduce-scatter, the transpose of its
all-gather, still runs per micro-batch: its gradients stay sharded in between).

Example:
    >>> import torch, hpfunc
    >>> loss = lambda p, b: ((b @ p["w"]) ** 2).mean()
    >>> params, batch = {"w": torch.ones(3, 2)}, torch.arange(12.0).reshape(4, 3)
    >>> v1, g1 = hpfunc.value_and_grad(loss)(params, batch)
    >>> v4, g4 = hpfunc.microbatch(hpfunc.value_and_grad(loss), 4)(params, batch)
    >>> bool(torch.allclose(v1, v4)), bool(torch.allclose(g1["w"], g4["w"]))
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch

from hpfunc import layout
from hpfunc import tree as _tree

__all__ = ["microbatch"]


def _split(arg: Any, num: int, argnum: int) -> list[Any]:
    pieces: list[list[torch.Tensor]] = []
    leaves, treedef = _tree.flatten(arg)
    for path, x in _tree.leaves_with_paths(arg):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] % num:
            found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"microbatch: argument {argnum} leaf {path or '<root>'!r} of shape {found} does not "
                             f"split into {num} equal micro-batches along dimension 0")
    for x in leaves:
        pieces.append(list(x.chunk(num)))
    return [_tree.unflatten(treedef, [p[k] for p in pieces]) for k in range(num)]


def microbatch(fn: Callable, num: int, *, argnums: int | Sequence[int] = 1) -> Callable:
    """Average ``fn`` (a :func:`hpfunc.value_and_grad` function) over ``num`` micro-batches.

    Args:
        fn: returns ``(value, grads)`` or, with ``has_aux``, ``((value, aux), grads)``.
        num: how many equal slices (along dimension 0) of the arguments ``argnums`` to run.
        argnums: the batch argument(s) to split; the others are passed whole to every call.

    Returns:
        A function with ``fn``'s signature and output: the value, every floating ``aux`` leaf and the
        gradient averaged over micro-batches (integer ``aux`` leaves, such as counts, summed).
    """
    if not (isinstance(num, int) and num >= 1):
        raise ValueError(f"microbatch: num must be an integer >= 1, found {num!r}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for a in nums:
            if a >= len(args):
                raise ValueError(f"microbatch: argnums {a} but the function got {len(args)} positional arguments")
        slices = {a: _split(args[a], num, a) for a in nums}
        ctx = layout.current()
        # inside a parallelized step the gradients stay per rank until the last micro-batch
        with (ctx.accumulate() if ctx is not None else contextlib.nullcontext()) as acc:
            total_out, total_g = None, None
            for k in range(num):
                call = list(args)
                for a in nums:
                    call[a] = slices[a][k]
                out, g = fn(*call, **kwargs)
                total_out = out if total_out is None else _tree.tree_map(torch.add, total_out, out)
                total_g = g if total_g is None else _tree.tree_map(torch.add, total_g, g)
            if acc is not None:
                total_g = acc.reduce(total_g)
        mean = lambda x: x / num if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) else x  # noqa: E731
        return _tree.tree_map(mean, total_out), _tree.tree_map(mean, total_g)

    return wrapped
