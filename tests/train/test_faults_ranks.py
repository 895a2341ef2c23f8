"""No orphaned or hung ranks: ``hpfunc train`` and ``hpfunc launch`` under real faults.

A ``kill -9`` of the launcher takes its ranks with it; a rank stopped with SIGSTOP, or a collective
that only one rank calls, ends the job within the collective timeout with a message naming the rank
and the collective; SIGTERM to the launcher stops the ranks with one clean line; a wrong ``--nproc``
is a usage error. Every launch test finds the ranks' pids in ``/proc`` (the launcher's children)
and checks that none is left.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc import faults
from hpfunc.launch import main as launch_main
from hpfunc.train.config import ConfigError, config_to_dict, load_config_dict

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from Linux /proc")


# ---------------------------------------------------------------------------------------------
# Processes, from /proc


from hpfunc.faults import _stat  # (state letter, parent pid) from /proc, or None


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pid and st[0] != "Z":
                out.append(int(name))
    return sorted(out)


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def _ranks(launcher: int, n: int, timeout: float = 120.0) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's ``n`` rank processes, once they all run."""
    deadline = time.monotonic() + timeout
    while True:
        found = {r: p for p in _children(launcher) if (r := _rank_of(p)) is not None}
        if len(found) == n or time.monotonic() > deadline:
            assert len(found) == n, f"expected {n} ranks under pid {launcher}, found {found}"
            return found
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # an exited rank whose new parent has not reaped it is gone


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if _alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the launcher exited ({proc.returncode}) before {what}:\n{log.read_text() if log else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout} s:\n{log.read_text() if log else ''}")
        time.sleep(0.05)


class _Launch:
    """A launcher process with its output in files, every pid it ever had as a child remembered,
    and everything killed at the end (also when the test fails)."""

    def __init__(self, argv, cwd, env=None):
        self.out = cwd / "launcher.out"
        self.err = cwd / "launcher.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=o, stderr=e, env=env or _env(),
                                         start_new_session=True)
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.seen.update(_children(self.proc.pid))
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {timeout} s:\n{self.err.read_text()[-4000:]}")

    def stderr(self) -> str:
        return self.err.read_text()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for pid in [self.proc.pid, *self.seen]:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.proc.wait(timeout=10)
        # a launcher killed with -9 cannot remove its heartbeat folder
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"hpfunc-heartbeat-{self.proc.pid}-*")):
            shutil.rmtree(d, ignore_errors=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", faults.ENV_LAUNCHER_PID,
                faults.ENV_TIMEOUT, faults.ENV_HEARTBEAT_DIR):
        env.pop(key, None)  # the command launches its own ranks
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def _train_config(tmp_path, **parallel) -> str:
    write_corpus(tmp_path / "corpus")
    cfg = {**TINY,
           "train": {**TINY["train"], "steps": 100000, "log_every": 1, "eval_every": 0},  # runs until stopped
           "output": {**TINY["output"], "dir": str(tmp_path / "out"), "sample_tokens": 0, "plot": False},
           "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"], **parallel}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# Rank 1 calls psum over the last mesh axis; the others sleep. On 4 ranks that axis ('tp') is a
# group of the mesh, not the world: the timeout must reach the mesh's own groups too.
HANG = """
    import os, pathlib, sys, time
    import torch, hpfunc
    mesh = hpfunc.Mesh({"dp": 2, "tp": 2} if os.environ["WORLD_SIZE"] == "4" else {"dp": 2})
    axis = mesh.axis_names[-1]
    pathlib.Path(sys.argv[1], f"ready{os.environ['RANK']}").write_text("")
    if os.environ["RANK"] == "1":
        with mesh:
            hpfunc.lax.psum(torch.ones(3), axis)  # the line no other rank reaches
    else:
        time.sleep(300)
"""


def _hang_script(tmp_path) -> tuple[str, int]:
    path = tmp_path / "hang.py"
    path.write_text(textwrap.dedent(HANG))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "hpfunc.lax.psum" in text)
    return str(path), line


# ---------------------------------------------------------------------------------------------
# Without ranks: usage errors, the config key, the messages, the watchdog


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0", "x.py"], "--nproc: expected a number of processes >= 1 (e.g. --nproc 2), found '0'"),
    (["--nproc", "abc", "x.py"], "--nproc: expected a number of processes >= 1 (e.g. --nproc 2), found 'abc'"),
    (["-n", "-2", "x.py"], "-n: expected a number of processes >= 1"),
    (["--nproc-per-node=1.5", "x.py"], "--nproc-per-node: expected a number of processes >= 1"),
    (["--nproc", "2", "--timeout", "0", "x.py"], "--timeout: expected a number of seconds > 0 (e.g. 300), found '0'"),
    (["--nproc", "2", "--timeout=soon", "x.py"], "--timeout: expected a number of seconds > 0"),
    (["--nproc", "2", "--timeout"], "--timeout needs a value"),
    (["--nproc", "2"], "missing the script to run"),
])
def test_launch_usage_errors_exit_2_with_the_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        launch_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpfunc launch: {message}"), err
    assert "usage: hpfunc launch --nproc N [--timeout S] script.py" in err
    assert "Traceback" not in err


def test_parallel_timeout_s_is_checked_and_kept():
    assert load_config_dict({}).parallel.timeout_s == faults.DEFAULT_TIMEOUT_S == 300
    cfg = load_config_dict({"parallel": {"mesh": {"dp": 2}, "plan": ["ddp"], "timeout_s": 10}})
    assert cfg.parallel.timeout_s == 10.0
    assert load_config_dict(config_to_dict(cfg)) == cfg  # config.yaml of the run holds it
    for bad, found in [(0, "integer 0"), (-5, "integer -5"), ("1m", "string '1m'"), (True, "boolean True"),
                       (float("inf"), "number inf")]:
        with pytest.raises(ConfigError, match=rf"^parallel\.timeout_s: expected a number of seconds > 0 .*found "
                                              rf"{found}$"):
            load_config_dict({"parallel": {"mesh": {"dp": 2}, "plan": ["ddp"], "timeout_s": bad}})
    with pytest.raises(ConfigError, match="parallel.timeout: unknown key; did you mean 'timeout_s'"):
        load_config_dict({"parallel": {"timeout": 10}})


GLOO_TIMEOUT = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                            "waiting 10000ms for recv operation to complete")
GLOO_PEER = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                         "[127.0.0.1]:5261. This is typically caused by a remote worker crashing.")


@linux_only
def test_collective_error_names_the_rank_the_collective_and_the_silent_peer(tmp_path, monkeypatch):
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        # the stop takes effect when the kernel next runs the child's signal handling: on a loaded machine
        # that is after kill() returns, so wait for /proc to say so before asking for the message
        deadline = time.monotonic() + 30
        while (_stat(stopped.pid) or ("?",))[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "rank0").write_text(f"{os.getpid()}\n")
        (tmp_path / "rank1").write_text(f"{stopped.pid}\n")
        (tmp_path / "rank2").write_text(f"{os.getpid()}\n")
        old = time.time() - 12
        os.utime(tmp_path / "rank1", (old, old))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv(faults.ENV_HEARTBEAT_DIR, str(tmp_path))
        here = os.path.dirname(faults.__file__)
        frames = [(os.path.join(here, "lax.py"), 156), (os.path.join(os.path.dirname(here), "train.py"), 42)]
        msg = str(faults.collective_error(GLOO_TIMEOUT, name="all_gather", axes=("fsdp",), n=2, frames=frames))
        assert msg.startswith("rank 0: all_gather over mesh axis 'fsdp' (2 ranks), issued at train.py:42, timed out "
                              "after 10 s (the collective timeout; gloo: Timed out waiting 10000ms for recv operation "
                              "to complete); "), msg
        # 12 s old when written; a loaded machine may take seconds more to get here
        assert (re.search(rf"rank 1 \(pid {stopped.pid}\) has sent no heartbeat for (1[2-9]|[2-9]\d)\.\d", msg)
                and "(its process is stopped: SIGSTOP or SIGTSTP): that rank is stopped or hung, look there" in msg), msg
        assert "rank 2" not in msg and "parallel.timeout_s" in msg

        os.utime(tmp_path / "rank1")  # every rank alive: the ranks disagree on the collectives
        msg = str(faults.collective_error(GLOO_TIMEOUT, name="psum", axes=("dp", "tp"), n=4, frames=frames))
        assert "psum over mesh axes 'dp', 'tp' (4 ranks)" in msg
        assert "every other rank is alive" in msg and "did not issue the same collective" in msg

        msg = str(faults.collective_error(GLOO_PEER, name="psum", axes=("dp",), n=2, frames=frames))
        assert "failed: a peer of this group closed its connection (gloo: Connection closed by peer [127.0.0.1]:5261)" \
               in msg and "another rank exited or was killed" in msg
    finally:
        stopped.kill()
        stopped.wait()
    assert faults.is_comm_failure(GLOO_TIMEOUT) and faults.is_comm_failure(GLOO_PEER)
    assert not faults.is_comm_failure(RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"))
    assert not faults.is_comm_failure(ValueError("Timed out"))


@linux_only
def test_watchdog_names_and_kills_a_rank_whose_heartbeat_stopped(tmp_path):
    import io

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stream = io.StringIO()
    try:
        with faults.Watchdog(nproc=2, timeout_s=0.5, who="hpfunc launch", stream=stream) as dog:
            env = dog.env()
            assert env[faults.ENV_LAUNCHER_PID] == str(os.getpid()) and os.path.isdir(env[faults.ENV_HEARTBEAT_DIR])
            beat = faults.Heartbeat(env[faults.ENV_HEARTBEAT_DIR], 0, 0.05).start()  # a live rank: this process
            with open(os.path.join(env[faults.ENV_HEARTBEAT_DIR], "rank1"), "w") as f:
                f.write(f"{child.pid}\n")  # a rank that never beats
            os.kill(child.pid, signal.SIGSTOP)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the watchdog did not kill the silent rank: {stream.getvalue()!r}")
            beat.stop()
            assert sorted(dog.killed) == [1]
        assert not os.path.exists(env[faults.ENV_HEARTBEAT_DIR])
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    line = stream.getvalue()
    assert line.startswith(f"hpfunc launch: rank 1 of 2 (pid {child.pid}) stopped responding: no heartbeat for ")
    assert "longer than the collective timeout of 0.5 s; its process is stopped: SIGSTOP or SIGTSTP; killing it" in line


# ---------------------------------------------------------------------------------------------
# Real launches


@linux_only
@pytest.mark.multirank
@pytest.mark.slow
def test_kill_9_of_the_train_launcher_takes_its_ranks_with_it(tmp_path):
    launch = _Launch(["-m", "hpfunc.cli", "train", _train_config(tmp_path)], tmp_path)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        _wait_for(lambda: len(_lines(metrics)) >= 2, 180, "two logged steps", launch.proc, launch.err)
        ranks = _ranks(launch.proc.pid, 2)
        os.kill(launch.proc.pid, signal.SIGKILL)
        assert _wait_gone(ranks.values(), timeout=5) == [], f"ranks {ranks} outlived their launcher"
        written = metrics.read_bytes()
        time.sleep(1.5)  # nothing may write once the ranks are gone
        assert metrics.read_bytes() == written
        assert len(written.splitlines()) >= 2  # what was logged before the kill is kept
    finally:
        launch.close()


@linux_only
@pytest.mark.multirank
@pytest.mark.slow
def test_kill_9_of_hpfunc_launch_takes_its_ranks_with_it(tmp_path):
    script = tmp_path / "tick.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        log = os.path.join(sys.argv[1], f"tick{os.environ['RANK']}")
        while True:
            with open(log, "a") as f:
                f.write("tick\\n")
            time.sleep(0.05)
    """))
    launch = _Launch(["-m", "hpfunc.launch", "--nproc", "2", str(script), str(tmp_path)], tmp_path)
    try:
        ticks = [tmp_path / "tick0", tmp_path / "tick1"]
        _wait_for(lambda: all(len(_lines(t)) >= 3 for t in ticks), 120, "both ranks ticking", launch.proc,
                  launch.err)
        ranks = _ranks(launch.proc.pid, 2)
        os.kill(launch.proc.pid, signal.SIGKILL)
        assert _wait_gone(ranks.values(), timeout=5) == [], f"ranks {ranks} outlived their launcher"
        counts = [len(_lines(t)) for t in ticks]
        time.sleep(1.0)  # twenty ticks' time
        assert [len(_lines(t)) for t in ticks] == counts
    finally:
        launch.close()


@linux_only
@pytest.mark.multirank
@pytest.mark.slow
def test_a_stopped_rank_ends_the_train_job_naming_the_rank_and_the_collective(tmp_path):
    launch = _Launch(["-m", "hpfunc.cli", "train", _train_config(tmp_path, timeout_s=10)], tmp_path)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        _wait_for(lambda: len(_lines(metrics)) >= 2, 180, "two logged steps", launch.proc, launch.err)
        ranks = _ranks(launch.proc.pid, 2)
        os.kill(ranks[1], signal.SIGSTOP)
        logged = _lines(metrics)
        t0 = time.monotonic()
        code = launch.wait(timeout=60)
        took = time.monotonic() - t0
        assert _wait_gone(ranks.values(), timeout=5) == []
        assert _wait_gone(launch.seen, timeout=5) == []
    finally:
        launch.close()
    err = launch.stderr()
    assert code == 1, err[-4000:]
    assert took < 30, f"the job took {took:.0f} s to end after the stop\n{err[-4000:]}"
    # rank 0 names the collective it waited in and the silent rank; the launcher names and kills it
    assert re.search(r"hpfunc train \[rank 0\]: failed: CollectiveError: rank 0: (\w+ over mesh axis 'fsdp' "
                     r"\(2 ranks\)|a torch.distributed collective outside hpfunc.lax, in `.*`).*, issued at hpfunc/",
                     err), err[-4000:]
    assert f"rank 1 (pid {ranks[1]}) has sent no heartbeat for " in err or "closed its connection" in err
    assert f"hpfunc train: rank 1 of 2 (pid {ranks[1]}) stopped responding: no heartbeat for " in err
    assert "longer than the collective timeout of 10 s; its process is stopped: SIGSTOP or SIGTSTP; killing it" in err
    assert "hpfunc: rank " in err and "The other ranks were stopped." in err
    kept = _lines(metrics)
    assert kept[:len(logged)] == logged and all(json.loads(x)["loss"] > 0 for x in logged)


@linux_only
@pytest.mark.multirank
@pytest.mark.slow
def test_a_collective_only_one_rank_calls_times_out_naming_rank_and_line(tmp_path):
    script, line = _hang_script(tmp_path)
    launch = _Launch(["-m", "hpfunc.launch", "--nproc", "4", "--timeout", "5", script, str(tmp_path)], tmp_path)
    try:
        _wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(4)), 180, "all four ranks",
                  launch.proc, launch.err)
        t0 = time.monotonic()
        code = launch.wait(timeout=60)
        took = time.monotonic() - t0
        assert _wait_gone(launch.seen, timeout=5) == []
    finally:
        launch.close()
    err = launch.stderr()
    assert code == 1, err[-4000:]
    assert took < 30, f"the job took {took:.0f} s to end\n{err[-4000:]}"
    assert (f"CollectiveError: rank 1: psum over mesh axis 'tp' (2 ranks), issued at {script}:{line}, timed out "
            f"after 5 s (the collective timeout; gloo: Timed out waiting 5000ms") in err, err[-4000:]
    assert "every other rank is alive" in err and "did not issue the same collective" in err
    assert ("hpfunc: rank 1 of 4 failed (exit status 1); its error is printed above. The other ranks were "
            "stopped.") in err
    assert len(launch.seen) >= 4


@linux_only
@pytest.mark.multirank
@pytest.mark.slow
def test_sigterm_to_hpfunc_launch_during_a_hang_stops_the_ranks_cleanly(tmp_path):
    script, _ = _hang_script(tmp_path)
    launch = _Launch(["-m", "hpfunc.launch", "--nproc", "2", script, str(tmp_path)], tmp_path)
    try:
        _wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), 120, "both ranks",
                  launch.proc, launch.err)
        ranks = _ranks(launch.proc.pid, 2)
        os.kill(launch.proc.pid, signal.SIGTERM)
        code = launch.wait(timeout=40)
        assert _wait_gone(ranks.values(), timeout=5) == []
    finally:
        launch.close()
    err = launch.stderr()
    assert code == 128 + signal.SIGTERM, err[-4000:]
    assert err.rstrip().endswith("hpfunc launch: stopped by SIGTERM; the ranks were stopped"), err[-4000:]
    assert "Traceback" not in err and "SignalException" not in err
