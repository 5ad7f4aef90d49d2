"""Attacks on figures and display as a researcher making paper figures and a notebook user would make them:
Explanation.show/save/figure/overlay/_repr_html_, render's functions handed odd maps, explain.figure and compare.
Each test checks pixels or file contents, and each rule on a second model or input too."""

from __future__ import annotations

import dataclasses
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
from explain.core.capture import LayerNotFoundError
from explain.io import render

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

torch.set_num_threads(1)


class ColumnScore(nn.Module):
    """Score 0 = mean of ``channel`` over the left third − ``weight`` × its mean over the right third (the middle
    third unused): Integrated Gradients with reduce="sum" is then positive, 0 and negative over the thirds."""

    def __init__(self, channel: int = 0, weight: float = 3.0):
        super().__init__()
        self.channel, self.weight = channel, weight

    def forward(self, x):
        plane = x[:, self.channel]
        third = plane.shape[-1] // 3
        score = plane[..., :third].mean((1, 2)) - self.weight * plane[..., -third:].mean((1, 2))
        return torch.stack([score, -score], 1)


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(channels, 4, 3, padding=1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


class Flat(nn.Module):
    """No spatial layer at all: CAM methods cannot find one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


def solid(height: int, width: int, colour=(255, 0, 0)) -> np.ndarray:
    image = np.zeros((height, width, 3), np.uint8)
    image[...] = colour
    return image


def signed_explanation(model: nn.Module, image: np.ndarray) -> explain.Explanation:
    return explain.IntegratedGradients(model, reduce="sum", steps=4).explain(image, target=0)


def panel(fig, index: int) -> np.ndarray:
    return np.asarray(fig.axes[index].images[0].get_array())


def drawn(fig):
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def rdbu(value: float) -> np.ndarray:
    return (render.colormap_table("RdBu_r")[round(value * 255)].numpy() * 255).round()


# ---------------------------------------------------------------- 1. NaN in a signed map


def test_a_nan_pixel_does_not_turn_a_signed_map_into_strong_evidence_against():
    """signed_to_unit took the percentile with NaN inside: the scale was NaN, every pixel NaN, drawn as 0, the
    strongest evidence against, over the whole panel. NaN is left out and drawn at 0.5, as as_drawn does."""
    values = torch.tensor([[[float("nan"), -1.0, 1.0, 0.5]]])
    assert render.signed_to_unit(values, clip_percentile=100).tolist() == [[[0.5, 0.0, 1.0, 0.75]]]

    # the rule in explain.figure, on an Integrated Gradients map with one NaN pixel
    e = signed_explanation(ColumnScore(), solid(30, 30))
    broken = dataclasses.replace(e, raw_map_grid=e.raw_map_grid.clone())
    broken.raw_map_grid[0, 0, 0, 0] = float("nan")
    clean_panel = panel(explain.figure([e], alpha=1.0, clip_percentile=100), 1)
    nan_panel = panel(explain.figure([broken], alpha=1.0, clip_percentile=100), 1)
    assert np.array_equal(nan_panel[5:, :], clean_panel[5:, :])  # the other pixels as without the NaN
    assert nan_panel[0, 0].tolist() == rdbu(0.5).tolist() and clean_panel[5, 27].tolist() == rdbu(0.0).tolist()


# ---------------------------------------------------------------- 2. "mask" mode with no evidence


def test_mask_mode_keeps_nothing_of_an_all_zero_map():
    """mode="mask" kept every pixel >= the top-20 % threshold; with an all-zero map the threshold is 0 and the
    whole image was shown as relevant. A pixel of no evidence is dimmed; ties of a constant positive map are kept."""
    image = np.full((10, 10, 3), 200, np.uint8)
    assert (render.overlay(image, np.zeros((10, 10)), mode="mask") == 30).all()
    assert (render.overlay(image, np.full((10, 10), 0.4), mode="mask") == 200).all()

    # the rule in a figure of an explanation whose map is zero everywhere (a score that ignores the image)
    class Ignores(nn.Module):
        def forward(self, x):
            return torch.stack([x.sum((1, 2, 3)) * 0, x.sum((1, 2, 3)) * 0 + 1], 1)

    with pytest.warns(RuntimeWarning, match="zero everywhere"):
        zero = explain.Saliency(Ignores()).explain(solid(12, 20, (100, 150, 250)), target=0)
    masked = panel(explain.figure([zero], mode="mask"), 1).reshape(-1, 3).astype(float)
    assert np.abs(masked - 0.15 * np.array([100, 150, 250])).max() <= 0.5  # dimmed to 15 %, everywhere


# ---------------------------------------------------------------- 3. "alpha" mode with signed maps


def test_alpha_mode_draws_evidence_against_as_strongly_as_evidence_for():
    """mode="alpha" scaled the opacity by the centred value m, so the strongest evidence against (m = 0) was
    drawn as the bare image, no evidence (m = 0.5) half covered. The opacity is |2m − 1| for signed maps."""
    e = signed_explanation(ColumnScore(weight=1.0), solid(30, 30))  # +1, 0, −1 over the thirds
    assert float(e.maps[0, 5, 2]) == pytest.approx(1.0) and float(e.maps[0, 5, 27]) == pytest.approx(-1.0)
    faded = panel(explain.figure([e], mode="alpha", alpha=0.8, clip_percentile=100), 1)
    image = np.array([255, 0, 0])
    assert faded[5, 15].tolist() == [255, 0, 0]  # no evidence: the image, pure red kept red (RGB, not BGR)
    for column, value in ((2, 1.0), (27, 0.0)):  # evidence for and against: 80 % of their colours
        assert faded[5, column].tolist() == (0.2 * image + 0.8 * rdbu(value)).round().tolist()

    # the rule on another model and image: green channel, a non-square grey image, render.overlay directly
    other = signed_explanation(ColumnScore(channel=1, weight=2.0), solid(18, 45, (200, 200, 200)))
    other_faded = panel(explain.figure([other], mode="alpha", alpha=1.0, clip_percentile=100), 1)
    assert other_faded[9, 22].tolist() == [200, 200, 200]
    assert other_faded[9, 40].tolist() == rdbu(0.0).tolist()  # the strongest evidence against, fully opaque
    grey = np.full((1, 3, 3), 90, np.uint8)
    direct = render.overlay(grey, np.array([[0.0, 0.5, 1.0]]), mode="alpha", alpha=1.0, cmap="RdBu_r", signed=True)
    assert direct[0].tolist() == [rdbu(0.0).tolist(), [90, 90, 90], rdbu(1.0).tolist()]


# ---------------------------------------------------------------- 4. show() under Agg


def test_show_under_agg_leaves_no_figure_open():
    """Under Agg plt.show() does nothing: the figure stayed open in pyplot, one more on every call (a leak in a
    loop, and matplotlib's 'more than 20 figures' warning). It is closed once shown, as a notebook closes it."""
    plt.close("all")
    e = explain.GradCAM(TinyCNN(), "conv").explain(solid(16, 16, (30, 200, 90)))
    for _ in range(3):
        e.show()
    assert plt.get_fignums() == []
    # a figure the user made before is the user's: show() neither draws into it nor closes it
    own = plt.figure()
    e.show()
    assert plt.get_fignums() == [own.number] and own.axes == []
    plt.close(own)

    # the rule when the drawing fails, on another model: the half-made figure is closed too
    other = explain.Saliency(TinyCNN(channels=1, seed=3)).explain(torch.rand(2, 1, 9, 13))
    for bad in ({"cmap": "no-such-map"}, {"image_titles": ["only one"]}):
        with pytest.raises((KeyError, ValueError)):
            other.show(**bad)
        assert plt.get_fignums() == [], bad


# ---------------------------------------------------------------- 5. long class names


def _titles_inside_and_apart(fig) -> list[str]:
    renderer = drawn(fig)
    width = fig.bbox.width
    boxes = [(axis.title.get_window_extent(renderer), axis.get_title()) for axis in fig.axes if axis.get_title()]
    for box, text in boxes:
        assert box.x0 >= -1 and box.x1 <= width + 1, f"title runs off the figure: {text[:40]!r}"
    for (first, text), (second, _) in zip(boxes, boxes[1:]):
        if first.overlaps(second):
            raise AssertionError(f"titles overlap: {text[:40]!r}")
    return [text for _, text in boxes]


def test_a_long_class_name_stays_over_its_panel_and_in_the_figure():
    """A 90-character class name ran over the neighbouring panels and off the figure (cut off in a saved PDF).
    It is broken into lines at the panel's width, every character kept."""
    long_name = "American Staffordshire terrier, Staffordshire terrier, pit bull terrier, a dog of some size"
    names = [long_name, "b" * 70, "c"]
    e = explain.GradCAM(TinyCNN(), "conv", class_names=names).explain(
        [solid(16, 16, (200, 30, 30)), solid(16, 16, (30, 30, 200))], target=[0, 1])
    texts = _titles_inside_and_apart(e.figure())
    assert any(re.sub(r"\s", "", long_name) in re.sub(r"\s", "", text) for text in texts)
    assert any("b" * 70 in text.replace("\n", "") for text in texts)

    # the rule in a comparison grid of two methods, another model and input size
    model = TinyCNN(seed=5)
    images = [solid(20, 30, (10, 220, 10))]
    grid = explain.figure([explain.GradCAM(model, "conv", class_names=names).explain(images, target=0),
                           explain.Saliency(model, class_names=names).explain(images, target=0)])
    assert sum(re.sub(r"\s", "", long_name) in re.sub(r"\s", "", text) for text in _titles_inside_and_apart(grid)) == 2


def test_the_notebook_table_escapes_class_names():
    names = ['<img src=x onerror="alert(1)">', "a & b", "c"]
    page = explain.GradCAM(TinyCNN(), "conv", class_names=names).explain(solid(8, 8), target=[0]).__getitem__(0)
    html_page = page._repr_html_()
    assert "<img src=x" not in html_page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt; (0)" in html_page
    assert explain.GradCAM(TinyCNN(), "conv", class_names=names).explain(solid(8, 8), target=1)._repr_html_().count(
        "a &amp; b (1)") == 1


# ---------------------------------------------------------------- 6. non-square images


def _panel_share(fig) -> float:
    """The share of the figure's area covered by its panels' pictures."""
    renderer = drawn(fig)
    covered = sum(image.get_window_extent(renderer).width * image.get_window_extent(renderer).height
                  for axis in fig.axes if axis.get_label() != "<colorbar>" for image in axis.images)
    return covered / (fig.bbox.width * fig.bbox.height)


@pytest.mark.parametrize("size", [(90, 160), (160, 90)], ids=["wide", "tall"])
def test_panels_follow_the_images_shape(size):
    """Panels were square whatever the image: a 16:9 picture filled less than half of e.figure() and of a grid,
    the rest blank. Panels take the images' aspect ratio, so the pictures fill about as much as square ones."""
    model = TinyCNN(seed=2)
    e = explain.GradCAM(model, "conv").explain(np.random.default_rng(0).integers(0, 255, (*size, 3), np.uint8), topk=2)
    square = explain.GradCAM(model, "conv").explain(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8),
                                                    topk=2)
    for draw in (lambda x: x.figure(), lambda x: explain.figure([x, x]),
                 lambda x: explain.figure([x, x], rows="methods", colorbar=True)):
        assert _panel_share(draw(e)) >= 0.75 * _panel_share(draw(square))


# ---------------------------------------------------------------- 7. saving: folders, dpi, vector files


def test_saving_into_a_folder_that_does_not_exist_names_the_folder(tmp_path):
    e = explain.GradCAM(TinyCNN(), "conv").explain(solid(8, 8))
    for name in ("cam.png", "cam.pdf"):
        with pytest.raises(FileNotFoundError, match=r"the folder '.*missing' does not exist\. Create it first"):
            e.save(tmp_path / "missing" / name)
    assert list(tmp_path.iterdir()) == []

    # the rule for a comparison's figure, another model
    comparison = explain.compare(TinyCNN(seed=4), solid(12, 12, (0, 0, 255)), methods=["saliency"], layer=None)
    with pytest.raises(FileNotFoundError, match=r"the folder '.*nowhere' does not exist"):
        comparison.save(tmp_path / "nowhere" / "grid.svg")


def test_raster_files_carry_their_dpi_and_a_dpi_must_be_positive(tmp_path):
    """save(dpi=300) to PNG/JPG/TIFF wrote the overlays at the input's resolution with no dpi at all: a document
    placed them at its own default size. The files now say their dpi; dpi 0 or -1 wrote a file, now refused."""
    e = explain.GradCAM(TinyCNN(), "conv").explain([solid(16, 16), solid(16, 16, (0, 255, 0))])
    for name in ("cam.png", "cam.jpg", "cam.tif"):
        saved = Image.open(e.save(tmp_path / name, dpi=300))
        assert saved.size == (32, 16) and [round(float(value)) for value in saved.info["dpi"]] == [300, 300], name
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="dpi must be a positive number"):
            e.save(tmp_path / "bad.pdf", dpi=bad)
    assert not (tmp_path / "bad.pdf").exists()

    # the rule on one image of a K-target explanation, another model
    topk = explain.Saliency(TinyCNN(seed=7, classes=4)).explain([solid(10, 14)] * 3, topk=2)
    saved = Image.open(topk[1].save(tmp_path / "one.png", dpi=72))
    assert saved.size == (14, 20) and [round(float(value)) for value in saved.info["dpi"]] == [72, 72]


def test_vector_files_hold_one_embedded_picture_per_panel_and_text_as_text(tmp_path):
    """Not a regression: what save promises for PDF/SVG, checked in the files, for a K-target explanation and
    one image sliced from it."""
    names = ["disc", "square", "triangle", "cross"]
    e = explain.GradCAM(TinyCNN(classes=4), "conv", class_names=names).explain([solid(20, 30)] * 2, topk=3)
    svg = ET.parse(e.save(tmp_path / "cam.svg")).getroot()
    pictures = list(svg.iter("{http://www.w3.org/2000/svg}image"))
    texts = " ".join("".join(node.itertext()) for node in svg.iter("{http://www.w3.org/2000/svg}text"))
    assert len(pictures) == 2 * (1 + 3) and "GradCAM @ conv" in texts and sum(name in texts for name in names) >= 3
    pdf = e[1].save(tmp_path / "one.pdf").read_bytes()
    assert pdf.count(b"/Subtype /Image") == 1 + 3 and b"/Font" in pdf


# ---------------------------------------------------------------- 8. compare with a method that fails


def test_compare_names_the_method_that_failed():
    with pytest.raises(ValueError, match="gradcam"):
        explain.compare(Flat(), solid(8, 8), methods=["saliency", "gradcam"])
    with pytest.raises(ValueError, match="layercam"):
        explain.compare(Flat(), solid(8, 8), methods=["inputxgradient", "layercam"])
    with pytest.raises(LayerNotFoundError, match="compare: method 'gradcam'"):  # the error's own type is kept
        explain.compare(Flat(), solid(8, 8), methods=["gradcam"], layer="nowhere")
