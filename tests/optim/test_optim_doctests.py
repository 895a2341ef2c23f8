"""The examples in hpfunc.optim's docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import hpfunc.optim

MODULES = sorted(
    name for _, name, _ in pkgutil.iter_modules(hpfunc.optim.__path__, "hpfunc.optim.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"
