"""ROAD's imputation noise, two scales: ``noise_scale="absolute"`` is Quantus 0.6's and pytorch-grad-cam's
(Gaussian of standard deviation ``noise`` added to the imputed pixels of the model input); the default "range"
(``noise`` × the image's value range) carries the authors' 0.01 on the [0, 1] image (github.com/tleemann/
road_evaluation, imputed before normalising) to the model input's scale."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from torch import nn

from explain import metrics

needs_quantus = pytest.mark.skipif(importlib.util.find_spec("quantus") is None, reason="Quantus 0.6 is not installed")


class MeanModel(nn.Module):
    """Logits (mean of x, −mean of x): the score of class 0 is the mean pixel value."""

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3))
        return torch.stack([mean, -mean], dim=1)


def draws(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The standard normal draws the imputation adds (one (1, C, H, W) draw, the same for every image)."""
    return torch.randn(1, *shape, generator=torch.Generator().manual_seed(seed))


def wide_image() -> tuple[torch.Tensor, torch.Tensor]:
    """A (1, 3, 12, 12) image of value range ~100 and a removed set of 40 scattered pixels."""
    generator = torch.Generator().manual_seed(5)
    image = torch.rand(1, 3, 12, 12, generator=generator) * 100 - 30
    removed = torch.zeros(1, 12 * 12, dtype=torch.bool)
    removed[0, torch.randperm(144, generator=generator)[:40]] = True
    return image, removed.view(1, 12, 12)


def quantus_imputation(image: torch.Tensor, removed: torch.Tensor, noise: float) -> torch.Tensor:
    from quantus.functions.perturb_func import noisy_linear_imputation

    indices = np.flatnonzero(removed[0].numpy())
    return torch.from_numpy(noisy_linear_imputation(image[0].double().numpy(), indices, noise=noise)).float()[None]


@needs_quantus
def test_absolute_noise_is_quantus_sparse_solve_plus_seeded_draws():
    """Ours = Quantus's exact sparse solve (noise 0) + 0.01 × our seeded draws on the removed pixels, whatever
    the image's value range."""
    image, removed = wide_image()
    image = image / 25  # range ~4, as a normalised model input: the old noise was 4 times larger
    ours = metrics.noisy_linear_imputation(image, removed, noise=0.01, seed=3, noise_scale="absolute")
    by_hand = quantus_imputation(image, removed, 0.0) + 0.01 * draws(3, (3, 12, 12)) * removed[:, None]
    torch.testing.assert_close(ours, by_hand, rtol=0, atol=1e-3)  # the CG solver stops at a 1e-4 residual
    noise_only = ours - metrics.noisy_linear_imputation(image, removed, noise=0.0, seed=3)
    torch.testing.assert_close(noise_only, 0.01 * draws(3, (3, 12, 12)) * removed[:, None], rtol=0, atol=1e-5)
    # Quantus's own noise is absolute too: its noisy minus its noiseless imputation, 120 draws of σ = 0.01
    np.random.seed(0)
    theirs = (quantus_imputation(image, removed, 0.01) - quantus_imputation(image, removed, 0.0))[:, :, removed[0]]
    assert 0.007 < theirs.std().item() < 0.013


def test_noise_standard_deviation_on_a_large_flat_region():
    """A flat 50 image (its corner 150, far from the hole: value range 100): the linear imputation of a 40 × 40
    hole is 50; "absolute" noise on its 4800 values has standard deviation 0.01 and mean 0, "range" (the default)
    0.01 × 100, the same draws."""
    image = torch.full((1, 3, 48, 48), 50.0)
    image[0, :, 0, 0] = 150.0
    removed = torch.zeros(1, 48, 48, dtype=torch.bool)
    removed[0, 4:44, 4:44] = True
    clean = metrics.noisy_linear_imputation(image, removed, noise=0.0)
    torch.testing.assert_close(clean, image, rtol=2e-4, atol=0)  # the CG solver stops at a 1e-4 residual
    deviations = (metrics.noisy_linear_imputation(image, removed, noise=0.01, noise_scale="absolute")
                  - clean)[:, :, removed[0]]
    assert deviations.std().item() == pytest.approx(0.01, rel=0.05)  # 4800 draws: the std's own spread is ~1 %
    assert abs(deviations.mean().item()) < 4 * 0.01 / 4800 ** 0.5
    ranged = (metrics.noisy_linear_imputation(image, removed, noise=0.01) - clean)
    torch.testing.assert_close(ranged, 100 * (deviations.new_zeros(ranged.shape).masked_scatter(
        removed[:, None].expand_as(ranged), deviations)), rtol=0, atol=1e-3)  # float32 rounding of 50 + noise, × 100


def test_road_scores_the_imputation_at_either_noise_scale():
    """road scores the model on the imputation with noise of 0.01 × the image's range (the default) or 0.01
    ("absolute"): by hand, the mean of the imputed image, the score of MeanModel's class 0.
    The solver is ours in both, so only the noise is compared."""
    image, _ = wide_image()
    heat = torch.arange(144.0).view(1, 12, 12)  # the last 36 pixels (25 %) are the most relevant
    removed = torch.zeros(1, 12, 12, dtype=torch.bool)
    removed.view(1, -1)[0, -36:] = True
    spread = (image.max() - image.min()).item()
    for scale, deviation in (("absolute", 0.01), (None, 0.01 * spread)):
        options = {} if scale is None else {"noise_scale": scale}
        curve = metrics.road(MeanModel(), image, heat, target=0, percentages=[0.25], score="logit", **options)
        clean = metrics.noisy_linear_imputation(image, removed, noise=0.0)
        by_hand = clean + deviation * draws(0, (3, 12, 12)) * removed[:, None]
        assert curve.area.item() == pytest.approx(by_hand.mean().item(), abs=1e-4)
    assert by_hand.mean().item() != pytest.approx(clean.mean().item(), abs=1e-3)  # the scales differ visibly


def test_noise_scale_is_checked():
    image, removed = wide_image()
    with pytest.raises(ValueError, match="noise_scale must be 'range' .* or 'absolute' .*; got 'relative'"):
        metrics.noisy_linear_imputation(image, removed, noise_scale="relative")
    with pytest.raises(ValueError, match="noise_scale must be .*; got 1"):
        metrics.road(MeanModel(), image, torch.rand(1, 12, 12), target=0, noise_scale=1)  # type: ignore[arg-type]
