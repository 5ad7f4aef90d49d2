"""Issue 29, second tranche: the faithfulness metrics faithfulness_correlation, faithfulness_estimate,
monotonicity, monotonicity_correlation, region_perturbation, selectivity, sensitivity_n, irof,
infidelity and sufficiency.

Each is checked on a tiny linear model whose answer is worked out by hand, and against Quantus 0.6 on
the shipped demo CNN and a randomly initialised resnet18, 4 images of 48 px with different targets, the
same maps and the same random draws (Quantus's numpy draws replayed and passed to ours). Quantus steps
through the C·H·W input values k at a time and insists that k divides H·W; with k a multiple of 3 every
step holds whole pixels, which is what ``features="pixels"`` removes: 48² = 2304 = 3 · 768 allows that.
Where Quantus 0.6 computes something else than the metric's paper (monotonicity, sensitivity-n, IROF's
default baseline, sufficiency with constant pixels), the test shows what and why. The Quantus tests skip
when it is not installed (``pip install --no-deps "quantus==0.6.*"``; ``pip install pandas cachetools``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from test_metrics_breadth import Linear, as_numpy, demo_images, needs_quantus, quantus_metric, resnet18, signed_maps
from torch import nn

import explain
from explain import metrics
from explain.data import load_demo_model

SIZE = 48


@pytest.fixture(scope="module", params=["demo", "resnet18"])
def setting(request):
    """(model, (4, 3, 48, 48) inputs, (4,) targets all different, (4, 48, 48) signed gradient maps)."""
    images, labels, _ = demo_images()
    images = F.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    model, targets = (load_demo_model(), labels) if request.param == "demo" else (resnet18(),
                                                                                   torch.tensor([3, 141, 500, 999]))
    return model, images, targets, signed_maps(model, images, targets)


def ones_model(shape=(1, 2, 2), bias=0.5) -> Linear:
    """Logits (Σ x + b, −Σ x + b): removing a value v lowers the class-0 logit by v."""
    model = Linear(shape)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(bias)
    return model


def pixel_contributions(model: Linear, x: torch.Tensor) -> torch.Tensor:
    """(N, H, W) Σ_c w x: by how much each pixel moves the class-0 logit from a zero input."""
    return (x * model.weight.detach()).sum(dim=1)


def correlation(first, second) -> float:
    return float(np.corrcoef(np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64))[0, 1])


class Recorder(nn.Module):
    """The model, recording every batch it is given and its outputs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def forward(self, x):
        result = self.model(x)
        self.inputs.append(x.detach().clone())
        self.outputs.append(result.detach().clone())
        return result


# ------------------------------------------------------------------ by hand


def test_faithfulness_correlation_by_hand():
    model = ones_model()
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    one_at_a_time = torch.tensor([[[0], [1], [2], [3]]])  # four runs, one pixel each: drops 1, 2, 3, 4
    reversed_map = torch.tensor([[[4.0, 3.0], [2.0, 1.0]]])
    reversed_value = metrics.faithfulness_correlation(model, x, reversed_map, 0, subsets=one_at_a_time)
    assert reversed_value.item() == pytest.approx(-1)
    assert metrics.faithfulness_correlation(model, x, x[:, 0], 0, subsets=one_at_a_time).item() == pytest.approx(1)
    corner = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    pairs = torch.tensor([[[0, 1], [1, 2], [2, 3], [0, 3]]])  # drops 3, 5, 7, 5; map sums 1, 0, 0, 1
    assert metrics.faithfulness_correlation(model, x, corner, 0, subsets=pairs).item() == pytest.approx(
        correlation([1, 0, 0, 1], [3, 5, 7, 5]), abs=1e-6)
    # exact attributions of a linear model: Σ over any subset is its drop, whatever the draws
    model = Linear((3, 8, 8))
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    exact = metrics.faithfulness_correlation(model, x, pixel_contributions(model, x), 0, runs=20, subset_size=10)
    torch.testing.assert_close(exact, torch.ones(3))
    flipped = metrics.faithfulness_correlation(model, x, -pixel_contributions(model, x), 0, runs=20, subset_size=10)
    torch.testing.assert_close(flipped, -torch.ones(3))
    # the draws come from the generator: the same seed, the same value; another seed, another value
    noise_map = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    first, again, other = (metrics.faithfulness_correlation(model, x, noise_map, 0, runs=10, subset_size=5,
                                                            generator=torch.Generator().manual_seed(seed))
                           for seed in (4, 4, 5))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sensitivity_n_by_hand():
    """Ancona et al.: the exact attributions of a linear model reach 1 for every n; sensitivity-n at one n is
    faithfulness_correlation with subsets of that size."""
    model = Linear((3, 8, 8))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    exact = metrics.sensitivity_n(model, x, pixel_contributions(model, x), 0, runs=12)
    assert exact.subset_sizes.tolist() == [1, 2, 3, 5, 9, 17, 29, 51]  # geometric, 1 … 80 % of 64 pixels
    torch.testing.assert_close(exact.correlations, torch.ones(2, 8))
    noise_map = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(2))
    subsets = [torch.stack([torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(10 * i + r))[:n]
                                         for r in range(6)]) for i in range(2)]) for n in (4, 16)]
    result = metrics.sensitivity_n(model, x, noise_map, 0, subsets=subsets)
    assert result.subset_sizes.tolist() == [4, 16]
    for column, chosen in enumerate(subsets):
        torch.testing.assert_close(result.correlations[:, column],
                                   metrics.faithfulness_correlation(model, x, noise_map, 0, subsets=chosen))
    with pytest.raises(ValueError, match="disagree with the subsets' sizes"):
        metrics.sensitivity_n(model, x, noise_map, 0, subsets=subsets, subset_sizes=[4, 8])
    with pytest.raises(ValueError, match="holds 65, more than the 64 features"):
        metrics.sensitivity_n(model, x, noise_map, 0, subset_sizes=[1, 65])


def test_faithfulness_estimate_by_hand():
    model = ones_model((1, 2, 3))
    x = torch.tensor([[[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]]])
    heat = torch.tensor([[[0.5, -1.0, 2.0], [0.0, 3.0, 1.0]]])
    # one pixel a step: the map's values against the pixels' own drops
    single = metrics.faithfulness_estimate(model, x, heat, 0, steps=6).item()
    assert single == pytest.approx(correlation(heat.flatten(), x.flatten()), abs=1e-6)
    # three steps of two pixels, most relevant first: {3.0, 2.0}, {1.0, 0.5}, {0.0, −1.0}
    groups = [(4, 2), (5, 0), (3, 1)]  # the pixels' flat indices
    sums = [float(heat.flatten()[list(g)].sum()) for g in groups]
    drops = [float(x.flatten()[list(g)].sum()) for g in groups]
    assert metrics.faithfulness_estimate(model, x, heat, 0, steps=3).item() == pytest.approx(correlation(sums, drops),
                                                                                            abs=1e-6)
    exact = Linear((3, 6, 6))
    images = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(metrics.faithfulness_estimate(exact, images, pixel_contributions(exact, images), 0,
                                                             steps=12), torch.ones(2))
    with pytest.raises(ValueError, match="steps = 7 is more than the 6 features"):
        metrics.faithfulness_estimate(model, x, heat, 0, steps=7)


def test_monotonicity_by_hand():
    """Contributions 2, −2, 1, 0.5 put back two at a time, least relevant first, from a zero input."""
    model = ones_model()
    x = torch.tensor([[[[2.0, -2.0], [1.0, 0.5]]]])
    right = metrics.monotonicity(model, x, x[:, 0], 0, steps=2, score="logit")  # −2 and 0.5 first, then 1 and 2
    torch.testing.assert_close(right.curves, torch.tensor([[0.5 - 1.5, 0.5 + 1.5]]))
    assert right.monotonic.tolist() == [1.0] and right.fractions.tolist() == [0.5, 1.0]
    wrong = metrics.monotonicity(model, x, torch.tensor([[[0.0, 3.0], [1.0, 2.0]]]), 0, steps=2, score="logit")
    torch.testing.assert_close(wrong.curves, torch.tensor([[0.5 + 3.0, 0.5 + 1.5]]))  # 2 and 1 first, then 0.5, −2
    assert wrong.monotonic.tolist() == [0.0]
    # element by element: a channel's value counts alone
    two_channels = ones_model((2, 1, 2))
    values = torch.tensor([[[[1.0, 1.0]], [[1.0, -5.0]]]])
    elements = metrics.monotonicity(two_channels, values, torch.tensor([[[1.0, 2.0]]]), 0, steps=4,
                                    features="elements", score="logit")
    assert elements.monotonic.tolist() == [0.0]  # the −5 comes back with the pixel the map ranks highest
    assert elements.curves[0, -1].item() == pytest.approx(0.5 - 2.0)


def test_monotonicity_correlation_by_hand():
    """Replacing pixel i by v moves the logit by w_i (v − x_i): the mean square change over the samples is known,
    and a map ranked like it correlates 1, ranked against it −1."""
    model = ones_model((1, 1, 4))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]))
    x = torch.zeros(1, 1, 1, 4)
    noise = torch.tensor([1.0, -1.0]).view(1, 1, 2, 1)  # every step, samples v = 1 and −1: change w_i²
    ranked = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    assert metrics.monotonicity_correlation(model, x, ranked, 0, steps=4, samples=2, noise=noise,
                                            score="logit").item() == pytest.approx(1.0)
    assert metrics.monotonicity_correlation(model, x, -ranked.flip(-1), 0, steps=4, samples=2, noise=noise,
                                            score="logit").item() == pytest.approx(-1.0)  # |map| counts
    with pytest.raises(ValueError, match=r"noise has shape \(3,\), which does not broadcast"):
        metrics.monotonicity_correlation(model, x, ranked, 0, steps=4, samples=2, noise=torch.ones(3))


def test_patch_grid_is_centred_as_quantus_pads():
    grid, count = metrics.patch_grid(6, 5, 4)
    # rows: 2 of padding split 1 | 1 → patches of 3 and 3 rows; columns: 3 split 1 | 2 → 3 and 2 columns
    assert count == 4
    assert grid.tolist() == [[0, 0, 0, 1, 1]] * 3 + [[2, 2, 2, 3, 3]] * 3
    assert metrics.patch_grid(8, 8, 4)[0].unique(return_counts=True)[1].tolist() == [16] * 4


def test_region_perturbation_and_selectivity_by_hand():
    model = ones_model((1, 4, 4))
    x = torch.arange(16.0).view(1, 1, 4, 4) + 1
    heat = x[:, 0].clone()
    patch_sums = torch.tensor([1 + 2 + 5 + 6, 3 + 4 + 7 + 8, 9 + 10 + 13 + 14, 11 + 12 + 15 + 16], dtype=torch.float32)
    original = x.sum() + 0.5
    morf = metrics.region_perturbation(model, x, heat, 0, patch_size=2, score="logit")
    removed = torch.cat([torch.zeros(1), patch_sums.flip(0).cumsum(0)])  # largest patch sum first
    torch.testing.assert_close(morf.curves, (original - removed)[None])
    torch.testing.assert_close(morf.aopc, removed.mean()[None])
    assert morf.fractions.tolist() == [0, 0.25, 0.5, 0.75, 1.0]
    lerf = metrics.region_perturbation(model, x, heat, 0, patch_size=2, order="lerf", regions=2, score="logit")
    torch.testing.assert_close(lerf.curves, (original - torch.tensor([0.0, 14.0, 14.0 + 22.0]))[None])
    given = metrics.region_perturbation(model, x, heat, 0, patch_size=2, order=torch.tensor([[2, 0, 3, 1]]),
                                        score="logit")
    torch.testing.assert_close(given.curves, (original - torch.tensor([0.0, 46, 60, 114, 136]))[None])
    drawn = metrics.region_perturbation(model, x, heat, 0, patch_size=2, order="random", score="logit",
                                        generator=torch.Generator().manual_seed(0))
    assert drawn.curves[0, -1].item() == pytest.approx(0.5)  # every patch gone, in some order
    selective = metrics.selectivity(model, x, heat, 0, patch_size=2, score="logit")
    torch.testing.assert_close(selective.curves, morf.curves)
    trapezoids = ((selective.curves[0, 1:] + selective.curves[0, :-1]) / 2 * 0.25).sum()
    torch.testing.assert_close(selective.area, trapezoids[None])
    with pytest.raises(ValueError, match="permutation of the 4 patch indices"):
        metrics.region_perturbation(model, x, heat, 0, patch_size=2, order=torch.tensor([[0, 0, 1, 2]]))
    with pytest.raises(ValueError, match="order must be 'morf', 'lerf', 'random'"):
        metrics.region_perturbation(model, x, heat, 0, order="most")


def test_irof_by_hand():
    model = ones_model((1, 2, 4), bias=1.0)
    x = torch.tensor([[[[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]]]])  # logit 1 + 4 + 8 = 13
    halves = torch.tensor([[[5, 5, 9, 9], [5, 5, 9, 9]]])  # any labels: numbered 0, 1
    heat = torch.tensor([[[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]])
    result = metrics.irof(model, x, heat, 0, segments=halves, substrate="zeros", score="logit")
    assert result.segments.unique().tolist() == [0, 1]
    torch.testing.assert_close(result.curves[0], torch.tensor([1.0, 5 / 13, 1 / 13]))  # the right half goes first
    expected = 1 - ((1 + 5 / 13) / 2 + (5 / 13 + 1 / 13) / 2) / 2
    assert result.area_over_curve.item() == pytest.approx(expected)
    backwards = metrics.irof(model, x, -heat, 0, segments=halves, substrate="zeros", score="logit")
    assert backwards.area_over_curve.item() < result.area_over_curve.item()
    with pytest.raises(ValueError, match=r"segments must be \(N, H, W\) integer labels"):
        metrics.irof(model, x, heat, 0, segments=torch.zeros(1, 2, 3, dtype=torch.long))


def test_infidelity_by_hand():
    """f(x) − f(x − I) = Iᵀw for a linear model: its gradient w is exactly faithful (Yeh et al.)."""
    model = Linear((3, 6, 6))
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    gradient = model.weight.detach().expand(2, -1, -1, -1)
    perturbations = torch.randn(2, 5, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    assert metrics.infidelity(model, x, gradient, 0, perturbations=perturbations).max().item() < 1e-9
    assert metrics.infidelity(model, x, gradient, 0).max().item() < 1e-9  # the default Gaussian draws too
    changes = (perturbations * gradient[:, None]).sum(dim=(2, 3, 4))  # Iᵀw, exactly f(x) − f(x − I)
    halved = metrics.infidelity(model, x, gradient / 2, 0, perturbations=perturbations)
    torch.testing.assert_close(halved, (changes / 2).pow(2).mean(dim=1), rtol=1e-4, atol=1e-6)
    assert metrics.infidelity(model, x, gradient / 2, 0, perturbations=perturbations, normalize=True).max() < 1e-9
    # a (N, H, W) map is shared by the channels; a (S, C, H, W) tensor perturbs every image alike
    heat = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(3))
    shared = perturbations[0]
    changes = (shared[None] * gradient[:, None]).sum(dim=(2, 3, 4))
    predicted = (shared[None] * heat[:, None, None]).sum(dim=(2, 3, 4))
    torch.testing.assert_close(metrics.infidelity(model, x, heat, 0, perturbations=shared),
                               (predicted - changes).pow(2).mean(dim=1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="perturbations must be"):
        metrics.infidelity(model, x, gradient, 0, perturbations=torch.zeros(2, 5, 3, 6, 5))
    with pytest.raises(ValueError, match="attributions must have the input's shape"):
        metrics.infidelity(model, x, gradient[:, :2], 0)


class FirstValuesClassifier(nn.Module):
    """Three logits: the first three values of the image's first row, so its class is set by hand."""

    def forward(self, x):
        return x[:, 0, 0, :3]


def test_sufficiency_by_hand():
    images = torch.zeros(4, 1, 2, 4)
    for index, predicted in enumerate([0, 0, 1, 2]):
        images[index, 0, 0, predicted] = 1.0
    maps = torch.zeros(4, 2, 4)
    maps[1, 0, 0] = 0.1  # maps 0 and 1 alike, 2 and 3 alike, the pairs far apart
    maps[2:] = 1.0
    maps[3, 1, 3] = 1.1
    model = FirstValuesClassifier()
    close = metrics.sufficiency(model, images, maps, distance="euclidean")
    assert close.tolist() == [1.0, 1.0, 0.0, 0.0]  # 0 and 1 share their class, 2 and 3 do not
    everyone = metrics.sufficiency(model, images, maps, distance="euclidean", threshold=1.0)
    torch.testing.assert_close(everyone, torch.tensor([1 / 3, 1 / 3, 0.0, 0.0]))
    nobody = metrics.sufficiency(model, images, maps, distance="euclidean", threshold=0.0)
    assert nobody.tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="at least 2 images"):
        metrics.sufficiency(model, images[:1], maps[:1])
    with pytest.raises(ValueError, match="distance must be 'seuclidean' or 'euclidean'"):
        metrics.sufficiency(model, images, maps, distance="cosine")


def test_bad_input_is_refused_saying_what_was_wrong():
    model = ones_model((1, 4, 4))
    x = torch.rand(2, 1, 4, 4)
    heat = torch.rand(2, 4, 4)
    with pytest.raises(ValueError, match="features must be 'pixels' or 'elements'"):
        metrics.faithfulness_estimate(model, x, heat, 0, features="channels")
    with pytest.raises(ValueError, match="3 maps for 2 images"):
        metrics.monotonicity(model, x, torch.rand(3, 4, 4), 0)
    nan_map = heat.clone()
    nan_map[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="map 1 holds NaN"):
        metrics.selectivity(model, x, nan_map, 0)
    with pytest.raises(ValueError, match="repeats a feature within a subset"):
        metrics.faithfulness_correlation(model, x, heat, 0, subsets=torch.tensor([[[0, 0], [1, 2]]] * 2))
    with pytest.raises(ValueError, match="outside the 16 features"):
        metrics.faithfulness_correlation(model, x, heat, 0, subsets=torch.tensor([[[0, 16], [1, 2]]] * 2))
    with pytest.raises(ValueError, match="at least 2 runs"):
        metrics.faithfulness_correlation(model, x, heat, 0, subsets=torch.tensor([[[0, 1]]] * 2))
    with pytest.raises(ValueError, match="3 images' subsets for 2 images"):
        metrics.faithfulness_correlation(model, x, heat, 0, subsets=torch.tensor([[[0], [1]]] * 3))
    with pytest.raises(ValueError, match="subset_size = 17 is more than the 16 features"):
        metrics.faithfulness_correlation(model, x, heat, 0, subset_size=17)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        metrics.faithfulness_correlation(model, x, heat, 0, subset_size=4, generator=0)
    with pytest.raises(ValueError, match="substrate must be one of"):
        metrics.region_perturbation(model, x, heat, 0, substrate="black")
    with pytest.raises(ValueError, match="score must be 'probability' or 'logit'"):
        metrics.infidelity(model, x, heat, 0, score="softmax")
    with pytest.raises(ValueError, match="patch_size must be an int of at least 1"):
        metrics.selectivity(model, x, heat, 0, patch_size=0)
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        metrics.sufficiency(model, x, heat, threshold=float("nan"))
    with pytest.raises(ValueError, match="noise for images 0, 1 hold NaN"):
        metrics.monotonicity_correlation(model, x, heat, 0, steps=2, samples=1, noise=torch.tensor(float("nan")))


def test_the_model_is_left_as_found_and_results_stay_on_its_device():
    model = load_demo_model().train()
    images, labels, _ = demo_images(2)
    heat = torch.rand(2, 64, 64, generator=torch.Generator().manual_seed(0))
    before = model_state(model)
    results = [metrics.faithfulness_correlation(model, images, heat, labels, runs=3, subset_size=50),
               metrics.sensitivity_n(model, images, heat, labels, subset_sizes=[10], runs=3).correlations,
               metrics.faithfulness_estimate(model, images, heat, labels, steps=4),
               metrics.monotonicity(model, images, heat, labels, steps=3).monotonic,
               metrics.monotonicity_correlation(model, images, heat, labels, steps=3, samples=2),
               metrics.region_perturbation(model, images, heat, labels, patch_size=32).aopc,
               metrics.selectivity(model, images, heat, labels, patch_size=32).area,
               metrics.irof(model, images, heat, labels, segments=(heat > 0.5).long()).area_over_curve,
               metrics.infidelity(model, images, heat, labels, samples=3),
               metrics.sufficiency(model, images, heat)]
    assert_state_equal(before, model_state(model))
    assert all(result.device == images.device and bool(torch.isfinite(result).all()) for result in results)


class ViewsItsFeatures(nn.Module):
    """A CNN whose ``.view`` refuses a channels-last batch (its convolution's output is then channels-last)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x):
        features = self.conv(x)
        return self.fc(features.view(features.shape[0], -1))


def test_a_model_that_refuses_the_channels_last_layout_is_run_in_the_usual_one(channels_last_for_small_images):
    from explain.core.memory_format import usual_layout_only

    model = ViewsItsFeatures().eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    heat = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="view size"):
        model(x.contiguous(memory_format=torch.channels_last))
    result = metrics.region_perturbation(model, x, heat, 0, patch_size=2, batch_size=8)
    with usual_layout_only():
        expected = metrics.region_perturbation(model, x, heat, 0, patch_size=2, batch_size=8)
    torch.testing.assert_close(result.curves, expected.curves)


# ------------------------------------------------------------------ against Quantus 0.6


def quantus_subset_draws(seed: int, runs: int, count: int, feature_count: int, size: int) -> torch.Tensor:
    """Quantus 0.6's FaithfulnessCorrelation draws after np.random.seed(seed): per run, np.random.choice of
    ``size`` of the features without replacement for each image, then the N uniform values its "black"
    baseline draws and throws away."""
    state = np.random.get_state()
    np.random.seed(seed)
    runs_drawn = []
    for _ in range(runs):
        runs_drawn.append(np.stack([np.random.choice(feature_count, size, replace=False) for _ in range(count)]))
        np.random.uniform(size=count)
    np.random.set_state(state)
    return torch.from_numpy(np.stack(runs_drawn, axis=1))


@needs_quantus
def test_faithfulness_correlation_equals_quantus(setting):
    model, images, targets, heat = setting
    count, channels = images.shape[:2]
    subsets = quantus_subset_draws(7, 10, count, channels * SIZE * SIZE, 50)
    np.random.seed(7)
    theirs = quantus_metric("FaithfulnessCorrelation", nr_runs=10, subset_size=50, return_aggregate=False)(
        model, images.numpy(), targets.numpy(), as_numpy(heat))
    ours = metrics.faithfulness_correlation(model, images, heat, targets, subsets=subsets, features="elements",
                                            substrate="minimum")
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-4)


@needs_quantus
def test_faithfulness_estimate_equals_quantus(setting):
    model, images, targets, heat = setting
    theirs = quantus_metric("FaithfulnessEstimate", features_in_step=3 * 64)(model, images.numpy(), targets.numpy(),
                                                                             as_numpy(heat))
    for features in ("pixels", "elements"):  # steps of 64 pixels, or of their 192 values
        ours = metrics.faithfulness_estimate(model, images, heat, targets, steps=36, features=features,
                                             substrate="minimum")
        np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-5)


@needs_quantus
def test_monotonicity_against_quantus(setting):
    """Quantus 0.6 starts from the baseline image and at every step writes the baseline again over the
    features it should put back (its perturb_func replaces values by the baseline): the model sees the
    same blank image throughout, so every image is "monotonic". Arya et al. put the features back: with a
    perturb_func that does, Quantus computes our curves and verdicts."""
    model, images, targets, heat = setting
    x, y, a = images.numpy(), targets.numpy(), as_numpy(heat)
    recorder = Recorder(model).eval()
    assert quantus_metric("Monotonicity", features_in_step=3 * 768)(recorder, x, y, a) == [True] * 4
    assert all(torch.equal(seen, recorder.inputs[0]) for seen in recorder.inputs)
    assert bool((recorder.inputs[0] == images.flatten(1).amin(dim=1).view(-1, 1, 1, 1)).all())
    count = images.shape[0]
    values = x.reshape(count, -1)

    def put_back(arr, indices, **kwargs):
        restored = arr.copy()
        rows = np.arange(count)[:, None]
        restored[rows, indices] = values[rows, indices]
        return restored

    for steps in (3, 36):
        recorder = Recorder(model).eval()
        theirs = quantus_metric("Monotonicity", features_in_step=3 * SIZE * SIZE // steps, perturb_func=put_back)(
            recorder, x, y, np.abs(a))
        ours = metrics.monotonicity(model, images, heat.abs(), targets, steps=steps, substrate="minimum")
        their_curves = torch.stack([output.softmax(dim=1)[torch.arange(count), targets]
                                    for output in recorder.outputs], dim=1)
        torch.testing.assert_close(ours.curves, their_curves, rtol=0, atol=1e-5)
        assert ours.monotonic.tolist() == [float(verdict) for verdict in theirs]


@needs_quantus
def test_monotonicity_correlation_equals_quantus(setting):
    """Quantus draws one value per image, step and sample, uniform in [0, 1] (np.random, in step, sample,
    image order): the same draws, given to ours as (N, steps, samples, 1)."""
    model, images, targets, heat = setting
    steps, samples = 9, 3
    np.random.seed(3)
    noise = torch.from_numpy(np.random.uniform(size=(steps, samples, images.shape[0]))).permute(2, 0, 1)[..., None]
    np.random.seed(3)
    theirs = quantus_metric("MonotonicityCorrelation", features_in_step=3 * SIZE * SIZE // steps, nr_samples=samples)(
        model, images.numpy(), targets.numpy(), as_numpy(heat))
    ours = metrics.monotonicity_correlation(model, images, heat, targets, steps=steps, samples=samples,
                                            noise=noise.float())
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-6)


@needs_quantus
def test_region_perturbation_and_selectivity_equal_quantus(setting):
    """Quantus returns the drops f(x) − f(x_k) for k ≥ 1 (region perturbation) and the scores f(x_k) for
    k ≥ 1 (selectivity); ours add k = 0. Patches of 10 px on 48 px leave 2 px, split 1 | 1 as Quantus pads."""
    model, images, targets, heat = setting
    x, y, a = images.numpy(), targets.numpy(), as_numpy(heat)
    for order in ("morf", "lerf"):
        theirs = quantus_metric("RegionPerturbation", patch_size=10, order=order, regions_evaluation=12)(model, x, y, a)
        ours = metrics.region_perturbation(model, images, heat, targets, patch_size=10, order=order, regions=12,
                                           substrate="minimum")
        np.testing.assert_allclose((ours.curves[:, :1] - ours.curves[:, 1:]).numpy(), theirs, atol=1e-5)
    np.random.seed(5)  # Quantus's random order: np.random.permutation of the patches for each image
    order = torch.from_numpy(np.stack([np.random.permutation(25) for _ in range(4)]))
    np.random.seed(5)
    theirs = quantus_metric("RegionPerturbation", patch_size=10, order="random", regions_evaluation=6)(model, x, y, a)
    ours = metrics.region_perturbation(model, images, heat, targets, patch_size=10, order=order, regions=6,
                                       substrate="minimum")
    np.testing.assert_allclose((ours.curves[:, :1] - ours.curves[:, 1:]).numpy(), theirs, atol=1e-5)
    theirs = quantus_metric("Selectivity", patch_size=16)(model, x, y, a)
    ours = metrics.selectivity(model, images, heat, targets, patch_size=16, substrate="minimum")
    np.testing.assert_allclose(ours.curves[:, 1:].numpy(), theirs, atol=1e-5)


@needs_quantus
def test_sensitivity_n_differs_from_quantus_as_the_paper_shows():
    """Ancona et al.: for each n, random subsets of n features, one correlation per image, and exact
    attributions of a linear model reach 1. Quantus 0.6 removes the top features cumulatively, pairs each
    step's drop with that step's attributions only (not the removed set's) and correlates across the
    images of the batch: on exactly complete attributions it is far from 1, where ours is 1."""
    model = Linear((1, 8, 8)).eval()
    x = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    exact = pixel_contributions(model, x)
    theirs = quantus_metric("SensitivityN", features_in_step=8, n_max_percentage=0.8, return_aggregate=False,
                            normalise=False)(model, x.numpy(), np.zeros(6, dtype=int), as_numpy(exact), softmax=False)
    assert len(theirs) == 6 and max(abs(1 - value) for value in theirs) > 0.05
    ours = metrics.sensitivity_n(model, x, exact, 0, subset_sizes=[8, 16, 24, 32, 40, 48], runs=10)
    torch.testing.assert_close(ours.correlations, torch.ones(6, 6))


class Grey(nn.Module):
    """The model on one-channel images, repeated over its three channels."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.expand(-1, 3, -1, -1))


@needs_quantus
def test_irof_equals_quantus_on_one_channel_images(setting, monkeypatch):
    """Quantus 0.6's IROF fails on RGB images (its (N, 1, H, W) segment mask against the (N, 3, H, W) input) and
    calls np.trapz, which NumPy 2 renamed np.trapezoid: on one-channel images, with the alias restored, it
    computes ours. Its default baseline, "mean", is the mean of the whole batch, taken again after each step,
    so an image's score depends on the images beside it; Rieger and Hansen replace a segment by the image's
    mean. With "black", the smallest value of the batch, which removal does not change, the two agree:
    Quantus's unnormalised area over its curve (k ≥ 1) is S · ours + (1 + p₁) / 2."""
    model, images, targets, _ = setting
    grey_model, grey = Grey(model).eval(), images.mean(dim=1, keepdim=True)
    with pytest.raises(AssertionError, match="shape of arr must be the same as the mask"):
        quantus_metric("IROF")(model, images.numpy(), targets.numpy(), as_numpy(torch.rand(4, SIZE, SIZE)))
    if not hasattr(np, "trapz"):
        monkeypatch.setattr(np, "trapz", np.trapezoid, raising=False)
    heat = signed_maps(grey_model, grey, targets)
    theirs = quantus_metric("IROF", perturb_baseline="black", return_aggregate=False)(
        grey_model, grey.numpy(), targets.numpy(), as_numpy(heat))
    ours = metrics.irof(grey_model, grey, heat, targets, substrate=float(grey.min()))
    segment_counts = torch.tensor([curve.shape[0] - 1 for curve in ours.curves])
    first_step = torch.stack([curve[1] for curve in ours.curves])
    np.testing.assert_allclose((segment_counts * ours.area_over_curve + (1 + first_step) / 2).numpy(), theirs,
                               rtol=1e-4)
    assert torch.equal(ours.segments, metrics.slic_segments(grey))


@needs_quantus
def test_infidelity_equals_quantus(setting):
    """Quantus 0.6 replaces the patches of a grid one after another (raster order, cumulatively) by the
    baseline: those are its perturbations I = x − x_k, given to ours. Its n_perturb_samples repeats the same
    deterministic pass (1 here); Yeh et al. draw random perturbations, ours' default."""
    model, images, targets, heat = setting
    grid, patch_count = metrics.patch_grid(SIZE, SIZE, 8)
    lowest = images.flatten(1).amin(dim=1).view(-1, 1, 1, 1)
    perturbed, perturbations = images, []
    for patch in range(patch_count):
        perturbed = torch.where(grid == patch, lowest, perturbed)
        perturbations.append(images - perturbed)
    theirs = quantus_metric("Infidelity", perturb_patch_sizes=[8], n_perturb_samples=1)(
        model, images.numpy(), targets.numpy(), as_numpy(heat))
    ours = metrics.infidelity(model, images, heat, targets, perturbations=torch.stack(perturbations, dim=1))
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-5)


@needs_quantus
def test_sufficiency_equals_quantus(setting):
    """Eight images whose maps come in near-twins; the model's own predictions. Quantus takes |map| (abs=True):
    ours is given |map|. A pixel equal in every map (variance 0) makes Quantus's standardised distances NaN,
    so it finds no neighbours at all; ours leaves such pixels out (they do not tell the maps apart)."""
    model, images, targets, heat = setting
    jitter = torch.randn(heat.shape, generator=torch.Generator().manual_seed(0)) * 0.01 * heat.abs().amax()
    maps = torch.cat([heat, heat[[0, 0, 2, 1]] + jitter]).abs()  # twins of images 0, 0, 2 and 1
    both = torch.cat([images, images])
    theirs = quantus_metric("Sufficiency")(model, both.numpy(), torch.cat([targets, targets]).numpy(),
                                           as_numpy(maps))
    ours = metrics.sufficiency(model, both, maps)
    np.testing.assert_array_equal(ours.numpy(), np.asarray(theirs, dtype=np.float32))
    assert 0 < ours.mean().item() < 1
    bordered = maps.clone()
    bordered[:, 0, 0] = 0.0
    theirs = quantus_metric("Sufficiency")(model, both.numpy(), np.zeros(8, dtype=int), as_numpy(bordered))
    assert list(theirs) == [0.0] * 8
    distance = pytest.importorskip("scipy.spatial.distance")  # standardised distances over the other pixels
    apart = distance.cdist(*[bordered.flatten(1)[:, 1:].double().numpy()] * 2, "seuclidean")
    close = (apart / apart.max() <= 0.6) & ~np.eye(8, dtype=bool)
    predicted = model(both).argmax(dim=1).numpy()
    expected = (close & (predicted[:, None] == predicted[None])).sum(1) / np.maximum(close.sum(1), 1)
    np.testing.assert_allclose(metrics.sufficiency(model, both, bordered).numpy(), expected, rtol=1e-6)


def test_an_explanation_gives_its_maps_and_classes():
    model = load_demo_model()
    images, labels, _ = demo_images(2)
    explanation = explain.Saliency(model, reduce="sum", normalize=None).explain(images, labels)
    from_explanation = metrics.faithfulness_estimate(model, images, explanation, steps=8)
    from_tensor = metrics.faithfulness_estimate(model, images, explanation.map_grid[:, 0], labels, steps=8)
    torch.testing.assert_close(from_explanation, from_tensor)
    from_explanation = metrics.infidelity(model, images, explanation, samples=4)
    per_channel = metrics.infidelity(model, images, explanation.attributions[:, 0], labels, samples=4)
    torch.testing.assert_close(from_explanation, per_channel)  # the per-channel attributions, not the summed map
    summed = metrics.infidelity(model, images, explanation.raw_map_grid[:, 0], labels, samples=4)
    assert not torch.allclose(summed, per_channel)
