"""``import hpfunc`` stays light (transforms and subpackages load on first use), the lazy names still
resolve, and the notebook path (``hpfunc.launch``, ``hpfunc.testing``) works without the test extra.

Each check runs in a fresh interpreter: this process has long imported everything."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Nothing under these prefixes may be loaded by a bare `import hpfunc`.
HEAVY_PREFIXES = ("hpfunc.transforms", "hpfunc.schedules", "hpfunc.models", "hpfunc.optim", "hpfunc.train",
                  "transformers", "matplotlib")


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def import_chains(importtime_log: str) -> dict[str, str]:
    """Module -> the chain of imports that loaded it, read from ``-X importtime``'s nesting."""
    chains: dict[str, str] = {}
    lines = [m for m in (re.match(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)", ln) for ln in importtime_log.splitlines())
             if m]
    # importtime prints a module after the modules it imported, one level deeper: read it backwards.
    stack: list[tuple[int, str]] = []
    for m in reversed(lines):
        depth, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        stack.append((depth, name))
        chains[name] = " -> ".join(n for _, n in stack)
    return chains


def test_import_hpfunc_loads_only_the_core() -> None:
    proc = python("import hpfunc, sys, json; print(json.dumps(sorted(sys.modules)))")
    assert proc.returncode == 0, f"`import hpfunc` failed in a fresh interpreter:\n{proc.stderr[-4000:]}"
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    heavy = [m for m in loaded if m.startswith(HEAVY_PREFIXES)]
    chains = import_chains(proc.stderr)
    assert not heavy, (
        "`import hpfunc` loaded modules that must load only on first use:\n"
        + "\n".join(f"  {m}  (imported via {chains.get(m, '?')})" for m in heavy)
        + "\nfix: import them lazily (hpfunc/__init__.py's _LAZY_ATTRS / _LAZY_SUBMODULES, or inside the "
        "function that needs them) instead of at the top of a core module")


LAZY_ATTRS = {
    "shard_map": "hpfunc.transforms.shard_map", "ReplicationError": "hpfunc.transforms.shard_map",
    "remat": "hpfunc.transforms.remat", "checkpoint_name": "hpfunc.transforms.remat",
    "checkpoint_policies": "hpfunc.transforms.remat", "offload": "hpfunc.transforms.offload",
    "pipeline_map": "hpfunc.transforms.pipeline", "PipelineError": "hpfunc.transforms.pipeline",
    "parallelize": "hpfunc.transforms.parallelize", "parallel_train_step": "hpfunc.transforms.parallelize",
    "init_sharded": "hpfunc.transforms.parallelize",
}
LAZY_SUBMODULES = ["optim", "models", "schedules", "transforms", "train", "testing", "launch", "memory", "layout",
                   "saved_tensors"]

CHECK_NAMES = """
import importlib, json, sys, traceback
import hpfunc
expected = json.loads(sys.argv[1])
problems = []
for name, module in expected["attrs"].items():
    try:
        got = getattr(hpfunc, name)
        want = getattr(importlib.import_module(module), name)
        if got is not want:
            problems.append(f"hpfunc.{name} is {got!r}, expected {module}.{name}")
    except Exception:
        problems.append(f"hpfunc.{name} (from {module}) does not resolve:\\n" + traceback.format_exc(limit=-3))
for name in expected["submodules"]:
    try:
        got = getattr(hpfunc, name)
        if got is not importlib.import_module("hpfunc." + name):
            problems.append(f"hpfunc.{name} is {got!r}, expected the module hpfunc.{name}")
    except Exception:
        problems.append(f"hpfunc.{name} does not resolve:\\n" + traceback.format_exc(limit=-3))
missing_dir = sorted((set(expected["attrs"]) | set(expected["submodules"])) - set(dir(hpfunc)))
if missing_dir:
    problems.append(f"dir(hpfunc) lacks {missing_dir}")
unresolved_all = [n for n in hpfunc.__all__ if n not in dir(hpfunc)]
if unresolved_all:
    problems.append(f"hpfunc.__all__ names {unresolved_all}, which dir(hpfunc) does not list")
try:
    hpfunc.no_such_name
    problems.append("hpfunc.no_such_name resolved; expected AttributeError")
except AttributeError as err:
    if "no_such_name" not in str(err):
        problems.append(f"AttributeError for hpfunc.no_such_name does not name it: {err}")
print(json.dumps(problems))
"""


def _check_names(attrs: dict[str, str], submodules: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", CHECK_NAMES, json.dumps({"attrs": attrs, "submodules": submodules})],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lazy_transforms_resolve() -> None:
    problems = _check_names(LAZY_ATTRS, [])
    assert not problems, "lazy names of hpfunc (hpfunc/__init__.py _LAZY_ATTRS):\n" + "\n".join(problems)


@pytest.mark.parametrize("name", LAZY_SUBMODULES)
def test_lazy_submodule_resolves(name: str) -> None:
    problems = _check_names({}, [name])
    assert not problems, "\n".join(problems)


def test_advertised_names_exist() -> None:
    import hpfunc

    for name in sorted(hpfunc._LAZY_SUBMODULES):
        assert (ROOT / "hpfunc" / name / "__init__.py").is_file() or (ROOT / "hpfunc" / f"{name}.py").is_file(), (
            f"hpfunc advertises the submodule hpfunc.{name}, which does not exist: remove it from "
            "hpfunc/__init__.py's _LAZY_SUBMODULES")
    assert set(LAZY_SUBMODULES) <= set(hpfunc._LAZY_SUBMODULES), sorted(set(LAZY_SUBMODULES) - hpfunc._LAZY_SUBMODULES)
    for name, module in LAZY_ATTRS.items():
        assert hpfunc._LAZY_ATTRS.get(name) == module, (
            f"hpfunc.{name} should load from {module}; _LAZY_ATTRS says {hpfunc._LAZY_ATTRS.get(name)!r}")
        assert name in hpfunc.__all__, f"hpfunc.{name} is public: list it in hpfunc.__all__"


# Importing hypothesis (the [test] extra) fails in this interpreter, as on a machine without it.
NO_HYPOTHESIS = "import sys; sys.modules['hypothesis'] = None\n"


def test_notebook_path_works_without_hypothesis() -> None:
    proc = subprocess.run([sys.executable, "-c", NO_HYPOTHESIS + (
        "from hpfunc.launch import spmd\n"
        "from hpfunc.testing import RankPool, assert_trees_close, assert_parity\n"
        "import hpfunc.testing\n"
        "try:\n"
        "    from hpfunc.testing import strategies\n"
        "except ModuleNotFoundError as err:\n"
        "    print('strategies:', err.name, '|', err)\n"
        "else:\n"
        "    print('strategies imported although hypothesis cannot be')\n")],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (
        "without hypothesis, `from hpfunc.launch import spmd` / `from hpfunc.testing import RankPool` must work "
        f"(hpfunc.testing loads strategies only on use); got:\n{proc.stderr[-4000:]}")
    out = proc.stdout.strip()
    assert out.startswith("strategies: hypothesis |") and "pip install" in out, (
        f"`from hpfunc.testing import strategies` without hypothesis should raise ModuleNotFoundError naming "
        f"hypothesis and how to install it; got: {out!r}")


def test_testing_loads_hypothesis_only_for_strategies() -> None:
    proc = subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "from hpfunc.testing import RankPool, assert_trees_close\n"
        "print('hypothesis' in sys.modules)\n"
        "import hpfunc.testing\n"
        "from hpfunc.testing import strategies\n"
        "print(hpfunc.testing.strategies is strategies, 'strategies' in dir(hpfunc.testing), "
        "callable(strategies.mesh_shapes))\n")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["False", "True", "True", "True"], (
        f"expected hypothesis unloaded by RankPool and strategies importable on use; got {proc.stdout!r}")
