"""How images come in: [0, 1] float tensors given where the preprocess normalises, display images that keep no
preprocess (nor the model it may hold), paths as bytes, channels-first arrays."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import explain
from explain.io.inputs import Normalize, prepare_inputs


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).eval()


def unit_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [warning for warning in caught if "un-normalised pixels" in str(warning.message)]


def test_a_unit_range_tensor_with_a_stated_normalising_preprocess_warns_with_the_fix():
    model, image = small_cnn(), torch.rand(3, 16, 16)
    explainer = explain.GradCAM(model, "0", preprocess=Normalize())  # stated: the model takes normalised input
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explainer.explain(image)
    found = unit_warnings(caught)
    assert len(found) == 1 and found[0].filename == __file__  # at the user's line
    message = str(found[0].message)
    assert "mean=(0.485, 0.456, 0.406)" in message and "(x * 255).round().to(torch.uint8)" in message

    # the fix it names: the same pixels as uint8 give the map of the explicitly normalised image, and no warning
    pixels = (image * 255).round().to(torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = explainer.explain(pixels)
        by_hand = explainer.explain(Normalize()(pixels.float() / 255))
    assert not unit_warnings(caught)
    torch.testing.assert_close(fixed.maps, by_hand.maps)
    torch.testing.assert_close(fixed.images[0], pixels.permute(1, 2, 0).float() / 255)


def test_without_a_stated_preprocess_a_unit_range_tensor_is_shown_as_it_is_without_a_warning():
    model, image = small_cnn(), torch.rand(3, 16, 16)
    normalised = Normalize()(torch.rand(3, 16, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = explain.GradCAM(model, "0").explain(torch.stack([image, normalised]))  # the model may take it
        one = explain.GradCAM(model, "0").explain(image)
    assert not unit_warnings(caught)
    torch.testing.assert_close(explanation.images[0], image.permute(1, 2, 0))  # not de-normalised (washed out)
    torch.testing.assert_close(one.images[0], image.permute(1, 2, 0))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(explanation.images[1], (normalised.permute(1, 2, 0) * std + mean).clamp(0, 1))


def test_the_unit_range_rule_names_the_images_and_spares_normalised_or_unnormalising_cases():
    image = torch.rand(3, 8, 8)
    photo = Image.fromarray((np.random.default_rng(0).random((8, 8, 3)) * 255).astype(np.uint8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_inputs([photo, image], Normalize(), torch.device("cpu"))  # the PIL image is normalised: only #1
    found = unit_warnings(caught)
    assert len(found) == 1 and "image(s) 1 lies" in str(found[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_inputs(Normalize()(image), Normalize(), torch.device("cpu"))  # model input: below 0
        prepare_inputs(image, Normalize((0, 0, 0), (1, 1, 1)), torch.device("cpu"))  # the model takes [0, 1]
        prepare_inputs(torch.zeros(2, 3, 8, 8), Normalize(), torch.device("cpu"))  # the mean image, normalised
        prepare_inputs(image, lambda picture: torch.zeros(3, 8, 8), torch.device("cpu"))  # no stated statistics
    assert not unit_warnings(caught)


def test_a_detector_that_normalises_inside_takes_unit_tensors_without_a_warning():
    detector_type = type("FasterRCNN", (nn.Module,), {"__module__": "torchvision.models.detection.faster_rcnn"})
    model = detector_type()
    model.add_module("conv", nn.Conv2d(3, 2, 3, padding=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with explain.core.scope.CallScope(model):
            prepare_inputs(torch.rand(3, 8, 8), Normalize(), torch.device("cpu"))
        prepare_inputs(torch.rand(3, 8, 8), Normalize(), torch.device("cpu"))  # outside: warned
    assert len(unit_warnings(caught)) == 1


class HoldsTheModel:
    """A user's preprocess that keeps the model (as a closure or bound method would)."""

    def __init__(self, model: nn.Module):
        self.model, self.mean, self.std = model, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return (torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 255 - 0.5) / 0.25


@pytest.mark.parametrize("draw_first", [True, False])
def test_an_explanation_does_not_keep_the_preprocess_nor_its_model_alive(draw_first):
    model = small_cnn()
    alive = weakref.ref(model)
    batch = torch.randn(2, 3, 8, 8)
    explanation = explain.GradCAM(model, "0", preprocess=HoldsTheModel(model)).explain(batch)
    if draw_first:
        assert explanation.images.shape[0] == len(batch)
    del model
    gc.collect()
    assert alive() is None
    # the display images still undo the preprocess's statistics
    torch.testing.assert_close(explanation.images, (batch * 0.25 + 0.5).clamp(0, 1).permute(0, 2, 3, 1))


def test_a_path_given_as_bytes_reads_as_the_same_path_as_str(tmp_path):
    pixels = np.random.default_rng(1).integers(0, 256, (6, 7, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    expected = Normalize()(torch.from_numpy(pixels).permute(2, 0, 1).float() / 255)
    prepared = prepare_inputs([bytes(tmp_path / "a.png")], Normalize(), torch.device("cpu"))
    torch.testing.assert_close(prepared.batch[0], expected)


def test_a_channels_first_array_is_refused_with_the_transpose_that_fixes_it():
    pixels = np.random.default_rng(2).random((3, 8, 10)).astype(np.float32)
    with pytest.raises(ValueError, match=r"channels-first: pass array\.transpose\(1, 2, 0\)"):
        prepare_inputs(pixels, Normalize(), torch.device("cpu"))
    prepared = prepare_inputs(pixels.transpose(1, 2, 0), Normalize(), torch.device("cpu"))  # the fix it names
    torch.testing.assert_close(prepared.batch[0], Normalize()(torch.from_numpy(pixels)))
