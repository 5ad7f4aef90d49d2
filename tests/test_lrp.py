"""LRP: every rule against its formula worked out by hand (Montavon et al. 2019), every composite against zennit 0.5
on torchvision models, relevance conserved layer by layer, and the model left exactly as found."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import SmallCNN, assert_state_equal, model_state
from torch import nn

from explain.core.capture import ModelInputError
from explain.methods.lrp import COMPOSITES, LRP

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406])
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225])
LOW, HIGH = (-IMAGENET_MEAN / IMAGENET_STD).view(1, 3, 1, 1), ((1 - IMAGENET_MEAN) / IMAGENET_STD).view(1, 3, 1, 1)


def lrp(model: nn.Module, x: torch.Tensor, target, composite: str = "epsilon_gamma_box", **options):
    """The explanation, with the raw relevance kept (no normalisation)."""
    return LRP(model, composite, normalize=None, **options).explain(x, target=target)


# ------------------------------------------------------------------ 1. each rule, by hand


def dense(layer, in_shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) of a linear layer as a matrix (out, in) and a vector, read off its outputs for the basis vectors."""
    size = int(np.prod(in_shape))
    with torch.no_grad():
        bias = layer(torch.zeros(1, *in_shape, dtype=torch.float64)).flatten()
        basis = torch.eye(size, dtype=torch.float64).reshape(size, *in_shape)
        weight = layer(basis).reshape(size, -1) - bias
    return weight.T.numpy(), bias.numpy()


def stabilized(z: np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    return z + epsilon * np.where(z >= 0, 1.0, -1.0)


def by_contributions(q: np.ndarray, denominator: np.ndarray, relevance: np.ndarray) -> np.ndarray:
    """R_i = Σ_j q_ji / stab(d_j) R_j for contributions q (out, in)."""
    return (q / stabilized(denominator)[:, None] * relevance[:, None]).sum(axis=0)


def pos(a):
    return np.clip(a, 0, None)


def neg(a):
    return np.clip(a, None, 0)


def rule_epsilon(w, b, x, relevance):
    q = w * x
    return by_contributions(q, q.sum(1) + b, relevance)


def rule_zplus(w, b, x, relevance):
    q = pos(w) * pos(x) + neg(w) * neg(x)
    return by_contributions(q, q.sum(1) + pos(b), relevance)


def rule_alpha2_beta1(w, b, x, relevance, alpha=2.0, beta=1.0):
    activating = pos(w) * pos(x) + neg(w) * neg(x)
    inhibiting = neg(w) * pos(x) + pos(w) * neg(x)
    return (alpha * by_contributions(activating, activating.sum(1) + pos(b), relevance)
            - beta * by_contributions(inhibiting, inhibiting.sum(1) + neg(b), relevance))


def rule_gamma(w, b, x, relevance, gamma=0.25):
    z = w @ x + b
    up, down = w + gamma * pos(w), w + gamma * neg(w)
    for_positive = up * pos(x) + down * neg(x)
    for_negative = down * pos(x) + up * neg(x)
    return (by_contributions(for_positive, for_positive.sum(1) + b + gamma * pos(b), relevance * (z > 0))
            + by_contributions(for_negative, for_negative.sum(1) + b + gamma * neg(b), relevance * (z < 0)))


def rule_zbox(w, b, x, relevance, low, high):
    q = w * x - pos(w) * low - neg(w) * high
    return by_contributions(q, q.sum(1), relevance)


def rule_flat(connected, relevance):
    q = connected.astype(float)
    return by_contributions(q, q.sum(1), relevance)


class TwoConvs(nn.Module):
    """conv → ReLU → conv → ReLU → flatten → linear, on 2 × 4 × 4 inputs (float64)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(48, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


FIRST_AND_OTHER_RULES = {
    "epsilon_gamma_box": ("zbox", rule_gamma),
    "epsilon_plus": (rule_zplus, rule_zplus),
    "epsilon_alpha2_beta1": (rule_alpha2_beta1, rule_alpha2_beta1),
    "epsilon_plus_flat": ("flat", rule_zplus),
    "epsilon_alpha2_beta1_flat": ("flat", rule_alpha2_beta1),
}


@pytest.mark.parametrize("composite", COMPOSITES)
def test_each_rule_equals_its_formula_worked_out_by_hand(composite):
    """z^B, γ, z⁺, α2β1 and flat on the convolutions, ε on the linear layer, relevance passing the ReLUs unchanged,
    the propagation starting from the target's logit: the input relevance equals the matrix formulas."""
    torch.manual_seed(0)
    model = TwoConvs().double().eval()
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64).clamp(-1.4, 1.9)
    low, high = torch.tensor([-1.5, -2.0], dtype=torch.float64), torch.tensor([2.5, 2.0], dtype=torch.float64)
    target = 2
    w1, b1 = dense(model.conv1, (2, 4, 4))
    w2, b2 = dense(model.conv2, (3, 4, 4))
    w3, b3 = model.fc.weight.detach().numpy(), model.fc.bias.detach().numpy()
    connected = dense(lambda t: F.conv2d(t, torch.ones_like(model.conv1.weight), padding=1), (2, 4, 4))[0] != 0
    x0 = x.flatten().numpy()
    h1 = pos(w1 @ x0 + b1)
    h2 = pos(w2 @ h1 + b2)
    y = w3 @ h2 + b3
    relevance = rule_epsilon(w3, b3, h2, np.eye(4)[target] * y)  # starts from the logit; ReLUs pass it on
    first, other = FIRST_AND_OTHER_RULES[composite]
    relevance = other(w2, b2, h1, relevance)
    if first == "zbox":
        box = np.repeat(low.numpy(), 16), np.repeat(high.numpy(), 16)
        expected = rule_zbox(w1, b1, x0, relevance, *box)
    elif first == "flat":
        expected = rule_flat(connected, relevance)
    else:
        expected = first(w1, b1, x0, relevance)
    explanation = lrp(model, x, target, composite, low=low, high=high)
    np.testing.assert_allclose(explanation.attributions[0, 0].flatten().numpy(), expected, rtol=1e-9, atol=1e-12)
    assert explanation.diagnostics["layers"] == ["conv1: conv2d", "conv2: conv2d", "fc: linear"]


class FoldedResidual(nn.Module):
    """conv → BatchNorm → ReLU, then a residual block whose sum is in place (out += identity), average pooling
    and a linear layer: BatchNorm folding, the proportional sum and the average pool's rule, by hand."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(12, 4)

    def forward(self, x):
        identity = self.relu(self.bn1(self.conv1(x)))
        out = self.conv2(identity)
        out += identity
        return self.fc(self.pool(self.relu(out)).flatten(1))


def test_batchnorm_folding_residual_sums_and_average_pooling_equal_their_formulas():
    torch.manual_seed(1)
    model = FoldedResidual().double().eval()
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-0.5, 0.5)
        model.bn1.running_var.uniform_(0.5, 2.0)
        model.bn1.weight.uniform_(0.5, 1.5)
        model.bn1.bias.uniform_(-0.3, 0.3)
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    bn = model.bn1
    scale = (bn.weight / (bn.running_var + bn.eps) ** 0.5).detach().numpy()
    w1, _ = dense(model.conv1, (2, 4, 4))
    w1 = w1 * np.repeat(scale, 16)[:, None]  # the BatchNorm folded into conv1
    b1 = np.repeat((bn.bias.detach().numpy() - bn.running_mean.numpy() * scale), 16)
    w2, b2 = dense(model.conv2, (3, 4, 4))
    pool, _ = dense(model.pool, (3, 4, 4))
    w3, b3 = model.fc.weight.detach().numpy(), model.fc.bias.detach().numpy()
    x0 = x.flatten().numpy()
    identity = pos(w1 @ x0 + b1)
    branch = w2 @ identity + b2
    total = branch + identity
    pooled = pool @ pos(total)
    y = w3 @ pooled + b3
    relevance = rule_epsilon(w3, b3, pooled, np.eye(4)[1] * y)
    relevance = by_contributions(pool * pos(total), pool @ pos(total), relevance)  # the pool: contributions
    share = relevance / stabilized(total)  # the sum: in proportion to the terms
    relevance = share * identity + rule_zplus(w2, b2, identity, share * branch)
    expected = rule_zplus(w1, b1, x0, relevance)
    explanation = lrp(model, x, 1, "epsilon_plus")
    np.testing.assert_allclose(explanation.attributions[0, 0].flatten().numpy(), expected, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ 2. each composite equals zennit


def randomised_batchnorm(model: nn.Module) -> nn.Module:
    """Random BatchNorm statistics and affine parameters (so that folding matters), and eps = 0: zennit's folded
    BatchNorm then computes the identity. (With eps > 0 it computes x / √(1 + eps): zennit explains a model whose
    folded BatchNorms all scale by (1 + eps)^-½, which differs from the model by ~1e-4 after resnet18's 20 of them.)"""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                count = module.num_features
                module.running_mean.copy_(torch.randn(count, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(count, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.rand(count, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(count, generator=generator) * 0.2)
                module.eps = 0.0
    return model.eval()


@pytest.fixture(scope="module")
def torchvision_models():
    torch.manual_seed(0)
    return {name: randomised_batchnorm(torchvision.models.get_model(name, weights=None))
            for name in ("vgg11_bn", "resnet18")}


def zennit_relevance(model: nn.Module, composite: str, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    from zennit import composites
    from zennit.attribution import Gradient
    from zennit.torchvision import ResNetCanonizer, VGGCanonizer

    canonizer = ResNetCanonizer() if isinstance(model, torchvision.models.ResNet) else VGGCanonizer()
    name = "".join(part.capitalize() for part in composite.split("_"))
    options = {"low": LOW, "high": HIGH} if composite == "epsilon_gamma_box" else {}
    chosen = getattr(composites, name)(canonizers=[canonizer], **options)
    with Gradient(model, chosen) as attributor:
        _, relevance = attributor(x, lambda output: F.one_hot(torch.tensor(targets), output.shape[1]) * output)
    return relevance


@pytest.mark.parametrize("name", ["vgg11_bn", "resnet18"])
@pytest.mark.parametrize("composite", ["epsilon_gamma_box", "epsilon_plus", "epsilon_alpha2_beta1"])
def test_each_composite_equals_zennit_on_torchvision_models(torchvision_models, name, composite):
    pytest.importorskip("zennit")
    model = torchvision_models[name]
    torch.manual_seed(2)
    x = torch.randn(3, 3, 32, 32).clamp(-1.8, 2.2)
    targets = [1, 5, 7]
    ours = lrp(model, x, targets, composite, low=LOW, high=HIGH).attributions[:, 0]
    theirs = zennit_relevance(model, composite, x, targets)
    relative = (ours - theirs).abs().flatten(1).amax(1) / theirs.abs().flatten(1).amax(1)
    assert relative.max() <= 1e-4, relative


# ------------------------------------------------------------------ 3. conservation


class BiasFree(nn.Module):
    """Convolutions and a linear layer without bias, a residual sum, max and average pooling, functional ReLUs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.head = nn.Linear(6, 4, bias=False)

    def forward(self, x):
        features = F.max_pool2d(F.relu(self.conv1(x)), 2)
        features = F.relu(features + self.conv2(features))
        return self.head(F.adaptive_avg_pool2d(features, 1).flatten(1))


@pytest.mark.parametrize("composite", COMPOSITES)
def test_without_biases_relevance_is_conserved_layer_by_layer(composite):
    """z^B, z⁺, α2β1, γ, flat, the proportional sum and average pool conserve relevance exactly (up to their 1e-6
    stabiliser); ε loses ε / (|z| + ε) of each output's relevance. So with no biases every layer passes on what it
    received, and the input relevance sums to the score, to float32 rounding."""
    torch.manual_seed(0)
    model = BiasFree().eval()
    x = torch.randn(2, 3, 8, 8).clamp(-1.5, 1.5)
    diagnostics = lrp(model, x, [[0, 3], [1, 2]], composite).diagnostics
    received, sent = diagnostics["layer_output_relevance"], diagnostics["layer_input_relevance"]
    assert diagnostics["layers"] == ["conv1: conv2d", "conv2: conv2d", "model: add", "model: adaptive_avg_pool2d",
                                     "head: linear"]
    torch.testing.assert_close(sent, received, rtol=1e-5, atol=1e-6)
    scale = diagnostics["output_relevance"].abs()
    assert (diagnostics["conservation_error"].abs() <= 1e-5 * scale + 1e-6).all()


def test_with_biases_the_relevance_lost_is_what_each_layers_rule_absorbed():
    """Biases (and folded BatchNorm shifts) take a share of the relevance: the overall conservation error is the
    sum of what the layers' rules absorbed, and the ε rule keeps all relevance but the bias's share."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16).clamp(-1.8, 2.2)
    for composite in COMPOSITES:
        diagnostics = lrp(model, x, [1, 3], composite).diagnostics
        absorbed = (diagnostics["layer_input_relevance"] - diagnostics["layer_output_relevance"]).sum(dim=2)
        torch.testing.assert_close(diagnostics["conservation_error"].double(), absorbed, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(diagnostics["output_relevance"], diagnostics["relevance_sum"]
                                   - diagnostics["conservation_error"])


# ------------------------------------------------------------------ 4. the model as found


def versions(model: nn.Module) -> dict[str, int]:
    """Every parameter's and buffer's version counter: it moves on any write, even one undone afterwards."""
    return {name: tensor._version for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


class InPlaceResidual(nn.Module):
    """A residual block with BatchNorm and torchvision's in-place ``out += identity``, partly frozen."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        identity = self.stem(x)
        out = self.bn(self.conv(identity))
        out += identity
        return self.head(self.dropout(F.relu(out).mean(dim=(2, 3))))


@pytest.mark.parametrize("make", [SmallCNN, InPlaceResidual])
def test_the_model_is_bit_identical_afterwards_also_after_a_call_that_raises(make):
    torch.manual_seed(0)
    model = make().train()
    model.head.weight.requires_grad_(False)
    before, written = model_state(model), versions(model)
    explainer = LRP(model)

    def target_that_raises(output):
        raise KeyError("the user's target failed")

    x = torch.randn(2, 3, 16, 16).clamp(-1.8, 2.2)
    for inputs, target in [(x, [0, 99]), (torch.randn(1, 5, 16, 16), None), (x, target_that_raises)]:
        with pytest.raises((ValueError, RuntimeError, KeyError)):
            explainer.explain(inputs, target=target)
        assert_state_equal(before, model_state(model))
    explanation = explainer.explain(x, target=[1, 2])
    assert torch.isfinite(explanation.attributions).all()
    assert_state_equal(before, model_state(model))
    assert versions(model) == written, "a parameter or buffer was written"
    assert not torch._C._is_torch_function_mode_enabled()


# ------------------------------------------------------------------ what else holds


def test_functional_relus_pass_relevance_as_modules_do():
    torch.manual_seed(0)
    modules = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 36, 3)).eval()

    class Functional(nn.Module):
        def forward(self, x):
            return modules[3](torch.relu_(modules[0](x)).flatten(1))

    x = torch.randn(2, 3, 8, 8).clamp(-1.5, 1.5)
    torch.testing.assert_close(lrp(Functional(), x, [0, 2]).attributions, lrp(modules, x, [0, 2]).attributions)


def test_k_targets_per_image_equal_one_call_per_target():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16).clamp(-1.5, 1.5)
    both = lrp(model, x, [[1, 3], [0, 2]]).attributions
    for k in range(2):
        torch.testing.assert_close(both[:, k], lrp(model, x, [[1, 3][k], [0, 2][k]]).attributions[:, 0])


class Scaled(nn.Module):
    """A product of two tensors that both depend on the input, neither a sigmoid gate (which LRP holds constant)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.scale = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        features = torch.relu(self.conv(x))
        weights = torch.tanh(self.scale(features.mean(dim=(2, 3))))
        return self.head((features * weights[:, :, None, None]).mean(dim=(2, 3)))


def test_a_function_without_an_lrp_rule_gets_a_warning_naming_it_and_its_module():
    x = torch.randn(1, 3, 8, 8).clamp(-1.5, 1.5)
    with pytest.warns(RuntimeWarning, match=r"no rule for model: mul on the input's path.*not LRP"):
        explanation = lrp(Scaled().eval(), x, 0)
    assert explanation.diagnostics["unruled"] == ["model: mul"]
    softmax_model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(72, 3), nn.Softmax(dim=1)).eval()
    with pytest.warns(RuntimeWarning, match=r"no rule for 3: softmax"):
        lrp(softmax_model, x, 0)


def test_an_input_outside_the_box_gets_a_warning_and_one_inside_none():
    model = SmallCNN().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp(model, torch.rand(1, 3, 16, 16) * (HIGH - LOW) + LOW, 0)
    with pytest.warns(RuntimeWarning, match=r"outside the box \[low, high\].*low= and high="):
        lrp(model, torch.full((1, 3, 16, 16), 5.0), 0)


def test_densenet_runs_with_batchnorms_after_concatenations_passing_relevance():
    """DenseNet: each dense layer's second BatchNorm reads conv1's output and is folded into it; the BatchNorms
    that read a concatenation pass relevance unchanged; the concatenation routes each channel's relevance back to
    the layer that made it. Every function has a rule, and the relevance lost is what the layers absorbed."""
    torch.manual_seed(0)
    model = torchvision.models.densenet121(weights=None).eval()
    x = torch.randn(1, 3, 32, 32).clamp(-1.8, 2.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diagnostics = lrp(model, x, 3, "epsilon_plus").diagnostics
    absorbed = (diagnostics["layer_input_relevance"] - diagnostics["layer_output_relevance"]).sum(dim=2)
    torch.testing.assert_close(diagnostics["conservation_error"].double(), absorbed, rtol=1e-3, atol=1e-4)


def test_composite_names_and_box_errors():
    model = SmallCNN().eval()
    assert LRP(model, "EpsilonGammaBox").composite.name == "epsilon_gamma_box"
    assert LRP(model, "epsilon-alpha2-beta1-flat").composite.name == "epsilon_alpha2_beta1_flat"
    with pytest.raises(ValueError, match="unknown composite 'gamma'.*epsilon_plus"):
        LRP(model, "gamma")
    with pytest.raises(ValueError, match="needs the box.*low= and high="):
        LRP(model, preprocess=lambda image: image)
    LRP(model, "epsilon_plus", preprocess=lambda image: image)  # no z^B rule, no box needed
    with pytest.raises(ModelInputError, match="fits neither the channels"):
        LRP(model, low=[0.0, 0.0], high=[1.0, 1.0]).explain(torch.rand(1, 3, 16, 16))
