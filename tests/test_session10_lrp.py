"""LRP and AttnLRP on model families met in the wild (session 10): where LRP meets calls without a rule (a
transformer's LayerNorm), the relevance follows the plain gradient there and its sum need not match the score; the
warning must say that, not blame ε for a "lost" share of a small score."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from explain.methods.lrp import LRP


def tiny_layer_norm_model() -> nn.Module:
    """flatten → linear (no bias) → LayerNorm (no affine) → linear (no bias), the last scaled so the score is ~1e-5,
    within 1e3 × ε = 1e-6 of ε."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6, bias=False), nn.LayerNorm(6, elementwise_affine=False),
                          nn.Linear(6, 2, bias=False))
    with torch.no_grad():
        model[3].weight.mul_(1e-5)
    return model.eval()


def by_hand(model: nn.Module, x: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LRP-ε on both linear layers (target 0, R = the logit), the plain gradient through the LayerNorm, float64."""
    w1, w2 = model[1].weight.detach().double(), model[3].weight.detach().double()[0]
    flat = x.double().flatten(1)[0]
    a = (w1 @ flat).requires_grad_(True)
    h = torch.nn.functional.layer_norm(a, (6,), eps=model[2].eps)
    z = float(h.detach() @ w2)
    relevance_h = h.detach() * w2 / (z + epsilon * (1 if z >= 0 else -1)) * z
    (relevance_a,) = torch.autograd.grad(h, a, relevance_h)
    a = a.detach()
    return flat * (w1.T @ (relevance_a / (a + epsilon * torch.where(a >= 0, 1.0, -1.0).double())))


def test_unruled_calls_are_named_and_epsilon_is_not_blamed_for_the_difference():
    model = tiny_layer_norm_model()
    x = torch.rand(1, 3, 2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = LRP(model, "epsilon_plus", normalize=None).explain(x, target=0)
    messages = [str(warning.message) for warning in caught]
    expected = by_hand(model, x, 1e-6)
    got = explanation.attributions[0, 0].double().flatten()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))
    score = float(explanation.diagnostics["output_relevance"][0, 0])
    assert abs(score) < 1e-3  # within 1e3 × ε
    assert abs(float(expected.sum()) / score - 1) > 0.1  # the LayerNorm's gradient changed the sum by over 10 %
    (gap,) = [m for m in messages if "no rule for" in m]
    assert "2: layer_norm" in gap and "AttnLRP" in gap
    assert not [m for m in messages if "lost a large share" in m]  # not ε's doing: the gap warning says why


def half_model_with_exact_zeros() -> tuple[nn.Module, torch.Tensor]:
    """flatten → linear (no bias; its first unit's weights 0, so its pre-activation is exactly 0) → GELU → linear (no
    bias), and an input with exact zeros: in float16, x + 1e-10 is 0 there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6, bias=False), nn.GELU(), nn.Linear(6, 2, bias=False))
    with torch.no_grad():
        model[1].weight[0] = 0
    x = torch.rand(1, 3, 2, 2)
    x[0, 0, 0] = 0
    return model.eval(), x


@pytest.mark.parametrize("linear_gamma", [None, 0.25])
def test_attnlrp_float16_exact_zeros_give_zero_relevance_not_nan(linear_gamma):
    from explain.methods.attnlrp import AttnLRP

    model, x = half_model_with_exact_zeros()
    reference = AttnLRP(model.double(), normalize=None, linear_gamma=linear_gamma).explain(x.double(), target=0)
    if linear_gamma is None:  # by hand: the identity rule gelu(a) / a (0 where a = 0), LRP-0 on both layers
        w1, w2 = model[1].weight.detach()[:, :], model[3].weight.detach()[0]
        flat = x.double().flatten()
        a = w1 @ flat
        ratio = torch.where(a == 0, 0.0, torch.nn.functional.gelu(a) / a)
        assert torch.allclose(reference.attributions[0, 0].flatten(), flat * (w1.T @ (ratio * w2)), atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float16 precision warning
        explanation = AttnLRP(model.half(), normalize=None, linear_gamma=linear_gamma).explain(x.half(), target=0)
    got, expected = explanation.attributions.double(), reference.attributions
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=2e-3 * float(expected.abs().max()))
