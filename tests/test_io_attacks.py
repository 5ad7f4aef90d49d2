"""Hostile input, rendering, saving and figure checks: each test asserts the behaviour the docs promise
(correct output, or a clear error that says what was wrong), never only "no exception"."""

from __future__ import annotations

import copy
import gc
import warnings
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch import nn

import explain
from explain.cli import main
from explain.data import make_dataset

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo():
    return explain.load_model("demo").model


@pytest.fixture(scope="module")
def images():
    return list(make_dataset(4, seed=0).images)


class ThreeColumns(nn.Module):
    """Score 0 = mean red of the left third − mean red of the right third; the middle third is unused.
    Input × gradient with reduce="sum" is then +, 0 and − over the three thirds."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 1)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.bias.zero_()
            self.conv.weight[0, 0] = 1.0

    def forward(self, x):
        a = self.conv(x)[:, 0]
        third = a.shape[-1] // 3
        score = a[..., :third].mean((1, 2)) - a[..., -third:].mean((1, 2))
        return torch.stack([score, -score], 1)


def phone_photo(path):
    """A 32 × 64 JPEG stored landscape, left half red, with EXIF orientation 6: shown portrait, red on top."""
    stored = np.zeros((32, 64, 3), np.uint8)
    stored[:, :32, 0] = 255
    picture = Image.fromarray(stored)
    exif = picture.getexif()
    exif[0x0112] = 6
    picture.save(path, exif=exif.tobytes(), quality=95)
    return path


def _colorbar_cmaps(fig) -> set[str]:
    from matplotlib.collections import QuadMesh

    names = set()
    for axis in fig.axes:
        if axis.get_label() == "<colorbar>":
            names.update(c.get_cmap().name for c in axis.collections if isinstance(c, QuadMesh))
    return names


# ---------------------------------------------------------------- image files


def test_load_image_applies_exif_orientation(tmp_path):
    """A phone JPEG stored landscape with EXIF orientation 6 is portrait in every viewer: the model and the
    overlay must see it as displayed, not rotated by 90°."""
    path = phone_photo(tmp_path / "phone.jpg")

    with Image.open(path) as opened:
        shown = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
    assert shown.shape == (64, 32, 3)
    loaded = np.asarray(explain.load_image(path))
    assert loaded.shape == shown.shape, "EXIF orientation ignored: the image is explained rotated"
    assert np.abs(loaded.astype(int) - shown.astype(int)).max() == 0
    e = explain.Saliency(ThreeColumns()).explain(path, target=0)
    assert tuple(e.images.shape) == (1, 64, 32, 3)
    assert float(e.images[0, 5, 16, 0]) > 0.9 and float(e.images[0, 60, 16, 0]) < 0.1  # red on top


def test_load_image_closes_its_file(tmp_path):
    """load_image must not leak the file handle: not for a multi-frame GIF, not when decoding fails
    (a batch over thousands of files runs out of descriptors)."""
    base = (np.random.default_rng(0).random((16, 16, 3)) * 255).astype(np.uint8)
    gif = tmp_path / "anim.gif"
    Image.fromarray(base).save(gif, save_all=True, append_images=[Image.fromarray(255 - base)])
    Image.fromarray(base).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(data[: len(data) // 2])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = explain.load_image(gif)
        assert image.size == (16, 16)
        del image
        with pytest.raises(ValueError, match="could not be read"):
            explain.load_image(truncated)
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaked == []


def test_decompression_bomb_is_a_clear_error(tmp_path, capsys):
    """A 20000 × 20000 PNG (48 kB on disk) trips PIL's bomb check: explain must say so as its own error,
    and the command line must print one `explain: error:` line, not a PIL traceback."""
    bomb = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(bomb)
    with pytest.raises(ValueError, match="pixels"):
        explain.load_image(bomb)
    code = main([str(bomb), "--model", "demo", "--out", str(tmp_path / "out")])
    assert code == 2
    assert "explain: error:" in capsys.readouterr().err


# ---------------------------------------------------------------- rendering of maps


def test_save_of_a_signed_map_keeps_negative_evidence(tmp_path):
    """maps are in [-1, 1] for signed maps (docs); e.save / e.overlay must not draw −1 (strong evidence
    against) exactly like 0 (no evidence)."""
    image = np.full((30, 30, 3), 200, np.uint8)
    e = explain.InputXGradient(ThreeColumns(), reduce="sum").explain(image, target=0)
    maps = e.maps[0]
    assert float(maps[5, 2]) == pytest.approx(1.0) and float(maps[5, 15]) == 0.0
    assert float(maps[5, 27]) == pytest.approx(-1.0)
    e.save(tmp_path / "signed.png")
    saved = np.asarray(Image.open(tmp_path / "signed.png")).astype(int)
    positive, zero, negative = saved[5, 2], saved[5, 15], saved[5, 27]
    assert np.abs(positive - zero).max() > 20
    assert np.abs(negative - zero).max() > 20, "negative evidence is drawn as 'no evidence'"


def test_overlay_refuses_or_scales_non_unit_images():
    """explain.overlay takes uint8 or float [0, 1] images; a float image in 0-255 or an int64 image must not
    silently come out white."""
    heat = np.zeros((4, 6))
    for pixels in (np.full((4, 6, 3), 100.0, np.float32), np.full((4, 6, 3), 100, np.int64)):
        try:
            drawn = explain.overlay(pixels, heat, alpha=0.0)
        except ValueError as error:
            assert "255" in str(error) or "[0, 1]" in str(error)
            continue
        assert drawn[0, 0].tolist() == [100, 100, 100], f"{pixels.dtype} image drawn as {drawn[0, 0].tolist()}"


def test_overlay_of_a_uint8_map():
    """Images in uint8 are 0-255; a uint8 map (a heatmap read from a PNG) must be too, or be refused, not
    clipped to 1 everywhere it is non-zero."""
    image = np.zeros((4, 6, 3), np.uint8)
    heat = np.full((4, 6), 64, np.uint8)
    try:
        drawn = explain.overlay(image, heat, alpha=1.0)
    except (ValueError, TypeError) as error:
        assert "uint8" in str(error) or "[0, 1]" in str(error)
        return
    expected = (explain.colorize(np.full((4, 6), 64 / 255)).numpy() * 255).round()
    assert drawn[0, 0].tolist() == expected[0, 0].tolist()


def test_overlay_with_a_different_number_of_maps_and_images():
    with pytest.raises(ValueError, match="2"):
        explain.overlay(np.zeros((2, 4, 6, 3), np.uint8), np.zeros((3, 4, 6)))


def test_normalize_refuses_what_it_cannot_take():
    """Normalize takes a (3, H, W) float tensor in [0, 1]: an ndarray in 0-255 is refused, a tensor in 0-255
    must be too (not normalised to values up to 1000), and a channels-last tensor gets a ValueError."""
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        explain.Normalize()(torch.full((3, 4, 4), 200.0))
    with pytest.raises(ValueError, match="channel|permute"):
        explain.Normalize()(torch.rand(8, 8, 3))


# ---------------------------------------------------------------- saving


def test_save_with_no_or_unknown_extension_names_the_formats(demo, images, tmp_path):
    e = explain.GradCAM(demo, "layer4").explain(images[0])
    for name in ("noext", "picture.foo"):
        with pytest.raises(ValueError) as error:
            e.save(tmp_path / name)
        assert ".png" in str(error.value), f"unhelpful error for {name!r}: {error.value}"
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises((ValueError, IsADirectoryError)) as error:
        e.save(folder)
    assert "folder" in str(error.value) or "directory" in str(error.value).lower()


def test_saving_an_empty_selection(demo, images, tmp_path):
    """e[mask] where the mask selects no image (no prediction above a threshold) is a legal Explanation;
    saving it must say that there is nothing to draw."""
    e = explain.GradCAM(demo, "layer4").explain(images[:2])
    none = e[e.scores[:, 0] > 1e9]
    assert len(none) == 0
    with pytest.raises(ValueError, match="no image|empty|0 images|nothing"):
        none.save(tmp_path / "none.png")


def test_svg_titles_stay_text(demo, images, tmp_path):
    """figures.py: 'titles and colorbars stay text' in PDF/SVG; in the SVG that e.save writes they are glyph
    outlines, not <text>, so they cannot be searched or edited."""
    e = explain.GradCAM(demo, "layer4").explain(images[:2])
    path = e.save(tmp_path / "cam.svg")
    root = ET.parse(path).getroot()
    texts = " ".join("".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "GradCAM" in texts


# ---------------------------------------------------------------- figures


def _panel(fig, row: int, column: int, columns: int) -> np.ndarray:
    return np.asarray(fig.axes[row * columns + column].images[0].get_array())


def test_figure_draws_each_explanation_on_its_own_images(demo, images):
    """figure() checks only that N matches: explanations of other images of the same count are drawn on the
    first explanation's images. It must refuse them, or draw each on its own images."""
    first = explain.GradCAM(demo, "layer4").explain(images[:2])
    second = explain.GradCAM(demo, "layer4").explain(images[2:4])
    try:
        fig = explain.figure([first, second], alpha=0.0)
    except ValueError as error:
        assert "image" in str(error)
    else:
        drawn = _panel(fig, 0, 2, 3)  # row of image 0, the second method's column
        own = (second.images[0].numpy() * 255).round().astype(np.uint8)
        assert np.abs(drawn.astype(int) - own.astype(int)).max() <= 1, "second method drawn on other images"

    # explain.figure(e) with an Explanation of 2 images: the second image's map drawn on image 0
    try:
        fig = explain.figure(first, alpha=0.0)
    except (ValueError, TypeError):
        return
    own = (first.images[1].numpy() * 255).round().astype(np.uint8)
    assert np.abs(_panel(fig, 0, 2, 3).astype(int) - own.astype(int)).max() <= 1


def test_figure_colorbar_covers_signed_and_unsigned_panels(demo, images):
    """With Grad-CAM (drawn in jet) next to signed Integrated Gradients (RdBu_r), the one colorbar is RdBu_r
    from −1 to 1: the Grad-CAM panels have no correct scale."""
    cam = explain.GradCAM(demo, "layer4").explain(images[:2])
    signed = explain.IntegratedGradients(demo, steps=4, reduce="sum").explain(images[:2])
    assert explain.io.figures.is_signed(signed) and not explain.io.figures.is_signed(cam)
    fig = explain.figure([cam, signed], colorbar=True)
    assert {"jet", "RdBu_r"} <= _colorbar_cmaps(fig)


def test_figure_image_titles_of_the_wrong_length(demo, images):
    e = explain.GradCAM(demo, "layer4").explain(images[:2])
    with pytest.raises(ValueError, match="title"):
        e.figure(image_titles=["only one"])


def test_compare_with_one_method_name_as_a_string(demo, images):
    try:
        comparison = explain.compare(demo, images[0], methods="gradcam")
    except (ValueError, TypeError) as error:
        assert "'g'" not in str(error), f"the string was split into letters: {error}"
    else:
        assert [e.method for e in comparison.explanations] == ["GradCAM"]


# ---------------------------------------------------------------- Explanation objects


def test_explanations_compare_without_a_torch_error(demo, images):
    """Explanation is a dataclass with eq=True: == compares tensor fields and raises 'Boolean value of Tensor
    with more than one value is ambiguous'."""
    e = explain.GradCAM(demo, "layer4").explain(images[:2])
    other = explain.GradCAM(demo, "layer4").explain(images[2:4])
    same = e == copy.deepcopy(e)
    assert isinstance(same, bool)
    assert (e == other) is False


# ---------------------------------------------------------------- command line


def test_cli_layer_for_a_method_without_layer(images, tmp_path, capsys):
    """--layer with saliency is silently ignored, yet the output file is named ..._layer4.png as if the layer
    had been used. It must be refused (or at least warned about and left out of the name)."""
    path = tmp_path / "img.png"
    Image.fromarray(images[0]).save(path)
    out = tmp_path / "out"
    code = main([str(path), "--model", "demo", "--method", "saliency", "--layer", "layer4", "--out", str(out)])
    err = capsys.readouterr().err
    written = [p.name for p in out.glob("*.png")] if out.exists() else []
    if code == 0:
        assert "layer" in err.lower(), "--layer ignored without a word"
        assert not any("layer4" in name for name in written), written
    else:
        assert code == 2 and "layer" in err and written == []


# ---------------------------------------------------------------- found with the fixes above


def test_a_paper_grid_saved_as_svg_keeps_its_text_and_dollar_signs(demo, images, tmp_path):
    """explain.figure's own savefig writes SVG text as text, and class names are drawn as written: "$"
    does not start matplotlib's math (which drew "a$b$c" as "abc" in italics)."""
    names = ["a$b$c", "x", "y", "z"]
    cam = explain.GradCAM(demo, "layer4", class_names=names).explain(images[:2], target=0)
    signed = explain.IntegratedGradients(demo, steps=4, reduce="sum", class_names=names).explain(images[:2], target=0)
    grid = explain.figure([cam, signed], colorbar=True)
    grid.savefig(tmp_path / "grid.svg")
    cam.save(tmp_path / "cam.svg")
    for path in (tmp_path / "grid.svg", tmp_path / "cam.svg"):
        root = ET.parse(path).getroot()
        texts = [" ".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text")]
        assert any(text.startswith("a$b$c (0): ") for text in texts), (path.name, texts[:6])
    bars = " ".join(" ".join(node.itertext()) for node in ET.parse(tmp_path / "grid.svg").getroot().iter(
        "{http://www.w3.org/2000/svg}text"))
    assert "signed relevance (scaled)" in bars and "relevance (normalised)" in bars


def test_read_only_arrays_draw_without_a_warning_and_odd_dtypes_get_the_right_hint():
    image = np.asarray(Image.new("RGB", (8, 6), (200, 10, 10)))
    assert not image.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn = explain.overlay(image, np.zeros((6, 8)), alpha=0.0)
    assert drawn[0, 0].tolist() == [200, 10, 10]
    with pytest.raises(ValueError, match="mask is no image"):
        explain.Saliency(ThreeColumns()).explain(np.ones((6, 9, 3), bool))
    with pytest.raises(ValueError, match=r"0-255: array.astype\(np.uint8\)"):
        explain.Saliency(ThreeColumns()).explain(np.full((6, 9, 3), 100, np.int64))


def test_an_empty_selection_shows_in_a_notebook_as_a_line(demo, images):
    e = explain.GradCAM(demo, "layer4").explain(images[:2])
    shown = e[e.scores[:, 0] > 1e9]._repr_html_()
    assert "no image" in shown and "<img" not in shown
    with pytest.raises(ValueError, match="no image"):
        e[[]].overlay()


def test_the_report_draws_a_phone_photo_upright_under_its_maps(tmp_path):
    """The HTML report's thumbnails put each map on its source image: that image must be turned as its EXIF
    orientation says, as the maps were made (load_image), not drawn sideways under them."""
    from explain.dataset_tools.html_report import _panels_from_maps

    source = phone_photo(tmp_path / "phone.jpg")
    map_file = tmp_path / "maps.npy"
    np.save(map_file, np.zeros((1, 64, 32), np.float32))  # the maps of the upright (portrait) image
    (panel,) = _panels_from_maps(np.load(map_file), source, 1, 64)
    pixels = np.asarray(panel).astype(int)
    assert pixels.shape[:2] == (64, 32)
    assert pixels[8, 16, 0] - pixels[56, 16, 0] > 80  # red on top, as shown
