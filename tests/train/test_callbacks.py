"""The trainer's callbacks on real runs: each built-in writes its file with the values the step returned,
a callback of one's own is loaded by import path, a failing callback is named and leaves the run's
outputs whole, and bad ``callbacks:`` entries are config errors naming the key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _train_helpers import TINY, write_corpus
from _user_callbacks import Recorder

from hpfunc.train import Trainer
from hpfunc.train.build import check_buildable
from hpfunc.train.callbacks import CallbackError
from hpfunc.train.callbacks.layer_norms import group_of
from hpfunc.train.config import ConfigError, load_config_dict
from hpfunc.train.output import read_metrics

STEPS = 6
CALLBACKS = ["metrics_log", {"moe_monitor": {"dead_after": 2, "max_experts": 3}}, {"layer_norms": {"every": 2}},
             "checkpoint_log", "tensorboard", {"_user_callbacks:Recorder": {"tag": "mine"}}]


def _cfg(tmp_path, callbacks, **train):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return {**TINY, "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
            "train": {**TINY["train"], "steps": STEPS, "log_every": 1, "eval_every": 3, **train},
            "output": {**TINY["output"], "dir": str(tmp_path / "out"), "progress": "none", "sample_tokens": 0},
            "checkpoint": {"every": 2, "async_save": False}, "callbacks": callbacks}


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """One run with every built-in callback and a user's: (trainer, the Recorder it loaded, its folder)."""
    tmp_path = tmp_path_factory.mktemp("callbacks")
    trainer = Trainer(_cfg(tmp_path, CALLBACKS), echo=False)
    trainer.run()
    (label, recorder), = [(lb, cb) for lb, cb in trainer.callbacks if isinstance(cb, Recorder)]
    assert label == "callbacks[5] (_user_callbacks:Recorder)"
    return trainer, recorder, trainer.out_dir


def test_a_user_callback_by_import_path_sees_every_hook(done):
    trainer, rec, out = done
    assert rec.tag == "mine" and rec.events == ["start", "end"]
    assert [s for s, _ in rec.steps] == list(range(1, STEPS + 1))
    assert [s for s, _ in rec.evals] == [3, STEPS]
    assert rec.saves == [2, 4, 6]
    assert json.loads((out / "recorded.json").read_text())["tag"] == "mine"
    # what it was given is what the run logged (log_every 1: each record is one step's values)
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [float(m["loss"]) for _, m in rec.steps] == [r["loss"] for r in logged]
    assert [v for _, v in rec.evals] == [r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]


def test_metrics_log_writes_each_step_as_returned(done):
    _, rec, out = done
    lines = read_metrics(out / "steps.jsonl")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line, (_, m) in zip(lines, rec.steps):
        for key in ("loss", "ce_loss", "aux_loss", "grad_norm", "lr"):
            assert line[key] == float(m[key]), key


def test_moe_monitor_writes_the_load_statistics_of_each_step(done):
    _, rec, out = done
    lines = read_metrics(out / "moe.jsonl")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    idle = None
    for line, (_, m) in zip(lines, rec.steps):
        load = m["expert_load"].to(torch.int64)
        idle = torch.zeros_like(load) if idle is None else torch.where(load > 0, 0, idle + 1)
        assert line["aux_loss"] == float(m["aux_loss"])
        assert len(line["layers"]) == load.shape[0]
        for i, layer in enumerate(line["layers"]):
            x = load[i].double()
            mean = x.mean().item()
            assert layer["max_violation"] == pytest.approx((x.max().item() - mean) / mean, rel=1e-12)
            assert layer["top10_share"] == pytest.approx(x.max().item() / x.sum().item(), rel=1e-12)  # 4 experts
            assert layer["dead_experts"] == torch.nonzero(idle[i] >= 2).flatten().tolist()
            # 4 experts, max_experts 3: capped to the 3 busiest
            assert "load" not in layer and len(layer["top_load"]) == 3
            assert sorted(layer["top_load"].values(), reverse=True) == sorted(load[i].tolist(), reverse=True)[:3]
            assert all(load[i, int(e)] == c for e, c in layer["top_load"].items())
    assert (out / "moe_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_norms_equal_the_norms_of_the_parameters(done):
    trainer, _, out = done
    lines = read_metrics(out / "norms.jsonl")
    assert [line["step"] for line in lines] == [2, 4, 6]
    from hpfunc import tree

    sq: dict[str, float] = {}
    for path, x in tree.leaves_with_paths(trainer.state.params):  # the final state: the line of step 6
        sq[group_of(path)] = sq.get(group_of(path), 0.0) + x.double().pow(2).sum().item()
    last = lines[-1]
    assert set(last["param_norm"]) == {"embed", "layers.0", "layers.1", "final_norm"} | (
        {"lm_head"} if "lm_head" in sq else set())
    for g, v in sq.items():
        assert last["param_norm"][g] == pytest.approx(math.sqrt(v), rel=1e-12), g
    assert last["total"] ** 2 == pytest.approx(sum(n ** 2 for n in last["param_norm"].values()), rel=1e-12)


def test_checkpoint_log_has_a_line_per_saved_checkpoint(done):
    trainer, _, out = done
    lines = read_metrics(out / "checkpoints.jsonl")
    assert [line["step"] for line in lines] == [2, 4, 6]
    assert all(line["dir"] == str(trainer.checkpoint_root) and line["blocked_s"] >= 0 and line["async"] is False
               for line in lines)
    from hpfunc.checkpoint import latest

    assert latest(trainer.checkpoint_root) is not None


def test_tensorboard_events_hold_the_logged_scalars(done):
    _, _, out = done
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    records = read_metrics(out / "metrics.jsonl")
    for key in ("loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "expert_imbalance"):
        want = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in acc.Scalars(f"train/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key  # stored as float32
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("val/loss")] == val
    hist = acc.Histograms("moe/expert_load/layer0")
    assert [h.step for h in hist] == list(range(1, STEPS + 1))
    assert hist[0].histogram_value.sum == pytest.approx(sum(records[0]["expert_load"][0]))


def test_a_failing_callback_is_named_and_the_outputs_stay_whole(tmp_path):
    trainer = Trainer(_cfg(tmp_path, ["metrics_log", {"_user_callbacks:FailAt": {"step": 3}},
                                      {"_user_callbacks:Recorder": {"tag": "t"}}]), echo=False)
    with pytest.raises(CallbackError) as info:
        trainer.run()
    assert str(info.value) == ("callbacks[1] (_user_callbacks:FailAt) failed in on_step_end at step 3: OSError: "
                               "the disk of this callback is full")
    out = tmp_path / "out"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]  # whole lines, readable
    assert [r["step"] for r in read_metrics(out / "steps.jsonl")] == [1, 2, 3]
    assert not (out / "summary.json").exists()  # the run did not finish
    recorder = trainer.callbacks[2][1]
    assert recorder.events == ["start", "exception CallbackError"]


@pytest.mark.parametrize("callbacks, message", [
    (["moe_monitr"], "callbacks[0]: unknown callback 'moe_monitr'; did you mean 'moe_monitor'?"),
    (["metrics_log", "no_such_package.mod:Cb"], "callbacks[1]: cannot import the module 'no_such_package.mod' of "
                                                "the callback 'no_such_package.mod:Cb'"),
    (["_user_callbacks:Recorderr"], "callbacks[0]: the module '_user_callbacks' has no attribute 'Recorderr'; did "
                                    "you mean 'Recorder'?"),
    ([{"moe_monitor": {"every": "often"}}], "callbacks[0].moe_monitor.every: expected an integer, found string "
                                            "'often'"),
    ([{"layer_norms": {"evry": 2}}], "callbacks[0].layer_norms.evry: unknown option; did you mean 'every'?"),
    ([{"metrics_log": {"every": 0}}], "callbacks[0].metrics_log: every: expected an integer >= 1, found 0"),
    (["_user_callbacks:Recorder"], "callbacks[0]._user_callbacks:Recorder: missing option(s) tag"),
    ([{"tensorboard": 3}], "callbacks[0].tensorboard: expected a mapping of options, found integer 3"),
])
def test_bad_callback_entries_are_config_errors_naming_the_key(callbacks, message):
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict({"callbacks": callbacks}))
    assert str(info.value).startswith(message), str(info.value)
