"""The trainer loop's device side on fake CUDA: batches fed to the device, per-step scalars held there.

Three steps of the trainer's parallel step (``{fsdp: 8}``, rank 5 of a fake world of 8) the way
:class:`hpfunc.train.loop.TrainingRun` runs them on a CUDA mesh: the host batch through
:class:`hpfunc.train.batch_feed.BatchFeed` with the step's ``put_batch`` (only this rank's block of the
batch is copied, ``non_blocking``: no host sync), the step told the loop's count of applied steps (the
precision monitor, configured every 2 steps, decides from it), the step's scalars into
:class:`hpfunc.train.readout.StepReadout` and read at the logging steps only (every 2). Each step is
recorded: a step that does not log makes no host sync at all; a logging step makes exactly one, the
readout's copy to the host of every pending step's values. The same for the single-process trainer
(no mesh) on one fake CUDA device. The CPU side (the same values as reading each step) is
``tests/train/test_step_readout.py``; the values of the per-rank blocks on gloo ranks are
``tests/train/test_batch_blocks.py``.
"""

from __future__ import annotations

import torch

from hpfunc.testing.fake_devices import answer_host_syncs, run_on_fake_devices
from tests.gpu import _fake_pieces as fp
from tests.gpu.test_fake_cuda_step import LIFTED

READOUT = "hpfunc/train/readout.py"
SCHEDULES = "hpfunc/optim/schedules.py"
ROW_BYTES = 17 * 8  # a row of the batch: seq_len + 1 int64 token ids


def _check_steps(steps: list, *, monitored: bool) -> None:
    for n, s in enumerate(steps, start=1):
        assert s["batch"] == "cuda"
        # nothing made off the device by the step but host literals lifted to it (as in test_fake_cuda_step),
        # and the readout's copy to the host of the values it reads
        assert all(f == READOUT or (op == "lift_fresh" and f in LIFTED) for op, f in s["off_device"]), (n, s["off_device"])
        # host numbers go to the device pinned and non_blocking (a pageable copy makes a GPU's host wait), but
        # the lr schedule's table, lifted once per device on a real one (each step on fake devices)
        assert s["blocking_in_step"] in ([], [SCHEDULES]), (n, s["blocking_in_step"])
        if n % 2:
            assert s["syncs"] == [] and s["host_reads"] == [], (n, s["syncs"], s["host_reads"])
            assert s["read"] == [] and s["row"] == ((5,), "cuda")  # held on the device
        else:
            assert s["syncs"] == [("copy to host", "_to_copy", READOUT)], (n, s["syncs"])
            assert s["read"] == [n - 1, n]  # the held step and this one, in that one transfer
            assert {f for _, _, f in s["host_reads"]} == {READOUT}  # the values, read on the host
            assert s["extras"] == {"expert_load": ((2, 8), torch.int64, "cpu")}
        assert s["measured"] == (monitored and n % 2 == 0), n  # the monitor's steps: from the loop's count


def test_only_logging_steps_sync_and_each_rank_copies_its_block():
    run = run_on_fake_devices(fp.fed_and_read_steps, {"mesh": {"fsdp": 8}, "plan": ["fsdp"]}, steps=3, log_every=2,
                              monitor_every=2, world_size=8, rank=5, isolated=True,
                              on_host_sync=answer_host_syncs(1))
    out = run.result
    steps = out["steps"]
    assert out["whole"] == (16, 17) and out["state_devices"] == ["cuda"]
    # this rank's 2 rows of the global 16 went to the device by one non_blocking copy (unpinned: a fake
    # device has no memory to pin), measured by the copy's own size: 272 bytes, not the batch's 2176
    assert [s["copies"] for s in steps] == [[("cpu", "cuda", True, 2 * ROW_BYTES)]] * 3
    assert [s["block"] for s in steps] == [[(2, 17)]] * 3
    # handed the global host batch itself, the step's input path slices it on the host: the block alone travels
    # (the step's other copies are the small host literals test_fake_cuda_step lists: the lr table's 80 bytes)
    assert [c for c in out["direct_copies"] if c[3] >= 2 * ROW_BYTES] == [("cpu", "cuda", True, 2 * ROW_BYTES)]
    assert all(c[3] <= 80 for c in out["direct_copies"] if c[3] != 2 * ROW_BYTES), out["direct_copies"]
    assert [s["fed_off_device"] for s in steps] == [[("slice", (2, 17))]] * 3  # the block: a view of the host batch
    _check_steps(steps, monitored=True)
    # nothing outside the recorded steps synced: one logging step, one copy
    assert [h.kind for h in run.record.host_syncs] == ["copy to host"]  # (its line: the step's record above)


def test_single_process_trainer_runs_on_the_device():
    """No mesh, ``parallel.device: cuda``: the state, every tensor of the step, the batches and the held
    scalars on the device; the same syncs as on a mesh (the logging steps' one read)."""
    run = run_on_fake_devices(fp.fed_and_read_steps, None, steps=3, log_every=2, monitor_every=2, world_size=1,
                              isolated=True, on_host_sync=answer_host_syncs(1))
    out = run.result
    assert out["state_devices"] == ["cuda"]  # parameters, optimizer state and step counter
    assert [s["copies"] for s in out["steps"]] == [[("cpu", "cuda", True, 2 * ROW_BYTES)]] * 3  # the whole batch
    assert [s["fed_off_device"] for s in out["steps"]] == [[]] * 3
    _check_steps(out["steps"], monitored=True)
    assert [h.kind for h in run.record.host_syncs] == ["copy to host"]  # (its line: the step's record above)
