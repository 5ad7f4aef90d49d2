"""Issue 26, the command line and model loading: each case an ``explain: error:`` line or the right
model (item 15), a resumed batch run after the index's line endings changed (18), no silent
random weights (19), one output file per run's settings (20), hidden folders not explained (23)."""

from __future__ import annotations

import csv
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import transformers
from PIL import Image

import explain
import explain.dataset_tools.batch as batch
import explain.dataset_tools.index as index_module
from explain.cli import main
from explain.data import load_demo_model, make_dataset
from explain.dataset_tools.batch import image_files, item_id
from explain.dataset_tools.index import FIELDS
from explain.models import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: models are built from configs


def run_cli(capsys, arguments) -> tuple[int, str, str]:
    """main(arguments): (exit status, stdout, stderr); a traceback would fail the test."""
    status = main([str(argument) for argument in arguments])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def error_line(capsys, arguments) -> str:
    """The command's one error line (exit status 2)."""
    status, _, err = run_cli(capsys, arguments)
    lines = [line for line in err.splitlines() if line.startswith("explain: error:")]
    assert status == 2 and len(lines) == 1, err
    return lines[0]


@pytest.fixture
def shape_image(tmp_path) -> Path:
    path = tmp_path / "shape.png"
    Image.fromarray(make_dataset(1, seed=7).images[0]).save(path)
    return path


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_vit")
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=1, num_attention_heads=2,
                                    hidden_size=16, intermediate_size=32, num_labels=3)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- item 15: corrupt and pickled weights


def test_a_damaged_safetensors_file_is_an_error_line_for_a_state_dict_and_an_hf_directory(
        tmp_path, shape_image, tiny_vit, capsys):
    from safetensors.torch import save_file

    whole = tmp_path / "demo.safetensors"
    save_file(load_demo_model().state_dict(), str(whole))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # an interrupted download
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    for weights in (truncated, garbage):
        line = error_line(capsys, [shape_image, "--model", "demo", "--weights", weights])
        assert "not a complete safetensors file" in line and "again" in line
    # the same file in an hf: directory (the rule holds for transformers' own loading too)
    damaged = tmp_path / "damaged_vit"
    damaged.mkdir()
    (damaged / "config.json").write_bytes((tiny_vit / "config.json").read_bytes())
    (damaged / "model.safetensors").write_bytes((tiny_vit / "model.safetensors").read_bytes()[:500])
    line = error_line(capsys, [shape_image, "--model", f"hf:{damaged}"])
    assert "damaged or incomplete" in line and "again" in line


def test_an_hf_directory_with_pickled_weights_needs_allow_pickle_and_then_loads_them(
        tmp_path, shape_image, tiny_vit, capsys):
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled_vit"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((tiny_vit / "config.json").read_bytes())
    torch.save(load_file(str(tiny_vit / "model.safetensors")), pickled / "pytorch_model.bin")
    line = error_line(capsys, [shape_image, "--model", f"hf:{pickled}", "--out", tmp_path / "out"])
    assert "pytorch_model.bin" in line and "--allow-pickle" in line and "run code" in line
    with pytest.raises(ValueError, match="allow_pickle=True"):
        load_model(f"hf:{pickled}")
    loaded = load_model(f"hf:{pickled}", allow_pickle=True)
    reference = load_model(f"hf:{tiny_vit}")
    for (name, value), (_, expected) in zip(loaded.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(value, expected), name  # the pickled weights, not a random initialisation
    status, out, _ = run_cli(capsys, [shape_image, "--model", f"hf:{pickled}", "--allow-pickle",
                                      "--out", tmp_path / "out"])
    assert status == 0 and "GradCAM" in out


# ---------------------------------------------------------------- item 15: a full disk during a batch run


def shape_folder(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, picture in enumerate(make_dataset(count, seed=11).images):
        Image.fromarray(picture).save(folder / f"shape{index:02d}.png")
    return folder


def complete_index_rows(index: Path) -> list[dict[str, str]]:
    with open(index, newline="", encoding="utf-8-sig") as file:
        return list(csv.DictReader(file))


def assert_each_image_once(out: Path, folder: Path, targets: int = 1) -> None:
    rows = complete_index_rows(out / "index.csv")
    ids = sorted(item_id(path, folder) for path in image_files(folder))
    assert sorted(row["id"] for row in rows) == sorted(ids * targets)
    for item in ids:
        assert sorted(int(row["k"]) for row in rows if row["id"] == item) == list(range(targets))
        assert batch.MapReader(out).read(item).shape[0] == targets


@pytest.mark.parametrize("fails", ["index sync", "index write", "map"])
def test_a_full_disk_stops_the_batch_with_an_error_line_and_a_resume_finishes(fails, tmp_path, monkeypatch, capsys):
    """The disk fills while the third image's rows are synced (ENOSPC from fsync, as on delayed
    allocation), while they are written (half of them written), or while the fourth map is written
    (batches of one image: a batch's rows are synced, and its maps written, at once)."""
    folder = shape_folder(tmp_path / "images", 6)
    out = tmp_path / "out"
    calls = {"count": 0}
    real_fsync, real_save_maps = os.fsync, batch._save_maps_file
    real_write_all = index_module._write_all

    def sync_fills_the_disk(descriptor):
        calls["count"] += 1
        if calls["count"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(descriptor)

    def write_fills_the_disk(descriptor, data):
        calls["count"] += 1
        if calls["count"] == 3:
            real_write_all(descriptor, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write_all(descriptor, data)

    def map_fills_the_disk(path, maps):
        calls["count"] += 1
        if calls["count"] == 4:
            Path(path).write_bytes(b"PK\x03\x04")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save_maps(path, maps)

    if fails == "index sync":
        monkeypatch.setattr(batch.os, "fsync", sync_fills_the_disk)
    elif fails == "index write":
        monkeypatch.setattr(index_module, "_write_all", write_fills_the_disk)
    else:
        monkeypatch.setattr(batch, "_save_maps_file", map_fills_the_disk)
    command = ["batch", folder, "--model", "demo", "--out", out, "--batch-size", "1", "--topk", "2", "--no-progress"]
    line = error_line(capsys, command)
    assert "no space left" in line and "free some space and run the same command again" in line
    kept = 3 if fails == "map" else 2
    assert f"({kept} by this run)" in line
    raw = (out / "index.csv").read_bytes()
    assert raw.endswith(b"\r\n") and len(complete_index_rows(out / "index.csv")) == 2 * kept  # no torn rows
    assert not list(out.rglob("*.part"))  # no temporary file left behind
    monkeypatch.undo()
    status, printed, _ = run_cli(capsys, command)
    assert status == 0 and f"{6 - kept} image(s) explained, {kept} already done" in printed
    assert_each_image_once(out, folder, targets=2)


# ---------------------------------------------------------------- item 15: CLIP, segmentation models


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_clip")
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8, projection_dim=8), projection_dim=8)
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(folder)
    return folder


def test_clip_on_the_command_line_is_an_error_line_whose_advice_works(tiny_clip, tmp_path, shape_image, capsys):
    for output in ("logits_per_image", "image_embeds"):
        line = error_line(capsys, [shape_image, "--model", f"hf:{tiny_clip}", "--output", output])
        assert "CLIPModel" in line and "input_ids" in line and "forward_kwargs" in line
    # the Python recipe of the message
    loaded = load_model(f"hf:{tiny_clip}", output="logits_per_image")
    prompts = torch.tensor([[1, 5, 7, 2], [1, 9, 3, 2], [1, 4, 4, 2]])
    explanation = explain.Saliency(loaded.model, output="logits_per_image", preprocess=loaded.preprocess).explain(
        str(shape_image), target=[[0, 1, 2]], forward_kwargs=dict(input_ids=prompts), input_position="pixel_values",
        per_image=[])
    assert explanation.map_grid.shape == (1, 3, 32, 32)
    # and its command-line recipe: the image tower saved once, then --output image_embeds
    tower = tmp_path / "tower"
    transformers.CLIPVisionModelWithProjection.from_pretrained(tiny_clip).save_pretrained(tower)
    status, out, _ = run_cli(capsys, [shape_image, "--model", f"hf:{tower}", "--output", "image_embeds",
                                      "--target", "3", "--out", tmp_path / "out"])
    assert status == 0 and "-> " in out


def no_download(*args, **kwargs):
    raise AssertionError("a download was attempted")


@pytest.mark.parametrize("name", ["deeplabv3_resnet50", "lraspp_mobilenet_v3_large",
                                  "fasterrcnn_mobilenet_v3_large_320_fpn"])
def test_torchvision_segmentation_and_detection_models_load_without_downloading(name, monkeypatch):
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", no_download)
    loaded = load_model(name)
    assert loaded.random_weights and loaded.task == ("detection" if "rcnn" in name else "segmentation")


def test_a_torchvision_segmenter_from_the_command_line_explains_a_class_over_its_pixels(tmp_path, monkeypatch,
                                                                                     capsys):
    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", no_download)
    image = tmp_path / "street.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(image)
    common = [image, "--model", "lraspp_mobilenet_v3_large", "--weights", "random", "--size", "48"]
    assert "--target CLASS" in error_line(capsys, common)
    torch.manual_seed(3)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    torch.save(model.state_dict(), tmp_path / "seg.pt")
    steps = load_model("lraspp_mobilenet_v3_large", size=(48,)).preprocess
    predicted = int(model(steps(Image.open(image).convert("RGB"))[None])["out"].argmax(1).flatten().mode().values)
    status, out, _ = run_cli(capsys, [image, "--model", "lraspp_mobilenet_v3_large", "--weights", tmp_path / "seg.pt",
                                      "--size", "48", "--target", predicted, "--out", tmp_path / "out"])
    assert status == 0
    written = Path(out.split("-> ")[1].split(" (")[0].strip())
    target = explain.SegmentationTarget(predicted)
    expected = explain.GradCAM(model, preprocess=steps).explain(str(image), target=target)
    np.testing.assert_array_equal(np.asarray(Image.open(written)), expected.overlay()[0])


def test_an_hf_segformer_keeps_its_decode_head(tmp_path, capsys):
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                                          mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)
    torch.manual_seed(0)
    segformer = transformers.SegformerForSemanticSegmentation(config).eval()
    segformer.save_pretrained(tmp_path / "segformer")
    loaded = load_model(f"hf:{tmp_path / 'segformer'}")
    assert type(loaded.model) is transformers.SegformerForSemanticSegmentation and loaded.task == "segmentation"
    pixels = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(pixels).logits, segformer(pixels).logits)  # the trained decode head
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    status, out, err = run_cli(capsys, [image, "--model", f"hf:{tmp_path / 'segformer'}", "--target", "1",
                                        "--out", tmp_path / "out"])
    assert status == 0 and "-> " in out, err


# ---------------------------------------------------------------- item 18: line endings and byte-order marks


class Stop(Exception):
    pass


def stop_after_first_batch(done: int) -> None:
    raise Stop


@pytest.mark.parametrize("edit", ["lf", "lf+bom", "crlf+bom"])
def test_a_resumed_batch_accepts_an_index_saved_with_other_line_endings_or_a_bom(edit, tmp_path):
    folder = shape_folder(tmp_path / "images", 5)
    out = tmp_path / "out"
    explainer = explain.GradCAM(load_demo_model(), "layer4")
    with pytest.raises(Stop):
        batch.run(explainer, folder, out, topk=2, batch_size=2, progress=False, on_batch=stop_after_first_batch)
    index = out / "index.csv"
    text = index.read_bytes()
    assert text.count(b"\r\n") == 1 + 2 * 2  # header and two images' two rows, as explain writes them
    if edit.startswith("lf"):
        text = text.replace(b"\r\n", b"\n")
    if edit.endswith("bom"):
        text = b"\xef\xbb\xbf" + text
    index.write_bytes(text)
    summary = batch.run(explainer, folder, out, topk=2, batch_size=2, progress=False)
    assert (summary.explained, summary.already_done) == (3, 2)
    assert_each_image_once(out, folder, targets=2)
    lines = index.read_bytes().splitlines(keepends=True)
    ending = b"\n" if edit.startswith("lf") else b"\r\n"
    assert all(line.endswith(ending) and not line.endswith(b"\r\r\n") for line in lines)  # its own line ending
    assert (not edit.startswith("lf")) or not any(line.endswith(b"\r\n") for line in lines)
    batch.run(explainer, folder, out, topk=2, batch_size=2, progress=False)  # a third run: nothing added
    assert_each_image_once(out, folder, targets=2)


def test_an_index_with_old_mac_line_endings_is_refused_not_cut(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    text = (",".join(FIELDS) + "\r" + "a,a.png,0,0,1,,1,,maps/a.npy\r").encode()
    (out / "index.csv").write_bytes(text)
    with pytest.raises(ValueError, match="not an index"):
        batch.run(explain.GradCAM(load_demo_model(), "layer4"), shape_folder(tmp_path / "images", 1), out,
                  progress=False)
    assert (out / "index.csv").read_bytes() == text  # untouched


# ---------------------------------------------------------------- item 19: random weights are never silent


def test_an_architecture_without_weights_is_refused_with_the_choices(tmp_path, shape_image, capsys):
    line = error_line(capsys, [shape_image, "--model", "resnet18", "--out", tmp_path / "out"])
    for choice in ("random", "--weights DEFAULT", "IMAGENET1K_V1", "--weights FILE", "--weights random"):
        assert choice in line
    line = error_line(capsys, [shape_image, "--model", "timm:resnet18", "--out", tmp_path / "out"])
    assert "--weights pretrained" in line and "--weights random" in line and "DEFAULT" not in line
    line = error_line(capsys, ["batch", tmp_path, "--model", "mobilenet_v3_small", "--out", tmp_path / "out"])
    assert "--weights DEFAULT" in line and "IMAGENET1K_V1" in line
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_random_weights_said_loudly_and_the_shipped_models_need_no_weights(tmp_path, shape_image, capsys):
    status, out, err = run_cli(capsys, [shape_image, "--model", "resnet18", "--weights", "random", "--size", "64",
                                        "--out", tmp_path])
    assert status == 0 and "random weights" in err and "mean nothing" in err and "[random weights]" in out
    for model in ("demo", "demo-vit"):
        status, out, err = run_cli(capsys, [shape_image, "--model", model, "--out", tmp_path])
        assert status == 0 and "random weights" not in out + err
    assert load_model("resnet18", "random").random_weights
    assert load_model("demo", "random").random_weights and not load_model("demo").random_weights
    with pytest.raises(ValueError, match="brings its own weights"):
        load_model("hf:some/model", "random")


# ---------------------------------------------------------------- item 20: one file per run's settings


def test_eight_runs_with_other_models_layers_and_targets_into_one_folder_leave_eight_files(
        tmp_path, shape_image, tiny_vit, capsys):
    torch.save(load_demo_model().state_dict(), tmp_path / "demo weights.pt")
    out = tmp_path / "out"
    runs = [["--model", "demo"], ["--model", "demo", "--layer", "layer3"], ["--model", "demo", "--target", "1"],
            ["--model", "demo", "--topk", "2"], ["--model", "demo", "--weights", tmp_path / "demo weights.pt"],
            ["--model", "demo-vit"], ["--model", "resnet18", "--weights", "random", "--size", "64"],
            ["--model", f"hf:{tiny_vit}"]]
    written = []
    for options in runs:
        status, printed, err = run_cli(capsys, [shape_image, *options, "--out", out])
        assert status == 0, err
        written.append(Path(printed.split("-> ")[1].strip()))
    assert len(set(written)) == 8 and sorted(written) == sorted(out.iterdir())
    for path in written:
        assert re.fullmatch(r"shape_gradcam_[A-Za-z0-9._=-]+\.png", path.name), path.name
    assert {path.name for path in written} >= {"shape_gradcam_demo.png", "shape_gradcam_demo_layer3.png",
                                               "shape_gradcam_demo_t1.png", "shape_gradcam_demo_top2.png",
                                               "shape_gradcam_demo-vit.png", f"shape_gradcam_hf-{tiny_vit.name}.png",
                                               "shape_gradcam_demo_demo-weights.png"}


def test_an_existing_file_from_other_settings_is_kept_and_the_same_settings_replace_their_own(
        tmp_path, shape_image, capsys):
    out = tmp_path / "out"
    out.mkdir()
    foreign = out / "shape_gradcam_demo.png"
    Image.new("RGB", (8, 8), "red").save(foreign)
    before = foreign.read_bytes()
    status, printed, _ = run_cli(capsys, [shape_image, "--model", "demo", "--out", out])
    assert status == 0 and foreign.read_bytes() == before
    assert printed.strip().endswith(f"-> {out / 'shape_gradcam_demo-2.png'} (shape_gradcam_demo.png holds another "
                                    "run's result: kept; this one numbered)")
    status, printed, _ = run_cli(capsys, [shape_image, "--model", "demo", "--out", out])  # the same command again
    assert printed.strip().endswith("-2.png (shape_gradcam_demo.png holds another run's result: kept; replaced the "
                                    "earlier result of the same settings)")
    # an image of the same name from another folder is another run's result too
    other = tmp_path / "elsewhere" / "shape.png"
    other.parent.mkdir()
    Image.fromarray(make_dataset(2, seed=3).images[1]).save(other)
    status, printed, _ = run_cli(capsys, [other, "--model", "demo", "--out", out])
    assert printed.strip().endswith("shape_gradcam_demo-3.png (shape_gradcam_demo.png holds another run's result: "
                                    "kept; this one numbered)")
    assert sorted(path.name for path in out.iterdir()) == ["shape_gradcam_demo-2.png", "shape_gradcam_demo-3.png",
                                                           "shape_gradcam_demo.png"]


# ---------------------------------------------------------------- item 23: hidden folders, python -m explain


def test_hidden_files_and_folders_are_not_explained(tmp_path, capsys):
    root = tmp_path / ".data" / "images"  # a hidden folder above the one given still counts
    shape_folder(root, 2)
    shape_folder(root / "sub", 1)
    for hidden in (root / ".ipynb_checkpoints", root / "sub" / ".git", root / ".cache" / "deeper"):
        shape_folder(hidden, 1)
    Image.fromarray(make_dataset(1, seed=1).images[0]).save(root / ".hidden.png")
    expected = [root / "shape00.png", root / "shape01.png", root / "sub" / "shape00.png"]
    assert image_files(root) == expected
    status, printed, _ = run_cli(capsys, ["batch", root, "--model", "demo", "--out", tmp_path / "out", "--no-progress"])
    assert status == 0 and "3 image(s) explained" in printed
    assert sorted(row["id"] for row in complete_index_rows(tmp_path / "out" / "index.csv")) == sorted(
        item_id(path, root) for path in expected)


def test_importing_explain_main_does_not_run_the_command():
    """mkdocstrings (griffe, force_inspection) imports every module, explain.__main__ too: with
    ``mkdocs build`` as sys.argv the command ran and printed a stray ``explain: error:`` line."""
    code = "import sys; sys.argv = ['mkdocs', 'build']; import explain.__main__; print('imported')"
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "explain: error" not in finished.stderr and "imported" in finished.stdout
