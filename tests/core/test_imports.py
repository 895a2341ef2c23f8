"""The import graph of hpfunc, read from the source (ast, nothing imported): no import cycle between
hpfunc's modules, and the core, the memory reports, the models and the optimizers never import the
transforms or the trainer (they are the layers those are built on).

Edges: every ``import`` statement, including those inside functions, except under
``if TYPE_CHECKING:`` (never executed). ``import a.b`` is an edge to ``a.b`` (not to the parent
packages it implicitly imports); ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``; relative imports are resolved. Three lazy forms count too, as they load the module
when used: ``from hpfunc import remat`` (a name of ``hpfunc/__init__.py``'s ``_LAZY_ATTRS``) is an
edge to ``hpfunc.transforms.remat``, so is ``hpfunc.remat`` after ``import hpfunc``, and
``importlib.import_module("hpfunc.x")`` with a literal name is an edge to ``hpfunc.x``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from _source_modules import PACKAGE, SourceModule, source_modules

# The layers below the transforms and the trainer.
CORE = ("hpfunc.tree", "hpfunc.mesh", "hpfunc.sharding", "hpfunc.lax", "hpfunc.random", "hpfunc.autodiff",
        "hpfunc.comm", "hpfunc.microbatch", "hpfunc.saved_tensors", "hpfunc.durable")
CORE_PACKAGES = ("hpfunc.layout", "hpfunc.memory", "hpfunc.models", "hpfunc.optim")  # and all their submodules
UPPER_PACKAGES = ("hpfunc.transforms", "hpfunc.train")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # of the importing module, relative to the repository
    line: int
    how: str  # the statement, e.g. "from hpfunc.transforms import plans"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target} ({self.how})"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _lazy_attrs(modules: dict[str, SourceModule], root: str) -> dict[str, str]:
    """``_LAZY_ATTRS`` of the root package's ``__init__.py`` (a dict literal of name -> module), if any."""
    init = modules.get(root)
    if init is None:
        return {}
    for node in init.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "_LAZY_ATTRS" for t in targets) and isinstance(node.value, ast.Dict):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def import_edges(modules: dict[str, SourceModule], root: str = "hpfunc") -> list[Edge]:
    """Every import of a module of ``root`` by a module of ``root``."""
    lazy = _lazy_attrs(modules, root)
    edges: list[Edge] = []

    def inside(name: str) -> bool:
        return name == root or name.startswith(root + ".")

    for module in modules.values():
        package = module.name if module.is_package else module.name.rpartition(".")[0]
        root_aliases: set[str] = set()  # local names bound to the root package by `import hpfunc [as x]`

        def add(target: str, node: ast.AST, how: str) -> None:
            if inside(target) and target != module.name:
                edges.append(Edge(module.name, target, module.rel, node.lineno, how))

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    visit(child)
                return
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node, f"import {alias.name}")
                    if alias.name == root:
                        root_aliases.add(alias.asname or root)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                dots = "." * node.level
                for alias in node.names:
                    how = f"from {dots}{node.module or ''} import {alias.name}"
                    candidate = f"{parent}.{alias.name}"
                    if candidate in modules:
                        add(candidate, node, how)
                    elif parent == root and alias.name in lazy:
                        add(lazy[alias.name], node, how + f", lazily from {lazy[alias.name]}")
                    else:
                        add(parent, node, how)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in root_aliases and node.attr in lazy):
                add(lazy[node.attr], node, f"{node.value.id}.{node.attr}, lazily from {lazy[node.attr]}")
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str) and (
                      (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                      or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):
                add(node.args[0].value, node, f"import_module({node.args[0].value!r})")
            for child in ast.iter_child_nodes(node):
                visit(child)

        # Aliases first (an `import hpfunc` inside a function still binds the name there).
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                root_aliases.update(a.asname or root for a in node.names if a.name == root)
        visit(module.tree)
    return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges, in order) per strongly connected component that has one (Tarjan)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # iterative: the graph can be deep
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph[comp[0]]:
            continue
        # A shortest cycle through the component's first module (breadth-first inside the component).
        start = comp[0]
        previous: dict[str, Edge] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for u in frontier:
                for w, e in sorted(graph[u].items()):
                    if w == start:
                        found = e
                        break
                    if w in members and w not in previous:
                        previous[w] = e
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        path = [found]
        while path[0].source != start:
            path.insert(0, previous[path[0].source])
        cycles.append(path)
    return cycles


def layering_violations(edges: list[Edge]) -> list[Edge]:
    def under(name: str, packages: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    return [e for e in edges if (e.source in CORE or under(e.source, CORE_PACKAGES)) and under(e.target, UPPER_PACKAGES)]


def _hpfunc_edges() -> list[Edge]:
    return import_edges({m.name: m for m in source_modules(PACKAGE)})


def _describe(cycle: list[Edge]) -> str:
    modules = " -> ".join([e.source for e in cycle] + [cycle[0].source])
    return f"cycle {modules}:\n" + "\n".join(f"    {e}" for e in cycle)


def test_no_import_cycle_between_hpfunc_modules() -> None:
    cycles = find_cycles(_hpfunc_edges())
    assert not cycles, (
        f"{len(cycles)} import cycle(s) between hpfunc's modules (each: its modules, then the imports that close "
        f"it); break each by moving the shared piece into the lower module or importing at the point of use "
        f"from a module that does not import back:\n" + "\n".join(_describe(c) for c in cycles))


def test_core_models_and_optim_do_not_import_transforms_or_train() -> None:
    bad = layering_violations(_hpfunc_edges())
    assert not bad, (
        f"{len(bad)} import(s) from the core (hpfunc.{{tree, mesh, sharding, lax, random, autodiff, comm, "
        f"microbatch, saved_tensors, layout.*}}), hpfunc.models or hpfunc.optim of hpfunc.transforms / hpfunc.train, "
        f"which are built on them; move what is needed down (e.g. into hpfunc.layout) or invert the "
        f"dependency:\n" + "\n".join(f"    {e}" for e in bad))


# The walk itself, on a small package written here: it must see what it claims to see.

def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, SourceModule]:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {m.name: m for m in source_modules(tmp_path / "pkg")}


def test_the_walk_finds_cycles_relative_and_function_level_imports(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "__init__.py": "_LAZY_ATTRS = {'lazy_fn': 'pkg.sub.lazy'}\n",
        "a.py": "from pkg.sub import b\n",                   # a module: edge to pkg.sub.b
        "sub/__init__.py": "from .b import thing\n",          # relative: pkg.sub.b
        "sub/b.py": "def f():\n    from .. import a\n",     # inside a function, relative two levels: pkg.a
        "sub/lazy.py": "",
        "c.py": "from pkg.sub import thing\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "d.py": "import pkg.c\nfrom pkg import lazy_fn\n",
        "e.py": "import pkg\nimport importlib\nx = pkg.lazy_fn\ny = importlib.import_module('pkg.c')\n",
    })
    edges = import_edges(modules, root="pkg")
    got = {(e.source, e.target, e.line) for e in edges}
    assert got == {("pkg.a", "pkg.sub.b", 1), ("pkg.sub", "pkg.sub.b", 1), ("pkg.sub.b", "pkg.a", 2),
                   ("pkg.c", "pkg.sub", 1), ("pkg.d", "pkg.c", 1), ("pkg.d", "pkg.sub.lazy", 2),
                   ("pkg.e", "pkg", 1), ("pkg.e", "pkg.sub.lazy", 3), ("pkg.e", "pkg.c", 4)}, sorted(got)
    cycles = find_cycles(edges)
    assert [[e.source for e in c] for c in cycles] == [["pkg.a", "pkg.sub.b"]], cycles
    assert "cycle pkg.a -> pkg.sub.b -> pkg.a" in _describe(cycles[0])
    assert "pkg/sub/b.py:2: pkg.sub.b imports pkg.a (from .. import a)" in _describe(cycles[0])


def test_the_layering_rule_names_module_line_and_target() -> None:
    edges = [Edge("hpfunc.optim.adam", "hpfunc.transforms.plans", "hpfunc/optim/adam.py", 7, "from x import y"),
             Edge("hpfunc.layout.step", "hpfunc.train.loop", "hpfunc/layout/step.py", 3, "import hpfunc.train.loop"),
             Edge("hpfunc.transforms.remat", "hpfunc.train", "hpfunc/transforms/remat.py", 1, "import hpfunc.train"),
             Edge("hpfunc.lax", "hpfunc.transforms", "hpfunc/lax.py", 9, "import hpfunc.transforms"),
             Edge("hpfunc.models.moe", "hpfunc.layout", "hpfunc/models/moe.py", 30, "from hpfunc import layout")]
    bad = [str(e) for e in layering_violations(edges)]
    assert bad == ["hpfunc/optim/adam.py:7: hpfunc.optim.adam imports hpfunc.transforms.plans (from x import y)",
                   "hpfunc/layout/step.py:3: hpfunc.layout.step imports hpfunc.train.loop (import hpfunc.train.loop)",
                   "hpfunc/lax.py:9: hpfunc.lax imports hpfunc.transforms (import hpfunc.transforms)"], bad
