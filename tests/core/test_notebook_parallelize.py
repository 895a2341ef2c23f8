"""The parallelize notebook runs top to bottom: a 2x2 mesh equals one device, step by step."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "parallelize.ipynb"


@pytest.mark.slow
@pytest.mark.multirank
def test_parallelize_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    text = "\n".join("".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                             for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code")
    assert "3 steps on a 2x2 mesh equal one device" in text
    assert "MiB sent per rank per step" in text
