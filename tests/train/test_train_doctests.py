"""The docstring examples of hpfunc.train run (the loop's trains two tiny steps)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["__init__", "config", "build", "data", "step", "output", "loop", "parallel", "sample", "cli"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module("hpfunc.train" + ("" if name == "__init__" else f".{name}"))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
