"""Testing SPMD code: a persistent rank pool, parity assertions and hypothesis strategies.

Public: users test their own models and transforms with it.

    >>> from hpfunc.testing import assert_trees_close, RankPool

``hpfunc.testing.strategies`` (hypothesis strategies for meshes, specs and shapes) loads on first
use, so the rank pool and the parity assertions work without the ``[test]`` extra (a notebook);
the strategies themselves need ``hypothesis``: ``from hpfunc.testing import strategies``.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpfunc.testing.parity import assert_parity, assert_trees_close, to_full, tolerance
from hpfunc.testing.pool import RankError, RankPool, RankTimeout

__all__ = ["RankPool", "RankError", "RankTimeout", "assert_parity", "assert_trees_close", "to_full", "tolerance",
           "strategies"]


def __getattr__(name: str) -> Any:
    # Only on first use: hypothesis is a test-only dependency.
    if name == "strategies":
        return importlib.import_module("hpfunc.testing.strategies")
    raise AttributeError(f"module 'hpfunc.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
