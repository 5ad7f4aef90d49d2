"""Reliability: every method leaves the model as found, keeps memory flat, nests, runs in threads,
and answers bad input with a clear error. Property-based tests over random small CNNs."""

from __future__ import annotations

import gc
import os
import tracemalloc
import warnings

import psutil
import pytest
import torch
import torchvision
from conftest import SmallCNN, SmallViT, assert_state_equal, errors_in_threads, model_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import explain
from explain.methods.perturbation import PerturbationCAM

ALL_METHODS = sorted(name for name, cls in explain.REGISTRY.items() if not cls.explains_instances)
"""The methods of classifiers; those made for detectors (ODAM, D-RISE) are checked in test_detection_reliability.py."""
ATTENTION_METHODS = [name for name in ALL_METHODS if getattr(explain.get_method(name), "needs_attention", False)]
CNN_METHODS = [name for name in ALL_METHODS if name not in ATTENTION_METHODS]


def small_model(name: str) -> torch.nn.Module:
    """The model a method is checked on: a small transformer for attention methods, else a small CNN;
    both take 16 × 16 RGB images, have dropout and give 5 classes."""
    return SmallViT() if name in ATTENTION_METHODS else SmallCNN()


def mixed_mode(model: torch.nn.Module) -> torch.nn.Module:
    """Train mode with one submodule in eval mode and one frozen parameter."""
    model.train()
    list(model.children())[0].eval()
    model.head.weight.requires_grad_(False)
    return model
# random draws (noise, paths) depend on N for these
BATCH_INDEPENDENT = [name for name in CNN_METHODS if name not in ("smoothgrad", "smoothgrad_sq", "vargrad",
                                                                   "gradientshap", "smoothgradcam++", "sscam")]
"""Methods whose noise is drawn for the whole batch (as SmoothGrad's) are not: a batch and its images alone differ."""


def build(name: str, model: nn.Module, layer: str, **extra):
    """A method with small settings (few samples and steps) so that many calls stay fast."""
    cls = explain.get_method(name)
    options = dict(extra)
    if issubclass(cls, PerturbationCAM):
        options["progress"] = False
    if issubclass(cls, (explain.SmoothGrad, explain.GradientShap)):
        options["samples"] = 3
    if cls in (explain.IntegratedGradients, explain.GuidedIG, explain.BlurIG, explain.LayerIntegratedGradients,
               explain.LayerConductance):
        options["steps"] = 4
    if cls in (explain.SSCAM, explain.SmoothGradCAMPlusPlus):
        options["samples"] = 2
    if cls is explain.ISCAM:
        options["steps"] = 2
    if cls is explain.SESS:
        options["num_scales"] = 2
    if cls is explain.XRAI:
        options.update(steps=4, segmenter=explain.Felzenszwalb(scales=(100,), size=None))
    return cls(model, layer, **options) if cls.needs_layer else cls(model, **options)


def no_global_mode_left() -> bool:
    return torch.is_grad_enabled() and not torch._C._is_torch_function_mode_enabled()


# ------------------------------------------------------------------ state


def failing_calls():
    """Each kind of failing call: (description, inputs, target)."""

    def target_that_raises(output):
        raise KeyError("the user's target failed")

    return [
        ("target out of range", torch.randn(2, 3, 16, 16), [0, 99]),
        ("targets not matching the batch", torch.randn(2, 3, 16, 16), [0, 1, 2]),
        ("NaN in the input", torch.full((1, 3, 16, 16), float("nan")), None),
        ("empty batch", [], None),
        ("a target callable that raises", torch.randn(2, 3, 16, 16), target_that_raises),
        ("input the model cannot take", torch.randn(1, 5, 16, 16), None),
    ]


@pytest.mark.parametrize("name", ALL_METHODS)
def test_model_left_exactly_as_found_after_success_and_every_failure(name):
    """A model in train mode (BatchNorm, dropout): the call runs it in eval mode, never updates
    BatchNorm's running statistics, and restores every module's mode."""
    torch.manual_seed(0)
    model = mixed_mode(small_model(name))  # a mixed-mode, partly frozen model comes back so
    modules = {name: id(module) for name, module in model.named_modules()}
    before = model_state(model)
    explainer = build(name, model, "features.6")
    for description, inputs, target in failing_calls():
        with pytest.raises(Exception) as error:
            explainer.explain(inputs, target=target)
        assert not isinstance(error.value, (AssertionError, AttributeError)), f"{description}: {error.value!r}"
        assert_state_equal(before, model_state(model))
        assert no_global_mode_left(), description
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        explanation = explainer.explain(torch.randn(2, 3, 16, 16), target=[1, 2])
    assert torch.isfinite(explanation.maps).all()
    assert_state_equal(before, model_state(model))
    assert no_global_mode_left()
    assert {name: id(module) for name, module in model.named_modules()} == modules


# ------------------------------------------------------------------ memory


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some module proxies warns about deprecated names
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


# Calls per method in the memory test: 200 by default (every method in about 90 s on two cores);
# EXPLAIN_RELIABILITY_CALLS=1000 gives the full run the release check uses. Traced Python memory
# moves by 10-30 kB whatever the number of calls (torch's dispatch caches, the function modes'
# frames) and a leak grows with the calls: hence a fixed allowance plus a per-call one.
RELIABILITY_CALLS = int(os.environ.get("EXPLAIN_RELIABILITY_CALLS", "200"))


@pytest.mark.parametrize("name", ALL_METHODS)
def test_many_calls_keep_memory_flat(name):
    torch.manual_seed(0)
    model = small_model(name).eval()
    explainer = build(name, model, "features.6")
    x = torch.randn(2, 3, 16, 16)
    process = psutil.Process()
    traced = RELIABILITY_CALLS // 5
    untraced = RELIABILITY_CALLS - 2 * traced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(30):  # warm-up: allocator caches, lazy imports
            explainer.explain(x)
        tensors_before, rss_before = live_tensors(), process.memory_info().rss
        for _ in range(untraced):
            explainer.explain(x)
        tracemalloc.start()
        for _ in range(traced):  # blocks that torch and CPython recycle (function modes' dispatch) are
            explainer.explain(x)  # traced as new once they are reallocated: let that settle first
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(traced):
            explainer.explain(x)
        gc.collect()
        python_growth = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
    assert live_tensors() <= tensors_before, "tensors are kept between calls"
    assert python_growth < 40_000 + 100 * traced, f"Python memory grew by {python_growth} bytes over {traced} calls"
    assert process.memory_info().rss - rss_before < 8 * 2**20, \
        f"RSS grew by more than 8 MiB over {RELIABILITY_CALLS} calls"


# ------------------------------------------------------------------ nesting and threads


def test_two_explainers_on_one_model_one_after_the_other_and_nested():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    early = explain.GradCAM(model, "features.3", normalize=None)
    late = explain.GradCAM(model, "features.6", normalize=None)
    expected_early, expected_late = early.explain(x, target=1).raw_maps, late.explain(x, target=1).raw_maps
    inner_maps = []

    def target_that_explains(output):
        inner_maps.append(late.explain(x, target=1).raw_maps)  # an explainer inside another's target
        return output[:, 1]

    nested = early.explain(x, target=target_that_explains)
    torch.testing.assert_close(nested.raw_maps, expected_early)
    torch.testing.assert_close(inner_maps[0], expected_late)
    torch.testing.assert_close(late.explain(x, target=1).raw_maps, expected_late)
    guided_inside = []
    explain.GuidedBackprop(model).explain(x, target=lambda out: (guided_inside.append(
        late.explain(x, target=1).raw_maps), out[:, 1])[1])
    torch.testing.assert_close(guided_inside[0], expected_late)  # the ReLU rule is off outside guided's forward


def test_explainers_in_two_threads_on_two_model_copies():
    torch.manual_seed(0)
    models = [SmallCNN().eval() for _ in range(2)]
    inputs = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    methods = ("gradcam", "guidedbackprop", "scorecam", "integratedgradients")
    expected = {(i, name): build(name, models[i], "features.6").explain(inputs[i]).maps
                for i in range(2) for name in methods}
    results = {}

    def work(i):
        for _ in range(10):
            for name in methods:
                results[(i, name)] = build(name, models[i], "features.6").explain(inputs[i]).maps

    errors = errors_in_threads(work, 2)
    assert not errors, errors
    for key, maps in expected.items():
        torch.testing.assert_close(results[key], maps)
    assert no_global_mode_left()


# ------------------------------------------------------------------ bad input


def test_an_image_of_the_wrong_size_for_a_fixed_size_model_says_how_to_fix_it():
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=1,
                                               hidden_dim=8, mlp_dim=8).eval()
    before = model_state(vit)
    with pytest.raises(explain.ModelInputError, match=r"input of shape \(1, 3, 48, 48\).*preprocess"):
        explain.Saliency(vit).explain(torch.randn(1, 3, 48, 48))
    assert_state_equal(before, model_state(vit))


def test_input_dtype_follows_the_model():
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    explanation = explain.GradCAM(model, "features.6").explain(x)
    torch.testing.assert_close(explanation.maps, explain.GradCAM(model, "features.6").explain(x.float()).maps)


# ------------------------------------------------------------------ properties over random CNNs


@st.composite
def random_cnns(draw):
    depth = draw(st.integers(1, 3))
    layers, channels = [], 3
    for _ in range(depth):
        out_channels = draw(st.integers(2, 6))
        layers += [nn.Conv2d(channels, out_channels, 3, padding=1), nn.ReLU(inplace=draw(st.booleans()))]
        if draw(st.booleans()):
            layers.append(nn.MaxPool2d(2))
        channels = out_channels
    classes = draw(st.integers(2, 5))
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)).eval()
    conv_names = [str(i) for i, layer in enumerate(layers) if isinstance(layer, nn.Conv2d)]
    size = draw(st.integers(8, 20))
    batch = draw(st.integers(1, 4))
    targets = draw(st.lists(st.integers(0, classes - 1), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**16))
    return model, conv_names[-1], size, batch, targets, seed


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cnns())
def test_maps_are_finite_in_range_shaped_and_independent_of_the_rest_of_the_batch(case):
    model, layer, size, batch, targets, seed = case
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    x = torch.randn(batch, 3, size, size)
    # CAM needs the layer the classifier reads average-pooled: a max-pool between them is refused, not approximated
    pooled_directly = not isinstance(model[int(layer) + 2], nn.MaxPool2d)
    methods = [name for name in CNN_METHODS if pooled_directly or name != "cam"]
    if not pooled_directly:
        with pytest.raises(ValueError, match="does not read layer"):
            build("cam", model, layer).explain(x, target=targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in methods:
            explanation = build(name, model, layer).explain(x, target=targets)
            maps = explanation.maps
            assert maps.shape == (batch, size, size), name
            assert torch.isfinite(maps).all() and maps.min() >= 0 and maps.max() <= 1, name
    # Batch independence in float64: in float32 a batched convolution rounds differently from a
    # single image's, and a formula that divides by a sum that cancels (XGrad-CAM on a layer with
    # signed activations) magnifies that rounding past any fixed tolerance; in float64 it does not.
    model, x = model.double(), x.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in [name for name in BATCH_INDEPENDENT if name in methods] if batch > 1 else []:
            together = build(name, model, layer).explain(x, target=targets).raw_maps
            alone = torch.cat([build(name, model, layer).explain(x[i : i + 1], target=targets[i]).raw_maps
                               for i in range(batch)])
            torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5, msg=name)


class RandomViT(nn.Module):
    """patches → class token (or none: mean pooling) → nn.TransformerEncoder → linear head."""

    def __init__(self, patch: int, dim: int, heads: int, depth: int, classes: int, class_token: bool):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim)) if class_token else None
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        if self.cls_token is None:
            return self.head(self.encoder(tokens).mean(dim=1))
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1)
        return self.head(self.encoder(tokens)[:, 0])


@st.composite
def random_vits(draw):
    patch, grid = draw(st.sampled_from([2, 4])), draw(st.integers(2, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    classes = draw(st.integers(2, 5))
    depth, flag, seed = draw(st.integers(1, 3)), draw(st.booleans()), draw(st.integers(0, 2**16))
    torch.manual_seed(seed)  # the weights follow from the example, so that a failure replays (it was flaky)
    model = RandomViT(patch, 4 * heads, heads, depth, classes, flag).eval()
    batch = draw(st.integers(1, 4))
    targets = draw(st.lists(st.integers(0, classes - 1), min_size=batch, max_size=batch))
    return model, patch * grid, batch, targets, seed


# derandomized: the same examples on every run and machine (random weights drawn outside the example made a rare
# rounding case fail on one run and pass on its replay)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(random_vits())
def test_attention_maps_are_finite_in_range_shaped_and_independent_of_the_rest_of_the_batch(case):
    model, size, batch, targets, seed = case
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in ATTENTION_METHODS:
            explanation = build(name, model, None).explain(x, target=targets)
            maps = explanation.maps
            assert maps.shape == (batch, size, size), name
            assert torch.isfinite(maps).all() and maps.min() >= 0 and maps.max() <= 1, name
            if batch > 1:
                alone = torch.cat([build(name, model, None).explain(x[i : i + 1], target=targets[i]).raw_maps
                                   for i in range(batch)])
                torch.testing.assert_close(explanation.raw_maps, alone, rtol=1e-4, atol=1e-6, msg=name)
