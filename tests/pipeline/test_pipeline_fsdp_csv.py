"""pipeline_map composed with data parallel / FSDP on another mesh axis, and schedules from CSV (torch's own)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hpfunc.schedules import (dualpipev, from_torch_pipeline_order, insert_fsdp, interleaved_1f1b, one_f_one_b, read_csv, split_backward, validate,
                              write_csv, zb_h2, zbv)
from test_pipeline_parity import check, run_pipeline

DENSE, MOE = "qwen3-dense-tiny", "qwen3-moe-tiny"


@pytest.mark.multirank
@pytest.mark.parametrize("model", [DENSE, MOE])
def test_pp_x_dp(pool4, model):
    # 2 pp x 2 dp: each dp rank takes half the batch; gradients and loss averaged over "dp".
    counts, m, bs = (2, 1), 4, 8
    res = pool4.run(run_pipeline, model, one_f_one_b(2, m), counts, bs, {"pp": 2, "dp": 2}, {"data_axis": "dp"})
    # dp rank j's microbatches are chunks j*m .. j*m+m-1 of the batch cut into dp*m pieces.
    check(res, model, counts, bs, 2 * m)


@pytest.mark.multirank
@pytest.mark.parametrize("model,schedule,counts", [
    (DENSE, insert_fsdp(one_f_one_b(2, 4)), (1, 2)),
    # two stages per rank, at most one gathered: RESHARD and a second UNSHARD of the same stage
    (DENSE, insert_fsdp(interleaved_1f1b(2, 4, 2), max_unsharded=1, prefetch=1), (2, 1, 1, 1)),
    (MOE, insert_fsdp(split_backward(zbv(2, 4)), max_unsharded=1), (1, 1, 2, 1)),
    (DENSE, insert_fsdp(dualpipev(2, 4), prefetch=1), (1, 2, 1, 1)),
], ids=["1f1b-dense", "interleaved-reshard-dense", "zbv-split-moe", "dualpipev-prefetch-dense"])
def test_pp_x_fsdp(pool4, model, schedule, counts):
    validate(schedule)
    assert any(a.kind.value == "REDUCE_GRAD" for a in schedule[0])
    m, bs = schedule.num_microbatches, 8
    res = pool4.run(run_pipeline, model, schedule, counts, bs, {"pp": 2, "fsdp": 2}, {"fsdp_axis": "fsdp"})
    check(res, model, counts, bs, 2 * m)


# -- CSV -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_zbv_order():
    """torch.distributed.pipelining's own ScheduleZBVZeroBubble order for p=2, m=4 (fake process group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # a test before this module left its default group (conftest destroys those)
        pytest.fail("a default process group already exists: torch's schedules need a fake world of their own")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        group = dist.new_group([0, 1])
        stages = [PipelineStage(torch.nn.Linear(2, 2), i, 4, torch.device("cpu"), group=group) for i in (0, 3)]
        sched = torch_schedules.ScheduleZBVZeroBubble(stages, 4, loss_fn=lambda out, target: out.sum())
        yield sched.pipeline_order, sched.pipeline_order_with_comms
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_torch_zbv_csv_runs(pool2, torch_zbv_order, tmp_path: Path):
    torch_zbv_order, _ = torch_zbv_order
    path = tmp_path / "torch_zbv.csv"
    with open(path, "w", newline="") as f:   # as torch's _dump_csv writes it
        csv.writer(f).writerows(torch_zbv_order[r] for r in sorted(torch_zbv_order))
    s = validate(read_csv(path, name="torch-zbv"))
    assert s.num_stages == 4 and s.stage_to_rank == (0, 1, 1, 0) and s.num_microbatches == 4
    assert any(a.kind.value == "W" for a in s[0])       # torch's I/W split survives
    counts = (1, 2, 1, 1)
    check(pool2.run(run_pipeline, DENSE, s, counts, 8, {"pp": 2}), DENSE, counts, 8, 4)


@pytest.mark.multirank
def test_hpfunc_csv_roundtrip_runs(pool2, tmp_path: Path):
    s = zb_h2(2, 4)
    path = tmp_path / "zb_h2.csv"
    write_csv(s, path)
    back = read_csv(path)
    assert back == s
    counts = (2, 1)
    check(pool2.run(run_pipeline, MOE, back, counts, 8, {"pp": 2}), MOE, counts, 8, 4)


@pytest.mark.multirank
def test_torch_lowered_zbv_runs(pool2, torch_zbv_order):
    # torch's own lowering (its SEND/RECV placement) runs as well
    _, with_comms = torch_zbv_order
    s = validate(from_torch_pipeline_order(with_comms, stage_to_rank=(0, 1, 1, 0), num_microbatches=4))
    assert s.has_comms
    counts = (1, 1, 1, 2)
    check(pool2.run(run_pipeline, MOE, s, counts, 8, {"pp": 2}), MOE, counts, 8, 4)
