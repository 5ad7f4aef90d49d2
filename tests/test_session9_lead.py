"""Session 9, own pieces: saved overlays that a file format alters (GIF's 256 colours, WebP's lossy default) and the
colour each map value takes (matplotlib's own choice of colour-table entry)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from explain.io.explanation import Explanation
from explain.io.inputs import DisplayImages


def hand_made(maps: torch.Tensor, images: torch.Tensor) -> Explanation:
    """An Explanation of (N, K, H, W) maps on (N, H, W, 3) display images, as a method returns one."""
    count, targets = maps.shape[:2]
    return Explanation(map_grid=maps, raw_map_grid=maps, scores=torch.zeros(count, targets),
                       class_indices=torch.zeros(count, targets, dtype=torch.long),
                       display=DisplayImages(images), method="Hand")


def many_colours() -> Explanation:
    """A 32 × 48 overlay with far more than 256 colours (a smooth map over a noisy image)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(1, 32, 48, 3, generator=generator)
    values = torch.linspace(0, 1, 32 * 48).reshape(1, 1, 32, 48)
    return hand_made(values, images)


def test_gif_warns_that_it_keeps_256_colours_and_says_by_how_much(tmp_path: Path) -> None:
    """A GIF holds 256 colours: the overlay read back differs from the PNG one. Saving said nothing; now the
    warning gives the largest change read back from the file and points to .png."""
    e = many_colours()
    exact = np.asarray(Image.open(e.save(tmp_path / "exact.png")).convert("RGB")).astype(int)
    with pytest.warns(UserWarning, match=r"'cam.gif' is not the exact overlay: its colours differ .* by up to "
                                         r"(\d+)/255 .*Save as \.png") as caught:
        e.save(tmp_path / "cam.gif")
    read = np.asarray(Image.open(tmp_path / "cam.gif").convert("RGB")).astype(int)
    largest = int(np.abs(read - exact).max())
    assert largest > 0 and f"up to {largest}/255" in str(caught[0].message)


def test_webp_and_lossless_formats_keep_the_exact_pixels_without_a_word(tmp_path: Path) -> None:
    """WebP was written lossy (Pillow's default, quality 80): the overlay came back changed. It is written lossless
    now; PNG, TIFF and BMP read back exactly and do not warn, nor does JPEG, lossy by design."""
    e = many_colours()
    exact = np.asarray(Image.open(e.save(tmp_path / "exact.png")).convert("RGB"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for suffix in (".webp", ".tif", ".bmp", ".jpg"):
            e.save(tmp_path / f"cam{suffix}")
    for suffix in (".webp", ".tif", ".bmp"):
        assert np.array_equal(np.asarray(Image.open(tmp_path / f"cam{suffix}").convert("RGB")), exact), suffix


def test_ico_warns_that_it_shrinks_the_overlay(tmp_path: Path) -> None:
    """An icon holds at most 256 × 256 pixels: a 300-pixel-wide overlay is stored smaller, which is now said."""
    e = hand_made(torch.rand(1, 1, 20, 300), torch.rand(1, 20, 300, 3))
    with pytest.warns(UserWarning, match=r"'cam.ico' is not the exact overlay: it holds \d+×\d+ pixels, not the "
                                         r"overlays' 300×20"):
        e.save(tmp_path / "cam.ico")


@pytest.mark.parametrize("cmap", ["jet", "viridis", "RdBu_r"])
def test_each_value_takes_the_colour_matplotlib_gives_it(cmap: str) -> None:
    """render.colorize took entry round(255 · v) where matplotlib takes floor(256 · v): 0.1 came out one step
    apart from ``plt.imshow(map, cmap=...)``. Now every value, the ends and NaN (drawn as 0) included, takes
    matplotlib's own colour."""
    import matplotlib

    from explain.io import render

    values = torch.cat([torch.rand(2000, generator=torch.Generator().manual_seed(1)),
                        torch.tensor([0.0, 0.1, 0.5, 1 / 256, 255 / 256, 1.0, -0.3, 1.7])]).double()
    expected = matplotlib.colormaps[cmap](values.clamp(0, 1).numpy())[:, :3]
    assert np.array_equal(render.colorize(values, cmap).double().numpy(), expected.astype(np.float32))
    assert torch.equal(render.colorize(torch.tensor([float("nan")]), cmap), render.colorize(torch.tensor([0.0]), cmap))
