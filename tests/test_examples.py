"""Every script in examples/ runs and writes what it says."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
from PIL import Image

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", str(tmp_path)])
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    assert np.asarray(Image.open(tmp_path / "quickstart.png")).shape == (64, 4 * 64, 3)
    assert (tmp_path / "quickstart.pdf").read_bytes().startswith(b"%PDF")
    assert capsys.readouterr().out.count(":") >= 4
