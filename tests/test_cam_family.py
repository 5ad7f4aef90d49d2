"""Each CAM method against a slow, independent computation of its paper's formula.

References are written with explicit loops over images, channels and pixels, from
activations A and gradients G obtained by hand (tiny model) or from a network split
by hand into head and tail (resnet18), never through the toolkit's pipeline.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import ConvGapLinear, assert_state_equal, model_state

import explain
from explain.cli import main

# ---------------------------------------------------------------- slow formulas, per image


def slow_gradcam_plus_plus(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    channels, height, width = a.shape
    cam = np.zeros((height, width))
    for k in range(channels):
        activation_sum = a[k].sum()
        weight = 0.0
        for i in range(height):
            for j in range(width):
                denominator = 2 * g[k, i, j] ** 2 + activation_sum * g[k, i, j] ** 3
                alpha = g[k, i, j] ** 2 / denominator if denominator != 0 else 0.0
                weight += alpha * max(g[k, i, j], 0.0)
        cam += weight * a[k]
    return cam


def slow_xgradcam(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    cam = np.zeros(a.shape[1:])
    for k in range(a.shape[0]):
        total = a[k].sum()
        if total == 0:
            continue  # a channel that sums to zero gets weight 0
        weight = sum(a[k, i, j] / total * g[k, i, j] for i in range(a.shape[1]) for j in range(a.shape[2]))
        cam += weight * a[k]
    return cam


def slow_hirescam(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    return sum(g[k] * a[k] for k in range(a.shape[0]))


def slow_layercam(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    return sum(np.maximum(g[k], 0) * a[k] for k in range(a.shape[0]))


def slow_eigencam(a: np.ndarray) -> np.ndarray:
    """First eigenvector of the channel covariance (numpy eigh), the centred data projected on it."""
    samples = a.reshape(a.shape[0], -1).T.astype(np.float64)  # (hw, C)
    centred = samples - samples.mean(0)
    _, vectors = np.linalg.eigh(centred.T @ centred)
    projection = centred @ vectors[:, -1]
    if np.corrcoef(projection, samples.sum(1))[0, 1] < 0:
        projection = -projection
    return projection.reshape(a.shape[1:])


GRADIENT_FORMULAS = {
    explain.GradCAMPlusPlus: slow_gradcam_plus_plus,
    explain.XGradCAM: slow_xgradcam,
    explain.HiResCAM: slow_hirescam,
    explain.LayerCAM: slow_layercam,
}

# ---------------------------------------------------------------- tiny model: A and G by hand


def tiny_model_and_input(seed: int = 0):
    torch.manual_seed(seed)
    model = ConvGapLinear(channels=5, classes=4, relu=True).eval()
    return model, torch.randn(3, 3, 6, 6)


def by_hand_activations_and_gradients(model: ConvGapLinear, x: torch.Tensor, classes):
    """A = conv(x); with ReLU → GAP → linear, ∂y_c/∂A = W[c, k] · 1[A > 0] / (h w)."""
    with torch.no_grad():
        a = model.conv(x)
        h, w = a.shape[-2:]
        g = torch.stack([model.fc.weight[c].view(-1, 1, 1) * (a[n] > 0) / (h * w) for n, c in enumerate(classes)])
    return a.double().numpy(), g.double().numpy()


@pytest.mark.parametrize("method", list(GRADIENT_FORMULAS), ids=lambda m: m.name)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "signed"])
def test_gradient_cams_match_their_formula_on_a_tiny_model(method, relu):
    model, x = tiny_model_and_input()
    classes = [0, 3, 1]
    a, g = by_hand_activations_and_gradients(model, x, classes)
    result = method(model, "conv", normalize=None, relu=relu).explain(x, target=classes)
    for n in range(3):
        expected = GRADIENT_FORMULAS[method](a[n], g[n])
        expected = np.maximum(expected, 0) if relu else expected
        np.testing.assert_allclose(result.raw_maps[n].numpy(), expected, rtol=1e-4, atol=1e-7)


def test_eigencam_matches_the_first_principal_component_with_a_positive_sign():
    model, x = tiny_model_and_input()
    a, _ = by_hand_activations_and_gradients(model, x, [0, 0, 0])
    result = explain.EigenCAM(model, "conv", normalize=None, relu=False).explain(x, topk=2)
    for n in range(3):
        expected = slow_eigencam(a[n])
        for k in range(2):  # class-agnostic: the same map for every target
            np.testing.assert_allclose(result.raw_maps[n, k].numpy(), expected, rtol=1e-4, atol=1e-6)
        mass = a[n].sum(0).ravel()
        assert np.corrcoef(result.raw_maps[n, 0].numpy().ravel(), mass)[0, 1] > 0


def slow_scorecam(model, x: torch.Tensor, a: torch.Tensor, classes) -> list[np.ndarray]:
    """One forward per channel: the input masked by the upsampled, min-max normalised channel."""
    maps = []
    for n, c in enumerate(classes):
        scores = []
        for k in range(a.shape[1]):
            upsampled = F.interpolate(a[n : n + 1, k : k + 1], size=x.shape[-2:], mode="bilinear", align_corners=False)
            low, high = upsampled.min(), upsampled.max()
            mask = (upsampled - low) / (high - low) if high > low else torch.zeros_like(upsampled)
            with torch.no_grad():
                scores.append(model(x[n : n + 1] * mask)[0, c].item())
        weights = np.exp(np.array(scores) - max(scores))
        weights /= weights.sum()
        maps.append(sum(weights[k] * a[n, k].double().numpy() for k in range(a.shape[1])))
    return maps


def test_scorecam_matches_one_forward_per_channel_and_skips_identical_masks():
    model, x = tiny_model_and_input()
    with torch.no_grad():  # make two channels all-zero after the conv: identical masks
        model.conv.weight[3:] = 0
        model.conv.bias[3:] = 0
    classes = [2, 0, 1]
    with torch.no_grad():
        a = model.conv(x)
    forwards = []
    handle = model.fc.register_forward_hook(lambda module, args, output: forwards.append(len(output)))
    try:
        result = explain.ScoreCAM(model, "conv", normalize=None, relu=False, batch_size=4).explain(x, target=classes)
    finally:
        handle.remove()
    for n, expected in enumerate(slow_scorecam(model, x, a, classes)):
        np.testing.assert_allclose(result.raw_maps[n].numpy(), expected, rtol=1e-4, atol=1e-6)
    # 1 plain forward + (3 distinct masks per image: channels 3 and 4 share one) × 3 images
    assert sum(forwards) == 3 + 3 * 4


def slow_ablation_tiny(model: ConvGapLinear, x: torch.Tensor, classes) -> list[np.ndarray]:
    maps = []
    with torch.no_grad():
        a = model.conv(x)
        for n, c in enumerate(classes):
            def tail(features, c=c):
                return model.fc(torch.relu(features).mean(dim=(1, 2)))[c].item()

            y = tail(a[n])
            cam = torch.zeros(a.shape[-2:])
            for k in range(a.shape[1]):
                ablated = a[n].clone()
                ablated[k] = 0
                cam += (y - tail(ablated)) / abs(y) * a[n, k]  # |y|: see AblationCAM
            maps.append(cam.numpy())
    return maps


def test_ablationcam_matches_its_formula_replaying_only_the_tail():
    model, x = tiny_model_and_input()
    classes = [1, 2, 3]
    calls = []
    handle = model.conv.register_forward_hook(lambda module, args, output: calls.append(len(output)))
    try:
        result = explain.AblationCAM(model, "conv", normalize=None, relu=False).explain(x, target=classes)
    finally:
        handle.remove()
    for n, expected in enumerate(slow_ablation_tiny(model, x, classes)):
        np.testing.assert_allclose(result.raw_maps[n].numpy(), expected, rtol=1e-4, atol=1e-6)
    assert calls == [3, 3]  # the layers up to the target layer ran twice on the 3 images, no more


class ResidualAroundTarget(torch.nn.Module):
    """The tail adds a tensor from before the target layer: replaying the tail alone is impossible."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        first = torch.relu(self.conv1(x))
        return self.fc((self.conv2(first) + first).mean(dim=(2, 3)))


def test_ablationcam_falls_back_to_full_forwards_with_a_warning():
    torch.manual_seed(0)
    model = ResidualAroundTarget().eval()
    x = torch.randn(2, 3, 5, 5)
    before = model_state(model)
    with pytest.warns(RuntimeWarning, match="full forward passes"):
        result = explain.AblationCAM(model, "conv2", normalize=None, relu=False).explain(x, target=[0, 2])
    assert_state_equal(before, model_state(model))
    with torch.no_grad():
        first = torch.relu(model.conv1(x))
        a = model.conv2(first)
        for n, c in enumerate([0, 2]):
            y = model.fc((a[n] + first[n]).mean(dim=(1, 2)))[c]
            cam = torch.zeros(5, 5)
            for k in range(4):
                ablated = a[n].clone()
                ablated[k] = 0
                cam += (y - model.fc((ablated + first[n]).mean(dim=(1, 2)))[c]) / y.abs() * a[n, k]
            torch.testing.assert_close(result.raw_maps[n], cam, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- resnet18, batch of 3, different targets


@pytest.fixture(scope="module")
def resnet_case():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(3, 3, 64, 64)
    classes = [2, 5, 9]
    with torch.no_grad():
        stem = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        a = model.layer4(model.layer3(model.layer2(model.layer1(stem))))

    def tail(features):
        return model.fc(torch.flatten(model.avgpool(features), 1))

    gradients = torch.stack(
        [torch.autograd.functional.jacobian(lambda f, n=n, c=c: tail(f)[0, c], a[n : n + 1])[0]
         for n, c in enumerate(classes)]
    )
    return model, x, classes, a, gradients, tail


def upsampled(cam: np.ndarray, size) -> torch.Tensor:
    return F.interpolate(torch.as_tensor(cam, dtype=torch.float32)[None, None], size=size, mode="bilinear",
                         align_corners=False)[0, 0]


@pytest.mark.parametrize("method", list(GRADIENT_FORMULAS), ids=lambda m: m.name)
def test_gradient_cams_on_resnet18_batch_of_three(method, resnet_case):
    model, x, classes, a, gradients, _ = resnet_case
    result = method(model, "layer4", normalize=None).explain(x, target=classes)
    assert result.maps.shape == (3, 64, 64)
    for n in range(3):
        expected = np.maximum(GRADIENT_FORMULAS[method](a[n].double().numpy(), gradients[n].double().numpy()), 0)
        torch.testing.assert_close(result.raw_maps[n], upsampled(expected, (64, 64)), rtol=1e-3, atol=1e-6)


def test_eigencam_on_resnet18_batch_of_three(resnet_case):
    model, x, classes, a, _, _ = resnet_case
    result = explain.EigenCAM(model, "layer4", normalize=None).explain(x, target=classes)
    for n in range(3):
        expected = np.maximum(slow_eigencam(a[n].double().numpy()), 0)
        torch.testing.assert_close(result.raw_maps[n], upsampled(expected, (64, 64)), rtol=1e-3, atol=1e-5)


def test_scorecam_on_resnet18_batch_of_three(resnet_case):
    model, x, classes, a, _, _ = resnet_case
    result = explain.ScoreCAM(model, "layer4", normalize=None, batch_size=128).explain(x, target=classes)
    for n, expected in enumerate(slow_scorecam(model, x, a, classes)):
        torch.testing.assert_close(result.raw_maps[n], upsampled(np.maximum(expected, 0), (64, 64)),
                                   rtol=1e-3, atol=1e-5)


def test_ablationcam_on_resnet18_batch_of_three(resnet_case):
    model, x, classes, a, _, tail = resnet_case
    result = explain.AblationCAM(model, "layer4", normalize=None).explain(x, target=classes)
    with torch.no_grad():
        for n, c in enumerate(classes):
            y = tail(a[n : n + 1])[0, c]
            ablated = a[n].expand(a.shape[1], -1, -1, -1).clone()  # copy k has channel k zeroed
            ablated[torch.arange(a.shape[1]), torch.arange(a.shape[1])] = 0
            weights = (y - tail(ablated)[:, c]) / y.abs()
            expected = upsampled(torch.relu(sum(weights[k] * a[n, k] for k in range(a.shape[1]))).numpy(), (64, 64))
            # y − y_k cancels in float32 (one channel of 512 moves the score little): compare at the map's scale
            torch.testing.assert_close(result.raw_maps[n], expected, rtol=0, atol=3e-3 * float(expected.abs().max()))


# ---------------------------------------------------------------- shared options


def test_several_layers_are_resized_and_combined(resnet_case):
    model, x, classes, *_ = resnet_case
    single = [explain.GradCAM(model, name, normalize=None).explain(x, target=classes).raw_maps
              for name in ("layer3", "layer4")]
    both = explain.GradCAM(model, ["layer3", "layer4"], normalize=None, normalize_layers=False).explain(
        x, target=classes)
    torch.testing.assert_close(both.raw_maps, (single[0] + single[1]) / 2)
    assert both.layer == ["layer3", "layer4"] and [m.shape[-1] for m in both.low_res_maps] == [4, 2]
    largest = explain.GradCAM(model, ["layer3", "layer4"], normalize=None, normalize_layers=False,
                              combine="max").explain(x, target=classes)
    torch.testing.assert_close(largest.raw_maps, torch.maximum(single[0], single[1]))


def test_minmax_normalisation_and_low_resolution_maps(resnet_case):
    model, x, classes, *_ = resnet_case
    result = explain.HiResCAM(model, "layer4", normalize="minmax", relu=False).explain(x, target=classes)
    flat = result.maps.flatten(1)
    torch.testing.assert_close(flat.amin(1), torch.zeros(3))
    torch.testing.assert_close(flat.amax(1), torch.ones(3))
    assert result.low_res_maps[0].shape == (3, 1, 2, 2)


@pytest.mark.parametrize("name", sorted(explain.REGISTRY))
def test_every_registered_method_runs_from_the_command_line(name, tmp_path, capsys):
    from PIL import Image

    from explain.data import make_dataset
    from explain.data.detection_scenes import make_detection_scenes

    image = tmp_path / "shape.png"
    method = explain.get_method(name)
    if method.explains_instances:  # a detector's method: the demo detector's two best detections in a scene
        Image.fromarray(make_detection_scenes(1, seed=5).images[0]).save(image)
        model, extra, size = "demo-detector", ["--instances", "2"], (192, 96, 3)
    else:
        Image.fromarray(make_dataset(1, seed=5).images[0]).save(image)
        model, extra, size = ("demo-vit" if getattr(method, "needs_attention", False) else "demo"), [], (64, 64, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no zero-gradient warning on the demo model
        options = ["--option", "masks=64"] if name == "drise" else []
        assert main([str(image), "--model", model, "--method", name, "--out", str(tmp_path), *extra, *options]) == 0
    written = np.asarray(Image.open(next(tmp_path.glob(f"shape_{name}_{model}*.png"))))
    assert written.shape == size and written.std() > 1
    printed = capsys.readouterr().out
    assert ("#1 " in printed) if method.explains_instances else ("p=" in printed)


def test_method_names_are_forgiving_and_unknown_names_are_explained():
    assert explain.get_method("Grad-CAM++") is explain.GradCAMPlusPlus
    assert explain.get_method("score_cam") is explain.ScoreCAM
    with pytest.raises(ValueError, match="Did you mean gradcam"):
        explain.get_method("gradcan")
    assert math.isfinite(len(explain.REGISTRY)) and len(explain.REGISTRY) >= 8
