"""Per-instance explanations of detectors attacked as a hostile user would: instances the detector cannot score,
boxes that match nothing, degenerate detections, detectors in training mode or without detections, SSD, and maps
checked against a hand-built detector whose answer is known (its scores depend on one cell of the image each)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import assert_state_equal, model_state
from detection_models import SmallDetector, faster_rcnn
from torch import nn

import explain
from explain.detection import Instances, InstanceTarget, detect

GRID, CELL = 4, 8  # the hand-built detector's 4 × 4 cells of 8 × 8 pixels of its 32 × 32 network input


class CellDetector(nn.Module):
    """A {"boxes", "scores"} detector whose answer is known: it resizes the image to 32 × 32 (bilinear, as a
    detector's preprocessing inside its forward), and each of its 4 × 4 cells is one candidate, its box the cell's
    area in the input's pixels, its class c scored sigmoid(4 · (the cell's mean of channel c) − 2). ``degenerate``:
    one more candidate with a box of no area scoring 0.99 in class 0."""

    def __init__(self, degenerate: bool = False):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(4.0))
        self.degenerate = degenerate

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        height, width = images.shape[-2:]
        small = F.interpolate(images, size=(GRID * CELL, GRID * CELL), mode="bilinear", align_corners=False)
        means = F.avg_pool2d(small, CELL)  # (N, 3, 4, 4)
        scores = (self.gain * means - 2).sigmoid().flatten(2).transpose(1, 2)  # (N, 16, 3)
        rows, cols = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
        x0, y0 = cols.flatten() * width / GRID, rows.flatten() * height / GRID
        boxes = torch.stack([x0, y0, x0 + width / GRID, y0 + height / GRID], dim=-1).to(images)
        boxes = boxes.expand(images.shape[0], -1, -1)
        if self.degenerate:
            flat = torch.tensor([[5.0, 5.0, 5.0, 9.0]]).to(images).expand(images.shape[0], 1, 4)
            boxes = torch.cat([boxes, flat], dim=1)
            top = torch.tensor([[[0.99, 0.0, 0.0]]]).to(scores).expand(images.shape[0], 1, 3)
            scores = torch.cat([scores, top], dim=1)
        return {"boxes": boxes, "scores": scores}


def cell_box(row: int, col: int, size: tuple[int, int]) -> torch.Tensor:
    height, width = size
    return torch.tensor([col * width / GRID, row * height / GRID, (col + 1) * width / GRID,
                         (row + 1) * height / GRID])


def scene(size: tuple[int, int] = (40, 100)) -> torch.Tensor:
    """Dim noise with bright cells: (1, 1) red, (2, 3) green, so that those two are the clear detections."""
    image = torch.rand(1, 3, *size, generator=torch.Generator().manual_seed(0)) * 0.2
    for (row, col), channel in (((1, 1), 0), ((2, 3), 1)):
        x0, y0, x1, y1 = cell_box(row, col, size).round().long().tolist()
        image[0, channel, y0:y1, x0:x1] = 1.0
    return image


def test_each_instances_map_is_its_score_gradient_and_sits_in_its_box_on_the_original_image():
    """An image of 40 × 100, resized by the detector to 32 × 32: each instance's Saliency map is max_c |∂s/∂x_c| of
    its own candidate's class score (autograd by hand), in the original image's pixels, and its mass lies in its box
    (dilated by the 2 pixels bilinear resizing reads around it)."""
    model, image = CellDetector().eval(), scene()
    explanation = explain.Saliency(model).explain(image, instances=2)
    assert explanation.class_indices.tolist() == [[0, 1]]
    for index, ((row, col), label) in enumerate((((1, 1), 0), ((2, 3), 1))):
        box = cell_box(row, col, (40, 100))
        assert torch.allclose(explanation.boxes[0, index], box)
        pixels = image.clone().requires_grad_()
        score = model(pixels)["scores"][0, row * GRID + col, label]
        expected = torch.autograd.grad(score, pixels)[0][0].abs().amax(dim=0)
        torch.testing.assert_close(explanation.raw_map_grid[0, index], expected)
        x0, y0, x1, y1 = box.tolist()
        inside = torch.zeros(40, 100, dtype=torch.bool)
        inside[max(int(y0) - 2, 0): int(y1) + 2, max(int(x0) - 2, 0): int(x1) + 2] = True
        mass = explanation.raw_map_grid[0, index]
        assert float(mass[inside].sum() / mass.sum()) > 0.999


def test_instances_the_detector_cannot_score_are_refused_not_clamped():
    """A class index outside the detector's classes was clamped to its last class (a map of another class, said as
    an empty region at best); a negative one, or instances for another number of images, failed inside torch."""
    model, image = CellDetector().eval(), scene()
    box = cell_box(1, 1, (40, 100))[None, None]

    def instances(label: int, images: int = 1, box: torch.Tensor = box) -> Instances:
        return Instances(box.expand(images, 1, 4), torch.full((images, 1), label), torch.full((images, 1), 0.5),
                         torch.ones(images, 1, dtype=torch.bool))

    with pytest.raises(ValueError, match="class index is 3: the detector scores 3 classes"):
        explain.Saliency(model).explain(image, instances=instances(3))
    with pytest.raises(ValueError, match="class index is -1"):
        explain.Saliency(model).explain(image, instances=instances(-1))
    with pytest.raises(ValueError, match="class index is 7"):
        explain.Saliency(model).explain(image, target=InstanceTarget(instances(7), model, image.shape[-2:]))
    two = image.expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="for 1 image"):
        explain.Saliency(model).explain(two, instances=instances(0))
    with pytest.raises(ValueError, match="holds instances for 1 image"):
        explain.Saliency(model).explain(two, target=InstanceTarget(instances(0), model, image.shape[-2:]))
    with pytest.raises(ValueError, match="box of an instance present must be finite"):
        explain.Saliency(model).explain(image, instances=instances(0, box=torch.full((1, 1, 4), float("nan"))))
    explanation = explain.Saliency(model).explain(image, instances=instances(0))  # a valid one still works
    assert explanation.class_indices.tolist() == [[0]] and float(explanation.raw_map_grid.sum()) > 0


def test_a_given_box_that_overlaps_no_detection_is_said_and_none_at_all_is_refused():
    """A box overlapping no candidate was made padding silently: an empty map titled 'no instance', no warning."""
    model, image = CellDetector().eval(), scene()
    found, nowhere = cell_box(1, 1, (40, 100)), torch.tensor([200.0, 200.0, 220.0, 220.0])
    with pytest.warns(RuntimeWarning, match=r"overlap no detection.*\(0, 1\) \[200.0, 200.0, 220.0, 220.0\]") as caught:
        explanation = explain.Saliency(model).explain(image, instances=torch.stack([found, nowhere]))
    assert any(warning.filename == __file__ for warning in caught)
    assert explanation.class_indices[0, 0] == 0 and float(explanation.raw_map_grid[0, 0].sum()) > 0
    assert float(explanation.raw_map_grid[0, 1].abs().sum()) == 0 and bool(explanation.boxes[0, 1].isnan().all())
    with pytest.raises(ValueError, match="no instance selected by the boxes given"):
        explain.Saliency(model).explain(image, instances=nowhere[None])


def test_drise_draws_no_map_for_an_instance_marked_absent():
    """D-RISE weighed every instance by its similarity, padding included: an instance given with present=False and a
    real box got a map although it is drawn as 'no instance'."""
    model, image = CellDetector().eval(), scene()
    boxes = torch.stack([cell_box(1, 1, (40, 100)), cell_box(2, 3, (40, 100))])[None]
    both = Instances(boxes, torch.tensor([[0, 1]]), torch.full((1, 2), 0.5), torch.tensor([[True, False]]))
    alone = Instances(boxes[:, :1], torch.tensor([[0]]), torch.full((1, 1), 0.5), torch.tensor([[True]]))
    drise = explain.DRISE(model, masks=32, grid=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padding is empty by design: no warning
        explanation = drise.explain(image, instances=both)
    assert float(explanation.raw_map_grid[0, 1].abs().sum()) == 0
    torch.testing.assert_close(explanation.raw_map_grid[0, :1], drise.explain(image, instances=alone).raw_map_grid[0])


def test_a_detection_whose_box_has_no_area_is_not_selected():
    """A box clipped to a side of the image has no area: no box overlaps it, so it can never be found again. It was
    selected (the highest score here) and explained as an empty map; now the detections with area are."""
    model, image = CellDetector(degenerate=True).eval(), scene()
    found = detect(model, image, 1)
    torch.testing.assert_close(found.boxes[0, 0], cell_box(1, 1, (40, 100)))
    assert not bool(((detect(model, image, "all").boxes[..., 2] - detect(model, image, "all").boxes[..., 0]) == 0)
                    .any())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explanation = explain.Saliency(model).explain(image, instances=1)
    assert float(explanation.raw_map_grid.sum()) > 0


def test_detect_runs_a_detector_left_in_training_mode_in_eval_mode_and_leaves_it_so():
    """torchvision detectors in training mode need targets (detect failed with torchvision's assertion); other
    detectors ran with dropout and batch statistics. detect now reads the eval-mode detections, modes restored."""
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    for model in (faster_rcnn(), SmallDetector()):
        expected = detect(model.eval(), image, 2)
        model.train()
        before = model_state(model)
        found = detect(model, image, 2)
        assert_state_equal(before, model_state(model))
        assert all(module.training for module in model.modules())
        torch.testing.assert_close(found.boxes, expected.boxes)
        torch.testing.assert_close(found.scores, expected.scores)


def test_a_torchvision_training_output_is_refused_with_what_to_do():
    model = faster_rcnn().train()
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    losses = model(list(image), [{"boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]), "labels": torch.tensor([1])}])
    model.eval()
    with pytest.raises(ValueError, match="loss_classifier.*in training mode it returns its losses.*model.eval"):
        detect(model, image, 2, output=losses)


def test_a_torchvision_detector_without_detections_names_its_own_threshold():
    """It said 'the highest score is nan: give a lower threshold, or instances=k', neither of which helps."""
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=64, max_size=64, box_score_thresh=1.0).eval()
    image = torch.rand(1, 3, 64, 64)
    for spec in ("all", 3):
        with pytest.raises(ValueError, match=r"^no instance selected.*roi_heads.score_thresh = 1.0.*box_score_thresh"):
            explain.Saliency(model).explain(image, instances=spec)


class TinyBackbone(nn.Module):
    """Two feature maps (stride 8 and 16) for a small SSD."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Conv2d(3, 8, 3, stride=8, padding=1), nn.ReLU())
        self.second = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        first = self.first(images)
        return {"0": first, "1": self.second(first)}


def test_ssd_detections_are_read_and_explained_as_their_own_score():
    """SSD and SSDlite keep their class count as num_columns: explain could not read them at all."""
    detection = torchvision.models.detection
    torch.manual_seed(0)
    anchors = detection.anchor_utils.DefaultBoxGenerator([[2], [2]])
    head = detection.ssd.SSDHead([8, 8], anchors.num_anchors_per_location(), 5)
    model = detection.ssd.SSD(TinyBackbone(), anchors, (64, 64), 5, head=head, score_thresh=0.0,
                              detections_per_img=20).eval()
    image = torch.rand(1, 3, 48, 80)
    with torch.no_grad():
        output = model(image)[0]
    found = detect(model, image, 2)
    for box, label, score in zip(found.boxes[0], found.classes[0], found.scores[0]):
        same = (output["boxes"] - box).abs().amax(dim=-1) < 1e-5
        assert bool((same & (output["labels"] == label) & ((output["scores"] - score).abs() < 1e-6)).any())
    assert float(found.scores[0, 0]) == float(output["scores"].max())
    explanation = explain.Saliency(model).explain(image, instances=found)
    pixels = image.clone().requires_grad_()
    again = model(pixels)[0]
    row = int(((again["boxes"].detach() - found.boxes[0, 0]).abs().amax(dim=-1) < 1e-5).nonzero()[0])
    expected = torch.autograd.grad(again["scores"][row], pixels)[0][0].abs().amax(dim=0)
    torch.testing.assert_close(explanation.raw_map_grid[0, 0], expected, rtol=1e-4, atol=1e-7)


def test_boxes_of_a_different_count_per_image_are_refused_with_what_to_do():
    """A ragged list of per-image boxes failed with torch's 'expected sequence of length 1 at dim 1 (got 2)'."""
    model, image = CellDetector().eval(), scene().expand(2, -1, -1, -1)
    ragged = [[cell_box(1, 1, (40, 100)).tolist()], [cell_box(1, 1, (40, 100)).tolist(), [0.0, 0.0, 5.0, 5.0]]]
    with pytest.raises(ValueError, match="the same K for every image: give explain.detection.Instances"):
        explain.Saliency(model).explain(image, instances=ragged)
