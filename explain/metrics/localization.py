"""Localisation: does the map point at the ground-truth object?

Each function takes maps (an Explanation or a (N, H, W) tensor) and masks
((N, H, W), non-zero inside) or boxes ((N, 4) x0, y0, x1, y1: whole, inclusive pixel
coordinates inside the maps), and returns one value per image, (N,) float in [0, 1],
higher is better. Every function refuses, with a ValueError naming the map, mask or box:
maps with NaN or inf; another number of masks or boxes than maps (none is ignored); an empty
mask or box; a box reaching outside the maps; a box in normalised [0, 1] coordinates or with
fractional ones (scale or round it to pixels: coordinates are never guessed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..methods.options import number_option
from ._common import MapsLike, as_maps, as_masks, boxes_to_masks, ranking


def pointing_game(maps: MapsLike, masks_or_boxes: Tensor, tolerance: float = 0.0) -> Tensor:
    """1 where the map's maximum lies within ``tolerance`` pixels (Euclidean) of the object, else 0.

    TorchRay's protocol uses 15 px at 224 px (about 4 px at 64 px). A constant map
    has no maximum and scores 0. Chance level: about the (dilated) object's area fraction.
    """
    heat = as_maps(maps)
    region = as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device)
    tolerance = number_option("tolerance", tolerance)
    if tolerance > 0:  # no point of the map is farther than its diagonal: a larger radius adds nothing
        tolerance = min(tolerance, math.hypot(*heat.shape[-2:]))
        radius = int(tolerance)
        offsets = torch.arange(-radius, radius + 1, device=heat.device, dtype=torch.float32)
        disk = ((offsets[:, None] ** 2 + offsets[None, :] ** 2) <= tolerance**2).float()
        region = F.conv2d(region[:, None].float(), disk[None, None], padding=radius)[:, 0] > 0
    flat = heat.reshape(heat.shape[0], -1)
    peak = flat.argmax(dim=1)
    hit = region.reshape(region.shape[0], -1).gather(1, peak[:, None])[:, 0]
    has_peak = flat.amax(dim=1) > flat.amin(dim=1)
    return (hit & has_peak).float()


def _positive_mass_inside(heat: Tensor, region: Tensor) -> Tensor:
    positive = heat.clamp_min(0).reshape(heat.shape[0], -1)
    inside = (positive * region.reshape(region.shape[0], -1)).sum(dim=1)
    total = positive.sum(dim=1)
    return torch.where(total > 0, inside / torch.where(total > 0, total, 1.0), torch.zeros_like(total))


def energy_pointing_game(maps: MapsLike, masks_or_boxes: Tensor) -> Tensor:
    """Share of the map's positive mass inside the object's bounding box (Wang et al. 2020).
    Masks are turned into their bounding boxes. Chance level: the box's area fraction."""
    heat = as_maps(maps)
    region = as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device)  # none empty
    boxes = []
    for mask in region:
        rows, columns = torch.nonzero(mask, as_tuple=True)
        boxes.append(torch.stack([columns.min(), rows.min(), columns.max(), rows.max()]))
    return _positive_mass_inside(heat, boxes_to_masks(torch.stack(boxes), heat.shape[-2:]))


def relevance_mass_accuracy(maps: MapsLike, masks_or_boxes: Tensor) -> Tensor:
    """Share of the map's positive relevance inside the mask (Arras et al. 2022).
    Chance level: the mask's area fraction."""
    heat = as_maps(maps)
    return _positive_mass_inside(heat, as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device))


def relevance_rank_accuracy(maps: MapsLike, masks_or_boxes: Tensor) -> Tensor:
    """Of the K most relevant pixels, K the mask's size, the share inside the mask (Arras et al. 2022).
    Ties are broken at random (seeded). Chance level: the mask's area fraction."""
    heat = as_maps(maps)
    region = as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device).reshape(heat.shape[0], -1)
    ranks = ranking(heat).reshape(heat.shape[0], -1)
    size = region.sum(dim=1, keepdim=True)
    top = ranks < size
    return ((top & region).sum(dim=1).float() / size[:, 0].clamp_min(1)).float()
