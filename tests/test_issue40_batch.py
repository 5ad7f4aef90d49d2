"""Issue 40, dataset runs: a pipeline (worker processes decode and preprocess a folder's images, a thread
writes the results, one synced append to the index per batch) whose maps are stored compactly
(``stored_maps``: several images per file, at the method's resolution where that gives the maps back
exactly) and read back at the input's resolution bit for bit, with every kill -9, Ctrl-C and resume guarantee
kept."""

from __future__ import annotations

import csv
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from test_batch_robustness import kill_at_random_moments, run_in_fork

import explain
import explain.dataset_tools.batch as batch
import explain.dataset_tools.pipeline as pipeline
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import item_id, run
from explain.dataset_tools.html_report import report
from explain.dataset_tools.index import FIELDS, MapReader, read_index, read_maps
from explain.dataset_tools.run_folder import FolderInUseError
from explain.dataset_tools.stored_maps import AT_INPUT, LOW_RES, load_maps, stored_form
from explain.io.explanation import Explanation
from explain.methods.maps import normalize_maps, upsample_maps


def save_images(folder: Path, count: int, seed: int, size: int = 64, start: int = 0) -> list[Path]:
    """``count`` demo images (shapes on a background) as PNGs, resized to ``size`` px."""
    data = make_dataset(count, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, image in enumerate(data.images):
        path = folder / f"shape{start + index:03d}-{size}.png"
        Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR).save(path)
        paths.append(path)
    return paths


def gradcam(**options) -> explain.GradCAM:
    return explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES, **options)


def capture(explainer: explain.methods.Explainer) -> list[Explanation]:
    """The explanations ``explainer`` makes from now on, in order (its explain wrapped)."""
    made: list[Explanation] = []
    original = explainer.explain

    def explained(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    explainer.explain = explained
    return made


def maps_files(out: Path) -> list[Path]:
    return sorted((out / "maps").iterdir())


def stored_ids(out: Path) -> list[str]:
    """The ids that the maps files of ``out`` hold, with repeats."""
    return [item for path in maps_files(out) for item in load_maps(path).ids]


def assert_no_orphans(out: Path) -> None:
    """Every maps file is named by the index, holds only images of the index, each image once; no temporary file."""
    rows = read_index(out / "index.csv")
    assert sorted(stored_ids(out)) == sorted({row["id"] for row in rows})
    assert {path.name for path in maps_files(out)} == {Path(row["map"]).name for row in rows}
    assert not list(out.rglob("*.part"))


# ------------------------------------------------------------------ maps stored compactly, read back exactly


def test_maps_read_back_are_the_explanations_maps_bit_for_bit_in_a_quarter_of_the_bytes(tmp_path):
    """Grad-CAM's maps are stored at its layer's resolution (16 × 16 for 64-px input) and come back as the
    Explanation's map_grid and raw_map_grid, bit for bit; the maps files take less than a quarter of the bytes
    of the earlier version's float16 maps at 64 × 64 (K = 2 maps per image, 10 images, 4 per batch: 3 files)."""
    folder = tmp_path / "images"
    save_images(folder, 10, seed=1)
    out = tmp_path / "out"
    explainer = gradcam()
    made = capture(explainer)
    run(explainer, folder, out, topk=2, batch_size=4, progress=False, workers=0)
    expected = torch.cat([explanation.map_grid for explanation in made])  # (10, 2, 64, 64), in the index's order
    raw = torch.cat([explanation.raw_map_grid for explanation in made])
    read = list(read_maps(out))
    assert [image for image, _ in read] == list(dict.fromkeys(row["id"] for row in read_index(out / "index.csv")))
    assert torch.equal(torch.stack([maps for _, maps in read]), expected)
    assert torch.equal(torch.stack([maps for _, maps in read_maps(out, raw=True)]), raw)
    files = [load_maps(path) for path in maps_files(out)]
    assert [len(stored.ids) for stored in files] == [4, 4, 2]
    assert all(stored.form == LOW_RES and stored.maps.dtype == torch.float32 and stored.maps.shape[1:] == (16, 16)
               for stored in files)
    assert sum(path.stat().st_size for path in maps_files(out)) < 10 * 2 * 64 * 64 * 2 / 4
    row = read_index(out / "index.csv")[5]
    assert torch.equal(MapReader(out).read(row), MapReader(out).read(row["id"]))  # by row or by id


def test_the_same_through_a_dataloader_on_a_torchvision_resnet_with_minmax_maps_at_another_layer(tmp_path):
    """The rule on another model and input: resnet18 (random weights, 5 classes) at layer3, min-max
    normalisation, 96-px model-ready batches from a DataLoader: 6 × 6 maps stored, given back exactly."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=5).eval()
    images = torch.rand(7, 3, 96, 96)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=3)
    explainer = explain.GradCAM(model, "layer3", normalize="minmax")
    made = capture(explainer)
    out = tmp_path / "out"
    run(explainer, ([batch] for (batch,) in loader), out, progress=False)
    assert torch.equal(torch.stack([maps for _, maps in read_maps(out)]),
                       torch.cat([explanation.map_grid for explanation in made]))
    assert torch.equal(torch.stack([maps for _, maps in read_maps(out, raw=True)]),
                       torch.cat([explanation.raw_map_grid for explanation in made]))
    assert {(stored.form, stored.normalize, tuple(stored.maps.shape[1:])) for stored in map(load_maps, maps_files(out))
            } == {(LOW_RES, "minmax", (6, 6))}


def padded_vit() -> torch.nn.Module:
    """A tiny timm ViT (random weights) with 16-px patches that pads an input whose side is not a multiple of 16."""
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=4,
                             dynamic_img_size=True, dynamic_img_pad=True).eval()


@pytest.mark.parametrize("kind", ["saliency", "two layers", "vit patches past the input"])
def test_maps_that_low_res_maps_cannot_give_back_are_stored_at_the_input_resolution(kind, tmp_path):
    """A pixel-level method, a CAM combining two layers, and a ViT's token maps where the patches reach past the
    input (72 px, 5 × 16-px patches: placed on the 80 px they cover, cropped, not upsampled over the input):
    their maps are stored at the input's resolution, float16, and come back as the Explanation's maps rounded
    to float16; their values before normalisation were not kept."""
    folder = tmp_path / "images"
    save_images(folder, 5, seed=2, size=72 if kind.startswith("vit") else 64)
    if kind.startswith("vit"):
        explainer = explain.GradCAM(padded_vit(), "blocks.1")
    elif kind == "two layers":
        explainer = explain.GradCAM(load_demo_model(), ["layer3", "layer4"])
    else:
        explainer = explain.Saliency(load_demo_model())
    made = capture(explainer)
    out = tmp_path / "out"
    run(explainer, folder, out, batch_size=2, progress=False, workers=0)
    assert {load_maps(path).form for path in maps_files(out)} == {AT_INPUT}
    expected = torch.cat([explanation.map_grid for explanation in made])
    assert torch.equal(torch.stack([maps for _, maps in read_maps(out)]), expected.half().float())
    with pytest.raises(ValueError, match="stored at the input's resolution, normalised .* raw=False"):
        next(read_maps(out, raw=True))


def test_a_vits_token_maps_are_stored_at_its_grid_where_the_patches_span_the_input(tmp_path):
    """The same ViT on 64-px images (4 × 4 patches span them): its maps are upsampled over the whole input, so
    the 4 × 4 grid is stored and gives them back exactly."""
    folder = tmp_path / "images"
    save_images(folder, 5, seed=2)
    explainer = explain.GradCAM(padded_vit(), "blocks.1")
    made = capture(explainer)
    out = tmp_path / "out"
    run(explainer, folder, out, batch_size=2, progress=False, workers=0)
    assert {(load_maps(path).form, tuple(load_maps(path).maps.shape[1:])) for path in maps_files(out)} == {
        (LOW_RES, (4, 4))}
    assert torch.equal(torch.stack([maps for _, maps in read_maps(out)]),
                       torch.cat([explanation.map_grid for explanation in made]))


def test_stored_form_keeps_the_input_resolution_unless_the_low_res_maps_give_the_maps_exactly():
    """The check behind the choice: upsampling the layer's maps must give raw_map_grid, and normalising that
    with the explainer's normalisation map_grid, bit for bit; else the maps are kept at the input's resolution."""
    explainer = gradcam()
    explanation = explainer.explain(torch.rand(2, 3, 64, 64))
    form, low_res = stored_form(explanation, "max")
    assert form == LOW_RES and torch.equal(low_res, explanation.low_res_maps[0])
    assert stored_form(explanation, "sideways")[0] == AT_INPUT  # no normalisation explain knows
    positive = torch.rand(2, 1, 4, 4) + 1  # by hand: maps whose minimum is not 0, so min-max differs from max
    raw = upsample_maps(positive, (32, 32))
    by_hand = Explanation(**{**vars(explanation), "low_res_maps": [positive], "raw_map_grid": raw,
                             "map_grid": normalize_maps(raw, "max")})
    assert stored_form(by_hand, "max")[0] == LOW_RES
    assert stored_form(by_hand, "minmax")[0] == AT_INPUT  # not how its maps were normalised
    nudged = explanation.raw_map_grid.clone()
    nudged[1, 0, 5, 5] = torch.nextafter(nudged[1, 0, 5, 5], torch.tensor(2.0))  # one ulp off
    form, maps = stored_form(Explanation(**{**vars(explanation), "raw_map_grid": nudged}), "max")
    assert form == AT_INPUT and torch.equal(maps, explanation.map_grid.half())


def test_a_folder_of_the_earlier_layout_is_read_resumed_and_analysed(tmp_path):
    """A folder written by the earlier version (one (K, H, W) float16 .npy per image) is read back as it was,
    and a resumed run adds maps files beside it: read_maps, SpRAy and the report read both."""
    folder = tmp_path / "images"
    save_images(folder, 12, seed=3)
    out = tmp_path / "out"
    run(gradcam(), folder, out, batch_size=4, progress=False, workers=0)
    earlier = {image: maps for image, maps in read_maps(out)}
    rows = read_index(out / "index.csv")[:8]  # as the earlier version wrote the first 8 images
    for image in dict.fromkeys(row["id"] for row in rows):
        np.save(out / "maps" / f"{image}.npy", earlier[image].numpy().astype(np.float16))
    with open(out / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows({**row, "map": f"maps/{row['id']}.npy"} for row in rows)
    for path in (out / "maps").glob("*.npz"):
        path.unlink()
    summary = run(gradcam(), folder, out, batch_size=4, progress=False, workers=0)
    assert (summary.explained, summary.already_done) == (4, 8)
    again = dict(read_maps(out))
    assert sorted(again) == sorted(earlier)
    for row in rows:
        assert torch.equal(again[row["id"]], earlier[row["id"]].half().float())
    with pytest.raises(ValueError, match="earlier version of explain: it holds normalised float16 maps"):
        MapReader(out).read(rows[0]["id"], raw=True)
    found = explain.strategies(out, min_images=3, progress=False)
    assert sum(entry.images for entry in found.classes) + sum(skipped.images for skipped in found.skipped) == 12
    assert not any("could not be read" in note for note in found.notes)
    made = report(out)
    assert made.thumbnails_made == 12 and not any("no readable" in note for note in made.notes)


def test_the_report_draws_compact_maps_as_it_drew_the_earlier_files(tmp_path):
    """The report's thumbnails (no overlays: drawn from the maps) of a compact folder and of the same maps
    in the earlier layout differ by float16 rounding at most: a value may take the next colour of the map, which
    JPEG spreads over its block."""
    folder = tmp_path / "images"
    save_images(folder, 6, seed=4)
    compact = tmp_path / "compact"
    run(gradcam(), folder, compact, topk=2, batch_size=4, progress=False, workers=0)
    files = tmp_path / "files"
    shutil.copytree(compact, files)
    rows = read_index(files / "index.csv")
    for image, maps in read_maps(compact):
        np.save(files / "maps" / f"{image}.npy", maps.numpy().astype(np.float16))
    with open(files / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows({**row, "map": f"maps/{row['id']}.npy"} for row in rows)
    report(compact)
    report(files)
    thumbnails = sorted(path.relative_to(compact) for path in compact.rglob("*.jpg"))
    assert len(thumbnails) == 12 and thumbnails == sorted(path.relative_to(files) for path in files.rglob("*.jpg"))
    for path in thumbnails:
        one, other = (np.asarray(Image.open(root / path)).astype(int) for root in (compact, files))
        # a colour step, JPEG-spread: float16 moves 1-2 % of the values into the next of matplotlib's 256 equal
        # colour bins (whose edges k/256 float16 holds exactly), mean difference 0.64 on these thumbnails
        assert np.abs(one - other).mean() < 1.0 and np.abs(one - other).max() <= 24


def test_a_damaged_maps_file_is_a_clear_error_and_its_images_are_left_out_with_a_note(tmp_path):
    """A maps file cut short (a disk that failed) or replaced: reading it says which file and why; SpRAy and the
    report leave its images out with a note, and read the others."""
    folder = tmp_path / "images"
    save_images(folder, 9, seed=19)
    out = tmp_path / "out"
    run(gradcam(), folder, out, batch_size=3, progress=False, workers=0)
    first = maps_files(out)[0]
    first.write_bytes(first.read_bytes()[:300])
    row = read_index(out / "index.csv")[0]
    with pytest.raises(ValueError, match=f"{first.name} is not a maps file of explain \\(BadZipFile"):
        MapReader(out).read(row)
    found = explain.strategies(out, min_images=3, progress=False)
    assert any("1 map file(s) could not be read, so 3 map(s) were left out" in note for note in found.notes)
    assert sum(entry.images for entry in found.classes) + sum(skipped.images for skipped in found.skipped) == 6
    with pytest.warns(UserWarning, match="3 image\\(s\\) have no readable overlay or map file"):
        made = report(out)
    assert any("3 image(s) have no readable overlay or map file" in note for note in made.notes)
    assert made.thumbnails_made == 6


# ------------------------------------------------------------------ the pipeline


def two_sizes_and_a_bad_file(folder: Path) -> list[Path]:
    paths = save_images(folder, 5, seed=5) + save_images(folder, 3, seed=6, size=96, start=5)
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    return paths


def test_worker_processes_write_what_decoding_in_process_writes(tmp_path):
    """Images of two sizes and a corrupt file, overlays on: the index, the skipped list, the maps and the
    overlays of a run with 2 worker processes are those of a run that decodes in its own process."""
    folder = tmp_path / "images"
    two_sizes_and_a_bad_file(folder)
    outs = {workers: tmp_path / f"out{workers}" for workers in (0, 2)}
    for workers, out in outs.items():
        summary = run(gradcam(), folder, out, batch_size=3, overlays=True, progress=False, workers=workers)
        assert (summary.explained, list(summary.skipped)) == (8, [str(folder / "broken.png")])
    for name in ("index.csv", "skipped.csv"):
        assert (outs[0] / name).read_bytes() == (outs[2] / name).read_bytes()
    stored = [[load_maps(path) for path in maps_files(out)] for out in outs.values()]
    assert [(one.ids, one.targets, one.form, one.size) for one in stored[0]] == [
        (one.ids, one.targets, one.form, one.size) for one in stored[1]]
    assert all(torch.equal(one.maps, other.maps) for one, other in zip(*stored))
    assert {one.size for one in stored[0]} == {(64, 64), (96, 96)}  # a batch's two sizes, one file each
    overlays = sorted(path.name for path in (outs[0] / "overlays").iterdir())
    assert len(overlays) == 8 and overlays == sorted(path.name for path in (outs[2] / "overlays").iterdir())
    for name in overlays:
        assert (outs[0] / "overlays" / name).read_bytes() == (outs[2] / "overlays" / name).read_bytes()


def test_each_batch_is_one_synced_append_and_on_batch_sees_it_in_the_index(tmp_path, monkeypatch):
    """12 images in batches of 4: three fsyncs of the index, and when on_batch(done) is called (by the writer),
    the index holds exactly ``done`` complete images."""
    folder = tmp_path / "images"
    save_images(folder, 12, seed=7)
    out = tmp_path / "out"
    syncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(batch.os, "fsync", lambda descriptor: (syncs.append(descriptor), real_fsync(descriptor))[1])
    seen = []
    run(gradcam(), folder, out, batch_size=4, progress=False, workers=1,
        on_batch=lambda done: seen.append((done, len(read_index(out / "index.csv")))))
    assert len(syncs) == 3
    assert seen == [(4, 4), (8, 8), (12, 12)]


def test_an_interrupt_while_explaining_keeps_every_batch_explained_before_it(tmp_path, monkeypatch):
    """Ctrl-C while the 4th batch is explained, the writer still on the 1st (its rows wait until then) and the
    2nd and 3rd waiting for it: the three batches explained before are written whole, nothing else; the resume
    explains the rest, each once."""
    folder = tmp_path / "images"
    paths = save_images(folder, 12, seed=8)
    out = tmp_path / "out"
    real_append, interrupting = batch.append_rows, threading.Event()
    monkeypatch.setattr(batch, "append_rows", lambda *args: (interrupting.wait(60), real_append(*args))[1])
    explainer = gradcam()
    original, calls = explainer.explain, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            interrupting.set()
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    explainer.explain = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(explainer, folder, out, batch_size=2, progress=False, workers=1)
    assert len(read_index(out / "index.csv")) == 6
    assert_no_orphans(out)
    monkeypatch.undo()
    summary = run(gradcam(), folder, out, batch_size=2, progress=False, workers=1)
    assert (summary.explained, summary.already_done) == (6, 6)
    assert sorted(row["id"] for row in read_index(out / "index.csv")) == sorted(item_id(path, folder)
                                                                                for path in paths)
    assert_no_orphans(out)


def test_a_resumed_run_removes_its_own_unlisted_maps_files_and_temporary_files_only(tmp_path):
    """What a kill -9 leaves (a maps file whose rows never reached the index, a temporary file) is removed
    when the run resumes; another rank's files and files that are not maps files are left; numbering goes on
    after the highest listed file."""
    folder = tmp_path / "images"
    save_images(folder, 6, seed=9)
    out = tmp_path / "out"
    run(gradcam(), folder, out, batch_size=2, progress=False, workers=0)
    maps = out / "maps"
    assert [path.name for path in maps_files(out)] == ["batch-000001.npz", "batch-000002.npz", "batch-000003.npz"]
    shutil.copy(maps / "batch-000002.npz", maps / "batch-000009.npz")
    (maps / ".batch-000010.npz.part").write_bytes(b"PK")
    (maps / "rank1-batch-000001.npz").write_bytes(b"another rank's")
    (maps / "notes.txt").write_text("mine")
    save_images(folder, 2, seed=10, start=6)
    assert run(gradcam(), folder, out, batch_size=2, progress=False, workers=0).explained == 2
    assert [path.name for path in maps_files(out)] == ["batch-000001.npz", "batch-000002.npz", "batch-000003.npz",
                                                       "batch-000004.npz", "notes.txt", "rank1-batch-000001.npz"]
    assert len(read_index(out / "index.csv")) == 8


class RefusesLargeImages:
    """A preprocess (module level: worker processes can take it) that refuses images wider than 64 px."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if image.width > 64:
            raise ValueError(f"{image.width} px is too wide")
        return explain.Normalize()(image)


class GivesAnArray:
    """A broken preprocess: it returns an ndarray, not a tensor."""

    def __call__(self, image: Image.Image) -> np.ndarray:
        return np.asarray(image)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_image_the_preprocessing_refuses_is_skipped_and_a_broken_preprocessing_stops_the_run(workers, tmp_path):
    folder = tmp_path / "images"
    two_sizes_and_a_bad_file(folder)
    out = tmp_path / "out"
    explainer = explain.GradCAM(load_demo_model(), "layer4", preprocess=RefusesLargeImages())
    summary = run(explainer, folder, out, batch_size=4, progress=False, workers=workers)
    assert summary.explained == 5
    reasons = {Path(name).name: reason for name, reason in summary.skipped.items()}
    assert sorted(reasons) == ["broken.png", "shape005-96.png", "shape006-96.png", "shape007-96.png"]
    assert reasons["shape005-96.png"] == "preparing it for the model failed: ValueError: 96 px is too wide"
    with open(out / "skipped.csv", newline="") as file:
        assert len(list(csv.DictReader(file))) == 4
    broken = explain.GradCAM(load_demo_model(), "layer4", preprocess=GivesAnArray())
    with pytest.raises(TypeError, match="preprocess must return a tensor"):
        run(broken, folder, tmp_path / "broken", progress=False, workers=workers)


def test_a_preprocess_that_cannot_be_pickled_is_run_in_process_with_a_warning(tmp_path, monkeypatch):
    """Where worker processes start by spawn or forkserver (Python 3.14 on Linux), a lambda cannot reach
    them: the run decodes in its own process and says so, at the caller's line."""
    folder = tmp_path / "images"
    save_images(folder, 4, seed=11)
    monkeypatch.setattr(pipeline, "_sends_by_fork", lambda: False)
    normalize = explain.Normalize()
    explainer = explain.GradCAM(load_demo_model(), "layer4", preprocess=lambda image: normalize(image))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(explainer, folder, tmp_path / "out", progress=False, workers=2)
    (warning,) = [item for item in caught if "cannot be sent to worker processes" in str(item.message)]
    assert warning.filename == __file__ and "workers=0 to silence" in str(warning.message)
    assert summary.explained == 4 and summary.notes == [str(warning.message)]
    run(explain.GradCAM(load_demo_model(), "layer4"), folder, tmp_path / "reference", progress=False, workers=0)
    assert torch.equal(torch.stack([maps for _, maps in read_maps(tmp_path / "out")]),
                       torch.stack([maps for _, maps in read_maps(tmp_path / "reference")]))


def test_workers_is_checked_and_the_command_takes_it(tmp_path, capsys):
    folder = tmp_path / "images"
    paths = save_images(folder, 5, seed=12)
    out = tmp_path / "out"
    for wrong in (-1, 1.5, True):
        with pytest.raises(ValueError, match="workers must be a whole number of at least 0"):
            run(gradcam(), folder, out, workers=wrong, progress=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(4, 3, 64, 64)), batch_size=2)
    with pytest.raises(ValueError, match="a DataLoader loads with its own num_workers"):
        run(gradcam(), loader, out, workers=1, progress=False)
    with pytest.raises(SystemExit) as exited:
        main(["batch", str(folder), "--model", "demo", "--out", str(out), "--workers", "-1"])
    assert exited.value.code == 2
    assert "explain: error: argument --workers: must be at least 0; got -1" in capsys.readouterr().err
    assert main(["batch", str(folder), "--model", "demo", "--out", str(out), "--workers", "2", "--no-progress"]) == 0
    assert sorted(row["id"] for row in read_index(out / "index.csv")) == sorted(item_id(path, folder)
                                                                                for path in paths)


def test_evaluate_reads_a_folder_in_worker_processes_as_in_its_own(tmp_path):
    """``explain evaluate --data FOLDER``'s batches (images of two sizes, class folders) are the same read by
    2 worker processes as in the main process; a corrupt image stops both with the same error."""
    from explain import cli

    data = tmp_path / "data"
    for name, seed in (("disc", 17), ("square", 18)):
        save_images(data / name, 3, seed=seed)
        save_images(data / name, 2, seed=seed + 10, size=48, start=3)
    loaded = explain.load_model("demo")
    in_process = list(cli._folder_batches(data, loaded, 2, workers=0))
    in_workers = list(cli._folder_batches(data, loaded, 2, workers=2))
    assert len(in_process) == len(in_workers) == 5  # 6 images of 64 px and 4 of 48 px, in pairs
    for (inputs, labels), (other_inputs, other_labels) in zip(in_process, in_workers):
        assert torch.equal(inputs, other_inputs) and torch.equal(labels, other_labels)
    (data / "disc" / "broken.png").write_bytes(b"not a picture")
    errors = []
    for workers in (0, 2):
        with pytest.raises(ValueError, match="could not be read as an image") as raised:
            list(cli._folder_batches(data, loaded, 2, workers=workers))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


# ------------------------------------------------------------------ kill -9 with workers and the writer


def test_kill_9_at_random_moments_with_worker_processes_leaves_each_image_once_and_no_stray_maps(tmp_path):
    """`explain batch --workers 2` (K = 2, overlays, batches of 3) is SIGKILLed at random moments at least 30
    times and resumed each time: then each image is in the index once, each in one maps file the index names,
    no temporary file is left, and the maps are those of an uninterrupted run."""
    folder = tmp_path / "images"
    paths = save_images(folder, 24, seed=13)
    options = ["--topk", "2", "--workers", "2"]
    reference = tmp_path / "reference"
    full_run = run_in_fork(folder, reference, options)
    out = tmp_path / "out"
    assert kill_at_random_moments(folder, out, options, full_run, kills=30, seed=2) >= 30
    rows = read_index(out / "index.csv")
    assert sorted(row["id"] for row in rows) == sorted(item_id(path, folder) for path in paths for _ in range(2))
    assert_no_orphans(out)
    expected = dict(read_maps(reference))
    for image, maps in read_maps(out):
        torch.testing.assert_close(maps, expected[image], atol=2e-3, rtol=0)
    assert len(list((out / "overlays").glob("*.png"))) == 24


def dataloader_run_in_child(folder: str, out: str) -> None:
    """A forked ``explain.run`` over an ImageFolder read by a DataLoader with 2 worker processes, each batch
    taking at least 1 s to write, quietly."""
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    real_append = batch.append_rows
    batch.append_rows = lambda *args: (time.sleep(1.0), real_append(*args))[1]
    dataset = torchvision.datasets.ImageFolder(folder, transform=explain.Normalize())
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2)
    run(gradcam(), loader, out, progress=False)


def worker_processes(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(child) for child in text]
    return children


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
@pytest.mark.parametrize("source", ["folder", "dataloader"])
def test_a_kill_9_of_a_run_whose_worker_processes_live_on_leaves_the_folder_unlocked(source, tmp_path):
    """The run is SIGKILLed while its DataLoader workers run; they notice only seconds later. They must not
    hold the folder's lock (a flock belongs to every process that inherited its descriptor): a run started
    at once resumes, and the images end up each once."""
    folder = tmp_path / "images"
    for name in ("a", "b"):
        save_images(folder / name, 5, seed=14 if name == "a" else 15)
    out = tmp_path / "out"
    context = multiprocessing.get_context("fork")
    if source == "folder":
        child = context.Process(target=run_in_child_slowly, args=(str(folder), str(out)))
    else:
        child = context.Process(target=dataloader_run_in_child, args=(str(folder), str(out)))
    child.start()
    deadline = time.monotonic() + 120
    while not ((out / "index.csv").exists() and len(read_index(out / "index.csv")) >= 2):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    workers = worker_processes(child.pid)
    assert workers, "the run has worker processes"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert any(Path(f"/proc/{pid}").exists() for pid in workers)  # still there: they notice within seconds
    if source == "folder":
        summary = run(gradcam(), folder, out, progress=False, workers=0)
    else:
        dataset = torchvision.datasets.ImageFolder(folder, transform=explain.Normalize())
        summary = run(gradcam(), torch.utils.data.DataLoader(dataset, batch_size=2), out, progress=False)
    assert summary.already_done >= 2 and summary.explained + summary.already_done == 10
    rows = read_index(out / "index.csv")
    assert len({row["id"] for row in rows}) == 10 and len(rows) == 10 + sum(row["role"] == "label" for row in rows)
    assert_no_orphans(out)


def run_in_child_slowly(folder: str, out: str) -> None:
    """A forked ``explain batch --workers 2`` whose every batch takes at least 1 s to write, quietly."""
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    real_append = batch.append_rows
    batch.append_rows = lambda *args: (time.sleep(1.0), real_append(*args))[1]
    main(["batch", folder, "--model", "demo", "--out", out, "--batch-size", "2", "--workers", "2", "--no-progress"])


def test_a_second_run_while_the_first_runs_with_workers_is_refused(tmp_path):
    """The lock is still held by the run itself while its workers live (closing the workers' copies does
    not unlock it)."""
    folder = tmp_path / "images"
    save_images(folder, 8, seed=16)
    out = tmp_path / "out"
    child = multiprocessing.get_context("fork").Process(target=run_in_child_slowly, args=(str(folder), str(out)))
    child.start()
    deadline = time.monotonic() + 120
    while not ((out / "index.csv").exists() and len(read_index(out / "index.csv")) >= 2):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    try:
        with pytest.raises(FolderInUseError, match=f"pid {child.pid} on "):
            run(gradcam(), folder, out, progress=False, workers=0)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()


# ------------------------------------------------------------------ on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_with_workers_and_pinned_memory_writes_the_maps_of_a_cpu_run(tmp_path):
    folder = tmp_path / "images"
    two_sizes_and_a_bad_file(folder)
    on_gpu = explain.GradCAM(load_demo_model().cuda(), "layer4", class_names=CLASS_NAMES)
    made = capture(on_gpu)
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    assert run(on_gpu, folder, gpu, topk=2, batch_size=3, progress=False, workers=2).explained == 8
    run(gradcam(), folder, cpu, topk=2, batch_size=3, progress=False, workers=0)
    assert {load_maps(path).form for path in maps_files(gpu)} == {LOW_RES}
    assert_no_orphans(gpu)
    expected = dict(read_maps(cpu))
    for image, maps in read_maps(gpu):
        torch.testing.assert_close(maps, expected[image], atol=1e-4, rtol=0)
    stored = torch.cat([maps for _, maps in read_maps(gpu, raw=True)])
    torch.testing.assert_close(stored, torch.cat([e.raw_map_grid.cpu() for e in made]).flatten(0, 1), atol=1e-5,
                               rtol=1e-5)  # upsampled on the CPU: equal to the GPU's up to float32 rounding

