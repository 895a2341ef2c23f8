"""``hpfunc dryrun``: the trainer's real step of the tiny Qwen3 MoE as rank 5 of 8 (fsdp 8) on fake CUDA
devices, its measurements against the formulas of docs/reference.md and the cost model, and the
command's bad-input errors (exit 2, the key named).

One fake-device run in a fresh process (the shape-only CUDA runtime), shared by the module.
"""

from __future__ import annotations

import json

import pytest

from hpfunc import tree
from hpfunc.autoparallel.dryrun import DryRunError, PeakTracker, check_request, dry_runs
from hpfunc.autoparallel.dryrun_cli import main as dryrun_main
from hpfunc.autoparallel.flops import train_flops_per_token
from hpfunc.models import preset, qwen3
from hpfunc.models.qwen3.describe import describe

N, B, S = 8, 16, 16
RAW = {"model": {"preset": "qwen3-moe-tiny", "dtype": "float32"},  # fp32 master weights, bf16 compute
       "precision": {"compute_dtype": "bfloat16", "reduce_dtype": "float32"},
       "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1},
       "train": {"steps": 10, "batch_size": B, "seq_len": S},
       "parallel": {"mesh": {"fsdp": N}, "plan": ["fsdp"], "device": "cpu"}}


# fsdp x ep: the experts split over ep (2 of 8 per rank) and their shards over fsdp, the rest over both
RAW_EP = {**RAW, "model": {**RAW["model"], "moe_dispatcher": "padded"},
          "parallel": {"mesh": {"fsdp": 2, "ep": 4}, "plan": ["fsdp", "ep"], "device": "cpu"}}


@pytest.fixture(scope="module")
def reports() -> list:
    return dry_runs([RAW, RAW_EP], rank=5, device="cuda", hardware="h100", moe="both")


@pytest.fixture(scope="module")
def report(reports) -> dict:
    return reports[0]


def _counts():
    cfg = preset("qwen3-moe-tiny")
    desc = describe(cfg)
    shapes = {p: s for p, s in tree.leaves_with_paths(qwen3.param_shapes(cfg))}
    bias = sum(_numel(s) for p, s in shapes.items() if p.endswith("expert_bias"))  # a frozen buffer, not in Psi
    return desc, desc.params, bias


def _numel(shape) -> int:
    n = 1
    for d in tuple(shape.shape if hasattr(shape, "shape") else shape):
        n *= int(d)
    return n


def test_model_state_bytes_equal_the_formulas(report):
    _, psi, bias = _counts()
    sb = report["state_bytes"]
    # fsdp over 8 with fp32 storage and bf16 compute: params 4 Psi / n, grads 4 Psi / n (reduced in the
    # storage dtype), AdamW 8 Psi / n (the two step counters apart): 16 Psi / n
    assert sb["grads"] == {"float32": 4 * psi // N}
    assert sb["params"] == {"float32": 4 * (psi + bias) // N}
    assert sb["optimizer"] == {"float32": 8 * psi // N, "int64": 16}
    assert report["estimate"]["memory_bytes"]["master"] == 4 * psi / N  # the cost model's fp32 copy
    assert report["estimate"]["memory_bytes"]["optimizer"] == 8 * psi / N
    # the step allocates: at least the gathered bf16 parameters of one layer, the new state (fp32 params
    # and moments) before the old is dropped
    assert 12 * psi // N < report["step_peak_bytes"] < 64 * psi
    assert report["peak_bytes"] == report["step_peak_bytes"] + 12 * psi // N + 4 * bias // N + 16


def test_expert_parallel_state_bytes_equal_the_formulas(reports):
    _, psi, bias = _counts()
    r = reports[1]
    assert r["coordinate"] == {"fsdp": 1, "ep": 1}
    # every parameter sharded 8 ways (experts: 8 / ep 4 per rank, then over fsdp 2): 16 Psi / n again
    assert r["state_bytes"]["grads"] == {"float32": 4 * psi // N}
    assert r["state_bytes"]["optimizer"] == {"float32": 8 * psi // N, "int64": 16}
    assert r["estimate"]["memory_bytes"]["optimizer"] == 8 * psi / N
    # the expert traffic crosses the ep axis as all-to-alls, forward and backward
    kinds = {(e["collective"], e["axes"], e["phase"]) for e in r["comm"]}
    assert {("all_to_all", "ep", "forward"), ("all_to_all", "ep", "backward")} <= kinds


def test_flops_equal_the_cost_model(report):
    desc, _, _ = _counts()
    # the trainer feeds windows of seq_len + 1 tokens; torch counts attention unhalved
    s = S + 1
    tokens = B // N * s
    by = report["flops_by_op"]
    matmuls = 3 * (sum(l.matmul_flops_per_token for l in desc.layers) + desc.head_flops_per_token) * tokens
    assert by["mm"] + by["_grouped_mm"] == matmuls
    # attention runs as flash on the fake GPU: forward as the cost model; its backward recomputes the
    # scores, 2.5 x forward in torch's count where the cost model takes 2 x
    attn_fwd = sum(l.attention_flops_per_token_per_position for l in desc.layers) * s * tokens
    assert by["_scaled_dot_product_flash_attention"] == attn_fwd
    assert by["_scaled_dot_product_flash_attention_backward"] == 2.5 * attn_fwd
    assert report["flops"] == train_flops_per_token(desc, s, causal=False) * tokens + 0.5 * attn_fwd
    assert report["attention"].startswith("flash")


def test_communication_equals_the_formulas(report):
    desc, psi, bias = _counts()
    c = {(e["collective"], e["axes"], e["phase"]): e for e in report["comm"]}
    ring = (N - 1) / N
    # FSDP, reshard after forward (docs/reference.md): all-gather of the bf16 parameters forward and
    # again backward (the embedding's lookup needs no weights backward), reduce-scatter of the gradients
    # in fp32 (the storage dtype); the frozen expert bias travels with its layer
    fwd = 2 * (psi + bias)
    assert c[("all_gather", "fsdp", "forward")]["payload_bytes"] == fwd
    assert c[("all_gather", "fsdp", "forward")]["sent_bytes"] == pytest.approx(ring * fwd)
    bwd = fwd - 2 * desc.embed_params
    assert c[("all_gather", "fsdp", "backward")]["payload_bytes"] == bwd
    assert c[("reduce_scatter", "fsdp", "backward")]["payload_bytes"] == 4 * (psi + bias)
    assert c[("reduce_scatter", "fsdp", "backward")]["sent_bytes"] == pytest.approx(ring * 4 * (psi + bias))
    # the rest: scalars (loss, routing statistics, gradient norm) all-reduced
    rest = [e for k, e in c.items() if k[0] == "all_reduce"]
    assert sum(e["payload_bytes"] for e in rest) < 1024
    assert set(k[0] for k in c) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_report_lists_the_unmodelled_and_the_estimate(report):
    assert any("CUDA context" in u for u in report["unmodelled"])
    assert any("allocator" in u for u in report["unmodelled"])
    assert report["estimate"]["layout"] == "fsdp8 remat=none" and report["estimate"]["step_seconds"] > 0
    assert report["coordinate"] == {"fsdp": 5} and report["world"] == N
    json.dumps(report)  # what --json writes


def test_peak_tracker_counts_storages_once():
    import torch

    t = PeakTracker()
    with t:
        a = torch.ones(256)
        v = a.view(16, 16).t()  # a view: no new storage
        b = a * 2
        del a, v, b
        c = torch.ones(64)
    assert t.peak == 2048 and t.live() == 256
    del c


@pytest.mark.parametrize("kwargs, key", [
    ({"world": 6}, "parallel.mesh"),
    ({"hardware": "h300"}, "--hardware"),
    ({"rank": 8}, "--rank"),
    ({"device": "tpu"}, "--device"),
])
def test_bad_input_names_the_key(kwargs, key):
    with pytest.raises(DryRunError, match=key.replace(".", r"\.")):
        check_request(RAW, **kwargs)


def test_cli_exits_2_naming_the_key(tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAW))
    for args, key in ([str(path), "--world", "12"], "parallel.mesh"), ([str(path), "--hardware", "tpu9"], "--hardware"), \
                     ([str(path), "--set", "train.batch_size=12"], "train.batch_size"):
        with pytest.raises(SystemExit) as e:
            dryrun_main(args)
        assert e.value.code == 2
        assert key in capsys.readouterr().err
    from hpfunc.cli import main as hpfunc_main  # the command is registered

    with pytest.raises(SystemExit) as e:
        hpfunc_main(["dryrun", str(path), "--rank", "9"])
    assert e.value.code == 2 and "--rank" in capsys.readouterr().err


def test_moe_is_reported_forced_balanced_and_at_the_capacity_worst_case(reports):
    r = reports[1]  # the padded dispatcher, moe_buffer_factor 1.5, ep 4
    bal, worst = r["moe_cases"]["forced_balanced"], r["moe_cases"]["capacity_worst_case"]
    assert (bal["moe_buffer_factor"], worst["moe_buffer_factor"]) == (1.0, 1.5)

    def a2a(case):
        return sum(e["payload_bytes"] for e in case["comm"] if e["collective"] == "all_to_all")

    # the dispatch buffers (and so the all-to-all payloads) scale with the buffer factor
    assert a2a(worst) == pytest.approx(1.5 * a2a(bal), rel=0.02)
    assert bal["flops"] < worst["flops"] and bal["step_peak_bytes"] <= worst["step_peak_bytes"]
    # the cost model follows the same assumption; the report's main figures are the worst case
    assert bal["estimate_memory_total_bytes"] < worst["estimate_memory_total_bytes"]
    assert r["step_peak_bytes"] == worst["step_peak_bytes"]
    # without ep the dropless path's shapes do not depend on the routing: one run, both names
    c = reports[0]["moe_cases"]
    assert c["forced_balanced"]["step_peak_bytes"] == c["capacity_worst_case"]["step_peak_bytes"]


def test_reserve_is_added_to_the_measured_peak(report):
    assert report["reserve_bytes"] == 4 * 2**30
    assert report["peak_with_reserve_bytes"] == report["peak_bytes"] + 4 * 2**30
    assert report["estimate"]["memory_bytes"]["reserve"] == 4 * 2**30


def test_hardware_profile_round_trip(tmp_path):
    from hpfunc.autoparallel.hardware import HardwareError, hardware, to_json

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**to_json(hardware("cpu")), "name": "mine"}))
    assert hardware(str(path)) == attrs_evolve(hardware("cpu"), name="mine")
    (tmp_path / "bad.json").write_text("{\"name\": 1}")
    with pytest.raises(HardwareError, match="--hardware: .*bad.json.* is not a hardware profile"):
        hardware(str(tmp_path / "bad.json"))


def attrs_evolve(x, **kw):
    import attrs

    return attrs.evolve(x, **kw)


def test_cli_reads_and_checks_the_dryrun_section(tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**RAW, "dryrun": {"reserve": "lots"}}))
    with pytest.raises(SystemExit) as e:
        dryrun_main([str(path)])
    assert e.value.code == 2 and "dryrun.reserve" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        dryrun_main([str(path), "--reserve", "-1GiB"])
    assert e.value.code == 2 and "--reserve" in capsys.readouterr().err
