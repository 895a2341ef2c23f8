"""The context-parallel binding: the mesh axes over which each sequence's tokens are split, and how
attention crosses them.

A parallelized step whose plan has a ``cp`` layer (``plans.cp(axis, impl=...)``) binds a
:class:`ContextParallel` around the function it differentiates. Inside, every rank of the cp axes
receives its data shard's whole sequence (the batch is not split along the sequence by the data path's
sharding) and the model takes its own tokens of it: the sequence is padded to a multiple of ``2 P``
(``P`` ranks), cut into ``2 P`` chunks and rank ``r`` keeps chunks ``r`` and ``2P - 1 - r`` (causal load
balancing; :class:`hpfunc.models.sequence_split.SequenceSplit`), with their global positions for RoPE,
their labels, and an attention that crosses the ranks (:mod:`hpfunc.models.context_attention`). With
nothing bound :func:`cp_binding` answers ``None`` and the model is the single-device one.

    >>> cp_binding() is None
    True
    >>> with context_parallel(ContextParallel("cp", impl="ulysses")):
    ...     cp_binding().axes, cp_binding().impl
    (('cp',), 'ulysses')
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import attrs

from hpfunc import lax
from hpfunc.layout.binding import bound, rebind
from hpfunc.layout.step import PlanError

__all__ = ["IMPLS", "ContextParallel", "context_parallel", "cp_binding"]

# the attention strategies (hpfunc.models.context_attention implements them on local blocks)
IMPLS = ("allgather", "ring", "ulysses", "hybrid")


def _impl(_self: object, _attr: attrs.Attribute, value: str) -> None:
    if value not in IMPLS:
        raise PlanError(f"cp: impl must be one of {', '.join(map(repr, IMPLS))}, found {value!r}")


@attrs.frozen
class ContextParallel:
    """How a step splits sequences over context-parallel ranks (what ``plans.cp`` binds).

    ``axis``: the mesh axis of the split (the ring's for ``hybrid``); ``impl``: the attention strategy
    (:data:`IMPLS`); ``ulysses_axis``: ``hybrid`` only, the axis Ulysses splits the heads over (the
    sequence is split over ``(axis, ulysses_axis)`` flattened, ring index major); ``balanced``: the causal
    load-balancing permutation (else contiguous chunks); ``pad``: pad a sequence whose length does not
    divide into ``2 P`` chunks (else such a length is an error); ``replicate_kv``: Ulysses above the KV
    heads repeats them; ``overlap``: the ring posts the next K, V transfer before the current block.
    """

    axis: str
    impl: str = attrs.field(default="ring", validator=_impl)
    ulysses_axis: str | None = None
    balanced: bool = True
    pad: bool = True
    replicate_kv: bool = False
    overlap: bool = True

    def __attrs_post_init__(self) -> None:
        if (self.impl == "hybrid") != (self.ulysses_axis is not None):
            raise PlanError(f"cp({self.axis!r}, impl={self.impl!r}): ulysses_axis= is "
                            f"{'required' if self.impl == 'hybrid' else 'only for impl=hybrid'} (Ulysses inside "
                            f"it, the ring across {self.axis!r}); found ulysses_axis={self.ulysses_axis!r}")
        if self.ulysses_axis == self.axis:
            raise PlanError(f"cp({self.axis!r}, impl='hybrid'): ulysses_axis must be another mesh axis than the "
                            f"ring's, found {self.ulysses_axis!r} twice")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the sequence is split over, in the split's rank order."""
        return (self.axis,) if self.ulysses_axis is None else (self.axis, self.ulysses_axis)

    @property
    def heads_axis(self) -> str | None:
        """The axis Ulysses splits the heads over (``None`` for allgather and ring)."""
        return {"ulysses": self.axis, "hybrid": self.ulysses_axis}.get(self.impl)

    def size(self) -> int:
        """The number of context-parallel ranks (inside a mesh)."""
        return lax.axis_size(self.axes)

    def rank(self) -> int:
        """This rank's index in the split (inside a mesh)."""
        return lax.axis_index(self.axes)


@contextlib.contextmanager
def context_parallel(value: ContextParallel | None) -> Iterator[None]:
    """Bind a :class:`ContextParallel` (``None``: no context parallelism) for the ``with`` block.
    ``hpfunc.parallelize`` binds its plan's around the differentiated function."""
    with rebind(context_parallel=value):
        yield


def cp_binding() -> ContextParallel | None:
    """The bound :class:`ContextParallel`, or ``None``."""
    return bound().context_parallel
