"""The small grammars of the config: ``callbacks:`` entries and the per-layer ``activations:`` policies.

    >>> parse_callbacks(["metrics_log", {"moe_monitor": {"every": 5}}], "callbacks")[1]
    CallbackEntry(name='moe_monitor', options={'every': 5})
    >>> parse_layer_policies({0: "nothing_saveable", 2: None}, "activations.remat", REMAT_POLICIES)
    {0: 'nothing_saveable', 2: None}
    >>> parse_layer_policies("dots_saveabel", "activations.remat", REMAT_POLICIES)
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: activations.remat: unknown policy 'dots_saveabel'; did you mean 'dots_saveable'? ...
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence

from hpfunc.train.config.errors import ConfigError, found
from hpfunc.train.config.schema import REMAT_POLICIES, CallbackEntry

__all__ = ["parse_callbacks", "parse_layer_policies", "layer_policy", "check_layer_policies"]


def parse_callbacks(data: Any, path: str) -> tuple:
    """``[name, {name: {option: value}}, ...]`` -> a tuple of :class:`CallbackEntry` (syntax only)."""
    if data is None:
        return ()
    if isinstance(data, (str, Mapping)):
        data = [data]
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of callbacks (e.g. [moe_monitor, {{tensorboard: {{every: 10}}}}]), "
                          f"found {found(data)}")
    out = []
    for i, item in enumerate(data):
        where = f"{path}[{i}]"
        if isinstance(item, str):
            out.append(CallbackEntry(item))
            continue
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ConfigError(f"{where}: expected a callback name or a mapping of one name to its options "
                              f"({{moe_monitor: {{every: 5}}}}), found {found(item)}")
        (name, options), = item.items()
        if not isinstance(name, str):
            raise ConfigError(f"{where}: the callback's name must be a string, found {found(name)}")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}.{name}: expected a mapping of options, found {found(options)}")
        for key in options:
            if not isinstance(key, str):
                raise ConfigError(f"{where}.{name}: option names must be strings, found {found(key)}")
        out.append(CallbackEntry(name, dict(options)))
    return tuple(out)


def _policy(value: Any, path: str, choices: Sequence[str]) -> str | None:
    if value is None or value == "none" or value is False:
        return None
    if not isinstance(value, str) or value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
        hint = f"did you mean {close[0]!r}? " if close else ""
        what = f"policy {value!r}" if isinstance(value, str) else f"policy: {found(value)}"
        raise ConfigError(f"{path}: unknown {what}; {hint}expected one of {', '.join(choices)}")
    return value


def parse_layer_policies(value: Any, path: str, choices: Sequence[str]) -> Any:
    """A per-layer policy key: one name for every layer (``str``), one per layer (a ``tuple``, ``None``
    for a layer left as is), or ``{layer index: name}`` (a ``dict``); ``None``/``none``: no layer.
    Names are checked here; layer indices against the model by :func:`check_layer_policies`."""
    if isinstance(value, (list, tuple)):
        return tuple(_policy(v, f"{path}[{i}]", choices) for i, v in enumerate(value))
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, int):
                raise ConfigError(f"{path}: expected layer indices (integers) as keys, found {found(k)}; e.g. "
                                  f"{{0: {choices[0]}, 3: {choices[0]}}}")
            out[k] = _policy(v, f"{path}.{k}", choices)
        return out
    return _policy(value, path, choices)


def check_layer_policies(value: Any, path: str, num_layers: int, where: str) -> None:
    """Raise :class:`ConfigError` naming ``path`` when a per-layer policy does not fit a model of
    ``num_layers`` layers (``where``: the key that says so, e.g. ``model.num_hidden_layers``)."""
    if isinstance(value, tuple) and len(value) != num_layers:
        raise ConfigError(f"{path}: {len(value)} {'entry' if len(value) == 1 else 'entries'}, but the model has {num_layers} layers ({where}); give "
                          f"one policy (or none) per layer, or a mapping {{layer index: policy}}")
    if isinstance(value, dict):
        for k in value:
            if not 0 <= k < num_layers:
                raise ConfigError(f"{path}.{k}: layer {k} is out of range: the model has {num_layers} layers "
                                  f"({where}), numbered 0 to {num_layers - 1}")


def layer_policy(value: Any, index: int) -> str | None:
    """The policy name of layer ``index`` (``None``: the layer as is).

    >>> [layer_policy(v, 1) for v in ("dots_saveable", (None, "dots_saveable"), {0: "dots_saveable"}, None)]
    ['dots_saveable', 'dots_saveable', None, None]
    """
    if isinstance(value, tuple):
        return value[index] if index < len(value) else None
    if isinstance(value, dict):
        return value.get(index)
    return value
