"""Callbacks: what runs beside the training loop (see :mod:`hpfunc.train.callbacks.base` for the protocol).

Built-in (``callbacks:`` in the YAML, by name, with options):

==================  ======================================================================  ==================
name                what it does                                                            module
==================  ======================================================================  ==================
``metrics_log``     every step's metrics as the step returned them, one JSON line each      ``metrics_log``
``moe_monitor``     per MoE layer: expert load, max violation, top-10% share, dead experts  ``moe_monitor``
                    (``moe.jsonl``) and a heat map of load per layer and expert (PNG)
``layer_norms``     per-layer parameter norms from the shards, one reduction (``norms.jsonl``)  ``layer_norms``
``checkpoint_log``  one line per checkpoint saved: step, path, the seconds the step waited   ``checkpoint_log``
``tensorboard``     the logged scalars, expert-load histograms and validation loss as        ``tensorboard``
                    TensorBoard events (needs the ``tensorboard`` package)
``precision_        per layer and parameter group: gradient and parameter norms, update     ``precision_
monitor``           ratios (one reduction in the step); local loss per data rank and        monitor``
                    micro-batch; loss / gradient-norm spikes naming the layer and rank
                    (``precision.jsonl``)
==================  ======================================================================  ==================

The run's own outputs (progress, metrics.jsonl, checkpoints, loss.png, summary.json) are built-in
callbacks that are always on (:mod:`hpfunc.train.callbacks.defaults`); the entries of ``callbacks:`` run
between them. Every callback's file writes go to the run's background writer
(:mod:`hpfunc.train.callbacks.writer`), so no step waits for a disk.

A callback of your own is named by import path, ``my_pkg.module:MyCallback`` (a class, called with the
entry's options as keyword arguments, or an object). Options are checked against the constructor's
annotations before anything runs: an unknown callback (with a did-you-mean), an import path that does
not resolve, an unknown option or an option of the wrong type is a
:class:`~hpfunc.train.config.ConfigError` naming the key (``callbacks[0].moe_monitor.every``).

    >>> from hpfunc.train.config import load_config_dict
    >>> [label for label, _ in build_callbacks(load_config_dict({"callbacks": [{"moe_monitor": {"every": 2}}]}))]
    ['callbacks[0] (moe_monitor)']
    >>> build_callbacks(load_config_dict({"callbacks": ["moe_monitr"]}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: callbacks[0]: unknown callback 'moe_monitr'; did you mean 'moe_monitor'? ...
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from typing import Any, Mapping

from hpfunc.train.callbacks.base import Callback, CallbackError, CallbackList, WriterCallback, open_lines
from hpfunc.train.config import CallbackEntry, Config, ConfigError

__all__ = ["BUILTIN", "Callback", "CallbackError", "CallbackList", "WriterCallback", "build_callbacks", "make_callback",
           "open_lines"]

# name -> import path of the class; read-only (a callback of your own is named by its import path)
BUILTIN: Mapping[str, str] = types.MappingProxyType({
    "metrics_log": "hpfunc.train.callbacks.metrics_log:MetricsLog",
    "moe_monitor": "hpfunc.train.callbacks.moe_monitor:MoeMonitor",
    "layer_norms": "hpfunc.train.callbacks.layer_norms:LayerNorms",
    "checkpoint_log": "hpfunc.train.callbacks.checkpoint_log:CheckpointLog",
    "tensorboard": "hpfunc.train.callbacks.tensorboard:TensorBoard",
    "precision_monitor": "hpfunc.train.callbacks.precision_monitor:PrecisionMonitor",
})


def _resolve(name: str, where: str) -> Any:
    if ":" not in name:
        if name not in BUILTIN:
            close = difflib.get_close_matches(name, list(BUILTIN), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: unknown callback {name!r}; {hint}built-in: {', '.join(BUILTIN)} (or the "
                              f"import path of your own, package.module:Name)")
        name = BUILTIN[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: {name!r} is not an import path; expected 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import the module {module_name!r} of the callback {name!r}: {e}; is "
                          f"its package installed (or on PYTHONPATH) in every rank?") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: the module {module_name!r} has no attribute {attr!r}{hint}") from None


def make_callback(entry: CallbackEntry, where: str) -> Any:
    """The callback of one ``callbacks:`` entry, its options checked against the constructor."""
    from hpfunc.train.config import _convert

    target = _resolve(entry.name, where)
    key = f"{where}.{entry.name}"
    if not inspect.isclass(target):
        if entry.options:
            raise ConfigError(f"{key}: {entry.name!r} is an object, not a class: it takes no options")
        return target
    params = {n: p for n, p in inspect.signature(target).parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    try:
        hints = typing.get_type_hints(target.__init__)
    except Exception:  # noqa: BLE001 - annotations that do not evaluate: options are passed unchecked
        hints = {}
    options = {}
    for opt, value in entry.options.items():
        if opt not in params:
            close = difflib.get_close_matches(opt, list(params), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}.{opt}: unknown option; {hint}expected one of {', '.join(params) or 'none'}")
        tp = hints.get(opt, Any)
        options[opt] = _convert(value, tp, f"{key}.{opt}")
    missing = [n for n, p in params.items() if p.default is p.empty and n not in options]
    if missing:
        raise ConfigError(f"{key}: missing option(s) {', '.join(missing)}")
    try:
        return target(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


def build_callbacks(cfg: Config) -> list[tuple[str, Any]]:
    """``(label, callback)`` of every ``callbacks:`` entry, in order; errors name the entry's key."""
    out = []
    for i, entry in enumerate(cfg.callbacks):
        where = f"callbacks[{i}]"
        out.append((f"{where} ({entry.name})", make_callback(entry, where)))
    return out
