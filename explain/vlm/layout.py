"""Where each image token of a vision-language model lies on the image.

A model's processor resizes, crops, pads or tiles the image into views; the vision encoder cuts each view into
patches (merged 2×2 by Qwen2-VL, pixel-shuffled by Idefics3) and the language model receives one token per
patch group, in the model's own order. ``ImageLayout`` states that order as grids of tokens, each grid covering a
box of the original image; ``paint`` turns one relevance value per image token into a map over the image.

Each model family has a function ``layout(model, processor, inputs, image_size) -> ImageLayout`` registered in
``LAYOUTS`` under its ``config.model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

Box = tuple[float, float, float, float]
"""(left, top, right, bottom) in the original image's pixels; may reach beyond the image where the processor
padded it."""


@dataclass(frozen=True)
class TokenGrid:
    """Image tokens that tile one box of the image, row by row.

    tokens: (rows, cols) long, each cell's index among the image's tokens in sequence order (0 for the first
        image token of the sequence), −1 for a cell no token covers.
    box: the region of the original image the grid covers.
    """

    tokens: Tensor
    box: Box


@dataclass(frozen=True)
class ImageLayout:
    """The image tokens of one image: ``token_count`` tokens in the sequence, placed by ``grids``. Tokens in no grid
    (LLaVA-NeXT's row ends, a class token) carry no place on the image; their relevance is reported apart."""

    size: tuple[int, int]
    grids: list[TokenGrid]
    token_count: int

    def placed(self) -> Tensor:
        """(token_count,) bool: which tokens some grid places on the image."""
        placed = torch.zeros(self.token_count, dtype=torch.bool)
        for grid in self.grids:
            cells = grid.tokens[grid.tokens >= 0]
            placed[cells] = True
        return placed


LayoutFunction = Callable[[nn.Module, Any, Mapping[str, Any], tuple[int, int]], ImageLayout]
LAYOUTS: dict[str, LayoutFunction] = {}
"""``config.model_type`` → its layout function."""


def register_layout(*model_types: str) -> Callable[[LayoutFunction], LayoutFunction]:
    """Register a layout function for these ``config.model_type`` values."""

    def register(function: LayoutFunction) -> LayoutFunction:
        for model_type in model_types:
            LAYOUTS[model_type] = function
        return function

    return register


def _overlaps(pixels: int, start: float, cell: float, cells: int, device: torch.device) -> Tensor:
    """(pixels, cells) float64: the length of each map pixel's extent [p, p + 1) inside each cell's extent
    [start + c·cell, start + (c + 1)·cell), divided by the cell's length."""
    edges = start + cell * torch.arange(cells + 1, device=device, dtype=torch.float64)
    low = torch.arange(pixels, device=device, dtype=torch.float64)[:, None]
    inside = torch.minimum(low + 1, edges[None, 1:]) - torch.maximum(low, edges[None, :-1])
    return inside.clamp(min=0) / cell


def paint(relevance: Tensor, layout: ImageLayout, size: tuple[int, int]) -> Tensor:
    """Relevance per image token → relevance density over the image.

    relevance: (K, token_count) one value per image token for each of K targets.
    size: (height, width) of the map, the original image scaled (the boxes are scaled with it).
    Returns (K, height, width): each token's relevance spread evenly over its cell, each map pixel getting the
    share of the cell it covers (so a map's sum over the image is exactly the placed tokens' relevance that falls
    on the image, whatever the sizes), summed over grids where views overlap (a tile and the whole image)."""
    count = relevance.shape[0]
    height, width = size
    scale_y, scale_x = height / layout.size[0], width / layout.size[1]
    canvas = torch.zeros(count, height, width, dtype=torch.float64, device=relevance.device)
    for grid in layout.grids:
        rows, cols = grid.tokens.shape
        left, top, right, bottom = grid.box
        down = _overlaps(height, top * scale_y, (bottom - top) * scale_y / rows, rows, relevance.device)
        across = _overlaps(width, left * scale_x, (right - left) * scale_x / cols, cols, relevance.device)
        tokens = grid.tokens.to(relevance.device)
        cell_values = torch.where(tokens >= 0, relevance[:, tokens.clamp(min=0)], relevance.new_zeros(()))
        canvas += torch.einsum("yr,krc,xc->kyx", down, cell_values.double(), across)
    return canvas.to(relevance.dtype)


# ------------------------------------------------------------------ shared by the families' layouts


def model_config(model: nn.Module) -> Any:
    """The HuggingFace ``config`` of a model, or a clear error."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass the HuggingFace model itself.")
    return config


def checked_image_size(image_size: tuple[int, int]) -> tuple[int, int]:
    """The original image's (height, width) as positive ints, or a clear error."""
    height, width = (int(value) for value in image_size)
    if height <= 0 or width <= 0:
        raise ValueError(f"image_size must be the original image's (height, width) in pixels, got {image_size}.")
    return height, width


def image_token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:
    """How many image tokens (``config.image_token_id``) ``inputs["input_ids"]`` holds, for one sequence."""
    if "input_ids" not in inputs:
        raise ValueError("the processor's output has no input_ids: call the processor with the text as well.")
    input_ids = torch.as_tensor(inputs["input_ids"])
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids hold {input_ids.shape[0]} sequences; a layout is for one image in one "
                             "sequence: process one image and one text.")
        input_ids = input_ids[0]
    config = model_config(model)
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        image_token = config.image_token_index
    return int(input_ids.eq(int(image_token)).sum())
