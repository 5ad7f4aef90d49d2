"""False alarms of today's checks: a normalised bright image that lies in [0, 1] (mean = std = 0.5), and a user's
module wrapping HF's SigLIP classifier, which computes its attention-pooling head but classifies the mean token."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import explain
from explain.io.inputs import Normalize, prepare_inputs


def unit_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [warning for warning in caught if "un-normalised pixels" in str(warning.message)]


def test_a_normalised_bright_image_in_unit_range_is_not_taken_for_pixels_but_pixels_still_are():
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(160 + (rng.random((3, 8, 8)) * 95).astype(np.uint8)).float() / 255  # all levels ≥ 160
    half = Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # ViT's, SigLIP's, timm ViTs' statistics
    bright = half(pixels)  # 2x - 1: every value in [0.25, 1], yet normalised as stated
    assert 0 <= float(bright.min()) and float(bright.max()) <= 1
    low_contrast = Normalize()((torch.tensor([124.0, 117.0, 104.0]).view(3, 1, 1) + torch.from_numpy(
        rng.integers(0, 50, (3, 8, 8))).float()) / 255)  # levels within one ImageNet std above the mean: in [0, 1]
    assert 0 <= float(low_contrast.min()) and float(low_contrast.max()) <= 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_inputs(bright, half, torch.device("cpu"))
        prepare_inputs(low_contrast, Normalize(), torch.device("cpu"))
        prepare_inputs(bright.half(), half, torch.device("cpu"), dtype=torch.float16)  # float16 rounding: still levels
    assert not unit_warnings(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_inputs([bright, pixels, torch.rand(3, 8, 8)], half, torch.device("cpu"))  # the pixels: #1 and #2
    found = unit_warnings(caught)
    assert len(found) == 1 and "image(s) 1, 2 lies" in str(found[0].message)
    from explain.io.inputs import off_pixel_levels

    # by hand: read back as levels, (x * std + mean) * 255, a normalised image is whole levels; pixels k / 255 are not
    assert float(off_pixel_levels(bright[None], half.mean, half.std)[0]) < 1e-3
    assert float(off_pixel_levels(pixels[None], half.mean, half.std)[0]) == pytest.approx(0.5, abs=1e-3)  # even k


def test_a_siglip_processors_pixel_values_of_a_bright_photo_do_not_warn():
    transformers = pytest.importorskip("transformers")
    processor = transformers.SiglipImageProcessor(size={"height": 16, "width": 16})
    photo = Image.fromarray((200 + np.random.default_rng(1).random((20, 20, 3)) * 55).astype(np.uint8))
    pixel_values = processor(images=photo, return_tensors="pt")["pixel_values"]
    assert 0 <= float(pixel_values.min()) and float(pixel_values.max()) <= 1
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain.GradCAM(model, "0", preprocess=processor).explain(pixel_values)
        raw = explain.GradCAM(model, "0", preprocess=processor).explain(torch.from_numpy(  # ToTensor's output
            np.asarray(photo.resize((16, 16)), dtype=np.float32) / 255).permute(2, 0, 1))
    assert len(unit_warnings(caught)) == 1 and raw.maps.shape[-2:] == (16, 16)


def test_a_module_wrapping_the_siglip_classifier_gets_no_attention_pooling_warning():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.SiglipConfig(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=50, bos_token_id=1, eos_token_id=2, pad_token_id=0), num_labels=3)
    classifier = transformers.SiglipForImageClassification(config).eval()

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = classifier

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(pixel_values=x).logits

    x = torch.randn(1, 3, 16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        direct = explain.AttentionRollout(classifier, blocks="vision_model.encoder").explain(x)
        wrapped = explain.AttentionRollout(Wrapped(), blocks="inner.vision_model.encoder").explain(x)
    assert not [warning for warning in caught if "pools the tokens with attention" in str(warning.message)]
    torch.testing.assert_close(wrapped.maps, direct.maps)  # the same reading: the mean of the patch tokens' rows


class _Features(nn.Module):
    """Two convolutions, then the mean of their maps through a linear head; ``term`` adds what it computes."""

    def __init__(self, term: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.term = term
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(6, 4)
        self.colour = nn.Linear(3, 4)
        self.pixels = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.fc(self.features(x).mean((2, 3)))
        if self.term == "mean colour":  # a bias from the image's mean colour: no map goes around 'features'
            return scores + self.colour(x.mean((2, 3)))
        if self.term == "normalised mean colour":  # the same, after a normalisation inside the model
            return scores + self.colour(((x - 0.5) / 0.25).amax((2, 3)))
        if self.term == "flattened pixels":  # a linear layer on every pixel: a path around that carries the image
            return scores + self.pixels(x.flatten(1))
        return scores


@pytest.mark.parametrize("term", ["mean colour", "normalised mean colour", "none"])
def test_a_term_from_the_images_mean_colour_is_no_bypass_of_the_default_layer(term: str):
    from explain.core.layers import default_layer

    model = _Features(term).eval()
    x = torch.randn(1, 3, 8, 8)
    # by hand: the output does depend on the image through the colour term, around 'features' (a finite difference)
    if term != "none":
        shifted = x + 0.5  # the same maps' shape, another colour
        features_only = model.fc(model.features(shifted).mean((2, 3))) - model.fc(model.features(x).mean((2, 3)))
        assert not torch.allclose(model(shifted) - model(x), features_only)
    assert default_layer(model, x) == "features"


def test_paths_around_the_layer_that_carry_the_image_still_refuse():
    from explain.core.layers import default_layer

    with pytest.raises(ValueError, match="'features' for the evidence that goes through it"):
        default_layer(_Features("flattened pixels").eval(), torch.randn(1, 3, 8, 8))

    class Skip(nn.Module):  # a residual from the image itself around the whole body
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.body(x)).mean((2, 3))

    with pytest.raises(ValueError, match="is bypassed"):
        default_layer(Skip().eval(), torch.randn(1, 3, 8, 8))
