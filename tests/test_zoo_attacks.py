"""Attacks on the methods with the models people use (timm, HuggingFace, torchvision), built tiny from
configs with random weights (nothing is downloaded). Each test states the correct behaviour: the map
a method gives equals the one computed by hand, or the one the same method gives on the same
function written another way (eager attention instead of fused, trainable instead of frozen
weights, no gradient checkpointing), and the model is left exactly as found.
"""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers
from torch import nn

import explain

transformers.logging.set_verbosity_error()

TIMM_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
HF_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8, num_labels=5)


def timm_vit(fused: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, **TIMM_VIT)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model.eval()


def hf_vit(attention: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(**HF_VIT, attn_implementation=attention)).eval()


def torchvision_vit() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=5)
    nn.init.normal_(model.heads.head.weight, std=0.1)  # torchvision's head starts at zero
    return model.eval()


def timm_swin() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=5, img_size=64,
                             patch_size=4, window_size=4, embed_dim=16, depths=(1, 1, 2, 1),
                             num_heads=(1, 1, 2, 2)).eval()


def hf_swin() -> nn.Module:
    torch.manual_seed(0)
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 2], num_heads=[1, 1, 2, 2], window_size=2,
        num_labels=5)).eval()


def images(size: int, count: int = 3) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(count, 3, size, size)


def state(model: nn.Module) -> dict:
    """Everything of the model that a call must leave as found, compared bit for bit."""
    found: dict = {}
    for name, module in model.named_modules():
        found["module:" + name] = (id(module), module.training, len(module._forward_hooks),
                                   len(module._forward_pre_hooks), len(module._backward_hooks),
                                   len(module._backward_pre_hooks), sorted(vars(module)))
    for name, parameter in model.named_parameters():
        found["parameter:" + name] = (parameter.detach().clone(), parameter.requires_grad, parameter.grad)
    for name, buffer in model.named_buffers():
        found["buffer:" + name] = buffer.detach().clone()
    return found


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if isinstance(old, torch.Tensor):
            assert torch.equal(old, new), key
        elif key.startswith("parameter:"):
            assert torch.equal(old[0], new[0]) and old[1:] == new[1:], key
        else:
            assert old == new, key


def quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call()


# --- ShapleyCAM on the fused attention of every library's ViT -------------------------------------------


@pytest.mark.parametrize("library", ["timm", "huggingface"])
def test_shapleycam_on_a_fused_attention_vit_equals_shapleycam_on_the_eager_attention(library):
    """ShapleyCAM needs a Hessian-vector product, a double backward pass; fused
    scaled_dot_product_attention on the CPU has no double backward. The fused model computes the same
    function as the eager one, so its map must be the eager model's (the call-scoped step-by-step
    attention that the attention methods already use gives it), not a RuntimeError from autograd."""
    x = images(32)

    def target(output):
        return output[:, 1] + output.log_softmax(1)[:, 1]  # the paper's ReST target
    if library == "timm":
        fused, eager = timm_vit(fused=True), timm_vit(fused=False)
    else:
        fused, eager = hf_vit("sdpa"), hf_vit("eager")
        eager.load_state_dict(fused.state_dict())
    expected = quiet(lambda: explain.ShapleyCAM(eager).explain(x, target=target))
    # not Grad-CAM's map: through attention the Hessian term is not zero
    assert (expected.maps - quiet(lambda: explain.GradCAM(eager).explain(x, target=target)).maps).abs().max() > 1e-2
    before = state(fused)
    got = quiet(lambda: explain.ShapleyCAM(fused).explain(x, target=target))
    assert_same_state(before, state(fused))
    assert got.layer == expected.layer
    torch.testing.assert_close(got.maps, expected.maps, atol=1e-4, rtol=1e-4)


# --- Gradient-weighted attention methods on a frozen ViT ------------------------------------------------


VITS = {"timm": timm_vit, "huggingface": hf_vit, "torchvision": torchvision_vit}


@pytest.mark.parametrize("method", [explain.GradientAttentionRollout, explain.TransformerAttribution,
                                    explain.AttnLRPRollout])
@pytest.mark.parametrize("library", VITS)
def test_gradient_attention_methods_on_a_frozen_vit_give_the_maps_of_the_trainable_one(library, method):
    """A frozen model (``model.requires_grad_(False)``, a linear probe, a deployed model) computes the same
    attention and the same ∂y/∂A. The docs promise that every method works on frozen models; these two
    record the attention in a forward pass on an input that does not require grad, so with frozen
    weights nothing is in the graph, ∂y/∂A is never computed and every map is blank."""
    model = VITS[library]()
    x = images(32)
    expected = quiet(lambda: method(model).explain(x, target=[0, 1, 2]))
    assert expected.maps.flatten(1).amax(1).min() > 0
    model.requires_grad_(False)
    before = state(model)
    got = quiet(lambda: method(model).explain(x, target=[0, 1, 2]))
    assert_same_state(before, state(model))
    torch.testing.assert_close(got.maps, expected.maps, atol=1e-5, rtol=1e-5)


def test_transformer_attribution_on_a_frozen_swin_gives_the_map_of_the_trainable_one():
    """The same as above for window attention (its own rollout, ``_window_rollout``)."""
    model = timm_swin()
    x = images(64)
    expected = quiet(lambda: explain.TransformerAttribution(model, normalize=None).explain(x, target=[0, 1, 2]))
    model.requires_grad_(False)
    got = quiet(lambda: explain.TransformerAttribution(model, normalize=None).explain(x, target=[0, 1, 2]))
    # the map is the uniform row of the residual plus what the attention adds; that part must survive
    # freezing (frozen, nothing is added and every map is exactly constant)
    def varying(maps):
        return maps - maps.mean(dim=(1, 2), keepdim=True)
    assert varying(expected.maps).abs().amax(dim=(1, 2)).min() > 0
    torch.testing.assert_close(varying(got.maps), varying(expected.maps),
                               atol=1e-3 * varying(expected.maps).abs().max().item(), rtol=0)


# --- FullGrad on models whose linear layers run on windows or patches --------------------------------------


def rescaled(values: torch.Tensor, dims: tuple) -> torch.Tensor:
    low = values.amin(dim=dims, keepdim=True)
    span = values.amax(dim=dims, keepdim=True) - low
    return torch.where(span > 0, (values - low) / torch.where(span > 0, span, 1.0), 0.0)


def fullgrad_by_hand(model: nn.Module, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """FullGrad as the docs define it: ψ(|x ⊙ ∂y/∂x|) summed over colours, plus, for every Conv2d with a
    bias (these models have no BatchNorm), Σ_c ψ(|b_c ∂y/∂z_c|) upsampled; ψ rescales to [0, 1]."""
    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.bias is not None]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda module, args, output: outputs.append((output, module.bias.detach())))
               for m in convolutions]
    try:
        inputs = x.clone().requires_grad_(True)
        logits = model(inputs)
        logits = getattr(logits, "logits", logits)
    finally:
        for handle in handles:
            handle.remove()
    score = logits[torch.arange(len(targets)), torch.tensor(targets)].sum()
    gradients = torch.autograd.grad(score, [inputs, *[output for output, _ in outputs]])
    result = rescaled((inputs * gradients[0]).detach().abs(), (1, 2, 3)).sum(1)
    for (_, bias), gradient in zip(outputs, gradients[1:]):
        terms = rescaled((gradient * bias.view(1, -1, 1, 1)).detach().abs(), (2, 3)).sum(1, keepdim=True)
        result = result + F.interpolate(terms, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    return result


@pytest.mark.parametrize("build", [timm_swin, hf_swin], ids=["timm-swin", "huggingface-swin"])
def test_fullgrad_on_swin_equals_fullgrad_by_hand(build):
    """Swin's attention and MLP linear layers run on (N × windows) rows; FullGrad adds their bias terms
    to its (N,) completeness sum and crashes with 'The size of tensor a (3) must match the size of tensor
    b (48)'. The map (input term plus the patch embedding's bias term) is well defined."""
    model = build()
    x = images(64)
    before = state(model)
    got = quiet(lambda: explain.FullGrad(model, normalize=None).explain(x, target=[0, 1, 2]))
    assert_same_state(before, state(model))
    torch.testing.assert_close(got.maps, fullgrad_by_hand(model, x, [0, 1, 2]), atol=1e-4, rtol=1e-4)


# --- timm's gradient checkpointing left on after fine-tuning -------------------------------------------------


@pytest.mark.parametrize("method", [explain.AttnLRP, explain.GradientAttentionRollout,
                                    explain.TransformerAttribution, explain.AttnLRPRollout, explain.LeGrad,
                                    explain.LRP, explain.DeepLift])
def test_a_timm_vit_with_gradient_checkpointing_gets_its_map_or_a_clear_error(method):
    """``model.set_grad_checkpointing()`` (timm; left on after fine-tuning) recomputes each block in the
    backward pass, outside the call's rules: the attention methods fail with torch's CheckpointError
    ('Recomputed values ... have different metadata'), LRP says the model changed an input in place, and
    DeepLIFT that the model's operations differ. The model computes the same function, so the map must
    be the one without checkpointing, or the error must say that checkpointing is the cause."""
    model = timm_vit()
    x = images(32)
    expected = quiet(lambda: method(model).explain(x, target=[0, 1, 2]))
    model.set_grad_checkpointing(True)
    before = state(model)
    try:
        got = quiet(lambda: method(model).explain(x, target=[0, 1, 2]))
    except Exception as error:  # a clear error is acceptable: it must name the cause and the fix
        assert type(error).__name__ != "CheckpointError"
        assert "checkpointing" in str(error), str(error)
    else:
        torch.testing.assert_close(got.maps, expected.maps, atol=1e-5, rtol=1e-5)
    assert_same_state(before, state(model))
    assert all(block is not None for block in model.blocks) and model.grad_checkpointing


# --- MobileViT: an error that recommends the method that raised it -----------------------------------------


@pytest.mark.parametrize("method", [explain.TransformerAttribution, explain.LeGrad])
def test_mobilevit_error_does_not_recommend_the_method_that_raised_it(method):
    """MobileViT folds its patches into the batch ((N × patch area) rows of attention). TransformerAttribution
    and LeGrad refuse it with the rollouts' message, 'this looks like window attention ... Use
    TransformerAttribution, AttnLRP or LeGrad, which read window attention': the user is sent to the
    method that has just refused. The message must name something that works (AttnLRP, GradCAM), not
    the method itself."""
    torch.manual_seed(0)
    model = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=5).eval()
    x = images(64)
    before = state(model)
    try:
        explanation = quiet(lambda: method(model).explain(x, target=[0, 1, 2]))
    except ValueError as error:
        advice = str(error).split("Use ", 1)[-1]
        assert method.__name__ not in advice, str(error)
    else:
        assert torch.isfinite(explanation.maps).all() and explanation.maps.flatten(1).amax(1).min() > 0
    assert_same_state(before, state(model))


# --- DeepLIFT through LayerNorm when the baseline's tokens are constant ------------------------------------------


def hf_mobilevit(image_size: int = 64, labels: int = 5) -> nn.Module:
    """HuggingFace MobileViT, tiny; re-initialised so that its logits depend on the image (its own init gives
    logits of exactly 0). Biases start at 0, as in most freshly built models."""
    torch.manual_seed(0)
    model = transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=image_size, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_labels=labels)).eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.normal_(module.weight, std=module.weight[0].numel() ** -0.5)
    return model


def test_deeplift_on_mobilevit_sums_to_the_score_change():
    """With the zero baseline every token reaching MobileViT's transformer LayerNorms is constant (variance 0):
    DeepLIFT's multipliers there grow by ~100× per norm, and the attributions sum to 1e28 (one image, returned
    with no warning) or overflow (the others, reported as 'a gradient or a score overflowed inside the model.
    Check the input's range', although the model's logits are ~0.03). The docs promise the sum of the
    attributions equals y(x) − y(x′) within 1e-6 in float64."""
    model = hf_mobilevit().double()
    x = images(64).double()
    with torch.no_grad():
        scores = model(x).logits[torch.arange(3), torch.tensor([0, 1, 2])]
        baseline = model(torch.zeros_like(x)).logits[torch.arange(3), torch.tensor([0, 1, 2])]
    assert scores.abs().max() < 1  # nothing overflows in the model itself
    explanation = quiet(lambda: explain.DeepLift(model, normalize=None).explain(x, target=[0, 1, 2]))
    total = explanation.attributions.flatten(2).sum(2)[:, 0]
    torch.testing.assert_close(total.double(), (scores - baseline).double(), atol=1e-5, rtol=1e-3)
