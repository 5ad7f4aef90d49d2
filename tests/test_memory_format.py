"""The memory layout in which a batch reaches the model (explain.core.memory_format): channels-last on the
CPU for batches of at least 4 rows of images of at least 128 × 128 pixels for a convolutional model, the usual layout
otherwise; a model that refuses channels-last is run in the usual layout; results as accurate as with the usual
layout. The tests of the channels-last path use small images with the size threshold lifted
(``channels_last_for_small_images``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from conftest import SmallCNN, assert_state_equal, model_state
from torch import nn

import explain
from explain.core.capture import ModelInputError
from explain.core.memory_format import CHANNELS_LAST_MIN_ROWS, usual_layout_only

pytestmark = pytest.mark.usefixtures("channels_last_for_small_images")


def layout_of(tensor: torch.Tensor) -> str:
    if tensor.is_contiguous():
        return "contiguous"
    return "channels_last" if tensor.is_contiguous(memory_format=torch.channels_last) else "other"


class RecordsItsInput(nn.Module):
    """A small CNN that records the memory layout of every batch its forward receives."""

    def __init__(self, flatten_by_view: bool = False, fail_with: str = ""):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 3)
        self.flatten_by_view, self.fail_with = flatten_by_view, fail_with
        self.layouts: list[str] = []

    def forward(self, x):
        self.layouts.append(layout_of(x))
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        features = torch.relu(self.conv(x))
        # .view needs memory whose order matches the shape: a channels-last feature map refuses it
        flat = features.view(len(x), -1) if self.flatten_by_view else features.reshape(len(x), -1)
        return self.head(flat)


def test_a_batch_of_at_least_four_rows_reaches_a_convolutional_model_channels_last():
    torch.manual_seed(0)
    model = RecordsItsInput().eval()
    assert CHANNELS_LAST_MIN_ROWS == 4
    explain.Saliency(model).explain(torch.randn(4, 3, 8, 8), target=0)
    assert model.layouts == ["channels_last"]
    model.layouts.clear()
    explain.Saliency(model).explain(torch.randn(3, 3, 8, 8), target=0)
    assert model.layouts == ["contiguous"]  # fewer rows: measured slower channels-last
    model.layouts.clear()
    explain.Saliency(model.double()).explain(torch.randn(4, 3, 8, 8, dtype=torch.float64), target=0)
    assert model.layouts == ["contiguous"]  # float64: no channels-last kernels
    model.float().layouts.clear()
    with usual_layout_only():
        explain.Saliency(model).explain(torch.randn(4, 3, 8, 8), target=0)
    assert model.layouts == ["contiguous"]
    # Integrated Gradients: x and x' ride in the first pass (2 + 8 rows), then 8 rows: both channels-last
    model.layouts.clear()
    explain.IntegratedGradients(model, steps=16, batch_size=8).explain(torch.randn(1, 3, 8, 8), target=0)
    assert model.layouts == ["channels_last"] * 2


def test_a_model_without_convolutions_gets_the_usual_layout():
    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.layouts: list[str] = []
            self.fc = nn.Linear(3 * 8 * 8, 3)

        def forward(self, x):
            self.layouts.append(layout_of(x))
            return self.fc(x.reshape(len(x), -1))

    model = Linear()
    explain.Saliency(model).explain(torch.randn(8, 3, 8, 8), target=0)
    assert model.layouts == ["contiguous"]


def test_the_model_is_left_as_found_and_its_parameters_keep_their_layout():
    torch.manual_seed(0)
    model = SmallCNN().train()
    before = model_state(model)
    strides = {name: parameter.stride() for name, parameter in model.named_parameters()}
    pointers = {name: parameter.data_ptr() for name, parameter in model.named_parameters()}
    for method in (explain.Saliency(model), explain.IntegratedGradients(model, steps=8),
                   explain.GradCAM(model, "features.6"), explain.DeepLift(model)):
        method.explain(torch.randn(6, 3, 16, 16), target=1)
    assert_state_equal(before, model_state(model))
    assert strides == {name: parameter.stride() for name, parameter in model.named_parameters()}
    assert pointers == {name: parameter.data_ptr() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("method", ["saliency", "integratedgradients", "gradcam", "deeplift", "smoothgrad"])
def test_a_model_that_refuses_channels_last_is_run_in_the_usual_layout(method):
    """Its map equals, exactly, the map computed with the usual layout throughout; the first forward
    was the refused channels-last one, every later one used the usual layout; the next call tries
    channels-last again (nothing is remembered)."""
    torch.manual_seed(0)
    model = RecordsItsInput(flatten_by_view=True).eval()
    x = torch.randn(4, 3, 8, 8)
    cls = explain.get_method(method)

    def build():
        return cls(model, "conv", normalize=None) if cls.needs_layer else cls(model, normalize=None)

    with usual_layout_only():
        expected = build().explain(x, target=[0, 1, 2, 0]).maps
    model.layouts.clear()
    for _ in range(2):
        model.layouts.clear()
        maps = build().explain(x, target=[0, 1, 2, 0]).maps
        torch.testing.assert_close(maps, expected, rtol=0, atol=0)
        assert model.layouts[0] == "channels_last" and set(model.layouts[1:]) == {"contiguous"}, model.layouts


def test_an_error_outside_the_model_is_raised_at_once():
    model = RecordsItsInput().eval()
    with pytest.raises(ValueError, match="out of range"):
        explain.Saliency(model).explain(torch.randn(4, 3, 8, 8), target=7)  # 3 classes
    assert model.layouts == ["channels_last"]  # not run again


class AssertsContiguousInput(nn.Module):
    """A model that checks its input's layout with a bare assert (no message to recognise)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        assert x.is_contiguous()
        return self.fc(torch.relu(self.conv(x)).amax(dim=(2, 3)))


@pytest.mark.parametrize("method, images", [("saliency", 4), ("integratedgradients", 1), ("deeplift", 4),
                                            ("gradcam", 5)])
def test_a_model_that_asserts_a_contiguous_input_gets_its_usual_map(method, images):
    """Integrated Gradients of one image runs 16-row passes and DeepLIFT of four images 4-row ones:
    each gets a channels-last batch first, fails inside the model, and is run again as usual."""
    torch.manual_seed(0)
    model = AssertsContiguousInput().eval()
    x = torch.randn(images, 3, 8, 8)
    cls = explain.get_method(method)

    def build():
        return cls(model, "conv", normalize=None) if cls.needs_layer else cls(model, normalize=None)

    with usual_layout_only():
        expected = build().explain(x, target=0).maps
    torch.testing.assert_close(build().explain(x, target=0).maps, expected, rtol=0, atol=0)


def test_an_error_chain_that_loops_is_raised_not_walked_forever():
    class RaisesFromItself(RecordsItsInput):
        def forward(self, x):
            self.layouts.append(layout_of(x))
            error = RuntimeError("the model is not ready")
            raise error from error

    model = RaisesFromItself().eval()
    with pytest.raises(ModelInputError, match="not ready"):
        explain.Saliency(model).explain(torch.randn(4, 3, 8, 8), target=0)
    assert model.layouts == ["channels_last", "contiguous"]  # a model failure: run once more as usual


def test_a_model_that_fails_in_both_layouts_raises_the_usual_layouts_error_and_leaves_nothing_set():
    class FailsBoth(RecordsItsInput):
        def forward(self, x):
            self.layouts.append(layout_of(x))
            if layout_of(x) == "channels_last":
                raise RuntimeError("view size is not compatible with input tensor's size and stride")
            raise RuntimeError("something else went wrong")

    model = FailsBoth().eval()
    with pytest.raises(ModelInputError, match="something else went wrong"):
        explain.Saliency(model).explain(torch.randn(4, 3, 8, 8), target=0)
    assert model.layouts == ["channels_last", "contiguous"]
    working = RecordsItsInput().eval()
    explain.Saliency(working).explain(torch.randn(4, 3, 8, 8), target=0)
    assert working.layouts == ["channels_last"]  # the usual-layout fallback ended with the call


def relative_distance(values: torch.Tensor, reference: torch.Tensor) -> float:
    return float((values.double() - reference.double()).norm() / reference.double().norm())


METHODS = [
    ("saliency", {}),
    ("integratedgradients", {"steps": 8}),
    ("deeplift", {}),
    ("layerconductance", {"steps": 8}),
    ("gradcam", {}),
]


def attributions_of(method: str, options: dict, model: nn.Module, layer: str, x: torch.Tensor) -> torch.Tensor:
    """Per-channel attributions (or raw maps for a CAM) for targets 0..N-1."""
    cls = explain.get_method(method)
    explainer = cls(model, layer, **options) if cls.needs_layer else cls(model, **options)
    explanation = explainer.explain(x, target=list(range(len(x))))
    return explanation.attributions if explanation.attributions is not None else explanation.raw_maps


@pytest.mark.parametrize("method, options", METHODS)
def test_channels_last_gives_the_same_attributions_up_to_float32_rounding(method, options):
    """resnet18 (random weights), batch of 4: against the same computation in float64, the relative
    L2 distance with channels-last is within 5× the usual layout's, or 1e-5 (measured: 0.8–1.5e-6
    against 0.3–0.6e-6; oneDNN's channels-last convolutions sum in another order)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(4, 3, 64, 64)
    reference = attributions_of(method, options, copy.deepcopy(model).double(), "layer3", x.double())
    channels_last = attributions_of(method, options, model, "layer3", x)
    with usual_layout_only():
        usual = attributions_of(method, options, model, "layer3", x)
    distance_channels_last = relative_distance(channels_last, reference)
    distance_usual = relative_distance(usual, reference)
    assert distance_channels_last <= max(5 * distance_usual, 1e-5), (distance_channels_last, distance_usual)


@pytest.mark.parametrize("method, options", METHODS[1:4:2])
def test_where_rounding_decides_a_max_pooling_near_tie_the_layouts_agree_to_float32_precision_of_the_map(
        method, options):
    """vgg11 without BatchNorm: near the zero baseline its activations are nearly its biases, so
    max-pooling windows hold values equal to 7 digits, and float32 rounding (of either layout, or of
    any other implementation) decides which of them receives the gradient. The layouts then route
    one gradient to a neighbouring pixel: measured on one image of 4, relative L2 distance 4e-4 and
    map correlation 0.9999998. Both are the exact gradient of an input within rounding of x; this is
    why equality with a peer library is tested in float64, where no near-tie is that near."""
    torch.manual_seed(0)
    model = torchvision.models.vgg11(num_classes=5).eval()
    x = torch.randn(4, 3, 64, 64)
    channels_last = attributions_of(method, options, model, "features.12", x)
    with usual_layout_only():
        usual = attributions_of(method, options, model, "features.12", x)
    for image in range(len(x)):
        assert relative_distance(channels_last[image], usual[image]) <= 1e-3
        maps = torch.stack([channels_last[image].sum(dim=(0, 1)).flatten(), usual[image].sum(dim=(0, 1)).flatten()])
        assert torch.corrcoef(maps.double())[0, 1] >= 0.99999


def test_small_images_reach_the_model_in_the_usual_layout(monkeypatch):
    """Below 128 × 128 pixels channels-last ran slower (benchmarks/RESULTS.md, "Memory layout of the model's input by
    image size"): a batch of 4 images of 64 × 64 stays contiguous, of 128 × 128 goes channels-last."""
    from explain.core import memory_format

    monkeypatch.setattr(memory_format, "CHANNELS_LAST_MIN_PIXELS", 128 * 128)  # the module's value, not the fixture's
    assert memory_format.CHANNELS_LAST_MIN_PIXELS == 128 * 128

    class Records(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.layouts = nn.Conv2d(3, 4, 3, padding=1), []

        def forward(self, x):
            self.layouts.append(layout_of(x))
            return self.conv(x).mean(dim=(2, 3))

    model = Records().eval()
    explain.Saliency(model).explain(torch.randn(4, 3, 64, 64), target=0)
    explain.Saliency(model).explain(torch.randn(4, 3, 128, 128), target=0)
    assert model.layouts == ["contiguous", "channels_last"]


def test_a_strided_batch_gives_the_maps_of_its_contiguous_copy_to_the_last_bit(monkeypatch):
    """A NumPy (N, H, W, C) array transposed to (N, C, H, W) (what Quantus hands an explain function) reaches the
    model as the contiguous copy does: the same maps to the last bit, for small images (contiguous) and large ones
    (channels-last). Quantus's Continuity divides the maps' difference at a zero translation by 1e-9: rounding
    differences between layouts became a score of 27 000 there."""
    from explain.core import memory_format

    monkeypatch.setattr(memory_format, "CHANNELS_LAST_MIN_PIXELS", 128 * 128)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).eval()
    for size in (32, 128):
        pixels = torch.rand(4, size, size, 3, generator=torch.Generator().manual_seed(size)).numpy()
        strided = torch.from_numpy(pixels).permute(0, 3, 1, 2)
        assert not strided.is_contiguous()
        for method in (explain.Saliency(model, normalize=None), explain.IntegratedGradients(model, steps=4)):
            expected = method.explain(strided.contiguous(), target=[0, 1, 2, 0]).raw_maps
            assert torch.equal(method.explain(strided, target=[0, 1, 2, 0]).raw_maps, expected), (size, method)
