"""The examples in docs/schedules.md run, and the bench script writes its JSON (the docstring examples of
hpfunc.schedules run as doctests: ``--doctest-modules`` in pyproject.toml)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "schedules.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_doc_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(python_blocks()[index], f"{DOC}:block{index}", "exec"), {"__name__": "__doc_example__"})


def test_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_schedules", ROOT / "bench" / "schedules.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "schedules.json"
    assert bench.main(["--out", str(out), "--p", "2", "4"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * (4 * 6 + 3)  # 6 schedules x 4 values of m, DualPipeV for m >= 2p
    # every mismatch with docs/reference.md#pipeline-schedules is one of the small-m rows explained
    # in docs/schedules.md
    for row in rows:
        if not row["matches"]:
            assert row["m"] == row["p"] and row["schedule"] in ("interleaved_1f1b", "zb_h2", "zbv"), row
    assert "48/54 rows match" in capsys.readouterr().out
