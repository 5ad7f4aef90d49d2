"""The command line answers bad arguments with one `explain: error:` line that says the fix, and
exit status 2, never a traceback (issue 13, item 17)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import explain
from explain.cli import main, output_names
from explain.data import load_demo_model, make_dataset


@pytest.fixture
def image(tmp_path) -> Path:
    path = tmp_path / "shape.png"
    Image.fromarray(make_dataset(1, seed=0).images[0]).save(path)
    return path


def fails_with(capsys, arguments: list[str], *patterns: str) -> str:
    with pytest.raises(SystemExit) as exited:
        status = main(arguments)
        raise SystemExit(status)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    line = [line for line in error.splitlines() if line.startswith("explain: error:")]
    assert len(line) == 1, error
    for pattern in patterns:
        assert pattern in line[0], (pattern, line[0])
    return line[0]


def test_weights_of_another_architecture_for_the_demo_model(capsys, tmp_path, image):
    weights = tmp_path / "resnet.pt"
    torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), weights)
    fails_with(capsys, [str(image), "--model", "demo", "--weights", str(weights)], "do not fit the demo model",
               "another architecture")


def test_a_text_file_as_weights(capsys, tmp_path, image):
    weights = tmp_path / "notes.pt"
    weights.write_text("these are not weights")
    fails_with(capsys, [str(image), "--model", "demo", "--weights", str(weights)], "could not read weights",
               "torch.save(model.state_dict()")


def test_an_unknown_colour_map(capsys, image, tmp_path):
    fails_with(capsys, [str(image), "--model", "demo", "--cmap", "virdis", "--out", str(tmp_path)],
               "'virdis' is not a matplotlib colour map", "viridis")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_and_an_unknown_device(capsys, image, tmp_path):
    fails_with(capsys, [str(image), "--model", "demo", "--device", "cuda", "--out", str(tmp_path)],
               "no CUDA GPU", "--device cpu")
    fails_with(capsys, [str(image), "--model", "demo", "--device", "gpu0", "--out", str(tmp_path)],
               "not a device", "cpu, cuda")
    fails_with(capsys, ["batch", str(image.parent), "--model", "demo", "--device", "cuda", "--out",
                        str(tmp_path / "o")], "no CUDA GPU")


def test_an_output_that_is_a_file(capsys, image, tmp_path):
    existing = tmp_path / "results.txt"
    existing.write_text("")
    fails_with(capsys, [str(image), "--model", "demo", "--out", str(existing)], "is a file", "give a folder")
    fails_with(capsys, ["batch", str(image.parent), "--model", "demo", "--out", str(existing)], "is a file")


def test_negative_sizes_and_batch_sizes(capsys, image, tmp_path):
    fails_with(capsys, ["layers", "demo", "--input-size", "3", "-64", "64"], "must be at least 1")
    for size in ("0", "-4", "four"):
        fails_with(capsys, ["batch", str(image.parent), "--model", "demo", "--out", str(tmp_path / "o"),
                            "--batch-size", size], "--batch-size")


def test_inputs_with_the_same_stem_get_their_own_outputs(tmp_path):
    data = make_dataset(3, seed=4)
    paths = [tmp_path / "a" / "x.png", tmp_path / "b" / "x.png", tmp_path / "x.jpg"]
    for path, picture in zip(paths, data.images):
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(picture).save(path, quality=100) if path.suffix == ".jpg" else Image.fromarray(picture).save(
            path)
    out = tmp_path / "out"
    assert main([*map(str, paths), "--model", "demo", "--out", str(out)]) == 0
    written = sorted(out.glob("*.png"))
    assert len(written) == 3
    model = explain.GradCAM(load_demo_model(), "layer4")
    for path, name in zip(paths, output_names([str(path) for path in paths])):
        expected = model.explain(str(path)).save(tmp_path / "expected.png")
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{name}_gradcam_demo.png")),
                                      np.asarray(Image.open(expected)))
    assert output_names(["x.png", "x.png"]) == ["x_png-1", "x_png-2"]


def test_the_command_runs_as_a_module_without_a_traceback_on_bad_input(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "explain", "batch", str(tmp_path / "missing"), "--model", "demo",
                             "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("explain: error: no folder at")
