"""Issue 39, points 9 and 10 and SpRAy's non-finite maps (point 14).

9: OUT/run.json records the model (class, names as given, SHA-256 of its weights) and the input (folder, each
file's size and modification time) besides the method's settings; a resumed run with another model, other weights,
another folder of the same file names, changed files, or other settings is refused saying what differs and what to
do; the same run resumes; a run.json of the previous version resumes with a note.
10: one run at a time writes to an output folder (an flock on OUT/.explain.lock); two runs started at once give one
complete index and one clear error; a kill -9 of the holder blocks nothing; an index whose rows two unlocked runs
wrote twice is read once per image and cleaned by a resume.
14: SpRAy refuses maps given in memory that hold NaN or ±inf, naming them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision.datasets import ImageFolder

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.data.demo_watermark import load_watermark_demo
from explain.dataset_tools import batch as batch_module
from explain.dataset_tools.batch import run
from explain.dataset_tools.html_report import report
from explain.dataset_tools.index import read_index_contents
from explain.dataset_tools.run_folder import LOCK_FILE, FolderInUseError, Shard, folder_lock
from explain.dataset_tools.run_record import RUN_RECORD, weights_fingerprint
from explain.dataset_tools.spray import strategies


def save_images(folder: Path, count: int, seed: int) -> list[Path]:
    """``count`` demo images in class folders (as --labels folders reads them)."""
    data = make_dataset(count, seed=seed)
    paths = []
    for index, (image, label) in enumerate(zip(data.images, data.labels)):
        path = folder / CLASS_NAMES[int(label)] / f"shape{index:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        paths.append(path)
    return paths


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "images"
    save_images(root, 6, seed=39)
    return root


def folder_state(out: Path) -> dict[str, bytes]:
    return {str(path.relative_to(out)): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}


def recorded(out: Path) -> dict:
    return json.loads((out / RUN_RECORD).read_text(encoding="utf-8"))


def index_ids(out: Path) -> list[str]:
    with open(out / "index.csv", newline="", encoding="utf-8") as file:
        return [row["id"] for row in csv.DictReader(file)]


def batch_command(folder: Path, out: Path, *options: str) -> list[str]:
    return ["batch", str(folder), "--out", str(out), "--no-progress", *options]


# ------------------------------------------------------------------ 9. what run.json records


def test_run_json_records_the_model_its_weights_and_the_input_files(folder, tmp_path):
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo")) == 0
    record = recorded(out)
    model = load_demo_model()
    assert record["model"] == {"class": "explain.data.demo.DemoNet", "name": "demo", "weights": None,
                               "fingerprint": weights_fingerprint(model)}
    files = sorted(folder.rglob("*.png"))
    assert record["data"] == {"folder": str(folder.resolve()), "files": {
        batch_module.item_id(path, folder): [path.stat().st_size, path.stat().st_mtime_ns] for path in files}}
    assert len(record["data"]["files"]) == 6
    # the preprocessing, the layer and the options are in the settings already
    assert "preprocess=Normalize(mean=(0.485, 0.456, 0.406)" in record["settings"] and "layer=['layer4']" in \
        record["settings"]
    # the Python API names no model: its class and fingerprint
    run(explain.GradCAM(model, "layer4"), folder, tmp_path / "api", progress=False)
    assert recorded(tmp_path / "api")["model"] == {"class": "explain.data.demo.DemoNet", "name": None,
                                                   "weights": None, "fingerprint": weights_fingerprint(model)}


def test_the_fingerprint_is_the_weights_not_the_module_object_or_its_names():
    """Equal for a copy and for a wrapper (names prefixed "0."); different for one weight changed by one ulp, a
    buffer changed, another dtype; the digest of the state dict's bytes in order, as computed here by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 8, 8))
    by_hand = hashlib.sha256()
    for value in model.state_dict().values():
        by_hand.update(f"{value.dtype} {tuple(value.shape)};".encode())
        by_hand.update(value.detach().contiguous().numpy().tobytes())
    assert weights_fingerprint(model) == by_hand.hexdigest()
    copy = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    copy.load_state_dict(model.state_dict())
    assert weights_fingerprint(copy) == weights_fingerprint(model) == weights_fingerprint(nn.Sequential(model))
    with torch.no_grad():
        copy[0].weight[0, 0, 0, 0] = torch.nextafter(copy[0].weight[0, 0, 0, 0], torch.tensor(math.inf))
    assert weights_fingerprint(copy) != weights_fingerprint(model)
    copy.load_state_dict(model.state_dict())
    copy[1].running_mean += 1e-3  # a buffer, not a parameter
    assert weights_fingerprint(copy) != weights_fingerprint(model)
    assert weights_fingerprint(copy.double()) != weights_fingerprint(copy.float())
    assert weights_fingerprint(load_demo_model()) != weights_fingerprint(load_watermark_demo())


# ------------------------------------------------------------------ 9. resuming otherwise is refused


def test_demo_then_demo_watermark_into_one_folder_is_refused_naming_both_models(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo", "--layer", "layer4")) == 0
    before = folder_state(out)
    status = main(batch_command(folder, out, "--model", "demo-watermark", "--layer", "layer4"))
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    fingerprints = weights_fingerprint(load_demo_model())[:12], weights_fingerprint(load_watermark_demo())[:12]
    assert (f"model: 'demo' (DemoNet, weights' fingerprint {fingerprints[0]}) earlier, 'demo-watermark' (DemoNet, "
            f"weights' fingerprint {fingerprints[1]}) now") in error[0]
    assert "mix maps of two models" in error[0] and "give another output folder" in error[0]
    assert "method settings" not in error[0]  # the same layer: only the model differs
    assert folder_state(out) == before
    # through the Python API (no names: the class and the fingerprint)
    with pytest.raises(ValueError, match=f"model: 'demo' \\(DemoNet, weights' fingerprint {fingerprints[0]}\\) "
                       f"earlier, DemoNet \\(weights' fingerprint {fingerprints[1]}\\) now"):
        run(explain.GradCAM(load_watermark_demo(), "layer4", class_names=CLASS_NAMES), folder, out, progress=False)
    assert folder_state(out) == before


def test_random_weights_then_a_weights_file_is_refused_and_random_weights_never_resume(folder, tmp_path, capsys):
    """The rule on another model: a torchvision architecture with random weights, then with a state-dict file (its
    absolute path recorded); random weights drawn again are other weights too."""
    out = tmp_path / "out"
    common = ["--model", "resnet18", "--size", "32", "--layer", "layer4"]
    assert main(batch_command(folder, out, *common, "--weights", "random")) == 0
    assert recorded(out)["model"]["weights"] == "random"
    weights = tmp_path / "fine-tuned.pt"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    capsys.readouterr()
    before = folder_state(out)
    assert main(batch_command(folder, out, *common, "--weights", str(weights))) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model: 'resnet18' with weights 'random' (ResNet, weights' fingerprint " in error
    assert f"'resnet18' with weights '{weights.resolve()}' (ResNet" in error and "maps of two models" in error
    assert "Random weights (--weights random) are drawn anew by every run, so a run with them cannot be resumed" \
        in error
    assert main(batch_command(folder, out, *common, "--weights", "random")) == 2
    drawn_again = re.search(r"model: 'resnet18' with weights 'random' \(ResNet, weights' fingerprint (\w+)\) earlier, "
                            r"'resnet18' with weights 'random' \(ResNet, weights' fingerprint (\w+)\) now",
                            capsys.readouterr().err)
    assert drawn_again is not None and drawn_again.group(1) != drawn_again.group(2)
    assert folder_state(out) == before
    assert main(batch_command(folder, tmp_path / "other", *common, "--weights", str(weights))) == 0  # as it says


def test_the_same_file_names_in_another_folder_or_changed_files_are_refused(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo")) == 0
    before = folder_state(out)
    copy = tmp_path / "other images"
    shutil.copytree(folder, copy)
    assert main(batch_command(copy, out, "--model", "demo")) == 2
    error = capsys.readouterr().err
    assert f"input folder: {folder.resolve()} earlier, {copy.resolve()} now" in error
    assert "maps of other images under the same names" in error and "give another output folder" in error
    # the same folder, one image replaced by another (same name, other size and time)
    changed = sorted(folder.rglob("*.png"))[2]
    earlier = changed.stat()
    Image.fromarray(make_dataset(1, seed=99).images[0]).save(changed)
    os.utime(changed, ns=(earlier.st_atime_ns, earlier.st_mtime_ns + 10**9))
    assert main(batch_command(folder, out, "--model", "demo")) == 2
    error = capsys.readouterr().err
    item = batch_module.item_id(changed, folder)
    assert f"images: 1 of the images already explained changed since (another size or modification time): {item} " \
           f"({earlier.st_size} bytes, modified " in error
    assert f"{changed.stat().st_size} bytes, modified " in error and 'delete the "data" entry of run.json' in error
    assert folder_state(out) == before
    # as the message says: without the "data" entry the run resumes (with a note) and records the files anew
    record = recorded(out)
    del record["data"]
    (out / RUN_RECORD).write_text(json.dumps(record), encoding="utf-8")
    with pytest.warns(UserWarning, match="did not record the input images: this run cannot check that the 6 image"):
        summary = run(explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES), folder, out,
                      progress=False, model_name="demo")
    assert summary.already_done == 6 and recorded(out)["data"]["files"][item][0] == changed.stat().st_size


def test_the_same_run_resumes_and_new_files_are_added_to_the_record(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo", "--batch-size", "4")) == 0
    first = (out / RUN_RECORD).read_bytes()
    capsys.readouterr()
    assert main(batch_command(folder, out, "--model", "demo", "--batch-size", "2")) == 0
    assert "0 image(s) explained, 6 already done" in capsys.readouterr().out
    assert (out / RUN_RECORD).read_bytes() == first  # nothing new: not rewritten
    Image.fromarray(make_dataset(1, seed=7).images[0]).save(folder / "disc" / "new.png")
    assert main(batch_command(folder, out, "--model", "demo")) == 0
    assert "1 image(s) explained, 6 already done" in capsys.readouterr().out
    files = recorded(out)["data"]["files"]
    assert len(files) == 7 and files[batch_module.item_id(folder / "disc" / "new.png", folder)][0] == (
        folder / "disc" / "new.png").stat().st_size
    assert main(batch_command(folder, out, "--model", "demo")) == 0  # and the next resume checks it too
    assert "0 image(s) explained, 7 already done" in capsys.readouterr().out
    # the Python API, resumed through another route to the same folder, is the same run
    api = tmp_path / "api"
    run(explain.GradCAM(load_demo_model(), "layer4"), folder, api, progress=False)
    link = tmp_path / "link"
    link.symlink_to(folder)
    assert run(explain.GradCAM(load_demo_model(), "layer4"), link, api, progress=False).already_done == 7


def test_a_run_json_of_the_previous_version_resumes_with_a_note_and_is_completed(folder, tmp_path):
    out = tmp_path / "out"
    explainer = explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)
    run(explainer, folder, out, progress=False)
    complete = recorded(out)
    previous = {name: value for name, value in complete.items() if name not in ("model", "data")}
    (out / RUN_RECORD).write_text(json.dumps(previous), encoding="utf-8")  # as the previous version wrote it
    with pytest.warns(UserWarning, match="was written by an earlier version of explain, which did not record the "
                      "model and the input images: this run cannot check that the 6 image\\(s\\) already done were "
                      "explained by this run's model and from this run's files") as caught:
        summary = run(explainer, folder, out, progress=False)
    assert caught[0].filename == __file__  # the caller's line
    assert summary.already_done == 6 and summary.explained == 0 and len(summary.notes) == 1
    assert recorded(out) == complete  # recorded from now on
    # and the next resume with another model is refused
    with pytest.raises(ValueError, match="maps of two models"):
        run(explain.GradCAM(load_watermark_demo(), "layer4", class_names=CLASS_NAMES), folder, out, progress=False)


def test_other_settings_on_the_command_line_and_another_dataset_transform_are_refused(folder, tmp_path, capsys):
    """The rule on other inputs: --layer and --option change the settings; a DataLoader over an ImageFolder with
    another transform (its preprocessing) changes the input."""
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo")) == 0
    before = folder_state(out)
    for option, shown in ((["--layer", "layer3"], "layer=['layer3']"), (["--option", "relu=False"], "relu=False")):
        assert main(batch_command(folder, out, "--model", "demo", *option)) == 2
        error = capsys.readouterr().err
        assert "method settings: GradCAM(layer=['layer4'], relu=True" in error and shown in error.split("earlier")[1]
        assert "maps made two ways" in error
    assert folder_state(out) == before

    def loader(size: int) -> torch.utils.data.DataLoader:
        transform = torchvision.transforms.Compose([torchvision.transforms.Resize(size),
                                                    torchvision.transforms.ToTensor(), explain.Normalize()])
        return torch.utils.data.DataLoader(ImageFolder(str(folder), transform=transform), batch_size=4)

    model = load_demo_model()
    loaded = tmp_path / "loader"
    run(explain.GradCAM(model, "layer4"), loader(64), loaded, progress=False)
    assert recorded(loaded)["data"]["folder"] == str(folder.resolve())
    assert "Resize(size=64" in recorded(loaded)["data"]["transform"]
    assert run(explain.GradCAM(model, "layer4"), loader(64), loaded, progress=False).already_done == 6
    with pytest.raises(ValueError, match="the dataset's transform: Compose\\( Resize\\(size=64, .*\\) ToTensor\\(\\) "
                       "Normalize.* earlier, Compose\\( Resize\\(size=48, .* now.*maps made two ways"):
        run(explain.GradCAM(model, "layer4"), loader(48), loaded, progress=False)


# ------------------------------------------------------------------ 10. one run at a time


SLOW_CHILD = """
import pathlib, sys, time
import torch
import explain.dataset_tools.batch as batch
from explain.cli import main

torch.set_num_threads(1)
ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
append_rows = batch.append_rows

def slowly(*args, **kwargs):  # each batch of 3 takes at least 0.9 s: the two runs overlap however their start differs
    time.sleep(0.9)
    return append_rows(*args, **kwargs)

batch.append_rows = slowly
ready.touch()
while not go.exists():
    time.sleep(0.01)
sys.exit(main(sys.argv[3:]))
"""


def test_two_runs_started_at_once_into_one_folder_give_one_index_and_one_clear_error(tmp_path):
    """Both processes start (import explain), then begin their runs at the same moment; the one that locks the
    folder explains every image once, the other stops with an error naming the folder and the first's pid."""
    folder = tmp_path / "images"
    paths = save_images(folder, 12, seed=10)
    out = tmp_path / "out"
    go = tmp_path / "go"
    children = []
    for number in range(2):
        ready = tmp_path / f"ready{number}"
        command = [sys.executable, "-c", SLOW_CHILD, str(ready), str(go), *batch_command(folder, out, "--model", "demo",
                                                                                          "--batch-size", "3")]
        children.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}), ready))
    deadline = time.monotonic() + 300
    while not all(ready.exists() for _, ready in children):
        assert time.monotonic() < deadline and all(child.poll() is None for child, _ in children)
        time.sleep(0.05)
    go.touch()
    results = [(child.pid, *child.communicate(timeout=300), child.returncode) for child, _ in children]
    statuses = sorted(status for *_, status in results)
    assert statuses == [0, 2], results
    (winner,) = [pid for pid, _, _, status in results if status == 0]
    (error,) = [stderr for _, _, stderr, status in results if status == 2]
    assert f"explain: error: {out} is in use by another run of explain (pid {winner} on " in error
    assert "explain every image and write each image's rows twice" in error and "another output folder" in error
    assert (out / "run.json").exists() and not (out / LOCK_FILE).exists()  # removed by the run that held it
    ids = index_ids(out)
    assert sorted(ids) == sorted(batch_module.item_id(path, folder) for path in paths)  # each image exactly once


def hold_the_folder_slowly(folder: str, out: str) -> None:
    """A forked ``explain batch`` whose every batch of 2 images takes at least 1 s to write, quietly."""
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    append_rows = batch_module.append_rows
    batch_module.append_rows = lambda *args, **kwargs: (time.sleep(1.0), append_rows(*args, **kwargs))[1]
    main(["batch", folder, "--model", "demo", "--out", out, "--batch-size", "2", "--no-progress"])


def test_kill_9_of_the_run_holding_the_lock_blocks_no_later_run(tmp_path):
    folder = tmp_path / "images"
    paths = save_images(folder, 12, seed=11)
    out = tmp_path / "out"
    child = multiprocessing.get_context("fork").Process(target=hold_the_folder_slowly, args=(str(folder), str(out)))
    child.start()
    deadline = time.monotonic() + 120
    while not ((out / "index.csv").exists() and len(index_ids(out)) >= 3):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    explainer = explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)
    with pytest.raises(FolderInUseError, match=f"is in use by another run of explain \\(pid {child.pid} on "):
        run(explainer, folder, out, progress=False)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert (out / LOCK_FILE).read_text().startswith(f"pid {child.pid} on ")  # left behind, unlocked
    summary = run(explainer, folder, out, progress=False)
    assert summary.already_done >= 3 and summary.explained + summary.already_done == 12
    assert sorted(index_ids(out)) == sorted(batch_module.item_id(path, folder) for path in paths)
    assert not (out / LOCK_FILE).exists()


def test_the_lock_names_its_holder_and_the_ranks_of_a_torchrun_run_share_it(folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    explainer = explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)
    with folder_lock(out):
        with pytest.raises(FolderInUseError, match=f"in use by another run of explain \\(pid {os.getpid()} on "):
            run(explainer, folder, out, progress=False)
        assert main(batch_command(folder, out, "--model", "demo")) == 2  # one error line, exit status 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"is in use by another run of explain (pid {os.getpid()} on " in error[0]
    assert list(out.iterdir()) == []  # nothing written, no lock file left
    with folder_lock(out, Shard(0, 2)), folder_lock(out, Shard(1, 2)):  # the ranks of one run hold it together
        with pytest.raises(FolderInUseError, match="rank 0 of 2; pid .* rank 1 of 2"):
            run(explainer, folder, out, progress=False)
        with pytest.raises(FolderInUseError, match="rank 1 of 2"):  # a second run's rank 1
            run(explainer, folder, out, shard=Shard(1, 2), progress=False)
    assert list(out.iterdir()) == []
    assert run(explainer, folder, out, progress=False).explained == 6


# ------------------------------------------------------------------ 10. indexes two unlocked runs wrote


def duplicate_rows(index: Path, interleaved: bool) -> bytes:
    """The index as two runs at once wrote it before the lock: each image's rows twice, either one run's rows
    after the other's or image by image. Returns the index's bytes before."""
    original = index.read_bytes()
    header, *lines = original.splitlines(keepends=True)
    groups: list[list[bytes]] = []
    for line in lines:
        k = next(csv.reader([line.decode()]))[3]
        if k == "0":
            groups.append([])
        groups[-1].append(line)
    if interleaved:
        index.write_bytes(header + b"".join(b"".join(group) * 2 for group in groups))
    else:
        index.write_bytes(header + b"".join(lines) * 2)
    return original


@pytest.mark.parametrize("targets, interleaved", [(1, False), (2, True)])
def test_an_index_with_every_row_twice_is_read_once_per_image_and_cleaned_by_a_resume(tmp_path, targets,
                                                                                      interleaved):
    folder = tmp_path / "images"
    save_images(folder, 12, seed=12)
    out = tmp_path / "out"
    options = ["--model", "demo", "--overlays"] + (["--topk", "2"] if targets == 2 else [])
    assert main(batch_command(folder, out, *options)) == 0
    read_before = read_index_contents(out / "index.csv")
    original = duplicate_rows(out / "index.csv", interleaved)
    # the readers keep each image's first rows, and say so
    contents = read_index_contents(out / "index.csv")
    assert len(contents.rows) == 12 * targets and len(contents.duplicated) == 12 and contents.incomplete == []
    assert [row["id"] for row in contents.rows] == [row["id"] for row in read_before.rows]
    if targets == 1:
        result = strategies(out, min_images=3, progress=False)
        assert any("12 image(s) have their rows in the index more than once" in note for note in result.notes)
        assert sum(entry.images for entry in result.classes) + sum(entry.images for entry in result.skipped) == 12
    with pytest.warns(UserWarning, match="12 image\\(s\\) have their rows in the index more than once"):
        page = report(out)
    assert page.images == 12
    # a resume removes the copies: the index is byte for byte the one before
    with pytest.warns(UserWarning, match="held the rows of 12 image\\(s\\) more than once .* the copies were removed"):
        assert main(batch_command(folder, out, *options)) == 0
    assert (out / "index.csv").read_bytes() == original
    assert read_index_contents(out / "index.csv").duplicated == []
    if targets == 1:
        assert strategies(out, min_images=3, progress=False).notes == []
    assert report(out).notes == []


# ------------------------------------------------------------------ 14. SpRAy and maps that are not finite


def spread_maps(count: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((count, 16, 16)).astype(np.float32), np.repeat([0, 1], count // 2)


def test_spray_refuses_maps_in_memory_that_hold_nan_naming_them():
    maps, classes = spread_maps()
    assert len(strategies(maps, classes=classes, min_images=5, progress=False).classes) == 2  # finite: analysed
    maps[3, 2, 2] = np.nan
    maps[3, 5, :3] = np.nan
    maps[17, 0, 0] = np.nan
    with pytest.raises(ValueError, match="2 of the 24 maps hold values that are not finite \\(map 3: 4 NaN; map 17: "
                       "1 NaN\\).*read as 0 it would silently change the map"):
        strategies(maps, classes=classes, min_images=5, progress=False)


def test_spray_refuses_infinite_maps_in_memory_also_as_a_half_precision_tensor():
    maps, classes = spread_maps()
    maps[0, 1, 1] = np.inf
    maps[0, 2, 2] = -np.inf
    maps[9, 0, :2] = np.inf
    with pytest.raises(ValueError, match="2 of the 24 maps .* \\(map 0: 1 \\+inf, 1 −inf; map 9: 2 \\+inf\\)"):
        strategies(maps, classes=classes, min_images=5, progress=False)
    tensor = torch.from_numpy(spread_maps()[0]).half()
    tensor[5] += 7e4  # past float16's largest, 65504: every value of map 5 becomes +inf
    with pytest.raises(ValueError, match="1 of the 24 maps .* \\(map 5: 256 \\+inf\\)"):
        strategies(tensor, classes=torch.from_numpy(classes), min_images=5, progress=False)


def test_spray_leaves_out_a_folder_map_that_holds_nan_with_a_note(tmp_path):
    folder = tmp_path / "images"
    save_images(folder, 12, seed=13)
    out = tmp_path / "out"
    assert main(batch_command(folder, out, "--model", "demo")) == 0
    (first, *_) = read_index_contents(out / "index.csv").rows
    with np.load(out / first["map"]) as stored:  # the maps file of the first batch: the first image's map first
        members = dict(stored)
    members["maps"][0, 0, 0] = np.nan
    np.savez(out / first["map"], **members)
    result = strategies(out, min_images=3, progress=False)
    assert any(f"1 map(s) hold NaN or infinite values and were left out (SpRAy cannot place their relevance), e.g. "
               f"{first['map']} (image {first['id']}, k = 0)" in note for note in result.notes)
    assert first["id"] not in {member for entry in result.classes for cluster in entry.clusters
                               for member in cluster.members}
