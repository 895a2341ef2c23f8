"""Custom distributed operators: sharding rules for ops the global view does not know, a YAML
registry of them, distributed functions with their own backward, and the supported-operator list.

* :func:`register` (:mod:`hpfunc.ops.register`): an einsum-like rule (``"i j, j k -> i k | sum j"``,
  :mod:`hpfunc.ops.rule`) registered with torch's DTensor sharding registry, optionally with an ``impl``
  on local blocks;
* :func:`load_registry` (:mod:`hpfunc.ops.yaml_registry`): the same from a YAML file; the registry
  shipped for hpfunc's own models is ``hpfunc/ops/registry.yaml``;
* :func:`dfunction` (:mod:`hpfunc.ops.dfunction`): a function on local blocks with in/out specs and a
  hand-written backward (JAX's ``custom_vjp`` inside ``shard_map``);
* :mod:`hpfunc.ops.coverage`: the table of ops Qwen3-class models use and the input placements the
  global view runs them with (``docs/operators.md``).

See ``docs/operators.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpfunc.ops.register import Registration, register, resolve_op
from hpfunc.ops.rule import Rule, RuleError, parse

__all__ = ["register", "Registration", "resolve_op", "Rule", "RuleError", "parse", "load_registry",
           "RegistryError", "shipped_registry", "dfunction", "DFunction", "DFunctionError"]

_LAZY = {
    "load_registry": "hpfunc.ops.yaml_registry",
    "RegistryError": "hpfunc.ops.yaml_registry",
    "shipped_registry": "hpfunc.ops.yaml_registry",
    "dfunction": "hpfunc.ops.dfunction",
    "DFunction": "hpfunc.ops.dfunction",
    "DFunctionError": "hpfunc.ops.dfunction",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpfunc.ops' has no attribute {name!r}")
