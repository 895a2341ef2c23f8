"""Qwen3's parallel plan: what the model knows about being distributed, kept beside the model (as
torchtitan keeps ``parallelize.py`` next to each ``model.py``); generic code names no Qwen3 parameter.

* :func:`tp_styles`: the Megatron tensor-parallel table for a config (``plans.tp(axis, tp_styles(cfg))``):
  column-parallel ``wq, wk, wv, w_gate, w_up``, row-parallel ``wo, w_down``, attention split by whole
  heads (``unit=head_dim``), norms and router replicated; optionally sequence-parallel norms and a
  vocabulary-parallel embedding and head.
* :func:`ep_experts`: the expert stacks that ``plans.ep(axis, ep_experts(cfg))`` splits over the
  expert-parallel axis (the MoE blocks then dispatch tokens to their experts' ranks,
  :mod:`hpfunc.models.dispatch`);
* :func:`pipeline_stages`: the model split into pipeline stages for ``plans.pp(axis, pipeline_stages(cfg, n))``
  (:mod:`hpfunc.models.qwen3.stages`);
* :func:`apply` / :func:`loss`: :func:`~hpfunc.models.qwen3.model.apply` / ``loss``, which read the
  layout the step binds (:mod:`hpfunc.layout`) themselves; ``loss`` also runs a ``pp`` plan layer's
  pipeline stages. With nothing bound they *are* the single-device functions.
* the optimizer routing of Qwen3's parameters (which go to Muon, which to AdamW, which decay).

The model adds the collectives the bound layout implies (:mod:`hpfunc.models.qwen3.layout_ops`):

* **tensor parallel**: the row-parallel partial outputs are summed (:func:`hpfunc.layout.reduce_partial`), two
  all-reduces of ``b s h`` per layer forward and, by the transpose, two backward;
* **sequence parallel** (Megatron-SP): the residual stream, the RMSNorms and the residual adds work on
  this rank's block of the sequence; the normalised input of attention and MLP/MoE is all-gathered
  along the sequence (:func:`hpfunc.layout.gather_sequence`) and their partial outputs are
  reduce-scattered along it (:func:`hpfunc.layout.reduce_partial`): two all-gathers and two
  reduce-scatters of ``b s h`` per layer forward, the same backward, the bytes of TP's all-reduces. The
  embedding output is this rank's sequence block (a replicated table looks up only those tokens), and
  the loss is computed on that block: the head and cross-entropy of each token run on one rank only,
  and the sum of the per-token losses is all-reduced (one scalar) and divided by the global count of
  targets;
* **vocabulary parallel**: the embedding and head are split by vocabulary rows; the masked lookup is
  summed (reduce-scattered along the sequence under sequence parallelism), the head sees the whole
  sequence (gathered first under sequence parallelism) and the cross-entropy reduces a max, a sum of
  exponentials and the target logit over the axis.

    >>> import torch
    >>> from hpfunc import random
    >>> from hpfunc.models import qwen3
    >>> cfg = qwen3.preset("qwen3-dense-tiny")
    >>> p = qwen3.init(random.key(0), cfg)
    >>> b = {"tokens": torch.randint(0, 256, (2, 8))}
    >>> bool(torch.equal(loss(p, b, cfg)[0], qwen3.loss(p, b, cfg)[0]))
    True
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import layout
from hpfunc.layout import ColwiseParallel, RowwiseParallel, SequenceParallel, Style, VocabParallel
from hpfunc.models.config import Qwen3Config
from hpfunc.models.qwen3 import model as _model
from hpfunc.models.qwen3.stages import layers_per_stage, pipeline_stages
from hpfunc.regions import Regions

__all__ = ["tp_styles", "ep_experts", "pipeline_stages", "layers_per_stage", "apply", "loss", "adamw_when",
           "decay_mask"]


def tp_styles(cfg: Qwen3Config, *, vocab_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, Style]:
    """The Megatron tensor-parallel styles of a Qwen3 model with config ``cfg``, one pattern per
    parameter family that the config has (so that every pattern matches a parameter).

    ``sequence_parallel``: the norms between blocks become :class:`~hpfunc.layout.SequenceParallel`
    (activations split along the sequence); ``vocab_parallel``: the embedding (and an untied
    ``lm_head``) are split by vocabulary rows.

    >>> sorted(tp_styles(_model.preset("qwen3-dense-tiny"), sequence_parallel=True))[:3]
    ['final_norm', 'layers.*.attn.w[qkv]', 'layers.*.attn.wo']
    """
    col, row = ColwiseParallel(), RowwiseParallel()
    heads = {"unit": cfg.head_dim, "unit_name": "heads"}
    heads_col, heads_row = ColwiseParallel(**heads), RowwiseParallel(**heads)
    styles: dict[str, Style] = {
        "layers.*.attn.w[qkv]": heads_col,  # [heads * D, H]: split by whole heads
        "layers.*.attn.wo": heads_row,      # [H, heads * D]
    }
    if cfg.attention_bias:
        styles["layers.*.attn.b[qkv]"] = heads_col
    if len(cfg.moe_layers) < cfg.num_hidden_layers:  # dense MLP layers [I, H] / [H, I]
        styles.update({"layers.*.mlp.w_gate": col, "layers.*.mlp.w_up": col, "layers.*.mlp.w_down": row})
    if cfg.moe_layers:  # routed experts [E, I, H] / [E, H, I]; the router stays replicated
        styles.update({"layers.*.moe.experts.w_gate": col, "layers.*.moe.experts.w_up": col,
                       "layers.*.moe.experts.w_down": row})
        if cfg.shared_expert_intermediate_size:
            styles.update({"layers.*.moe.shared.w_gate": col, "layers.*.moe.shared.w_up": col,
                           "layers.*.moe.shared.w_down": row})
    if sequence_parallel:
        sp = SequenceParallel()
        styles.update({"layers.*.attn_norm": sp, "layers.*.mlp_norm": sp, "final_norm": sp})
    if vocab_parallel:
        styles["embed"] = VocabParallel()
        if not cfg.tie_word_embeddings:
            styles["lm_head"] = VocabParallel()
    return styles


def ep_experts(cfg: Qwen3Config) -> tuple[str, ...]:
    """The expert stacks of a Qwen3-MoE model, for ``plans.ep(axis, ep_experts(cfg))``: the routed
    experts ``layers.*.moe.experts.{w_gate, w_up, w_down}`` (``[E, ...]``, split on dimension 0). The
    router, the expert bias and a shared expert are not experts: every rank scores every expert.

    >>> ep_experts(_model.preset("qwen3-moe-tiny"))
    ('layers.*.moe.experts.w_gate', 'layers.*.moe.experts.w_up', 'layers.*.moe.experts.w_down')
    """
    if not cfg.moe_layers:
        raise layout.PlanError("ep_experts: the model has no MoE layer (config.num_experts = 0 or no sparse "
                               "layer); expert parallelism needs experts")
    return tuple(f"layers.*.moe.experts.{w}" for w in ("w_gate", "w_up", "w_down"))


def apply(params: dict, tokens: torch.Tensor, cfg: Qwen3Config, *, return_aux: bool = False,
          moe_impl: str = "auto", moe_dispatchers: Any = None, regions: Regions | None = None) -> Any:
    """:func:`qwen3.apply <hpfunc.models.qwen3.model.apply>`, which reads the bound layout itself (kept as
    the parallel plan's name for it).

    The logits are the full ``[B, S, V]`` under tensor parallelism; under context parallelism those of
    this rank's tokens (:func:`~hpfunc.models.qwen3.layout_ops.context_split`: ``SequenceSplit.local`` order); this rank's sequence block
    ``[B, S / n, V]`` under sequence parallelism; this rank's vocabulary columns ``[B, S, V / n]`` with a
    vocabulary-parallel head (with or without sequence parallelism). ``aux`` is the same on every rank.
    """
    return _model.apply(params, tokens, cfg, return_aux=return_aux, moe_impl=moe_impl,
                        moe_dispatchers=moe_dispatchers, regions=regions)


def loss(params: dict, batch: dict, cfg: Qwen3Config, *, moe_impl: str = "auto",
         moe_dispatchers: Any = None, regions: Regions | None = None) -> tuple[torch.Tensor, dict]:
    """:func:`qwen3.loss <hpfunc.models.qwen3.model.loss>` (which reads the bound tensor-, sequence-,
    vocabulary-, context- and expert-parallel layout itself), or under a ``pp`` plan layer the loss run
    pipelined through the plan's stages (:func:`pipeline_stages` of this config). ``regions``: compile
    the model's compute (:func:`~hpfunc.models.qwen3.model.compiled_layer`; not under ``pp`` yet)."""
    pipe = layout.runner()
    if pipe is None:
        return _model.loss(params, batch, cfg, moe_impl=moe_impl, moe_dispatchers=moe_dispatchers, regions=regions)
    if regions is not None or layout.regions() is not None:
        raise layout.PlanError("qwen3 parallel_plan.loss: compiled regions (train.compile, Lowered.compile) are not "
                               "passed to the pipeline's stages yet; under a pp plan layer run without them "
                               "(train.compile: false)")
    if moe_dispatchers is not None:
        raise layout.PlanError("qwen3 parallel_plan.loss: moe_dispatchers are not passed to the pipeline's "
                               "stages yet; under a pp plan layer the MoE blocks use their default dispatcher")
    return pipe.run(params, batch, owner=cfg)


# ---- Optimizer routing ---------------------------------------------------------------------------
# What Qwen3 knows about its parameters that a generic optimizer cannot: which matrices Muon should
# leave to AdamW, and which parameters take weight decay. hpfunc.optim reads no parameter names; pass
# these to it (``optim.muon_adamw(..., adamw_when=adamw_when)``, ``optim.adamw(..., mask=decay_mask)``),
# as ``hpfunc.train.build.build_optimizer`` does.

_ADAMW_PATH_KEYWORDS = ("embed", "lm_head", "norm", "router")  # anywhere in the lower-cased path
_ADAMW_PATH_COMPONENTS = ("gate", "head", "output", "bias")  # as a whole dotted component


def adamw_when(path: str, leaf: torch.Tensor) -> bool:
    """True for the Qwen3 parameters that AdamW, not Muon, should update in ``optim.muon_adamw``.

    AdamW takes every leaf that is not a matrix or a stack of matrices (``ndim`` not 2 or 3: norms,
    the MoE expert bias), and every matrix whose lower-cased dotted path contains ``embed``,
    ``lm_head``, ``norm`` or ``router``, or has ``gate``, ``head``, ``output`` or ``bias`` as a whole
    component (``mlp.gate`` is the MoE router in the Hugging Face layout; ``gate_proj`` and
    ``w_gate`` are not matched). Muon takes the rest: attention and MLP matrices and the stacked
    experts ``[E, out, in]``.

    >>> import torch
    >>> adamw_when("layers.0.attn.wq", torch.zeros(4, 4)), adamw_when("embed", torch.zeros(9, 4))
    (False, True)
    >>> adamw_when("layers.0.moe.router", torch.zeros(8, 4)), adamw_when("layers.0.moe.experts.w_up", torch.zeros(8, 2, 4))
    (True, False)
    >>> adamw_when("layers.0.mlp.gate", torch.zeros(8, 4)), adamw_when("layers.0.mlp.gate_proj", torch.zeros(8, 4))
    (True, False)
    >>> adamw_when("layers.0.attn_norm", torch.ones(4)), adamw_when("lm_head", torch.zeros(9, 4))
    (True, True)
    """
    if leaf.ndim not in (2, 3):
        return True
    lowered = path.lower()
    if any(k in lowered for k in _ADAMW_PATH_KEYWORDS):
        return True
    return any(c in _ADAMW_PATH_COMPONENTS for c in lowered.split("."))


def decay_mask(path: str, leaf: torch.Tensor) -> bool:
    """True for the Qwen3 parameters that take weight decay: matrices and expert stacks, not norms,
    biases or embeddings (``optim.adamw(..., mask=decay_mask)``).

    >>> import torch
    >>> decay_mask("layers.0.attn.wq", torch.zeros(4, 4)), decay_mask("embed", torch.zeros(9, 4))
    (True, False)
    >>> decay_mask("layers.0.attn.q_norm", torch.ones(4)), decay_mask("layers.0.moe.experts.w_up", torch.zeros(8, 2, 4))
    (False, True)
    """
    lowered = path.lower()
    return leaf.ndim >= 2 and "embed" not in lowered and "norm" not in lowered
