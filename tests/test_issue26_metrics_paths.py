"""Issue 26, items 6, 7, 8, 13 (metrics) and 16: the metrics, XRAI, Guided / Blur IG and GradientSHAP
refuse bad input and options with an error that names it, and give by-hand values on odd sizes."""

from __future__ import annotations

import math
import signal
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from conftest import ConvGapLinear, SmallCNN, assert_state_equal, model_state
from scipy import ndimage
from torch import nn

from explain import metrics
from explain.io.blur import gaussian_blur, reflect_blur
from explain.methods.expected_gradients import GradientShap
from explain.methods.path_methods import BlurIG, GuidedIG, guided_ig_paths
from explain.methods.xrai import XRAI, Felzenszwalb


class MeanModel(nn.Module):
    """Logits (mean of x, −mean of x): the score of class 0 is the mean pixel value."""

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3))
        return torch.stack([mean, -mean], dim=1)


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the main thread after ``seconds`` (a loop that spins forever fails the test)."""

    def interrupt(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


LOCALIZATION = (metrics.pointing_game, metrics.energy_pointing_game, metrics.relevance_mass_accuracy,
                metrics.relevance_rank_accuracy)


def faithfulness_calls(model, images, maps):
    return {
        "deletion": lambda: metrics.deletion(model, images, maps, target=0, steps=2),
        "insertion": lambda: metrics.insertion(model, images, maps, target=0, steps=2),
        "road": lambda: metrics.road(model, images, maps, target=0, percentages=[0.5]),
        "confidence_change": lambda: metrics.confidence_change(model, images, maps, target=0),
    }


# ------------------------------------------------------------------ item 6: bad input to the metrics


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_metric_refuses_a_map_with_nan_or_inf_naming_it(bad):
    heat = torch.rand(3, 8, 8)
    heat[1, 2, 5] = bad
    mask = torch.zeros(3, 8, 8, dtype=torch.bool)
    mask[:, 2:6, 2:6] = True
    for metric in LOCALIZATION:
        with pytest.raises(ValueError, match=r"map 1 holds NaN or inf"):
            metric(heat, mask)
    torch.manual_seed(0)
    model = ConvGapLinear().eval()  # another model and size for the faithfulness metrics
    heat = torch.rand(2, 6, 10)
    heat[0, 0, 0] = bad
    for call in faithfulness_calls(model, torch.rand(2, 3, 6, 10), heat).values():
        with pytest.raises(ValueError, match=r"map 0 holds NaN or inf"):
            call()


def test_every_metric_refuses_another_number_of_masks_maps_or_images_naming_both():
    heat = torch.rand(2, 8, 8)
    masks = torch.zeros(3, 8, 8, dtype=torch.bool)
    masks[:, 1:4, 1:4] = True
    boxes = torch.tensor([[1, 1, 3, 3]] * 3)
    for metric in LOCALIZATION:
        with pytest.raises(ValueError, match="3 masks for 2 maps"):
            metric(heat, masks)
        with pytest.raises(ValueError, match="3 boxes for 2 maps"):
            metric(heat, boxes)
        with pytest.raises(ValueError, match="1 masks for 2 maps"):
            metric(heat, masks[0])  # one (H, W) mask is not repeated silently either
    model = MeanModel()
    for maps, images in ((torch.rand(2, 8, 8), torch.rand(3, 3, 8, 8)), (torch.rand(3, 8, 8), torch.rand(2, 3, 8, 8))):
        for call in faithfulness_calls(model, images, maps).values():
            with pytest.raises(ValueError, match=f"{len(maps)} maps for {len(images)} images"):
                call()


def test_every_box_metric_refuses_empty_and_out_of_image_boxes_and_empty_masks_naming_them():
    heat = torch.rand(2, 8, 12)  # H = 8, W = 12
    cases = [  # empty; outside; an exclusive end (x1 = W); a negative corner
        ([[1, 1, 3, 3], [5, 5, 3, 6]], r"box 1 \(5, 5, 3, 6\) is empty"),
        ([[20, 20, 30, 30], [1, 1, 3, 3]], r"box 0 \(20, 20, 30, 30\) reaches outside the 8 × 12"),
        ([[0, 0, 12, 8], [1, 1, 3, 3]], r"box 0 \(0, 0, 12, 8\) reaches outside.*subtract 1"),
        ([[1, 1, 3, 3], [-1, 0, 2, 2]], r"box 1 \(-1, 0, 2, 2\) reaches outside"),
    ]
    for metric in LOCALIZATION:
        for boxes, message in cases:
            with pytest.raises(ValueError, match=message):
                metric(heat, torch.tensor(boxes))
        masks = torch.zeros(2, 8, 12)
        masks[0, 2:4, 2:4] = 1.0
        with pytest.raises(ValueError, match="mask 1 is empty: there is no object"):
            metric(heat, masks)


def test_box_coordinates_are_whole_pixels_never_guessed_and_give_the_by_hand_value():
    heat = torch.tensor([[[1.0, 2.0, 0.0, 0.0],
                          [3.0, 4.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 10.0]]])
    normalised = torch.tensor([[0.0, 0.0, 0.25, 0.5]])
    fractional = torch.tensor([[0.0, 0.0, 1.5, 1.0]])
    for metric in LOCALIZATION:
        with pytest.raises(ValueError, match=r"box 0 \(0, 0, 0.25, 0.5\) looks normalised.*Scale them"):
            metric(heat, normalised)
        with pytest.raises(ValueError, match=r"box 0 \(0, 0, 1.5, 1\) has fractional coordinates.*round"):
            metric(heat, fractional)
    # whole-number float boxes (a detector's) are pixels: the top-left 2 × 2 holds 10 of the mass 20
    for boxes in (torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)):
        assert metrics.relevance_mass_accuracy(heat, boxes).item() == pytest.approx(10 / 20)
        assert metrics.energy_pointing_game(heat, boxes).item() == pytest.approx(10 / 20)
        assert metrics.pointing_game(heat, boxes).item() == 0.0  # the peak (10) is outside
        assert metrics.pointing_game(heat, boxes, tolerance=2.3).item() == 1.0  # 2 px right, 1 down: √5
        assert metrics.relevance_rank_accuracy(heat, boxes).item() == pytest.approx(3 / 4)  # top 4: 10, 4, 3, 2


# ------------------------------------------------------------------ item 13: the blur substrate on any size


def scipy_mirror_blur(image: torch.Tensor, sigma: float) -> np.ndarray:
    """(C, H, W) → (C, H, W): scipy's Gaussian with radius ⌈3σ⌉ and mode="mirror" (torch's reflect)."""
    radius = math.ceil(3 * sigma)
    return np.stack([ndimage.gaussian_filter(channel.double().numpy(), sigma, mode="mirror", truncate=radius / sigma)
                     for channel in image])


def test_reflect_blur_by_hand_on_two_pixels():
    """Two pixels [0, 1], σ = 1, radius 3: the taps at offsets −3 … 3 reflect onto pixel (i + o) mod 2
    (the reflection's period is 2), so pixel 0 gets the weights of the odd offsets, pixel 1 the even."""
    weight = [math.exp(-(offset**2) / 2) for offset in range(4)]
    total = weight[0] + 2 * (weight[1] + weight[2] + weight[3])
    odd = 2 * (weight[1] + weight[3]) / total
    image = torch.tensor([0.0, 1.0], dtype=torch.float64).view(1, 1, 1, 2)
    torch.testing.assert_close(reflect_blur(image, 1.0).flatten(), torch.tensor([odd, 1 - odd], dtype=torch.float64))


@pytest.mark.parametrize("size", [(1, 1), (64, 4), (64, 16), (2, 7), (5, 3), (13, 9)])
def test_reflect_blur_equals_scipy_everywhere_and_torchvision_where_it_runs(size):
    torch.manual_seed(0)
    images = torch.rand(2, 3, *size, dtype=torch.float64)
    sigma = max(size) / 16
    blurred = reflect_blur(images, sigma)
    for image, result in zip(images, blurred):
        np.testing.assert_allclose(result.numpy(), scipy_mirror_blur(image, sigma), rtol=1e-12, atol=1e-14)
    kernel = 2 * math.ceil(3 * sigma) + 1
    if kernel // 2 < min(size):  # torchvision's reflect padding runs only there
        torch.testing.assert_close(blurred, TF.gaussian_blur(images, [kernel, kernel], [sigma, sigma]))
    else:
        with pytest.raises(RuntimeError, match="[Pp]adding"):
            TF.gaussian_blur(images, [kernel, kernel], [sigma, sigma])


def test_gaussian_blur_with_zeros_outside_equals_scipy_constant_mode():
    torch.manual_seed(0)
    images = torch.randn(4, 2, 3, 11, dtype=torch.float64)
    sigmas = [0.0, 0.7, 3.0, 40.0]  # the last far wider than the image
    for image, sigma, result in zip(images, sigmas, gaussian_blur(images, sigmas)):
        expected = image.numpy() if sigma == 0 else ndimage.gaussian_filter(image.numpy(), [0, sigma, sigma],
                                                                           mode="constant")
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("size", [(1, 1), (64, 4), (4, 64), (64, 16)])
def test_insertion_and_deletion_with_the_blur_substrate_on_thin_and_tiny_images_by_hand(size):
    """The score of class 0 is the mean pixel: at fraction 0 insertion scores the blurred image (scipy's
    mirror blur, σ = max(H, W) / 16), deletion the image; at fraction 1 the other way round."""
    torch.manual_seed(0)
    image = torch.rand(1, 3, *size, dtype=torch.float64)
    heat = torch.rand(1, *size)
    blurred_mean = scipy_mirror_blur(image[0], max(size) / 16).mean()
    inserted = metrics.insertion(MeanModel().double(), image, heat, target=0, steps=4, score="logit")
    deleted = metrics.deletion(MeanModel().double(), image, heat, target=0, steps=4, score="logit", substrate="blur")
    mean = image.mean().item()
    for curve, start, end in ((inserted, blurred_mean, mean), (deleted, mean, blurred_mean)):
        assert curve.curves[0, 0].item() == pytest.approx(start, rel=1e-6)
        assert curve.curves[0, -1].item() == pytest.approx(end, rel=1e-6)
    if size == (1, 1):  # one pixel blurred is itself: the curve is flat
        torch.testing.assert_close(inserted.curves[0], torch.full((5,), image.mean().item()))


def test_road_on_tiny_and_thin_images_by_hand():
    """Linear imputation on a 1 × 5 row with its first two pixels removed: both take the value of their
    only known neighbour's side, pixel 2; a 1 × 1 image's removed pixel has no neighbour and becomes 0
    (it was NaN, 0 / 0)."""
    row = torch.tensor([[[[1.0, 2.0, 7.0, 3.0, 5.0]]]], dtype=torch.float64)
    removed = torch.tensor([[[True, True, False, False, False]]])
    imputed = metrics.noisy_linear_imputation(row, removed, noise=0.0)
    torch.testing.assert_close(imputed.flatten(), torch.tensor([7.0, 7.0, 7.0, 3.0, 5.0], dtype=torch.float64),
                               rtol=0, atol=1e-3)
    pixel = torch.full((1, 3, 1, 1), 4.0, dtype=torch.float64)
    curve = metrics.road(MeanModel().double(), pixel, torch.ones(1, 1, 1), target=0, percentages=[0.4, 1.0],
                         noise=0.0, score="logit")
    torch.testing.assert_close(curve.curves, torch.tensor([[4.0, 0.0]]))  # round(0.4) = 0 pixels, then all


# ------------------------------------------------------------------ item 7: XRAI's regions


def quadrant_case():
    """A 4 × 4 one-channel image, 2 everywhere but 0 at its corner (3, 3), and a linear model: PAIR's black
    and white baselines (0 and 2) give attributions (x − 1) ⊙ w = w for target 0 (w = 0 at the corner).
    Quadrant means of w: top-left 3, top-right 7, bottom-left −1, bottom-right 1.5."""
    image = torch.full((1, 1, 4, 4), 2.0, dtype=torch.float64)
    image[0, 0, 3, 3] = 0.0
    weights = torch.tensor([[2.0, 4.0, 7.0, 7.0],
                            [3.0, 3.0, 6.0, 8.0],
                            [-1.0, -1.0, 2.0, 2.0],
                            [-1.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 1, bias=False)).double().eval()
    with torch.no_grad():
        model[1].weight.copy_(weights.flatten()[None])
    labels = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]])
    return model, image, weights, labels


def test_xrai_takes_a_label_map_as_one_region_per_label_ranked_by_density_by_hand():
    model, image, weights, labels = quadrant_case()
    result = XRAI(model, segmenter=lambda picture: labels, min_pixel_diff=1, steps=1, normalize=None).explain(
        image, target=0)
    torch.testing.assert_close(result.diagnostics["base_attributions"][0, 0], weights.float())
    rank_of_label = torch.tensor([2, 1, 4, 3])  # densities 3, 7, −1, 1.5: top-right first, bottom-left last
    assert torch.equal(result.diagnostics["ranks"][0, 0], rank_of_label[labels])
    torch.testing.assert_close(result.raw_maps[0], (5 - rank_of_label[labels]).float() / 4)


def test_xrai_label_map_as_numpy_with_any_labels_on_a_cnn():
    """Disjoint regions: XRAI's greedy order is the regions sorted by their mean attribution."""
    torch.manual_seed(0)
    model, x = SmallCNN().double().eval(), torch.randn(1, 3, 8, 8, dtype=torch.float64)
    labels = np.full((8, 8), 9)
    labels[:4, :4], labels[4:, :2], labels[:2, 4:] = -1, 5, 30
    result = XRAI(model, segmenter=lambda picture: labels, min_pixel_diff=1, steps=4, normalize=None).explain(
        x, target=2)
    attribution = result.diagnostics["base_attributions"][0, 0].double()
    values = np.unique(labels)
    density = [attribution[torch.from_numpy(labels == value)].mean().item() for value in values]
    expected = torch.zeros(8, 8, dtype=torch.long)
    for rank, index in enumerate(np.argsort(density)[::-1], start=1):
        expected[torch.from_numpy(labels == values[index])] = rank
    assert torch.equal(result.diagnostics["ranks"][0, 0], expected)


def test_xrai_refuses_min_pixel_diff_beyond_the_image_and_warns_about_a_single_region():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    with pytest.raises(ValueError, match=r"min_pixel_diff=50 is more than the 4 × 4 image's 16 pixels.*smaller"):
        XRAI(model, steps=2).explain(torch.rand(1, 3, 4, 4), target=0)
    with pytest.raises(ValueError, match=r"min_pixel_diff=5000 is more than the 32 × 32 image's 1024 pixels"):
        XRAI(model, steps=2, min_pixel_diff=5000).explain(torch.rand(1, 3, 32, 32), target=0)
    with pytest.warns(RuntimeWarning, match=r"single region.*\(0, 0\), \(1, 0\).*covers the whole image.*"
                                            r"Felzenszwalb\(dilation_radius=1\)"):
        result = XRAI(model, steps=2, min_pixel_diff=1).explain(torch.rand(2, 3, 4, 4), target=0)
    assert result.raw_maps.eq(1).all()  # one region: the constant map, now said
    finer = XRAI(model, steps=2, min_pixel_diff=1, segmenter=Felzenszwalb(dilation_radius=1)).explain(
        torch.rand(2, 3, 4, 4), target=0)
    assert finer.diagnostics["ranks"].amax() > 1
    small = torch.zeros(16, 8, 8, dtype=torch.bool)
    small.view(16, -1)[torch.arange(16), torch.arange(0, 64, 4)] = True  # 16 one-pixel masks
    with pytest.warns(RuntimeWarning, match=r"no candidate segment has min_pixel_diff=5 pixels \(the largest has 1\)"):
        XRAI(model, steps=2, min_pixel_diff=5, segmenter=lambda picture: small).explain(torch.rand(1, 3, 8, 8))


def test_xrai_refuses_a_segmenters_output_of_the_wrong_size_or_kind_naming_it():
    model, x = ConvGapLinear().eval(), torch.rand(1, 3, 32, 32)
    before = model_state(model)
    cases = [
        (torch.ones(2, 16, 16, dtype=torch.bool), r"returned shape \(2, 16, 16\) for a 32 × 32 image"),
        (torch.ones(32, 32, 3, dtype=torch.bool), r"returned shape \(32, 32, 3\)"),
        (torch.zeros(0, 32, 32, dtype=torch.bool), "returned no mask"),
        (torch.rand(3, 32, 32), "values other than 0 and 1"),
        (torch.rand(32, 32), "fractional values"),
        ([[0, 1]], "returned list"),
    ]
    for output, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            XRAI(model, steps=2, segmenter=lambda picture, output=output: output).explain(x, target=0)
    assert_state_equal(before, model_state(model))
    with pytest.raises(TypeError, match="segmenter must be a callable"):
        XRAI(model, segmenter="felzenszwalb")
    with pytest.raises(ValueError, match=r"baselines must be a list.*got a tensor of shape \(3, 32, 32\)"):
        XRAI(model, baselines=torch.zeros(3, 32, 32))
    with pytest.raises(ValueError, match=r"baselines\[1\] holds NaN or inf"):
        XRAI(model, baselines=["zeros", torch.full((3, 32, 32), float("nan"))])
    for options, message in ((dict(min_pixel_diff=2.5), "min_pixel_diff must be an int of at least 0; got 2.5"),
                             (dict(area_threshold=float("nan")), "area_threshold must be a finite number"),
                             (dict(steps=0), "steps must be an int of at least 1; got 0")):
        with pytest.raises(ValueError, match=message):
            XRAI(model, **options)
    with pytest.raises(ValueError, match=r"dilation_radius must be an int of at least 0; got -1"):
        Felzenszwalb(dilation_radius=-1)


# ------------------------------------------------------------------ item 8: Guided IG ends, on any input


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_guided_ig_refuses_a_non_finite_baseline_instead_of_spinning(bad):
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(1, 3, 16, 16)
    baseline = torch.zeros(3, 16, 16)
    baseline[1, 2, 3] = bad
    with time_limit(20), pytest.raises(ValueError, match=r"the baseline holds NaN or inf .*index \(1, 2, 3\)"):
        GuidedIG(model, baseline=baseline, steps=4)
    before = model_state(model)
    huge = torch.full((3, 16, 16), 1e300, dtype=torch.float64)  # finite in float64, inf as the model's float32
    with time_limit(20), pytest.raises(ValueError, match=r"baseline \(as torch.float32 model input\) holds NaN or inf"):
        GuidedIG(model, baseline=huge, steps=4).explain(x, target=0)
    assert_state_equal(before, model_state(model))
    # the path function itself ends on any rows it is given
    inputs, starts = torch.randn(2, 6, dtype=torch.float64), torch.zeros(2, 6, dtype=torch.float64)
    starts[1, 0] = bad
    with time_limit(20), pytest.raises(ValueError, match=r"path is undefined for rows \[1\]"):
        guided_ig_paths(inputs, starts, lambda points: torch.ones_like(points), 4, 0.25, 0.02)


def test_gradient_shap_and_blur_ig_refuse_non_finite_references_and_inputs():
    model = SmallCNN().eval()
    references = torch.zeros(4, 3, 8, 8)
    references[2, 0, 1, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"baselines holds NaN or inf .*index \(2, 0, 1, 1\)"):
        GradientShap(model, references)
    huge = torch.full((2, 3, 8, 8), 1e300, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"baselines \(cast to the model's torch.float32\) holds NaN or inf"):
        GradientShap(model, huge, samples=2).explain(torch.rand(1, 3, 8, 8), target=0)
    nan_image = torch.rand(1, 3, 8, 8)
    nan_image[0, 0, 0, 0] = float("nan")
    for explainer in (BlurIG(model, steps=2), GradientShap(model, samples=2), GuidedIG(model, steps=2)):
        with pytest.raises(ValueError, match="NaN or inf"):
            explainer.explain(nan_image, target=0)


def test_guided_ig_ends_with_a_clear_outcome_on_degenerate_paths():
    torch.manual_seed(0)
    model, x = ConvGapLinear().double().eval(), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    # a baseline equal to an image: zero attributions for it, and a warning that says why
    baseline = torch.stack([x[0], torch.zeros_like(x[0])])
    with time_limit(20), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = GuidedIG(model, baseline=baseline, steps=5, normalize=None).explain(x, target=1)
    messages = [str(warning.message) for warning in caught]
    assert any("(image, target) (0, 0): the baseline equals the image, so the path from it has length 0" in text
               for text in messages)
    assert not any("vanishes" in text for text in messages)  # not blamed on the gradient
    assert same.attributions[0].eq(0).all() and same.attributions[1].ne(0).any()
    # steps=1 with max_dist=0: one step from the baseline, (x − x') ⊙ ∂y/∂x at x' (the left Riemann sum)
    start = torch.randn(3, 6, 6, dtype=torch.float64)
    one = GuidedIG(model, baseline=start, steps=1, max_dist=0.0, normalize=None).explain(x, target=2)
    point = start.expand_as(x).clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(point)[:, 2].sum(), point)
    torch.testing.assert_close(one.attributions[:, 0], (x - start) * gradient)
    # zero gradient everywhere: the path still ends, with zero attributions and the usual warning
    flat = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 2)).double().eval()
    with torch.no_grad():
        flat[1].weight.zero_()
    with time_limit(20), pytest.warns(RuntimeWarning, match="gradient of the score at the input is zero everywhere"):
        zero = GuidedIG(flat, steps=7, fraction=1.0, max_dist=1.0).explain(x, target=0)
    assert zero.attributions.eq(0).all()


# ------------------------------------------------------------------ item 16: options named, with their value


def test_gradient_shap_options_are_checked_at_construction_naming_option_and_value():
    model = SmallCNN().eval()
    cases = [
        (dict(samples=2.5), "samples must be an int of at least 1; got 2.5"),
        (dict(samples=0), "samples must be an int of at least 1; got 0"),
        (dict(samples=True), "samples must be an int of at least 1; got True"),
        (dict(noise_std=-0.1), "noise_std must be a finite number ≥ 0; got -0.1"),
        (dict(noise_std=float("nan")), "noise_std must be a finite number ≥ 0; got nan"),
        (dict(seed=1.5), "seed must be an int .* or None .*; got 1.5"),
        (dict(seed="0"), "seed must be an int .* or None .*; got '0'"),
        (dict(seed=2**64), "seed must be an int"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            GradientShap(model, **options)
    with pytest.raises(TypeError, match="multiply_by_inputs must be True or False; got 'yes'"):
        GradientShap(model, multiply_by_inputs="yes")
    assert GradientShap(model, samples=np.int64(3)).samples == 3


def test_gradient_shap_seed_none_draws_afresh_each_call_from_torchs_global_random_state():
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(1, 3, 8, 8)
    references = torch.randn(4, 3, 8, 8)
    fresh = GradientShap(model, references, samples=3, noise_std=0.1, seed=None)
    first, second = fresh.explain(x, target=1), fresh.explain(x, target=1)
    assert not torch.equal(first.attributions, second.attributions)
    torch.manual_seed(123)
    drawn_seed = int(torch.randint(0, 2**62, ()).item())  # what seed=None takes from the global generator
    torch.manual_seed(123)
    again = fresh.explain(x, target=1)
    seeded = GradientShap(model, references, samples=3, noise_std=0.1, seed=drawn_seed).explain(x, target=1)
    torch.testing.assert_close(again.attributions, seeded.attributions)


def test_blur_and_guided_ig_options_are_checked_at_construction():
    model = SmallCNN().eval()
    cases = [
        (BlurIG, dict(max_sigma=float("inf")), "max_sigma must be a finite number > 0; got inf"),
        (BlurIG, dict(max_sigma=0), "max_sigma must be a finite number > 0; got 0"),
        (BlurIG, dict(grad_step=float("nan")), "grad_step must be a finite number > 0; got nan"),
        (BlurIG, dict(steps=10.0), "steps must be an int of at least 1; got 10.0"),
        (GuidedIG, dict(steps=0), "steps must be an int of at least 1; got 0"),
        (GuidedIG, dict(fraction=float("nan")), "fraction must be a finite number ≥ 0; got nan"),
        (GuidedIG, dict(fraction=0), r"fraction must be in \(0, 1\]; got 0"),
        (GuidedIG, dict(max_dist=2), r"max_dist must be in \[0, 1\]; got 2"),
    ]
    for method, options, message in cases:
        with pytest.raises(ValueError, match=message):
            method(model, **options)
    with pytest.raises(TypeError, match="sqrt must be True or False; got 'no'"):
        BlurIG(model, sqrt="no")


def test_metric_options_are_named_with_a_short_value_never_a_whole_tensor():
    image, heat = torch.full((1, 3, 8, 8), 2.0), torch.rand(1, 8, 8)
    wrong = torch.zeros(1, 3, 5, 5)
    with pytest.raises(ValueError, match=r"substrate tensor has shape \(1, 3, 5, 5\).*batch \(1, 3, 8, 8\)") as raised:
        metrics.deletion(MeanModel(), image, heat, target=0, substrate=wrong)
    assert "tensor(" not in str(raised.value) and len(str(raised.value)) < 300
    with pytest.raises(ValueError, match=r"substrate must be .*got a ndarray of shape \(3, 8, 8\)") as raised:
        metrics.insertion(MeanModel(), image, heat, target=0, substrate=np.zeros((3, 8, 8)))
    assert "array(" not in str(raised.value)
    with pytest.raises(ValueError, match="substrate tensor holds NaN or inf"):
        metrics.deletion(MeanModel(), image, heat, target=0, substrate=torch.full((3, 1, 1), float("nan")))
    # a tensor substrate is taken, broadcast to the batch: removed pixels become 5, the mean rises from 2 to 5
    steps = 4
    share = torch.arange(steps + 1) / steps
    filled = metrics.deletion(MeanModel(), image, heat, target=0, steps=steps, score="logit",
                              substrate=torch.full((3, 1, 1), 5.0))
    torch.testing.assert_close(filled.curves[0], 2.0 + 3.0 * share)
    cases = [
        (lambda: metrics.deletion(MeanModel(), image, heat, steps=2.5), "steps must be an int of at least 1; got 2.5"),
        (lambda: metrics.insertion(MeanModel(), image, heat, batch_size=0), "batch_size must be an int of at least 1"),
        (lambda: metrics.deletion(MeanModel(), image, heat, score="prob"), "score must be 'probability' or 'logit'"),
        (lambda: metrics.road(MeanModel(), image, heat, percentages=[0.5, 1.5]), r"percentages must be .*\[0, 1\]"),
        (lambda: metrics.road(MeanModel(), image, heat, noise=-1), "noise must be a finite number ≥ 0; got -1"),
        (lambda: metrics.pointing_game(heat, heat > 0.5, tolerance=float("nan")), "tolerance must be a finite number"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_no_warning_and_same_values_on_the_usual_sizes():
    """The checks cost no behaviour: at 64 px the blur substrate is torchvision's, to rounding."""
    torch.manual_seed(0)
    model, x = ConvGapLinear().eval(), torch.rand(2, 3, 64, 64)
    heat = torch.rand(2, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curve = metrics.insertion(model, x, heat, target=[0, 1], steps=4)
    sigma = 64 / 16
    kernel = 2 * math.ceil(3 * sigma) + 1
    expected = metrics.insertion(model, x, heat, target=[0, 1], steps=4,
                                 substrate=lambda batch: TF.gaussian_blur(batch, [kernel, kernel], [sigma, sigma]))
    torch.testing.assert_close(curve.curves, expected.curves, rtol=1e-5, atol=1e-6)
