"""Issue 28: OUT/run.json records how a dataset run explains its images (method, target, label
source, class names). Its contents are checked against what each run was asked, field by field; a
resumed run that differs (another method, target or label source) is refused with the
differences named and the folder left untouched; the report names the method from it, and still
reports a folder written before run.json existed."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import run
from explain.dataset_tools.html_report import main_report, report
from explain.dataset_tools.run_folder import Shard
from explain.dataset_tools.run_record import RUN_RECORD, RunRecord, read_run_record
from explain.methods.signatures import setting_text

MODEL = load_demo_model()


def gradcam() -> explain.GradCAM:
    return explain.GradCAM(MODEL, "layer4", class_names=CLASS_NAMES)


@pytest.fixture
def folder(tmp_path) -> Path:
    """Four images in class folders (disc, square, cross), as --labels folders reads them."""
    root = tmp_path / "images"
    for name, image in zip(["disc/a.png", "disc/b.png", "square/c.png", "cross/d.png"], make_dataset(4, seed=3).images):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(root / name)
    return root


def recorded(out: Path) -> dict:
    return json.loads((out / RUN_RECORD).read_text(encoding="utf-8"))


def but_model_and_data(record: dict) -> dict:
    """run.json's fields but the model and the input (tests/test_issue39_batch.py checks those)."""
    return {name: value for name, value in record.items() if name not in ("model", "data")}


def folder_state(out: Path) -> dict[str, bytes]:
    """Every file of an output folder and its bytes."""
    return {str(path.relative_to(out)): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}


# ---------------------------------------------------------------- what run.json holds


def test_run_json_records_what_each_run_was_asked(folder, tmp_path):
    run(gradcam(), folder, tmp_path / "both", labels="folders", progress=False)
    both = but_model_and_data(recorded(tmp_path / "both"))
    assert both == {"method": "gradcam", "method_class": "GradCAM", "class_names": list(CLASS_NAMES),
                    "target": {"mode": "both"}, "labels": "class folders", "settings": setting_text(gradcam())}
    assert recorded(tmp_path / "both")["settings"].startswith("GradCAM(layer=['layer4'], relu=True, ")
    run(explain.Saliency(MODEL), folder, tmp_path / "topk", topk=2, progress=False)
    assert but_model_and_data(recorded(tmp_path / "topk")) == {
        "method": "saliency", "method_class": "Saliency", "class_names": None, "target": {"mode": "topk", "topk": 2},
        "labels": "none", "settings": setting_text(explain.Saliency(MODEL))}
    labels = tmp_path / "my labels.csv"
    labels.write_text("path,label\ndisc/a.png,disc\n")
    run(gradcam(), folder, tmp_path / "given", target="square", labels=labels, progress=False)  # a name: its index
    assert recorded(tmp_path / "given")["target"] == {"mode": "given", "target": CLASS_NAMES.index("square")}
    assert recorded(tmp_path / "given")["labels"] == "the file my labels.csv"
    batches = [(torch.stack([explain.Normalize()(image) for image in make_dataset(2, seed=4).images]),
                torch.tensor([0, 1]))]
    run(gradcam(), batches, tmp_path / "loader", target="label", progress=False)
    assert recorded(tmp_path / "loader")["labels"] == "the DataLoader's batches"
    assert recorded(tmp_path / "loader")["target"] == {"mode": "label"}
    # the reader gives back what was written
    assert replace(read_run_record(tmp_path / "both"), model=None, data=None) == RunRecord(
        "gradcam", "GradCAM", list(CLASS_NAMES), {"mode": "both"}, "class folders", setting_text(gradcam()))
    assert read_run_record(tmp_path / "nothing here") is None


def test_the_command_records_its_method_and_target(folder, tmp_path):
    out = tmp_path / "out"
    assert main(["batch", str(folder), "--model", "demo", "--method", "gradcam++", "--target", "2", "--out",
                 str(out), "--no-progress"]) == 0
    record = recorded(out)
    assert (record["method"], record["method_class"]) == ("gradcam++", "GradCAMPlusPlus")
    assert record["target"] == {"mode": "given", "target": 2} and record["labels"] == "none"
    assert record["class_names"] == list(CLASS_NAMES)  # the demo model's
    assert (out / RUN_RECORD).read_text().count("\n") == 10  # one setting a line, for reading by eye


# ---------------------------------------------------------------- resuming


def test_a_resume_with_the_same_settings_goes_on_and_keeps_the_record(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", batch_size=3, progress=False)
    first = (out / RUN_RECORD).read_bytes()
    again = run(gradcam(), folder, out, labels="folders", batch_size=1, progress=False)
    assert again.already_done == 4 and again.explained == 0
    assert (out / RUN_RECORD).read_bytes() == first


def test_a_resume_with_another_method_is_refused_saying_what_differs(folder, tmp_path, capsys):
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", progress=False)
    before = folder_state(out)
    with pytest.raises(ValueError) as raised:
        run(explain.GradCAMPlusPlus(MODEL, "layer4", class_names=CLASS_NAMES), folder, out, labels="folders",
            progress=False)
    message = str(raised.value)
    assert "method: 'gradcam' (GradCAM) earlier, 'gradcam++' (GradCAMPlusPlus) now" in message
    assert "maps of two methods" in message and "another output folder" in message
    assert not any(what in message for what in ("target:", "labels:", "class names:"))  # only what differs
    assert folder_state(out) == before  # nothing explained, nothing rewritten
    # the command says the same, in one line, with exit status 2
    status = main(["batch", str(folder), "--model", "demo", "--method", "saliency", "--labels", "folders", "--out",
                   str(out), "--no-progress"])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    assert "method: 'gradcam' (GradCAM) earlier, 'saliency' (Saliency) now" in error[0]
    assert folder_state(out) == before


def test_a_resume_with_other_settings_of_the_method_is_refused_naming_them(folder, tmp_path):
    """The same method with another option (Grad-CAM at another layer, without its ReLU; Saliency's reduction) would
    mix maps made two ways in one index; the same settings built again, or an explainer already used (its layer
    chosen on the first call), resume. A record written before explain recorded settings resumes too."""
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", progress=False)
    before = folder_state(out)
    for other, shown in [(explain.GradCAM(MODEL, "layer3", class_names=CLASS_NAMES), "layer=['layer3']"),
                         (explain.GradCAM(MODEL, "layer4", relu=False, class_names=CLASS_NAMES), "relu=False")]:
        with pytest.raises(ValueError, match="method settings: GradCAM\\(layer=\\['layer4'\\], relu=True.* earlier, "
                           f"GradCAM\\(.*{re.escape(shown)}.* now.*maps made two ways"):
            run(other, folder, out, labels="folders", progress=False)
    assert folder_state(out) == before
    assert run(gradcam(), folder, out, labels="folders", progress=False).already_done == 4
    automatic = explain.Saliency(MODEL)
    run(automatic, folder, tmp_path / "saliency", progress=False)
    assert run(automatic, folder, tmp_path / "saliency", progress=False).already_done == 4  # used: the same
    with pytest.raises(ValueError, match="method settings: Saliency\\(reduce='maxabs'.* earlier, "
                       "Saliency\\(reduce='sum'"):
        run(explain.Saliency(MODEL, reduce="sum"), folder, tmp_path / "saliency", progress=False)
    old = json.loads((out / RUN_RECORD).read_text(encoding="utf-8"))
    del old["settings"]  # a folder of an earlier version
    (out / RUN_RECORD).write_text(json.dumps(old), encoding="utf-8")
    assert run(explain.GradCAM(MODEL, "layer4", relu=False, class_names=CLASS_NAMES), folder, out, labels="folders",
               progress=False).already_done == 4


def test_a_resume_with_another_target_labels_or_class_names_lists_each_difference(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", progress=False)
    before = folder_state(out)
    with pytest.raises(ValueError) as raised:
        run(explain.GradCAM(MODEL, "layer4"), folder, out, topk=2, progress=False)
    message = str(raised.value)
    assert "target: 'both' earlier, 'topk' (topk 2) now" in message
    assert "labels: class folders earlier, none now" in message
    assert "class names: 4 earlier, none now" in message
    assert "method" not in message and "maps made two ways" in message
    renamed = ["disc", "square", "cross", "triangle"]  # the folders still name classes of the model
    with pytest.raises(ValueError, match="class names: class 2 is 'triangle' earlier, 'cross' now"):
        run(explain.GradCAM(MODEL, "layer4", class_names=renamed), folder, out, labels="folders", progress=False)
    assert folder_state(out) == before


def test_a_folder_with_nothing_done_yet_takes_the_new_record(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = RunRecord("saliency", "Saliency", None, {"mode": "predicted"}, "none")
    (out / RUN_RECORD).write_text(stale.to_text())  # e.g. a first run that stopped before any image
    summary = run(gradcam(), folder, out, labels="folders", progress=False)
    assert summary.explained == 4 and recorded(out)["method"] == "gradcam"


def test_a_folder_from_before_run_json_resumes_and_gets_one(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", progress=False)
    expected = (out / RUN_RECORD).read_bytes()
    (out / RUN_RECORD).unlink()
    assert run(gradcam(), folder, out, labels="folders", progress=False).already_done == 4
    assert (out / RUN_RECORD).read_bytes() == expected


def test_an_unreadable_record_beside_explained_images_is_a_clear_error(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, progress=False)
    for text, message in [("{not json", "is not JSON"), ('{"method": 3}', "field\\(s\\) method, method_class, "
                                                                           "class_names, target, labels are missing"),
                          ("[1, 2]", "holds list, not an object")]:
        (out / RUN_RECORD).write_text(text)
        with pytest.raises(ValueError, match=f"{message}.*delete it"):
            run(gradcam(), folder, out, progress=False)
        assert (out / RUN_RECORD).read_text() == text


def test_only_rank_0_writes_the_record_and_every_rank_checks_it(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, shard=Shard(1, 2), progress=False)
    assert not (out / RUN_RECORD).exists()
    run(gradcam(), folder, out, shard=Shard(0, 2), progress=False)
    assert recorded(out)["method"] == "gradcam"
    with pytest.raises(ValueError, match="'gradcam' \\(GradCAM\\) earlier, 'saliency' \\(Saliency\\) now"):
        run(explain.Saliency(MODEL, class_names=CLASS_NAMES), folder, out, shard=Shard(1, 2), progress=False)


# ---------------------------------------------------------------- the report


def page_meta(page: Path) -> dict:
    return json.loads(re.search(r'id="report-meta">(.*?)</script>', page.read_text(), re.S).group(1))


def test_the_report_names_the_method_from_run_json_and_method_overrides_it(folder, tmp_path, capsys):
    out = tmp_path / "out"
    run(explain.GradCAMPlusPlus(MODEL, "layer4", class_names=CLASS_NAMES), folder, out, labels="folders",
        overlays=True, progress=False)
    (out / "strategies.json").write_text(json.dumps({"method": "from strategies", "map_size": [4, 4],
                                                     "classes": []}))
    page = report(out).page
    assert page_meta(page)["method"] == "GradCAMPlusPlus"  # run.json before strategies.json
    assert "· GradCAMPlusPlus ·" in page.read_text()
    assert main_report([str(out), "--method", "my <method>"]) == 0
    assert page_meta(page)["method"] == "my <method>" and "my &lt;method&gt;" in page.read_text()
    capsys.readouterr()


def test_a_folder_from_before_run_json_still_reports(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, labels="folders", overlays=True, progress=False)
    (out / RUN_RECORD).unlink()
    result = report(out)
    assert result.images == 4 and result.notes == []
    assert page_meta(result.page)["method"] == ""
    assert page_meta(report(out, method="GradCAM").page)["method"] == "GradCAM"
    (out / "strategies.json").write_text(json.dumps({"method": "gradcam", "map_size": [4, 4], "classes": []}))
    assert page_meta(report(out).page)["method"] == "gradcam"  # the method strategies.json names


def test_an_unreadable_run_json_is_a_note_of_the_report_not_a_failure(folder, tmp_path):
    out = tmp_path / "out"
    run(gradcam(), folder, out, progress=False)
    (out / RUN_RECORD).write_text("{torn")
    with pytest.warns(UserWarning, match="run.json is not JSON"):
        result = report(out)
    assert result.images == 4 and page_meta(result.page)["method"] == ""
    assert any("run.json is not JSON" in note and "method is not named" in note for note in result.notes)
