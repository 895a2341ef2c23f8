"""``Trainer`` a piece at a time: ``step()``, ``run(n)``, ``evaluate()``, ``save()``.

Interleaving them trains exactly as one ``run()`` (the batches are a pure function of seed and step, and
an evaluation reads the state without changing it); a checkpoint from ``save()`` resumed by a new Trainer
continues with the losses the saving run went on to log; the callbacks' file writes run on a background
writer, so a slow write never holds a step, and a failing one is reported naming its callback; on a rank
pool ``on_eval`` reaches the ``every_rank`` callbacks of every rank with the same value.
"""

from __future__ import annotations

import math
import threading

import pytest
from _train_helpers import TINY, write_corpus

from hpfunc.train import Trainer
from hpfunc.train.callbacks import Callback, CallbackError, open_lines
from hpfunc.train.output import read_metrics

STEPS = 5


def _cfg(tmp_path, name, **over):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "schedule": {"name": "cosine", "warmup_steps": 2},
           "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
           "train": {**TINY["train"], "steps": STEPS, "batch_size": 2, "seq_len": 16, "log_every": 1,
                     "eval_every": 0, "eval_batches": 1},
           "output": {**TINY["output"], "dir": str(tmp_path / name), "progress": "none", "plot": False,
                      "sample_tokens": 0}}
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _losses(trainer):
    return [(r["step"], r["loss"]) for r in trainer.metrics if "loss" in r]


def test_steps_evaluations_and_runs_interleaved_train_as_one_run(tmp_path):
    whole = Trainer(_cfg(tmp_path, "whole"), echo=False)
    whole.run()
    pieces = Trainer(_cfg(tmp_path, "pieces"), echo=False)
    first, second = pieces.step(), pieces.step()
    val = pieces.evaluate()
    assert pieces.done == 2 and pieces.summary is None
    partial = pieces.run(3)
    assert partial.summary is None and pieces.done == STEPS
    result = pieces.run()  # no steps left: finishes the run
    assert result.summary["steps"] == STEPS and (pieces.out_dir / "summary.json").exists()
    # the same per-step losses, bit for bit, and what step() returned is what was logged
    assert _losses(pieces) == _losses(whole)
    assert [float(first["loss"]), float(second["loss"])] == [loss for _, loss in _losses(whole)[:2]]
    # the validation in between is logged at its step, and changes nothing after it
    assert {"step": 2, "val_loss": val} in read_metrics(pieces.out_dir / "metrics.jsonl")
    assert math.isfinite(val) and result.summary["val_loss"] == whole.summary["val_loss"]
    assert [r for r in read_metrics(pieces.out_dir / "metrics.jsonl") if "loss" in r] == \
        [r for r in pieces.metrics if "loss" in r]
    with pytest.raises(ValueError, match=r"steps: expected 0 to 0 more steps \(5 of train.steps 5 are done\)"):
        pieces.run(1)


def test_save_then_a_new_trainer_resuming_continues_with_the_same_losses(tmp_path):
    going_on = Trainer(_cfg(tmp_path, "a", checkpoint={"every": 0}), echo=False)
    going_on.run(2)
    path = going_on.save()
    assert path.name.endswith("2") and path.exists()
    going_on.run()  # steps 3 to 5 after the save
    resumed = Trainer(_cfg(tmp_path, "b", checkpoint={"every": 0}), resume=str(path), echo=False)
    resumed.run()
    assert resumed.start_step == 2
    assert _losses(resumed) == _losses(going_on)[2:]
    assert [r["step"] for r in read_metrics(resumed.out_dir / "metrics.jsonl") if "loss" in r] == [3, 4, 5]


class SlowWrites(Callback):
    """Hands a write to the background writer at every step; each write waits until the test opens the
    gate, and notes whether the gate was open when it ran."""

    def __init__(self, gate: threading.Event):
        self.gate = gate
        self.ran: list[tuple[int, bool]] = []
        self.lines = None

    def on_train_start(self, trainer):
        self.lines = open_lines(trainer, "slow.jsonl")

    def on_step_end(self, trainer, step, metrics):
        def write():
            opened = self.gate.wait(timeout=60)
            self.ran.append((step, opened))

        trainer.writer.submit(write)
        self.lines.write({"step": step, "loss": float(metrics["loss"])})

    def on_train_end(self, trainer, summary):
        self.lines.close()


def test_a_slow_callback_write_does_not_hold_the_step(tmp_path):
    gate = threading.Event()
    slow = SlowWrites(gate)
    trainer = Trainer(_cfg(tmp_path, "slow"), callbacks=[slow], echo=False)
    for _ in range(3):
        trainer.step()  # a write that ran in the step's thread would wait for the gate here, and fail
    assert trainer.done == 3 and slow.ran == []  # three steps done, no write finished: they wait behind the gate
    gate.set()
    trainer.run()  # the end of the run flushes the writer before summary.json
    assert slow.ran == [(s, True) for s in range(1, STEPS + 1)]
    assert [r["step"] for r in read_metrics(trainer.out_dir / "slow.jsonl")] == list(range(1, STEPS + 1))
    assert (trainer.out_dir / "summary.json").exists()


class FailingWrite(Callback):
    def on_step_end(self, trainer, step, metrics):
        if step == 2:
            trainer.writer.submit(lambda: (_ for _ in ()).throw(OSError("the callback's disk is gone")))


def test_a_failing_background_write_is_named_and_the_outputs_stay_whole(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "fail"), callbacks=[FailingWrite()], echo=False)
    with pytest.raises(CallbackError, match=r"^callbacks argument 0 \(FailingWrite\) failed in a background write: "
                                            r"OSError: the callback's disk is gone$"):
        trainer.run()
    out = tmp_path / "fail"
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) <= 3  # whole lines up to the failure
    assert not (out / "summary.json").exists() and not (out / ".hpfunc-train.lock").exists()
    with pytest.raises(RuntimeError, match="this run has ended"):
        trainer.step()


def _pieces_in_rank(raw: dict) -> dict:
    """In each rank of the pool: a step, a validation, a save, the rest of the run."""
    from hpfunc.train import Trainer

    trainer = Trainer(raw, echo=False)
    loss = float(trainer.step()["loss"])
    val = trainer.evaluate()
    path = trainer.save()
    trainer.run()
    cbs = {type(cb).__name__: cb for _, cb in trainer.callbacks}
    return {"rank": trainer.rank, "loss": loss, "val": val, "path": str(path), "losses": _losses(trainer),
            "every_rank": cbs["EvalRecorder"].evals, "rank0": cbs["Rank0Recorder"].evals}


@pytest.mark.multirank
def test_on_a_rank_pool_on_eval_reaches_every_rank_that_asks(pools, tmp_path):
    raw = _cfg(tmp_path, "pool", train={"steps": 3}, checkpoint={"every": 0})
    raw["callbacks"] = ["_user_callbacks:EvalRecorder", "_user_callbacks:Rank0Recorder"]
    raw["parallel"] = {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}
    got = sorted(pools(2).run(_pieces_in_rank, raw), key=lambda r: r["rank"])
    assert [g["rank"] for g in got] == [0, 1]
    assert got[0]["val"] == got[1]["val"] and math.isfinite(got[0]["val"])  # every rank holds the value
    assert got[0]["losses"] == got[1]["losses"] and [s for s, _ in got[0]["losses"]] == [1, 2, 3]
    final = got[0]["every_rank"][-1][2]
    for g in got:  # the validation after step 1 and the final one, on every rank
        assert g["every_rank"] == [(g["rank"], 1, got[0]["val"]), (g["rank"], 3, final)]
    assert got[0]["rank0"] == got[0]["every_rank"] and got[1]["rank0"] == []  # rank 0 only by default
    assert got[0]["path"] == got[1]["path"]
    one = Trainer({k: v for k, v in raw.items() if k != "parallel"} | {"output": {**raw["output"],
                                                                                  "dir": str(tmp_path / "one")}},
                  echo=False)
    loss = float(one.step()["loss"])
    assert got[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert one.evaluate() == pytest.approx(got[0]["val"], rel=1e-5)
    one.close()
    assert not (tmp_path / "one" / "summary.json").exists() and not (tmp_path / "one" / ".hpfunc-train.lock").exists()
