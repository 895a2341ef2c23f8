"""The tensor- and sequence-parallel binding, and the building blocks a model calls where its layout
needs a collective.

A parallelized step binds the tensor-parallel axis of its plan (and whether the embedding/head are
split by vocabulary rows, whether activations between blocks are split along the sequence) around
the function it differentiates. A model marks the places where the layout changes; with no axis
bound every building block is the identity, so the same code is the single-device reference:

* :func:`scatter_sequence` (this rank's block along the sequence, no communication),
* :func:`gather_sequence` (all-gather along the sequence before a column-parallel block),
* :func:`reduce_partial` (the sum of a row-parallel block's partial outputs: ``psum``, or under
  sequence parallelism ``psum_scatter`` along the sequence).

    >>> import torch
    >>> x = torch.ones(2, 4, 3)
    >>> tp_axis(), bool(torch.equal(reduce_partial(gather_sequence(scatter_sequence(x))), x))
    (None, True)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hpfunc import lax
from hpfunc.layout.binding import bound, rebind
from hpfunc.layout.step import PlanError

__all__ = ["tensor_parallel", "tp_axis", "sequence_parallel", "vocab_parallel", "scatter_sequence",
           "gather_sequence", "reduce_partial", "check_sequence"]


@contextlib.contextmanager
def tensor_parallel(axis: str | None, *, vocab_parallel: bool = False,
                    sequence_parallel: bool = False) -> Iterator[None]:
    """Bind the mesh axis over which row-parallel outputs are reduced (``None``: no tensor parallelism).

    ``vocab_parallel``: the embedding and head are split by vocabulary rows over it too.
    ``sequence_parallel``: activations between blocks are split along the sequence over it.
    ``hpfunc.parallelize`` binds the plan's ``tp_axis``, ``tp_vocab_parallel`` and
    ``tp_sequence_parallel`` around the differentiated function.
    """
    on = axis is not None
    with rebind(tp_axis=axis, vocab_parallel=bool(vocab_parallel) and on,
                sequence_parallel=bool(sequence_parallel) and on):
        yield


def tp_axis() -> str | None:
    """The bound tensor-parallel axis, or ``None``."""
    return bound().tp_axis


def sequence_parallel() -> bool:
    """Whether activations between blocks are split along the sequence over :func:`tp_axis`."""
    return bound().sequence_parallel


def vocab_parallel() -> bool:
    """Whether the embedding and head are split by vocabulary rows over :func:`tp_axis`."""
    return bound().vocab_parallel


def check_sequence(x: torch.Tensor, path: str, axis: str, n: int) -> None:
    """:class:`PlanError` unless dimension 1 (the sequence) of ``x`` (named ``path``) divides over ``axis``."""
    if x.ndim >= 2 and x.shape[1] % n:
        raise PlanError(f"batch leaf {path!r} of shape {tuple(x.shape)}: dimension 1 (the sequence) must divide "
                        f"evenly over the sequence-parallel axis {axis!r} ({n} ranks); pad the sequence to a "
                        f"multiple of {n}")


def _sequence_block(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    n = lax.axis_size(axis)
    if x.shape[dim] % n:
        raise PlanError(f"sequence parallelism over {axis!r} ({n} ranks) needs dimension {dim} (the sequence) "
                        f"of shape {tuple(x.shape)} to divide evenly; pad the sequence to a multiple of {n}")
    k = x.shape[dim] // n
    return x.narrow(dim, lax.axis_index(axis) * k, k)


def scatter_sequence(x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """Under sequence parallelism, this rank's block of ``x`` (replicated over the axis) along ``dim``:
    no communication; the gradient is zero outside the block and is summed over the axis by whoever
    owns ``x`` (the step, for a replicated parameter). Otherwise ``x``."""
    b = bound()
    return _sequence_block(x, dim, b.tp_axis) if b.sequence_parallel else x


def gather_sequence(x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """Under sequence parallelism, the whole sequence from every rank's block (``all_gather`` along
    ``dim``; its transpose reduce-scatters the gradient). Otherwise ``x``. Use it on the input of a
    column-parallel block."""
    b = bound()
    return lax.all_gather(x, b.tp_axis, axis=dim, tiled=True) if b.sequence_parallel else x


def reduce_partial(y: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """The output of a row-parallel block from this rank's partial sum: ``psum`` over the bound axis,
    or under sequence parallelism ``psum_scatter`` along ``dim`` (this rank's sequence block of the
    sum). Without a bound axis, ``y``."""
    b = bound()
    if b.tp_axis is None:
        return y
    if b.sequence_parallel:
        return lax.psum_scatter(y, b.tp_axis, scatter_dimension=dim, tiled=True)
    return lax.psum(y, b.tp_axis)
