"""The image command and ``explain.load_model`` attacked as a hostile user would (session 10): each bad input is one
``explain: error:`` line with the fix, before any image is explained where it concerns every image; each accepted
input gives the map Python gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.cli import main, make_explainer
from explain.data import make_dataset
from explain.data.demo import DemoNet


@pytest.fixture
def image(tmp_path) -> Path:
    path = tmp_path / "shape.png"
    Image.fromarray(make_dataset(1, seed=0).images[0]).save(path)
    return path


def one_error(capsys, arguments: list[str]) -> str:
    """The single ``explain: error:`` line of a failed command (exit status 2, no traceback, nothing else said)."""
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    lines = [line for line in error.splitlines() if line.startswith("explain: error:")]
    assert len(lines) == 1, error
    return lines[0]


def test_a_reason_shared_by_every_image_is_said_once(capsys, tmp_path, image):
    other = tmp_path / "other.png"
    Image.fromarray(make_dataset(2, seed=1).images[1]).save(other)
    line = one_error(capsys, [str(image), str(other), "--model", "demo", "--target", "4", "--out", str(tmp_path / "o")])
    assert line == ("explain: error: class index 4 is out of range: the model has 4 classes (0 to 3). (each of the 2 "
                    "images)")
    line = one_error(capsys, [str(tmp_path / "missing.png"), "--model", "demo", "--out", str(tmp_path / "o")])
    assert line == f"explain: error: no image file at {str(tmp_path / 'missing.png')!r}."


def test_alpha_and_target_with_topk_are_refused_before_the_model_runs(capsys, tmp_path, image):
    out = tmp_path / "o"
    assert one_error(capsys, [str(image), "--model", "demo", "--alpha", "2", "--out", str(out)]) == (
        "explain: error: --alpha is the heatmap's opacity, in [0, 1]; got 2.0.")
    assert "give one of them" in one_error(capsys, [str(image), "--model", "demo", "--target", "1", "--topk", "2",
                                                    "--out", str(out)])
    assert "--layer is empty" in one_error(capsys, [str(image), "--model", "demo", "--layer", " ", "--out", str(out)])
    assert not out.exists()  # nothing written


def test_empty_class_names_are_refused(capsys, tmp_path, image):
    names = tmp_path / "names.txt"
    names.write_text("\n\n")
    assert "holds no names" in one_error(capsys, [str(image), "--model", "demo", "--class-names", str(names)])
    with pytest.raises(ValueError, match="class_names is empty"):
        explain.load_model("demo", class_names=[])
    with pytest.raises(IsADirectoryError, match="is a folder"):
        explain.load_model("demo", class_names=tmp_path)


def test_class_names_with_a_byte_order_mark_and_crlf(tmp_path):
    names = tmp_path / "names.txt"
    names.write_bytes("\ufeffdisc\r\nsquare\r\n\r\ntriangle\r\ncross\r\n".encode("utf-8"))
    assert explain.load_model("demo", class_names=names).class_names == ["disc", "square", "triangle", "cross"]


def test_statistics_in_0_255_units_are_refused(capsys, image):
    line = one_error(capsys, [str(image), "--model", "demo", "--mean", "124", "117", "104"])
    assert "--mean values lie in [0, 1]" in line and "divided by 255" in line
    with pytest.raises(ValueError, match="std values lie in"):
        explain.load_model("demo", std=[float("nan")])


def test_a_target_with_spaces_and_a_name_in_other_letters(capsys, tmp_path, image):
    names = tmp_path / "names.txt"
    names.write_text("круг\n正方形\ntriángulo\ncross\n", encoding="utf-8")
    out = tmp_path / "o"
    assert main([str(image), "--model", "demo", "--target", " 1", "--out", str(out)]) == 0
    with_names = [str(image), "--model", "demo", "--class-names", str(names), "--out", str(out)]
    assert main([*with_names, "--target", "正方形"]) == 0
    assert main([*with_names, "--target", "круг"]) == 0
    written = capsys.readouterr().out
    assert "square (1)" in written and "正方形 (1)" in written and "круг (0)" in written
    names_written = sorted(path.name for path in out.iterdir())
    assert len(names_written) == 3 and not any(name.endswith("-2.png") for name in names_written), names_written
    # the overlay is what Python writes for the same call
    loaded = explain.load_model("demo", class_names=names)
    explanation = make_explainer("gradcam", loaded).explain(str(image), target="正方形")
    explanation.save(tmp_path / "python.png")
    by_name = [path for path in out.iterdir() if path.name.startswith("shape_gradcam_demo_t") and "t1" not in path.name]
    pictures = [np.asarray(Image.open(path).convert("RGB")) for path in by_name]
    assert any(np.array_equal(picture, np.asarray(Image.open(tmp_path / "python.png").convert("RGB")))
               for picture in pictures)


def test_load_model_takes_paths_and_single_numbers(tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save(DemoNet(), whole)
    assert isinstance(explain.load_model(whole, allow_pickle=True).model, DemoNet)
    loaded = explain.load_model("demo", size=32, mean=0.5, std=0.25)
    assert loaded.input_size == (3, 32, 32)
    tensor = loaded.preprocess(Image.new("RGB", (64, 48), (255, 0, 0)))
    assert tuple(tensor.shape) == (3, 32, 32)
    assert torch.allclose(tensor[0], torch.full((32, 32), 2.0))  # (1 - 0.5) / 0.25
    assert torch.allclose(tensor[1], torch.full((32, 32), -2.0))  # (0 - 0.5) / 0.25


def test_a_whole_model_given_as_weights(capsys, tmp_path, image):
    whole = tmp_path / "whole.pt"
    torch.save(DemoNet(), whole)
    line = one_error(capsys, [str(image), "--model", "demo", "--weights", str(whole), "--allow-pickle"])
    assert "holds a whole model (DemoNet)" in line and f"--model {whole} --allow-pickle" in line


def test_a_pretrained_name_for_a_shipped_model(capsys, image):
    line = one_error(capsys, [str(image), "--model", "demo", "--weights", "DEFAULT"])
    assert "comes with its trained weights: leave out --weights" in line


def test_a_torchvision_vit_is_built_for_size(capsys, tmp_path, image):
    torch.manual_seed(0)
    loaded = explain.load_model("vit_b_16", "random", size=[32])
    assert loaded.model.image_size == 32 and loaded.input_size == (3, 32, 32)
    assert loaded.model(torch.zeros(1, 3, 32, 32)).shape == (1, 1000)
    line = one_error(capsys, [str(image), "--model", "vit_b_16", "--weights", "random", "--size", "32", "48"])
    assert "vit_b_16 takes square inputs of whole 16-pixel patches" in line and "e.g. 32" in line
