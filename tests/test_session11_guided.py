"""Guided backprop, deconvnet and Guided Grad-CAM under hostile use: models that mix ReLUs with other
activations (MobileNetV3's hardswish and hard-sigmoid gates) are warned of, not half-guided in silence;
activation checkpointing in the model's own forward; by-hand backward passes, layer by layer."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import explain


class TwoLayerNet(nn.Module):
    """conv → ReLU → conv (stride 2) → ReLU → mean → linear; the ReLUs called as functions."""

    def __init__(self, checkpointed: bool = False, gate: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, stride=2)
        self.fc = nn.Linear(8, 4)
        self.checkpointed = checkpointed
        self.gate = gate

    def block(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.conv1(x))
        if self.gate:  # a MobileNetV3-style hardswish and hard-sigmoid gate
            hidden = F.hardswish(hidden) * F.hardsigmoid(hidden.mean((2, 3), keepdim=True))
        return torch.relu(self.conv2(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.fc(features.mean((2, 3)))


def by_hand(model: TwoLayerNet, x: torch.Tensor, target: int, guided: bool) -> torch.Tensor:
    """The rectified backward pass of one image, written layer by layer: at each ReLU, grad⁺, times
    [input > 0] for guided backprop (Springenberg et al.), alone for deconvnet (Zeiler & Fergus)."""
    with torch.no_grad():
        z1 = model.conv1(x)
        a1 = z1.clamp(min=0)
        z2 = model.conv2(a1)
        grad_a2 = (model.fc.weight[target] / (z2.shape[2] * z2.shape[3]))[None, :, None, None].expand_as(z2)
        grad_z2 = grad_a2.clamp(min=0) * ((z2 > 0) if guided else 1)
        grad_a1 = torch.nn.grad.conv2d_input(a1.shape, model.conv2.weight, grad_z2, stride=2, padding=1)
        grad_z1 = grad_a1.clamp(min=0) * ((z1 > 0) if guided else 1)
        return torch.nn.grad.conv2d_input(x.shape, model.conv1.weight, grad_z1, padding=1)


@pytest.fixture
def case():
    torch.manual_seed(0)
    return TwoLayerNet().eval(), torch.randn(3, 3, 8, 8, dtype=torch.float64), [0, 2, 3]


@pytest.mark.parametrize("method, guided", [(explain.GuidedBackprop, True), (explain.Deconvnet, False)])
def test_backward_pass_by_hand_per_image_targets_float64(case, method, guided):
    model, x, targets = case
    model = model.double()
    result = method(model, normalize=None).explain(x, target=targets)
    expected = torch.cat([by_hand(model, x[n:n + 1], t, guided) for n, t in enumerate(targets)])
    assert result.attributions.dtype == torch.float64
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-10, atol=1e-14)
    assert result.diagnostics["relu_calls"] == 2


def test_guided_gradcam_by_hand(case):
    model, x, targets = case
    model, x = model.float(), x.float()
    expected = []
    for n, t in enumerate(targets):
        features = model.conv2(F.relu(model.conv1(x[n:n + 1]))).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(model.fc(F.relu(features).mean((2, 3)))[0, t], features)  # plain gradient
        cam = (grad.mean((2, 3), keepdim=True) * features).sum(1, keepdim=True).clamp(min=0).detach()
        upsampled = F.interpolate(cam, size=(8, 8), mode="bilinear", align_corners=False)
        expected.append(by_hand(model, x[n:n + 1], t, guided=True) * upsampled)
    result = explain.GuidedGradCAM(model, "conv2", normalize=None).explain(x, target=targets)
    torch.testing.assert_close(result.attributions[:, 0], torch.cat(expected), rtol=1e-4, atol=1e-9)


def test_a_model_with_relus_and_other_activations_is_not_half_guided_in_silence():
    """MobileNetV3 runs ReLUs and hardswish / hard-sigmoid gates: the ReLUs were guided and the gates
    plain, without a word (only a model with no ReLU at all was warned of)."""
    torch.manual_seed(0)
    model, x = TwoLayerNet(gate=True).eval(), torch.randn(2, 3, 8, 8)
    for method in (explain.GuidedBackprop, explain.Deconvnet):
        with pytest.warns(RuntimeWarning, match=r"2 ReLU call\(s\) only.*hardswish ×1, whose"):
            method(model).explain(x, target=[0, 1])
    with pytest.warns(RuntimeWarning, match=r"GuidedGradCAM rewrote.*hardswish"):
        explain.GuidedGradCAM(model, "conv2").explain(x, target=[1, 2])
    # a pure ReLU network: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.GuidedBackprop(TwoLayerNet().eval()).explain(x, target=[0, 1])


def test_the_no_relu_warning_names_the_activations_it_ran():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SiLU(), nn.Conv2d(4, 4, 3), nn.GELU(), nn.Flatten(),
                          nn.Linear(4 * 2 * 2, 2)).eval()
    with pytest.warns(RuntimeWarning, match=r"no ReLU.*it ran silu ×1, gelu ×1|no ReLU.*it ran gelu ×1, silu ×1"):
        explain.GuidedBackprop(model).explain(torch.randn(1, 3, 6, 6))


@pytest.mark.parametrize("method, guided", [(explain.GuidedBackprop, True), (explain.Deconvnet, False)])
def test_activation_checkpointing_in_the_models_forward(method, guided):
    """torch.utils.checkpoint recomputes the block with plain ReLUs in the backward pass: it raised a
    CheckpointError (the saved tensors' metadata differed); the map now equals the uncheckpointed model's."""
    torch.manual_seed(0)
    plain = TwoLayerNet().eval()
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpointed = True
    x = torch.randn(2, 3, 8, 8)
    result = method(checkpointed, normalize=None).explain(x, target=[1, 3])
    expected = torch.cat([by_hand(plain, x[n:n + 1], t, guided) for n, t in enumerate([1, 3])])
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-4, atol=1e-9)


def test_in_place_relu_on_a_view_and_two_targets():
    """relu_ on a channel slice (a view): the slice's mask, kept across two backward passes (topk=2)."""
    torch.manual_seed(0)

    class ViewNet(TwoLayerNet):
        def block(self, x):
            hidden = self.conv1(x)
            hidden[:, :3].relu_()
            hidden = torch.cat([hidden[:, :3], F.relu(hidden[:, 3:])], 1)
            return torch.relu(self.conv2(hidden))

    model, x = ViewNet().eval(), torch.randn(2, 3, 8, 8)
    result = explain.GuidedBackprop(model, normalize=None).explain(x, topk=2)
    for k in range(2):
        targets = torch.as_tensor(result.targets)[:, k].tolist()
        expected = torch.cat([by_hand(model, x[n:n + 1], t, True) for n, t in enumerate(targets)])
        torch.testing.assert_close(result.attributions[:, k], expected, rtol=1e-4, atol=1e-9)


def test_the_rule_stays_in_the_calling_thread(case):
    """Guided backprop and saliency on one model in two threads at once: each gets its own map."""
    model, x, targets = case
    model, x = model.float(), x.float()
    expected = {
        explain.GuidedBackprop: torch.cat([by_hand(model, x[n:n + 1], t, True) for n, t in enumerate(targets)]),
        explain.Saliency: explain.Saliency(model, normalize=None).explain(x, target=targets).attributions[:, 0],
    }
    errors: list[str] = []

    def work(method):
        explainer = method(model, normalize=None)
        for _ in range(15):
            got = explainer.explain(x, target=targets).attributions[:, 0]
            if not torch.allclose(got, expected[method], rtol=1e-4, atol=1e-9):
                errors.append(method.__name__)

    threads = [threading.Thread(target=work, args=(method,)) for method in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert not torch.allclose(expected[explain.GuidedBackprop], expected[explain.Saliency])


def test_no_grad_and_inference_mode_callers_and_the_model_left_as_found(case):
    model, x, targets = case
    model, x = model.float(), x.float()
    model.train()
    model.conv1.weight.requires_grad_(False)
    state = copy.deepcopy(model.state_dict())
    expected = torch.cat([by_hand(model, x[n:n + 1], t, True) for n, t in enumerate(targets)])
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            result = explain.GuidedBackprop(model, normalize=None).explain(x, target=targets)
        torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-4, atol=1e-9)
    assert model.training and not model.conv1.weight.requires_grad and model.conv2.weight.requires_grad
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_a_relu_network_with_sigmoid_gates_and_a_sigmoid_output_is_not_warned_of() -> None:
    """Sigmoid and tanh are gates (squeeze-and-excitation) or an output squashing in a ReLU network, not a ReLU's
    replacement: the papers' rule leaves them plain, and a map guided at every ReLU is no half-guided map."""
    torch.manual_seed(0)
    conv, head = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4, 3)

    class Gated(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(conv(x))
            hidden = hidden * torch.sigmoid(hidden.mean((2, 3), keepdim=True))  # an SE gate
            return torch.sigmoid(head(hidden.mean((2, 3))))  # a multi-label output

    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.GuidedBackprop(Gated().eval()).explain(x, target=[0, 1])
