"""Collection of the docstring examples under hpfunc/ (``--doctest-modules``, see pyproject.toml).

Only modules under hpfunc/ are searched for examples (not the test files). A module that imports a
package of an optional extra (``hpfunc.testing.strategies`` needs ``hypothesis`` from ``[test]``) is
skipped, with the package and the install command as the reason, when that package is not
installed. Any other import error stays a collection error.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from _pytest.doctest import DoctestModule  # not exported by pytest; the class --doctest-modules collects with

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "hpfunc"


def _optional_packages() -> dict[str, str]:
    """Import name -> extra, for every requirement of ``[project.optional-dependencies]``."""
    pairs: list[tuple[str, str]] = []
    if sys.version_info >= (3, 11):
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        pairs = [(req, extra) for extra, reqs in extras.items() for req in reqs]
    else:  # no tomllib on Python 3.10: the installed distribution's metadata says the same
        from importlib.metadata import requires

        for req in requires("hpfunc") or []:
            marker = re.search(r"extra\s*==\s*[\"']([^\"']+)", req)
            if marker:
                pairs.append((req, marker.group(1)))
    out: dict[str, str] = {}
    for req, extra in pairs:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        out.setdefault(name.lower().replace("-", "_"), extra)
    return out


OPTIONAL = _optional_packages()


def _module_name(path: Path) -> str:
    parts = [path.stem] if path.name != "__init__.py" else []
    parent = path.parent
    while (parent / "__init__.py").exists():
        parts.insert(0, parent.name)
        parent = parent.parent
    return ".".join(parts)


def _lineno(err: BaseException, path: Path) -> int:
    """The line of ``path`` that ran the failed import (0 where the traceback does not pass through it)."""
    line, tb = 0, err.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@pytest.hookimpl(tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport | None:
    if not isinstance(collector, DoctestModule):
        return None
    if not collector.path.is_relative_to(PACKAGE):
        # Test files hold no doctests: not importing them a second time for it keeps each of their import
        # errors reported once (by their test module).
        return pytest.CollectReport(collector.nodeid, "passed", None, [])
    name = _module_name(collector.path)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing in OPTIONAL:
            extra = OPTIONAL[missing]
            reason = (f"Skipped: doctests of {name} not run: it needs {missing!r}, from the optional extra "
                      f"[{extra}], which is not installed (pip install -e \".[{extra}]\")")
            where = (str(collector.path), _lineno(err, collector.path), reason)
            return pytest.CollectReport(collector.nodeid, "skipped", where, [])
    except Exception:
        pass  # pytest's own import reports it as a collection error
    return None


@pytest.fixture(scope="session")
def optional_packages() -> dict[str, str]:
    """Import name -> the optional extra that brings it (pyproject.toml's ``[project.optional-dependencies]``)."""
    return dict(OPTIONAL)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything collection made (the imported modules, hundreds of thousands of objects that
    live for the whole run) out of the collector's reach: each later automatic full collection then
    walks only what the tests make (``gc.freeze``; nothing that becomes unreachable is kept by it)."""
    import gc

    gc.collect()
    gc.freeze()
