"""Per-instance detector explanations attacked as a hostile user would (session 13): ODAM's box-coordinate maps of a
box clipped at the image's border (torchvision clips every box to the image: the clipped coordinate is a constant
whose gradient is 0), a detector that clips its own boxes, given boxes wholly outside the image, no box at all, a
number held in a tensor, images whose detector output is NaN, and D-RISE given a box coordinate to explain."""

from __future__ import annotations

import threading
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from detection_models import SmallDetector, faster_rcnn, xyxy, yolo
from torch import nn
from torchvision.ops import batched_nms, box_iou
from torchvision.ops import boxes as box_ops

import explain
from explain.detection import Instances, InstanceTarget, detect

SIZE = (64, 64)
LAYER = "backbone.body.16"


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """One torch thread: these detectors run many times slower with two threads competing on a shared CPU."""


def images(count: int, seed: int, size: tuple[int, int] = SIZE) -> torch.Tensor:
    return torch.rand(count, 3, *size, generator=torch.Generator().manual_seed(seed))


def model_state(model: nn.Module) -> tuple:
    return ([module.training for module in model.modules()], [p.requires_grad for p in model.parameters()],
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()))


# 1. ODAM's map of a coordinate clipped at the border -----------------------------------------------------------


def odam_unclipped_by_hand(model: nn.Module, batch: torch.Tensor, box: torch.Tensor, label: int,
                           quantity: str) -> torch.Tensor:
    """ReLU(Σ_k ∂y/∂A_k ⊙ A_k) at LAYER, bilinearly resized to the input, y the coordinate of the detection matching
    the instance, differentiated as the box before torchvision clips it to the image (the test's own straight-through
    clip: the clipped value, the gradient of the unclipped box)."""
    original = box_ops.clip_boxes_to_image

    def straight_through(boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return boxes + (original(boxes, size) - boxes).detach()

    captured = {}
    handle = dict(model.named_modules())[LAYER].register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("A", output))
    try:
        with mock.patch.object(box_ops, "clip_boxes_to_image", straight_through):
            detections = model(batch)[0]
    finally:
        handle.remove()
    overlaps = box_iou(box[None], detections["boxes"].detach())[0]
    similarity = overlaps * (detections["labels"] == label) * detections["scores"].detach() * (overlaps >= 0.5)
    value = detections["boxes"][int(similarity.argmax()), ["x0", "y0", "x1", "y1"].index(quantity)]
    gradient, = torch.autograd.grad(value, captured["A"])
    cam = (gradient * captured["A"]).sum(dim=1)[0].clamp(min=0)
    return F.interpolate(cam[None, None].detach(), size=SIZE, mode="bilinear", align_corners=False)[0, 0]


def test_odam_maps_a_faster_rcnn_box_coordinate_clipped_at_the_border_as_the_unclipped_regression():
    """Image 0's second detection is the whole image, [0, 0, 63.99, 64]: torchvision clips its x0 and y0 to 0, a
    constant whose gradient is 0. ODAM's box maps differentiate the box head's regression (the authors'), so the
    clipped coordinate gets the map of the unclipped one, equal to the by-hand computation and not empty. (Before,
    the map was empty and the warning blamed a zero-initialised classifier head.) The detections, the model and
    torchvision's clip function are left as found."""
    model = faster_rcnn()
    batch = images(2, seed=3)[:1]
    state = model_state(model)
    with torch.no_grad():
        own = model(batch)[0]
    for quantity in ("x0", "y0"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no empty map
            e = explain.ODAM(model, LAYER, quantity=quantity).explain(batch, instances=2)
        assert float(e.boxes[0, 1, 0]) == 0 and float(e.boxes[0, 1, 1]) == 0  # the clipped box
        for box in e.boxes[0]:  # the values are the detector's own
            assert float((own["boxes"] - box).abs().amax(dim=-1).min()) == 0
        for k in range(2):
            expected = odam_unclipped_by_hand(model, batch, e.boxes[0, k], int(e.class_indices[0, k]), quantity)
            assert float(expected.max()) > 0
            torch.testing.assert_close(e.raw_maps[0, k], expected, atol=1e-15, rtol=1e-4)
    assert model_state(model) == state
    assert box_ops.clip_boxes_to_image.__module__ == "torchvision.ops.boxes"


def test_unclipped_box_gradients_is_for_its_own_thread_and_restores_torchvision_after_an_error():
    """Inside, this thread's clipped boxes keep their values and pass the gradient on; another thread at the same time
    gets torchvision's own clip (gradient 0 where clipped); after the block, even one left by an error, torchvision's
    function is its own again."""
    from explain.detection.candidates import unclipped_box_gradients

    original = box_ops.clip_boxes_to_image
    boxes = torch.tensor([[-3.0, 2.0, 70.0, 10.0]])

    def gradient() -> torch.Tensor:
        given = boxes.clone().requires_grad_(True)
        clipped = box_ops.clip_boxes_to_image(given, (64, 64))
        assert torch.equal(clipped.detach(), torch.tensor([[0.0, 2.0, 64.0, 10.0]]))
        clipped.sum().backward()
        return given.grad

    other: list[torch.Tensor] = []
    with pytest.raises(KeyError), unclipped_box_gradients():
        torch.testing.assert_close(gradient(), torch.ones(1, 4))
        thread = threading.Thread(target=lambda: other.append(gradient()))
        thread.start()
        thread.join()
        raise KeyError("an error inside")
    torch.testing.assert_close(other[0], torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    assert box_ops.clip_boxes_to_image is original
    torch.testing.assert_close(gradient(), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


class ClippingDetector(SmallDetector):
    """The demo detector with its boxes clipped to the image, as many detectors' postprocessing does."""

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        output = super().forward(images)
        height, width = images.shape[-2:]
        x = output["boxes"][..., 0::2].clamp(0, width)
        y = output["boxes"][..., 1::2].clamp(0, height)
        return {"boxes": torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1),
                "scores": output["scores"]}


def test_an_empty_odam_map_of_a_coordinate_a_detector_clipped_itself_names_the_border_not_the_head():
    """A detector that clips its own boxes: an instance's x0 clipped to 0 has no gradient (by hand: autograd of the
    clamped x0 at the layer is zero everywhere), so its map is empty; the warning says the coordinate lies on the
    border and is clipped, and what to do, not that a zero-initialised head stops the gradient."""
    model = ClippingDetector().eval()
    batch = images(1, seed=4, size=(32, 40))
    found = detect(model, batch, 40)
    on_border = (found.boxes[0, :, 0] == 0) & found.present[0]
    assert on_border.any() and (~on_border & found.present[0]).any()
    k = int(on_border.nonzero()[0, 0])
    keep = torch.zeros_like(found.present)
    keep[0, k] = True
    target = InstanceTarget(Instances(found.boxes[:, k:k + 1], found.classes[:, k:k + 1], found.scores[:, k:k + 1],
                                      keep[:, k:k + 1]), model, quantity="x0")
    captured = {}
    handle = model.features[4].register_forward_hook(lambda module, inputs, output: captured.__setitem__("A", output))
    try:
        output = model(batch)
    finally:
        handle.remove()
    overlaps = box_iou(found.boxes[0, k:k + 1], output["boxes"][0].detach())[0]
    match = int((overlaps * output["scores"][0, :, int(found.classes[0, k])].detach() * (overlaps >= 0.5)).argmax())
    gradient, = torch.autograd.grad(output["boxes"][0, match, 0], captured["A"], allow_unused=True)
    assert gradient is None or float(gradient.abs().max()) == 0
    with pytest.warns(RuntimeWarning) as caught:
        e = explain.ODAM(model, "features.4").explain(batch, target=target)
    message = " ".join(str(warning.message) for warning in caught)
    assert "(0, 0)" in message and "border" in message and "clips" in message and "quantity='score'" in message
    assert "zero-initialised" not in message
    assert float(e.raw_maps.abs().max()) == 0


# 2. Boxes given by the user -------------------------------------------------------------------------------------


def test_a_given_box_wholly_outside_the_image_is_padding_said_so_even_where_a_candidate_reaches_it():
    """[100, 100, 120, 120] lies outside the 64 × 64 input. A YOLO model's candidates reach past the image's sides, so
    one overlapped it and it was made an instance (before), whose map was then empty for another reason; it is
    padding, as a box overlapping no detection is, and the warning says it lies outside the input. A box partly
    inside is kept; all boxes outside: no instance, an error."""
    model = yolo()
    batch = images(1, seed=1)
    with torch.no_grad():
        raw = model(batch)[0][0].T  # (A, 4 + C): centre x, y, width, height, class scores
    corners = xyxy(raw[:, :4])
    assert bool((corners[:, 2] > 100).any() & (corners[:, 3] > 100).any())  # candidates reach past the sides
    best = int((raw[:, 4:].amax(dim=-1) * (corners[:, 0] > 0) * (corners[:, 2] < 64)).argmax())
    inside, outside = corners[best], torch.tensor([100.0, 100.0, 120.0, 120.0])
    with pytest.warns(RuntimeWarning, match=r"\(0, 1\) \[100.0, 100.0, 120.0, 120.0\] \(wholly outside the 64 × 64 "
                      r"input\)"):
        found = detect(model, batch, torch.stack([inside, outside]))
    assert found.present.tolist() == [[True, False]]
    agreement = box_iou(inside[None], corners)[0, :, None] * raw[:, 4:]  # the class of the best overlap × score
    assert int(found.classes[0, 0]) == int(agreement.flatten().argmax()) % raw[:, 4:].shape[1]
    with pytest.raises(ValueError, match=r"no instance selected by the boxes given.*wholly outside"):
        detect(model, batch, outside[None])
    partly = detect(model, batch, [[-5.0, -5.0, 10.0, 10.0], inside.tolist()])
    assert partly.present.all()


def reference_top(model: nn.Module, batch: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Per image, the boxes of the k best detections of the {"boxes", "scores"} model by the test's own reading: each
    candidate's best class, per-class NMS at IoU 0.5, highest score first."""
    with torch.no_grad():
        output = model(batch)
    tops = []
    for boxes, scores in zip(output["boxes"], output["scores"]):
        best, classes = scores.max(dim=-1)
        kept = batched_nms(boxes, best, classes, 0.5)
        tops.append(boxes[kept[best[kept].argsort(descending=True)][:k]])
    return tops


def test_no_box_and_a_number_held_in_a_tensor():
    """instances=[] gives no box: said so (before: 'got list', as if a list were not taken). A 0-d tensor or array is
    the number it holds, k or a threshold (before: read as a box of shape ())."""
    model = SmallDetector().eval()
    batch = images(2, seed=1, size=(32, 40))
    with pytest.raises(ValueError, match=r"instances=\[\] gives no box"):
        detect(model, batch, [])
    tops = reference_top(model, batch, 2)
    for spec in (torch.tensor(2), __import__("numpy").array(2)):
        found = detect(model, batch, spec)
        assert found.present.all()
        for image in range(2):
            torch.testing.assert_close(found.boxes[image], tops[image])
    with_threshold = detect(model, batch, torch.tensor(0.5))
    torch.testing.assert_close(with_threshold.present, detect(model, batch, 0.5).present)


# 3. A detector output that is not finite ------------------------------------------------------------------------


def test_images_whose_detector_output_is_nan_are_named():
    """A NaN image makes the detector's boxes and scores NaN: every image NaN is an error that says so (before: 'no
    detection reaches the score threshold ... the highest score is nan'); one NaN image among others is named in a
    warning, and the other images' instances are those found without it."""
    model = SmallDetector().eval()
    batch = images(2, seed=1, size=(32, 40))
    broken = batch.clone()
    broken[1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite boxes or scores for every image"):
        detect(model, torch.full_like(batch, float("nan")), 2)
    with pytest.warns(RuntimeWarning, match=r"NaN or infinite boxes or scores for image\(s\) 1:"):
        found = detect(model, broken, 2)
    alone = detect(model, batch[:1], 2)
    torch.testing.assert_close(found.boxes[0], alone.boxes[0])
    assert found.present[0].all() and not found.present[1].any()


# 4. D-RISE explains the similarity, never a coordinate ----------------------------------------------------------


def test_drise_refuses_a_target_of_a_box_coordinate():
    """D-RISE weighs its masks by the instance's similarity: given InstanceTarget(quantity="x0") it would return the
    similarity's map labelled as x0's (before: silently). Refused, pointing at ODAM; quantity="score" runs."""
    model = SmallDetector().eval()
    batch = images(1, seed=1, size=(32, 40))
    found = detect(model, batch, 2)
    method = explain.DRISE(model, masks=4, grid=4)
    with pytest.raises(ValueError, match=r"not by its x0.*ODAM\(model, layer, quantity='x0'\)"):
        method.explain(batch, target=InstanceTarget(found, model, quantity="x0"))
    scored = method.explain(batch, target=InstanceTarget(found, model))
    assert scored.raw_maps.shape == (1, 2, 32, 40) and float(scored.raw_maps.min()) >= 0


def test_grad_cam_of_a_clipped_faster_rcnn_box_coordinate_given_as_a_target_is_the_unclipped_regressions():
    """Not ODAM alone: any method given ``InstanceTarget(quantity="x0")`` differentiates torchvision's box before it
    is clipped. Grad-CAM's map, ReLU(Σ_k mean(G_k) A_k) with G the gradient of the straight-through clipped x0, by
    hand; before, the whole-image box's x0 map was empty. torchvision's clip function is left as found."""
    model = faster_rcnn()
    batch = images(2, seed=3)[:1]
    state = model_state(model)
    instances = detect(model, batch, 2)
    assert float(instances.boxes[0, 1, 0]) == 0  # the whole-image box: its x0 clipped to 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no empty map
        e = explain.GradCAM(model, LAYER).explain(batch, target=InstanceTarget(instances, model, SIZE, quantity="x0"))
    original = box_ops.clip_boxes_to_image
    captured = {}
    handle = dict(model.named_modules())[LAYER].register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("A", output))
    try:
        with mock.patch.object(box_ops, "clip_boxes_to_image",
                               lambda boxes, size: boxes + (original(boxes, size) - boxes).detach()):
            detections = model(batch)[0]
    finally:
        handle.remove()
    for k in range(2):
        row = int((detections["boxes"].detach() - instances.boxes[0, k]).abs().amax(dim=-1).argmin())
        gradient, = torch.autograd.grad(detections["boxes"][row, 0], captured["A"], retain_graph=True)
        cam = (gradient.mean(dim=(2, 3), keepdim=True) * captured["A"]).sum(dim=1)[0].clamp(min=0).detach()
        expected = F.interpolate(cam[None, None], size=SIZE, mode="bilinear", align_corners=False)[0, 0]
        assert float(expected.max()) > 0
        torch.testing.assert_close(e.raw_maps[0, k], expected, atol=1e-12, rtol=1e-4)
    assert model_state(model) == state
    assert box_ops.clip_boxes_to_image is original and original.__module__ == "torchvision.ops.boxes"
