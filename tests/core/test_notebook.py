"""The research-notebook tour runs top to bottom (it starts its own CPU ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "shard_map.ipynb"


@pytest.mark.slow
@pytest.mark.multirank
def test_shard_map_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = ["".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for o in c.get("outputs", []))
               for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(outputs)
    assert "f32[8@dp,4@tp]" in text and "f32[8@(dp,tp),4]" in text
    assert "('f32[8@dp,3]', True, 'f32[8,6]')" in text
    assert "('f32[6@dp,4@tp]', True)" in text
