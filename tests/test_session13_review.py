"""Session 13, review: what the helpers' reports pointed at outside their files."""

from __future__ import annotations

import pytest
from torchvision.models import resnet18

import explain


def test_the_cam_base_class_is_refused_naming_the_cam_method_and_leaves_the_model_as_found():
    """Before, ``explain.CAM(model)`` (a user after Zhou et al.'s CAM) was built, and its call failed with "CAM
    defines neither channel_terms, layer_map nor layer_maps"."""
    model = resnet18(num_classes=3).train()
    flags = [parameter.requires_grad for parameter in model.parameters()]
    with pytest.raises(TypeError, match=r"explain\.CAM is the base class .* use explain\.ClassActivationMapping"):
        explain.CAM(model, "layer4")
    assert model.training and flags == [parameter.requires_grad for parameter in model.parameters()]
    assert not any(module._forward_hooks or module._backward_hooks for module in model.modules())
