"""``hpfunc train`` with ``pp`` in the plan, run in the session's rank pools (``hpfunc.train.trainer.run`` in
every rank, as a launch would): every per-step loss and gradient norm (and a MoE model's aux loss and
expert load) equals the single-device run of the same config (``parallel=null``, rtol 1e-5) for every
schedule the trainer accepts on pp 2 and pp 4, schedules read from CSV files in torch's format, dense
and MoE, even and uneven ``layers_per_stage``.

The reference is computed once per config in the main process. A dense model's pipelined loss is the
whole batch's; a MoE model's load-balancing loss is per microbatch, so its reference accumulates
gradients over the same microbatches (``train.microbatches=<m>``). The gradient norm is what catches a
gradient wrong by a constant factor: AdamW's update hardly changes under one, so the losses would not.
"""

from __future__ import annotations

import json

import pytest
from _train_helpers import TINY, write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multirank

DENSE = {"preset": "qwen3-dense-tiny", "hidden_size": 32, "intermediate_size": 64}
MOE = TINY["model"]
STEPS = 2
BATCH = 8  # dualpipev on 4 pipeline ranks needs 8 microbatches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp-train") / "corpus"
    write_corpus(folder)
    return folder


def _raw(corpus, out, *, model: dict, layers: int, pp: int, pp_options: dict) -> dict:
    return {**TINY, "model": {**model, "num_hidden_layers": layers},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
            "data": {**TINY["data"], "paths": [str(corpus / "*.py")]},
            "train": {**TINY["train"], "steps": STEPS, "batch_size": BATCH, "seq_len": 16, "log_every": 1,
                      "eval_every": 0, "eval_batches": 0, "expert_bias_rate": 1e-2, "aux_loss_coef": 0.1},
            "output": {**TINY["output"], "dir": str(out), "progress": "none", "plot": False, "sample_tokens": 0},
            "parallel": {"mesh": {"pp": pp}, "plan": [{"pp": pp_options}]}}


KEYS = ("loss", "grad_norm", "aux_loss", "expert_load")  # the last two of a MoE model only


def train_in_rank(raw: dict) -> list[dict]:
    """``hpfunc.train.trainer.run`` in this rank of the pool: the :data:`KEYS` of every step's record."""
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.trainer import run

    return [{k: r[k] for k in KEYS if k in r} for r in run(load_config_dict(raw), echo=False).records if "loss" in r]


_REFERENCES: dict[str, list[dict]] = {}


def _reference(raw: dict, where) -> list[dict]:
    """The single-device run of ``raw`` (``parallel=null``), once per config: a MoE model accumulates
    gradients over the pipeline's microbatches, a dense one takes the whole batch at once."""
    m = raw["parallel"]["plan"][0]["pp"].get("microbatches", 1) if "num_experts" in raw["model"] else 1
    single = {**raw, "parallel": None, "train": {**raw["train"], "microbatches": m}}
    key = json.dumps({k: v for k, v in single.items() if k != "output"}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_in_rank({**single, "output": {**raw["output"], "dir": str(where)}})
    return _REFERENCES[key]


def _check(pools, tmp_path, raw: dict, *, compare=("loss", "grad_norm", "aux_loss")) -> None:
    import math

    got = pools(math.prod(raw["parallel"]["mesh"].values())).run(train_in_rank, raw)[0]
    want = _reference(raw, tmp_path / "single")
    what = f"{raw['model'].get('preset')} {raw['model']['num_hidden_layers']} layers {raw['parallel']}"
    assert len(got) == len(want) == STEPS, what
    assert [sorted(g) for g in got] == [sorted(w) for w in want], what
    for key in compare:
        if key in want[0]:
            assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5), f"{what}: {key}"
    if "expert_load" in want[0]:  # integer counts summed over the microbatches: exact
        assert [g["expert_load"] for g in got] == [w["expert_load"] for w in want], what


# (schedule, options): every name the trainer accepts; microbatches fit the schedule on 2 and 4 ranks
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"virtual_stages": 2}), ("interleaved_1f1b", {}),
             ("zb_h1", {}), ("zb_h2", {}), ("zbv", {}), ("dualpipev", {})]


def _layers(pp: int) -> int:
    return 2 * pp  # two stages per rank under interleaved / zbv / dualpipev: one layer each


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule,options", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_every_schedule_matches_parallel_null(pools, corpus, tmp_path, schedule, options, pp, kind):
    m = 2 * pp if schedule == "dualpipev" else 4
    raw = _raw(corpus, tmp_path / "out", model=DENSE if kind == "dense" else MOE, layers=_layers(pp), pp=pp,
               pp_options={"schedule": schedule, "microbatches": m, **options})
    _check(pools, tmp_path, raw)


@pytest.mark.parametrize("kind,pp,schedule,split", [
    ("dense", 2, "1f1b", [1, 3]),
    ("moe", 2, "gpipe", [3, 1]),
    ("dense", 4, "zb_h1", [3, 1, 2, 2]),
    ("moe", 2, "zbv", [2, 1, 3, 2]),
], ids=["dense-pp2-1f1b", "moe-pp2-gpipe", "dense-pp4-zb_h1", "moe-pp2-zbv"])
def test_uneven_layers_per_stage(pools, corpus, tmp_path, kind, pp, schedule, split):
    raw = _raw(corpus, tmp_path / "out", model=DENSE if kind == "dense" else MOE, layers=sum(split), pp=pp,
               pp_options={"schedule": schedule, "microbatches": 4, "layers_per_stage": split})
    _check(pools, tmp_path, raw)


@pytest.mark.parametrize("kind,pp,generator,args", [
    ("dense", 2, "zb_h2", ()),
    ("moe", 2, "interleaved_1f1b", (2,)),
    ("dense", 4, "zbv", ()),
], ids=["dense-pp2-zb_h2", "moe-pp2-interleaved", "dense-pp4-zbv"])
def test_a_schedule_from_a_torch_csv_file(pools, corpus, tmp_path, kind, pp, generator, args):
    """``schedule: <file>.csv`` as torch's ``_dump_csv`` writes it (placement and microbatches inferred)."""
    from hpfunc.schedules import GENERATORS, write_csv

    path = tmp_path / f"{generator}.csv"
    write_csv(GENERATORS[generator](pp, 4, *args), path, torch_compatible=True)
    raw = _raw(corpus, tmp_path / "out", model=DENSE if kind == "dense" else MOE, layers=_layers(pp), pp=pp,
               pp_options={"schedule": str(path), "microbatches": 4})
    _check(pools, tmp_path, raw)


@pytest.mark.parametrize("kind,schedule,mesh,plan", [
    ("moe", "1f1b", {"pp": 2, "fsdp": 2}, ["fsdp"]),
    ("dense", "zbv", {"pp": 2, "tp": 2}, ["tp"]),
    ("moe", "gpipe", {"pp": 2, "ep": 2}, ["ep"]),
    ("dense", "1f1b", {"pp": 2, "fsdp": 2, "tp": 2}, ["fsdp", "tp"]),
], ids=["moe-pp2-fsdp2", "dense-pp2-tp2", "moe-pp2-ep2", "dense-pp2-fsdp2-tp2-8ranks"])
def test_pp_composed_with_fsdp_tp_ep(pools, corpus, tmp_path, kind, schedule, mesh, plan):
    """The rest of the plan inside the stages, through the trainer: pp x fsdp, pp x tp, pp x ep on 4
    ranks and pp x fsdp x tp on 8. With a data axis beside pp a microbatch is a slice of each data
    shard (rows 0-1 and 4-5 of 8, say), not a slice of the batch as single-device accumulation takes it,
    so the per-microbatch load-balancing loss would group other rows: the MoE cases train without it
    (``aux_loss_coef: 0``; the expert bias still follows the exact expert load)."""
    raw = _raw(corpus, tmp_path / "out", model=DENSE if kind == "dense" else MOE, layers=4, pp=2,
               pp_options={"schedule": schedule, "microbatches": 2})
    raw["parallel"] = {"mesh": mesh, "plan": [*raw["parallel"]["plan"], *plan]}
    if kind == "moe":  # (the reported aux loss, still computed, groups other rows: not compared)
        raw["train"] = {**raw["train"], "aux_loss_coef": 0.0}
    _check(pools, tmp_path, raw, compare=("loss", "grad_norm") if kind == "moe" else ("loss", "grad_norm", "aux_loss"))


@pytest.mark.parametrize("kind,schedule,options", [
    ("dense", "1f1b", {"remat": "nothing_saveable"}),
    ("moe", "zbv", {"remat": ["nothing_saveable", None, None, "nothing_saveable"]}),
    ("dense", "zbv", {"max_resident": 1}),
    ("moe", "1f1b", {"max_resident": 1, "remat": [None, "dots_saveable"]}),
], ids=["dense-1f1b-remat", "moe-zbv-remat-per-stage", "dense-zbv-swaps", "moe-1f1b-swaps-selective"])
def test_recompute_and_swaps_through_the_trainer(pools, corpus, tmp_path, kind, schedule, options):
    """``remat`` (one policy, or one per stage) and ``max_resident`` (executed swaps) in the YAML's pp entry
    change nothing in the numbers."""
    raw = _raw(corpus, tmp_path / "out", model=DENSE if kind == "dense" else MOE, layers=4, pp=2,
               pp_options={"schedule": schedule, "microbatches": 4, **options})
    _check(pools, tmp_path, raw)


@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_drawn_pipelines_match_parallel_null(pools, corpus, tmp_path_factory, data):
    """Drawn (model, schedule, microbatches, layers_per_stage) on pp 2."""
    schedule, options = data.draw(st.sampled_from(SCHEDULES), "schedule")
    per_rank = 2 if schedule in ("interleaved", "interleaved_1f1b", "zbv", "dualpipev") else 1
    m = data.draw(st.sampled_from([4, 8] if schedule == "dualpipev" else
                                  [2, 4, 8] if per_rank == 2 else [1, 2, 4, 8]), "microbatches")
    split = data.draw(st.lists(st.integers(1, 3), min_size=2 * per_rank, max_size=2 * per_rank), "layers_per_stage")
    kind = data.draw(st.sampled_from(["dense", "moe"]), "kind")
    tmp = tmp_path_factory.mktemp("drawn")
    raw = _raw(corpus, tmp / "out", model=DENSE if kind == "dense" else MOE, layers=sum(split), pp=2,
               pp_options={"schedule": schedule, "microbatches": m, "layers_per_stage": split, **options})
    _check(pools, tmp, raw)


@pytest.mark.parametrize("text,needle", [(None, "does not exist"), ("F0\n", "cannot parse torch action string 'F0'")],
                         ids=["missing", "malformed"])
def test_a_schedule_file_that_cannot_be_read_is_a_config_error(corpus, tmp_path, text, needle):
    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import ConfigError, load_config_dict

    path = tmp_path / "s.csv"
    if text is not None:
        path.write_text(text)
    raw = _raw(corpus, tmp_path / "out", model=DENSE, layers=4, pp=2, pp_options={"schedule": str(path)})
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict(raw))
    assert str(info.value).startswith("parallel.plan[0].pp.schedule: pp: schedule file") and needle in str(info.value)


def test_a_relative_schedule_file_is_read_beside_the_config(corpus, tmp_path):
    """A relative CSV ``schedule`` is resolved against the config file's folder (as ``data.paths`` is),
    not the working directory; ``virtual_stages`` that disagrees with the file is a config error."""
    import yaml

    from hpfunc.schedules import GENERATORS, write_csv
    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import ConfigError, load_config

    folder = tmp_path / "configs"
    folder.mkdir()
    write_csv(GENERATORS["zbv"](2, 4), folder / "zbv.csv", torch_compatible=True)
    raw = _raw(corpus, tmp_path / "out", model=DENSE, layers=4, pp=2, pp_options={"schedule": "zbv.csv",
                                                                                   "microbatches": 4})
    (folder / "run.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(folder / "run.yaml")
    assert cfg.parallel.plan[0].options["schedule"] == str(folder / "zbv.csv")
    check_buildable(cfg)  # 2 stages per rank, read from the file: 4 stages of one layer
    raw["parallel"]["plan"][0]["pp"]["virtual_stages"] = 3
    (folder / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config(folder / "bad.yaml"))
    assert "virtual_stages=3 does not match the schedule 'zbv.csv', which places 2 stage(s)" in str(info.value)
