"""The YAML reaches every transform: ``activations:`` (remat and offload per layer) and ``precision:`` (mixed
precision) through ``hpfunc train`` (``Trainer`` in the ranks of the session's pools, as a launch runs it).

* Remat and offload do not change the math: the per-step losses and gradient norms with them equal the
  single-device run without them (rtol 1e-5) on fsdp, fsdp x tp, fsdp x ep, ddp, hsdp and pp, each plan
  with different policies (per layer, per list, for every layer).
* Mixed precision changes the math: the per-step losses equal the matching hand-written
  ``hpfunc.parallelize`` call (``plan.with_mixed_precision(bfloat16, float32)``) and differ from fp32's.
* The policies take effect: every layer call of a model of the test's own is seen (a recompute counted, the
  offload layer on the saved-tensor stack), and on Qwen3 the bytes kept for backward, measured on
  storage liveness, drop.
* Bad values are config errors naming the key, before any work.
"""

from __future__ import annotations

import math

import pytest
import torch
from _train_helpers import TINY, write_corpus

from hpfunc.train.build import check_buildable
from hpfunc.train.config import ConfigError, load_config_dict

STEPS = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("step-transforms") / "corpus"
    write_corpus(folder)
    return folder


def _raw(corpus, out, **sections) -> dict:
    return {**TINY, "data": {**TINY["data"], "paths": [str(corpus / "*.py")]},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
            "train": {**TINY["train"], "steps": STEPS, "batch_size": 4, "seq_len": 16, "log_every": 1,
                      "eval_every": 0, "eval_batches": 0},
            "output": {**TINY["output"], "dir": str(out), "progress": "none", "plot": False, "sample_tokens": 0},
            **sections}


def train_in_rank(raw: dict) -> list[dict]:
    """``Trainer(raw).run()`` in this rank: each step's loss and gradient norm."""
    from hpfunc.train import Trainer

    trainer = Trainer(raw, echo=False)
    trainer.run()
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in trainer.metrics if "loss" in r]


_SINGLE: dict[str, list[dict]] = {}


def _single(corpus, tmp_path) -> list[dict]:
    """The single-device run without any of the keys (once per session)."""
    if "fp32" not in _SINGLE:
        _SINGLE["fp32"] = train_in_rank(_raw(corpus, tmp_path / "single"))
    return _SINGLE["fp32"]


PLANS = {
    "fsdp2": ({"mesh": {"fsdp": 2}, "plan": ["fsdp"]}, {"remat": "dots_saveable"}),
    "fsdp2-tp2": ({"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]},
                  {"remat": ["nothing_saveable", None], "offload": {1: "everything"}}),
    "fsdp2-ep2": ({"mesh": {"fsdp": 2, "ep": 2}, "plan": ["fsdp", "ep"]},
                  {"remat": {0: "dots_with_no_batch_dims_saveable"}, "offload": "dots"}),
    "ddp2": ({"mesh": {"dp": 2}, "plan": ["ddp"]}, {"offload": "everything"}),
    "hsdp2x2": ({"mesh": {"dp": 2, "fsdp": 2}, "plan": ["hsdp"]},
                {"remat": "nothing_saveable", "offload": "everything"}),
    "pp2": ({"mesh": {"pp": 2}, "plan": [{"pp": {"schedule": "1f1b", "microbatches": 1}}]},
            {"remat": {1: "nothing_saveable"}, "offload": {0: "everything"}}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(PLANS))
def test_remat_and_offload_leave_every_plan_s_losses_unchanged(pools, corpus, tmp_path, name):
    parallel, activations = PLANS[name]
    raw = _raw(corpus, tmp_path / "out", parallel=parallel, activations=activations)
    got = pools(math.prod(parallel["mesh"].values())).run(train_in_rank, raw)
    want = _single(corpus, tmp_path)
    assert len(got[0]) == len(want) == STEPS
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got[0]] == pytest.approx([r[key] for r in want], rel=1e-5), key


DENSE = {"preset": "qwen3-dense-tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4}


@pytest.mark.multirank
def test_offload_and_full_remat_under_a_schedule_that_splits_the_backward(pools, corpus, tmp_path):
    """zbv on pp 2 (four stages, each backward split into B and W: the saved activations are read twice):
    the dense model's losses and gradient norms equal the single-device run without the keys."""
    parallel = {"mesh": {"pp": 2}, "plan": [{"pp": {"schedule": "zbv", "microbatches": 2}}]}
    activations = {"remat": {1: "nothing_saveable", 2: "nothing_saveable"},
                   "offload": {0: "everything", 2: "everything", 3: "dots"}}
    got = pools(2).run(train_in_rank, _raw(corpus, tmp_path / "out", model=DENSE, parallel=parallel,
                                           activations=activations))[0]
    want = train_in_rank(_raw(corpus, tmp_path / "single", model=DENSE))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key


def mixed_in_rank(raw: dict) -> dict:
    """This rank's per-step losses from ``Trainer(raw)`` (``precision:`` set) and from the matching
    ``hpfunc.parallelize`` call written by hand: the same model, data, optimizer and initial key, the
    plan ``fsdp`` / ``pp`` of the mesh's one axis with ``.with_mixed_precision(bfloat16, float32)``."""
    import functools

    from hpfunc.mesh import Mesh
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.data import load_data, sample_batch
    from hpfunc.train.loop import data_keys
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import init_sharded, parallelize

    trainer = [r["loss"] for r in train_in_rank(raw)]
    cfg = load_config_dict(raw)
    spec, model_cfg = model_spec(cfg.model), build_model_config(cfg.model)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps), spec)
    (axis, size), = cfg.parallel.mesh.items()
    if axis == "pp":
        plan = plans.pp("pp", spec.pipeline_stages(model_cfg, size), microbatches=1)
    else:
        plan = plans.fsdp(axis)
    plan = plan.with_mixed_precision(torch.bfloat16, torch.float32)
    mesh = Mesh(dict(cfg.parallel.mesh))
    step = parallelize(make_train_step(model_cfg, optimizer, expert_bias_rate=cfg.train.expert_bias_rate,
                                       lr_schedule=lr, loss_fn=spec.step_loss()), mesh, plan, params="params")
    init_key, train_key, _ = data_keys(cfg.seed)
    params = init_sharded(functools.partial(spec.init, cfg=model_cfg, dtype=torch.float32), mesh, plan, init_key,
                          shapes=spec.param_shapes(model_cfg))
    state = step.init_state(lambda p: init_train_state(p, optimizer), params)
    data = load_data(cfg.data)
    by_hand = []
    for k in range(cfg.train.steps):
        batch = sample_batch(data.train, train_key, k, cfg.train.batch_size, cfg.train.seq_len, data.train_docs)
        state, metrics = step(state, batch)
        loss = metrics["loss"]
        by_hand.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return {"trainer": trainer, "by_hand": by_hand}


@pytest.mark.multirank
@pytest.mark.parametrize("parallel", [{"mesh": {"fsdp": 2}, "plan": ["fsdp"]},
                                      {"mesh": {"pp": 2}, "plan": [{"pp": {"microbatches": 1}}]}],
                         ids=["fsdp2", "pp2"])
def test_precision_equals_the_matching_parallelize_call(pools, corpus, tmp_path, parallel):
    raw = _raw(corpus, tmp_path / "out", parallel=parallel,
               precision={"compute_dtype": "bfloat16", "reduce_dtype": "float32"})
    got = pools(2).run(mixed_in_rank, raw)[0]
    assert len(got["trainer"]) == STEPS
    assert got["trainer"] == pytest.approx(got["by_hand"], rel=1e-5)
    fp32 = [r["loss"] for r in _single(corpus, tmp_path)]
    # the key changes the math: bf16 compute is not fp32's (so a run that ignored it would fail above)
    assert max(abs(a - b) / b for a, b in zip(got["trainer"], fp32)) > 1e-4
    # on one process the loss reads the parameters cast to bf16: the mesh's bf16 losses to bf16's 1e-2
    if "bf16" not in _SINGLE:
        _SINGLE["bf16"] = train_in_rank(_raw(corpus, tmp_path / "single-bf16", precision={"compute_dtype": "bfloat16"}))
    one = [r["loss"] for r in _SINGLE["bf16"]]
    assert one == pytest.approx(got["trainer"], rel=1e-2)
    assert max(abs(a - b) / b for a, b in zip(one, fp32)) > 1e-4


def test_policies_take_effect_per_layer(corpus, tmp_path):
    """A model of the test's own sees each layer call: under ``remat`` layer 1 runs twice (the forward and
    the backward's recompute, both inside its region), under ``offload`` layer 0 runs with the offload layer on the saved-tensor
    stack; without the keys each layer runs once, with none."""
    import _tiny_mlp_lm
    from hpfunc.train import Trainer

    def calls(activations: dict | None) -> list:
        raw = _raw(corpus, tmp_path / f"out{len(activations or {})}", model={"name": "_tiny_mlp_lm:SPEC",
                                                                              "preset": "mlp-tiny"},
                   train={**_raw(corpus, tmp_path)["train"], "steps": 1})
        if activations is not None:
            raw["activations"] = activations
        seen: list = []
        token = _tiny_mlp_lm.CALLS.set(seen)
        try:
            Trainer(raw, echo=False).run()
        finally:
            _tiny_mlp_lm.CALLS.reset(token)
        return seen

    plain = calls(None)
    assert [(i, again) for i, again, _ in plain] == [(0, False), (1, False)]
    assert not any("_OffloadLayer" in stack for _, _, stack in plain)
    changed = calls({"remat": {1: "nothing_saveable"}, "offload": {0: "everything"}})
    # layer 1 runs in its remat region twice: the forward, and the recompute in the backward
    assert [(i, rematted) for i, rematted, _ in changed] == [(0, False), (1, True), (1, True)]
    assert "_OffloadLayer" in changed[0][2] and not any("_OffloadLayer" in s for _, _, s in changed[1:])


def test_saved_activation_bytes_drop_by_storage_liveness():
    """The loss the trainer differentiates (``train_loss``) on the tiny Qwen3 MoE (4 layers, one device):
    remat with ``nothing_saveable`` on every layer keeps less for backward, offloading every layer keeps
    less on the device, both measured on storage liveness."""
    from hpfunc import random
    from hpfunc.memory import saved_activations
    from hpfunc.train.build import build_model_config
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step_transforms import train_loss

    def device_bytes(activations: dict) -> int:
        cfg = load_config_dict({**TINY, "model": {**TINY["model"], "num_hidden_layers": 4},
                                "activations": activations})
        spec, model_cfg = model_spec(cfg.model), build_model_config(cfg.model)
        params = spec.init(random.key(0), model_cfg)
        batch = {"tokens": random.randint(random.key(1), (2, 32), 0, model_cfg.vocab_size)}
        loss = train_loss(cfg, spec, on_mesh=False)
        return saved_activations(loss, params, batch, model_cfg, state_argnums=(0,)).device_bytes

    none = device_bytes({})
    assert device_bytes({"remat": "nothing_saveable"}) < 0.5 * none
    assert device_bytes({"offload": "everything"}) < 0.5 * none


@pytest.mark.parametrize("data,needle", [
    ({"activations": {"remat": "dots_saveabel"}},
     "activations.remat: unknown policy 'dots_saveabel'; did you mean 'dots_saveable'?"),
    ({"activations": {"offload": "evrything"}}, "activations.offload: unknown policy 'evrything'; did you mean "
                                                "'everything'?"),
    ({"activations": {"remat": {7: "dots_saveable"}}},
     "activations.remat.7: layer 7 is out of range: the model has 2 layers (model.num_hidden_layers)"),
    ({"activations": {"offload": ["everything"]}},
     "activations.offload: 1 entry, but the model has 2 layers (model.num_hidden_layers)"),
    ({"activations": {"remat": {"first": "dots_saveable"}}}, "activations.remat: expected layer indices"),
    ({"activations": {"remt": "dots_saveable"}}, "activations.remt: unknown key; did you mean 'remat'?"),
    ({"precision": {"compute_dtype": "bf16"}},
     "precision.compute_dtype: expected one of 'float32', 'bfloat16', 'float16', 'float64' or null, found string "
     "'bf16'; did you mean 'bfloat16'?"),
    ({"precision": {"reduce_dtype": "float32"}}, "precision.reduce_dtype: float32 on a single device"),
    ({"precision": {"param_dtype": "bfloat16"}}, "precision.param_dtype: unknown key; the parameters' own dtype"),
    ({"parallel": {"mesh": {"pp": 2}, "plan": [{"pp": {"remat": "nothing_saveable"}}]},
      "activations": {"remat": "nothing_saveable"}}, "activations.remat: parallel.plan[0].pp.remat recomputes"),
    ({"parallel": {"mesh": {"pp": 2}, "plan": [{"pp": {"schedule": "zbv", "microbatches": 2}}]},
      "model": {**TINY["model"], "num_hidden_layers": 4}, "activations": {"remat": "dots_saveable"}},
     "activations.remat: the selective policy 'dots_saveable' recomputes a layer once, but the schedule 'zbv'"),
], ids=["remat-name", "offload-name", "layer-range", "list-length", "layer-key", "unknown-key", "dtype",
        "reduce-single", "param-dtype", "pp-remat-twice", "pp-split-backward"])
def test_bad_values_are_config_errors_naming_the_key(data, needle):
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict({**TINY, **data}))
    assert needle in str(info.value), str(info.value)


def test_the_keys_reach_hpfunc_train_by_set_and_round_trip():
    from hpfunc.train.config import config_to_dict

    cfg = load_config_dict(TINY, ["activations.remat={1: dots_saveable}", "activations.offload=[everything, none]",
                                  "precision.compute_dtype=bfloat16"])
    assert cfg.activations.remat == {1: "dots_saveable"} and cfg.activations.offload == ("everything", None)
    assert cfg.precision.compute_dtype == "bfloat16"
    assert load_config_dict(config_to_dict(cfg)) == cfg
    assert "activations" not in config_to_dict(load_config_dict(TINY))  # unset: written as before
