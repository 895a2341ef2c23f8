"""SAPP-ND search and ``hpfunc plan``: published layouts fit, infeasible ones name the term, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpfunc.autoparallel.configuration import Layout, Workload
from hpfunc.autoparallel.hardware import parse_bytes
from hpfunc.autoparallel.search import PlanError, evaluate, overflow, search
from hpfunc.cli import main as hpfunc_main
from hpfunc.models import qwen3
from hpfunc.models.qwen3.describe import describe

D = describe(qwen3.preset("qwen3-30b-a3b"))
GIB80 = parse_bytes("80GiB")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_30b_a3b_ep8.yaml"


@pytest.fixture(scope="module")
def on8():
    return search(D, 8, Workload(global_batch=64, seq_len=4096), "h100", memory_limit=GIB80)


def test_published_layouts_fit(on8):
    # NeMo AutoModel: EP8 x FSDP8 on 8 x 80 GB (hpfunc's ep plan shards the non-experts over the ep axis)
    ep8 = [c for c in on8.feasible if c.layout.family == "ep8"]
    assert ep8 and all(c.memory.total <= GIB80 for c in ep8)
    # Megatron-Bridge: EP16 on 16 x 80 GB
    on16 = search(D, 16, Workload(global_batch=128, seq_len=4096), "h100", memory_limit=GIB80)
    assert any(c.layout.family == "ep16" for c in on16.feasible)
    # ranked by estimated step time
    times = [c.time.total for c in on8.feasible if c.time is not None]
    assert times == sorted(times)


def test_infeasible_families_name_the_overflowing_term(on8):
    rejected = {r.family: r for r in on8.rejected}
    dp8 = rejected["dp8"]  # 16 Psi = 455 GiB of model states per rank
    assert dp8.term == "model states"
    assert dp8.over_bytes == pytest.approx(dp8.memory.total - GIB80)
    assert "the limit is passed at the model states term" in dp8.reason(GIB80)
    # the published layout without recompute: its activations do not fit
    c = evaluate(D, Layout(ep=8, microbatches=8), Workload(global_batch=64, seq_len=4096), "h100", memory_limit=GIB80)
    term, over = overflow(c.memory, GIB80)
    assert term == "activations" and over > 0 and c.time is None


def test_memory_limit_below_every_footprint_names_the_term():
    with pytest.raises(PlanError, match=r"--memory: the limit 40.00 GiB is below the smallest footprint.*"
                                        r"passed at the model states term"):
        search(D, 8, Workload(global_batch=64, seq_len=4096), "h100", memory_limit=40 * 2**30)


def test_devices_the_batch_cannot_fill():
    tiny = describe(qwen3.preset("qwen3-moe-tiny"))  # 2 layers, 8 experts, 4 heads
    with pytest.raises(PlanError, match=r"--devices: no layout fills 5 devices with train.batch_size=8"):
        search(tiny, 5, Workload(global_batch=8, seq_len=64), "cpu")


def _tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "qwen3-moe-tiny"}, "train": {"batch_size": 8, "seq_len": 64},
                                    "parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}}))
    return path


def test_plan_command_writes_a_config_the_trainer_accepts(tmp_path, capsys):
    from hpfunc.autoparallel.trainer_config import layout_of
    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import load_config

    best, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    hpfunc_main(["plan", str(_tiny_config(tmp_path)), "--devices", "4", "--memory", "1GiB", "--hardware", "cpu",
                 "--reserve", "0", "--top", "3", "--write", str(best), "--json", str(report)])
    out = capsys.readouterr().out
    assert "layouts fit; the 3 fastest" in out and "the config's own layout fsdp2xtp2" in out
    data = json.loads(report.read_text())
    assert {"devices", "hardware", "memory_limit_bytes", "model", "workload", "top", "rejected", "config_layout",
            "unmodelled"} <= set(data)
    cfg = load_config(best)
    check_buildable(cfg)
    written = layout_of(cfg)  # the trainer's config read back as a layout: the best one's mesh and plan
    assert written.family == data["top"][0]["family"]
    assert written.microbatches == data["top"][0]["microbatches"]


def test_plan_command_on_the_published_config(capsys):
    hpfunc_main(["plan", str(EXAMPLE), "--devices", "8", "--memory", "80GiB", "--top", "3"])
    out = capsys.readouterr().out
    assert "30.53 B parameters" in out and "23.08 GFLOP/token" in out
    # the config asks for ep8 without recompute: it does not fit, and the family fits with recompute
    assert "the config's own layout ep8 accum8 remat=none: does not fit" in out
    assert "passed at the activations term" in out and "its family ep8 fits as ep8" in out


@pytest.mark.parametrize("args, message", [
    (["--devices", "4", "--hardware", "tpu9"], "--hardware: unknown hardware 'tpu9'"),
    (["--devices", "4", "--memory", "lots"], "--memory: expected a positive size"),
    (["--devices", "zero"], "--devices: expected an integer >= 1"),
    (["--devices", "5", "--hardware", "cpu"], "--devices: no layout fills 5 devices"),
    (["--devices", "4", "--hardware", "cpu", "--memory", "1MiB"], "--memory: the limit 1.0 MiB is below"),
])
def test_plan_command_bad_input(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        hpfunc_main(["plan", str(_tiny_config(tmp_path)), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_layouts_become_trainer_configs_and_back():
    from hpfunc.autoparallel.trainer_config import check_runnable, layout_of, with_layout

    base = {"model": {"preset": "qwen3-moe-small"}, "train": {"batch_size": 16, "seq_len": 64}}
    for lay in (Layout(fsdp=2, tp=2, sp=True, microbatches=4), Layout(dp=2, fsdp=2, ep=2),
                Layout(fsdp=2, zero=2, microbatches=2),
                Layout(pp=2, ep=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4,
                       layers_per_stage=(1, 1, 1, 1), stage_remat=("full", "none", "selective", "full")),
                Layout(pp=2, fsdp=2, schedule="zbv", microbatches=2, remat="full")):
        cfg = check_runnable(with_layout(base, lay))  # the trainer's loader and plan check accept it
        back = layout_of(cfg)
        assert back.parallel_section() == lay.parallel_section(), lay.name
        assert back.microbatches == lay.microbatches and back.family == lay.family
        if lay.pp > 1:  # the pipeline cuts the batch itself; its remat is per stage or one for all
            assert cfg.train.microbatches == 1
            assert (back.stage_remat, back.remat) == (lay.stage_remat, lay.remat)
