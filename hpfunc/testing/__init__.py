"""Testing SPMD code: a persistent rank pool, hypothesis strategies and parity assertions.

Public: users test their own models and transforms with it.
"""

from hpfunc.testing.pool import RankError, RankPool, RankTimeout

__all__ = ["RankPool", "RankError", "RankTimeout"]
