"""DeepLIFT (rescale rule), DeepLIFT-SHAP and GradientSHAP / expected gradients against hand-worked
computations, their summation property, and Captum 0.9 where Captum computes the same thing."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import SmallCNN
from torch import Tensor, nn

import explain
from explain.methods.expected_gradients import PathSamples


def calibrated(model: nn.Module, size: int = 64) -> nn.Module:
    """Random weights with BatchNorm statistics of random images (realistic activation scales)."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, size, size))
    return model.eval()


# ------------------------------------------------------------------ DeepLIFT by hand


class TwoLayers(nn.Module):
    """x (N, 3, 2, 2) → flatten → W1 x + b1 → ReLU (functional) → w2 · h + b2."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(12, 5)
        self.second = nn.Linear(5, 2)

    def forward(self, x):
        return self.second(F.relu(self.first(x.flatten(1))))


def test_deeplift_equals_the_rescale_rule_worked_by_hand():
    """m_h = Δrelu/Δz (relu'(z) where Δz = 0); attribution = (x − x') ⊙ W1ᵀ (w2 ⊙ m_h)."""
    torch.manual_seed(0)
    model = TwoLayers().double().eval()
    x = torch.randn(3, 3, 2, 2, dtype=torch.float64)
    baseline = torch.randn(3, 2, 2, dtype=torch.float64) * 0.5
    classes = [0, 1, 1]
    result = explain.DeepLift(model, baseline=baseline, normalize=None).explain(x, target=classes)
    weights_1, bias_1 = model.first.weight, model.first.bias
    for n, c in enumerate(classes):
        z = weights_1 @ x[n].flatten() + bias_1
        z_ref = weights_1 @ baseline.flatten() + bias_1
        delta = z - z_ref
        multiplier = torch.where(delta.abs() > 1e-10, (z.relu() - z_ref.relu()) / delta, (z > 0).double())
        expected = (x[n] - baseline).flatten() * (weights_1.T @ (model.second.weight[c] * multiplier))
        torch.testing.assert_close(result.attributions[n, 0].flatten(), expected.detach())
    with torch.no_grad():
        change = model(x)[torch.arange(3), classes] - model(baseline[None])[0, classes]
    torch.testing.assert_close(result.diagnostics["score_change"][:, 0].double(), change, rtol=1e-6, atol=1e-7)
    assert result.diagnostics["summation_error"].abs().max() < 1e-6


def test_max_pooling_sends_the_pooled_difference_to_the_maxima_even_where_windows_overlap():
    """A 3 × 3 pool of stride 2 (windows overlap): each window's share w · (max(y, y') − y') goes to
    the position of its maximum in x, w · (y − max(y, y')) to that in x'; shares that land on one
    position add up, so Σ attributions = y(x) − y(x') exactly."""
    torch.manual_seed(0)
    head = nn.Linear(4, 1)
    model = nn.Sequential(nn.MaxPool2d(3, 2, 1), nn.Flatten(), head).eval()
    x, baseline = torch.randn(1, 1, 4, 4), torch.randn(1, 4, 4)
    result = explain.DeepLift(model, baseline=baseline, normalize=None).explain(x, target=0)
    pooled, where = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    pooled_ref, where_ref = F.max_pool2d(baseline[None], 3, 2, 1, return_indices=True)
    larger = torch.max(pooled, pooled_ref)
    weight = head.weight.detach().view(1, 1, 2, 2)
    spread = torch.zeros(16)
    spread.index_add_(0, where.flatten(), (weight * (larger - pooled_ref)).flatten())
    spread.index_add_(0, where_ref.flatten(), (weight * (pooled - larger)).flatten())
    delta = (x - baseline).flatten()
    expected = torch.where(delta.abs() > 1e-10, spread, torch.zeros(16))  # multiplier × Δx = the share
    torch.testing.assert_close(result.attributions[0, 0].flatten(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert result.diagnostics["summation_error"].abs().max() < 1e-5


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_deeplift_sums_to_the_score_difference_on_resnet18_and_vgg11(name):
    """In-place ReLU modules used twice per block (resnet18), overlapping max pooling (resnet18's
    stem): the attributions sum to y(x) − y(x') within 1e-4 of the difference (in float64, so
    that float32 rounding over 12,288 pixels does not blur the test)."""
    torch.manual_seed(0)
    model = calibrated(torchvision.models.get_model(name, num_classes=5)).double()
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)
    for baseline in ("zeros", torch.randn(3, 64, 64, dtype=torch.float64)):
        result = explain.DeepLift(model, baseline=baseline).explain(x, target=[0, 2, 4])
        error, change = result.diagnostics["summation_error"], result.diagnostics["score_change"]
        assert (error.abs() <= 1e-4 * change.abs().clamp_min(1e-3)).all(), (error, change)


def test_functional_relus_and_modules_give_the_same_deeplift():
    torch.manual_seed(0)
    with_modules = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3), nn.Sigmoid(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()

    class Functional(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            x = self.layers[0](x).relu_()
            x = torch.sigmoid(self.layers[2](x))
            return self.layers[6](self.layers[4](x).flatten(1))

    x = torch.randn(2, 3, 10, 10)
    expected = explain.DeepLift(with_modules, normalize=None).explain(x, target=[0, 2])
    functional = explain.DeepLift(Functional(with_modules).eval(), normalize=None).explain(x, target=[0, 2])
    torch.testing.assert_close(functional.attributions, expected.attributions)
    assert functional.diagnostics["summation_error"].abs().max() < 1e-5
    saliency = explain.InputXGradient(with_modules, normalize=None).explain(x, target=[0, 2])
    assert (saliency.attributions - expected.attributions).abs().max() > 1e-4  # the rule changed something


def test_deeplift_shap_is_the_mean_of_deeplift_over_the_references():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x, references = torch.randn(2, 3, 12, 12), torch.randn(3, 3, 12, 12)
    shap = explain.DeepLiftShap(model, references, batch_size=4, normalize=None).explain(x, target=[1, 3])
    each = [explain.DeepLift(model, baseline=reference, normalize=None).explain(x, target=[1, 3])
            for reference in references]
    torch.testing.assert_close(shap.attributions, torch.stack([e.attributions for e in each]).mean(0))
    assert shap.diagnostics["summation_error"].abs().max() < 1e-5


# ------------------------------------------------------------------ GradientSHAP by hand


def test_gradientshap_is_the_mean_of_gradients_at_the_drawn_points_times_the_differences():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x, references = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 8, 8)
    explainer = explain.GradientShap(model, references, samples=5, noise_std=0.2, seed=3, batch_size=3,
                                     normalize=None)
    result = explainer.explain(x, target=[1, 3])
    draws = explainer.draw(x)
    for n, c in enumerate([1, 3]):
        total = torch.zeros(3, 8, 8)
        for s in range(5):
            row = n * 5 + s
            noisy = x[n] + draws.noise[row]
            reference = references[draws.baseline_index[row]]
            alpha = float(draws.alphas[row])
            point = (alpha * noisy + (1 - alpha) * reference).requires_grad_(True)
            (gradient,) = torch.autograd.grad(model(point[None])[0, c], point)
            total += (noisy - reference) * gradient
        torch.testing.assert_close(result.attributions[n, 0], total / 5, rtol=1e-4, atol=1e-6)
    again = explain.GradientShap(model, references, samples=5, noise_std=0.2, seed=3).explain(x, target=[1, 3])
    torch.testing.assert_close(again.attributions, result.attributions)


def test_gradientshap_converges_to_the_mean_integrated_gradients_over_the_references():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x, references = torch.randn(1, 3, 8, 8), torch.randn(2, 3, 8, 8)
    shap = explain.GradientShap(model, references, samples=4000, batch_size=500, normalize=None).explain(x, target=2)
    integrated = torch.stack([explain.IntegratedGradients(model, baseline=reference, steps=64).explain(
        x, target=2).attributions for reference in references]).mean(0)
    relative = (shap.attributions - integrated).norm() / integrated.norm()
    assert relative < 0.1, relative
    assert (shap.diagnostics["completeness_error"].abs() < 0.1 * shap.diagnostics["score_change"].abs()).all()


class Conditioned(nn.Module):
    """A second, per-image input (a condition vector) scales the features: a reference's score
    depends on the image it is drawn for."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 5)

    def forward(self, condition, image):
        return self.head(torch.tanh(self.conv(image) * condition[:, :, None, None]).mean(dim=(2, 3)))


@pytest.mark.parametrize("conditioned", [False, True], ids=["shared references", "per-image forward arguments"])
def test_gradientshap_completeness_error_is_against_the_mean_score_of_each_images_drawn_references(conditioned):
    """Σ attributions − (y(x) − mean over the image's draws of y(b_s)), y(b_s) computed row by row
    here, with the image's own forward arguments where it has them; batch_size smaller than the
    distinct references, so the scores come in several chunks."""
    torch.manual_seed(0)
    x, references = torch.randn(3, 3, 8, 8), torch.randn(5, 3, 8, 8)
    targets = [1, 3, 0]
    model = Conditioned().eval() if conditioned else SmallCNN().eval()
    conditions = torch.rand(3, 4) + 0.5
    call = {"forward_args": (conditions,), "input_position": 1, "per_image": [0]} if conditioned else {}

    def score(image: int, inputs: Tensor) -> float:
        with torch.no_grad():
            output = model(conditions[image : image + 1], inputs) if conditioned else model(inputs)
        return float(output[0, targets[image]])

    explainer = explain.GradientShap(model, references, samples=7, noise_std=0.1, seed=5, batch_size=2,
                                     normalize=None)
    result = explainer.explain(x, target=targets, **call)
    draws = explainer.draw(x)
    for image in range(3):
        drawn = draws.baseline_index[image * 7 : (image + 1) * 7]
        mean_reference_score = sum(score(image, references[int(i)][None]) for i in drawn) / 7
        change = score(image, x[image : image + 1]) - mean_reference_score
        assert result.diagnostics["score_change"][image, 0].item() == pytest.approx(change, rel=1e-5, abs=1e-6)
        error = result.attributions[image, 0].double().sum().item() - change
        assert result.diagnostics["completeness_error"][image, 0].item() == pytest.approx(error, rel=1e-4, abs=1e-5)
    unchecked = explain.GradientShap(model, references, samples=7, noise_std=0.1, seed=5, batch_size=2,
                                     normalize=None, check_completeness=False).explain(x, target=targets, **call)
    torch.testing.assert_close(unchecked.attributions, result.attributions)
    assert "completeness_error" not in unchecked.diagnostics and "score_change" not in unchecked.diagnostics


# ------------------------------------------------------------------ Captum 0.9


def split_relus(resnet: nn.Module) -> nn.Module:
    """A copy of a torchvision resnet whose blocks use a separate ReLU module per call: Captum's
    DeepLift hooks modules and refuses one that runs twice (our rule belongs to each call)."""

    class Block(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block, self.relu1, self.relu2 = block, nn.ReLU(), nn.ReLU()

        def forward(self, x):
            b = self.block
            out = b.bn2(b.conv2(self.relu1(b.bn1(b.conv1(x)))))
            return self.relu2(out + (b.downsample(x) if b.downsample is not None else x))

    copied = copy.deepcopy(resnet)
    copied.relu = nn.ReLU()
    for name in ("layer1", "layer2", "layer3", "layer4"):
        setattr(copied, name, nn.Sequential(*[Block(block) for block in getattr(copied, name)]))
    return copied.eval()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_deeplift_equals_captum_with_a_zero_baseline(name):
    """resnet18 keeps its BatchNorm statistics at their initial values here: then the zero
    baseline stays zero up to the stem's max pooling, and Captum 0.9 is right (see the next test
    for what happens to Captum otherwise). In float64: the rescale rule divides by differences
    that cancel, so in float32 either implementation's rounding moves single attributions by up
    to 1 % of the largest (tests/test_memory_format.py)."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=5).eval()
    if name == "vgg11":
        model = calibrated(model)
    model = model.double()
    x, targets = torch.randn(3, 3, 64, 64, dtype=torch.float64), [0, 2, 4]
    ours = explain.DeepLift(model).explain(x, target=targets).attributions[:, 0]
    theirs = captum_deeplift(captum, model, x, torch.zeros_like(x), targets)[0]
    assert relative_error(ours, theirs) <= 1e-4


def captum_deeplift(captum, model: nn.Module, x: torch.Tensor, baselines: torch.Tensor,
                    targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Captum's DeepLift attributions and convergence deltas, on a copy it can hook."""
    peer_model = split_relus(model) if isinstance(model, torchvision.models.ResNet) else copy.deepcopy(model)
    for module in peer_model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attributions, delta = captum.DeepLift(peer_model).attribute(x, baselines=baselines, target=targets,
                                                                    return_convergence_delta=True)
    return attributions.detach(), delta.detach()


def test_where_captum_misses_the_summation_property_ours_keeps_it():
    """Captum 0.9's DeepLift lets a ReLU that feeds a max pooling use a stale output gradient when
    the pooling's reference input is not zero (captum issue #1104, fixed after 0.9): on resnet18
    (calibrated BatchNorm) with a random baseline its attributions miss y(x) − y(x') by more than
    the difference itself; ours sum to it exactly (float64 here)."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = calibrated(torchvision.models.resnet18(num_classes=5)).double()
    x, targets = torch.randn(2, 3, 64, 64, dtype=torch.float64), [0, 3]
    baseline = torch.randn(3, 64, 64, dtype=torch.float64)
    ours = explain.DeepLift(model, baseline=baseline).explain(x, target=targets)
    _, captum_delta = captum_deeplift(captum, model, x, baseline.expand_as(x), targets)
    change = ours.diagnostics["score_change"][:, 0].double()
    assert (ours.diagnostics["summation_error"].abs().double()[:, 0] <= 1e-4 * change.abs()).all()
    assert (captum_delta.abs() > 0.1 * change.abs()).any()


def test_deeplift_shap_equals_captum_where_captum_sums_to_delta_and_is_exact_where_it_does_not():
    """Captum 0.9's DeepLift lets a ReLU that feeds a max pooling use a stale output gradient
    when the baselines are not zero (captum issue #1104, fixed after 0.9): its attributions then
    miss the summation property by up to 10 % of the score difference on vgg11. Without max
    pooling the two agree; ours sums exactly in both."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x, references = torch.randn(3, 3, 16, 16), torch.randn(4, 3, 16, 16)
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    ours = explain.DeepLiftShap(model, references, normalize=None).explain(x, target=[0, 2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum.DeepLiftShap(model).attribute(x, baselines=references, target=[0, 2, 4])
    assert relative_error(ours.attributions[:, 0], theirs.detach()) <= 1e-4
    vgg = calibrated(torchvision.models.vgg11(num_classes=5))
    for module in vgg.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    x, references = torch.randn(2, 3, 64, 64), torch.randn(3, 3, 64, 64)
    ours = explain.DeepLiftShap(vgg.double(), references.double()).explain(x.double(), target=[0, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, captum_delta = captum.DeepLiftShap(vgg).attribute(x.double(), baselines=references.double(),
                                                             target=[0, 2], return_convergence_delta=True)
    change = ours.diagnostics["score_change"].abs()
    assert (ours.diagnostics["summation_error"].abs() <= 1e-4 * change.clamp_min(1e-3)).all()
    assert captum_delta.abs().max() > 1e-2  # the peer's error this test documents


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_gradientshap_equals_captum_given_the_same_draws(name, monkeypatch):
    """Captum draws the references (numpy choice), the noise (torch.normal) and the positions
    (numpy uniform); the test records those draws and gives them to ours."""
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(0)
    model = calibrated(torchvision.models.get_model(name, num_classes=5))
    x, references, targets = torch.randn(3, 3, 32, 32), torch.randn(4, 3, 32, 32), [0, 2, 4]
    recorded: dict[str, list] = {"choice": [], "uniform": [], "normal": []}
    choice, uniform, normal = np.random.choice, np.random.uniform, torch.normal

    def record(kind, function):
        def wrapper(*args, **kwargs):
            value = function(*args, **kwargs)
            recorded[kind].append(value)
            return value

        return wrapper

    monkeypatch.setattr(np.random, "choice", record("choice", choice))
    monkeypatch.setattr(np.random, "uniform", record("uniform", uniform))
    monkeypatch.setattr(torch, "normal", record("normal", normal))
    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum.GradientShap(model).attribute(x, baselines=references, target=targets, n_samples=6,
                                                      stdevs=0.1)
    monkeypatch.undo()
    samples = PathSamples(torch.as_tensor(np.asarray(recorded["choice"][0])),
                          torch.as_tensor(np.asarray(recorded["uniform"][0]), dtype=torch.float64),
                          recorded["normal"][0])
    explainer = explain.GradientShap(model, references, samples=6, normalize=None)
    with torch.no_grad():
        selected = explain.core.targets.select_targets(model(x), targets, None, batch_size=3)
    ours = explainer.attribute_with(x, selected, samples)
    assert relative_error(ours.attributions[:, 0], theirs.detach()) <= 1e-4


class CountsForwards(nn.Module):
    """SmallCNN in float64 that records the batch size of every forward, its output a dict."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN().double().eval()
        self.batch_sizes: list[int] = []

    def forward(self, x):
        self.batch_sizes.append(len(x))
        return {"logits": self.net(x)}


def test_deeplift_runs_the_model_once_on_images_and_baselines_and_picks_targets_there():
    """The baselines' forward, then the images' (N rows each); the images' forward serves the target choice
    too: top-1 and top-k classes are the model's own on x, and the attributions equal those for the same
    classes given explicitly."""
    torch.manual_seed(0)
    model = CountsForwards()
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        logits = model.net(x)
    top1 = explain.DeepLift(model).explain(x)
    assert model.batch_sizes == [3, 3]
    assert top1.class_indices.flatten().tolist() == logits.argmax(1).tolist()
    torch.testing.assert_close(top1.scores.flatten().double(), logits.max(1).values, rtol=1e-6, atol=1e-6)
    top2 = explain.DeepLift(model).explain(x, topk=2)
    assert top2.class_indices.tolist() == logits.topk(2).indices.tolist()
    given = explain.DeepLift(model).explain(x, target=top2.class_indices.tolist())
    torch.testing.assert_close(top2.attributions, given.attributions, rtol=0, atol=0)
    change = top2.diagnostics["score_change"].double()
    assert (top2.diagnostics["summation_error"].double().abs() <= 1e-6 * change.abs().clamp_min(1)).all()
