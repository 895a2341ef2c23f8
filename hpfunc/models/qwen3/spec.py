"""Qwen3's two registrations for the trainer (:mod:`hpfunc.models.registry`): ``DENSE`` (``qwen3``) and
``MOE`` (``qwen3_moe``), the same functions with their own presets (the Hugging Face ``model_type``
names). Everything model-specific the trainer uses is reached through these values.

    >>> MOE.name, MOE.presets
    ('qwen3_moe', ('qwen3-30b-a3b', 'qwen3-moe-tiny', 'qwen3-moe-small'))
    >>> cfg = DENSE.preset("qwen3-dense-tiny")
    >>> DENSE.describe(cfg)
    '2 layers, hidden 64: 115,072 params'
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from hpfunc.models import config as _config
from hpfunc.models.qwen3 import hf as _hf
from hpfunc.models.qwen3 import hf_sharded as _hf_sharded
from hpfunc.models.qwen3 import model as _model
from hpfunc.models.qwen3 import parallel_plan as _plan
from hpfunc.models.spec import HFSupport, ModelSpec
from hpfunc.regions import Regions

__all__ = ["DENSE", "MOE"]


def _describe(cfg: _config.Qwen3Config) -> str:
    n, active = _model.count_params(cfg), _model.active_params(cfg)
    moe = f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.is_moe else ""
    act = f" ({active:,} active)" if active != n else ""
    return f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}{moe}: {n:,} params{act}"


def _tp_divides(cfg: _config.Qwen3Config, *, vocab_parallel: bool = False) -> list[tuple[str, str]]:
    out = [("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads")]
    if vocab_parallel:
        out.append(("vocab_size", "vocabulary rows (vocab_parallel)"))
    return out


def _with_aux_loss_coef(cfg: _config.Qwen3Config, coef: float) -> _config.Qwen3Config:
    return attrs.evolve(cfg, router_aux_loss_coef=float(coef))


def _compile_loss(loss: Any, regions: Regions) -> Any:
    """``loss`` (``model.loss`` or ``parallel_plan.loss``) with each decoder layer's compute in ``regions``
    (:func:`hpfunc.models.qwen3.model.compiled_layer`)."""
    return functools.partial(loss, regions=regions)


def _spec(name: str, presets: tuple[str, ...]) -> ModelSpec:
    return ModelSpec(
        name=name, config_class=_config.Qwen3Config, presets=presets, preset=_config.preset,
        init=_model.init, param_shapes=_model.param_shapes, loss=_model.loss, apply=_model.apply,
        parallel_loss=_plan.loss, tp_styles=_plan.tp_styles, tp_divides=_tp_divides, ep_experts=_plan.ep_experts,
        pipeline_stages=_plan.pipeline_stages, decay_mask=_plan.decay_mask, adamw_when=_plan.adamw_when,
        with_aux_loss_coef=_with_aux_loss_coef, count_params_fn=_model.count_params,
        active_params_fn=_model.active_params, describe_fn=_describe,
        to_dict_fn=_config.Qwen3Config.to_hf_dict,
        hf=HFSupport(load_config=_hf.load_config, load_params=_hf.load_params,
                     import_sharded=_hf_sharded.import_pretrained, config_error=_config.ConfigError),
        config_error=_config.ConfigError, not_overridable=frozenset({"rope_scaling"}),  # nested: not from YAML yet
        vocab_field="vocab_size", positions_field="max_position_embeddings", layers_field="num_hidden_layers",
        experts_field="num_experts", ignore_index=_model.IGNORE_INDEX, compile_loss=_compile_loss,
    )


_MOE_PRESETS = tuple(p for p in _config.PRESETS if _config.preset(p).is_moe)
DENSE = _spec("qwen3", tuple(p for p in _config.PRESETS if p not in _MOE_PRESETS))
MOE = _spec("qwen3_moe", _MOE_PRESETS)
