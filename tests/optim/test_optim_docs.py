"""The example in docs/optim.md runs and trains."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

from _optim_helpers import one_intra_op_thread  # noqa: F401 (autouse fixture)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "optim.md"


def test_docs_example_runs_and_lowers_the_loss():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/optim.md has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "docs_optim_example"})
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["['adamw', 'muon']", "30"], lines
    first, _, last = lines[0].removeprefix("loss ").partition(" -> ")
    assert float(last) < 0.5 * float(first), lines[0]
