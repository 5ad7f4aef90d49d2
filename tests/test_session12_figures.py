"""Paper figures checked in their pixels and files: panels drawn with no colour the overlay does not hold (no
resampling between pixels), vector files that embed each panel's own pixels once, and signed maps with ±inf pixels
drawn on the scale of their finite values."""

from __future__ import annotations

import base64
import dataclasses
import io
import re
import xml.etree.ElementTree as ET

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image
from torch import nn

import explain
from explain.io import render

matplotlib.use("Agg")
torch.set_num_threads(1)

SVG = "{http://www.w3.org/2000/svg}"


class TinyCNN(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def with_maps(explanation: explain.Explanation, maps: torch.Tensor) -> explain.Explanation:
    """``explanation`` holding ``maps`` (N, 1, H, W) as its maps, normalised and raw alike."""
    return dataclasses.replace(explanation, map_grid=maps.clone(), raw_map_grid=maps.clone())


def checkerboard(height: int, width: int, scale: float = 1.0) -> torch.Tensor:
    """(1, 1, H, W) signed map: +scale and −scale in alternating pixels, the strongest evidence for and against."""
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.where((rows + columns) % 2 == 0, scale, -scale).float()[None, None]


def signed_panel(image: np.ndarray, unit: torch.Tensor) -> np.ndarray:
    """The overlay figure() draws for a signed map already in [0, 1] (0.5 no evidence), by its documented rule."""
    return render.overlay(image, unit, alpha=0.5, cmap=render.DIVERGING_CMAP, signed=True)


def panel_pixels(fig, axis) -> np.ndarray:
    """The RGB pixels of ``axis``'s picture in ``fig`` drawn by Agg, without a 2-pixel border."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rendered = np.asarray(canvas.buffer_rgba())[..., :3]
    box = axis.images[0].get_window_extent(canvas.get_renderer())
    top = rendered.shape[0]
    return rendered[int(top - box.y1) + 2:int(top - box.y0) - 2, int(box.x0) + 2:int(box.x1) - 2]


def embedded_svg_pictures(svg: bytes) -> list[np.ndarray]:
    """Every picture embedded in an SVG file, decoded to RGB."""
    pictures = []
    for node in ET.fromstring(svg).iter(f"{SVG}image"):
        reference = node.get("{http://www.w3.org/1999/xlink}href") or node.get("href")
        data = base64.b64decode(reference.split(",", 1)[1])
        pictures.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    return pictures


# ---------------------------------------------------------------- 1. panels are drawn with their own colours


def test_a_grid_panel_shows_only_the_overlays_colours():
    """figure() drew its panels with bilinear interpolation: between a pixel of evidence for (red) and one of
    evidence against (blue) it drew mixtures, the diverging map's pale "no evidence" among them, and small images
    were blurred. A panel now holds only the colours of its overlay, in nearest-neighbour blocks."""
    image = np.full((8, 12, 3), 120, np.uint8)
    e = with_maps(explain.Saliency(TinyCNN()).explain(image), checkerboard(8, 12))
    fig = explain.figure([e], clip_percentile=100)
    expected = signed_panel(image, render.signed_to_unit(checkerboard(8, 12)[0, 0], 100))
    assert np.array_equal(np.asarray(fig.axes[1].images[0].get_array()), expected)
    drawn = panel_pixels(fig, fig.axes[1])
    colours = {tuple(colour) for colour in drawn.reshape(-1, 3).tolist()}
    assert colours == {tuple(colour) for colour in expected.reshape(-1, 3).tolist()}  # the two, and no other
    # the hottest pixel (evidence for, top left) is drawn at its place: the panel's top-left block is red-ish
    assert tuple(drawn[0, 0]) == tuple(expected[0, 0]) and tuple(drawn[-1, 0]) == tuple(expected[-1, 0])

    # the rule on an explanation's own figure, a wider image, unsigned maps on "viridis"
    wide = np.random.default_rng(1).integers(0, 255, (6, 20, 3), np.uint8)
    hot = torch.zeros(1, 1, 6, 20)
    hot[0, 0, 1, 17] = 1.0
    own = with_maps(explain.Saliency(TinyCNN(seed=2)).explain(wide), hot)
    own_fig = own.figure(cmap="viridis")
    drawn = panel_pixels(own_fig, own_fig.axes[1])
    overlay = own.overlay(cmap="viridis")[0]
    assert {tuple(c) for c in drawn.reshape(-1, 3).tolist()} <= {tuple(c) for c in overlay.reshape(-1, 3).tolist()}
    hottest = tuple(overlay[1, 17])
    rows, columns = np.nonzero((drawn == hottest).all(-1))
    height, width = drawn.shape[:2]
    assert rows.size and (rows.max() + 1) / height * 6 <= 2.2 and rows.min() / height * 6 >= 0.8
    assert columns.min() / width * 20 >= 16.8 and (columns.max() + 1) / width * 20 <= 18.2


# ---------------------------------------------------------------- 2. vector files embed each panel's own pixels


def test_vector_files_embed_each_panel_at_its_own_pixels_whatever_the_dpi(tmp_path):
    """PDF/SVG/EPS embedded each panel resampled at the save's dpi: a 20 × 30 panel became a 570-pixel-wide blurred
    picture at 300 dpi (a grid of 224-pixel images, 7 MB of PDF; EPS 19 MB). Each panel is now embedded once at its
    own pixels, exactly the overlay's, so the file does not grow with the dpi."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (20, 30, 3), np.uint8) for _ in range(2)]
    model = TinyCNN()
    saliency = explain.Saliency(model).explain(images)
    signed = with_maps(explain.Saliency(model).explain(images), torch.cat([checkerboard(20, 30, 0.3)] * 2))
    fig = explain.figure([saliency, signed], clip_percentile=100)
    sizes = []
    for dpi in (72, 300):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="svg", dpi=dpi)
        sizes.append(len(buffer.getvalue()))
        pictures = embedded_svg_pictures(buffer.getvalue())
        assert len(pictures) == 2 * 3
        for image in range(2):
            shown = [np.asarray(axis.images[0].get_array()) for axis in fig.axes[3 * image:3 * image + 3]]
            assert np.array_equal(shown[0], images[image])
            assert np.array_equal(shown[2], signed_panel(images[image], render.signed_to_unit(
                checkerboard(20, 30, 0.3)[0, 0], 100)))
            for picture, panel in zip(pictures[3 * image:3 * image + 3], shown):
                assert np.array_equal(picture, panel)
    assert sizes[1] < 1.05 * sizes[0]
    pdf = io.BytesIO()
    fig.savefig(pdf, format="pdf", dpi=300)
    dimensions = re.findall(rb"/Subtype /Image.*?/Width (\d+).*?/Height (\d+)", pdf.getvalue(), re.S)
    widths_heights = re.findall(rb"/Height (\d+).*?/Width (\d+)", pdf.getvalue(), re.S)
    assert dimensions or widths_heights
    assert all(sorted((int(a), int(b))) == [20, 30] for a, b in dimensions or widths_heights)

    # the rule for an explanation's own figure saved as SVG: its image and overlay, as e.overlay() draws them
    one = explain.GradCAM(TinyCNN(seed=3), "conv").explain(rng.integers(0, 255, (9, 14, 3), np.uint8), topk=2)
    pictures = embedded_svg_pictures(one.save(tmp_path / "cam.svg", dpi=600).read_bytes())
    assert [picture.shape for picture in pictures] == [(9, 14, 3)] * 3
    assert np.array_equal(pictures[0], render.as_uint8(one.images[0]))
    assert np.array_equal(pictures[1], one.overlay()[0, 0]) and np.array_equal(pictures[2], one.overlay()[0, 1])


# ---------------------------------------------------------------- 3. signed maps with ±inf pixels


def test_signed_maps_with_infinite_pixels_are_scaled_by_their_finite_values():
    """signed_to_unit took the percentile with ±inf inside: it came out NaN (or inf), the scale fell back to 1, and
    a map of small values (IG's 1e-2) was drawn as no evidence at all, ±inf aside. The percentile is of the finite
    |values|; ±inf is drawn at 1 and 0, the strongest evidence, as the figure's warning says."""
    values = torch.tensor([[[float("inf"), 0.01, -0.005, 0.02, float("-inf")]]])
    assert render.signed_to_unit(values, clip_percentile=100)[0, 0].tolist() == pytest.approx([1.0, 0.75, 0.375, 1.0,
                                                                                               0.0])
    assert render.signed_to_unit(values, clip_percentile=50)[0, 0, 1:4].tolist() == pytest.approx([1.0, 0.25, 1.0])

    # the rule in explain.figure: one +inf pixel of a 12 × 12 map left the others' colours as without it
    image = np.full((12, 12, 3), 200, np.uint8)
    small = checkerboard(12, 12, 0.01)
    small[..., 6:, :] *= 0.5  # the lower half weaker: not every finite pixel at the largest |value|
    clean = with_maps(explain.Saliency(TinyCNN(seed=4)).explain(image), small)
    broken_maps = small.clone()
    broken_maps[0, 0, 8, 3] = float("inf")
    broken = with_maps(clean, broken_maps)
    with pytest.warns(UserWarning, match="1 infinite pixel"):
        broken_panel = np.asarray(explain.figure([broken], clip_percentile=100).axes[1].images[0].get_array())
    clean_panel = np.asarray(explain.figure([clean], clip_percentile=100).axes[1].images[0].get_array())
    expected = signed_panel(image, render.signed_to_unit(small[0, 0], 100))
    assert np.array_equal(clean_panel, expected)
    outside = np.ones((12, 12), bool)
    outside[7:10, 2:5] = False  # the inf pixel and its neighbours (the overlay is drawn pixel for pixel)
    assert np.array_equal(broken_panel[outside], expected[outside])
    assert broken_panel[8, 3].tolist() == signed_panel(image[:1, :1], torch.ones(1, 1))[0, 0].tolist()
