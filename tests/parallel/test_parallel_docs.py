"""The runnable example of docs/parallel.md (a layer of one's own that reads the layout seam) runs on the
session's 4 gloo ranks and prints that one device and the 2 x 2 mesh agree."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "parallel.md"

pytestmark = pytest.mark.multirank


def test_layout_seam_example_runs(pool4, monkeypatch, capsys):
    import hpfunc.launch

    # the example calls spmd(train, 4, ...); give it the session's running ranks instead of new ones
    monkeypatch.setattr(hpfunc.launch, "spmd", functools.partial(hpfunc.launch.spmd, pool=pool4))
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "spmd(train, 4" in b]
    assert len(blocks) == 1, "docs/parallel.md lost its runnable layout-seam example"
    exec(compile(blocks[0], f"{DOC}:layout-seam", "exec"), {"__name__": "__doc_example__"})
    assert "one device and a 2 x 2 mesh agree" in capsys.readouterr().out
