"""Session 9, ``explain batch`` over a hostile folder: a resumed run whose images still to do are only files the
model cannot take skips them (as the first run did) instead of stopping; a resume that would leave overlays of some
images only is refused; ``--out=~/...`` (which the shell leaves as it is) means the home folder."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model
from explain.dataset_tools.batch import run
from explain.dataset_tools.index import MapReader, read_index


def save(path: Path, size: int, seed: int) -> Path:
    """A random RGB PNG of size × size pixels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def gradcam() -> explain.GradCAM:
    return explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)


def test_the_same_command_again_skips_a_file_the_model_cannot_take_instead_of_stopping(tmp_path):
    """A 1 × 1 image is too small for the demo CNN: the first run skips it (it shares a batch with images that
    work). The rerun has only that file to do, alone in its batch: it was taken for a run that cannot work at all
    and stopped with the model's error, so the same command could never finish. Images explained by an earlier run
    with the same settings show the settings work: the file is skipped again, with the reason."""
    folder = tmp_path / "images"
    save(folder / "a.png", 32, 0)
    save(folder / "b.png", 32, 1)
    save(folder / "c.png", 1, 2)  # sorted last: with batch_size=2 alone in the second batch
    out = tmp_path / "out"
    first = run(gradcam(), folder, out, batch_size=3, progress=False, workers=0)
    assert first.explained == 2 and list(first.skipped) == [str(folder / "c.png")]
    rows = read_index(out / "index.csv")

    again = run(gradcam(), folder, out, batch_size=2, progress=False, workers=0)

    assert (again.explained, again.already_done) == (0, 2)
    assert list(again.skipped) == [str(folder / "c.png")]
    assert again.skipped[str(folder / "c.png")].startswith("explaining it failed: ModelInputError")
    assert read_index(out / "index.csv") == rows  # nothing added, nothing lost


def test_a_fresh_run_whose_first_batch_fails_as_a_whole_still_stops(tmp_path):
    """The guard kept: with nothing explained yet, by this run or an earlier one, a first batch that fails as a
    whole is a problem of the run (here every image is too small), raised rather than every file skipped."""
    folder = tmp_path / "images"
    save(folder / "a.png", 1, 0)
    with pytest.raises(explain.ModelInputError, match="too small"):
        run(gradcam(), folder, tmp_path / "out", batch_size=2, progress=False, workers=0)


def test_a_resume_that_writes_overlays_of_some_images_only_says_so(tmp_path):
    """Images already done are not explained again: a resume with overlays after a run without them (or the other
    way round) leaves overlays of some images only, silently until now."""
    folder = tmp_path / "images"
    save(folder / "a.png", 32, 0)
    out = tmp_path / "out"
    run(gradcam(), folder, out, progress=False, workers=0)  # no overlays
    save(folder / "b.png", 32, 1)
    with pytest.warns(UserWarning, match=r"1 of the 1 image\(s\) already explained in .* have no overlay") as caught:
        summary = run(gradcam(), folder, out, overlays=True, progress=False, workers=0)
    assert caught[0].filename == __file__  # at the caller's line
    assert "have no overlay" in summary.notes[-1]
    new_id = next(row["id"] for row in read_index(out / "index.csv") if row["image"].endswith("b.png"))
    assert [path.name for path in (out / "overlays").iterdir()] == [f"{new_id}.png"]

    with_overlays = tmp_path / "with"
    (folder / "b.png").unlink()
    run(gradcam(), folder, with_overlays, overlays=True, progress=False, workers=0)
    with warnings.catch_warnings():  # every image done: a rerun without overlays leaves the folder whole
        warnings.simplefilter("error")
        assert run(gradcam(), folder, with_overlays, progress=False, workers=0).already_done == 1
    save(folder / "b.png", 32, 1)
    with pytest.warns(UserWarning, match=r"1 of the 1 image\(s\) already explained in .* have overlays"):
        run(gradcam(), folder, with_overlays, progress=False, workers=0)


def test_an_output_folder_that_is_or_holds_the_input_folder_is_refused(tmp_path):
    """The output folder is left out of the images (a rerun must not read its overlays as data), so ``--out`` equal
    to the input folder, or above it, explained nothing and said "0 image(s) explained"."""
    folder = tmp_path / "data" / "images"
    save(folder / "a.png", 32, 0)
    for out in (folder, tmp_path / "data"):
        with pytest.raises(ValueError, match="give an output folder outside it, or one inside it"):
            run(gradcam(), folder, out, progress=False, workers=0)
        assert not (out / "index.csv").exists()
    assert run(gradcam(), folder, folder / "explained", progress=False, workers=0).explained == 1
    assert run(gradcam(), folder, folder / "explained", progress=False, workers=0).already_done == 1


def test_a_folder_without_images_warns(tmp_path):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "notes.txt").write_text("no image")
    with pytest.warns(UserWarning, match=r"no image file in .*images \(nor its sub-folders\): nothing to explain"):
        summary = run(gradcam(), folder, tmp_path / "out", progress=False, workers=0)
    assert summary.explained == 0


def test_out_and_folder_with_a_tilde_are_the_home_folder_and_the_rows_match_a_forward_pass(tmp_path, monkeypatch,
                                                                                          capsys):
    """``--out=~/runs`` reaches the program as it is written (bash expands no ~ after "="): it was a folder named
    "~" in the working folder. The rows written there hold what a forward pass by hand gives."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    image = save(home / "data" / "x y.png", 32, 3)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)

    assert main(["batch", "~/data", "--model", "demo", "--out=~/runs", "--no-progress", "--workers", "0"]) == 0

    assert not (work / "~").exists()
    rows = read_index(home / "runs" / "index.csv")
    assert [row["image"] for row in rows] == [str(Path("~/data/x y.png").expanduser())]
    model = load_demo_model()
    pixels = torch.from_numpy(np.array(Image.open(image).convert("RGB"))).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    with torch.no_grad():
        probabilities = model(((pixels - mean) / std)[None])[0].softmax(0)
    row = rows[0]
    assert int(row["predicted"]) == int(probabilities.argmax()) == int(row["target"])
    assert float(row["confidence"]) == pytest.approx(float(probabilities.max()), abs=1e-6)
    stored = MapReader(home / "runs").read(row["id"])[0]
    by_api = gradcam().explain(Image.open(image).convert("RGB"), target=int(row["target"])).map_grid[0, 0]
    assert torch.allclose(stored, by_api.float(), atol=1e-5)
