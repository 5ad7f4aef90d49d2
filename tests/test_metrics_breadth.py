"""Issue 29, first tranche: localisation (top-k intersection, AUC, Focus), complexity (sparseness,
complexity, effective complexity), axiomatic (completeness, non-sensitivity, input invariance) and
randomisation (random logit) metrics.

Each metric is checked on cases worked out by hand, and against Quantus 0.6 on the shipped demo CNN
and on a randomly initialised torchvision resnet18 (64 px), 4 images with different targets, with the
same maps and random draws. Where Quantus 0.6 computes something else than the metric's paper, the
test shows the difference and why. The Quantus tests skip when it is not installed
(``pip install --no-deps "quantus==0.6.*"`` and ``pip install pandas cachetools``).
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain import metrics
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.data.train import to_model_input

needs_quantus = pytest.mark.skipif(
    importlib.util.find_spec("quantus") is None,
    reason="Quantus 0.6 is not installed (pip install --no-deps 'quantus==0.6.*'; pip install pandas cachetools)",
)

# ------------------------------------------------------------------ shared set-ups


def demo_images(count: int = 4, seed: int = 3):
    """``count`` synthetic 64 px images with distinct labels (model input), their labels and masks."""
    data = make_dataset(40, seed=seed)
    chosen, seen = [], set()
    for index, label in enumerate(data.labels.tolist()):
        if label not in seen:
            chosen.append(index)
            seen.add(label)
        if len(chosen) == count:
            break
    return to_model_input(data.images[chosen]), torch.from_numpy(data.labels[chosen]), torch.from_numpy(
        data.masks[chosen])


def resnet18() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


@pytest.fixture(scope="module", params=["demo", "resnet18"])
def setting(request):
    """(model, (N, 3, 64, 64) inputs, (N,) targets all different, (N, 64, 64) masks)."""
    images, labels, masks = demo_images()
    if request.param == "demo":
        return load_demo_model(), images, labels, masks
    return resnet18(), images, torch.tensor([3, 141, 500, 999]), masks


def signed_maps(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, H, W) raw signed gradient maps (Σ over channels)."""
    return explain.Saliency(model, reduce="sum", normalize=None).explain(images, targets).raw_map_grid[:, 0]


def quantus_explain_func(method: type = explain.Saliency):
    """Quantus's explain_func: our explainer on whatever model Quantus passes, raw (N, 1, H, W) maps."""
    def explain_func(model, inputs, targets, **kwargs):
        explainer = method(model, reduce="sum", normalize=None)
        batch = torch.as_tensor(np.asarray(inputs), dtype=torch.float32)
        maps = explainer.explain(batch, torch.as_tensor(np.asarray(targets)).long()).raw_map_grid[:, 0]
        return maps[:, None].numpy()
    return explain_func


def quantus_metric(name: str, **options):
    import quantus

    warnings.filterwarnings("ignore", module="quantus")
    return getattr(quantus, name)(disable_warnings=True, **options)


def as_numpy(tensor: torch.Tensor, channel: bool = True) -> np.ndarray:
    array = tensor.detach().cpu().numpy()
    return array[:, None] if channel else array


# ------------------------------------------------------------------ localisation by hand


def test_top_k_intersection_by_hand():
    heat = torch.tensor([[[3.0, -1.0], [1.0, 0.0]]])
    top_row = torch.tensor([[[1, 1], [0, 0]]], dtype=torch.bool)
    assert metrics.top_k_intersection(heat, top_row, k=1).item() == 1.0  # 3.0 is inside
    assert metrics.top_k_intersection(heat, top_row, k=2).item() == 0.5  # 3.0 in, 1.0 out
    assert metrics.top_k_intersection(heat, top_row, k=4).item() == 0.5  # every pixel: the mask's area fraction
    assert metrics.top_k_intersection(heat, top_row, k=2, concept_influence=True).item() == 1.0  # 0.5 / (2 / 4)
    boxes = torch.tensor([[0, 0, 1, 0]])  # the top row as a box
    assert metrics.top_k_intersection(heat, boxes, k=2).item() == 0.5
    with pytest.raises(ValueError, match="k = 5 is more pixels"):
        metrics.top_k_intersection(heat, top_row, k=5)
    with pytest.raises(ValueError, match="k must be an int"):
        metrics.top_k_intersection(heat, top_row, k=0)


def test_auc_by_hand_with_ties_and_extremes():
    top_row = torch.tensor([[[1, 1], [0, 0]]], dtype=torch.bool)
    # inside {3, −1}, outside {1, 0}: 3 beats both, −1 neither → 2 of 4 pairs
    assert metrics.auc(torch.tensor([[[3.0, -1.0], [1.0, 0.0]]]), top_row).item() == 0.5
    # inside {1, 1}, outside {1, 0}: each inside pixel ties one (½) and beats one → 3 of 4
    assert metrics.auc(torch.tensor([[[1.0, 1.0], [1.0, 0.0]]]), top_row).item() == 0.75
    mask = torch.zeros(3, 8, 8, dtype=torch.bool)
    mask[:, 2:5, 3:7] = True
    heat = torch.stack([mask.float()[0], -mask.float()[0], torch.ones(8, 8)])
    assert metrics.auc(heat, mask).tolist() == [1.0, 0.0, 0.5]  # perfect, inverted, constant
    torch.manual_seed(0)
    random_maps = torch.rand(300, 8, 8)
    assert abs(metrics.auc(random_maps, mask[:1].expand(300, -1, -1)).mean().item() - 0.5) < 0.02
    with pytest.raises(ValueError, match="cover the whole map|covers the whole map"):
        metrics.auc(torch.rand(1, 4, 4), torch.ones(1, 4, 4))


def test_auc_with_many_ties_equals_scikit_learn():
    """Maps of a few distinct values (ties everywhere) and continuous ones, against sklearn's
    roc_auc_score image by image (an independent computation: ROC curve, trapezoids)."""
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    generator = torch.Generator().manual_seed(0)
    masks = torch.rand(6, 12, 10, generator=generator) < 0.3
    for heat in (torch.randint(0, 4, (6, 12, 10), generator=generator).float(), torch.randn(6, 12, 10)):
        expected = [sklearn_metrics.roc_auc_score(mask.flatten().numpy(), values.flatten().numpy())
                    for mask, values in zip(masks, heat)]
        torch.testing.assert_close(metrics.auc(heat, masks), torch.tensor(expected, dtype=torch.float32))


def test_focus_by_hand():
    heat = torch.zeros(2, 4, 4)
    heat[:, :2, :2] = 1.0  # top-left: mass 4
    heat[:, :2, 2:] = 3.0  # top-right: mass 12
    heat[:, 2:, :2] = -5.0  # bottom-left: negative, not counted
    heat[:, 2:, 2:] = 1.0  # bottom-right: mass 4
    positions = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0]])
    torch.testing.assert_close(metrics.focus(heat, positions), torch.tensor([8 / 20, 12 / 20]))
    odd = torch.zeros(1, 5, 5)
    odd[0, 2, 2] = 1.0  # the centre of a 5 × 5 mosaic lies in the bottom-right quadrant (split at 2)
    assert metrics.focus(odd, torch.tensor([[0, 0, 0, 1]])).item() == 1.0
    assert metrics.focus(-odd, torch.tensor([[0, 0, 0, 1]])).item() == 0.0  # no positive relevance
    with pytest.raises(ValueError, match=r"positions must be \(N, 4\)"):
        metrics.focus(heat, torch.ones(2, 3))
    with pytest.raises(ValueError, match="only 0 and 1"):
        metrics.focus(heat, torch.full((2, 4), 2))
    with pytest.raises(ValueError, match="3 rows of positions for 2 maps"):
        metrics.focus(heat, torch.ones(3, 4))


def test_make_mosaics_places_two_target_images_and_two_others():
    images, labels, _ = demo_images(4)
    images, labels = torch.cat([images, images.flip(-1)]), torch.cat([labels, labels])  # two of each class
    mosaics = metrics.make_mosaics(images, labels, count=6, generator=torch.Generator().manual_seed(1))
    assert mosaics.images.shape == (6, 3, 128, 128)
    for index in range(6):
        quadrants = [mosaics.images[index, :, :64, :64], mosaics.images[index, :, :64, 64:],
                     mosaics.images[index, :, 64:, :64], mosaics.images[index, :, 64:, 64:]]
        sources = mosaics.sources[index]
        for quadrant, source in zip(quadrants, sources):
            assert torch.equal(quadrant, images[source])
        is_target = labels[sources] == mosaics.targets[index]
        assert torch.equal(is_target, mosaics.positions[index])
        assert int(is_target.sum()) == 2 and len(set(sources.tolist())) == 4
    again = metrics.make_mosaics(images, labels, count=6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.sources, mosaics.sources)
    with pytest.raises(ValueError, match="no class can be a mosaic's target"):
        metrics.make_mosaics(images[:4], labels[:4], count=1)


# ------------------------------------------------------------------ complexity by hand


def test_sparseness_by_hand():
    one_hot = torch.zeros(1, 8, 8)
    one_hot[0, 3, 5] = -2.0
    assert metrics.sparseness(one_hot).item() == pytest.approx(1 - 1 / 64)  # the largest a map can reach
    assert metrics.sparseness(torch.ones(1, 8, 8)).item() == 0.0
    assert metrics.sparseness(torch.zeros(1, 8, 8)).item() == 0.0  # shows nothing: the worst
    # sorted |values| 0, 0, 1, 3 with weights 2i − 5 = −3, −1, 1, 3: (1 + 9) / (4 · 4)
    assert metrics.sparseness(torch.tensor([[[0.0, -1.0], [3.0, 0.0]]])).item() == pytest.approx(10 / 16)
    torch.manual_seed(0)
    maps = torch.rand(3, 8, 8)
    torch.testing.assert_close(metrics.sparseness(maps), metrics.sparseness(5 * maps))  # scale-free


def test_complexity_by_hand():
    one_hot = torch.zeros(2, 8, 8)
    one_hot[:, 0, 0] = 1.0
    assert metrics.complexity(one_hot).tolist() == [0.0, 0.0]
    assert metrics.complexity(torch.ones(1, 8, 8)).item() == pytest.approx(math.log(64))
    assert metrics.complexity(torch.zeros(1, 8, 8)).item() == pytest.approx(math.log(64))
    assert metrics.complexity(torch.tensor([[[1.0, -1.0], [0.0, 0.0]]])).item() == pytest.approx(math.log(2))
    shares = torch.tensor([0.5, 0.25, 0.25])
    assert metrics.complexity(torch.tensor([[[2.0, 1.0, 1.0]]])).item() == pytest.approx(
        float(-(shares * shares.log()).sum()))


def test_effective_complexity_by_hand():
    heat = torch.tensor([[[1.0, 1e-6], [-0.5, 0.0]]])
    assert metrics.effective_complexity(heat).item() == 2.0  # 1 and 0.5 exceed 1e-5 of the peak
    assert metrics.effective_complexity(heat * 1e-3).item() == 2.0  # the same relative to each map's peak
    assert metrics.effective_complexity(heat * 1e-3, normalise=False).item() == 2.0  # 1e-3, 5e-4 > 1e-5
    assert metrics.effective_complexity(heat * 1e-3, eps=1e-3, normalise=False).item() == 0.0  # strictly above
    assert metrics.effective_complexity(heat, eps=0.0).item() == 3.0
    assert metrics.effective_complexity(torch.zeros(1, 4, 4)).item() == 0.0
    with pytest.raises(ValueError, match="eps must be a finite number"):
        metrics.effective_complexity(heat, eps=-1.0)


def test_maps_with_nan_are_refused_naming_them():
    heat = torch.rand(3, 4, 4)
    heat[1, 0, 0] = float("nan")
    for metric in (metrics.sparseness, metrics.complexity, metrics.effective_complexity):
        with pytest.raises(ValueError, match="map 1 holds NaN"):
            metric(heat)
    with pytest.raises(ValueError, match="map 1 holds NaN"):
        metrics.auc(heat, torch.ones(3, 4, 4).tril())


# ------------------------------------------------------------------ axiomatic by hand


class Linear(nn.Module):
    """Logits (w·x, −w·x) + b: Input × Gradient is exactly complete for class 0 from a zero baseline."""

    def __init__(self, shape=(3, 4, 4)):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        self.bias = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        score = (x * self.weight).sum(dim=(1, 2, 3))
        return torch.stack([score, -score], dim=1) + self.bias


def test_completeness_by_hand_on_a_linear_model():
    model = Linear()
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    attributions = x * model.weight.detach()  # Input × Gradient of class 0
    result = metrics.completeness(model, x, attributions, target=0)
    expected_change = (x * model.weight.detach()).sum(dim=(1, 2, 3)).double()  # f(x) − f(0): the bias cancels
    torch.testing.assert_close(result.score_change, expected_change, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result.attribution_sum, expected_change, rtol=1e-6, atol=1e-6)
    assert result.relative_error.max().item() < 1e-5
    halved = metrics.completeness(model, x, attributions / 2, target=0)
    torch.testing.assert_close(halved.error, -expected_change / 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(halved.relative_error, torch.full((2,), 0.5, dtype=torch.float64), rtol=1e-5,
                               atol=1e-5)
    # an Explanation's own per-channel attributions and targets are used (never its normalised maps)
    explanation = explain.InputXGradient(model).explain(x, target=0)
    from_explanation = metrics.completeness(model, x, explanation)
    assert from_explanation.relative_error.max().item() < 1e-5
    # the baseline x' moves f(x'): a baseline of ones gives f(x) − f(1) = w·x − Σw
    shifted = metrics.completeness(model, x, attributions, target=0, baseline=1.0)
    torch.testing.assert_close(shifted.score_change, expected_change - model.weight.detach().sum().double(),
                               rtol=1e-5, atol=1e-5)
    minimum = metrics.completeness(model, x, attributions, target=0, baseline="minimum")
    lowest = x.flatten(1).amin(dim=1)
    torch.testing.assert_close(minimum.score_change, (expected_change - lowest.double() * model.weight.detach().sum()),
                               rtol=1e-5, atol=1e-5)


def test_completeness_refuses_what_is_not_an_input_attribution():
    model = Linear()
    x = torch.randn(2, 3, 4, 4)
    cam = explain.GradCAM(load_demo_model(), "layer4").explain(torch.randn(2, 3, 64, 64))
    with pytest.raises(ValueError, match="holds no attributions"):
        metrics.completeness(model, x, cam)
    with pytest.raises(ValueError, match="3 attribution maps for 2 images"):
        metrics.completeness(model, x, torch.zeros(3, 3, 4, 4))
    with pytest.raises(ValueError, match="baseline must be one of"):
        metrics.completeness(model, x, torch.zeros(2, 3, 4, 4), baseline="black")
    with pytest.raises(ValueError, match="does not broadcast"):
        metrics.completeness(model, x, torch.zeros(2, 3, 4, 4), baseline=torch.zeros(2, 4, 4))


def test_integrated_gradients_error_is_its_own_diagnostic():
    model = load_demo_model()
    images, labels, _ = demo_images()
    explanation = explain.IntegratedGradients(model, steps=16).explain(images, labels)
    result = metrics.completeness(model, images, explanation)
    torch.testing.assert_close(result.error.float(), explanation.diagnostics["completeness_error"][:, 0].float(),
                               rtol=1e-3, atol=1e-3)
    assert torch.equal(result.attribution_sum, explanation.attributions[:, 0].double().sum(dim=(1, 2, 3)))


class LeftHalf(nn.Module):
    """Logits (mean of the image's left half, 0): the right half is irrelevant to every score."""

    def forward(self, x):
        left = x[..., : x.shape[-1] // 2].mean(dim=(1, 2, 3))
        return torch.stack([left, torch.zeros_like(left)], dim=1)


def test_non_sensitivity_by_hand():
    model = LeftHalf()
    x = torch.rand(2, 3, 6, 6) + 0.5  # no pixel equals the zero baseline
    left = torch.zeros(2, 6, 6)
    left[..., :3] = 1.0  # exactly the pixels the model depends on
    assert metrics.non_sensitivity(model, x, left, target=0, score="logit").tolist() == [0.0, 0.0]
    top = torch.zeros(2, 6, 6)
    top[:, :3] = 1.0  # bottom-left is called irrelevant but matters, top-right the reverse: 9 + 9 pixels
    assert metrics.non_sensitivity(model, x, top, target=0, score="logit").tolist() == [18.0, 18.0]
    assert metrics.non_sensitivity(model, x, top, target=0, score="logit", features="elements").tolist() == [54.0,
                                                                                                             54.0]
    # 2 × 2 patches: a 3 × 3 grid whose middle column straddles both halves (relevant, sensitive)
    assert metrics.non_sensitivity(model, x, top, target=0, score="logit", patch_size=2).tolist() == [4.0, 4.0]
    # a map's values below map_eps of its peak count as zero
    faint = left + 1e-7 * (1 - left)
    assert metrics.non_sensitivity(model, x, faint, target=0, score="logit").tolist() == [0.0, 0.0]
    assert metrics.non_sensitivity(model, x, faint, target=0, score="logit", map_eps=0.0).tolist() == [18.0, 18.0]
    with pytest.raises(ValueError, match="features must be 'pixels' or 'elements'"):
        metrics.non_sensitivity(model, x, top, features="channels")
    with pytest.raises(ValueError, match="3 maps for 2 images"):
        metrics.non_sensitivity(model, x, torch.zeros(3, 6, 6))


def test_input_invariance_by_hand(setting):
    """Gradients are invariant; Input × Gradient changes by shift · Σ_c ∂y/∂x_c (Kindermans et al.)."""
    model, images, targets, _ = setting
    before = model_state(model)
    shift = -1.0
    gradient = explain.Saliency(model, reduce="sum", normalize=None)
    invariant = metrics.input_invariance(gradient, images, targets, shift=shift)
    assert invariant.invariant.tolist() == [1.0] * 4
    assert invariant.difference.max().item() < 1e-4 * gradient.explain(images, targets).raw_map_grid.abs().max()
    input_times_gradient = explain.InputXGradient(model, reduce="sum", normalize=None)
    changed = metrics.input_invariance(input_times_gradient, images, targets, shift=shift)
    assert changed.invariant.tolist() == [0.0] * 4
    expected = (shift * gradient.explain(images, targets).raw_map_grid[:, 0]).abs().flatten(1).amax(dim=1)
    torch.testing.assert_close(changed.difference, expected, rtol=1e-3, atol=1e-6)
    assert_state_equal(before, model_state(model))


def test_integrated_gradients_is_input_invariant_from_a_baseline_that_moves_with_the_input():
    """Kindermans et al.: IG from a zero baseline is not input invariant; from a baseline shifted with the
    input it is. The blurred image moves with the input (blur(x + m) = blur(x) + m), zero does not. In float64: in
    float32 the shifted path's rounding flips ReLUs near 0 and moves the demo model's map by up to 7e-4 (of 0.42),
    more than the metric's atol, depending on the batch's memory layout."""
    model = load_demo_model().double()
    images, labels, _ = demo_images(2)
    images = images.double()
    options = {"steps": 8, "reduce": "sum", "normalize": None}
    zeros = metrics.input_invariance(explain.IntegratedGradients(model, baseline="zeros", **options), images, labels)
    blur = metrics.input_invariance(explain.IntegratedGradients(model, baseline="blur", **options), images, labels)
    assert zeros.invariant.tolist() == [0.0, 0.0] and blur.invariant.tolist() == [1.0, 1.0]
    assert zeros.difference.min().item() > 1e3 * blur.difference.max().item()
    with pytest.raises(ValueError, match="shift must be a finite number"):
        metrics.input_invariance(explain.Saliency(model), images, shift=float("nan"))


def test_input_invariance_refuses_a_layer_that_cannot_absorb_the_shift():
    class PReLUFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.PReLU(init=0.1)
            self.fc = nn.Linear(48, 2)

        def forward(self, x):
            return self.fc(self.act(x).flatten(1))

    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="not affine in its input"):
        metrics.input_invariance(explain.Saliency(PReLUFirst()), x)
    with pytest.raises(ValueError, match="does not take the model's input as it is"):
        metrics.input_invariance(explain.Saliency(PReLUFirst()), x, layer="fc")
    model = load_demo_model()
    with pytest.raises(ValueError, match="does not take the model's input"):
        metrics.input_invariance(explain.Saliency(model), torch.randn(1, 3, 64, 64), layer="layer1")


# ------------------------------------------------------------------ randomisation by hand


class ClassPerQuadrant(nn.Module):
    """Four logits: class k is the sum of quadrant k of the image (top-left, top-right, bottom-left,
    bottom-right), so each class's gradient is one quadrant."""

    def forward(self, x):
        h, w = x.shape[-2] // 2, x.shape[-1] // 2
        quadrants = [x[..., :h, :w], x[..., :h, w:], x[..., h:, :w], x[..., h:, w:]]
        return torch.stack([q.sum(dim=(1, 2, 3)) for q in quadrants], dim=1)


class OneDirection(nn.Module):
    """Logits (s, 2s, −3s) for s = w·x: every class's gradient is a multiple of w."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        s = (x * self.weight).sum(dim=(1, 2, 3))
        return torch.stack([s, 2 * s, -3 * s], dim=1)


def test_random_logit_by_hand():
    x = torch.randn(3, 3, 16, 16)
    same = metrics.random_logit(explain.Saliency(OneDirection(), reduce="sum"), x, target=0)
    torch.testing.assert_close(same.similarity, torch.ones(3))  # the map ignores the class: the worst
    spearman = metrics.random_logit(explain.Saliency(OneDirection(), reduce="sum"), x, 0, similarity="spearman")
    torch.testing.assert_close(spearman.similarity, torch.ones(3))
    quadrants = explain.Saliency(ClassPerQuadrant(), reduce="sum")
    result = metrics.random_logit(quadrants, x, target=[0, 1, 2], other_classes=torch.tensor([3, 0, 1]))
    assert result.other_classes.tolist() == [3, 0, 1] and result.classes.tolist() == [0, 1, 2]
    # |map| is 1 on one quadrant, 0 elsewhere; disjoint quadrants: SSIM of two such maps, by an independent route
    first = torch.zeros(3, 16, 16)
    second = torch.zeros(3, 16, 16)
    for index, (a, b) in enumerate([(0, 3), (1, 0), (2, 1)]):
        for maps, quadrant in ((first, a), (second, b)):
            rows, columns = divmod(quadrant, 2)
            maps[index, rows * 8:(rows + 1) * 8, columns * 8:(columns + 1) * 8] = 1.0
    skimage_metrics = pytest.importorskip("skimage.metrics")
    expected = [skimage_metrics.structural_similarity(a.numpy(), b.numpy(), gaussian_weights=True, sigma=1.5,
                                                      use_sample_covariance=False, data_range=1.0)
                for a, b in zip(first.double(), second.double())]
    torch.testing.assert_close(result.similarity, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    assert result.similarity.max().item() < 0.5


def test_random_logit_draws_other_classes_from_the_generator():
    model = load_demo_model()
    images, labels, _ = demo_images()
    saliency = explain.Saliency(model)
    drawn = [metrics.random_logit(saliency, images, labels, generator=torch.Generator().manual_seed(seed)
                                  ).other_classes for seed in range(40)]
    stacked = torch.stack(drawn)
    assert bool((stacked != labels).all())  # never the image's own class
    assert set(stacked.flatten().tolist()) == set(range(len(CLASS_NAMES)))  # every other class comes up
    again = metrics.random_logit(saliency, images, labels, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.other_classes, drawn[3])
    default = metrics.random_logit(saliency, images, labels)
    assert torch.equal(default.other_classes, metrics.random_logit(saliency, images, labels).other_classes)
    others = (labels + 1) % len(CLASS_NAMES)
    others[1] = labels[1]
    with pytest.raises(ValueError, match="repeats the class explained for image 1"):
        metrics.random_logit(saliency, images, labels, other_classes=others)
    with pytest.raises(ValueError, match="outside the model's"):
        metrics.random_logit(saliency, images, labels, other_classes=torch.tensor([99, 99, 99, 99]))
    with pytest.raises(ValueError, match="similarity must be"):
        metrics.random_logit(saliency, images, labels, similarity="cosine")


# ------------------------------------------------------------------ against Quantus 0.6


@needs_quantus
def test_localisation_equals_quantus(setting):
    model, images, targets, masks = setting
    heat = signed_maps(model, images, targets)
    x, y, a, s = images.numpy(), targets.numpy(), as_numpy(heat), as_numpy(masks.float())
    for k in (1, 100, 1000):
        theirs = quantus_metric("TopKIntersection", k=k)(model, x, y, a, s)
        np.testing.assert_allclose(metrics.top_k_intersection(heat, masks, k=k).numpy(), theirs, atol=1e-7)
    theirs = quantus_metric("TopKIntersection", k=300, concept_influence=True)(model, x, y, a, s)
    ours = metrics.top_k_intersection(heat, masks, k=300, concept_influence=True)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-6)
    theirs = quantus_metric("AUC")(model, x, y, a, s)
    np.testing.assert_allclose(metrics.auc(heat, masks).numpy(), theirs, atol=1e-6)
    theirs = quantus_metric("AUC", abs=True)(model, x, y, a, s)
    np.testing.assert_allclose(metrics.auc(heat.abs(), masks).numpy(), theirs, atol=1e-6)


@needs_quantus
def test_focus_equals_quantus(setting):
    model, images, labels, _ = setting
    source_labels = torch.cat([labels, labels])
    mosaics = metrics.make_mosaics(torch.cat([images, images.flip(-1)]), source_labels, count=4,
                                   generator=torch.Generator().manual_seed(0))
    heat = signed_maps(model, mosaics.images, mosaics.targets)
    theirs = quantus_metric("Focus")(model, mosaics.images.numpy(), mosaics.targets.numpy(), as_numpy(heat),
                                     custom_batch=mosaics.positions.int().tolist())
    np.testing.assert_allclose(metrics.focus(heat, mosaics.positions).numpy(), theirs, rtol=1e-5, atol=1e-7)


@needs_quantus
def test_complexity_equals_quantus(setting):
    model, images, targets, _ = setting
    heat = signed_maps(model, images, targets)
    x, y, a = images.numpy(), targets.numpy(), as_numpy(heat)
    # Gini and entropy do not depend on the map's scale; Quantus adds 1e-7 to every |value| (Gini) and
    # 1e-12 inside the logarithm (entropy), which moves them by less than 1e-5 here
    np.testing.assert_allclose(metrics.sparseness(heat).numpy(), quantus_metric("Sparseness")(model, x, y, a),
                               atol=1e-5)
    np.testing.assert_allclose(metrics.complexity(heat).numpy(), quantus_metric("Complexity")(model, x, y, a),
                               atol=1e-5)
    # effective complexity depends on the scale: Quantus divides by the largest |value| of the whole batch
    # (normalise_by_max over every axis), so an image's score depends on the other images it is passed with.
    # Nguyen and Martínez define it per explanation: we divide each map by its own peak, which is Quantus
    # called one image at a time.
    one_at_a_time = [quantus_metric("EffectiveComplexity", eps=1e-2)(model, x[i:i + 1], y[i:i + 1], a[i:i + 1])[0]
                     for i in range(len(x))]
    np.testing.assert_array_equal(metrics.effective_complexity(heat, eps=1e-2).numpy(), one_at_a_time)
    whole_batch = quantus_metric("EffectiveComplexity", eps=1e-2)(model, x, y, a)
    batch_peak = heat.abs().max()
    np.testing.assert_array_equal(metrics.effective_complexity(heat / batch_peak, eps=1e-2, normalise=False).numpy(),
                                  whole_batch)
    raw = quantus_metric("EffectiveComplexity", eps=1e-4, normalise=False)(model, x, y, a)
    np.testing.assert_array_equal(metrics.effective_complexity(heat, eps=1e-4, normalise=False).numpy(), raw)


@needs_quantus
def test_completeness_against_quantus(setting):
    """Quantus 0.6 returns ``Σ a == f(x) − f(x')``, exact float equality, after dividing the attributions
    by their batch maximum (normalise=True by default). Sundararajan et al. ask for the sum to equal the
    change; we return the error. Exactly complete attributions: Quantus (normalise=False) says True where our
    error is exactly 0; Integrated Gradients is complete up to its quadrature error: Quantus says False,
    we give the error, which is the method's own diagnostic."""
    model, images, targets, _ = setting
    x, y = images.numpy(), targets.numpy()
    with torch.no_grad():
        logits = model(images)
        at_black = model(images.flatten(1).amin(dim=1).view(-1, 1, 1, 1).expand_as(images).contiguous())
    change = (logits - at_black)[torch.arange(4), targets]  # float32, as both compute it
    exact = torch.zeros(4, 3, 64, 64)
    exact[:, 1, 10, 20] = change  # one value holding the whole change: sums to it exactly
    exact[1, 1, 10, 20] += 0.01  # … except image 1's
    # per-channel attributions: given (N, 1, H, W), Quantus 0.6 sets only the first H·W input values (the
    # first channel) to the baseline, as it counts the features in the attributions, not in the input
    theirs = quantus_metric("Completeness", normalise=False)(model, x, y, exact.numpy())
    ours = metrics.completeness(model, images, exact, targets, baseline="minimum")
    assert list(map(bool, theirs)) == [True, False, True, True]
    assert (ours.error == 0).tolist() == [True, False, True, True]
    assert ours.error[1].item() == pytest.approx(0.01, rel=1e-4)
    with_defaults = quantus_metric("Completeness")(model, x, y, exact.numpy())
    assert not any(with_defaults)  # the sum of normalised attributions is no longer the score change
    ig = explain.IntegratedGradients(model, steps=16, baseline="zeros").explain(images, targets)
    attributions = ig.attributions[:, 0]
    theirs = quantus_metric("Completeness", normalise=False, perturb_baseline=0.0)(model, x, y,
                                                                                   attributions.numpy())
    ours = metrics.completeness(model, images, ig)
    assert (ours.error != 0).all()
    # Quantus compares float32 sums exactly: it may say True only where IG's error is below float32's resolution of
    # the score change (16 steps on a random resnet18 come within 1e-7 of complete); above it, False
    resolution = 4 * torch.finfo(torch.float32).eps * ours.score_change.abs().double()
    for verdict, error, tolerance in zip(map(bool, theirs), ours.error.abs().tolist(), resolution.tolist()):
        assert not verdict or error <= tolerance
    torch.testing.assert_close(ours.error.float(), ig.diagnostics["completeness_error"][:, 0].float(), rtol=1e-3,
                               atol=1e-4)


@needs_quantus
def test_non_sensitivity_equals_quantus(setting):
    """Quantus 0.6 counts channel elements (the map repeated over channels), perturbs one at a time
    (features_in_step > 1 fails in 0.6: its two arrays no longer broadcast) and divides the maps by the
    batch's peak, where we divide each by its own: features="elements", and Quantus given maps already
    divided by their peaks (normalise=False). At 8 px (one forward per element and image)."""
    model, images, targets, _ = setting
    small = torch.nn.functional.interpolate(images, size=(8, 8), mode="bilinear", align_corners=False)
    heat = signed_maps(model, small, targets)
    peaks = heat.abs().amax(dim=(1, 2), keepdim=True)
    heat = torch.where(heat.abs() < 0.05 * peaks, 0.0, heat) / peaks  # some zeros; each map's peak 1
    for score, softmax in (("probability", True), ("logit", False)):
        ours = metrics.non_sensitivity(model, small, heat, targets, baseline="minimum", features="elements",
                                       score=score)
        theirs = quantus_metric("NonSensitivity", normalise=False)(model, small.numpy(), targets.numpy(),
                                                                    as_numpy(heat), softmax=softmax)
        np.testing.assert_array_equal(ours.numpy(), np.array(theirs, dtype=np.float32))


class BiasedConvFirst(nn.Module):
    """A first layer Quantus 0.6 can shift: a convolution with a bias and no padding (Quantus changes
    the first module's bias, reading it from ``named_modules()[1]``)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, 5))
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.head(self.conv(x))


@needs_quantus
def test_input_invariance_equals_quantus_where_quantus_can_shift_the_model():
    model = BiasedConvFirst().eval()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([0, 1, 2, 3])
    for method in (explain.Saliency, explain.InputXGradient):
        explainer = method(model, reduce="sum", normalize=None)
        a = explainer.explain(images, targets).raw_map_grid[:, 0]
        theirs = quantus_metric("InputInvariance")(model, images.numpy(), targets.numpy(), as_numpy(a),
                                                   explain_func=quantus_explain_func(method))
        ours = metrics.input_invariance(explainer, images, targets)
        assert ours.invariant.tolist() == [float(value) for value in theirs]
        assert ours.invariant.tolist() == ([1.0] * 4 if method is explain.Saliency else [0.0] * 4)


@needs_quantus
def test_quantus_cannot_shift_the_demo_cnn_or_resnet18(setting):
    """Quantus 0.6 shifts the bias of ``named_modules()[1]``: the demo CNN's is a Sequential block and
    resnet18's conv1 has no bias, so it fails on both; ``input_invariance`` works on both (see
    test_input_invariance_by_hand)."""
    model, images, targets, _ = setting
    a = signed_maps(model, images, targets)
    with pytest.raises((TypeError, AttributeError)):
        quantus_metric("InputInvariance")(model, images.numpy(), targets.numpy(), as_numpy(a),
                                          explain_func=quantus_explain_func())


def quantus_draws(targets: np.ndarray, class_count: int, seed: int = 42) -> torch.Tensor:
    """Quantus 0.6's random other classes: np.random.seed(seed); an index into the classes without the
    target, drawn with np.random.randint(0, class_count − 1, N)."""
    state = np.random.get_state()
    np.random.seed(seed)
    offsets = np.random.randint(0, class_count - 1, len(targets))
    np.random.set_state(state)
    return torch.from_numpy(offsets + (offsets >= targets)).long()


def ssim_2d(shape):
    """Quantus similarity_func: the maps (which Quantus flattens) back to 2-D, SSIM as Wang et al. 2004."""
    from skimage.metrics import structural_similarity

    def similarity(a, b, batched=True, **kwargs):
        return [structural_similarity(first.reshape(shape).astype(np.float64), second.reshape(shape).astype(np.float64),
                                      gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0)
                for first, second in zip(a, b)]
    return similarity


@needs_quantus
def test_random_logit_equals_quantus(setting):
    """Same other classes (Quantus's seeded draws, passed to ours), same maps. Quantus 0.6 compares the
    maps flattened to 1-D (a 7-wide window running along the rows and across their ends) and scales
    them by the batch's peak; Sixt et al. compare images: we use 2-D SSIM of each |map| / its peak.
    With Quantus given that similarity and per-image scaling, the two agree; given Quantus's own
    similarity as ours, they agree too."""
    import quantus

    model, images, targets, _ = setting
    class_count = model(images[:1]).shape[1]
    others = quantus_draws(targets.numpy(), class_count)
    explainer = explain.Saliency(model, reduce="sum", normalize=None)
    a = as_numpy(explainer.explain(images, targets).raw_map_grid[:, 0])
    theirs = quantus_metric("RandomLogit", num_classes=class_count, seed=42, abs=True,
                            normalise_func_kwargs={"normalise_axes": (1, 2, 3)}, similarity_func=ssim_2d((64, 64)))(
        model, images.numpy(), targets.numpy(), a, explain_func=quantus_explain_func())
    ours = metrics.random_logit(explainer, images, targets, other_classes=others)
    np.testing.assert_allclose(ours.similarity.numpy(), theirs, atol=1e-5)
    theirs_flat = quantus_metric("RandomLogit", num_classes=class_count, seed=42, normalise=False)(
        model, images.numpy(), targets.numpy(), a, explain_func=quantus_explain_func())

    def quantus_ssim(first, second):
        values = quantus.functions.similarity_func.ssim(first.flatten(1).numpy(), second.flatten(1).numpy(),
                                                        batched=True)
        return torch.tensor(values, dtype=torch.float32)
    ours_flat = metrics.random_logit(explainer, images, targets, other_classes=others, similarity=quantus_ssim)
    np.testing.assert_allclose(ours_flat.similarity.numpy(), theirs_flat, atol=1e-6)
    assert np.abs(ours_flat.similarity.numpy() - ours.similarity.numpy()).max() > 1e-3  # 1-D is another measure


def test_random_logit_ssim_equals_the_sanity_check_ssim():
    from explain.metrics.randomisation import _ssim

    torch.manual_seed(0)
    first, second = torch.rand(3, 40, 33), torch.rand(3, 40, 33)
    second[0] = first[0]
    torch.testing.assert_close(_ssim(first, second), metrics.ssim(first, second), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_ssim(first[:, :7, :9], second[:, :7, :9]), metrics.ssim(first[:, :7, :9],
                                                                                         second[:, :7, :9]))
    assert _ssim(first, second)[0].item() == pytest.approx(1.0)


def test_monotonicity_correlation_ranks_changes_that_only_rounding_orders():
    """Why tests/test_cuda.py compares monotonicity correlation across devices in float64: its groups change the
    probability by ~1e-9, two of them within 2e-4 of each other (relative), an order that float32 rounding decides.
    The same model, map and draws in float32 and float64 give other values on the CPU alone, though their changes
    agree to 1e-3; in float64 the value is stable to rounding (channels-last, another summation order, equal)."""
    from conftest import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().eval()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(2, 3, 32, 32, generator=generator), torch.tensor([1, 3])
    explanation = explain.Saliency(model).explain(x, y)

    def value(network: nn.Module, images: torch.Tensor) -> torch.Tensor:
        return metrics.monotonicity_correlation(network, images, explanation, y, steps=16, samples=4,
                                                generator=torch.Generator().manual_seed(16))  # draws shared by
        # the images since session 10: seed 16 gives image 1 groups that rounding orders (seed 0 did before)

    single = value(model, x)
    wide = model.double()
    double = value(wide, x.double())
    assert (single - double).abs().max() > 5e-3  # rounding moved a rank
    channels_last = torch.channels_last
    shuffled = value(wide.to(memory_format=channels_last), x.double().contiguous(memory_format=channels_last))
    torch.testing.assert_close(shuffled, double, rtol=0, atol=1e-12)
