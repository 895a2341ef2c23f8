"""The few cross-rank steps a checkpoint needs, on a process group or (no group running) on this process alone.

>>> rank(None), world(None), all_gather("x", None)
(0, 1, ['x'])
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["active", "rank", "world", "barrier", "all_gather", "from_rank0"]


def active() -> bool:
    """Whether a default process group is running."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any) -> int:
    return dist.get_rank(group) if active() else 0


def world(group: Any) -> int:
    return dist.get_world_size(group) if active() else 1


def barrier(group: Any) -> None:
    if active() and world(group) > 1:
        dist.barrier(group=group)


def all_gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not active() or world(group) == 1:
        return [obj]
    out: list[Any] = [None] * world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank0(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank (what rank 0 decided or the error it met)."""
    if not active() or world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
