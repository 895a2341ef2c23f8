"""Pipeline parallelism inside the front door (``plans.pp``): parity with one device through
``hpfunc.parallelize`` for every schedule, pp x fsdp / tp / ep and pp x fsdp x tp on 8 ranks, dense
and MoE, uneven layers and tied embeddings; the pipeline's point-to-point bytes against the schedule's
sends; the plan's errors before any communication.

The reference is the single-device step on the same global batch, its loss the mean over the
pipeline's microbatches (a MoE load-balancing loss is that of each microbatch, as with gradient
accumulation; for the dense model this is the whole batch's loss).
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _pp_helpers as H
from hpfunc.layout import PlanError
from hpfunc.train.distributed import AbstractMesh
from hpfunc.transforms import plans

pytestmark = pytest.mark.multirank

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zbv", "dualpipev")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_every_schedule_matches_single_device(pools, schedule):
    out = pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], schedule=schedule, m=4)
    # each rank holds only its stages' parameters: stage 0's rank the embedding, the last's the head
    first, last = out[0]["local_paths"], out[1]["local_paths"]
    if schedule not in ("zbv", "dualpipev"):  # a V puts the first and the last stage on rank 0
        assert "embed" in first and "lm_head" in last and "embed" not in last and "lm_head" not in first
    assert not set(first) & set(last)


@pytest.mark.parametrize("case", [
    dict(schedule="1f1b", m=2, kind="moe", layers=2),
    dict(schedule="zbv", m=4, kind="moe", layers=4, tied=True),
    dict(schedule="1f1b", m=2, tied=True, split=(1, 3)),
    dict(schedule="gpipe", m=3, split=(3, 1), batch=6),
], ids=["moe", "moe-zbv-tied", "tied-uneven", "uneven-m3"])
def test_pp2_moe_tied_and_uneven_layers(pools, case):
    out = pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], **case)
    if case.get("tied"):  # a tied embedding is held by every pipeline rank (its gradient summed over them)
        assert all("embed" in o["local_paths"] for o in out)


@pytest.mark.parametrize("mesh,roles,case", [
    ({"pp": 2, "fsdp": 2}, ["pp", "fsdp"], dict(schedule="1f1b", m=2)),
    ({"fsdp": 2, "pp": 2}, ["fsdp", "pp"], dict(schedule="gpipe", m=2, kind="moe", layers=2, tied=True)),
    ({"pp": 2, "tp": 2}, ["pp", "tp"], dict(schedule="zbv", m=2)),
    ({"pp": 2, "ep": 2}, ["pp", "ep"], dict(schedule="1f1b", m=2, kind="moe", layers=2)),
    ({"pp": 4}, ["pp"], dict(schedule="1f1b", m=4)),
    ({"pp": 4}, ["pp"], dict(schedule="interleaved", m=4, layers=8)),
], ids=["pp-fsdp", "fsdp-pp-moe-tied", "pp-tp-zbv", "pp-ep-moe", "pp4-1f1b", "pp4-interleaved"])
def test_pp_composes_on_4_ranks(pools, mesh, roles, case):
    pools(4).run(H.run_pp_parity, mesh, roles, **case)


@pytest.mark.parametrize("case", [
    dict(schedule="1f1b", m=2, remat="nothing_saveable"),
    # full recompute under B/W, the last stage's loss region included
    dict(schedule="zbv", m=4, remat={0: "nothing_saveable", 2: "nothing_saveable", 3: "nothing_saveable"}),
    dict(schedule="interleaved", m=4, remat=["dots_saveable", None, "nothing_saveable", "dots_saveable"]),
    dict(schedule="zb_h1", m=4, kind="moe", remat=["nothing_saveable", None]),
], ids=["all-stages", "zbv-some", "interleaved-per-stage", "moe-zb_h1"])
def test_per_stage_recompute_matches_single_device(pools, case):
    pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], steps=1, **case)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_swapped_activations_change_nothing(pools, schedule):
    """``max_resident=1``: the schedule swaps activations to host and back (executed), same results."""
    pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], schedule=schedule, m=4, steps=1, max_resident=1)


def test_selective_recompute_on_a_split_backward_is_a_plan_error():
    cfg, shapes, pplan = _dense()
    plan = plans.pp("pp", pplan.pipeline_stages(cfg, 4), schedule="zbv", microbatches=4, remat="dots_saveable")
    with pytest.raises(PlanError, match=r"stage 0 has the selective remat policy dots_saveable but schedule 'zbv' "
                                        r"splits its backward"):
        plan.resolve(shapes, AbstractMesh({"pp": 2}))
    with pytest.raises(PlanError, match=r"unknown remat policy 'dots'"):
        plans.pp("pp", pplan.pipeline_stages(cfg, 2), microbatches=2, remat="dots").resolve(
            shapes, AbstractMesh({"pp": 2}))


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1", "zb_h2", "zbv", "dualpipev"])
def test_pp4_more_schedules_match_single_device(pools, schedule):
    two = schedule in ("zbv", "dualpipev")
    pools(4).run(H.run_pp_parity, {"pp": 4}, ["pp"], schedule=schedule, m=8 if schedule == "dualpipev" else 4,
                 layers=8 if two else 4, steps=1)


def test_pp_fsdp_tp_on_8_ranks(pools):
    """Parity, and for dense 1F1B the bytes inside each stage: the tensor-parallel all-reduces of
    :func:`_tp_traffic` on microbatches of ``b / (fsdp x m)`` rows, the replicated gradients' sum over
    this rank's fsdp shard of them; FSDP gathers and reduce-scatters the stage's tp-local bytes
    (each parameter's block on this tp rank) once per step."""
    mesh, roles = {"pp": 2, "fsdp": 2, "tp": 2}, ["pp", "fsdp", "tp"]
    out = pools(8).run(H.run_pp_parity, mesh, roles, schedule="1f1b", m=2, steps=1, count_comm=True)
    for rank, o in enumerate(out):
        want, replicated, tp_local = _tp_traffic(o["local_paths"], m=2, rows=8 // 2, fsdp=2)
        assert _records_over(o, ("tp",)) == want, rank
        assert sum(r[3] for r in o["records"] if r[0] == "all_gather" and r[2] == ("fsdp",)) == tp_local, rank
        assert sum(r[3] for r in o["records"] if r[0] == "reduce_scatter" and r[2] == ("fsdp",)) == tp_local, rank
    pools(8).run(H.run_pp_parity, mesh, roles, schedule="zbv", m=2, kind="moe", layers=4, steps=1)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_schedules_microbatches_and_splits(pools, data):
    schedule = data.draw(st.sampled_from(SCHEDULES), label="schedule")
    per_rank = 2 if schedule in ("zbv", "dualpipev", "interleaved") else 1
    n = 2 * per_rank
    layers = data.draw(st.integers(n, n + 2), label="layers")
    cuts = sorted(data.draw(st.lists(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1, unique=True),
                            label="cuts"))
    split = tuple(b - a for a, b in zip([0] + cuts, cuts + [layers]))
    m = 4 if schedule == "dualpipev" else data.draw(st.sampled_from([2, 4]), label="microbatches")  # m >= 2p
    kind = data.draw(st.sampled_from(["dense", "moe"]), label="kind")
    pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], schedule=schedule, m=m, kind=kind, layers=layers,
                 split=split, steps=1, seed=data.draw(st.integers(0, 100), label="seed"))


def test_pipeline_sends_are_counted_as_the_schedule_says(pools):
    """1F1B on 2 ranks, 4 microbatches of [2, 8, 64] fp32 hidden states: in each step rank 0 sends 4
    activations, rank 1 sends 4 gradients back, each b/m x s x H x 4 bytes; in the first step each
    forward message also has a header naming its shapes, in the second none (both ends know them).
    Besides them each rank makes one collective a step: the loss, the aux and the gradients' sum of
    squares (the train step's grad_norm) packed in one fp64 psum (loss, ce_loss, aux_loss, tokens and
    the norm: 5 x 8 bytes; a dense model's expert load is empty)."""
    out = pools(2).run(H.run_pp_parity, {"pp": 2}, ["pp"], schedule="1f1b", m=4, steps=2, count_comm=True)
    nbytes = 2 * 8 * 64 * 4
    for step in range(2):
        for rank, name, phase in ((0, "pipeline_activations", "forward"), (1, "pipeline_grads", "backward")):
            records = out[rank]["records_per_step"][step]
            sends = [r for r in records if r[0] == "send" and r[6] != "header"]
            assert [(r[1], r[4], r[3], r[5]) for r in sends] == [(name, phase, nbytes, float(nbytes))] * 4, (step, rank)
        assert sum(r[0] == "send" and r[6] == "header" for r in out[0]["records_per_step"][step]) == (4, 0)[step]
        for rank in range(2):
            others = [r[:4] for r in out[rank]["records_per_step"][step] if r[0] != "send"]
            assert others == [("all_reduce", "psum", ("pp",), 5 * 8)], (step, rank, others)


def test_fsdp_inside_stages_gathers_each_stage_once_per_step(pools):
    """pp 2 x fsdp 2: each rank all-gathers its stages' parameters once per step (payload = their whole
    bytes, every leaf being sharded) and reduce-scatters their gradients once, over ``fsdp`` only; the
    pipeline's sends go over ``pp`` only."""
    out = pools(4).run(H.run_pp_parity, {"pp": 2, "fsdp": 2}, ["pp", "fsdp"], schedule="1f1b", m=2, steps=1,
                       count_comm=True)
    for rank, o in enumerate(out):
        def total(op, axes):
            return sum(r[3] for r in o["records"] if r[0] == op and r[2] == axes)
        assert total("all_gather", ("fsdp",)) == o["stage_bytes"], rank
        assert total("reduce_scatter", ("fsdp",)) == o["stage_bytes"], rank
        assert {r[2] for r in o["records"] if r[0] == "send"} == {("pp",)}, rank
        assert not [r for r in o["records"] if r[0] in ("all_gather", "reduce_scatter") and "pp" in r[2]], rank


def test_fsdp_inside_stages_gathers_the_next_layer_while_a_layer_computes(pools):
    """pp 2 x fsdp 2 (1F1B, m = 2), two steps traced (comm counter issue / wait times, each decoder
    layer's forward window): each stage's first forward reads its layers one by one, and landing a
    layer's all-gather issues the next group's without waiting, so on every rank at least one all-gather
    is issued inside a layer's forward and still in flight when that layer ends (stage 0: embed, layers.0,
    layers.1; stage 1: layers.2, layers.3, then the head's groups; each rank's 2 layers -> >= 1), in both
    steps (the first in the tree's order, the second in the order the first read). The gradients'
    reduce-scatters are issued without waiting (tagged ``async``) in the step's backward, at least one
    still in flight when the next is issued. Every step gathers and reduce-scatters each stage's bytes
    exactly once (as :func:`test_fsdp_inside_stages_gathers_each_stage_once_per_step`), and the losses are
    the same on the fsdp pair (parity: ``test_pp_composes_on_4_ranks[pp-fsdp]``)."""
    out = pools(4).run(H.run_pp_fsdp_trace)
    for rank, o in enumerate(out):
        for k, st in enumerate(o["steps"]):
            where = (rank, k)
            assert H.gathers_in_flight_across_layers(st) >= 1, (where, st["records"], st["layers"])
            rs = [r for r in st["records"] if r[0] == "reduce_scatter"]
            assert rs and all(r[2] == "async" and r[4] is not None for r in rs), (where, rs)
            assert H.scatters_in_flight_together(st) >= 1, (where, rs)
            for op in ("all_gather", "reduce_scatter"):
                assert sum(r[1] for r in st["records"] if r[0] == op) == o["stage_bytes"], (where, op)
    for a, b in ((0, 1), (2, 3)):  # an fsdp pair holds the same stage: the same loss
        assert [s["loss"] for s in out[a]["steps"]] == [s["loss"] for s in out[b]["steps"]]


def test_fsdp_inside_stages_under_mixed_precision(pools):
    """pp 2 x fsdp 2 computing in fp64 over fp32 storage: the stages' deferred reads land fp64 gathers
    and the asynchronous reduce-scatters sum fp64 into carriers; losses and gradients equal the fp32
    run's (rtol 1e-5 / 1e-4) over 2 steps, the same on every rank."""
    out = pools(4).run(H.run_pp_fsdp_mixed)
    assert all(o == out[0] for o in out), out


def _tp_traffic(local_paths, *, m: int, rows: int, fsdp: int = 1, seq: int = 8, layers: int = 4):
    """What the tensor-parallel axis carries in one step for the rank holding ``local_paths`` of the
    dense tiny Qwen3 (hidden H = 64, fp32) under ``qwen3.parallel_plan.tp_styles``, derived from that
    plan: the activations ``[rows / m, seq, H]`` of a microbatch are replicated between the blocks;
    ``wq/wk/wv`` and ``w_gate/w_up`` are column-parallel (their input needs no communication), ``wo``
    and ``w_down`` row-parallel, their partial outputs summed by one all-reduce each. So per layer of
    the stage and per microbatch: 2 all-reduces forward, and their transposes (psum's is psum) 2
    backward, each ``rows / m x seq x H x 4`` bytes. After the backward, one all-reduce sums the
    gradients of the stage's tp-replicated parameters (norms, embedding, head; the styles match none of
    them), ``R / fsdp`` bytes (each rank holds its fsdp shard of them). Nothing else goes over ``tp``
    alone (the loss and the gradient norm's scalars go over the pipeline axis as well).

    Returns the sorted ``(op, phase, bytes)`` of that traffic (the replicated sum's phase unchecked:
    ``None``), ``R`` and the stage's tp-local bytes ``R + (T - R) / 2`` (``T``: all its parameters)."""
    import fnmatch

    import hpfunc
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan

    cfg = H.model_cfg("dense", layers, False)
    shapes = dict(hpfunc.tree.leaves_with_paths(qwen3.param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size)))
    styles = parallel_plan.tp_styles(cfg)
    nbytes = {p: 4 * int(torch.Size(shapes[p]).numel()) for p in local_paths}
    replicated = sum(n for p, n in nbytes.items() if not any(fnmatch.fnmatchcase(p, pat) for pat in styles))
    n_layers = len({p.split(".")[1] for p in local_paths if p.startswith("layers.")})
    act = rows // m * seq * cfg.hidden_size * 4
    want = [("all_reduce", "forward", act)] * (2 * n_layers * m) + [("all_reduce", "backward", act)] * (2 * n_layers * m)
    want = sorted(want + [("all_reduce", None, replicated // fsdp)], key=str)
    return want, replicated, replicated + (sum(nbytes.values()) - replicated) // 2


def _records_over(out: dict, axes: tuple) -> list:
    """The communication records over exactly ``axes`` as ``(op, phase, bytes)`` (the phase of any
    record that is not an activation's ``None``), sorted as :func:`_tp_traffic` sorts."""
    act = max(r[3] for r in out["records"] if r[2] == axes and r[4] == "backward")
    return sorted(((r[0], r[4] if r[3] == act else None, r[3]) for r in out["records"] if r[2] == axes), key=str)


def test_tp_inside_stages_all_reduces_as_the_tp_plan_says(pools):
    """pp 2 x tp 2 (1F1B, m = 2, 8 x 8 tokens, 2 layers per stage): each rank's tp traffic is
    :func:`_tp_traffic`: 8 all-reduces of 2 x 8 x 64 x 4 = 8 KiB forward and 8 backward (2 per layer per
    microbatch each way) and one of its stage's replicated gradients. The same model without a pipeline
    (tp 2 alone, one batch of b / m = 4 rows) all-reduces, summed over the stages, exactly 1/m of the
    pipeline's activation bytes and exactly the replicated gradients of both stages: the pipeline adds
    no tensor-parallel traffic, it runs each stage's per microbatch."""
    out = pools(4).run(H.run_pp_parity, {"pp": 2, "tp": 2}, ["pp", "tp"], schedule="1f1b", m=2, steps=1,
                       count_comm=True)
    for rank, o in enumerate(out):
        assert _records_over(o, ("tp",)) == _tp_traffic(o["local_paths"], m=2, rows=8)[0], rank
        assert not [r for r in o["records"] if "tp" in r[2] and r[0] != "all_reduce"], rank
    flat = pools(2).run(H.run_pp_parity, {"tp": 2}, ["tp"], m=1, batch=4, steps=1, count_comm=True)[0]
    act = 4 * 8 * 64 * 4
    flat_recs = [r for r in flat["records"] if r[2] == ("tp",) and r[3] > 8]  # the grad norm's scalar apart
    piped = [r for o in (out[0], out[2]) for r in o["records"] if r[2] == ("tp",)]  # tp rank 0 of each stage
    for phase in ("forward", "backward"):
        assert 2 * sum(r[3] for r in flat_recs if r[3] == act and r[4] == phase) == \
            sum(r[3] for r in piped if r[3] == act and r[4] == phase) == 16 * act, phase
    # the replicated gradients: the same bytes (without a pipeline in buckets started during the backward:
    # under the default bucket cap, 25 MiB, the tiny model's 4 layers and top-level parameters share one)
    assert sum(r[3] for r in flat_recs if r[3] != act) == sum(r[3] for r in piped if r[3] != act)
    assert len([r for r in flat_recs if r[3] != act]) == 1


def _resident_bytes(actions, nbytes) -> int:
    """``simulate``'s count behind ``peak_resident_until_w`` for one rank, each stage-microbatch weighted
    by its stage's bytes: ``F`` adds it, ``SWAP_OUT`` takes it off the device, ``SWAP_IN`` brings it
    back, its ``W`` (or ``BW``) frees it."""
    held = peak = 0
    for kind, s in actions:
        held += {"F": 1, "SWAP_IN": 1, "SWAP_OUT": -1, "W": -1, "BW": -1}.get(kind, 0) * nbytes[s]
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("schedule,mesh", [("1f1b", {"pp": 4}), ("zbv", {"pp": 2})])
def test_resident_activation_bytes_follow_simulate_with_and_without_swaps(pools, schedule, mesh):
    """The saved-activation bytes resident on each rank over one front-door step, measured by storage
    liveness (``_pp_helpers.run_pp_resident``), against ``simulate(schedule).peak_resident_until_w`` in
    bytes: each stage-microbatch weighted by what one microbatch of that stage keeps on one device
    (``hpfunc.memory.saved_activations``: 97.75 KiB for a layer stage, 125.9 KiB for the last stage
    with the head; 4 layers, microbatches of 2 x 8 tokens), with and without ``max_resident=1``.

    The executor frees a stage-microbatch at its ``W`` (a split ``B`` keeps the graph for ``W``), hence
    ``peak_resident_until_w``; here it equals ``peak_resident`` for both schedules.

    Tolerance: 1F1B (pp 4) is exact. For ZBV the measured peak may exceed the prediction by whole
    boundary tensors ``I = 2 x 8 x 64 x 4`` B = 4 KiB (4 % of a stage's bytes), at most one per
    stage-microbatch in flight: a swap leaves a stage's *input* on the device (the step holds it as the
    gradient target of ``B``), and at the V's turn the input a stage saved is the previous local
    stage's output, which the step holds as that stage's backward root until its own ``W``. simulate
    counts whole stage-microbatches. Measured: rank 1 exceeds by 1 I unswapped, by 2 I swapped; rank 0
    (whose stage 0 input is the batch) is exact.

    With swaps the peak drops where simulate says: 1F1B rank 0 from 4 to 2 stage-microbatches
    (400384 -> 200192 B); ZBV from 4 to 2 / 3 (429252 -> 229060, 404480 -> 308480 B)."""
    got = {k: pools(mesh["pp"]).run(H.run_pp_resident, mesh, schedule, m=4, max_resident=k) for k in (None, 1)}
    for r in range(len(got[None])):
        boundary = got[None][r]["boundary"]
        predicted = {}
        for k, outs in got.items():
            o = outs[r]
            assert _resident_bytes(o["actions"], collections.defaultdict(lambda: 1)) == o["peak_resident_until_w"] \
                == o["peak_resident"], (k, r)
            predicted[k] = _resident_bytes(o["actions"], o["stage_bytes"])
            extra = o["peak"] - predicted[k]
            assert extra % boundary == 0 and 0 <= extra <= o["peak_until_w"] * boundary, (k, r, o["peak"], predicted[k])
            if schedule == "1f1b":
                assert extra == 0, (k, r)
        plain, swapped = got[None][r], got[1][r]
        if swapped["peak_resident_until_w"] < plain["peak_resident_until_w"]:
            assert swapped["peak"] < plain["peak"], r
            saving, want = plain["peak"] - swapped["peak"], predicted[None] - predicted[1]
            assert abs(saving - want) <= plain["peak_until_w"] * boundary, (r, saving, want)
        else:
            assert swapped["peak"] == plain["peak"], r
    if schedule == "1f1b":
        assert [o["peak"] for o in got[None]] == [400384, 300288, 200192, 128964]
        assert [o["peak"] for o in got[1]] == [200192, 300288, 200192, 128964]


def test_per_stage_recompute_frees_the_stage_activations(pools):
    """pp 2, 1F1B, m = 4, 2 layers per stage: the saved-activation bytes resident per rank (storage
    liveness) with ``remat`` equal exactly the schedule's count weighted by what the recomputed stage
    keeps on one device (``saved_activations`` of the stage under its policy). Full recompute
    (``nothing_saveable``) leaves stage 0 nothing (its input is the batch, held by the step anyway:
    398336 -> 0 B for its 2 stage-microbatches) and the last stage its input and its loss region's
    input (228036 -> 8192 B: the head's logits go too); ``dots_saveable`` on the last stage keeps the
    matmul outputs (228036 -> 115200 B)."""
    runs = {name: pools(2).run(H.run_pp_resident, {"pp": 2}, "1f1b", m=4, remat=remat)
            for name, remat in (("none", None), ("full", "nothing_saveable"), ("dots", {1: "dots_saveable"}))}
    for name, outs in runs.items():
        for r, o in enumerate(outs):
            assert o["peak"] == _resident_bytes(o["actions"], o["stage_bytes"]), (name, r, o)
    assert [o["peak"] for o in runs["none"]] == [398336, 228036]
    assert [o["peak"] for o in runs["full"]] == [0, 2 * runs["full"][1]["boundary"]]
    assert [o["peak"] for o in runs["dots"]] == [398336, 115200]


# ---- errors before any communication


def _dense(layers: int = 4, **kw):
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan

    cfg = qwen3.preset("qwen3-dense-tiny", num_hidden_layers=layers, **kw)
    return cfg, qwen3.param_shapes(cfg), parallel_plan


def test_more_stages_than_layers_is_a_plan_error():
    cfg, _, pplan = _dense(2)
    with pytest.raises(PlanError, match=r"4 stages but the model has 2 layers \(model.num_hidden_layers\)"):
        pplan.pipeline_stages(cfg, 4)
    with pytest.raises(PlanError, match=r"layers_per_stage=\[1, 2\] must give each of the 2 stages"):
        pplan.pipeline_stages(cfg, 2, layers=[1, 2])


def test_a_schedule_for_another_rank_count_or_stage_count_is_a_plan_error():
    from hpfunc.schedules import one_f_one_b

    cfg, shapes, pplan = _dense()
    stages = pplan.pipeline_stages(cfg, 2)
    with pytest.raises(PlanError, match=r"runs on 4 ranks .* but the pipeline axis has 2"):
        plans.pp("pp", pplan.pipeline_stages(cfg, 4), schedule=one_f_one_b(4, 4), microbatches=4).resolve(
            shapes, AbstractMesh({"pp": 2}))
    with pytest.raises(PlanError, match=r"'zbv' on 2 ranks has 4 stages but the model was split into 2"):
        plans.pp("pp", stages, schedule="zbv", microbatches=4).resolve(shapes, AbstractMesh({"pp": 2}))
    with pytest.raises(PlanError, match=r"unknown schedule 'one_f_one_b'; use one of gpipe, 1f1b"):
        plans.pp("pp", stages, schedule="one_f_one_b", microbatches=4).resolve(shapes, AbstractMesh({"pp": 2}))
    with pytest.raises(PlanError, match=r"pp\('pp'\) names mesh axis 'pp', which the mesh does not have"):
        plans.pp("pp", stages, microbatches=4).resolve(shapes, AbstractMesh({"fsdp": 2}))
    with pytest.raises(PlanError, match=r"microbatches must be an int >= 1"):
        plans.pp("pp", stages, microbatches=0)
    other, other_shapes, _ = _dense(6)
    with pytest.raises(PlanError, match=r"'layers.4.attn.k_norm' is not a parameter of the model the pipeline stages were built for"):
        plans.pp("pp", stages, microbatches=2).resolve(other_shapes, AbstractMesh({"pp": 2}))


def test_microbatches_that_do_not_divide_the_batch_are_a_plan_error():
    cfg, _, pplan = _dense()
    plan = plans.pp("pp", pplan.pipeline_stages(cfg, 2), microbatches=4) + plans.fsdp("fsdp")
    with pytest.raises(PlanError, match=r"each data shard's 3 rows do not split into pp microbatches=4.*multiple of 8"):
        plan.check_batch({"tokens": torch.zeros(6, 8, dtype=torch.long)}, AbstractMesh({"pp": 2, "fsdp": 2}))
    plan.check_batch({"tokens": torch.zeros(8, 8, dtype=torch.long)}, AbstractMesh({"pp": 2, "fsdp": 2}))


def test_stages_run_one_after_the_other_are_the_model():
    """The split itself, on one device: dense, MoE, tied, uneven."""
    from hpfunc import random
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan

    b = {"tokens": torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))}
    for cfg, n, layers in ((qwen3.preset("qwen3-dense-tiny", num_hidden_layers=3), 3, None),
                           (qwen3.preset("qwen3-moe-tiny", num_hidden_layers=4, router_aux_loss_coef=0.1), 2, (3, 1)),
                           (qwen3.preset("qwen3-dense-tiny", tie_word_embeddings=True), 2, None)):
        p = qwen3.init(random.key(1), cfg)
        stages = parallel_plan.pipeline_stages(cfg, n, layers=layers)
        (got, aux), (want, ref) = stages.run(p, b), qwen3.loss(p, b, cfg)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(aux["aux_loss"], ref["aux_loss"], rtol=1e-6, atol=1e-7)
        assert torch.equal(aux["expert_load"], ref["expert_load"])
        assert set(stages.paths) == {path for path, _ in __import__("hpfunc").tree.leaves_with_paths(p)}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_receives_are_posted_ahead_of_the_compute_that_waits_for_them(pools, schedule):
    """The recorded timeline of one step: every receive but each stage's first forward input (whose
    header tells the shapes) is posted before at least one compute action that runs ahead of its
    arrival, so its transfer overlaps that compute (on gloo the transfer runs on gloo's threads)."""
    for rank, out in enumerate(pools(2).run(H.run_timeline, schedule)):
        ev = out["events"]
        posts = {a: t for what, a, t in ev if what == "post"}
        arrived = {a: t for what, a, t in ev if what == "arrived"}
        starts = [t for what, a, t in ev if what == "start"]
        assert posts and set(posts) == set(arrived), rank
        overlapped = {a for a, t in posts.items() if any(t < ts < arrived[a] for ts in starts)}
        firsts = {a for a in posts if a.endswith("RECV_F0")}
        assert set(posts) - overlapped == firsts, (rank, sorted(set(posts) - overlapped), out["actions"])


def test_a_loss_that_skips_the_pipeline_stages_is_a_plan_error(pools):
    for msg in pools(2).run(H.run_unpipelined_loss):
        assert "under a pp plan" in msg and "qwen3.parallel_plan.loss" in msg, msg


def test_a_stage_that_reaches_around_its_params_is_a_plan_error(pools):
    """The executor's stages are closed (a full backward names no targets): a stage function that takes
    a parameter from elsewhere than its arguments is caught, not left with a zero gradient."""
    for rank, msg in enumerate(pools(2).run(H.run_stage_reaching_around_its_params)):
        assert "reached the step's parameter" in msg and repr("ab"[rank]) in msg, msg


def test_the_norm_reduced_with_the_loss_is_not_reused_for_gradients_changed_in_place(pools):
    """The pipeline reduces its gradients' sum of squares together with the loss, and global_norm of
    those very tensors reads it; once they are written to in place it is computed again."""
    for first, second in pools(2).run(H.run_norm_of_gradients_scaled_in_place):
        assert first > 0 and abs(second - 2 * first) <= 1e-6 * second, (first, second)


def test_the_pipelined_state_the_step_returned_skips_the_layout_check(pools):
    assert pools(2).run(H.run_pipelined_state_checks) == [0, 0]
