"""The small object detector that the package ships, trained on ``explain.data.detection_scenes``.

An anchor-free, FCOS-like one-stage detector: a backbone of six conv blocks (``features.0`` …
``features.5``, conv → BatchNorm → ReLU, strides 2, 2, 1, 2, 1, 1) turns an (N, 3, H, W) image into an
(N, 64, H / 8, W / 8) feature grid; a head block (``head``) and two 1×1 convolutions give per grid cell four
class logits (``classifier``) and four distances (``regressor``) from the cell's centre to the box's left,
top, right and bottom sides. No NMS, no thresholds: every cell proposes one box with a score per class.
Grad-CAM's layer is ``features.5`` (the last backbone stage, 12×12 cells at 96 px). Inputs: (N, 3, H, W) RGB in
[0, 1] normalised with ``DETECTOR_MEAN`` / ``DETECTOR_STD`` (ImageNet's, the toolkit's default preprocess and
``explain.data.train.to_model_input``), H and W multiples of 8 (96 px as trained). The weights are made by
``python -m explain.data.train_detector`` (stored in float16, loaded as float32).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..io.inputs import IMAGENET_MEAN, IMAGENET_STD
from .demo import load_weights
from .detection_scenes import DETECTION_CLASS_NAMES

DETECTOR_WEIGHTS_PATH = Path(__file__).with_name("demo_detector.pt")
DETECTOR_MEAN = IMAGENET_MEAN
"""Per-channel mean (RGB, of images in [0, 1]) subtracted from the detector's input."""
DETECTOR_STD = IMAGENET_STD
"""Per-channel std (RGB) that the detector's input is divided by after the mean is subtracted."""
DETECTOR_STRIDE = 8
"""Pixels per feature-grid cell: cell (i, j) is centred at ((j + 0.5) · 8, (i + 0.5) · 8) px."""
DETECTOR_CAM_LAYER = "features.5"
"""The layer to give Grad-CAM and the other CAMs: the last backbone stage, (N, 64, H / 8, W / 8)."""
MIN_DISTANCE = 0.5
"""Each box side lies at least this many pixels from its cell's centre, so that x0 < x1 and y0 < y1."""


def _conv_block(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


def cell_centres(height: int, width: int, device: torch.device | None = None, dtype: torch.dtype | None = None
                 ) -> Tensor:
    """(h · w, 2) pixel centres (x, y) of the cells of an (h, w) feature grid, row-major (as the output's P)."""
    rows = (torch.arange(height, device=device, dtype=dtype) + 0.5) * DETECTOR_STRIDE
    columns = (torch.arange(width, device=device, dtype=dtype) + 0.5) * DETECTOR_STRIDE
    y, x = torch.meshgrid(rows, columns, indexing="ij")
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)


class DemoDetector(nn.Module):
    """(N, 3, H, W) normalised images → ``{"boxes": (N, P, 4), "scores": (N, P, C)}``, P = (H / 8) · (W / 8)
    grid cells in row-major order, C = 4 classes (``DETECTION_CLASS_NAMES``).

    ``boxes[n, p]`` is (x0, y0, x1, y1) in input pixels (right and bottom exclusive, as the scenes' boxes), the box
    that cell p proposes: its centre minus / plus distances ≥ ``MIN_DISTANCE`` px, so it always contains the
    cell's centre. ``scores[n, p, c]`` in [0, 1] is the sigmoid of cell p's logit for class c (independent per
    class, not a softmax). Differentiable with respect to the input; no NMS or thresholding (post-processing
    is the caller's)."""

    def __init__(self, num_classes: int = len(DETECTION_CLASS_NAMES)):
        super().__init__()
        self.features = nn.Sequential(
            _conv_block(3, 16, stride=2),
            _conv_block(16, 32, stride=2),
            _conv_block(32, 32),
            _conv_block(32, 64, stride=2),
            _conv_block(64, 64),
            _conv_block(64, 64),
        )
        self.head = _conv_block(64, 64)
        self.classifier = nn.Conv2d(64, num_classes, 1)
        self.regressor = nn.Conv2d(64, 4, 1)

    def forward_logits(self, x: Tensor) -> dict[str, Tensor]:
        """As ``forward`` with ``"logits"`` (N, P, C), the class scores before the sigmoid, for ``"scores"``."""
        if x.ndim != 4 or x.shape[1] != 3 or x.shape[2] % DETECTOR_STRIDE or x.shape[3] % DETECTOR_STRIDE:
            raise ValueError(f"the demo detector takes (N, 3, H, W) images with H and W multiples of "
                             f"{DETECTOR_STRIDE} (96×96 as trained); got shape {tuple(x.shape)}. Resize or pad "
                             f"the images.")
        hidden = self.head(self.features(x))
        height, width = hidden.shape[-2:]
        logits = self.classifier(hidden).flatten(2).transpose(1, 2)  # (N, P, C)
        distances = F.softplus(self.regressor(hidden).flatten(2).transpose(1, 2)) * DETECTOR_STRIDE + MIN_DISTANCE
        centres = cell_centres(height, width, x.device, distances.dtype).repeat(1, 2)  # (P, 4): x, y, x, y
        signs = torch.tensor([-1.0, -1.0, 1.0, 1.0], device=x.device, dtype=distances.dtype)
        return {"boxes": centres + signs * distances, "logits": logits}

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        outputs = self.forward_logits(x)
        return {"boxes": outputs["boxes"], "scores": torch.sigmoid(outputs["logits"])}


def load_demo_detector(path: Path | str = DETECTOR_WEIGHTS_PATH) -> DemoDetector:
    """The trained demo detector, in eval mode, on the CPU."""
    return load_weights(DemoDetector(), path, "the demo detector", "explain.data.train_detector")
