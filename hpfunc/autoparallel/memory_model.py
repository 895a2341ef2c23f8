"""Peak memory per rank of a layout: model states, gathered parameters, activations, loss, reserve.

Terms (bytes, per rank; the largest rank of the pipeline is reported):

* ``params``, ``grads``, ``master``, ``optimizer``: the rank's parameters (its pipeline stages; the
  attention/MLP matrices over ``tp``; the experts over ``ep x tp``) times the bytes of
  :data:`~hpfunc.autoparallel.configuration.STATE_BYTES`, divided by the data ranks that shard each:
  the non-expert parameters over ``fsdp x ep`` (``ep`` shards them as fsdp), the experts over
  ``fsdp``; ZeRO-1 shards only master and optimizer state, ZeRO-2 the gradients too. With mixed
  precision and ZeRO-3 this is ``16 Psi / n`` (docs/reference.md#model-state-memory).
* ``activations``: per layer and token, the saved values of the model description kept under the
  remat kind (Korthikanti et al. 2022: ``2 s b h`` with full recompute; hidden-width values split over
  ``tp`` only with sequence parallelism); times the tokens of a microbatch; times the rank's
  layers; times the stage-microbatches in flight, ``peak_resident_until_w`` of
  :func:`hpfunc.schedules.simulate` for the schedule (1 without a pipeline). Flash attention keeps no
  ``s^2`` term; without it the float32 probabilities ``4 a s`` per token are added. The dispatched MoE
  values scale with the workload's ``expert_rows_factor`` (the padded dispatcher's buffers, 1.5 x by
  default, or the routing imbalance of the dropless one).
* ``gathered``, ``recompute``, ``backward``: what a layer's backward holds besides
  (:func:`backward_phase_bytes`): its parameters gathered again with its unreduced gradients (FSDP),
  its activations rebuilt (remat), the SwiGLU backward's temporaries and the residual gradient.
* ``loss``: the last stage's logits for one microbatch, bf16 plus float32 log-softmax and its gradient
  (with the final norm's saved values, in ``activations`` for that phase).

The peak is the largest of three phases of the step (measured by storage liveness on the real step:
docs/autoparallel.md), not the sum of the terms: the loss's backward, the backward of the rank's last
layer, the backward of its first layer; the terms of the other phases are 0. ``grads`` is what is held
at the peak (all of them once a microbatch's backward ran before it, else those already made);
:attr:`MemoryEstimate.model_states` keeps them all.
* ``reserve``: the workload's reserve for what is not modelled (:data:`UNMODELLED`).

    >>> from hpfunc.models.qwen3.describe import describe
    >>> from hpfunc.models.qwen3.model import preset
    >>> from hpfunc.autoparallel.configuration import Layout, Workload
    >>> m = memory(describe(preset("qwen3-30b-a3b")), Layout(ep=8, remat="full"), Workload(global_batch=8, seq_len=4096))
    >>> round(m.model_states / 1e9, 1)   # 16 x 30.53e9 / 8
    61.1
"""

from __future__ import annotations

import functools
from typing import Mapping

import attrs

from hpfunc.autoparallel.configuration import STATE_BYTES, Layout, Workload
from hpfunc.models.description import LayerDescription, ModelDescription

__all__ = ["MemoryEstimate", "memory", "stage_layers", "rank_stages", "inflight", "UNMODELLED",
           "layer_activation_bytes_per_token", "tokens_per_microbatch", "rank_params", "backward_phase_bytes"]

UNMODELLED = (
    "allocator reserve and fragmentation (the caching allocator's unused blocks)",
    "communication buffers (NCCL channels, all-to-all staging, DeepEP buffers)",
    "CUDA context, cuBLAS/cuDNN workspaces and kernels",
    "optimizer-step temporaries (foreach copies, gradient-norm buffers)",
    "routing imbalance beyond the declared factor (balanced routing assumed by default)",
)


@attrs.frozen
class MemoryEstimate:
    """Bytes per term on the largest rank (``rank``: its pipeline rank)."""

    terms: Mapping[str, float]
    rank: int = 0
    model_state_bytes: float | None = None  # params, all gradients, master, optimizer (``grads`` is those held at the peak)

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def model_states(self) -> float:
        if self.model_state_bytes is not None:
            return float(self.model_state_bytes)
        return float(sum(self.terms[k] for k in ("params", "grads", "master", "optimizer")))

    def largest(self) -> tuple[str, float]:
        """The largest term and its bytes."""
        return max(self.terms.items(), key=lambda kv: kv[1])


def stage_layers(num_layers: int, num_stages: int, given: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per stage: ``given``, or an even split with the remainder on the middle stages (which
    hold neither the embedding nor the head)."""
    if given is not None:
        return tuple(given)
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    bonus = set(order[:extra])
    return tuple(base + (s in bonus) for s in range(num_stages))


def rank_stages(layout: Layout, rank: int) -> tuple[int, ...]:
    """The stages pipeline rank ``rank`` holds (interleaved: ``c p + r``; V schedules: ``r, 2p - 1 - r``)."""
    p = layout.pp
    if layout.pp == 1:
        return (0,)
    if layout.schedule == "zbv":
        return (rank, 2 * p - 1 - rank)
    return tuple(c * p + rank for c in range(layout.stages_per_rank))


def inflight(layout: Layout) -> tuple[int, ...]:
    """Stage-microbatches each pipeline rank keeps at its peak (1 each without a pipeline)."""
    if layout.pp == 1:
        return (1,)
    from hpfunc.autoparallel.pipeline_time import peak_inflight

    return peak_inflight(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def tokens_per_microbatch(layout: Layout, work: Workload) -> float:
    return work.global_batch * work.seq_len / (layout.data_shards * layout.microbatches)


def layer_activation_bytes_per_token(layer: LayerDescription, remat: str, layout: Layout, work: Workload) -> float:
    """What one layer keeps per token of the microbatch on one rank (tp / sp splits applied)."""
    return _layer_bytes(layer, remat, layout.tp, layout.sp, work.expert_rows_factor, work.flash_attention, work.seq_len)


@functools.lru_cache(maxsize=4096)
def _layer_bytes(layer: LayerDescription, remat: str, t: int, sp: bool, imbalance: float, flash: bool,
                 seq_len: int) -> float:
    if remat == "full":
        kept = layer.act_bytes * layer.hidden / (t if sp else 1)
    else:
        values = [v for v in layer.saved if (v.autograd if remat == "none" else v.matmul)]
        kept = sum(v.bytes_per_token / (t if (v.tp_split or sp) else 1) for v in values)
        if remat == "selective":
            kept += layer.act_bytes * layer.hidden / (t if sp else 1)
        moe = sum(v.bytes_per_token / (t if (v.tp_split or sp) else 1) for v in values
                  if v.name.startswith(("expert_", "moe_")) or (layer.is_moe and v.name == "mlp_hidden"))
        kept += moe * (imbalance - 1.0)
        if remat == "none" and not flash:
            kept += 4.0 * layer.heads * seq_len / t
    return float(kept)


def backward_phase_bytes(desc: ModelDescription, layout: Layout, work: Workload, i: int, remat: str,
                         tokens: float) -> dict[str, float]:
    """What layer ``i``'s backward holds at its peak on top of the saved activations, per term:
    ``gathered`` (when FSDP shards them, its parameters unsharded once more for the backward and its
    unreduced gradients), ``recompute`` (with remat: its activations rebuilt) and ``backward`` (the gradient
    temporaries: the SwiGLU's backward holds about eight arrays of the MLP's hidden width at once,
    the down projection's input gradient, the sigmoid, ``1 - sigmoid`` and the products of the SiLU's
    derivative, plus the residual stream's gradient; measured by storage liveness on the tiny MoE)."""
    layer = desc.layers[i]
    p_b, g_b = STATE_BYTES[work.precision][:2]
    gathered = 0.0
    if layout.fsdp * layout.ep > 1 and layout.zero == 3:
        d, e = rank_params(desc, layout, [i], False, False)
        gathered = (d + (e if layout.fsdp > 1 else 0.0)) * (p_b + g_b)
    rec = layer_activation_bytes_per_token(layer, "none", layout, work) * tokens if remat != "none" else 0.0
    t = layout.tp
    hidden = max((v.bytes_per_token / (t if (v.tp_split or layout.sp) else 1) for v in layer.saved
                  if v.name == "mlp_hidden"), default=0.0)
    if layer.is_moe:
        hidden *= work.expert_rows_factor
    resid = layer.act_bytes * layer.hidden / (t if layout.sp else 1)
    return {"gathered": gathered, "recompute": rec, "backward": tokens * (8.0 * hidden + resid)}


def rank_params(desc: ModelDescription, layout: Layout, layers: list[int], first: bool, last: bool
                 ) -> tuple[float, float]:
    """(non-expert, expert) parameters of one model-parallel rank before data sharding."""
    t = layout.tp
    dense = sum(desc.layers[i].dense_params - desc.layers[i].tp_params + desc.layers[i].tp_params / t for i in layers)
    expert = sum((desc.layers[i].expert_params - desc.layers[i].expert_tp_params) / layout.ep
                 + desc.layers[i].expert_tp_params / (layout.ep * t) for i in layers)
    if first:
        dense += desc.embed_params
    if last:
        dense += desc.head_params + desc.final_norm_params
    return dense, expert


def memory(desc: ModelDescription, layout: Layout, work: Workload) -> MemoryEstimate:
    """The memory estimate of the busiest rank (see the module docstring for the terms)."""
    p_b, g_b, m_b, o_b = STATE_BYTES[work.precision]
    counts = stage_layers(desc.num_layers, layout.num_stages, layout.layers_per_stage)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    peaks = inflight(layout)
    tokens = tokens_per_microbatch(layout, work)
    n_dense = layout.fsdp * layout.ep
    n_exp = layout.fsdp
    shard_p = layout.zero == 3
    shard_g = layout.zero >= 2
    best: MemoryEstimate | None = None
    for r in range(layout.pp):
        stages = rank_stages(layout, r)
        layers = [i for s in stages for i in range(starts[s], starts[s] + counts[s])]
        first, last = 0 in stages, layout.num_stages - 1 in stages
        dense, expert = rank_params(desc, layout, layers, first, last)
        terms: dict[str, float] = {
            "params": p_b * (dense / (n_dense if shard_p else layout.ep) + expert / (n_exp if shard_p else 1)),
            "grads": g_b * (dense / (n_dense if shard_g else layout.ep) + expert / (n_exp if shard_g else 1)),
            "master": m_b * (dense / n_dense + expert / n_exp),
            "optimizer": o_b * (dense / n_dense + expert / n_exp),
        }
        all_grads = terms["grads"]
        remat_of = (lambda s: layout.stage_remat[s]) if layout.stage_remat is not None else (lambda s: layout.remat)

        def stage_bytes(s: int, upto: int | None = None) -> float:
            stop = starts[s] + counts[s] if upto is None else upto
            return sum(layer_activation_bytes_per_token(desc.layers[i], remat_of(s), layout, work)
                       for i in range(starts[s], stop)) * tokens

        embed = tokens * desc.act_bytes * desc.hidden / (layout.tp if layout.sp else 1) if first else 0.0
        act = peaks[r] * (max(stage_bytes(s) for s in stages) + embed)  # the embedding output of each in flight
        # gradients exist at the peak when a microbatch's backward ran before it (accumulation, or a
        # pipeline with more microbatches than it keeps in flight); else they come into being after it
        held = all_grads if layout.microbatches > peaks[r] else 0.0
        zero = {"gathered": 0.0, "recompute": 0.0, "backward": 0.0}
        # the phases: the loss's backward (last stage), the backward of the rank's last layer (every
        # activation kept), the backward of its first layer (every gradient made, one layer's activations)
        phases = []
        if last:
            # the final norm's values and the head's input are alive until the loss's backward is done
            head = tokens * desc.head_saved_bytes_per_token
            phases.append(dict(zero, grads=held, activations=act + head, loss=tokens * desc.vocab * (desc.act_bytes + 8)))
        if layers:
            s_last, s_first = stages[-1], stages[0]
            phases.append(dict(backward_phase_bytes(desc, layout, work, layers[-1], remat_of(s_last), tokens),
                               grads=held, activations=act, loss=0.0))
            first_act = (peaks[r] - 1) * (max(stage_bytes(s) for s in stages) + embed) + embed + stage_bytes(
                s_first, starts[s_first] + 1)
            made = g_b * sum(rank_params(desc, layout, layers[1:], False, last)) / (n_dense if shard_g else 1)
            phases.append(dict(backward_phase_bytes(desc, layout, work, layers[0], remat_of(s_first), tokens),
                               grads=all_grads if held else made, activations=first_act, loss=0.0))
        terms.update(max(phases, key=lambda d: sum(d.values()), default=dict(zero, activations=act, loss=0.0)))
        terms["reserve"] = float(work.reserve_bytes)
        est = MemoryEstimate(terms, rank=r, model_state_bytes=terms["params"] + all_grads + terms["master"]
                             + terms["optimizer"])
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best
