"""Shared helpers of the metrics: maps and masks as batched tensors, model scores."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import model_device, model_dtype, preserved_model_state
from ..explanation import Explanation
from ..inputs import Inputs, PreprocessSpec, as_preprocess, prepare_inputs
from ..targets import Target, select_targets

MapsLike = Union[Explanation, Tensor]
"""Maps to evaluate: an Explanation (one target per image) or a (N, H, W) / (H, W) tensor."""


def as_maps(maps: MapsLike, size: Optional[Sequence[int]] = None) -> Tensor:
    """An Explanation (one target per image) or a (N, H, W) / (H, W) tensor → (N, H, W) float,
    resized bilinearly to ``size`` when given."""
    if isinstance(maps, Explanation):
        if maps.keep_target_dim and maps.map_grid.shape[1] != 1:
            raise ValueError(
                "this explanation has several targets per image; pass one target's maps, e.g. explanation.maps[:, k]."
            )
        maps = maps.map_grid[:, 0]
    maps = torch.as_tensor(maps).detach().float()
    if maps.dim() == 2:
        maps = maps[None]
    if maps.dim() != 3:
        raise ValueError(f"maps must be (N, H, W); got shape {tuple(maps.shape)}.")
    if size is not None and tuple(maps.shape[-2:]) != tuple(size):
        maps = F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return maps


def boxes_to_masks(boxes: Tensor, size: Sequence[int]) -> Tensor:
    """(N, 4) boxes (x0, y0, x1, y1), inclusive pixel coordinates → (N, H, W) bool masks."""
    boxes = torch.as_tensor(boxes).long()
    rows = torch.arange(size[0], device=boxes.device).view(1, -1, 1)
    columns = torch.arange(size[1], device=boxes.device).view(1, 1, -1)
    x0, y0, x1, y1 = (boxes[:, i].view(-1, 1, 1) for i in range(4))
    return (columns >= x0) & (columns <= x1) & (rows >= y0) & (rows <= y1)


def as_masks(masks_or_boxes: Tensor, size: Sequence[int]) -> Tensor:
    """(N, H, W) masks (any dtype, non-zero = inside) or (N, 4) boxes → (N, H, W) bool masks."""
    region = torch.as_tensor(masks_or_boxes)
    if region.dim() == 2 and region.shape[1] == 4 and tuple(region.shape) != tuple(size):
        return boxes_to_masks(region, size)
    if region.dim() == 2:
        region = region[None]
    if region.dim() != 3 or tuple(region.shape[-2:]) != tuple(size):
        raise ValueError(f"masks must be (N, H, W) at the maps' size {tuple(size)}, or (N, 4) boxes; "
                         f"got shape {tuple(region.shape)}.")
    return region != 0


def model_inputs(model: nn.Module, inputs: Inputs, preprocess: PreprocessSpec) -> Tensor:
    """Anything ``explain()`` accepts → the (N, C, H, W) model batch on the model's device."""
    return prepare_inputs(inputs, as_preprocess(preprocess), model_device(model), model_dtype(model)).batch


def fixed_classes(model: nn.Module, batch: Tensor, maps: MapsLike, target: Target) -> Tensor:
    """(N,) classes to score: the explanation's, else ``target``, else each image's top class."""
    if isinstance(maps, Explanation) and target is None and maps.class_indices is not None:
        return maps.class_indices[:, 0].to(batch.device)
    with torch.no_grad(), preserved_model_state(model):
        selected = select_targets(model(batch), target, None, batch_size=batch.shape[0])
    if selected.class_indices is None:
        raise ValueError("faithfulness metrics score classes: give class targets, not a callable.")
    if selected.class_indices.shape[1] != 1:
        raise ValueError("faithfulness metrics take one class per image.")
    return selected.class_indices[:, 0]


def class_scores(model: nn.Module, batch: Tensor, classes: Tensor, score: str, batch_size: int) -> Tensor:
    """(R,) score of ``classes[r]`` on row r of ``batch``: softmax "probability" or "logit"."""
    if score not in ("probability", "logit"):
        raise ValueError(f"score must be 'probability' or 'logit'; got {score!r}.")
    results: list[Tensor] = []
    with torch.no_grad(), preserved_model_state(model):
        for start in range(0, batch.shape[0], batch_size):
            output = model(batch[start : start + batch_size]).float()
            if score == "probability":
                output = output.softmax(dim=1)
            results.append(output.gather(1, classes[start : start + batch_size, None].to(output.device))[:, 0])
    return torch.cat(results)


def ranking(maps: Tensor, seed: int = 0) -> Tensor:
    """(N, H, W) maps → (N, H, W) rank of each pixel, 0 for the most relevant.
    Ties are broken by a seeded random order, so a constant map ranks pixels at random."""
    count = maps.shape[0]
    flat = maps.reshape(count, -1)
    generator = torch.Generator().manual_seed(seed)
    shuffle = torch.stack([torch.randperm(flat.shape[1], generator=generator) for _ in range(count)]).to(flat.device)
    order_in_shuffle = torch.argsort(-flat.gather(1, shuffle), dim=1, stable=True)
    order = shuffle.gather(1, order_in_shuffle)  # pixel indices, most relevant first
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(flat.shape[1], device=flat.device).expand(count, -1))
    return ranks.reshape(maps.shape)
