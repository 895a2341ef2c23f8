"""The runnable examples in docs/pipeline.md run (on the session's 2 gloo ranks): the front door's
pipelined step equals one device, and pipeline_map's V placement."""

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
    assert len(blocks) == 2
    exec(compile(blocks[0], f"{DOC}:block0", "exec"), {"__name__": "__doc_example__"})
    printed = capsys.readouterr().out.strip().rsplit("] ", 1)
    ranks, one = [float(x) for x in printed[0].strip("[").split(",")], float(printed[1])
    assert ranks == [ranks[0]] * 2 and abs(ranks[0] - one) <= 1e-4 * abs(one), printed
    exec(compile(blocks[1], f"{DOC}:block1", "exec"), {"__name__": "__doc_example__"})
    assert "[(0, 3), (1, 2)]" in capsys.readouterr().out
