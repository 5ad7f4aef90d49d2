"""A hostile user on the output side (session 10): the shared uint8 colour table, overlays of PIL images and of maps
outside [0, 1], mask/contour options out of range, ``np.asarray`` of an Explanation, figures of 1 × 2000 strips and
with very long titles, ``normalize="method"`` figures of maps holding NaN or inf, and bytes paths. Each test checks
pixels, sizes or file contents against a by-hand computation, or the error's text."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

import explain
from explain.io import render
from explain.io.explanation import Explanation
from explain.io.inputs import DisplayImages, load_image

matplotlib.use("Agg")


def hand_made(maps: torch.Tensor, images: torch.Tensor | None = None) -> Explanation:
    """An Explanation of (N, K, H, W) maps (raw maps equal to them) on (N, H, W, 3) display images."""
    count, targets, height, width = maps.shape
    if images is None:
        images = torch.rand(count, height, width, 3, generator=torch.Generator().manual_seed(0))
    return Explanation(map_grid=maps, raw_map_grid=maps.clone(), scores=torch.zeros(count, targets),
                       class_indices=torch.zeros(count, targets, dtype=torch.long), display=DisplayImages(images),
                       method="Hand")


def blended(image: np.ndarray, colour: np.ndarray, alpha: float) -> np.ndarray:
    """(1 − alpha) · image + alpha · colour, both uint8, rounded to uint8: an overlay pixel by hand."""
    return np.round((1 - alpha) * image.astype(np.float64) + alpha * colour.astype(np.float64)).astype(np.uint8)


def matplotlib_uint8(cmap: str, value: float) -> np.ndarray:
    """matplotlib's own colour of ``value`` as uint8 RGB (its 256-entry lookup), rounded from float32 as render
    keeps its colours."""
    return (np.asarray(matplotlib.colormaps[cmap](value), dtype=np.float32)[:3] * np.float32(255)).round().astype(
        np.uint8)


def panel_pictures(figure: matplotlib.figure.Figure) -> list[np.ndarray]:
    """The pictures that a figure's panels show, in the order of its axes."""
    return [np.asarray(axis.images[0].get_array()) for axis in figure.axes if axis.images]


def panel_heights(figure: matplotlib.figure.Figure) -> list[float]:
    """Each picture panel's drawn height in pixels, once the figure is laid out."""
    FigureCanvasAgg(figure).draw()
    return [axis.get_window_extent().height for axis in figure.axes if axis.images]


# ---------------------------------------------------------------- the shared colour table


@pytest.mark.parametrize("cmap", ["jet", "RdBu_r", matplotlib.colormaps["viridis"]])
def test_the_uint8_colour_table_is_matplotlibs_lookup_and_cannot_be_edited(cmap) -> None:
    table = render.colour_table_uint8(cmap)
    name = cmap if isinstance(cmap, str) else cmap.name
    expected = np.stack([matplotlib_uint8(name, value) for value in np.linspace(0, 1, 256)])
    assert table.dtype == np.uint8 and table.shape == (256, 3) and np.array_equal(table, expected)
    values = torch.tensor([0.0, 0.3, 0.5, 0.999, 1.0])
    colours = render.colour_table_uint8(cmap)[render.colour_indices(values).numpy()]
    assert np.array_equal(colours, (render.colorize(values, cmap).numpy() * 255).round().astype(np.uint8))
    with pytest.raises(ValueError):
        table[0, 0] = 1  # cached and shared: a caller cannot change every later drawing


# ---------------------------------------------------------------- overlay's inputs


def test_overlay_takes_an_rgb_pil_image_as_its_uint8_pixels() -> None:
    pixels = np.zeros((4, 5, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = 200, 10, 50
    values = np.zeros((4, 5), np.float32)
    values[1, 2] = 1.0
    drawn = render.overlay(Image.fromarray(pixels), values, alpha=0.3)
    assert np.array_equal(drawn[1, 2], blended(pixels[1, 2], matplotlib_uint8("jet", 1.0), 0.3))
    assert np.array_equal(drawn[0, 0], blended(pixels[0, 0], matplotlib_uint8("jet", 0.0), 0.3))
    assert np.array_equal(drawn, render.overlay(pixels, values, alpha=0.3))


def test_overlay_warns_that_maps_outside_the_unit_range_are_clipped() -> None:
    image = np.full((2, 3, 3), 100, np.uint8)
    raw = np.array([[0.0, 3.5, 7.0], [-2.0, 0.5, 1.0]])
    with pytest.warns(UserWarning, match=r"span \[-2, 7\] and are clipped.*maps / maps.max\(\)"):
        drawn = render.overlay(image, raw, alpha=1.0)
    assert np.array_equal(drawn[0, 2], matplotlib_uint8("jet", 1.0))  # what it draws is what it says
    assert np.array_equal(drawn[1, 0], matplotlib_uint8("jet", 0.0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render.overlay(image, raw.clip(0, 1), alpha=1.0)  # maps in [0, 1]: nothing to say


@pytest.mark.parametrize(("options", "message"), [
    ({"mode": "mask", "keep": 2.0}, "keep is the share of pixels"),
    ({"mode": "mask", "keep": -0.5}, "keep is the share of pixels"),
    ({"mode": "contour", "levels": (0.5, 2.0)}, r"levels are map values in \[0, 1\]"),
])
def test_overlay_refuses_mask_and_contour_options_outside_the_unit_range(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        render.overlay(np.zeros((4, 4, 3), np.uint8), np.random.rand(4, 4), **options)


@pytest.mark.parametrize("maps", [np.ones(5), np.ones((0, 3)), np.ones((2, 3, 0))])
def test_overlay_refuses_maps_without_two_dimensions_of_pixels(maps) -> None:
    with pytest.raises(ValueError, match=r"maps must be \(h, w\), \(N, h, w\) or \(N, K, h, w\) with at least one"):
        render.overlay(np.zeros((4, 5, 3), np.uint8), maps)


# ---------------------------------------------------------------- Explanation as an array


def test_an_explanation_as_a_numpy_array_says_what_to_take_instead() -> None:
    explanation = hand_made(torch.rand(2, 1, 4, 4))
    for convert in (np.asarray, np.array):
        with pytest.raises(TypeError, match=r"e\.maps\.cpu\(\)\.numpy\(\).*e\.overlay\(\)"):
            convert(explanation)


# ---------------------------------------------------------------- figures: strips and long titles


@pytest.mark.parametrize("shape", [(1, 2000), (2000, 1)])
def test_the_panels_of_a_strip_image_are_drawn_thick_enough_to_see(shape) -> None:
    values = torch.rand(1, 1, *shape)
    explanation = hand_made(values / values.max())
    for figure in (explanation.figure(), explain.figure([explanation])):
        FigureCanvasAgg(figure).draw()
        for axis in (axis for axis in figure.axes if axis.images):
            extent = axis.get_window_extent()
            assert min(extent.width, extent.height) >= 20, (shape, extent)
        assert np.array_equal(panel_pictures(figure)[-1], explanation.overlay()[0])  # every pixel, stretched


def test_a_very_long_title_leaves_the_panels_their_size() -> None:
    values = torch.rand(1, 1, 32, 32)
    explanation = hand_made(values / values.max())
    short = panel_heights(explanation.figure(title="Grad-CAM"))
    long = panel_heights(explanation.figure(title="word " * 200))
    assert min(long) >= 0.9 * min(short), (short, long)
    grid_short = panel_heights(explain.figure([explanation]))
    grid_long = panel_heights(explain.figure([explanation], method_titles=["m " * 100]))
    assert min(grid_long) >= 0.9 * min(grid_short), (grid_short, grid_long)


# ---------------------------------------------------------------- normalize="method" with NaN and inf


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_method_scale_leaves_out_nan_and_inf_and_says_so(bad: float) -> None:
    maps = torch.zeros(2, 1, 8, 10)
    maps[0, 0, 2, 3], maps[1, 0, 5, 5] = 1.0, 0.5
    maps[1, 0, 0, 0] = bad
    explanation = hand_made(maps)
    with pytest.warns(UserWarning, match="explanation 1 \\(Hand\\): its maps hold"):
        figure = explain.figure([explanation], normalize="method", alpha=1.0, show_image=False)
    first, second = panel_pictures(figure)
    assert np.array_equal(first[2, 3], matplotlib_uint8("jet", 1.0))  # the largest finite value: the top colour
    assert np.array_equal(second[5, 5], matplotlib_uint8("jet", 0.5))  # half of it: the middle colour
    expected = matplotlib_uint8("jet", 0.0 if bad != bad else 1.0)  # NaN no evidence, inf the strongest
    assert np.array_equal(second[0, 0], expected)


def test_a_nan_pixel_of_a_signed_map_on_a_method_scale_is_drawn_as_no_evidence() -> None:
    maps = torch.zeros(1, 1, 6, 6)
    maps[0, 0, 1, 1], maps[0, 0, 4, 4], maps[0, 0, 3, 3] = 2.0, -2.0, float("nan")
    with pytest.warns(UserWarning, match="NaN"):
        figure = explain.figure([hand_made(maps)], normalize="method", alpha=1.0, show_image=False)
    (picture,) = panel_pictures(figure)
    assert np.array_equal(picture[3, 3], picture[0, 0])  # as a 0 pixel, not as the strongest evidence against
    assert np.array_equal(picture[3, 3], matplotlib_uint8(render.DIVERGING_CMAP, 0.5))
    assert np.array_equal(picture[4, 4], matplotlib_uint8(render.DIVERGING_CMAP, 0.0))


# ---------------------------------------------------------------- bytes paths


def test_load_image_and_save_take_a_bytes_path(tmp_path: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (6, 7, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    assert np.array_equal(np.asarray(load_image(os.fsencode(tmp_path / "in.png"))), pixels)
    values = torch.rand(1, 1, 6, 7)
    explanation = hand_made(values / values.max(), torch.from_numpy(pixels)[None].float() / 255)
    written = explanation.save(os.fsencode(tmp_path / "out.png"))
    assert written == tmp_path / "out.png"
    assert np.array_equal(np.asarray(Image.open(written)), explanation.overlay()[0])


def test_a_figure_of_maps_on_the_meta_device_says_why_it_cannot_be_drawn() -> None:
    explanation = hand_made(torch.rand(1, 1, 4, 4))
    explanation.raw_map_grid = explanation.raw_map_grid.to("meta")
    with pytest.raises(ValueError, match="explanation 1's maps are on the meta device"):
        explain.figure([explanation])
