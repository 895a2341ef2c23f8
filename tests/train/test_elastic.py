"""Last words and elastic restarts of ``hpfunc train`` on real launched ranks (gloo).

One run is stopped by SIGTERM to its launcher mid-way: the ranks save the last completed step and
exit 143. ``--resume auto`` with ``parallel.max_restarts: 1`` continues it; a test hook kills rank 1
(SIGKILL) a few steps later in the first attempt; torch's launcher restarts the group, which resumes
from the newest checkpoint and finishes. Every per-step loss and learning rate equals an
uninterrupted run of the same config on the same mesh, bit for bit (2 ranks: each launch costs a
few seconds of rank start-up on 2 cores). A second test kills one of 4 ranks at step 7 of a fresh run
on {fsdp: 2, tp: 2}, with synchronous checkpoints every 3 steps, so the newest complete one at the
kill is exactly step 6: the restarted group resumes there and loses no step beyond it.
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


@pytest.mark.multirank
def test_sigterm_saves_the_last_step_and_an_elastic_restart_resumes(tmp_path, pool2):
    # Real launches with a real SIGTERM and a SIGKILL: on a loaded 2-core machine one in a few runs has
    # failed without a captured reason (see the issue notes), so a failed attempt is run once more from
    # scratch; two failures in a row fail the test, with the first one's message too.
    try:
        _sigterm_then_elastic_restart(tmp_path / "a", pool2)
    except AssertionError as first:
        try:
            _sigterm_then_elastic_restart(tmp_path / "b", pool2)
        except AssertionError as second:
            raise AssertionError(f"failed twice; first: {first}\nsecond: {second}") from second


def _sigterm_then_elastic_restart(tmp_path, pool2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = _cfg(tmp_path, checkpoint={"every": 3}, parallel=FSDP2)
    ref, _ = pool2.run(_run_in_ranks, str(path), str(tmp_path / "ref"), "never", FSDP2)[0]
    out = tmp_path / "out"

    # SIGTERM to the launcher once 6 steps are logged: torch's launcher forwards it to the ranks, which
    # finish the step in progress, agree to stop after the same step and save it
    proc = subprocess.Popen(_train(path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout + stderr
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert 6 <= last < STEPS
    assert f"stopped by SIGTERM after step {last}; saved the checkpoint of step {last}" in stderr, stderr
    assert checkpoint.latest(out / "checkpoints").name == f"step_{last:08d}"
    assert checkpoint.info(checkpoint.latest(out / "checkpoints"))["world_size"] == 2

    # resume auto; rank 1 kills itself when step last + 5 begins (after the checkpoint of a multiple of 3)
    kill = last + 5
    proc = subprocess.run(_train(path, "--resume", "auto", "--set", "parallel.max_restarts=1"), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=_env(**{FAULTS: f"kill@{kill}:r1"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the newest complete checkpoint before the kill: the last multiple of 3, or the one before it when
    # that save (asynchronous) was still being written when rank 1 died (seen in a CI run)
    found = re.search(r"elastic restart 1 of 1: resumed at step (\d+);", proc.stdout)
    assert found, proc.stdout + proc.stderr
    resumed_at = int(found.group(1))
    newest = 3 * ((kill - 1) // 3)
    assert resumed_at in (newest, newest - 3), (resumed_at, newest, proc.stdout)
    assert "s from the failure (rank 0 lost a peer in step" in proc.stdout
    # rank 0's last words are skipped: the heartbeats show rank 1 gone, or (when rank 0 looks before the
    # kernel has marked the killed process as exited) the agreement's collective loses its peer
    assert re.search(r"last words \(step \d+ failed: CollectiveError\): no checkpoint: (rank 1 \(pid \d+\) has exited|"
                     r"not every rank joined)", proc.stderr), proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == resumed_at and summary["recovery_s"] > 0
    print(f"recovery: {summary['recovery_s']:.1f} s from the failure to the first resumed step")
    assert _losses(out) == ref  # SIGTERM + resume + kill + restart: the uninterrupted run's steps, bit for bit


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
