"""Estimated step time of a layout on a hardware description.

Per microbatch and layer: matrix multiplications at ``matmul_efficiency`` of the dtype's peak (the
experts' grouped GEMMs at ``moe_efficiency``, scaled by the routing imbalance), attention at
``attention_efficiency``, every non-matmul saved value written and read once more through HBM;
backward costs twice the forward; recompute adds the forward work the remat kind drops
(:func:`hpfunc.autoparallel.flops.recompute_flops_per_token`). Collectives cost ``latency + bytes /
(link bandwidth x link_efficiency)`` (the latency once per message a ring step waits for, and per
FSDP parameter group), on the intra-node link when the axis's group lies inside one
node (axes ordered ``pp, dp, fsdp, ep, tp``, the last varying fastest), else the inter-node one.
Tensor-, expert- and pipeline-parallel traffic is on the layer's critical path; data-parallel
traffic overlaps compute and only its excess counts. A pipeline's step is the makespan of
:func:`hpfunc.schedules.simulate` with those per-stage costs (its bubble included). The optimizer
step reads and writes the rank's model states once.

This is a model, not a measurement: the efficiencies are the hardware preset's assumptions.

    >>> from hpfunc.models.qwen3.describe import describe
    >>> from hpfunc.models.qwen3.model import preset
    >>> from hpfunc.autoparallel.configuration import Layout, Workload
    >>> from hpfunc.autoparallel.hardware import hardware
    >>> t = step_time(describe(preset("qwen3-30b-a3b")), Layout(ep=8, remat="full", microbatches=8),
    ...               Workload(global_batch=64, seq_len=4096), hardware("h100"))
    >>> sorted(t.terms)[:3], t.total > 0
    (['compute', 'data_comm', 'data_comm_exposed'], True)
"""

from __future__ import annotations

import math
from typing import Mapping

import attrs

from hpfunc.autoparallel.comm_model import Collective, communication
from hpfunc.autoparallel.configuration import AXIS_ORDER, Layout, Workload
from hpfunc.autoparallel.flops import layer_forward_flops_per_token
from hpfunc.autoparallel.hardware import Hardware
from hpfunc.autoparallel.memory_model import memory, rank_stages, stage_layers, tokens_per_microbatch
from hpfunc.models.description import LayerDescription, ModelDescription

__all__ = ["TimeEstimate", "step_time", "collective_seconds", "layer_seconds", "ring_steps", "OPS_PER_PARAM_TENSOR",
           "EP_EXCHANGE_FORWARD_OPS", "TP_FORWARD_OPS"]

# Operators the step dispatches per parameter tensor outside the layers (AdamW's update, the gradient
# norm, FSDP's copies in and out of its buffers): fitted to the op counts of the tiny MoE's real
# step on 4 gloo ranks (fsdp 4: 2,084 ops per rank; the 1F1B ranks of pp 2 x fsdp 2: 1,597 and 1,845).
OPS_PER_PARAM_TENSOR = 14
# Operators a plan adds to a layer's forward (its backward: 2 x), counted the same way: expert
# parallelism's exchange in the padded dispatcher (counts, buffers, the all-to-alls: fsdp 2 x ep 2
# dispatches 505 ops per rank more than fsdp 4 for 2 MoE layers), tensor parallelism's reductions
# (fsdp 2 x tp 2: 72 more).
EP_EXCHANGE_FORWARD_OPS = 84
TP_FORWARD_OPS = 12
# Full recompute dispatches the layer's forward again (charged: ``h_b`` below) and saved-tensor
# bookkeeping (views and detaches, not charged: they allocate nothing): the 1F1B pipeline's first
# rank with ``nothing_saveable`` dispatches 368 ops more for its 2 layer-microbatches, 1.66 x the
# layer's 111 forward ops each. Charging all of them at the full per-op cost moves 1F1B with
# recompute 1% above fsdp x tp at 8 x 32, which every measured run has 11-16% below.


@attrs.frozen
class TimeEstimate:
    """Seconds per term of one step; ``total`` is the step."""

    terms: Mapping[str, float]
    total: float
    tokens: int
    world: int
    busy_seconds: float = 0.0  # every rank's busy time (compute, host, communication, optimizer) summed

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens / (self.total * self.world)


def _span(axis: str, layout: Layout) -> int:
    sizes = {"pp": layout.pp, "dp": layout.dp, "fsdp": layout.fsdp, "ep": layout.ep, "tp": layout.tp}
    outer = min(AXIS_ORDER.index(a) for a in axis.split("+"))
    span = 1
    for a in AXIS_ORDER[outer:]:
        span *= sizes[a]
    return span


def ring_steps(collective: str, n: int) -> int:
    """Messages one rank waits for, in sequence, in a collective over ``n`` ranks (each pays the link
    latency): a ring's ``n - 1`` for all-gather, reduce-scatter and all-to-all, ``2 (n - 1)`` for
    all-reduce, capped at a tree's ``2 log2 n`` per direction (NCCL's algorithms at scale keep the
    latency logarithmic); 1 for a point-to-point send.

    >>> ring_steps("all_gather", 4), ring_steps("all_reduce", 2), ring_steps("all_gather", 256)
    (3, 2, 16)
    """
    if collective == "send_recv":
        return 1
    steps = min(max(0, n - 1), 2 * max(1, math.ceil(math.log2(max(n, 2)))))
    return (2 if collective == "all_reduce" else 1) * steps


def collective_seconds(c: Collective, layout: Layout, hw: Hardware, groups: int = 1) -> float:
    """Time of ``c`` on its axis's link: ``groups`` calls per counted collective (FSDP's one per
    parameter group), each paying :func:`ring_steps` latencies, plus its bytes over the bandwidth."""
    span = _span(c.axis, layout)
    lat = c.count * groups * ring_steps(c.collective, c.group) * hw.latency_s
    if span <= hw.ranks_per_node:
        return lat + c.bytes / (hw.intra_node_bw * hw.link_efficiency)
    if c.collective == "all_to_all":  # the peers inside the node over its links, the others over the NIC
        n = c.group
        local = max(1, min(n, hw.ranks_per_node // max(1, span // n)))
        intra = c.bytes * (local - 1) / (n - 1) / hw.intra_node_bw
        inter = c.bytes * (n - local) / (n - 1) / hw.inter_node_bw
        return lat + max(intra, inter) / hw.link_efficiency
    return lat + c.bytes / (hw.inter_node_bw * hw.link_efficiency)


def layer_seconds(layer: LayerDescription, layout: Layout, work: Workload, hw: Hardware, remat: str,
                  tokens: float) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one layer on ``tokens`` tokens (backward includes recompute)."""
    peak = hw.peak_flops(work.dtype)
    mm, attn = layer_forward_flops_per_token(layer, work.seq_len, causal=work.causal)
    expert = 2.0 * layer.expert_params * layer.top_k / layer.num_experts if layer.num_experts else 0.0
    t = layout.tp
    f_mm = tokens * ((mm - expert) / t / (peak * hw.matmul_efficiency)
                     + expert * work.expert_rows_factor / t / (peak * hw.moe_efficiency))
    f_attn = tokens * attn / t / (peak * hw.attention_efficiency)
    elementwise = sum(v.bytes_per_token / (t if (v.tp_split or layout.sp) else 1)
                      for v in layer.saved if not v.matmul)
    f_mem = tokens * 2.0 * elementwise / hw.hbm_bw
    fwd = f_mm + f_attn + f_mem
    rec = 0.0
    if remat == "full":
        rec = fwd
    elif remat == "selective":  # attention, the elementwise values and uncached (grouped) GEMMs again
        uncached = sum(v.recompute_flops_per_token for v in layer.saved if not v.matmul)
        rec = f_attn + f_mem + tokens * uncached * work.expert_rows_factor / t / (peak * hw.moe_efficiency)
    bwd = 2.0 * (f_mm + f_attn) + 2.0 * f_mem + rec
    # the host's time per dispatched operator: the forward's, twice that in the backward, the forward
    # again under full recompute; serial with the compute on a CPU, hidden behind it on a GPU
    ops = layer.forward_ops + (EP_EXCHANGE_FORWARD_OPS if layer.is_moe and layout.ep > 1 else 0) + (
        TP_FORWARD_OPS if layout.tp > 1 else 0)
    h_f = ops * hw.op_overhead_s
    h_b = (2.0 + (remat == "full")) * h_f
    if hw.host_overlap:
        return max(fwd, h_f), max(bwd, h_b)
    return fwd + h_f, bwd + h_b


def step_time(desc: ModelDescription, layout: Layout, work: Workload, hw: Hardware, *,
              pipeline_bubble: bool = True) -> TimeEstimate:
    """The estimated step time (see the module docstring). ``pipeline_bubble=False`` leaves the
    schedule's bubble out: a lower bound, cheap to compute (the search ranks by it first)."""
    tokens = tokens_per_microbatch(layout, work)
    comm = communication(desc, layout, work)
    by_kind = {"tp": 0.0, "ep": 0.0, "pp": 0.0, "data": 0.0}
    counts = stage_layers(desc.num_layers, layout.num_stages, layout.layers_per_stage)
    # FSDP gathers and reduces each layer (and the embedding, head and final norm) on its own
    fsdp_groups = max(sum(counts[s] for s in rank_stages(layout, r)) for r in range(layout.pp)) + 1
    for c in comm:
        s = collective_seconds(c, layout, hw, fsdp_groups if (c.phase == "data" and layout.zero == 3) else 1)
        key = "data" if c.phase == "data" else c.axis
        by_kind[key] = by_kind.get(key, 0.0) + s
    starts = [sum(counts[:s]) for s in range(len(counts))]
    remat_of = (lambda s: layout.stage_remat[s]) if layout.stage_remat is not None else (lambda s: layout.remat)
    stage_f, stage_b = [], []
    for s in range(layout.num_stages):
        f = b = 0.0
        for i in range(starts[s], starts[s] + counts[s]):
            lf, lb = layer_seconds(desc.layers[i], layout, work, hw, remat_of(s), tokens)
            f, b = f + lf, b + lb
        if s == layout.num_stages - 1:  # head and loss (not split over tp: the trainer's default)
            head = tokens * desc.head_flops_per_token / (hw.peak_flops(work.dtype) * hw.matmul_efficiency)
            loss = tokens * desc.vocab * (desc.act_bytes + 8) * 2 / hw.hbm_bw
            f, b = f + head + loss, b + 2 * head + loss
        stage_f.append(f)
        stage_b.append(b)
    # model-parallel traffic per microbatch and stage, a third forward, two thirds backward
    mp = (by_kind["tp"] + by_kind["ep"] + by_kind["pp"]) / (layout.microbatches * layout.stages_per_rank)
    compute = sum(stage_f[s] + stage_b[s] for s in rank_stages(layout, 0)) * layout.microbatches
    if layout.pp == 1:
        body = layout.microbatches * (stage_f[0] + stage_b[0] + mp)
        bubble = 0.0
    else:
        from hpfunc.autoparallel.pipeline_time import makespan

        split = layout.schedule in ("zb_h1", "zbv")

        def cost(kind: str, s: int) -> float:
            if kind == "F":
                return stage_f[s] + mp / 3
            if kind == "BW":
                return stage_b[s] + 2 * mp / 3
            if kind == "B":
                return (stage_b[s] / 2 if split else stage_b[s]) + 2 * mp / 3
            if kind == "W":
                return stage_b[s] / 2 if split else 0.0
            return 0.0

        per_rank = max(sum(stage_f[s] + stage_b[s] + mp for s in rank_stages(layout, r)) * layout.microbatches
                       for r in range(layout.pp))
        if pipeline_bubble:
            body = makespan(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages, cost)
        else:
            body = per_rank
        bubble = max(0.0, body - per_rank)
    data_exposed = max(0.0, by_kind["data"] - compute)
    mem = memory(desc, layout, work)
    states = mem.model_states
    optimizer = 2.0 * states / hw.hbm_bw
    # the optimizer's and FSDP's operators per parameter tensor of the rank (its layers' and the ends')
    tensors = max(sum(desc.layers[i].param_tensors for s in rank_stages(layout, r)
                      for i in range(starts[s], starts[s] + counts[s])) + 2 for r in range(layout.pp))
    host_opt = tensors * OPS_PER_PARAM_TENSOR * hw.op_overhead_s
    optimizer = max(optimizer, host_opt) if hw.host_overlap else optimizer + host_opt
    terms = {"compute": compute, "tp_comm": by_kind["tp"], "ep_comm": by_kind["ep"], "pp_comm": by_kind["pp"],
             "pp_bubble": bubble, "data_comm": by_kind["data"], "data_comm_exposed": data_exposed,
             "optimizer": optimizer}
    total = body + data_exposed + optimizer
    # what the ranks are busy with, summed: where ranks share cores (this CPU: 4 ranks on 2), one rank's
    # idle time (the pipeline's bubble, a wait) is another's, and the step is this over the cores
    busy = sum(sum(stage_f[s] + stage_b[s] + mp for s in rank_stages(layout, r)) * layout.microbatches
               + by_kind["data"] + optimizer for r in range(layout.pp)) * (layout.world // layout.pp)
    return TimeEstimate(terms, total, work.tokens, layout.world, busy)

