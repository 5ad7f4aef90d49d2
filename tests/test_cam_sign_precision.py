"""CAMs whose maps rounding used to decide: Eigen-CAM's sign after a LayerNorm, XGrad-CAM at signed activations.

After a LayerNorm without affine weights Σ_k A_k ≡ 0 at every position, so the correlation that fixed the principal
component's sign was rounding noise: the sign flipped between float32 and bfloat16 autocast and between a batch and
an image alone. The tiny models here are worked out by hand (the activations are recomputed outside the toolkit).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import explain
from explain.methods.cam import principal_component


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of (N, C, h, w) maps, without affine weights (as ConvNeXt's, untrained)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2]).permute(0, 3, 1, 2)


class ConvNormHead(nn.Module):
    """conv 3 → 8 channels (signed), channel LayerNorm ("norm"), mean over positions, linear → 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = ChannelLayerNorm()
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.conv(x)).mean(dim=(2, 3)))


def images(count: int = 3, size: int = 10) -> Tensor:
    """Dim noise with one bright 3 × 3 patch per image (at a different place), so each map has a clear peak."""
    x = 0.3 * torch.rand(count, 3, size, size, generator=torch.Generator().manual_seed(1))
    for n in range(count):
        top, left = (2 * n + 1) % (size - 3), (3 * n + 2) % (size - 3)
        x[n, :, top:top + 3, left:left + 3] = 1.0
    return x


def normed_features(model: ConvNormHead, x: Tensor) -> np.ndarray:
    """The layer's output A (N, C, h, w), by hand, in float64."""
    with torch.no_grad():
        features = F.conv2d(x.double(), model.conv.weight.double(), model.conv.bias.double(), padding=1)
    centred = features - features.mean(dim=1, keepdim=True)
    return (centred / (centred.pow(2).mean(dim=1, keepdim=True) + 1e-5).sqrt()).numpy()


def peak_signed_component(a: np.ndarray) -> np.ndarray:
    """(C, h, w) → (h, w): the first principal component (numpy eigh), its larger extreme positive."""
    samples = a.reshape(a.shape[0], -1).T
    centred = samples - samples.mean(0)
    _, vectors = np.linalg.eigh(centred.T @ centred)
    projection = centred @ vectors[:, -1]
    if abs(projection.min()) > abs(projection.max()):
        projection = -projection
    return projection.reshape(a.shape[1:])


def correlation(a: Tensor, b: Tensor) -> float:
    a, b = a.flatten().double() - a.double().mean(), b.flatten().double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


METHODS = [explain.EigenCAM, explain.KernelPCACAM]


def test_the_reference_after_a_channel_layer_norm_is_zero_at_every_position():
    """The premise: Σ_k A_k is 0 up to float32 rounding, so it cannot say which sign is evidence."""
    model = ConvNormHead().eval()
    x = images()
    a = normed_features(model, x)
    assert np.abs(a.sum(axis=1)).max() < 1e-12 * np.abs(a).sum(axis=1).max()
    with torch.no_grad():
        float32 = model.norm(model.conv(x))
    assert float32.sum(dim=1).abs().max() < 1e-5 * float32.abs().sum(dim=1).max()


def test_eigencam_after_a_layer_norm_is_the_principal_component_with_its_larger_extreme_positive():
    model = ConvNormHead().eval()
    x = images()
    result = explain.EigenCAM(model, "norm", normalize=None, relu=False).explain(x)
    a = normed_features(model, x)
    for n in range(len(x)):
        expected = peak_signed_component(a[n])
        assert abs(expected.min()) < 0.9 * expected.max()  # a clear peak: the sign rule is not a near tie here
        np.testing.assert_allclose(result.raw_maps[n].double().numpy(), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("method", METHODS, ids=["eigencam", "kpcacam"])
def test_the_sign_after_a_layer_norm_is_the_same_under_bfloat16_autocast_and_for_an_image_alone(method):
    model = ConvNormHead().eval()
    x = images()
    explainer = method(model, "norm", normalize=None, relu=False)
    float32 = explainer.explain(x).raw_maps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bfloat16 = explainer.explain(x).raw_maps
    for n in range(len(x)):
        assert correlation(bfloat16[n], float32[n]) > 0.9
        alone = explainer.explain(x[n:n + 1]).raw_maps[0]
        torch.testing.assert_close(alone, float32[n], rtol=1e-4, atol=1e-5)


def test_where_the_reference_is_informative_the_sign_still_follows_it_not_the_peak():
    """Terms u vᵀ (+ small noise) with Σ_k v_k > 0: the reference Σ_k terms_k ∝ u decides the sign, so the map is
    ≈ u although u's largest value in magnitude is negative (the peak rule would negate it)."""
    generator = torch.Generator().manual_seed(2)
    u = torch.rand(16, generator=generator) * 0.5
    u[5] = -3.0
    v = torch.rand(6, generator=generator) + 0.1
    terms = (v[:, None] * u[None, :] + 1e-3 * torch.randn(6, 16, generator=generator)).reshape(1, 6, 4, 4)
    projection = principal_component(terms).flatten()
    assert correlation(projection, u) > 0.99
    assert projection.argmin() == 5 and projection.min().abs() > projection.max().abs()
    # and through a model: a ReLU layer's maps keep the reference's sign (slow formula of tests/test_cam_variants.py)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(6, 3)).eval()
    x = images(2)
    result = explain.EigenCAM(model, "1", normalize=None, relu=False).explain(x)
    with torch.no_grad():
        a = model[1](model[0](x)).double().numpy()
    for n in range(2):
        samples = a[n].reshape(6, -1).T
        centred = samples - samples.mean(0)
        _, vectors = np.linalg.eigh(centred.T @ centred)
        expected = centred @ vectors[:, -1]
        reference = samples.sum(1)
        if ((expected - expected.mean()) * (reference - reference.mean())).sum() < 0:
            expected = -expected
        np.testing.assert_allclose(result.raw_maps[n].double().numpy().ravel(), expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- XGrad-CAM


class Cancelling(nn.Module):
    """conv 3 → 8 channels (the layer, signed) whose biases make each channel's sum over the positions of one image
    1e-3 of its spread, then A ⊙ |A| averaged (so G varies over positions) and linear → 4 classes."""

    def __init__(self, x: Tensor, remainder: float = 1e-3) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            unbiased = F.conv2d(x.double(), self.conv.weight.double(), None, padding=1)[0]
            self.conv.bias.copy_(-unbiased.mean(dim=(1, 2)) + remainder * unbiased.std(dim=(1, 2)))

    def forward(self, x: Tensor) -> Tensor:
        features = self.conv(x)
        return self.head((features * features.detach().abs()).mean(dim=(2, 3)))


def test_xgradcam_at_cancelling_channels_under_autocast_is_close_to_float32_or_warns():
    """|Σ A_k| ≈ 2e-3 Σ|A_k|: bfloat16 rounding of A decides the weights (the map moved by 2.0 of its maximum with
    no warning); now the maps stay within 0.02 of float32's or one RuntimeWarning at the caller's line says so."""
    x = images(1, 12)
    model = Cancelling(x).eval()
    with torch.no_grad():
        features = model.conv(x)
    assert (features.sum(dim=(2, 3)).abs() < 3e-3 * features.abs().sum(dim=(2, 3))).all()
    explainer = explain.XGradCAM(model, "conv", relu=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32: rounding cannot move the map, no warning
        float32 = explainer.explain(x, target=[1]).maps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bfloat16 = explainer.explain(x, target=[1]).maps
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning) and "XGradCAM" in str(w.message)]
    assert len(warned) == 1 or (bfloat16 - float32).abs().max() <= 0.02
    if warned:
        assert warned[0].filename == __file__


def test_xgradcam_at_a_relu_layer_is_still_the_papers_formula():
    """w_k = Σ_ij A_k,ij G_k,ij / Σ_ab A_k,ab with G by hand (linear head after mean pooling: G = W_c / hw)."""
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(6, 3)).eval()
    x = images(2)
    result = explain.XGradCAM(model, "1", normalize=None, relu=False).explain(x, target=[0, 2])
    with torch.no_grad():
        a = model[1](model[0](x)).double().numpy()
    weights = model[4].weight.detach().double().numpy()
    for n, c in enumerate([0, 2]):
        g = np.broadcast_to(weights[c][:, None, None] / a[n, 0].size, a[n].shape)
        sums = a[n].sum(axis=(1, 2))
        w = np.where(sums != 0, (a[n] * g).sum(axis=(1, 2)) / np.where(sums != 0, sums, 1), 0.0)
        np.testing.assert_allclose(result.raw_maps[n].double().numpy(), (w[:, None, None] * a[n]).sum(0),
                                   rtol=1e-5, atol=1e-6)
