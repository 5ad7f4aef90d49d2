"""Layer Integrated Gradients and Layer Conductance: closed forms on a linear-then-ReLU network, a slow
per-step loop written here, Captum 0.9's LayerIntegratedGradients / LayerConductance, completeness,
batches, token layouts and the model left as found."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import SmallCNN, SmallViT, assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.layer_attribution import LayerConductance, LayerIntegratedGradients

pytestmark = [pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients"),
              pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU")]  # Captum's notices

METHODS = [LayerIntegratedGradients, LayerConductance]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours − theirs| / max |theirs|."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def with_random_biases(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BatchNorm statistics and affine parameters, and random biases: torchvision's initial
    values (zero biases, BatchNorm the identity) make a ReLU network positively homogeneous, so that
    from a zero baseline the gradient is constant along the path and every rule is exact."""
    generator = torch.Generator().manual_seed(seed)

    def draw(tensor, low, high):
        tensor.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                draw(module.running_mean, -0.3, 0.3), draw(module.running_var, 0.5, 2.0)
                draw(module.weight, 0.5, 1.5), draw(module.bias, -0.3, 0.3)
            elif isinstance(module, (nn.Conv2d, nn.Linear)) and module.bias is not None:
                draw(module.bias, -0.1, 0.1)
    return model.eval()


# ------------------------------------------------------------------ closed forms by hand


class LinearReLUNet(nn.Module):
    """x → 1×1 convolution (linear per pixel) → in-place ReLU → mean over pixels → linear head.

    At ``relu`` the head is linear: ∂y_k/∂A_c = V[k, c] / P (P pixels), the same at every point, so
    both methods give V[k, c] / P · (A_c(end) − A_c(start)) exactly. At ``linear`` (before the ReLU)
    the layer is affine in x, so the input path and the layer path coincide: A(α) = A' + α (A − A'),
    and ∂y_k/∂A_c(α) = V[k, c] / P · 1[A_c(α) > 0]."""

    def __init__(self, channels: int = 4, classes: int = 3):
        super().__init__()
        self.linear = nn.Conv2d(3, channels, 1)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.relu(self.linear(x)).mean(dim=(2, 3)))


def tiny_case():
    torch.manual_seed(0)
    model = LinearReLUNet().eval()
    x, baseline = torch.randn(2, 3, 6, 6), 0.5 * torch.randn(3, 6, 6)
    targets = [[0, 2], [1, 0]]
    with torch.no_grad():
        pre, pre_baseline = model.linear(x), model.linear(baseline[None])  # (N, C, h, w), (1, C, h, w)
    head = torch.stack([model.head.weight[row] for row in targets]).detach() / 36  # (N, K, C) = V[k, c] / P
    return model, x, baseline, targets, pre, pre_baseline, head[..., None, None]


def test_after_the_relu_both_methods_are_the_head_weight_times_the_change_exactly():
    model, x, baseline, targets, pre, pre_baseline, head = tiny_case()
    expected = head * (F.relu(pre) - F.relu(pre_baseline))[:, None]  # (N, K, C, h, w)
    for method in METHODS:
        explanation = method(model, "relu", baseline=baseline, steps=3, normalize=None).explain(x, target=targets)
        torch.testing.assert_close(explanation.attributions, expected, rtol=1e-5, atol=1e-7)
        assert explanation.diagnostics["completeness_error"].abs().max() < 1e-5
        # the map: the signed sum over channels, ReLU'd as the CAMs do, upsampled (here 6×6 already)
        torch.testing.assert_close(explanation.raw_maps, F.relu(expected.sum(2)))
        torch.testing.assert_close(explanation.low_res_maps[0], F.relu(expected.sum(2)))
        signed = method(model, "relu", baseline=baseline, steps=3, relu=False, normalize=None).explain(
            x, target=targets)
        torch.testing.assert_close(signed.raw_maps, expected.sum(2))
    # conductance with Gauss-Legendre points: the path runs from x(α_0) to x(α_3), not from x' to x
    alphas = (np.polynomial.legendre.leggauss(4)[0] + 1) / 2
    with torch.no_grad():
        ends = [model.linear(baseline + float(alpha) * (x - baseline)) for alpha in (alphas[0], alphas[-1])]
    conductance = LayerConductance(model, "relu", baseline=baseline, steps=3, rule="gausslegendre").explain(
        x, target=targets)
    torch.testing.assert_close(conductance.attributions, head * (F.relu(ends[1]) - F.relu(ends[0]))[:, None],
                               rtol=1e-5, atol=1e-7)


def test_before_the_relu_the_sums_count_the_path_points_where_the_unit_is_positive():
    model, x, baseline, targets, pre, pre_baseline, head = tiny_case()
    change = (pre - pre_baseline)[:, None]
    steps = 16
    midpoints = (torch.arange(steps) + 0.5) / steps  # Layer IG, midpoint rule: mean of the indicator
    on_path = torch.stack([(pre_baseline + alpha * (pre - pre_baseline) > 0).float() for alpha in midpoints])
    expected_ig = head * change * on_path.mean(0)[:, None]
    ig = LayerIntegratedGradients(model, "linear", baseline=baseline, steps=steps).explain(x, target=targets)
    torch.testing.assert_close(ig.attributions, expected_ig, rtol=1e-5, atol=1e-7)
    left_points = torch.arange(steps) / steps  # conductance, evenly spaced points: the left sum
    on_path = torch.stack([(pre_baseline + alpha * (pre - pre_baseline) > 0).float() for alpha in left_points])
    expected_conductance = head * change * on_path.mean(0)[:, None]
    conductance = LayerConductance(model, "linear", baseline=baseline, steps=steps).explain(x, target=targets)
    torch.testing.assert_close(conductance.attributions, expected_conductance, rtol=1e-5, atol=1e-7)
    # both tend to the continuous closed form V[k, c] / P · (ReLU(A) − ReLU(A')), within one step
    limit = head * (F.relu(pre) - F.relu(pre_baseline))[:, None]
    for explanation in (ig, conductance):
        assert ((explanation.attributions - limit).abs() <= (head * change).abs() / steps + 1e-6).all()


# ------------------------------------------------------------------ a slow per-step loop


def sequential_cnn() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    ).eval()


def slow_layer_ig(prefix, suffix, x, baseline, targets, alphas, weights):
    """Per image, target and step: the suffix on the interpolated layer output, one gradient each."""
    result = []
    for image, row in enumerate(targets):
        with torch.no_grad():
            end, start = prefix(x[image : image + 1]), prefix(baseline[None])
        per_target = []
        for target in row:
            integral = torch.zeros_like(end)
            for alpha, weight in zip(alphas, weights):
                point = (start + float(alpha) * (end - start)).requires_grad_(True)
                (gradient,) = torch.autograd.grad(suffix(point.clone())[0, target], point)  # in-place ReLU next
                integral += float(weight) * gradient
            per_target.append(integral * (end - start))
        result.append(torch.cat(per_target))
    return torch.stack(result)


def slow_conductance(prefix, suffix, x, baseline, targets, alphas):
    """Per image, target and point: the layer's output on the input path and the gradient there."""
    result = []
    for image, row in enumerate(targets):
        per_target = []
        for target in row:
            outputs, gradients = [], []
            for alpha in alphas:
                with torch.no_grad():
                    layer = prefix(baseline[None] + float(alpha) * (x[image : image + 1] - baseline[None]))
                layer.requires_grad_(True)
                (gradient,) = torch.autograd.grad(suffix(layer.clone())[0, target], layer)
                outputs.append(layer.detach())
                gradients.append(gradient)
            per_target.append(sum(gradients[i] * (outputs[i + 1] - outputs[i]) for i in range(len(alphas) - 1)))
        result.append(torch.cat(per_target))
    return torch.stack(result)


@pytest.mark.parametrize("rule", ["gausslegendre", "left", "trapezoid"])
def test_equal_to_a_slow_loop_over_images_targets_and_steps(rule):
    model = sequential_cnn()
    prefix, suffix = model[:3], model[3:]
    x, baseline, targets = torch.randn(3, 3, 8, 8), torch.randn(3, 8, 8) * 0.3, [[0, 3], [2, 2], [1, 0]]
    steps = 5
    options = dict(baseline=baseline, steps=steps, rule=rule, batch_size=4, normalize=None)  # chunks split images
    ig = LayerIntegratedGradients(model, "2", **options).explain(x, target=targets)
    alphas, weights = explain.methods.gradients.integration_nodes(steps, rule)
    torch.testing.assert_close(ig.attributions, slow_layer_ig(prefix, suffix, x, baseline, targets, alphas, weights),
                               rtol=1e-4, atol=1e-6)
    conductance = LayerConductance(model, "2", **options).explain(x, target=targets)
    alphas, _ = explain.methods.gradients.integration_nodes(steps + 1, rule)
    torch.testing.assert_close(conductance.attributions, slow_conductance(prefix, suffix, x, baseline, targets, alphas),
                               rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ Captum 0.9


def captum_reference(captum, method, model, layer, x, baseline, targets, steps, rule):
    """Captum's per-unit attributions, one call per target column: (N, K, ...)."""
    peer = {LayerIntegratedGradients: captum.LayerIntegratedGradients, LayerConductance: captum.LayerConductance}
    columns = [peer[method](model, layer).attribute(x, baselines=baseline.expand_as(x),
                                                   target=[row[k] for row in targets], n_steps=steps, method=rule)
               for k in range(len(targets[0]))]
    return torch.stack(columns, dim=1).detach()


@pytest.fixture(scope="module")
def peer_models():
    torch.manual_seed(0)
    resnet = with_random_biases(torchvision.models.resnet18(num_classes=10))
    vgg = with_random_biases(torchvision.models.vgg11(num_classes=10))
    return {"resnet18": (resnet, "layer3", 64), "vgg11": (vgg, "features.12", 32)}


CAPTUM_CASES = [  # (method, our rule, Captum's name for it): Captum's default, and each method's default
    (LayerIntegratedGradients, "gausslegendre", "gausslegendre"),
    (LayerIntegratedGradients, "midpoint", "riemann_middle"),
    (LayerConductance, "gausslegendre", "gausslegendre"),
    (LayerConductance, "trapezoid", "riemann_trapezoid"),
]


@pytest.mark.parametrize("method, rule, captum_rule", CAPTUM_CASES, ids=lambda value: getattr(value, "name", value))
@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_per_unit_attributions_equal_captum(name, method, rule, captum_rule, peer_models):
    """A batch of 3 images, 2 different targets each, a random baseline: relative error ≤ 1e-4
    (measured in float64: below 1e-12; in float32 conductance's differences of consecutive layer
    outputs cancel, and either side's rounding moves it by up to 3e-3, tests/test_memory_format.py)."""
    captum = pytest.importorskip("captum.attr")
    model, layer, size = peer_models[name]
    model = copy.deepcopy(model).double()
    torch.manual_seed(2)
    x, baseline = torch.randn(3, 3, size, size).double(), 0.3 * torch.randn(3, size, size).double()
    targets = [[1, 4], [7, 2], [3, 3]]
    before = model_state(model)
    ours = method(model, layer, baseline=baseline, steps=8, rule=rule).explain(x, target=targets)
    assert_state_equal(before, model_state(model))
    theirs = captum_reference(captum, method, model, dict(model.named_modules())[layer], x, baseline, targets, 8,
                              captum_rule)
    assert ours.attributions.shape == theirs.shape
    assert relative_error(ours.attributions, theirs) <= 1e-4


def test_captums_trapezoid_layer_ig_is_ours_times_the_sum_of_its_weights(peer_models):
    """Captum's "riemann_trapezoid" gives the end points 1/(2n) and the others 1/n: its weights sum
    to (n − 1)/n, not 1, so its Layer IG is ours times that factor (ours: the trapezoid rule)."""
    captum = pytest.importorskip("captum.attr")
    model, layer, size = peer_models["resnet18"]
    torch.manual_seed(3)
    x, baseline, targets, steps = torch.randn(2, 3, size, size), torch.zeros(3, size, size), [[5], [6]], 6
    ours = LayerIntegratedGradients(model, layer, baseline=baseline, steps=steps, rule="trapezoid").explain(
        x, target=targets)
    theirs = captum_reference(captum, LayerIntegratedGradients, model, model.layer3, x, baseline, targets, steps,
                              "riemann_trapezoid")
    assert relative_error(ours.attributions * (steps - 1) / steps, theirs) <= 1e-4


def test_token_layouts_read_like_the_cams_and_equal_captum():
    """A ViT block's output (N, 1 + 16, D): the class token is dropped from the maps and per-unit
    attributions (laid out on the 4 × 4 patch grid), and counted in the completeness."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = SmallViT().eval()
    x, targets = torch.randn(2, 3, 16, 16), [[1, 3], [0, 4]]
    for method in METHODS:
        ours = method(model, "encoder.layers.0", steps=8, rule="gausslegendre").explain(x, target=targets)
        theirs = captum_reference(captum, method, model, model.encoder.layers[0], x, torch.zeros(3, 16, 16), targets,
                                  8, "gausslegendre")  # (N, K, 17, 16)
        assert ours.attributions.shape == (2, 2, 16, 4, 4) and ours.maps.shape == (2, 2, 16, 16)
        patches = theirs[:, :, 1:].reshape(2, 2, 4, 4, 16).permute(0, 1, 4, 2, 3)
        assert relative_error(ours.attributions, patches) <= 1e-4
        captum_completeness = theirs.sum(dim=(2, 3)).double() - ours.diagnostics["score_change"].double()
        torch.testing.assert_close(ours.diagnostics["completeness_error"].double(), captum_completeness,
                                   rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ completeness


def test_completeness_within_a_stated_tolerance_and_shrinking_with_the_steps():
    """Σ over units = y(x) − y(x') up to the path sum's error, on the shipped demo model (trained) at
    layer3, two shapes, their top-2 classes, from a blurred baseline: Layer IG within 1 % of
    |y(x) − y(x')| at 32 midpoint steps (measured: 0.14 %); conductance, a left sum, within 10 % at
    64 steps (measured: 5.2 %), its error shrinking like 1 / steps (×4 steps: error × 0.26)."""
    from explain.data import make_dataset
    from explain.models import load_demo_model

    model, images = load_demo_model(), list(make_dataset(2, seed=5).images)

    def relative_completeness_error(method, steps):
        explanation = method(model, "layer3", baseline="blur", steps=steps, batch_size=64).explain(images, topk=2)
        change, error = explanation.diagnostics["score_change"], explanation.diagnostics["completeness_error"]
        summed = explanation.attributions.double().sum(dim=(2, 3, 4))  # layer3: channels first, every unit
        torch.testing.assert_close(summed - change.double(), error.double(), rtol=1e-4, atol=1e-5)
        return (error.abs() / change.abs()).max().item()

    assert relative_completeness_error(LayerIntegratedGradients, 32) <= 0.01
    coarse, fine = (relative_completeness_error(LayerConductance, steps) for steps in (16, 64))
    assert fine <= 0.10 and fine <= 0.4 * coarse, (coarse, fine)


def test_a_hidden_unit_after_the_layer_is_explained_completely():
    torch.manual_seed(0)
    model = with_random_biases(SmallCNN())
    x = torch.randn(2, 3, 16, 16)
    unit = explain.Channel("features.7", [0, 3])  # BatchNorm output: never dead
    for method in METHODS:
        explanation = method(model, "features.3", steps=64).explain(x, target=unit)
        relative = explanation.diagnostics["completeness_error"].abs() / explanation.diagnostics["score_change"].abs()
        assert explanation.maps.shape == (2, 2, 16, 16) and (relative <= 0.02).all(), (method.name, relative)


# ------------------------------------------------------------------ batches, state, cost


@pytest.mark.parametrize("method", METHODS, ids=lambda cls: cls.name)
def test_a_batch_equals_each_image_alone_and_the_model_is_left_exactly_as_found(method):
    torch.manual_seed(0)
    model = with_random_biases(SmallCNN())
    model.train()
    model.features[0].eval()
    model.head.weight.requires_grad_(False)
    before = model_state(model)
    x, targets = torch.randn(3, 3, 16, 16), [[1, 2], [0, 4], [3, 3]]
    explainer = method(model, "features.3", steps=6, batch_size=5, normalize=None)  # chunks cross images
    batch = explainer.explain(x, target=targets)
    assert_state_equal(before, model_state(model))
    for image in range(3):
        alone = explainer.explain(x[image : image + 1], target=[targets[image]])
        torch.testing.assert_close(batch.attributions[image : image + 1], alone.attributions, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(batch.raw_maps[image : image + 1], alone.raw_maps, rtol=1e-5, atol=1e-7)
        for key in ("completeness_error", "score_change"):
            torch.testing.assert_close(batch.diagnostics[key][image : image + 1], alone.diagnostics[key],
                                       rtol=1e-4, atol=1e-6)
    assert_state_equal(before, model_state(model))
    with torch.no_grad():  # a caller's no_grad() changes nothing
        torch.testing.assert_close(explainer.explain(x, target=targets).attributions, batch.attributions)
    assert_state_equal(before, model_state(model))


class Conditioned(nn.Module):
    """An image and a per-image condition that scales the feature maps after ``conv`` (it bypasses the layer)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, condition, image):
        return self.head(torch.tanh(self.conv(image) * condition[:, :, None, None]).mean(dim=(2, 3)))


@pytest.mark.parametrize("method", METHODS, ids=lambda cls: cls.name)
def test_a_model_with_a_second_input_gets_each_images_own_rows_on_the_path(method):
    torch.manual_seed(0)
    model = Conditioned().eval()
    images, conditions = torch.randn(2, 3, 8, 8), torch.rand(2, 4) + 0.5
    explainer = method(model, "conv", steps=5, batch_size=4)
    both = explainer.explain(images, target=[0, 2], forward_args=(conditions,), input_position=1, per_image=[0])
    for image in range(2):
        alone = explainer.explain(images[image : image + 1], target=[0, 2][image],
                                  forward_args=(conditions[image : image + 1],), input_position=1, per_image=[0])
        torch.testing.assert_close(both.attributions[image : image + 1], alone.attributions, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", METHODS, ids=lambda cls: cls.name)
def test_no_parameter_gradient_and_no_graph_before_the_layer(method):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    seen = {"layer2": [], "layer4": []}

    def record(name):
        return lambda module, args, output: seen[name].append((torch.is_grad_enabled(), output.requires_grad))

    handles = [model.layer2.register_forward_hook(record("layer2")),
               model.layer4.register_forward_hook(record("layer4"))]
    try:
        method(model, "layer3", steps=4, batch_size=3).explain(torch.randn(2, 3, 32, 32), target=[1, 2])
    finally:
        for handle in handles:
            handle.remove()
    assert all(parameter.grad is None for parameter in model.parameters())
    assert len(seen["layer2"]) == len(seen["layer4"]) >= 2 + 3  # x, x', then one pass per chunk of path points
    assert all(not grad and not requires_grad for grad, requires_grad in seen["layer2"])
    assert seen["layer4"][:2] == [(False, False)] * 2  # the forwards of x and x' build no graph at all
    assert all(grad and requires_grad for grad, requires_grad in seen["layer4"][2:])


# ------------------------------------------------------------------ registry, defaults, errors


def test_registered_with_a_layer_chosen_like_the_cams_and_clear_errors():
    assert explain.get_method("layer-integrated-gradients") is LayerIntegratedGradients
    assert explain.get_method("layer_conductance") is LayerConductance
    assert LayerIntegratedGradients.needs_layer and LayerConductance.needs_layer
    torch.manual_seed(0)
    model = SmallCNN().eval()
    explanation = LayerConductance(model).explain(torch.randn(1, 3, 16, 16))  # layer None: the CAMs' default
    assert explanation.layer == explain.GradCAM(model).explain(torch.randn(1, 3, 16, 16)).layer
    with pytest.raises(ValueError, match="one layer"):
        LayerIntegratedGradients(model, "features.*")
    with pytest.raises(ValueError, match="steps"):
        LayerConductance(model, "features.3", steps=0)
    with pytest.raises(ValueError, match="rule"):
        LayerIntegratedGradients(model, "features.3", rule="simpson")
    with pytest.raises(explain.LayerNotFoundError):
        LayerConductance(model, "features.99")
    resnet = torchvision.models.resnet18(num_classes=3).eval()
    with pytest.raises(explain.LayerNotRunError, match="more than once"):
        LayerIntegratedGradients(resnet, "layer1.0.relu", steps=2).explain(torch.randn(1, 3, 32, 32))
