"""Dataset runs as a hostile user meets them (issue 13): bad files, odd names, colliding ids, an
output folder inside the input folder, and `kill -9` at random moments."""

from __future__ import annotations

import csv
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import item_id, run
from explain.dataset_tools.index import FIELDS, MapReader
from explain.dataset_tools.stored_maps import load_maps


def save_images(folder: Path, count: int, seed: int, names=None) -> list[Path]:
    data = make_dataset(count, seed=seed)
    paths = []
    for index, image in enumerate(data.images):
        path = folder / (names[index] if names else f"shape{index:03d}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        paths.append(path)
    return paths


def read_index(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def explainer() -> explain.GradCAM:
    return explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)


def check_complete_and_consistent(out: Path, folder: Path, paths: list[Path], targets: int) -> None:
    """Exactly one complete set of K rows per image, in order; every map present and equal to the
    map of that image explained on its own, for the targets its rows name."""
    rows = read_index(out / "index.csv")
    assert list(rows[0]) == FIELDS
    by_id: dict[str, list[dict]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    assert sorted(by_id) == sorted(item_id(path, folder) for path in paths)
    reference = explainer()
    for path in paths:
        group = by_id[item_id(path, folder)]
        assert [int(row["k"]) for row in group] == list(range(targets))
        assert all(int(row["targets"]) == targets for row in group)
        assert len({row["map"] for row in group}) == 1
        saved = MapReader(out).read(group[0]).numpy()
        expected = reference.explain(str(path), topk=targets)
        assert [int(row["target"]) for row in group] == expected.targets[0].tolist()
        np.testing.assert_allclose(saved, expected.map_grid[0].numpy(), atol=2e-3)
        # no labels: empty label columns; the prediction is the top class, its confidence its probability
        top = int(expected.class_indices[0, 0])
        for row in group:
            assert (row["label"], row["label_name"], row["correct"]) == ("", "", "")
            assert (row["predicted"], row["predicted_name"]) == (str(top), CLASS_NAMES[top])
            assert float(row["confidence"]) == pytest.approx(float(expected.probabilities[0, 0]), abs=1e-5)
            assert row["role"] == ("topk" if targets > 1 else "predicted")


# ------------------------------------------------------------------ 13. bad files and names


def test_corrupt_empty_and_non_image_files_are_skipped_recorded_and_counted(tmp_path):
    folder = tmp_path / "images"
    good = save_images(folder, 5, seed=1)
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "text.png").write_text("not an image")
    truncated = good[0].read_bytes()
    (folder / "truncated.png").write_bytes(truncated[: len(truncated) // 2])
    Image.new("RGBA", (64, 64)).save(folder / "transparent.png")
    out = tmp_path / "out"
    summary = run(explainer(), folder, out, batch_size=4, progress=False)
    assert summary.explained == 5 and len(summary.skipped) == 4
    with open(out / "skipped.csv", newline="") as file:
        skipped = {Path(row["image"]).name: row["reason"] for row in csv.DictReader(file)}
    assert set(skipped) == {"empty.jpg", "text.png", "truncated.png", "transparent.png"}
    assert "alpha" in skipped["transparent.png"] and all(skipped.values())
    check_complete_and_consistent(out, folder, good, 1)
    again = run(explainer(), folder, out, batch_size=4, progress=False)  # a rerun retries the bad files
    assert again.explained == 0 and again.already_done == 5 and len(again.skipped) == 4


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes in names")
def test_a_file_name_that_is_not_utf8_or_holds_a_newline_is_explained_and_listed(tmp_path):
    folder = tmp_path / "images"
    paths = save_images(folder, 2, seed=2)
    odd = [Path(os.fsdecode(bytes(folder) + b"/caf\xe9.png")), folder / "two\nlines.png"]
    for source, target in zip(paths, odd):
        os.rename(source, target)
    out = tmp_path / "out"
    main(["batch", str(folder), "--model", "demo", "--out", str(out), "--no-progress"])
    rows = read_index(out / "index.csv")
    assert sorted(row["image"].rsplit("/", 1)[-1] for row in rows) == ["caf\\xe9.png", "two\\x0alines.png"]
    check_complete_and_consistent(out, folder, odd, 1)


# ------------------------------------------------------------------ 15, 16. ids and output folders


def test_files_whose_old_ids_collided_get_their_own_ids_and_maps(tmp_path):
    folder = tmp_path / "images"
    names = ["cat.png", "cat.jpg", "a/b.png", "a__b.png", "a/b/c.png", "a__b__c.png"]
    data = make_dataset(len(names), seed=5)
    for name, image in zip(names, data.images):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / name, quality=100) if name.endswith(".jpg") else \
            Image.fromarray(image).save(folder / name)
    out = tmp_path / "out"
    run(explainer(), folder, out, batch_size=4, progress=False)
    rows = read_index(out / "index.csv")
    assert len({row["id"] for row in rows}) == 6
    assert sorted(item for path in (out / "maps").iterdir() for item in load_maps(path).ids) == sorted(
        row["id"] for row in rows)  # each image its own maps
    check_complete_and_consistent(out, folder, [folder / name for name in names], 1)


def test_an_output_folder_inside_the_input_folder_is_not_explained(tmp_path):
    folder = tmp_path / "images"
    paths = save_images(folder, 3, seed=6)
    out = folder / "results"
    run(explainer(), folder, out, batch_size=4, progress=False, overlays=True)
    assert len(list((out / "overlays").glob("*.png"))) == 3
    second = run(explainer(), folder, out, batch_size=4, progress=False, overlays=True)
    assert second.explained == 0 and second.already_done == 3  # the overlays were not taken as images
    check_complete_and_consistent(out, folder, paths, 1)


def test_images_of_different_sizes_are_explained_in_groups_of_one_size(tmp_path):
    folder = tmp_path / "images"
    paths = save_images(folder, 4, seed=7)
    big = folder / "big.png"
    Image.open(paths[0]).resize((96, 96)).save(big)
    out = tmp_path / "out"
    summary = run(explainer(), folder, out, batch_size=8, progress=False)
    assert summary.explained == 5 and not summary.skipped
    check_complete_and_consistent(out, folder, [*paths, big], 1)


# ------------------------------------------------------------------ 14. kill -9 at random moments


def batch_command_in_child(folder: str, out: str, *options: str) -> None:
    """``explain batch FOLDER --out OUT`` on the demo model, in batches of 3 with overlays, quietly,
    on one thread (the body of a forked process)."""
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    main(["batch", folder, "--model", "demo", "--out", out, "--batch-size", "3", "--overlays", "--no-progress",
          *options])


def run_in_fork(folder: Path, out: Path, options: Sequence[str]) -> float:
    """``explain batch`` with ``options`` in a forked process, to its end; how many seconds it took."""
    child = multiprocessing.get_context("fork").Process(target=batch_command_in_child,
                                                        args=(str(folder), str(out), *options))
    start = time.perf_counter()
    child.start()
    join_or_fail(child, RUN_TIME_LIMIT)
    return time.perf_counter() - start


RUN_TIME_LIMIT = 300.0  # seconds: a run of this file's folders takes a few; a child past this is stuck


def join_or_fail(child: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait for ``child`` to finish with exit code 0; kill it and fail if it runs past ``timeout``."""
    child.join(timeout=timeout)
    if child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        pytest.fail(f"a forked `explain batch` did not finish within {timeout:.0f} s (stuck child)")
    assert child.exitcode == 0


def clear_files(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            path.unlink()


def kill_at_random_moments(folder: Path, out: Path, options: Sequence[str], full_run: float, kills: int,
                           seed: int) -> int:
    """``explain batch`` with ``options`` in forked processes, each SIGKILLed at a random moment within
    ``full_run`` seconds and followed by the next (a resume), until one finishes after at least
    ``kills`` kills (a run that finishes sooner is started over on an empty ``out``). Returns the kills;
    fails if a run is stuck or too few kills land in a bounded number of runs."""
    context = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    killed = 0
    for _ in range(4 * kills + 20):  # a bound, so that a stuck child fails the test instead of looping
        child = context.Process(target=batch_command_in_child, args=(str(folder), str(out), *options))
        child.start()
        if killed >= kills:  # enough kills: this resume must finish
            join_or_fail(child, RUN_TIME_LIMIT)
            return killed
        child.join(timeout=rng.uniform(0, full_run))
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            killed += 1
            continue
        assert child.exitcode == 0
        clear_files(out)  # done before enough kills: start over, to kill more
    pytest.fail(f"only {killed} of {kills} kills landed in {4 * kills + 20} runs")


def test_kill_9_at_random_moments_then_resume_gives_exactly_one_complete_set_of_rows(tmp_path):
    """`explain batch` (K = 2 targets per image, overlays on) is SIGKILLed at random moments, at
    least 30 times, and resumed each time until it finishes; the index and the maps are then
    complete and consistent."""
    folder = tmp_path / "images"
    paths = save_images(folder, 24, seed=9)
    out = tmp_path / "out"
    full_run = run_in_fork(folder, out, ["--topk", "2"])  # one uninterrupted run, for the range of kill times
    clear_files(out)
    assert kill_at_random_moments(folder, out, ["--topk", "2"], full_run, kills=30, seed=0) >= 30
    check_complete_and_consistent(out, folder, paths, 2)
    assert len(list((out / "overlays").glob("*.png"))) == 24
