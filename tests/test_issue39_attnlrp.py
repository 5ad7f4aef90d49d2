"""Issue 39, AttnLRP:

4. the diagnostics ("relevance_sum", "output_relevance", "conservation_error") are float64, whatever the model's
   precision: for a float64 model they equal Σ attributions and the score to float64 rounding (LRP's too);
5. squeeze-and-excitation gates x · σ(W s) (EfficientNet, MobileNetV3, RegNetY) and other activations with
   y(0) ≠ 0. The uniform rule sent half of the product's relevance into the gate, where the identity rule σ(z) / z
   divides by a pre-activation near 0: relevance sums of 1e6 to 1e11 for scores below 1, float32 and float64 maps
   and a batch and its images alone up to 200 % apart. Now the gate is held constant (a weight: all the relevance
   goes to the gated features), and an activation with y(0) ≠ 0 used otherwise gets the identity rule of y − y(0)
   (bounded by its slope; the constant y(0) keeps its share, as a bias does). Checked against the relevance by
   hand on one gate and one activation, and on torchvision's EfficientNet-B0, MobileNetV3-small and RegNetY-400MF
   with realistic BatchNorm statistics and gate biases.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.ops import SqueezeExcitation

import explain


def strictly(function: Callable, *args, **kwargs):
    """The call with every RuntimeWarning an error: an unruled call on the input's path fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return function(*args, **kwargs)


def relative_error(value: Tensor, reference: Tensor) -> float:
    return ((value.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


# ------------------------------------------------------------------ 4. float64 diagnostics


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.GELU(), nn.Conv2d(6, 4, 3),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).double().eval()


@pytest.mark.parametrize("method", ["attnlrp", "lrp"])
def test_the_diagnostics_of_a_float64_model_are_its_sums_in_float64(method):
    """relevance_sum = Σ attributions, output_relevance = the logit, conservation_error = their difference, to
    float64 rounding (they were cast to float32: 1e-8 apart). LRP's diagnostics are made the same way."""
    model = small_cnn()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    torch.manual_seed(1)
    x, targets = torch.randn(3, 3, 8, 8, dtype=torch.float64), [0, 4, 2]
    options = {"composite": "epsilon_plus"} if method == "lrp" else {}
    explanation = strictly(explain.get_method(method)(model, **options).explain, x, target=targets)
    diagnostics = explanation.diagnostics
    with torch.no_grad():
        scores = model(x)[torch.arange(3), targets].unsqueeze(1)
    sums = explanation.attributions.flatten(2).sum(dim=2)
    for name in ("relevance_sum", "output_relevance", "conservation_error"):
        assert diagnostics[name].dtype == torch.float64, name
    torch.testing.assert_close(diagnostics["relevance_sum"], sums, rtol=1e-12, atol=0)
    torch.testing.assert_close(diagnostics["output_relevance"], scores, rtol=1e-12, atol=0)
    torch.testing.assert_close(diagnostics["conservation_error"], sums - scores, rtol=1e-9, atol=1e-15)


# ------------------------------------------------------------------ 5a. one gate, by hand


class Gated(nn.Module):
    """A squeeze-and-excitation block written in one of the ways models write it: x · gate(fc2(relu(fc1(pool x))))."""

    def __init__(self, channels: int, form: str):
        super().__init__()
        self.form = form
        self.fc1, self.fc2 = nn.Conv2d(channels, 3, 1), nn.Conv2d(3, channels, 1)
        self.gate = nn.Hardsigmoid() if form == "hardsigmoid module" else nn.Sigmoid()

    def pre_activation(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1))))

    def gate_values(self, x: Tensor) -> Tensor:
        return self.gate(self.pre_activation(x))

    def forward(self, x: Tensor) -> Tensor:
        z = self.pre_activation(x)
        if self.form in ("sigmoid module", "hardsigmoid module"):  # torchvision's SqueezeExcitation
            return self.gate(z) * x
        if self.form == "torch.sigmoid":
            return x * torch.sigmoid(z)
        if self.form == "expand_as":  # timm's EcaModule: the gate reshaped, then expanded to the features
            return x * torch.sigmoid(z).view(x.shape[0], -1, 1, 1).expand_as(x)
        gated = x.clone()  # "in place": h *= g
        gated *= z.sigmoid()
        return gated


def gated_model(form: str) -> nn.Sequential:
    """Gate, average pool, a linear head without bias; one gate's pre-activation is 1e-6 for the first image."""
    torch.manual_seed(0)
    model = nn.Sequential(Gated(4, form), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3, bias=False))
    nn.init.uniform_(model[0].fc1.bias, 0.2, 0.6)  # hidden units that are on: the gate depends on the input
    return model.double().eval()


GATE_FORMS = ["sigmoid module", "torch.sigmoid", "hardsigmoid module", "expand_as", "in place"]


@pytest.mark.parametrize("form", GATE_FORMS)
def test_one_squeeze_excitation_gate_holds_the_gate_constant_as_worked_out_by_hand(form):
    """score = Σ_c w_c · mean_hw(x_c g_c): the head (LRP-0, no bias) and the mean give x_c g_c w_c / HW to each
    feature; the gate is held constant, so the input's relevance is R = x ⊙ g w / HW, which sums to the score.
    With a gate pre-activation of 1e-6 the uniform rule and σ(z) / z gave the first image a relevance sum of 844 for
    a score of −0.007."""
    model = gated_model(form)
    torch.manual_seed(1)
    x, targets = torch.randn(3, 4, 5, 5, dtype=torch.float64), [0, 2, 1]
    block = model[0]
    with torch.no_grad():
        z = block.pre_activation(x)
        block.fc2.bias[1] -= z[0, 1, 0, 0] - 1e-6
        gate = block.gate_values(x)
    assert abs(block.pre_activation(x)[0, 1].item() - 1e-6) < 1e-12
    explanation = strictly(explain.AttnLRP(model).explain, x, target=targets)
    weights = model[3].weight[targets].detach()  # (N, C)
    by_hand = x * gate * weights[:, :, None, None] / 25
    assert relative_error(explanation.attributions[:, 0], by_hand) <= 1e-12
    torch.testing.assert_close(explanation.diagnostics["relevance_sum"], explanation.diagnostics["output_relevance"],
                               rtol=1e-12, atol=1e-15)
    applied = dict(rule.split(": ") for rule in explanation.diagnostics["rules"])
    assert applied["gate"] == "1" and "uniform" not in applied, applied


def test_a_product_of_two_gates_keeps_the_uniform_rule_and_a_silu_gate_is_not_a_gate():
    """Only a gate times something that is not one holds the gate: σ(a) · σ(b) splits its relevance between the two,
    and SiLU(a) · b (SwiGLU's form, y(0) = 0) keeps the uniform rule, as lxt does."""

    class TwoProducts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x: Tensor) -> Tensor:
            x = x.flatten(1)
            return torch.sigmoid(self.a(x)) * torch.sigmoid(self.b(x)) + F.silu(self.a(x)) * self.c(x)

    torch.manual_seed(0)
    model = TwoProducts().double().eval()
    x = torch.randn(2, 3, 1, 2, dtype=torch.float64)
    applied = dict(rule.split(": ") for rule in
                   strictly(explain.AttnLRP(model).explain, x, target=[0, 1]).diagnostics["rules"])
    assert applied["uniform"] == "2" and "gate" not in applied, applied
    assert applied["shifted identity"] == "2" and applied["identity"] == "1", applied


# ------------------------------------------------------------------ 5b. an activation with y(0) ≠ 0, not a gate


class Layer(nn.Module):
    """Flatten, a linear layer with bias, the activation, a linear layer without bias."""

    def __init__(self, activation: Callable[[Tensor], Tensor]):
        super().__init__()
        self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 1, bias=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.activation(self.first(x.flatten(1))))


ACTIVATIONS = {"torch.sigmoid": torch.sigmoid, "nn.Sigmoid": nn.Sigmoid(), "F.softplus": F.softplus,
               "nn.Hardsigmoid": nn.Hardsigmoid()}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_with_a_nonzero_value_at_zero_gets_the_identity_rule_of_y_minus_y0(name):
    """f(x) = w₂ · a(W₁ x + b₁): R_x = x ⊙ W₁ᵀ((a(u) − a(0)) / (u + ε) ⊙ w₂). The identity rule a(u) / u with u = 1e-7
    multiplied that unit's relevance by 5e6 (sigmoid): the relevance was unbounded; now each input's is bounded by
    |x| ⊙ |W₁|ᵀ|w₂| times the activation's largest slope, and a(0) w₂ keeps its share as a bias does."""
    activation = ACTIVATIONS[name]
    torch.manual_seed(0)
    model = Layer(activation).double().eval()
    torch.manual_seed(1)
    x = torch.randn(4, 3, 1, 2, dtype=torch.float64)
    with torch.no_grad():
        model.first.bias[2] -= model.first(x.flatten(1))[0, 2] - 1e-7
    explanation = strictly(explain.AttnLRP(model).explain, x, target=[0] * 4)
    with torch.no_grad():
        u = model.first(x.flatten(1))
        at_zero = activation(torch.zeros(1, dtype=torch.float64))
        ratio = (activation(u) - at_zero) / (u + 1e-10 * u.sign())  # the divisor kept ε from 0
        expected = x.flatten(1) * ((ratio * model.second.weight[0]) @ model.first.weight)
    assert abs(u[0, 2].item() - 1e-7) < 1e-12
    assert relative_error(explanation.attributions[:, 0].flatten(1), expected) <= 1e-8
    slope_bound = x.flatten(1).abs() * (model.second.weight.abs() @ model.first.weight.abs())  # |a'| ≤ 1 for all four
    assert (explanation.attributions[:, 0].flatten(1).abs() <= slope_bound + 1e-12).all()
    assert explanation.diagnostics["rules"] == ["linear: 2", "shifted identity: 1"]


# ------------------------------------------------------------------ 5c. torchvision's squeeze-and-excitation CNNs


SE_MODELS = {"efficientnet_b0": 16, "mobilenet_v3_small": 9, "regnet_y_400mf": 16}
"""The model and its number of squeeze-and-excitation blocks."""


@functools.lru_cache(maxsize=None)
def realistic_state(name: str) -> dict[str, Tensor]:
    """Random weights (weights=None) with what training leaves that initialisation does not: BatchNorm scales and
    shifts away from 1 and 0 and running statistics of the data (train-mode forwards of random images), and biases
    in the squeeze-and-excitation convolutions (torchvision initialises them to 0), so the gates' pre-activations
    spread around 0 as a trained network's do."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SqueezeExcitation):
                for layer in (module.fc1, module.fc2):
                    layer.bias.copy_(0.5 * torch.randn(layer.bias.shape, generator=generator))
            if isinstance(module, nn.BatchNorm2d):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=generator))
                module.momentum = None  # the running statistics: the average over the forwards below
                module.reset_running_stats()
        model.train()
        for _ in range(4):
            model(torch.randn(8, 3, 64, 64, generator=generator))
    return {key: value.clone() for key, value in model.state_dict().items()}


def se_model(name: str) -> nn.Module:
    model = getattr(torchvision.models, name)(weights=None)
    model.load_state_dict(realistic_state(name))
    return model.eval()


def images() -> Tensor:
    return torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def with_a_gate_near_zero(model: nn.Module, x: Tensor) -> nn.Module:
    """The last gate's pre-activation nearest 0 for the first image moved to 1e-6 (in float64; its float32 value is
    then a rounding error): among a trained network's thousands of gate channels some are this near."""
    block = [module for module in model.modules() if isinstance(module, SqueezeExcitation)][-1]
    recorded = []
    handle = block.fc2.register_forward_hook(lambda module, args, output: recorded.append(output))
    try:
        with torch.no_grad():
            model.double()(x.double())
    finally:
        handle.remove()
        model.float()
    z = recorded[0][0].flatten()
    channel = int(z.abs().argmin())
    with torch.no_grad():
        block.fc2.bias[channel] -= float(z[channel]) - 1e-6
    return model


@pytest.mark.parametrize("name", SE_MODELS)
def test_squeeze_excitation_cnns_conserve_relevance(name):
    """Every constant outside the gates set to 0 (BatchNorm shifts and means, the head's bias) and the gates' own
    biases kept: each rule then conserves (LRP-0 without bias, the identity rules of ReLU, SiLU and hard swish, the
    held gate, proportional sums, the mean), so the input's relevance sums to the logit. Measured: 3e-10 to 5e-9
    (the ε of y / (x + ε)); the uniform rule through the gates gave errors of 2e5 to 2e11 times the logit."""
    model = se_model(name)
    gate_layers = {id(layer) for module in model.modules() if isinstance(module, SqueezeExcitation)
                   for layer in (module.fc1, module.fc2)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.zero_()
                module.bias.zero_()
            elif isinstance(module, (nn.Conv2d, nn.Linear)) and id(module) not in gate_layers:
                if module.bias is not None:
                    module.bias.zero_()
    model.double()
    explanation = strictly(explain.AttnLRP(model).explain, images()[:3].double(), target=[1, 2, 3])
    diagnostics = explanation.diagnostics
    error = (diagnostics["conservation_error"] / diagnostics["output_relevance"]).abs()
    assert error.max() <= 1e-6, error
    assert diagnostics["unruled"] == []
    applied = dict(rule.split(": ") for rule in diagnostics["rules"])
    assert applied["gate"] == str(SE_MODELS[name]) and "uniform" not in applied, applied


def input_times_gradient_precision_gap(model: nn.Module, x: Tensor, targets: list[int]) -> float:
    """How far the model's own input × gradient of the batch's first image is between float32 and float64 (relative to
    its maximum): a ReLU input that rounds to the other side of 0 in float32 changes the gradient itself (on an AMD
    EPYC, RegNet's batch of 4, run channels-last, has one ReLU input of exactly 0 in float64 and above 0 in float32:
    1.2e-2 apart; on an Intel Xeon none). The model is left in float32."""
    def input_times_gradient(images: Tensor) -> Tensor:
        images = images.clone().requires_grad_(True)
        scores = model(images)[torch.arange(len(targets)), targets]
        (gradient,) = torch.autograd.grad(scores.sum(), images)
        return (gradient * images).detach()[0]

    single = input_times_gradient(x)
    model.double()
    try:
        double = input_times_gradient(x.double())
    finally:
        model.float()
    return relative_error(single, double)


@pytest.mark.parametrize("name", SE_MODELS)
def test_squeeze_excitation_cnns_give_the_same_maps_in_float32_and_float64_and_alone(name):
    """A gate pre-activation 1e-6 from 0 (first image): the maps in float32 and float64, and of a batch of 4 (which
    runs channels-last on the CPU) and of each image alone, agree to float32 rounding, 5e-6 of the map's maximum
    (measured on an Intel Xeon), plus twice the model's own float32/float64 gap of input × gradient where a ReLU input
    rounds across 0 (1.2e-2 for RegNet's first image on an AMD EPYC); they were 11 % to 200 % apart. The other
    images' maps agree to 1e-2 in L2 (the worst, 3e-3, is RegNet's third image, where input × gradient itself is 9e-3
    apart: a ReLU input at its kink)."""
    x = images()
    model = with_a_gate_near_zero(se_model(name), x)
    targets = [1, 2, 3, 4]
    single = strictly(explain.AttnLRP(model).explain, x, target=targets).attributions
    alone = torch.cat([strictly(explain.AttnLRP(model).explain, x[i : i + 1], target=[targets[i]]).attributions
                       for i in range(4)])
    kink = input_times_gradient_precision_gap(model, x, targets)
    double = strictly(explain.AttnLRP(model.double()).explain, x.double(), target=targets).attributions
    for other, label in ((double, "float64"), (alone, "alone")):
        assert relative_error(single[0], other[0]) <= 1e-4 + 2 * kink, (label, kink)
        l2 = ((single.double() - other.double()).flatten(1).norm(dim=1) / other.double().flatten(1).norm(dim=1))
        assert l2.max() <= 1e-2 + 2 * kink, (label, l2, kink)
