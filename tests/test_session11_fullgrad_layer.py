"""FullGrad, Layer Integrated Gradients and Layer Conductance used the way people use them: timm's fused
BatchNorm-activation layers, caller contexts (no_grad, inference_mode), float64, channels-last, models in train
mode or with frozen parameters, in-place activations after the layer; each against a computation written here or
Captum's, with the model left as found."""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from test_issue39_batchnorm import randomized_statistics
from torch import nn

import explain
from explain.core.capture import LayerOutputError
from explain.methods.layer_attribution import LayerConductance, LayerIntegratedGradients

timm_layers = pytest.importorskip("timm.layers")


def randomised_batchnorm(model: nn.Module) -> nn.Module:
    """Random running statistics and affine parameters (the initial ones make every effective bias 0)."""
    return randomized_statistics(model)


# ------------------------------------------------------------------ FullGrad written out by hand


def rescaled(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    low = values.amin(dim=dims, keepdim=True)
    span = values.amax(dim=dims, keepdim=True) - low
    return torch.where(span > 0, (values - low) / torch.where(span > 0, span, 1.0), 0.0)


class ConvBnNet(nn.Module):
    """conv (bias) → BatchNorm → ReLU → conv (no bias) → BatchNorm → ReLU → mean → linear; ``forward_by_hand``
    is the same network with a zero probe added to each biased output z, so that ∂y/∂probe = ∂y/∂z."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 5, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(5)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        return self.fc(self.relu(self.bn2(self.conv2(x))).mean(dim=(2, 3)))

    def forward_by_hand(self, x, probes: list):
        def affine_bn(bn, value):  # eval-mode BatchNorm: scale · z + (β − γ μ / √(σ² + ε))
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            bias = bn.bias - bn.running_mean * scale
            return value * scale.view(-1, 1, 1) + probe(value, bias)

        def probe(value, bias):
            zero = torch.zeros(value.shape, dtype=value.dtype, requires_grad=True)
            probes.append((zero, bias.detach()))
            return bias.view(-1, 1, 1) + zero

        x = F.conv2d(x, self.conv1.weight, None, padding=1)
        x = torch.relu(affine_bn(self.bn1, x + probe(x, self.conv1.bias)))
        x = torch.relu(affine_bn(self.bn2, F.conv2d(x, self.conv2.weight, None, stride=2, padding=1)))
        return self.fc(x.mean(dim=(2, 3)))


def fullgrad_by_hand(model: ConvBnNet, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """ψ(|x ⊙ ∂y/∂x|) summed over colours plus Σ_layers Σ_c ψ(|b_c ∂y/∂z_c|) upsampled, image by image, float64."""
    model = copy.deepcopy(model).double().eval()
    maps = []
    for n, target in enumerate(targets):
        probes: list = []
        image = x[n : n + 1].double().clone().requires_grad_(True)
        score = model.forward_by_hand(image, probes)[0, target]
        gradients = torch.autograd.grad(score, [image, *[zero for zero, _ in probes]])
        result = rescaled((image * gradients[0]).abs(), (1, 2, 3)).sum(1)
        for (_, bias), gradient in zip(probes, gradients[1:]):
            terms = rescaled((gradient * bias.view(1, -1, 1, 1)).abs(), (2, 3)).sum(1, keepdim=True)
            result = result + F.interpolate(terms, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        maps.append(result[0])
    return torch.stack(maps)


def in_inference_mode(call: Callable[[], explain.Explanation]) -> explain.Explanation:
    with torch.inference_mode():
        return call()


def without_grad(call: Callable[[], explain.Explanation]) -> explain.Explanation:
    with torch.no_grad():
        return call()


CONTEXTS: dict[str, Callable[[nn.Module, torch.Tensor], tuple[nn.Module, torch.Tensor, Callable]]] = {
    "plain": lambda model, x: (model, x, lambda call: call()),
    "no_grad": lambda model, x: (model, x, without_grad),
    "inference_mode": lambda model, x: (model, x, in_inference_mode),
    "float64": lambda model, x: (model.double(), x.double(), lambda call: call()),
    "channels_last": lambda model, x: (model.to(memory_format=torch.channels_last),
                                       x.contiguous(memory_format=torch.channels_last), lambda call: call()),
    "train_mode": lambda model, x: (model.train(), x, lambda call: call()),
    "frozen": lambda model, x: (model.requires_grad_(False), x, lambda call: call()),
}


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_fullgrad_equals_the_formula_by_hand_in_every_callers_context_and_leaves_the_model_as_found(context):
    """A batch of 3 with different targets at an odd size (13 × 11, so that the stride-2 layer is upsampled)."""
    torch.manual_seed(0)
    reference = randomised_batchnorm(ConvBnNet())
    x, targets = torch.randn(3, 3, 13, 11), [2, 0, 1]
    expected = fullgrad_by_hand(reference, x, targets)
    model, x, call_in = CONTEXTS[context](copy.deepcopy(reference), x)
    before = model_state(model)
    result = call_in(lambda: explain.FullGrad(model, normalize=None).explain(x, target=targets))
    assert_state_equal(before, model_state(model))
    torch.testing.assert_close(result.raw_maps.double(), expected, rtol=1e-4, atol=1e-4)
    assert result.diagnostics["completeness_error"].abs().max() < 1e-4  # a ReLU network: complete
    assert int(result.diagnostics["bias_layers"]) == 4  # conv1, two BatchNorms, fc


# ------------------------------------------------------------------ FullGrad and timm's BatchNormAct2d


class PlainBlocks(nn.Module):
    """conv (no bias) → BatchNorm2d → ReLU, twice, then a head: what timm's BatchNormAct2d fuses."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.bn2(self.conv2(x))).mean(dim=(2, 3)))


class FusedBlocks(PlainBlocks):
    """The same network with timm's BatchNormAct2d (ReLU in place), as timm's EfficientNet / RegNet build it."""

    def __init__(self, drop_layer=None):
        super().__init__()
        self.bn1 = timm_layers.BatchNormAct2d(4, act_layer=nn.ReLU, drop_layer=drop_layer)
        self.bn2 = timm_layers.BatchNormAct2d(6, act_layer=nn.ReLU, drop_layer=drop_layer)

    def forward(self, x):
        return self.fc(self.bn2(self.conv2(self.bn1(self.conv1(x)))).mean(dim=(2, 3)))


@pytest.mark.parametrize("variant", ["BatchNormAct2d", "with dropout", "FrozenBatchNormAct2d"])
def test_fullgrad_counts_timms_batchnormact_as_the_batchnorm_before_its_activation(variant):
    """timm's BatchNormAct2d (every BatchNorm of timm's EfficientNet, MobileNetV3, RegNet) was left out: the map
    lost every BatchNorm term, and timm's regnetx_002 (a ReLU network) missed 100 % of its score in the
    completeness check. Now the fused network's map equals the one of the same network with nn.BatchNorm2d."""
    torch.manual_seed(0)
    plain = randomised_batchnorm(PlainBlocks())
    fused = FusedBlocks(nn.Dropout if variant == "with dropout" else None)
    fused.load_state_dict(plain.state_dict())
    fused.eval()
    if variant == "FrozenBatchNormAct2d":
        fused = timm_layers.freeze_batch_norm_2d(fused)
        assert isinstance(fused.bn1, timm_layers.FrozenBatchNormAct2d)
    x, targets = torch.randn(2, 3, 9, 10), [1, 2]
    expected = explain.FullGrad(plain, normalize=None).explain(x, target=targets)
    before = model_state(fused)
    result = explain.FullGrad(fused, normalize=None).explain(x, target=targets)
    assert_state_equal(before, model_state(fused))
    torch.testing.assert_close(result.raw_maps, expected.raw_maps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.diagnostics["completeness_error"], expected.diagnostics["completeness_error"],
                               rtol=0, atol=1e-5)
    assert int(result.diagnostics["bias_layers"]) == 3  # two BatchNorms and the head


def test_fullgrad_on_timms_regnet_is_complete():
    """regnetx_002: convolutions without bias, every BatchNorm a BatchNormAct2d with ReLU: y = x ∂y/∂x + Σ b ∂y/∂z
    (before: the error was 5.37 of a score of 5.23)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = randomised_batchnorm(timm.create_model("regnetx_002", pretrained=False, num_classes=5))
    result = explain.FullGrad(model, normalize=None).explain(torch.randn(1, 3, 64, 64), target=1)
    assert int(result.diagnostics["bias_layers"]) == 45  # 44 BatchNormAct2d and the head
    assert result.diagnostics["completeness_error"].abs().item() < 1e-4 * max(1.0, result.scores.abs().item())


# ------------------------------------------------------------------ Layer IG and Layer Conductance


class Stem(nn.Module):
    """Identity at the input, conv → BatchNorm → in-place ReLU → conv → tanh → mean → linear; the ``functional``
    copy applies F.relu, so that nothing after a layer changes its output in place."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.first = nn.Identity()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 5, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        x = self.bn(self.conv(self.first(x)))
        x = F.relu(x) if self.functional else self.relu(x)
        return self.head(self.drop(torch.tanh(self.conv2(x)).mean(dim=(2, 3))))


LAYER_METHODS = [(LayerIntegratedGradients, "midpoint", "riemann_middle"),
                 (LayerConductance, "trapezoid", "riemann_trapezoid")]


@pytest.mark.parametrize("method, rule, captum_rule", LAYER_METHODS, ids=["layer-ig", "conductance"])
@pytest.mark.parametrize("layer", ["first", "bn", "conv2"])
def test_layer_methods_equal_captum_at_the_input_and_before_an_in_place_relu(method, rule, captum_rule, layer):
    """float64, 2 images with 2 different targets each, a random baseline; 4 steps (Captum's step sizes are float32:
    1/4 is exact). "first" is an Identity at the input (its output is the input tensor itself); "bn" is followed by
    an in-place ReLU, which must change neither the layer's recorded output nor its gradient."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = randomised_batchnorm(Stem()).double()
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64)
    baseline = 0.3 * torch.randn_like(x)
    targets = [[0, 2], [1, 1]]
    before = model_state(model)
    ours = method(model, layer, baseline=baseline, steps=4, rule=rule).explain(x, target=targets)
    assert_state_equal(before, model_state(model))
    peer = {LayerIntegratedGradients: captum.LayerIntegratedGradients, LayerConductance: captum.LayerConductance}
    functional = Stem(functional=True).double().eval()
    functional.load_state_dict(model.state_dict())  # Captum's hooks and an in-place ReLU: give it the F.relu copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.stack([peer[method](functional, getattr(functional, layer)).attribute(
            x, baselines=baseline, target=[row[k] for row in targets], n_steps=4, method=captum_rule)
            for k in range(2)], dim=1).detach()
    torch.testing.assert_close(ours.attributions, theirs, rtol=1e-9, atol=1e-12)
    complete = theirs.flatten(2).sum(2) - ours.diagnostics["score_change"].double()
    torch.testing.assert_close(ours.diagnostics["completeness_error"].double(), complete, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:LayerConductance. the attributions miss")  # 8 steps; not what is tested
@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("method", [LayerIntegratedGradients, LayerConductance])
def test_layer_methods_give_the_same_attributions_in_every_callers_context(method, context):
    """The same per-unit attributions as a plain call on the float64 copy of the model with F.relu (8 steps,
    batch_size 5: passes that split an image's path), and the model left as found."""
    torch.manual_seed(1)
    reference = randomised_batchnorm(Stem())
    x, targets = torch.randn(3, 3, 9, 8), [[0, 1], [2, 2], [1, 0]]
    functional = Stem(functional=True).double().eval()
    functional.load_state_dict(reference.state_dict())
    expected = method(functional, "bn", steps=8).explain(x.double(), target=targets).attributions
    model, x, call_in = CONTEXTS[context](copy.deepcopy(reference), x)
    before = model_state(model)
    result = call_in(lambda: method(model, "bn", steps=8, batch_size=5).explain(x, target=targets))
    assert_state_equal(before, model_state(model))
    torch.testing.assert_close(result.attributions.double(), expected, rtol=1e-4, atol=1e-5)


class TupleLayer(nn.Module):
    def forward(self, x):
        return x, x.sum()


class Awkward(nn.Module):
    """A layer that never runs, one returning a tuple, one run twice."""

    def __init__(self):
        super().__init__()
        self.conv, self.unused, self.shared = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.split = TupleLayer()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x, _ = self.split(self.conv(x))
        return self.head(self.shared(self.shared(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("method", [LayerIntegratedGradients, LayerConductance])
def test_layers_that_do_not_run_return_a_tuple_or_run_twice_are_refused_with_the_reason(method):
    torch.manual_seed(0)
    model = Awkward().eval()
    x = torch.randn(1, 3, 6, 6)
    before = model_state(model)
    for layer, error, message in [("unused", explain.LayerNotRunError, "did not run"),
                                  ("split", LayerOutputError, "returned a tuple"),
                                  ("shared", explain.LayerNotRunError, "more than once")]:
        with pytest.raises(error, match=message):
            method(model, layer, steps=2).explain(x, target=0)
        assert_state_equal(before, model_state(model))
