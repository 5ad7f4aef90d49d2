"""Grad-CAM against its definition: ReLU(Σ_k α_k A_k), α_k = mean_ij ∂y_c/∂A_k(i, j), upsampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import ConvGapLinear, SmallCNN, assert_state_equal, model_state
from PIL import Image

from explain import GradCAM
from explain.io.inputs import IMAGENET_MEAN, IMAGENET_STD


def by_hand_cam(model: ConvGapLinear, x: torch.Tensor, classes: list[int], relu_after_conv: bool) -> torch.Tensor:
    """The classic CAM worked out by hand for conv → [ReLU] → GAP → linear, one image at a time."""
    maps = []
    with torch.no_grad():
        activations = model.conv(x)  # (N, C, h, w), before any in-place ReLU
        for n, c in enumerate(classes):
            a = activations[n]
            h, w = a.shape[-2:]
            gate = (a > 0).float() if relu_after_conv else torch.ones_like(a)
            gradient = model.fc.weight[c].view(-1, 1, 1) * gate / (h * w)  # ∂y_c / ∂A
            alpha = gradient.mean(dim=(1, 2))
            cam = torch.zeros(h, w)
            for k in range(a.shape[0]):  # explicit loop: Σ_k α_k A_k
                cam += alpha[k] * a[k]
            maps.append(torch.relu(cam))
    return torch.stack(maps)


@pytest.mark.parametrize("relu_after_conv", [False, True], ids=["plain", "inplace-relu-after-layer"])
def test_gradcam_equals_the_classic_cam_worked_out_by_hand(relu_after_conv):
    torch.manual_seed(0)
    model = ConvGapLinear(relu=relu_after_conv).eval()
    x = torch.randn(3, 3, 8, 8)
    classes = [0, 2, 1]
    explanation = GradCAM(model, "conv", normalize=None).explain(x, target=classes)
    expected = by_hand_cam(model, x, classes, relu_after_conv)
    torch.testing.assert_close(explanation.low_res_maps[0][:, 0], expected, rtol=1e-5, atol=1e-7)
    # the conv keeps the 8×8 resolution, so the map needs no upsampling
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-5, atol=1e-7)
    # scores are the explained logits
    torch.testing.assert_close(explanation.scores[:, 0], model(x)[torch.arange(3), classes].detach())


def test_in_place_relu_after_layer_changes_the_map():
    """The in-place case is not vacuous: the gated gradient differs from the ungated one."""
    torch.manual_seed(0)
    model = ConvGapLinear(relu=True).eval()
    x = torch.randn(2, 3, 8, 8)
    ours = GradCAM(model, "conv", normalize=None).explain(x, target=[0, 1]).raw_maps
    assert not torch.allclose(ours, by_hand_cam(model, x, [0, 1], relu_after_conv=False))


def slow_gradcam_resnet(model: torchvision.models.ResNet, x: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """Grad-CAM at layer4 by an independent route: the network split by hand into a head and a
    tail, the tail's Jacobian from torch.autograd.functional, one image at a time."""
    maps = []
    with torch.no_grad():
        stem = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        activations = model.layer4(model.layer3(model.layer2(model.layer1(stem))))
    for n, c in enumerate(classes):
        a = activations[n : n + 1]

        def tail(features, c=c):
            return model.fc(torch.flatten(model.avgpool(features), 1))[0, c]

        gradient = torch.autograd.functional.jacobian(tail, a)[0]  # (C, h, w)
        alpha = gradient.mean(dim=(1, 2))
        cam = torch.relu((alpha.view(-1, 1, 1) * a[0]).sum(0))
        maps.append(F.interpolate(cam[None, None], size=x.shape[-2:], mode="bilinear", align_corners=False)[0, 0])
    return torch.stack(maps)


def test_gradcam_on_resnet18_matches_a_slow_independent_computation():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(4, 3, 96, 96)
    classes = [3, 7, 0, 9]
    explanation = GradCAM(model, "layer4", normalize=None).explain(x, target=classes)
    expected = slow_gradcam_resnet(model, x, classes)
    assert explanation.maps.shape == (4, 96, 96)
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)
    normalized = GradCAM(model, "layer4").explain(x, target=classes).maps
    torch.testing.assert_close(normalized, expected / expected.amax(dim=(1, 2), keepdim=True), rtol=1e-4, atol=1e-6)


def test_resnet18_accepts_path_pil_ndarray_and_tensor_alike(tmp_path, rng):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    pixels = rng.integers(0, 256, size=(64, 80, 3), dtype=np.uint8)
    path = tmp_path / "image.png"
    Image.fromarray(pixels).save(path)
    scaled = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    tensor = (scaled - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    explainer = GradCAM(model, "layer4")
    inputs = (str(path), Image.fromarray(pixels), pixels, pixels / 255.0, tensor)
    results = [explainer.explain(item, target=4) for item in inputs]
    for result in results:
        assert result.maps.shape == (1, 64, 80)
        torch.testing.assert_close(result.maps, results[0].maps, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result.images[0], torch.from_numpy(pixels).float() / 255, rtol=0, atol=1e-5)


def test_frozen_model_and_caller_no_grad_give_the_same_map():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    reference = GradCAM(model, "features.6").explain(x).raw_maps
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    frozen = GradCAM(model, "features.6").explain(x).raw_maps
    with torch.no_grad():
        inside_no_grad = GradCAM(model, "features.6").explain(x).raw_maps
    assert torch.is_grad_enabled()
    torch.testing.assert_close(frozen, reference)
    torch.testing.assert_close(inside_no_grad, reference)
    assert all(not p.requires_grad for p in model.parameters())


def test_no_parameter_gradient_and_state_unchanged_after_a_call():
    torch.manual_seed(0)
    model = SmallCNN().train()  # train mode: the call runs in eval mode and restores it
    model.features[1].eval()  # a mixed-mode model comes back mixed
    before = model_state(model)
    GradCAM(model, "features.3").explain(torch.randn(3, 3, 16, 16), target=[0, 1, 2])
    assert_state_equal(before, model_state(model))
    assert all(p.grad is None for p in model.parameters())


def test_state_unchanged_after_a_failing_call():
    torch.manual_seed(0)
    model = SmallCNN().train()
    before = model_state(model)
    with pytest.raises(ValueError, match="out of range"):
        GradCAM(model, "features.3").explain(torch.randn(2, 3, 16, 16), target=[0, 99])
    assert_state_equal(before, model_state(model))

    def failing_target(output):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        GradCAM(model, "features.3").explain(torch.randn(2, 3, 16, 16), target=failing_target)
    assert_state_equal(before, model_state(model))


def test_map_is_computed_in_eval_mode():
    """BatchNorm uses running statistics: a map of one image does not depend on the rest of the batch."""
    torch.manual_seed(0)
    model = SmallCNN().train()
    x = torch.randn(4, 3, 16, 16)
    together = GradCAM(model, "features.6").explain(x, target=1).raw_maps
    alone = torch.cat([GradCAM(model, "features.6").explain(x[i : i + 1], target=1).raw_maps for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-6)


def test_k_targets_per_image_give_one_map_each():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    x = torch.randn(2, 3, 8, 8)
    explanation = GradCAM(model, "conv", normalize=None).explain(x, topk=3)
    assert explanation.maps.shape == (2, 3, 8, 8)
    assert explanation.targets.shape == (2, 3)
    for k in range(3):
        expected = by_hand_cam(model, x, explanation.targets[:, k].tolist(), relu_after_conv=False)
        torch.testing.assert_close(explanation.maps[:, k], expected, rtol=1e-5, atol=1e-7)
    nested = GradCAM(model, "conv", normalize=None).explain(x, target=[[0, 1], [2, 0]])
    assert nested.maps.shape == (2, 2, 8, 8)
    torch.testing.assert_close(nested.maps[1, 0], by_hand_cam(model, x[1:], [2], False)[0], rtol=1e-5, atol=1e-7)


def test_callable_target_selects_any_scalar():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    x = torch.randn(2, 3, 8, 8)
    difference = GradCAM(model, "conv", normalize=None, relu=False).explain(x, target=lambda out: out[:, 0] - out[:, 1])
    plain = [GradCAM(model, "conv", normalize=None, relu=False).explain(x, target=c).raw_maps for c in (0, 1)]
    torch.testing.assert_close(difference.raw_maps, plain[0] - plain[1], rtol=1e-5, atol=1e-6)
    assert difference.targets is None


def test_zero_map_is_zero_after_normalisation_not_nan():
    model = ConvGapLinear().eval()
    with torch.no_grad():
        model.fc.weight.zero_()
    explanation = GradCAM(model, "conv").explain(torch.randn(1, 3, 8, 8), target=0)
    assert torch.isfinite(explanation.maps).all() and explanation.maps.abs().max() == 0


class IgnoresItsBranch(torch.nn.Module):
    """A model whose output does not depend on the ``side`` layer at all."""

    def __init__(self):
        super().__init__()
        self.side = torch.nn.Conv2d(3, 2, 3, padding=1)
        self.main = torch.nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        self.side(x)
        return self.main(x).mean(dim=(2, 3))


def test_output_independent_of_the_layer_gives_a_zero_map_and_a_warning():
    with pytest.warns(RuntimeWarning, match="does not depend on the target layer"):
        explanation = GradCAM(IgnoresItsBranch().eval(), "side").explain(torch.randn(2, 3, 8, 8))
    assert torch.isfinite(explanation.maps).all() and explanation.maps.abs().max() == 0
