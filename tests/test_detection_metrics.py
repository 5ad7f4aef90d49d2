"""D-RISE's deletion and insertion per detected instance (Petsiuk et al. 2021, section 4), as specifications: at each
step, the largest D-RISE similarity (IoU × cos(class vectors) × objectness) of the instance to the perturbed image's
detections, computed here by hand from each family's documented output (tests/detection_models.py), one perturbed
image at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, model_state
from detection_models import DETECTORS, SmallDetector, decoded
from torchvision.ops import box_iou

import explain
from explain.detection import detect
from explain.metrics import instance_boxes, instance_deletion, instance_insertion

SIZE = (64, 64)
STEPS = 4


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(2, 3, *SIZE, generator=torch.Generator().manual_seed(5))


def best_similarity(name: str, model, image: torch.Tensor, box: torch.Tensor, label: int) -> float:
    """max over the image's candidates j of IoU(box, box_j) × v_j[label] / ‖v_j‖ × objectness_j (no IoU gate)."""
    with torch.no_grad():
        boxes, _, vectors, objectness = decoded(name, model, model(image[None]), SIZE)
    if len(boxes) == 0:
        return 0.0
    overlaps = box_iou(box[None].float(), boxes.float())[0]
    cosine = vectors[:, label].float() / vectors.float().norm(dim=-1).clamp_min(1e-12)
    return float((overlaps * cosine * objectness.float()).max())


def curve_by_hand(name, model, image, heat, box, label, insertion: bool, fill: torch.Tensor) -> list[float]:
    """The pixels in order of ``heat`` (highest first), changed in STEPS equal steps of round(s · P / STEPS)."""
    pixels = heat.numel()
    order = heat.flatten().argsort(descending=True, stable=True)
    values = []
    for step in range(STEPS + 1):
        changed = torch.zeros(pixels, dtype=torch.bool)
        changed[order[:round(step * pixels / STEPS)]] = True
        changed = changed.view(1, *heat.shape)
        perturbed = torch.where(changed, image, fill) if insertion else torch.where(changed, fill, image)
        values.append(best_similarity(name, model, perturbed, box, label))
    return values


def trapezoid(values: list[float]) -> float:
    return sum((a + b) / 2 for a, b in zip(values[:-1], values[1:])) / (len(values) - 1)


@pytest.mark.parametrize("name", ["small", "yolov8n", "faster_rcnn"])
@pytest.mark.parametrize("insertion", [False, True], ids=["deletion", "insertion"])
def test_each_instance_curve_is_its_best_similarity_to_the_perturbed_detections(name, insertion, images):
    model = DETECTORS[name][0]()
    # input × gradient: a value per pixel, no ties in the order (which the metric breaks at random, seeded)
    explanation = explain.InputXGradient(model).explain(images, instances=2)
    before = model_state(model)
    metric = instance_insertion if insertion else instance_deletion
    curve = metric(model, images, explanation, steps=STEPS, substrate=0.25)
    assert_state_equal(before, model_state(model))
    maps, _ = instance_boxes(explanation)
    assert curve.curves.shape == (maps.shape[0], STEPS + 1) and curve.area.shape == (maps.shape[0],)
    torch.testing.assert_close(curve.fractions, torch.tensor([round(s * 4096 / STEPS) / 4096 for s in range(5)]))
    row = 0
    for image in range(2):
        for instance in range(2):
            box = explanation.boxes[image, instance]
            if bool(box.isnan().any()):
                continue
            label = int(explanation.class_indices[image, instance])
            expected = curve_by_hand(name, model, images[image], explanation.maps[image, instance], box, label,
                                     insertion, torch.full_like(images[image], 0.25))
            torch.testing.assert_close(curve.curves[row], torch.tensor(expected), atol=1e-4, rtol=1e-4)
            assert float(curve.area[row]) == pytest.approx(trapezoid(expected), abs=1e-4)
            row += 1
    assert row == maps.shape[0]


def test_nothing_changed_and_everything_changed_are_the_ends_of_the_curves(images):
    """Deletion starts at the instance's best similarity on its own image and insertion ends there."""
    model = SmallDetector().eval()
    explanation = explain.GradCAM(model, "features.4", relu=False).explain(images, instances=3)
    deletion = instance_deletion(model, images, explanation, steps=STEPS)
    insertion = instance_insertion(model, images, explanation, steps=STEPS)
    found = detect(model, images, 3)
    with torch.no_grad():
        scores = model(images)["scores"]
    for row, (image, instance) in enumerate(found.present.nonzero().tolist()):
        box, label = found.boxes[image, instance], int(found.classes[image, instance])
        own = best_similarity("small", model, images[image], box, label)
        assert float(deletion.curves[row, 0]) == pytest.approx(own, abs=1e-5)
        assert float(insertion.curves[row, -1]) == pytest.approx(own, abs=1e-5)
        # the detection itself is a candidate: IoU 1 × s / ‖v‖ × s (its class is its top one) ≥ s² / max ‖v‖
        assert own >= float(found.scores[image, instance]) ** 2 / float(scores[image].norm(dim=-1).max()) - 1e-5


def test_an_explanation_without_instances_or_of_other_images_is_refused(images):
    model = SmallDetector().eval()
    classifier = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    of_classes = explain.GradCAM(classifier, "0").explain(images)
    with pytest.raises(ValueError, match="instances="):
        instance_deletion(model, images, of_classes)
    explanation = explain.GradCAM(model, "features.4", relu=False).explain(images, instances=1)
    with pytest.raises(ValueError, match="images"):
        instance_insertion(model, images[:1], explanation)
    with pytest.raises(ValueError, match="steps"):
        instance_deletion(model, images, explanation, steps=0)


# ------------------------------------------------------------------ explain.evaluate with a detector


@pytest.fixture(scope="module")
def scenes() -> torch.Tensor:
    from explain.data import make_detection_scenes
    from explain.data.train import to_model_input

    return to_model_input(make_detection_scenes(5, seed=5).images)


def demo_methods(model) -> dict:
    from explain.data.demo_detector import DETECTOR_CAM_LAYER

    return {"odam": explain.ODAM(model, DETECTOR_CAM_LAYER), "gradcam": explain.GradCAM(model, DETECTOR_CAM_LAYER)}


def test_evaluate_scores_every_method_on_the_same_instances_as_the_metrics_called_directly(scenes):
    """Each batch's instances are detected once; each method's values are the metric functions' on its explanation
    of those instances, one per instance slot (image × K + instance), NaN for padding."""
    from explain.data import load_demo_detector

    model = load_demo_detector()
    before = model_state(model)
    result = explain.evaluate(model, demo_methods(model), (scenes, None), instances="all", batch_size=3,
                              progress=False)
    assert_state_equal(before, model_state(model))
    assert [metric.name for metric in result.metrics] == ["instance_deletion", "instance_insertion",
                                                          "instance_pointing_game", "instance_energy"]
    for method, explainer in demo_methods(model).items():
        expected: dict[str, list[float]] = {name: [] for name in ("instance_deletion", "instance_energy")}
        for start in (0, 3):
            batch = scenes[start:start + 3]
            explanation = explainer.explain(batch, instances=detect(model, batch, "all"))
            present = ~explanation.boxes.isnan().any(dim=-1).flatten()
            deletion = torch.full((present.numel(),), float("nan"), dtype=torch.float64)
            deletion[present] = instance_deletion(model, batch, explanation).area.double()
            energy = torch.full((present.numel(),), float("nan"), dtype=torch.float64)
            energy[present] = explain.metrics.energy_pointing_game(*instance_boxes(explanation)).double()
            expected["instance_deletion"] += deletion.tolist()
            expected["instance_energy"] += energy.tolist()
        for name, values in expected.items():
            torch.testing.assert_close(result.values[method][name], torch.tensor(values, dtype=torch.float64),
                                       equal_nan=True, atol=1e-6, rtol=1e-5)
    assert result.mean("odam", "instance_energy") > result.mean("gradcam", "instance_energy")


def test_an_evaluation_of_instances_resumes_and_refuses_other_instances(scenes, tmp_path):
    from explain.data import load_demo_detector

    model = load_demo_detector()
    options = {"metrics": ["instance_pointing_game", "instance_energy"], "batch_size": 2, "progress": False}
    first = explain.evaluate(model, demo_methods(model), scenes, instances=2, out=tmp_path, **options)
    again = explain.evaluate(model, demo_methods(model), scenes, instances=2, out=tmp_path, **options)
    for method in first.values:
        for name in first.values[method]:
            torch.testing.assert_close(first.values[method][name], again.values[method][name], equal_nan=True)
    assert first.values["odam"]["instance_energy"].shape == (10,)  # 5 images × 2 instances
    with pytest.raises(ValueError, match="instances"):
        explain.evaluate(model, demo_methods(model), scenes, instances=3, out=tmp_path, **options)


def test_evaluate_refuses_what_does_not_fit_a_detector_or_a_classifier(scenes):
    from explain.data import load_demo_detector

    model = load_demo_detector()
    methods = demo_methods(model)
    with pytest.raises(ValueError, match="per-instance metrics"):
        explain.evaluate(model, methods, scenes, instances="all", metrics=["deletion"], progress=False)
    with pytest.raises(ValueError, match="give instances="):
        explain.evaluate(model, methods, (scenes, torch.zeros(5, dtype=torch.long)), metrics=["instance_energy"],
                         progress=False)
    with pytest.raises(ValueError, match="one batch"):
        explain.evaluate(model, methods, scenes, instances=detect(model, scenes, 2), progress=False)
    with pytest.raises(ValueError, match="selects no instance"):
        explain.evaluate(model, methods, scenes, instances=0.999999, metrics=["instance_energy"], progress=False)
    classifier = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(ValueError, match="detector"):
        explain.evaluate(classifier, ["saliency"], scenes, instances="all", progress=False)


def test_methods_named_for_a_loaded_detector_explain_at_its_own_layer(scenes):
    """explain.load_model("demo-detector") names its CAM layer: methods given by name use it (the layer found by
    default would be one of the heads, which the class score does not depend on)."""
    loaded = explain.load_model("demo-detector")
    options = {"instances": 2, "metrics": ["instance_energy"], "progress": False}
    named = explain.evaluate(loaded, ["odam"], scenes, **options)
    given = explain.evaluate(loaded.model, demo_methods(loaded.model), scenes, **options)
    torch.testing.assert_close(named.values["odam"]["instance_energy"], given.values["odam"]["instance_energy"])


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_the_per_instance_metrics_called_inside_no_grad_or_inference_mode_give_the_values_outside(scenes, context):
    from explain.data import load_demo_detector
    from explain.dataset_tools.evaluation import METRICS, MetricInput

    model = load_demo_detector()
    explainer = demo_methods(model)["odam"]
    found = detect(model, scenes[:2], 2)
    given = MetricInput(model, explainer, scenes[:2], explainer.explain(scenes[:2], instances=found),
                        found.classes.flatten(), None)
    for name, metric in METRICS.items():
        if metric.per_instance:
            outside = metric.compute(given)
            with context():
                inside = metric.compute(given)
            assert outside.shape == (4,)
            torch.testing.assert_close(inside, outside, rtol=0, atol=0, equal_nan=True, msg=name)


class OneCornerDetector(torch.nn.Module):
    """A {"boxes", "scores"} detector with one candidate, the top-left 16 × 16 box, scored by the image's mean."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Conv2d(3, 2, 1)

    def forward(self, images):
        scores = self.features(images).mean(dim=(2, 3)).sigmoid()[:, None]  # (N, 1, 2)
        boxes = torch.tensor([[0.0, 0.0, 16.0, 16.0]]).expand(images.shape[0], 1, 4)
        return {"boxes": boxes, "scores": scores}


def test_given_boxes_no_detection_overlaps_are_said_not_silently_left_out(images):
    model = OneCornerDetector().eval()
    boxes = torch.tensor([[0.0, 0.0, 16.0, 16.0], [40.0, 40.0, 60.0, 60.0]])
    with pytest.warns(RuntimeWarning, match="1 of the 4 given boxes|2 of the 4 given boxes") as caught:
        result = explain.evaluate(model, {"saliency": explain.Saliency(model)}, images, ["instance_energy"],
                                  instances=boxes, progress=False)
    assert any(warning.filename == __file__ for warning in caught if "given boxes" in str(warning.message))
    values = result.values["saliency"]["instance_energy"]
    assert values.shape == (4,) and bool(values[1::2].isnan().all()) and not bool(values[0::2].isnan().any())
