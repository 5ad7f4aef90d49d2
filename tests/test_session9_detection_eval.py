"""Per-instance detector evaluation attacked as a hostile user would (session 9): SESS refusing instances (its
windows are not the image whose pixels the boxes are in), ``explain.evaluate`` taking boxes as an ndarray or nested
lists exactly as a tensor, and given boxes that overlap a detection too little for the explanations to find it (an
empty map's values, counted in the means, before) left out with a warning. As specifications: the same values
reached another way, or IoUs computed by hand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from detection_models import SmallDetector
from torchvision.ops import box_iou

import explain
from explain.detection import InstanceTarget, detect

METRICS = ["instance_pointing_game", "instance_energy"]
BOXES = [[4.0, 4.0, 16.0, 16.0], [100.0, 100.0, 120.0, 120.0]]  # the second outside the 32 × 32 images


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def evaluated(model, images, boxes) -> tuple[dict[str, torch.Tensor], list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = explain.evaluate(model, ["saliency"], images, METRICS, instances=boxes, progress=False).values
    return values["saliency"], caught


def unmatched_warnings(caught) -> list[warnings.WarningMessage]:
    return [record for record in caught if "overlap no detection" in str(record.message)]


def test_sess_refuses_instances_and_leaves_the_model_as_found(images):
    """A square image at one scale is one window of the image's own size, so nothing failed before: the map was
    SESS's of windows rescaled, its instances matched in window pixels. Refused now, naming the methods to use, and
    an InstanceTarget given as target= too."""
    image = images[:1]
    model = SmallDetector().eval()
    model.dropout.train()  # a mode the call must give back
    before = model_state(model)
    sess = explain.SESS(model, "features.4", num_scales=1, reshape="channels_first")
    with pytest.raises(ValueError, match=r"SESS cannot explain detected instances.*GradCAM.*ODAM.*DRISE.*Saliency"):
        sess.explain(image, instances=2)
    assert_state_equal(before, model_state(model))
    target = InstanceTarget(detect(model, image, 2), model)
    with pytest.raises(ValueError, match=r"SESS cannot explain detected instances"):
        sess.explain(image, target=target)
    assert_state_equal(before, model_state(model))


def test_evaluate_takes_boxes_as_an_ndarray_or_lists_as_a_tensor(images):
    """The same values and the same warning (at the caller's line) for the box outside the images, whatever holds
    the boxes; the values are the metrics of the explanation of the same instances made by hand."""
    model = SmallDetector().eval()
    tensor = torch.tensor(BOXES)
    from_tensor, caught = evaluated(model, images, tensor)
    assert [record.filename for record in unmatched_warnings(caught)] == [__file__]
    assert "2 of the 4 given boxes" in str(unmatched_warnings(caught)[0].message)
    for boxes in (tensor.numpy().astype(np.float64), BOXES, tensor[0].numpy()):
        values, caught = evaluated(model, images, boxes)
        expected = 2 if len(np.shape(boxes)) == 2 else 0
        assert len(unmatched_warnings(caught)) == (1 if expected else 0)
        reference = from_tensor if expected else {name: value[0::2] for name, value in from_tensor.items()}
        for name in METRICS:
            torch.testing.assert_close(values[name], reference[name], equal_nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explanation = explain.Saliency(model).explain(images, instances=tensor)
    maps, boxes = explain.metrics.instance_boxes(explanation)
    expected_energy = explain.metrics.energy_pointing_game(maps, boxes).double()
    kept = from_tensor["instance_energy"][~from_tensor["instance_energy"].isnan()]
    torch.testing.assert_close(kept, expected_energy)
    assert torch.isnan(from_tensor["instance_energy"][1::2]).all()


def test_evaluate_refuses_boxes_per_image_as_an_ndarray(images):
    """(N, K, 4) boxes belong to one batch: refused as an ndarray as they are as a tensor."""
    model = SmallDetector().eval()
    per_image = np.array([BOXES, BOXES], dtype=np.float32)
    for boxes in (torch.from_numpy(per_image), per_image, per_image.tolist()):
        with pytest.raises(ValueError, match=r"\(N, K, 4\) boxes belong to one batch"):
            explain.evaluate(model, ["saliency"], images, METRICS, instances=boxes, progress=False)


def test_boxes_overlapping_a_detection_too_little_are_left_out(images):
    """A box that overlaps detections, but none by IoU ≥ 0.5 (by hand), is never found by the explanation: its map is
    empty, and its values were an empty map's (0 here), counted in the means. NaN now, and said."""
    model = SmallDetector().eval()
    box = torch.tensor([14.0, 10.0, 30.0, 26.0])
    with torch.no_grad():
        output = model(images)
    overlaps = torch.stack([box_iou(box[None], found)[0] for found in output["boxes"]])
    assert float(overlaps.max()) < 0.5 and bool((overlaps > 0).any(dim=1).all())  # overlaps some, none enough
    values, caught = evaluated(model, images, torch.stack([torch.tensor(BOXES[0]), box]))
    assert len(unmatched_warnings(caught)) == 1 and "IoU ≥ 0.5" in str(unmatched_warnings(caught)[0].message)
    assert "2 of the 4 given boxes" in str(unmatched_warnings(caught)[0].message)
    for name in METRICS:
        assert all(math.isnan(value) for value in values[name][1::2].tolist())
        assert not any(math.isnan(value) for value in values[name][0::2].tolist())
    assert not [record for record in caught if "zero everywhere" in str(record.message)]
