"""Reliability of per-instance explanations of object detectors (``explain(..., instances=...)``, ODAM, D-RISE): the
guarantees of docs/guarantees.md (model left as found after success, failure and Ctrl-C; the caller's grad mode,
inference mode and autocast; threads; flat memory; batch independence; clear errors for bad input; instances that
disappear said) checked on the small {"boxes", "scores"} detector of tests/detection_models.py, and on YOLOv8n and
Faster R-CNN (random weights) for the rule on other families."""

from __future__ import annotations

import gc
import os
import re
import tracemalloc
import warnings
from typing import Any, Callable

import psutil
import pytest
import torch
from conftest import ServingThread, SmallCNN, assert_state_equal, errors_in_threads, model_state
from detection_models import DETECTORS, SmallDetector
from test_reliability import live_tensors
from torch import nn
from torchvision.ops import box_iou

import explain
from explain.detection import Instances, InstanceTarget, detect

LAYER = "features.4"
"""The CAM layer of SmallDetector: 16 channels at half the input's resolution (a 40 × 40 input: 20 × 20, never
mistaken for channels last)."""


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test on one torch thread: small models on a shared CPU."""


def scene(seed: int) -> torch.Tensor:
    """(1, 3, 40, 40): a dim noisy background with three bright squares of random colours."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(1, 3, 40, 40, generator=generator) * 0.2
    for _ in range(3):
        top, left = torch.randint(0, 28, (2,), generator=generator).tolist()
        image[0, :, top:top + 10, left:left + 10] = torch.rand(3, 1, 1, generator=generator) * 3
    return image


def scenes(*seeds: int) -> torch.Tensor:
    return torch.cat([scene(seed) for seed in seeds])


def detector(seed: int = 0) -> SmallDetector:
    """SmallDetector whose heads are rescaled so that it behaves as a trained detector would: with random weights
    every candidate scores 0.53 ± 0.001 for the same class and has the same box size; here each head's output is
    standardised on two calibration scenes, so that scores spread over (0, 1) (a few candidates per image above
    0.5, three classes) and box sizes follow the image (they change on perturbed copies, where instances can
    disappear)."""
    model = SmallDetector(seed=seed).eval()
    outputs: dict[str, torch.Tensor] = {}
    hooks = [model.classify.register_forward_hook(lambda module, args, output: outputs.setdefault("classify", output)),
             model.size.register_forward_hook(lambda module, args, output: outputs.setdefault("size", output))]
    with torch.no_grad():
        model(scenes(100, 101))
        for hook in hooks:
            hook.remove()
        for name, gain, shift in (("classify", 3.0, -5.0), ("size", 1.5, 0.0)):
            conv = getattr(model, name)
            mean, std = outputs[name].mean(dim=(0, 2, 3)), outputs[name].std(dim=(0, 2, 3))
            conv.weight.mul_((gain / std)[:, None, None, None])
            conv.bias.copy_((conv.bias - mean) * gain / std + shift)
    return model


def small_methods(model: nn.Module, layer: str = LAYER, scorecam: bool = True) -> dict[str, Callable[[], object]]:
    """The methods checked, with few masks and steps so that calls stay fast."""
    methods = {
        "odam": lambda: explain.ODAM(model, layer),
        "drise": lambda: explain.DRISE(model, masks=8, batch_size=4),
        "gradcam": lambda: explain.GradCAM(model, layer),
        "saliency": lambda: explain.Saliency(model),
        "integratedgradients": lambda: explain.IntegratedGradients(model, steps=4),
    }
    if scorecam:
        methods["scorecam"] = lambda: explain.ScoreCAM(model, layer, progress=False)
    return methods


METHODS = list(small_methods(nn.Identity()))


def sliced(instances: Instances, images: slice = slice(None), columns: slice = slice(None)) -> Instances:
    """Some images' or some instances' part of ``instances``."""
    return Instances(instances.boxes[images, columns], instances.classes[images, columns],
                     instances.scores[images, columns], instances.present[images, columns])


def quietly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """function(*args, **kwargs) with the package's RuntimeWarnings (zero maps, disappearing instances) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return function(*args, **kwargs)


def raising_on_call(number: int, error: BaseException):
    """A forward hook that raises ``error`` on its ``number``-th call."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == number:
            raise error

    return hook


class ModelFailure(Exception):
    """What a hook raises to make the model's forward fail."""


def no_global_mode_left() -> bool:
    return (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and not torch._C._is_torch_function_mode_enabled())


def check_left_as_found(model: nn.Module, make: Callable[[], explain.Explainer], image: torch.Tensor,
                        failing_module: nn.Module, instances) -> None:
    """The model's state is unchanged after calls that raise inside its forward (the detection forward: call 1; the
    method's own: call 2), after KeyboardInterrupt there, and after a call that succeeds; and the map after all the
    failures is the map of the first call."""
    before = model_state(model)
    explainer = make()
    first = quietly(explainer.explain, image, instances=instances)
    assert_state_equal(before, model_state(model))
    for number in (1, 2):
        for error in (ModelFailure("the model failed"), KeyboardInterrupt()):
            handle = failing_module.register_forward_hook(raising_on_call(number, error))
            try:
                with pytest.raises(type(error)):
                    quietly(explainer.explain, image, instances=instances)
            finally:
                handle.remove()
            assert_state_equal(before, model_state(model))
            assert no_global_mode_left(), (number, type(error).__name__)
    again = quietly(explainer.explain, image, instances=instances)
    assert_state_equal(before, model_state(model))
    torch.testing.assert_close(again.raw_maps, first.raw_maps, rtol=0, atol=0)
    torch.testing.assert_close(again.boxes, first.boxes, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(again.maps).all()


# ------------------------------------------------------------------ 1. the model left exactly as found


@pytest.mark.parametrize("name", METHODS)
def test_model_left_exactly_as_found_after_success_failure_and_interrupt(name):
    """A detector in train mode with one submodule in eval mode and a frozen parameter: every call (successful,
    raising inside the forward, interrupted) leaves parameters, buffers, each module's mode, requires_grad, .grad
    (None) and hooks as they were; instances given as k, a threshold, boxes and Instances."""
    model = detector()
    model.train()
    model.features.eval()
    model.classify.weight.requires_grad_(False)
    image = scenes(0, 1)
    make = small_methods(model)[name]
    instances = detect(model.eval(), image, 2)
    model.train()
    model.features.eval()
    for spec in (2, 0.5, torch.tensor([[4.0, 4.0, 20.0, 20.0]]), instances):
        check_left_as_found(model, make, image, model.classify, spec)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert model.training and not model.features.training and model.dropout.training


@pytest.mark.parametrize("name", ["yolov8n", "faster_rcnn"])
def test_other_detector_families_left_exactly_as_found(name):
    """The same rule on YOLOv8n (its Detect head raising) and Faster R-CNN (its box head raising), given in train
    mode with the backbone's first block in eval mode and a frozen head weight."""
    build, layer = DETECTORS[name]
    model = build()
    model.train()
    if name == "yolov8n":
        model.model[0].eval()
        model.model[-1].cv3[0][2].weight.requires_grad_(False)
        failing = model.model[-1]
    else:
        model.backbone.body["0"].eval()
        model.roi_heads.box_predictor.cls_score.weight.requires_grad_(False)
        failing = model.roi_heads.box_head
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for make in small_methods(model, layer, scorecam=name == "yolov8n").values():
        check_left_as_found(model, make, image, failing, 2)
    assert model.training


# ------------------------------------------------------------------ 2. the caller's context


@pytest.mark.parametrize("name", METHODS)
def test_no_grad_and_inference_mode_give_the_plain_calls_maps(name):
    """Inside torch.no_grad() and torch.inference_mode() the instances and maps are those of a plain call; so are
    the maps of Instances detected inside inference_mode and explained outside it."""
    model = detector()
    image = scenes(2, 3)
    explainer = small_methods(model)[name]()
    plain = quietly(explainer.explain, image, instances=3)
    with torch.no_grad():
        without_grad = quietly(explainer.explain, image, instances=3)
    with torch.inference_mode():
        inference = quietly(explainer.explain, image, instances=3)
        detected_in_inference_mode = detect(model, image, 3)
    given = quietly(explainer.explain, image, instances=detected_in_inference_mode)
    for other in (without_grad, inference, given):
        torch.testing.assert_close(other.raw_maps, plain.raw_maps, rtol=0, atol=0)
        torch.testing.assert_close(other.boxes, plain.boxes, rtol=0, atol=0)
    assert no_global_mode_left()


def test_inference_mode_on_yolo_gives_the_plain_calls_maps():
    """The rule on another family: ODAM and Grad-CAM of YOLOv8n inside inference_mode."""
    build, layer = DETECTORS["yolov8n"]
    model = build()
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    for explainer in (explain.ODAM(model, layer), explain.GradCAM(model, layer)):
        plain = quietly(explainer.explain, image, instances=2)
        with torch.inference_mode():
            inference = quietly(explainer.explain, image, instances=2)
        torch.testing.assert_close(inference.raw_maps, plain.raw_maps, rtol=0, atol=0)
        torch.testing.assert_close(inference.boxes, plain.boxes, rtol=0, atol=0)


AUTOCAST_TOLERANCE = 0.05
"""Of each map's maximum. Measured on detector(seed) for seeds 0-5, three instances in each of two scenes, each
method under CPU autocast(bfloat16) against float32 with the same Instances: Score-CAM ≤ 0.011; D-RISE's weights
computed as the paper's similarity (no IoU threshold) ≤ 0.024 (8 or 64 masks). Today without a warning: D-RISE
(its min_iou=0.5 threshold on the similarity flips a mask's weight between 0 and 0.48 when bfloat16 moves an IoU
from 0.5017 to 0.4991) up to 0.92 with 8 masks and 0.25 with 64; Grad-CAM and ODAM up to 1.0 (the class score,
a sigmoid in the model, rounds to 1 in bfloat16 above 0.996, so its gradient vanishes: an instance scoring 0.9999
gets a zero map) and 0.06 for instances scoring < 0.95. Saliency and Integrated Gradients (0.22, 0.23) warn."""


@pytest.mark.parametrize("name", METHODS)
def test_autocast_bfloat16_gives_close_maps_or_says_the_precision(name):
    """Under CPU autocast(bfloat16), for the same instances: each map within AUTOCAST_TOLERANCE of its float32
    map's maximum, or a RuntimeWarning naming bfloat16."""
    model = detector(0)
    image = scenes(0, 1)  # its instances score 0.9999, 0.992, 0.991 and 0.94, 0.90, 0.84
    instances = detect(model, image, 3)
    explainer = small_methods(model)[name]()
    plain = quietly(explainer.explain, image, instances=instances)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reduced = explainer.explain(image, instances=instances)
    assert reduced.raw_maps.dtype == torch.float32
    said = [str(warning.message) for warning in caught if "bfloat16" in str(warning.message)]
    if said:
        assert issubclass(next(w.category for w in caught if "bfloat16" in str(w.message)), RuntimeWarning)
        assert "autocast" in said[0] and ("float32" in said[0] or "model.float()" in said[0]), said[0]
        return
    scale = plain.raw_maps.abs().amax(dim=(-2, -1)).clamp_min(1e-30)
    difference = ((reduced.raw_maps - plain.raw_maps).abs().amax(dim=(-2, -1)) / scale).max().item()
    assert difference <= AUTOCAST_TOLERANCE, (
        f"{name} under autocast(bfloat16): maps differ by {difference:.3f} of their maximum, with no warning")


# ------------------------------------------------------------------ 3. threads


def test_one_explainer_shared_by_two_threads_gives_each_its_own_instance_maps():
    """Two threads explaining instances of their own images with the same explainer objects at once: each thread
    gets the maps and boxes it gets alone."""
    model = detector()
    inputs = [scenes(4, 5), scenes(6)]
    shared = {
        "odam": explain.ODAM(model, LAYER),
        "odam box": explain.ODAM(model, LAYER, quantity="x1"),
        "drise": explain.DRISE(model, masks=8, batch_size=4),
        "gradcam": explain.GradCAM(model, LAYER),
        "integratedgradients": explain.IntegratedGradients(model, steps=4),
    }
    expected = {(name, index): quietly(explainer.explain, image, instances=3)
                for name, explainer in shared.items() for index, image in enumerate(inputs)}

    def work(index: int) -> None:
        for _ in range(4):
            for name, explainer in shared.items():
                got = quietly(explainer.explain, inputs[index], instances=3)
                torch.testing.assert_close(got.raw_maps, expected[(name, index)].raw_maps, msg=name)
                torch.testing.assert_close(got.boxes, expected[(name, index)].boxes, msg=name)

    errors = errors_in_threads(work, 2)
    assert not errors, errors[:3]
    assert no_global_mode_left()


class DetectorServer(ServingThread):
    """Plain inference on the detector in a thread of its own; every output that differs from the model's is a
    problem."""

    def __init__(self, model: nn.Module, image: torch.Tensor, grad_enabled: bool):
        super().__init__(grad_enabled)
        self.model, self.image = model, image
        with torch.no_grad():
            self.expected = {key: value.clone() for key, value in model(image).items()}

    def serve_once(self) -> None:
        output = self.model(self.image)
        for key, value in self.expected.items():
            if not torch.equal(output[key].detach(), value):
                self.problems.append(f"{key} differ by {(output[key].detach() - value).abs().max():.3g}")


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_another_threads_inference_on_the_detector_is_undisturbed(grad_enabled):
    """While one thread explains instances with every method, another thread's plain inference on the same model
    gets the model's own output, and the explanations are those made alone."""
    model = detector()
    served, explained = scenes(7), scenes(8, 9)
    methods = {name: make() for name, make in small_methods(model).items()}
    expected = {name: quietly(explainer.explain, explained, instances=2).raw_maps
                for name, explainer in methods.items()}
    with DetectorServer(model, served, grad_enabled) as server:
        for _ in range(3):
            for name, explainer in methods.items():
                maps = quietly(explainer.explain, explained, instances=2).raw_maps
                torch.testing.assert_close(maps, expected[name], msg=name)
    assert server.rounds > 20, "the serving thread hardly ran"
    assert not server.problems, server.problems[:5]


# ------------------------------------------------------------------ 4. memory


@pytest.mark.parametrize("name", ["gradcam", "odam", "drise"])
def test_fifty_calls_with_instances_keep_memory_flat(name):
    """50 calls with instances=2: no tensor kept, Python memory and RSS flat (allowances as in
    test_reliability.py's memory test, for 15 traced calls)."""
    model = detector()
    explainer = small_methods(model)[name]()
    image = scenes(0, 1)
    process = psutil.Process()

    def call() -> None:
        quietly(explainer.explain, image, instances=2)

    for _ in range(10):  # warm-up: allocator caches, lazy imports
        call()
    tensors_before, rss_before = live_tensors(), process.memory_info().rss
    for _ in range(20):
        call()
    tracemalloc.start()
    try:
        for _ in range(5):  # blocks torch recycles are traced as new once reallocated: let that settle
            call()
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(15):
            call()
        gc.collect()
        python_growth = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert live_tensors() <= tensors_before, "tensors are kept between calls"
    assert python_growth < 40_000 + 100 * 15, f"Python memory grew by {python_growth} bytes over 15 calls"
    assert process.memory_info().rss - rss_before < 8 * 2**20, "RSS grew by more than 8 MiB over 40 calls"


# ------------------------------------------------------------------ 5. batches and instances


@pytest.mark.parametrize("name", ["gradcam", "odam", "drise"])
def test_a_batch_equals_each_image_alone(name):
    """In float64: the maps, boxes and scores of a batch are each image's alone, for instances=k, for a score
    threshold that finds another number of instances in each image (padding), and for given Instances; the scores
    are the detections' own."""
    model = detector().double()
    images = scenes(0, 1, 2).double()
    explainer = small_methods(model)[name]()
    instances = detect(model, images, 3)
    for spec, alone_spec in ((3, lambda index: 3), (0.5, lambda index: 0.5),
                             (instances, lambda index: sliced(instances, slice(index, index + 1)))):
        together = quietly(explainer.explain, images, instances=spec)
        for index in range(len(images)):
            alone = quietly(explainer.explain, images[index:index + 1], instances=alone_spec(index))
            count = alone.boxes.shape[1]
            assert torch.isnan(together.boxes[index, count:]).all(), "instances past the image's are padding"
            torch.testing.assert_close(together.boxes[index, :count], alone.boxes[0])
            torch.testing.assert_close(together.raw_maps[index, :count], alone.raw_maps[0], rtol=1e-5,
                                       atol=1e-6 * float(alone.raw_maps.abs().max()))
            torch.testing.assert_close(together.scores[index, :count], alone.scores[0])
    detected = detect(model, images, 3)
    torch.testing.assert_close(quietly(explainer.explain, images, instances=3).scores,
                               detected.scores.float())


@pytest.mark.parametrize("name", ["gradcam", "odam", "drise", "integratedgradients"])
def test_k_instances_in_one_call_equal_k_calls_of_one_instance(name):
    """Instances from one detect() call: the maps of all K in one call are the maps of K calls, one instance each."""
    model = detector().double()
    images = scenes(3, 4).double()
    instances = detect(model, images, 3)
    explainer = small_methods(model)[name]()
    together = quietly(explainer.explain, images, instances=instances)
    for column in range(instances.count):
        one = quietly(explainer.explain, images, instances=sliced(instances, columns=slice(column, column + 1)))
        torch.testing.assert_close(together.raw_maps[:, column], one.raw_maps[:, 0], rtol=1e-5,
                                   atol=1e-6 * float(one.raw_maps.abs().max()))
        torch.testing.assert_close(together.boxes[:, column], one.boxes[:, 0])


def test_k_instances_in_one_call_equal_k_calls_on_yolo():
    """The rule on another family: ODAM and Grad-CAM of YOLOv8n, three instances."""
    build, layer = DETECTORS["yolov8n"]
    model = build().double()
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    instances = detect(model, image, 3)
    for explainer in (explain.ODAM(model, layer), explain.GradCAM(model, layer)):
        together = quietly(explainer.explain, image, instances=instances)
        for column in range(instances.count):
            one = quietly(explainer.explain, image, instances=sliced(instances, columns=slice(column, column + 1)))
            torch.testing.assert_close(together.raw_maps[:, column], one.raw_maps[:, 0], rtol=1e-5,
                                       atol=1e-6 * float(one.raw_maps.abs().max()))


# ------------------------------------------------------------------ 6. bad input


def error_of(kind: type[Exception], function: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the ``kind`` error that function(*args, **kwargs) raises."""
    with pytest.raises(kind) as caught:
        quietly(function, *args, **kwargs)
    return str(caught.value)


@pytest.mark.parametrize("method", ["odam", "drise"])
def test_odam_and_drise_without_instances_say_to_give_them(method):
    model = detector()
    before = model_state(model)
    explainer = small_methods(model)[method]()
    for call in ((explainer.explain, scenes(0)), (explainer.explain, scenes(0), 1)):
        message = error_of(ValueError, *call)
        assert "detected instances" in message and "instances=" in message and "'all'" in message, message
    assert_state_equal(before, model_state(model))


def test_instances_with_target_or_topk_are_refused():
    model = detector()
    for explainer in (explain.GradCAM(model, LAYER), explain.ODAM(model, LAYER)):
        for extra in ({"target": 1}, {"topk": 2}, {"target": [0, 1]}):
            message = error_of(ValueError, explainer.explain, scenes(0), instances=2, **extra)
            assert "instances=" in message and "target=" in message and "not both" in message, message


@pytest.mark.parametrize(("spec", "kind", "words"), [
    ("some", ValueError, ["'all'", "int k", "score threshold", "'some'"]),
    (0, ValueError, ["k must be ≥ 1", "got 0"]),
    (-1, ValueError, ["k must be ≥ 1", "got -1"]),
    (1.5, ValueError, ["(0, 1)", "1.5"]),
    (True, TypeError, ["int k", "score threshold", "bool"]),
])
def test_an_instances_value_that_is_no_spec_is_refused_naming_it(spec, kind, words):
    """Each says what was given and what instances= takes; on two methods (a gradient CAM and D-RISE)."""
    model = detector()
    for explainer in (explain.GradCAM(model, LAYER), explain.DRISE(model, masks=4)):
        message = error_of(kind, explainer.explain, scenes(0, 1), instances=spec)
        assert all(word in message for word in words), message


@pytest.mark.parametrize("boxes", [torch.zeros(3, 3), torch.zeros(3, 2, 4), torch.zeros(2, 2, 5), [[1.0, 2.0, 3.0]]])
def test_boxes_of_a_wrong_shape_are_refused_with_the_shapes_that_fit(boxes):
    model = detector()
    for explainer in (explain.ODAM(model, LAYER), explain.Saliency(model)):
        message = error_of(ValueError, explainer.explain, scenes(0, 1), instances=boxes)
        assert "(K, 4)" in message and "(N, K, 4)" in message and "N = 2" in message and "pixels" in message, message


@pytest.mark.parametrize("box", [[30.0, 30.0, 10.0, 10.0], [float("nan"), 2.0, 20.0, 20.0],
                                 [2.0, 2.0, float("inf"), 9.0]])
def test_a_box_that_is_not_a_box_is_refused_naming_it(box):
    """x1 < x0, NaN or inf: a ValueError naming the box, not a zero map whose warning blames the detector."""
    model = detector()
    for explainer in (explain.GradCAM(model, LAYER), explain.DRISE(model, masks=4)):
        message = error_of(ValueError, explainer.explain, scenes(0), instances=torch.tensor([box]))
        assert "box" in message and "x0" in message and ("x1" in message or "finite" in message), message


@pytest.mark.parametrize("spec", [0.9, torch.zeros(0, 4)])
@pytest.mark.parametrize("name", ["gradcam", "odam", "drise", "saliency"])
def test_instances_that_select_nothing_are_said(name, spec):
    """No detection scores 0.9 in any image (SmallDetector's random weights: every score is 0.53 ± 0.01), or no box
    is given: a ValueError, or empty maps with a RuntimeWarning, that says no instance was selected and what to give
    instead; never an internal error or silently empty maps."""
    model = SmallDetector().eval()
    explainer = small_methods(model)[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            explanation = explainer.explain(scenes(0, 1), instances=spec)
        except ValueError as error:
            message = str(error)
        except Exception as error:
            pytest.fail(f"{name}: {type(error).__name__}: {error}")
        else:
            assert explanation.maps.shape[:2] == (2, 0)
            said = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
            assert said, f"{name} returned {tuple(explanation.maps.shape)} maps and said nothing"
            message = said[0]
    assert "no " in message and "instance" in message, message
    assert re.search(r"threshold|instances=", message), message


def test_a_classifier_with_instances_is_told_instances_are_for_detectors():
    """A classifier explained with instances=: the error says the model is no detector read here, and to use
    target= (a class) for a classifier; the model is left as found."""
    model = SmallCNN().eval()
    before = model_state(model)
    for explainer in (explain.GradCAM(model, "features.6"), explain.DRISE(model, masks=4), explain.Saliency(model)):
        message = error_of(ValueError, explainer.explain, torch.rand(1, 3, 16, 16), instances=2)
        assert "detect" in message and "SmallCNN" in message, message
        assert "target=" in message, f"the error does not say how to explain a classifier: {message}"
    assert_state_equal(before, model_state(model))


def test_a_detector_without_instances_is_told_to_give_instances():
    """A class-target method on a detector, called as on a classifier: the error names instances=; on the
    {"boxes", "scores"} detector and on Faster R-CNN (a list of dicts)."""
    model = detector()
    faster_rcnn, layer = DETECTORS["faster_rcnn"][0](), DETECTORS["faster_rcnn"][1]
    for explainer, image in ((explain.GradCAM(model, LAYER), scenes(0)), (explain.Saliency(model), scenes(0)),
                             (explain.GradCAM(faster_rcnn, layer), torch.rand(1, 3, 64, 64))):
        message = error_of(ValueError, explainer.explain, image)
        assert "instances=" in message, f"the error does not point at instances=: {message}"


@pytest.fixture(scope="module")
def yolo_wrapper_class():
    os.environ.setdefault("YOLO_OFFLINE", "1")
    ultralytics = pytest.importorskip("ultralytics")
    try:
        ultralytics.YOLO("yolov8n.yaml")
    except Exception as error:  # built from its YAML, offline: nothing to download
        pytest.skip(f"ultralytics.YOLO('yolov8n.yaml') cannot be built offline: {error!r}")
    return ultralytics.YOLO


@pytest.mark.parametrize("name", ["gradcam", "odam", "drise", "saliency"])
def test_the_ultralytics_yolo_wrapper_is_refused_and_left_as_found(yolo_wrapper_class, name):
    """Ultralytics' YOLO object (whose forward preprocesses files and runs NMS; whose train() trains): a TypeError
    naming the wrapper and `yolo.model`, raised before its predictor runs, and the wrapper left as found (built in
    train mode)."""
    wrapper = yolo_wrapper_class("yolov8n.yaml")
    before = model_state(wrapper)
    explainer = small_methods(wrapper, "model.model.9")[name]()
    message = error_of(TypeError, explainer.explain, torch.rand(1, 3, 64, 64), instances=2)
    assert "YOLO" in message and "yolo.model" in message, message
    assert wrapper.predictor is None, "the wrapper's predictor ran"
    assert_state_equal(before, model_state(wrapper))


# ------------------------------------------------------------------ 7. instances that disappear


def missing_on_the_path(model: nn.Module, images: torch.Tensor, instances: Instances, alphas: list[float],
                        min_iou: float = 0.5) -> dict[tuple[int, int], int]:
    """By hand: for each (image, instance), in how many of the images α·x (a black baseline's path) no candidate
    box overlaps the instance's box by IoU ≥ min_iou (every candidate has a class score > 0: a sigmoid)."""
    missing = {}
    with torch.no_grad():
        for image in range(len(images)):
            outputs = [model(images[image:image + 1] * alpha) for alpha in alphas]
            for column in range(instances.count):
                box = instances.boxes[image, column:column + 1]
                missing[(image, column)] = sum(not bool((box_iou(box, output["boxes"][0]) >= min_iou).any())
                                               for output in outputs)
    return missing


def test_an_instance_that_disappears_on_the_path_is_said_by_name():
    """Integrated Gradients from a black baseline on detector(): the instances whose box no candidate overlaps on
    some of the path's images are named, each with how many of the passes lacked it, counted by hand (4 midpoint
    steps, the baseline and the image: 6 passes), at the caller's line; those always found are not named."""
    model = detector()
    images = scenes(0, 1)
    instances = detect(model, images, 3)
    alphas = [0.0, 0.125, 0.375, 0.625, 0.875, 1.0]
    missing = missing_on_the_path(model, images, instances, alphas)
    assert any(missing.values()) and not all(missing.values()), missing  # both cases in the test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain.IntegratedGradients(model, steps=4).explain(images, instances=instances)
    said = [warning for warning in caught if "disappeared" in str(warning.message)]
    assert len(said) == 1, [str(warning.message) for warning in caught]
    assert issubclass(said[0].category, RuntimeWarning) and said[0].filename == __file__
    named = {(int(image), int(column)): (int(without), int(total)) for image, column, without, total in
             re.findall(r"\((\d+), (\d+)\): (\d+) of (\d+)", str(said[0].message))}
    assert named == {pair: (count, len(alphas)) for pair, count in missing.items() if count}


def test_instances_found_in_every_pass_are_not_said():
    """The negative: Saliency (one pass) and Integrated Gradients from a baseline close to the image (every
    instance stays on the whole path): no disappearance warning."""
    model = detector()
    images = scenes(0, 1)
    instances = detect(model, images, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain.Saliency(model).explain(images, instances=instances)
        explain.IntegratedGradients(model, steps=4, baseline=images * 0.98).explain(images, instances=instances)
    assert not [str(warning.message) for warning in caught if "disappeared" in str(warning.message)]


def test_the_same_instance_target_given_twice_counts_each_call_alone():
    """An InstanceTarget passed as target= (as ODAM's error suggests) to two calls: each call's warning counts its
    own passes; a one-pass method after a perturbing one says nothing."""
    model = detector()
    images = scenes(0, 1)
    target = InstanceTarget(detect(model, images, 3), model, images.shape[-2:])
    integrated = explain.IntegratedGradients(model, steps=4)

    def said(call: Callable[[], object]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        return [str(warning.message) for warning in caught if "disappeared" in str(warning.message)]

    first = said(lambda: integrated.explain(images, target=target))
    second = said(lambda: integrated.explain(images, target=target))
    assert first and second == first, (first, second)
    assert said(lambda: explain.GradCAM(model, LAYER).explain(images, target=target)) == []
