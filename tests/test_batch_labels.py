"""Issue 28, part A: dataset runs with the images' true labels. Each label source (class folders,
a CSV file, a mapping, a DataLoader's batches) writes the label columns; a misclassified image gets
the maps of its label and of its prediction, each equal to explaining that class directly; the
predictions are checked against the model run by hand; bad label files are clear errors; a run
killed with -9 and resumed writes the same index as one left alone."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from test_batch_robustness import kill_at_random_moments, run_in_fork

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import item_id, panel_captions, run
from explain.dataset_tools.index import EARLIER_FIELDS, FIELDS, MapReader, read_index
from explain.dataset_tools.labels import LabelError
from explain.dataset_tools.run_folder import Shard
from explain.io import render

MODEL = load_demo_model()


def gradcam(class_names=CLASS_NAMES) -> explain.GradCAM:
    return explain.GradCAM(MODEL, "layer4", class_names=class_names)


def by_hand(path: Path) -> tuple[int, float]:
    """The demo model's top-1 class of an image file and its softmax probability, computed here."""
    with torch.no_grad():
        logits = MODEL(explain.Normalize()(Image.open(path).convert("RGB"))[None])[0]
    probabilities = logits.softmax(0)
    return int(probabilities.argmax()), float(probabilities.max())


def class_folders(root: Path, count: int, seed: int, wrong_every: int = 4, names=CLASS_NAMES) -> dict[Path, int]:
    """Images in DIR/<class name>/: every ``wrong_every``-th one in the folder of the next class (a
    wrong label). Returns each image's folder class index."""
    data = make_dataset(count, seed=seed)
    labels = {}
    for index, (image, shape) in enumerate(zip(data.images, data.labels)):
        label = int(shape) if index % wrong_every else (int(shape) + 1) % len(CLASS_NAMES)
        path = root / names[label] / f"img{index:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        labels[path] = label
    return labels


def rows_by_id(index: Path) -> dict[str, list[dict[str, str]]]:
    grouped: dict[str, list[dict[str, str]]] = {}
    for row in read_index(index):
        grouped.setdefault(row["id"], []).append(row)
    return grouped


def check_labelled_rows(out: Path, folder: Path, labels: dict[Path, int | None], class_names=CLASS_NAMES) -> int:
    """Every image's rows against the model run by hand: the label columns, the prediction, and
    for a misclassified image two rows (label, then predicted) whose maps equal explaining each
    class directly. Returns how many images were misclassified."""
    groups = rows_by_id(out / "index.csv")
    with open(out / "index.csv", newline="", encoding="utf-8") as file:
        assert next(csv.reader(file)) == FIELDS
    assert sorted(groups) == sorted(item_id(path, folder) for path in labels)
    reference = gradcam(class_names)
    misclassified = 0
    for path, label in labels.items():
        group = groups[item_id(path, folder)]
        predicted, confidence = by_hand(path)
        for row in group:
            assert row["label"] == ("" if label is None else str(label))
            assert row["label_name"] == ("" if label is None or class_names is None else class_names[label])
            assert row["predicted"] == str(predicted)
            assert row["predicted_name"] == (class_names[predicted] if class_names is not None else "")
            assert float(row["confidence"]) == pytest.approx(confidence, abs=1e-5) and 0 <= confidence <= 1
            assert row["correct"] == ("" if label is None else str(int(label == predicted)))
        wrong = label is not None and label != predicted
        misclassified += wrong
        expected_targets = [label, predicted] if wrong else [predicted]
        assert [row["role"] for row in group] == (["label", "predicted"] if wrong else ["predicted"])
        assert [int(row["target"]) for row in group] == expected_targets
        assert [int(row["k"]) for row in group] == list(range(len(group)))
        assert all(int(row["targets"]) == len(group) for row in group)
        saved = MapReader(out).read(group[0]).numpy()
        assert saved.shape == (len(group), 64, 64)
        for k, target in enumerate(expected_targets):
            direct = reference.explain(str(path), target=target)
            np.testing.assert_allclose(saved[k], direct.maps[0].numpy(), atol=2e-3)
            assert float(group[k]["score"]) == pytest.approx(float(direct.scores[0, 0]), rel=1e-4, abs=1e-4)
    return misclassified


# ---------------------------------------------------------------- label sources


def test_class_folders_matched_by_name_give_both_maps_for_misclassified_images(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 12, seed=3)
    (folder / "notes").mkdir()  # a folder without images need not name a class
    (folder / "notes" / "readme.txt").write_text("not an image")
    summary = run(gradcam(), folder, tmp_path / "out", labels="folders", batch_size=5, progress=False)
    assert "matched by name to the model's 4 class names" in summary.labels
    misclassified = check_labelled_rows(tmp_path / "out", folder, labels)
    assert misclassified >= 3  # the wrongly filed images (the demo model gets these shapes right)
    assert (summary.explained, summary.labelled, summary.misclassified) == (12, 12, misclassified)


def test_class_folders_without_class_names_are_numbered_in_sorted_order(tmp_path):
    folder = tmp_path / "images"
    names = ("b-second", "a-first", "d-fourth", "c-third")  # CLASS_NAMES order: index i is names[i] ...
    labels = class_folders(folder, 8, seed=4, names=names)
    (folder / "e-empty").mkdir()  # an empty class folder still takes its place in the order
    (folder / ".ipynb_checkpoints").mkdir()  # a hidden one does not
    summary = run(gradcam(class_names=None), folder, tmp_path / "out", labels="folders", progress=False)
    assert "sorted order" in summary.labels
    assert "a-first=0, b-second=1, c-third=2, d-fourth=3, e-empty=4" in summary.labels
    sorted_position = {name: position for position, name in enumerate(sorted(names))}
    folder_index = {path: sorted_position[path.parent.name] for path in labels}
    groups = rows_by_id(tmp_path / "out" / "index.csv")
    for path, label in folder_index.items():
        predicted, _ = by_hand(path)
        for row in groups[item_id(path, folder)]:
            assert (row["label"], row["label_name"]) == (str(label), path.parent.name)
            assert row["predicted_name"] == sorted(names)[predicted]  # the folder names name the classes
            assert row["correct"] == str(int(label == predicted))


def test_a_csv_file_with_indices_names_and_unlabelled_images(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 8, seed=5)
    paths = sorted(labels)
    table = tmp_path / "labels.csv"
    lines = ["path,label,comment"]
    for number, path in enumerate(paths[:-1]):  # the last image has no label
        relative = path.relative_to(folder).as_posix()
        label = labels[path]
        lines.append(f"./{relative},{CLASS_NAMES[label].upper()},x" if number % 2 else f"{relative},{label},y")
    table.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8-sig")  # as a spreadsheet saves it
    summary = run(gradcam(), folder, tmp_path / "out", labels=table, progress=False, overlays=True)
    assert summary.labels == f"labels: 7 of 8 image(s) labelled by {table}"
    check_labelled_rows(tmp_path / "out", folder, {**labels, paths[-1]: None})
    assert summary.labelled == 7


def test_a_mapping_and_the_targets_label_and_predicted(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 8, seed=6)
    mapping = {path.relative_to(folder): CLASS_NAMES[label] for path, label in labels.items()}
    wrong = [path for path, label in labels.items() if by_hand(path)[0] != label]
    assert wrong
    run(gradcam(), folder, tmp_path / "label", labels=mapping, target="label", progress=False)
    run(gradcam(), folder, tmp_path / "predicted", labels=mapping, target="predicted", progress=False)
    for out, role in ((tmp_path / "label", "label"), (tmp_path / "predicted", "predicted")):
        groups = rows_by_id(out / "index.csv")
        for path, label in labels.items():
            (row,) = groups[item_id(path, folder)]  # one row per image
            expected = label if role == "label" else by_hand(path)[0]
            assert (row["role"], int(row["target"]), row["label"]) == (role, expected, str(label))
            direct = gradcam().explain(str(path), target=expected).maps[0].numpy()
            np.testing.assert_allclose(MapReader(out).read(row)[0].numpy(), direct, atol=2e-3)


def test_given_targets_and_topk_keep_working_with_labels_and_without(tmp_path, capsys):
    folder = tmp_path / "images"
    labels = class_folders(folder, 6, seed=7)
    common = ["batch", folder, "--model", "demo", "--no-progress"]
    assert main([str(part) for part in [*common, "--out", tmp_path / "given", "--labels", "folders", "--target",
                                        "triangle"]]) == 0
    assert main([str(part) for part in [*common, "--out", tmp_path / "topk", "--labels", "folders", "--topk",
                                        "2"]]) == 0
    assert main([str(part) for part in [*common, "--out", tmp_path / "plain"]]) == 0
    printed = capsys.readouterr().out
    assert "labels: from the class folders, matched by name" in printed and "6 of them with a label" in printed
    for path, label in labels.items():
        predicted, confidence = by_hand(path)
        with torch.no_grad():
            top2 = MODEL(explain.Normalize()(Image.open(path))[None])[0].topk(2).indices.tolist()
        item = item_id(path, folder)
        given = rows_by_id(tmp_path / "given" / "index.csv")[item]
        assert [(row["role"], row["target"], row["label"], row["predicted"]) for row in given] == [
            ("given", "2", str(label), str(predicted))]
        topk = rows_by_id(tmp_path / "topk" / "index.csv")[item]
        assert [(row["role"], int(row["target"])) for row in topk] == [("topk", top2[0]), ("topk", top2[1])]
        assert {row["predicted"] for row in topk} == {str(top2[0])}
        assert topk[0]["correct"] == str(int(label == predicted))
        (plain,) = rows_by_id(tmp_path / "plain" / "index.csv")[item]  # no labels: as before, with the prediction
        assert (plain["role"], plain["target"], plain["label"], plain["label_name"], plain["correct"]) == (
            "predicted", str(predicted), "", "", "")
        assert (plain["predicted"], plain["predicted_name"]) == (str(predicted), CLASS_NAMES[predicted])
        assert float(plain["confidence"]) == pytest.approx(confidence, abs=1e-5)


# ---------------------------------------------------------------- bad labels


@pytest.fixture
def small_folder(tmp_path) -> Path:
    folder = tmp_path / "images"
    for name, image in zip(["disc/img01.png", "disc/img03.png", "square/img02.png", "cross/img04.png"],
                           make_dataset(4, seed=8).images):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / name)
    return folder


@pytest.mark.parametrize("table, message", [
    ("path,label\ndisc/img01.png,dsic\n", "line 2: no class is called 'dsic'.*Did you mean 'disc'"),
    ("path,label\ndisc/nothere.png,0\n", "line 2: 'disc/nothere.png' \\(no such file\\)"),
    ("path,label\n../outside.png,0\n", "outside the folder"),
    ("path,label\nsquare/img02.png,1\n./square//img02.png,1\n", "listed more than once.*line 2 and line 3"),
    ("file,class\nsquare/img02.png,1\n", "must start with the header 'path,label'.*'file,class'"),
    ("square/img02.png,1\n", "must start with the header 'path,label'"),
    ("", "is empty"),
    ("path,label\nsquare/img02.png,\n", "line 2: the label is empty"),
    ("path,label\nsquare/img02.png,7\n", "line 2: label 7 is out of range: the model has 4 classes"),
])
def test_a_bad_label_file_is_one_clear_error_line(small_folder, tmp_path, capsys, table, message):
    labels = tmp_path / "labels.csv"
    labels.write_text(table)
    out = tmp_path / "out"
    status = main(["batch", str(small_folder), "--model", "demo", "--out", str(out), "--labels", str(labels)])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and error[0].startswith("explain: error: ")
    assert re.search(message, error[0]), error[0]
    assert not (out / "index.csv").exists()  # refused before anything was written


def test_other_label_mistakes_are_clear_errors(small_folder, tmp_path, capsys):
    def error_of(*arguments) -> str:
        status = main(["batch", str(small_folder), "--model", "demo", "--out", str(tmp_path / "out"), *arguments])
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1, lines
        return lines[0]

    assert "no such file" in error_of("--labels", "folder")  # a typo of 'folders'
    assert "--labels folders" in error_of("--target", "both") and "--labels FILE.csv" in error_of("--target", "label")
    assert "give one of them" in error_of("--labels", "folders", "--target", "label", "--topk", "2")
    Image.fromarray(make_dataset(1, seed=1).images[0]).save(small_folder / "loose.png")
    assert "1 image(s) lie directly in it, outside any class folder: loose.png" in error_of("--labels", "folders")
    (small_folder / "loose.png").unlink()
    (small_folder / "hexagon").mkdir()
    Image.fromarray(make_dataset(1, seed=1).images[0]).save(small_folder / "hexagon" / "h.png")
    assert "'hexagon' (no class is called 'hexagon'" in error_of("--labels", "folders")
    with pytest.raises(LabelError, match="class name, but the model's class names are not known"):
        run(gradcam(class_names=None), small_folder, tmp_path / "out2", labels={"hexagon/h.png": "hexagon"},
            progress=False)
    with pytest.raises(LabelError, match="the label of .*h.png is 9, out of range: the model has 4 classes"):
        run(gradcam(class_names=None), small_folder, tmp_path / "out3", labels={"hexagon/h.png": 9}, progress=False)
    with pytest.raises(LabelError, match="keys are paths relative to the image folder; got 3"):
        run(gradcam(), small_folder, tmp_path / "out4", labels={3: "disc"}, progress=False)


# ---------------------------------------------------------------- DataLoaders


class FilesWithPaths(torch.utils.data.Dataset):
    """A dataset that returns each image with its label and file name, as a dict or a tuple."""

    def __init__(self, files: list[Path], labels: list[int], as_dict: bool):
        self.files, self.labels, self.as_dict = files, labels, as_dict

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        image = explain.Normalize()(Image.open(self.files[index]).convert("RGB"))
        if self.as_dict:
            return {"image": image, "label": self.labels[index], "path": str(self.files[index])}
        return image, self.labels[index], str(self.files[index])


def test_an_image_folder_loader_names_images_by_their_files_and_reads_its_labels(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 8, seed=9, names=("c0", "c1", "c2", "c3"))  # sorted position = class
    dataset = torchvision.datasets.ImageFolder(str(folder), transform=explain.Normalize())
    loader = torch.utils.data.DataLoader(dataset, batch_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = run(gradcam(), loader, tmp_path / "loader", progress=False)
    assert summary.labels == "labels: from the DataLoader's batches"
    # the ids of a run over the folder itself; the labels of the dataset; the same checks by hand
    check_labelled_rows(tmp_path / "loader", folder, labels)
    assert run(gradcam(), loader, tmp_path / "loader", progress=False).already_done == 8  # resumes by file
    for shuffled in (torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=True),
                     torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, [0, 1]), shuffle=True)):
        with pytest.warns(UserWarning, match="shuffle=True.*cannot be named by their files.*would not resume"):
            rows = read_index(run(gradcam(), shuffled, tmp_path / f"shuffled{len(shuffled)}", progress=False).index)
        assert rows[0]["id"] == "00000000"
    subset = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, [5, 2]), batch_size=2)
    rows = read_index(run(gradcam(), subset, tmp_path / "subset", progress=False).index)
    assert [row["id"] for row in rows if row["k"] == "0"] == [item_id(Path(dataset.samples[i][0]), folder)
                                                            for i in (5, 2)]


@pytest.mark.parametrize("as_dict", [True, False])
def test_batches_that_carry_file_names_name_the_images_even_shuffled(tmp_path, as_dict):
    folder = tmp_path / "images"
    labels = class_folders(folder, 6, seed=10)
    files = sorted(labels)
    dataset = FilesWithPaths(files, [labels[path] for path in files], as_dict)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(gradcam(), loader, tmp_path / "out", progress=False)
    groups = rows_by_id(tmp_path / "out" / "index.csv")
    assert sorted(groups) == sorted(item_id(path, Path(path.anchor)) for path in files)  # the absolute names
    for path in files:
        group = groups[item_id(path, Path(path.anchor))]
        assert group[0]["image"] == str(path) and group[0]["label"] == str(labels[path])


def test_loader_labels_that_are_not_class_indices_are_refused_and_negative_ones_mean_none(tmp_path):
    images = torch.stack([explain.Normalize()(image) for image in make_dataset(4, seed=12).images])
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 3]), 4).float()
    with pytest.raises(LabelError, match=r"\(N,\) integer class indices.*shape \(4, 4\).*labels.argmax\(1\)"):
        run(gradcam(), [(images, one_hot)], tmp_path / "one-hot", progress=False)
    with pytest.raises(LabelError, match="carry no labels"):
        run(gradcam(), [images], tmp_path / "none", target="label", progress=False)
    with pytest.raises(LabelError, match="a DataLoader's labels come from its batches"):
        run(gradcam(), [images], tmp_path / "none", labels="folders", progress=False)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) model-input tensor; got \(3, 64, 64\).*batch_size"):
        run(gradcam(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.arange(4)),
                                                   batch_size=None), tmp_path / "unbatched", progress=False)
    rows = read_index(run(gradcam(), [(images, torch.tensor([-1, 0, -1, 3]))], tmp_path / "unlabelled",
                          progress=False).index)
    first = [row for row in rows if row["k"] == "0"]
    assert [row["label"] for row in first] == ["", "0", "", "3"]
    assert [row["correct"] for row in first][::2] == ["", ""]


# ---------------------------------------------------------------- overlays


def test_each_overlay_panel_is_captioned_with_its_role_class_score_and_method(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 4, seed=13, wrong_every=2)
    run(gradcam(), folder, tmp_path / "out", labels="folders", overlays=True, progress=False)
    groups = rows_by_id(tmp_path / "out" / "index.csv")
    path = next(path for path, label in labels.items() if by_hand(path)[0] != label)
    group = groups[item_id(path, folder)]
    picture = np.asarray(Image.open(tmp_path / "out" / "overlays" / f"{group[0]['id']}.png"))
    scale = 3  # 64-pixel panels are enlarged to 192 so that their captions can be read
    band = picture.shape[0] - 64 * scale
    assert picture.shape == (band + 64 * scale, 2 * 64 * scale, 3) and band > 0
    maps = MapReader(tmp_path / "out").read(group[0]).numpy()
    expected = render.overlay(np.array(Image.open(path)), maps)  # (2, 64, 64, 3)
    for k in range(2):  # the saved maps are float16: a pixel may take the next colour of the map
        panel = picture[band:, k * 192 : (k + 1) * 192].astype(int)
        assert np.abs(panel - expected[k].repeat(scale, 0).repeat(scale, 1)).max() <= 3
    captions = panel_captions(["label", "predicted"], [int(row["target"]) for row in group],
                              [float(row["score"]) for row in group], [float(row["probability"]) for row in group],
                              "GradCAM @ layer4", CLASS_NAMES)
    label, predicted = int(group[0]["target"]), int(group[1]["target"])
    assert captions[0][0] == f"true: {CLASS_NAMES[label]} ({label})"
    assert captions[1][0] == f"predicted: {CLASS_NAMES[predicted]} ({predicted})"
    assert captions[0][1].startswith("score ") and ", p 0." in captions[0][1] and captions[0][2] == "GradCAM @ layer4"
    assert panel_captions(["topk", "topk"], [1, 2], [1.0, 0.5], [None, None], "m", None)[1][:2] == [
        "top 2: class 2", "score 0.5"]
    drawn = render.captioned_panels(expected, captions)
    np.testing.assert_array_equal(drawn[:band], picture[:band])  # the picture's captions are these
    assert not np.array_equal(picture[:band, :192], picture[:band, 192:])  # two different captions


# ---------------------------------------------------------------- earlier indexes, torchrun, kill -9


def test_an_index_of_the_earlier_version_is_refused_untouched_and_still_read(small_folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    earlier = (",".join(EARLIER_FIELDS) + "\r\n" + "a-1,a.png,2,0,1,triangle,3.5,0.9,maps/a-1.npy\r\n").encode()
    (out / "index.csv").write_bytes(earlier)
    status = main(["batch", str(small_folder), "--model", "demo", "--out", str(out), "--no-progress"])
    error = capsys.readouterr().err
    assert status == 2 and "written by an earlier version of explain" in error and "Move it out of the way" in error
    assert (out / "index.csv").read_bytes() == earlier
    with pytest.raises(ValueError, match="earlier version"):  # under torchrun too, before a rank's index is made
        run(gradcam(), small_folder, out, shard=Shard(1, 2), progress=False)
    assert sorted(path.name for path in out.iterdir()) == ["index.csv", "maps"]
    (row,) = read_index(out / "index.csv")
    assert row["target"] == "2" and all(row[name] == "" for name in FIELDS[len(EARLIER_FIELDS):])
    (out / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an index written by explain"):
        read_index(out / "other.csv")
    (out / "other.csv").unlink()
    (out / "index.csv").rename(out / "earlier-index.csv")  # as the message says: the run then goes on
    assert main(["batch", str(small_folder), "--model", "demo", "--out", str(out), "--no-progress"]) == 0
    assert len(read_index(out / "index.csv")) == 4


def test_torchrun_shards_a_labelled_run_and_merges_both_maps(tmp_path):
    folder = tmp_path / "images"
    labels = class_folders(folder, 8, seed=14)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29541",
               "-m", "explain", "batch", str(folder), "--model", "demo", "--out", str(out), "--labels", "folders",
               "--batch-size", "3", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(out.glob("index.rank*.csv"))
    assert check_labelled_rows(out, folder, labels) >= 2


def test_kill_9_in_the_middle_of_a_labelled_run_then_resume_gives_the_same_index(tmp_path):
    """A labelled run (one or two maps per image) is SIGKILLed at random moments, at least 15
    times, and resumed each time until it finishes: its index is that of a run left alone."""
    folder = tmp_path / "images"
    class_folders(folder, 16, seed=15, wrong_every=3)
    reference, out = tmp_path / "reference", tmp_path / "out"
    full_run = run_in_fork(folder, reference, ["--labels", "folders"])
    assert kill_at_random_moments(folder, out, ["--labels", "folders"], full_run, kills=15, seed=1) >= 15
    numeric = ("score", "probability", "confidence")
    not_compared = (*numeric, "map")  # which batch's maps file holds an image depends on where the kills fell
    expected, resumed = read_index(reference / "index.csv"), read_index(out / "index.csv")
    assert len(resumed) == len(expected) > 16  # some images have two rows
    for mine, theirs in zip(resumed, expected):
        assert {key: value for key, value in mine.items() if key not in not_compared} == {
            key: value for key, value in theirs.items() if key not in not_compared}
        for key in numeric:
            assert float(mine[key]) == pytest.approx(float(theirs[key]), rel=1e-4, abs=1e-6)
        np.testing.assert_allclose(MapReader(out).read(mine), MapReader(reference).read(theirs), atol=2e-3)
    assert sorted(path.name for path in (out / "overlays").iterdir()) == sorted(
        path.name for path in (reference / "overlays").iterdir())
    assert not list(out.rglob("*.part"))
    assert (out / "run.json").read_text() == (reference / "run.json").read_text()
