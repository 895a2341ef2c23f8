"""``hpfunc.ops.load_registry(path)``: sharding rules from a YAML file, for ops that need no code.

The file holds a list ``ops`` of entries::

    ops:
      - op: mylib::fused_mm                   # an op name, ns::name[.overload]
        rule: "i k, k n -> i n | sum k"       # the rule language of hpfunc.ops.rule
      - op: mylib::row_softmax
        rule: "... j -> ... j"
        impl: mypackage.kernels:row_softmax   # module:function (or module.function), run on local blocks
        static: {dim: -1}                     # values of non-tensor arguments without default, for the check
        check: true                           # run the op once to check the rule against its shapes (default)
      - import: mypackage.ops                 # a module to import first (it defines the ops above)

Each entry is registered with :func:`hpfunc.ops.register`; entries are checked in order and the first
bad one raises :class:`RegistryError` naming the file, the entry (index and op) and the key: an unknown
key, an op that does not exist, a rule that does not parse or contradicts the op's shapes, an ``impl``
that does not import. ``shipped_registry()`` is the registry hpfunc ships for the ops its own models use
outside torch's DTensor coverage (the CPU flash-attention kernel behind
``F.scaled_dot_product_attention``, forward and backward).

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "bad.yaml"
    >>> _ = path.write_text("ops:\\n  - op: aten::mm\\n    rule: 'i j, j k -> i k |'\\n")
    >>> load_registry(path)
    Traceback (most recent call last):
    ...
    hpfunc.ops.yaml_registry.RegistryError: ...bad.yaml: entry 0 (op aten::mm), key 'rule': rule 'i j, j k -> i k |': an empty '|' clause; expected e.g. '| sum j' or '| whole h'
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable

import yaml

from hpfunc.ops.register import Registration, _check_shapes, register, resolve_op
from hpfunc.ops.rule import RuleError, parse

__all__ = ["load_registry", "RegistryError", "shipped_registry", "import_object"]

_KEYS = {"op", "rule", "impl", "static", "check"}


class RegistryError(ValueError):
    """A bad entry in a YAML operator registry (the message names the file, the entry and the key)."""


def shipped_registry() -> Path:
    """The registry shipped with hpfunc (``hpfunc/ops/registry.yaml``)."""
    return Path(__file__).with_name("registry.yaml")


def import_object(path: str) -> Callable:
    """The object at ``"module:attr"`` or ``"module.attr"``; ``ImportError``/``AttributeError`` otherwise."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ImportError(f"{path!r} is not an import path; expected 'package.module:function'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_registry(path: str | os.PathLike) -> list[Registration]:
    """Register every entry of the YAML file at ``path`` (see the module docstring); returns the
    registrations in file order."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RegistryError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ops"), list):
        raise RegistryError(f"{path}: expected a mapping with a list 'ops' of entries, found {type(doc).__name__}")
    checked: list[tuple[dict, Any, Callable | None]] = []
    # every entry is checked before any is registered: a bad file registers nothing
    for i, entry in enumerate(doc["ops"]):
        if isinstance(entry, dict) and set(entry) == {"import"}:
            try:
                importlib.import_module(str(entry["import"]))
            except ImportError as e:
                raise RegistryError(f"{path}: entry {i}, key 'import': cannot import {entry['import']!r}: {e}") from None
            continue
        if not isinstance(entry, dict):
            raise RegistryError(f"{path}: entry {i} is a {type(entry).__name__}; expected a mapping with keys op, rule "
                                f"(and optionally impl, static, check) or a single key import")
        name = entry.get("op")
        where = f"{path}: entry {i} (op {name})"
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise RegistryError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_KEYS))}")
        for key in ("op", "rule"):
            if not isinstance(entry.get(key), str):
                raise RegistryError(f"{where}, key {key!r}: expected a string, found {entry.get(key)!r}")
        try:
            op = resolve_op(name)
        except (ValueError, TypeError) as e:
            raise RegistryError(f"{where}, key 'op': {e}") from None
        static = entry.get("static") or {}
        if not isinstance(static, dict):
            raise RegistryError(f"{where}, key 'static': expected a mapping of argument name to value")
        try:
            rule = parse(entry["rule"])
            if entry.get("check", True):
                _check_shapes(op, rule, static)
        except RuleError as e:
            raise RegistryError(f"{where}, key 'rule': {e}") from None
        impl = None
        if entry.get("impl") is not None:
            try:
                impl = import_object(str(entry["impl"]))
            except (ImportError, AttributeError) as e:
                raise RegistryError(f"{where}, key 'impl': cannot import {entry['impl']!r} "
                                    f"({type(e).__name__}: {e}); give 'package.module:function'") from None
            if not callable(impl):
                raise RegistryError(f"{where}, key 'impl': {entry['impl']!r} is not callable")
        checked.append((entry, op, impl))
    return [register(op, entry["rule"], impl, check=False) for entry, op, impl in checked]
