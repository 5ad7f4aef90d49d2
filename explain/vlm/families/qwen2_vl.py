"""Qwen2-VL and Qwen2.5-VL: where each image token lies on the image.

The image processor resizes the whole image (no crop, no padding) to ``patch_rows × patch_cols`` patches of
``patch_size`` pixels, both counts multiples of ``spatial_merge_size`` (``smart_resize``: the aspect ratio kept as
near as the rounding allows, the pixel count between ``min_pixels`` and ``max_pixels``). It writes the patches into
``pixel_values`` group by group: the ``merge × merge`` groups row by row, the patches of a group row by row inside
it, each patch repeated ``temporal_patch_size`` times along time (an image is one frame: ``image_grid_thw`` is
``(1, patch_rows, patch_cols)``). The vision model's merger joins each group into one token, so the language model
gets ``(patch_rows / merge) × (patch_cols / merge)`` tokens in row order. Qwen2.5-VL's encoder reorders the groups
into attention windows and puts them back in row order after the merger, so both share this layout.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..layout import ImageLayout, TokenGrid, checked_image_size, image_token_count, model_config, register_layout


@register_layout("qwen2_vl", "qwen2_5_vl")
def qwen2_vl_layout(model: nn.Module, processor: Any, inputs: Mapping[str, Any], image_size: tuple[int, int]
                    ) -> ImageLayout:
    """One grid of ``(patch_rows / merge, patch_cols / merge)`` tokens over the whole image, per frame.

    inputs: the processor's output for one image (``input_ids`` (1, L), ``image_grid_thw`` (1, 3)).
    image_size: (height, width) of the original image in pixels."""
    height, width = checked_image_size(image_size)
    grid_thw = inputs.get("image_grid_thw")
    if grid_thw is None:
        raise ValueError("Qwen2-VL's layout needs inputs['image_grid_thw']: pass the processor's whole output "
                         "(processor(images=image, text=..., return_tensors='pt')), not only input_ids.")
    grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3)
    if grid_thw.shape[0] != 1:
        raise ValueError(f"inputs hold {grid_thw.shape[0]} images (image_grid_thw {tuple(grid_thw.shape)}); "
                         "explain one image at a time: process a single image with its prompt.")
    frames, patch_rows, patch_cols = (int(value) for value in grid_thw[0])
    merge = int(model_config(model).vision_config.spatial_merge_size)
    if patch_rows % merge or patch_cols % merge:
        raise ValueError(f"image_grid_thw {(frames, patch_rows, patch_cols)} is not divisible by the model's "
                         f"spatial_merge_size {merge}: the processor and the model disagree; use the processor "
                         "saved with the model.")
    rows, cols = patch_rows // merge, patch_cols // merge
    count = image_token_count(model, inputs)
    if count != frames * rows * cols:
        raise ValueError(f"input_ids hold {count} image tokens but image_grid_thw {(frames, patch_rows, patch_cols)} "
                         f"with merge {merge} gives {frames * rows * cols}: pass input_ids and image_grid_thw from "
                         "the same processor call.")
    whole_image = (0.0, 0.0, float(width), float(height))
    grids = [TokenGrid(tokens=torch.arange(rows * cols).reshape(rows, cols) + frame * rows * cols, box=whole_image)
             for frame in range(frames)]
    return ImageLayout(size=(height, width), grids=grids, token_count=count)
