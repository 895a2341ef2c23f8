"""Qwen3 cut into pipeline stages, composed from the public blocks of :mod:`hpfunc.models`.

``stage_fns(cfg, counts)`` returns one function per stage (stage ``s`` runs ``counts[s]`` decoder
layers; stage 0 also embeds, the last stage also applies the final norm and the head);
``split_params`` / ``merge_grads`` move between the model's parameter tree and per-stage trees.
For MoE models the activations carry the load-balancing statistics (expert counts, summed router
probabilities, rows) so that the last stage computes exactly ``qwen3.loss``'s auxiliary term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpfunc.models import qwen3
from hpfunc.models.attention import gqa_attention
from hpfunc.models.layers import rms_norm, swiglu_mlp
from hpfunc.models.moe import expert_counts, moe_block
from hpfunc.models.rope import rope_inv_freq, rope_tables


def bounds(counts):
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def split_params(params, cfg, counts):
    """Per-stage parameter trees: ``{"embed"?, "layers", "final_norm"?, "head"?}``."""
    if sum(counts) != cfg.num_hidden_layers:
        raise ValueError(f"counts {counts} sum to {sum(counts)}, the model has {cfg.num_hidden_layers} layers")
    stages = []
    last = len(counts) - 1
    for s, (a, b) in enumerate(bounds(counts)):
        p = {"layers": list(params["layers"][a:b])}
        if s == 0:
            p["embed"] = params["embed"]
        if s == last:
            p["final_norm"] = params["final_norm"]
            p["head"] = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
        stages.append(p)
    return stages


def merge_grads(stage_grads, cfg, counts):
    """The model's gradient tree from per-stage gradients (tied embeddings: both uses summed)."""
    last = len(counts) - 1
    layers = [g for s in range(len(counts)) for g in stage_grads[s]["layers"]]
    out = {"embed": stage_grads[0]["embed"], "layers": layers, "final_norm": stage_grads[last]["final_norm"]}
    if cfg.tie_word_embeddings:
        out["embed"] = out["embed"] + stage_grads[last]["head"]
    else:
        out["lm_head"] = stage_grads[last]["head"]
    return out


def _layer(layer, h, cos, sin, cfg, stats):
    eps = cfg.rms_norm_eps
    a = layer["attn"]
    h = h + gqa_attention(rms_norm(h, layer["attn_norm"], eps), a["wq"], a["wk"], a["wv"], a["wo"],
                          a["q_norm"], a["k_norm"], cos, sin, eps=eps,
                          bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"), bo=a.get("bo"))
    x = rms_norm(h, layer["mlp_norm"], eps)
    if "moe" in layer:
        m = layer["moe"]
        y, r = moe_block(x, m["router"], m["experts"]["w_gate"], m["experts"]["w_up"], m["experts"]["w_down"],
                         top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                         expert_bias=m.get("expert_bias"), shared=m.get("shared"))
        counts, probs, rows = stats
        stats = (counts + expert_counts(r.indices, cfg.num_experts).float(), probs + r.probs.float().sum(0),
                 rows + r.probs.shape[0])
    else:
        y = swiglu_mlp(x, layer["mlp"]["w_gate"], layer["mlp"]["w_up"], layer["mlp"]["w_down"])
    return h + y, stats


def stage_fns(cfg, counts):
    """One function per stage: ``fn(stage_params, x)``; stage 0 takes the microbatch dict."""
    last = len(counts) - 1
    moe = bool(cfg.moe_layers)
    E = cfg.num_experts if moe else 0

    def make(s):
        def fn(p, x):
            if s == 0:
                tokens = x["tokens"]
                qwen3.check_tokens(tokens, cfg.vocab_size)
                h = F.embedding(tokens, p["embed"])
                stats = (h.new_zeros(E, dtype=torch.float32), h.new_zeros(E, dtype=torch.float32),
                         h.new_zeros((), dtype=torch.float32))
            else:
                h, *stats = (x,) if isinstance(x, torch.Tensor) else x
                stats = tuple(stats) if moe else None
            S = h.shape[1]
            inv_freq, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                            max_position_embeddings=cfg.max_position_embeddings)
            cos, sin = rope_tables(torch.arange(S, device=h.device), inv_freq, scale, dtype=h.dtype)
            for layer in p["layers"]:
                h, stats = _layer(layer, h, cos, sin, cfg, stats)
            if s != last:
                return (h, *stats) if moe else h
            h = rms_norm(h, p["final_norm"], cfg.rms_norm_eps)
            logits = F.linear(h, p["head"])
            if moe:
                c, pr, rows = stats
                aux = E * torch.sum((c / rows) * (pr / rows))
            else:
                aux = None
            return logits, aux

        return fn

    return [make(s) for s in range(len(counts))]


def make_loss_fn(cfg):
    def loss_fn(y, mb):
        logits, aux = y
        labels = qwen3.shift_labels(mb["tokens"])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=qwen3.IGNORE_INDEX)
        return ce + cfg.router_aux_loss_coef * aux if cfg.moe_layers else ce

    return loss_fn
