"""The expert-parallel binding: the mesh axis over which a mixture-of-experts layer's experts are split.

A parallelized step whose plan has an ``ep`` layer (``plans.ep(axis, experts)``) binds its axis around
the function it differentiates. Inside, each rank holds ``E / n`` of every expert stack (dimension 0
of ``w_gate, w_up, w_down``) and its own shard of the batch; an MoE block asks :func:`ep_axis` and, when
one is bound, sends each (token, expert) pair to the rank that holds the expert and back
(:mod:`hpfunc.models.dispatch`). With nothing bound it answers ``None`` and the block is the
single-device one.

    >>> ep_axis() is None
    True
    >>> with expert_parallel("ep"):
    ...     ep_axis()
    'ep'
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from hpfunc.layout.binding import bound, rebind

__all__ = ["expert_parallel", "ep_axis"]

@contextlib.contextmanager
def expert_parallel(axis: str | None) -> Iterator[None]:
    """Bind the mesh axis the expert stacks are split over (``None``: no expert parallelism).
    ``hpfunc.parallelize`` binds the plan's ``ep_axis`` around the differentiated function."""
    with rebind(ep_axis=axis):
        yield


def ep_axis() -> str | None:
    """The bound expert-parallel axis, or ``None``."""
    return bound().ep_axis
