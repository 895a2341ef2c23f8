"""The fenced ``python`` blocks of README.md and docs/*.md, and how each one runs.

A block's first line may say how it runs:

* ``# ranks: N``: a program for N ranks (it builds its own mesh); run on a pool of N gloo ranks;
* ``# fragment: <where the page's full example is>``: a piece of a larger example on the same page,
  not run on its own (the full example it names is).

Any other block runs in one process, in a namespace shared with the page's earlier one-process blocks
(a page's blocks read as one session), in a temporary folder.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str  # "docs/parallel.md"
    line: int  # the line of the fence
    code: str

    @property
    def ranks(self) -> int:
        m = re.match(r"#\s*ranks:\s*(\d+)", self.code)
        return int(m.group(1)) if m else 1

    @property
    def fragment(self) -> bool:
        return re.match(r"#\s*fragment:", self.code) is not None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(str(page.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in _FENCE.finditer(text)]


def run_block(code: str, name: str) -> str:
    """Run ``code`` in a fresh namespace in a temporary folder (a rank of a pool calls this); ``"ok"``."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(old)
    return "ok"
