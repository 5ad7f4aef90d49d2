"""Gradient and guided methods against independent computations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import SmallCNN, assert_state_equal, model_state
from torch import nn

import explain
from explain.data import load_demo_model, make_dataset
from explain.methods.gradients import integration_nodes, reduce_channels


class SmoothNet(nn.Module):
    """A tiny smooth network (tanh), in float64, where finite differences are accurate."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def finite_difference_gradient(model, x: torch.Tensor, index: int, target: int, step: float = 1e-6) -> torch.Tensor:
    gradient = torch.zeros_like(x[index])
    with torch.no_grad():
        for position in range(x[index].numel()):
            delta = torch.zeros(x[index].numel(), dtype=x.dtype)
            delta[position] = step
            delta = delta.view_as(x[index])
            up = model((x[index] + delta)[None])[0, target]
            down = model((x[index] - delta)[None])[0, target]
            gradient.view(-1)[position] = (up - down) / (2 * step)
    return gradient


@pytest.fixture
def smooth_case():
    torch.manual_seed(0)
    model = SmoothNet().double().eval()
    return model, torch.randn(2, 3, 5, 5, dtype=torch.float64), [2, 0]


def test_saliency_equals_finite_differences_and_torch_func(smooth_case):
    model, x, classes = smooth_case
    result = explain.Saliency(model, normalize=None).explain(x, target=classes)
    for n, c in enumerate(classes):
        expected = finite_difference_gradient(model, x, n, c)
        torch.testing.assert_close(result.attributions[n, 0], expected, rtol=1e-6, atol=1e-9)
        jacobian = torch.func.jacrev(lambda image, c=c: model(image[None])[0, c])(x[n])
        torch.testing.assert_close(result.attributions[n, 0], jacobian)
        torch.testing.assert_close(result.raw_maps[n], expected.abs().amax(0).float())


def test_input_x_gradient_and_channel_reductions(smooth_case):
    model, x, classes = smooth_case
    result = explain.InputXGradient(model, normalize=None, reduce="sum").explain(x, target=classes)
    for n, c in enumerate(classes):
        expected = x[n] * finite_difference_gradient(model, x, n, c)
        torch.testing.assert_close(result.attributions[n, 0], expected, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(result.raw_maps[n], expected.sum(0).float(), rtol=1e-5, atol=1e-7)
    absolute = explain.InputXGradient(model, normalize=None, reduce="sumabs").explain(x, target=classes)
    torch.testing.assert_close(absolute.raw_maps, result.attributions[:, 0].abs().sum(1).float())
    with pytest.raises(ValueError, match="reduce must be one of"):
        explain.Saliency(model, reduce="mean")


@pytest.mark.parametrize("rule", ["gausslegendre", "midpoint"])
def test_integrated_gradients_is_complete_within_one_percent_with_64_steps(rule):
    """On the shipped (trained) small CNN, where the explained logit moves by several units."""
    model = load_demo_model()
    images = list(make_dataset(4, seed=3).images)
    result = explain.IntegratedGradients(model, steps=64, rule=rule, batch_size=64).explain(images)
    error = result.diagnostics["completeness_error"].abs()
    change = result.diagnostics["score_change"].abs()
    assert (change > 1).all()
    assert (error <= 0.01 * change).all(), f"completeness error {error.flatten()} for score change {change.flatten()}"
    with torch.no_grad():
        zero_baseline_scores = model(torch.zeros(1, 3, 64, 64))[0, result.targets]
    torch.testing.assert_close(result.diagnostics["score_change"][:, 0], result.scores[:, 0] - zero_baseline_scores)


def test_integrated_gradients_equals_a_slow_riemann_sum():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    baseline = torch.full((1, 3, 8, 8), 0.5)
    steps, classes = 8, [1, 2]
    result = explain.IntegratedGradients(model, baseline=baseline, steps=steps, rule="midpoint", batch_size=5)
    attributions = result.explain(x, target=classes).attributions[:, 0]
    for n, c in enumerate(classes):
        total = torch.zeros(3, 8, 8)
        for i in range(steps):  # midpoints of [0, 1]
            point = (baseline[0] + (i + 0.5) / steps * (x[n] - baseline[0])).requires_grad_(True)
            (gradient,) = torch.autograd.grad(model(point[None])[0, c], point)
            total += gradient / steps
        torch.testing.assert_close(attributions[n], (x[n] - baseline[0]) * total, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rule, exact_degree", [("left", 0), ("right", 0), ("midpoint", 1), ("trapezoid", 1),
                                                 ("gausslegendre", 7)])
def test_integration_rules_are_exact_for_the_polynomials_they_should_be(rule, exact_degree):
    """With 4 points: Riemann left/right sums integrate constants exactly, midpoint and trapezoid
    linear functions, Gauss-Legendre polynomials up to degree 2·4 − 1."""
    points, weights = integration_nodes(4, rule)
    assert abs(weights.sum() - 1) < 1e-12 and ((0 <= points) & (points <= 1)).all()
    for degree in range(exact_degree + 1):
        assert abs((weights * points**degree).sum() - 1 / (degree + 1)) < 1e-12, degree
    assert abs((weights * points ** (exact_degree + 1)).sum() - 1 / (exact_degree + 2)) > 1e-6
    assert integration_nodes(4, "riemann_trapezoid")[0].tolist() == integration_nodes(4, "trapezoid")[0].tolist()


@pytest.mark.parametrize("rule", ["left", "right", "trapezoid", "gausslegendre"])
def test_integrated_gradients_with_each_rule_equals_the_weighted_sum_of_gradients_by_hand(rule):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    classes, steps = [1, 2], 5
    attributions = explain.IntegratedGradients(model, steps=steps, rule=rule, batch_size=3).explain(
        x, target=classes).attributions[:, 0]
    points, weights = integration_nodes(steps, rule)
    for n, c in enumerate(classes):
        total = torch.zeros(3, 8, 8, dtype=torch.float64)
        for alpha, weight in zip(points, weights):
            point = (float(alpha) * x[n]).requires_grad_(True)
            (gradient,) = torch.autograd.grad(model(point[None])[0, c], point)
            total += weight * gradient.double()
        torch.testing.assert_close(attributions[n], (x[n].double() * total).float(), rtol=1e-4, atol=1e-6)


def test_integrated_gradients_doubles_its_steps_until_complete_within_the_tolerance():
    model = load_demo_model()
    images = list(make_dataset(3, seed=4).images)
    coarse = explain.IntegratedGradients(model, steps=2, rule="midpoint").explain(images)
    relative = lambda result: (result.diagnostics["completeness_error"].abs()  # noqa: E731
                               / result.diagnostics["score_change"].abs())
    assert relative(coarse).amax() > 0.01
    adaptive = explain.IntegratedGradients(model, steps=2, rule="midpoint", tolerance=0.01).explain(images)
    assert relative(adaptive).amax() <= 0.01
    for image, steps in enumerate(adaptive.diagnostics["steps"].tolist()):  # each image's own steps
        assert steps >= 2 and steps & (steps - 1) == 0  # a power of two times the first
        fixed = explain.IntegratedGradients(model, steps=steps, rule="midpoint").explain(images[image : image + 1])
        torch.testing.assert_close(adaptive.attributions[image : image + 1], fixed.attributions)
    capped = explain.IntegratedGradients(model, steps=2, tolerance=1e-9, max_steps=8).explain(images)
    assert capped.diagnostics["steps"].tolist() == [8] * len(images)


def test_integrated_gradients_without_multiplying_by_inputs_is_the_path_integrated_gradient():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    baseline = torch.full((3, 8, 8), 0.25)
    complete = explain.IntegratedGradients(model, baseline=baseline, steps=6).explain(x, target=[0, 3])
    integral = explain.IntegratedGradients(model, baseline=baseline, steps=6, multiply_by_inputs=False).explain(
        x, target=[0, 3])
    torch.testing.assert_close((x - baseline)[:, None] * integral.attributions, complete.attributions)


def test_integrated_gradients_blurred_baseline_is_the_blurred_input():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16)
    explainer = explain.IntegratedGradients(model, baseline="blur", steps=16)
    blurred = explainer.baseline_for(x)
    assert blurred.shape == x.shape and blurred.std() < x.std() / 2
    with torch.no_grad():
        expected_change = model(x)[0, 1] - model(blurred)[0, 1]
    result = explainer.explain(x, target=1)
    torch.testing.assert_close(result.diagnostics["score_change"][0, 0], expected_change, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ guided backprop and deconvnet


class ReferenceRectifier(torch.autograd.Function):
    """Written here, independently of the toolkit: ReLU with the guided or deconvnet backward."""

    @staticmethod
    def forward(ctx, x, guided):
        ctx.guided = guided
        ctx.save_for_backward(x)
        return torch.where(x > 0, x, torch.zeros_like(x))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        passed = torch.where(grad > 0, grad, torch.zeros_like(grad))
        if ctx.guided:
            passed = torch.where(x > 0, passed, torch.zeros_like(passed))
        return passed, None


class SwappedReLU(nn.Module):
    def __init__(self, guided: bool):
        super().__init__()
        self.guided = guided

    def forward(self, x):
        return ReferenceRectifier.apply(x, self.guided)


class ReusedInplaceReLUNet(nn.Module):
    """One ``nn.ReLU(inplace=True)`` module used after three different layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.conv3 = nn.Conv2d(6, 6, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.fc(x.mean(dim=(2, 3)))


class FunctionalReLUNet(nn.Module):
    """ReLUs called as functions: F.relu, torch.relu, Tensor.relu_ and F.relu(inplace=True).
    With ``reference`` set, the same network calls the reference rectifier instead."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.conv3 = nn.Conv2d(6, 6, 3, padding=1)
        self.conv4 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)
        self.reference = None

    def forward(self, x):
        act = self.reference
        x = F.relu(self.conv1(x)) if act is None else act(self.conv1(x))
        x = torch.relu(self.conv2(x)) if act is None else act(self.conv2(x))
        y = self.conv3(x)
        if act is None:
            y.relu_()
        else:
            y = act(y)
        z = F.relu(self.conv4(y), inplace=True) if act is None else act(self.conv4(y))
        return self.fc(z.mean(dim=(2, 3)))


def reference_model(model: nn.Module, guided: bool) -> nn.Module:
    reference = copy.deepcopy(model)
    if isinstance(reference, ReusedInplaceReLUNet):
        reference.relu = SwappedReLU(guided)
    else:
        reference.reference = SwappedReLU(guided)
    return reference


def reference_gradients(model: nn.Module, x: torch.Tensor, classes: list[int]) -> torch.Tensor:
    inputs = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(inputs)[torch.arange(len(classes)), classes].sum(), inputs)
    return gradient


@pytest.mark.parametrize(
    "network", [ReusedInplaceReLUNet, FunctionalReLUNet], ids=["reused-inplace-module", "functional"]
)
@pytest.mark.parametrize("method, guided", [(explain.GuidedBackprop, True), (explain.Deconvnet, False)],
                         ids=["guided", "deconvnet"])
def test_rectified_backward_matches_a_reference_that_swaps_the_relus(network, method, guided):
    torch.manual_seed(0)
    model = network().eval()
    x = torch.randn(4, 3, 6, 6)
    classes = [0, 3, 1, 2]
    before = model_state(model)
    result = method(model, normalize=None).explain(x, target=classes)
    assert_state_equal(before, model_state(model))
    assert result.diagnostics["relu_calls"] == (3 if network is ReusedInplaceReLUNet else 4)
    expected = reference_gradients(reference_model(model, guided), x, classes)
    torch.testing.assert_close(result.attributions[:, 0], expected)
    plain = explain.Saliency(model, normalize=None).explain(x, target=classes).attributions[:, 0]
    assert not torch.allclose(result.attributions[:, 0], plain, atol=1e-4)
    torch.testing.assert_close(plain, reference_gradients(model, x, classes))  # the model itself is untouched


def test_no_module_replaced_no_mode_left_also_when_the_call_raises():
    torch.manual_seed(0)
    model = FunctionalReLUNet().train()
    before = model_state(model)
    methods = (explain.GuidedBackprop, explain.Deconvnet, explain.Saliency, explain.InputXGradient,
               explain.IntegratedGradients, explain.SmoothGrad, explain.VarGrad, explain.GuidedGradCAM)
    for method in methods:
        build = (lambda m, method=method: method(m, "conv4")) if method.needs_layer else method
        with pytest.raises(ValueError, match="out of range"):
            build(model).explain(torch.randn(2, 3, 6, 6), target=[0, 7])
        assert_state_equal(before, model_state(model))
        assert not torch._C._is_torch_function_mode_enabled()
        build(model).explain(torch.randn(2, 3, 6, 6), target=[0, 1])
        assert_state_equal(before, model_state(model))
        assert not torch._C._is_torch_function_mode_enabled()
    assert all(p.grad is None for p in model.parameters())


def test_guided_gradcam_is_guided_backprop_times_the_upsampled_cam():
    torch.manual_seed(0)
    model = ReusedInplaceReLUNet().eval()
    x = torch.randn(3, 3, 6, 6)
    classes = [1, 0, 3]
    result = explain.GuidedGradCAM(model, "conv3", normalize=None).explain(x, target=classes)
    guided = explain.GuidedBackprop(model, normalize=None).explain(x, target=classes).attributions[:, 0]
    cam = explain.GradCAM(model, "conv3", normalize=None).explain(x, target=classes).raw_maps
    torch.testing.assert_close(result.attributions[:, 0], guided * cam[:, None])
    torch.testing.assert_close(result.raw_maps, (guided * cam[:, None]).abs().amax(1))
    with_layer_cam = explain.GuidedGradCAM(model, cam=explain.LayerCAM(model, "conv2"), normalize=None)
    layer_cam = with_layer_cam.explain(x, target=classes)
    expected = guided * explain.LayerCAM(model, "conv2", normalize=None).explain(x, target=classes).raw_maps[:, None]
    torch.testing.assert_close(layer_cam.attributions[:, 0], expected)


# ------------------------------------------------------------------ SmoothGrad and VarGrad


def test_smoothgrad_of_a_cam_is_the_mean_over_seeded_noisy_copies():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    samples, noise, seed = 6, 0.2, 7
    smooth = explain.SmoothGrad(explain.GradCAM(model, "features.6", normalize=None), samples=samples, noise=noise,
                                seed=seed, batch_size=4)
    result = smooth.explain(x, target=[1, 2])
    again = explain.SmoothGrad(explain.GradCAM(model, "features.6", normalize=None), samples=samples, noise=noise,
                               seed=seed, batch_size=64).explain(x, target=[1, 2])
    torch.testing.assert_close(result.raw_maps, again.raw_maps)  # same seed, same map, whatever the batch size
    other = explain.SmoothGrad(explain.GradCAM(model, "features.6"), samples=samples, noise=noise, seed=8)
    assert not torch.allclose(other.explain(x, target=[1, 2]).maps, result.maps)
    generator = torch.Generator().manual_seed(seed)
    spread = (x.amax(dim=(1, 2, 3)) - x.amin(dim=(1, 2, 3))).view(-1, 1, 1, 1) * noise
    maps = [explain.GradCAM(model, "features.6", normalize=None).explain(
        x + torch.randn((1, *x.shape[1:]), generator=generator) * spread, target=[1, 2]).raw_maps
        for _ in range(samples)]
    torch.testing.assert_close(result.raw_maps, torch.stack(maps).mean(0), rtol=1e-4, atol=1e-6)
    variance = explain.VarGrad(explain.GradCAM(model, "features.6", normalize=None), samples=samples, noise=noise,
                               seed=seed).explain(x, target=[1, 2])
    torch.testing.assert_close(variance.raw_maps, torch.stack(maps).var(0, unbiased=False), rtol=1e-3, atol=1e-6)


def test_smoothgrad_keeps_the_clean_targets_and_without_noise_equals_the_method(smooth_case):
    model, x, _ = smooth_case
    plain = explain.Saliency(model, normalize=None).explain(x)
    smooth = explain.SmoothGrad(model, samples=3, noise=0.0, normalize=None).explain(x)
    torch.testing.assert_close(smooth.raw_maps, plain.raw_maps)
    assert torch.equal(smooth.targets, plain.targets)
    noisy = explain.SmoothGrad(model, samples=50, noise=0.5).explain(x)
    assert torch.equal(noisy.targets, plain.targets)


def noisy_copies_by_hand(x: torch.Tensor, samples: int, noise_std: float, seed: int) -> list[torch.Tensor]:
    """The noisy copies SmoothGrad draws: per sample, a standard normal of one image's shape from a
    generator seeded with ``seed`` (the same draw for every image of the batch), scaled by the noise's
    standard deviation."""
    generator = torch.Generator().manual_seed(seed)
    return [x + torch.randn((1, *x.shape[1:]), generator=generator) * noise_std for _ in range(samples)]


def test_smoothgrad_averages_the_gradients_then_reduces_the_channels_as_the_papers_do():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    classes, samples, sigma = [1, 2], 6, 0.3
    gradients = []
    for copy_ in noisy_copies_by_hand(x, samples, sigma, seed=5):
        copy_ = copy_.requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(copy_)[[0, 1], classes].sum(), copy_)
        gradients.append(gradient)
    gradients = torch.stack(gradients)  # (samples, N, C, H, W)
    options = dict(samples=samples, noise_std=sigma, seed=5, batch_size=4, normalize=None)
    smooth = explain.SmoothGrad(model, **options).explain(x, target=classes)
    torch.testing.assert_close(smooth.raw_maps, gradients.mean(0).abs().amax(1), rtol=1e-4, atol=1e-6)
    squared = explain.SmoothGradSquared(model, **options).explain(x, target=classes)
    torch.testing.assert_close(squared.raw_maps, gradients.pow(2).mean(0).amax(1), rtol=1e-4, atol=1e-7)
    variance = explain.VarGrad(model, **options).explain(x, target=classes)
    torch.testing.assert_close(variance.raw_maps, gradients.var(0, unbiased=False).amax(1), rtol=1e-3, atol=1e-7)
    per_map = explain.SmoothGrad(model, average="maps", **options).explain(x, target=classes)
    torch.testing.assert_close(per_map.raw_maps, gradients.abs().amax(2).mean(0), rtol=1e-4, atol=1e-6)
    assert (per_map.raw_maps - smooth.raw_maps).abs().amax() > 0.05 * smooth.raw_maps.amax()  # the orders differ
    relative = explain.SmoothGrad(model, samples=samples, noise=0.1, seed=5, normalize=None).explain(x, target=classes)
    spread = (x.amax(dim=(1, 2, 3)) - x.amin(dim=(1, 2, 3))) * 0.1
    by_hand = []
    for n in range(2):
        copies = noisy_copies_by_hand(x, samples, 1.0, seed=5)
        image_gradients = []
        for copy_ in copies:
            noisy = (x[n] + (copy_[n] - x[n]) * spread[n]).requires_grad_(True)
            (gradient,) = torch.autograd.grad(model(noisy[None])[0, classes[n]], noisy)
            image_gradients.append(gradient)
        by_hand.append(torch.stack(image_gradients).mean(0).abs().amax(0))
    torch.testing.assert_close(relative.raw_maps, torch.stack(by_hand), rtol=1e-4, atol=1e-6)


def test_smoothgrad_equals_captums_noise_tunnel_given_the_same_noise(monkeypatch):
    """Captum's NoiseTunnel (smoothgrad, Saliency without abs) averages the gradients of the noisy copies;
    the default SmoothGrad map is max over channels of |that mean|. Captum draws its noise with torch.normal
    (rows image by image, samples within); it is given SmoothGrad's draws here."""
    captum_attr = pytest.importorskip("captum.attr")
    from captum.attr._core.noise_tunnel import NoiseTunnel

    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(3, 3, 16, 16)
    classes, samples, sigma, seed = [1, 2, 0], 5, 0.3, 3
    ours = explain.SmoothGrad(model, samples=samples, noise_std=sigma, seed=seed, normalize=None).explain(
        x, target=classes)
    copies = torch.stack(noisy_copies_by_hand(x, samples, sigma, seed), dim=1)  # (N, samples, C, H, W)

    def the_same_noise(inputs, stdev, partition):
        assert partition == samples and stdev == sigma
        return copies.reshape(-1, *x.shape[1:]).clone()

    monkeypatch.setattr(NoiseTunnel, "_add_noise_to_input", staticmethod(the_same_noise))
    tunnel = captum_attr.NoiseTunnel(captum_attr.Saliency(model))
    mean_gradient = tunnel.attribute(x, nt_type="smoothgrad", nt_samples=samples, stdevs=sigma,
                                     target=torch.tensor(classes), abs=False)
    torch.testing.assert_close(ours.attributions[:, 0], mean_gradient, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours.raw_maps, mean_gradient.abs().amax(1), rtol=1e-4, atol=1e-7)


def test_reductions_by_hand():
    attributions = torch.tensor([[[[[1.0]], [[-3.0]], [[2.0]]]]])  # (1, 1, 3, 1, 1)
    assert reduce_channels(attributions, "maxabs").item() == 3.0
    assert reduce_channels(attributions, "sumabs").item() == 6.0
    assert reduce_channels(attributions, "sum").item() == 0.0


def test_guided_backprop_warns_when_the_model_has_no_relu():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).eval()
    x = torch.randn(1, 3, 6, 6)
    with pytest.warns(RuntimeWarning, match="no ReLU"):
        result = explain.GuidedBackprop(model, normalize=None).explain(x)
    assert result.diagnostics["relu_calls"] == 0
    torch.testing.assert_close(result.attributions, explain.Saliency(model, normalize=None).explain(x).attributions)
