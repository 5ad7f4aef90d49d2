"""Issue 28 attacked as a hostile user would: one test per bug found, each saying what the user
should get. Labels (symbolic-link class folders, an ImageFolder numbered otherwise than the model,
class names given as strings, signed labels, macOS file names, newlines in class names, label
files edited between runs, labels out of range, the skipped files of torchrun shards), the report
(skipped files, classes that SpRAy did not analyse, a stale strategies.json) and the debugging
demo (another --count)."""

from __future__ import annotations

import csv
import json
import os
import re
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from test_batch_labels import by_hand, class_folders, gradcam, rows_by_id
from test_report import browser_page, wait_for_render, write_run, write_strategies  # noqa: F401

import explain
from explain.data import CLASS_NAMES, make_dataset
from explain.data.debugging import describe, run_debugging_demo
from explain.dataset_tools.batch import item_id, merge_shard_indexes, run
from explain.dataset_tools.html_report import report
from explain.dataset_tools.index import read_index
from explain.dataset_tools.labels import LabelError
from explain.dataset_tools.run_folder import Shard

# ---------------------------------------------------------------- labels


def test_class_folders_that_are_symbolic_links_are_explained_as_image_folder_reads_them(tmp_path):
    real = tmp_path / "real"
    labels = class_folders(real, 8, seed=21)
    folder = tmp_path / "linked"
    folder.mkdir()
    for name in CLASS_NAMES:
        (folder / name).symlink_to(real / name, target_is_directory=True)
    summary = run(gradcam(), folder, tmp_path / "out", labels="folders", progress=False)
    torchvision_files = [Path(path) for path, _ in torchvision.datasets.ImageFolder(str(folder)).samples]
    assert summary.explained == 8 == len(torchvision_files)
    groups = rows_by_id(tmp_path / "out" / "index.csv")
    assert sorted(groups) == sorted(item_id(path, folder) for path in torchvision_files)
    for path, label in labels.items():
        assert groups[item_id(folder / path.relative_to(real), folder)][0]["label"] == str(label)
    (folder / "disc" / "again").symlink_to(folder, target_is_directory=True)  # a loop: each folder is walked once
    again = run(gradcam(), folder, tmp_path / "out", labels="folders", progress=False)
    assert (again.explained, again.already_done) == (0, 8)


def test_an_image_folder_loader_numbered_otherwise_than_the_model_gets_the_labels_of_its_folders(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 12, seed=22)  # folders named as the model's classes, all four
    dataset = torchvision.datasets.ImageFolder(str(folder), transform=explain.Normalize())
    assert dataset.classes == sorted(CLASS_NAMES) != list(CLASS_NAMES)  # ImageFolder numbers them otherwise
    summary = run(gradcam(), torch.utils.data.DataLoader(dataset, batch_size=3), tmp_path / "loader", progress=False)
    assert "renumbered" in summary.labels and "cross 0→3" in summary.labels
    groups = rows_by_id(tmp_path / "loader" / "index.csv")
    by_folder = rows_by_id(run(gradcam(), folder, tmp_path / "folder", labels="folders", progress=False).index)
    for path, label in labels.items():
        first = groups[item_id(path, folder)][0]
        predicted, _ = by_hand(path)
        assert (first["label"], first["label_name"]) == (str(label), CLASS_NAMES[label])
        assert first["correct"] == str(int(label == predicted))
        assert [row["label"] for row in by_folder[item_id(path, folder)]][0] == first["label"]
    # a target_transform may have renumbered them already: the labels are then taken as they come
    relabelled = torchvision.datasets.ImageFolder(str(folder), transform=explain.Normalize(),
                                                  target_transform=lambda label: label)
    run(gradcam(), torch.utils.data.DataLoader(relabelled, batch_size=3), tmp_path / "relabelled", progress=False)
    for path in labels:
        row = rows_by_id(tmp_path / "relabelled" / "index.csv")[item_id(path, folder)][0]
        assert row["label"] == str(sorted(CLASS_NAMES).index(path.parent.name))


def test_a_batch_of_class_name_strings_is_refused_not_taken_for_file_names(tmp_path):
    images = torch.stack([explain.Normalize()(image) for image in make_dataset(4, seed=23).images])
    names = ["disc", "disc", "square", "st. bernard"]  # two alike: as file names, one image would be lost
    with pytest.raises(LabelError, match=r"not file names.*'disc', 'disc', 'square', 'st. bernard'.*class indices"):
        run(gradcam(), [(images, names)], tmp_path / "names", progress=False)
    rows = read_index(run(gradcam(), [(images, torch.arange(4), ["a/x", "b.png", "c.jpeg", "d/e.tif"])],
                          tmp_path / "files", progress=False).index)
    assert [row["image"] for row in rows if row["k"] == "0"] == ["a/x", "b.png", "c.jpeg", "d/e.tif"]


def test_signed_labels_in_a_csv_file_are_indices(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 4, seed=24)
    first = sorted(labels)[0]
    table = tmp_path / "labels.csv"
    for label, message in [("-1", "label -1 is negative"), ("-0003", "label -3 is negative"),
                           ("7", "label 7 is out of range: the model has 4 classes")]:
        table.write_text(f"path,label\n{first.relative_to(folder)},{label}\n")
        with pytest.raises(LabelError, match=f"line 2: {message}"):
            run(gradcam(), folder, tmp_path / "out", labels=str(table), progress=False)
    table.write_text(f"path,label\n{first.relative_to(folder)},+2\n")
    rows = rows_by_id(run(gradcam(), folder, tmp_path / "plus", labels=str(table), progress=False).index)
    assert rows[item_id(first, folder)][0]["label"] == "2"
    with pytest.raises(LabelError, match="label -1 is negative"):
        run(gradcam(), folder, tmp_path / "mapping", labels={first.relative_to(folder): -1}, progress=False)


def test_class_folders_named_on_a_mac_match_the_class_names(tmp_path):
    names = ["café", "naïve", "über", "ñandú"]
    decomposed = [unicodedata.normalize("NFD", name) for name in names]  # as macOS writes file names
    assert decomposed != names
    folder = tmp_path / "images"
    labels = class_folders(folder, 8, seed=25, names=decomposed)
    summary = run(gradcam(class_names=names), folder, tmp_path / "out", labels="folders", progress=False)
    assert "matched by name" in summary.labels
    groups = rows_by_id(summary.index)
    for path, label in labels.items():
        assert groups[item_id(path, folder)][0]["label_name"] == names[label]
    table = tmp_path / "labels.csv"
    table.write_text("path,label\n" + "".join(f"{path.relative_to(folder)},{decomposed[label]}\n"
                                              for path, label in labels.items()), encoding="utf-8")
    by_file = rows_by_id(run(gradcam(class_names=names), folder, tmp_path / "csv", labels=str(table),
                             progress=False).index)
    assert all(by_file[item_id(path, folder)][0]["label"] == str(label) for path, label in labels.items())


def test_a_class_name_with_a_newline_keeps_each_row_on_one_line_and_the_run_resumes(tmp_path):
    folder = tmp_path / "images"
    names = ["a", "new\nline", "tab\there", "d"]  # the folders name the classes (the model has no names)
    labels = class_folders(folder, 8, seed=26, names=names)
    first = run(gradcam(class_names=None), folder, tmp_path / "out", labels="folders", overlays=True, progress=False)
    assert first.explained == 8
    rows = read_index(first.index)
    assert len((tmp_path / "out" / "index.csv").read_bytes().splitlines()) == len(rows) + 1
    shown = {"a": "a", "new\nline": "new\\x0aline", "tab\there": "tab\\x09here", "d": "d"}
    for path, label in labels.items():
        row = rows_by_id(first.index)[item_id(path, folder)][0]
        assert row["label_name"] == shown[names[label]]
    assert len(list((tmp_path / "out" / "overlays").glob("*.png"))) == 8
    again = run(gradcam(class_names=None), folder, tmp_path / "out", labels="folders", overlays=True, progress=False)
    assert (again.explained, again.already_done) == (0, 8)
    assert read_index(again.index) == rows


def test_resuming_after_the_label_file_changed_is_refused(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 6, seed=27)
    files = sorted(labels)
    table = tmp_path / "labels.csv"
    table.write_text("path,label\n" + "".join(f"{path.relative_to(folder)},{labels[path]}\n" for path in files))
    run(gradcam(), folder, tmp_path / "out", labels=str(table), progress=False)
    assert run(gradcam(), folder, tmp_path / "out", labels=str(table), progress=False).already_done == 6
    relabelled = (labels[files[0]] + 1) % 4
    table.write_text("path,label\n" + f"{files[0].relative_to(folder)},{relabelled}\n"
                     + "".join(f"{path.relative_to(folder)},{labels[path]}\n" for path in files[2:]))
    before = (tmp_path / "out" / "index.csv").read_bytes()
    with pytest.raises(LabelError, match=rf"2 image\(s\) already explained have another label now: .*"
                                         rf"\({labels[files[0]]} in the index, {relabelled} now\).*"
                                         rf"\({labels[files[1]]} in the index, no label now\)"):
        run(gradcam(), folder, tmp_path / "out", labels=str(table), progress=False)
    assert (tmp_path / "out" / "index.csv").read_bytes() == before


def test_a_label_out_of_range_stops_the_run_before_any_image_is_written(tmp_path):
    folder = tmp_path / "images"
    class_folders(folder, 8, seed=28, names=("a", "b", "c", "d"))
    class_folders(folder, 1, seed=29, names=("e",) * 4)  # a fifth folder: label 4 of a 4-class model, sorted last
    with pytest.raises(LabelError, match=r"e/img00.png is 4, out of range: the model has 4 classes"):
        run(gradcam(class_names=None), folder, tmp_path / "out", labels="folders", batch_size=2, progress=False)
    assert read_index(tmp_path / "out" / "index.csv") == []
    assert list((tmp_path / "out" / "maps").iterdir()) == []


def test_torchrun_shards_keep_every_rank_s_skipped_files(tmp_path):
    folder = tmp_path / "images"
    class_folders(folder, 8, seed=31)
    broken = [folder / name / "zz broken.png" for name in CLASS_NAMES]  # two in each rank's share
    for path in broken:
        path.write_bytes(b"not a png")
    for rank in (0, 1):
        summary = run(gradcam(), folder, tmp_path / "out", labels="folders", progress=False, shard=Shard(rank, 2))
        assert summary.explained == 4 and len(summary.skipped) == 2
    merge_shard_indexes(tmp_path / "out")
    with open(tmp_path / "out" / "skipped.csv", newline="", encoding="utf-8") as file:
        skipped = {row["image"]: row["reason"] for row in csv.DictReader(file)}
    assert sorted(skipped) == sorted(str(path) for path in broken)
    assert all("could not be read as an image" in reason for reason in skipped.values())
    assert sorted(path.name for path in (tmp_path / "out").glob("*.csv")) == ["index.csv", "skipped.csv"]


# ---------------------------------------------------------------- the report


def test_the_report_lists_the_files_explain_batch_skipped(tmp_path):
    folder = tmp_path / "images"
    class_folders(folder, 2, seed=30)
    (folder / "disc" / "broken <b>.png").write_bytes(b"not a png")
    run(gradcam(), folder, tmp_path / "out", labels="folders", progress=False)
    with pytest.warns(UserWarning, match="could not be explained"):
        result = report(tmp_path / "out")
    assert result.images == 2
    (note,) = result.notes
    assert note.startswith("1 file(s) could not be explained and are not shown (each with the reason in "
                           "skipped.csv):") and "broken <b>.png" in note and "could not be read as an image" in note
    page = result.page.read_text(encoding="utf-8")
    assert "broken &lt;b&gt;.png" in page and "broken <b>" not in page


def small_run_with_strategies(out: Path) -> list:
    """A 12-image run whose strategies skip every class (fewer than 20 maps each)."""
    truths = write_run(out, 12)
    found = explain.strategies(out, progress=False)
    assert found.classes == [] and len(found.skipped) == len({t.predicted for t in truths})
    return truths


def test_the_report_says_which_classes_strategies_did_not_analyse(browser_page, tmp_path):  # noqa: F811
    page, blocked, errors = browser_page
    out = tmp_path / "out"
    truths = small_run_with_strategies(out)
    html = report(out).page.read_text(encoding="utf-8")
    skipped = re.search(r'<p class="hint" id="strategies-skipped">(.*?)</p>', html, re.S).group(1)
    counts = {c: sum(t.predicted == c for t in truths) for c in {t.predicted for t in truths}}
    assert skipped.startswith(f"{len(counts)} class(es) not analysed")
    for class_index, count in counts.items():
        assert f"({class_index}): {count} map(s); SpRAy needs at least 20" in skipped
    assert "&lt;script&gt;" in skipped or 2 not in counts  # the hostile class name, escaped
    page.goto((out / "report.html").resolve().as_uri())
    wait_for_render(page, 0)
    assert page.inner_text("#strategies-list") == "No class was analysed: none had enough maps."
    assert page.evaluate("window.__pwned") is None and blocked == [] and errors == []


def test_the_report_notes_a_strategies_file_older_than_the_index(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 10)
    write_strategies(out, truths)
    assert not any("older than index.csv" in note for note in report(out).notes)
    later = time.time() + 10
    os.utime(out / "index.csv", (later, later))  # more images explained after the strategies were found
    with pytest.warns(UserWarning):
        notes = report(out).notes
    assert [note for note in notes if "older" in note] == [
        "strategies.json is older than index.csv: images explained since then are not in the strategies. Run "
        "`explain strategies OUT` again, then this report."]


# ---------------------------------------------------------------- the debugging demo


def test_the_debugging_demo_keeps_its_count_and_says_when_no_class_was_analysed(tmp_path):
    out = tmp_path / "demo"
    demo = run_debugging_demo(out, count=8, progress=False)
    text = describe(demo)
    assert demo.strategies.classes == [] and "no class analysed: too few images of each" in text
    assert text.count("not analysed: class") == len(demo.strategies.skipped) > 0
    assert json.loads((out / "demo.json").read_text()) == {"count": 8}
    with pytest.raises(ValueError, match="holds the debugging demo of 8 images.*another --out for 9 images"):
        run_debugging_demo(out, count=9, progress=False)
    assert len(list((out / "images").rglob("*.png"))) == 8  # not mixed with the images of 9
    assert run_debugging_demo(out, count=8, progress=False).summary.already_done == 8
    foreign = tmp_path / "mine"
    (foreign / "images").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(foreign / "images" / "holiday.png")
    with pytest.raises(ValueError, match="not empty and is not a folder of the debugging demo"):
        run_debugging_demo(foreign, count=8, progress=False)
    assert not (foreign / "run").exists()
