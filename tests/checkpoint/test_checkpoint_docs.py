"""The runnable example of docs/checkpoint.md (save on fsdp 4, restore on fsdp 2 and step on) runs on the
session's gloo ranks and prints that the next step's loss agrees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoint.md"

pytestmark = pytest.mark.multirank


def test_checkpoint_example_runs(pools, monkeypatch, capsys):
    import hpfunc.launch

    real = hpfunc.launch.spmd
    # the example calls spmd(fn, n, ...); give it the session's running ranks instead of new ones
    monkeypatch.setattr(hpfunc.launch, "spmd", lambda fn, n, *a, **k: real(fn, n, *a, pool=pools(n), **k))
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "spmd(restore_and_step" in b]
    assert len(blocks) == 1, "docs/checkpoint.md lost its runnable example"
    exec(compile(blocks[0], f"{DOC}:example", "exec"), {"__name__": "__doc_example__"})
    assert "the next step's loss is the 4-rank run's" in capsys.readouterr().out
