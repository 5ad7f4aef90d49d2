"""Faithfulness by region: the score as whole regions of the image are replaced, in the map's order.

region_perturbation and selectivity replace square patches of a grid, irof superpixels; a region's
relevance is the map's sum over a patch, its mean over a superpixel. Regions are replaced
cumulatively by the substrate (``substrate_for``: "zeros" by default, the zero model input; Quantus's
"black" is "minimum"). Inputs, maps, classes, ``output=`` and the errors are as for
``explain.metrics.deletion``; results are on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..core.targets import OutputSelector, Target
from ..io.inputs import Inputs, PreprocessSpec
from ..methods.options import int_option
from ._common import MapsLike, as_tensor, check_count, ranking, short_repr
from .complexity import _wide
from .faithfulness import (
    Curve,
    RowImages,
    Substrate,
    _area,
    check_substrate,
    grid_scores,
    perturbed_scores,
    substrate_for,
)
from .faithfulness_breadth import _generator, _Setting, _setting

Order = Union[str, Tensor]
"""Which regions go first: "morf" (most relevant first), "lerf" (least relevant first), "random", or a
(N, P) tensor of region indices in the order they are replaced."""


def patch_grid(height: int, width: int, patch_size: int, device: Optional[torch.device] = None) -> tuple[Tensor, int]:
    """The patch of each pixel, (H, W) long, row-major over a grid of ⌈H/p⌉ × ⌈W/p⌉ patches of p × p pixels
    centred on the image (where p does not divide a side, the patches at its two ends are cut short, the
    leftover split as Quantus pads: the smaller part first), and the number of patches."""
    height, width = int_option("height", height, 1), int_option("width", width, 1)
    patch_size = int_option("patch_size", patch_size, 1)
    top, left = ((-height) % patch_size) // 2, ((-width) % patch_size) // 2
    rows = (torch.arange(height, device=device) + top) // patch_size
    columns = (torch.arange(width, device=device) + left) // patch_size
    column_count = -(-(width + left) // patch_size)
    row_count = -(-(height + top) // patch_size)
    return rows[:, None] * column_count + columns[None, :], row_count * column_count


def _region_ranks(relevance: Tensor, order: Order, generator: Optional[torch.Generator]) -> Tensor:
    """(N, P) region relevance → (N, P) the position at which each region is replaced, 0 first."""
    count, regions = relevance.shape
    if isinstance(order, str) and order in ("morf", "lerf"):
        ranks = ranking((relevance if order == "morf" else -relevance)[:, None])
        return ranks.view(count, regions)
    if isinstance(order, str) and order == "random":
        keys = torch.rand(1, regions, generator=_generator(generator))  # one order for every image of the batch,
        return keys.argsort(dim=1).argsort(dim=1).expand(count, -1).to(relevance.device)  # so none depends on its place
    if not isinstance(order, Tensor):
        raise ValueError(f"order must be 'morf', 'lerf', 'random' or a (N, P) tensor of patch indices; got "
                         f"{short_repr(order)}.")
    given = order.to(relevance.device)
    if given.dim() != 2 or given.is_floating_point() or given.dtype == torch.bool:
        raise ValueError(f"an order tensor must be (N, P) integer patch indices; got {short_repr(order)}.")
    check_count(given.shape[0], "rows of order", count, "images")
    expected = torch.arange(regions, device=given.device).expand(count, -1)
    if given.shape[1] != regions or not torch.equal(given.sort(dim=1).values, expected):
        raise ValueError(f"each row of order must be a permutation of the {regions} patch indices (0 … "
                         f"{regions - 1}, row-major over the patch grid).")
    return given.argsort(dim=1)


def _removal(batch: Tensor, pixel_ranks: Tensor, fill: Tensor) -> RowImages:
    """Rows (image n, k): image n with the pixels of its first k regions replaced by ``fill``; pixel_ranks
    (N, 1, H, W) the position of each pixel's region in the order of removal."""

    def perturbed(image: Tensor, removed: Tensor) -> Tensor:
        return torch.where(pixel_ranks[image] < removed.view(-1, 1, 1, 1), fill[image], batch[image])

    return perturbed


def _patch_curves(model: nn.Module, setting: _Setting, patch_size: int, order: Order, regions: Optional[int],
                  generator: Optional[torch.Generator], substrate: Substrate, score: str, batch_size: int,
                  output: OutputSelector) -> tuple[Tensor, int]:
    """((N, L + 1) scores after 0 … L patches replaced in ``order``, the number P of patches)."""
    batch, heat = setting.batch, setting.heat
    count, _, height, width = batch.shape
    patch_of, patch_count = patch_grid(height, width, patch_size, batch.device)
    values = _wide(heat.flatten(1))
    relevance = torch.zeros(count, patch_count, dtype=values.dtype, device=batch.device)
    relevance.scatter_add_(1, patch_of.flatten().expand(count, -1), values)
    ranks = _region_ranks(relevance, order, generator)
    pixel_ranks = ranks[:, patch_of.flatten()].view(count, 1, height, width)
    steps = patch_count if regions is None else min(regions, patch_count)
    removal = _removal(batch, pixel_ranks, substrate_for(batch, substrate))
    scores = grid_scores(model, steps, lambda image, step: removal(image, step + 1), setting.classes, score,
                         batch_size, output)
    return torch.cat([setting.original[:, None], scores], dim=1), patch_count


@dataclass
class RegionPerturbation:
    """fractions: (L + 1,) share of the patches replaced, k / P for k = 0 … L; curves: (N, L + 1) the class
    score after the first k patches are replaced (k = 0: the image's); aopc: (N,) the mean drop
    f(x) − f(x_k) over k = 0 … L (Samek et al.'s area over the perturbation curve): higher is better when the
    most relevant patches go first ("morf"), lower when the least relevant do ("lerf")."""

    fractions: Tensor
    curves: Tensor
    aopc: Tensor


def region_perturbation(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    patch_size: int = 8,
    order: Order = "morf",
    regions: int = 100,
    generator: Optional[torch.Generator] = None,
    substrate: Substrate = "zeros",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> RegionPerturbation:
    """Region perturbation (Samek et al. 2015): the first ``regions`` patches of ``patch_size`` × ``patch_size``
    pixels (``patch_grid``) replaced one after another by the substrate, in ``order`` of the map's sum over
    each patch ("random": one order drawn from ``generator``, the same for every image, so that an image's curve does
    not depend on its batch; or a (N, P) tensor of patch indices). Samek et al.
    replaced 9 × 9 regions with uniform noise (substrate="noise"). Costs N · min(regions, P) forward passes.
    """
    check_substrate(substrate)
    patch_size = int_option("patch_size", patch_size, 1)
    regions = int_option("regions", regions, 1)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    curves, patch_count = _patch_curves(model, setting, patch_size, order, regions, generator, substrate, score,
                                        batch_size, output)
    steps = curves.shape[1] - 1
    fractions = torch.arange(steps + 1, device=curves.device) / patch_count
    drops = setting.original[:, None] - curves
    return RegionPerturbation(fractions=fractions, curves=curves, aopc=drops.mean(dim=1))


def selectivity(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    patch_size: int = 8,
    substrate: Substrate = "zeros",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Curve:
    """Selectivity (Montavon et al. 2018): the score as every patch of ``patch_size`` × ``patch_size`` pixels
    (``patch_grid``) is replaced by the substrate, most relevant (largest map sum) first: deletion by
    patches. fractions: (P + 1,) share of patches replaced; curves: (N, P + 1) scores, k = 0 the image's;
    area: (N,) trapezoid area under the curve over fractions in [0, 1], in [0, 1] with probabilities, lower
    is better. Costs N · P forward passes."""
    check_substrate(substrate)
    patch_size = int_option("patch_size", patch_size, 1)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    curves, patch_count = _patch_curves(model, setting, patch_size, "morf", None, None, substrate, score,
                                        batch_size, output)
    fractions = torch.arange(patch_count + 1, device=curves.device) / patch_count
    return Curve(fractions=fractions, curves=curves, area=_area(fractions, curves))


# ------------------------------------------------------------------ IROF


@dataclass
class Irof:
    """area_over_curve: (N,) 1 − the area under each image's curve over the share of segments replaced
    (trapezoids over [0, 1]), in [0, 1] where replacing segments lowers the score, higher is better;
    curves: per image, (S_n + 1,) the score after its k = 0 … S_n most relevant segments are replaced,
    divided by the image's score (1 at k = 0); segments: (N, H, W) long, each pixel's segment, 0 … S_n − 1."""

    area_over_curve: Tensor
    curves: list[Tensor]
    segments: Tensor


def slic_segments(batch: Tensor) -> Tensor:
    """(N, C, H, W) model inputs → (N, H, W) long SLIC superpixels of each (skimage.segmentation.slic with its
    defaults, about 100 segments, on the image in model-input space, as Quantus 0.6), numbered from 0."""
    from skimage.segmentation import slic

    images = batch.detach().permute(0, 2, 3, 1).double().cpu().numpy()
    return torch.stack([torch.from_numpy(np.asarray(slic(image, start_label=0))).long() for image in images])


def _check_segments(segments: object, batch: Tensor) -> Tensor:
    values = as_tensor(segments, "segments must be a (N, H, W) tensor of segment labels")
    if values.dim() == 2:
        values = values[None]
    if values.dim() != 3 or values.shape[1:] != batch.shape[2:] or values.is_floating_point() or values.is_complex():
        raise ValueError(f"segments must be (N, H, W) integer labels at the input's size {tuple(batch.shape[2:])}; "
                         f"got {short_repr(segments)}.")
    check_count(values.shape[0], "segment maps", batch.shape[0], "images")
    return values.long()


def irof(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    segments: Optional[Tensor] = None,
    substrate: Substrate = "mean",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Irof:
    """Iterative removal of features, IROF (Rieger and Hansen 2020): each image's superpixels replaced one
    after another by the substrate (default "mean": each image's mean value), in order of the map's mean
    over each; the area over the curve of the score relative to the image's.

    segments: (N, H, W) integer labels, any values (numbered from 0 in the result); default
        ``slic_segments`` of the model inputs. score: "probability" (default); the curve is divided by the
        image's score, so a logit that is not positive makes it meaningless. Costs Σ_n S_n forward passes
        (about 100 per image with SLIC).
    """
    check_substrate(substrate)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    batch, heat = setting.batch, setting.heat
    count, _, height, width = batch.shape
    labels = slic_segments(batch) if segments is None else _check_segments(segments, batch)
    numbered = torch.stack([torch.unique(image, return_inverse=True)[1] for image in labels]).to(batch.device)
    segment_counts = numbered.flatten(1).amax(dim=1) + 1
    largest = int(segment_counts.max())
    flat = numbered.flatten(1)
    values = _wide(heat.flatten(1))
    sums = torch.zeros(count, largest, dtype=values.dtype, device=batch.device).scatter_add_(1, flat, values)
    sizes = torch.zeros_like(sums).scatter_add_(1, flat, torch.ones_like(values))
    means = torch.where(sizes > 0, sums / sizes.clamp_min(1), -torch.inf)  # absent labels go last
    ranks = _region_ranks(means, "morf", None)
    pixel_ranks = ranks.gather(1, flat).view(count, 1, height, width)
    images = torch.repeat_interleave(torch.arange(count, device=batch.device), segment_counts)
    starts = torch.cumsum(segment_counts, 0) - segment_counts
    removed = torch.arange(images.shape[0], device=batch.device) - starts[images] + 1  # 1 … S_n per image
    removal = _removal(batch, pixel_ranks, substrate_for(batch, substrate))
    scores = perturbed_scores(model, images, removed, removal, setting.classes, score, batch_size, output)
    relative = scores / setting.original[images]
    curves = [torch.cat([torch.ones(1, device=batch.device), part]) for part in
              relative.split(segment_counts.tolist())]
    areas = torch.stack([((curve[1:] + curve[:-1]) / 2).sum() / (curve.shape[0] - 1) for curve in curves])
    return Irof(area_over_curve=(1 - areas).float(), curves=curves, segments=numbered)
