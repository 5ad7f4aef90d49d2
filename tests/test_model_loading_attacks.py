"""Model loading attacked with checkpoints as users have them (random weights, saved by the test; nothing
is downloaded): prefixes of torch.compile around DDP, wrappers that keep a few keys outside the model's
prefix (a Lightning module's loss weights, an EMA's counter), training checkpoints holding numpy scalars
or argparse.Namespace, whole pickled models that cannot be unpickled, options a source silently ignores,
torchvision weights of another architecture, and missing HuggingFace directories or config.json."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from test_cli_errors import fails_with

from explain.data.demo import DemoNet
from explain.models import WeightsUnavailableError, load_model

torch.set_num_threads(1)


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def demo_state(num_classes: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return DemoNet(num_classes=num_classes).state_dict()


def assert_loaded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        assert torch.equal(got[key], value), key


# ---------------------------------------------------------------- prefixes and wrappers


def test_torch_compile_around_ddp_prefix_is_removed(tmp_path):
    """torch.compile(DDP(model)).state_dict() has keys "_orig_mod.module.…" (the order the DDP docs
    recommend); "module._orig_mod." already works, this order did not (the prefixes are tried once each,
    "module." before "_orig_mod.")."""
    state = demo_state()
    path = tmp_path / "compiled_ddp.pt"
    torch.save({f"_orig_mod.module.{key}": value for key, value in state.items()}, path)
    assert_loaded(load_model("demo", str(path)).model, state)


def test_averaged_model_state_dict_with_its_counter_loads(tmp_path):
    """torch.optim.swa_utils.AveragedModel (SWA / EMA) saves "module.…" keys and an "n_averaged" buffer:
    the prefix is only removed when every key has it, so the file did not fit the model."""
    torch.manual_seed(0)
    averaged = torch.optim.swa_utils.AveragedModel(DemoNet())
    state = averaged.module.state_dict()
    path = tmp_path / "swa.pt"
    torch.save(averaged.state_dict(), path)
    assert_loaded(load_model("demo", str(path)).model, state)


def test_lightning_checkpoint_with_a_loss_buffer_outside_the_model_loads(tmp_path):
    """A LightningModule with self.model and self.criterion = nn.CrossEntropyLoss(weight=...) saves
    "model.…" keys and "criterion.weight": the "model." prefix was kept, nothing fitted."""
    state = demo_state()
    wrapped = {f"model.{key}": value for key, value in state.items()}
    wrapped["criterion.weight"] = torch.ones(4)
    path = tmp_path / "epoch=3.ckpt"
    torch.save({"state_dict": wrapped, "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0"}, path)
    assert_loaded(load_model("demo", str(path)).model, state)


# ---------------------------------------------------------------- checkpoints with pickled extras


@pytest.mark.parametrize("extra", [{"best_acc1": np.float64(0.7)}, {"args": argparse.Namespace(lr=0.1)}],
                         ids=["numpy-scalar", "argparse-namespace"])
def test_training_checkpoint_with_pickled_extras_loads_with_allow_pickle(tmp_path, extra):
    """timm's train.py and the PyTorch ImageNet example save {"state_dict", "args": Namespace, ...} or numpy
    metrics. weights_only refuses them; allow_pickle=True must then unpickle the trusted file (it was
    ignored for --weights: the file could not be loaded at all)."""
    state = demo_state()
    path = tmp_path / "checkpoint.pth.tar"
    torch.save({"epoch": 3, "arch": "demo", "state_dict": state, **extra}, path)
    assert_loaded(load_model("demo", str(path), allow_pickle=True).model, state)


def test_checkpoint_with_pickled_extras_error_gives_a_fix_that_works(tmp_path, image, capsys):
    """Without --allow-pickle, the error advised `--model FILE --allow-pickle` (a whole model), which then
    fails with "holds a dict, not a model". The advice must be the flag with --weights."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"state_dict": demo_state(), "best_acc1": np.float64(0.7)}, path)
    line = fails_with(capsys, [str(image), "--model", "demo", "--weights", str(path), "--out", str(tmp_path / "o")],
                      "--allow-pickle")
    assert "--model FILE" not in line, line
    line = fails_with(capsys, [str(image), "--model", str(path), "--allow-pickle", "--out", str(tmp_path / "o")])
    # following the old advice leads nowhere: at least say to name the architecture with --weights
    assert "--weights" in line, line


# ---------------------------------------------------------------- whole pickled models


def whole_model_of_a_missing_class(tmp_path, monkeypatch) -> str:
    """A torch.save(model) of a class from a training script that is not importable here."""
    module_name = "attack_training_script_models"
    (tmp_path / f"{module_name}.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.conv = torch.nn.Conv2d(3, 4, 3); "
        "self.fc = torch.nn.Linear(4, 3)\n"
        "    def forward(self, x):\n        return self.fc(self.conv(x).mean((2, 3)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(module_name)
    path = tmp_path / "whole.pt"
    torch.save(module.Net(), path)
    del sys.modules[module_name]
    (tmp_path / f"{module_name}.py").unlink()
    return str(path)


def test_whole_model_whose_class_cannot_be_imported_is_a_clear_error(tmp_path, image, capsys, monkeypatch):
    """Unpickling a model defined in a training script raised AttributeError ("Can't get attribute 'Net'")
    through the command line: a traceback, exit status 1."""
    path = whole_model_of_a_missing_class(tmp_path, monkeypatch)
    missing = "attack_training_script_models"  # what cannot be imported: the module that defined Net
    fails_with(capsys, [str(image), "--model", path, "--allow-pickle", "--out", str(tmp_path / "o")], missing)
    fails_with(capsys, ["layers", path, "--allow-pickle"], missing)


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_whole_model_file_is_a_clear_error(tmp_path, image, capsys, damage):
    """An empty (EOFError) or truncated (RuntimeError from the zip reader) whole-model file gave a traceback."""
    path = tmp_path / "whole.pt"
    torch.save(DemoNet(), path)
    data = path.read_bytes()
    path.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    fails_with(capsys, [str(image), "--model", str(path), "--allow-pickle", "--out", str(tmp_path / "o")],
               str(path))
    with pytest.raises((WeightsUnavailableError, ValueError)):
        load_model(str(path), allow_pickle=True)


def test_weights_for_a_whole_model_file_are_not_silently_ignored(tmp_path):
    """--model whole.pt --allow-pickle --weights other.pt loaded whole.pt's own weights and named the output
    files after other.pt: apply the weights, or refuse the combination."""
    torch.manual_seed(0)
    whole, other = DemoNet(), DemoNet()
    torch.save(whole, tmp_path / "whole.pt")
    torch.save(other.state_dict(), tmp_path / "other.pt")
    try:
        loaded = load_model(str(tmp_path / "whole.pt"), str(tmp_path / "other.pt"), allow_pickle=True)
    except ValueError as error:
        assert "weights" in str(error)
    else:
        assert_loaded(loaded.model, other.state_dict())


@pytest.mark.parametrize("source", ["demo", "whole-file"])
def test_num_classes_is_not_silently_ignored(tmp_path, source):
    """num_classes=10 (--num-classes 10) gave the demo's or a whole file's 4 classes without a word; the
    demo's mismatch error even says "add --num-classes 10", which then changes nothing."""
    if source == "whole-file":
        torch.save(DemoNet(), tmp_path / "whole.pt")
        source = str(tmp_path / "whole.pt")
    try:
        loaded = load_model(source, num_classes=10, allow_pickle=True)
    except ValueError as error:
        assert "num" in str(error).lower()
    else:
        assert loaded.model(torch.zeros(1, 3, 64, 64)).shape[-1] == 10


def test_demo_fine_tuned_with_ten_classes_follows_the_hint(tmp_path):
    state = demo_state(10)
    torch.save(state, tmp_path / "demo10.pt")
    with pytest.raises(WeightsUnavailableError, match="num-classes 10"):
        load_model("demo", str(tmp_path / "demo10.pt"))
    # the fix the message gives must work (or the message must not give it)
    assert_loaded(load_model("demo", str(tmp_path / "demo10.pt"), num_classes=10).model, state)


# ---------------------------------------------------------------- messages


def test_torchvision_weights_of_another_architecture_are_not_a_download_failure(tmp_path, image, capsys):
    """resnet50 with ResNet18_Weights.IMAGENET1K_V1: torchvision's TypeError was reported as "could not
    download ... This machine may have no network. Download resnet18-….pth" — resnet18's file for resnet50."""
    with pytest.raises(ValueError) as raised:
        load_model("resnet50", "ResNet18_Weights.IMAGENET1K_V1")
    assert "download" not in str(raised.value).lower(), raised.value
    assert "ResNet50_Weights" in str(raised.value)
    fails_with(capsys, [str(image), "--model", "resnet50", "--weights", "ResNet18_Weights.IMAGENET1K_V1",
                        "--out", str(tmp_path / "o")], "ResNet50_Weights")


def test_num_classes_hint_only_when_the_head_is_the_only_difference(tmp_path):
    """mobilenet_v3_small weights (10 classes) for mobilenet_v3_large: the message said "add --num-classes
    10", which does not make them fit; the architectures differ."""
    torch.manual_seed(0)
    path = tmp_path / "small10.pt"
    torch.save(torchvision.models.mobilenet_v3_small(num_classes=10).state_dict(), path)
    with pytest.raises(WeightsUnavailableError) as raised:
        load_model("mobilenet_v3_large", str(path))
    assert "num-classes" not in str(raised.value), raised.value
    with pytest.raises(WeightsUnavailableError):  # the old hint's advice does not help
        load_model("mobilenet_v3_large", str(path), num_classes=10)


def test_missing_checkpoint_pth_tar_is_a_missing_file(tmp_path):
    """"checkpoint.pth.tar" (the PyTorch ImageNet example's name) that is not there was taken for a
    torchvision weights name: "Invalid weight name provided: 'checkpoint.pth.tar'"."""
    with pytest.raises(FileNotFoundError, match="checkpoint.pth.tar"):
        load_model("resnet18", "checkpoint.pth.tar")


def test_safetensors_file_with_another_suffix_is_not_called_a_pickle(tmp_path):
    """A safetensors file saved as weights.pt was reported as "holds pickled Python objects ... a whole model":
    load it (its header says what it is), or say it is safetensors."""
    from safetensors.torch import save_file

    state = demo_state()
    path = tmp_path / "weights.pt"
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    try:
        loaded = load_model("demo", str(path))
    except WeightsUnavailableError as error:
        assert "safetensors" in str(error) and "whole model" not in str(error), error
    else:
        assert_loaded(loaded.model, state)


# ---------------------------------------------------------------- HuggingFace directories


@pytest.fixture
def tiny_vit_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=3,
                                    id2label={0: "cat", 1: "dog", 2: "bird"}, label2id={"cat": 0, "dog": 1, "bird": 2})
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "vit")
    return tmp_path / "vit", model


def test_huggingface_directory_loads_bit_identical_with_its_labels(tiny_vit_directory):
    directory, model = tiny_vit_directory
    loaded = load_model(f"hf:{directory}")
    assert loaded.class_names == ["cat", "dog", "bird"]
    assert not loaded.model.training and loaded.input_size == (3, 32, 32)
    assert_loaded(loaded.model, model.state_dict())


def test_huggingface_directory_that_does_not_exist_is_not_a_network_problem(tmp_path, image, capsys):
    """hf:/a/missing/directory was taken for a hub id: "Repo id must be in the form ..." and "A hub id needs
    the network"."""
    missing = tmp_path / "no_such_model"
    with pytest.raises((FileNotFoundError, ValueError, WeightsUnavailableError)) as raised:
        load_model(f"hf:{missing}")
    text = str(raised.value)
    assert "network" not in text and "Repo id" not in text, text
    assert str(missing) in text


def test_huggingface_directory_without_config_json_says_so(tiny_vit_directory, image, capsys):
    """A directory with model.safetensors but no config.json: "transformers cannot build ... with its Auto
    classes: Unrecognized model" — the file is missing, not the architecture unknown."""
    directory, _ = tiny_vit_directory
    (directory / "config.json").unlink()
    line = fails_with(capsys, [str(image), "--model", f"hf:{directory}", "--out", str(directory.parent / "o")],
                      "config.json")
    assert "Auto classes" not in line, line
    assert re.search(r"no config\.json|config\.json (is )?missing|without (a )?config\.json|(lacks|has no) "
                     r"config\.json", line), line


def test_huggingface_directory_without_the_hf_prefix_gets_a_hint(tiny_vit_directory, image, capsys):
    directory, _ = tiny_vit_directory
    fails_with(capsys, [str(image), "--model", str(directory), "--out", str(directory.parent / "o")],
               f"hf:{directory}")
    json.loads((directory / "config.json").read_text())  # the directory is intact
