"""Hugging Face interop for Qwen3: ``from_pretrained`` / ``save_pretrained`` (config.json + safetensors).

Reads single-file or sharded (``model.safetensors.index.json``) checkpoints, with MoE experts either
per expert as published on the hub (``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``) or
fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``, the in-memory layout
of transformers 5). Always writes the published per-expert layout.

The expert-selection bias (``layers.N.moe.expert_bias``, trained by the aux-loss-free balancing that is
on by default) has no place in transformers' Qwen3-MoE: it drops ``mlp.gate.e_score_correction_bias``
as an unexpected key and routes tokens to other experts, a different function. An export of a nonzero
bias therefore refuses (:class:`ExpertBiasError`) unless told what to do with it: ``expert_bias="drop"``
writes the model without it (knowingly: the refusal says by how much the logits change, see
:func:`expert_bias_effect`), ``expert_bias="keep"`` writes it as
``model.layers.N.mlp.gate.e_score_correction_bias`` for hpfunc's own readers (``from_pretrained`` of that
folder returns ``params`` exactly; transformers ignores the key). A zero bias is never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
from typing import Any, NamedTuple

import torch

from hpfunc import tree as _tree
from hpfunc.durable import fsync_dir, fsync_file
from hpfunc.models.config import ConfigError, Qwen3Config
from hpfunc.models.qwen3.model import _is_shape, param_shapes

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_EXPERT_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_ATTN = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
         "bq": "q_proj.bias", "bk": "k_proj.bias", "bv": "v_proj.bias", "bo": "o_proj.bias",
         "q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}
_SHARED = {"w_gate": "shared_expert.gate_proj.weight", "w_up": "shared_expert.up_proj.weight",
           "w_down": "shared_expert.down_proj.weight", "gate": "shared_expert_gate.weight"}
BIAS_KEY = "mlp.gate.e_score_correction_bias"


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the configuration (names the keys and shapes)."""


EXPERT_BIAS_MODES = ("refuse", "keep", "drop")


class ExpertBiasError(CheckpointError):
    """An export refused because the model has a nonzero expert-selection bias that transformers would drop."""


def check_expert_bias_mode(mode: str, where: str = "save_pretrained") -> None:
    """Reject an unknown ``expert_bias`` option.

    >>> check_expert_bias_mode("drop")
    >>> check_expert_bias_mode("ignore")
    Traceback (most recent call last):
    ...
    ValueError: save_pretrained: expert_bias must be one of 'refuse', 'keep', 'drop', found 'ignore'
    """
    if mode not in EXPERT_BIAS_MODES:
        raise ValueError(f"{where}: expert_bias must be one of {', '.join(map(repr, EXPERT_BIAS_MODES))}, "
                         f"found {mode!r}")


def expert_bias_names(nonzero: dict[str, float], mode: str, *, where: str = "save_pretrained",
                      option: str = "expert_bias", effect: str = "") -> set[str]:
    """The Hugging Face names of the biases to write, given ``nonzero`` ``{hf name: max |bias|}`` (the
    layers whose bias is nonzero) and the export's ``mode``; raises :class:`ExpertBiasError` for
    ``"refuse"`` when any is nonzero. ``option`` is how the caller spells the option (``--expert-bias``
    on the command line); ``effect`` is a measured logit change to quote.

    >>> expert_bias_names({}, "refuse")
    set()
    >>> sorted(expert_bias_names({"model.layers.1.mlp.gate.e_score_correction_bias": 0.3}, "keep"))
    ['model.layers.1.mlp.gate.e_score_correction_bias']
    >>> expert_bias_names({"model.layers.1.mlp.gate.e_score_correction_bias": 0.3}, "drop")
    set()
    """
    check_expert_bias_mode(mode, where)
    if not nonzero or mode == "drop":
        return set()
    if mode == "keep":
        return set(nonzero)
    spell = (lambda v: f"{option} {v}") if option.startswith("-") else (lambda v: f"{option}={v!r}")
    raise ExpertBiasError(
        f"{where}: refusing to export an MoE whose expert-selection bias is nonzero in {len(nonzero)} layer(s) "
        f"({_names(sorted(nonzero), 4)}; largest |bias| {max(nonzero.values()):.3g}). transformers' Qwen3-MoE has "
        f"no such bias: it drops 'mlp.gate.e_score_correction_bias' as an unexpected key and routes tokens to "
        f"other experts, so the exported model would compute a different function"
        + (f" ({effect})" if effect else "")
        + f". Pass {spell('drop')} to export the model without the bias knowingly (its logits change by that "
        f"much; hpfunc.models.qwen3.hf.expert_bias_effect(params, cfg) measures it), or {spell('keep')} to write "
        f"the bias for hpfunc's own from_pretrained (transformers ignores it)")


def nonzero_expert_bias(params: dict) -> dict[str, float]:
    """``{hf name: max |bias|}`` of the layers whose expert bias is nonzero (plain tensors).

    >>> from hpfunc import random
    >>> from hpfunc.models import preset, qwen3
    >>> cfg = preset("qwen3-moe-tiny")
    >>> params = qwen3.init(random.key(0), cfg)
    >>> nonzero_expert_bias(params)
    {}
    >>> params["layers"][1]["moe"]["expert_bias"][3] = -0.5
    >>> nonzero_expert_bias(params)
    {'model.layers.1.mlp.gate.e_score_correction_bias': 0.5}
    """
    return {hf_name(p): float(t.abs().max()) for p, t in _tree.leaves_with_paths(params)
            if p.endswith("moe.expert_bias") and bool(t.ne(0).any())}


class BiasEffect(NamedTuple):
    """What dropping the expert bias does to a model's logits on some tokens."""

    max_abs_logit_change: float
    top1_agreement: float  # the fraction of tokens whose argmax is unchanged
    tokens: int

    def __str__(self) -> str:
        return (f"measured on {self.tokens} random tokens: logits change by up to {self.max_abs_logit_change:.3g}, "
                f"top-1 prediction unchanged on {100 * self.top1_agreement:.1f}% of tokens")


def expert_bias_effect(params: dict, cfg: Qwen3Config, tokens: torch.Tensor | None = None) -> BiasEffect:
    """The change of the logits on ``tokens`` (default: 4 x 64 random tokens, seed 0) when the expert
    bias is dropped, as an export to transformers' Qwen3-MoE with ``expert_bias="drop"`` does.

    >>> from hpfunc import random
    >>> from hpfunc.models import preset, qwen3
    >>> cfg = preset("qwen3-moe-tiny")
    >>> params = qwen3.init(random.key(0), cfg)
    >>> expert_bias_effect(params, cfg).max_abs_logit_change
    0.0
    """
    from hpfunc.models.qwen3.model import apply

    if tokens is None:
        tokens = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    zeroed = _tree.map_with_path(lambda p, t: torch.zeros_like(t) if p.endswith("moe.expert_bias") else t, params)
    with torch.no_grad():
        a, b = apply(params, tokens, cfg).float(), apply(zeroed, tokens, cfg).float()
    same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return BiasEffect((a - b).abs().max().item(), same, tokens.numel())


def hf_name(path: str) -> str:
    """The Hugging Face tensor name of a (non-expert) parameter path.

    >>> hf_name("layers.3.attn.wq")
    'model.layers.3.self_attn.q_proj.weight'
    """
    if path == "embed":
        return "model.embed_tokens.weight"
    if path == "final_norm":
        return "model.norm.weight"
    if path == "lm_head":
        return "lm_head.weight"
    parts = path.split(".")
    if parts[0] != "layers":
        raise KeyError(f"hf_name: no Hugging Face name for parameter path {path!r}")
    pre, rest = f"model.layers.{parts[1]}.", parts[2:]
    if rest == ["attn_norm"]:
        return pre + "input_layernorm.weight"
    if rest == ["mlp_norm"]:
        return pre + "post_attention_layernorm.weight"
    if rest[0] == "attn":
        return pre + "self_attn." + _ATTN[rest[1]]
    if rest[0] == "mlp":
        return pre + f"mlp.{_EXPERT_PROJ[rest[1]]}.weight"
    if rest == ["moe", "router"]:
        return pre + "mlp.gate.weight"
    if rest == ["moe", "expert_bias"]:
        return pre + BIAS_KEY
    if rest[:2] == ["moe", "shared"]:
        return pre + "mlp." + _SHARED[rest[2]]
    raise KeyError(f"hf_name: no Hugging Face name for parameter path {path!r}")


def _expert_names(path: str, num_experts: int) -> list[str]:
    # layers.N.moe.experts.w_gate -> model.layers.N.mlp.experts.{e}.gate_proj.weight
    layer, proj = path.split(".")[1], _EXPERT_PROJ[path.rsplit(".", 1)[-1]]
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(num_experts)]


def to_hf_state_dict(params: dict, cfg: Qwen3Config, *, expert_bias: str = "refuse") -> dict:
    """Flat ``{hf_name: tensor}`` in the published layout (per-expert keys; ``lm_head`` absent when tied).

    ``expert_bias``: what to do with a nonzero expert bias (``"refuse"``, ``"keep"``, ``"drop"``; see the
    module docstring); a zero bias is never written.
    """
    written = expert_bias_names(nonzero_expert_bias(params), expert_bias, where="to_hf_state_dict")
    out: dict[str, torch.Tensor] = {}
    for path, leaf in _tree.leaves_with_paths(params):
        if ".moe.experts." in path:
            for name, t in zip(_expert_names(path, leaf.shape[0]), leaf.unbind(0)):
                out[name] = t
        elif path.endswith("moe.expert_bias"):
            if hf_name(path) in written:
                out[hf_name(path)] = leaf
        else:
            out[hf_name(path)] = leaf
    return out


def _fused_expert_names(layer: str) -> tuple[str, str]:
    pre = f"model.layers.{layer}.mlp.experts."
    return pre + "gate_up_proj", pre + "down_proj"


def from_hf_state_dict(tensors: dict[str, torch.Tensor], cfg: Qwen3Config, *,
                       dtype: torch.dtype | None = None, device: Any = None) -> dict:
    """Build the parameter tree from a flat HF tensor dict; strict about missing/unexpected keys and shapes."""
    shapes = param_shapes(cfg)
    remaining = dict(tensors)
    missing: list[str] = []

    def take(name: str, shape: torch.Size) -> torch.Tensor | None:
        t = remaining.pop(name, None)
        if t is None:
            missing.append(name)
            return None
        if t.shape != shape:
            raise CheckpointError(f"tensor {name!r}: expected shape {tuple(shape)}, found {tuple(t.shape)}")
        return t

    def load(path: str, shape: torch.Size) -> torch.Tensor | None:
        if ".moe.experts." in path:
            layer = path.split(".")[1]
            E = shape[0]
            gate_up, down = _fused_expert_names(layer)
            fused_name = down if path.endswith("w_down") else gate_up
            if fused_name in tensors:  # transformers-5 fused layout
                t = tensors[fused_name]
                remaining.pop(fused_name, None)
                if path.endswith("w_down"):
                    expected = shape
                else:
                    expected = torch.Size([E, 2 * shape[1], shape[2]])
                if t.shape != expected:
                    raise CheckpointError(
                        f"tensor {fused_name!r}: expected shape {tuple(expected)}, found {tuple(t.shape)}")
                if path.endswith("w_gate"):
                    return t[:, : shape[1]].clone()
                if path.endswith("w_up"):
                    return t[:, shape[1]:].clone()
                return t
            parts = [take(n, shape[1:]) for n in _expert_names(path, E)]
            return None if any(p is None for p in parts) else torch.stack(parts)
        if path.endswith("moe.expert_bias"):
            t = remaining.pop(hf_name(path), None)
            if t is None:
                return torch.zeros(shape, dtype=torch.float32)
            if t.shape != shape:
                raise CheckpointError(f"tensor {hf_name(path)!r}: expected shape {tuple(shape)}, "
                                      f"found {tuple(t.shape)}")
            return t.float()
        return take(hf_name(path), shape)

    floats = {}
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r}: expected a floating dtype, found {t.dtype}")
        if not name.endswith(BIAS_KEY):
            floats.setdefault(t.dtype, name)
    if len(floats) > 1 and dtype is None:
        raise CheckpointError(f"the weights have {len(floats)} dtypes ({', '.join(f'{d} in {n!r}' for d, n in floats.items())}); "
                              f"expected one: pass dtype= to cast them all to one")
    params = _tree.map_with_path(load, shapes, is_leaf=_is_shape)
    if cfg.tie_word_embeddings and "lm_head.weight" in remaining:
        lm = remaining.pop("lm_head.weight")
        if "model.embed_tokens.weight" in tensors and not torch.equal(lm, tensors["model.embed_tokens.weight"]):
            raise CheckpointError("tensor 'lm_head.weight': tie_word_embeddings is true but lm_head.weight "
                                  "differs from model.embed_tokens.weight")
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the config needs: "
                              f"{_names(missing)}")
    if remaining:
        raise CheckpointError(f"checkpoint has {len(remaining)} unexpected tensor(s) for this config: "
                              f"{_names(sorted(remaining))}")

    def finish(path: str, t: torch.Tensor) -> torch.Tensor:
        if path.endswith("moe.expert_bias"):
            return t if device is None else t.to(device)
        return t.to(dtype=dtype or t.dtype, device=device).contiguous()

    return _tree.map_with_path(finish, params)


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# config.json keys whose JSON type and range are checked before they are read (a string where a number
# belongs, a bool written as "false", a float where an int belongs, a count of 0 would otherwise be
# converted silently into another model or fail deep inside). Other keys (the hub's configs carry many:
# transformers_version, use_cache, ...) are not read and do not change the function.
_POS_INT, _NONNEG_INT, _POS_NUM, _NONNEG_NUM = "an int >= 1", "an int >= 0", "a number > 0", "a number >= 0"
_CONFIG_KEYS: dict[str, tuple[str, bool]] = {  # key: (kind, required)
    "vocab_size": (_POS_INT, True), "hidden_size": (_POS_INT, True), "num_hidden_layers": (_POS_INT, True),
    "num_attention_heads": (_POS_INT, True), "num_key_value_heads": (_POS_INT, False), "head_dim": (_POS_INT, False),
    "intermediate_size": (_NONNEG_INT, False), "moe_intermediate_size": (_NONNEG_INT, False),
    "num_experts": (_NONNEG_INT, False), "num_local_experts": (_NONNEG_INT, False), "num_experts_per_tok": (_NONNEG_INT, False),
    "decoder_sparse_step": (_POS_INT, False), "shared_expert_intermediate_size": (_NONNEG_INT, False),
    "max_position_embeddings": (_POS_INT, False), "rope_theta": (_POS_NUM, False), "rms_norm_eps": (_POS_NUM, False),
    "initializer_range": (_NONNEG_NUM, False), "router_aux_loss_coef": (_NONNEG_NUM, False),
    "attention_dropout": (_NONNEG_NUM, False), "tie_word_embeddings": ("a bool", False),
    "attention_bias": ("a bool", False), "norm_topk_prob": ("a bool", False), "use_sliding_window": ("a bool", False),
    "model_type": ("a string", True), "hidden_act": ("a string", False), "architectures": ("a list of strings", False),
    "mlp_only_layers": ("a list of layer indices", False), "bos_token_id": ("a token id", False),
    "eos_token_id": ("a token id", False), "rope_scaling": ("an object", False),
    "rope_parameters": ("an object", False),
}


def _fits(kind: str, v: Any, layers: int | None) -> bool:
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (float("inf"), float("-inf"))
    integer = isinstance(v, int) and not isinstance(v, bool)
    if kind == _POS_INT:
        return integer and v >= 1
    if kind == _NONNEG_INT:
        return integer and v >= 0
    if kind == _POS_NUM:
        return number and v > 0
    if kind == _NONNEG_NUM:
        return number and v >= 0
    if kind == "a bool":
        return isinstance(v, bool)
    if kind == "a string":
        return isinstance(v, str)
    if kind == "a list of strings":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if kind == "a list of layer indices":
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (layers or 0)
                                           for x in v)
    if kind == "a token id":
        ids = v if isinstance(v, list) else [v]
        return all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)
    return isinstance(v, dict)  # an object


def check_config_dict(d: Any, file: str = CONFIG_NAME) -> None:
    """Check the JSON types and ranges of the keys of a ``config.json`` that :class:`Qwen3Config` reads;
    a :class:`ConfigError` names the file and the key, what was expected and what was found.

    >>> check_config_dict({"model_type": "qwen3", "vocab_size": 8, "hidden_size": "64", "num_hidden_layers": 1,
    ...                    "num_attention_heads": 2})
    Traceback (most recent call last):
    ...
    hpfunc.models.config.ConfigError: config.json: key 'hidden_size': expected an int >= 1, found '64' (str)
    """
    if not isinstance(d, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(d).__name__}")
    layers = d.get("num_hidden_layers") if isinstance(d.get("num_hidden_layers"), int) else None
    for key, (kind, required) in _CONFIG_KEYS.items():
        if key not in d:
            if required:
                raise ConfigError(f"{file}: key {key!r} is missing; expected {kind}")
            continue
        v = d[key]
        if v is None and not required and kind not in ("a bool",) and key not in ("vocab_size",):
            continue  # null: the default (as transformers reads it)
        if not _fits(kind, v, layers):
            raise ConfigError(f"{file}: key {key!r}: expected {kind}, found {v!r} ({type(v).__name__})")
    if d.get("model_type") == "qwen3_moe":
        e, k = d.get("num_experts", d.get("num_local_experts")) or 0, d.get("num_experts_per_tok") or 0
        if not 1 <= k <= e:
            raise ConfigError(f"{file}: key 'num_experts_per_tok': expected 1 <= num_experts_per_tok <= num_experts "
                              f"({e}) for an MoE model, found {k!r}")
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads") or d.get("num_attention_heads")
    if heads % kv:
        raise ConfigError(f"{file}: key 'num_key_value_heads': expected a divisor of num_attention_heads ({heads}), "
                          f"found {kv}")


def load_config(path: str | os.PathLike) -> Qwen3Config:
    """Read ``path/config.json`` into a :class:`Qwen3Config`; a malformed file is a :class:`ConfigError`
    naming the file and the key (:func:`check_config_dict`)."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(file):
        raise FileNotFoundError(f"from_pretrained: no {CONFIG_NAME} in {os.fspath(path)!r}")
    try:
        with open(file) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON: {e}") from None
    check_config_dict(d, file)
    try:
        return Qwen3Config.from_hf_dict(d)
    except (ConfigError, TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{file}: {e}") from None


def _load_file(file: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from None


def _read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' of tensor name -> file; "
                                  f"{type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: key 'weight_map': expected an object of tensor name -> file name")
        tensors: dict[str, torch.Tensor] = {}
        where: dict[str, str] = {}
        # shard files the index no longer names are read too, so a tensor dropped from weight_map (even
        # the only one of its file) is reported against the index, not as missing from the model
        unlisted = {f for f in os.listdir(path) if re.fullmatch(r"model-\d+-of-\d+\.safetensors", f)}
        for shard in sorted(set(weight_map.values()) | unlisted):
            file = os.path.join(path, shard)
            if os.path.basename(shard) != shard or not os.path.exists(file):
                raise CheckpointError(f"{index}: key 'weight_map' lists the file {shard!r} (for "
                                      f"{_names(sorted(k for k, v in weight_map.items() if v == shard), 3)}), "
                                      f"which is not in {os.fspath(path)!r}")
            for name, t in _load_file(file).items():
                if name in tensors:
                    raise CheckpointError(f"{file}: tensor {name!r} is in {where[name]!r} too")
                tensors[name], where[name] = t, shard
        listed, found = set(weight_map), set(tensors)
        if listed != found:
            parts = [f"{what}: {_names(sorted(names))}" for what, names in
                     (("listed but in no shard", listed - found), ("in a shard but not listed", found - listed))
                     if names]
            raise CheckpointError(f"{index}: weight_map and the shard files differ; {'; '.join(parts)}")
        moved = sorted(k for k in listed if weight_map[k] != where[k])
        if moved:
            raise CheckpointError(f"{index}: weight_map names another file than the one holding "
                                  f"{_names(moved, 3)} (in {where[moved[0]]!r}, listed in {weight_map[moved[0]]!r})")
        return tensors
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return _load_file(single)
    raise FileNotFoundError(f"from_pretrained: neither {SINGLE_FILE} nor {INDEX_FILE} in {os.fspath(path)!r}")


def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: Any = None) -> tuple[Qwen3Config, dict]:
    """Load ``(cfg, params)`` from a Hugging Face Qwen3 / Qwen3-MoE checkpoint directory, or a hub
    repository id (``owner/name[@revision]``, see :mod:`hpfunc.models.hub`).

    ``dtype``: cast floating weights (default: as stored). The expert bias is float32 (zeros when the
    checkpoint has none).

    >>> import tempfile
    >>> from hpfunc import random
    >>> from hpfunc.models import preset, qwen3
    >>> cfg = preset("qwen3-moe-tiny")
    >>> params = qwen3.init(random.key(0), cfg)
    >>> d = tempfile.mkdtemp()
    >>> save_pretrained(params, cfg, d)
    >>> cfg2, params2 = from_pretrained(d)
    >>> cfg2 == cfg and bool(torch.equal(params2["embed"], params["embed"]))
    True
    """
    from hpfunc.models.hub import local_folder

    path = local_folder(path)  # a folder, or a hub repository id through huggingface_hub's cache
    cfg = load_config(path)
    tensors = _read_tensors(path)
    try:
        return cfg, from_hf_state_dict(tensors, cfg, dtype=dtype, device=device)
    except CheckpointError as e:  # the tensors against config.json: say which folder
        raise type(e)(f"{os.fspath(path)}: {e} (against its {CONFIG_NAME})") from None


def load_params(path: str | os.PathLike, cfg: Qwen3Config, *, dtype: torch.dtype | None = None) -> dict:
    """The parameters of the Hugging Face folder ``path`` for the config ``cfg`` (which may differ from the
    folder's ``config.json`` in fields that do not change shapes); every tensor is checked against it.

    >>> import tempfile
    >>> from hpfunc import random
    >>> from hpfunc.models import preset, qwen3
    >>> cfg, d = preset("qwen3-dense-tiny"), tempfile.mkdtemp()
    >>> save_pretrained(qwen3.init(random.key(0), cfg), cfg, d)
    >>> load_params(d, cfg)["embed"].shape
    torch.Size([256, 64])
    """
    return from_hf_state_dict(_read_tensors(path), cfg, dtype=dtype)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size: expected bytes or a string like '5GB', found {size!r}")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * mult)


def _measurable(params: dict) -> bool:
    """Whether :func:`expert_bias_effect` can run here: plain, allocated tensors of a model small enough
    for a forward on a few hundred tokens in a moment (up to 1e9 parameters)."""
    leaves = _tree.leaves(params)
    return (all(type(t) is torch.Tensor and t.device.type != "meta" for t in leaves)
            and sum(t.numel() for t in leaves) <= 10**9)


def _is_model_file(name: str) -> bool:
    """The files save_pretrained owns in a folder (everything else there, a tokenizer say, is kept)."""
    return name in (CONFIG_NAME, SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(name) is not None


def _write_files(params: dict, cfg: Qwen3Config, folder: pathlib.Path, limit: int, expert_bias: str) -> None:
    from safetensors.torch import save_file

    state = to_hf_state_dict(params, cfg, expert_bias=expert_bias)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(params["embed"].dtype).removeprefix("torch.")  # informational, as on the hub
    written = [folder / CONFIG_NAME]
    with open(written[0], "w") as f:
        json.dump(config, f, indent=2, sort_keys=True, allow_nan=False)  # strict JSON
    if len(shards) == 1:
        save_file(shards[0], os.fspath(folder / SINGLE_FILE), metadata={"format": "pt"})
        written.append(folder / SINGLE_FILE)
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.fspath(folder / fname), metadata={"format": "pt"})
            written.append(folder / fname)
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        with open(folder / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True,
                      allow_nan=False)
        written.append(folder / INDEX_FILE)
    for file in written:
        fsync_file(file)


def save_pretrained(params: dict, cfg: Qwen3Config, path: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", expert_bias: str = "refuse") -> None:
    """Write ``config.json`` and safetensors (sharded with an index when larger than ``max_shard_size``).

    Tensors are written in parameter order (all of a layer together); a tensor larger than the limit gets
    a shard of its own. The exact inverse of :func:`from_pretrained` (with ``expert_bias="keep"`` for an
    MoE whose expert bias is nonzero).

    ``expert_bias``: a nonzero expert-selection bias, which transformers' Qwen3-MoE drops, makes the
    export refuse (:class:`ExpertBiasError`, quoting the logit change measured by
    :func:`expert_bias_effect`) unless ``"drop"`` (write the model without it) or ``"keep"`` (write it
    as ``mlp.gate.e_score_correction_bias`` for hpfunc's readers) is given. Nothing is written on refusal.

    Atomic: the files are written and synced in a hidden sibling folder ``.NAME.partial-PID``, which
    then takes the place of ``path`` (the old folder is renamed aside and removed). A write that fails
    (a full disk, an exception, a kill) leaves ``path`` as it was, never a mix of old and new files; the
    other files of an existing folder (a tokenizer, a README) are carried over, and stale shards of an
    older save are not.
    """
    limit = _parse_size(max_shard_size)
    nonzero = nonzero_expert_bias(params)
    if nonzero and expert_bias == "refuse":
        effect = str(expert_bias_effect(params, cfg)) if _measurable(params) else ""
        expert_bias_names(nonzero, expert_bias, effect=effect)
    check_expert_bias_mode(expert_bias)
    final = pathlib.Path(path).absolute()
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(f"save_pretrained: {os.fspath(path)!r} exists and is not a folder")
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        _write_files(params, cfg, tmp, limit, expert_bias)
        if final.exists():
            for entry in final.iterdir():
                if _is_model_file(entry.name):
                    continue
                if entry.is_dir():
                    shutil.copytree(entry, tmp / entry.name, symlinks=True)
                else:
                    try:
                        os.link(entry, tmp / entry.name, follow_symlinks=False)
                    except OSError:
                        shutil.copy2(entry, tmp / entry.name, follow_symlinks=False)
        fsync_dir(tmp)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            if old.exists() and not final.exists():
                os.replace(old, final)  # a failure between the two renames: the old folder comes back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
