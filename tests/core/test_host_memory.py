"""``hpfunc.host_memory``: the ranks hpfunc starts get glibc malloc's thresholds raised, unless the
environment sets its own (what that saves is measured by the benches, not here: whether glibc can grow
its heap in place, so keep a block instead of mapping it, depends on the process's address layout)."""

from __future__ import annotations

import os

import pytest

from hpfunc.host_memory import THRESHOLD_BYTES, rank_environment


def test_rank_environment_defaults_and_respects_the_users_choice():
    both = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD_BYTES)}
    assert rank_environment({}) == both == rank_environment({"HPFUNC_HOST_MALLOC": "hpfunc"})
    assert rank_environment({"MALLOC_MMAP_THRESHOLD_": "65536"}) == {}  # the user's own: nothing added
    assert rank_environment({"MALLOC_TRIM_THRESHOLD_": "0"}) == {}
    assert rank_environment({"HPFUNC_HOST_MALLOC": "system"}) == {}
    with pytest.raises(ValueError, match="HPFUNC_HOST_MALLOC='jemalloc'.*'system'"):
        rank_environment({"HPFUNC_HOST_MALLOC": "jemalloc"})


def _environ_of_rank():
    return os.environ.get("MALLOC_MMAP_THRESHOLD_"), os.environ.get("MALLOC_TRIM_THRESHOLD_")


@pytest.mark.multirank
def test_pool_ranks_get_the_thresholds(pool2):
    expected = tuple(rank_environment(os.environ).get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
    if expected == (None, None):  # the test run's environment chose its own allocator settings
        expected = (os.environ.get("MALLOC_MMAP_THRESHOLD_"), os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    assert pool2.run(_environ_of_rank) == [expected] * 2
