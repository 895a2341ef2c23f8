"""The plan bound while a step runs under :func:`hpfunc.parallelize`.

Inside a parallelized step every parameter, gradient and optimizer-state leaf is this rank's block.
Library code that is not elementwise asks this module how a leaf is laid out, so that the same
single-device code gives the single-device answer:

* :func:`hpfunc.value_and_grad` gathers parameters on use and reduces their gradients (the plan's
  engine, see :mod:`hpfunc.transforms.parallelize`);
* :func:`hpfunc.optim.global_norm` (and ``clip_by_global_norm``) sums squares over all shards;
* Muon gathers a sharded matrix before Newton-Schulz;
* :func:`local_block` cuts a global value (an expert-load vector) to the block a leaf holds here.

Outside a parallelized step :func:`current` is ``None`` and every caller keeps its plain path.

Example (no step bound, so library code runs unchanged):
    >>> current() is None
    True
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Iterator, Protocol

import torch

__all__ = ["StepContext", "current", "bind", "local_block", "global_sq_norm", "blocks_sq_norm"]

_state = threading.local()


class StepContext(Protocol):
    """What a parallelized step exposes to shard-unaware library code."""

    mesh: Any

    def leaf(self, path: str, x: torch.Tensor, where: str) -> Any:
        """The plan's ``ResolvedLeaf`` of the parameter at ``path`` (relative to the parameters root),
        after checking that ``x`` has the shape of that parameter's optimizer block here."""

    def value_and_grad(self, fn: Any, argnums: tuple[int, ...], multi: bool, has_aux: bool, args: tuple,
                       kwargs: dict) -> Any:
        """``value_and_grad`` of ``fn`` with the plan's gather-on-use and gradient reduction."""


def current() -> StepContext | None:
    """The step context of the parallelized step running now (``None`` outside, and inside the
    function being differentiated, where the model runs on gathered blocks)."""
    return getattr(_state, "ctx", None)


@contextlib.contextmanager
def bind(ctx: StepContext | None) -> Iterator[None]:
    """Make ``ctx`` current for the ``with`` block (``None`` hides an outer one)."""
    prev = getattr(_state, "ctx", None)
    _state.ctx = ctx
    try:
        yield
    finally:
        _state.ctx = prev


def _opt_axes(leaf: Any, d: int) -> tuple[str, ...]:
    return leaf.spec.opt.dim_axes(d)


def local_block(path: str, full: torch.Tensor) -> torch.Tensor:
    """The block of ``full`` (a value shaped like the whole parameter at ``path``) that this rank's
    optimizer block of that parameter covers; ``full`` itself outside a parallelized step.

    >>> local_block("w", torch.arange(4)).tolist()
    [0, 1, 2, 3]
    """
    ctx = current()
    if ctx is None:
        return full
    from hpfunc import lax

    leaf = ctx.leaf(path, None, "local_block")
    if tuple(full.shape) != tuple(leaf.shape):
        raise ValueError(f"local_block: {path!r} has global shape {tuple(leaf.shape)}, the value has "
                         f"{tuple(full.shape)}")
    for d in range(full.ndim):
        axes = _opt_axes(leaf, d)
        if axes:
            n = lax.axis_size(axes)
            k = full.shape[d] // n
            full = full.narrow(d, lax.axis_index(axes) * k, k)
    return full


def global_sq_norm(paths: list[str], leaves: list[torch.Tensor], where: str) -> torch.Tensor | None:
    """Sum of squares (fp64) of the global tensors whose local blocks are ``leaves``, or ``None``
    outside a parallelized step. Each block counts once: a block replicated on ``k`` ranks adds
    ``1/k`` of its square on each, and one ``psum`` over the whole mesh adds them up."""
    ctx = current()
    if ctx is None:
        return None
    specs = [ctx.leaf(path, x, where).spec.opt for path, x in zip(paths, leaves)]
    return blocks_sq_norm(ctx.mesh, specs, leaves)


def blocks_sq_norm(mesh: Any, opt_specs: list[Any], blocks: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares (fp64) of global tensors given as this rank's blocks laid out by ``opt_specs``
    (inside ``shard_map`` on ``mesh``): one scalar ``psum``."""
    from hpfunc import lax

    # only the axes some block is split on need a sum (on the others every block is whole on every rank)
    split = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1 and any(a in s.axes for s in opt_specs))
    terms = []
    for spec, x in zip(opt_specs, blocks):
        reps = math.prod(mesh.axis_size(a) for a in split if a not in spec.axes)
        terms.append(x.detach().double().pow(2).sum() / reps)
    total = torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64)
    return lax.psum(total, split) if split else total
