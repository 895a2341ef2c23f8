"""``layer_norms``: the norm of each layer's parameters, computed where they live.

Every rank sums the squares of the blocks it holds, grouped by layer (``layers.<i>`` for a path under
``layers.<i>.``, otherwise the path's first component: ``embed``, ``final_norm``, ...); a block that is
replicated over some mesh axes is counted by the replica at coordinate 0 of those axes only; then one
``all_reduce`` of the vector of group sums over the mesh gives every group's global squared norm. No
parameter is gathered, and no partial value is written as a global one. The squares sum to the
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

from hpfunc.train.callbacks.base import Callback, open_lines

__all__ = ["LayerNorms", "group_of", "group_sq_norms"]

_LAYER = re.compile(r"^(layers\.\d+)(\.|$)")


def group_of(path: str) -> str:
    """``layers.3.attn.wq`` -> ``layers.3``; ``embed`` -> ``embed``; ``final_norm.w`` -> ``final_norm``."""
    m = _LAYER.match(path)
    return m.group(1) if m else path.split(".", 1)[0]


def _local_sq(x: Any) -> torch.Tensor:
    """This rank's contribution to ``x``'s squared norm: its block's, or 0 on a replica that does not count."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        coord = x.device_mesh.get_coordinate()
        if coord is None:  # this rank is not in the tensor's mesh
            return torch.zeros((), dtype=torch.float64)
        for dim, placement in enumerate(x.placements):
            if placement.is_replicate() and coord[dim] != 0:
                return torch.zeros((), dtype=torch.float64)
        x = x.to_local()
    return x.detach().to(torch.float64).pow(2).sum()


def group_sq_norms(params: Any, *, reduce: bool = False) -> dict[str, float]:
    """The squared norm of every group's parameters; ``reduce``: summed over the process group (every rank
    must call it, with the same tree structure; leaves this rank does not hold may be ``None``)."""
    from hpfunc import tree

    groups: dict[str, list[Any]] = {}
    pairs = tree.leaves(tree.map_with_path(lambda p, x: (p, x), params, none_is_leaf=True),
                        is_leaf=lambda x: isinstance(x, tuple))
    for path, x in pairs:
        groups.setdefault(group_of(path), []).append(x)
    names = sorted(groups, key=_order)
    sums = torch.stack([sum((_local_sq(x) for x in groups[g] if x is not None),
                            torch.zeros((), dtype=torch.float64)) for g in names])
    if reduce:
        torch.distributed.all_reduce(sums)  # the one reduction: every group at once
    return dict(zip(names, sums.tolist()))


def _order(name: str) -> tuple:
    m = _LAYER.match(name)
    return (1, int(name.split(".")[1]), "") if m else (0 if name == "embed" else 2, 0, name)


class LayerNorms(Callback):
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

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
