"""The loop's per-step scalars held on the device and read at the logging steps in one transfer
(:class:`hpfunc.train.readout.StepReadout`; on a CUDA mesh with ``train.on_nonfinite: stop``).

On the CPU the loop reads every step (a read there waits for no device). The deferred path is run here
on the CPU by asking for it (``reads_each_step`` answering False, as it does on a CUDA mesh): its
metrics lines and summary must be those of the per-step reads, value for value, with one read per
logging step (and per save, evaluation and the end); and a non-finite step is still found, at the next
read, naming the step. The fake-CUDA run (``tests/gpu/test_fake_cuda_step.py``) counts its host syncs.
"""

from __future__ import annotations

import pytest
from _train_helpers import TINY, write_corpus

from hpfunc.train import loop
from hpfunc.train.fault_hooks import ENV as FAULTS
from hpfunc.train.readout import StepReadout

TIMES = ("tokens_per_s", "elapsed_s")


def _config(tmp_path, name, **train):
    from hpfunc.train.config import load_config_dict

    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return load_config_dict({
        **TINY, "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
        "train": {**TINY["train"], "steps": 7, "log_every": 3, "eval_every": 4, **train},
        "checkpoint": {"every": 5},
        "output": {**TINY["output"], "dir": str(tmp_path / name), "sample_tokens": 0, "plot": False,
                   "progress": "none"}})


def _counted_run(cfg, monkeypatch, *, deferred: bool):
    from hpfunc.train.trainer import run

    reads = []
    real_read = StepReadout.read

    def read(self):
        out = real_read(self)
        if out:
            reads.append([e.step for e in out])
        return out

    with monkeypatch.context() as m:
        m.setattr(StepReadout, "read", read)
        if deferred:
            m.setattr(loop, "reads_each_step", lambda device, on_nonfinite: False)
        result = run(cfg, echo=False)
    return result, reads


def test_deferred_reads_log_the_same_values_in_one_read_per_logging_step(tmp_path, monkeypatch):
    each, each_reads = _counted_run(_config(tmp_path, "each"), monkeypatch, deferred=False)
    held, held_reads = _counted_run(_config(tmp_path, "held"), monkeypatch, deferred=True)
    assert each_reads == [[n] for n in range(1, 8)]
    # step 1 (logged), 2-3 (logged), 4 (the evaluation), 5 (the save), 6 (logged), 7 (the last)
    assert held_reads == [[1], [2, 3], [4], [5], [6], [7]]

    def strip(records):
        return [{k: v for k, v in r.items() if k not in TIMES} for r in records]

    assert strip(held.records) == strip(each.records)  # losses, grad norms, lr, val losses: equal
    assert len([r for r in held.records if "loss" in r]) == 4  # steps 1, 3, 6, 7
    for key in ("first_loss", "last_loss", "min_loss", "val_loss"):
        assert held.summary[key] == each.summary[key], key
    lines = (tmp_path / "held" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(held.records)


def test_a_non_finite_step_held_on_the_device_stops_the_run_at_the_next_read(tmp_path, monkeypatch):
    import os

    os.environ[FAULTS] = "nan@2"
    try:
        with pytest.raises(loop.TrainingDiverged, match=r"step 2: the loss is nan .*found at step 3"):
            _counted_run(_config(tmp_path, "nan"), monkeypatch, deferred=True)
    finally:
        del os.environ[FAULTS]
