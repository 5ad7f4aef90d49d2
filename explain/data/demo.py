"""The small model that the package ships: a CNN trained on ``explain.data.synthetic`` images.

Its layers are named like a torchvision ResNet (``stem``, ``layer1`` … ``layer4``,
``avgpool``, ``fc``), so ``GradCAM(model, "layer4")`` works on it as on a ResNet.
Inputs: (N, 3, 64, 64) RGB in [0, 1] normalised with ImageNet mean/std (the
toolkit's default preprocess). The weights are made by ``python -m explain.data.train``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from .synthetic import CLASS_NAMES

WEIGHTS_PATH = Path(__file__).with_name("demo_model.pt")


def _conv_block(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class DemoNet(nn.Module):
    """A small CNN for 64×64 images: 16×16 feature maps at ``layer2``-``layer4``, global
    average pooling and a linear head (so Grad-CAM at ``layer4`` is the classic CAM)."""

    def __init__(self, num_classes: int = len(CLASS_NAMES)):
        super().__init__()
        self.stem = _conv_block(3, 32)
        self.layer1 = nn.Sequential(nn.MaxPool2d(2), _conv_block(32, 48))
        self.layer2 = nn.Sequential(nn.MaxPool2d(2), _conv_block(48, 64))
        self.layer3 = _conv_block(64, 64)
        self.layer4 = _conv_block(64, 64)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def save_half_weights(model: nn.Module, path: Path | str) -> None:
    """Write ``model``'s state dict with its floating-point tensors in float16 (the shipped weights' format)."""
    torch.save({name: value.half() if value.is_floating_point() else value
                for name, value in model.state_dict().items()}, path)


def load_weights(model: ModuleT, path: Path | str, what: str, script: str) -> ModuleT:
    """``model`` with the shipped weights at ``path`` (float16 ones read as float32), in eval mode, on the CPU; a
    missing file is a FileNotFoundError naming ``what`` and the ``python -m`` ``script`` that recreates it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}'s weights are missing at {path}; recreate them with `python -m {script}`.")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({name: value.float() if value.is_floating_point() else value
                           for name, value in state.items()})
    return model.eval()


def load_demo_model(path: Path | str = WEIGHTS_PATH) -> DemoNet:
    """The trained demo model, in eval mode, on the CPU."""
    return load_weights(DemoNet(), path, "the demo model", "explain.data.train")
