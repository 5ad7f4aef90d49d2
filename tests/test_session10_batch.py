"""Session 10: the warnings of ``explain batch`` name the files they concern (a method numbers the images of its
batch), an image that cannot be explained is skipped alone (not its whole batch), and the concept atlas lists
broken symbolic links as ``explain batch`` does."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.data import CLASS_NAMES, load_demo_model
from explain.dataset_tools.batch import _broken_link_reason, read_index, read_maps, run
from explain.dataset_tools.concept_atlas import build_atlas, image_files_and_broken_links


def make_folder(folder: Path, count: int = 3, black: bool = True) -> Path:
    """``count`` random 32 × 32 images and, with ``black``, a black one (sorted first: black.png)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"img {index} é.png")
    if black:
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "black.png")
    return folder


def gradcam() -> explain.GradCAM:
    return explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)


def test_a_zero_map_warning_names_the_files_whose_maps_are_zero(tmp_path):
    folder = make_folder(tmp_path / "images")
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(gradcam(), folder, out, target=3, batch_size=4, progress=False, workers=0)
    zero = [str(warning.message) for warning in caught if "zero everywhere" in str(warning.message)]
    # by hand: the files whose stored map is zero everywhere
    rows = read_index(out / "index.csv")
    maps = dict(read_maps(out, [row["id"] for row in rows]))
    empty = sorted(row["image"] for row in rows if not bool(maps[row["id"]][0].any()))
    assert empty, "the black image's class-3 Grad-CAM map is zero (the test's premise)"
    assert len(zero) == 1, zero
    named = sorted(name for name in (row["image"] for row in rows) if repr(name) in zero[0])
    assert named == empty


def test_a_warning_about_the_run_is_shown_once_naming_the_first_batch(tmp_path):
    folder = make_folder(tmp_path / "images", count=2, black=False)
    explainer = explain.GradCAM(load_demo_model(), "layer4", class_names=["a", "b"])  # 2 names, 4 classes: warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(explainer, folder, tmp_path / "out", batch_size=1, progress=False, workers=0)
    about = [str(warning.message) for warning in caught if "class_names has 2 names" in str(warning.message)]
    assert len(about) == 1, about  # each batch warns: shown once
    assert about[0].endswith(f"(first while explaining {str(folder / 'img 0 é.png')!r})")


def test_an_image_whose_score_is_not_finite_is_skipped_alone_and_named(tmp_path):
    folder = make_folder(tmp_path / "images")
    model = load_demo_model()
    black_score = float(explain.GradCAM(model, "layer4").explain(str(folder / "black.png"), target=0).scores[0, 0])

    def nan_for_black(output: torch.Tensor) -> torch.Tensor:
        score = output[:, 0]
        return torch.where(torch.isclose(score, torch.tensor(black_score), rtol=1e-4), float("nan"), score)

    out = tmp_path / "out"
    summary = run(explain.GradCAM(model, "layer4"), folder, out, target=nan_for_black, batch_size=4, progress=False,
                  workers=0)
    assert list(summary.skipped) == [str(folder / "black.png")]
    assert "not finite" in summary.skipped[str(folder / "black.png")]
    assert sorted(row["image"] for row in read_index(out / "index.csv")) == sorted(
        str(folder / f"img {index} é.png") for index in range(3))


def test_the_atlas_lists_a_broken_link_as_explain_batch_does(tmp_path):
    folder = make_folder(tmp_path / "images", count=2, black=False)
    link = folder / "sub" / "gone.png"
    link.parent.mkdir()
    os.symlink(tmp_path / "missing.png", link)
    files, names, broken = image_files_and_broken_links(folder)
    assert names == ["img 0 é.png", "img 1 é.png"] and files == [folder / name for name in names]
    assert broken == {"sub/gone.png": _broken_link_reason(link)}  # the reason explain batch writes in skipped.csv
    summary = run(gradcam(), folder, tmp_path / "out", progress=False, workers=0)
    assert summary.skipped == {str(link): _broken_link_reason(link)}


def test_an_atlas_of_broken_links_only_says_so(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    os.symlink(tmp_path / "missing.png", folder / "gone.png")
    with pytest.raises(ValueError, match=r"1 broken symbolic link\(s\) with such a name: gone.png: a broken symbolic "
                       r"link: its target"):
        build_atlas(load_demo_model(), "layer3", folder, tmp_path / "atlas", progress=False)


def test_an_atlas_folder_inside_the_data_folder_is_not_read_as_images(tmp_path):
    folder = make_folder(tmp_path / "images", count=2, black=False)
    (folder / "atlas" / "patches").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "atlas" / "patches" / "r00000_0.png")
    files, names, _ = image_files_and_broken_links(folder, exclude=folder / "atlas")
    assert names == ["img 0 é.png", "img 1 é.png"]  # a rerun's image list (its record) is the first run's


def test_the_same_position_in_two_batches_is_two_files_each_named(tmp_path):
    """A method numbers the images of its own batch: "image 0" of the first batch and of the second are two files,
    and each gets its warning (the text alone is the same)."""
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a black.png", "b black.png"):
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(gradcam(), folder, tmp_path / "out", target=3, batch_size=1, progress=False, workers=0)
    zero = [str(warning.message) for warning in caught if "zero everywhere" in str(warning.message)]
    assert len(zero) == 2, zero
    assert repr(str(folder / "a black.png")) in zero[0] and repr(str(folder / "b black.png")) in zero[1]
