"""The strict structurer: plain data (as read from YAML) into attrs classes, every key and type checked.

An unknown key, a value of the wrong type or an unknown choice raises :class:`ConfigError` naming the
dotted key path, saying what was expected and what was found and, where it can, the fix: a close key of
the same section, the same key in another section, or a key sharing a word with it (``lr_warmup`` ->
``schedule.warmup_steps``). Numbers are not coerced silently: ``2.5`` is not an integer, ``"no"`` is
not a boolean (YAML 1.1's ``3e-4``, read as a string, is the one string taken as a number).

Why not cattrs (with ``forbid_extra_keys``), the well-kept library for this: measured with cattrs 26.2,
it structures ``steps: 2.5`` as 2, ``steps: true`` as 1, ``plot: "no"`` as ``True``, and reports an
unknown key as ``extra fields found (stpes) @ $.train`` with no suggestion; each of those would need a
hook of our own, which is this module again.

    >>> from hpfunc.train.config.schema import Config
    >>> s = Structurer(Config)
    >>> s.structure({"train": {"steps": 3}}).train.steps
    3
    >>> s.structure({"train": {"stpes": 3}})
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: train.stpes: unknown key; did you mean 'steps'? expected one of ...
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import attrs

from hpfunc.train.config.errors import ConfigError, found

__all__ = ["Structurer", "join", "type_name"]


def join(path: str, key: Any) -> str:
    """``path.key`` (``key`` at the top level)."""
    return f"{path}.{key}" if path else str(key)


def type_name(tp: Any) -> str:
    """An annotation as an error message says what was expected (``an integer``, ``one of 'a', 'b'``)."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple:
            return f"a list of {len(args)} numbers" if all(a is float for a in args) else "a list"
        return f"a list of {type_name(args[0])}" if args else "a list"
    if attrs.has(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _word_score(key: str, candidate: str) -> int:
    words = set(key.lower().replace("-", "_").split("_")) - {""}
    return sum(len(w) for w in words & set(candidate.split("_")))


def _choices(tp: Any) -> list[str]:
    """The choices of a ``Literal`` annotation, also inside ``Union[Literal[...], None]``."""
    if typing.get_origin(tp) is Literal:
        return [str(c) for c in typing.get_args(tp)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [c for a in typing.get_args(tp) for c in _choices(a)]
    return []


@attrs.frozen
class Structurer:
    """Structures plain data into the attrs class ``root`` (see the module docstring).

    ``hooks``: dotted key path -> ``fn(value, path)`` for a section with a grammar of its own (the
    ``parallel:`` section); ``open_fields``: attrs class -> the name of its field that collects the
    section's keys that are not fields (checked later, e.g. model-config overrides); ``moved``: the
    hint for a key users look for in a section where it is not (``precision.param_dtype``).
    """

    root: type
    hooks: Mapping[str, Callable[[Any, str], Any]] = attrs.field(factory=dict)
    open_fields: Mapping[type, str] = attrs.field(factory=dict)
    moved: Mapping[str, str] = attrs.field(factory=dict)  # "section.key" users may look for -> where it is

    def structure(self, data: Any) -> Any:
        """``data`` (a mapping, or ``None`` for every default) as an instance of ``root``."""
        return self.from_mapping(self.root, data, "")

    def schema_keys(self, cls: type | None = None, prefix: str = "") -> list[tuple[str, str]]:
        """Every ``(section_path, key)`` of the schema, for suggestions across sections."""
        cls = self.root if cls is None else cls
        out = []
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            if f.name == self.open_fields.get(cls):
                continue
            out.append((prefix, f.name))
            if attrs.has(hints[f.name]):
                out.extend(self.schema_keys(hints[f.name], join(prefix, f.name)))
        return out

    def unknown_key_message(self, path: str, key: str, allowed: Sequence[str]) -> str:
        """``path.key: unknown key; did you mean ...? expected one of ...``: a close key of the section, the
        same key elsewhere in the schema, or the key sharing the longest words with it."""
        hint = ""
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        if join(path, key) in self.moved:
            hint = f"{self.moved[join(path, key)]}; "
        elif close:
            hint = f"did you mean {close[0]!r}? "
        else:
            keys = self.schema_keys()
            exact = [(s, k) for s, k in keys if s != path and k == key and s]
            if exact:
                hint = f"did you mean {join(*exact[0])!r}? "
            else:
                scored = [(_word_score(key, k), s == path, s, k) for s, k in keys]
                scored = [t for t in scored if t[0] > 0]
                if scored:
                    best, same, s, k = max(scored, key=lambda t: (t[0], t[1]))
                    where = "" if same else f" (in {s or 'the top level'}: {join(s, k)})"
                    hint = f"did you mean {k!r}{where}? "
        return f"{join(path, key)}: unknown key; {hint}expected one of {', '.join(sorted(allowed))}"

    def convert(self, value: Any, tp: Any, path: str) -> Any:
        """Check ``value`` against the annotation ``tp`` and convert it; :class:`ConfigError` naming ``path``."""
        hook = self.hooks.get(path)
        if hook is not None:
            return hook(value, path)
        origin = typing.get_origin(tp)
        if attrs.has(tp):
            return self.from_mapping(tp, value, path)
        if origin in (Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            for a in args:
                if a is type(None):
                    continue
                try:
                    return self.convert(value, a, path)
                except ConfigError:
                    continue
            close = difflib.get_close_matches(str(value), _choices(tp), n=1) if isinstance(value, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: expected {type_name(tp)}, found {found(value)}{hint}")
        if origin is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{path}: expected {type_name(tp)}, found {found(value)}{hint}")
            return value
        if tp is Any:
            return value
        if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
            (arg, _) = typing.get_args(tp)
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{path}: expected a list of {type_name(arg)}, found {found(value)}")
            return tuple(self.convert(v, arg, f"{path}.{i}") for i, v in enumerate(value))
        if origin is tuple:
            args = typing.get_args(tp)
            if not isinstance(value, (list, tuple)) or len(value) != len(args):
                raise ConfigError(f"{path}: expected {type_name(tp)}, found {found(value)}")
            return tuple(self.convert(v, a, f"{path}.{i}") for i, (v, a) in enumerate(zip(value, args)))
        if origin is list:
            (arg,) = typing.get_args(tp)
            if isinstance(value, str) and arg is str:  # a single glob is a list of one
                return [value]
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{path}: expected {type_name(tp)}, found {found(value)}")
            return [self.convert(v, arg, f"{path}.{i}") for i, v in enumerate(value)]
        if tp is dict:
            if value is None:
                return {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}: expected a mapping, found {found(value)}")
            return dict(value)
        if tp is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{path}: expected true or false, found {found(value)}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                    return int(value)  # 1e4 in YAML
                raise ConfigError(f"{path}: expected an integer, found {found(value)}")
            return value
        if tp is float:
            if isinstance(value, bool):
                raise ConfigError(f"{path}: expected a number, found {found(value)}")
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}: expected a number, found {found(value)}")
        if tp is str:
            if not isinstance(value, str):
                raise ConfigError(f"{path}: expected a string, found {found(value)}")
            return value
        raise TypeError(f"config schema: unsupported annotation {tp!r} at {path}")  # a bug in the schema

    def from_mapping(self, cls: type, data: Any, path: str) -> Any:
        """``data`` (a mapping or ``None``) as an instance of the attrs class ``cls`` found at ``path``."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or '<top level>'}: expected a mapping, found {found(data)}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in attrs.fields(cls)}
        open_field = self.open_fields.get(cls)
        allowed = [n for n in fields if n != open_field]
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"{join(path, key)}: keys must be strings, found {found(key)}")
            if key not in allowed:
                if open_field is not None:
                    extra[key] = value
                    continue
                raise ConfigError(self.unknown_key_message(path, key, allowed))
            kwargs[key] = self.convert(value, hints[key], join(path, key))
        if open_field is not None:
            kwargs[open_field] = extra
        return cls(**kwargs)
