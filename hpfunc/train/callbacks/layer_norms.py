"""``layer_norms``: the norm of each layer's parameters, computed where they live.

Every rank sums the squares of the blocks it holds; one ``all_reduce`` of a small table (per leaf: the
squares, the number of ranks holding it, its number of distinct blocks) gives each leaf's global
squared norm (a block replicated on ``k`` ranks is counted ``k`` times and divided by ``k``), grouped by
layer (``layers.<i>`` for a path under ``layers.<i>.``, otherwise the path's first component: ``embed``,
``final_norm``, ...). No parameter is gathered, and no partial value is written as a global one. The squares sum to the
squared global norm (``total``).

Each ``every``-th step, a line of ``norms.jsonl`` (rank 0 writes):
``{"step": n, "param_norm": {"embed": ..., "layers.0": ..., ...}, "total": ...}``. The callback runs on
every rank (it joins a collective).

    callbacks: [{layer_norms: {every: 10}}]

    >>> import torch
    >>> norms = group_sq_norms({"embed": torch.ones(2, 2), "layers": [{"w": torch.ones(3)}]})
    >>> norms
    {'embed': 4.0, 'layers.0': 3.0}
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from hpfunc.train.callbacks.base import WriterCallback, open_lines

__all__ = ["LayerNorms", "group_of", "group_order", "group_sq_norms"]

_LAYER = re.compile(r"^(layers\.\d+)(\.|$)")


def group_of(path: str) -> str:
    """``layers.3.attn.wq`` -> ``layers.3``; ``embed`` -> ``embed``; ``final_norm.w`` -> ``final_norm``."""
    m = _LAYER.match(path)
    return m.group(1) if m else path.split(".", 1)[0]


def _local_sq(x: Any) -> tuple[torch.Tensor, int]:
    """``(squares of this rank's block, number of distinct blocks of the leaf)``: for a DTensor, the product
    of the mesh sizes of its sharded dimensions; a plain tensor is one block."""
    from torch.distributed.tensor import DTensor

    shards = 1
    if isinstance(x, DTensor):
        for dim, placement in enumerate(x.placements):
            if placement.is_shard():
                shards *= x.device_mesh.size(dim)
        x = x.to_local()
    return x.detach().to(torch.float64).pow(2).sum(), shards


def group_sq_norms(params: Any, *, reduce: bool = False) -> dict[str, float]:
    """The squared norm of every group's parameters; ``reduce``: summed over the process group (every rank
    must call it, with the same tree structure; leaves this rank does not hold may be ``None``).

    Every rank that holds a leaf adds its block's squares, the count 1 and the leaf's number of distinct
    blocks, in one vector of three entries per leaf; one ``all_reduce`` of it gives each leaf's
    squares summed over its holders, which hold each block ``holders / blocks`` times (replicas), so
    the leaf's squared norm is ``squares * blocks / holders``, whatever the layout (sharded, replicated,
    or held by one pipeline stage's ranks only).
    """
    from hpfunc import tree

    pairs = tree.leaves(tree.map_with_path(lambda p, x: (p, x), params, none_is_leaf=True),
                        is_leaf=lambda x: isinstance(x, tuple))
    rows = []
    for _, x in pairs:
        if x is None:
            rows.append(torch.zeros(3, dtype=torch.float64))
        else:
            sq, shards = _local_sq(x)
            rows.append(torch.stack([sq, torch.tensor(1.0, dtype=torch.float64),
                                     torch.tensor(float(shards), dtype=torch.float64)]))
    table = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)
    if reduce:
        torch.distributed.all_reduce(table)  # the one reduction: every leaf's squares, holders and blocks
    sq = table[:, 0] * (table[:, 2] / table[:, 1].clamp_min(1)) / table[:, 1].clamp_min(1)
    # table[:, 2] / holders is the leaf's number of blocks (each holder added it); squares * blocks / holders
    out: dict[str, float] = {}
    for (path, _), v in zip(pairs, sq.tolist()):
        out[group_of(path)] = out.get(group_of(path), 0.0) + v
    return {g: out[g] for g in sorted(out, key=group_order)}


def group_order(name: str) -> tuple:
    """The sort key of groups: ``embed`` first, then the layers by index, then the rest by name."""
    m = _LAYER.match(name)
    return (1, int(name.split(".")[1]), "") if m else (0 if name == "embed" else 2, 0, name)


class LayerNorms(WriterCallback):
    """Per-layer parameter norms every ``every`` steps to ``file`` (all ranks compute, rank 0 writes)."""

    every_rank = True

    def __init__(self, *, every: int = 1, file: str = "norms.jsonl"):
        if every < 1:
            raise ValueError(f"every: expected an integer >= 1, found {every}")
        self.every, self.file = every, file
        self._writer: Any = None
        self.last: dict[str, Any] | None = None

    def on_train_start(self, trainer: Any) -> None:
        if trainer.main:
            self._writer = open_lines(trainer, self.file)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if step % self.every:
            return
        sq = group_sq_norms(trainer.state.params, reduce=trainer.mesh is not None)
        self.last = {"step": step, "param_norm": {g: math.sqrt(v) for g, v in sq.items()},
                     "total": math.sqrt(sum(sq.values()))}
        if self._writer is not None:
            self._writer.write(self.last)
