"""The command line, the demo, and the shipped demo model's localisation."""

from __future__ import annotations

import urllib.error

import numpy as np
import pytest
import torch
from PIL import Image

from explain import GradCAM
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.data.train import EVALUATION_SEED, accuracy
from explain.models import WeightsUnavailableError, load_model


@pytest.fixture(scope="module")
def demo_model():
    return load_demo_model()


def test_demo_model_is_accurate_on_held_out_images(demo_model):
    assert accuracy(demo_model, count=400) >= 0.95


def test_gradcam_peak_lies_on_the_object_that_decides_the_class(demo_model):
    data = make_dataset(200, seed=EVALUATION_SEED)
    maps = GradCAM(demo_model, "layer4").explain(list(data.images), target=data.labels.tolist()).maps.numpy()
    hits = []
    for heat, mask in zip(maps, data.masks):
        row, column = np.unravel_index(heat.argmax(), heat.shape)
        near = mask[max(row - 3, 0) : row + 4, max(column - 3, 0) : column + 4]  # 3 px ≈ TorchRay's 15 px at 224
        hits.append(near.any())
    assert np.mean(hits) >= 0.9, f"pointing game {np.mean(hits):.2f}"


@pytest.mark.parametrize("model", ["demo", "demo-vit"])
def test_demo_writes_its_figure(model, tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--model", model, "--out", str(out)]) == 0
    figure = np.asarray(Image.open(out))
    assert figure.shape[0] > 300 and figure.shape[1] > 900 and figure.std() > 10
    printed = capsys.readouterr().out
    assert printed.count("predicted") == 6 and "figure written" in printed


def test_cli_writes_an_overlay_per_image_and_prints_the_class(tmp_path, capsys):
    data = make_dataset(2, seed=EVALUATION_SEED)
    paths = []
    for index, image in enumerate(data.images):
        paths.append(tmp_path / f"shape{index}.png")
        Image.fromarray(image).save(paths[-1])
    out = tmp_path / "out"
    assert main([*map(str, paths), "--model", "demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    for path, label, line in zip(paths, data.labels, printed):
        written = out / f"{path.stem}_gradcam_demo.png"
        assert np.asarray(Image.open(written)).shape == (64, 64, 3)
        assert line.startswith(str(path)) and CLASS_NAMES[label] in line and "p=" in line
    assert main([str(paths[0]), "--model", "demo", "--target", "cross", "--out", str(out)]) == 0
    assert "cross (3)" in capsys.readouterr().out


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing.png"), "--model", "demo"]) == 2
    assert "no image file" in capsys.readouterr().err
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(image)
    assert main([str(image), "--model", "demo", "--layer", "layer9"]) == 2
    assert "'layer4'" in capsys.readouterr().err
    assert main([str(image), "--model", "resnet18", "--weights", "random", "--out", str(tmp_path)]) == 0  # layer chosen
    assert "GradCAM @ layer4" in capsys.readouterr().out


def test_cli_on_a_torchvision_model_with_random_weights(tmp_path, capsys):
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 80, 3), dtype=np.uint8)).save(image)
    assert main([str(image), "--model", "resnet18", "--weights", "random", "--layer", "layer4", "--topk", "2",
                 "--out", str(tmp_path)]) == 0
    assert np.asarray(Image.open(tmp_path / "x_gradcam_resnet18_random_layer4_top2.png")).shape == (2 * 224, 224, 3)
    printed = capsys.readouterr()
    assert printed.out.count("p=") == 2 and printed.out.count("[random weights]") == 1
    assert "random weights" in printed.err


def test_weights_that_cannot_be_downloaded_say_how_to_pass_a_file(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", no_network)
    with pytest.raises(WeightsUnavailableError, match="--weights /path/to/resnet18-.*pth"):
        load_model("resnet18", "DEFAULT")
    # a local file works
    path = tmp_path / "weights.pth"
    import torchvision

    reference = torchvision.models.resnet18()
    torch.save({"state_dict": reference.state_dict()}, path)
    loaded = load_model("resnet18", str(path))
    assert torch.equal(loaded.model.fc.weight, reference.fc.weight)
    assert loaded.class_names is not None and len(loaded.class_names) == 1000
    with pytest.raises(FileNotFoundError):
        load_model("resnet18", str(tmp_path / "missing.pth"))
    with pytest.raises(ValueError, match="Did you mean resnet18"):
        load_model("resnet81")
