"""Session 10: the gradient and attribution family attacked as a hostile user would (graph leaks from an input or
baseline that requires grad, Guided IG's exploding path, unclear option errors), against by-hand computations."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

import explain

pytestmark = pytest.mark.filterwarnings("ignore:IntegratedGradients. the attributions miss more:RuntimeWarning")


class TinyCNN(nn.Module):
    """Conv, ReLU, conv, ReLU, linear: small enough for exact by-hand checks."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.r1 = nn.ReLU()
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.r2 = nn.ReLU()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(self.r2(self.c2(self.r1(self.c1(x)))).flatten(1))


@pytest.fixture
def case():
    torch.manual_seed(0)
    return TinyCNN().double().eval(), torch.randn(2, 3, 6, 6, dtype=torch.float64)


@pytest.mark.parametrize("make", [
    lambda m: explain.IntegratedGradients(m, steps=8, normalize=None),
    lambda m: explain.GradientShap(m, samples=4, normalize=None),
    lambda m: explain.DeepLift(m, normalize=None),
    lambda m: explain.DeepLiftShap(m, torch.zeros(2, 3, 6, 6, dtype=torch.float64), normalize=None),
    lambda m: explain.GuidedIG(m, steps=4, normalize=None),
    lambda m: explain.BlurIG(m, steps=4, normalize=None),
], ids=["ig", "gradientshap", "deeplift", "deepliftshap", "guidedig", "blurig"])
def test_an_input_that_requires_grad_leaves_no_graph_in_the_diagnostics(case, make):
    model, x = case
    expected = make(model).explain(x, target=[0, 2])
    leaf = x.clone().requires_grad_(True)
    state = model_state(model)
    result = make(model).explain(leaf * 1.0, target=[0, 2])  # a non-leaf in the caller's graph
    assert_state_equal(state, model_state(model))
    for key, value in result.diagnostics.items():
        assert isinstance(value, torch.Tensor) and not value.requires_grad, key
        torch.testing.assert_close(value, expected.diagnostics[key])
    assert leaf.grad is None
    torch.testing.assert_close(result.attributions, expected.attributions)


def test_a_baseline_that_requires_grad_leaves_no_graph_and_matches_by_hand(case):
    model, x = case
    baseline = torch.full((1, 3, 6, 6), 0.1, dtype=torch.float64, requires_grad=True)
    result = explain.IntegratedGradients(model, baseline=baseline, steps=4, normalize=None).explain(x, target=1)
    error = result.diagnostics["completeness_error"]
    assert not error.requires_grad and not result.diagnostics["score_change"].requires_grad
    # by hand: the midpoint rule, 4 points
    total = torch.zeros_like(x)
    for alpha in (0.125, 0.375, 0.625, 0.875):
        point = (baseline.detach() + alpha * (x - baseline.detach())).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(point)[:, 1].sum(), point)
        total += gradient / 4
    by_hand = (x - baseline.detach()) * total
    torch.testing.assert_close(result.attributions[:, 0], by_hand)
    with torch.no_grad():
        change = model(x)[:, 1] - model(baseline.detach())[:, 1]
    torch.testing.assert_close(error[:, 0].double(), by_hand.sum(dim=(1, 2, 3)) - change, rtol=0, atol=1e-6)


class ExplodingAtZero(nn.Module):
    """y = w · x / (‖x‖ + 1e-12): scale-free, so its gradient at the zero baseline is ~1e12 × its size elsewhere
    (as ConvNeXt's, a LayerNorm after a stem convolution without bias)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3 * 4 * 4, dtype=torch.float64))

    def forward(self, x):
        flat = x.flatten(1)
        return (flat / (flat.norm(dim=1, keepdim=True) + 1e-12)) @ self.w.T


def test_guided_ig_warns_where_its_path_sum_explodes():
    torch.manual_seed(0)
    model = ExplodingAtZero()
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="GuidedIG: the attributions miss more than 1000% of the score change"):
        result = explain.GuidedIG(model, steps=4, normalize=None).explain(x, target=0)
    # the gradient at the zero start is huge: the sum is orders of magnitude off y(x) − y(0)
    error, change = result.diagnostics["completeness_error"], result.diagnostics["score_change"]
    assert error.abs().item() > 1e3 * change.abs().item()
    # a sound path (a smooth model) stays silent, as documented: Guided IG is not complete by design
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smooth = nn.Sequential(nn.Flatten(), nn.Linear(48, 2)).double()
        explain.GuidedIG(smooth, steps=4, normalize=None).explain(x, target=0)


@pytest.mark.parametrize("baseline, hint", [(0.5, r"torch\.tensor\(0\.5\)"),
                                            (lambda images: images * 0, r"baseline=f\(images\)")])
def test_a_baseline_given_as_a_number_or_a_function_says_how_to_give_it(case, baseline, hint):
    model, _ = case
    for make in (explain.IntegratedGradients, explain.DeepLift, explain.GuidedIG):
        with pytest.raises(TypeError, match=hint):
            make(model, baseline=baseline)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), "small"])
def test_deeplift_refuses_an_eps_that_is_not_a_finite_nonnegative_number(case, eps):
    model, _ = case
    with pytest.raises(ValueError, match="eps must be a finite number"):
        explain.DeepLift(model, eps=eps)
