"""CAM methods compute only what they need: no parameter gradient, no graph before the target layer."""

from __future__ import annotations

import pytest
import torch
import torchvision

import explain

CAMS = [cls for cls in explain.REGISTRY.values() if issubclass(cls, explain.CAM) and not cls.explains_instances]
FEW = {"sscam": {"samples": 2}, "iscam": {"steps": 2}, "sess": {"num_scales": 2}}


@pytest.mark.parametrize("method", CAMS, ids=lambda cls: cls.name)
def test_cams_compute_no_parameter_gradient_and_build_no_graph_before_the_layer(method):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, []).append((torch.is_grad_enabled(), output.requires_grad))
        return hook

    handles = [model.layer3.register_forward_hook(record("layer3")), model.fc.register_forward_hook(record("fc"))]
    try:
        options = {"progress": False} if "progress" in method.__init__.__code__.co_varnames else {}
        options.update(FEW.get(method.name, {}))  # the noisy Score-CAMs: few samples, the same code paths
        method(model, "layer4", **options).explain(torch.randn(2, 3, 64, 64), target=[1, 2])
    finally:
        for handle in handles:
            handle.remove()
    assert all(parameter.grad is None for parameter in model.parameters())
    # the layers before the target layer ran without building a graph
    assert seen["layer3"]
    assert all(not grad_enabled and not requires_grad for grad_enabled, requires_grad in seen["layer3"])
    first_fc = seen["fc"][0]
    assert first_fc == ((True, True) if method.uses_gradients else (False, False))
