"""Session 10: the random-draw metrics score an image the same alone as at any place in any batch.

faithfulness_correlation, sensitivity_n, monotonicity_correlation, infidelity, the "noise" substrate, the
robustness metrics' noise, random_logit's other class and sMPRT's noise drew each image's draws from one
generator in batch order, so image k alone scored differently from image k inside a batch. The draws are now
made once per call and shared by the images of the batch (as the tie order of ``ranking`` and ROAD's noise):
each test scores a batch of 3, each image alone and the batch permuted, from generators in the same state, and
where cheap checks the draws by hand against the documented ones.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import Tensor, nn

import explain
from explain import metrics

PERMUTATION = [2, 0, 1]


class TinyCNN(nn.Module):
    """Conv → ReLU → linear, 6 classes, float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Linear(nn.Module):
    """logit_k = (k + 1) · Σ w · x: a linear model whose class scores are all multiples of one direction."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1),
                                               dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        s = (x * self.weight).sum(dim=(1, 2, 3))
        return torch.stack([s * (k + 1) for k in range(4)], dim=1)


def tiny_model() -> nn.Module:
    return TinyCNN().double().eval()


def images() -> Tensor:
    return torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def maps() -> Tensor:
    return torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def seeded(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_batch_free(score: Callable[[list[int]], Tensor]) -> None:
    """``score(indices)`` (the scores of those images, evaluated together, from a fresh generator) gives each
    image the same value alone, at its place in the batch of 3 and in the permuted batch."""
    together = score([0, 1, 2])
    alone = torch.cat([score([index]) for index in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(score(PERMUTATION), together[PERMUTATION], rtol=1e-9, atol=1e-12)
    assert not torch.isnan(together).any()


# ------------------------------------------------------------------ faithfulness by feature


def test_faithfulness_correlation_scores_an_image_alone_as_in_any_batch():
    model, x, heat = tiny_model(), images(), maps()
    assert_batch_free(lambda rows: metrics.faithfulness_correlation(
        model, x[rows], heat[rows], 1, runs=6, subset_size=10, generator=seeded()))
    assert_batch_free(lambda rows: metrics.faithfulness_correlation(
        model, x[rows], heat[rows], 1, runs=6, subset_size=10, generator=seeded(), features="elements",
        substrate="noise"))


def test_faithfulness_correlation_by_hand_on_a_linear_model():
    """The documented draws: ``runs`` subsets, each the top ``subset_size`` of F uniform keys, shared by every
    image; the Pearson correlation of the map's sums and the drops (w · x over the subset for zeros)."""
    model, x, heat = Linear().eval(), images(), maps()
    runs, size = 7, 12
    result = metrics.faithfulness_correlation(model, x, heat, 2, runs=runs, subset_size=size, generator=seeded(9))
    subsets = torch.rand(runs, 64, generator=seeded(9)).topk(size, dim=1).indices
    contribution = (3 * model.weight * x).sum(dim=1).flatten(1)  # class 2: 3 · Σ_c w · x per pixel
    for image in range(3):
        sums = heat[image].flatten()[subsets].sum(dim=1)
        drops = contribution[image][subsets].sum(dim=1)
        expected = torch.corrcoef(torch.stack([sums, drops]))[0, 1]
        torch.testing.assert_close(result[image].double(), expected, rtol=1e-5, atol=1e-6)


def test_sensitivity_n_scores_an_image_alone_as_in_any_batch():
    model, x, heat = tiny_model(), images(), maps()
    assert_batch_free(lambda rows: metrics.sensitivity_n(
        model, x[rows], heat[rows], 1, subset_sizes=[1, 5, 20], runs=5, generator=seeded()).correlations)


def test_monotonicity_correlation_scores_an_image_alone_as_in_any_batch():
    model, x, heat = tiny_model(), images(), maps()
    assert_batch_free(lambda rows: metrics.monotonicity_correlation(
        model, x[rows], heat[rows], 1, steps=8, samples=3, generator=seeded(), score="logit"))


def test_monotonicity_correlation_noise_by_hand():
    """The default noise is one (steps, samples, C) uniform draw u shared by the images, image n's values
    low_n + (high_n − low_n) · u: giving those values as ``noise`` scores the same."""
    model, x, heat = tiny_model(), images(), maps()
    x = x * torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64).view(-1, 1, 1, 1)  # different value ranges
    drawn = metrics.monotonicity_correlation(model, x, heat, 1, steps=8, samples=3, generator=seeded(4),
                                             score="logit")
    u = torch.rand(1, 8, 3, 3, generator=seeded(4))
    low, high = x.flatten(1).amin(dim=1).view(-1, 1, 1, 1), x.flatten(1).amax(dim=1).view(-1, 1, 1, 1)
    given = metrics.monotonicity_correlation(model, x, heat, 1, steps=8, samples=3, noise=low + (high - low) * u,
                                             score="logit")
    torch.testing.assert_close(drawn, given, rtol=0, atol=0)


def test_infidelity_scores_an_image_alone_as_in_any_batch():
    model, x, heat = tiny_model(), images(), maps()
    assert_batch_free(lambda rows: metrics.infidelity(model, x[rows], heat[rows], 1, samples=5,
                                                      generator=seeded()))
    assert_batch_free(lambda rows: metrics.infidelity(model, x[rows], heat[rows], 1, samples=5,
                                                      generator=seeded(), batch_size=4, normalize=True))


def test_infidelity_by_hand_on_a_linear_model():
    """Perturbation s is N(0, 1) from a generator seeded with the s-th of S seeds drawn from ``generator``, times
    ``noise``, the same for every image; f(x) − f(x − I) = w · I on a linear model."""
    model, x = Linear().eval(), images()
    attributions = torch.randn(3, 3, 8, 8, generator=seeded(6), dtype=torch.float64)
    samples, noise = 4, 0.3
    result = metrics.infidelity(model, x, attributions, 0, samples=samples, noise=noise, generator=seeded(8),
                                batch_size=3)
    seeds = torch.randint(0, 2**62, (samples,), generator=seeded(8))
    perturbations = torch.stack([torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(int(seed)))
                                 for seed in seeds]).double() * noise
    for image in range(3):
        predicted = (perturbations * attributions[image]).flatten(1).sum(dim=1)
        change = (perturbations * model.weight).flatten(1).sum(dim=1)
        expected = (predicted - change).pow(2).mean()
        torch.testing.assert_close(result[image].double(), expected, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ the "noise" substrate


def test_noise_substrate_is_one_draw_scaled_to_each_image():
    x = images() * torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64).view(-1, 1, 1, 1)
    fill = metrics.substrate_for(x, "noise", seed=7)
    u = torch.rand(1, 3, 8, 8, generator=seeded(7)).double()
    low, high = x.flatten(1).amin(dim=1).view(-1, 1, 1, 1), x.flatten(1).amax(dim=1).view(-1, 1, 1, 1)
    torch.testing.assert_close(fill, low + (high - low) * u)
    for index in range(3):
        torch.testing.assert_close(metrics.substrate_for(x[index:index + 1], "noise", seed=7), fill[index:index + 1])


def test_deletion_with_noise_substrate_scores_an_image_alone_as_in_any_batch():
    model, x, heat = tiny_model(), images(), maps()
    assert_batch_free(lambda rows: metrics.deletion(model, x[rows], heat[rows], 1, steps=4, substrate="noise",
                                                    score="logit").area.double())


# ------------------------------------------------------------------ robustness and randomisation


@pytest.mark.parametrize("metric", ["max_sensitivity", "avg_sensitivity", "local_lipschitz_estimate",
                                    "relative_input_stability", "relative_output_stability"])
def test_robustness_noise_scores_an_image_alone_as_in_any_batch(metric):
    model, x = tiny_model(), images()
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    options = {"keep_prediction": False} if metric.startswith("relative") else {}
    assert_batch_free(lambda rows: getattr(metrics, metric)(saliency, x[rows], torch.ones(len(rows)).long(),
                                                            samples=3, generator=seeded(), batch_size=4,
                                                            **options).double())


def test_robustness_noise_is_one_draw_per_sample_shared_by_the_images():
    """max_sensitivity's drawn noise equals giving, as ``noise``, sample s's uniform (C, H, W) draw in
    [−radius, radius] for every image."""
    model, x = tiny_model(), images()
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    targets = torch.tensor([0, 1, 2])
    drawn = metrics.max_sensitivity(saliency, x, targets, samples=3, radius=0.1, generator=seeded(3))
    generator = seeded(3)
    offsets = torch.stack([(torch.rand(3, 8, 8, generator=generator, dtype=torch.float64) * 2 - 1) * 0.1
                           for _ in range(3)])
    given = metrics.max_sensitivity(saliency, x, targets, radius=0.1, noise=offsets[:, None].expand(-1, 3, -1, -1,
                                                                                                      -1))
    torch.testing.assert_close(drawn, given, rtol=0, atol=0)


def test_random_logit_draws_the_other_class_independently_of_the_batch():
    model, x = tiny_model(), images()
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    targets = torch.tensor([0, 3, 5])
    for seed in range(3):
        def score(rows: list[int], seed: int = seed) -> Tensor:
            result = metrics.random_logit(saliency, x[rows], targets[rows], generator=seeded(seed))
            return torch.stack([result.similarity.double(), result.other_classes.double()], dim=1)
        assert_batch_free(score)
        # by hand: one offset u in 0 … 4 shared by the images, u or u + 1 where u ≥ the image's class
        u = int(torch.randint(0, 5, (1,), generator=seeded(seed)))
        expected = [u + (u >= int(target)) for target in targets]
        assert metrics.random_logit(saliency, x, targets, generator=seeded(seed)).other_classes.tolist() == expected


def test_smooth_mprt_scores_an_image_alone_as_in_any_batch():
    model, x = tiny_model(), images()
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    targets = torch.tensor([0, 1, 2])

    def score(rows: list[int]) -> Tensor:
        stages = metrics.smooth_mprt(saliency, x[rows], targets[rows], samples=3, generator=seeded(), batch_size=4)
        return torch.stack([value for stage in stages for value in (stage.rank_correlation, stage.ssim)],
                           dim=1).double()
    assert_batch_free(score)


# ------------------------------------------------------------------ axiomatic


class Curved(nn.Module):
    """w · x + 1e-3 · x², w = 1: not affine, the shift m leaves an error 2e-3 · m · x per value."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x + 1e-3 * x * x


class SlightlyCurved(nn.Module):
    """score = Σ (x + 1e-3 · x²), twice (two classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Curved()

    def forward(self, x: Tensor) -> Tensor:
        s = self.first(x).flatten(1).sum(dim=1)
        return torch.stack([s, s], dim=1)


def test_input_invariance_refuses_an_image_whatever_its_companions():
    """Image a: values 0.1, score 4.8, error of the shift 2e-3 · 4.8 = 9.6e-3 > 1e-4 · 4.8: refused alone. Image
    b: values ±100 (Σ x = 0: no error), score 1e-3 · 48 · 1e4 = 480. Before, the tolerance was the batch's
    largest score's (1e-4 · 480 = 0.048), so image a passed beside image b."""
    small = torch.full((1, 3, 4, 4), 0.1, dtype=torch.float64)
    large = (torch.arange(48, dtype=torch.float64) % 2 * 2 - 1).view(1, 3, 4, 4) * 100
    saliency = explain.Saliency(SlightlyCurved(), reduce="sum", normalize=None)
    scores = SlightlyCurved()(torch.cat([small, large]))[:, 0]
    torch.testing.assert_close(scores, torch.tensor([4.8 + 4.8e-4, 480.0], dtype=torch.float64))
    for batch in (small, torch.cat([small, large]), torch.cat([large, small])):
        with pytest.raises(ValueError, match="is not affine in its input"):
            metrics.input_invariance(saliency, batch, 0)
    result = metrics.input_invariance(saliency, large, 0)  # image b alone passes; its gradient 1 + 2e-3 · x moves
    assert result.invariant.tolist() == [0.0]  # by 2e-3 · m per channel, 6e-3 summed over the 3
    torch.testing.assert_close(result.difference, torch.tensor([6e-3]), rtol=1e-4, atol=0)


def test_region_perturbation_in_random_order_scores_an_image_alone_as_in_any_batch():
    model, batch, heat = tiny_model(), images(), maps()

    def score(indices: list[int]) -> Tensor:
        return metrics.region_perturbation(model, batch[indices], heat[indices], target=[1] * len(indices),
                                           patch_size=2, order="random", regions=6, generator=seeded(),
                                           score="logit").curves

    assert_batch_free(score)
    # by hand: one order for the batch, the permutation of the 16 patches that sorts the generator's 16 keys
    keys = torch.rand(1, 16, generator=seeded())
    order = keys.argsort(dim=1).expand(3, -1)
    given = metrics.region_perturbation(model, batch, heat, target=[1] * 3, patch_size=2, order=order, regions=6,
                                        score="logit").curves
    torch.testing.assert_close(score([0, 1, 2]), given)
