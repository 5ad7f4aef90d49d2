"""The README's Python examples run as written (on small stand-in models)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    image_path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image_path)
    (tmp_path / "images").mkdir()
    Image.open(image_path).save(tmp_path / "images" / "first.png")
    namespace = {
        "torch": torch,
        "model": torchvision.models.resnet18().eval(),
        "vit": torchvision.models.VisionTransformer(
            image_size=64, patch_size=16, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64
        ).eval(),
        "x": torch.randn(1, 3, 64, 64),
        "img": str(image_path),
        "dataloader": torch.utils.data.DataLoader(torch.randn(4, 3, 64, 64), batch_size=2),
    }
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
