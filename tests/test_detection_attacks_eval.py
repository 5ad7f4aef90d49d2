"""Hostile inputs for the detection features: LRP per instance on detectors whose output is one dict per image
(torchvision), D-RISE's deletion / insertion given a loaded model, and ``explain.evaluate`` per instance with data in
every form it takes. As specifications: by-hand values, or the same values reached another way."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_state_equal, model_state
from detection_models import DETECTORS, SmallDetector
from torch.utils.data import DataLoader, TensorDataset
from torchvision.ops import box_iou

import explain
from explain.metrics import instance_deletion, instance_insertion

SIZE = (64, 64)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 3, *SIZE, generator=torch.Generator().manual_seed(3))


def torchvision_matched_scores(model, images: torch.Tensor, explanation) -> torch.Tensor:
    """(N, K) by hand: the score of the detection most similar to each instance (torchvision's class vector is one-hot
    × score, so D-RISE's similarity is IoU × score for a detection of the instance's class, among IoU ≥ 0.5)."""
    with torch.no_grad():
        output = model(images)
    expected = torch.zeros(explanation.boxes.shape[:2], dtype=torch.float64)
    for image, detections in enumerate(output):
        for instance, box in enumerate(explanation.boxes[image]):
            label = int(explanation.class_indices[image, instance])
            overlaps = box_iou(box[None], detections["boxes"])[0]
            similarity = overlaps * detections["scores"] * (detections["labels"] == label)
            similarity[overlaps < 0.5] = 0
            expected[image, instance] = float(detections["scores"][similarity.argmax()])
    return expected


@pytest.mark.parametrize("name", ["faster_rcnn", "retinanet"])
def test_lrp_of_a_detector_returning_a_dict_per_image_starts_from_each_images_matched_score(name, images):
    """torchvision's output is a list of one dict per image, whose tensors' first dimension is the image's detections,
    not the batch: the relevance the propagation starts from (output_relevance) is summed per image, and equals the
    instance's matched detection score (R = score × 1 at it, 0 at the boxes). Its forward iterates over the batch,
    which the trace cannot follow: the call says the map is not LRP (it did not before)."""
    model = DETECTORS[name][0]()
    before = model_state(model)
    with pytest.warns(RuntimeWarning, match="cannot follow") as caught:
        explanation = explain.LRP(model, composite="epsilon_plus").explain(images, instances=2)
    assert all(record.filename == __file__ for record in caught if "cannot follow" in str(record.message))
    assert_state_equal(before, model_state(model))
    present = ~explanation.boxes.isnan().any(dim=-1)
    assert bool(present.all())
    expected = torchvision_matched_scores(model, images, explanation)
    torch.testing.assert_close(explanation.diagnostics["output_relevance"], expected, atol=1e-6, rtol=1e-5)


def test_lrp_of_a_detector_it_follows_gives_no_warning_and_the_matched_score():
    """The same bookkeeping on a batch-first {"boxes", "scores"} output that the trace follows: no warning, and the
    relevance started from is the matched class score (explanation.scores)."""
    model = SmallDetector().eval()
    batch = torch.rand(3, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explanation = explain.LRP(model, composite="epsilon_plus").explain(batch, instances=2)
    torch.testing.assert_close(explanation.diagnostics["output_relevance"], explanation.scores.double(),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("metric", [instance_deletion, instance_insertion], ids=["deletion", "insertion"])
def test_the_per_instance_curves_take_a_loaded_model_as_its_module_and_preprocessing(metric):
    """explain.load_model's result is what the methods take; the metrics took only its module (an AttributeError
    before). Given raw images, the loaded model's curves equal the module's with its preprocess, and the module's on
    the model-input batch."""
    from explain.data import make_detection_scenes

    loaded = explain.load_model("demo-detector")
    raw = make_detection_scenes(2, seed=3).images
    explanation = explain.ODAM(loaded).explain(raw, instances=2)
    before = model_state(loaded.model)
    given_loaded = metric(loaded, raw, explanation, steps=3)
    assert_state_equal(before, model_state(loaded.model))
    given_module = metric(loaded.model, raw, explanation, steps=3, preprocess=loaded.preprocess)
    batch = torch.stack([loaded.preprocess(image) for image in raw])
    given_batch = metric(loaded.model, batch, explanation, steps=3)
    assert given_loaded.area.shape == (4,)
    torch.testing.assert_close(given_loaded.curves, given_module.curves)
    torch.testing.assert_close(given_loaded.curves, given_batch.curves, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="nn.Module"):
        metric("demo-detector", raw, explanation)


def test_evaluate_per_instance_reads_every_form_of_data_alike_and_skips_a_batch_without_instances():
    """Data as a tensor, a DataLoader of (images, labels) or (images,), a list of batches: the same values; a batch
    where nothing reaches the threshold adds no slot (and no value) between batches that have some."""
    from explain.data import load_demo_detector, make_detection_scenes
    from explain.data.demo_detector import DETECTOR_CAM_LAYER
    from explain.data.train import to_model_input
    from explain.detection import detect

    model = load_demo_detector()
    scenes = to_model_input(make_detection_scenes(4, seed=5).images)
    methods = {"odam": explain.ODAM(model, DETECTOR_CAM_LAYER)}
    options = {"metrics": ["instance_energy"], "instances": 0.5, "progress": False}
    blank = torch.full_like(scenes[:2], float(scenes.min()))
    assert float(detect(model, blank, 1).scores.max()) < 0.5
    data = torch.cat([scenes[:2], blank, scenes[2:]])
    reference = explain.evaluate(model, methods, data, batch_size=2, **options).values["odam"]["instance_energy"]
    labels = torch.zeros(len(data), dtype=torch.long)
    for given in (DataLoader(TensorDataset(data, labels), batch_size=2), DataLoader(TensorDataset(data), batch_size=2),
                  [data[:2], data[2:4], data[4:]]):
        values = explain.evaluate(model, methods, given, **options).values["odam"]["instance_energy"]
        torch.testing.assert_close(values, reference, equal_nan=True, atol=1e-6, rtol=1e-5)
    expected = []
    for start in (0, 4):
        batch = data[start:start + 2]
        explanation = methods["odam"].explain(batch, instances=detect(model, batch, 0.5))
        present = ~explanation.boxes.isnan().any(dim=-1).flatten()
        slot = torch.full((present.numel(),), float("nan"), dtype=torch.float64)
        slot[present] = explain.metrics.energy_pointing_game(*explain.metrics.instance_boxes(explanation)).double()
        expected += slot.tolist()
    torch.testing.assert_close(reference, torch.tensor(expected, dtype=torch.float64), equal_nan=True,
                               atol=1e-6, rtol=1e-5)
