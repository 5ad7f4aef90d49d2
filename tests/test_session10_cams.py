"""Session 10: CAM (ClassActivationMapping) on models whose classifier does not read the CAMs' default layer.

CAM weights a layer's maps by the classifier's rows, which is the class score only where the classifier reads that
layer averaged over positions. On transformers the family's default layer is the last block's first norm, which no
classifier reads: CAM used to return a map there silently (on a Swin 1.0 of its maximum away from Grad-CAM at the
same layer). Now the default is the layer the classifier pools (a Swin's final norm, NHWC), and where none is (a ViT
reads its class token, ConvNeXt normalises the pooled features) or a named layer is not it, the call raises.
"""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

import explain


def model_state(model: nn.Module) -> list[object]:
    return [(name, module.training, len(module._forward_hooks), len(module._forward_pre_hooks),
             len(module._backward_hooks)) for name, module in model.named_modules()] + [
        (name, parameter.requires_grad, parameter.grad is None) for name, parameter in model.named_parameters()]


def tiny_swin() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=2,
                             embed_dim=16, depths=(1, 1), num_heads=(1, 1), num_classes=5).eval()


def test_cam_default_layer_on_a_swin_is_the_pooled_final_norm_and_equals_the_map_by_hand():
    model = tiny_swin()
    x = torch.randn(2, 3, 32, 32)
    before = model_state(model)
    result = explain.ClassActivationMapping(model, relu=False, normalize=None).explain(x, target=[1, 4])
    assert result.layer == "norm"  # not "layers.1.blocks.0.norm1", which the classifier never reads
    store = {}
    handle = model.norm.register_forward_hook(lambda module, args, output: store.update(a=output.detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    maps = store["a"].permute(0, 3, 1, 2).double()  # timm's Swin stages are (N, h, w, C)
    weights = model.head.fc.weight.detach().double()[[1, 4]]
    by_hand = torch.einsum("nc,nchw->nhw", weights, maps)
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-5)
    assert model_state(model) == before
    # a CNN that pools its last stage keeps the family's default layer and its exact map
    cnn = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(2, 3, 64, 64)  # layer4's maps are 2 × 2
    result = explain.ClassActivationMapping(cnn, relu=False, normalize=None).explain(x, target=[0, 3])
    assert result.layer == "layer4"
    handle = cnn.layer4.register_forward_hook(lambda module, args, output: store.update(a=output.detach()))
    with torch.no_grad():
        cnn(x)
    handle.remove()
    by_hand = torch.einsum("nc,nchw->nhw", cnn.fc.weight.detach()[[0, 3]].double(), store["a"].double())
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-5)


def test_cam_refuses_a_layer_the_classifier_does_not_pool():
    swin = tiny_swin()
    x = torch.randn(2, 3, 32, 32)
    before = model_state(swin)
    with pytest.raises(ValueError, match=r"'head\.fc' does not read layer 'layers\.1\.blocks\.0\.norm1' averaged"):
        explain.ClassActivationMapping(swin, "layers.1.blocks.0.norm1").explain(x, target=1)
    assert model_state(swin) == before
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                            embed_dim=16, num_heads=1, num_classes=5).eval()  # the classifier reads the class token
    before = model_state(vit)
    with pytest.raises(ValueError, match="A ViT's classifier reads its class token"):
        explain.ClassActivationMapping(vit).explain(x, target=1)
    assert model_state(vit) == before
    # ConvNeXt normalises the pooled features (LayerNorm2d, Flatten, Linear): no layer is what the classifier reads
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=5).eval()
    with pytest.raises(ValueError, match=r"'head\.fc' does not read layer 'stages' averaged over positions"):
        explain.ClassActivationMapping(convnext).explain(torch.randn(1, 3, 64, 64), target=1)
