"""Last words and elastic restarts of ``hpfunc train`` on real launched ranks (gloo).

One run is stopped by SIGTERM to its launcher mid-way: the ranks save the last completed step and
exit 143. ``--resume auto`` with ``parallel.max_restarts: 1`` and synchronous saves continues it; a
test hook kills rank 1 (SIGKILL) a few steps later in the first attempt; torch's launcher restarts
the group, which resumes from exactly the newest checkpoint and finishes. Every per-step loss and
learning rate equals an uninterrupted run of the same config on the same mesh, bit for bit (2 ranks:
each launch costs a few seconds of rank start-up on 2 cores). A second test kills one of 4 ranks at
step 7 of a fresh run on {fsdp: 2, tp: 2}, with synchronous checkpoints every 3 steps, so the newest
complete one at the kill is exactly step 6: the restarted group resumes there and loses no step
beyond it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_resume import FSDP2, FSDP2_TP2, STEPS, _cfg, _losses, _run_in_ranks

from hpfunc import checkpoint
from hpfunc.train.fault_hooks import ENV as FAULTS
from hpfunc.train.output import read_metrics


def _env(**extra):
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", FAULTS):
        env.pop(key, None)  # the command launches its own ranks
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


def _train(path, *args, env=None):
    return [sys.executable, "-m", "hpfunc.cli", "train", str(path), *args]


def _said(**outputs):
    """Every launch's whole output, for an assertion message: what a failure needs to be diagnosed."""
    return "".join(f"\n===== {name} =====\n{text}" for name, text in outputs.items())


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


@pytest.mark.multirank
def test_sigterm_saves_the_last_step_and_an_elastic_restart_resumes(tmp_path, pool2):
    path = _cfg(tmp_path, checkpoint={"every": 3}, parallel=FSDP2)
    ref, _ = pool2.run(_run_in_ranks, str(path), str(tmp_path / "ref"), "never", FSDP2)[0]
    out = tmp_path / "out"

    # SIGTERM to the launcher once 6 steps are logged: torch's launcher forwards it to the ranks, which
    # finish the step in progress, agree to stop after the same step and save it
    proc = subprocess.Popen(_train(path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 6:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the run ended (status {proc.returncode}) or took over 240 s before its 6th "
                                 f"step" + _said(stdout=stdout, stderr=stderr))
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError("the run did not end within 120 s of its SIGTERM" +
                             _said(stdout=stdout, stderr=stderr)) from None
    said = _said(**{"SIGTERM run stdout": stdout, "SIGTERM run stderr": stderr})
    assert proc.returncode == 143, said
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert 6 <= last < STEPS, f"last logged step {last}{said}"
    assert f"stopped by SIGTERM after step {last}; saved the checkpoint of step {last}" in stderr, said
    assert checkpoint.latest(out / "checkpoints").name == f"step_{last:08d}", said
    assert checkpoint.info(checkpoint.latest(out / "checkpoints"))["world_size"] == 2

    # resume auto; rank 1 kills itself when step last + 5 begins (at most the last step). This run saves
    # synchronously: every save is complete before the next step begins, so the newest complete checkpoint
    # at the kill is exactly the last multiple of 3 before it (or the SIGTERM's, if none came after it).
    # With asynchronous saves it was that one or an older one, depending on whether the background write
    # finished within the two steps before the kill: under load it sometimes did not (the restart resumed
    # from the SIGTERM's checkpoint), and the test could not say which to expect.
    kill = min(last + 5, STEPS)
    try:
        proc = subprocess.run(_train(path, "--resume", "auto", "--set", "parallel.max_restarts=1", "--set",
                                     "checkpoint.async_save=false"),
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=_env(**{FAULTS: f"kill@{kill}:r1"}))
    except subprocess.TimeoutExpired as e:  # the output so far comes with it (bytes or str)
        raise AssertionError("the resumed run took over 300 s" + said + _said(
            **{"resumed run stdout": _text(e.stdout), "resumed run stderr": _text(e.stderr)})) from None
    said += _said(**{"resumed run stdout": proc.stdout, "resumed run stderr": proc.stderr})
    assert proc.returncode == 0, said
    found = re.search(r"elastic restart 1 of 1: resumed at step (\d+);", proc.stdout)
    assert found, said
    resumed_at = int(found.group(1))
    newest = max(last, 3 * ((kill - 1) // 3))  # the newest checkpoint before the kill
    assert resumed_at == newest, f"resumed at step {resumed_at}, expected {newest}{said}"
    assert "s from the failure (rank 0 lost a peer in step" in proc.stdout, said
    # rank 0's last words are skipped: the heartbeats show rank 1 gone, or (when rank 0 looks before the
    # kernel has marked the killed process as exited) the agreement's collective loses its peer
    assert re.search(r"last words \(step \d+ failed: CollectiveError\): no checkpoint: (rank 1 \(pid \d+\) has exited|"
                     r"not every rank joined)", proc.stderr), said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == resumed_at and summary["recovery_s"] > 0, \
        f"{summary}{said}"
    print(f"recovery: {summary['recovery_s']:.1f} s from the failure to the first resumed step")
    # SIGTERM + resume + kill + restart: the uninterrupted run's steps, bit for bit
    assert _losses(out) == ref, f"{_losses(out)} != {ref}{said}"


@pytest.mark.multirank
def test_one_of_4_ranks_killed_at_step_7_restarts_from_step_6(tmp_path, pool4):
    steps = 12
    path = _cfg(tmp_path, checkpoint={"every": 3, "async_save": False}, parallel=FSDP2_TP2, train={"steps": steps})
    ref, _ = pool4.run(_run_in_ranks, str(path), str(tmp_path / "ref"), "never", FSDP2_TP2)[0]
    assert [s for s, _, _ in ref] == list(range(1, steps + 1))
    out = tmp_path / "out"
    # rank 2 sends itself SIGKILL when step 7 begins (its peers are then inside step 7's collectives)
    proc = subprocess.run(_train(path, "--set", "parallel.max_restarts=1"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=_env(**{FAULTS: "kill@7:r2"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"elastic restart 1 of 1: resumed at step (\d+); ([\d.]+) s from the failure", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert int(found.group(1)) == 6, proc.stdout  # the newest complete checkpoint when rank 2 died
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 6 and summary["recovery_s"] > 0
    assert summary["steps"] == steps
    print(f"recovery: {summary['recovery_s']:.1f} s from the kill of rank 2 to the first resumed step")
    # every step once (7 ran again after the restart, 1-6 kept from the first attempt), bit for bit
    assert _losses(out) == ref
    assert checkpoint.complete_steps(out / "checkpoints")[-1] == steps
