"""Qwen3 causal language model (dense and MoE) as pure functions over a nested-dict pytree.

``params = init(key, cfg)``, ``logits = apply(params, tokens, cfg)``, ``value, aux = loss(params, batch, cfg)``.
The function is Hugging Face's ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` exactly (logits agree to
fp32 rounding; see ``tests/models``).

Parameter paths (``hpfunc.tree.path_str``), all linear weights ``[out, in]`` as in ``nn.Linear``::

    embed                                   [V, H]
    layers.N.attn_norm, layers.N.mlp_norm   [H]
    layers.N.attn.wq                        [Hq*D, H]       (column parallel = shard dim 0)
    layers.N.attn.wk, layers.N.attn.wv      [Hkv*D, H]
    layers.N.attn.wo                        [H, Hq*D]       (row parallel = shard dim 1)
    layers.N.attn.q_norm, .k_norm           [D]
    layers.N.attn.bq/bk/bv/bo               (only with attention_bias)
    layers.N.mlp.w_gate, .w_up              [I, H]          dense layers
    layers.N.mlp.w_down                     [H, I]
    layers.N.moe.router                     [E, H]          MoE layers
    layers.N.moe.experts.w_gate, .w_up      [E, Im, H]      (expert parallel = shard dim 0)
    layers.N.moe.experts.w_down             [E, H, Im]
    layers.N.moe.expert_bias                [E] float32     selection-only bias, never differentiated
    layers.N.moe.shared.{w_gate,w_up,w_down,gate}           (only with a shared expert)
    final_norm                              [H]
    lm_head                                 [V, H]          (absent when tie_word_embeddings)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch

from hpfunc import layout
from hpfunc import random as _random
from hpfunc import tree as _tree
from hpfunc.models.attention import gqa_attention
from hpfunc.models.attention_blocks import dense_attention
from hpfunc.models.dispatch import AllToAll, PaddedAllToAll
from hpfunc.models.config import ConfigError, Qwen3Config, RopeScaling, preset  # noqa: F401  (re-exported)
from hpfunc.models.layers import rms_norm, swiglu_mlp
from hpfunc.models.moe import expert_counts, is_expert_bias, load_balancing_loss, moe_block, update_expert_bias
from hpfunc.models.qwen3.layout_ops import check_batch, context_split, embed_tokens, head, head_loss, reject_hooks
from hpfunc.models.qwen3.tokens import IGNORE_INDEX, check_doc_ids, check_tokens, shift_labels  # noqa: F401
from hpfunc.models.rope import rope_inv_freq, rope_tables
from hpfunc.regions import Regions, plain
from hpfunc.sharding import NamedSharding, full

# Leaf kinds for init: "normal" (std = initializer_range), "ones" (norm weights), "zeros".
_ONES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")
_ZEROS = ("expert_bias", "bq", "bk", "bv", "bo")


def param_shapes(cfg: Qwen3Config) -> dict:
    """The parameter tree with ``torch.Size`` leaves (no memory), the single source of the layout.

    >>> from hpfunc.models import preset
    >>> param_shapes(preset("qwen3-moe-tiny"))["layers"][0]["moe"]["experts"]["w_gate"]
    torch.Size([8, 32, 64])
    """
    S = torch.Size
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = {"wq": S([q, H]), "wk": S([kv, H]), "wv": S([kv, H]), "wo": S([H, q]),
                "q_norm": S([D]), "k_norm": S([D])}
        if cfg.attention_bias:
            attn.update(bq=S([q]), bk=S([kv]), bv=S([kv]), bo=S([H]))
        layer: dict[str, Any] = {"attn_norm": S([H]), "attn": attn, "mlp_norm": S([H])}
        if cfg.is_moe_layer(i):
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            moe: dict[str, Any] = {
                "router": S([E, H]),
                "experts": {"w_gate": S([E, I, H]), "w_up": S([E, I, H]), "w_down": S([E, H, I])},
                "expert_bias": S([E]),
            }
            if cfg.shared_expert_intermediate_size:
                Is = cfg.shared_expert_intermediate_size
                moe["shared"] = {"w_gate": S([Is, H]), "w_up": S([Is, H]), "w_down": S([H, Is]), "gate": S([1, H])}
            layer["moe"] = moe
        else:
            I = cfg.intermediate_size
            layer["mlp"] = {"w_gate": S([I, H]), "w_up": S([I, H]), "w_down": S([H, I])}
        layers.append(layer)
    params: dict[str, Any] = {"embed": S([V, H]), "layers": layers, "final_norm": S([H])}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = S([V, H])
    return params


def _is_shape(x: Any) -> bool:
    return isinstance(x, torch.Size)


def init(key: torch.Tensor, cfg: Qwen3Config, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None, *, shardings: Any = None) -> dict:
    """Initialise parameters: weights ``N(0, initializer_range)``, norm weights 1, biases 0.

    Each leaf draws from ``fold_in(key, i)`` (``i`` its index in flattening order) with counter-based
    :mod:`hpfunc.random`, so values do not depend on the device or on sharding. ``device="meta"``
    allocates nothing (dry runs of the full model). ``expert_bias`` is always float32.

    ``shardings``: a tree of :class:`~hpfunc.sharding.NamedSharding` shaped like :func:`param_shapes`
    (what ``hpfunc.transforms.parallelize.init_sharded`` passes): each leaf is created directly as a
    DTensor, every rank filling or sampling only its own block, with the values of the unsharded init;
    a leaf whose sharding is ``None`` is not created (``None``: a pipeline rank holding other stages).

    >>> from hpfunc.models import preset
    >>> p = init(_random.key(0), preset("qwen3-moe-tiny"))
    >>> tuple(p["layers"][1]["attn"]["wq"].shape)
    (64, 64)
    """
    meta = device is not None and torch.device(device).type == "meta"
    shapes = param_shapes(cfg)
    leaves = _tree.leaves_with_paths(shapes, is_leaf=_is_shape)
    index = {path: i for i, (path, _) in enumerate(leaves)}
    by_path = {} if shardings is None else dict(_tree.leaves_with_paths(shardings, is_leaf=_is_sharding))

    def make(path: str, shape: torch.Size) -> torch.Tensor:
        name = path.rsplit(".", 1)[-1]
        leaf_dtype = torch.float32 if name == "expert_bias" else dtype
        if meta:
            return torch.empty(shape, dtype=leaf_dtype, device="meta")
        if shardings is not None and path not in by_path:
            return None  # no sharding given: a leaf this rank does not hold (another pipeline stage's)
        sharding = by_path.get(path)
        if name in _ONES or name in _ZEROS:
            # unsharded: on the key's device, as the sampled leaves are (a cuda key inits on the GPU)
            out = full(tuple(shape), 1.0 if name in _ONES else 0.0, dtype=leaf_dtype, sharding=sharding,
                       device=None if sharding is not None else key.device)
        else:
            out = _random.normal(_random.fold_in(key, index[path]), tuple(shape), leaf_dtype,
                                 std=cfg.initializer_range, sharding=sharding)
        return out if device is None else out.to(device)

    return _tree.map_with_path(make, shapes, is_leaf=_is_shape)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, NamedSharding)


def count_params(cfg: Qwen3Config) -> int:
    """Total trainable parameters (the expert bias, a buffer-like statistic, is not counted).

    >>> from hpfunc.models import preset
    >>> round(count_params(preset("qwen3-30b-a3b")) / 1e9, 2)
    30.53
    """
    return sum(math.prod(s) for p, s in _tree.leaves_with_paths(param_shapes(cfg), is_leaf=_is_shape)
               if not is_expert_bias(p))


def active_params(cfg: Qwen3Config) -> int:
    """Parameters used per token: routed experts count ``top_k / E`` of their size; embeddings and
    ``lm_head`` count in full (the convention behind "A3B").

    >>> from hpfunc.models import preset
    >>> round(active_params(preset("qwen3-30b-a3b")) / 1e9, 2)
    3.35
    """
    total = 0
    for p, s in _tree.leaves_with_paths(param_shapes(cfg), is_leaf=_is_shape):
        if is_expert_bias(p):
            continue
        n = math.prod(s)
        if ".moe.experts." in p:
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        total += n
    return total


def moe_dispatcher(cfg: Qwen3Config) -> AllToAll | PaddedAllToAll | None:
    """The token dispatcher of the config's MoE layers (``moe_dispatcher``, ``moe_capacity_factor``,
    ``moe_buffer_factor``, ``moe_dispatch_chunks``); ``None`` for the default dropless all-to-all, which
    leaves one device's MoE block on its single-device path.

    >>> from hpfunc.models import preset
    >>> moe_dispatcher(preset("qwen3-moe-tiny")) is None, moe_dispatcher(preset("qwen3-moe-tiny", moe_capacity_factor=1.0))
    (True, AllToAll(capacity_factor=1.0, chunks=1))
    >>> moe_dispatcher(preset("qwen3-moe-tiny", moe_dispatcher="padded", moe_buffer_factor=2.0))
    PaddedAllToAll(buffer_factor=2.0)
    """
    if cfg.moe_dispatcher == "padded":
        return PaddedAllToAll(buffer_factor=cfg.moe_buffer_factor)
    if cfg.moe_capacity_factor is not None:
        return AllToAll(capacity_factor=cfg.moe_capacity_factor)
    if cfg.moe_dispatch_chunks > 1:
        return AllToAll(chunks=cfg.moe_dispatch_chunks)
    return None


def rope_for(h: torch.Tensor, positions: torch.Tensor, cfg: Qwen3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``(cos, sin)`` for ``positions`` in the hidden states' dtype."""
    inv_freq, rope_scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                         max_position_embeddings=cfg.max_position_embeddings, device=positions.device)
    return rope_tables(positions, inv_freq, rope_scale, dtype=h.dtype)


def decoder_layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Qwen3Config, *,
                  moe_impl: str = "auto", dispatcher: Any = None, attend: Callable[..., torch.Tensor] | None = None,
                  regions: Regions | None = None, **removed: Any) -> tuple[torch.Tensor, Any]:
    """One decoder layer (attention then MLP or MoE, pre-norm residuals): ``(h, routing)`` with the MoE
    routing (``None`` for a dense layer). ``dispatcher``: the MoE block's token dispatcher
    (:func:`hpfunc.models.moe.moe_block`; :func:`moe_dispatcher` of the config); ``attend``: as in
    :func:`apply`. ``regions``: run the layer's compute as compiled regions (:func:`compiled_layer`).

    Under a bound tensor-parallel axis (:func:`hpfunc.layout.tp_axis`) the normalised inputs of attention
    and MLP / MoE go through :func:`hpfunc.layout.gather_sequence` (an all-gather along the sequence under
    sequence parallelism) and the row-parallel outputs through :func:`hpfunc.layout.reduce_partial` (the
    attention's output bias added once, after it)."""
    reject_hooks("qwen3.decoder_layer", removed)
    if regions is not None:
        return compiled_layer(layer, h, cos, sin, cfg, regions, moe_impl=moe_impl, dispatcher=dispatcher,
                              attend=attend)
    eps = cfg.rms_norm_eps
    tp = layout.tp_axis() is not None
    a = layer["attn"]
    out = gqa_attention(layout.gather_sequence(rms_norm(h, layer["attn_norm"], eps)), a["wq"], a["wk"], a["wv"],
                        a["wo"], a["q_norm"], a["k_norm"], cos, sin, eps=eps,
                        bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"), bo=None if tp else a.get("bo"), attend=attend)
    h = h + _reduced_attention(out, a, tp)
    x = layout.gather_sequence(rms_norm(h, layer["mlp_norm"], eps))
    y, routing = _feed_forward(layer, x, cfg, moe_impl=moe_impl, dispatcher=dispatcher, mlp=_mlp)
    return h + layout.reduce_partial(y), routing


# ---- Compiled regions (torch.compile of the layer's compute; see hpfunc.regions) -------------------
# Each region is pure tensor compute on plain tensors: the parameters are read (gathered, cast) before
# the call and every layout-dependent choice arrives as an argument, so dynamo traces it whole.


def _dense_layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """A dense layer with no seam in it (no tensor-parallel hook, the default attention): one region."""
    h, x = _attention_block(layer, h, cos, sin, eps)
    m = layer["mlp"]
    return h + swiglu_mlp(x, m["w_gate"], m["w_up"], m["w_down"])


def _attention_block(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a layer with no seam in it, and the MoE block's normalised input."""
    a = layer["attn"]
    h = h + gqa_attention(rms_norm(h, layer["attn_norm"], eps), a["wq"], a["wk"], a["wv"], a["wo"], a["q_norm"],
                          a["k_norm"], cos, sin, eps=eps, bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"),
                          bo=a.get("bo"))
    return h, rms_norm(h, layer["mlp_norm"], eps)


def _attention_in(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(h, w, eps)


def _attention(a: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               with_bo: bool) -> torch.Tensor:
    """The attention block after its input norm; its output projection's bias only when nothing is
    summed after it (``with_bo``)."""
    return gqa_attention(x, a["wq"], a["wk"], a["wv"], a["wo"], a["q_norm"], a["k_norm"], cos, sin, eps=eps,
                         bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"), bo=a.get("bo") if with_bo else None)


def _residual_norm(h: torch.Tensor, out: torch.Tensor, w: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + out
    return h, rms_norm(h, w, eps)


def _reduced_attention(out: torch.Tensor, a: dict, tp: bool) -> torch.Tensor:
    """The attention's output completed under tensor parallelism (``tp``) by :func:`hpfunc.layout.reduce_partial`
    (its bias ``bo``, left out of the partial sums, added once after the reduction); unchanged without."""
    if not tp:
        return out
    out = layout.reduce_partial(out)
    return out + a["bo"] if "bo" in a else out


def _mlp(m: dict, x: torch.Tensor) -> torch.Tensor:
    return swiglu_mlp(x, m["w_gate"], m["w_up"], m["w_down"])


def _feed_forward(layer: dict, x: torch.Tensor, cfg: Qwen3Config, *, moe_impl: str, dispatcher: Any,
                  mlp: Callable[[dict, torch.Tensor], torch.Tensor],
                  regions: Regions | None = None) -> tuple[torch.Tensor, Any]:
    """The layer's MoE block (and its routing; its router and shared expert as compiled regions with
    ``regions``) or its dense MLP (run by ``mlp``; no routing)."""
    if "moe" not in layer:
        return mlp(layer["mlp"], x), None
    m = layer["moe"]
    return moe_block(x, m["router"], m["experts"]["w_gate"], m["experts"]["w_up"], m["experts"]["w_down"],
                     top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                     expert_bias=m.get("expert_bias"), shared=m.get("shared"), impl=moe_impl, dispatcher=dispatcher,
                     regions=regions)


def compiled_layer(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Qwen3Config,
                   regions: Regions, *, moe_impl: str = "auto", dispatcher: Any = None,
                   attend: Callable[..., torch.Tensor] | None = None, **removed: Any) -> tuple[torch.Tensor, Any]:
    """:func:`decoder_layer` with its compute in compiled regions (:class:`hpfunc.regions.Regions`), the
    same function.

    The layer's parameters are read first (:func:`hpfunc.regions.plain`: in a parallelized step that is
    the layer's FSDP gather and mixed-precision cast), eagerly. A dense layer with no tensor-parallel
    axis bound is one region, ``qwen3.layer``. Under a bound tensor-parallel axis the collectives
    (:func:`hpfunc.layout.gather_sequence`, :func:`hpfunc.layout.reduce_partial`) stay eager between four
    regions: ``qwen3.attention_in`` (the input norm), ``qwen3.attention`` (the projections, RoPE and
    attention), ``qwen3.residual_norm`` (the residual add and the MLP's input norm) and ``qwen3.mlp``. An
    ``attend`` function (context parallelism's ring or all-to-all attention, packed documents) keeps the
    attention core eager (the same regions less ``qwen3.attention``). In an MoE block the router
    (``moe.router``) and a shared expert (``moe.shared``) are regions; the routed experts' dispatch and
    compute stay eager: their group sizes are data (a new shape every batch, a recompilation each, or
    dynamic shapes that the grouped kernels do not take), and under expert parallelism the dispatch is
    an all-to-all whose split sizes are read on the host. With no seam the attention half before it is
    one region, ``qwen3.attention_block``.

    >>> from hpfunc.models import preset
    >>> from hpfunc.regions import Regions
    >>> cfg = preset("qwen3-dense-tiny")
    >>> p = init(_random.key(0), cfg)
    >>> h = torch.randn(1, 4, cfg.hidden_size)
    >>> cos, sin = rope_for(h, torch.arange(4), cfg)
    >>> regions = Regions("eager")
    >>> y, _ = compiled_layer(p["layers"][0], h, cos, sin, cfg, regions)
    >>> torch.allclose(y, decoder_layer(p["layers"][0], h, cos, sin, cfg)[0], rtol=1e-5, atol=1e-6)
    True
    >>> regions.compilations
    {'qwen3.layer': 1}
    """
    reject_hooks("qwen3.compiled_layer", removed)
    eps = cfg.rms_norm_eps
    layer = plain(layer)  # read here, outside the regions: the gathers and casts of a parallelized step
    a = layer["attn"]
    tp = layout.tp_axis() is not None
    if not tp and attend is None:
        if "mlp" in layer:
            return regions("qwen3.layer", _dense_layer, layer, h, cos, sin, eps), None
        h, x = regions("qwen3.attention_block", _attention_block, layer, h, cos, sin, eps)
    else:
        x = layout.gather_sequence(regions("qwen3.attention_in", _attention_in, h, layer["attn_norm"], eps))
        if attend is None:
            out = regions("qwen3.attention", _attention, a, x, cos, sin, eps, not tp)
        else:  # eager: the hook may communicate (context parallelism)
            out = gqa_attention(x, a["wq"], a["wk"], a["wv"], a["wo"], a["q_norm"], a["k_norm"], cos, sin, eps=eps,
                                bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"), bo=None if tp else a.get("bo"),
                                attend=attend)
        out = _reduced_attention(out, a, tp)
        h, x = regions("qwen3.residual_norm", _residual_norm, h, out, layer["mlp_norm"], eps)
        x = layout.gather_sequence(x)
    y, routing = _feed_forward(layer, x, cfg, moe_impl=moe_impl, dispatcher=dispatcher,
                               mlp=lambda m, x: regions("qwen3.mlp", _mlp, m, x), regions=regions)
    return h + layout.reduce_partial(y), routing


def apply(params: dict, tokens: torch.Tensor, cfg: Qwen3Config, *, positions: torch.Tensor | None = None,
          return_aux: bool = False, moe_impl: str = "auto", moe_dispatchers: Sequence[Any] | None = None,
          attend: Callable[..., torch.Tensor] | None = None, doc_ids: torch.Tensor | None = None,
          regions: Regions | None = None, **removed: Any) -> Any:
    """Logits ``[B, S, V]`` for ``tokens [B, S]`` (causal; ``positions`` ``[S]`` or ``[B, S]`` default
    ``arange(S)``).

    With ``return_aux`` returns ``(logits, aux)``: ``aux["aux_loss"]`` the load-balancing loss over all
    MoE layers (0 for a dense model, not scaled by ``router_aux_loss_coef``), ``aux["expert_load"]``
    ``[n_moe_layers, E]`` int64 (top-k assignments per expert), ``aux["router_logits"]`` (one
    ``[B*S, E]`` per MoE layer) and, when the config's dispatcher can drop pairs (a capacity factor, or
    the padded dispatcher: :func:`moe_dispatcher`), ``aux["dropped_pairs"]`` ``[n_moe_layers]`` int64,
    the pairs of these tokens that no expert computed.

    ``moe_dispatchers``: one token dispatcher per MoE layer for expert parallelism (e.g. a
    :class:`hpfunc.models.hot_experts.ReplicatedAllToAll` per layer, whose placements change during
    training); default each block's own (:func:`hpfunc.models.moe.moe_block`).

    The layout a parallelized step binds is read from :mod:`hpfunc.layout` (no parameter for it: one way
    to be parallel): under a tensor-parallel axis (:func:`hpfunc.layout.tp_axis`) ``params`` are this
    rank's Megatron shards (:func:`hpfunc.models.qwen3.parallel_plan.tp_styles`) and the row-parallel
    outputs are summed over the axis; under sequence parallelism the residual stream is this rank's
    sequence block; with a vocabulary-parallel embedding and head the logits are this rank's vocabulary
    columns ``[B, S, V / n]``; under context parallelism (:func:`hpfunc.layout.cp_binding`) the logits
    are those of this rank's tokens of each sequence (:func:`~hpfunc.models.qwen3.layout_ops.context_split`).
    With nothing bound this is the single-device model.

    ``attend(q, k, v) -> out``: the causal attention core of every layer (default
    ``scaled_dot_product_attention``; context parallelism attends across the ranks that hold the
    sequence's other tokens).

    ``doc_ids`` ``[B, S]`` int (packed sequences): a token attends only to earlier tokens of its own
    document (ignored when ``attend`` is given: that hook holds the documents itself).

    ``regions``: a :class:`hpfunc.regions.Regions` that compiles each decoder layer's compute
    (:func:`compiled_layer`) and the embedding; default the regions bound by a compiled step
    (:func:`hpfunc.layout.regions`, ``Lowered.compile``), else eager.

    >>> from hpfunc.models import preset
    >>> cfg = preset("qwen3-dense-tiny")
    >>> apply(init(_random.key(0), cfg), torch.zeros(1, 3, dtype=torch.long), cfg).shape
    torch.Size([1, 3, 256])
    """
    reject_hooks("qwen3.apply", removed)
    if layout.runner() is not None:
        raise layout.PlanError("qwen3.apply under a pp plan layer: each pipeline rank holds only its stages' "
                               "parameters; use hpfunc.models.qwen3.parallel_plan.loss, which runs the stages")
    regions = layout.regions() if regions is None else regions
    counted = None
    if layout.cp_binding() is not None:  # this rank's tokens of every sequence, attending across the cp ranks
        local, cp = context_split(cfg, {"tokens": tokens})
        tokens, positions, attend, counted = local["tokens"], cp["positions"], cp["attend"], cp["counted"]
    else:
        check_batch({"tokens": tokens})
    h, aux = _forward(params, tokens, cfg, positions=positions, moe_impl=moe_impl, moe_dispatchers=moe_dispatchers,
                      attend=attend, counted=counted, doc_ids=doc_ids, regions=regions)
    w_out = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = head(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), w_out, cfg)
    return (logits, aux) if return_aux else logits


def _forward(params: dict, tokens: torch.Tensor, cfg: Qwen3Config, *, positions: torch.Tensor | None,
             moe_impl: str, moe_dispatchers: Sequence[Any] | None, attend: Callable[..., torch.Tensor] | None,
             counted: torch.Tensor | None, doc_ids: torch.Tensor | None,
             regions: Regions | None) -> tuple[torch.Tensor, dict]:
    """The embedding and the decoder layers: the last layer's output (before the final norm) and the MoE
    statistics (:func:`apply`'s ``aux``)."""
    check_tokens(tokens, cfg.vocab_size)
    B, S = tokens.shape
    if attend is None and doc_ids is not None:
        attend = functools.partial(dense_attention, causal=True, doc_ids=check_doc_ids(doc_ids, tokens.shape))
    h = embed_tokens(tokens, params["embed"], cfg, regions)
    if positions is None:
        positions = torch.arange(S, device=tokens.device)
    cos, sin = rope_for(h, positions, cfg)
    routings = []
    dispatcher = moe_dispatcher(cfg)
    moe_layers = sum("moe" in layer for layer in params["layers"])
    if moe_dispatchers is not None and len(moe_dispatchers) != moe_layers:
        raise ValueError(f"apply: moe_dispatchers has {len(moe_dispatchers)} entries, expected one per MoE layer "
                         f"({moe_layers})")
    for i, layer in enumerate(params["layers"]):
        # through the layout seam: a bound per-layer transform (remat, offload) wraps the layer
        h, routing = layout.run_layer(i, decoder_layer, layer, h, cos, sin, cfg, moe_impl=moe_impl, attend=attend,
                                      regions=regions, dispatcher=dispatcher if moe_dispatchers is None
                                      else moe_dispatchers[len(routings)])
        if routing is not None:
            routings.append(routing)
    if routings and counted is not None:  # statistics of the counted tokens only
        keep = counted.reshape(-1)
        routings = [r._replace(probs=r.probs[keep], indices=r.indices[keep]) for r in routings]
    if routings:
        E = routings[0].probs.shape[-1]
        aux_loss = load_balancing_loss(routings, E)
        load = torch.stack([expert_counts(r.indices, E) for r in routings])
    else:
        aux_loss = h.new_zeros((), dtype=torch.float32)
        load = torch.zeros(0, 0, dtype=torch.int64, device=h.device)
    aux = {"aux_loss": aux_loss, "expert_load": load, "router_logits": tuple(r.logits for r in routings)}
    if routings and routings[0].dropped is not None:  # pairs the dispatcher did not compute, per MoE layer
        aux["dropped_pairs"] = torch.stack([r.dropped.to(torch.int64) for r in routings])
    return h, aux


def loss(params: dict, batch: dict, cfg: Qwen3Config, *, moe_impl: str = "auto",
         moe_dispatchers: Sequence[Any] | None = None, regions: Regions | None = None,
         **removed: Any) -> tuple[torch.Tensor, dict]:
    """Training loss ``ce + router_aux_loss_coef * aux_loss`` (the aux term only for MoE models).

    ``batch["tokens"]`` int64 ``[B, S]``; ``batch["labels"]`` (optional) ``[B, S]`` targets *aligned with
    the positions* (``labels[:, s]`` is predicted from ``tokens[:, :s+1]``), ``-100`` ignored; default
    :func:`shift_labels` of the tokens (equal to Hugging Face's ``labels=input_ids``). Cross-entropy is the
    mean over non-ignored targets, in float32.

    ``batch["doc_ids"]`` (optional) ``[B, S]``: the document of each token of packed sequences (attention
    stays within a document). ``moe_dispatchers``, ``regions`` are :func:`apply`'s (with ``regions`` the
    final norm, head and cross-entropy are one more region, ``qwen3.head_loss``, where the head needs no
    collective). The bound layout is :func:`apply`'s too; the value is the same on every rank of a
    tensor- or context-parallel axis (the mean over the whole sequences' targets). Under a ``pp`` plan
    layer use :func:`hpfunc.models.qwen3.parallel_plan.loss`, which runs the pipeline's stages.

    Returns ``(loss, aux)`` with detached ``aux``: ``ce_loss``, ``aux_loss``, ``expert_load``
    ``[n_moe_layers, E]``, ``tokens`` (number of counted targets) and, with a dispatcher that can drop,
    ``dropped_pairs`` ``[n_moe_layers]``.

    >>> from hpfunc.models import preset
    >>> cfg = preset("qwen3-moe-tiny")
    >>> value, aux = loss(init(_random.key(0), cfg), {"tokens": torch.randint(0, 256, (2, 8))}, cfg)
    >>> sorted(aux), tuple(aux["expert_load"].shape)
    (['aux_loss', 'ce_loss', 'expert_load', 'tokens'], (2, 8))
    """
    reject_hooks("qwen3.loss", removed)
    if layout.runner() is not None:
        raise layout.PlanError("qwen3.loss under a pp plan layer: each pipeline rank holds only its stages' "
                               "parameters; use hpfunc.models.qwen3.parallel_plan.loss, which runs the stages")
    regions = layout.regions() if regions is None else regions
    positions = attend = counted = None
    if layout.cp_binding() is not None:  # this rank's tokens of every sequence, attending across the cp ranks
        batch, cp = context_split(cfg, batch)
        positions, attend, counted = cp["positions"], cp["attend"], cp["counted"]
    check_batch(batch)
    tokens = batch["tokens"]
    labels = batch.get("labels")
    labels = shift_labels(tokens) if labels is None else labels
    if labels.shape != tokens.shape:
        raise ValueError(f"loss: labels must have the tokens' shape {tuple(tokens.shape)}, "
                         f"found {tuple(labels.shape)}")
    h, aux = _forward(params, tokens, cfg, positions=positions, moe_impl=moe_impl, moe_dispatchers=moe_dispatchers,
                      attend=attend, counted=counted, doc_ids=batch.get("doc_ids"), regions=regions)
    w_out = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    ce = head_loss(h, params["final_norm"], w_out, labels, cfg, regions)
    total = ce + cfg.router_aux_loss_coef * aux["aux_loss"] if cfg.moe_layers else ce
    out = {"ce_loss": ce.detach(), "aux_loss": aux["aux_loss"].detach(),
           "expert_load": aux["expert_load"], "tokens": (labels != IGNORE_INDEX).sum()}
    if "dropped_pairs" in aux:
        out["dropped_pairs"] = aux["dropped_pairs"]
    return total, out


__all__ = ["Qwen3Config", "RopeScaling", "ConfigError", "preset", "param_shapes", "init", "apply", "loss",
           "shift_labels", "moe_dispatcher", "count_params", "active_params", "check_tokens", "update_expert_bias",
           "is_expert_bias", "decoder_layer", "compiled_layer", "rope_for", "check_doc_ids",
           "IGNORE_INDEX"]
