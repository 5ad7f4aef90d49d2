"""Layer Integrated Gradients and Layer Conductance pick, in a transformer, a layer through which the whole score
flows: the output of the block before the last. The CAMs' choice, the last block's first norm, is bypassed by the
block's residual connection, so that attributions there could not sum to the score's change (completeness)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision

import explain


def tiny_vits() -> dict[str, torch.nn.Module]:
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, num_labels=5)).eval()
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=5,
                            depth=3).eval()
    return {"hf": hf, "timm": vit}


def test_layer_ig_on_a_vit_defaults_to_the_block_before_the_last_and_is_complete_there() -> None:
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for name, model in tiny_vits().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a random ViT's maps may be zero after the ReLU: not the point here
            chosen = explain.LayerIntegratedGradients(model, steps=16).explain(x, target=1)
            cam_layer = explain.GradCAM(model).explain(x, target=1).layer
            at_the_norm = explain.LayerIntegratedGradients(model, cam_layer, steps=16).explain(x, target=1)
        assert chosen.layer.endswith(".1") and cam_layer.startswith(chosen.layer[:-1] + "2."), (chosen.layer,
                                                                                                   cam_layer)
        change = chosen.diagnostics["score_change"].abs()
        assert (chosen.diagnostics["completeness_error"].abs() <= 0.1 * change + 1e-6).all(), name
        # at the first norm of the last block the residual bypasses the layer: far from complete (before: default)
        assert (at_the_norm.diagnostics["completeness_error"].abs() > 0.3 * change).any(), name


def test_the_default_of_the_layer_methods_on_a_cnn_is_the_cams() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
    x = torch.rand(1, 3, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert explain.LayerConductance(model, steps=4).explain(x, target=0).layer == \
            explain.GradCAM(model).explain(x, target=0).layer == "layer4"
