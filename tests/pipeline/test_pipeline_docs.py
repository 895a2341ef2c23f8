"""The runnable example in docs/pipeline.md runs (on its own 2 gloo ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"


@pytest.mark.multirank
def test_doc_example_runs(pool2, monkeypatch, capsys):
    # The example calls spmd(train, 2); give it the session's running ranks instead of new ones.
    import functools

    import hpfunc.launch

    monkeypatch.setattr(hpfunc.launch, "spmd", functools.partial(hpfunc.launch.spmd, pool=pool2))
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], f"{DOC}:block0", "exec"), {"__name__": "__doc_example__"})
    assert "[(0, 3), (1, 2)]" in capsys.readouterr().out
