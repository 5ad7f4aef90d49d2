"""Per-instance explanations of detectors attacked as a hostile user would (session 12): D-RISE's black fill on the
detectors that take [0, 1] pixels and normalise them inside (torchvision, Ultralytics)."""

from __future__ import annotations

import torch
from detection_models import SmallDetector, faster_rcnn
from torchvision.ops import box_iou

import explain

SIZE = (64, 64)


def drise_by_hand(model, image, box, label, masks, black) -> torch.Tensor:
    """Σ_i w_i M_i with w_i the best similarity (IoU × class cosine × objectness, IoU ≥ 0 ungated) of the instance to
    the torchvision detections of the image masked with ``black``."""
    expected = torch.zeros(SIZE, dtype=torch.float64)
    for mask in masks:
        with torch.no_grad():
            detections = model((image * mask + black * (1 - mask))[None])[0]
        if len(detections["scores"]) == 0:
            continue
        vectors = torch.nn.functional.one_hot(detections["labels"], 4).float() * detections["scores"][:, None]
        overlaps = box_iou(box[None], detections["boxes"])[0]
        similarity = overlaps * vectors[:, label] / vectors.norm(dim=-1).clamp_min(1e-12) * vectors.amax(dim=-1)
        expected += float(similarity.max()) * mask.double()
    return expected


def test_drise_masks_a_torchvision_detector_with_black_pixels_not_the_assumed_imagenet_statistics():
    """A torchvision detector takes [0, 1] pixels (docs/detection.md: image = torch.rand(3, H, W)) and normalises them
    inside: a masked pixel must be black, 0, not (0 − ImageNet mean) / std ≈ −2, an image no camera gives."""
    model = faster_rcnn()
    image = torch.rand(3, *SIZE, generator=torch.Generator().manual_seed(3))
    method = explain.DRISE(model, masks=12, grid=4, seed=1, batch_size=6)
    assert torch.equal(method.fill_values(3, torch.device("cpu"), torch.float32), torch.zeros(3, 1, 1))
    explanation = method.explain(image, instances=1)
    masks = method.mask_set(SIZE, torch.device("cpu"))
    box, label = explanation.boxes[0, 0], int(explanation.class_indices[0, 0])
    expected = drise_by_hand(model, image, box, label, masks, torch.zeros(3, 1, 1))
    torch.testing.assert_close(explanation.raw_maps[0, 0].double(), expected, atol=1e-4, rtol=1e-4)


def test_drise_black_follows_a_stated_preprocess_and_a_model_of_other_families():
    """Where the preprocess is stated, or the model is not a [0, 1]-pixel detector, black is the preprocess's own."""
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    imagenet_black = ((0 - mean) / std).view(3, 1, 1)
    stated = explain.DRISE(faster_rcnn(), masks=2, preprocess=explain.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    torch.testing.assert_close(stated.fill_values(3, torch.device("cpu"), torch.float32), torch.full((3, 1, 1), -2.0))
    other = explain.DRISE(SmallDetector().eval(), masks=2)
    torch.testing.assert_close(other.fill_values(3, torch.device("cpu"), torch.float32), imagenet_black)


def test_a_pil_image_reaches_a_bare_torchvision_detector_as_its_unit_pixels_not_normalised_twice():
    """A torchvision detector normalises inside: with no preprocess given, a PIL image is passed on as [0, 1] pixels
    (its ToTensor), so its map equals the map of that float tensor, and the display is the image itself. (Before,
    ImageNet's Normalize ran first: the detector saw a black pixel as about −2 and normalised it again.)"""
    from PIL import Image

    model = faster_rcnn()
    pixels = torch.randint(0, 256, (*SIZE, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    picture = Image.fromarray(pixels.numpy())
    unit = pixels.permute(2, 0, 1).float() / 255
    method = explain.Saliency(model, normalize=None)
    assert method.preprocess(picture).shape == unit.shape
    torch.testing.assert_close(method.preprocess(picture), unit)
    from_picture = method.explain(picture, instances=1)
    from_tensor = method.explain(unit, instances=1)
    torch.testing.assert_close(from_picture.boxes, from_tensor.boxes)
    torch.testing.assert_close(from_picture.raw_maps, from_tensor.raw_maps)
    torch.testing.assert_close(from_picture.images[0], unit.permute(1, 2, 0), atol=1 / 255, rtol=0)
    loaded = explain.load_model("fasterrcnn_mobilenet_v3_large_320_fpn", "random")
    torch.testing.assert_close(loaded.preprocess(picture), unit)
