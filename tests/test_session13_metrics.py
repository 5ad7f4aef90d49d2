"""Session 13 attacks on the metrics: layers whose weight the forward recomputes (weight_norm, spectral_norm)
are randomised, a model that applies its own softmax is said so, ARCC refuses maps beyond [0, 1], bool boxes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import explain
from explain import metrics
from explain.metrics.sanity import randomized_copies, reinitialize


def _old_style(wrap, layer: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated, and still found in models
        return wrap(layer)


@pytest.mark.parametrize("wrap, names", [(torch.nn.utils.weight_norm, ("weight_g", "weight_v")),
                                         (torch.nn.utils.spectral_norm, ("weight_orig",))])
def test_reinitialize_randomises_the_parameters_a_weight_is_recomputed_from(wrap, names):
    """reset_parameters re-initialised the ``weight`` that the forward recomputes from weight_g / weight_v
    (weight_orig): the layer kept its trained weight and the sanity check compared an unrandomised layer."""
    torch.manual_seed(0)
    layer = _old_style(wrap, nn.Linear(6, 5))
    before = {name: parameter.detach().clone() for name, parameter in layer.named_parameters()}
    inputs = torch.randn(4, 6)
    with torch.no_grad():
        weight_before = layer(inputs) - layer.bias
    reinitialize(layer, 3)
    for name in names:
        assert not torch.equal(getattr(layer, name), before[name]), name
    with torch.no_grad():
        weight_after = layer(inputs) - layer.bias  # the weight the forward uses, times the inputs
    assert (weight_after - weight_before).abs().max() > 1e-3
    bound = 2 * 0.02 + 1e-7  # drawn as free parameters: N(0, 0.02²) truncated at ±2 std
    for name in names:
        assert getattr(layer, name).abs().max() <= bound
    # seeded: the same draw again
    again = _old_style(wrap, nn.Linear(6, 5))
    again.load_state_dict({name: value for name, value in before.items()}, strict=False)
    with torch.no_grad():
        again(inputs)  # as the layer was run (spectral_norm's weight shares weight_orig's storage until then)
    reinitialize(again, 3)
    for name in names:
        torch.testing.assert_close(getattr(again, name), getattr(layer, name), rtol=0, atol=0)


def test_reinitialize_leaves_what_reset_parameters_sets_as_it_sets_it():
    """A reset that writes the values the parameter already held (LayerNorm's ones and zeros) is a reset: not
    redrawn; a plain Linear gets exactly what its reset_parameters draws from the seed."""
    norm = nn.LayerNorm(4)
    reinitialize(norm, 0)
    assert torch.equal(norm.weight, torch.ones(4)) and torch.equal(norm.bias, torch.zeros(4))
    layer = nn.Linear(3, 2)
    reinitialize(layer, 5)
    expected = nn.Linear(3, 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        expected.reset_parameters()
    assert torch.equal(layer.weight, expected.weight) and torch.equal(layer.bias, expected.bias)


class _WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = _old_style(torch.nn.utils.weight_norm, nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).relu().mean(dim=(2, 3)))


def test_randomised_copy_of_a_weight_normed_head_changes_its_weights_and_the_model_is_left_as_found():
    torch.manual_seed(0)
    model = _WeightNormed()
    model.conv.weight.requires_grad_(False)
    model.train()
    model.head.eval()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    modes = [module.training for module in model.modules()]
    explainer = explain.GradCAM(model, "conv")
    images = torch.rand(2, 3, 8, 8)
    for _, layers, randomized in randomized_copies(explainer, images, ["head"]):
        assert layers == ["head"]
        head = randomized.model.head
        assert not torch.equal(head.weight_v, state["head.weight_v"])
        assert not torch.equal(head.weight_g, state["head.weight_g"])
    stages = metrics.cascading_randomization(explainer, images, stages=["head"])
    assert len(stages) == 1
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert {name: parameter.requires_grad for name, parameter in model.named_parameters()} == flags
    assert [module.training for module in model.modules()] == modes


class _Softmaxed(nn.Module):
    """Two classes from one channel: logits (0.1 · Σ pixels, 0), given as their softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit = 0.1 * x.sum(dim=(1, 2, 3))
        return torch.stack([logit, torch.zeros_like(logit)], dim=1).softmax(dim=1)


def test_a_model_that_applies_its_own_softmax_is_said_so_and_scored_as_it_is_with_logit():
    image = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    heat = torch.tensor([[[4.0, 3.0], [2.0, 1.0]]])  # deletes 1, then 2, 3, 4
    model = _Softmaxed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curve = metrics.deletion(model, image, heat, target=0, steps=4, score="logit")
    assert not caught
    remaining = torch.tensor([10.0, 9.0, 7.0, 4.0, 0.0])  # Σ pixels after each step
    by_hand = torch.sigmoid(0.1 * remaining)  # the model's own probability of class 0
    torch.testing.assert_close(curve.curves[0], by_hand)
    area = sum((by_hand[i] + by_hand[i + 1]) / 2 * 0.25 for i in range(4))
    torch.testing.assert_close(curve.area[0], area)
    with pytest.warns(UserWarning, match="already are probabilities") as caught:
        twice = metrics.deletion(model, image, heat, target=0, steps=4)
    assert {record.filename for record in caught} == {__file__}
    # what it warns about: the softmax of probabilities, near 1 / 2 whatever the input
    torch.testing.assert_close(twice.curves[0], torch.sigmoid(by_hand - (1 - by_hand)))
    with pytest.warns(UserWarning, match="already are probabilities"):
        metrics.non_sensitivity(model, image, heat, target=0)


def test_logits_that_sum_to_one_by_chance_in_some_rows_only_are_not_warned_about():
    class Logits(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([x.mean(dim=(1, 2, 3)), 2 - x.mean(dim=(1, 2, 3)) - x[:, 0, 1, 1]], dim=1)

    image = torch.tensor([[[[0.0, 0.5], [0.5, 1.0]]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.deletion(Logits(), image, image[:, 0], target=0, steps=4)  # the first row sums to 1, others not


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).relu().mean(dim=(2, 3)))


def test_arcc_refuses_maps_beyond_one_naming_them_and_keeps_maps_in_range():
    torch.manual_seed(0)
    explainer = explain.GradCAM(_Cnn().eval(), "conv")
    images = torch.rand(2, 3, 8, 8)
    maps = torch.rand(2, 8, 8)
    result = metrics.arcc(explainer, images, maps, [0, 1], percentages=(0.5,))
    parts = (result.coherency, 1 - result.complexity, (2 * result.road).clamp(0, 1))
    torch.testing.assert_close(result.arcc, 3 / sum(1 / (part + 1e-8) for part in parts))
    torch.testing.assert_close(result.complexity, maps.flatten(1).mean(dim=1))
    scaled = maps.clone()
    scaled[1] *= 5  # complexity ≈ 2.5: 1 − complexity < 0, the harmonic mean out of [0, 1]
    with pytest.raises(ValueError, match=r"arcc takes maps in \[0, 1\], but map 1 reaches beyond it"):
        metrics.arcc(explainer, images, scaled, [0, 1], percentages=(0.5,))


def test_bool_boxes_are_refused_saying_boxes_are_coordinates():
    maps = torch.rand(2, 8, 8)
    with pytest.raises(ValueError, match="boxes must be pixel coordinates"):
        metrics.pointing_game(maps, torch.ones(2, 4, dtype=torch.bool))
    boxes = torch.tensor([[0, 0, 3, 3], [4, 4, 7, 7]])
    inside = torch.zeros(2, 8, 8)
    inside[0, 1, 2] = inside[1, 6, 5] = 1
    assert metrics.pointing_game(inside, boxes).tolist() == [1.0, 1.0]
    assert math.isclose(float(metrics.relevance_mass_accuracy(inside + 1, boxes)[0]), 17 / 65, rel_tol=1e-6)
