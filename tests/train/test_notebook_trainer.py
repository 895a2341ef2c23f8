"""The trainer notebook runs top to bottom: the tiny MoE trains through ``Trainer`` with callbacks, and the
MoE monitor's heat map and the per-layer norms are plotted inline."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "trainer.ipynb"


@pytest.mark.slow
def test_trainer_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "trained 20 steps: loss" in text
    assert "validation loss after 10 steps:" in text  # the run driven a piece at a time
    assert "step 20: loss" in text  # the notebook's own callback
    assert "the squares of 5 group norms sum to the global norm squared" in text
    assert "20 per-step lines; the mean of steps 2-5 equals metrics.jsonl's step-5 loss" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # the heat map and the norms, inline
