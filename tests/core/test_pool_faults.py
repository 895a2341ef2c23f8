"""RankPool under real faults: a rank killed (SIGKILL) or stopped (SIGSTOP) between or during runs, a
rank that exits in the function, an interrupted run, the caller killed, a program read from stdin.
Every test checks by pid that no rank process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hpfunc.testing import RankError, RankPool, RankTimeout

pytestmark = pytest.mark.multirank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(pid: int) -> str | None:
    """The process's scheduler state letter, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _wait_gone(pids, timeout: float = 20.0, *, zombie_ok: bool = False) -> list[int]:
    """Wait until none of ``pids`` runs; return those still there. ``zombie_ok``: an exited process
    that its (not our) parent has not reaped yet counts as gone."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if _state(p) is not None and not (zombie_ok and _state(p) == "Z")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _getpid():
    return os.getpid()


def _barrier():
    import torch.distributed as dist

    dist.barrier()
    return dist.get_rank()


@pytest.fixture(scope="module")
def pool():
    """One pool of 2 for this module (each test leaves it able to run; a fresh start costs seconds)."""
    p = RankPool(2, timeout=60)
    seen: list[int] = []
    p.seen = seen  # every pid this pool ever had, checked at the end
    yield p
    seen += p.pids
    p.close()
    assert _wait_gone(seen, timeout=5) == [], "RankPool.close() left rank processes behind"


def _started(pool: RankPool) -> list[int]:
    pool.start()
    pool.seen += pool.pids
    assert pool.run(_getpid) == pool.pids
    return pool.pids


@pytest.mark.parametrize("rank", [1, 0])
def test_rank_killed_between_runs_restarts_transparently(pool, rank):
    old = _started(pool)
    restarts = pool.restarts
    os.kill(old[rank], signal.SIGKILL)
    deadline = time.monotonic() + 10  # until the process has exited (its last thread too) and the pool sees it
    while pool.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.alive, f"rank {rank} (pid {old[rank]}) still runs 10 s after SIGKILL"
    assert pool.run(_barrier) == [0, 1], "the next run must start fresh ranks, not fail"
    new = pool.pids
    pool.seen += new
    assert not set(new) & set(old), f"expected fresh rank processes, found {new} (old {old})"
    assert pool.restarts == restarts + 1
    assert f"rank {rank} of 2 (pid {old[rank]}) was killed by signal SIGKILL between runs" in pool.last_restart_reason
    assert _wait_gone(old) == [], f"old ranks left behind: {old}"


def _exit_on_rank1(code):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()  # rank 0 waits for rank 1, which is gone


def _sleep_then_barrier(seconds):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(seconds)
    dist.barrier()


@pytest.mark.parametrize("how", ["os._exit", "SIGKILL from outside"])
def test_rank_dies_during_run_raises_rank_error(pool, how):
    old = _started(pool)
    t0 = time.monotonic()
    if how == "os._exit":
        with pytest.raises(RankError, match=rf"rank 1 of 2 \(pid {old[1]}\) exited with status 7 while running "
                                            r"'_exit_on_rank1'; the other ranks were stopped"):
            pool.run(_exit_on_rank1, 7)
    else:
        killer = threading.Timer(1.0, os.kill, (old[0], signal.SIGKILL))
        killer.start()
        try:
            with pytest.raises(RankError, match=rf"rank 0 of 2 \(pid {old[0]}\) was killed by signal SIGKILL "
                                                r"while running '_sleep_then_barrier'"):
                pool.run(_sleep_then_barrier, 30)
        finally:
            killer.cancel()
    # at once, not after the run's timeout (60 s) nor the grace period for the other ranks (10 s)
    assert time.monotonic() - t0 < 8, "a dead rank must end the run at once"
    assert pool.pids == [] and _wait_gone(old) == [], f"ranks left behind: {old}"
    assert pool.run(_barrier) == [0, 1]
    pool.seen += pool.pids


def test_stopped_rank_times_out_and_is_killed(pool):
    old = _started(pool)
    os.kill(old[1], signal.SIGSTOP)
    try:
        with pytest.raises(RankTimeout, match=rf"rank 1 \(pid {old[1]}\) \(stopped: SIGSTOP or SIGTSTP\)"):
            pool.run(_barrier, timeout=3)
    finally:
        if _state(old[1]) == "T":
            os.kill(old[1], signal.SIGCONT)
    assert _wait_gone(old) == [], f"a stopped rank must be killed too: {old}"
    assert pool.run(_barrier) == [0, 1]
    pool.seen += pool.pids


def test_interrupted_run_stops_ranks_and_next_run_is_clean(pool):
    old = _started(pool)
    # a real SIGINT to this thread (Ctrl-C): it interrupts the pool's wait for the ranks' answers
    interrupter = threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run(lambda: time.sleep(30) or "late")
    finally:
        interrupter.cancel()
    assert _wait_gone(old) == [], f"an interrupted run left ranks behind: {old}"
    # the interrupted function's late answers must not come back as this run's
    assert pool.run(lambda: "fresh") == ["fresh", "fresh"]
    pool.seen += pool.pids


def _script(body: str) -> str:
    return textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from hpfunc.testing import RankPool
        def hang():
            import torch, torch.distributed as dist
            if dist.get_rank() == 1:
                dist.all_reduce(torch.ones(1))   # rank 0 never joins: rank 1 waits inside gloo
            else:
                time.sleep(600)
        """) + textwrap.dedent(body)


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_program_from_stdin_runs_and_ranks_exit_with_their_caller():
    # `python - <<EOF`: the main module has no file; spawn-based pools failed to start with EOFError
    prog = _script("""
        pool = RankPool(2, timeout=600).start()
        print("result", pool.run(lambda: 6 * 7), flush=True)
        print("pids", *pool.pids, flush=True)
        pool.run(hang)
        """)
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    pids: list[int] = []
    try:
        proc.stdin.write(prog)
        proc.stdin.close()
        first = proc.stdout.readline()
        assert first.strip() == "result [42, 42]", (first, proc.stderr.read() if proc.poll() is not None else "")
        pids = [int(x) for x in proc.stdout.readline().split()[1:]]
        assert len(pids) == 2
        time.sleep(0.5)  # both ranks inside hang(): one in a gloo collective, one sleeping
        proc.kill()  # the caller dies without closing its pool
        proc.wait(10)
        # the ranks' parent is gone: they are reparented (possibly to a PID 1 that never reaps them)
        assert _wait_gone(pids, timeout=15, zombie_ok=True) == [], f"ranks outlived their caller: {pids}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in pids:
            if _state(p) not in (None, "Z"):
                os.kill(p, signal.SIGKILL)
