"""The modules under hpfunc/, read from their source files (nothing is imported)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpfunc"


@dataclass(frozen=True)
class SourceModule:
    name: str  # dotted: "hpfunc.transforms.remat"
    path: Path
    rel: str  # the path from the directory above the package: "hpfunc/transforms/remat.py"

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @cached_property
    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(), filename=str(self.path))


def source_modules(root: Path = PACKAGE) -> list[SourceModule]:
    """Every ``.py`` module of the package at ``root``, sorted by name."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root.parent)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(SourceModule(".".join(parts), path, rel.as_posix()))
    return out
