"""LRP and AttnLRP of a detected instance: the relevance starts at the instance's matched class score (R = output ⊙
∂score/∂output on each tensor of the detector's output) and follows the same rules as for a classifier. As a
specification: each instance's map equals the map of the same method on the detector cut down to a classifier whose
output is the matched candidate's row (found by hand with D-RISE's similarity), for that class."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, model_state
from detection_models import DETECTORS, SmallDetector
from torch import nn
from torchvision.ops import box_iou

import explain

SIZE = (64, 64)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 3, *SIZE, generator=torch.Generator().manual_seed(9))


class OneCandidate(nn.Module):
    """The detector's output reduced to one candidate's row of class scores, (N, C): a classifier."""

    def __init__(self, detector: nn.Module, read: str, candidate: int):
        super().__init__()
        self.detector, self.read, self.candidate = detector, read, candidate

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        output = self.detector(images)
        if self.read == "scores":  # {"boxes", "scores"}: sigmoid scores of the model
            return output["scores"][:, self.candidate]
        return output.logits[:, self.candidate]  # DETR: the logits, softmax in the target as explain reads them


def small_match(output, box: torch.Tensor, label: int) -> int:
    """D-RISE's match among a {"boxes", "scores"} model's candidates, by hand: IoU × cos(one-hot class, scores) ×
    objectness (the highest score), among those overlapping by IoU ≥ 0.5."""
    scores = output["scores"][0]
    overlaps = box_iou(box[None], output["boxes"][0])[0]
    similarity = overlaps * scores[:, label] / scores.norm(dim=-1) * scores.max(dim=-1).values
    similarity[overlaps < 0.5] = 0
    return int(similarity.argmax())


def detr_match(output, box: torch.Tensor, label: int) -> int:
    """D-RISE's match among DETR's queries (Petsiuk et al. 2021), by hand: the query maximising IoU × cos(one-hot
    class, the query's softmax over the classes and "no object"), among those overlapping by IoU ≥ 0.5 (random
    queries are near duplicates: another than the detection itself may match best)."""
    probabilities = output.logits[0].softmax(-1)
    overlaps = box_iou(box[None], xyxy_pixels(output.pred_boxes[0]))[0]
    similarity = overlaps * probabilities[:, label] / probabilities.norm(dim=-1)
    similarity[overlaps < 0.5] = 0
    return int(similarity.argmax())


def xyxy_pixels(centre_size: torch.Tensor) -> torch.Tensor:
    x, y, width, height = centre_size.unbind(-1)
    corners = torch.stack([x - width / 2, y - height / 2, x + width / 2, y + height / 2], dim=-1)
    return corners * corners.new_tensor([SIZE[1], SIZE[0], SIZE[1], SIZE[0]])


@pytest.mark.parametrize("method", ["lrp", "attnlrp"])
def test_an_instances_relevance_is_that_of_its_candidate_read_as_a_classifier(method, images):
    model = SmallDetector().eval()
    make = explain.get_method(method)
    before = model_state(model)
    explanation = make(model).explain(images[:1], instances=2)
    assert_state_equal(before, model_state(model))
    with torch.no_grad():
        output = model(images[:1])
    for instance in range(2):
        box, label = explanation.boxes[0, instance], int(explanation.class_indices[0, instance])
        reduced = OneCandidate(model, "scores", small_match(output, box, label)).eval()
        expected = make(reduced).explain(images[:1], target=label)
        torch.testing.assert_close(explanation.attributions[0, instance], expected.attributions[0, 0],
                                   atol=1e-7, rtol=1e-5)


def test_attnlrp_through_detrs_transformer_is_that_of_the_matched_query(images):
    """DETR (HuggingFace, random weights): AttnLRP's rules through the backbone, the encoder and the decoder; the
    instance's score is the softmax over the query's classes and "no object", as explain reads DETR."""
    model = DETECTORS["detr"][0]()
    explanation = explain.AttnLRP(model).explain(images[:1], instances=1)
    box, label = explanation.boxes[0, 0], int(explanation.class_indices[0, 0])
    with torch.no_grad():
        output = model(images[:1])
    reduced = OneCandidate(model, "logits", detr_match(output, box, label)).eval()
    expected = explain.AttnLRP(reduced).explain(images[:1], target=lambda logits: logits.softmax(-1)[:, label])
    scale = float(expected.attributions.abs().max())
    assert scale > 0
    torch.testing.assert_close(explanation.attributions[0, 0] / scale, expected.attributions[0, 0] / scale,
                               atol=1e-6, rtol=1e-5)


def test_lrp_of_a_detector_says_what_it_has_no_rule_for():
    """DETR's attention and layer norms have no LRP rule: the map is not LRP there, and the call says so (and names
    AttnLRP); a detector output without instances= is refused with what to give."""
    model = DETECTORS["detr"][0]()
    with pytest.warns(RuntimeWarning, match="AttnLRP"):
        explain.LRP(model).explain(torch.rand(1, 3, *SIZE), instances=1)
    with pytest.raises(ValueError, match="instances="):
        explain.LRP(model).explain(torch.rand(1, 3, *SIZE))
