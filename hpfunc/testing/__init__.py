"""Testing SPMD code: a persistent rank pool, hypothesis strategies and parity assertions.

Public: users test their own models and transforms with it.

    >>> from hpfunc.testing import assert_trees_close, RankPool, strategies
"""

from hpfunc.testing import strategies
from hpfunc.testing.parity import assert_parity, assert_trees_close, to_full, tolerance
from hpfunc.testing.pool import RankError, RankPool, RankTimeout

__all__ = ["RankPool", "RankError", "RankTimeout", "assert_parity", "assert_trees_close", "to_full", "tolerance",
           "strategies"]
