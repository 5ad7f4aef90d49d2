"""Session 12: an image's map does not depend on the other images of its call, on their order, on how many rows a
pass runs (``batch_size``-like options) nor on how its targets are given (one per image, top-k). Every registered
method is swept on a tiny CNN (eval mode, BatchNorm with running statistics) and a tiny timm ViT, random weights,
in float64, where batched and unbatched arithmetic agree to rounding (in float32 the batched matrix products round
differently: Ablation-CAM's score differences then differ by up to 3e-5 of the map's maximum); the maps come back
in float32, so they agree to a few of its roundings."""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

import explain
from explain.methods.registry import REGISTRY

TARGETS = [0, 3, 1]
ORDER = [2, 0, 1]
DETECTION = ("drise", "odam")
ATTENTION = ("attentionrollout", "attnlrprollout", "gradientrollout", "legrad", "transformerattribution")
FEWER = {  # fewer steps and samples than the defaults: the sweep stays fast
    "integratedgradients": {"steps": 4}, "blurig": {"steps": 4}, "guidedig": {"steps": 4},
    "layerconductance": {"steps": 4}, "layerintegratedgradients": {"steps": 4}, "gradientshap": {"samples": 3},
    "smoothgrad": {"samples": 3}, "smoothgrad_sq": {"samples": 3}, "vargrad": {"samples": 3},
    "smoothgradcam++": {"samples": 3}, "sscam": {"samples": 2}, "iscam": {"steps": 3}, "xrai": {"steps": 4},
    "sess": {"num_scales": 2},
}
CHUNKS = ("batch_size", "replay_batch_size")
"""The options that set how many rows a pass runs."""


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 4, 3, padding=1), bn1=nn.BatchNorm2d(4), relu1=nn.ReLU(),
        conv2=nn.Conv2d(4, 6, 3, padding=1), bn2=nn.BatchNorm2d(6), relu2=nn.ReLU(),
        pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), fc=nn.Linear(6, 5)))
    for norm in (model.bn1, model.bn2):  # running statistics far from a fresh module's
        assert isinstance(norm.running_mean, torch.Tensor) and isinstance(norm.running_var, torch.Tensor)
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
        nn.init.uniform_(norm.weight, 0.5, 1.5)
        nn.init.uniform_(norm.bias, -0.3, 0.3)
    return model.double().eval()


def vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, num_classes=5)
    nn.init.normal_(model.head.weight, std=0.5)  # timm zero-initialises an untrained head: every gradient is 0
    return model.double().eval()


MODELS = {"cnn": (cnn, "relu1", 12), "vit": (vit, "blocks.0", 32)}
"""Model, layer of the CAMs, image size. The CNN's layer is its first block: at the last one, before the average
pool and linear head, every gradient is the head's row whatever the input (noise would change no derivative); the
ViT's is its first block (the head reads the last block's class token alone: its patch tokens get no gradient)."""


def grid_regions(image: torch.Tensor) -> torch.Tensor:
    """XRAI's candidate regions: 4 × 4 pixel squares (the default Felzenszwalb segmenter, one image at a time, takes
    seconds per call; swept with it, the maps agree as closely)."""
    rows = torch.arange(image.shape[-2])[:, None] // 4
    return rows * 100 + torch.arange(image.shape[-1])[None, :] // 4


def explainer(name: str, model: nn.Module, layer: str, size: int, **extra: Any) -> explain.Explainer:
    cls = REGISTRY[name]
    parameters = inspect.signature(cls).parameters
    options: dict[str, Any] = {**FEWER.get(name, {}), **extra, "normalize": None, "progress": False}
    if "seed" in parameters:
        options["seed"] = 0
    if name == "deepliftshap":
        options["baselines"] = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(7),
                                          dtype=torch.float64)
    if name == "xrai":
        options["segmenter"] = grid_regions
    if "explainer" in parameters:
        return cls(model if name == "xrai" else explain.Saliency(model), **options)  # type: ignore[call-arg]
    if cls.needs_layer:
        return cls(model, "relu2" if name == "cam" else layer, **options)  # CAM: the layer the head averages  # type: ignore[call-arg]
    return cls(model, **options)  # type: ignore[call-arg]


def differences(name: str, kind: str) -> dict[str, float]:
    """The largest |difference| of each way of calling from the maps of [a, b, c] explained together (targets 0, 3,
    1), over the images, divided by the largest |value| of those maps: alone, in the order [c, a, b], with each
    chunking option at 1 and at 64, and topk=2 against each image alone with each of its two classes."""
    make, layer, size = MODELS[kind]
    model = make()
    images = torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    method = explainer(name, model, layer, size)
    together = method.explain(images, target=TARGETS).raw_maps
    scale = float(together.abs().max())
    assert scale > 0, "the premise: maps that are not zero everywhere"
    found = {"alone": max(float((together[index] - method.explain(images[index:index + 1],
                                                                  target=TARGETS[index]).raw_maps[0]).abs().max())
                          for index in range(3)),
             "order": float((together[ORDER] - method.explain(images[ORDER], target=[TARGETS[index] for index in ORDER])
                             .raw_maps).abs().max())}
    for option in CHUNKS:
        if option in inspect.signature(type(method)).parameters:
            for rows in (1, 64):
                chunked = explainer(name, model, layer, size, **{option: rows}).explain(images, target=TARGETS).raw_maps
                found[f"{option}={rows}"] = float((chunked - together).abs().max())
    top = method.explain(images, topk=2)
    found["topk"] = max(float((top.raw_maps[index, rank] - method.explain(
        images[index:index + 1], target=int(top.class_indices[index, rank])).raw_maps[0]).abs().max())
        for index in range(3) for rank in range(2))
    return {way: difference / scale for way, difference in found.items()}


CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name in sorted(REGISTRY) if name not in DETECTION
         for kind in MODELS
         if not (kind == "cnn" and name in ATTENTION) and not (kind == "vit" and name == "cam")]
# CAM reads a classifier over the layer's average (a ViT's head reads the class token); the attention methods need
# attention


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_an_image_gets_one_map_alone_in_any_batch_order_chunking_and_target_form(name: str, kind: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # un-normalised pixels, a random model's flat maps: not what is tested
        found = differences(name, kind)
    assert max(found.values()) < 1e-5, found  # the maps are float32 (Score-CAM sums its scores in it)


def test_smooth_grad_cam_plus_plus_seeded_noise_is_one_images_draw_shared_by_the_batch() -> None:
    """Before: the generator drew noise of the batch's shape, so an image got other draws in another batch (its map
    alone was up to 0.4 of the maximum away from its map in [a, b, c]). By hand: the same image's map with draws
    (1, C, H, W) given as noise_draws, broadcast to its batch."""
    model = cnn()
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    seeded = explain.SmoothGradCAMPlusPlus(model, "relu1", samples=3, noise_std=0.5, normalize=None, progress=False)
    together = seeded.explain(images, target=TARGETS).raw_maps
    generator = torch.Generator().manual_seed(0)
    draws = [torch.randn(1, 3, 16, 16, generator=generator) for _ in range(3)]
    for index in range(3):
        replayed = iter(draws)
        by_hand = explain.SmoothGradCAMPlusPlus(model, "relu1", samples=3, noise_std=0.5, normalize=None,
                                                noise_draws=lambda shape, drawn=replayed: next(drawn), progress=False)
        expected = by_hand.explain(images[index:index + 1], target=TARGETS[index]).raw_maps[0]
        torch.testing.assert_close(together[index], expected, rtol=1e-9, atol=1e-12)
        alone = seeded.explain(images[index:index + 1], target=TARGETS[index]).raw_maps[0]
        torch.testing.assert_close(together[index], alone, rtol=1e-9, atol=1e-12)
