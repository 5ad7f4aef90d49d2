"""Attacks on the methods with the CNNs people use (torchvision and timm), built with random weights
(nothing is downloaded) at small inputs. Each test states the correct behaviour, checked against a hand
computation with plain autograd and hooks, and that the model is left exactly as found.
"""

from __future__ import annotations

import re
import warnings

import pytest
import timm
import torch
import torchvision
from test_zoo_attacks import assert_same_state, quiet, state
from torch import nn

import explain

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hand_gradcam(model: nn.Module, layer: str, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """Grad-CAM before the ReLU at ``layer``, (N, h, w), with a forward hook and torch.autograd.grad."""
    store = {}
    handle = dict(model.named_modules())[layer].register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    try:
        output = model(x)
    finally:
        handle.remove()
    activations = store["a"]
    (gradient,) = torch.autograd.grad(output[torch.arange(len(targets)), targets].sum(), activations)
    return (gradient.mean(dim=(2, 3), keepdim=True) * activations).sum(1).detach()


# --- The automatic layer at small inputs: not a branch inside a block that a bypass skips ------------------


def tv_inception_v3() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False, num_classes=10).eval()


def tv_shufflenet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=10).eval()


def timm_regnet() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("regnetx_002", pretrained=False, num_classes=10).eval()


SMALL_INPUTS = {
    # 96 px: Mixed_7a..7c are 1 × 1, Mixed_6e 4 × 4; the choice now is Mixed_7a.branch7x7x3_3, one of
    # Mixed_7a's three parallel branches (branch3x3 and the max-pool branch bypass it)
    "inception_v3-96px": (tv_inception_v3, 96, "Mixed_6e"),
    # 32 px: stage4 is 1 × 1; the choice now is stage4.0.branch2.2, which branch1 bypasses
    "shufflenet-32px": (tv_shufflenet, 32, "stage3"),
    # 32 px: s4 is 1 × 1; the choice now is s4.b1.conv1, which the block's shortcut bypasses
    "regnetx_002-32px": (timm_regnet, 32, "s3"),
}


@pytest.mark.parametrize("case", SMALL_INPUTS)
def test_automatic_layer_at_a_small_input_is_the_last_whole_stage_not_a_branch_inside_a_block(case):
    """When the last stage's output is 1 × 1 (inputs of 75-127 px for Inception-v3, 32 px for ShuffleNet
    and RegNet), the automatic layer is the last candidate with h, w ≥ 2 to finish, which is then a
    convolution inside the first block of the last stage, on one of its parallel paths: the other
    branches (Inception's branch3x3 and pool branch, ShuffleNet's branch1, RegNet's shortcut) carry
    evidence that bypasses it, so its Grad-CAM sees only part of what the class depends on; CAM raises
    and Ablation-CAM cannot replay the tail from it. The layer a practitioner picks, and what the
    documented rule intends ("the last stage before global pooling ... a stage wins over its last
    block"), is the last stage whose output everything downstream is computed from, with maps ≥ 2 × 2."""
    build, size, expected = SMALL_INPUTS[case]
    model = build()
    torch.manual_seed(1)
    x = torch.randn(2, 3, size, size)
    before = state(model)
    got = quiet(lambda: explain.GradCAM(model, relu=False, normalize=None).explain(x, target=[1, 4]))
    assert_same_state(before, state(model))
    assert got.layer == expected
    expected_maps = hand_gradcam(model, expected, x, [1, 4])
    scale = expected_maps.abs().amax(dim=(1, 2), keepdim=True)  # random weights: tiny activations
    assert (scale > 0).all()
    torch.testing.assert_close(got.low_res_maps[0][:, 0] / scale, expected_maps / scale, atol=1e-5, rtol=1e-4)


# --- FEM on maps of ≤ 5 positions: blank by construction, and the warning gives a wrong cause ------------


def test_fem_on_a_2x2_layer_warns_that_the_k_sigma_threshold_cannot_be_reached_not_that_activations_are_zero():
    """FEM keeps A_k > μ_k + k σ_k (population σ). Over n positions no value exceeds the mean by more
    than √(n − 1) σ, so with k = 2 every map of ≤ 5 positions is zero by construction: on every CNN at
    64 px (2 × 2 at the last stage: resnet18, densenet, efficientnet, convnext, vgg, ...) FEM returns a
    blank map. The activations are not zero, yet the warning says "e.g. the layer's activations are all
    zero for this image". The promise is a warning that says why: here, that k σ cannot be exceeded with
    so few positions (a larger input, an earlier layer or a smaller k gives a map)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 64, 64)
    store = {}
    handle = model.layer4.register_forward_hook(lambda m, i, o: store.__setitem__("a", o))
    with torch.no_grad():
        model(x)
    handle.remove()
    activations = store["a"]
    assert activations.shape[-2:] == (2, 2) and activations.abs().max() > 0.1  # not zero activations
    # by hand: no position of any channel passes the 2-sigma threshold
    mean = activations.mean(dim=(2, 3), keepdim=True)
    std = activations.std(dim=(2, 3), keepdim=True, correction=0)
    assert not (activations > mean + 2 * std).any()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = explain.FEM(model, "layer4").explain(x, target=3)
    assert (e.raw_maps == 0).all()
    messages = [str(w.message) for w in caught if "FEM" in str(w.message)]
    assert messages, "a blank FEM map must come with a warning"
    assert not any("activations are all zero" in m for m in messages), messages
    assert any(re.search(r"\bk\b|σ|sigma|standard deviation", m) for m in messages), messages


# --- Models in train mode with auxiliary outputs: the maps of eval mode, the model as found --------------


@pytest.mark.parametrize("method", ["gradcam", "integratedgradients", "deeplift"])
def test_googlenet_in_train_mode_with_aux_logits_gives_the_eval_maps_and_is_left_as_found(method):
    """GoogLeNet in train mode returns a namedtuple (logits, aux2, aux1) and its BatchNorms update their
    running statistics on every forward. A call must run it in eval mode (the plain logits), give the
    eval-mode model's maps, and leave every flag and buffer bit-identical."""
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False, num_classes=10)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    options = {"integratedgradients": dict(steps=4)}.get(method, {})
    cls = explain.get_method(method)
    model.eval()
    expected = quiet(lambda: cls(model, normalize=None, **options).explain(x, target=[1, 4])).raw_maps
    model.train()
    model.inception5b.branch1.bn.eval()  # mixed modes, as with frozen BatchNorm
    before = state(model)
    got = quiet(lambda: cls(model, normalize=None, **options).explain(x, target=[1, 4])).raw_maps
    assert_same_state(before, state(model))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    if method == "deeplift":  # completeness by hand: Σ attributions = y(x) − y(0)
        model.eval()
        e = quiet(lambda: explain.DeepLift(model, normalize=None).explain(x, target=[1, 4]))
        with torch.no_grad():
            change = model(x)[[0, 1], [1, 4]] - model(torch.zeros_like(x))[[0, 1], [1, 4]]
        torch.testing.assert_close(e.attributions.sum(dim=(2, 3, 4))[:, 0], change, atol=1e-4, rtol=1e-3)
