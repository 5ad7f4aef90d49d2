"""Every script in examples/ runs and writes what it says."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", str(tmp_path)])
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    assert np.asarray(Image.open(tmp_path / "quickstart.png")).shape == (64, 4 * 64, 3)
    assert (tmp_path / "quickstart.pdf").read_bytes().startswith(b"%PDF")
    assert capsys.readouterr().out.count(":") >= 4


# The scripts that draw the README's figures run when the documentation site is built: tests/test_docs.py
# compares what they draw with the committed figures.


def test_the_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs)  # the comparison figure
    # the Explanation of 4 images × 3 targets displays itself once: one picture, a table, a short text
    (explanation_cell,) = [cell for cell in notebook.cells if "topk=3" in cell.source]
    (display,) = explanation_cell.outputs
    assert set(display["data"]) == {"text/html", "text/plain"}
    assert display["data"]["text/html"].count("data:image/") == 1 and "<table>" in display["data"]["text/html"]
    assert display["data"]["text/plain"].startswith("Explanation(GradCAM @ layer4, 4 images × 3 targets")
    size = len(nbformat.writes(nbformat.v4.new_notebook(cells=[explanation_cell])).encode())
    assert size < 400_000, f"the cell's outputs take {size / 1000:.0f} kB"
