"""Hidden units as targets: explain.Channel and explain.Neuron against autograd by hand (a plain forward
hook records the unit's layer, torch.autograd.grad differentiates its value) and against Captum's
Neuron* methods."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import assert_state_equal, hook_count, model_state

import explain

pytestmark = [pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients"),
              pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU")]  # Captum's notices


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval(), torch.randn(3, 3, 64, 64)


def layer_outputs(model, names, x):
    """The outputs of the named layers in one forward (plain hooks, by hand; copies, safe from in-place ops)."""
    modules = dict(model.named_modules())
    stash = {}
    handles = [modules[name].register_forward_hook(lambda m, a, out, name=name: stash.__setitem__(name, out.clone()))
               for name in names]
    try:
        output = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return output, stash


def input_gradient_of(model, x, layer, value_of):
    """∂(Σ_n value_of(layer output)[n]) / ∂x, by hand."""
    inputs = x.clone().requires_grad_(True)
    _, stash = layer_outputs(model, [layer], inputs)
    (gradient,) = torch.autograd.grad(value_of(stash[layer]).sum(), inputs)
    return gradient


UNITS = [
    ("channel mean", explain.Channel("layer3", 17), lambda out: out[:, 17].mean(dim=(1, 2))),
    ("channel at a position", explain.Channel("layer3", 17, position=(1, 2)), lambda out: out[:, 17, 1, 2]),
    ("neuron", explain.Neuron("layer3", (5, 0, 3)), lambda out: out[:, 5, 0, 3]),
    ("neuron before an in-place add and ReLU", explain.Neuron("layer4.1.bn2", (7, 1, 1)),
     lambda out: out[:, 7, 1, 1]),
]


@pytest.mark.parametrize("bound", [False, True], ids=["unit given", "unit bound by the caller"])
@pytest.mark.parametrize("unit, value_of", [case[1:] for case in UNITS], ids=[case[0] for case in UNITS])
def test_saliency_of_a_unit_is_the_gradient_of_its_value(unit, value_of, bound, resnet):
    model, x = resnet
    if bound:
        with unit.bind(model) as target:
            result = explain.Saliency(model).explain(x, target=target)
    else:
        result = explain.Saliency(model).explain(x, target=unit)
    torch.testing.assert_close(result.attributions[:, 0], input_gradient_of(model, x, unit.layer, value_of))
    _, stash = layer_outputs(model, [unit.layer], x)
    torch.testing.assert_close(result.scores[:, 0], value_of(stash[unit.layer]))
    assert result.targets is None and result.maps.shape == (3, 64, 64)


def gradcam_of_unit_by_hand(model, x, cam_layer, unit_layer, value_of):
    """Grad-CAM at ``cam_layer`` of a unit's value: the layers' outputs by plain hooks, the gradient by autograd."""
    modules = dict(model.named_modules())
    stash = {}

    def keep(name):
        def hook(module, args, output):
            stash[name] = output
            return output.clone()  # later in-place ops change the clone

        return hook

    handles = [modules[name].register_forward_hook(keep(name)) for name in dict.fromkeys([cam_layer, unit_layer])]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    a = stash[cam_layer]
    (g,) = torch.autograd.grad(value_of(stash[unit_layer]).sum(), a)
    cam = (g.mean(dim=(2, 3), keepdim=True) * a).sum(1, keepdim=True).detach()
    return F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


@pytest.mark.parametrize("cam_layer", ["layer2", "layer3"])
def test_grad_cam_of_a_channel_binds_the_unit_itself(cam_layer, resnet):
    model, x = resnet
    before = model_state(model)
    result = explain.GradCAM(model, cam_layer, normalize=None, relu=False).explain(x, target=explain.Channel("layer3",
                                                                                                            17))
    expected = gradcam_of_unit_by_hand(model, x, cam_layer, "layer3", lambda out: out[:, 17].mean(dim=(1, 2)))
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-4, atol=1e-6)
    assert_state_equal(before, model_state(model))


def test_k_units_per_image_shared_or_per_image(resnet):
    model, x = resnet
    method = explain.GradCAM(model, "layer2", normalize=None, relu=False)
    shared = method.explain(x, target=explain.Channel("layer3", [17, 4]))
    assert shared.maps.shape == (3, 2, 64, 64)
    for k, channel in enumerate([17, 4]):
        torch.testing.assert_close(shared.raw_maps[:, k], method.explain(x, target=explain.Channel("layer3",
                                                                                                   channel)).raw_maps)
    per_image = method.explain(x, target=explain.Channel("layer3", [[17, 4], [4, 9], [9, 17]]))
    for n, channels in enumerate([[17, 4], [4, 9], [9, 17]]):
        for k, channel in enumerate(channels):
            expected = method.explain(x[n : n + 1], target=explain.Channel("layer3", channel)).raw_maps[0]
            torch.testing.assert_close(per_image.raw_maps[n, k], expected, rtol=1e-4, atol=1e-6)
    neurons = method.explain(x, target=explain.Neuron("layer3", [(17, 0, 0), (4, 3, 3)]))
    assert neurons.maps.shape == (3, 2, 64, 64)
    _, stash = layer_outputs(model, ["layer3"], x)
    torch.testing.assert_close(neurons.scores, torch.stack([stash["layer3"][:, 17, 0, 0], stash["layer3"][:, 4, 3, 3]],
                                                           dim=1))


def test_guided_backprop_and_integrated_gradients_of_a_unit(resnet):
    model, x = resnet
    unit = explain.Neuron("layer3", (5, 0, 3))
    with unit.bind(model) as target:
        guided = explain.GuidedBackprop(model).explain(x, target=target)
        ig = explain.IntegratedGradients(model, steps=8).explain(x, target=target)
    plain = input_gradient_of(model, x, "layer3", lambda out: out[:, 5, 0, 3])
    assert not torch.allclose(guided.attributions[:, 0], plain)  # the guided rule applies
    captum = pytest.importorskip("captum.attr")
    reference = captum.NeuronGuidedBackprop(model, model.layer3).attribute(x, neuron_selector=(5, 0, 3))
    torch.testing.assert_close(guided.attributions[:, 0], reference)
    by_hand = torch.zeros_like(x)
    for alpha in (torch.arange(8) + 0.5) / 8:  # midpoint rule, zero baseline
        by_hand += input_gradient_of(model, alpha * x, "layer3", lambda out: out[:, 5, 0, 3]) / 8
    torch.testing.assert_close(ig.attributions[:, 0], x * by_hand, rtol=1e-4, atol=1e-6)


def test_captum_neuron_gradient_and_integrated_gradients_agree(resnet):
    captum = pytest.importorskip("captum.attr")
    model, x = resnet
    for unit, selector in [(explain.Neuron("layer3", (5, 0, 3)), (5, 0, 3)),
                           (explain.Channel("layer3", 17), lambda out: out[:, 17].mean(dim=(1, 2)))]:
        with unit.bind(model) as target:
            saliency = explain.Saliency(model).explain(x, target=target)
            ig = explain.IntegratedGradients(model, steps=16, rule="gausslegendre").explain(x, target=target)
        reference = captum.NeuronGradient(model, model.layer3).attribute(x, neuron_selector=selector)
        torch.testing.assert_close(saliency.attributions[:, 0], reference)
        reference = captum.NeuronIntegratedGradients(model, model.layer3).attribute(
            x, neuron_selector=selector, n_steps=16, method="gausslegendre")
        torch.testing.assert_close(ig.attributions[:, 0], reference, rtol=1e-4, atol=1e-5)


def test_units_are_checked_and_explained_when_misused(resnet):
    model, x = resnet
    with pytest.raises(TypeError, match="bind"):  # a unit used outside a call, on an output alone
        explain.Channel("layer3", 17)(model(x))
    with pytest.raises(ValueError, match="out of range"):
        explain.GradCAM(model, "layer2").explain(x, target=explain.Channel("layer3", 999))
    with pytest.raises(ValueError, match="needs 3 indices"):
        explain.GradCAM(model, "layer2").explain(x, target=explain.Neuron("layer3", (1, 2)))
    with pytest.raises(explain.LayerNotRunError, match="ran 2 times"):
        explain.GradCAM(model, "layer2").explain(x, target=explain.Channel("layer3.0.relu", 1))
    with pytest.raises(ValueError, match="shared by every image"), explain.Channel("layer3", [[1], [2], [3]]).bind(
            model) as target:
        explain.IntegratedGradients(model, steps=2).explain(x, target=target)
    with pytest.raises(ValueError, match="same number"):
        explain.Channel("layer3", [[1, 2], [3]])
    with pytest.raises(TypeError, match="a unit is an int or a tuple"):
        explain.Neuron("layer3", "a")
    assert hook_count(model) == 0


def test_a_bound_unit_is_undone_with_its_block(resnet):
    model, x = resnet
    before = model_state(model)
    with explain.Neuron("layer3", (1, 1, 1)).bind(model) as target:
        assert hook_count(model) == 2  # the model's start of a forward, the unit's layer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            explain.ScoreCAM(model, "layer4", progress=False, batch_size=256).explain(x[:1], target=target)
    assert_state_equal(before, model_state(model))
    with pytest.raises(RuntimeError, match="has ended"):
        target(model(x))
