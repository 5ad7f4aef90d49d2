"""Idefics3 and SmolVLM: where each image token lies on the image.

The image processor (with ``do_image_splitting``) resizes the image so its longest edge is ``size['longest_edge']``
(the other edge rounded to an even number), then stretches both edges up to multiples of the tile side
``max_image_size['longest_edge']`` and cuts the result into ``rows × cols`` tiles, row by row; the stretched image
squeezed into one tile follows as the global image (an image that fits one tile is only that global image). The
vision encoder cuts each tile into ``patch_size`` patches; the connector's pixel shuffle joins each
``scale_factor × scale_factor`` block of patches into one token, so a tile gives ``side × side`` tokens in row order,
``side = tile / patch_size / scale_factor``. The prompt holds the tiles' tokens then the global image's, each
tile's run led by ``<fake_token_around_image><row_r_col_c>`` and the global's by ``<global-img>``; only the
``<image>`` positions are image tokens. Tiles are never padded for a single image (every tile is tile × tile).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from ..layout import ImageLayout, TokenGrid, checked_image_size, image_token_count, model_config, register_layout

LARGEST_RESIZED_EDGE = 4096
"""The image processors' cap on an edge after the longest-edge resize (their ``MAX_IMAGE_SIZE``)."""


@register_layout("idefics3", "smolvlm")
def idefics3_layout(model: nn.Module, processor: Any, inputs: Mapping[str, Any], image_size: tuple[int, int]
                    ) -> ImageLayout:
    """One ``side × side`` grid per tile (row by row over the image), then one over the whole image (global).

    inputs: the processor's output for one image (``input_ids`` (1, L), ``pixel_values`` (1, frames, 3, tile,
    tile), optionally ``pixel_attention_mask`` (1, frames, tile, tile)).
    image_size: (height, width) of the original image in pixels."""
    height, width = checked_image_size(image_size)
    pixel_values = inputs.get("pixel_values")
    if pixel_values is None or pixel_values.dim() != 5 or pixel_values.shape[0] != 1:
        shape = None if pixel_values is None else tuple(pixel_values.shape)
        raise ValueError(f"Idefics3's layout needs inputs['pixel_values'] of one image, (1, frames, 3, tile, tile), "
                         f"got {shape}: pass the processor's output for a single image with return_tensors='pt'.")
    frames, tile_h, tile_w = pixel_values.shape[1], pixel_values.shape[-2], pixel_values.shape[-1]
    mask = inputs.get("pixel_attention_mask")
    if tile_h != tile_w or (mask is not None and not bool(torch.as_tensor(mask).bool().all())):
        raise ValueError(f"the frames of pixel_values are padded or not square ({tile_h}×{tile_w}); a single image's "
                         "tiles are square and unpadded: process one image at a time.")
    tile = int(tile_h)
    config = model_config(model)
    patch, scale = int(config.vision_config.patch_size), int(config.scale_factor)
    side = tile // patch // scale
    count = image_token_count(model, inputs)
    if count != frames * side * side:
        raise ValueError(f"input_ids hold {count} image tokens but {frames} frames of {tile}×{tile} pixels give "
                         f"{frames} × {side}² = {frames * side * side} (patch_size {patch}, scale_factor {scale}): "
                         "pass input_ids and pixel_values from the same processor call, with the model's processor.")
    covered = side * scale * patch / tile  # share of a tile's side that its tokens cover (1 unless it is uneven)
    tokens_per_frame = side * side
    tile_tokens = torch.arange(tokens_per_frame).reshape(side, side)
    grids: list[TokenGrid] = []
    if frames > 1:
        rows, cols = _tile_rows_cols(height, width, processor.image_processor, tile)
        if rows * cols + 1 != frames:
            raise ValueError(f"pixel_values hold {frames} frames but this processor's settings cut a {height}×{width} "
                             f"image into {rows}×{cols} tiles plus the global image: pass the original image's "
                             "(height, width) as image_size, and the processor (and its settings) that made inputs.")
        tile_height, tile_width = height / rows, width / cols
        for row in range(rows):
            for col in range(cols):
                left, top = col * tile_width, row * tile_height
                box = (left, top, left + covered * tile_width, top + covered * tile_height)
                grids.append(TokenGrid(tokens=tile_tokens + (row * cols + col) * tokens_per_frame, box=box))
    global_box = (0.0, 0.0, covered * width, covered * height)
    grids.append(TokenGrid(tokens=tile_tokens + (frames - 1) * tokens_per_frame, box=global_box))
    return ImageLayout(size=(height, width), grids=grids, token_count=count)


def _tile_rows_cols(height: int, width: int, image_processor: Any, tile: int) -> tuple[int, int]:
    """Tile rows and columns the image processor cuts a ``height × width`` image into (as its ``_preprocess``)."""
    if image_processor.do_resize:
        height, width = _longest_edge_resize(height, width, int(image_processor.size["longest_edge"]))
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height // tile, width // tile


def _longest_edge_resize(height: int, width: int, longest: int) -> tuple[int, int]:
    """The processors' resize: longest edge to ``longest``, the other edge scaled and made even; then both under
    ``LARGEST_RESIZED_EDGE``."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > LARGEST_RESIZED_EDGE:
        width, height = LARGEST_RESIZED_EDGE, int(LARGEST_RESIZED_EDGE / aspect)
    elif height > width and height > LARGEST_RESIZED_EDGE:
        height, width = LARGEST_RESIZED_EDGE, int(LARGEST_RESIZED_EDGE * aspect)
    return max(height, 1), max(width, 1)
