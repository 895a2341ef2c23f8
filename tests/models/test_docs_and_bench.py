"""The docs/models.md example runs, and the model_step bench runs end to end on a tiny model (the docstring
examples of hpfunc.models run as doctests: ``--doctest-modules`` in pyproject.toml)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

def test_models_guide_example_runs() -> None:
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "models.md")
    with open(path) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    exec(compile(code, "docs/models.md", "exec"), {})


def test_model_step_bench_smoke(tmp_path) -> None:
    pytest.importorskip("transformers")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "model_step.py")
    spec = importlib.util.spec_from_file_location("model_step_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    result = bench.main(["--preset", "qwen3-moe-tiny", "--batch", "1", "--seq", "16", "--warmup", "0",
                         "--iters", "1", "--compile", "eager", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ratio"] == result["ratio"] > 0
    assert abs(saved["loss_hpfunc"] - saved["loss_transformers"]) < 1e-4
    assert saved["compiled"]["rel_loss_diff"] < 1e-5 and saved["compiled"]["graphs_after_first_step"] == 0
