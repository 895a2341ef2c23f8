"""``parallel.device``: which device the trainer's ranks run on, resolved on this machine before launch.

``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``. A ``cuda`` run starts NCCL and puts
each rank on ``cuda:LOCAL_RANK``; a ``cpu`` run starts gloo. Asking for ``cuda`` where there is none is
a :class:`~hpfunc.train.config.ConfigError` naming the key (``hpfunc train`` exits with status 2 before
any rank starts):

    >>> from hpfunc.train.config import load_config_dict
    >>> resolve_device(load_config_dict({"parallel": {"device": "cpu"}}).parallel)
    'cpu'
    >>> backend_for("cuda"), backend_for("cpu")
    ('nccl', 'gloo')
"""

from __future__ import annotations

import os

import torch

from hpfunc.train.config import ConfigError, ParallelConfig

__all__ = ["resolve_device", "backend_for", "local_device"]


def resolve_device(pc: ParallelConfig, *, cuda_count: int | None = None) -> str:
    """``"cpu"`` or ``"cuda"`` for ``parallel.device`` on this machine (``cuda_count``: the CUDA devices
    seen, default ``torch.cuda.device_count()`` when CUDA is available).

    Raises:
      ConfigError: ``cuda`` asked for on a machine without CUDA, or a one-machine mesh needing more
        processes than it has GPUs (under torchrun's multi-node launch ``LOCAL_WORLD_SIZE`` counts).
    """
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if pc.device == "cpu" or (pc.device == "auto" and cuda_count == 0):
        return "cpu"
    if cuda_count == 0:
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
        raise ConfigError(f"parallel.device: cuda was asked for but this machine has no CUDA device "
                          f"(torch.cuda.is_available() is False: {build}); use parallel.device: cpu, or auto "
                          f"(cuda when available)")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", pc.size))
    if per_node > cuda_count:
        raise ConfigError(f"parallel.device: cuda with {per_node} processes on this machine but it has {cuda_count} "
                          f"GPU(s); one rank per GPU: shrink parallel.mesh or spread it over several machines "
                          f"(docs/gpu.md: several machines)")
    return "cuda"


def backend_for(device: str) -> str:
    """The process-group backend for a device type: NCCL for ``cuda``, gloo for ``cpu``."""
    return {"cuda": "nccl", "cpu": "gloo"}[device]


def local_device(device: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current with ``torch.cuda.set_device``), or ``cpu``."""
    if device != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
