"""What a model tells a cost model: parameter counts by how they shard, FLOPs and saved activations.

A :class:`ModelDescription` is plain data a model builds from its own config (Qwen3:
:func:`hpfunc.models.qwen3.describe.describe`), so that the planner (:mod:`hpfunc.autoparallel`)
estimates memory, communication and time without naming any model's parameters. Counts are per
decoder layer (:class:`LayerDescription`) plus the embedding, the head and the final norm.

Saved activations are listed per layer as :class:`SavedValue` rows, one per value the layer's
backward needs, named by the ``checkpoint_name`` tags hpfunc's remat policies select on
(``attn_in``, ``q``, ``mlp_hidden`` ...); each row says how many bytes it keeps per token, whether it
is the output of a matrix multiplication (what ``dots_with_no_batch_dims_saveable`` keeps) and what
recomputing it costs.

    >>> v = SavedValue("q", bytes_per_token=8.0, matmul=True, recompute_flops_per_token=2.0 * 16 * 4)
    >>> layer = LayerDescription(hidden=16, dense_params=100, saved=(v,), matmul_flops_per_token=200.0)
    >>> layer.activation_bytes_per_token("none"), layer.activation_bytes_per_token("full")
    (8.0, 32.0)
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["SavedValue", "LayerDescription", "ModelDescription", "REMAT_KINDS"]

# How a layer's saved values are treated: none (everything kept), selective (matrix-multiplication
# outputs kept, the rest recomputed: hpfunc's dots_with_no_batch_dims_saveable), full (only the layer
# input kept: nothing_saveable).
REMAT_KINDS = ("none", "selective", "full")
Remat = Literal["none", "selective", "full"]


@attrs.frozen(cache_hash=True)
class SavedValue:
    """One value a layer keeps for its backward, per token of the microbatch.

    ``autograd``: kept by autograd without remat (a matmul output that only feeds a residual add is
    not, but selective remat caches it); ``matmul``: the output of a matrix multiplication without
    batch dimensions (cached by ``dots_with_no_batch_dims_saveable``); ``tp_split``: divided by the
    tensor-parallel degree (a head- or feature-split value), else divided by it only under sequence
    parallelism (a value of hidden width); ``attention``: the fused attention's output, whose
    recompute costs the attention FLOPs of the sequence; ``recompute_flops_per_token``: forward FLOPs
    to produce it again from its inputs (0 for an elementwise value, whose cost is memory traffic).
    Under balanced routing, dispatched expert copies hold the same count per rank as any value.
    """

    name: str
    bytes_per_token: float
    autograd: bool = True
    matmul: bool = False
    tp_split: bool = True
    attention: bool = False
    recompute_flops_per_token: float = 0.0


@attrs.frozen(cache_hash=True)
class LayerDescription:
    """One decoder layer.

    Parameters, by how they shard: ``dense_params`` (replicated over the expert axis; sharded by data
    parallel plans), of which ``tp_params`` split over tensor parallelism; ``expert_params`` (all
    experts together; split over the expert axis), of which ``expert_tp_params`` split over tp too.
    FLOPs are forward FLOPs per token: ``matmul_flops_per_token`` (2 x the parameters a token
    multiplies with), ``attention_flops_per_token_per_position`` (``4 x query width``: scores and
    weighted values, per position attended; causal attention attends ``s / 2`` on average).
    ``forward_ops``: the operators its forward dispatches (what a host-bound step pays per op).
    """

    hidden: int
    dense_params: int
    saved: tuple[SavedValue, ...] = ()
    tp_params: int = 0
    expert_params: int = 0
    expert_tp_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    matmul_flops_per_token: float = 0.0
    attention_flops_per_token_per_position: float = 0.0
    heads: int = 1
    kv_heads: int = 1
    tp_divides: tuple[int, ...] = ()  # sizes tensor parallelism must divide (heads, kv heads, widths)
    act_bytes: int = 2  # bytes of one activation element
    forward_ops: int = 0  # operators the host dispatches for the layer's forward (its backward: about 2 x)
    param_tensors: int = 0  # parameter tensors (the optimizer and FSDP handle each)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def activation_bytes_per_token(self, remat: Remat) -> float:
        """Bytes the layer keeps per token under a remat kind (no parallelism)."""
        if remat == "full":
            return float(self.act_bytes * self.hidden)
        if remat == "selective":
            return float(self.act_bytes * self.hidden) + sum(v.bytes_per_token for v in self.saved if v.matmul)
        if remat == "none":
            return float(sum(v.bytes_per_token for v in self.saved if v.autograd))
        raise ValueError(f"remat: expected one of {REMAT_KINDS}, found {remat!r}")


@attrs.frozen
class ModelDescription:
    """A decoder-only language model: its layers in order plus the embedding, final norm and head.

    ``head_params`` is 0 for a tied head (the embedding's matrix is reused; its FLOPs still count in
    ``head_flops_per_token``). ``embed_params`` are looked up (no FLOPs). ``head_saved_bytes_per_token``:
    what the final norm keeps for its backward and the head's input, per token (on the last stage).
    """

    name: str
    vocab: int
    hidden: int
    layers: tuple[LayerDescription, ...]
    embed_params: int
    head_params: int
    final_norm_params: int
    act_bytes: int = 2
    head_saved_bytes_per_token: float = 0.0  # what the final norm and the head keep for the backward


    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        """Total parameters."""
        return self.embed_params + self.head_params + self.final_norm_params + sum(l.params for l in self.layers)

    @property
    def expert_params(self) -> int:
        return sum(l.expert_params for l in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(l.is_moe for l in self.layers)

    @property
    def num_experts(self) -> int:
        return max((l.num_experts for l in self.layers), default=0)

    @property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the output projection per token (``2 h V``, tied or not)."""
        return 2.0 * self.hidden * self.vocab
