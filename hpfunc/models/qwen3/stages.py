"""Qwen3 split into pipeline stages, for ``plans.pp(axis, pipeline_stages(cfg, n), ...)``.

Stage 0 holds the embedding and its first layers, the last stage its last layers, the final norm and
the head (a tied embedding is used by both: the plan keeps it on every pipeline rank and sums its
gradient over them); each stage runs :func:`~hpfunc.models.qwen3.model.decoder_layer` on its layers
in the bound tensor-parallel layout, which it reads from :mod:`hpfunc.layout` as the model does
(:mod:`hpfunc.models.qwen3.layout_ops`).

What passes from a stage to the next (the *carry*): the hidden states ``h [b, s, H]`` and, for a
mixture-of-experts model, the routing statistics of the layers so far, pooled as the load-balancing
loss pools them (expert counts ``[E]``, router probability sums ``[E]`` and rows) plus the expert load
``[n_moe_layers, E]``. The last stage therefore computes the auxiliary loss of the whole model from
every layer's routing, exactly as :func:`qwen3.loss <hpfunc.models.qwen3.model.loss>` does for that
microbatch, and the probability sums carry its gradient back to each stage's routers.

    >>> import torch
    >>> from hpfunc import random
    >>> from hpfunc.models import qwen3
    >>> cfg = qwen3.preset("qwen3-moe-tiny")
    >>> stages = pipeline_stages(cfg, 2)
    >>> stages.layers, stages.stage_of("embed"), stages.stage_of("layers.1.moe.router")
    ((1, 1), (0,), (1,))
    >>> p, b = qwen3.init(random.key(0), cfg), {"tokens": torch.randint(0, 256, (2, 8))}
    >>> torch.testing.assert_close(stages.run(p, b)[0], qwen3.loss(p, b, cfg)[0])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from hpfunc import layout
from hpfunc import tree as _tree
from hpfunc.layout import PlanError, Stages
from hpfunc.models.config import Qwen3Config
from hpfunc.models.attention_blocks import dense_attention
from hpfunc.models.moe import balancing_loss_from_stats, expert_counts, routing_stats
from hpfunc.models.qwen3 import model as _model
from hpfunc.models.qwen3.layout_ops import check_batch, context_split, embed_tokens, head_loss

__all__ = ["pipeline_stages", "layers_per_stage"]


def layers_per_stage(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """An even split of ``num_layers`` over ``num_stages`` (the remainder to the middle stages, which
    hold neither the embedding nor the head).

    >>> layers_per_stage(7, 3), layers_per_stage(4, 4)
    ((2, 3, 2), (1, 1, 1, 1))
    """
    if num_stages > num_layers:
        raise PlanError(f"pipeline: {num_stages} stages but the model has {num_layers} layers "
                        f"(model.num_hidden_layers); every stage needs at least one layer: use at most "
                        f"{num_layers} stages (pp size x virtual stages)")
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    bonus = set(order[:extra])
    return tuple(base + (s in bonus) for s in range(num_stages))


def _check_split(cfg: Qwen3Config, num_stages: int, layers: Sequence[int] | None) -> tuple[int, ...]:
    L = cfg.num_hidden_layers
    if layers is None:
        return layers_per_stage(L, num_stages)
    layers = tuple(int(n) for n in layers)
    if len(layers) != num_stages or any(n < 1 for n in layers) or sum(layers) != L:
        raise PlanError(f"pipeline: layers_per_stage={list(layers)} must give each of the {num_stages} stages at "
                        f"least one layer and sum to model.num_hidden_layers={L}")
    return layers


def pipeline_stages(cfg: Qwen3Config, num_stages: int, *, layers: Sequence[int] | None = None,
                    moe_impl: str = "auto") -> Stages:
    """Qwen3 as ``num_stages`` pipeline stages (``layers[s]`` decoder layers on stage ``s``; default an
    even split, :func:`layers_per_stage`; ``schedules.balance_layers`` chooses one from costs)."""
    layers = _check_split(cfg, num_stages, layers)
    bounds, start = [], 0
    for n in layers:
        bounds.append((start, start + n))
        start += n
    layer_stage = {i: s for s, (a, b) in enumerate(bounds) for i in range(a, b)}
    last = num_stages - 1
    paths = tuple(p for p, _ in _tree.leaves_with_paths(_model.param_shapes(cfg),
                                                        is_leaf=lambda x: isinstance(x, torch.Size)))
    moe_rows = {i: k for k, i in enumerate(cfg.moe_layers)}
    dispatcher = _model.moe_dispatcher(cfg)
    # a dispatcher that can drop pairs (a capacity factor, padded buffers) reports them per MoE layer
    drops = bool(cfg.moe_layers) and (cfg.moe_capacity_factor is not None or cfg.moe_dispatcher == "padded")

    def stage_of(path: str) -> tuple[int, ...]:
        head = path.split(".")[0]
        if head == "layers":
            return (layer_stage[int(path.split(".")[1])],)
        if head == "embed":
            return (0, last) if cfg.tie_word_embeddings and last != 0 else (0,)
        if head in ("final_norm", "lm_head"):
            return (last,)
        raise PlanError(f"qwen3 pipeline: no stage for parameter {path!r}")

    def local_view(mb: dict) -> tuple[dict, dict]:
        """The microbatch as this rank sees it (its tokens of each sequence under context parallelism) and
        the positions, attention and counted tokens of the bound context-parallel layout for it."""
        cp: dict = {}
        if layout.cp_binding() is not None:
            mb, cp = context_split(cfg, mb)
        check_batch(mb)
        return mb, cp

    def forward(s: int, params: Any, carry: Any, mb: dict) -> tuple:
        mb, hk = local_view(mb)
        tokens = mb["tokens"]
        if s == 0:
            _model.check_tokens(tokens, cfg.vocab_size)
            h = embed_tokens(tokens, params["embed"], cfg)
            stats = None
            if cfg.moe_layers:
                E = cfg.num_experts
                z = h.new_zeros(E, dtype=torch.float32)
                stats = (z, z.clone(), h.new_zeros((), dtype=torch.float32),
                         torch.zeros(len(cfg.moe_layers), E, dtype=torch.int64, device=h.device))
                if drops:
                    stats += (torch.zeros(len(cfg.moe_layers), dtype=torch.int64, device=h.device),)
        else:
            h, stats = carry[0], (tuple(carry[1:]) if len(carry) > 1 else None)
        positions = hk.get("positions")
        positions = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
        cos, sin = _model.rope_for(h, positions, cfg)
        counted = hk.get("counted")
        attend = hk.get("attend")
        if attend is None and mb.get("doc_ids") is not None:  # packed sequences on the pipeline's ranks
            attend = functools.partial(dense_attention, causal=True,
                                       doc_ids=_model.check_doc_ids(mb["doc_ids"], tokens.shape))
        a, b = bounds[s]
        for i in range(a, b):
            h, routing = layout.run_layer(i, _model.decoder_layer, params["layers"][i], h, cos, sin, cfg,
                                          moe_impl=moe_impl, dispatcher=dispatcher, attend=attend)
            if routing is not None:
                if counted is not None:  # context parallelism's padding is not counted
                    keep = counted.reshape(-1)
                    routing = routing._replace(probs=routing.probs[keep], indices=routing.indices[keep])
                counts, prob_sum, rows = routing_stats([routing], cfg.num_experts)
                load = stats[3].clone()
                load[moe_rows[i]] = expert_counts(routing.indices, cfg.num_experts)
                new = (stats[0] + counts, stats[1] + prob_sum, stats[2] + rows, load)
                if drops:
                    dropped = stats[4].clone()
                    dropped[moe_rows[i]] = routing.dropped.to(torch.int64)
                    new += (dropped,)
                stats = new
        return (h,) if stats is None else (h, *stats)

    def loss(params: Any, carry: tuple, mb: dict) -> tuple[torch.Tensor, dict]:
        mb, _ = local_view(mb)
        tokens, labels = mb["tokens"], mb.get("labels")
        labels = _model.shift_labels(tokens) if labels is None else labels
        w_out = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
        # the mean over the whole sequences' targets (across the cp ranks under context parallelism)
        ce = head_loss(carry[0], params["final_norm"], w_out, labels, cfg)
        if cfg.moe_layers:
            counts, prob_sum, rows, load = carry[1:5]
            aux_loss = balancing_loss_from_stats(counts, prob_sum, rows, cfg.num_experts)
            total = ce + cfg.router_aux_loss_coef * aux_loss
        else:
            aux_loss, load = ce.new_zeros(()), torch.zeros(0, 0, dtype=torch.int64, device=ce.device)
            total = ce
        out = {"ce_loss": ce.detach(), "aux_loss": aux_loss.detach(), "expert_load": load,
               "tokens": (labels != _model.IGNORE_INDEX).sum()}
        if drops:
            out["dropped_pairs"] = carry[5]
        return total, out

    def aux_template(mb: dict) -> dict:
        n, E = (len(cfg.moe_layers), cfg.num_experts) if cfg.moe_layers else (0, 0)
        dev = next((x.device for x in mb.values() if isinstance(x, torch.Tensor)), None)  # the batch's device
        z = torch.zeros((), dtype=torch.float32, device=dev)
        out = {"ce_loss": z, "aux_loss": z.clone(), "expert_load": torch.zeros(n, E, dtype=torch.int64, device=dev),
               "tokens": torch.zeros((), dtype=torch.int64, device=dev)}
        if drops:
            out["dropped_pairs"] = torch.zeros(n, dtype=torch.int64, device=dev)
        return out

    return Stages(num_stages=num_stages, paths=paths, stage_of=stage_of, forward=forward, loss=loss,
                  aux_template=aux_template, owner=cfg, layers=layers)
