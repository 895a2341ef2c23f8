"""Every docstring example under hpfunc/ runs in the suite: ``python -m pytest`` collects them
(``--doctest-modules`` and ``testpaths`` in pyproject.toml), and doctest finds every docstring that
has examples, so none stops running silently (a decorator that drops ``__doc__`` or
``functools.wraps``, a docstring moved where doctest does not look, a module left out of testpaths)."""

from __future__ import annotations

import ast
import doctest
import importlib
import re

import pytest
from _source_modules import ROOT, SourceModule, source_modules

PROMPT = re.compile(r"^[ ]*>>>", re.M)  # doctest's PS1 line: one per example


def test_pytest_runs_the_package_doctests(pytestconfig: pytest.Config) -> None:
    fix = "set it in pyproject.toml [tool.pytest.ini_options]"
    assert pytestconfig.getoption("doctestmodules"), f"pytest runs without --doctest-modules in addopts: {fix}"
    testpaths = pytestconfig.getini("testpaths")
    assert "hpfunc" in testpaths, f"testpaths is {testpaths}, without 'hpfunc': `python -m pytest` skips its doctests; {fix}"
    flags = pytestconfig.getini("doctest_optionflags")
    for flag in ("ELLIPSIS", "NORMALIZE_WHITESPACE"):
        assert flag in flags, f"doctest_optionflags is {flags}, without {flag}: {fix}"


def documented_examples(module: SourceModule) -> dict[str, tuple[int, int]]:
    """doctest name -> (line, number of examples) of every docstring with examples that doctest should find:
    the module's, its top-level functions' and classes', and (recursively) their members'."""
    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, name: str, line: int) -> None:
        doc = ast.get_docstring(node, clean=False) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc and PROMPT.search(doc):
            found[name] = (line, len(PROMPT.findall(doc)))
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for child in node.body:
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{name}.{child.name}", child.lineno)

    visit(module.tree, module.name, 1)
    return found


MODULES = [m for m in source_modules() if PROMPT.search(m.path.read_text())]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_doctest_finds_every_example(module: SourceModule, optional_packages: dict[str, str]) -> None:
    expected = documented_examples(module)
    assert expected, (f"{module.rel} has '>>>' lines outside any docstring doctest reads (module, class, function, "
                      f"method): move the examples into a docstring")
    try:
        mod = importlib.import_module(module.name)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top not in optional_packages:
            raise
        pytest.skip(f"{module.name} needs {top!r} (extra [{optional_packages[top]}]), not installed")
    seen = {t.name: len(t.examples) for t in doctest.DocTestFinder().find(mod, module.name) if t.examples}
    problems = []
    for name, (line, count) in sorted(expected.items(), key=lambda kv: kv[1]):
        if name not in seen:
            problems.append(f"{module.rel}:{line}: the docstring of {name} has {count} example(s) that doctest does not "
                            f"find (is the object's __doc__ or __module__ not this module's? a decorator without "
                            f"functools.wraps, a name rebound to another object?)")
        elif seen[name] != count:
            problems.append(f"{module.rel}:{line}: {name}: {count} '>>>' lines in the source, doctest runs "
                            f"{seen[name]} (the runtime __doc__ differs from the source)")
    assert not problems, "\n".join(problems)
    assert sum(seen.values()) > 0, f"{module.rel}: doctest attempts no example, the source has {expected}"


def test_the_walk_sees_the_package() -> None:
    names = {m.name for m in source_modules()}
    assert {"hpfunc", "hpfunc.lax", "hpfunc.autodiff"} <= names, sorted(names)[:10]
    assert len(MODULES) >= 10, f"only {len(MODULES)} modules with examples found under {ROOT / 'hpfunc'}"
