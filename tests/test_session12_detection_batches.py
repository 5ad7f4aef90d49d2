"""Per-instance detector explanations over batches (session 12): an image's D-RISE and ODAM maps do not depend on the
other images of the batch, their order or ``batch_size``; images with different numbers of instances (none next to
several) are padded, and padding is never drawn as an instance; ODAM's box-coordinate maps and the per-instance
deletion / insertion curves against by-hand computations, on the demo detector, Faster R-CNN and transformers
DETR-style detectors built from tiny configs with random weights."""

from __future__ import annotations

import dataclasses
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from detection_models import SmallDetector, conditional_detr, decoded, faster_rcnn, rt_detr
from torch import nn
from torchvision.ops import box_iou
from torchvision.ops import boxes as box_ops

import explain
from explain.detection import Instances, InstanceTarget, detect
from explain.metrics import instance_deletion, instance_insertion
from explain.metrics._common import ranking
from explain.metrics.faithfulness import substrate_for

SIZE = (64, 64)


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """One torch thread: these detectors run many times slower with two threads competing on a shared CPU."""


def yolos() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                      image_size=list(SIZE), patch_size=16, num_detection_tokens=10, num_labels=3)
    return transformers.YolosForObjectDetection(config).eval()


def images(count: int, seed: int, size: tuple[int, int] = SIZE) -> torch.Tensor:
    return torch.rand(count, 3, *size, generator=torch.Generator().manual_seed(seed))


def model_state(model: nn.Module) -> tuple:
    return ([module.training for module in model.modules()], [p.requires_grad for p in model.parameters()],
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()))


def best_similarity(family: str, model: nn.Module, image: torch.Tensor, box: torch.Tensor, label: int) -> float:
    """D-RISE's similarity of an instance (box, label) to its best match among the detections of one image, from the
    test's own reading of the output (IoU × class cosine × objectness, ungated)."""
    with torch.no_grad():
        output = model(image[None])
    boxes, _, vectors, objectness = decoded(family, model, output, tuple(image.shape[-2:]))
    if len(boxes) == 0:
        return 0.0
    cosine = vectors[:, label] / vectors.norm(dim=-1).clamp_min(1e-12)
    return float((box_iou(box[None], boxes.float())[0] * cosine * objectness).max().clamp(min=0))


def drise_by_hand(family: str, model: nn.Module, image: torch.Tensor, box: torch.Tensor, label: int,
                  masks: torch.Tensor, black: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i M_i, w_i the instance's best similarity in the image masked by M_i (masked pixels ``black``)."""
    expected = torch.zeros(masks.shape[-2:], dtype=torch.float64)
    for mask in masks:
        expected += best_similarity(family, model, image * mask + black * (1 - mask), box, label) * mask.double()
    return expected


# 1. An image's map does not depend on the batch ----------------------------------------------------------------


def check_batch_independence(method: explain.Explainer, a: torch.Tensor, b: torch.Tensor, atol: float) -> tuple:
    pair = method.explain(torch.stack([a, b]), instances=2)
    swapped = method.explain(torch.stack([b, a]), instances=2)
    alone_a, alone_b = method.explain(a[None], instances=2), method.explain(b[None], instances=2)
    for together, alone in ((pair[0], alone_a), (pair[1], alone_b), (swapped[1], alone_a), (swapped[0], alone_b)):
        torch.testing.assert_close(together.boxes, alone.boxes)
        torch.testing.assert_close(together.raw_maps, alone.raw_maps, atol=atol, rtol=1e-4)
        assert float(together.raw_maps.abs().max()) > 10 * atol  # a real map, not two empty ones compared
    return pair, alone_a


def test_demo_detector_drise_and_odam_maps_of_an_image_are_those_it_has_alone_and_drise_matches_by_hand():
    """[a, b], [b, a], a alone and b alone give each image the same maps (D-RISE: the same seeded masks for every
    image; ``batch_size`` changes nothing), and D-RISE's map of b inside the pair is Σ w_i M_i computed by hand."""
    model = explain.load_model("demo-detector")
    from explain.data.detection_scenes import make_detection_scenes
    from explain.data.train import to_model_input

    batch = to_model_input(make_detection_scenes(2, seed=7).images)
    a, b = batch[0], batch[1]
    state = model_state(model.model)
    drise = explain.DRISE(model, masks=10, grid=4, seed=3, batch_size=4)
    pair, _ = check_batch_independence(drise, a, b, atol=1e-5)
    other_chunks = explain.DRISE(model, masks=10, grid=4, seed=3, batch_size=10).explain(torch.stack([a, b]),
                                                                                          instances=2)
    torch.testing.assert_close(other_chunks.raw_maps, pair.raw_maps, atol=1e-5, rtol=1e-5)
    masks = drise.mask_set(batch.shape[-2:], torch.device("cpu"))
    black = drise.fill_values(3, torch.device("cpu"), torch.float32)
    for k in range(2):
        expected = drise_by_hand("small", model.model, b, pair.boxes[1, k], int(pair.class_indices[1, k]), masks,
                                 black)
        torch.testing.assert_close(pair.raw_maps[1, k].double(), expected, atol=1e-4, rtol=1e-4)
    check_batch_independence(explain.ODAM(model, "head"), a, b, atol=1e-7)
    assert model_state(model.model) == state


def test_faster_rcnn_drise_and_odam_maps_of_an_image_are_those_it_has_alone():
    model = faster_rcnn()
    a, b = images(2, seed=3)
    state = model_state(model)
    check_batch_independence(explain.DRISE(model, masks=4, grid=4, seed=1, batch_size=3), a, b, atol=1e-5)
    check_batch_independence(explain.ODAM(model, "backbone.body.16"), a, b, atol=1e-14)
    assert model_state(model) == state


# 2. Images with different numbers of instances ---------------------------------------------------------------


HUGGINGFACE = {"conditional_detr": conditional_detr, "rt_detr": rt_detr, "yolos": yolos}


@pytest.mark.parametrize("name", ["conditional_detr", "rt_detr", "yolos", "faster_rcnn"])
def test_an_image_with_no_instance_next_to_one_with_several_is_padding_and_draws_no_map(name):
    """Image 0 has no instance, image 1 two, image 2 one: the instances are real detections marked present=False
    (so a map drawn for them would be a real one, not a blank); every padding map is zero, its box NaN, its title "no
    instance", without a warning; the maps of image 1 are those it has alone, and
    D-RISE's are Σ w_i M_i by hand."""
    model = faster_rcnn() if name == "faster_rcnn" else HUGGINGFACE[name]()
    # the test's reading of the output: sigmoid scores (Conditional DETR, RT-DETR), softmax with no-object (YOLOS)
    family = {"faster_rcnn": "faster_rcnn", "yolos": "detr"}.get(name, "rt_detr")
    batch = images(3, seed=1)
    found = detect(model, batch, 2)
    assert bool(found.present.all())
    present = torch.tensor([[False, False], [True, True], [True, False]])
    instances = Instances(found.boxes, found.classes, found.scores, present)
    state = model_state(model)
    drise = explain.DRISE(model, masks=3, grid=4, seed=2)
    masks = drise.mask_set(SIZE, torch.device("cpu"))
    black = drise.fill_values(3, torch.device("cpu"), torch.float32)
    own = Instances(found.boxes[1:2], found.classes[1:2], found.scores[1:2], present[1:2])
    for method in (explain.Saliency(model), drise):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            e = method.explain(batch, target=InstanceTarget(instances, model))
        assert e.raw_maps.shape == (3, 2, *SIZE)
        assert torch.equal(e.boxes.isnan().any(dim=-1), ~present)
        torch.testing.assert_close(e.boxes[present], found.boxes[present])
        assert torch.equal(e.raw_maps[~present], torch.zeros(int((~present).sum()), *SIZE))
        assert torch.equal(e.maps[~present], torch.zeros(int((~present).sum()), *SIZE))
        assert [e.title(0, 0), e.title(0, 1), e.title(2, 1)] == ["no instance"] * 3
        assert "no instance" not in (e.title(1, 0), e.title(1, 1), e.title(2, 0))
        alone = method.explain(batch[1:2], target=InstanceTarget(own, model))
        torch.testing.assert_close(e.raw_maps[1], alone.raw_maps[0], atol=1e-6, rtol=1e-4)
        assert float(e.raw_maps[2, 0].abs().max()) > 0
        if method is drise:
            expected = drise_by_hand(family, model, batch[2], found.boxes[2, 0], int(found.classes[2, 0]), masks,
                                     black)
            torch.testing.assert_close(e.raw_maps[2, 0].double(), expected, atol=1e-4, rtol=1e-4)
    assert model_state(model) == state


# 3. ODAM against its formula ---------------------------------------------------------------------------------


def odam_by_hand(model: nn.Module, layer: str, batch: torch.Tensor, image: int, box: torch.Tensor, label: int,
                 quantity: str) -> torch.Tensor:
    """ReLU(Σ_k ∂y/∂A_k ⊙ A_k) at ``layer``, bilinearly resized to the input, y the quantity of the torchvision
    detection matching the instance (same class, best IoU × score among IoU ≥ 0.5)."""
    captured = {}
    handle = dict(model.named_modules())[layer].register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("A", output))
    original = box_ops.clip_boxes_to_image  # ODAM differentiates the box before torchvision clips it to the image

    def straight_through(boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return boxes + (original(boxes, size) - boxes).detach()

    try:
        with mock.patch.object(box_ops, "clip_boxes_to_image", straight_through):
            output = model(batch)
    finally:
        handle.remove()
    detections = output[image]
    overlaps = box_iou(box[None], detections["boxes"].detach())[0]
    similarity = overlaps * (detections["labels"] == label) * detections["scores"].detach() * (overlaps >= 0.5)
    match = int(similarity.argmax())
    value = (detections["scores"][match] if quantity == "score"
             else detections["boxes"][match, ["x0", "y0", "x1", "y1"].index(quantity)])
    gradient, = torch.autograd.grad(value, captured["A"])
    cam = (gradient * captured["A"]).sum(dim=1)[image].clamp(min=0)
    return F.interpolate(cam[None, None].detach(), size=tuple(batch.shape[-2:]), mode="bilinear",
                         align_corners=False)[0, 0]


def test_odam_box_coordinate_and_score_maps_of_faster_rcnn_follow_the_papers_formula():
    model = faster_rcnn()
    batch = images(2, seed=3)
    layer = "backbone.body.16"
    state = model_state(model)
    for quantity in ("x0", "x1", "y1", "score"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = explain.ODAM(model, layer, quantity=quantity).explain(batch, instances=2)
        nonzero = 0
        for image in range(2):
            for k in range(2):
                expected = odam_by_hand(model, layer, batch, image, e.boxes[image, k],
                                        int(e.class_indices[image, k]), quantity)
                torch.testing.assert_close(e.raw_maps[image, k], expected, atol=1e-15, rtol=1e-4)
                if float(expected.max()) > 0:
                    nonzero += 1
                    scaled = (expected - expected.min()) / (expected.max() - expected.min())
                    torch.testing.assert_close(e.maps[image, k], scaled, atol=1e-4, rtol=1e-4)
        assert nonzero >= 2
    assert model_state(model) == state


# 4. Deletion and insertion per instance ----------------------------------------------------------------------


def curves_by_hand(family: str, model: nn.Module, batch: torch.Tensor, e, steps: int, insertion: bool):
    fill = substrate_for(batch, "blur") if insertion else torch.zeros_like(batch)
    pixels = batch.shape[-2] * batch.shape[-1]
    rows = []
    for image in range(batch.shape[0]):
        for k in range(e.boxes.shape[1]):
            if bool(e.boxes[image, k].isnan().any()):
                continue
            ranks = ranking(e.maps[image, k][None])[0]
            curve = []
            for step in range(steps + 1):
                changed = ranks < round(step * pixels / steps)
                perturbed = (torch.where(changed, batch[image], fill[image]) if insertion
                             else torch.where(changed, fill[image], batch[image]))
                curve.append(best_similarity(family, model, perturbed, e.boxes[image, k],
                                             int(e.class_indices[image, k])))
            rows.append(curve)
    return torch.tensor(rows)


@pytest.mark.parametrize("family,build", [("small", lambda: SmallDetector().eval()), ("rt_detr", rt_detr),
                                          ("faster_rcnn", faster_rcnn)])
def test_instance_deletion_and_insertion_score_each_instance_of_each_image_by_hand(family, build):
    """Random maps, distinct for every (image, instance), and padding in image 0: each row of the curves is the
    similarity, step by step, of its own instance in its own image with its own map's pixels changed; a
    ``batch_size`` that splits rows across images changes nothing; the model's modes are left as found."""
    model = build()
    batch = images(2, seed=2, size=(32, 32) if family == "small" else SIZE)
    found = detect(model, batch, 3)
    present = torch.tensor([[True, False, False], [True, True, True]])
    target = InstanceTarget(Instances(found.boxes, found.classes, found.scores, present), model)
    e = explain.Saliency(model).explain(batch, target=target)
    e = dataclasses.replace(e, map_grid=torch.rand(e.map_grid.shape, generator=torch.Generator().manual_seed(9)))
    model.train()  # left in training mode: the metric runs it in eval mode and gives it back as it was
    state = model_state(model)
    for metric, insertion in ((instance_deletion, False), (instance_insertion, True)):
        result = metric(model, batch, e, steps=2, batch_size=5)
        expected = curves_by_hand(family, model.eval(), batch, e, 2, insertion)
        model.train()
        assert result.curves.shape == (4, 3)
        torch.testing.assert_close(result.curves, expected, atol=1e-5, rtol=1e-4)
        widths = torch.tensor([0.5, 0.5])
        torch.testing.assert_close(result.area, ((expected[:, 1:] + expected[:, :-1]) / 2 * widths).sum(1),
                                   atol=1e-5, rtol=1e-4)
        assert model_state(model) == state


def test_an_empty_drise_map_says_what_d_rise_requires_not_to_lower_min_iou():
    """D-RISE weighs a mask by the instance's ungated similarity (any overlap): a map is empty only where no candidate
    overlapped the box at all in any masked image. (Before, the warning said a candidate overlapping by IoU ≥ 0.5 was
    missing and advised to lower min_iou, which does not change D-RISE's maps.)"""
    model = rt_detr()
    batch = images(3, seed=1)
    found = detect(model, batch, 3)
    target = InstanceTarget(found, model)
    method = explain.DRISE(model, masks=3, grid=4, seed=2)
    masks = method.mask_set(SIZE, torch.device("cpu"))
    black = method.fill_values(3, torch.device("cpu"), torch.float32)
    with pytest.warns(RuntimeWarning, match=r"\(1, 2\)") as caught:
        e = method.explain(batch, target=target)
    message = " ".join(str(warning.message) for warning in caught)
    assert "IoU > 0" in message and "min_iou" in message and "lower min_iou" not in message
    assert float(e.raw_maps[1, 2].abs().max()) == 0
    torch.testing.assert_close(drise_by_hand("rt_detr", model, batch[1], found.boxes[1, 2], int(found.classes[1, 2]),
                                             masks, black), torch.zeros(SIZE, dtype=torch.float64))
    with pytest.warns(RuntimeWarning, match=r"\(1, 2\)"):  # min_iou=0 changes nothing in D-RISE's maps
        lower = method.explain(batch, target=InstanceTarget(found, model, min_iou=0.0))
    torch.testing.assert_close(lower.raw_maps, e.raw_maps)
