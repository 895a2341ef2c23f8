"""A batch cut into the schedule's microbatches (every tensor leaf split along dim 0)."""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import tree as _tree
from hpfunc.transforms.pipeline.errors import PipelineError

__all__ = ["split_microbatches"]


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` into ``m`` equal chunks along dim 0.

    Example:
        >>> [mb["x"].tolist() for mb in split_microbatches({"x": torch.arange(4)}, 2)]
        [[0, 1], [2, 3]]

    Raises:
        PipelineError: a leaf's batch dimension is not divisible by ``m``.
    """
    leaves = _tree.leaves_with_paths(batch)
    chunks: dict[str, tuple[torch.Tensor, ...]] = {}
    for path, x in leaves:
        if not isinstance(x, torch.Tensor):
            continue
        if x.dim() == 0 or x.shape[0] % m:
            n = "a scalar" if x.dim() == 0 else f"batch size {x.shape[0]}"
            raise PipelineError(
                f"cannot split batch leaf {path or '<root>'!r} ({n}) into {m} microbatches; the batch size "
                f"must be a multiple of schedule.num_microbatches={m}")
        chunks[path] = torch.chunk(x, m, dim=0)
    return [_tree.map_with_path(lambda p, x: chunks[p][i] if p in chunks else x, batch) for i in range(m)]
