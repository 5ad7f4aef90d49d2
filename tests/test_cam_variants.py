"""The CAM variants of issue 16 and the options every CAM takes, each against a slow by-hand computation.

Activations A and gradients G come from a network split by hand (tiny model: worked out in closed
form; resnet18: head and tail run by hand, gradients by autograd.functional), never from the
toolkit's pipeline; the formulas are loops over channels and positions in numpy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import ConvGapLinear, assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.cam import AUGMENTATIONS

# ---------------------------------------------------------------- slow formulas, one image: a, g (C, h, w)


def slow_principal_component(terms: np.ndarray) -> np.ndarray:
    """Projection on the first eigenvector of the channel covariance (numpy eigh), signed to correlate
    positively with Σ_k terms_k."""
    samples = terms.reshape(terms.shape[0], -1).T.astype(np.float64)  # (hw, C)
    centred = samples - samples.mean(0)
    _, vectors = np.linalg.eigh(centred.T @ centred)
    projection = centred @ vectors[:, -1]
    reference = samples.sum(1)
    if ((projection - projection.mean()) * (reference - reference.mean())).sum() < 0:
        projection = -projection
    return projection.reshape(terms.shape[1:])


def slow_eigengradcam(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    return slow_principal_component(g * a)


def slow_elementwise(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    cam = np.zeros(a.shape[1:])
    for k in range(a.shape[0]):
        for i in range(a.shape[1]):
            for j in range(a.shape[2]):
                cam[i, j] += max(g[k, i, j] * a[k, i, j], 0.0)
    return cam


def slow_fem(a: np.ndarray, sigmas: float = 2.0) -> np.ndarray:
    """Fuad et al.: Σ_k μ_k · 1[A_k > μ_k + 2 σ_k] (population σ)."""
    cam = np.zeros(a.shape[1:])
    for k in range(a.shape[0]):
        mean, std = a[k].mean(), a[k].std()
        cam += mean * (a[k] > mean + sigmas * std)
    return cam


def slow_kpca(a: np.ndarray, kernel: str, gamma=None, coef0: float = 1.0, degree: int = 3) -> np.ndarray:
    """Kernel PCA by its definition: kernel matrix over positions (loops), double centring, top eigenpair."""
    x = a.reshape(a.shape[0], -1).T.astype(np.float64)
    x = x - x.mean(0)
    count, gamma = len(x), gamma if gamma is not None else 1.0 / x.shape[1]
    gram = np.empty((count, count))
    for p in range(count):
        for q in range(count):
            dot = x[p] @ x[q]
            gram[p, q] = {
                "linear": dot,
                "sigmoid": np.tanh(gamma * dot + coef0),
                "poly": (gamma * dot + coef0) ** degree,
                "rbf": np.exp(-gamma * np.sum((x[p] - x[q]) ** 2)),
                "cosine": dot / max(np.linalg.norm(x[p]) * np.linalg.norm(x[q]), 1e-300),
            }[kernel]
    ones = np.full((count, count), 1.0 / count)
    centred = gram - ones @ gram - gram @ ones + ones @ gram @ ones
    values, vectors = np.linalg.eigh(centred)
    scores = vectors[:, -1] * np.sqrt(max(values[-1], 0.0))
    mass = a.reshape(a.shape[0], -1).sum(0)
    if ((scores - scores.mean()) * (mass - mass.mean())).sum() < 0:
        scores = -scores
    return scores.reshape(a.shape[1:])


def upsampled(cam: np.ndarray, size) -> torch.Tensor:
    return F.interpolate(torch.as_tensor(cam, dtype=torch.float32)[None, None], size=size, mode="bilinear",
                         align_corners=False)[0, 0]


# ---------------------------------------------------------------- tiny model: A, G and H·A in closed form


def tiny_case(seed: int = 0):
    torch.manual_seed(seed)
    model = ConvGapLinear(channels=5, classes=4, relu=True).eval()
    return model, torch.randn(3, 3, 6, 6), [0, 3, 1]


def tiny_activations_and_gradients(model: ConvGapLinear, x: torch.Tensor, classes):
    """A = conv(x); ReLU → GAP → linear gives ∂y_c/∂A = W[c, k] · 1[A > 0] / (h w)."""
    with torch.no_grad():
        a = model.conv(x)
        hw = a.shape[-2] * a.shape[-1]
        g = torch.stack([model.fc.weight[c].view(-1, 1, 1) * (a[n] > 0) / hw for n, c in enumerate(classes)])
    return a.double().numpy(), g.double().numpy()


@pytest.mark.parametrize("method, formula", [(explain.EigenGradCAM, slow_eigengradcam),
                                             (explain.GradCAMElementWise, slow_elementwise)],
                         ids=["eigengradcam", "gradcamelementwise"])
def test_gradient_variants_match_their_formula_on_a_tiny_model(method, formula):
    model, x, classes = tiny_case()
    a, g = tiny_activations_and_gradients(model, x, classes)
    result = method(model, "conv", normalize=None, relu=False).explain(x, target=classes)
    for n in range(3):
        np.testing.assert_allclose(result.raw_maps[n].numpy(), formula(a[n], g[n]), rtol=1e-4, atol=1e-6)


def test_fem_is_the_channel_mean_times_the_k_sigma_binary_map():
    model, x, _ = tiny_case()
    a, _ = tiny_activations_and_gradients(model, x, [0, 0, 0])
    result = explain.FEM(model, "conv", normalize=None, relu=False).explain(x, topk=2)
    for n in range(3):
        for k in range(2):  # class-agnostic
            np.testing.assert_allclose(result.raw_maps[n, k].numpy(), slow_fem(a[n]), rtol=1e-5, atol=1e-6)
    stricter = explain.FEM(model, "conv", normalize=None, relu=False, k=1.0).explain(x, target=0)
    np.testing.assert_allclose(stricter.raw_maps[0].numpy(), slow_fem(a[0], 1.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["sigmoid", "rbf", "poly", "linear", "cosine"])
def test_kpca_cam_is_the_first_kernel_principal_component(kernel):
    model, x, _ = tiny_case()
    a, _ = tiny_activations_and_gradients(model, x, [0, 0, 0])
    result = explain.KernelPCACAM(model, "conv", normalize=None, relu=False, kernel=kernel).explain(x, target=1)
    for n in range(3):
        np.testing.assert_allclose(result.raw_maps[n].numpy(), slow_kpca(a[n], kernel), rtol=1e-4, atol=1e-6)


def test_kpca_cam_with_a_linear_kernel_is_eigencam():
    model, x, _ = tiny_case()
    linear = explain.KernelPCACAM(model, "conv", normalize=None, relu=False, kernel="linear").explain(x)
    eigen = explain.EigenCAM(model, "conv", normalize=None, relu=False).explain(x)
    torch.testing.assert_close(linear.raw_maps, eigen.raw_maps, rtol=1e-4, atol=1e-6)


def test_kpca_cam_equals_scikit_learn_kernel_pca_up_to_sign():
    decomposition = pytest.importorskip("sklearn.decomposition")
    model, x, _ = tiny_case()
    a, _ = tiny_activations_and_gradients(model, x, [0, 0, 0])
    result = explain.KernelPCACAM(model, "conv", normalize=None, relu=False).explain(x)
    for n in range(3):
        samples = a[n].reshape(a.shape[1], -1).T
        reference = decomposition.KernelPCA(n_components=1, kernel="sigmoid").fit_transform(samples - samples.mean(0))
        ours = result.raw_maps[n].numpy().ravel()
        assert abs(np.corrcoef(ours, reference[:, 0])[0, 1]) > 0.9999
        np.testing.assert_allclose(np.abs(ours), np.abs(reference[:, 0]), rtol=1e-3, atol=1e-6)


def test_random_cam_uses_seeded_uniform_weights_shared_by_every_image_and_target():
    model, x, _ = tiny_case()
    a, _ = tiny_activations_and_gradients(model, x, [0, 0, 0])
    weights = (torch.rand(5, generator=torch.Generator().manual_seed(3)) * 2 - 1).double().numpy()
    result = explain.RandomCAM(model, "conv", normalize=None, relu=False, seed=3).explain(x, topk=2)
    for n in range(3):
        expected = sum(weights[k] * a[n, k] for k in range(5))
        for k in range(2):
            np.testing.assert_allclose(result.raw_maps[n, k].numpy(), expected, rtol=1e-5, atol=1e-6)
    again = explain.RandomCAM(model, "conv", normalize=None, relu=False, seed=3).explain(x, topk=2)
    other = explain.RandomCAM(model, "conv", normalize=None, relu=False, seed=4).explain(x, topk=2)
    torch.testing.assert_close(again.raw_maps, result.raw_maps)
    assert not torch.allclose(other.raw_maps, result.raw_maps)


def rest_scores(classes):
    """pytorch-grad-cam's ReST target (Shapley-CAM paper): logit + log-softmax of each image's class."""
    index = torch.tensor(classes)
    return lambda output: output[torch.arange(len(index)), index] + output.log_softmax(1)[torch.arange(len(index)),
                                                                                          index]


def slow_shapley_weights(weight: np.ndarray, bias: np.ndarray, pooled: np.ndarray, mask: np.ndarray,
                         c: int) -> np.ndarray:
    """w_k = mean_ij (G − ½ H A)_k,ij for s = y_c + log softmax(y)_c, y = W · mean(f(A)) + b, f = ReLU or
    identity (mask = f'(A)): G = mask (2 W_c − pᵀW) / hw, H A = −mask Wᵀ(diag p − p pᵀ) W mean(f(A)) / hw."""
    hw = mask.shape[1] * mask.shape[2]
    logits = weight @ pooled + bias
    p = np.exp(logits - logits.max())
    p /= p.sum()
    gradient = (2 * weight[c] - p @ weight)[:, None, None] * mask / hw
    hessian_a = -((weight.T @ (np.diag(p) - np.outer(p, p)) @ weight @ pooled)[:, None, None]) * mask / hw
    return (gradient - 0.5 * hessian_a).mean(axis=(1, 2))


def test_shapley_cam_weights_are_the_gradient_minus_half_the_hessian_vector_product():
    model, x, classes = tiny_case()
    a, _ = tiny_activations_and_gradients(model, x, classes)
    weight, bias = model.fc.weight.detach().double().numpy(), model.fc.bias.detach().double().numpy()
    result = explain.ShapleyCAM(model, "conv", normalize=None, relu=False).explain(x, target=rest_scores(classes))
    gradcam = explain.GradCAM(model, "conv", normalize=None, relu=False).explain(x, target=rest_scores(classes))
    for n, c in enumerate(classes):
        pooled = np.maximum(a[n], 0).mean(axis=(1, 2))
        weights = slow_shapley_weights(weight, bias, pooled, (a[n] > 0).astype(float), c)
        np.testing.assert_allclose(result.raw_maps[n].numpy(), np.tensordot(weights, a[n], 1), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(result.raw_maps, gradcam.raw_maps, rtol=1e-3)  # the Hessian term matters here


def test_shapley_cam_is_grad_cam_where_the_tail_is_linear():
    model, x, classes = tiny_case()
    shapley = explain.ShapleyCAM(model, "relu", normalize=None, relu=False).explain(x, target=classes)
    gradcam = explain.GradCAM(model, "relu", normalize=None, relu=False).explain(x, target=classes)
    torch.testing.assert_close(shapley.raw_maps, gradcam.raw_maps)


# ---------------------------------------------------------------- resnet18, batch of 3, different targets


@pytest.fixture(scope="module")
def resnet_case():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(3, 3, 96, 96)
    classes = [2, 5, 9]
    with torch.no_grad():
        stem = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        a = model.layer4(model.layer3(model.layer2(model.layer1(stem))))  # (3, 512, 3, 3)

    def tail(features):
        return model.fc(torch.flatten(model.avgpool(features), 1))

    gradients = torch.stack(
        [torch.autograd.functional.jacobian(lambda f, n=n, c=c: tail(f)[0, c], a[n : n + 1])[0]
         for n, c in enumerate(classes)]
    )
    return model, x, classes, a.double().numpy(), gradients.double().numpy()


@pytest.mark.parametrize("method, formula", [(explain.EigenGradCAM, slow_eigengradcam),
                                             (explain.GradCAMElementWise, slow_elementwise)],
                         ids=["eigengradcam", "gradcamelementwise"])
def test_gradient_variants_on_resnet18_batch_of_three(method, formula, resnet_case):
    model, x, classes, a, g = resnet_case
    result = method(model, "layer4", normalize=None, relu=False).explain(x, target=classes)
    assert result.maps.shape == (3, 96, 96)
    for n in range(3):
        torch.testing.assert_close(result.raw_maps[n], upsampled(formula(a[n], g[n]), (96, 96)), rtol=1e-3,
                                   atol=1e-5)


@pytest.mark.parametrize("method, formula", [(explain.FEM, slow_fem),
                                             (explain.KernelPCACAM, lambda a: slow_kpca(a, "sigmoid"))],
                         ids=["fem", "kpcacam"])
def test_class_agnostic_variants_on_resnet18_batch_of_three(method, formula, resnet_case):
    model, x, classes, a, _ = resnet_case
    result = method(model, "layer4", normalize=None, relu=False).explain(x, target=classes)
    for n in range(3):
        expected = upsampled(formula(a[n]), (96, 96))
        torch.testing.assert_close(result.raw_maps[n], expected, rtol=1e-3, atol=1e-5 * float(expected.abs().max()))


def test_shapley_cam_on_resnet18_batch_of_three(resnet_case):
    model, x, classes, a, _ = resnet_case
    weight, bias = model.fc.weight.detach().double().numpy(), model.fc.bias.detach().double().numpy()
    result = explain.ShapleyCAM(model, "layer4", normalize=None, relu=False).explain(x, target=rest_scores(classes))
    for n, c in enumerate(classes):  # layer4 ends with a ReLU: the tail is linear in A, mask = 1
        weights = slow_shapley_weights(weight, bias, a[n].mean(axis=(1, 2)), np.ones_like(a[n]), c)
        torch.testing.assert_close(result.raw_maps[n], upsampled(np.tensordot(weights, a[n], 1), (96, 96)),
                                   rtol=1e-3, atol=1e-5)


def test_random_cam_on_resnet18_batch_of_three(resnet_case):
    model, x, classes, a, _ = resnet_case
    weights = (torch.rand(512, generator=torch.Generator().manual_seed(0)) * 2 - 1).double().numpy()
    result = explain.RandomCAM(model, "layer4", normalize=None, relu=False).explain(x, target=classes)
    for n in range(3):
        torch.testing.assert_close(result.raw_maps[n], upsampled(np.tensordot(weights, a[n], 1), (96, 96)),
                                   rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------- FullGrad


def rescale(values: np.ndarray) -> np.ndarray:
    span = values.max() - values.min()
    return (values - values.min()) / span if span > 0 else np.zeros_like(values)


def test_fullgrad_on_a_tiny_model_matches_the_paper_formula_and_is_complete():
    model, x, classes = tiny_case()
    result = explain.FullGrad(model, normalize=None).explain(x, target=classes)
    weight = model.fc.weight.detach()
    for n, c in enumerate(classes):
        image = x[n : n + 1].clone().requires_grad_(True)
        z = F.conv2d(image, model.conv.weight, model.conv.bias, padding=1)
        y = F.linear(torch.relu(z).mean(dim=(2, 3)), model.fc.weight, model.fc.bias)[0, c]
        (input_gradient,) = torch.autograd.grad(y, image)
        hw = z.shape[-1] * z.shape[-2]
        bias_gradient = (weight[c].view(-1, 1, 1) * (z[0] > 0) / hw).double().numpy()  # ∂y/∂z, (C, h, w)
        bias = model.conv.bias.detach().double().numpy()
        expected = rescale(np.abs((image * input_gradient).detach().double().numpy()[0])).sum(0)
        for k in range(5):  # same resolution as the input: no upsampling
            expected = expected + rescale(np.abs(bias[k] * bias_gradient[k]))
        np.testing.assert_allclose(result.raw_maps[n].numpy(), expected, rtol=1e-4, atol=1e-5)
        total = float((image * input_gradient).detach().sum()) + (bias[:, None, None] * bias_gradient).sum()
        assert abs(total + model.fc.bias[c].item() - y.item()) < 1e-4  # completeness of the decomposition, by hand
    assert result.diagnostics["completeness_error"].abs().max() < 1e-4


def randomised_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random running statistics and affine parameters, as after training (torchvision's initial ones
    make every BatchNorm's effective bias zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(size, generator=generator) * 0.2)
    return model


def resnet18_with_probes(model, x, probes: list):
    """resnet18's forward written out by hand, adding a zero probe to the output of every conv and
    BatchNorm: ∂y/∂probe = ∂y/∂(that output). Appends (probe, effective bias) to ``probes``."""

    def probed(module, value):
        if isinstance(module, nn.BatchNorm2d):
            bias = module.bias - module.running_mean * module.weight / torch.sqrt(module.running_var + module.eps)
        else:
            bias = module.bias
        if bias is None:
            return value
        probe = torch.zeros_like(value, requires_grad=True)
        probes.append((probe, bias.detach()))
        return value + probe

    def layer(module, value):
        return probed(module, module(value))

    out = torch.relu(layer(model.bn1, layer(model.conv1, x)))
    out = model.maxpool(out)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            identity = out
            hidden = torch.relu(layer(block.bn1, layer(block.conv1, out)))
            hidden = layer(block.bn2, layer(block.conv2, hidden))
            if block.downsample is not None:
                identity = layer(block.downsample[1], layer(block.downsample[0], out))
            out = torch.relu(hidden + identity)
    return model.fc(torch.flatten(model.avgpool(out), 1))


def test_fullgrad_on_resnet18_batch_of_three_matches_a_forward_written_by_hand():
    torch.manual_seed(0)
    model = randomised_batchnorm(torchvision.models.resnet18(num_classes=10).eval())
    x = torch.randn(3, 3, 64, 64)
    classes = [2, 5, 9]
    result = explain.FullGrad(model, normalize=None).explain(x, target=classes)
    for n, c in enumerate(classes):
        probes: list = []
        image = x[n : n + 1].clone().requires_grad_(True)
        y = resnet18_with_probes(model, image, probes)[0, c]
        gradients = torch.autograd.grad(y, [image] + [probe for probe, _ in probes])
        expected = torch.zeros(64, 64, dtype=torch.float64)
        expected += torch.from_numpy(rescale(np.abs((image * gradients[0]).detach().double().numpy()[0])).sum(0))
        total = (image * gradients[0]).sum().item() + model.fc.bias[c].item()
        for (_, bias), gradient in zip(probes, gradients[1:]):
            terms = (gradient[0] * bias.view(-1, 1, 1)).double()
            total += float(terms.sum())
            per_channel = np.stack([rescale(np.abs(channel)) for channel in terms.numpy()])
            expected += upsampled(per_channel.sum(0), (64, 64)).double()
        torch.testing.assert_close(result.raw_maps[n].double(), expected, rtol=1e-4, atol=1e-4)
        assert abs(total - y.item()) < 1e-3 * max(1.0, abs(y.item()))  # complete, by hand
    assert len(probes) == 20  # resnet18's convolutions have no bias: its 20 BatchNorms
    assert result.diagnostics["completeness_error"].abs().max() < 1e-3


class ReluVariants(nn.Module):
    """conv-BN-ReLU ×2, then pooling and a head; the ReLUs as modules in place, or as F.relu."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        act = F.relu if self.functional else self.relu
        x = act(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = act(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def test_fullgrad_is_the_same_with_in_place_and_functional_relus_and_leaves_the_model_as_found():
    torch.manual_seed(1)
    in_place = randomised_batchnorm(ReluVariants(functional=False)).train()
    functional = ReluVariants(functional=True)
    functional.load_state_dict(in_place.state_dict())
    before = model_state(in_place)
    x = torch.randn(2, 3, 12, 12)
    maps = explain.FullGrad(in_place, normalize=None).explain(x, target=[0, 3])
    assert_state_equal(before, model_state(in_place))
    reference = explain.FullGrad(functional.eval(), normalize=None).explain(x, target=[0, 3])
    torch.testing.assert_close(maps.raw_maps, reference.raw_maps)
    assert maps.diagnostics["completeness_error"].abs().max() < 1e-4
    assert int(maps.diagnostics["bias_layers"]) == 4  # conv1 and the two BatchNorms, and the head


@pytest.mark.parametrize("name", ["vgg11", "densenet121", "efficientnet_b0"])
def test_fullgrad_runs_on_vgg_densenet_and_efficientnet(name):
    torch.manual_seed(0)
    model = randomised_batchnorm(getattr(torchvision.models, name)(num_classes=10).eval())
    result = explain.FullGrad(model).explain(torch.randn(1, 3, 64, 64), target=3)
    assert result.maps.shape == (1, 64, 64) and torch.isfinite(result.maps).all() and result.maps.min() >= 0
    error = result.diagnostics["completeness_error"].abs().item() / max(1.0, result.scores.abs().item())
    if name != "efficientnet_b0":  # ReLU networks are complete; SiLU's implicit biases are left out
        assert error < 1e-3


# ---------------------------------------------------------------- options of every CAM


def test_eigen_smoothing_is_the_first_principal_component_of_the_weighted_activations(resnet_case):
    model, x, classes, a, g = resnet_case
    result = explain.GradCAM(model, "layer4", normalize=None, relu=False, smooth="eigen").explain(x, target=classes)
    layer = explain.LayerCAM(model, "layer4", normalize=None, relu=False, smooth="eigen").explain(x, target=classes)
    for n in range(3):
        weights = g[n].mean(axis=(1, 2))
        expected = slow_principal_component(weights[:, None, None] * a[n])
        torch.testing.assert_close(result.raw_maps[n], upsampled(expected, (96, 96)), rtol=1e-3, atol=1e-5)
        expected = slow_principal_component(np.maximum(g[n], 0) * a[n])
        torch.testing.assert_close(layer.raw_maps[n], upsampled(expected, (96, 96)), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("normalize", ["max", None])
def test_augmentation_smoothing_is_the_mean_of_the_maps_of_flipped_and_scaled_copies(resnet_case, normalize):
    """Each copy's map, normalised as the explainer normalises maps (or raw with normalize=None), flipped
    back; the explanation's raw maps are their mean (the final normalisation comes after)."""
    model, x, _, _, _ = resnet_case
    result = explain.GradCAM(model, "layer4", normalize=normalize, smooth="augment").explain(x, topk=2)
    targets = result.targets.tolist()  # chosen on the unchanged images, kept for every copy
    expected = torch.zeros(3, 2, 96, 96)
    for flip, factor in AUGMENTATIONS:
        copy = x * factor
        copy = copy.flip(-1) if flip else copy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = explain.GradCAM(model, "layer4", normalize=None).explain(copy, target=targets).low_res_maps[0]
        maps = explain.methods.normalize_maps(maps, normalize)
        expected += upsampled_all(maps.flip(-1) if flip else maps, (96, 96)) / len(AUGMENTATIONS)
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-4, atol=1e-5)
    assert len(AUGMENTATIONS) == 6 and sorted({f for _, f in AUGMENTATIONS}) == [0.9, 1.0, 1.1]


def upsampled_all(maps: torch.Tensor, size) -> torch.Tensor:
    return F.interpolate(maps.float(), size=size, mode="bilinear", align_corners=False)


def test_several_layers_are_normalised_before_combining_unless_asked_for_raw_maps(resnet_case):
    model, x, classes, *_ = resnet_case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        single = [explain.GradCAM(model, name, normalize=None).explain(x, target=classes) for name in ("layer3",
                                                                                                    "layer4")]
        low_res = [explanation.low_res_maps[0] for explanation in single]
        scaled = [upsampled_all(maps / maps.flatten(2).amax(2).clamp_min(1e-30)[..., None, None], (96, 96))[:, 0]
                  for maps in low_res]
        raw = [explanation.raw_maps for explanation in single]
        layers = ["layer3", "layer4"]
        mean = explain.GradCAM(model, layers, normalize=None).explain(x, target=classes)
        product = explain.GradCAM(model, layers, normalize=None, combine="product").explain(x, target=classes)
        maximum = explain.GradCAM(model, layers, normalize=None, combine="max").explain(x, target=classes)
        raw_mean = explain.GradCAM(model, layers, normalize=None, normalize_layers=False).explain(x, target=classes)
    torch.testing.assert_close(mean.raw_maps, (scaled[0] + scaled[1]) / 2)
    torch.testing.assert_close(product.raw_maps, scaled[0] * scaled[1])
    torch.testing.assert_close(maximum.raw_maps, torch.maximum(scaled[0], scaled[1]))
    torch.testing.assert_close(raw_mean.raw_maps, (raw[0] + raw[1]) / 2)
    assert [maps.shape[-1] for maps in mean.low_res_maps] == [6, 3]


def test_bad_options_are_refused():
    model, _, _ = tiny_case()
    with pytest.raises(ValueError, match="smooth must be one of"):
        explain.GradCAM(model, "conv", smooth="gaussian")
    with pytest.raises(ValueError, match="combine must be one of"):
        explain.GradCAM(model, "conv", combine="median")
    with pytest.raises(ValueError, match="kernel must be one of"):
        explain.KernelPCACAM(model, "conv", kernel="laplace")
    with pytest.raises(ValueError, match="FullGrad's smooth"):
        explain.FullGrad(model, smooth="eigen")


def test_new_methods_are_registered_for_the_command_line_and_the_reliability_suite():
    for name in ("eigengradcam", "gradcamelementwise", "fullgrad", "kpcacam", "fem", "shapleycam", "randomcam"):
        assert explain.get_method(name).name == name
    assert explain.get_method("KPCA-CAM") is explain.KernelPCACAM
    assert explain.get_method("Grad-CAM-ElementWise") is explain.GradCAMElementWise
