"""The non-finite guard (``train.on_nonfinite``): a step whose loss or gradient norm is NaN is not applied.

The NaN comes from the data: the test hook ``nan@STEP`` gives that step a batch whose labels are all
ignored (an all-padding batch), so its mean cross-entropy is 0/0. The step is called on the real
state; a skipped step must leave it bit for bit as it was (the step is pure: nothing is donated or
written in place), on one process and on a 2-rank mesh.
"""

from __future__ import annotations

import pytest
import torch
from _train_helpers import TINY, write_corpus

from hpfunc.train.fault_hooks import ENV as FAULTS


def _config(tmp_path, steps, name, **train):
    from hpfunc.train.config import load_config_dict

    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return load_config_dict({
        **TINY, "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
        "train": {**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0, **train},
        "output": {**TINY["output"], "dir": str(tmp_path / name), "sample_tokens": 0, "plot": False,
                   "progress": "none"}})


def _skip_vs_fewer_steps(tmp_path, parallel):
    """(params after 4 steps whose 4th is NaN and skipped, params after 3 steps, the skipped run's result)."""
    import os

    from torch.distributed.tensor import DTensor

    from hpfunc import tree
    from hpfunc.train.trainer import run

    def full(params):  # full tensors on every rank (a collective)
        return tree.tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, params)

    over = {} if parallel is None else {"parallel": parallel}
    skipped_cfg = _config(tmp_path, 4, "skip", on_nonfinite="skip")
    fewer_cfg = _config(tmp_path, 3, "three")
    if over:
        import attrs

        from hpfunc.train.config import load_config_dict

        par = load_config_dict(over).parallel
        skipped_cfg, fewer_cfg = attrs.evolve(skipped_cfg, parallel=par), attrs.evolve(fewer_cfg, parallel=par)
    os.environ[FAULTS] = "nan@4"
    try:
        skipped = run(skipped_cfg, echo=False)
    finally:
        del os.environ[FAULTS]
    fewer = run(fewer_cfg, echo=False)
    return full(skipped.state.params), full(fewer.state.params), skipped.records, skipped.summary, \
        int(skipped.state.step)


def _check(a, b, records, summary, opt_steps):
    from hpfunc import tree

    pa, pb = dict(tree.leaves_with_paths(a)), dict(tree.leaves_with_paths(b))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k  # bit for bit: the NaN step changed nothing
    assert opt_steps == 3  # the optimizer step count (the schedule's position) did not advance
    (skip,) = [r for r in records if r.get("skipped")]
    assert skip == {"step": 4, "skipped": True, "skipped_steps": 1, "reason": skip["reason"]}
    assert "the loss is nan" in skip["reason"] and "the step was not applied" in skip["reason"]
    assert summary["skipped_steps"] == 1 and summary["steps"] == 4


def test_a_skipped_step_leaves_the_state_bit_identical_on_one_process(tmp_path):
    _check(*_skip_vs_fewer_steps(tmp_path, None))


@pytest.mark.multirank
def test_a_skipped_step_leaves_the_state_bit_identical_on_a_mesh(tmp_path, pool2):
    write_corpus(tmp_path / "corpus")  # here, not by both ranks at once (they raced: one's mkdir failed)
    _check(*pool2.run(_skip_vs_fewer_steps, tmp_path, {"mesh": {"fsdp": 2}, "plan": ["fsdp"]})[0])


def test_stop_names_the_step_and_the_parameter_and_skip_stops_after_max_skips(tmp_path, monkeypatch):
    from hpfunc.train.loop import TrainingDiverged
    from hpfunc.train.trainer import run

    monkeypatch.setenv(FAULTS, "nan@2")
    cfg = _config(tmp_path, 4, "stop")
    import attrs

    cfg = attrs.evolve(cfg, checkpoint=attrs.evolve(cfg.checkpoint, every=5))
    with pytest.raises(TrainingDiverged) as e:
        run(cfg, echo=False)
    msg = str(e.value)
    # an all-ignored batch: the mean cross-entropy is 0/0, its gradient 0 (the load-balancing term's is finite)
    assert msg.startswith("step 2: the loss is nan (grad norm "), msg
    assert "every parameter's gradient is finite" in msg
    assert "the step was not applied (the state is that of step 1; last words: saved the checkpoint of step 1" in msg
    assert (tmp_path / "stop" / "checkpoints" / "step_00000001").is_dir()
    assert not (tmp_path / "stop" / "summary.json").exists()

    monkeypatch.setenv(FAULTS, "nan@2,nan@3")
    with pytest.raises(TrainingDiverged) as e:
        run(_config(tmp_path, 4, "cap", on_nonfinite="skip", max_skips=1), echo=False)
    assert "step 3: the loss is nan" in str(e.value)
    assert "2 steps in a row were not finite, more than train.max_skips (1)" in str(e.value)


def _diverge_on_mesh(tmp_path, parallel):
    """The message of a run on ``parallel`` whose learning rate makes a later gradient NaN."""
    import attrs

    from hpfunc.train.config import load_config_dict
    from hpfunc.train.loop import TrainingDiverged
    from hpfunc.train.trainer import run

    cfg = _config(tmp_path, 6, "diverge")
    cfg = attrs.evolve(cfg, parallel=load_config_dict({"parallel": parallel}).parallel,
                       optimizer=attrs.evolve(cfg.optimizer, lr=1e10, clip_norm=None),
                       schedule=attrs.evolve(cfg.schedule, warmup_steps=0))
    try:
        run(cfg, echo=False)
    except TrainingDiverged as e:
        return str(e)
    return "no divergence"


@pytest.mark.multirank
@pytest.mark.parametrize("parallel", [
    {"mesh": {"fsdp": 2}, "plan": ["fsdp"]},
    {"mesh": {"pp": 2}, "plan": [{"pp": {"microbatches": 2}}]},
], ids=["fsdp2", "pp2"])
def test_stop_names_the_parameter_on_a_mesh(tmp_path, pool2, parallel):
    """On a mesh the failure path runs the step's gradient once more on every rank (each counts the
    non-finite values of its blocks, one psum adds them up): every rank names the same parameter,
    under a pipeline too (where each rank holds only its stages' parameters)."""
    import re

    write_corpus(tmp_path / "corpus")  # here, not by both ranks at once
    msgs = pool2.run(_diverge_on_mesh, tmp_path, parallel)
    assert msgs[0] == msgs[1], msgs
    assert re.search(r"the gradient norm is nan while the loss is", msgs[0]), msgs[0]
    assert re.search(r"the first parameter whose gradient is not finite: '[a-z_.0-9]+' \(its gradient has "
                     r"non-finite values on the ranks that hold it\)", msgs[0]), msgs[0]
