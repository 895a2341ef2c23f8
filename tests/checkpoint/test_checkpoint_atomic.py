"""Atomic saves, retention and asynchronous saves: ``latest`` only ever returns a complete checkpoint,
whatever moment a saving process is killed, and the previous complete one loads."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from hpfunc import checkpoint

import _ckpt_helpers as H

WRITER = pathlib.Path(__file__).with_name("_kill_writer.py")


def _complete_named(root: pathlib.Path) -> None:
    """Every folder with a checkpoint's name is complete and its bytes match its marker."""
    from hpfunc.checkpoint import marker

    for p in root.iterdir():
        if p.name.startswith("step_"):
            m = marker.read(p)  # raises if incomplete
            assert marker.check_files(p, m, checksums=True) == [], p


def test_kill_9_at_random_moments_never_leaves_an_incomplete_latest(tmp_path):
    root = tmp_path / "run"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    last = -1
    for kill in range(3):
        proc = subprocess.Popen([sys.executable, str(WRITER), str(root)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            line = proc.stdout.readline()  # the first save of this life finished
            assert line.startswith("saved"), line
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        found = checkpoint.latest(root)
        assert found is not None
        _complete_named(root)
        step = checkpoint.info(found)["step"]
        assert step >= last
        last = step
        out = checkpoint.load(found, {"w": torch.empty(64, 1024), "step": 0})
        assert out["step"] == step and torch.equal(out["w"], torch.full((64, 1024), float(step)))
    assert last >= 1


def test_retention_keep_last_and_keep_every(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 10):
        manager.save({"w": torch.full((3,), float(step))}, step)
    assert manager.steps() == [4, 8, 9] and manager.latest().name == "step_00000009"
    # a leftover of a killed save is ignored, and cleared by the next save
    (tmp_path / ".step_00000010.partial").mkdir()
    (tmp_path / "step_00000011").mkdir()  # a folder without marker: not a checkpoint
    assert manager.latest().name == "step_00000009"
    manager.save({"w": torch.zeros(3)}, 12)  # keeps 9 and 12 (the last 2), 4 and 8 (multiples of 4)
    assert not (tmp_path / ".step_00000010.partial").exists() and manager.steps() == [4, 8, 9, 12]
    assert manager.restore({"w": torch.empty(3)}, step=8)["w"].tolist() == [8.0] * 3
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        checkpoint.CheckpointManager(tmp_path, keep_last=0)


def test_async_save_in_process_blocks_less_than_it_writes(tmp_path):
    state = {"w": torch.randn(256, 1024)}
    saver = checkpoint.AsyncSaver()
    pending = saver.save(tmp_path / "a", state, step=1)
    expected = state["w"].clone()
    state["w"].add_(1.0)  # after the call: not in the checkpoint
    result = pending.wait()
    saver.close()
    assert result.step == 1 and pending.blocked_s < result.seconds
    assert torch.equal(checkpoint.load(tmp_path / "a", {"w": torch.empty(256, 1024)})["w"], expected)


def test_async_save_error_is_raised_by_wait(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    saver = checkpoint.AsyncSaver()
    pending = saver.save(blocker / "c", {"w": torch.ones(2)}, step=1)
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot save the checkpoint of step 1 to .*/file/c: Not a directory \(ENOTDIR\)"):
        pending.wait()
    saver.close()


@pytest.mark.multirank
def test_async_saves_on_4_ranks_one_in_flight_staged_values(pools, tmp_path):
    out = pools(4).run0(H.async_roundtrip, str(tmp_path))
    assert out["first_step"] == 1 and out["second_step"] == 2 and out["steps"] == [2]
    assert torch.equal(out["loaded"]["w"], torch.arange(64.0).reshape(16, 4) + 1000.0)
    assert out["loaded"]["step"] == 2 and all(b >= 0 for b in out["blocked"])


@pytest.mark.multirank
def test_an_async_save_whose_peer_never_joins_fails_within_its_timeout(pools, tmp_path):
    """The background write's process group has the saver's timeout (here 2 s; 600 s by default, not
    gloo's 30 minutes): a peer that never joins makes ``wait()`` raise, naming the step, and no
    checkpoint of that step is taken for complete."""
    seconds, message = pools(2).run0(H.async_save_without_a_peer, str(tmp_path))
    assert seconds < 30, (seconds, message)
    assert "step 1" in message, message
    assert checkpoint.complete_steps(tmp_path) == []
