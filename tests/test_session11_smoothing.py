"""Session 11, SmoothGrad / SmoothGrad² / VarGrad and the Gaussian blur attacked as a hostile user would: every image
of a call gets the same noise draws (an image's map does not depend on the rest of the batch), scaled per image by
its own value range as in Smilkov et al. 2017 and PAIR's saliency (σ = noise · (max − min) of the image); and a blur's
cost does not grow with σ (BlurIG with max_sigma = 1e6), its values those of scipy.ndimage.gaussian_filter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage
from torch import nn

import explain
from explain.io.blur import blur_matrices, gaussian_blur

STATISTICS = {"mean": explain.SmoothGrad, "mean_square": explain.SmoothGradSquared, "variance": explain.VarGrad}


def small_mlp(classes: int = 3) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 5, 6), nn.Tanh(), nn.Linear(6, classes)).double().eval()


def images(count: int = 3) -> torch.Tensor:
    """Images of different value ranges (so that each gets noise of its own scale)."""
    torch.manual_seed(2)
    ranges = torch.tensor([1.0, 5.0, 0.2, 2.0][:count], dtype=torch.float64).view(-1, 1, 1, 1)
    return torch.randn(count, 3, 4, 5, dtype=torch.float64) * ranges


def by_hand(model: nn.Module, image: torch.Tensor, target: int, samples: int, noise: float, seed: int) -> dict:
    """The statistics of ∂y/∂x over the noisy copies of one (C, H, W) image, the noise drawn sample by sample from a
    CPU generator seeded with ``seed`` (standard normal of the image's shape, float32) and scaled by
    noise · (max − min) of the image (Smilkov et al.; PAIR's stdev_spread)."""
    generator = torch.Generator().manual_seed(seed)
    spread = noise * (image.max() - image.min())
    gradients = []
    for _ in range(samples):
        noisy = (image + torch.randn(image.shape, generator=generator).double() * spread)[None].requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(noisy)[0, target], noisy)
        gradients.append(gradient[0])
    stack = torch.stack(gradients)
    return {"mean": stack.mean(0), "mean_square": stack.pow(2).mean(0), "variance": stack.var(0, unbiased=False)}


@pytest.mark.parametrize("statistic", list(STATISTICS))
def test_each_image_is_the_mean_over_the_same_draws_as_by_hand(statistic):
    model, batch = small_mlp(), images()
    targets = [0, 2, 1]
    result = STATISTICS[statistic](model, samples=5, noise=0.2, seed=7, normalize=None, batch_size=4).explain(
        batch, target=targets)
    for index in range(len(batch)):
        expected = by_hand(model, batch[index], targets[index], 5, 0.2, 7)[statistic]
        torch.testing.assert_close(result.attributions[index, 0], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("statistic", list(STATISTICS))
def test_an_images_map_is_the_same_alone_reordered_or_in_a_batch(statistic):
    model, batch = small_mlp(), images()
    explainer = STATISTICS[statistic](model, samples=4, noise=0.15, seed=3, normalize=None, batch_size=5)
    together = explainer.explain(batch, target=[1, 1, 1]).attributions
    reordered = explainer.explain(batch[[2, 0, 1]], target=[1, 1, 1]).attributions
    torch.testing.assert_close(reordered, together[[2, 0, 1]], rtol=1e-12, atol=0)
    for index in range(len(batch)):
        alone = explainer.explain(batch[index:index + 1], target=1).attributions
        torch.testing.assert_close(alone[0], together[index], rtol=1e-12, atol=0)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 7, None])
def test_splitting_the_copies_into_passes_gives_the_one_pass_result(batch_size):
    model, batch = small_mlp(), images()
    one_pass = explain.VarGrad(model, samples=4, noise=0.3, seed=5, normalize=None, batch_size=12).explain(
        batch, target=[0, 1, 2])
    split = explain.VarGrad(model, samples=4, noise=0.3, seed=5, normalize=None, batch_size=batch_size).explain(
        batch, target=[0, 1, 2])
    torch.testing.assert_close(split.attributions, one_pass.attributions, rtol=1e-12, atol=1e-15)


def test_the_noise_scale_is_per_image_and_the_seed_repeats_the_map():
    model, batch = small_mlp(), images(2)
    explainer = explain.SmoothGrad(model, samples=3, noise=0.1, seed=11, normalize=None)
    spread = explainer.noise_scale(batch).flatten()
    torch.testing.assert_close(spread, 0.1 * (batch.flatten(1).amax(1) - batch.flatten(1).amin(1)), rtol=0, atol=0)
    first, again = explainer.explain(batch, target=0), explainer.explain(batch, target=0)
    assert torch.equal(first.attributions, again.attributions)
    other = explain.SmoothGrad(model, samples=3, noise=0.1, seed=12, normalize=None).explain(batch, target=0)
    assert not torch.allclose(other.attributions, first.attributions)


def test_no_noise_is_saliency_exactly_and_its_variance_zero():
    model, batch = small_mlp(), images()
    saliency = explain.Saliency(model, normalize=None).explain(batch, target=[0, 1, 2])
    for samples in (1, 3):
        smooth = explain.SmoothGrad(model, samples=samples, noise=0.0, normalize=None).explain(batch, target=[0, 1, 2])
        # the same gradients, up to float64 rounding (the copies go through the model in a batch of another size)
        torch.testing.assert_close(smooth.attributions, saliency.attributions, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(smooth.raw_map_grid, saliency.raw_map_grid, rtol=1e-12, atol=1e-15)
    variance = explain.VarGrad(model, samples=3, noise=0.0, normalize=None).explain(batch, target=[0, 1, 2])
    # E[g²] − E[g]² of equal gradients: 0 up to the rounding of gradients of order 0.1 (squares of order 10⁻²)
    torch.testing.assert_close(variance.attributions, torch.zeros_like(variance.attributions), rtol=0, atol=1e-16)


@pytest.mark.parametrize("options", [dict(noise=-0.1), dict(noise=float("nan")), dict(noise=float("inf")),
                                     dict(noise_std=-1.0), dict(noise_std=float("nan")), dict(samples=0),
                                     dict(samples=-3), dict(samples=2.5), dict(average="median")])
def test_bad_options_are_refused_naming_them(options):
    name = next(iter(options))
    with pytest.raises((ValueError, TypeError), match=name):
        explain.SmoothGrad(small_mlp(), **options)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_caller_without_gradients_gets_the_same_map(context):
    model, batch = small_mlp(), images()
    explainer = explain.SmoothGrad(model, samples=3, noise=0.2, seed=1, normalize=None)
    expected = explainer.explain(batch, target=[0, 1, 2]).attributions
    with getattr(torch, context)():
        got = explainer.explain(batch, target=[0, 1, 2]).attributions
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_model_is_left_as_found():
    model = small_mlp()
    model.train()
    model[1].weight.requires_grad_(False)
    hooks = [len(module._forward_hooks) + len(module._backward_hooks) + len(module._forward_pre_hooks)
             for module in model.modules()]
    state = {key: value.clone() for key, value in model.state_dict().items()}
    explain.VarGrad(model, samples=2, noise=0.1, normalize=None).explain(images(), target=0)
    assert model.training and all(module.training for module in model.modules())
    assert not model[1].weight.requires_grad and model[1].bias.requires_grad and model[3].weight.requires_grad
    assert hooks == [len(module._forward_hooks) + len(module._backward_hooks) + len(module._forward_pre_hooks)
                     for module in model.modules()]
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in state.items())


# --- the Gaussian blur ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sigma", [0.4, 1.3, 3.0, 9.5])
@pytest.mark.parametrize("boundary, mode", [("zeros", "constant"), ("reflect", "mirror")])
def test_the_blur_is_scipys_gaussian_filter(sigma, boundary, mode):
    torch.manual_seed(4)
    batch = torch.rand(2, 3, 7, 11, dtype=torch.float64)
    expected = np.stack([ndimage.gaussian_filter(image, sigma=[0, sigma, sigma], mode=mode, truncate=4.0)
                         for image in batch.numpy()])
    torch.testing.assert_close(gaussian_blur(batch, sigma, boundary=boundary), torch.from_numpy(expected),
                               rtol=1e-10, atol=1e-12)


def slow_blur_matrix(size: int, sigma: float, boundary: str) -> torch.Tensor:
    """(size, size) blur matrix from every one of the 2⌊4σ + 0.5⌋ + 1 taps, summed in float64 (numpy)."""
    radius = int(np.floor(4 * sigma + 0.5))
    taps = np.arange(-radius, radius + 1, dtype=np.float64)
    gauss = np.exp(-0.5 * (taps / sigma) ** 2)
    total = gauss.sum()
    matrix = np.zeros((size, size))
    period = 2 * (size - 1)
    if boundary == "reflect":
        folded = np.bincount(np.remainder(taps.astype(np.int64), period), weights=gauss, minlength=period)
        for row in range(size):
            for offset in range(period):
                source = (row + offset) % period
                matrix[row, source if source < size else period - source] += folded[offset]
    else:
        for row in range(size):
            matrix[row] = gauss[radius - row: radius - row + size]
    return torch.from_numpy(matrix / total)


@pytest.mark.parametrize("boundary", ["zeros", "reflect"])
def test_a_huge_sigma_blurs_as_every_tap_summed_by_hand(boundary):
    sigma = 1e6  # 8 million taps: the blur sums them in closed form
    got = blur_matrices(6, torch.tensor([sigma], dtype=torch.float64), torch.tensor([np.floor(4 * sigma + 0.5)],
                                                                                   dtype=torch.float64), boundary)[0]
    torch.testing.assert_close(got, slow_blur_matrix(6, sigma, boundary), rtol=1e-10, atol=0)
    torch.manual_seed(5)
    batch = torch.rand(2, 3, 6, 6)  # float32, σ = 1e6 and 1e12 for each image
    blurred = gaussian_blur(batch, [sigma, 1e12], boundary=boundary)
    matrix = got.float()
    torch.testing.assert_close(blurred[0], matrix @ batch[0] @ matrix.T, rtol=1e-5, atol=1e-7)
    if boundary == "reflect":  # a kernel far wider than the image: the mirrored image's mean
        weights = torch.tensor([0.5, 1, 1, 1, 1, 0.5]) / 5
        mean = torch.einsum("chw,h,w->c", batch[1], weights, weights)
        torch.testing.assert_close(blurred[1], mean.view(3, 1, 1).expand(3, 6, 6), rtol=1e-5, atol=1e-6)


def test_a_small_sigma_with_a_huge_radius_is_cut_where_its_taps_vanish():
    torch.manual_seed(6)
    batch = torch.rand(1, 2, 5, 9, dtype=torch.float64)
    for boundary, mode in (("zeros", "constant"), ("reflect", "mirror")):
        got = gaussian_blur(batch, 1.5, radii=10**9, boundary=boundary)
        expected = ndimage.gaussian_filter(batch[0].numpy(), sigma=[0, 1.5, 1.5], mode=mode, truncate=40.0)
        torch.testing.assert_close(got[0], torch.from_numpy(expected), rtol=1e-10, atol=1e-12)


def test_blur_ig_with_a_huge_max_sigma_runs_and_starts_from_the_blurred_image():
    model = small_mlp().float()
    batch = images(2).float()
    result = explain.BlurIG(model, max_sigma=1e6, steps=4, normalize=None).explain(batch, target=[0, 1])
    assert torch.isfinite(result.attributions).all()
    assert result.attributions.abs().sum() > 0
