"""The trainer loop's device side on fake CUDA: batches fed to the device, per-step scalars held there.

Three steps of the trainer's parallel step (``{fsdp: 8}``, rank 5 of a fake world of 8) the way
:class:`hpfunc.train.loop.TrainingRun` runs them on a CUDA mesh: the host batch through
:class:`hpfunc.train.batch_feed.BatchFeed` (``non_blocking`` copies: no host sync), the step's
scalars into :class:`hpfunc.train.readout.StepReadout` and read at the logging steps only (every 2).
Each step is recorded: a step that does not log makes no host sync at all; a logging step makes
exactly one, the readout's copy to the host of every pending step's values. The CPU side (the same
values as reading each step) is ``tests/train/test_step_readout.py``.
"""

from __future__ import annotations

import torch

from hpfunc.testing.fake_devices import answer_host_syncs, run_on_fake_devices
from tests.gpu import _fake_pieces as fp

READOUT = "hpfunc/train/readout.py"


def test_only_logging_steps_sync_and_once():
    run = run_on_fake_devices(fp.fed_and_read_steps, {"mesh": {"fsdp": 8}, "plan": ["fsdp"]}, steps=3, log_every=2,
                              world_size=8, rank=5, isolated=True, on_host_sync=answer_host_syncs(1))
    steps = run.result
    assert [s["batch"] for s in steps] == ["cuda"] * 3
    # the host batch went to the device by one non_blocking copy (unpinned: a fake device has no memory to pin)
    assert [s["copies"] for s in steps] == [[("cpu", "cuda", True)]] * 3
    for n, s in enumerate(steps, start=1):
        if n % 2:
            assert s["syncs"] == [] and s["host_reads"] == [], (n, s["syncs"], s["host_reads"])
            assert s["read"] == [] and s["row"] == ((5,), "cuda")  # held on the device
        else:
            assert s["syncs"] == [("copy to host", "_to_copy", READOUT)], (n, s["syncs"])
            assert s["read"] == [n - 1, n]  # the held step and this one, in that one transfer
            assert {f for _, _, f in s["host_reads"]} == {READOUT}  # the values, read on the host
            assert s["extras"] == {"expert_load": ((2, 8), torch.int64, "cpu")}
    # nothing outside the recorded steps synced: one logging step, one copy
    assert [(h.kind, h.where.split(":")[0]) for h in run.record.host_syncs] == [("copy to host", READOUT)]
