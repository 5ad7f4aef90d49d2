"""Grayscale images on 1-channel models stay 1-channel; contours of signed maps are drawn on both signs."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch import nn

from explain.core.capture import model_input_channels
from explain.io import render
from explain.io.inputs import IMAGENET_MEAN, IMAGENET_STD, Normalize, prepare_inputs
from explain.methods import Saliency

CPU = torch.device("cpu")
GRAY_MEAN, GRAY_STD = sum(IMAGENET_MEAN) / 3, sum(IMAGENET_STD) / 3  # the default normalisation, averaged


def tiny_model(channels: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(channels, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 5))


def saliency_by_hand(model: nn.Module, batch: torch.Tensor, target: int) -> torch.Tensor:
    """max over channels of |∂score/∂input| of a (1, C, H, W) batch, (H, W)."""
    batch = batch.clone().requires_grad_(True)
    model(batch)[0, target].backward()
    assert batch.grad is not None
    return batch.grad[0].abs().amax(dim=0)


@pytest.fixture
def gray_pixels() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(12, 12), dtype=np.uint8)


def test_a_grayscale_image_stays_one_channel_for_a_one_channel_model(gray_pixels, tmp_path: Path):
    model = tiny_model(1)
    assert model_input_channels(model) == 1
    unit = torch.from_numpy(gray_pixels).float() / 255
    expected = saliency_by_hand(model, ((unit - GRAY_MEAN) / GRAY_STD)[None, None], target=2)
    path = tmp_path / "gray.png"
    Image.fromarray(gray_pixels).save(path)  # a 1-channel (mode L) file
    inputs = [gray_pixels, gray_pixels[:, :, None], Image.fromarray(gray_pixels), str(path),
              torch.from_numpy(gray_pixels)[None], np.repeat(gray_pixels[:, :, None], 3, axis=2)]  # gray stored as RGB
    explainer = Saliency(model)
    parameters = [(p.clone(), p.requires_grad) for p in model.parameters()]
    for item in inputs:
        explanation = explainer.explain(item, target=2)
        torch.testing.assert_close(explanation.raw_maps[0], expected)
        # the display image: the gray pixels, shown gray
        torch.testing.assert_close(explanation.images[0], unit[:, :, None].expand(-1, -1, 3))
    assert model.training and all(torch.equal(p, before) and p.requires_grad == flag
                                  for p, (before, flag) in zip(model.parameters(), parameters))


@pytest.mark.parametrize("preprocess", [Normalize(mean=(0.1307,), std=(0.3081,)),
                                        T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])])
def test_a_one_channel_models_own_preprocess_gets_the_grayscale_image(gray_pixels, preprocess):
    model = tiny_model(1)
    unit = torch.from_numpy(gray_pixels).float() / 255
    expected = saliency_by_hand(model, ((unit - 0.1307) / 0.3081)[None, None], target=4)
    explanation = Saliency(model, preprocess=preprocess).explain(gray_pixels, target=4)
    torch.testing.assert_close(explanation.raw_maps[0], expected)
    torch.testing.assert_close(explanation.images[0], unit[:, :, None].expand(-1, -1, 3), rtol=0, atol=1e-6)


def test_an_rgb_model_still_gets_the_grayscale_image_on_three_channels(gray_pixels):
    model = tiny_model(3)
    unit = torch.from_numpy(gray_pixels).float()[None].expand(3, -1, -1) / 255
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    expected = saliency_by_hand(model, ((unit - mean) / std)[None], target=1)
    for item in (gray_pixels, Image.fromarray(gray_pixels)):
        torch.testing.assert_close(Saliency(model).explain(item, target=1).raw_maps[0], expected)
    assert prepare_inputs(gray_pixels, Normalize(), CPU).batch.shape == (1, 3, 12, 12)  # channels unknown: RGB


def test_a_colour_image_for_a_one_channel_model_is_refused_with_the_fix(tmp_path: Path):
    colour = np.random.default_rng(1).integers(0, 256, size=(12, 12, 3), dtype=np.uint8)
    path = tmp_path / "colour.png"
    Image.fromarray(colour).save(path)
    explainer = Saliency(tiny_model(1))
    for item in (colour, Image.fromarray(colour), str(path), torch.from_numpy(colour).permute(2, 0, 1)):
        with pytest.raises(ValueError, match=r"takes 1-channel \(grayscale\) images.*convert\('L'\)"):
            explainer.explain(item, target=0)


def test_model_input_channels_reads_the_first_convolution():
    assert model_input_channels(nn.Sequential(nn.Flatten(), nn.Linear(4, 2))) is None
    assert model_input_channels(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 1, 1))) == 3
    assert model_input_channels(nn.Sequential(nn.LazyConv2d(8, 3))) is None  # not built yet: not known


# contours -------------------------------------------------------------------------------------------------

HEIGHT, WIDTH, RADIUS = 64, 96, 16.0
POSITIVE, NEGATIVE = (32, 24), (32, 72)  # (row, column) of each blob's centre


def cone(centre: tuple[int, int]) -> np.ndarray:
    """1 at ``centre`` falling linearly to 0 at RADIUS: the level-l iso-line is the circle of radius RADIUS·(1 − l)."""
    rows, columns = np.mgrid[0:HEIGHT, 0:WIDTH]
    return np.clip(1 - np.hypot(rows - centre[0], columns - centre[1]) / RADIUS, 0, 1).astype(np.float32)


def distances(centre: tuple[int, int]) -> np.ndarray:
    rows, columns = np.mgrid[0:HEIGHT, 0:WIDTH]
    return np.hypot(rows - centre[0], columns - centre[1])


def test_contours_of_a_signed_map_are_drawn_on_both_signs():
    signed_map = cone(POSITIVE) - cone(NEGATIVE)  # in [-1, 1]
    image = np.full((HEIGHT, WIDTH, 3), 128, np.uint8)
    drawn = render.overlay(image, (signed_map + 1) / 2, cmap=render.DIVERGING_CMAP, mode="contour", signed=True)
    table = (render.colormap_table(render.DIVERGING_CMAP) * 255).round().to(torch.uint8).numpy()
    for level in (0.25, 0.5, 0.75):
        radius = RADIUS * (1 - level)
        for centre, value in ((POSITIVE, 0.5 + level / 2), (NEGATIVE, 0.5 - level / 2)):
            colour = table[min(int(value * 256), 255)]  # matplotlib's entry for value
            on_line = (drawn == colour).all(axis=-1)
            beside_line = cv2.dilate(on_line.astype(np.uint8), np.ones((3, 3), np.uint8)).astype(bool)
            circle = np.abs(distances(centre) - radius) <= 0.5
            # the line is drawn: every pixel of the circle has one of its colour beside it, and none far from it
            assert beside_line[circle].all() and not (on_line & (np.abs(distances(centre) - radius) > 2)).any()
    negative_lines = (drawn != 128).any(axis=-1) & (distances(NEGATIVE) < RADIUS)
    assert negative_lines.sum() > 50 and (drawn[negative_lines][:, 2] > drawn[negative_lines][:, 0]).all()  # blue
    positive_lines = (drawn != 128).any(axis=-1) & (distances(POSITIVE) < RADIUS)
    assert (drawn[positive_lines][:, 0] > drawn[positive_lines][:, 2]).all()  # red
    assert (drawn[(distances(POSITIVE) > RADIUS + 2) & (distances(NEGATIVE) > RADIUS + 2)] == 128).all()


def test_contours_of_an_unsigned_map_are_drawn_as_before():
    image = np.random.default_rng(2).integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
    heat = cone(POSITIVE) * 0.9 + cone(NEGATIVE) * 0.4
    table = (render.colormap_table("jet") * 255).round().numpy()
    expected = image.copy()  # by hand: OpenCV's lines around each level's region, in the colour map's colour
    for level in (0.25, 0.5, 0.75):
        contours, _ = cv2.findContours((heat >= level).astype(np.uint8), cv2.RETR_LIST, cv2.CHAIN_APPROX_NONE)
        cv2.drawContours(expected, contours, -1, tuple(int(c) for c in table[min(int(level * 256), 255)]), 1)
    assert np.array_equal(render.overlay(image, heat, mode="contour"), expected)
    assert np.array_equal(render.overlay(image, heat, mode="contour", signed=False), expected)


def test_a_dataset_run_and_a_metric_read_grayscale_files_for_a_one_channel_model(tmp_path: Path):
    """``explain.run`` over a folder of grayscale PNGs (decoded in this process and by a worker process) and a metric
    given the files both make 1-channel model input: the stored maps equal the explainer's on the 1-channel tensor
    built by hand, and the metric's scores equal those of that tensor (before, both failed: the model got 3
    channels)."""
    import explain
    from explain.dataset_tools.index import read_maps
    from explain.metrics import deletion

    model = tiny_model(1).eval()
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(1)
    pixels = [rng.integers(0, 256, size=(12, 12), dtype=np.uint8) for _ in range(3)]
    for index, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"{index}.png")
    batch = torch.stack([((torch.from_numpy(image).float() / 255 - GRAY_MEAN) / GRAY_STD)[None] for image in pixels])
    explainer = Saliency(model)
    expected = explainer.explain(batch, target=1).map_grid
    for workers, out in ((0, tmp_path / "out0"), (1, tmp_path / "out1")):
        summary = explain.run(explainer, folder, out, target=1, batch_size=2, progress=False, workers=workers)
        assert summary.explained == 3
        stored = dict(read_maps(out))
        assert len(stored) == 3
        for image_id, maps in stored.items():
            index = int(image_id[0])  # "<file name>-<hash>"
            torch.testing.assert_close(maps[0], expected[index, 0].float(), atol=2e-3, rtol=0)  # stored as float16
    files = [str(folder / f"{index}.png") for index in range(3)]
    maps = expected[:, 0]
    from_files, from_tensor = deletion(model, files, maps, target=1), deletion(model, batch, maps, target=1)
    torch.testing.assert_close(from_files.curves, from_tensor.curves)
    assert from_tensor.curves.std() > 0  # the scores change as pixels are deleted: the comparison says something
