"""From config sections to objects: the model config, the learning-rate schedule, the optimizer.

Example:
    >>> from hpfunc.train.config import load_config_dict
    >>> cfg = load_config_dict({"model": {"num_hidden_layers": 1},
    ...                         "schedule": {"name": "constant"}})
    >>> build_model_config(cfg.model).num_hidden_layers
    1
    >>> build_schedule(cfg.schedule, steps=10)(5)
    1.0
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Callable

import attrs
import torch

from hpfunc.models.spec import ModelSpec
from hpfunc.train.config import Config, ConfigError, ModelConfig, OptimizerConfig, ScheduleConfig, convert
from hpfunc.train.model_spec import model_spec

__all__ = ["model_spec", "build_model_config", "build_schedule", "build_optimizer", "model_dtype", "check_buildable"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model_dtype(mc: ModelConfig) -> torch.dtype:
    return _DTYPES[mc.dtype]


def build_model_config(mc: ModelConfig) -> Any:
    """The model config of ``model.preset`` (of the model ``model.name``) with the ``model.<field>``
    overrides applied.

    Unknown models and presets, unknown fields and values of the wrong type raise :class:`ConfigError`
    naming ``model.name`` / ``model.preset`` / ``model.<field>``.
    """
    spec = model_spec(mc)
    if mc.pretrained is not None:
        return _pretrained_config(mc, spec)
    if mc.preset not in spec.presets:
        close = difflib.get_close_matches(mc.preset, spec.presets, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"model.preset: unknown preset {mc.preset!r} of model {spec.name!r}; {hint}available: "
                          f"{', '.join(spec.presets)}")
    overrides = _overrides(mc, spec, ["name", "preset", "dtype", "pretrained"])
    try:
        return spec.preset(mc.preset, **overrides)
    except spec.config_error as e:
        # the config class names its own field (``Config.head_dim``); say where it came from: the YAML key
        # when the field is one the config sets.
        msg = str(e)
        prefix = f"{spec.config_class.__name__}."
        field = msg[len(prefix):].split(":", 1)[0] if msg.startswith(prefix) else None
        where = f"model.{field}: " if field in overrides else ""
        raise ConfigError(f"{where}model (preset {mc.preset!r} with overrides {overrides}): {e}") from None


def _overrides(mc: ModelConfig, spec: ModelSpec, own_keys: list[str]) -> dict[str, Any]:
    """``model.<field>`` keys checked against the spec's config class and converted to its field types."""
    from hpfunc.train.config import unknown_key_message

    hints = typing.get_type_hints(spec.config_class)
    fields = [f.name for f in attrs.fields(spec.config_class) if f.name not in spec.not_overridable]
    overrides = {}
    for key, value in mc.overrides.items():
        if key not in fields:
            raise ConfigError(unknown_key_message("model", key, [*own_keys, *fields]))
        tp = hints[key]
        overrides[key] = value if tp is Any else convert(value, tp, f"model.{key}")
    return overrides


def _read_pretrained_config(folder: str, load_config: Callable[[str], Any], model_error: type) -> Any:
    """``folder/config.json`` read into a model config; a file that is not JSON, not an object or lacks
    a key is a :class:`ConfigError` naming ``model.pretrained``, the file and the line or the key.

    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text('{"model_type": "x",')
    >>> from hpfunc.models.registry import DEFAULT_PRESET, resolve
    >>> load = resolve(None, preset=DEFAULT_PRESET).hf.load_config
    >>> _read_pretrained_config(str(d), load, ValueError)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: model.pretrained: .../config.json is not valid JSON (line 1 column 20: ...
    """
    import json
    import os

    file = os.path.join(folder, "config.json")
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.pretrained: {file} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                          f"fix or replace the file (it is written by save_pretrained or hpfunc convert --to hf)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.pretrained: cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.pretrained: {file} holds a JSON {type(data).__name__}, expected an object of the "
                          f"model's keys (hidden_size, num_hidden_layers, ...)")
    try:
        return load_config(folder)
    except model_error as e:
        raise ConfigError(f"model.pretrained: {e}") from None
    except KeyError as e:
        raise ConfigError(f"model.pretrained: {file} lacks the key {e.args[0]!r}, which a {data.get('model_type')!r} "
                          f"config needs; add it (Hugging Face's config.json of the model has it)") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.pretrained: {file} has a value of the wrong kind ({e}); expected numbers for the "
                          f"sizes, as Hugging Face's config.json of the model has them") from None


def _pretrained_config(mc: ModelConfig, spec: ModelSpec) -> Any:
    """``model.pretrained``'s ``config.json`` with the ``model.<field>`` overrides applied."""
    import os

    if spec.hf is None:
        raise ConfigError(f"model.pretrained: the model {spec.name!r} has no Hugging Face import (its ModelSpec.hf "
                          f"is None); remove model.pretrained or give the spec an HFSupport")
    if not os.path.isfile(os.path.join(mc.pretrained, "config.json")):
        raise ConfigError(f"model.pretrained: {mc.pretrained!r} holds no config.json; expected a Hugging Face folder "
                          f"(config.json and *.safetensors, e.g. from save_pretrained or hpfunc convert --to hf)")
    base = _read_pretrained_config(mc.pretrained, spec.hf.load_config, spec.hf.config_error)
    if not any(os.path.isfile(os.path.join(mc.pretrained, n))
               for n in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(f"model.pretrained: {mc.pretrained!r} holds config.json but no weights (model.safetensors "
                          f"or model.safetensors.index.json); copy the whole Hugging Face folder")
    overrides = _overrides(mc, spec, ["name", "preset", "dtype", "pretrained"])
    return attrs.evolve(base, **overrides) if overrides else base


def build_schedule(sc: ScheduleConfig, steps: int) -> Callable[[int], float]:
    """The learning-rate *factor* ``step -> [0, 1]`` (multiplied by each peak rate).

    ``constant``: linear warmup then 1. ``cosine``: warmup then a half cosine to ``end_factor`` at the
    last step. ``wsd``: warmup, a plateau, then a decay over the last ``decay_fraction`` of the steps.
    """
    from hpfunc.optim import schedules

    if sc.warmup_steps > steps:
        raise ConfigError(f"schedule.warmup_steps: expected at most train.steps ({steps}), found {sc.warmup_steps}")
    if sc.name == "constant":
        if sc.warmup_steps == 0:
            return schedules.constant(1.0)
        return schedules.linear(0.0, 1.0, sc.warmup_steps)
    if sc.name == "cosine":
        # The last step (steps - 1) is the one that reaches end_factor.
        total = max(steps - 1, sc.warmup_steps)
        return schedules.linear_warmup_cosine_decay(0.0, 1.0, sc.warmup_steps, total, sc.end_factor)
    decay = int(round(sc.decay_fraction * steps))
    stable = steps - sc.warmup_steps - decay
    if stable < 0:
        raise ConfigError(
            f"schedule.decay_fraction: warmup ({sc.warmup_steps}) plus decay ({decay} = {sc.decay_fraction} * "
            f"{steps} steps) exceed train.steps ({steps})"
        )
    return schedules.warmup_stable_decay(0.0, 1.0, sc.warmup_steps, stable, decay, sc.end_factor,
                                         decay_shape=sc.decay_shape)


def _scaled(peak: float, factor: Callable[[int], float]) -> Callable[[int], float]:
    from hpfunc.optim.schedules import Tabled

    if isinstance(factor, Tabled):  # stays readable on the device (hpfunc.optim.schedules.Tabled)
        return factor.map(lambda f: peak * f)

    def lr(step: int) -> float:
        return peak * factor(step)

    return lr


def build_optimizer(oc: OptimizerConfig, factor: Callable[[int], float],
                    spec: ModelSpec | None = None) -> tuple[Any, Callable[[int], float]]:
    """``(optimizer, lr)``: the gradient transformation and the (AdamW) learning-rate schedule it uses.

    The schedule ``factor`` multiplies each peak rate (``lr``, and ``muon_lr`` for ``muon_adamw``);
    ``clip_norm`` chains a global-norm clip in front. The model's knowledge of its parameters comes
    from its spec (``spec``, by default the registered model of the default preset): ``adamw`` decays
    only the leaves of its ``decay_mask`` (every leaf when it has none); ``muon_adamw`` routes by its
    ``adamw_when`` (Muon's default when it has none) and decays every leaf.

    >>> from hpfunc.train.config import load_config_dict
    >>> tx, lr = build_optimizer(load_config_dict({"optimizer": {"lr": 0.01}}).optimizer, lambda s: 0.5)
    >>> lr(0)
    0.005
    >>> tx, _ = build_optimizer(load_config_dict({"optimizer": {"name": "muon_adamw"}}).optimizer, lambda s: 1.0)
    >>> state = tx.init({"embed": torch.zeros(8, 4), "layers": [{"attn": {"wq": torch.zeros(4, 4)}}]})
    >>> from hpfunc import tree
    >>> [path for path, _ in tree.leaves_with_paths(state[1].inner_states["muon"][0].momentum)]
    ['layers.0.attn.wq']
    """
    from hpfunc import optim
    from hpfunc.models import registry

    spec = registry.resolve(None, preset=registry.DEFAULT_PRESET) if spec is None else spec
    lr = _scaled(oc.lr, factor)
    b1, b2 = oc.betas
    if oc.name == "adamw":
        tx = optim.adamw(lr, b1, b2, oc.eps, weight_decay=oc.weight_decay, mask=spec.decay_mask)
    else:
        tx = optim.muon_adamw(
            _scaled(oc.muon_lr, factor),
            beta=oc.muon_momentum,
            weight_decay=oc.weight_decay,
            adam_learning_rate=lr,
            adam_b1=b1,
            adam_b2=b2,
            adam_eps=oc.eps,
            **({} if spec.adamw_when is None else {"adamw_when": spec.adamw_when}),
        )
    if oc.clip_norm is not None:
        tx = optim.chain(optim.clip_by_global_norm(oc.clip_norm), tx)
    return tx, lr


def check_buildable(cfg: Config) -> Any:
    """Build what can be built without data (model config, schedule) and check the parallel plan
    against the model, the ``precision:`` and ``activations:`` sections against the model and the plan
    (:func:`hpfunc.train.step_transforms.check_step_transforms`) and the ``callbacks:`` entries (names,
    import paths, options), so errors come before any work (and before any rank starts). Also checked:
    ``train.seq_len`` fits in the model's longest sequence (its spec's ``positions_field``).

    Returns the model config.
    """
    from hpfunc.train.distributed import check_parallel

    spec = model_spec(cfg.model)
    model_cfg = build_model_config(cfg.model)
    field = spec.positions_field
    limit = None if field is None else getattr(model_cfg, field)
    if limit is not None and cfg.train.seq_len > limit:
        # the positional embedding would run past the positions the model is made for, without a word
        raise ConfigError(
            f"train.seq_len: {cfg.train.seq_len} is longer than the model's model.{field} "
            f"({limit}, preset {cfg.model.preset!r}); use train.seq_len <= "
            f"{limit} or set model.{field}: {cfg.train.seq_len} (or more)"
        )
    build_schedule(cfg.schedule, cfg.train.steps)
    check_parallel(cfg, model_cfg)
    from hpfunc.train.step_transforms import check_step_transforms

    check_step_transforms(cfg, model_cfg, spec)  # precision: and activations: against the model and the plan
    from hpfunc.train.callbacks import build_callbacks

    build_callbacks(cfg)  # names, import paths and option types: errors before any rank starts
    return model_cfg
