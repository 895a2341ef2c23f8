"""hpfunc: JAX-style functional distributed training on PyTorch.

Models and optimizers are pure functions over pytrees of sharded state (DTensors on a named
``Mesh``); parallelism, recompute and swap are composable transforms over them.

    >>> import hpfunc
    >>> from hpfunc import P
    >>> P("dp", None)
    P('dp', None)

``import hpfunc`` loads only the core (meshes, specs, collectives, random numbers, ``grad``,
communication accounting, micro-batching). The transforms (``hpfunc.shard_map``, ``hpfunc.remat``,
``hpfunc.parallelize``, ``hpfunc.dfunction``, ...) and the subpackages (``hpfunc.models``,
``hpfunc.optim``, ``hpfunc.ops``, ``hpfunc.train``, ...) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpfunc import lax, random, tree
from hpfunc.autodiff import grad, value, value_and_grad
from hpfunc.comm import comm_stats
from hpfunc.mesh import Mesh, current_mesh, make_mesh
from hpfunc.microbatch import microbatch
from hpfunc.sharding import NamedSharding, P, SpecError, logical_to_spec, reshard, shard, typeof

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
    "dfunction",
    "ops",
    "grad",
    "value",
    "value_and_grad",
    "microbatch",
    "comm_stats",
    "lax",
    "random",
    "tree",
]

# Public name -> the module that defines it; imported on first access.
_LAZY_ATTRS = {
    "shard_map": "hpfunc.transforms.shard_map",
    "ReplicationError": "hpfunc.transforms.shard_map",
    "remat": "hpfunc.transforms.remat",
    "checkpoint_name": "hpfunc.transforms.remat",
    "checkpoint_policies": "hpfunc.transforms.remat",
    "offload": "hpfunc.transforms.offload",
    "pipeline_map": "hpfunc.transforms.pipeline",
    "PipelineError": "hpfunc.transforms.pipeline",
    "parallelize": "hpfunc.transforms.parallelize",
    "parallel_train_step": "hpfunc.transforms.parallelize",
    "init_sharded": "hpfunc.transforms.parallelize",
    "dfunction": "hpfunc.ops.dfunction",
}

_LAZY_SUBMODULES = frozenset({
    "optim", "models", "schedules", "transforms", "train", "testing", "launch", "memory", "layout", "saved_tensors",
    "checkpoint", "ops",
})


def __getattr__(name: str) -> Any:
    # Transforms and subpackages load on first use, so `import hpfunc` stays light (no transforms,
    # schedules, models, transformers or matplotlib until asked for).
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"hpfunc.{name}")
    raise AttributeError(f"module 'hpfunc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _LAZY_SUBMODULES)
