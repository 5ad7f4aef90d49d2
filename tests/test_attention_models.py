"""Attention recorded on five model families, checked against attention computed by hand.

For each family, a tiny model with random weights (no download) and a by-hand version of its
attention layer, built from the layer's own projection weights: A = softmax(QKᵀ/√d) with
``retain_grad()``. The tests replace each attention layer's output by the by-hand one (a
forward hook written here, in the test), so autograd through this eager re-implementation gives
∂score/∂A independently of ``explain``. The other test files import the builders from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import explain

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def heads_by_hand(q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float | None = None):
    """(N, T, D) projections → ((N, T, D) attention output, (N, heads, T, T) probabilities with
    retained gradient), by the formula."""
    count, tokens, dim = q.shape
    head_dim = dim // heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale

    def split(tensor: Tensor) -> Tensor:
        return tensor.reshape(count, tokens, heads, head_dim).transpose(1, 2)

    probabilities = torch.softmax(split(q) @ split(k).transpose(-2, -1) * scale, dim=-1)
    if probabilities.requires_grad:
        probabilities.retain_grad()
    return (probabilities @ split(v)).transpose(1, 2).reshape(count, tokens, dim), probabilities


@dataclass
class Family:
    """A tiny model of one family: ``build()`` → model; ``size``: input side in pixels;
    ``attention_layers(model)`` → the attention modules in order; ``by_hand(module, args, kwargs,
    stash)`` → the module's output computed by hand (appending A to ``stash``); ``names``: the
    recorded module names; ``logits(output)`` → (N, classes)."""

    build: Callable[[], nn.Module]
    size: int
    attention_layers: Callable[[nn.Module], list]
    by_hand: Callable
    names: list
    logits: Callable = lambda output: output
    prefix: int = 1


def multihead_by_hand(module: nn.MultiheadAttention, args, kwargs, stash):
    x = args[0]  # batch first, self-attention
    q, k, v = F.linear(x, module.in_proj_weight, module.in_proj_bias).chunk(3, dim=-1)
    output, probabilities = heads_by_hand(q, k, v, module.num_heads)
    stash.append(probabilities)
    return module.out_proj(output), None


def torchvision_vit() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=32, num_classes=5)
    nn.init.normal_(model.heads.head.weight, std=0.5)  # torchvision initialises it to zero
    return model.eval()


def timm_vit(fused: bool = True, class_token: bool = True) -> nn.Module:
    torch.manual_seed(0)
    options = {} if class_token else {"class_token": False, "global_pool": "avg"}
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=48, depth=2, num_classes=5,
                              **options)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model.eval()


def timm_by_hand(module, args, kwargs, stash):
    x = args[0]
    q, k, v = module.qkv(x).chunk(3, dim=-1)
    output, probabilities = heads_by_hand(q, k, v, module.num_heads)
    stash.append(probabilities)
    return module.proj(output)


def hf_vit(implementation: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification._from_config(config, attn_implementation=implementation).eval()


def hf_by_hand(output_projection: str):
    def by_hand(module, args, kwargs, stash):
        x = args[0] if args else kwargs["hidden_states"]
        heads = module.config.num_attention_heads
        output, probabilities = heads_by_hand(module.q_proj(x), module.k_proj(x), module.v_proj(x), heads)
        stash.append(probabilities)
        return getattr(module, output_projection)(output), probabilities

    return by_hand


def hf_clip(implementation: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4),
        projection_dim=16)
    return transformers.CLIPModel._from_config(config, attn_implementation=implementation).eval()


class ImageEmbedding(nn.Module):
    """A CLIP model's image tower as a model: pixels → (N, projection_dim) image embeddings."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.clip.get_image_features(pixel_values=pixel_values).pooler_output


class TokenEncoder(nn.Module):
    """Patches → class token + tokens → nn.TransformerEncoder (with dropout) → head on the class token."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 5):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, 8, stride=8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1)
        return self.head(self.encoder(tokens)[:, 0])


def token_encoder() -> nn.Module:
    torch.manual_seed(0)
    return TokenEncoder().eval()


FAMILIES = {
    "torchvision-vit": Family(torchvision_vit, 32, lambda m: [layer.self_attention for layer in m.encoder.layers],
                              multihead_by_hand, [f"encoder.layers.encoder_layer_{i}.self_attention" for i in (0, 1)]),
    "timm-fused": Family(timm_vit, 48, lambda m: [block.attn for block in m.blocks], timm_by_hand,
                         ["blocks.0.attn", "blocks.1.attn"]),
    "timm-eager": Family(lambda: timm_vit(fused=False), 48, lambda m: [block.attn for block in m.blocks],
                         timm_by_hand, ["blocks.0.attn", "blocks.1.attn"]),
    "timm-no-class-token": Family(lambda: timm_vit(class_token=False), 48, lambda m: [b.attn for b in m.blocks],
                                  timm_by_hand, ["blocks.0.attn", "blocks.1.attn"], prefix=0),
    "hf-vit-sdpa": Family(lambda: hf_vit("sdpa"), 32, lambda m: [layer.attention for layer in m.vit.layers],
                          hf_by_hand("o_proj"), ["vit.layers.0.attention", "vit.layers.1.attention"],
                          lambda output: output.logits),
    "hf-vit-eager": Family(lambda: hf_vit("eager"), 32, lambda m: [layer.attention for layer in m.vit.layers],
                           hf_by_hand("o_proj"), ["vit.layers.0.attention", "vit.layers.1.attention"],
                           lambda output: output.logits),
    "hf-clip-image-tower": Family(lambda: ImageEmbedding(hf_clip()), 32,
                                  lambda m: [layer.self_attn for layer in m.clip.vision_model.encoder.layers],
                                  hf_by_hand("out_proj"),
                                  [f"clip.vision_model.encoder.layers.{i}.self_attn" for i in (0, 1)]),
    "transformer-encoder": Family(token_encoder, 32, lambda m: [layer.self_attn for layer in m.encoder.layers],
                                  multihead_by_hand, [f"encoder.layers.{i}.self_attn" for i in (0, 1)]),
}

# The architectures at their real size (random weights, 224 px), for the recording test alone: the
# tiny configurations above run the same code paths and serve the slower method tests.
def torchvision_vit_b_16() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(weights=None)
    nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision initialises it to zero
    return model.eval().requires_grad_(False)  # no parameter gradients: the input's path alone


def timm_vit_small_full(fused: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model.eval().requires_grad_(False)


FULL_SIZE = {
    "torchvision-vit_b_16": Family(torchvision_vit_b_16, 224,
                                   lambda m: [layer.self_attention for layer in m.encoder.layers], multihead_by_hand,
                                   [f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(12)]),
    "timm-vit_small_patch16_224-fused": Family(timm_vit_small_full, 224, lambda m: [b.attn for b in m.blocks],
                                               timm_by_hand, [f"blocks.{i}.attn" for i in range(12)]),
    "timm-vit_small_patch16_224-eager": Family(lambda: timm_vit_small_full(fused=False), 224,
                                               lambda m: [b.attn for b in m.blocks], timm_by_hand,
                                               [f"blocks.{i}.attn" for i in range(12)]),
}


def score_of(family: Family, output, targets: list) -> Tensor:
    logits = family.logits(output)
    return logits[torch.arange(len(targets)), torch.tensor(targets)].sum()


def run_by_hand(family: Family, model: nn.Module, x: Tensor, targets=None):
    """The model's output with every attention layer computed by hand, and the by-hand probabilities
    (with their gradients of the targets' summed scores when targets are given)."""
    stash: list[Tensor] = []
    handles = [layer.register_forward_hook(lambda module, args, kwargs, output: family.by_hand(
        module, args, kwargs, stash), with_kwargs=True) for layer in family.attention_layers(model)]
    try:
        output = model(x)
    finally:
        for handle in handles:
            handle.remove()
    if targets is not None:
        score_of(family, output, targets).backward()
    return output, stash


@pytest.mark.parametrize("name", [*FAMILIES, *FULL_SIZE])
def test_recorded_attention_equals_attention_by_hand_and_the_output_stays_the_fused_one(name):
    family = FAMILIES.get(name) or FULL_SIZE[name]
    model = family.build()
    torch.manual_seed(1)
    x = torch.randn(3, 3, family.size, family.size, requires_grad=True)  # a path to A where weights are frozen
    targets = [0, 3, 1]
    with torch.no_grad():
        fused = family.logits(model(x))
    with explain.capture_attention(model, grads=True) as attention:
        output = model(x)
        score_of(family, output, targets).backward()
    assert torch._C._len_torch_function_stack() == 0
    recorded = family.logits(output).detach()
    assert ((recorded - fused).norm() / fused.norm()).item() <= 1e-5
    hand_output, by_hand = run_by_hand(family, model, x, targets)
    torch.testing.assert_close(family.logits(hand_output), fused, rtol=1e-5, atol=1e-5)
    assert attention.modules == family.names
    for probabilities, gradient, hand in zip(attention.probabilities, attention.grads, by_hand):
        assert probabilities.shape == hand.shape and not probabilities.requires_grad
        torch.testing.assert_close(probabilities, hand.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]), rtol=0, atol=1e-5)
        # float32 sums over 768 features in another order: an absolute floor scaled to the gradient
        torch.testing.assert_close(gradient, hand.grad, rtol=1e-4, atol=max(1e-6, 1e-4 * hand.grad.abs().max().item()))
        assert gradient.abs().sum() > 0
