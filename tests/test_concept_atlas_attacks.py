"""The concept atlas under attack: files in the data folder that are not usable images are left out and listed (the
rest gives the atlas of the good files alone), images of other sizes are measured (their relevance as by hand), a
resume with another preprocessing or other files of the same names is refused and says what differs, a second run
into a folder in use is refused (and a kill -9 then a rerun give the uninterrupted atlas), file names that are not
UTF-8 or that hold HTML are written safely, and the command line refuses options a folder's atlas would ignore."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.data.demo import load_demo_model
from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder
from explain.dataset_tools.concept_atlas import build_atlas, load_atlas
from explain.dataset_tools.run_folder import FolderInUseError

COUNT, TOP = 6, 1


@pytest.fixture(scope="module")
def clean_folder(tmp_path_factory) -> Path:
    return write_watermark_folder(tmp_path_factory.mktemp("attack-data") / "images", count=COUNT)


@pytest.fixture(scope="module")
def clean_atlas(clean_folder, tmp_path_factory):
    return build(load_watermark_demo(), clean_folder, tmp_path_factory.mktemp("attack-atlas") / "atlas")


def build(model: Any, data: Any, out: Path, layer: str = "layer3", **options: Any):
    return build_atlas(model, layer, data, out, **{"top": TOP, "batch_size": 4, "progress": False, **options})


def first_pixels(folder: Path) -> np.ndarray:
    return np.asarray(Image.open(sorted(folder.rglob("*.png"))[0]).convert("RGB"))


def add_bad_files(folder: Path, pixels: np.ndarray) -> list[str]:
    """A truncated JPEG, a zero-byte PNG, text named .png, an RGBA PNG and a 16-bit PNG: their names."""
    Image.fromarray(pixels).save(folder / "truncated.jpg")
    data = (folder / "truncated.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(data[:len(data) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "text.png").write_text("not an image")
    Image.fromarray(np.dstack([pixels, np.full(pixels.shape[:2], 128, np.uint8)])).save(folder / "alpha.png")
    Image.fromarray(pixels[..., 0].astype(np.uint16) * 256).save(folder / "sixteen.png")
    return ["alpha.png", "empty.png", "sixteen.png", "text.png", "truncated.jpg"]


def assert_same_atlas(atlas, expected) -> None:
    """Every concept's references (images in order, values) and classes agree."""
    assert atlas.entries["images"] == expected.entries["images"]
    for entry, other in zip(atlas.entries["concepts"], expected.entries["concepts"], strict=True):
        for kind in ("relevance_references", "activation_references"):
            assert [r["image"] for r in entry[kind]] == [r["image"] for r in other[kind]]
            assert [r["value"] for r in entry[kind]] == pytest.approx([r["value"] for r in other[kind]], rel=1e-4)
        assert [c["class"] for c in entry["classes"]] == [c["class"] for c in other["classes"]]


def test_unusable_files_are_left_out_and_listed_and_the_rest_is_the_atlas_of_the_good_files(clean_folder, clean_atlas,
                                                                                            tmp_path):
    """Before, the first bad file of a 10,000-image folder ended the run with an error, and removing it changed the
    image list, so the batches already measured could not be resumed."""
    data = tmp_path / "data"
    shutil.copytree(clean_folder, data)
    bad = add_bad_files(data, first_pixels(clean_folder))
    with pytest.warns(RuntimeWarning, match=r"5 of the 11 files of the atlas were left out.*\"skipped\"") as seen:
        atlas = build(load_watermark_demo(), data, tmp_path / "atlas")
    assert [warning.filename for warning in seen] == [__file__]
    assert_same_atlas(atlas, clean_atlas)
    assert [item["image"] for item in atlas.entries["skipped"]] == bad
    reasons = {item["image"]: item["reason"] for item in atlas.entries["skipped"]}
    assert "alpha channel" in reasons["alpha.png"] and "I;16" in reasons["sixteen.png"]
    assert "truncated" in reasons["truncated.jpg"] and "cannot identify" in reasons["empty.png"]
    assert load_atlas(tmp_path / "atlas").entries["skipped"] == atlas.entries["skipped"]
    assert "5 file(s) left out" in (tmp_path / "atlas" / "atlas.html").read_text(encoding="utf-8")


def test_unusable_files_are_left_out_of_a_list_of_files_with_another_model(clean_folder, tmp_path):
    """The same rule on the demo model's layer4, the data given as a list of files."""
    good = sorted(str(path) for path in clean_folder.rglob("*.png"))
    bad = [str(tmp_path / name) for name in add_bad_files(tmp_path, first_pixels(clean_folder))]
    model = load_demo_model()
    expected = build(model, good, tmp_path / "good", layer="layer4")
    with pytest.warns(RuntimeWarning, match="5 of the 11 files"):
        atlas = build(model, good[:3] + bad + good[3:], tmp_path / "mixed", layer="layer4")
    assert_same_atlas(atlas, expected)
    assert sorted(item["image"] for item in atlas.entries["skipped"]) == sorted(bad)


def relevance_by_hand(model: torch.nn.Module, layer: torch.nn.Module, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_c (C,), largest activation (C,)) of one image alone: LRP's relevance at the layer's output read with a
    tensor hook, summed per channel; the output's largest value per channel."""
    seen = {}

    def on_output(module, args, output):
        seen["a"] = output.detach().flatten(2).amax(2)[0].double()
        output.register_hook(lambda relevance: seen.update(r=relevance.detach().double().sum(dim=(2, 3))[0]))

    handle = layer.register_forward_hook(on_output)
    try:
        explain.LRP(model).explain(str(path))
    finally:
        handle.remove()
    return seen["r"], seen["a"]


@pytest.mark.parametrize("model_name, layer, size", [("watermark", "layer3", (64, 256)), ("demo", "layer4", (96, 64))])
def test_images_of_another_size_are_in_the_atlas_with_their_own_relevance(clean_folder, tmp_path, model_name, layer,
                                                                         size):
    """Images whose preprocessed sizes differ (a wide one, a tall one; a grayscale one too) are measured in groups of
    one size: every concept's first references are the images of largest R_c / activation computed image by image.
    Before, the run ended with "the inputs have different sizes", naming no file."""
    data = tmp_path / "data"
    shutil.copytree(clean_folder, data)
    pixels = first_pixels(clean_folder)
    Image.fromarray(pixels).resize(size[::-1], Image.BILINEAR).save(data / "odd size.png")  # no pixel-exact copy
    Image.fromarray(pixels[..., 1]).save(data / "gray.png")
    model = load_watermark_demo() if model_name == "watermark" else load_demo_model()
    files = sorted(data.rglob("*.png"))
    atlas = build(model, data, tmp_path / "atlas", layer=layer, batch_size=3, top=3)
    by_hand = [relevance_by_hand(model, model.get_submodule(layer), path) for path in files]
    names = [str(path.relative_to(data)) for path in files]
    assert atlas.entries["images"] == len(files) and atlas.entries["skipped"] == []
    for kind, table in (("relevance", torch.stack([r for r, _ in by_hand])), ("activation",
                                                                             torch.stack([a for _, a in by_hand]))):
        for entry in atlas.entries["concepts"]:  # the top 3 of each concept, as by hand (ties left out)
            values, indices = table[:, entry["concept"]].sort(descending=True)
            references = entry[f"{kind}_references"]
            assert [r["value"] for r in references] == pytest.approx(values[:3].tolist(), rel=1e-4, abs=1e-6)
            for rank, reference in enumerate(references):
                if min(abs(values[rank] - values[other]) for other in range(len(values)) if other != rank) > 1e-5:
                    assert reference["image"] == names[indices[rank]]
    shown = [r for entry in atlas.entries["concepts"] for r in entry["relevance_references"]]
    assert any(reference["image"] == "odd size.png" for reference in shown)
    assert all(min(Image.open(atlas.folder / reference["patch"]).size) > 0 for reference in shown)


def test_a_resume_with_another_preprocessing_or_other_files_of_the_same_names_is_refused(clean_folder, tmp_path):
    """Before, the record held neither the preprocessing nor anything of the files but their names: the merge mixed
    batches measured at 64 px with batches at 32 px, or of two data folders."""
    from explain.models import load_model

    out = tmp_path / "preprocess"
    build(load_model("demo-watermark"), clean_folder, out, shard=(0, 2))
    with pytest.raises(ValueError, match=r"preprocess: 'Normalize\(.*' earlier, 'TransformPreprocess\(Compose\( "
                                         r"Resize\(size=32"):
        build(load_model("demo-watermark", size=[32]), clean_folder, out)
    assert build(load_watermark_demo(), clean_folder, out) is not None  # the same model as a module: same settings
    other = tmp_path / "other"  # the same names, other pixels
    shutil.copytree(clean_folder, other)
    for path in other.rglob("*.png"):
        Image.fromarray(255 - np.asarray(Image.open(path))).save(path)
    out = tmp_path / "data"
    build(load_watermark_demo(), clean_folder, out, shard=(1, 2))
    with pytest.raises(ValueError, match="files: .* earlier, .* now .*other files, or the same ones changed since"):
        build(load_watermark_demo(), other, out)
    assert not list((out / "batches").glob("000000.pt"))  # nothing of the other folder was measured


def test_a_resume_from_the_command_line_with_another_size_or_a_changed_file_is_refused(clean_folder, tmp_path,
                                                                                     capsys):
    """The same rule through the command line (--size) and a list of files one of which is rewritten."""
    from explain.cli import main

    out = tmp_path / "cli"
    common = ["concepts", str(clean_folder), "--model", "demo-watermark", "--layer", "layer3", "--out", str(out),
              "--top", "1", "--batch-size", "4"]
    assert main([*common, "--shard", "0/2"]) == 0
    assert main([*common, "--size", "32"]) == 2
    assert "preprocess:" in capsys.readouterr().err
    files = sorted(str(path) for path in clean_folder.rglob("*.png"))
    copies = []
    for index, path in enumerate(files):
        shutil.copy(path, tmp_path / f"{index}.png")
        copies.append(tmp_path / f"{index}.png")
    build(load_demo_model(), copies, tmp_path / "list", layer="layer4", shard=(0, 2))
    Image.fromarray(np.asarray(Image.open(copies[-1]))[::-1].copy()).save(copies[-1])
    os.utime(copies[-1], ns=(0, 0))
    with pytest.raises(ValueError, match="files:"):
        build(load_demo_model(), copies, tmp_path / "list", layer="layer4")


def test_the_refusal_names_an_option_given_earlier_and_left_out_now(clean_folder, tmp_path):
    """Before, a resume without the earlier run's composite was refused with an empty list of differences: "()"."""
    build(load_watermark_demo(), clean_folder, tmp_path / "a", shard=(0, 2), composite="epsilon_plus")
    with pytest.raises(ValueError, match=r"options: \{'composite': \"'epsilon_plus'\"\} earlier, None now"):
        build(load_watermark_demo(), clean_folder, tmp_path / "a")
    build(load_demo_model(), clean_folder, tmp_path / "b", layer="layer4", shard=(0, 2), batch_size=2,
          directions=torch.eye(64)[:3])
    with pytest.raises(ValueError, match=r"options: \{'directions': 'tensor\(3, 64\):.*earlier, None now"):
        build(load_demo_model(), clean_folder, tmp_path / "b", layer="layer4", batch_size=2)


SLOW_BUILD = """
import sys, time
import explain.dataset_tools.concept_atlas as atlas
from explain.data.demo_watermark import load_watermark_demo
measure = atlas._measure_batch
def slow(*args, **kwargs):
    measure(*args, **kwargs)
    time.sleep(0.5)
atlas._measure_batch = slow
shard = None if sys.argv[3] == "-" else tuple(int(part) for part in sys.argv[3].split("/"))
atlas.build_atlas(load_watermark_demo(), "layer3", sys.argv[1], sys.argv[2], top=1, batch_size=1, progress=False,
                  shard=shard)
"""


def start_slow_build(script: Path, data: Path, out: Path, shard: str) -> subprocess.Popen:
    """A build of one image per batch, half a second a batch, in another process; returned once it has written a
    batch (so it holds the folder)."""
    process = subprocess.Popen([sys.executable, str(script), str(data), str(out), shard],
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not list((out / "batches").glob("*.pt")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the build ended before the test could race it"
    return process


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_kill_then_a_rerun_give_the_uninterrupted_atlas(
        clean_folder, clean_atlas, tmp_path):
    """Before, nothing held the folder: a second run measured every batch again beside the first (and, started with
    other settings before the first had written a batch, overwrote its record, so the two mixed). The data holds bad
    files too: after a kill -9 and a rerun, every good image is in the atlas once and the atlas is the clean one."""
    data = tmp_path / "data"
    shutil.copytree(clean_folder, data)
    bad = add_bad_files(data, first_pixels(clean_folder))
    script = tmp_path / "slow.py"
    script.write_text(SLOW_BUILD)
    out = tmp_path / "atlas"
    process = start_slow_build(script, data, out, "-")
    try:
        with pytest.raises(FolderInUseError, match="in use by another run of explain"):
            build(load_watermark_demo(), data, out, batch_size=1)
        with pytest.raises(FolderInUseError):  # a shard of a run is refused too while a whole run holds the folder
            build(load_watermark_demo(), data, out, batch_size=1, shard=(1, 2))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    written = len(list((out / "batches").glob("*.pt")))
    assert 1 <= written < COUNT + len(bad) and not (out / "atlas.json").exists()
    with pytest.warns(RuntimeWarning, match="5 of the 11 files"):
        atlas = build(load_watermark_demo(), data, out, batch_size=1)
    assert_same_atlas(atlas, clean_atlas)
    measured = [int(row) for path in sorted((out / "batches").glob("*.pt")) for row in torch.load(path)["rows"]]
    skipped = [int(row) for path in sorted((out / "batches").glob("*.pt")) for row in torch.load(path)["skipped"]]
    assert sorted(measured + skipped) == list(range(COUNT + len(bad)))  # each file once, in one batch or the other
    assert len(measured) == COUNT


def test_shards_of_one_run_share_the_folder_and_the_same_shard_twice_is_refused(clean_folder, clean_atlas, tmp_path):
    """The same rule for shards: shard 0 of 2 running, a second shard 0 is refused, shard 1 runs beside it."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_BUILD)
    out = tmp_path / "atlas"
    process = start_slow_build(script, clean_folder, out, "0/2")
    try:
        with pytest.raises(FolderInUseError):
            build(load_watermark_demo(), clean_folder, out, batch_size=1, shard=(0, 2))
        with pytest.raises(FolderInUseError):  # the merge waits for the shards
            build(load_watermark_demo(), clean_folder, out, batch_size=1)
        assert build(load_watermark_demo(), clean_folder, out, batch_size=1, shard=(1, 2)) is None
    finally:
        process.wait(timeout=120)
    assert process.returncode == 0
    assert_same_atlas(build(load_watermark_demo(), clean_folder, out, batch_size=1), clean_atlas)


def page_sources(folder: Path) -> list[str]:
    return re.findall(r'<img src="([^"]*)"', (folder / "atlas.html").read_text(encoding="utf-8"))


def test_file_names_that_are_not_utf8_or_hold_html_are_written_safely(clean_folder, tmp_path):
    """Before, a file name that is not UTF-8 (bytes a Linux folder may hold) ended the run with a UnicodeEncodeError.
    Names with HTML, quotes and ampersands stay text on the page; every image of the page is a relative file that
    exists; the page names no other site."""
    data = tmp_path / "data"
    shutil.copytree(clean_folder, data)
    pixels = first_pixels(clean_folder)
    Image.fromarray(255 - pixels).save(os.fsdecode(os.fsencode(data) + b"/\xff\xfe caf\xe9.png"))
    Image.fromarray(pixels[::-1].copy()).save(data / "<img src=x onerror=alert(1)>.png")
    Image.fromarray(pixels[:, ::-1].copy()).save(data / "a \"quoted\" & 'b' é.png")
    atlas = build(load_watermark_demo(), data, tmp_path / "atlas", top=COUNT + 3)
    names = {reference["image"] for reference in atlas.references(0)}
    assert names == {str(path.relative_to(data)) for path in data.rglob("*.png") if "caf" not in path.name} | {
        "\\xff\\xfe caf\\xe9.png"}
    page = (tmp_path / "atlas" / "atlas.html").read_text(encoding="utf-8")
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;.png" in page
    assert "a &quot;quoted&quot; &amp; &#x27;b&#x27; é.png" in page
    sources = page_sources(tmp_path / "atlas")
    assert len(sources) == 64 * 2 * (COUNT + 3)
    assert all(not source.startswith(("/", "http", "file:")) and (tmp_path / "atlas" / source).is_file()
               for source in sources)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    json.loads((tmp_path / "atlas" / "atlas.json").read_text(encoding="utf-8"))


def test_a_list_of_files_with_a_name_that_is_not_utf8_is_written_safely(clean_folder, tmp_path):
    """The same rule for a list of files, on the demo model's layer4."""
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/\x80.png")
    shutil.copy(sorted(clean_folder.rglob("*.png"))[0], odd)
    atlas = build(load_demo_model(), [odd], tmp_path / "atlas", layer="layer4")
    assert atlas.references(5)[0]["image"] == str(tmp_path / "\\x80.png")
    assert all((tmp_path / "atlas" / source).is_file() for source in page_sources(tmp_path / "atlas"))


@pytest.mark.parametrize("arguments, message", [
    (["--target", "1"], "--target apply to image files, not to a folder"),
    (["--references", "elsewhere", "--concepts", "2"], "--concepts and --references apply to image files"),
])
def test_the_command_line_refuses_options_a_folders_atlas_would_ignore(clean_folder, tmp_path, capsys, arguments,
                                                                       message):
    """Before, `explain concepts DIR --target 1` built the atlas of the predicted classes, --target unsaid."""
    from explain.cli import main

    out = tmp_path / "atlas"
    assert main(["concepts", str(clean_folder), "--model", "demo-watermark", "--layer", "layer3", "--out", str(out),
                 *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_layer_that_is_not_there_or_a_shard_of_image_files_writes_nothing(clean_folder, tmp_path, capsys):
    """A layer name that is not there is refused before the output folder is made (before, an empty folder was left);
    --shard with image files (not a folder) is refused rather than ignored."""
    from explain.cli import main

    with pytest.raises(explain.LayerNotFoundError, match="no layer named 'layer33'"):
        build(load_watermark_demo(), clean_folder, tmp_path / "python", layer="layer33")
    assert not (tmp_path / "python").exists()
    assert main(["concepts", str(clean_folder), "--model", "demo", "--layer", "layer44", "--out",
                 str(tmp_path / "cli")]) == 2
    assert "no layer named 'layer44'" in capsys.readouterr().err and not (tmp_path / "cli").exists()
    image = str(sorted(clean_folder.rglob("*.png"))[0])
    assert main(["concepts", image, "--model", "demo", "--layer", "layer4", "--shard", "0/2", "--out",
                 str(tmp_path / "figure.png")]) == 2
    assert "--shard splits a folder's concept atlas" in capsys.readouterr().err
    assert not (tmp_path / "figure.png").exists()
