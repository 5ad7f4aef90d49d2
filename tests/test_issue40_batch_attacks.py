"""Issue 40, dataset runs attacked: a second Ctrl-C while the background writer finishes, ``kill -9`` at each
step of the writer (inside a maps file, between the maps file and its rows, inside the rows, inside an overlay),
and maps files damaged in their zip headers. Each image must end in the index exactly once, its maps read back
as an uninterrupted run's, with no file left that no row names."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from test_batch_robustness import join_or_fail
from test_issue40_batch import gradcam, maps_files, save_images

import explain
import explain.dataset_tools.batch as batch
import explain.dataset_tools.pipeline as pipeline
from explain.cli import main
from explain.dataset_tools.batch import item_id, run
from explain.dataset_tools.index import read_index, read_index_contents, read_maps
from explain.dataset_tools.stored_maps import load_maps


def ctrl_c() -> None:
    """What Ctrl-C in a terminal does: SIGINT to the main thread, which interrupts a wait it is blocked in."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def writer_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "explain-writer" and thread.is_alive()]


def check_each_image_once(out: Path, ids: list[str], reference: Path, overlays: bool = False) -> None:
    """The index of ``out`` holds each of ``ids`` once (K rows each, no copies, nothing torn); every maps file is
    named by a row and holds that row's image; no temporary file is left; the maps read back are those of the
    uninterrupted run into ``reference`` (float32 rounding of another batch size aside)."""
    contents = read_index_contents(out / "index.csv")
    assert not contents.incomplete and not contents.duplicated
    rows = contents.rows
    assert sorted({row["id"] for row in rows}) == sorted(ids)
    assert len(rows) == len(read_index(reference / "index.csv"))
    named = {Path(row["map"]).name for row in rows}
    assert {path.name for path in maps_files(out)} == named  # no maps file that no row names
    for row in rows:
        assert row["id"] in load_maps(out / row["map"]).ids
    assert not list(out.rglob("*.part"))
    expected = dict(read_maps(reference))
    got = dict(read_maps(out))
    assert sorted(got) == sorted(expected)
    for image, maps in got.items():
        torch.testing.assert_close(maps, expected[image], atol=1e-5, rtol=0)
    if overlays:
        assert sorted(path.name for path in (out / "overlays").iterdir()) == sorted(f"{image}.png" for image in ids)


# ------------------------------------------------------------------ a second Ctrl-C while the writer finishes


def image_folder_loader(folder: Path, batch_size: int) -> torch.utils.data.DataLoader:
    dataset = torchvision.datasets.ImageFolder(str(folder), transform=explain.Normalize())
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


@pytest.mark.parametrize("source", ["folder", "dataloader with overlays"])
def test_a_second_ctrl_c_while_the_writer_finishes_stops_it_before_run_raises(source, tmp_path, monkeypatch,
                                                                               python_sigint_handler):
    """Ctrl-C while the 4th batch is explained (the writer slowed inside its 1st batch: its maps file, or an
    overlay), then a second Ctrl-C while run waits for the writer. The writer stops at its next step, and its
    thread has ended when run raises: nothing is written after that, so a run started at once into the folder
    (another batch size: other maps files under the same names) is the only one writing, and the folder ends
    with each image once and the maps of an uninterrupted run. (Before: run raised at once, unlocking the
    folder while the writer went on, and its maps file replaced the new run's of the same name.)"""
    folder = tmp_path / "images"
    if source == "folder":
        paths = save_images(folder, 16, seed=21)
        ids = [item_id(path, folder) for path in paths]
        overlays = False

        def explained(out: Path, batch_size: int) -> batch.RunSummary:
            return run(gradcam(), folder, out, batch_size=batch_size, progress=False, workers=0, overlays=overlays)
    else:
        paths = save_images(folder / "a", 7, seed=22) + save_images(folder / "b", 7, seed=23)
        ids = [item_id(path, folder) for path in paths]
        overlays = True

        def explained(out: Path, batch_size: int) -> batch.RunSummary:
            return run(gradcam(), image_folder_loader(folder, batch_size), out, progress=False, overlays=overlays)

    reference = tmp_path / "reference"
    explained(reference, 4)

    waiting, second_sent = threading.Event(), threading.Event()
    real_exit = pipeline.BackgroundWriter.__exit__

    def exit_observed(self, *args):
        waiting.set()  # run waits for the writer from here on
        return real_exit(self, *args)

    def second_interrupt() -> None:
        waiting.wait(60)
        time.sleep(0.05)
        ctrl_c()  # the second one
        second_sent.set()

    slowed = "_save_png" if overlays else "_save_maps_file"
    real_step = getattr(batch, slowed)
    calls = []

    def slow_step(*args):
        calls.append(1)
        if len(calls) == 1:
            second_sent.wait(60)
            time.sleep(0.5)  # the main thread handles the interrupt meanwhile
        return real_step(*args)

    monkeypatch.setattr(pipeline.BackgroundWriter, "__exit__", exit_observed)
    monkeypatch.setattr(batch, slowed, slow_step)
    explainer = gradcam()
    original, explains = explainer.explain, []

    def interrupted(*args, **kwargs):
        explains.append(1)
        if len(explains) == 4:
            threading.Thread(target=second_interrupt, daemon=True).start()
            raise KeyboardInterrupt  # the first Ctrl-C
        return original(*args, **kwargs)

    explainer.explain = interrupted
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        if source == "folder":
            run(explainer, folder, out, batch_size=2, progress=False, workers=0, overlays=overlays)
        else:
            run(explainer, image_folder_loader(folder, 2), out, progress=False, overlays=overlays)
    still_writing = writer_threads()
    monkeypatch.undo()
    summary = explained(out, 4)  # at once, with another batch size
    for thread in still_writing:
        thread.join(30)
    assert not still_writing, "the writer went on writing after run raised"
    assert summary.explained + summary.already_done == len(ids)
    check_each_image_once(out, ids, reference, overlays)


@pytest.mark.parametrize("case", ["one Ctrl-C at the end", "an error, then one Ctrl-C", "two Ctrl-C at the end"])
def test_the_writer_finishes_every_item_on_one_ctrl_c_and_stops_early_on_the_second(case, monkeypatch,
                                                                                    python_sigint_handler):
    """BackgroundWriter alone, three items queued, the first one's write held until the interrupts are sent
    while the block waits for it: one Ctrl-C (the block left normally, or by an error) lets every item be
    written and is raised then, not lost (chained to the error); two stop the writer after the item in
    progress. Either way its thread has ended when the block is left."""
    written, gate = [], threading.Event()

    def write(item: int) -> None:
        if item == 0:
            gate.wait(30)
        written.append(item)

    leaving, real_exit = threading.Event(), pipeline.BackgroundWriter.__exit__

    def exit_observed(self, *args):
        leaving.set()  # the block is being left: it waits for the writer from here on
        return real_exit(self, *args)

    monkeypatch.setattr(pipeline.BackgroundWriter, "__exit__", exit_observed)
    writer = pipeline.BackgroundWriter(write, depth=4)

    def interrupts() -> None:
        leaving.wait(30)
        for _ in range(2 if case.startswith("two") else 1):
            time.sleep(0.1)
            ctrl_c()
        time.sleep(0.2)
        gate.set()

    threading.Thread(target=interrupts, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as raised:
        with writer:
            for item in range(3):
                writer.put(item)
            if case.startswith("an error"):
                raise ValueError("explaining failed")
    assert not writer._thread.is_alive()
    assert written == ([0] if case.startswith("two") else [0, 1, 2])
    assert isinstance(raised.value.__cause__, ValueError) == case.startswith("an error")


# ------------------------------------------------------------------ kill -9 at each step of the writer


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def batch_killed_at(step: str, call: int, folder: str, out: str) -> None:
    """``explain batch`` (K = 2, overlays, batches of 3, 1 worker process) in a forked process that SIGKILLs
    itself from the writer thread at the ``call``-th time it reaches ``step``."""
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    count = [0]

    def reached() -> bool:
        count[0] += 1
        return count[0] == call

    real_save_maps, real_append, real_png = batch._save_maps_file, batch.append_rows, batch._save_png

    def save_maps(path, stored):
        real_save_maps(path, stored)
        if reached():  # the temporary maps file half written
            os.truncate(path, path.stat().st_size // 2)
            die()

    def append(index_file, rows):
        if step == "before the rows" and reached():
            die()
        if step == "inside the rows" and reached():  # part of the group's rows in the index
            os.write(index_file.fileno(), rows[: len(rows) * 2 // 3])
            die()
        real_append(index_file, rows)
        if step == "after the rows" and reached():
            die()

    def save_png(picture, path):
        real_png(picture, path)
        if reached():
            os.truncate(path, path.stat().st_size // 3)
            die()

    if step == "inside the maps file":
        batch._save_maps_file = save_maps
    elif step == "inside an overlay":
        batch._save_png = save_png
    else:
        batch.append_rows = append
    main(["batch", folder, "--model", "demo", "--out", out, "--batch-size", "3", "--overlays", "--topk", "2",
          "--workers", "1", "--no-progress"])


STEPS = ["inside the maps file", "before the rows", "inside the rows", "after the rows", "inside an overlay"]


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_each_step_of_the_background_writer_then_resume_leaves_each_image_once(step, tmp_path):
    """`explain batch --workers 1` (K = 2, overlays, 16 images of two sizes in batches of 3) is SIGKILLed from
    its writer thread at the 2nd time it reaches ``step`` and then again at the 4th (counting afresh in the
    resumed run), then resumed to its end: each image once in the index, no maps file that no row names, no
    temporary file, every overlay whole, the maps those of an uninterrupted run."""
    folder = tmp_path / "images"
    paths = save_images(folder, 12, seed=24) + save_images(folder, 4, seed=25, size=80, start=12)
    ids = [item_id(path, folder) for path in paths]
    reference = tmp_path / "reference"
    assert main(["batch", str(folder), "--model", "demo", "--out", str(reference), "--batch-size", "3", "--overlays",
                 "--topk", "2", "--workers", "0", "--no-progress"]) == 0
    out = tmp_path / "out"
    context = multiprocessing.get_context("fork")
    for call in (2, 4):
        child = context.Process(target=batch_killed_at, args=(step, call, str(folder), str(out)))
        child.start()
        child.join(300)
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            pytest.fail("the forked run is stuck")
        assert child.exitcode == -signal.SIGKILL, f"the run was not killed {step} (exit code {child.exitcode})"
    finish = context.Process(target=batch_killed_at, args=(step, 10**6, str(folder), str(out)))
    finish.start()
    join_or_fail(finish, 300)
    check_each_image_once(out, ids, reference, overlays=True)
    for path in (out / "overlays").iterdir():
        with Image.open(path) as picture:
            picture.load()  # whole: a PNG cut short does not load


# ------------------------------------------------------------------ maps files damaged on disk


def test_a_maps_file_damaged_anywhere_is_a_value_error_or_reads_as_written(tmp_path):
    """Every byte of a maps file inverted in turn, and the file cut at every length (every 7th of a large one):
    load_maps raises a ValueError naming the file, or gives back exactly what was written (a byte the format
    does not use); never another exception (a damaged zip header raised NotImplementedError for its compression
    method or RuntimeError for its encryption flag, a damaged array header tokenize.TokenError or SyntaxError)
    and never other maps. The rule on a second file: a ViT's maps, stored at the input's resolution (float16)."""
    folder = tmp_path / "images"
    save_images(folder, 3, seed=26)
    run(gradcam(), folder, tmp_path / "cam", topk=2, progress=False, workers=0)
    save_images(folder, 1, seed=27, size=72, start=3)
    from test_issue40_batch import padded_vit

    run(explain.GradCAM(padded_vit(), "blocks.1"), folder, tmp_path / "vit", progress=False, workers=0)
    for out in (tmp_path / "cam", tmp_path / "vit"):
        for path in maps_files(out):
            written = path.read_bytes()
            original = load_maps(io.BytesIO(written))
            every = 1 if len(written) < 6000 else 7  # the float16 file: every 7th byte (its headers are spread less)
            damaged = [written[:length] for length in range(0, len(written), every)]
            damaged += [written[:position] + bytes([written[position] ^ 0xFF]) + written[position + 1:]
                        for position in range(0, len(written), every)]
            for data in damaged:
                try:
                    read = load_maps(io.BytesIO(data))
                except ValueError as error:
                    assert "is not a maps file of explain" in str(error)
                    continue
                assert (read.ids, read.targets, read.form, read.size, read.normalize) == (
                    original.ids, original.targets, original.form, original.size, original.normalize)
                assert torch.equal(read.maps, original.maps)
