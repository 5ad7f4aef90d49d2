"""Session 13: a dataset run resumed after its folder was tampered with gives the maps of a run from scratch, or is
refused naming what was wrong: maps files deleted by hand are explained again (also under torchrun, after a merge),
and a rank's index left by a run with another model is refused before rank 0 has written run.json."""

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
from explain.dataset_tools.batch import Shard, merge_shard_indexes, read_index, read_maps, run


def make_folder(folder: Path, count: int = 6) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"im{index}.png")
    return folder


def gradcam(model: torch.nn.Module | None = None) -> explain.GradCAM:
    return explain.GradCAM(model if model is not None else load_demo_model(), "layer4", class_names=CLASS_NAMES)


def stored(out: Path) -> dict[str, torch.Tensor]:
    """Each image's maps as the folder's index and maps files give them back (each image once)."""
    rows = read_index(out / "index.csv")
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "an image's rows are in the index more than once"
    return dict(read_maps(out, ids))


def assert_same_maps(out: Path, reference: Path) -> None:
    got, expected = stored(out), stored(reference)
    assert sorted(got) == sorted(expected)
    for item in expected:
        assert torch.equal(got[item], expected[item]), item


def test_a_resume_explains_again_the_images_whose_maps_file_was_deleted(tmp_path):
    folder = make_folder(tmp_path / "images")
    reference, out = tmp_path / "reference", tmp_path / "out"
    arguments = ["--model", "demo", "--batch-size", "2", "--workers", "0", "--no-progress"]
    assert main(["batch", str(folder), "--out", str(reference), *arguments]) == 0
    assert main(["batch", str(folder), "--out", str(out), *arguments]) == 0
    deleted = out / "maps" / "batch-000002.npz"
    lost = sorted(row["id"] for row in read_index(out / "index.csv") if row["map"] == "maps/batch-000002.npz")
    assert len(lost) == 2
    deleted.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(gradcam(), folder, out, batch_size=2, progress=False, workers=0)
    assert (summary.explained, summary.already_done) == (2, 4)  # by hand: the deleted file's two images
    said = [str(warning.message) for warning in caught if "missing" in str(warning.message)]
    assert len(said) == 1 and "maps/batch-000002.npz" in said[0] and "2 image(s)" in said[0], said
    assert sorted(row["id"] for row in read_index(out / "index.csv") if row["map"] == "maps/batch-000004.npz") == lost
    assert_same_maps(out, reference)  # was: 0 explained, and reading the maps raised FileNotFoundError
    assert main(["batch", str(folder), "--out", str(out), *arguments]) == 0  # nothing left to do, nothing changes
    assert_same_maps(out, reference)


def test_a_merged_sharded_run_whose_maps_file_was_deleted_is_completed_by_its_ranks_and_merge(tmp_path):
    folder = make_folder(tmp_path / "images", count=5)
    reference, out = tmp_path / "reference", tmp_path / "out"
    run(gradcam(), folder, reference, batch_size=1, progress=False, workers=0)
    for rank in (0, 1):
        run(gradcam(), folder, out, batch_size=1, progress=False, workers=0, shard=Shard(rank, 2))
    merge_shard_indexes(out)
    (out / "maps" / "rank1-batch-000001.npz").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = [run(gradcam(), folder, out, batch_size=1, progress=False, workers=0,
                         shard=Shard(rank, 2)).explained for rank in (0, 1)]
    assert explained == [0, 1]
    merge_shard_indexes(out)
    assert_same_maps(out, reference)  # was: the merged index kept the row naming the deleted file


def test_a_ranks_index_left_by_a_run_with_another_model_is_refused_before_run_json_exists(tmp_path):
    folder = make_folder(tmp_path / "images", count=4)
    out = tmp_path / "out"
    other = load_demo_model()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert run(gradcam(other), folder, out, batch_size=1, progress=False, workers=0, shard=Shard(1, 2)).explained == 2
    assert not (out / "run.json").exists()  # rank 0 writes it: this rank's own record says how it explained
    with pytest.raises(ValueError, match=r"run\.rank1\.json records: model: .* earlier, .* now.*another output folder"):
        run(gradcam(), folder, out, batch_size=1, progress=False, workers=0, shard=Shard(0, 2))
    assert not (out / "index.rank0.csv").exists() or not read_index(out / "index.rank0.csv")  # refused before a row
    # the same model resumes; the merge leaves one record, run.json
    run(gradcam(other), folder, out, batch_size=1, progress=False, workers=0, shard=Shard(0, 2))
    merge_shard_indexes(out)
    assert sorted(path.name for path in out.glob("run*.json")) == ["run.json"]
    assert len(read_index(out / "index.csv")) == 4
