"""Session 13, attention methods: the rollouts' own arithmetic under a caller's ``torch.autocast`` and on a float64
model, against rollouts worked out by hand (Abnar & Zuidema: Â = mean_h A + I, rows renormalised, R ← Â R; Chefer et
al.: R ← R + mean_h (∇A ⊙ A)⁺ R) in float64 from the attention the model itself computed, read through timm's
attention dropout (an identity in eval mode)."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
from torch import Tensor, nn

import explain
from explain.methods.transformer_attribution import RelevanceWeightedRollout

timm = pytest.importorskip("timm")


def vit(depth: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random timm ViT on 32 × 32 inputs (a 4 × 4 grid of 8-pixel patches), eager attention."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=depth,
                              num_heads=2, embed_dim=32, mlp_ratio=2, num_classes=5).eval()
    for block in model.blocks:
        block.attn.fused_attn = False
    return model.to(dtype)


def attention_by_hand(model: nn.Module, x: Tensor, target: int) -> list[Tensor]:
    """Each block's attention probabilities (N, heads, T, T) as the model computed them (in the caller's autocast,
    if any), with ``.grad`` = ∂(Σ_images logit[target])/∂A; on a copy of the model."""
    copied = copy.deepcopy(model)
    probabilities: list[Tensor] = []

    def keep(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        output.retain_grad()
        probabilities.append(output)

    for block in copied.blocks:
        block.attn.attn_drop.register_forward_hook(keep)
    copied(x)[:, target].sum().backward()
    return probabilities


def class_rows(probabilities: list[Tensor], gradient: bool) -> Tensor:
    """(N, 4, 4): the class token's row over the patches of the rollout (gradient=False) or of Chefer et al.'s
    gradient-weighted rollout (gradient=True), in float64."""
    count, tokens = probabilities[0].shape[0], probabilities[0].shape[-1]
    identity = torch.eye(tokens, dtype=torch.float64)
    relevance = identity.expand(count, tokens, tokens)
    for block in probabilities:
        attention = block.detach().double()
        if gradient:
            relevance = relevance + (block.grad.double() * attention).clamp(min=0).mean(dim=1) @ relevance
        else:
            with_residual = attention.mean(dim=1) + identity
            relevance = (with_residual / with_residual.sum(dim=-1, keepdim=True)) @ relevance
    return relevance[:, 0, 1:].reshape(count, 4, 4)


@pytest.mark.parametrize("method", ["AttentionRollout", "GradientAttentionRollout"])
def test_under_bf16_autocast_the_rollout_of_the_models_attention_is_computed_in_float32(method):
    model = vit()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probabilities = attention_by_hand(model, x, target=3)
        maps = getattr(explain, method)(model, normalize=None).explain(x, target=3).low_res_maps[0][:, 0]
    assert probabilities[0].dtype == torch.bfloat16  # the model's attention is the caller's bfloat16 ...
    expected = class_rows(probabilities, gradient=method == "GradientAttentionRollout")
    assert maps.dtype == torch.float32  # ... its rollout is not: before, bfloat16 products (up to 4e-3 of the max)
    torch.testing.assert_close(maps.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@contextlib.contextmanager
def spied_rollout() -> Iterator[list[tuple[list[list[Tensor]], list[list[Tensor]], Tensor]]]:
    """Records each call of Transformer attribution's rollout: (relevances, gradients, result)."""
    calls: list[tuple[list[list[Tensor]], list[list[Tensor]], Tensor]] = []
    original = RelevanceWeightedRollout.__dict__["_rollout"]

    def spy(relevances, gradients, at_least=torch.float32):  # type: ignore[no-untyped-def]
        result = original.__func__(relevances, gradients, at_least)
        calls.append((relevances, gradients, result))
        return result

    RelevanceWeightedRollout._rollout = staticmethod(spy)  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        RelevanceWeightedRollout._rollout = original  # type: ignore[method-assign]


@pytest.mark.parametrize("method", ["TransformerAttribution", "AttnLRPRollout"])
def test_under_bf16_autocast_transformer_attributions_rollout_is_the_float32_product_of_its_blocks(method):
    model = vit(depth=6)
    torch.manual_seed(2)
    x = torch.randn(2, 3, 32, 32)
    with spied_rollout() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        getattr(explain, method)(model, normalize=None).explain(x, target=1)
    (relevances, gradients, result), = calls
    count, tokens = result.shape[0], result.shape[-1]
    expected = torch.eye(tokens, dtype=torch.float64).expand(count, tokens, tokens)
    for relevance, gradient in zip(relevances[0], gradients[0]):  # R ← R + mean_h (∇A ⊙ R_A)⁺ R, in float64
        expected = expected + (gradient.double() * relevance.double()).clamp(min=0).mean(dim=1) @ expected
    assert result.dtype == torch.float32
    # the class token's row over the patches, the map; before: each product in bfloat16 (the map 2e-3 of its maximum
    # away on a 12-block ViT)
    expected = expected[:, 0, 1:]
    torch.testing.assert_close(result[:, 0, 0, 1:].double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("method", ["AttentionRollout", "GradientAttentionRollout"])
def test_a_float64_model_gets_a_float64_rollout_equal_to_the_one_by_hand(method):
    model = vit(depth=3, dtype=torch.float64)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    probabilities = attention_by_hand(model, x, target=2)
    maps = getattr(explain, method)(model, normalize=None).explain(x, target=2).low_res_maps[0][:, 0]
    expected = class_rows(probabilities, gradient=method == "GradientAttentionRollout")
    assert maps.dtype == torch.float64  # as TransformerAttribution's; before: float32 (rounded at 6e-8)
    torch.testing.assert_close(maps, expected, rtol=1e-12, atol=1e-15)

