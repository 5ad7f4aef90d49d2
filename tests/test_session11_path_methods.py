"""Session 11: GradientSHAP / expected gradients, Integrated Gradients and Blur IG attacked as a hostile user would,
against by-hand computations of their formulas (and Captum's, where installed).

- Blur IG warned about no completeness error at all: with ``sqrt=True`` its sum missed 17× the score change on a small
  CNN in silence (Guided IG and Integrated Gradients warn); it now warns beyond ``GROSSLY_INCOMPLETE`` times.
- GradientSHAP drew its random samples for the whole batch at once, so an image's map changed with the other images
  of the batch and its place among them; every image now gets the call's same draws.
- GradientSHAP's baselines on the meta device failed inside torch ("Tensor.item() cannot be called on meta tensors");
  one (C, H, W) reference was refused without saying how to give it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from scipy import ndimage
from torch import nn

import explain
from explain.methods.path_methods import GROSSLY_INCOMPLETE


class TinyNet(nn.Module):
    """conv → softplus → linear, for 8 × 8 RGB images: smooth, so path integrals converge."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(nn.functional.softplus(self.conv(x)).flatten(1))


class WithBatchNorm(nn.Module):
    """conv → BatchNorm → softplus → linear, 6 × 6 inputs: train mode would normalise by the batch's statistics."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 3)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.fc(nn.functional.softplus(self.bn(self.conv(x))).flatten(1))


def scipy_blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """One (C, H, W) image blurred per channel by scipy (zeros outside, truncated at 4σ), as Blur IG's path."""
    return torch.from_numpy(np.stack([ndimage.gaussian_filter(channel.numpy(), sigma, mode="constant")
                                      for channel in image]))


# ------------------------------------------------------------------ Blur IG's gross incompleteness


def blur_case():
    """A small CNN and an image whose target-2 score barely changes between the image and its σ = √50 blur
    (3.3e-4), while Blur IG's sum with sqrt=True, 16 steps, is 0.006: 17× the score change."""
    torch.manual_seed(1)
    model = TinyNet().double().eval()
    images = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    return model, images[4:5], 2


def test_blur_ig_warns_where_its_sum_misses_the_score_change_by_more_than_ten_times():
    model, x, target = blur_case()
    before = model_state(model)
    with pytest.warns(RuntimeWarning, match="BlurIG: the attributions miss more than 1000% of the score change") as rec:
        result = explain.BlurIG(model, steps=16, sqrt=True, normalize=None).explain(x, target=target)
    assert_state_equal(before, model_state(model))
    text = " | ".join(str(warning.message) for warning in rec)
    assert "16 steps, square-root spacing" in text and "sqrt=False" in text
    with torch.no_grad():  # by hand: y(x) − y(x blurred with σ = √max_sigma, where square-root spacing starts)
        change = (model(x) - model(scipy_blur(x[0], 50.0**0.5)[None]))[0, target].item()
    assert result.diagnostics["score_change"].item() == pytest.approx(change, rel=1e-4)
    total = result.attributions.double().sum().item()
    assert result.diagnostics["completeness_error"].item() == pytest.approx(total - change, rel=1e-4)
    assert abs(total - change) > GROSSLY_INCOMPLETE * abs(change)  # the 17× documented in path_methods
    assert f"they sum to {total:.3g}, y(x) − y(x′) = {change:.3g}" in text


def test_blur_ig_converged_enough_stays_silent():
    """The same image, evenly spaced and with more points: within 0.4× of the score change; a smooth case within 1 %."""
    model, x, target = blur_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = explain.BlurIG(model, steps=400, normalize=None, progress=False).explain(x, target=target)
        error, change = result.diagnostics["completeness_error"], result.diagnostics["score_change"]
        assert error.abs().item() < 0.5 * change.abs().item()
        torch.manual_seed(0)
        smooth, images = TinyNet().double().eval(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
        close = explain.BlurIG(smooth, max_sigma=6, steps=256, normalize=None, progress=False).explain(images, target=1)
        assert (close.diagnostics["completeness_error"].abs() < 0.01 * close.diagnostics["score_change"].abs()).all()


# ------------------------------------------------------------------ GradientSHAP: the same map wherever the image is


def shap_case():
    torch.manual_seed(0)
    model = WithBatchNorm().double().eval()
    return model, torch.randn(3, 3, 6, 6, dtype=torch.float64), torch.randn(4, 3, 6, 6, dtype=torch.float64)


def shap_by_hand(model, image, references, target, baseline_index, alphas, noise) -> torch.Tensor:
    """Captum's GradientSHAP for one image: the mean over samples s of (x + ε_s − b_s) ⊙ ∂y/∂x at
    b_s + α_s (x + ε_s − b_s)."""
    total = torch.zeros_like(image)
    for s in range(len(alphas)):
        noisy = image + (0 if noise is None else noise[s])
        reference = references[int(baseline_index[s])]
        point = (reference + float(alphas[s]) * (noisy - reference)).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(point[None])[0, target], point)
        total += (noisy - reference) * gradient
    return total / len(alphas)


def test_gradient_shap_gives_an_image_the_same_map_alone_or_anywhere_in_a_batch():
    model, x, references = shap_case()
    targets = [0, 2, 1]

    def make():
        return explain.GradientShap(model, references, samples=5, noise_std=0.1, seed=7, normalize=None)

    batch = make().explain(x, target=targets)
    reordered = make().explain(x[[2, 0, 1]], target=[1, 0, 2])
    torch.testing.assert_close(reordered.attributions[[1, 2, 0]], batch.attributions, rtol=0, atol=1e-15)
    draws = make().draw(x[:1])  # the draws of one image alone: every image of the batch gets them
    for n, target in enumerate(targets):
        alone = make().explain(x[n : n + 1], target=target)
        torch.testing.assert_close(alone.attributions[0], batch.attributions[n], rtol=0, atol=1e-15)
        expected = shap_by_hand(model, x[n], references, target, draws.baseline_index, draws.alphas, draws.noise)
        torch.testing.assert_close(batch.attributions[n, 0], expected, rtol=1e-10, atol=1e-12)
    again = make().explain(x, target=targets)
    assert torch.equal(again.attributions, batch.attributions)  # same seed, same map
    other = explain.GradientShap(model, references, samples=5, noise_std=0.1, seed=8, normalize=None)
    assert not torch.equal(other.explain(x, target=targets).attributions, batch.attributions)


def test_gradient_shap_equals_captum_with_one_baseline_and_different_targets():
    """One reference (its index is always 0), no noise: Captum's positions α (numpy uniform) recorded and given to
    ours, float64 on a tiny model; a batch of two images with different targets."""
    captum = pytest.importorskip("captum.attr")
    model, x, references = shap_case()
    x, reference = x[:2], references[:1]
    np.random.seed(3)
    recorded = []
    uniform = np.random.uniform

    def recording(*args, **kwargs):
        recorded.append(uniform(*args, **kwargs))
        return recorded[-1]

    np.random.uniform = recording
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = captum.GradientShap(model).attribute(x, baselines=reference, target=[2, 0], n_samples=6,
                                                          stdevs=0.0)
    finally:
        np.random.uniform = uniform
    alphas = torch.as_tensor(recorded[0], dtype=torch.float64)
    for n, target in enumerate([2, 0]):
        ours = shap_by_hand(model, x[n], reference, target, [0] * 6, alphas[n * 6 : (n + 1) * 6], None)
        torch.testing.assert_close(ours, theirs[n].detach(), rtol=1e-10, atol=1e-12)
    # ours, given the same positions for both images (as it draws them), is the same formula
    explainer = explain.GradientShap(model, reference, samples=6, normalize=None)
    draws = explainer.draw(x)
    result = explainer.explain(x, target=[2, 0])
    for n, target in enumerate([2, 0]):
        expected = shap_by_hand(model, x[n], reference, target, [0] * 6, draws.alphas[:6], None)
        torch.testing.assert_close(result.attributions[n, 0], expected, rtol=1e-10, atol=1e-12)


def test_integrated_gradients_equals_captum_and_is_complete():
    captum = pytest.importorskip("captum.attr")
    model, x, references = shap_case()
    baseline = references[:1]
    ours = explain.IntegratedGradients(model, baseline=baseline, steps=16, normalize=None).explain(x, target=[0, 2, 1])
    theirs = captum.IntegratedGradients(model).attribute(x, baselines=baseline, target=[0, 2, 1], n_steps=16,
                                                         method="riemann_middle")
    torch.testing.assert_close(ours.attributions[:, 0], theirs.detach(), rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        change = (model(x) - model(baseline)).gather(1, torch.tensor([[0], [2], [1]]))[:, 0]
    assert (ours.attributions.double().sum(dim=(1, 2, 3, 4)) - change).abs().max() < 1e-3 * change.abs().max()


# ------------------------------------------------------------------ the caller's contexts and the model's state


@pytest.mark.parametrize("make", [
    lambda m, refs: explain.GradientShap(m, refs, samples=4, noise_std=0.1, normalize=None, progress=False),
    lambda m, refs: explain.IntegratedGradients(m, baseline=refs[:1], steps=5, normalize=None, progress=False),
    lambda m, refs: explain.BlurIG(m, max_sigma=4, steps=5, normalize=None, progress=False),
], ids=["gradientshap", "ig", "blurig"])
def test_train_mode_batch_norm_frozen_parameters_and_no_grad_give_the_eval_mode_map_and_leave_the_model(make):
    """The path's points, batched together, must neither be normalised by their own statistics nor update the
    running ones; a caller's no_grad / inference_mode or frozen parameters change nothing."""
    model, x, references = shap_case()
    expected = make(model, references).explain(x, target=[0, 2, 1]).attributions
    model.train()
    for parameter in model.conv.parameters():
        parameter.requires_grad_(False)
    before = model_state(model)
    with torch.no_grad():
        in_no_grad = make(model, references).explain(x, target=[0, 2, 1]).attributions
    with torch.inference_mode():
        in_inference = make(model, references).explain(x, target=[0, 2, 1]).attributions
    one_row_a_pass = make(model, references)
    one_row_a_pass.batch_size = 1
    alone = one_row_a_pass.explain(x, target=[0, 2, 1]).attributions
    assert_state_equal(before, model_state(model))
    assert model.training and not model.conv.weight.requires_grad and model.fc.weight.requires_grad
    for result in (in_no_grad, in_inference, alone):
        torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-14)


def test_many_points_in_small_passes_equal_one_pass():
    model, x, references = shap_case()
    blur = [explain.BlurIG(model, max_sigma=4, steps=24, batch_size=size, normalize=None, progress=False)
            .explain(x, target=1).attributions for size in (7, 72)]
    torch.testing.assert_close(blur[0], blur[1], rtol=1e-12, atol=1e-14)
    shap = [explain.GradientShap(model, references, samples=7, batch_size=size, normalize=None, progress=False)
            .explain(x, target=1).attributions for size in (4, 21)]
    torch.testing.assert_close(shap[0], shap[1], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ GradientSHAP's references, refused clearly


def test_gradient_shap_refuses_meta_baselines_and_says_how_to_give_one_reference():
    model, x, references = shap_case()
    with pytest.raises(ValueError, match="baselines are on the meta device"):
        explain.GradientShap(model, torch.empty(2, 3, 6, 6, device="meta"))
    with pytest.raises(ValueError, match=r"got \(3, 6, 6\)\. For one reference image give baselines\[None\]"):
        explain.GradientShap(model, references[0])
    one = explain.GradientShap(model, references[0][None], samples=3, normalize=None).explain(x[:1], target=1)
    draws = explain.GradientShap(model, references[0][None], samples=3).draw(x[:1])
    expected = shap_by_hand(model, x[0], references[:1], 1, [0, 0, 0], draws.alphas, None)
    torch.testing.assert_close(one.attributions[0, 0], expected, rtol=1e-10, atol=1e-12)
