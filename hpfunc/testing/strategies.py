"""Hypothesis strategies for SPMD tests: mesh shapes, specs valid for a shape, shapes, seeds, dtypes.

Meshes are described by plain ``{axis: size}`` dicts (picklable), built into a :class:`hpfunc.Mesh`
on the ranks.

    >>> from hypothesis import given
    >>> from hpfunc.testing import strategies as hst
    >>> @given(hst.mesh_shapes(4))
    ... def test_world(shape):
    ...     import math
    ...     assert math.prod(shape.values()) == 4
    >>> test_world()
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

try:
    from hypothesis import strategies as st
except ModuleNotFoundError as err:  # a test-only dependency: say which extra brings it
    if err.name != "hypothesis":
        raise
    raise ModuleNotFoundError(
        "hpfunc.testing.strategies needs hypothesis, which is not installed; install the test extra "
        "(pip install -e \".[test]\") or hypothesis itself (pip install hypothesis)", name="hypothesis") from err

from hpfunc.sharding import P

__all__ = ["AXIS_NAMES", "mesh_shapes", "shapes", "specs", "seeds", "dtypes", "axis_subsets", "factorizations"]

AXIS_NAMES = ("x", "y", "z")


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """All ordered tuples of ``parts`` integers >= 1 whose product is ``n`` (sizes of 1 excluded
    unless ``n == 1``)."""
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(2 if n > 1 else 1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, parts - 1):
                out.append((d,) + rest)
    return out


@st.composite
def mesh_shapes(draw, world: int | Sequence[int] = (1, 2, 4, 8), max_axes: int = 3,
                names: Sequence[str] = AXIS_NAMES) -> dict[str, int]:
    """``{axis: size}`` with 1 to ``max_axes`` named axes whose product is the world size."""
    worlds = [world] if isinstance(world, int) else list(world)
    w = draw(st.sampled_from(worlds))
    options = [f for k in range(1, max_axes + 1) for f in factorizations(w, k)]
    sizes = draw(st.sampled_from(options))
    return dict(zip(names, sizes))


@st.composite
def shapes(draw, min_rank: int = 1, max_rank: int = 3, min_side: int = 1, max_side: int = 8,
           multiple_of: Sequence[int] | None = None) -> tuple[int, ...]:
    """A tensor shape; ``multiple_of[d]`` forces dimension ``d`` to be a multiple of it."""
    rank = draw(st.integers(min_rank, max_rank))
    out = []
    for d in range(rank):
        m = multiple_of[d] if multiple_of and d < len(multiple_of) else 1
        lo = max(1, -(-min_side // m))
        out.append(m * draw(st.integers(lo, max(lo, max_side // m))))
    return tuple(out)


@st.composite
def specs(draw, shape: Sequence[int], mesh_shape: dict[str, int], *, even: bool = True,
          allow_multi: bool = True) -> P:
    """A spec valid for ``shape`` on a mesh of ``mesh_shape``: each axis used at most once, several
    axes on one dimension in mesh order; with ``even`` every split divides its dimension."""
    names = list(mesh_shape)
    unused = [a for a in names if mesh_shape[a] > 1] + [a for a in names if mesh_shape[a] == 1]
    parts: list = []
    for d, size in enumerate(shape):
        choices = [a for a in names if a in unused]
        k = draw(st.integers(0, min(len(choices), 2 if allow_multi else 1)))
        picked = list(draw(st.permutations(choices))[:k]) if choices else []
        picked = sorted(picked, key=names.index)
        if even and size % math.prod(mesh_shape[a] for a in picked):
            picked = []
        for a in picked:
            unused.remove(a)
        parts.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    while parts and parts[-1] is None and draw(st.booleans()):
        parts.pop()
    return P(*parts)


@st.composite
def axis_subsets(draw, mesh_shape: dict[str, int], min_size: int = 1, any_order: bool = True) -> tuple[str, ...]:
    """A non-empty tuple of distinct axes (in mesh order or, with ``any_order``, permuted)."""
    names = list(mesh_shape)
    k = draw(st.integers(min_size, len(names)))
    picked = draw(st.permutations(names))[:k]
    if not any_order:
        picked = sorted(picked, key=names.index)
    return tuple(picked)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for hpfunc.random keys and torch generators."""
    return st.integers(0, 2**31 - 1)


def dtypes(include_bf16: bool = True) -> st.SearchStrategy[torch.dtype]:
    """Floating dtypes the project tests (fp32, and bf16 with its looser tolerance)."""
    return st.sampled_from([torch.float32, torch.bfloat16] if include_bf16 else [torch.float32])
