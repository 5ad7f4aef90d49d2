"""LRP where the relevance vanishes on its way to the input: random-weight EfficientNet / MobileNet have activations
far smaller than ε and the stabiliser, which then absorb the relevance (zennit 0.5 gives the same all-zero map on
torchvision's efficientnet_b0). The map must not be returned silently: a warning says where and why."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from explain.methods.lrp import LRP


def tiny_model(scale: float, dtype: torch.dtype = torch.float32) -> nn.Module:
    """conv (no bias) → ReLU → average pool → linear (no bias), the conv's weights times ``scale``: activations and
    the score are ~``scale``, and no bias absorbs relevance (with ε → 0 LRP conserves it exactly)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(scale)
    return model.to(dtype).eval()


def explain(model: nn.Module, x: torch.Tensor, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = LRP(model, "epsilon_plus", normalize=None, **options).explain(x, target=0)
    return explanation, [str(warning.message) for warning in caught]


def linear_epsilon_by_hand(model: nn.Module, x: torch.Tensor, epsilon: float) -> tuple[float, float]:
    """(relevance the linear layer receives, relevance it passes on) for target 0, LRP-ε written out in float64."""
    with torch.no_grad():
        features = model[:4](x).double()[0]  # (4,)
        weight = model[4].weight.double()[0]  # (4,)
        z = float((features * weight).sum())
    received = z  # R = output ⊙ one-hot: the logit of class 0
    sent = float((features * weight / (z + epsilon * (1 if z >= 0 else -1))).sum()) * received
    return received, sent


def test_all_zero_map_warns_that_epsilon_absorbed_the_relevance_and_where():
    model = tiny_model(1e-20)  # score ~1e-20: ε = 1e-6 keeps ~1e-14 of it at the linear layer, float32 underflows
    x = torch.rand(1, 3, 8, 8)
    explanation, messages = explain(model, x)
    assert explanation.attributions.abs().max() == 0
    received, sent = linear_epsilon_by_hand(model, x, 1e-6)
    layers = explanation.diagnostics["layers"]
    index = layers.index("4: linear")
    assert explanation.diagnostics["layer_output_relevance"][0, 0, index].item() == pytest.approx(received, rel=1e-5)
    assert explanation.diagnostics["layer_input_relevance"][0, 0, index].item() == pytest.approx(sent, rel=1e-4)
    assert abs(sent) < 1e-12 * abs(received)
    (message,) = [m for m in messages if "zero everywhere" in m]
    assert "relevance vanished" in message and "4: linear" in message and "epsilon=1e-06" in message
    assert "zero-initialised classifier head" not in message  # the generic gradient reason does not apply


def test_nearly_vanished_map_warns_although_not_all_zero():
    model = tiny_model(1e-9)  # each of 3 rules keeps ~1e-3 of the relevance: ~1e-18 reaches the input
    x = torch.rand(1, 3, 8, 8)
    explanation, messages = explain(model, x)
    assert explanation.attributions.abs().max() > 0
    relevance_sum = explanation.diagnostics["relevance_sum"][0, 0].item()
    score = explanation.diagnostics["output_relevance"][0, 0].item()
    assert relevance_sum != 0 and abs(relevance_sum) < 1e-6 * abs(score)
    (message,) = [m for m in messages if "relevance vanished" in m]
    assert "hold almost no relevance" in message and "4: linear" in message


def test_small_epsilon_conserves_the_relevance_of_tiny_activations_without_warning():
    model = tiny_model(1e-20, torch.float64)
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    explanation, messages = explain(model, x, epsilon=1e-60, stabilizer=1e-60)
    with torch.no_grad():
        score = model(x)[0, 0].item()
    assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(score, rel=1e-9)
    assert not [m for m in messages if "vanished" in m]


def test_normal_scale_model_has_no_vanishing_warning():
    model = tiny_model(1.0)
    x = torch.rand(2, 3, 8, 8)
    explanation, messages = explain(model, x)
    assert not [m for m in messages if "vanished" in m]
    sums, scores = explanation.diagnostics["relevance_sum"], explanation.diagnostics["output_relevance"]
    assert torch.allclose(sums, scores, rtol=1e-4)  # ε = 1e-6 takes a negligible share of an O(1) score


# ------------------------------------------------------------------ CRP: the top concepts of a negative score


def negative_head_model() -> nn.Module:
    """conv → ReLU (the concept layer, 4 channels; channel 3 dead: bias −100) → average pool → linear with negative
    weights and no bias: every channel's relevance R_c = x̄_c · w_c ≤ 0 for class 0, and R_3 = 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([1.0, 1.0, 1.0, -100.0]))
        model[4].weight.copy_(-torch.rand(2, 4) - 0.1)
    return model.eval()


def test_crp_warns_when_its_most_relevant_concepts_carry_no_relevance():
    from explain.methods.concepts import ConceptRelevance

    model = negative_head_model()
    x = torch.rand(1, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = ConceptRelevance(model, "1", "lrp", composite="epsilon_plus", normalize=None).explain(
            x, target=0, concepts=2)
    # by hand: R_c = mean_c · w_0c (the ε rule of a bias-free linear layer; pooling passes it on)
    with torch.no_grad():
        means = model[:4](x)[0]
    by_hand = (means * model[4].weight[0]).double()
    layer_relevance = explanation.diagnostics["layer_relevance"][0]
    assert torch.allclose(layer_relevance, by_hand, rtol=1e-4, atol=1e-9)
    assert layer_relevance[3] == 0 and (layer_relevance[:3] < 0).all()
    assert explanation.class_indices[0, 0] == 3  # the "most relevant" concept (signed) is the dead channel
    assert explanation.raw_map_grid[0, 0].abs().max() == 0
    messages = [str(w.message) for w in caught if "no relevance (R_c = 0)" in str(w.message)]
    assert len(messages) == 1 and "image 0" in messages[0] and "0 channel(s) with positive relevance" in messages[0]


def test_crp_top_concepts_with_relevance_do_not_warn():
    from explain.methods.concepts import ConceptRelevance

    model = negative_head_model()
    with torch.no_grad():
        model[4].weight.abs_()  # positive weights: every live channel's R_c > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = ConceptRelevance(model, "1", "lrp", composite="epsilon_plus", normalize=None).explain(
            torch.rand(1, 3, 8, 8), target=0, concepts=2)
    assert (explanation.scores > 0).all()
    assert not [w for w in caught if "R_c = 0" in str(w.message)]
