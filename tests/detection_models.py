"""Small detectors of every family explain reads, built with random weights (never downloaded), and each family's
output decoded independently of explain (from the libraries' documented formats), for by-hand references."""

from __future__ import annotations

import os

import pytest
import torch
import torchvision
from torch import nn

os.environ.setdefault("YOLO_OFFLINE", "1")


class SmallDetector(nn.Module):
    """A detector returning {"boxes": (N, P, 4), "scores": (N, P, C)}: one candidate per cell of a stride-4 grid,
    boxes centred on the cell (sizes from the features), sigmoid class scores; dropout and BatchNorm so that modes
    matter."""

    def __init__(self, classes: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.dropout = nn.Dropout(0.2)
        self.classify = nn.Conv2d(16, classes, 1)
        self.size = nn.Conv2d(16, 2, 1)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.dropout(self.features(images))
        rows, cols = features.shape[-2:]
        stride_y, stride_x = images.shape[-2] / rows, images.shape[-1] / cols
        y, x = torch.meshgrid(torch.arange(rows, device=images.device), torch.arange(cols, device=images.device),
                              indexing="ij")
        centres = torch.stack([(x + 0.5) * stride_x, (y + 0.5) * stride_y]).flatten(1).T  # (P, 2)
        sizes = (nn.functional.softplus(self.size(features)) * 8 + 4).flatten(2).transpose(1, 2)  # (N, P, 2)
        boxes = torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)
        scores = self.classify(features).sigmoid().flatten(2).transpose(1, 2)
        return {"boxes": boxes, "scores": scores}


def faster_rcnn() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=64, max_size=64, box_score_thresh=0.0).eval()


def retinanet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=64, max_size=64, score_thresh=0.0).eval()


def _detr_style(config_name: str, model_name: str) -> nn.Module:
    """A tiny DETR-style detector of transformers (``config_name``, ``model_name``): a small ResNet backbone built
    from its config (no download), one encoder and one decoder layer, 10 queries, 3 classes; eval mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        use_timm_backbone=False, use_pretrained_backbone=False,
        backbone_config={"model_type": "resnet", "depths": [1, 1, 1, 1], "hidden_sizes": [8, 16, 32, 64],
                         "embedding_size": 8},
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=10, num_labels=3)
    return getattr(transformers, model_name)(config).eval()


def detr() -> nn.Module:
    return _detr_style("DetrConfig", "DetrForObjectDetection")


def conditional_detr() -> nn.Module:
    return _detr_style("ConditionalDetrConfig", "ConditionalDetrForObjectDetection")


def rt_detr() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    backbone = transformers.RTDetrResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], embedding_size=16,
                                               layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    config = transformers.RTDetrConfig(
        backbone_config=backbone, encoder_in_channels=[32, 64, 128], encoder_hidden_dim=32, d_model=32,
        encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_layers=1, encoder_layers=1, num_queries=10, num_labels=3,
        decoder_in_channels=[32, 32, 32], encoder_attention_heads=2, decoder_attention_heads=2, num_denoising=0,
        initializer_range=0.1)
    model = transformers.RTDetrForObjectDetection(config).eval()
    # transformers draws batch-norm scales from N(0, initializer_range) (0.01 by default) and so does every
    # convolution: a dozen such layers leave the scores depending on the image by gradients of ~1e-8, rounding's
    # size. Wider weights and unit scales, as a trained model has, give gradients a by-hand check can see.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)) and module.weight is not None:
                module.weight.fill_(1.0)
    return model


def yolo(version: str = "yolov8n") -> nn.Module:
    tasks = pytest.importorskip("ultralytics.nn.tasks")
    torch.manual_seed(0)
    return tasks.DetectionModel(f"{version}.yaml", nc=3, verbose=False).eval()


DETECTORS = {
    "small": (lambda: SmallDetector().eval(), "features.4"),
    "faster_rcnn": (faster_rcnn, "backbone.body.16"),
    "retinanet": (retinanet, "backbone.body.layer4"),
    "detr": (detr, "model.backbone.model.encoder.stages.3"),
    "rt_detr": (rt_detr, "model.backbone.model.encoder.stages.3"),
    "yolov8n": (lambda: yolo("yolov8n"), "model.9"),
    "yolo11n": (lambda: yolo("yolo11n"), "model.9"),
}
"""name → (builder, a layer for the CAMs)."""


def xyxy(centre_size: torch.Tensor) -> torch.Tensor:
    x, y, width, height = centre_size.unbind(-1)
    return torch.stack([x - width / 2, y - height / 2, x + width / 2, y + height / 2], dim=-1)


def decoded(name: str, model: nn.Module, output, size: tuple[int, int]):
    """The test's own reading of a family's output, image 0 only: boxes (P, 4) xyxy in pixels, the class scores
    explained (P, C), the class vector of D-RISE's cosine (P, C') and the objectness (P,)."""
    if name == "small":
        scores = output["scores"][0]
        return output["boxes"][0], scores, scores, scores.max(dim=-1).values
    if name in ("faster_rcnn", "retinanet"):
        detections = output[0]
        classes = 4
        one_hot = torch.zeros(len(detections["scores"]), classes)
        one_hot[torch.arange(len(detections["scores"])), detections["labels"]] = 1
        scores = one_hot * detections["scores"][:, None]
        return detections["boxes"], scores, scores, detections["scores"]
    if name in ("detr", "rt_detr"):
        height, width = size
        boxes = xyxy(output.pred_boxes[0]) * output.pred_boxes.new_tensor([width, height, width, height])
        logits = output.logits[0]
        if name == "detr":  # softmax with a last no-object class
            probabilities = logits.softmax(-1)
            return boxes, probabilities[:, :-1], probabilities, torch.ones(len(boxes))
        scores = logits.sigmoid()
        return boxes, scores, scores, scores.max(dim=-1).values
    raw = output[0][0].T  # YOLO: (A, 4 + C), centre x, y, width, height in pixels, sigmoid scores
    scores = raw[:, 4:]
    return xyxy(raw[:, :4]), scores, scores, scores.max(dim=-1).values
