"""Fixes for a hostile test of the attribution family: options that were silently ignored (GuidedGradCAM's layer
beside a CAM instance, SmoothGrad's reduce beside a wrapped explainer), non-float callable targets, a false
autocast precision warning on a float64 model, XRAI's empty-map reason and meta baselines, compare(methods=[])."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import explain


def small_net(stride_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if stride_layer:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5)).eval()
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5)).eval()


def test_guided_gradcam_refuses_a_layer_the_cam_instance_does_not_use():
    net = small_net(stride_layer=True)
    with pytest.raises(ValueError, match=r"layer \['0'\].*GradCAM built with layer\(s\) \['3'\].*Drop layer="):
        explain.GuidedGradCAM(net, "0", cam=explain.GradCAM(net, "3"))
    with pytest.raises(ValueError, match="no layer"):
        explain.GuidedGradCAM(net, "0", cam=explain.GradCAM(net))
    # the same layer, by name or module, is accepted and gives the layer's Guided Grad-CAM
    x = torch.randn(1, 3, 16, 16)
    given = explain.GuidedGradCAM(net, net[3], cam=explain.GradCAM(net, "3")).explain(x, target=0)
    assert given.layer == "3"
    assert torch.equal(given.attributions, explain.GuidedGradCAM(net, "3").explain(x, target=0).attributions)


@pytest.mark.parametrize("method", [explain.SmoothGrad, explain.VarGrad, explain.SmoothGradSquared])
def test_smoothgrad_refuses_a_reduce_the_wrapped_explainer_does_not_use(method):
    net = small_net()
    with pytest.raises(ValueError, match=r"reduce='sum'.*own reduce='maxabs'.*Saliency\(model, reduce='sum'\)"):
        method(explain.Saliency(net), reduce="sum", samples=2)
    with pytest.raises(ValueError, match="GradCAM reduces no colour channels"):
        method(explain.GradCAM(net, "0"), reduce="sum", samples=2)


def test_smoothgrad_with_the_wrapped_explainers_reduce_sums_signed_gradients():
    """noise=0: every copy is the image, so the map is the signed channel sum of the input gradient, by hand."""
    net = small_net()
    x = torch.randn(1, 3, 16, 16)
    smooth = explain.SmoothGrad(explain.Saliency(net, reduce="sum"), reduce="sum", noise=0.0, samples=3)
    got = smooth.explain(x, target=0).raw_maps
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(net(leaf)[0, 0], leaf)
    assert torch.allclose(got.reshape(16, 16), gradient[0].sum(dim=0), rtol=1e-5, atol=1e-9)
    assert bool((got < 0).any())  # signed: not max |·|


@pytest.mark.parametrize("method", [explain.Saliency, explain.DeepLift])
@pytest.mark.parametrize(("score", "dtype"), [(lambda o: (o[:, 0] * 10).long(), "int64"),
                                              (lambda o: o[:, 0] > 0, "bool")])
def test_callable_target_with_non_float_scores_is_refused(method, score, dtype):
    net = small_net()
    with pytest.raises(TypeError, match=f"must return floating-point scores; got {dtype}.*\\.float\\(\\)"):
        method(net).explain(torch.randn(2, 3, 12, 12), target=score)


def test_float64_model_under_bfloat16_autocast_has_no_precision_warning_and_the_same_maps():
    net = small_net().double()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    for make in (lambda: explain.Saliency(net), lambda: explain.IntegratedGradients(net, steps=4)):
        outside = make().explain(x, target=[0, 1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                inside = make().explain(x, target=[0, 1])
        assert [str(w.message) for w in caught] == []
        assert torch.equal(inside.attributions, outside.attributions)
        assert torch.equal(inside.raw_maps, outside.raw_maps)
    with pytest.warns(RuntimeWarning, match=r"ran in bfloat16 \(torch.autocast\)"):  # a float32 model does round
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explain.Saliency(small_net()).explain(x.float(), target=0)


def test_xrai_on_a_constant_image_blames_its_baselines():
    """A constant image equals its black (min) and white (max) baselines: every path has length 0."""
    net = small_net()
    with pytest.warns(RuntimeWarning) as caught:
        result = explain.XRAI(net, steps=4, min_pixel_diff=5, progress=False).explain(torch.full((1, 3, 32, 32), 0.3))
    messages = " ".join(str(w.message) for w in caught)
    assert "the baseline equals the image" in messages
    assert "activations" not in messages
    assert bool(result.raw_maps.eq(0).all())


def test_xrai_refuses_a_meta_baseline():
    with pytest.raises(ValueError, match=r"baselines\[1\] is on the meta device"):
        explain.XRAI(small_net(), baselines=["zeros", torch.zeros(3, 8, 8, device="meta")])


def test_compare_refuses_no_methods():
    with pytest.raises(ValueError, match=r"methods=\[\].*at least one"):
        explain.compare(small_net(), torch.rand(1, 3, 8, 8), [])
