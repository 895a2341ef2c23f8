"""Session-wide fixtures: persistent pools of gloo ranks shared by every multi-rank test."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from hpfunc.testing import RankPool

# Property tests: at least 50 examples in CI (the bar); no per-example deadline (ranks share 2 cores).
# Under CI (CI=true) the examples are derandomized: the same 50 per property on every run, so a
# submission lands or not on its own merits; locally each run explores new examples.
settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True, derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests use tiny tensors: extra intra-op threads only spin (up to 60x slower under load on 2 cores).
torch.set_num_threads(1)

# Checked mode for shard_map replication promises, in the ranks and in this process.
RANK_ENV = {"HPFUNC_CHECK_REP": "1", "PYTHONWARNINGS": "ignore"}
os.environ.setdefault("HPFUNC_CHECK_REP", "1")


class Pools:
    """Lazily started pools, one per world size, alive for the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, n: int) -> RankPool:
        pool = self._pools.get(n)
        if pool is None:
            pool = RankPool(n, timeout=float(os.environ.get("HPFUNC_TEST_TIMEOUT", "180")), env=RANK_ENV)
            self._pools[n] = pool
        return pool.start()

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` is a running :class:`RankPool` of ``n`` gloo ranks, reused by every test."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool2(pools):
    return pools(2)


@pytest.fixture(scope="session")
def pool4(pools):
    return pools(4)


@pytest.fixture(scope="session")
def pool8(pools):
    return pools(8)


@pytest.fixture(scope="module", autouse=True)
def _no_default_process_group_left_behind():
    """A default process group that a module's tests made in this process (a one-rank ``hpfunc.Mesh``
    initialises one) is destroyed when the module ends: left behind, it made the modules that need a
    world of their own (torch's own pipeline schedules on the fake process group) skip silently."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()
