"""The one error of the config package, and how its messages show a value.

    >>> found(3), found("adam"), found(None), found([1, 2])
    ('integer 3', "string 'adam'", 'null', 'list [1, 2]')
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ConfigError", "found", "flow"]


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type or an invalid value. The message names its path."""

    # shown (and pickled between ranks) under the package users import it from
    __module__ = "hpfunc.train.config"


def found(value: Any) -> str:
    """``value`` as an error message says what was found: its YAML kind and its value."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )
    return "null" if value is None else f"{kind} {value!r}"


def flow(mesh: Mapping[str, int]) -> str:
    """A mesh as written in YAML's flow style: ``{fsdp: 2, tp: 2}``.

    >>> flow({"fsdp": 2, "tp": 2})
    '{fsdp: 2, tp: 2}'
    """
    return "{" + ", ".join(f"{a}: {s}" for a, s in mesh.items()) + "}"
