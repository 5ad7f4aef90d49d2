"""PaliGemma (``config.model_type`` "paligemma"): where its image tokens lie on the image.

The SigLIP image processor resizes the image to its ``size`` (height × width, a square: the aspect is not kept); the
SigLIP vision tower has no class token and every patch, row by row, is an image token (the processor writes
``image_seq_length`` of them).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..layout import ImageLayout, image_token_count, register_layout
from .llava import check_count, check_view, patch_size, pixel_size, processed_frame


@register_layout("paligemma")
def paligemma_layout(model: nn.Module, processor: Any, inputs: Mapping[str, Any],
                     image_size: tuple[int, int]) -> ImageLayout:
    """Where PaliGemma's image tokens lie on an image of (height, width) ``image_size``: one grid of all the
    patches of the resized image."""
    image_processor = getattr(processor, "image_processor", processor)
    frame = processed_frame(image_processor, image_size)
    check_view(frame, pixel_size(inputs), image_size)
    patch = patch_size(model)
    rows, cols = frame.height // patch, frame.width // patch
    token_count = image_token_count(model, inputs)
    check_count(token_count, rows * cols, f"a {rows}×{cols} patch grid")
    tokens = torch.arange(rows * cols).view(rows, cols)
    return ImageLayout(size=(int(image_size[0]), int(image_size[1])), grids=[frame.grid(tokens, patch)],
                       token_count=token_count)
