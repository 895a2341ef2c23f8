"""hpfunc: JAX-style functional distributed training on PyTorch.

Models and optimizers are pure functions over pytrees of sharded state (DTensors on a named
``Mesh``); parallelism, recompute and swap are composable transforms over them.

    >>> import hpfunc
    >>> from hpfunc import P
    >>> P("dp", None)
    P('dp', None)
"""

from __future__ import annotations

import importlib
from typing import Any

from hpfunc import lax, random, tree
from hpfunc.autodiff import grad, value_and_grad
from hpfunc.comm import comm_stats
from hpfunc.mesh import Mesh, current_mesh, make_mesh
from hpfunc.microbatch import microbatch
from hpfunc.sharding import NamedSharding, P, SpecError, logical_to_spec, reshard, shard, typeof
from hpfunc.transforms.offload import offload
from hpfunc.transforms.pipeline import PipelineError, pipeline_map
from hpfunc.transforms.remat import checkpoint_name, checkpoint_policies, remat
from hpfunc.transforms.shard_map import ReplicationError, shard_map

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "make_mesh",
    "current_mesh",
    "P",
    "NamedSharding",
    "SpecError",
    "ReplicationError",
    "shard",
    "reshard",
    "typeof",
    "logical_to_spec",
    "shard_map",
    "parallelize",
    "parallel_train_step",
    "init_sharded",
    "pipeline_map",
    "PipelineError",
    "remat",
    "offload",
    "checkpoint_name",
    "checkpoint_policies",
    "grad",
    "value_and_grad",
    "microbatch",
    "comm_stats",
    "lax",
    "random",
    "tree",
]

_LAZY_SUBMODULES = {
    "optim", "models", "schedules", "transforms", "train", "testing", "launch", "checkpoint", "plan", "memory",
}


_LAZY_ATTRS = {
    "parallelize": "hpfunc.transforms.state_step",
    "parallel_train_step": "hpfunc.transforms.parallelize",
    "init_sharded": "hpfunc.transforms.parallelize",
}


def __getattr__(name: str) -> Any:
    # Subpackages load on first use so `import hpfunc` stays light (no transformers, matplotlib...).
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"hpfunc.{name}")
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
    raise AttributeError(f"module 'hpfunc' has no attribute {name!r}")
