"""A second model for the trainer's tests: a byte-level language model of an embedding, two residual MLP
blocks (column- then row-parallel, read through :mod:`hpfunc.layout`) and a head. It is registered by
no one: a config names it by import path (``model.name: _tiny_mlp_lm:SPEC``)."""

from __future__ import annotations

import contextvars

import attrs
import torch
import torch.nn.functional as F

from hpfunc import layout, saved_tensors
from hpfunc import random as hrandom
from hpfunc import tree
from hpfunc.layout import ColwiseParallel, RowwiseParallel
from hpfunc.models.spec import ModelSpec


@attrs.frozen
class MLPConfig:
    vocab_size: int = 256
    hidden_size: int = 16
    mlp_size: int = 32
    num_layers: int = 2


PRESETS = {"mlp-tiny": {}, "mlp-wide": {"hidden_size": 32, "mlp_size": 64}}


def preset(name: str, **overrides) -> MLPConfig:
    return MLPConfig(**{**PRESETS[name], **overrides})


def param_shapes(cfg: MLPConfig) -> dict:
    V, H, M = cfg.vocab_size, cfg.hidden_size, cfg.mlp_size
    return {"embed": torch.Size([V, H]),
            "layers": [{"w_in": torch.Size([M, H]), "w_out": torch.Size([H, M])} for _ in range(cfg.num_layers)],
            "head": torch.Size([V, H])}


def init(key, cfg: MLPConfig, dtype=torch.float32, *, shardings=None) -> dict:
    """Every leaf from ``fold_in(key, i)`` (counter-based: the same values for every sharding)."""
    shapes = tree.leaves_with_paths(param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size))
    index = {p: i for i, (p, _) in enumerate(shapes)}
    by_path = {} if shardings is None else dict(tree.leaves_with_paths(
        shardings, is_leaf=lambda x: not isinstance(x, (dict, list))))

    def make(path, shape):
        return hrandom.normal(hrandom.fold_in(key, index[path]), tuple(shape), dtype, std=0.1,
                              sharding=by_path.get(path))

    return tree.map_with_path(make, param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size))


# A test that sets this to a list sees every layer call: (layer index, inside a recompute, the saved-tensor
# layers in force), e.g. to count what a remat policy recomputes.
CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("tiny_mlp_lm_calls", default=None)


def block(layer: dict, h: torch.Tensor, index: int) -> torch.Tensor:
    calls = CALLS.get()
    if calls is not None:
        calls.append((index, saved_tensors.in_recompute_region() is not None,
                      tuple(type(x).__name__ for x in saved_tensors.layers())))
    inner = F.gelu(F.linear(layout.gather_sequence(h), layer["w_in"]))
    return h + layout.reduce_partial(F.linear(inner, layer["w_out"]))


def apply(params: dict, tokens: torch.Tensor, cfg: MLPConfig) -> torch.Tensor:
    h = F.embedding(tokens, params["embed"])
    for i, layer in enumerate(params["layers"]):
        h = layout.run_layer(i, block, layer, h, i)
    return F.linear(h, params["head"])


def loss(params: dict, batch: dict, cfg: MLPConfig):
    tokens = batch["tokens"]
    labels = batch.get("labels")
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100) if labels is None else labels
    logits = apply(params, tokens, cfg)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return ce, {"ce_loss": ce.detach()}


def tp_styles(cfg: MLPConfig, *, vocab_parallel: bool = False, sequence_parallel: bool = False) -> dict:
    if vocab_parallel or sequence_parallel:
        raise layout.PlanError("the tiny MLP LM has no vocabulary- or sequence-parallel styles")
    return {"layers.*.w_in": ColwiseParallel(), "layers.*.w_out": RowwiseParallel()}


SPEC = ModelSpec(name="tiny_mlp_lm", config_class=MLPConfig, presets=tuple(PRESETS), preset=preset, init=init,
                 param_shapes=param_shapes, loss=loss, apply=apply, tp_styles=tp_styles,
                 tp_divides=lambda cfg, vocab_parallel=False: [("mlp_size", "MLP features")],
                 layers_field="num_layers")
NOT_A_SPEC = 3
