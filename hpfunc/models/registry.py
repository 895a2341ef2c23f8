"""Which models the trainer can train: registered names and import paths, resolved to a :class:`ModelSpec`.

The registry is an immutable mapping from name to the import path of the spec (the spec module is
imported only when asked for); nothing registers itself at import time, and there is nothing to
mutate. A model of your own needs no registration: name its spec by import path (``model.name:
my_pkg.my_model:SPEC`` in the YAML), which works in every rank of a launch as long as the module is
importable there.

    >>> sorted(BUILTIN)
    ['qwen3', 'qwen3_moe']
    >>> resolve("qwen3_moe").name, resolve(None, preset="qwen3-dense-tiny").name
    ('qwen3_moe', 'qwen3')
    >>> resolve("hpfunc.models.qwen3.spec:DENSE").name
    'qwen3'
    >>> resolve("qwen3-moe")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.models.registry.UnknownModelError: unknown model 'qwen3-moe'; did you mean 'qwen3_moe'? registered: ...
"""

from __future__ import annotations

import difflib
import importlib
import types
from typing import Mapping

from hpfunc.models.spec import ModelSpec

__all__ = ["BUILTIN", "DEFAULT_PRESET", "UnknownModelError", "resolve", "load", "all_presets"]

# name -> "module:attribute" of its ModelSpec. Read-only: a test or a user adds a model by import path.
BUILTIN: Mapping[str, str] = types.MappingProxyType({
    "qwen3": "hpfunc.models.qwen3.spec:DENSE",
    "qwen3_moe": "hpfunc.models.qwen3.spec:MOE",
})
DEFAULT_PRESET = "qwen3-moe-tiny"  # the trainer's ``model.preset`` when the YAML names none


class UnknownModelError(LookupError):
    """A model name that is not registered, an import path that does not resolve, or a preset no model has."""

    def __str__(self) -> str:  # LookupError would quote the message
        return str(self.args[0])


def load(path: str) -> ModelSpec:
    """The :class:`ModelSpec` at ``"package.module:NAME"``; errors say which part did not resolve."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UnknownModelError(f"{path!r} is not an import path; expected 'package.module:NAME'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownModelError(f"cannot import the module {module_name!r} of {path!r}: {e}") from None
    try:
        spec = getattr(module, attr)
    except AttributeError:
        raise UnknownModelError(f"the module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    if not isinstance(spec, ModelSpec):
        raise UnknownModelError(f"{path!r} is a {type(spec).__name__}, expected a hpfunc.models.spec.ModelSpec")
    return spec


def resolve(name: str | None, *, preset: str | None = None, registry: Mapping[str, str] = BUILTIN) -> ModelSpec:
    """The spec of ``name``: a key of ``registry`` or an import path ``package.module:NAME``.

    ``name=None``: the registered model that has ``preset`` (:class:`UnknownModelError` when none has).
    """
    if name is None:
        for key in registry:
            spec = load(registry[key])
            if preset in spec.presets:
                return spec
        presets = all_presets(registry)
        close = difflib.get_close_matches(str(preset), presets, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownModelError(f"unknown preset {preset!r}; {hint}available: {', '.join(presets)}")
    if ":" in name:
        return load(name)
    if name in registry:
        return load(registry[name])
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownModelError(f"unknown model {name!r}; {hint}registered: {', '.join(registry)} (or give the import "
                            f"path of a ModelSpec: package.module:NAME)")


def all_presets(registry: Mapping[str, str] = BUILTIN) -> list[str]:
    """Every preset of the registered models, in registry order."""
    return [p for key in registry for p in load(registry[key]).presets]
