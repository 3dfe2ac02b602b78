"""The example notebook runs top to bottom in a fresh kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3").execute(cwd=str(NOTEBOOK.parent))
    outputs = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    # The plan printout, the policy estimates, a drawn figure and the final loss all appeared.
    assert "tokens per CP rank" in outputs
    assert "skrull" in outputs and "static" in outputs
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )
    loss_line = [line for line in outputs.splitlines() if line.startswith("train_loss")]
    assert loss_line and 0.0 < float(loss_line[-1].split()[1]) < 10.0
