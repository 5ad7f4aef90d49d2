"""The second small vision transformer that the package ships, a plain ViT trained on ``explain.data.synthetic``.

Made with another recipe than the first demo transformer (``demo_vit``), so that no conclusion
about an explanation method rests on one model: a pure patch embedding (one 8×8 convolution with
stride 8, no convolutional stem) turns a 64×64 image into an 8×8 grid of 64-dimensional patch
tokens, to which fixed 2-D sine-cosine position embeddings are added (not learned, so any grid
size works); a class token goes in front, then six pre-norm transformer blocks with four heads
(attention through ``F.scaled_dot_product_attention``, the fused kernel; GELU MLPs of ratio 4), a
final LayerNorm and a linear head on the class token. Module names follow timm
(``patch_embed.proj``, ``blocks.5.norm1``, ``blocks.5.attn.qkv``, ``blocks.5.mlp.fc1``, ``norm``,
``head``), so Grad-CAM's automatic layer, the token layout (class token, 8 px patch grid, read
from the model) and the attention methods work on it as on a timm ViT. Inputs: (N, 3, H, W) RGB in
[0, 1] normalised with ImageNet mean/std (the toolkit's default preprocess), H and W multiples of 8
(64 px as trained). The weights are made by ``python -m explain.data.train_vit2`` (another seed
and other augmentations than the first: random translations and colour jitter).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .demo import load_weights
from .demo_vit import Attention
from .synthetic import CLASS_NAMES

VIT2_WEIGHTS_PATH = Path(__file__).with_name("demo_vit2.pt")
PATCH = 8


class Mlp(nn.Module):
    """fc1 → GELU → fc2, (N, T, D) → (N, T, D), as timm's ``Mlp``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_ratio * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """One convolution with kernel = stride = ``patch``: (N, 3, H, W) → (N, D, H / patch, W / patch)."""

    def __init__(self, dim: int, patch: int = PATCH):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


def sincos_position_embeddings(height: int, width: int, dim: int, device: torch.device | None = None,
                               dtype: torch.dtype | None = None) -> Tensor:
    """(h·w, D) fixed 2-D sine-cosine position embeddings (as MAE's), row-major over the patch grid: a
    quarter of the D channels each holds sin and cos of the row and of the column index, at the
    frequencies 1 / 10000^(i / (D / 4)), i = 0 … D / 4 − 1. Values in [−1, 1]; any grid size."""
    quarter = dim // 4
    frequencies = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float64) / quarter)
    rows, columns = torch.meshgrid(torch.arange(height, device=device, dtype=torch.float64),
                                   torch.arange(width, device=device, dtype=torch.float64), indexing="ij")
    row_angles = rows.reshape(-1, 1) * frequencies  # (h·w, D / 4)
    column_angles = columns.reshape(-1, 1) * frequencies
    embeddings = torch.cat([row_angles.sin(), row_angles.cos(), column_angles.sin(), column_angles.cos()], dim=1)
    return embeddings.to(dtype or torch.get_default_dtype())


class DemoViT2(nn.Module):
    """A plain ViT for 64×64 images: 8 px patch embedding + fixed 2-D sine-cosine position embeddings
    → 8×8 patch tokens behind a class token → 6 blocks → final norm → linear head on the class token."""

    def __init__(self, num_classes: int = len(CLASS_NAMES), dim: int = 64, depth: int = 6, heads: int = 4,
                 mlp_ratio: int = 4, patch: int = PATCH):
        super().__init__()
        if dim % 4:
            raise ValueError(f"dim must be a multiple of 4 (the 2-D sine-cosine position embeddings); got {dim}.")
        self.dim = dim
        self.patch_embed = PatchEmbed(dim, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """(N, 3, H, W) normalised images → (N, classes) logits."""
        features = self.patch_embed(x)  # (N, D, h, w)
        height, width = features.shape[-2:]
        tokens = features.flatten(2).transpose(1, 2)  # (N, h·w, D)
        tokens = tokens + sincos_position_embeddings(height, width, self.dim, tokens.device, tokens.dtype)
        tokens = torch.cat([self.cls_token.expand(len(tokens), -1, -1), tokens], dim=1)
        return self.head(self.norm(self.blocks(tokens))[:, 0])


def load_demo_vit2(path: Path | str = VIT2_WEIGHTS_PATH) -> DemoViT2:
    """The trained second demo transformer, in eval mode, on the CPU (float16 weights read as float32)."""
    return load_weights(DemoViT2(), path, "the second demo transformer", "explain.data.train_vit2")
