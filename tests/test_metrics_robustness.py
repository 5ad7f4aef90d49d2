"""Issue 29, second tranche: robustness metrics that explain perturbed copies of the images (max and
average sensitivity, local Lipschitz estimate, relative input / output / representation stability,
continuity), consistency, and the repaired randomisation tests (eMPRT, sMPRT).

Each metric is worked out by hand on a model whose gradient map is linear in the input, and checked
against Quantus 0.6 on the shipped demo CNN and on a randomly initialised torchvision resnet18 (64 px),
4 images with different targets, the same maps, explainer (ours, wrapped as Quantus's explain_func) and
random draws (Quantus's numpy draws given to ours as ``noise``; its layer re-initialisation given to ours
as ``randomize``). Where Quantus 0.6 computes something else than the metric's paper, the test shows the
difference and why. The Quantus tests skip when it is not installed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from test_metrics_breadth import as_numpy, demo_images, needs_quantus, quantus_explain_func, quantus_metric, resnet18
from torch import nn

import explain
from explain.data import load_demo_model
from explain.metrics.randomisation import discrete_entropy, efficient_mprt, histogram_counts, smooth_mprt
from explain.metrics.robustness import (
    avg_sensitivity,
    consistency,
    continuity,
    local_lipschitz_estimate,
    max_sensitivity,
    quantus_shifts,
    relative_input_stability,
    relative_output_stability,
    relative_representation_stability,
    top_pixels,
    translate,
)
from explain.metrics.sanity import reinitialize

# ------------------------------------------------------------------ a model with closed forms


class Square(nn.Module):
    def forward(self, x):
        return x * x


class WeightedSum(nn.Module):
    """(N, C, H, W) → (N, K): ½ Σ_chw w_k ⊙ values."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, values):
        return 0.5 * torch.einsum("nchw,kchw->nk", values, self.weight)


class Quadratic(nn.Module):
    """Logits ½ Σ w_k ⊙ x²: the gradient of class k is w_k ⊙ x, so Saliency(reduce="sum")'s map is
    Φ_k(x) = Σ_c w_kc x_c, linear in x, and every robustness metric has a closed form."""

    def __init__(self, classes: int = 3, shape=(3, 5, 6), seed: int = 0):
        super().__init__()
        self.square = Square()
        self.head = WeightedSum(torch.randn(classes, *shape, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x):
        return self.head(self.square(x))


def quadratic_setting(count: int = 3):
    model = Quadratic()
    x = torch.randn(count, 3, 5, 6, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([0, 1, 2, 0][:count])
    return model, x, targets, explain.Saliency(model, reduce="sum", normalize=None)


def linear_map(weight: np.ndarray, x: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(N, H, W) Σ_c w_kc x_c, by numpy in float64."""
    return np.stack([(weight[k] * image).sum(axis=0) for k, image in zip(targets, x)])


def draws(shape, seed: int = 2, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# ------------------------------------------------------------------ by hand


def test_sensitivities_and_lipschitz_by_hand():
    model, x, targets, saliency = quadratic_setting()
    noise = draws((4, *x.shape))
    w, xs, d, k = model.head.weight.detach().double().numpy(), x.double().numpy(), noise.numpy(), targets.numpy()
    before = linear_map(w, xs, k)
    moved = np.stack([linear_map(w, (x.double() + noise[s]).float().double().numpy(), k) - before for s in range(4)])
    change = np.linalg.norm(moved.reshape(4, 3, -1), axis=2)  # (S, N) ‖Φ(x + δ) − Φ(x)‖
    scale = np.linalg.norm(before.reshape(3, -1), axis=1)
    ours = max_sensitivity(saliency, x, targets, noise=noise)
    np.testing.assert_allclose(ours.numpy(), (change / scale).max(axis=0), rtol=1e-5)
    np.testing.assert_allclose(avg_sensitivity(saliency, x, targets, noise=noise).numpy(),
                               (change / scale).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(max_sensitivity(saliency, x, targets, noise=noise, relative=False).numpy(),
                               change.max(axis=0), rtol=1e-5)
    steps = np.linalg.norm(d.reshape(4, 3, -1), axis=2)  # ‖δ‖
    np.testing.assert_allclose(local_lipschitz_estimate(saliency, x, targets, noise=noise).numpy(),
                               (change / steps).max(axis=0), rtol=1e-5)
    # a map that does not depend on the input at all is perfectly robust
    constant = explain.Saliency(WeightedSumOfInput(), reduce="sum", normalize=None)
    assert max_sensitivity(constant, x, 0, noise=noise).tolist() == [0.0, 0.0, 0.0]
    assert local_lipschitz_estimate(constant, x, 0, noise=noise).tolist() == [0.0, 0.0, 0.0]


class WeightedSumOfInput(nn.Module):
    """A linear model: its gradient, and so its Saliency map, is the same for every input."""

    def forward(self, x):
        return torch.stack([x.sum(dim=(1, 2, 3)), -x.sum(dim=(1, 2, 3))], dim=1)


def test_relative_stabilities_by_hand():
    model, x, targets, saliency = quadratic_setting()
    noise = draws((3, *x.shape), scale=0.1)
    w, k = model.head.weight.detach().double().numpy(), targets.numpy()
    xs = x.double().numpy()
    copies = [(x.double() + noise[s]).float().double().numpy() for s in range(3)]
    e_x = linear_map(w, xs, k)
    input_terms, output_terms, representation_terms = [], [], []
    for copy in copies:
        e_copy = linear_map(w, copy, k)
        change = np.linalg.norm(((e_x - e_copy) / e_x).reshape(3, -1), axis=1)
        moved = np.linalg.norm(((xs - copy) / xs).reshape(3, -1), axis=1)
        logits = 0.5 * np.einsum("nchw,kchw->nk", xs**2, w)
        logits_copy = 0.5 * np.einsum("nchw,kchw->nk", copy**2, w)
        squares = np.linalg.norm(((xs**2 - copy**2) / xs**2).reshape(3, -1), axis=1)
        input_terms.append(change / moved)
        output_terms.append(change / np.linalg.norm(logits - logits_copy, axis=1))
        representation_terms.append(change / squares)
    options = dict(noise=noise, keep_prediction=False)
    np.testing.assert_allclose(relative_input_stability(saliency, x, targets, **options).numpy(),
                               np.max(input_terms, axis=0), rtol=1e-4)
    np.testing.assert_allclose(relative_output_stability(saliency, x, targets, **options).numpy(),
                               np.max(output_terms, axis=0), rtol=1e-4)
    np.testing.assert_allclose(relative_representation_stability(saliency, x, targets, layers="square",
                                                                 **options).numpy(),
                               np.max(representation_terms, axis=0), rtol=1e-4)


def test_keep_prediction_leaves_out_copies_whose_class_changed():
    """Two classes ±(Σx + 0.01 Σx²): noise flips the top class of some copies near Σx = 0, which are
    left out; the others' largest is kept, copy by copy."""
    x = torch.full((3, 3, 5, 6), 0.002)
    x[1] = 1.0  # far from the boundary: no copy flips
    noise = draws((6, *x.shape), seed=4, scale=0.05)
    model = FlipAndSquare()
    with torch.no_grad():
        flipped = torch.stack([model((x.double() + offsets).float()).argmax(dim=1) != 0 for offsets in noise])
    assert bool(flipped[:, 0].any()) and not bool(flipped[:, 1].any()) and not bool(flipped.all(dim=0).any())
    combined = explain.Saliency(FlipAndSquare(), reduce="sum", normalize=None)
    per_sample = torch.stack([max_sensitivity(combined, x, 0, noise=noise[s:s + 1]) for s in range(6)])
    kept = max_sensitivity(combined, x, 0, noise=noise, keep_prediction=True)
    expected = torch.where(flipped, -torch.inf, per_sample.double()).amax(dim=0)
    expected = torch.where(flipped.all(dim=0), torch.nan, expected).float()
    torch.testing.assert_close(kept, expected, equal_nan=True)
    assert torch.equal(max_sensitivity(combined, x, 0, noise=noise), per_sample.amax(dim=0))
    every_copy_flips = torch.full_like(noise, -1.0)
    assert max_sensitivity(combined, x[:1], 0, noise=every_copy_flips[:, :1], keep_prediction=True).isnan().all()


class FlipAndSquare(nn.Module):
    """Logits (Σx + ε·Σx², −Σx − ε·Σx²): the top class is the sign of Σx (for small ε), the gradient
    moves with x."""

    def forward(self, x):
        score = x.sum(dim=(1, 2, 3)) + 0.01 * (x * x).sum(dim=(1, 2, 3))
        return torch.stack([score, -score], dim=1)


def test_continuity_by_hand():
    model, x, targets, saliency = quadratic_setting()
    w, k = model.head.weight.detach().double().numpy(), targets.numpy()
    xs = x.double().numpy()
    before = linear_map(w, xs, k)
    expected = np.zeros(3)
    for shift in (-2, 1, 3):
        moved = np.empty_like(xs)
        low = xs.reshape(3, -1).min(axis=1)[:, None, None, None]
        moved[...] = low  # Quantus's "black": each image's smallest value
        if shift > 0:
            moved[..., shift:] = xs[..., :-shift]
        else:
            moved[..., :shift] = xs[..., -shift:]
        change = np.abs(linear_map(w, moved, k) - before).reshape(3, -1).sum(axis=1)
        distance = np.linalg.norm((moved - xs).reshape(3, -1), axis=1)
        expected = np.maximum(expected, change / distance)
    ours = continuity(saliency, x, targets, shifts=[-2, 1, 3])
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-5)
    down = translate(x, torch.tensor([2, 2, 2]), torch.zeros_like(x), "y")
    assert torch.equal(down[:, :, 2:], x[:, :, :-2]) and not down[:, :, :2].any()
    assert quantus_shifts(64) == [shift for shift in range(-60, 49, 4) if shift != 0]
    with pytest.raises(ValueError, match="non-zero whole pixel translations"):
        continuity(saliency, x, targets, shifts=[0, 1])
    with pytest.raises(ValueError, match="direction must be 'x'"):
        continuity(saliency, x, targets, direction="z")


def test_consistency_by_hand():
    model = WeightedSumOfInput()
    x = torch.ones(5, 3, 4, 4)
    x[3:] = -1.0  # predictions: class 0, 0, 0, 1, 1
    maps = torch.zeros(5, 4, 4)
    maps[[0, 1, 3], 0, 0] = 1.0  # explanation A for images 0, 1, 3
    maps[2, 3, 3] = 1.0  # explanation B for image 2 alone
    maps[4, 0, 0] = -1.0  # |map|: explanation A as well
    # image 0: peers 1, 3, 4 → same class as 1 only; image 3: peers 0, 1, 4 → 4; image 2: no peer
    ours = consistency(model, x, maps, top=1)
    torch.testing.assert_close(ours, torch.tensor([1 / 3, 1 / 3, math.nan, 1 / 3, 1 / 3]), equal_nan=True)
    # by the sign of the map's sum: images 0 … 3 share "+" (image 3 predicted apart), image 4 is alone
    by_sign = consistency(model, x, maps, discretise=lambda heat: heat.flatten(1).sum(dim=1).sign())
    torch.testing.assert_close(by_sign, torch.tensor([2 / 3, 2 / 3, 2 / 3, 0.0, math.nan]), equal_nan=True)
    assert top_pixels(torch.tensor([[[0.0, -3.0], [3.0, 1.0]]]), 2).tolist() == [[1, 2]]  # |−3| = |3|: a set
    with pytest.raises(ValueError, match="one row per map"):
        consistency(model, x, maps, discretise=lambda heat: heat[:2])
    with pytest.raises(ValueError, match="4 maps for 5 images"):
        consistency(model, x, maps[:4])


def test_histogram_counts_equal_numpy_at_the_edges():
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(500, generator=generator), torch.full((500,), 2.5),  # continuous; constant
            torch.randint(0, 7, (500,), generator=generator).float() / 3,  # many values exactly on bin edges
            torch.linspace(-1, 1, 500)]
    values = torch.stack(rows)
    for bins in (1, 7, 100):
        expected = np.stack([np.histogram(row.numpy(), bins=bins)[0] for row in values])
        np.testing.assert_array_equal(histogram_counts(values, bins).numpy(), expected)
    maps = values.view(4, 20, 25)
    shares = [np.histogram(row.numpy(), bins=100)[0] / 500 for row in values]
    expected = [-(p[p > 0] * np.log(p[p > 0])).sum() for p in shares]
    np.testing.assert_allclose(discrete_entropy(maps).numpy(), expected, rtol=1e-12)
    assert discrete_entropy(maps)[1].item() == 0.0  # a constant map


def test_efficient_mprt_by_hand():
    """The randomised model's weights are set by ``randomize``, so both maps, and their entropies,
    are known: the trained map takes 4 values equally often (ln 4 with 4 bins), the randomised one 2."""
    model = Quadratic(classes=1, shape=(1, 4, 4))
    with torch.no_grad():
        model.head.weight.copy_(torch.arange(16.0).view(1, 1, 4, 4) % 4)
    x = torch.ones(1, 1, 4, 4)
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    before = model_state(model)

    def randomize(layer: nn.Module, index: int) -> None:
        with torch.no_grad():
            layer.weight.copy_(torch.arange(16.0).view(1, 1, 4, 4) % 2)
    result = efficient_mprt(saliency, x, 0, bins=4, randomize=randomize)
    assert result.layers == ["head"]
    torch.testing.assert_close(result.entropy, torch.tensor([math.log(4)], dtype=torch.float64))
    torch.testing.assert_close(result.randomized_entropy, torch.tensor([math.log(2)], dtype=torch.float64))
    torch.testing.assert_close(result.rise, torch.tensor([-0.5], dtype=torch.float64))
    assert_state_equal(before, model_state(model))


def test_smooth_mprt_by_hand():
    """Σ_c w_c x_c is linear in x: the mean map over copies x + δ_s and x is the map of x + mean δ.
    The randomised weights are set by ``randomize``; Spearman against scipy's."""
    scipy_stats = pytest.importorskip("scipy.stats")
    model, x, targets, saliency = quadratic_setting()
    noise = draws((2, *x.shape), seed=5, scale=0.2)
    random_weight = torch.randn(3, 3, 5, 6, generator=torch.Generator().manual_seed(9))

    def randomize(layer: nn.Module, index: int) -> None:
        with torch.no_grad():
            layer.weight.copy_(random_weight)
    before = model_state(model)
    stages = smooth_mprt(saliency, x, targets, samples=3, noise=noise, randomize=randomize)
    assert [stage.layer for stage in stages] == ["head"] and stages[0].layers == ["head"]
    copies = torch.cat([(x.double() + noise).float().double(), x.double()[None]])  # (3, N, C, H, W)
    k = targets.numpy()
    smooth_trained = np.mean([linear_map(model.head.weight.detach().double().numpy(), c.numpy(), k) for c in copies],
                             axis=0)
    smooth_random = np.mean([linear_map(random_weight.double().numpy(), c.numpy(), k) for c in copies], axis=0)
    expected = [scipy_stats.spearmanr(np.abs(a).ravel(), np.abs(b).ravel())[0]
                for a, b in zip(smooth_trained, smooth_random)]
    np.testing.assert_allclose(stages[0].rank_correlation.numpy(), expected, rtol=1e-5)
    assert_state_equal(before, model_state(model))
    unchanged = smooth_mprt(saliency, x, targets, samples=3, noise=noise, randomize=lambda layer, index: None)
    torch.testing.assert_close(unchanged[0].rank_correlation, torch.ones(3))
    torch.testing.assert_close(unchanged[0].ssim, torch.ones(3))


def test_draws_do_not_depend_on_the_batch_size():
    model, x, targets, saliency = quadratic_setting()
    whole = max_sensitivity(saliency, x, targets, samples=5, batch_size=64)
    assert torch.equal(max_sensitivity(saliency, x, targets, samples=5, batch_size=2), whole)
    assert torch.equal(max_sensitivity(saliency, x, targets, samples=5), whole)  # the default generator: seeded
    other = max_sensitivity(saliency, x, targets, samples=5, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other, whole)
    drawn = smooth_mprt(saliency, x, targets, samples=4, batch_size=5)
    again = smooth_mprt(saliency, x, targets, samples=4, batch_size=64)
    assert torch.equal(drawn[0].rank_correlation, again[0].rank_correlation)


def test_robustness_leaves_the_model_as_found_and_refuses_bad_input():
    model, x, targets, saliency = quadratic_setting()
    model.train()
    before = model_state(model)
    relative_representation_stability(saliency, x, targets, layers="square", samples=2)
    continuity(saliency, x, targets, shifts=[1])
    assert_state_equal(before, model_state(model))
    with pytest.raises(ValueError, match=r"noise must be \(S, N, C, H, W\) = \(S, 3, 3, 5, 6\)"):
        max_sensitivity(saliency, x, targets, noise=torch.zeros(2, 3, 5, 6))
    bad = torch.zeros(2, 3, 3, 5, 6)
    bad[1, 2, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="noise row 5 holds NaN"):
        max_sensitivity(saliency, x, targets, noise=bad)
    with pytest.raises(ValueError, match="samples = 3 but the noise holds 2"):
        avg_sensitivity(saliency, x, targets, noise=torch.zeros(2, 3, 3, 5, 6), samples=3)
    with pytest.raises(ValueError, match="one class per image"):
        max_sensitivity(saliency, x, lambda output: output[:, 0], samples=1)
    with pytest.raises(ValueError, match="samples must be an int of at least 1"):
        local_lipschitz_estimate(saliency, x, targets, samples=0)
    with pytest.raises(ValueError, match="std must be a finite number > 0"):
        local_lipschitz_estimate(saliency, x, targets, std=0.0)
    with pytest.raises(ValueError, match="no layer named|not found|did you mean|does not"):
        relative_representation_stability(saliency, x, targets, layers="sqare", samples=1)
    with pytest.raises(ValueError, match="never ran"):
        relative_representation_stability(explain.Saliency(Unused(), reduce="sum"), x, 0, layers="spare",
                                          samples=1)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        max_sensitivity(saliency, x, targets, generator=0)
    with pytest.raises(ValueError, match="give target or explanation, not both"):
        max_sensitivity(saliency, x, targets, explanation=saliency.explain(x, targets))
    with pytest.raises(ValueError, match="order must be 'top_down' or 'bottom_up'"):
        smooth_mprt(saliency, x, targets, order="random")
    with pytest.raises(ValueError, match="bins must be an int of at least 1"):
        efficient_mprt(saliency, x, targets, bins=0)
    with pytest.raises(ValueError, match="samples = 1 averages the image alone"):
        smooth_mprt(saliency, x, targets, samples=1, noise=torch.zeros(1, 3, 3, 5, 6))


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(2, 2)
        self.head = WeightedSum(torch.ones(2, 3, 5, 6))

    def forward(self, x):
        return self.head(x * x)


# ------------------------------------------------------------------ against Quantus 0.6


@pytest.fixture(scope="module", params=["demo", "resnet18"])
def setting(request):
    """(model, (4, 3, 64, 64) inputs, (4,) targets all different, a layer for the representation)."""
    images, labels, _ = demo_images()
    if request.param == "demo":
        return load_demo_model(), images, labels, "layer4.0"
    return resnet18(), images, torch.tensor([3, 141, 500, 999]), "layer4.1"


def quantus_noise(kind: str, samples: int, shape, seed: int, **parameters) -> torch.Tensor:
    """Quantus 0.6's draws after np.random.seed(seed): one (N, C·H·W) array a sample, from numpy's global
    state, as one (S, N, C, H, W) tensor of float64 offsets."""
    state = np.random.get_state()
    np.random.seed(seed)
    values = getattr(np.random, kind)(size=(samples, shape[0], int(np.prod(shape[1:]))), **parameters)
    np.random.set_state(state)
    return torch.from_numpy(values).view(samples, *shape)


def run_quantus(name: str, model, images, targets, maps, seed: int = 7, **options):
    np.random.seed(seed)
    metric = quantus_metric(name, **options)
    return np.asarray(metric(model, images.numpy(), targets.numpy(), a_batch=as_numpy(maps),
                             explain_func=quantus_explain_func()), dtype=np.float64)


@needs_quantus
def test_sensitivities_and_lipschitz_equal_quantus(setting):
    """Quantus divides by ‖Φ(x)‖ (relative=True, our default); Yeh et al. define the plain difference."""
    model, images, targets, _ = setting
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    explanation = saliency.explain(images, targets)
    uniform = quantus_noise("uniform", 3, images.shape, 7, low=-0.2, high=0.2)
    for name, metric in (("MaxSensitivity", max_sensitivity), ("AvgSensitivity", avg_sensitivity)):
        theirs = run_quantus(name, model, images, targets, explanation.raw_maps, nr_samples=3)
        ours = metric(saliency, images, noise=uniform, explanation=explanation)
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-5)
    gaussian = quantus_noise("normal", 3, images.shape, 7, loc=0.0, scale=0.1)
    theirs = run_quantus("LocalLipschitzEstimate", model, images, targets, explanation.raw_maps, nr_samples=3,
                         normalise=False)
    ours = local_lipschitz_estimate(saliency, images, targets, noise=gaussian)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-5)


def changed_classes(model: nn.Module, images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(S, N) whether copy s of image n (images + noise[s], rounded to float32) has another top class."""
    with torch.no_grad():
        predicted = model(images).argmax(dim=1)
        return torch.stack([model((images.double() + offsets).float()).argmax(dim=1) != predicted
                            for offsets in noise])


@needs_quantus
def test_relative_stabilities_equal_quantus(setting):
    """Same one-sided noise as Quantus 0.6's (uniform in [0.02, 0.2]). With every copy counted the two
    agree. Counting only the copies that keep the top class (the default of both), they agree where no
    copy changes it; where one does, Quantus returns NaN (np.max over the NaN it wrote there), where Agarwal
    et al. maximise over the copies that keep it: ours is the largest of those, checked copy by copy."""
    model, images, targets, layer = setting
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    maps = saliency.explain(images, targets).raw_maps
    cases = (("RelativeInputStability", relative_input_stability, {}, {}),
             ("RelativeOutputStability", relative_output_stability, {}, {}),
             ("RelativeRepresentationStability", relative_representation_stability, {"layer_names": [layer]},
              {"layers": layer}))
    for low, high, seed in ((0.02, 0.2, 7), (0.5, 3.0, 8)):
        noise = quantus_noise("uniform", 3, images.shape, seed, low=low, high=high)
        changed = changed_classes(model, images, noise).any(dim=0).numpy()
        bounds = {"lower_bound": low, "upper_bound": high}
        for name, metric, their_options, our_options in cases if low == 0.02 else cases[:1]:
            every = run_quantus(name, model, images, targets, maps, seed=seed, nr_samples=3,
                                perturb_func_kwargs=bounds, return_nan_when_prediction_changes=False, **their_options)
            ours = metric(saliency, images, targets, noise=noise, keep_prediction=False, **our_options)
            np.testing.assert_allclose(ours.numpy(), every, rtol=2e-5)
            kept = run_quantus(name, model, images, targets, maps, seed=seed, nr_samples=3, perturb_func_kwargs=bounds,
                               **their_options)
            ours = metric(saliency, images, targets, noise=noise, **our_options)
            assert np.isnan(kept).tolist() == changed.tolist()
            np.testing.assert_allclose(ours.numpy()[~changed], kept[~changed], rtol=2e-5)
    assert changed.any()  # the larger noise changes some top classes (the relative input stability's case)
    per_copy = torch.stack([relative_input_stability(saliency, images, targets, noise=noise[s:s + 1],
                                                     keep_prediction=False) for s in range(3)])
    copy_changed = changed_classes(model, images, noise)
    expected = torch.where(copy_changed, -torch.inf, per_copy).amax(dim=0)
    expected = torch.where(copy_changed.all(dim=0), torch.nan, expected)
    torch.testing.assert_close(relative_input_stability(saliency, images, targets, noise=noise), expected,
                               equal_nan=True)


@needs_quantus
def test_continuity_equals_quantus(setting):
    """Quantus 0.6's translations (its nr_steps steps across the width; 8 here, 28 by default as ours),
    filled with each image's smallest value, on the raw maps (abs=False, normalise=False: by default
    Quantus divides |map| by the batch's peak)."""
    model, images, targets, _ = setting
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    maps = saliency.explain(images, targets).raw_maps
    theirs = run_quantus("Continuity", model, images, targets, maps, nr_steps=8, abs=False, normalise=False)
    ours = continuity(saliency, images, targets, shifts=quantus_shifts(64, steps=8))
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-5)


@needs_quantus
def test_consistency_against_quantus(setting):
    """Quantus 0.6's default discretisation is the signs of the first 5 values of the flattened |map|
    (``np.sign(a)[:n]``, not the 5 largest): all +1 unless one of the top-left pixels is 0, so every image
    shares its explanation. Given as our ``discretise``, the two agree. Ours (the set of the 5 largest |map|)
    given to Quantus: they agree where an image has a peer; where none has, Quantus gives 0 (0 / (0 + 1e-9)),
    where Dasgupta et al.'s conditional probability is undefined: NaN."""
    model, images, targets, _ = setting
    pairs = torch.cat([images, images[:2]])  # images 0 and 1 twice: they have peers
    maps = explain.Saliency(model, reduce="sum", normalize=None).explain(pairs, torch.cat([targets, targets[:2]]))
    heat = maps.raw_maps
    x, y, a = pairs.numpy(), maps.class_indices[:, 0].numpy(), as_numpy(heat)
    theirs = quantus_metric("Consistency")(model, x, y, a_batch=a)
    first_signs = consistency(model, pairs, heat, discretise=lambda m: m.abs().flatten(1)[:, :5].sign())
    np.testing.assert_allclose(first_signs.numpy(), theirs, atol=1e-8)

    def top_five(values, **kwargs):
        return hash(bytes(np.sort(np.argsort(-values, kind="stable")[:5])))
    theirs = np.asarray(quantus_metric("Consistency", discretise_func=top_five)(model, x, y, a_batch=a))
    ours = consistency(model, pairs, heat).numpy()
    assert np.isnan(ours).tolist() == [False, False, True, True, False, False]
    np.testing.assert_allclose(ours[~np.isnan(ours)], theirs[~np.isnan(ours)], atol=1e-8)
    assert theirs[np.isnan(ours)].tolist() == [0.0, 0.0]


def quantus_randomize(layer: nn.Module, index: int) -> None:
    """Quantus 0.6's re-initialisation (seed 42): torch.manual_seed(43) before each layer's reset."""
    reinitialize(layer, 43)


def resettable_layers(model: nn.Module) -> list[str]:
    """The layers Quantus 0.6 randomises: every module with reset_parameters, in named_modules order."""
    return [name for name, module in model.named_modules() if hasattr(module, "reset_parameters")]


@needs_quantus
def test_efficient_mprt_equals_quantus(setting):
    """Every layer with reset_parameters re-initialised as Quantus does (its seed before each), 100 bins."""
    model, images, targets, _ = setting
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    metric = quantus_metric("EfficientMPRT")
    theirs = metric(model, images.numpy(), targets.numpy(), a_batch=None, explain_func=quantus_explain_func())
    ours = efficient_mprt(saliency, images, targets, stages=resettable_layers(model), randomize=quantus_randomize)
    np.testing.assert_allclose(ours.rise.numpy(), theirs, rtol=1e-10)
    assert ours.layers == resettable_layers(model)


@needs_quantus
def test_smooth_mprt_equals_quantus(setting, monkeypatch):
    """Quantus 0.6 smooths with ``quantus.explain`` (not the explain_func) and fresh np.random.randn
    draws for every layer; here both get our explainer and the same 2 draws for every stage (ours uses
    the same draws at every stage: a common-random-numbers comparison). Its extra "original" entry
    compares two smoothings of the trained model with each other and is left out."""
    import quantus

    model, images, targets, _ = setting
    small = torch.nn.functional.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)  # 42 stages
    x, y = small.numpy(), targets.numpy()
    unit = np.random.RandomState(5).randn(2, *x.shape)
    calls = []

    def fixed_randn(*shape):
        calls.append(shape)
        return unit[(len(calls) - 1) % 2].copy()
    explain_func = quantus_explain_func()
    monkeypatch.setattr(np.random, "randn", fixed_randn)
    monkeypatch.setattr(quantus, "explain", lambda model, inputs, targets, **kwargs: explain_func(model, inputs,
                                                                                                  targets))
    theirs = quantus_metric("SmoothMPRT", nr_samples=3)(model, x, y, a_batch=None, explain_func=explain_func)
    monkeypatch.undo()
    spread = 0.1 * (x.max(axis=(1, 2, 3), keepdims=True) - x.min(axis=(1, 2, 3), keepdims=True))
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    stages = smooth_mprt(saliency, small, targets, samples=3, noise=torch.from_numpy(unit * spread),
                         stages=resettable_layers(model), randomize=quantus_randomize)
    assert [stage.layer for stage in stages] == [name for name in theirs if name != "original"]
    for stage in stages:
        np.testing.assert_allclose(stage.rank_correlation.numpy(), theirs[stage.layer], atol=1e-5)
