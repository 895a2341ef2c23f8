"""The docs/remat.md examples run and print what the guide says they print."""

from __future__ import annotations

import contextlib
import io
import os
import re

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "remat.md")


def blocks() -> list[str]:
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_every_example_prints_its_comments():
    found = blocks()
    assert len(found) >= 2, "docs/remat.md lost its examples"
    for i, code in enumerate(found):
        # the expected output is the block's trailing run of comment lines, each "# <printed line>"
        lines = code.rstrip().splitlines()
        expected = []
        while lines and lines[-1].startswith("# "):
            expected.insert(0, lines.pop()[2:])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/remat.md[{i}]", "exec"), {})
        assert out.getvalue().splitlines() == expected, f"example {i}"
