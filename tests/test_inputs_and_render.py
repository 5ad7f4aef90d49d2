"""Inputs become the right batch and display images; overlays have the right pixels."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from explain.io.inputs import IMAGENET_MEAN, IMAGENET_STD, Normalize, prepare_inputs
from explain.io.render import colorize, overlay, resize_maps, tile

CPU = torch.device("cpu")


def normalized(pixels: np.ndarray) -> torch.Tensor:
    image = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    return (image - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


def test_images_are_normalised_with_imagenet_statistics_and_kept_for_display(rng):
    pixels = rng.integers(0, 256, size=(2, 12, 10, 3), dtype=np.uint8)
    prepared = prepare_inputs([pixels[0], Image.fromarray(pixels[1])], Normalize(), CPU)
    assert prepared.batch.shape == (2, 3, 12, 10)
    torch.testing.assert_close(prepared.batch[0], normalized(pixels[0]))
    torch.testing.assert_close(prepared.images, torch.from_numpy(pixels).float() / 255)


def test_tensors_are_used_as_they_are_and_denormalised_for_display(rng):
    pixels = rng.integers(0, 256, size=(3, 8, 8, 3), dtype=np.uint8)
    batch = torch.stack([normalized(p) for p in pixels])
    prepared = prepare_inputs(batch, Normalize(), CPU)
    assert torch.equal(prepared.batch, batch)
    torch.testing.assert_close(prepared.images, torch.from_numpy(pixels).float() / 255, rtol=0, atol=1e-5)


def test_a_resizing_preprocess_shows_what_the_model_saw(rng):
    import torchvision.transforms as T

    pixels = rng.integers(0, 256, size=(40, 60, 3), dtype=np.uint8)
    preprocess = T.Compose([T.Resize(20), T.CenterCrop(20), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    preprocess.mean, preprocess.std = IMAGENET_MEAN, IMAGENET_STD
    prepared = prepare_inputs(pixels, preprocess, CPU)
    assert prepared.batch.shape == (1, 3, 20, 20) and prepared.images.shape == (1, 20, 20, 3)
    expected = np.asarray(T.CenterCrop(20)(T.Resize(20)(Image.fromarray(pixels)))) / 255
    np.testing.assert_allclose(prepared.images[0].numpy(), expected, atol=1e-5)


def test_grayscale_is_repeated_to_rgb(rng):
    gray = rng.integers(0, 256, size=(6, 6), dtype=np.uint8)
    prepared = prepare_inputs([gray, Image.fromarray(gray)], Normalize(), CPU)
    torch.testing.assert_close(prepared.images[0], torch.from_numpy(np.repeat(gray[..., None], 3, 2)).float() / 255)
    torch.testing.assert_close(prepared.images[0], prepared.images[1])


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((6, 6, 4), np.uint8), "alpha"),
        (Image.new("RGBA", (6, 6)), "alpha channel"),
        (np.zeros((6, 6, 3), np.uint16), "16-bit"),
        (Image.new("I;16", (6, 6)), "16/32-bit"),
        (np.full((6, 6, 3), 2.0), "must lie in \\[0, 1\\]"),
        (np.full((6, 6, 3), np.nan), "NaN"),
        (torch.full((3, 6, 6), float("inf")), "NaN or inf"),
        ([], "empty"),
        ([np.zeros((6, 6, 3), np.uint8), np.zeros((7, 6, 3), np.uint8)], "different sizes"),
        ("/no/such/image.png", "no image file"),
        (42, "cannot explain a int"),
    ],
)
def test_bad_inputs_are_refused_with_the_fix(bad, message):
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message):
        prepare_inputs(bad, Normalize(), CPU)


def test_overlay_pixels_on_a_known_map():
    jet = matplotlib.colormaps["jet"]
    image = np.zeros((2, 2, 3), np.uint8)
    image[0, 0] = (200, 100, 0)
    heat = np.array([[1.0, 0.0], [0.5, 0.25]])
    result = overlay(image, heat, alpha=0.5)
    for (row, column) in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        colour = np.array(jet(int(round(heat[row, column] * 255)))[:3])
        expected = np.round((0.5 * image[row, column] / 255 + 0.5 * colour) * 255)
        np.testing.assert_array_equal(result[row, column], expected)
    # jet(1.0) is dark red (0.5, 0, 0): on a black pixel at alpha 0.5 → 0.25 · 255 ≈ 64
    assert tuple(overlay(np.zeros((1, 1, 3)), np.ones((1, 1)), alpha=0.5)[0, 0]) == (64, 0, 0)
    assert overlay(image, heat, alpha=0.0).tolist() == image.tolist()


def test_overlay_resizes_maps_and_is_batched():
    images = np.zeros((3, 8, 6, 3), np.float32)
    maps = torch.rand(3, 2, 4, 3)
    result = overlay(images, maps)
    assert result.shape == (3, 2, 8, 6, 3) and result.dtype == np.uint8
    single = overlay(images[1], resize_maps(maps[1, 0], (8, 6)))
    np.testing.assert_array_equal(result[1, 0], single)
    assert tile(result).shape == (16, 18, 3)


def test_colorize_is_a_lookup_of_the_colour_map():
    viridis = matplotlib.colormaps["viridis"]
    values = torch.tensor([0.0, 0.5, 1.0, 2.0])
    expected = [viridis(i)[:3] for i in (0, 128, 255, 255)]
    np.testing.assert_allclose(colorize(values, "viridis").numpy(), expected, atol=1e-6)
