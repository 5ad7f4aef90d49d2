"""A hostile user on the output side: Explanation's overlays, saving and figures handed unnormalised, non-finite,
tiny signed and meta-device maps, file formats that cannot hold RGB, and bad figure options. Each test checks
pixels or file contents against a by-hand drawing, or the error's text."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import explain
from explain.io import render
from explain.io.explanation import Explanation
from explain.io.inputs import DisplayImages

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

torch.set_num_threads(1)


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def hand_made(maps: torch.Tensor, images: torch.Tensor, raw: torch.Tensor | None = None) -> Explanation:
    """An Explanation of (N, K, H, W) maps on (N, H, W, 3) display images, as a method returns one."""
    count, targets = maps.shape[:2]
    return Explanation(map_grid=maps, raw_map_grid=maps * 3 if raw is None else raw,
                       scores=torch.zeros(count, targets), class_indices=torch.zeros(count, targets, dtype=torch.long),
                       display=DisplayImages(images), method="Hand")


def by_hand(image: torch.Tensor, values: torch.Tensor, alpha: float, cmap: str = "jet") -> np.ndarray:
    """(1 − alpha) · image + alpha · cmap(v), with render's colour table (entry floor(256 · v), 255 at 1: matplotlib's
    choice), as uint8."""
    table = render.colormap_table(cmap)
    colours = table[(values.clamp(0, 1) * 256).floor().clamp(max=255).long()]
    return ((1 - alpha) * image + alpha * colours).mul(255).round().to(torch.uint8).numpy()


# ---------------------------------------------------------------- maps that are not normalised


def test_unnormalised_maps_are_drawn_on_their_own_scale_with_a_warning(tmp_path: Path) -> None:
    """normalize=None keeps gradients of ~1e-3 in e.maps: drawn on [0, 1] they showed one flat colour (no pixel
    relevant) without a word. They are drawn scaled to their own largest |value|, as normalize="max" draws them,
    with a warning; e.maps keeps the raw values."""
    model = TinyCNN().eval()
    x = torch.rand(2, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    raw = explain.Saliency(model, normalize=None).explain(x)
    scaled = explain.Saliency(model).explain(x)
    assert float(raw.maps.max()) < 0.01  # the premise: raw gradients far below 1
    with pytest.warns(UserWarning, match="not normalised.*normalize='max'"):
        drawn = raw.overlay(alpha=0.7)
    expected = np.stack([by_hand(raw.images[n], raw.maps[n] / raw.maps[n].max(), 0.7) for n in range(2)])
    assert np.array_equal(drawn, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a normalised explanation draws without a word
        assert np.array_equal(scaled.overlay(alpha=0.7), expected)
    with pytest.warns(UserWarning, match="not normalised"):
        path = raw.save(tmp_path / "raw.png", alpha=0.7)
    assert np.array_equal(np.asarray(Image.open(path)), np.concatenate(list(expected), axis=1))
    assert float(raw.maps.max()) < 0.01  # left as it was

    # explain.figure's normalize="map" ("each map to its own maximum"): the same panels as the normalised maps'
    def first_panel(e: Explanation) -> np.ndarray:
        return np.asarray(explain.figure([e], alpha=0.7, show_image=False).axes[0].images[0].get_array())

    assert np.array_equal(first_panel(raw), first_panel(scaled))
    assert np.array_equal(first_panel(raw), expected[0])


def test_maps_above_one_are_scaled_not_saturated() -> None:
    """A map of 0 … 50 (raw scores kept) drew every pixel above 1 in the top colour: it is drawn scaled."""
    values = torch.linspace(0, 50, 12).reshape(1, 1, 3, 4)
    images = torch.full((1, 3, 4, 3), 0.25)
    e = hand_made(values, images, raw=values * 3)  # raw ≠ map: the rule holds for any map above 1
    with pytest.warns(UserWarning, match=r"not normalised \(1 of 1 map\(s\), largest \|value\| 50"):
        drawn = e.overlay(alpha=1.0)
    assert np.array_equal(drawn[0], by_hand(images[0], values[0, 0] / 50, 1.0))
    assert len(np.unique(drawn[0].reshape(-1, 3), axis=0)) == 12  # every value its own colour, none saturated


# ---------------------------------------------------------------- NaN and inf


def test_nan_and_inf_pixels_are_drawn_as_said_and_warned_about() -> None:
    """NaN was drawn as 0 without a word; +inf as 1 and -inf turned the map signed, silently. NaN is drawn as no
    evidence, ±inf as the map's strongest finite evidence with its sign, and a warning counts them."""
    values = torch.tensor([[[[float("nan"), 0.5, 1.0, float("inf")]]]])
    images = torch.full((1, 1, 4, 3), 0.5)
    e = hand_made(values, images)
    with pytest.warns(UserWarning, match=r"1 NaN and 1 infinite pixel"):
        drawn = e.overlay(alpha=0.6)
    assert np.array_equal(drawn[0], by_hand(images[0], torch.tensor([[0.0, 0.5, 1.0, 1.0]]), 0.6))

    signed = hand_made(torch.tensor([[[[-0.5, 0.25, float("-inf"), 0.0]]]]), images)
    with pytest.warns(UserWarning, match=r"0 NaN and 1 infinite pixel"):
        drawn = signed.overlay(alpha=1.0)
    centred = (torch.tensor([[-0.5, 0.25, -0.5, 0.0]]) + 1) / 2  # -inf → −0.5, the strongest finite evidence
    assert np.array_equal(drawn[0], by_hand(images[0], centred, 1.0, render.DIVERGING_CMAP))


# ---------------------------------------------------------------- signed maps of tiny values


def test_a_signed_map_of_tiny_values_is_not_drawn_as_no_evidence() -> None:
    """signed_to_unit floored each map's scale at 1e-12: a signed map of ±1e-13 (gradients through a saturated
    softmax) was drawn at 0.55 / 0.45, nearly white, as if it held no evidence."""
    raw = torch.zeros(1, 1, 4, 6)
    raw[..., :3], raw[..., 3:] = 1e-13, -1e-13
    assert render.signed_to_unit(raw[0, 0]).unique().tolist() == [0.0, 1.0]
    e = hand_made(raw / 1e-13, torch.full((1, 4, 6, 3), 0.5), raw=raw)
    picture = np.asarray(explain.figure([e], alpha=1.0, show_image=False).axes[0].images[0].get_array())
    assert np.array_equal(picture, by_hand(torch.full((4, 6, 3), 0.5), (raw[0, 0] / 1e-13 + 1) / 2, 1.0,
                                           render.DIVERGING_CMAP))
    assert render.signed_to_unit(torch.zeros(3, 3)).unique().tolist() == [0.5]  # an all-zero map: no evidence


# ---------------------------------------------------------------- saving


def test_a_format_that_cannot_hold_rgb_is_refused_and_leaves_an_existing_file_as_it_was(tmp_path: Path) -> None:
    """.msp (Pillow writes only 1-bit images there) truncated an existing file to 0 bytes, then failed with
    "cannot write mode RGB as MSP"; .h5 failed with "HDF5 save handler not installed". Both are refused with the
    formats that work, the existing file untouched and no new file left."""
    e = hand_made(torch.rand(1, 1, 4, 6), torch.full((1, 4, 6, 3), 0.5))
    kept = tmp_path / "precious.msp"
    kept.write_bytes(b"precious")
    with pytest.raises(ValueError, match=r"cannot write RGB overlays as MSP.*\.png, \.jpg"):
        e.save(kept)
    assert kept.read_bytes() == b"precious"
    with pytest.raises(ValueError, match=r"cannot write RGB overlays as HDF5"):
        e.save(tmp_path / "maps.h5")
    assert not (tmp_path / "maps.h5").exists()


@pytest.mark.parametrize("suffix", [".png", ".tif", ".bmp"])
def test_saved_overlays_keep_red_red_and_each_pixel_in_place(tmp_path: Path, suffix: str) -> None:
    """A pure red 5 × 7 image (not square) with one hot pixel at row 1, column 5, saved twice to a path with a space
    and an accent: read back with PIL the image is RGB (not BGR), the hot pixel where it was (no transpose), the
    second save replacing the first."""
    image = torch.zeros(1, 5, 7, 3)
    image[..., 0] = 1.0
    values = torch.zeros(1, 1, 5, 7)
    values[0, 0, 1, 5] = 1.0
    e = hand_made(values, image)
    path = tmp_path / f"red é{suffix}"
    hand_made(torch.zeros(1, 1, 5, 7), image).save(path)
    e.save(path, alpha=0.5)
    read = np.asarray(Image.open(path).convert("RGB")).astype(int)
    expected = by_hand(image[0], values[0, 0], 0.5).astype(int)
    assert np.array_equal(read, expected)
    assert read[0, 0].tolist() == [128, 0, 64]  # red blended with jet's dark blue at 0
    assert read[1, 5, 0] > 120 and read[1, 5, 1] < 5 and read[1, 5, 2] < 5  # jet's dark red at 1 over red


# ---------------------------------------------------------------- figure options and devices


@pytest.mark.parametrize("option, value, message", [
    ("clip_percentile", 150, r"clip_percentile must lie in \(0, 100\]"),
    ("clip_percentile", float("nan"), r"clip_percentile must lie in \(0, 100\]"),
    ("clip_percentile", 0, r"clip_percentile must lie in \(0, 100\]"),
    ("panel_size", 0, "panel_size must be a positive number"),
    ("fontsize", 0, "fontsize must be a positive number"),
    ("fontsize", float("inf"), "fontsize must be a positive number"),
])
def test_figure_options_out_of_range_are_refused_by_name(option: str, value: float, message: str) -> None:
    """clip_percentile=150 failed inside torch.quantile ("q must be in the range [0, 1]"), panel_size=0 and
    fontsize=0 with a ZeroDivisionError; clip_percentile=0 saturated every pixel of a signed map."""
    signed = torch.tensor([[[[-1.0, 0.5], [0.25, 1.0]]]])
    e = hand_made(signed, torch.full((1, 2, 2, 3), 0.5))
    with pytest.raises(ValueError, match=message):
        explain.figure([e], **{option: value})


def test_an_explanations_figure_refuses_a_zero_panel_and_a_figure_already_drawn_on() -> None:
    """e.figure(panel_size=0) failed with a ZeroDivisionError; e.figure(figure=fig) on a figure already drawn on
    laid the new axes over the old ones (4 axes for 2 panels)."""
    e = hand_made(torch.rand(1, 1, 4, 4), torch.full((1, 4, 4, 3), 0.5))
    with pytest.raises(ValueError, match="panel_size must be a positive number"):
        e.figure(panel_size=0)
    used = plt.figure()
    try:
        e.figure(figure=used)
        assert len(used.axes) == 2
        with pytest.raises(ValueError, match="already holds axes"):
            e.figure(figure=used)
        assert len(used.axes) == 2
    finally:
        plt.close(used)


def test_maps_on_the_meta_device_are_refused_with_the_reason() -> None:
    """Maps on the meta device failed deep in torch ("Cannot copy out of meta tensor; no data!")."""
    maps = torch.rand(1, 1, 4, 4, device="meta")
    e = Explanation(map_grid=maps, raw_map_grid=maps, scores=torch.zeros(1, 1), class_indices=None,
                    display=DisplayImages(torch.full((1, 4, 4, 3), 0.5)), method="Hand")
    with pytest.raises(ValueError, match="meta device: they hold no values"):
        e.overlay()
    with pytest.raises(ValueError, match="meta device"):
        explain.overlay(np.zeros((4, 4, 3), np.uint8), maps[0, 0])


def test_a_colour_bar_label_with_tex_specials_is_written_as_given(tmp_path: Path) -> None:
    """colorbar_label="$R_$" failed when the figure was saved (matplotlib's mathtext: "ParseSyntaxException"),
    long after the call; every other title is written as given (no mathtext), and so is the colour bar's label."""
    e = hand_made(torch.tensor([[[[-1.0, 0.5], [0.25, 1.0]]]]), torch.full((1, 2, 2, 3), 0.5))
    label = "$R_$ 50% #1 & a_b"
    explain.figure([e], colorbar=True, colorbar_label=label).savefig(tmp_path / "bar.svg")
    assert f">{label.replace('&', '&amp;')}<" in (tmp_path / "bar.svg").read_text()


# ---------------------------------------------------------------- blur


def test_blurred_uint8_images_are_rounded_as_torchvision_rounds_them() -> None:
    """A uint8 batch was blurred in float and truncated back to uint8: every pixel 0.5 darker on average than
    torchvision's gaussian_blur, which reflect_blur claims to equal. It is rounded."""
    import math

    from torchvision.transforms.functional import gaussian_blur as torchvision_blur

    from explain.io.blur import gaussian_blur, reflect_blur

    pixels = torch.randint(0, 256, (2, 3, 16, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    sigma = 1.3
    blurred = reflect_blur(pixels, sigma)
    assert blurred.dtype == torch.uint8
    assert torch.equal(blurred, reflect_blur(pixels.float(), sigma).round().to(torch.uint8))
    size = 2 * math.ceil(3 * sigma) + 1
    difference = (blurred.int() - torchvision_blur(pixels, [size, size], [sigma, sigma]).int()).abs()
    assert int(difference.max()) <= 1 and float(difference.float().mean()) < 0.02  # was 0.51: truncated
    zeros = gaussian_blur(pixels, [0.7, 2.0])
    assert torch.equal(zeros, gaussian_blur(pixels.float(), [0.7, 2.0]).round().to(torch.uint8))


def test_a_blur_with_the_wrong_number_of_sigmas_or_a_negative_radius_says_so() -> None:
    """Three σ for two images failed with torch's "The expanded size of the tensor (2) must match ..."; a radius
    of -2 with "upper bound and lower bound inconsistent with step sign"."""
    from explain.io.blur import gaussian_blur

    images = torch.rand(2, 3, 5, 7)
    with pytest.raises(ValueError, match=r"sigmas takes one value for every image or one per image \(2\); got 3"):
        gaussian_blur(images, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"radii takes one value .* got 3"):
        gaussian_blur(images, 1.0, radii=[1, 2, 3])
    with pytest.raises(ValueError, match="radius must be a whole number of pixels ≥ 0"):
        gaussian_blur(images, 1.0, radii=-2)
    assert torch.equal(gaussian_blur(images, [0.0, 0.0]), images)  # σ = 0 still leaves each image as it is
