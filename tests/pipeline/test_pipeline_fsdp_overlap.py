"""pipeline_map's FSDP and data-parallel collectives are the engine's, issued without waiting.

``UNSHARD`` issues the packed all-gathers of a stage's layer groups (the forward prefetch's
``engine.prefetch.start``) and the stage's first forward lands them; ``REDUCE_GRAD`` issues packed
reduce-scatters (``engine.reduce_async``) waited for at the end of the step; with a data axis a stage's
bucketed all-reduces start after its last weight gradient. The comm counter's issue and wait times
against the executor's timeline show the compute that ran while each was in flight; the bytes are the
formulas (every parameter gathered once per ``UNSHARD``, every gradient reduced once per step), and
the gradients equal one device's.
"""

from __future__ import annotations

import pytest
import torch

import _pipeline_qwen3 as Q
import hpfunc
from hpfunc.schedules import insert_fsdp, interleaved_1f1b
from hpfunc.transforms.pipeline import pipeline_map, record_timeline, shard_stage_params, unshard_stage_grads
from test_pipeline_parity import check, setup

MODEL, COUNTS, BS = "qwen3-dense-tiny", (2, 1, 1, 1), 8


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in hpfunc.tree.leaves(tree) if isinstance(x, torch.Tensor))


def traced_step(kind: str) -> dict:
    """Rank function: two steps of the interleaved schedule (2 stages a rank) on pp x ``kind``; the second
    under the comm counter and the timeline. Returns the loss and full gradients, the collectives (op,
    payload, issue time, wait time), the compute actions' (start, end) and the bytes the formulas say."""
    cfg, params, batch = setup(MODEL, COUNTS, BS)
    axis = "fsdp" if kind == "fsdp" else "dp"
    mesh = hpfunc.Mesh({"pp": 2, axis: 2})
    schedule = interleaved_1f1b(2, 4, 2)
    if kind == "fsdp":
        schedule = insert_fsdp(schedule, prefetch=1)  # each UNSHARD one compute ahead of the stage's first use
        kwargs = {"fsdp_axis": "fsdp"}
    else:
        kwargs = {"data_axis": "dp"}
    step = pipeline_map(Q.stage_fns(cfg, COUNTS), schedule, mesh, loss_fn=Q.make_loss_fn(cfg), **kwargs)
    full = {s: Q.split_params(params, cfg, COUNTS)[s] for s in step.local_stages}
    local = shard_stage_params(full, mesh, "fsdp") if kind == "fsdp" else full
    step(local, batch)
    with hpfunc.comm_stats() as stats, record_timeline() as events:
        loss, grads = step(local, batch)
    if kind == "fsdp":
        grads = unshard_stage_grads(grads, mesh, "fsdp")
    waited = {}
    for w in stats.waits:
        waited.setdefault(id(w.record), w.waited_at)
    records = [(r.op, r.payload_bytes, r.issued_at, waited.get(id(r))) for r in stats.records]
    starts = {a: t for what, a, t in events if what == "start"}
    computes = [(starts[a], t) for what, a, t in events if what == "end"]
    kinds = [(a.kind.value, a.stage) for a in step.actions]
    float_bytes = {s: _nbytes({k: v for k, v in hpfunc.tree.leaves_with_paths(full[s]) if v.is_floating_point()})
                   for s in full}
    expected = {
        "all_gather": sum(_nbytes(full[s]) for k, s in kinds if k == "UNSHARD"),
        "reduce_scatter": sum(float_bytes[s] for k, s in kinds if k == "REDUCE_GRAD"),
        "all_reduce": 0 if kind == "fsdp" else sum(float_bytes.values()),
    }
    return {"loss": loss, "grads": grads, "records": records, "computes": computes, "expected": expected}


def _in_flight_during_compute(out: dict, op: str) -> int:
    """How many ``op`` collectives were issued before some compute action started and waited for after it ended."""
    return sum(1 for o, _, issued, waited in out["records"] if o == op and waited is not None
               and any(issued < start and end < waited for start, end in out["computes"]))


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["fsdp", "dp"])
def test_pp_collectives_are_the_engines_and_overlap(pool4, kind):
    res = pool4.run(traced_step, kind)
    check([(r["loss"], r["grads"]) for r in res], MODEL, COUNTS, BS, 2 * 4)
    for r in res:
        sent = {op: sum(b for o, b, _, _ in r["records"] if o == op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
        assert sent == r["expected"], (sent, r["expected"])
        assert all(w is not None for o, _, _, w in r["records"] if o != "send"), "a collective never waited for"
        if kind == "fsdp":
            # stage 2's gathers run while stage 0 computes 0F1; stage 2's reduce-scatters while 0BW2, 0BW3 compute
            assert _in_flight_during_compute(r, "all_gather") >= 1, r["records"]
            assert _in_flight_during_compute(r, "reduce_scatter") >= 1, r["records"]
        else:
            assert _in_flight_during_compute(r, "all_reduce") >= 1, r["records"]
