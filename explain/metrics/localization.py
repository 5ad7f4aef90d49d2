"""Localisation: does the map point at the ground-truth object?

Each function takes maps (an Explanation or a (N, H, W) tensor) and masks
((N, H, W), non-zero inside) or boxes ((N, 4) x0, y0, x1, y1: whole, inclusive pixel
coordinates inside the maps), and returns one value per image, (N,) float in [0, 1],
higher is better. Every function refuses, with a ValueError naming the map, mask or box:
maps with NaN or inf; another number of masks or boxes than maps (none is ignored); an empty
mask or box; a box reaching outside the maps; a box in normalised [0, 1] coordinates or with
fractional ones (scale or round it to pixels: coordinates are never guessed).
``top_k_intersection(concept_influence=True)`` exceeds 1 (1 at chance level); ``focus`` takes
the maps of 2 × 2 mosaics and which quadrants show the target class (``make_mosaics`` builds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..methods.options import bool_option, int_option, number_option, random_generator, seed_option
from ._common import MapsLike, as_maps, as_masks, as_tensor, boxes_to_masks, check_count, ranking, short_repr


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


def top_k_intersection(maps: MapsLike, masks_or_boxes: Tensor, k: int = 1000, concept_influence: bool = False,
                       seed: Optional[int] = 0) -> Tensor:
    """Of the map's ``k`` most relevant pixels, the share inside the mask (Theiner et al. 2021), in
    [0, 1], higher is better; chance level: the mask's area fraction. ``k`` must lie in 1 … H·W.
    Pixels tied with the k-th value are taken uniformly at random among the ties (seeded by ``seed``),
    so a constant map scores the mask's area fraction on average (None: fresh draws each call).

    concept_influence: divide by the mask's area fraction (the score then lies in [0, H·W / mask
    size], 1 at chance level), so that large objects do not score high by their size alone.
    """
    heat = as_maps(maps)
    region = as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device).reshape(heat.shape[0], -1)
    pixels = region.shape[1]
    k = int_option("k", k, 1)
    if k > pixels:
        raise ValueError(f"k = {k} is more pixels than the {heat.shape[-2]} × {heat.shape[-1]} maps hold "
                         f"({pixels}): give k ≤ {pixels}.")
    top = top_k_pixels(heat.reshape(heat.shape[0], -1), k, seed_option(seed))
    share = (top & region).sum(dim=1).float() / k
    if bool_option("concept_influence", concept_influence):
        share = share * pixels / region.sum(dim=1).float()
    return share


def top_k_pixels(values: Tensor, k: int, seed: Optional[int] = 0) -> Tensor:
    """(N, P) values → (N, P) bool, True on each row's k largest values; of the values tied with the
    k-th largest, as many as needed are taken uniformly at random (seeded)."""
    threshold = values.topk(k, dim=1).values[:, -1:]
    above = values > threshold
    tied = values == threshold
    needed = k - above.sum(dim=1, keepdim=True)
    if bool((tied.sum(dim=1, keepdim=True) == needed).all()):  # no tie to break (the usual case)
        return above | tied
    drawn = torch.rand(values.shape[1], generator=random_generator(seed, torch.device("cpu")))
    priority = drawn.to(values.device).expand_as(values)  # the same order for every row: alone as in a batch
    priority = torch.where(tied, priority, -1.0)  # ties only, in random order
    tie_rank = torch.empty_like(priority).scatter_(
        1, priority.argsort(dim=1, descending=True), torch.arange(values.shape[1], device=values.device,
                                                                  dtype=priority.dtype).expand_as(priority))
    return above | (tied & (tie_rank < needed))


def sorting_order(values: Tensor) -> Tensor:
    """(N, P) → (N, P) the indices that sort each row ascending. On the CPU through NumPy, whose
    vectorised sort is several times faster than torch's there (8 × 224² values: 9 ms against 43 ms)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.argsort(values.detach().numpy(), axis=1))
    return values.argsort(dim=1)


def _rank_sums(sorted_values: Tensor, selected: Tensor) -> Tensor:
    """(N,) float64: per row, the sum of the ascending ranks 1 … P of the ``selected`` places, ties given
    their average rank. sorted_values: (N, P) rows sorted ascending; selected: (N, P) bool, in that order.
    Rank = place + 1, corrected on the runs of tied values only (few, in most maps)."""
    count, length = sorted_values.shape
    places = torch.arange(1, length + 1, device=sorted_values.device)
    sums = torch.where(selected, places, 0).sum(dim=1).double()
    equal_to_next = sorted_values[:, 1:] == sorted_values[:, :-1]
    if not bool(equal_to_next.any()):
        return sums
    tied = torch.zeros_like(selected)
    tied[:, 1:] |= equal_to_next
    tied[:, :-1] |= equal_to_next
    rows, columns = tied.nonzero(as_tuple=True)  # by row, then place: each run of ties is consecutive
    values = sorted_values[rows, columns]
    starts_run = torch.ones_like(rows, dtype=torch.bool)
    starts_run[1:] = (rows[1:] != rows[:-1]) | (values[1:] != values[:-1])
    run = starts_run.cumsum(0) - 1
    runs = int(run[-1]) + 1
    first = torch.full((runs,), length, device=rows.device).scatter_reduce(0, run, columns, "amin")
    last = torch.zeros(runs, dtype=columns.dtype, device=rows.device).scatter_reduce(0, run, columns, "amax")
    correction = (first[run] + last[run]).double() / 2 - columns.double()  # average rank − (place + 1)
    correction = torch.where(selected[rows, columns], correction, 0.0)
    return sums.index_add(0, rows, correction)


def auc(maps: MapsLike, masks_or_boxes: Tensor) -> Tensor:
    """Area under the ROC curve of the map as a pixel classifier of the mask (Fawcett 2006): the
    probability that a pixel inside the object outranks one outside, ties counting one half; in
    [0, 1], higher is better, 0.5 at chance (a constant map scores 0.5). A mask covering the whole
    map leaves no pixel outside to compare with and is refused, naming it."""
    heat = as_maps(maps)
    region = as_masks(masks_or_boxes, heat.shape[-2:], heat.shape[0]).to(heat.device).reshape(heat.shape[0], -1)
    inside = region.sum(dim=1).double()
    outside = region.shape[1] - inside
    full = outside == 0
    if bool(full.any()):
        indices = full.nonzero()[:, 0].tolist()
        raise ValueError(f"mask{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices[:8]))} cover"
                         f"{'' if len(indices) > 1 else 's'} the whole map: there is no background for the map to "
                         "rank below the object. Leave those images out, or give a mask smaller than the map.")
    flat = heat.reshape(heat.shape[0], -1)
    order = sorting_order(flat)
    rank_sum_inside = _rank_sums(flat.gather(1, order), region.gather(1, order))
    return ((rank_sum_inside - inside * (inside + 1) / 2) / (inside * outside)).float()  # Mann-Whitney U / (n⁺n⁻)


def focus(maps: MapsLike, positions: Tensor) -> Tensor:
    """Focus (Arias-Duart et al. 2022): the share of the map's positive relevance on the quadrants of a
    2 × 2 mosaic that show the target class, in [0, 1], higher is better; 0 for a map without positive
    values. Chance level: the share of those quadrants (one half in the paper's protocol, where two of
    the four images belong to the class; see ``make_mosaics``).

    maps: the mosaics' maps, (N, H, W), each split at H // 2 and W // 2.
    positions: (N, 4), 1 (True) where a quadrant shows the target class, 0 elsewhere, in the order
        top-left, top-right, bottom-left, bottom-right.
    """
    heat = as_maps(maps)
    flags = as_tensor(positions, "positions must be a (N, 4) tensor of 0 / 1 flags, one per quadrant")
    if flags.dim() != 2 or flags.shape[1] != 4:
        raise ValueError(f"positions must be (N, 4): per mosaic, 1 where the top-left, top-right, bottom-left, "
                         f"bottom-right quadrant shows the target class, else 0; got shape {tuple(flags.shape)}.")
    check_count(flags.shape[0], "rows of positions", heat.shape[0], "maps")
    if not bool(((flags == 0) | (flags == 1)).all()):
        raise ValueError("positions must hold only 0 and 1 (or True and False): 1 where a quadrant shows the "
                         "target class.")
    height, width = heat.shape[-2:]
    if height < 2 or width < 2:
        raise ValueError(f"a mosaic's map must be at least 2 × 2 to hold four quadrants; got {height} × {width}.")
    half_height, half_width = height // 2, width // 2
    quadrant_of_row = (torch.arange(height, device=heat.device) >= half_height).long() * 2
    quadrant_of_column = (torch.arange(width, device=heat.device) >= half_width).long()
    quadrant = quadrant_of_row[:, None] + quadrant_of_column[None, :]  # (H, W): 0 1 / 2 3
    on_target = flags.to(heat.device, torch.bool)[:, quadrant]  # (N, H, W)
    return _positive_mass_inside(heat, on_target)


@dataclass
class Mosaics:
    """images: (M, C, 2H, 2W) mosaics of four images each; positions: (M, 4) bool, True where a
    quadrant (top-left, top-right, bottom-left, bottom-right) shows the target class; targets: (M,)
    the class each mosaic is explained for; sources: (M, 4) the index of the image in each quadrant."""

    images: Tensor
    positions: Tensor
    targets: Tensor
    sources: Tensor


def make_mosaics(images: Tensor, labels: Tensor, count: int, generator: Optional[torch.Generator] = None
                 ) -> Mosaics:
    """``count`` mosaics for ``focus`` as Arias-Duart et al. (2022) make them: a target class drawn at
    random, two distinct images of it and two images of other classes, in random quadrants.

    images: (N, C, H, W) (model input, all the same size); labels: (N,) their classes; only classes
    with two or more images can be targets, and at least two images must have another class.
    generator: the random draws' source (CPU); default: a generator seeded with 0 (same mosaics each call).
    """
    batch = as_tensor(images, "images must be a (N, C, H, W) tensor")
    classes = as_tensor(labels, "labels must be a (N,) tensor of class indices")
    if batch.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W); got shape {tuple(batch.shape)}.")
    if classes.dim() != 1 or classes.is_floating_point() or classes.is_complex():
        raise ValueError(f"labels must be (N,) integer class indices; got {short_repr(labels)}.")
    check_count(classes.shape[0], "labels", batch.shape[0], "images")
    count = int_option("count", count, 1)
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    classes = classes.cpu()
    values, frequencies = classes.unique(return_counts=True)
    candidates = [int(value) for value, frequency in zip(values, frequencies)
                  if frequency >= 2 and int((classes != value).sum()) >= 2]
    if not candidates:
        raise ValueError("no class can be a mosaic's target: one needs two images of it and two of other classes "
                         f"(labels hold {len(values)} class{'es' if len(values) != 1 else ''}, counts "
                         f"{frequencies.tolist()}).")
    sources = torch.empty(count, 4, dtype=torch.long)
    positions = torch.empty(count, 4, dtype=torch.bool)
    targets = torch.empty(count, dtype=torch.long)
    for index in range(count):
        target = candidates[int(torch.randint(len(candidates), (), generator=generator))]
        same = (classes == target).nonzero()[:, 0]
        other = (classes != target).nonzero()[:, 0]
        chosen = torch.cat([same[torch.randperm(len(same), generator=generator)[:2]],
                            other[torch.randperm(len(other), generator=generator)[:2]]])
        order = torch.randperm(4, generator=generator)
        sources[index] = chosen[order]
        positions[index] = order < 2
        targets[index] = target
    tiles = batch[sources.to(batch.device)]  # (M, 4, C, H, W)
    top = torch.cat([tiles[:, 0], tiles[:, 1]], dim=-1)
    bottom = torch.cat([tiles[:, 2], tiles[:, 3]], dim=-1)
    return Mosaics(images=torch.cat([top, bottom], dim=-2), positions=positions.to(batch.device),
                   targets=targets.to(batch.device), sources=sources.to(batch.device))
