"""The model a config trains: ``model.name`` (or ``model.preset``) resolved to its
:class:`~hpfunc.models.spec.ModelSpec` through :mod:`hpfunc.models.registry`, errors named by config key."""

from __future__ import annotations

from hpfunc.models.spec import ModelSpec
from hpfunc.train.config import ConfigError, ModelConfig

__all__ = ["model_spec"]


def model_spec(mc: ModelConfig) -> ModelSpec:
    """The :class:`~hpfunc.models.spec.ModelSpec` of ``model.name`` (a registered name or an import path
    ``package.module:SPEC``; unset: the registered model that has ``model.preset``).

    An unknown name, an import path that does not resolve, or a preset no model has raise
    :class:`ConfigError` naming ``model.name`` / ``model.preset``.

    >>> from hpfunc.train.config import load_config_dict
    >>> from hpfunc.models.registry import BUILTIN
    >>> model_spec(load_config_dict({}).model).name in BUILTIN  # the registered model of the default preset
    True
    >>> model_spec(load_config_dict({"model": {"name": "nope"}}).model)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: model.name: unknown model 'nope'; registered: ...
    """
    from hpfunc.models import registry

    try:
        return registry.resolve(mc.name, preset=mc.preset)
    except registry.UnknownModelError as e:
        raise ConfigError(f"model.{'preset' if mc.name is None else 'name'}: {e}") from None
