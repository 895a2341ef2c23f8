"""Tensor-parallel-aware Qwen3 forward and loss, built from the single-device blocks of :mod:`qwen3`.

With no tensor-parallel axis bound these are exactly :func:`hpfunc.models.qwen3.apply` / ``loss``.
Inside :func:`tensor_parallel` (``hpfunc.transforms.parallelize`` binds it for plans with a ``tp``
layer) the attention and MLP/MoE weights are Megatron shards (column-parallel ``wq, wk, wv, w_gate,
w_up``, row-parallel ``wo, w_down``), each block computes its local heads / intermediate features,
and the row-parallel partial outputs are summed with :func:`hpfunc.lax.psum` over the axis: two
all-reduces per layer in the forward and, by the psum transpose, two in the backward.

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

import contextlib
import contextvars
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from hpfunc import lax
from hpfunc.models import qwen3
from hpfunc.models.attention import gqa_attention
from hpfunc.models.config import Qwen3Config
from hpfunc.models.layers import rms_norm, swiglu_mlp
from hpfunc.models.moe import expert_counts, load_balancing_loss, moe_block
from hpfunc.models.rope import rope_inv_freq, rope_tables

__all__ = ["tensor_parallel", "tp_axis", "apply", "loss"]

_TP: contextvars.ContextVar[tuple[str | None, bool]] = contextvars.ContextVar("hpfunc_tp", default=(None, False))


@contextlib.contextmanager
def tensor_parallel(axis: str | None, *, vocab_parallel: bool = False) -> Iterator[None]:
    """Bind the mesh axis over which row-parallel outputs are summed (``None``: no tensor parallelism);
    ``vocab_parallel``: the embedding and head are sharded by vocabulary rows over it too."""
    token = _TP.set((axis, bool(vocab_parallel) and axis is not None))
    try:
        yield
    finally:
        _TP.reset(token)


def tp_axis() -> str | None:
    """The bound tensor-parallel axis, or ``None``."""
    return _TP.get()[0]


def _vocab_sharded() -> bool:
    # from the binding, not from the weights: reading a weight under FSDP would gather it
    return _TP.get()[1]


def apply(params: dict, tokens: torch.Tensor, cfg: Qwen3Config, *, return_aux: bool = False,
          moe_impl: str = "auto") -> Any:
    """:func:`qwen3.apply` that sums row-parallel outputs over the bound tensor-parallel axis."""
    axis = tp_axis()
    if axis is None:
        return qwen3.apply(params, tokens, cfg, return_aux=return_aux, moe_impl=moe_impl)
    if not _vocab_sharded():
        # Megatron TP proper needs only the reduction of the row-parallel outputs: the model's own hook
        return qwen3.apply(params, tokens, cfg, return_aux=return_aux, moe_impl=moe_impl,
                           reduce_partial=functools.partial(lax.psum, axis_name=axis))
    # vocabulary-parallel embedding / head: the same layer stack, with a sharded lookup and head
    qwen3.check_tokens(tokens, cfg.vocab_size)
    B, S = tokens.shape
    h = _embed(tokens, params["embed"], cfg, axis)
    positions = torch.arange(S, device=tokens.device)
    inv_freq, rope_scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                         max_position_embeddings=cfg.max_position_embeddings)
    cos, sin = rope_tables(positions, inv_freq, rope_scale, dtype=h.dtype)
    eps = cfg.rms_norm_eps
    routings = []
    for layer in params["layers"]:
        a = layer["attn"]
        # bo is added once, after the reduction (every rank would add it to its partial sum)
        out = gqa_attention(rms_norm(h, layer["attn_norm"], eps), a["wq"], a["wk"], a["wv"], a["wo"],
                            a["q_norm"], a["k_norm"], cos, sin, eps=eps,
                            bq=a.get("bq"), bk=a.get("bk"), bv=a.get("bv"))
        out = lax.psum(out, axis)
        if "bo" in a:
            out = out + a["bo"]
        h = h + out
        x = rms_norm(h, layer["mlp_norm"], eps)
        if "moe" in layer:
            m = layer["moe"]
            y, routing = moe_block(x, m["router"], m["experts"]["w_gate"], m["experts"]["w_up"],
                                   m["experts"]["w_down"], top_k=cfg.num_experts_per_tok,
                                   norm_topk_prob=cfg.norm_topk_prob, expert_bias=m.get("expert_bias"),
                                   shared=m.get("shared"), impl=moe_impl)
            routings.append(routing)
        else:
            y = swiglu_mlp(x, layer["mlp"]["w_gate"], layer["mlp"]["w_up"], layer["mlp"]["w_down"])
        h = h + lax.psum(y, axis)
    h = rms_norm(h, params["final_norm"], eps)
    # with a vocabulary-parallel head these are this rank's vocabulary columns of the logits
    logits = F.linear(h, params["embed"] if cfg.tie_word_embeddings else params["lm_head"])
    if not return_aux:
        return logits
    if routings:
        E = routings[0].probs.shape[-1]
        aux_loss = load_balancing_loss(routings, E)
        load = torch.stack([expert_counts(r.indices, E) for r in routings])
    else:
        aux_loss = h.new_zeros((), dtype=torch.float32)
        load = torch.zeros(0, 0, dtype=torch.int64, device=h.device)
    return logits, {"aux_loss": aux_loss, "expert_load": load,
                    "router_logits": tuple(r.logits for r in routings)}


def _embed(tokens: torch.Tensor, table: torch.Tensor, cfg: Qwen3Config, axis: str) -> torch.Tensor:
    """Embedding lookup; a table sharded by vocabulary rows looks up its own ids and sums over ``axis``."""
    rows = table.shape[0]
    if rows == cfg.vocab_size:
        return F.embedding(tokens, table)
    local = tokens - lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    h = F.embedding(local.clamp(0, rows - 1), table) * mine.unsqueeze(-1).to(table.dtype)
    return lax.psum(h, axis)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config, axis: str) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets; logits split by vocabulary over ``axis`` are reduced
    with a max, a sum of exponentials and the target logit (three small all-reduces of [tokens])."""
    cols = logits.shape[-1]
    x = logits.float().reshape(-1, cols)
    y = labels.reshape(-1)
    if cols == cfg.vocab_size:
        return F.cross_entropy(x, y, ignore_index=qwen3.IGNORE_INDEX)
    valid = y != qwen3.IGNORE_INDEX
    # log-sum-exp is shift invariant: the max needs no gradient
    m = lax.pmax(x.detach().amax(-1), axis)
    sumexp = lax.psum(torch.exp(x - m[:, None]).sum(-1), axis)
    local = y - lax.axis_index(axis) * cols
    mine = (local >= 0) & (local < cols) & valid
    target = lax.psum(x.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1) * mine, axis)
    nll = torch.log(sumexp) + m - target
    return (nll * valid).sum() / valid.sum()


def loss(params: dict, batch: dict, cfg: Qwen3Config, *, moe_impl: str = "auto") -> tuple[torch.Tensor, dict]:
    """:func:`qwen3.loss` with the tensor-parallel-aware :func:`apply` (identical without a bound axis)."""
    axis = tp_axis()
    if axis is None:
        return qwen3.loss(params, batch, cfg, moe_impl=moe_impl)
    if not _vocab_sharded():
        return qwen3.loss(params, batch, cfg, moe_impl=moe_impl,
                          reduce_partial=functools.partial(lax.psum, axis_name=axis))
    tokens = batch["tokens"]
    labels = batch.get("labels")
    labels = qwen3.shift_labels(tokens) if labels is None else labels
    logits, aux = apply(params, tokens, cfg, return_aux=True, moe_impl=moe_impl)
    ce = _cross_entropy(logits, labels, cfg, tp_axis())
    total = ce + cfg.router_aux_loss_coef * aux["aux_loss"] if cfg.moe_layers else ce
    return total, {"ce_loss": ce.detach(), "aux_loss": aux["aux_loss"].detach(),
                   "expert_load": aux["expert_load"], "tokens": (labels != qwen3.IGNORE_INDEX).sum()}


def init(key: torch.Tensor, cfg: Qwen3Config, *, shardings: Any = None, dtype: torch.dtype = torch.float32) -> dict:
    """:func:`qwen3.init` with each leaf created directly as a DTensor with ``shardings`` (a tree of
    ``NamedSharding`` shaped like :func:`qwen3.param_shapes`): every rank samples only its own block
    (counter-based :mod:`hpfunc.random`), and the global values equal ``qwen3.init(key, cfg)``.
    Without ``shardings`` it is ``qwen3.init``."""
    if shardings is None:
        return qwen3.init(key, cfg, dtype)
    from hpfunc import random as _random
    from hpfunc import tree as _tree
    from hpfunc.sharding import from_local

    shapes = qwen3.param_shapes(cfg)
    is_shape = lambda x: isinstance(x, torch.Size)  # noqa: E731
    leaves = _tree.leaves_with_paths(shapes, is_leaf=is_shape)
    index = {path: i for i, (path, _) in enumerate(leaves)}
    sh_by_path = dict(_tree.leaves_with_paths(shardings, is_leaf=lambda x: hasattr(x, "spec")))

    def make(path: str, shape: torch.Size) -> torch.Tensor:
        name = path.rsplit(".", 1)[-1]
        leaf_dtype = torch.float32 if name == "expert_bias" else dtype
        sh = sh_by_path[path]
        if name in qwen3._ONES or name in qwen3._ZEROS:
            from hpfunc.sharding import local_block

            _, sizes = local_block(tuple(shape), sh.mesh, sh.spec, sh.mesh.coordinate())
            fill = torch.ones if name in qwen3._ONES else torch.zeros
            return from_local(fill(sizes, dtype=leaf_dtype), sh, global_shape=tuple(shape))
        return _random.normal(_random.fold_in(key, index[path]), tuple(shape), leaf_dtype,
                              std=cfg.initializer_range, sharding=sh)

    return _tree.map_with_path(make, shapes, is_leaf=is_shape)
