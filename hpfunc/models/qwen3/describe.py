"""Qwen3 described for the cost model (:class:`hpfunc.models.description.ModelDescription`).

Parameters are counted from :func:`~hpfunc.models.qwen3.model.param_shapes` (so they equal
:func:`~hpfunc.models.qwen3.model.count_params`) and split by how the Qwen3 parallel plan shards
them: attention projections and dense MLPs split over tensor parallelism, the expert stacks over
the expert axis (and their hidden features over tp), norms and the router replicated.

Saved activations per token follow what autograd keeps in :func:`~hpfunc.models.qwen3.model.decoder_layer`
with ``a`` bytes per activation element (``u = 4`` bytes more per element where an RMSNorm upcasts a
16-bit input to float32; 0 in float32): the attention block keeps the norm's float32 input and
statistics (in float32 also its normalised value), its normalised output (``attn_in``), the projections ``q``, ``k``, ``v``, the
q/k norms' inputs and outputs, the rotated ``q``, ``k`` that attention reads, and the attention output with
its float32 log-sum-exp; the MLP keeps ``mlp_in``, gate, up, SiLU and their product ``mlp_hidden``;
an MoE block keeps its float32 router probabilities and routing indices, ``k`` dispatched copies of
each token (``moe_dispatch``), the experts' gate, up and hidden values. The names are the
``checkpoint_name`` tags a remat policy selects on.

    >>> from hpfunc.models.qwen3.model import count_params, preset
    >>> d = describe(preset("qwen3-30b-a3b"))
    >>> d.params == count_params(preset("qwen3-30b-a3b")), d.num_layers
    (True, 48)
"""

from __future__ import annotations

from hpfunc.models.config import Qwen3Config
from hpfunc.models.description import LayerDescription, ModelDescription, SavedValue

__all__ = ["describe"]


# Operators one decoder layer's forward dispatches (aten ops under a dispatch mode, the local path:
# tests/autoparallel/test_autoparallel_costs.py counts them on the real layer); a parallel plan adds
# its collectives and the MoE dispatcher's exchange.
MOE_FORWARD_OPS = 111
DENSE_FORWARD_OPS = 86


def _tensors(layer_shapes: dict) -> int:
    import torch

    from hpfunc import tree

    return len(tree.leaves(layer_shapes, is_leaf=lambda x: isinstance(x, torch.Size)))


def _norm_bytes(H: int, a: int) -> int:
    """What a hidden-width RMSNorm keeps per token besides its output: in 16-bit its float32 copy of the
    input and the statistics (``4 H + 4``); in float32 the upcast is the input itself, which it keeps,
    and its normalised value, kept for the weight's gradient (``2 a H + 4``; measured with storage
    liveness on Qwen3's layer in both dtypes)."""
    return (4 * H if a < 4 else 2 * a * H) + 4


def _attention_values(cfg: Qwen3Config, a: int, u: int) -> list[SavedValue]:
    H, D = cfg.hidden_size, cfg.head_dim
    Q, K = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return [
        SavedValue("attn_norm", _norm_bytes(H, a), tp_split=False),
        SavedValue("attn_in", a * H, tp_split=False),
        SavedValue("q", a * Q, matmul=True, recompute_flops_per_token=2.0 * H * Q),
        SavedValue("k", a * K, matmul=True, recompute_flops_per_token=2.0 * H * K),
        SavedValue("v", a * K, matmul=True, recompute_flops_per_token=2.0 * H * K),
        SavedValue("q_norm", u * Q + a * Q + 4 * heads),
        SavedValue("k_norm", u * K + a * K + 4 * kv),
        SavedValue("q_rope", a * Q),
        SavedValue("k_rope", a * K),
        SavedValue("attn_out", a * Q + 4 * heads, attention=True),
        SavedValue("attn_proj", a * H, autograd=False, matmul=True, tp_split=False,
                   recompute_flops_per_token=2.0 * Q * H),
    ]


def _mlp_values(cfg: Qwen3Config, i: int, a: int, u: int) -> list[SavedValue]:
    H = cfg.hidden_size
    norm = [SavedValue("mlp_norm", _norm_bytes(H, a), tp_split=False), SavedValue("mlp_in", a * H, tp_split=False)]
    if not cfg.is_moe_layer(i):
        I = cfg.intermediate_size
        return norm + [
            SavedValue("mlp_gate", a * I, matmul=True, recompute_flops_per_token=2.0 * H * I),
            SavedValue("mlp_up", a * I, matmul=True, recompute_flops_per_token=2.0 * H * I),
            SavedValue("mlp_act", a * I),
            SavedValue("mlp_hidden", a * I),
            SavedValue("mlp_out", a * H, autograd=False, matmul=True, tp_split=False,
                       recompute_flops_per_token=2.0 * I * H),
        ]
    E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # The experts run as grouped GEMMs, which hpfunc's dots policies do not cache (not matmul=True):
    # selective remat recomputes them. The SiLU is applied inside the product and the routing weights
    # scale the hidden values before the down projection, so neither the SiLU output nor the experts'
    # outputs are kept (measured with hpfunc.memory.saved_activations on this layer).
    return norm + [
        SavedValue("router", a * E, autograd=False, matmul=True, tp_split=False, recompute_flops_per_token=2.0 * H * E),
        SavedValue("router_probs", 4 * E + 4 * k, tp_split=False),
        SavedValue("routing_indices", 8 * 4 * k + a * k, tp_split=False),
        SavedValue("moe_dispatch", a * k * H, tp_split=False),
        SavedValue("expert_gate", a * k * I, recompute_flops_per_token=2.0 * k * H * I),
        SavedValue("expert_up", a * k * I, recompute_flops_per_token=2.0 * k * H * I),
        SavedValue("mlp_hidden", a * k * I),
        SavedValue("expert_out", a * k * H, autograd=False, recompute_flops_per_token=2.0 * k * I * H),
    ]


def describe(cfg: Qwen3Config, *, act_bytes: int = 2) -> ModelDescription:
    """The cost-model description of a Qwen3 model with activations of ``act_bytes`` bytes (2: bf16).

    >>> from hpfunc.models.qwen3.model import preset
    >>> layer = describe(preset("qwen3-30b-a3b")).layers[0]
    >>> layer.num_experts, layer.top_k, round(layer.matmul_flops_per_token / 2e6, 2)  # active M params
    (128, 8, 56.89)
    """
    if act_bytes not in (2, 4):
        raise ValueError(f"describe: act_bytes must be 2 (bf16/fp16) or 4 (fp32), found {act_bytes!r}")
    a, u = act_bytes, (4 if act_bytes < 4 else 0)
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    Q, K = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attn_mm = Q * H + 2 * K * H + H * Q
    attn_bias = (Q + 2 * K + H) if cfg.attention_bias else 0
    attn = attn_mm + attn_bias + 2 * D
    from hpfunc.models.qwen3.model import param_shapes

    shapes = param_shapes(cfg)["layers"]
    layers = []
    for i in range(cfg.num_hidden_layers):
        norms = 2 * H
        sh = cfg.shared_expert_intermediate_size
        if cfg.is_moe_layer(i):
            E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
            experts = 3 * E * I * H
            shared = 3 * sh * H + H if sh else 0
            dense = attn + norms + E * H + shared
            tp = attn_mm + (Q + 2 * K if cfg.attention_bias else 0) + 3 * sh * H
            mm = 2.0 * (attn_mm + E * H + k * 3 * I * H + 3 * sh * H)
            divides = (cfg.num_attention_heads, cfg.num_key_value_heads, I) + ((sh,) if sh else ())
            layers.append(LayerDescription(
                hidden=H, dense_params=dense, tp_params=tp, expert_params=experts, expert_tp_params=experts,
                num_experts=E, top_k=k, matmul_flops_per_token=mm, attention_flops_per_token_per_position=4.0 * Q,
                heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, tp_divides=divides,
                saved=tuple(_attention_values(cfg, a, u) + _mlp_values(cfg, i, a, u)), act_bytes=a,
                forward_ops=MOE_FORWARD_OPS, param_tensors=_tensors(shapes[i])))
        else:
            I = cfg.intermediate_size
            mlp = 3 * I * H
            layers.append(LayerDescription(
                hidden=H, dense_params=attn + norms + mlp, tp_params=attn_mm + mlp
                + (Q + 2 * K if cfg.attention_bias else 0),
                matmul_flops_per_token=2.0 * (attn_mm + mlp), attention_flops_per_token_per_position=4.0 * Q,
                heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                tp_divides=(cfg.num_attention_heads, cfg.num_key_value_heads, I),
                saved=tuple(_attention_values(cfg, a, u) + _mlp_values(cfg, i, a, u)), act_bytes=a,
                forward_ops=DENSE_FORWARD_OPS, param_tensors=_tensors(shapes[i])))
    same: dict[LayerDescription, LayerDescription] = {}
    layers = [same.setdefault(layer, layer) for layer in layers]  # equal layers: one object (cheap lookups)
    return ModelDescription(
        name="qwen3", vocab=V, hidden=H, layers=tuple(layers), embed_params=V * H,
        head_params=0 if cfg.tie_word_embeddings else V * H, final_norm_params=H, act_bytes=a,
        head_saved_bytes_per_token=_norm_bytes(H, a) + a * H)
