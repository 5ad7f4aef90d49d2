"""Models as users have them (issue 15): timm and HuggingFace by name, fine-tuned checkpoints, whole
pickled models and TorchScript files, the model's own preprocessing and class names, and every method
option from the command line. Each command-line map is compared with the Python API on the same
model, image and preprocessing; nothing is downloaded (random weights, models saved by the test)."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from test_cli_errors import fails_with

import explain
from explain.cli import main
from explain.io.inputs import ImageProcessorPreprocess, TransformPreprocess
from explain.models import WeightsUnavailableError, load_model

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def photo(tmp_path):
    """An 80 × 96 RGB image: not the model's input size, so the model's own resizing shows."""
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(path)
    return path


def written_overlay(folder, stem: str, method: str = "gradcam") -> np.ndarray:
    """The overlay the command line wrote last for an image and method (named <stem>_<method>_<model>...)."""
    written = max(folder.glob(f"{stem}_{method}_*.png"), key=lambda path: path.stat().st_mtime_ns)
    return np.asarray(Image.open(written))


def python_overlay(explanation: explain.Explanation) -> np.ndarray:
    """What the command line writes for the first image, from the Python API (its K overlays stacked)."""
    first = explanation.overlay()[0]
    return np.concatenate(list(first), axis=0) if first.ndim == 4 else first


def test_timm_resnet18_by_name_with_its_own_preprocessing_and_class_names(photo, tmp_path, capsys):
    torch.manual_seed(0)
    reference = timm.create_model("resnet18", pretrained=False).eval()
    weights = tmp_path / "timm_resnet18.pt"
    torch.save({"model": reference.state_dict()}, weights)  # a training script's checkpoint wrapper
    assert main([str(photo), "--model", "timm:resnet18", "--weights", str(weights), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    config = timm.data.resolve_model_data_config(reference)
    preprocess = TransformPreprocess(timm.data.create_transform(**config))
    expected = explain.GradCAM(reference, preprocess=preprocess).explain(str(photo))
    written = written_overlay(tmp_path, "photo")
    assert written.shape == (224, 224, 3)  # timm's resize to 235 and centre crop to 224
    np.testing.assert_array_equal(written, python_overlay(expected))
    names = timm.data.ImageNetInfo("imagenet-1k").label_descriptions()
    assert f"{names[int(expected.targets[0])]} ({int(expected.targets[0])})" in printed
    assert "[GradCAM @ layer4]" in printed  # the automatic layer of a timm ResNet


def test_timm_vit_small_by_name(photo, tmp_path, capsys):
    torch.manual_seed(1)
    assert main([str(photo), "--model", "timm:vit_small_patch16_224", "--weights", "random", "--out",
                 str(tmp_path)]) == 0
    torch.manual_seed(1)
    reference = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    config = timm.data.resolve_model_data_config(reference)
    expected = explain.GradCAM(reference, preprocess=TransformPreprocess(timm.data.create_transform(**config))
                               ).explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo"), python_overlay(expected))
    assert "blocks.11.norm1" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    """A tiny HuggingFace ViT classifier and its processor, saved with save_pretrained."""
    folder = tmp_path_factory.mktemp("hf_vit")
    labels = {0: "cat", 1: "dog", 2: "bird"}
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, num_attention_heads=2,
                                    hidden_size=32, intermediate_size=64, num_labels=3, id2label=labels,
                                    label2id={name: index for index, name in labels.items()})
    torch.manual_seed(2)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_huggingface_directory_with_its_processor_and_labels(hf_directory, photo, tmp_path, capsys):
    arguments = [str(photo), "--model", f"hf:{hf_directory}", "--topk", "2", "--out", str(tmp_path)]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    model = transformers.AutoModelForImageClassification.from_pretrained(hf_directory).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(hf_directory)
    expected = explain.GradCAM(model, preprocess=processor).explain(str(photo), topk=2)  # a processor as preprocess
    written = written_overlay(tmp_path, "photo")
    assert written.shape == (2 * 32, 32, 3)
    np.testing.assert_array_equal(written, python_overlay(expected))
    first = ["cat", "dog", "bird"][int(expected.targets[0, 0])]
    assert f"{first} ({int(expected.targets[0, 0])})" in printed and "layernorm_before" in printed


def test_a_fine_tuned_checkpoint_with_its_number_of_classes_and_class_names(photo, tmp_path, capsys):
    torch.manual_seed(3)
    fine_tuned = torchvision.models.resnet18(num_classes=10).eval()
    weights = tmp_path / "finetuned.pt"
    torch.save({"state_dict": {f"module.{key}": value for key, value in fine_tuned.state_dict().items()}}, weights)
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(f"kind {index}" for index in range(10)))
    fails_with(capsys, [str(photo), "--model", "resnet18", "--weights", str(weights)], "--num-classes 10")
    arguments = [str(photo), "--model", "resnet18", "--weights", str(weights), "--num-classes", "10",
                 "--class-names", str(names), "--out", str(tmp_path)]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    transforms = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    expected = explain.GradCAM(fine_tuned, preprocess=transforms).explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo"), python_overlay(expected))
    assert f"kind {int(expected.targets[0])} ({int(expected.targets[0])})" in printed
    names.write_text(json.dumps(["only", "three", "names"]))
    fails_with(capsys, arguments, "3 class names", "10 outputs")


def test_size_mean_and_std_replace_the_models_own_preprocessing(photo, tmp_path):
    torch.manual_seed(4)
    model = torchvision.models.resnet18(num_classes=5).eval()
    weights = tmp_path / "w.pt"
    torch.save(model.state_dict(), weights)
    arguments = [str(photo), "--model", "resnet18", "--weights", str(weights), "--num-classes", "5", "--size", "48",
                 "--mean", "0.5", "--std", "0.25", "--out", str(tmp_path)]
    assert main(arguments) == 0
    steps = torchvision.transforms.Compose([torchvision.transforms.Resize(48), torchvision.transforms.CenterCrop(48),
                                            torchvision.transforms.ToTensor(),
                                            torchvision.transforms.Normalize([0.5] * 3, [0.25] * 3)])
    expected = explain.GradCAM(model, preprocess=TransformPreprocess(steps)).explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo"), python_overlay(expected))
    loaded = load_model("resnet18", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))  # geometry kept: 224 crop
    image = Image.open(photo).convert("RGB")
    default = torchvision.models.ResNet18_Weights.DEFAULT.transforms()(image)
    unit = default * torch.tensor([0.229, 0.224, 0.225])[:, None, None] + torch.tensor([0.485, 0.456, 0.406])[
        :, None, None]
    torch.testing.assert_close(loaded.preprocess(image), (unit - 0.5) / 0.25)


def test_every_method_option_from_the_command_line(photo, tmp_path, capsys):
    base = [str(photo), "--model", "demo", "--out", str(tmp_path)]
    assert main([*base, "--method", "integratedgradients", "--option", "steps=8", "--option", "baseline=blur",
                 "--option", "rule=gausslegendre"]) == 0
    model = load_model("demo").model
    expected = explain.IntegratedGradients(model, steps=8, baseline="blur", rule="gausslegendre").explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo", "integratedgradients"), python_overlay(expected))
    assert main([*base, "--option", "relu=false", "--option", "normalize=minmax"]) == 0
    expected = explain.GradCAM(model, "layer4", relu=False, normalize="minmax").explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo"), python_overlay(expected))
    fails_with(capsys, [*base, "--option", "stepz=8", "--method", "integratedgradients"], "no option 'stepz'",
               "Did you mean steps")
    fails_with(capsys, [*base, "--option", "steps=many", "--method", "integratedgradients"], "steps takes int")
    fails_with(capsys, [*base, "--option", "relu"], "KEY=VALUE")


def test_methods_list_their_options(capsys):
    assert main(["methods", "--verbose"]) == 0
    listing = capsys.readouterr().out
    assert "--option baseline='zeros' steps=32" in listing and "relu=True" in listing
    assert main(["methods", "integratedgradients"]) == 0
    described = capsys.readouterr().out
    for option in ("steps (default 32):", "baseline (default 'zeros'):", "rule (default 'midpoint'):",
                   "normalize (default 'max'):"):
        assert option in described


def test_help_shows_every_parameter_with_its_meaning():
    signature = inspect.signature(explain.IntegratedGradients)
    doc = inspect.getdoc(explain.IntegratedGradients)
    for name in ("steps", "baseline", "preprocess", "normalize", "class_names", "output"):
        assert name in signature.parameters, name
        assert f"\n{name}: " in f"\n{doc}" or f"; {name}: " in doc, name
    assert signature.parameters["steps"].default == 32 and signature.parameters["normalize"].default == "max"
    for cls in set(explain.REGISTRY.values()):  # no method hides its options behind **options
        parameters = inspect.signature(cls).parameters.values()
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters), cls
        assert "normalize" in inspect.signature(cls).parameters, cls
    assert "Initialize self" not in (explain.GradCAM.__init__.__doc__ or "")


def test_whole_pickled_models_only_when_allowed_and_torchscript_refused(photo, tmp_path, capsys):
    torch.manual_seed(5)
    model = torchvision.models.resnet18(num_classes=4).eval()
    whole = tmp_path / "whole.pt"
    torch.save(model, whole)
    fails_with(capsys, [str(photo), "--model", str(whole)], "--allow-pickle")
    fails_with(capsys, [str(photo), "--model", "resnet18", "--weights", str(whole)], "--allow-pickle")
    assert main([str(photo), "--model", str(whole), "--allow-pickle", "--out", str(tmp_path)]) == 0
    expected = explain.GradCAM(model).explain(str(photo))
    np.testing.assert_array_equal(written_overlay(tmp_path, "photo"), python_overlay(expected))
    scripted = tmp_path / "scripted.pt"
    with pytest.warns(FutureWarning):
        torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, 32, 32)), str(scripted))
    fails_with(capsys, [str(photo), "--model", str(scripted), "--allow-pickle"], "TorchScript", "hooks")
    fails_with(capsys, [str(photo), "--model", "resnet18", "--weights", str(scripted)], "TorchScript")


def test_weights_that_cannot_be_fetched_say_how_to_pass_a_local_file(monkeypatch, capsys, photo):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here either way: fail at once, not after retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(WeightsUnavailableError, match="--weights /path/to/model.safetensors"):
        load_model("timm:resnet18", "pretrained")
    with pytest.raises(WeightsUnavailableError, match="save_pretrained"):
        load_model("hf:google/vit-base-patch16-224")
    fails_with(capsys, [str(photo), "--model", "vit_small_patch16_224"], "--model timm:vit_small_patch16_224")
    fails_with(capsys, [str(photo), "--model", "timm:resnet1800"], "timm has no model")


def test_a_huggingface_backbone_needs_an_output_and_then_explains_a_feature(tmp_path, photo, capsys):
    folder = tmp_path / "backbone"
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=1, num_attention_heads=2,
                                    hidden_size=16, intermediate_size=32)
    transformers.ViTModel(config).save_pretrained(folder)
    fails_with(capsys, [str(photo), "--model", f"hf:{folder}"], "--output pooler_output")
    assert main([str(photo), "--model", f"hf:{folder}", "--output", "pooler_output", "--target", "3",
                 "--method", "saliency", "--out", str(tmp_path)]) == 0
    assert "class 3" in capsys.readouterr().out


def test_an_image_processor_object_is_accepted_as_preprocess():
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    model = torchvision.models.resnet18(num_classes=3).eval()
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    explanation = explain.Saliency(model, preprocess=processor).explain(image)
    assert explanation.maps.shape == (1, 32, 32)  # resized and centre-cropped by the processor
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(explanation.maps, explain.Saliency(model).explain(pixels).maps)
    wrapped = ImageProcessorPreprocess(processor)
    shown = explanation.images[0]
    expected = (pixels[0] * torch.tensor(wrapped.std)[:, None, None] + torch.tensor(wrapped.mean)[:, None, None])
    torch.testing.assert_close(shown, expected.clamp(0, 1).permute(1, 2, 0), atol=1e-6, rtol=0)
