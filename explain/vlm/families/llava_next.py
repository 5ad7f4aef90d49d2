"""LLaVA-NeXT (``config.model_type`` "llava_next"): where its image tokens lie on the image.

The image processor (LlavaNextImageProcessor, PIL or torchvision backend) makes several views of the image:

- the base view: the whole image resized to the processor's size (a square, the aspect not kept);
- the tiles: among ``image_grid_pinpoints`` the best resolution (the one that keeps most of the image's pixels,
  then wastes fewest) is chosen; the image is resized to fit it keeping its aspect (the fitted side exact, the other
  ceil(side · scale)), padded to it (centred, the odd pixel after) and cut into ``crop_size`` squares, row by row.

Each view is then resized and centre-cropped like a CLIP view. The model sends the base view's tokens first (as
LLaVA: its class token dropped by the "default" strategy); then the tiles' patch features, put together into one
grid over the padded resolution, from which "unpad" drops the rows (or columns) of padding as the model reckons
them (in whole patches, from the original size: it may drop a patch holding a few image pixels or keep one holding
some padding); row by row, each row ending with the ``image_newline`` token, which has no place on the image.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..layout import ImageLayout, image_token_count, register_layout
from .llava import (
    Frame,
    check_count,
    check_view,
    crop_and_resize,
    patch_size,
    pixel_size,
    size_entry,
    view_tokens,
)


def best_resolution(image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) among ``pinpoints`` that LLaVA-NeXT picks for an image of (height, width) ``image_size``:
    the most of the image's pixels kept when it is scaled to fit (sides rounded down), then the fewest pixels
    wasted; the first such in order."""
    height, width = image_size
    best, most_kept, least_wasted = None, 0, math.inf
    for target_height, target_width in pinpoints:
        scale = min(target_width / width, target_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (int(target_height), int(target_width)), kept, wasted
    if best is None:
        raise ValueError(f"no resolution in image_grid_pinpoints {list(pinpoints)!r} fits a "
                         f"{height}×{width} image.")
    return best


def fitted_size(image_size: tuple[int, int], resolution: tuple[int, int]) -> tuple[int, int]:
    """(height, width) the image is resized to inside ``resolution``, its aspect kept: the side that limits the
    scale exactly, the other ceil(side · scale), at most the resolution's."""
    height, width = image_size
    target_height, target_width = resolution
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def unpadded(rows: int, cols: int, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """(first row, end row, first col, end col) of the tiles' rows × cols feature grid that the model keeps: where
    the image is wider than the grid, the rows it reckons padding above and below (the same number each side), else
    the columns left and right."""
    height, width = image_size
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        padding = (rows - kept) // 2
        return padding, rows - padding, 0, cols
    kept = int(round(width * (rows / height), 7))
    padding = (cols - kept) // 2
    return 0, rows, padding, cols - padding


@register_layout("llava_next")
def llava_next_layout(model: nn.Module, processor: Any, inputs: Mapping[str, Any],
                      image_size: tuple[int, int]) -> ImageLayout:
    """Where LLaVA-NeXT's image tokens lie on an image of (height, width) ``image_size``: a grid over the base view,
    then one grid per tile (−1 where unpad dropped the patch); the row-end newline tokens (and with the "full"
    strategy a class token) have no place."""
    image_processor = getattr(processor, "image_processor", processor)
    config: Any = model.config
    image_size = (int(image_size[0]), int(image_size[1]))
    if "image_sizes" in inputs:
        sizes = torch.as_tensor(inputs["image_sizes"]).reshape(-1, 2)
        if sizes.shape[0] != 1:
            raise ValueError(f"the inputs hold {sizes.shape[0]} images; a layout is for one: process one image.")
        if tuple(int(v) for v in sizes[0]) != image_size:
            raise ValueError(f"the processor saw a {int(sizes[0, 0])}×{int(sizes[0, 1])} image but image_size is "
                             f"{image_size[0]}×{image_size[1]}: pass the original image's (height, width).")
    pinpoints = [tuple(int(v) for v in point) for point in image_processor.image_grid_pinpoints]
    model_pinpoints = [tuple(int(v) for v in point) for point in config.image_grid_pinpoints]
    resolution = best_resolution(image_size, pinpoints)
    if best_resolution(image_size, model_pinpoints) != resolution:
        raise ValueError("the processor's image_grid_pinpoints and model.config.image_grid_pinpoints pick different "
                         "resolutions: use the processor the model was built with.")
    size = image_processor.size
    shortest = size_entry(size, "shortest_edge")
    base_height, base_width = size_entry(size, "height"), size_entry(size, "width")  # the base view's resize
    if base_height is None or base_width is None:
        if shortest is None:
            raise ValueError(f"explain cannot follow a LLaVA-NeXT processor whose size is {size!r}: it knows "
                             "shortest_edge or height and width.")
        base_height = base_width = shortest
    tile = size_entry(image_processor.crop_size, "height") or size_entry(size, "height") or base_height
    if resolution[0] % tile or resolution[1] % tile:
        raise ValueError(f"the best resolution {resolution[0]}×{resolution[1]} is not a whole number of "
                         f"{tile}-pixel tiles: explain follows LLaVA-NeXT only where the pinpoints are multiples of "
                         "the processor's crop size.")
    tile_rows, tile_cols = resolution[0] // tile, resolution[1] // tile
    tile_in_model = int(config.vision_config.image_size)
    if (resolution[0] // tile_in_model, resolution[1] // tile_in_model) != (tile_rows, tile_cols):
        raise ValueError(f"the processor cuts {tile}-pixel tiles but the model expects {tile_in_model}-pixel ones "
                         "(vision_config.image_size): use the processor the model was built with.")

    base = crop_and_resize(image_processor, Frame.of(image_size).resize(base_height, base_width))
    processed = pixel_size(inputs)
    check_view(base, processed, image_size)
    fitted = fitted_size(image_size, resolution)
    pad_top, pad_left = (resolution[0] - fitted[0]) // 2, (resolution[1] - fitted[1]) // 2
    canvas = Frame.of(image_size).resize(*fitted).place(pad_top, pad_left, *resolution)
    tiles = [[crop_and_resize(image_processor, canvas.crop(row * tile, col * tile, tile, tile))
              for col in range(tile_cols)] for row in range(tile_rows)]
    for frame in (frame for row in tiles for frame in row):
        check_view(frame, processed, image_size)

    patch = patch_size(model)
    side = tile_in_model // patch  # features per tile side, as the model reshapes them
    base_rows, base_cols = base.height // patch, base.width // patch
    token_count = image_token_count(model, inputs)
    rows, cols = tile_rows * side, tile_cols * side
    first_row, end_row, first_col, end_col = unpadded(rows, cols, image_size)
    kept_rows, kept_cols = end_row - first_row, end_col - first_col
    base_tokens = view_tokens(model, base_rows * base_cols, token_count - kept_rows * (kept_cols + 1))
    base_count = int(base_tokens.max()) + 1
    check_count(token_count, base_count + kept_rows * (kept_cols + 1),
                f"the base view and {tile_rows}×{tile_cols} tiles (unpadded to {kept_rows}×{kept_cols} patches, "
                "a newline after each row)")

    features = torch.full((rows, cols), -1, dtype=torch.long)
    row_starts = base_count + torch.arange(kept_rows) * (kept_cols + 1)  # each row: its patches, then a newline
    features[first_row:end_row, first_col:end_col] = row_starts[:, None] + torch.arange(kept_cols)[None, :]
    grids = [base.grid(base_tokens.view(base_rows, base_cols), patch)]
    for tile_row in range(tile_rows):
        for tile_col in range(tile_cols):
            tokens = features[tile_row * side:(tile_row + 1) * side, tile_col * side:(tile_col + 1) * side]
            if bool((tokens >= 0).any()):
                grids.append(tiles[tile_row][tile_col].grid(tokens.clone(), patch))
    return ImageLayout(size=image_size, grids=grids, token_count=token_count)
