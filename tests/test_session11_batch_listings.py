"""Session 11: a warning raised by ``explain batch``'s background writer while the next group is explained names no
file of that group (``FileWarnings``), and none is lost; TCAV's and CRAFT's folder of images is listed as
``explain batch`` and the concept atlas list a folder; a TCAV concept or random set too small for the reference
code's train/test split is warned about."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import explain
from explain.dataset_tools.batch import image_files_and_broken_links, read_index, run
from explain.dataset_tools.concept_atlas import image_files_and_broken_links as atlas_files
from explain.dataset_tools.pipeline import FileWarnings
from explain.io import render
from explain.methods.tcav import TCAV, folder_images, training_split

WAIT = 10.0
"""Seconds a thread of a test waits for the other at most (a timeout fails the test's premise, not a hang)."""


# ------------------------------------------------------------------ 1. warnings of the writer thread


def test_a_warning_of_another_thread_names_no_file_of_the_batch_being_explained():
    file_warnings = FileWarnings()
    inside, warned = threading.Event(), threading.Event()

    def writer() -> None:  # warns about "image 0" of the batch it writes, while the main thread explains another
        assert inside.wait(WAIT)
        warnings.warn("image 0: written from the other thread", UserWarning, stacklevel=1)
        warned.set()

    thread = threading.Thread(target=writer)
    thread.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with file_warnings.naming(["b.png", "c.png"]):
            inside.set()
            assert warned.wait(WAIT), "the other thread warned while the batch was being explained (the premise)"
            warnings.warn("image 1: explained in this thread", UserWarning, stacklevel=1)
    thread.join()
    texts = sorted(str(warning.message) for warning in caught)
    # by hand: this thread's warning names its batch's image 1, c.png; the other thread's names no file (not b.png)
    assert texts == ["image 0: written from the other thread", "image 1: explained in this thread (image 1: 'c.png')"]


def test_a_warning_of_another_thread_is_shown_also_when_the_batch_fails_and_is_explained_again():
    file_warnings = FileWarnings()
    warned = threading.Event()

    def writer() -> None:
        warnings.warn("the disk is slow", UserWarning, stacklevel=1)
        warned.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError), file_warnings.naming(["b.png"], keep_on_error=False):
            thread = threading.Thread(target=writer)
            thread.start()
            assert warned.wait(WAIT)
            warnings.warn("image 0: dropped, explained again", UserWarning, stacklevel=1)
            raise ValueError("the batch fails")
    thread.join()
    # the batch's own warning is dropped (its images are explained again, and warn again); the writer's is not
    assert [str(warning.message) for warning in caught] == ["the disk is slow"]


def test_the_warnings_of_a_batch_of_one_file_that_fails_are_shown_naming_it():
    """A batch of one file is not explained again (``keep_on_error``): its warnings are shown when it fails."""
    file_warnings = FileWarnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="the batch fails"), file_warnings.naming(["b.png"]):
            warnings.warn("image 0: its score is large", UserWarning, stacklevel=1)
            raise ValueError("the batch fails")
    assert [str(warning.message) for warning in caught] == ["image 0: its score is large (image 0: 'b.png')"]


def test_no_warning_is_lost_when_another_thread_restores_the_warnings_state_after_the_batch():
    """A user's callback in the writer thread enters ``catch_warnings`` while a batch is explained and leaves it after:
    it restores the state the batch set (process-wide before Python 3.14), whose recorder must not swallow the
    warnings raised afterwards."""
    file_warnings = FileWarnings()
    entered, batch_done, left = threading.Event(), threading.Event(), threading.Event()

    def callback() -> None:
        with warnings.catch_warnings():
            entered.set()
            assert batch_done.wait(WAIT)
        left.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=callback)
        with file_warnings.naming(["b.png"]):
            thread.start()
            assert entered.wait(WAIT)
        batch_done.set()
        assert left.wait(WAIT)
        thread.join()
        warnings.warn("raised after the batch", UserWarning, stacklevel=1)
    assert [str(warning.message) for warning in caught] == ["raised after the batch"]


class _TinyNet(nn.Module):
    """conv → ReLU → mean → linear; its forward pass on the image ``wait_on`` tells (a black one) waits once until
    ``released``, having set ``waiting``: the writer thread can warn while that image is being explained."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.waiting, self.released = threading.Event(), threading.Event()
        self.waited = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.waited and threading.current_thread() is threading.main_thread() and float(x.detach().amax()) < -1:
            self.waited = True  # the black image (ImageNet normalisation: below -1 everywhere)
            self.waiting.set()
            assert self.released.wait(WAIT), "the writer warned while the black image was explained (the premise)"
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def test_a_warning_of_the_writer_does_not_name_the_files_explained_meanwhile(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / "a.png")
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "b.png")  # sorted after a.png: the second batch
    model = _TinyNet()
    real_overlay_drawn = render.overlay_drawn
    calls = []

    def overlay_outside_unit_range(image, maps, *args, **kwargs):
        """a.png's overlay (the writer's first) drawn from maps above 1, which render warns about, while b.png
        is being explained."""
        calls.append(threading.current_thread().name)
        if len(calls) > 1:
            return real_overlay_drawn(image, maps, *args, **kwargs)
        assert model.waiting.wait(WAIT), "b.png is being explained while a.png's overlay is drawn (the premise)"
        try:
            return real_overlay_drawn(image, maps + 1.5, *args, **kwargs)
        finally:
            model.released.set()

    monkeypatch.setattr(render, "overlay_drawn", overlay_outside_unit_range)
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(explain.GradCAM(model, "conv"), folder, out, target=0, batch_size=1, overlays=True, progress=False,
            workers=0)
    assert model.waited and calls[0] == "explain-writer"
    assert sorted(row["image"] for row in read_index(out / "index.csv")) == [str(folder / "a.png"),
                                                                            str(folder / "b.png")]
    drawn = [str(warning.message) for warning in caught if "overlay draws maps in [0, 1]" in str(warning.message)]
    assert len(drawn) == 1, drawn  # shown, once
    # its files cannot be known where it is shown (the writer's, not the batch explained meanwhile): none named
    assert "b.png" not in drawn[0] and "first while explaining" not in drawn[0], drawn[0]


# ------------------------------------------------------------------ 2. one listing of a folder's images


def _image(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path, format="PNG")
    return path


def tricky_folder(root: Path) -> Path:
    """Images with upper- and mixed-case suffixes, a hidden file and a hidden folder, a sub-folder (and one with an
    image's name), a broken symbolic link, a link to an image, a text file and a file without a suffix."""
    folder = root / "set"
    _image(folder / "b.PNG", 1)
    _image(folder / "a.jpg", 2)  # a PNG named .jpg: by suffix, an image
    _image(folder / "C.Jpeg", 3)
    _image(folder / ".hidden.png", 4)
    _image(folder / "._a.jpg", 5)  # macOS' resource fork beside a copied a.jpg
    _image(folder / ".ipynb_checkpoints" / "a-checkpoint.png", 6)
    _image(folder / "sub" / "d.png", 7)
    (folder / "folder.png").mkdir()
    _image(folder / "folder.png" / "e.png", 8)
    (folder / "notes.txt").write_text("not an image")
    (folder / "png").write_bytes((folder / "b.PNG").read_bytes())
    os.symlink(folder / "missing.png", folder / "broken.png")
    os.symlink(folder / "a.jpg", folder / "link.png")
    return folder


def test_tcav_craft_batch_and_the_atlas_list_a_tricky_folder_alike(tmp_path):
    folder = tricky_folder(tmp_path)
    # by hand: every file ending in an image suffix (any case), sub-folders included, hidden ones and broken links
    # left out, sorted by path
    expected = sorted([folder / "C.Jpeg", folder / "a.jpg", folder / "b.PNG", folder / "folder.png" / "e.png",
                       folder / "link.png", folder / "sub" / "d.png"])
    assert [path.relative_to(folder).as_posix() for path in expected] == [
        "C.Jpeg", "a.jpg", "b.PNG", "folder.png/e.png", "link.png", "sub/d.png"]
    batch_files, broken = image_files_and_broken_links(folder)
    assert batch_files == expected and broken == [folder / "broken.png"]
    assert atlas_files(folder)[0] == expected
    with pytest.warns(UserWarning, match=r"broken symbolic link.*left out.*broken\.png") as caught:
        assert folder_images(folder) == expected
    assert caught[0].filename == __file__  # at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _TinyNet()
        tcav = TCAV(model, "conv", batch_size=2)
        assert tcav._images(str(folder)) == expected
        craft = explain.CRAFT(model, "conv", concepts=2)
        batch, _ = craft._prepared(folder)
    # CRAFT's batch holds the listed images in order: each image is constant, its value tells which it is
    values = [round(float(np.asarray(Image.open(path))[0, 0, 0])) for path in expected]
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert [round(float(batch[index, 0, 0, 0] * std[0] + mean[0]) * 255) for index in range(len(expected))] == values


def test_a_folder_with_only_hidden_images_and_broken_links_is_refused_by_tcav(tmp_path):
    folder = tmp_path / "set"
    _image(folder / ".hidden.png")
    os.symlink(folder / "missing.png", folder / "broken.png")
    with pytest.raises(ValueError, match=r"holds no image files.*broken symbolic link.*broken\.png"):
        folder_images(folder)


# ------------------------------------------------------------------ 3. TCAV sets too small for a CAV


def test_the_reference_split_keeps_both_sets_on_each_side_from_five_images_and_none_is_made_below():
    for count in range(1, 12):
        concept, random = torch.randn(count, 4), torch.randn(count + 3, 4)
        _, labels = training_split(concept, random)
        if count < 5:  # trained on all of them: nothing held out
            assert labels.tolist() == [1] * count + [0] * (count + 3)
        else:  # by hand: a stratified 67 % keeps both labels
            assert 0 < int(labels.sum()) < count and 0 < int((labels == 0).sum()) < count + 3


def _tiny_sets(tmp_path: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """A folder of ``count`` random 8 × 8 images for each name."""
    rng = np.random.default_rng(1)
    folders = {}
    for name, count in sizes.items():
        folders[name] = tmp_path / name
        folders[name].mkdir()
        for index in range(count):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folders[name] / f"{index}.png")
    return folders


def test_a_concept_or_random_set_of_fewer_than_five_images_is_warned_about_naming_it(tmp_path):
    sets = _tiny_sets(tmp_path, {"class": 2, "striped": 1, "random0": 5, "random1": 3})
    tcav = TCAV(_TinyNet(), "conv", cav="fastcav")
    with pytest.warns(UserWarning) as caught:
        tcav.test(sets["class"], 0, {"striped": sets["striped"]}, [sets["random0"], sets["random1"]])
    small = [warning for warning in caught if "fewer than 5 images" in str(warning.message)]
    assert len(small) == 1, [str(warning.message) for warning in caught]
    text = str(small[0].message)
    assert "concept 'striped' has 1 image" in text and "random set 1 has 3 images" in text
    assert "random set 0" not in text and "class images" not in text  # 5 are enough; the class set makes no CAV
    assert small[0].filename == __file__


def test_sets_of_five_images_or_more_are_not_warned_about(tmp_path):
    sets = _tiny_sets(tmp_path, {"class": 2, "striped": 5, "random0": 5, "random1": 6})
    tcav = TCAV(_TinyNet(), "conv", cav="fastcav")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tcav.test(sets["class"], 0, {"striped": sets["striped"]}, [sets["random0"], sets["random1"]])
    assert not [str(warning.message) for warning in caught if "fewer than" in str(warning.message)]
    assert len(result.tests) == 1

