"""The small vision transformer that the package ships, trained on ``explain.data.synthetic`` images.

A convolutional stem turns a 64×64 image into an 8×8 grid of 64-dimensional patch tokens
(8 px each); a class token and learned position embeddings go in front, then four pre-norm
transformer blocks with four heads whose attention is ``F.scaled_dot_product_attention`` (the
fused kernel), a final norm and a linear head on the class token. Module names follow timm
(``blocks.3.norm1``, ``blocks.3.attn``, ``norm``, ``head``), so Grad-CAM's automatic layer and the
attention methods work on it as on a timm ViT. Inputs: (N, 3, H, W) RGB in [0, 1] normalised with
ImageNet mean/std (the toolkit's default preprocess), H and W multiples of 8 (64 px as trained;
other sizes interpolate the position embeddings). The weights are made by
``python -m explain.data.train_vit``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .demo import load_weights
from .synthetic import CLASS_NAMES, IMAGE_SIZE

VIT_WEIGHTS_PATH = Path(__file__).with_name("demo_vit.pt")
PATCH = 8


class Attention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``: (N, T, D) → (N, T, D)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        count, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(count, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(count, tokens, dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _stem(dim: int) -> nn.Sequential:
    """3 → dim channels at 1/8 of the resolution; receptive field 11 px, so each token sees its patch."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.Conv2d(64, dim, 2, stride=2),
    )


class DemoViT(nn.Module):
    """A small ViT for 64×64 images: conv stem → 8×8 patch tokens + class token → 4 blocks → head."""

    def __init__(self, num_classes: int = len(CLASS_NAMES), dim: int = 64, depth: int = 4, heads: int = 4):
        super().__init__()
        grid = IMAGE_SIZE // PATCH
        self.stem = _stem(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + grid * grid, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def position_embeddings(self, height: int, width: int) -> Tensor:
        """(1, 1 + h·w, D): the trained 8×8 grid, interpolated bicubically for other grids."""
        grid = IMAGE_SIZE // PATCH
        if (height, width) == (grid, grid):
            return self.pos_embed
        patches = self.pos_embed[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=(height, width), mode="bicubic", align_corners=False)
        return torch.cat([self.pos_embed[:, :1], patches.flatten(2).transpose(1, 2)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        features = self.stem(x)  # (N, D, h, w)
        height, width = features.shape[-2:]
        tokens = features.flatten(2).transpose(1, 2)  # (N, h·w, D)
        tokens = torch.cat([self.cls_token.expand(len(tokens), -1, -1), tokens], dim=1)
        tokens = self.blocks(tokens + self.position_embeddings(height, width))
        return self.head(self.norm(tokens)[:, 0])


def load_demo_vit(path: Path | str = VIT_WEIGHTS_PATH) -> DemoViT:
    """The trained demo transformer, in eval mode, on the CPU."""
    return load_weights(DemoViT(), path, "the demo transformer", "explain.data.train_vit")
