"""Token and channels-last layouts, and the automatic choice of a target layer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from conftest import class_scores, gradcam_by_hand

import explain
from explain.core.layers import default_layer
from explain.core.layouts import infer_layout, token_grid


@pytest.mark.parametrize(
    "tokens, size, expected",
    [
        (197, (224, 224), (1, (14, 14))),  # ViT-B/16: class token + 14 × 14
        (101, (160, 160), (1, (10, 10))),  # the same model at 160 px
        (198, (224, 224), (2, (14, 14))),  # DeiT: class and distillation tokens
        (201, (224, 224), (5, (14, 14))),  # class + 4 register tokens
        (141, (224, 160), (1, (14, 10))),  # a non-square input
        (196, (224, 224), (0, (14, 14))),  # no prefix token
    ],
)
def test_token_grids_are_inferred_from_the_count_and_the_input(tokens, size, expected):
    assert token_grid(tokens, size) == expected


def test_layouts_and_their_overrides():
    nchw, nhwc = torch.randn(2, 8, 7, 7), torch.randn(2, 7, 7, 768)
    assert infer_layout(nchw, (224, 224)).kind == "channels_first"
    assert infer_layout(nhwc, (224, 224)).kind == "channels_last"
    assert infer_layout(nhwc, (224, 224)).apply(nhwc).shape == (2, 768, 7, 7)
    tokens = torch.randn(2, 50, 16)
    assert infer_layout(tokens, (112, 112), reshape=(7, 7)).apply(tokens).shape == (2, 16, 7, 7)
    torch.testing.assert_close(infer_layout(tokens, (112, 112), reshape=(7, 7)).apply(tokens)[:, :, 0, 1],
                               tokens[:, 2])
    assert infer_layout(nchw, (1, 1), reshape="channels_last").apply(nchw).shape == (2, 7, 8, 7)
    with pytest.raises(ValueError, match="cannot lay 3 tokens"):
        infer_layout(torch.randn(1, 3, 4), (64, 64))
    with pytest.raises(ValueError, match="reshape"):
        infer_layout(torch.randn(1, 4), (64, 64))


def test_vit_at_160_px_explained_at_the_last_blocks_first_norm():
    torch.manual_seed(0)
    vit = torchvision.models.vit_b_16(image_size=160, num_classes=10).eval()
    torch.nn.init.normal_(vit.heads.head.weight, std=0.5)  # torchvision initialises the head to zero
    x = torch.randn(2, 3, 160, 160)
    explanation = explain.GradCAM(vit, normalize=None).explain(x, target=[3, 7])
    assert explanation.layer == "encoder.layers.encoder_layer_11.ln_1"
    layer = vit.encoder.layers.encoder_layer_11.ln_1

    def to_grid(tokens):  # written out for this model: drop the class token, 10 × 10 patches
        return tokens[:, 1:].reshape(2, 10, 10, 768).permute(0, 3, 1, 2)

    expected = gradcam_by_hand(vit, layer, x, class_scores([3, 7]), to_grid)
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)
    assert expected.abs().sum() > 0
    blind = explain.GradCAM(vit, "encoder.layers.encoder_layer_11", normalize=None).explain(x, target=[3, 7])
    assert blind.raw_maps.abs().max() == 0  # after the last block only the class token reaches the head


def test_swin_channels_last_blocks():
    torch.manual_seed(0)
    swin = torchvision.models.swin_t(num_classes=10).eval()
    x = torch.randn(2, 3, 96, 96)
    explanation = explain.GradCAM(swin, normalize=None).explain(x, target=[1, 2])
    assert explanation.layer == "features.7.1.norm1"
    expected = gradcam_by_hand(swin, swin.features[7][1].norm1, x, class_scores([1, 2]),
                               lambda t: t.permute(0, 3, 1, 2))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_ablation_and_score_cam_on_tokens():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                               hidden_dim=16, mlp_dim=16, num_classes=3).eval()
    torch.nn.init.normal_(vit.heads.head.weight, std=0.5)
    x = torch.randn(2, 3, 32, 32)
    for method in (explain.AblationCAM, explain.ScoreCAM, explain.EigenCAM, explain.LayerCAM):
        result = method(vit, progress=False) if method in (explain.AblationCAM, explain.ScoreCAM) else method(vit)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = result.explain(x, target=[0, 2]).maps
        assert maps.shape == (2, 32, 32) and torch.isfinite(maps).all()
    # Ablation-CAM zeroes channel d of every token: check one weight by hand
    layer = vit.encoder.layers.encoder_layer_1.ln_1
    # one image: the residual around ln_1 broadcasts over the ablated copies, so the tail replay is exact
    ablation = explain.AblationCAM(vit, normalize=None, relu=False, progress=False).explain(x[:1], target=0)
    with explain.capture(vit, layer) as captured, torch.no_grad():
        y = vit(x[:1])[0, 0]
    tokens = captured[next(iter(captured))].output
    weights = []
    for channel in range(16):
        with explain.edit(vit, layer, lambda t, c=channel: t.index_fill(2, torch.tensor([c]), 0.0)), torch.no_grad():
            weights.append((y - vit(x[:1])[0, 0]) / y.abs())  # |y|: see AblationCAM
    grid = tokens[:, 1:].reshape(1, 4, 4, 16).permute(0, 3, 1, 2)
    expected = (torch.stack(weights).view(1, 16, 1, 1) * grid).sum(1)
    torch.testing.assert_close(ablation.low_res_maps[0][:, 0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "builder, size, expected",
    [
        (lambda: torchvision.models.resnet18(), 64, "layer4"),
        (lambda: torchvision.models.vgg11(), 64, "features"),
        (lambda: torchvision.models.densenet121(), 64, "features"),
        (lambda: torchvision.models.mobilenet_v2(), 64, "features"),
        (lambda: torchvision.models.mobilenet_v3_small(), 64, "features"),
        (lambda: torchvision.models.efficientnet_b0(), 64, "features"),
        (lambda: torchvision.models.convnext_tiny(), 64, "features"),
        (lambda: torchvision.models.vit_b_16(image_size=64), 64, "encoder.layers.encoder_layer_11.ln_1"),
        (lambda: torchvision.models.swin_t(), 64, "features.7.1.norm1"),
    ],
    ids=["resnet", "vgg", "densenet", "mobilenet", "mobilenet-v3", "efficientnet", "convnext", "vit", "swin"],
)
def test_automatic_layer_choice(builder, size, expected):
    model = builder().eval()
    assert default_layer(model, torch.randn(1, 3, size, size)) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # torchvision's untrained ViT head is zero: empty maps
        explanation = explain.GradCAM(model).explain(torch.randn(2, 3, size, size))
    assert explanation.layer == expected
    assert explanation.maps.shape == (2, size, size)  # one map per image
