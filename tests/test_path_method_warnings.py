"""Path methods say when their attributions are not to be trusted (found by a hostile test of the attribution family).

- Integrated Gradients (and Layer IG, Layer Conductance) warns where the attributions miss more than half of the score
  change y(x) − y(x′): on a model that normalises its input's scale away (timm's ConvNeXt at random initialisation:
  a LayerNorm after a stem convolution without bias), y(αx) is constant for α > 0, so no point of the path sees the
  score change, which happens between α = 0 and the first point; the map was returned in silence.
- ``tolerance=`` not reached within ``max_steps`` is said.
- DeepLIFT of an image equal to its baseline says so (it blamed a vanishing gradient); Blur IG whose points give no
  attribution says why.
- ``steps=True`` and a 1-D or 2-D baseline (a (3,) tensor broadcast along the width) are refused."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain


class ScaleFree(nn.Module):
    """y(x) = head(mean over positions of conv(x) / ‖conv(x)‖): y(αx) = y(x) for every α > 0 (the convolution has no
    bias), and y(0) = head's bias. By Euler's theorem x · ∇y(αx) = 0 on the whole path from 0, so Integrated
    Gradients from the zero baseline sums to 0 whatever its steps, while y(x) − y(0) is not 0."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        features = self.conv(x)
        norms = features.flatten(1).norm(dim=1).clamp_min(1e-12)
        return self.head((features / norms[:, None, None, None]).mean(dim=(2, 3)))


def scale_free() -> ScaleFree:
    torch.manual_seed(0)
    return ScaleFree().double().eval()


def images() -> torch.Tensor:
    return torch.rand(2, 3, 10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def messages(record) -> str:
    return " | ".join(str(warning.message) for warning in record)


def test_integrated_gradients_warns_where_the_attributions_miss_the_score_change():
    model, x = scale_free(), images()
    before = model_state(model)
    with pytest.warns(RuntimeWarning) as record:
        explanation = explain.IntegratedGradients(model).explain(x, target=1)
    assert_state_equal(before, model_state(model))
    text = messages(record)
    assert "IntegratedGradients: the attributions miss more than 50% of the score change" in text
    assert "image 0, target 0" in text and "image 1, target 0" in text and "32 steps" in text
    assert "baseline='blur'" in text
    with torch.no_grad():  # by hand: y(x) − y(0), y(0) the head's bias
        expected_change = model(x)[:, 1] - model.head.bias[1]
    diagnostics = explanation.diagnostics
    torch.testing.assert_close(diagnostics["score_change"][:, 0].double(), expected_change, rtol=1e-6, atol=0)
    # the attributions sum to 0 (Euler), so the error is the whole score change
    torch.testing.assert_close(diagnostics["completeness_error"][:, 0].double(), -expected_change, rtol=1e-5, atol=1e-9)


def test_a_tolerance_not_reached_within_max_steps_is_said():
    model, x = scale_free(), images()
    with pytest.warns(RuntimeWarning) as record:
        explanation = explain.IntegratedGradients(model, steps=2, tolerance=0.01, max_steps=8).explain(x, target=0)
    text = messages(record)
    assert "miss more than 1% of the score change" in text
    assert "8 steps (max_steps=8; tolerance=0.01 not reached)" in text and "Raise max_steps" in text
    assert explanation.diagnostics["steps"].tolist() == [8, 8]


def test_a_complete_path_integral_gives_no_warning():
    """A smooth model at the default 32 midpoint steps: the attributions sum to the score change within 1e-3 of it,
    and nothing is said (warnings are errors here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Softplus(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(6, 3)).double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explanation = explain.IntegratedGradients(model).explain(images(), target=2)
    relative = explanation.diagnostics["completeness_error"] / explanation.diagnostics["score_change"]
    assert relative.abs().max() < 1e-3


def test_layer_integrated_gradients_warns_too():
    model, x = scale_free(), images()
    with pytest.warns(RuntimeWarning, match="LayerIntegratedGradients: the attributions miss more than 50%"):
        explanation = explain.LayerIntegratedGradients(model, "conv").explain(x, target=1)
    diagnostics = explanation.diagnostics
    torch.testing.assert_close(diagnostics["completeness_error"], -diagnostics["score_change"], rtol=1e-5, atol=1e-9)


def test_deeplift_of_an_image_equal_to_its_baseline_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    model = model.double().eval()
    with pytest.warns(RuntimeWarning) as record:
        explain.DeepLift(model).explain(torch.zeros(1, 3, 10, 10, dtype=torch.float64), target=0)
    text = messages(record)
    assert "the baseline equals the image" in text and "vanishes" not in text


def test_blur_ig_whose_points_give_no_attribution_says_why():
    """One step: the single point is the image blurred with σ = max_sigma, where more blur changes nothing, so every
    attribution is 0 though the gradient there is not: the empty map's warning says so (it blamed a vanishing
    gradient), and once: a map of zeros is not also reported as missing the score change."""
    model = scale_free()
    with pytest.warns(RuntimeWarning) as record:
        explanation = explain.BlurIG(model, steps=1, normalize=None).explain(images()[:1], target=1)
    text = messages(record)
    assert len(record) == 1 and "gave no attribution" in text and "vanishes" not in text
    assert explanation.raw_maps.abs().max() == 0
    assert explanation.diagnostics["score_change"].abs().min() > 0


def test_steps_that_are_a_bool_and_baselines_of_one_or_two_dimensions_are_refused():
    model = scale_free()
    with pytest.raises(ValueError, match="steps must be an int of at least 1; got True"):
        explain.IntegratedGradients(model, steps=True)
    for shape in ((3,), (10, 10)):
        with pytest.raises(ValueError, match=r"baseline.view\(-1, 1, 1\)"):
            explain.IntegratedGradients(model, baseline=torch.zeros(shape))
    with pytest.raises(ValueError, match="the baseline is on the meta device"):
        explain.IntegratedGradients(model, baseline=torch.zeros(3, 10, 10, device="meta"))
    # a 0-d tensor is one value for every pixel: the same as the full tensor of it
    x = images()
    scalar = explain.IntegratedGradients(model, baseline=torch.tensor(0.25), steps=4).explain(x, target=0)
    full = explain.IntegratedGradients(model, baseline=torch.full((3, 10, 10), 0.25), steps=4).explain(x, target=0)
    torch.testing.assert_close(scalar.attributions, full.attributions)


def test_a_nan_input_is_refused_without_a_warning_about_the_path_first():
    model = scale_free()
    x = images()
    x[0, 0, 0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="NaN"):
            explain.IntegratedGradients(model, steps=4).explain(x, target=0)


def test_integrated_gradients_checks_its_options():
    model = scale_free()
    with pytest.raises(TypeError, match="multiply_by_inputs must be True or False"):
        explain.IntegratedGradients(model, multiply_by_inputs="no")
    with pytest.raises(ValueError, match="max_steps must be an int of at least 1; got '64'"):
        explain.IntegratedGradients(model, max_steps="64")
    with pytest.raises(ValueError, match=r"tolerance .* must be a finite number > 0; got '0.1'"):
        explain.IntegratedGradients(model, tolerance="0.1")
    with pytest.warns(RuntimeWarning, match=r"miss more than 1e-10% of the score change"):
        explain.IntegratedGradients(model, steps=2, tolerance=1e-12, max_steps=2).explain(images(), target=0)
