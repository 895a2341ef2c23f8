"""Communication per step and rank: bytes each rank sends, per collective and mesh axis.

Ring volumes (docs/reference.md#ring-collectives): all-reduce ``2 (n-1)/n M``, all-gather and
reduce-scatter ``(n-1)/n M``, all-to-all ``(n-1)/n M`` (``M`` the full array; for all-to-all one
rank's buffer). Per step:

* **fsdp / zero-3** (reshard after forward, docs/reference.md#ddp-zero-and-fsdp, ``3 Psi``): per
  microbatch an all-gather of the rank's parameters forward and again backward (all but the
  embedding, whose lookup needs no weights in its backward: ``3 Psi - Psi_embed``, as hpfunc's step
  measures), and a reduce-scatter of their gradients in the reduce dtype
  (:data:`~hpfunc.autoparallel.configuration.REDUCE_BYTES`: fp32 under mixed precision, as hpfunc
  reduces), over the data ranks that shard them (``fsdp x ep`` for the non-expert parameters,
  ``fsdp`` for the experts); **zero-1/2**: one reduce-scatter of gradients and
  one all-gather of parameters per step (``2 Psi``); **dp** (ddp, hsdp's replicas): one all-reduce of
  the (sharded) gradients per step.
* **tp** (docs/reference.md#tensor-and-sequence-parallelism): 2 all-reduces forward and 2 backward of
  ``b s h`` per layer and microbatch, 2 more with full recompute; with sp each becomes an all-gather
  plus a reduce-scatter of the same volume.
* **ep** (docs/reference.md#expert-parallel-all-to-all-volume): 4 all-to-alls per MoE layer and
  microbatch of ``T k h`` elements times the workload's ``expert_rows_factor`` (the padded
  dispatcher's buffers: ``moe_buffer_factor``, 1.5 by default), 2 more with full recompute.
* **pp**: each stage boundary sends ``b s h`` forward and its gradient backward per microbatch.

    >>> from hpfunc.models.qwen3.describe import describe
    >>> from hpfunc.models.qwen3.model import preset
    >>> from hpfunc.autoparallel.configuration import Layout, Workload
    >>> c = communication(describe(preset("qwen3-30b-a3b")), Layout(ep=8), Workload(global_batch=8, seq_len=4096))
    >>> [(x.collective, x.axis, x.count) for x in c if x.collective == "all_to_all"]
    [('all_to_all', 'ep', 192)]
    >>> next(x for x in c if x.collective == "all_to_all").bytes / (192 * 4096)  # 32 KiB x 7/8 per token
    28672.0
"""

from __future__ import annotations

import attrs

from hpfunc.autoparallel.configuration import REDUCE_BYTES, STATE_BYTES, Layout, Workload
from hpfunc.autoparallel.memory_model import rank_stages, stage_layers, tokens_per_microbatch, rank_params
from hpfunc.models.description import ModelDescription

__all__ = ["Collective", "communication", "ring_factor"]


@attrs.frozen
class Collective:
    """``count`` collectives of one kind on one axis (or axes joined by ``+``), ``bytes`` sent in all
    by one rank, over a group of ``group`` ranks; ``phase``: ``data`` (gradient/parameter traffic that
    can overlap compute) or ``model`` (on the critical path of the layer: tp, ep, pp)."""

    collective: str
    axis: str
    group: int
    count: int
    bytes: float
    phase: str


def ring_factor(collective: str, n: int) -> float:
    """Bytes sent per byte of ``M`` for a ring collective over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if collective == "all_reduce" else 1.0) * (n - 1) / n


def _axes(*pairs: tuple[str, int]) -> tuple[str, int]:
    names = [a for a, n in pairs if n > 1]
    size = 1
    for _, n in pairs:
        size *= n
    return "+".join(names), size


def communication(desc: ModelDescription, layout: Layout, work: Workload) -> list[Collective]:
    """The collectives of one step on pipeline rank 0 (for a pipeline: its busiest rank's layers)."""
    p_b = STATE_BYTES[work.precision][0]
    g_b = REDUCE_BYTES[work.precision]
    out: list[Collective] = []
    m = layout.microbatches
    counts = stage_layers(desc.num_layers, layout.num_stages, layout.layers_per_stage)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    # the rank with the most parameters
    best = None
    for r in range(layout.pp):
        stages = rank_stages(layout, r)
        layers = [i for s in stages for i in range(starts[s], starts[s] + counts[s])]
        dense, expert = rank_params(desc, layout, layers, 0 in stages, layout.num_stages - 1 in stages)
        if best is None or dense + expert > best[1] + best[2]:
            best = (layers, dense, expert, 0 in stages)
    layers, dense, expert, first = best  # type: ignore[misc]
    # the backward does not gather the embedding again: its lookup's gradient needs no weights
    embed = desc.embed_params if first else 0

    def add(kind: str, axis: str, n: int, count: int, M: float, phase: str) -> None:
        if n > 1 and count and M:
            c = Collective(kind, axis, n, count, count * M * ring_factor(kind, n), phase)
            for i, o in enumerate(out):  # one entry per collective, axis and phase
                if (o.collective, o.axis, o.group, o.phase) == (kind, axis, n, phase):
                    c = Collective(kind, axis, n, o.count + count, o.bytes + c.bytes, phase)
                    out[i] = c
                    return
            out.append(c)

    d_axis, d_n = _axes(("fsdp", layout.fsdp), ("ep", layout.ep))
    if layout.zero == 3:
        same = layout.ep == 1  # experts and the rest are sharded over the same ranks: one collective each
        add("all_gather", d_axis, d_n, m, (dense + (expert if same else 0)) * p_b, "data")
        add("all_gather", d_axis, d_n, m, (dense - embed + (expert if same else 0)) * p_b, "data")
        add("reduce_scatter", d_axis, d_n, m, (dense + (expert if same else 0)) * g_b, "data")
        if not same:
            add("all_gather", "fsdp", layout.fsdp, 2 * m, expert * p_b, "data")
            add("reduce_scatter", "fsdp", layout.fsdp, m, expert * g_b, "data")
        shard_d, shard_e = d_n, layout.fsdp
    else:  # zero-1/2 on fsdp: once per step; ep still shards the non-experts as fsdp
        add("all_gather", "ep", layout.ep, m, dense / layout.fsdp * p_b, "data")
        add("all_gather", "ep", layout.ep, m, (dense - embed) / layout.fsdp * p_b, "data")
        add("reduce_scatter", "ep", layout.ep, m, dense / layout.fsdp * g_b, "data")
        add("reduce_scatter", "fsdp", layout.fsdp, 1, (dense + expert) * g_b, "data")
        add("all_gather", "fsdp", layout.fsdp, 1, (dense + expert) * p_b, "data")
        shard_d, shard_e = d_n, layout.fsdp
    add("all_reduce", "dp", layout.dp, 1, (dense / shard_d + expert / shard_e) * g_b, "data")

    tokens = tokens_per_microbatch(layout, work)
    a, h = desc.act_bytes, desc.hidden
    rematted = layout.remat == "full" or (layout.stage_remat is not None and "full" in layout.stage_remat)
    per_layer = 6 if rematted else 4
    if layout.tp > 1:
        M = tokens * h * a
        if layout.sp:
            add("all_gather", "tp", layout.tp, per_layer * len(layers) * m, M, "model")
            add("reduce_scatter", "tp", layout.tp, per_layer * len(layers) * m, M, "model")
        else:
            add("all_reduce", "tp", layout.tp, per_layer * len(layers) * m, M, "model")
    if layout.ep > 1:
        moe = [i for i in layers if desc.layers[i].is_moe]
        if moe:
            k = desc.layers[moe[0]].top_k
            M = tokens * k * h * a * work.expert_rows_factor / (layout.tp if layout.sp else 1)
            add("all_to_all", "ep", layout.ep, per_layer * len(moe) * m, M, "model")
    if layout.pp > 1:
        sends = 2 * m * layout.stages_per_rank
        M = tokens * h * a / (layout.tp if layout.sp else 1)
        out.append(Collective("send_recv", "pp", layout.pp, sends, sends * M, "model"))
    return out
