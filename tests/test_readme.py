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


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a Markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


BLOCKS = python_blocks(README)


def example_namespace(folder: Path) -> dict:
    """The names the documentation's examples use: ``model`` (a resnet18), ``vit`` (a small
    torchvision ViT), ``x`` (a batch of one), ``img`` (a path to a 64 × 64 image), ``dataloader``;
    ``images/`` holds one image. Matplotlib draws off-screen."""
    matplotlib.use("Agg")
    torch.manual_seed(0)
    image_path = folder / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image_path)
    (folder / "images").mkdir(exist_ok=True)
    Image.open(image_path).save(folder / "images" / "first.png")
    return {
        "torch": torch,
        "model": torchvision.models.resnet18().eval(),
        "vit": torchvision.models.VisionTransformer(
            image_size=64, patch_size=16, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64
        ).eval(),
        "x": torch.randn(1, 3, 64, 64),
        "img": str(image_path),
        "dataloader": torch.utils.data.DataLoader(torch.randn(4, 3, 64, 64), batch_size=2),
    }


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), example_namespace(tmp_path))
