"""Detectors explained per instance, as specifications: per-instance Grad-CAM and ODAM equal hooks and autograd of
the matched instance's score by hand, D-RISE equals its formula with the same masks, on random-weight models of
every family (torchvision Faster R-CNN and RetinaNet, HuggingFace DETR and RT-DETR, Ultralytics YOLOv8n and YOLO11n
from their YAML, a {"boxes", "scores"} model)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from detection_models import DETECTORS, SmallDetector, decoded
from torchvision.ops import box_iou

import explain
from explain.detection import Instances, InstanceTarget, detect

SIZE = (64, 64)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.rand(2, 3, *SIZE, generator=generator)


@pytest.fixture(scope="module", params=sorted(DETECTORS))
def detector(request):
    """(name, model, CAM layer) of every family."""
    build, layer = DETECTORS[request.param]
    return request.param, build(), layer


GRADIENT_FAMILIES = sorted(DETECTORS)
"""Every family: RT-DETR is built with weights wide enough for its gradients to rise above rounding
(tests/detection_models.py)."""


@pytest.fixture(scope="module", params=GRADIENT_FAMILIES)
def gradient_detector(request):
    build, layer = DETECTORS[request.param]
    return request.param, build(), layer


def module_named(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return dict(model.named_modules())[name]


def matched_score(name: str, model, output, box: torch.Tensor, label: int, quantity: str = "score") -> torch.Tensor:
    """The instance's scalar by D-RISE's similarity (Petsiuk et al. 2021): among the candidates overlapping the box
    by IoU ≥ 0.5, the one maximising IoU × cos(one-hot class, class vector) × objectness; its class score (or a
    coordinate of its box)."""
    boxes, scores, vectors, objectness = decoded(name, model, output, SIZE)
    overlaps = box_iou(box[None].to(boxes), boxes.detach())[0].float()
    vectors, objectness = vectors.float(), objectness.float()
    vectors, objectness = vectors.detach(), objectness.detach()
    similarity = overlaps * vectors[:, label] / vectors.norm(dim=-1).clamp_min(1e-12) * objectness
    similarity[overlaps < 0.5] = 0
    best = int(similarity.argmax())
    assert similarity[best] > 0, "the instance is found on its own image"
    if quantity == "score":
        return scores[best, label]
    return boxes[best, ("x0", "y0", "x1", "y1").index(quantity)]


def cam_by_hand(name, model, layer, image, box, label, element_wise: bool, relu: bool = False) -> torch.Tensor:
    """Grad-CAM (mean gradient per channel) or ODAM (element-wise gradient × activation), bilinear to the input, of
    the matched instance's score; the map before normalisation, signed (the ReLU of the papers with ``relu``: random
    weights give maps near 0 whose sign is rounding, so the tests compare the signed maps)."""
    recorded = {}
    handle = module_named(model, layer).register_forward_hook(lambda module, args, out: recorded.update(a=out))
    try:
        # two rows of the image, row 0 read: torch 2.14's CPU BatchNorm backward is wrong for one row whose gradient
        # arrives as tokens' (RT-DETR's decoder input projection; tests/test_issue39_batchnorm.py)
        output = model(image[None].repeat(2, 1, 1, 1).requires_grad_())  # a graph also where parameters are frozen
    finally:
        handle.remove()
    activations = recorded["a"]
    score = matched_score(name, model, output, box, label)
    gradients = torch.autograd.grad(score, activations)[0]
    weights = gradients if element_wise else gradients.mean(dim=(2, 3), keepdim=True)
    cam = (weights * activations).sum(dim=1, keepdim=True)
    cam = torch.relu(cam) if relu else cam
    return F.interpolate(cam.float(), size=SIZE, mode="bilinear", align_corners=False)[0, 0].detach()


def test_per_instance_gradcam_equals_hooks_and_autograd_of_the_matched_instance(gradient_detector, images):
    name, model, layer = gradient_detector
    before = model_state(model)
    explanation = explain.GradCAM(model, layer, relu=False).explain(images, instances=2)
    assert_state_equal(before, model_state(model))
    assert explanation.maps.shape == (2, 2, *SIZE) and explanation.boxes.shape == (2, 2, 4)
    for image in range(2):
        for instance in range(2):
            box, label = explanation.boxes[image, instance], int(explanation.class_indices[image, instance])
            expected = cam_by_hand(name, model, layer, images[image], box, label, element_wise=False)
            scale = float(expected.abs().max()) or 1.0  # maps of random weights are tiny; 5e-5: batch rounding
            torch.testing.assert_close(explanation.raw_maps[image, instance] / scale, expected / scale,
                                       atol=5e-5, rtol=1e-4)


def test_odam_equals_the_element_wise_map_of_the_matched_instance_min_max_normalised(gradient_detector, images):
    name, model, layer = gradient_detector
    explanation = explain.ODAM(model, layer, relu=False).explain(images[:1], instances=2)
    for instance in range(2):
        box, label = explanation.boxes[0, instance], int(explanation.class_indices[0, instance])
        expected = cam_by_hand(name, model, layer, images[0], box, label, element_wise=True)
        scale = float(expected.abs().max()) or 1.0  # random weights: some detectors' maps are tiny
        torch.testing.assert_close(explanation.raw_maps[0, instance] / scale, expected / scale, atol=5e-5, rtol=1e-4)
        raw = explanation.raw_maps[0, instance]
        if raw.max() > raw.min():  # the authors' normalisation: min-max per map
            torch.testing.assert_close(explanation.maps[0, instance], (raw - raw.min()) / (raw.max() - raw.min()))


def test_the_detections_are_the_detectors_own(detector, images):
    """instances=k are each image's k highest-scoring final detections: torchvision's own output, DETR's queries'
    best classes, per-class NMS of YOLO's and the {"boxes", "scores"} model's candidates; the first is the
    highest-scoring candidate (one of them, where random weights give several the same score)."""
    name, model, _ = detector
    with torch.no_grad():
        output = model(images)
    found = detect(model, images, 3, output)
    boxes, scores, _, _ = decoded(name, model, output, SIZE)
    best, classes = scores.max(dim=-1)
    assert float(found.scores[0, 0]) == pytest.approx(float(best.max()))
    first = (best == best.max()) & (classes == found.classes[0, 0]) & (boxes == found.boxes[0, 0]).all(dim=-1)
    assert bool(first.any()) and bool(found.present.all())
    assert bool((found.scores[0, :-1] >= found.scores[0, 1:]).all())  # highest first


@pytest.mark.parametrize("name", ["small", "yolov8n", "detr", "rt_detr", "faster_rcnn"])
def test_drise_equals_its_formula_with_the_same_masks(name, images):
    build, _ = DETECTORS[name]
    model = build()
    method = explain.DRISE(model, masks=24, grid=4, seed=1, batch_size=8)
    explanation = method.explain(images[:1], instances=2)
    masks = method.mask_set(SIZE, torch.device("cpu"))
    assert masks.shape == (24, *SIZE) and 0 <= float(masks.min()) and float(masks.max()) <= 1
    for instance in range(2):
        box, label = explanation.boxes[0, instance], int(explanation.class_indices[0, instance])
        expected = torch.zeros(SIZE, dtype=torch.float64)
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        black = ((0 - mean) / std)[:, None, None]  # a black pixel as the model sees it (the default ImageNet Normalize)
        if name in ("yolov8n", "faster_rcnn"):  # they take [0, 1] pixels: their default preprocess keeps them
            black = torch.zeros(3, 1, 1)
        for mask in masks:
            with torch.no_grad():
                output = model((images[0] * mask + black * (1 - mask))[None])
            boxes, _, vectors, objectness = decoded(name, model, output, SIZE)
            overlaps = box_iou(box[None], boxes)[0]
            similarity = overlaps * vectors[:, label] / vectors.norm(dim=-1).clamp_min(1e-12) * objectness
            similarity[overlaps < 0.5] = 0
            expected += float(similarity.max()) * mask.double()
        torch.testing.assert_close(explanation.raw_maps[0, instance].double(), expected, atol=1e-4, rtol=1e-4)


def test_rise_masks_follow_the_rise_recipe():
    """Cells of ⌈H/s⌉ px kept with probability p, upsampled bilinearly over s + 1 cells, cropped at a shift inside
    one cell: a mask is 1 (or 0) over the inside of a kept (dropped) cell's area, and smooth in between."""
    from explain.methods.detection import rise_masks

    masks = rise_masks(400, 4, 0.5, (32, 32), torch.Generator().manual_seed(0), torch.device("cpu"))
    assert masks.shape == (400, 32, 32)
    assert 0.45 < float(masks.mean()) < 0.55
    assert float((masks == 1).float().mean()) > 0.05 and float((masks == 0).float().mean()) > 0.05
    steps = (masks[:, :, 1:] - masks[:, :, :-1]).abs().max()
    assert float(steps) <= 1 / 8 + 1e-6  # bilinear over 8 px cells: no jump larger than one pixel's share
    assert not torch.equal(masks[0], masks[1])


def test_several_instances_in_one_call_equal_one_call_each(images):
    model = SmallDetector().eval()
    found = detect(model, images, 3)
    together = explain.GradCAM(model, "features.4").explain(images, instances=found)
    for instance in range(3):
        one = Instances(found.boxes[:, instance:instance + 1], found.classes[:, instance:instance + 1],
                        found.scores[:, instance:instance + 1], found.present[:, instance:instance + 1])
        alone = explain.GradCAM(model, "features.4").explain(images, instances=one)
        torch.testing.assert_close(together.raw_map_grid[:, instance], alone.raw_map_grid[:, 0])
        torch.testing.assert_close(together.scores[:, instance], alone.scores[:, 0])


@pytest.mark.parametrize("method", ["gradcam", "odam", "saliency", "drise"])
def test_a_batch_equals_each_image_alone(method, images):
    model = SmallDetector().eval()
    make = explain.get_method(method)
    options = {"masks": 16, "grid": 4} if method == "drise" else {}
    explainer = make(model, "features.4", **options) if make.needs_layer else make(model, **options)
    batch = explainer.explain(images, instances=2)
    for image in range(2):
        alone = explainer.explain(images[image:image + 1], instances=2)
        torch.testing.assert_close(batch.raw_map_grid[image], alone.raw_map_grid[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batch.boxes[image], alone.boxes[0])


def test_an_image_with_fewer_instances_gets_padding_drawn_as_no_instance_and_no_warning(images):
    """Padding is what instances="all" gives every image with fewer detections than another: an empty map, a NaN
    box, "no instance" in titles, and no warning (a warning is for an instance that is missing)."""
    model = SmallDetector().eval()
    found = detect(model, images, 2)
    found.present[1, 1] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # relu=False: the random weights' maps are negative, which is warned
        explanation = explain.GradCAM(model, "features.4", relu=False).explain(images, instances=found)
    assert float(explanation.raw_maps[1, 1].abs().max()) == 0
    assert bool(explanation.boxes[1, 1].isnan().all()) and explanation.title(1, 1) == "no instance"
    assert explanation.title(0, 1).startswith("#1 ")


class DriftingDetector(torch.nn.Module):
    """A {"boxes", "scores"} detector whose boxes drift right as the image darkens: on the dark path points of
    Integrated Gradients from a black baseline, the instance's box has moved away."""

    def __init__(self):
        super().__init__()
        self.inner = SmallDetector().eval()

    def forward(self, images):
        output = self.inner(images)
        drift = (1 - images.mean(dim=(1, 2, 3)))[:, None, None] * 40 * images.new_tensor([1.0, 0, 1, 0])
        return {"boxes": output["boxes"] + drift - 20 * images.new_tensor([1.0, 0, 1, 0]), "scores": output["scores"]}


def test_an_instance_that_disappears_in_perturbed_copies_is_said_not_scored_zero_silently(images):
    model = DriftingDetector()
    with pytest.warns(RuntimeWarning, match=r"disappeared .* scored 0 there\. \(image, instance\)"):
        explanation = explain.IntegratedGradients(model, steps=8, baseline="zeros").explain(images[:1], instances=1)
    assert explanation.maps.abs().max() > 0


def test_box_maps_differentiate_the_matched_box_coordinate(images):
    model = SmallDetector().eval()
    explanation = explain.ODAM(model, "features.4", quantity="x1").explain(images[:1], instances=1)  # with its ReLU
    box, label = explanation.boxes[0, 0], int(explanation.class_indices[0, 0])
    recorded = {}
    handle = model.features[4].register_forward_hook(lambda module, args, out: recorded.update(a=out))
    try:
        output = model(images[:1])
    finally:
        handle.remove()
    value = matched_score("small", model, output, box, label, quantity="x1")
    assert float(explanation.scores[0, 0]) == pytest.approx(float(value))
    gradients = torch.autograd.grad(value, recorded["a"])[0]
    expected = F.interpolate(torch.relu((gradients * recorded["a"]).sum(1, keepdim=True)), size=SIZE,
                             mode="bilinear", align_corners=False)[0, 0]
    torch.testing.assert_close(explanation.raw_maps[0, 0], expected.detach(), atol=1e-5, rtol=1e-4)


def test_weight_by_iou_multiplies_the_class_score_by_the_matched_boxes_agreement(images):
    model = SmallDetector().eval()
    found = detect(model, images[:1], 1)
    shifted = found.boxes.clone()
    shifted[..., [0, 2]] += 1.0  # a reference box one pixel off: IoU < 1
    reference = Instances(shifted, found.classes, found.scores, found.present)
    with torch.no_grad():
        output = model(images[:1])
    plain = InstanceTarget(reference, model, SIZE)(output)
    weighted = InstanceTarget(reference, model, SIZE, weight_by_iou=True)(output)
    overlap = box_iou(shifted[0], found.boxes[0])[0, 0]
    assert float(overlap) < 1
    torch.testing.assert_close(weighted, plain * overlap)


def test_given_boxes_are_explained_as_the_class_of_the_detection_that_overlaps_them_most(images):
    model = SmallDetector().eval()
    found = detect(model, images[:1], 1)
    given = explain.GradCAM(model, "features.4").explain(images[:1], instances=found.boxes[0])
    assert int(given.class_indices[0, 0]) == int(found.classes[0, 0])
    torch.testing.assert_close(given.boxes[0], found.boxes[0])


def test_the_overlays_and_the_figure_outline_each_instances_box(images, tmp_path):
    model = SmallDetector().eval()
    explanation = explain.GradCAM(model, "features.4").explain(images[:1], instances=2)
    overlays = explanation.overlay()  # (1, 2, H, W, 3)
    for instance in range(2):
        x0, y0, x1, y1 = (int(round(float(v))) for v in explanation.boxes[0, instance])
        inside = [(y, x) for y, x in ((y0, (x0 + x1) // 2), ((y0 + y1) // 2, x0)) if 0 <= y < 64 and 0 <= x < 64]
        for y, x in inside:
            assert tuple(overlays[0, instance, y, x]) == (255, 255, 255)
    path = explanation.save(tmp_path / "instances.png")
    assert np.asarray(__import__("PIL.Image").Image.open(path)).shape == (128, 64, 3)  # a row per instance
    explanation.figure().savefig(tmp_path / "figure.pdf")
    assert explanation[0].boxes.shape == (1, 2, 4)


def test_bad_requests_are_refused_with_what_to_do(images):
    model = SmallDetector().eval()
    with pytest.raises(ValueError, match="explains detected instances"):
        explain.ODAM(model, "features.4").explain(images, target=0)
    with pytest.raises(ValueError, match="not both"):
        explain.GradCAM(model, "features.4").explain(images, instances=1, target=0)
    for spec, error in (("some", ValueError), (0, ValueError), (1.5, ValueError), (True, TypeError)):
        with pytest.raises(error, match="instances|threshold|k must"):
            explain.GradCAM(model, "features.4").explain(images, instances=spec)
    with pytest.raises(ValueError, match=r"\(K, 4\)"):
        explain.GradCAM(model, "features.4").explain(images, instances=torch.zeros(2, 3))
    classifier = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(ValueError, match="cannot read detections"):
        explain.GradCAM(classifier, "0").explain(images, instances=1)
    with pytest.raises(ValueError, match="quantity"):
        explain.ODAM(model, "features.4", quantity="width")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.Saliency(model).explain(images, instances=1)  # a plain call warns of nothing


def test_a_broken_image_is_reported_as_one_after_ultralytics_replaced_pil_open(tmp_path):
    """Importing Ultralytics replaces PIL.Image.open in the process with a function that, on a file Pillow cannot
    identify, installs and imports pi-heif: explain opens images with Pillow's own function, so a broken file among
    a batch run's images is still reported as a broken image."""
    patches = pytest.importorskip("ultralytics.utils.patches")
    from PIL import Image

    assert Image.open is patches.image_open  # the replacement is in place
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="could not be read as an image"):
        explain.load_image(broken)


def test_each_instances_map_is_scored_against_its_own_box(images):
    """``instance_boxes``: one row per present instance (padding left out), its box as the pixels it covers; the
    localisation metrics then score each instance's map against its own box, as computed by hand."""
    from explain.metrics import energy_pointing_game, instance_boxes, pointing_game

    model = SmallDetector().eval()
    found = detect(model, images, 2)
    found.present[1, 1] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the padding's empty map is said
        explanation = explain.ODAM(model, "features.4").explain(images, instances=found)
    maps, boxes = instance_boxes(explanation)
    assert maps.shape == (3, *SIZE) and boxes.shape == (3, 4)
    rows = [(0, 0), (0, 1), (1, 0)]
    for row, (image, instance) in enumerate(rows):
        x0, y0, x1, y1 = explanation.boxes[image, instance].tolist()
        inside = torch.zeros(SIZE, dtype=torch.bool)
        top, bottom = max(int(np.floor(y0)), 0), min(int(np.ceil(y1)), 64)
        left, right = max(int(np.floor(x0)), 0), min(int(np.ceil(x1)), 64)
        inside[top:bottom, left:right] = True
        mine = explanation.maps[image, instance]
        assert torch.equal(maps[row], mine)
        hit = inside.flatten()[mine.flatten().argmax()]
        assert float(pointing_game(maps, boxes)[row]) == float(hit)
        mass = float(mine.clamp_min(0)[inside].sum() / mine.clamp_min(0).sum())
        assert float(energy_pointing_game(maps, boxes)[row]) == pytest.approx(mass, abs=1e-6)
    with pytest.raises(ValueError, match="instances="):
        plain = explain.Saliency(torch.nn.Conv2d(3, 2, 1)).explain(images, target=lambda out: out.mean((1, 2, 3)))
        instance_boxes(plain)
