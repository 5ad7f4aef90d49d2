"""The concept atlas attacked again: a method given as an explainer is recorded by its registered name and settings
(a resume with the same settings goes on, one with others is refused, a class or an explainer of another model is
refused before anything is written); shards of two layouts running at once (shard=(1, 2) beside shard=(2, 3)) compute
each batch once, and the merge computes only what is missing."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import explain
from explain.data.demo import load_demo_model
from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder
from explain.dataset_tools import concept_atlas
from explain.dataset_tools.concept_atlas import build_atlas
from explain.methods.signatures import setting_text

COUNT, TOP = 6, 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_watermark_folder(tmp_path_factory.mktemp("session6-data") / "images", count=COUNT)


def build(model: Any, data: Any, out: Path, layer: str = "layer3", **options: Any):
    return build_atlas(model, layer, data, out, **{"top": TOP, "batch_size": 4, "progress": False, **options})


def assert_same_atlas(atlas, expected) -> None:
    """Every concept's references (images in order, values) and classes agree."""
    assert atlas.entries["images"] == expected.entries["images"]
    for entry, other in zip(atlas.entries["concepts"], expected.entries["concepts"], strict=True):
        for kind in ("relevance_references", "activation_references"):
            assert [r["image"] for r in entry[kind]] == [r["image"] for r in other[kind]]
            assert [r["value"] for r in entry[kind]] == pytest.approx([r["value"] for r in other[kind]], rel=1e-4)
        assert [c["class"] for c in entry["classes"]] == [c["class"] for c in other["classes"]]


def count_measured(monkeypatch) -> list[int]:
    """The batch indices ``build_atlas`` measures from now on, in order."""
    measured: list[int] = []
    original = concept_atlas._measure_batch

    def measure(crp, files, start, batch_size, destination, folder, record):
        measured.append(int(destination.stem))
        return original(crp, files, start, batch_size, destination, folder, record)

    monkeypatch.setattr(concept_atlas, "_measure_batch", measure)
    return measured


# ---------------------------------------------------------------------------------------- 1. an explainer as method


def test_an_explainer_as_the_method_is_recorded_by_name_and_settings_and_a_resume_checks_them(folder, tmp_path,
                                                                                                monkeypatch):
    """Before, the record kept the explainer object itself: json.dumps raised TypeError after the folder was made,
    so an atlas could not be built with method=LRP(model) (ConceptRelevance takes one)."""
    model = load_watermark_demo()
    expected = build(model, folder, tmp_path / "named", method="lrp")
    out = tmp_path / "object"
    assert build(model, folder, out, method=explain.LRP(model), shard=(0, 2)) is None
    record = json.loads((out / concept_atlas.RECORD_FILE).read_text(encoding="utf-8"))
    assert record["method"] == "lrp"  # its registered name, and its settings (the composite among them)
    assert record["settings"] == setting_text(explain.LRP(model))
    measured = count_measured(monkeypatch)
    again = load_watermark_demo()  # another instance, the same weights
    atlas = build(again, folder, out, method=explain.LRP(again))  # a new explainer of the same settings
    assert measured == [1]  # only the batch shard 0 left: batch 0 was resumed
    assert_same_atlas(atlas, expected)
    assert json.loads((out / concept_atlas.ATLAS_FILE).read_text(encoding="utf-8"))["method"] == "LRP"
    other = explain.LRP(model, composite="epsilon_plus")
    with pytest.raises(ValueError, match=r"settings: .LRP\(composite=Composite\(name='epsilon_gamma_box'.*"
                                         r"earlier, .LRP\(composite=Composite\(name='epsilon_plus'"):
        build(model, folder, out, method=other)
    assert measured == [1]  # nothing measured with the other method


def test_an_explainer_with_options_resumes_on_another_model_and_another_one_is_refused(folder, tmp_path,
                                                                                         monkeypatch):
    """The same rule on the demo model's layer4, the data a list of files, an explainer with a composite given: a
    resume with an equal explainer goes on (the atlas of the composite named), one with the default composite is
    refused, and so is one with the name and the composite as options (recorded as options: not the same record)."""
    files = sorted(str(path) for path in folder.rglob("*.png"))
    model = load_demo_model()
    expected = build(model, files, tmp_path / "named", layer="layer4", composite="epsilon_plus")
    out = tmp_path / "object"
    build(model, files, out, layer="layer4", method=explain.LRP(model, composite="epsilon_plus"), shard=(1, 2))
    with pytest.raises(ValueError, match=r"settings: .LRP\(composite=Composite\(name='epsilon_plus'.*earlier, "
                                         r".LRP\(composite=Composite\(name='epsilon_gamma_box'"):
        build(model, files, out, layer="layer4", method=explain.LRP(model))
    with pytest.raises(ValueError, match=r"options: None earlier, \{'composite': \"'epsilon_plus'\"\} now"):
        build(model, files, out, layer="layer4", composite="epsilon_plus")
    measured = count_measured(monkeypatch)
    atlas = build(model, files, out, layer="layer4", method=explain.LRP(model, composite="epsilon_plus"))
    assert measured == [0]
    assert_same_atlas(atlas, expected)


@pytest.mark.parametrize("method, message", [
    (explain.LRP, r"method is the class LRP.*method='lrp'.*LRP\(model, \.\.\.\)"),
    (lambda model: explain.LRP(load_watermark_demo()), r"built on another model.*LRP\(model, \.\.\.\)"),
    (lambda model: explain.GradCAM(model, "layer3"), r"LRP or AttnLRP; got GradCAM"),
])
def test_a_class_or_an_explainer_of_another_model_is_refused_before_anything_is_written(folder, tmp_path, method,
                                                                                         message):
    """A class (not an explainer), an explainer built on another model (the atlas would be of that model, under this
    one's name), a method that is not LRP's: refused, saying what to pass, and no folder made."""
    model = load_watermark_demo()
    given = method if isinstance(method, type) else method(model)
    with pytest.raises(ValueError, match=message):
        build(model, folder, tmp_path / "atlas", method=given)
    assert not (tmp_path / "atlas").exists()


# --------------------------------------------------------------------------- 2. shards of two layouts at one time


@pytest.mark.parametrize("model_name, layer, batch_size, layouts, contested, files_as_list", [
    ("watermark", "layer3", 1, ((1, 2), (2, 3)), 5, False),  # batches 0..5: 1, 3, 5 beside 2, 5
    ("demo", "layer4", 2, ((0, 2), (2, 3)), 2, True),  # batches 0..2: 0, 2 beside 2
])
def test_shards_of_two_layouts_at_once_measure_each_batch_once_and_the_merge_only_what_is_missing(
        folder, tmp_path, monkeypatch, model_name, layer, batch_size, layouts, contested, files_as_list):
    """Two shards of other layouts run at the same time and both reach their common batch: the first to get there
    waits (in ``_measure_batch``) until the other has reached it too or ended. Before, both measured it (and wrote
    the same file, one of them failing on the other's temporary file); now the other skips it, as another process is
    measuring it. The merge then measures only the batches no shard took, and every batch is stored once."""
    load = load_watermark_demo if model_name == "watermark" else load_demo_model
    data: Any = sorted(str(path) for path in folder.rglob("*.png")) if files_as_list else folder
    expected = build(load(), data, tmp_path / "whole", layer=layer, batch_size=batch_size)
    out = tmp_path / "sharded"
    original = concept_atlas._measure_batch
    measured: list[tuple[str, int]] = []
    reached = {layout: threading.Event() for layout in layouts}  # at the common batch, or ended
    this_thread = threading.local()

    def measure(crp, files, start, size, destination, folder, record):
        index = int(destination.stem)
        layout = getattr(this_thread, "layout", None)
        measured.append((str(layout), index))
        if layout is not None and index == contested:
            reached[layout].set()
            other = next(item for item in layouts if item != layout)
            assert reached[other].wait(timeout=300), "the other shard neither reached the batch nor ended"
        return original(crp, files, start, size, destination, folder, record)

    monkeypatch.setattr(concept_atlas, "_measure_batch", measure)
    errors: list[BaseException] = []

    def shard(layout: tuple[int, int]) -> None:
        this_thread.layout = layout
        try:
            assert build(load(), data, out, layer=layer, batch_size=batch_size, shard=layout) is None
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)
        finally:
            reached[layout].set()

    threads = [threading.Thread(target=shard, args=(layout,)) for layout in layouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    batches = -(-COUNT // batch_size)
    by_shards = Counter(index for _, index in measured)
    assert by_shards[contested] == 1  # one of the two shards measured the common batch
    assert all(count == 1 for count in by_shards.values())
    covered = {index for rank, size in layouts for index in range(batches) if index % size == rank}
    assert set(by_shards) == covered
    measured.clear()
    atlas = build(load(), data, out, layer=layer, batch_size=batch_size)  # the merge
    assert sorted(index for _, index in measured) == sorted(set(range(batches)) - covered)
    assert_same_atlas(atlas, expected)
    rows = [int(row) for path in sorted((out / "batches").glob("*.pt")) for row in torch.load(path)["rows"]]
    assert sorted(rows) == list(range(COUNT))  # each image once, in one batch file
    assert sorted(path.name for path in (out / "batches").iterdir()) == [f"{index:06d}.pt" for index in range(batches)]
