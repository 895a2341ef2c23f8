"""Qwen3 model configuration (dense and MoE) and its mapping to Hugging Face ``config.json``.

Only fields that change the function (or its initialisation) are kept; everything else in a
``config.json`` (``use_cache``, ``dtype``, ``transformers_version`` ...) is ignored on read.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from hpfunc.models.rope import SUPPORTED_ROPE_TYPES

HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class ConfigError(ValueError):
    """A configuration (or ``config.json``) that hpfunc's Qwen3 cannot represent faithfully."""


def _tuple_of_ints(x: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in (x or ()))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


@attrs.frozen(kw_only=True)
class RopeScaling:
    """RoPE scaling (``rope_scaling`` / ``rope_parameters`` in HF). ``rope_type``: "linear" or "yarn"."""

    rope_type: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ROPE_TYPES[1:]))
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    @classmethod
    def from_hf(cls, d: dict | None, *, max_position_embeddings: int) -> "RopeScaling | None":
        if not d:
            return None
        d = dict(d)
        rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
        d.pop("type", None)
        d.pop("rope_theta", None)
        if d.get("partial_rotary_factor", 1.0) in (None, 1.0):
            d.pop("partial_rotary_factor", None)
        if rope_type == "default":
            return None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type: supported {SUPPORTED_ROPE_TYPES}, found {rope_type!r} "
                f"(dynamic/llama3/longrope are not implemented)")
        fields = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(f"rope_scaling: unsupported keys {unknown} for rope_type {rope_type!r}")
        if rope_type == "yarn" and d.get("original_max_position_embeddings") is None:
            d["original_max_position_embeddings"] = max_position_embeddings
        return cls(rope_type=rope_type, **d)

    def to_hf(self) -> dict:
        return {"rope_type": self.rope_type,
                **{k: v for k, v in attrs.asdict(self).items() if k != "rope_type" and v is not None}}


@attrs.frozen(kw_only=True)
class Qwen3Config:
    """Architecture of a Qwen3 causal LM, dense (``num_experts == 0``) or MoE.

    Layer ``i`` is an MoE layer iff ``num_experts > 0``, ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (the Hugging Face rule); other layers use a dense SwiGLU of
    width ``intermediate_size``. ``shared_expert_intermediate_size > 0`` adds a Qwen2-MoE style
    sigmoid-gated shared expert (0 for Qwen3; not representable in Qwen3 HF checkpoints).

    >>> cfg = preset("qwen3-moe-tiny")
    >>> cfg.is_moe, cfg.moe_layers
    (True, (0, 1))
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)
    shared_expert_intermediate_size: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    router_aux_loss_coef: float = 0.001
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: Any = attrs.field(default=None, converter=_token_ids)
    # How an MoE layer sends its (token, expert) pairs under expert parallelism (hpfunc.models.dispatch);
    # not part of a Hugging Face config.json. "alltoall": exact splits, one host read per layer, dropless
    # unless moe_capacity_factor caps each expert at ceil(c T k / E) pairs per source rank; "padded":
    # fixed buffers of ceil(moe_buffer_factor T k / n) rows per destination, no host read, overflow
    # dropped. A capacity factor or the padded dispatcher applies on one device too (n = 1).
    moe_dispatcher: Literal["alltoall", "padded"] = "alltoall"
    moe_capacity_factor: float | None = None
    moe_buffer_factor: float = 1.5
    # "alltoall" only: cut each MoE layer's tokens into this many chunks whose all-to-alls overlap the
    # expert compute of another chunk (dropless only)
    moe_dispatch_chunks: int = 1

    def __attrs_post_init__(self) -> None:
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "yarn" and rs.original_max_position_embeddings is None:
            # Normalise as transformers does, so that equal functions compare equal.
            object.__setattr__(self, "rope_scaling", attrs.evolve(
                rs, original_max_position_embeddings=self.max_position_embeddings))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"Qwen3Config.{name}: expected a positive int, found {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"Qwen3Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"Qwen3Config.head_dim: RoPE needs an even head_dim, found {self.head_dim}")
        if self.num_experts < 0 or self.decoder_sparse_step < 1:
            raise ConfigError(f"Qwen3Config: num_experts >= 0 and decoder_sparse_step >= 1 expected, found "
                              f"{self.num_experts} and {self.decoder_sparse_step}")
        if self.moe_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"Qwen3Config.num_experts_per_tok: expected 1..num_experts ({self.num_experts}), "
                    f"found {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("Qwen3Config.moe_intermediate_size: expected > 0 for an MoE model, "
                                  f"found {self.moe_intermediate_size}")
        self._check_dispatch()
        if len(self.moe_layers) < self.num_hidden_layers and self.intermediate_size <= 0:
            raise ConfigError("Qwen3Config.intermediate_size: dense layers need intermediate_size > 0, "
                              f"found {self.intermediate_size}")

    def _check_dispatch(self) -> None:
        if self.moe_dispatcher not in ("alltoall", "padded"):
            raise ConfigError(f"Qwen3Config.moe_dispatcher: expected 'alltoall' or 'padded', found {self.moe_dispatcher!r}")
        c = self.moe_capacity_factor
        if c is not None and not (_is_number(c) and math.isfinite(c) and c > 0):
            raise ConfigError(f"Qwen3Config.moe_capacity_factor: expected a finite number > 0 (each expert takes at "
                              f"most ceil(c * tokens * top_k / experts) pairs per rank) or null (dropless), found {c!r}")
        if c is not None and self.moe_dispatcher != "alltoall":
            raise ConfigError(f"Qwen3Config.moe_capacity_factor: a capacity factor ({c}) applies to the 'alltoall' "
                              f"dispatcher; the 'padded' one drops by moe_buffer_factor instead: set one of the two")
        ch = self.moe_dispatch_chunks
        if not (isinstance(ch, int) and not isinstance(ch, bool) and ch >= 1):
            raise ConfigError(f"Qwen3Config.moe_dispatch_chunks: expected an int >= 1, found {ch!r}")
        if ch > 1 and (self.moe_dispatcher != "alltoall" or c is not None):
            raise ConfigError(f"Qwen3Config.moe_dispatch_chunks: {ch} chunks overlap the dropless 'alltoall' dispatch "
                              f"only; found moe_dispatcher={self.moe_dispatcher!r}, moe_capacity_factor={c!r}")
        f = self.moe_buffer_factor
        if not (_is_number(f) and math.isfinite(f) and f > 0):
            raise ConfigError(f"Qwen3Config.moe_buffer_factor: expected a finite number > 0 (rows per destination "
                              f"rank = ceil(f * tokens * top_k / ranks)), found {f!r}")

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order (the rows of ``aux["expert_load"]``)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: Any) -> "Qwen3Config":
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)

    # --- Hugging Face config.json ---------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Qwen3Config":
        """Read a Hugging Face ``config.json`` dict of ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``.

        Accepts both the hub layout (``rope_theta`` + ``rope_scaling``) and transformers 5's
        ``rope_parameters``. Raises :class:`ConfigError` for other architectures and for features
        that would change the function but are not implemented (sliding window, non-SiLU activation,
        attention dropout).
        """
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type not in HF_ARCHITECTURES or any(a != HF_ARCHITECTURES[model_type] for a in archs):
            raise ConfigError(
                f"config.json: expected model_type in {sorted(HF_ARCHITECTURES)} with architectures "
                f"{sorted(HF_ARCHITECTURES.values())}; found model_type={model_type!r}, architectures={archs!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act: only 'silu' is implemented, found {d['hidden_act']!r}")
        if d.get("use_sliding_window", False):
            raise ConfigError("config.json use_sliding_window: sliding-window attention is not implemented; "
                              "found use_sliding_window=true")
        if d.get("attention_dropout", 0.0):
            raise ConfigError(f"config.json attention_dropout: only 0.0 is implemented, "
                              f"found {d['attention_dropout']}")
        max_pos = int(d.get("max_position_embeddings", 32768))
        rope = dict(d.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise ConfigError("config.json rope_parameters: per-layer-type RoPE is not implemented")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = RopeScaling.from_hf(rope or d.get("rope_scaling"), max_position_embeddings=max_pos)
        heads = int(d["num_attention_heads"])
        moe = model_type == "qwen3_moe"
        num_experts = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0) if moe else 0
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d.get("intermediate_size", 0)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)) if moe else 0,
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0)) if moe else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if moe else False,
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)) if moe else 1,
            mlp_only_layers=d.get("mlp_only_layers") or () if moe else (),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)) if moe else 0.001,
            max_position_embeddings=max_pos,
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict (hub layout: ``rope_theta`` + ``rope_scaling``)."""
        if self.shared_expert_intermediate_size:
            raise ConfigError("to_hf_dict: Qwen3 checkpoints have no shared expert; found "
                              f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}")
        model_type = "qwen3_moe" if self.is_moe else "qwen3"
        d: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if self.is_moe:
            d.update(
                moe_intermediate_size=self.moe_intermediate_size,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return d


_PRESETS: dict[str, dict[str, Any]] = {
    # The published Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=40960, router_aux_loss_coef=0.001, bos_token_id=151643, eos_token_id=151645,
    ),
    # Byte-level demo models: vocab 256 = one token per byte.
    "qwen3-moe-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=2048,
    ),
    "qwen3-dense-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=192, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "qwen3-moe-small": dict(
        vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=768, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=4096,
    ),
}

PRESETS = tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> Qwen3Config:
    """A named configuration: ``"qwen3-30b-a3b"`` (the real model), ``"qwen3-moe-tiny"``,
    ``"qwen3-dense-tiny"`` (byte-level, vocab 256), ``"qwen3-moe-small"`` (4 layers, hidden 256,
    32 experts, top-4). Keyword overrides replace fields.

    >>> preset("qwen3-30b-a3b").num_experts
    128
    """
    if name not in _PRESETS:
        raise KeyError(f"preset: unknown name {name!r}; available: {', '.join(PRESETS)}")
    return Qwen3Config(**{**_PRESETS[name], **overrides})
