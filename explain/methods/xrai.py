"""XRAI (Kapishnikov et al. 2019, "XRAI: Better attributions through regions").

An image is over-segmented at several scales (Felzenszwalb's graph segmentation, each segment
dilated so that it takes in its edges); the segments are then added to a growing mask one at a
time, greedily, each time the one whose not-yet-covered pixels have the highest mean attribution
(the "gain", an attribution density). The order in which regions are added ranks them: the map
is higher for earlier regions. The attributions are Integrated Gradients averaged over a black
and a white baseline by default, or those of any other explainer.

This follows Google PAIR's ``saliency`` 0.2 (its segmentation parameters, its default baselines,
its greedy "full" algorithm); the segmentation runs in scikit-image on the CPU, everything else
on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..targets import Target, select_targets
from .base import Attribution, Explainer, checked_batch_size, register, upsample_maps
from .gradients import REDUCTIONS, IntegratedGradients, baseline_like, reduce_channels

XRAI_REDUCTIONS = ("max", *REDUCTIONS)


def disk(radius: int) -> Tensor:
    """(2r + 1, 2r + 1) bool footprint of the pixels within ``radius`` of the centre (x² + y² ≤ r²),
    as ``skimage.morphology.disk``."""
    offsets = torch.arange(-radius, radius + 1)
    return offsets[:, None] ** 2 + offsets[None, :] ** 2 <= radius**2


def dilate_masks(masks: Tensor, radius: int) -> Tensor:
    """(M, H, W) bool masks, each grown by a disk of ``radius`` pixels (binary dilation; pixels
    outside the image count as off). Same shape, on the same device."""
    if radius <= 0 or masks.shape[0] == 0:
        return masks
    footprint = disk(radius).to(masks.device, torch.float32)[None, None]
    grown = F.conv2d(masks[:, None].float(), footprint, padding=radius)
    return grown[:, 0] > 0.5


class Felzenszwalb:
    """XRAI's over-segmentation: Felzenszwalb & Huttenlocher's graph segmentation
    (``skimage.segmentation.felzenszwalb``) at several scales, as PAIR's ``saliency`` runs it.

    The image's values are rescaled to ``value_range`` (over all channels), the image resized to
    ``size`` (bicubic; None: kept) so that the scales mean the same for every image size, each
    scale's segments resized back (nearest) and every segment dilated by a disk of
    ``dilation_radius`` pixels (at the image's own size).
    Called with a (C, H, W) image, returns (M, H, W) bool masks on the image's device: the
    segments of every scale, in order of scale then label; a constant image is one segment.
    """

    def __init__(
        self,
        scales: Sequence[float] = (50, 100, 150, 250, 500, 1200),
        sigma: float = 0.8,
        min_size: int = 150,
        size: Optional[tuple[int, int]] = (224, 224),
        value_range: tuple[float, float] = (-1.0, 1.0),
        dilation_radius: int = 5,
    ):
        if not scales:
            raise ValueError("scales must hold at least one Felzenszwalb scale.")
        self.scales, self.sigma, self.min_size = tuple(scales), sigma, min_size
        self.size, self.value_range, self.dilation_radius = size, value_range, dilation_radius

    def __call__(self, image: Tensor) -> Tensor:
        try:
            from skimage.segmentation import felzenszwalb
            from skimage.transform import resize
        except ImportError as error:
            raise ImportError("XRAI's segmentation needs scikit-image: pip install scikit-image.") from error

        height, width = image.shape[-2:]
        pixels = image.detach().double().permute(1, 2, 0).cpu().numpy()
        low, high = pixels.min(), pixels.max()
        if not high > low:
            return torch.ones(1, height, width, dtype=torch.bool, device=image.device)
        pixels = (pixels - low) / (high - low) * (self.value_range[1] - self.value_range[0]) + self.value_range[0]
        if self.size is not None:
            pixels = resize(pixels, tuple(self.size), order=3, mode="constant", preserve_range=True,
                            anti_aliasing=True)
        channel_axis = -1 if pixels.shape[-1] > 1 else None
        if channel_axis is None:
            pixels = pixels[..., 0]
        per_scale: list[Tensor] = []
        for scale in self.scales:
            labels = felzenszwalb(pixels, scale=scale, sigma=self.sigma, min_size=self.min_size,
                                  channel_axis=channel_axis)
            if self.size is not None:
                labels = resize(labels, (height, width), order=0, preserve_range=True, mode="constant",
                                anti_aliasing=False).astype(np.int64)
            labels = torch.from_numpy(np.ascontiguousarray(labels)).to(image.device)
            values = torch.arange(int(labels.min()), int(labels.max()) + 1, device=image.device)
            per_scale.append(labels[None] == values[:, None, None])
        masks = torch.cat(per_scale)
        masks = masks[masks.flatten(1).any(dim=1)]  # labels lost in the resize back
        return dilate_masks(masks, self.dilation_radius)

    def __repr__(self) -> str:
        return (f"Felzenszwalb(scales={self.scales}, sigma={self.sigma}, min_size={self.min_size}, size={self.size}, "
                f"dilation_radius={self.dilation_radius})")


@dataclass
class Regions:
    """XRAI's regions of one image and target, in the order they were added.

    masks: (R, H, W) bool, disjoint, covering the image; the last may be the pixels no segment
        was added for (when ``area_threshold`` < 1 or segments were too small).
    gains: (R,) float64, each region's mean attribution when it was added.
    """

    masks: Tensor
    gains: Tensor

    def ranking_map(self) -> Tensor:
        """(H, W) float: (R − i) / R on region i (0-based): 1 on the first region, 1/R on the last."""
        count = self.masks.shape[0]
        values = (count - torch.arange(count, dtype=torch.float64, device=self.masks.device)) / count
        return (self.masks.double() * values[:, None, None]).sum(dim=0)

    def gain_map(self) -> Tensor:
        """(H, W) float64: each pixel's region's gain (PAIR's XRAI heatmap)."""
        return (self.masks.double() * self.gains[:, None, None]).sum(dim=0)

    def rank_map(self) -> Tensor:
        """(H, W) long: 1 on the first region added, R on the last."""
        ranks = torch.arange(1, self.masks.shape[0] + 1, device=self.masks.device)
        return (self.masks.long() * ranks[:, None, None]).sum(dim=0)


def rank_regions(attribution: Tensor, masks: Tensor, *, area_threshold: float = 1.0,
                 min_pixel_diff: int = 50) -> Regions:
    """XRAI's greedy region selection.

    attribution: (H, W) attributions; masks: (M, H, W) bool candidate segments (overlapping).
    Until the covered fraction of the image exceeds ``area_threshold`` or no segment is left:
    every segment that would add fewer than ``min_pixel_diff`` new pixels is dropped; of the
    others, the one whose new pixels have the highest mean attribution (the first such, on a
    tie) is added. The pixels left over form a last region.
    """
    height, width = attribution.shape
    values = attribution.double().flatten()
    flat = masks.flatten(1)
    owner, pixel = flat.nonzero().unbind(1)  # every (segment, pixel) pair, so that sums cost Σ sizes
    covered = torch.zeros(height * width, dtype=torch.bool, device=values.device)
    alive = torch.ones(masks.shape[0], dtype=torch.bool, device=values.device)
    chosen, gains = [], []
    area = 0.0
    while area <= area_threshold:
        uncovered = ~covered
        new_pixels = torch.zeros(len(alive), dtype=torch.long, device=values.device).index_add_(
            0, owner, uncovered[pixel].long())
        alive &= new_pixels >= max(min_pixel_diff, 1)
        if not bool(alive.any()):
            break
        new_sums = torch.zeros(len(alive), dtype=torch.float64, device=values.device).index_add_(
            0, owner, (values * uncovered)[pixel])
        density = new_sums / new_pixels.clamp_min(1)
        best = int(torch.where(alive, density, -torch.inf).argmax())
        chosen.append(flat[best] & uncovered)
        gains.append(density[best])
        covered |= flat[best]
        alive[best] = False
        area = float(covered.double().mean())
    if not bool(covered.all()):
        chosen.append(~covered)
        gains.append(values[~covered].mean())
    return Regions(torch.stack(chosen).view(-1, height, width), torch.stack(gains))


@register
class XRAI(Explainer):
    """XRAI (Kapishnikov et al. 2019): regions of an over-segmentation ranked greedily by their
    attribution density. The map is the ranking: 1 on the first region added, (R − i) / R on the
    i-th (0-based) of R; higher = earlier.

    explainer: a model, whose attributions are then Integrated Gradients averaged over
        ``baselines`` (PAIR's default: two constant images, the image's minimum and its maximum
        value, "black" and "white"); or any explainer of the toolkit (e.g. ``GuidedIG(model)``),
        whose per-channel attributions (or, for CAM methods, maps) are used.
    steps: Integrated Gradients' steps per baseline (default 100 as PAIR; the midpoint rule).
    baselines: None (black and white), or a list of baselines as IntegratedGradients takes them.
    reduce: how the colour channels become one attribution per pixel: "max" (default, PAIR's
        signed maximum over channels), "maxabs", "sumabs" or "sum".
    segmenter: (C, H, W) model input → (M, H, W) bool candidate regions, used as given;
        default ``Felzenszwalb()`` (PAIR's scales, resize to 224 px and 5-pixel dilation).
    area_threshold: stop adding regions once this fraction of the image is covered (default 1.0).
    min_pixel_diff: segments adding fewer new pixels than this are dropped (default 50 as PAIR).
    batch_size: interpolated inputs per forward/backward pass of Integrated Gradients;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``Explanation.diagnostics``: "ranks" (N, K, H, W) long, 1 for the first region added;
    "gains" (N, K, H, W) each region's gain (PAIR's XRAI heatmap); "base_attributions"
    (N, K, H, W) the channel-reduced attributions the regions were ranked by.
    """

    name = "xrai"
    summary = "XRAI: regions of an over-segmentation ranked by integrated-gradients density"

    def __init__(
        self,
        explainer: Union[Explainer, nn.Module],
        *,
        steps: int = 100,
        baselines: Optional[Sequence[Union[str, Tensor]]] = None,
        reduce: str = "max",
        segmenter: Optional[Callable[[Tensor], Tensor]] = None,
        area_threshold: float = 1.0,
        min_pixel_diff: int = 50,
        batch_size: Optional[int] = None,
        **options,
    ):
        self.explainer: Optional[Explainer] = None
        if isinstance(explainer, Explainer):
            options.setdefault("preprocess", explainer.preprocess)
            options.setdefault("class_names", explainer.class_names)
            options.setdefault("output", explainer.output)
            model, self.explainer = explainer.model, explainer
        elif isinstance(explainer, nn.Module):
            model = explainer
        else:
            raise TypeError(f"XRAI takes a model or an explainer; got {type(explainer).__name__}.")
        super().__init__(model, **options)
        if reduce not in XRAI_REDUCTIONS:
            raise ValueError(f"reduce must be one of {XRAI_REDUCTIONS}; got {reduce!r}.")
        checked_batch_size(batch_size)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int of at least 1; got {steps!r}.")
        if not 0 <= area_threshold <= 1:
            raise ValueError(f"area_threshold must be in [0, 1]; got {area_threshold!r}.")
        if baselines is not None:
            if len(baselines) == 0:
                raise ValueError("baselines must hold at least one baseline (or be None for black and white).")
            for baseline in baselines:
                baseline_like(baseline, None)  # validates
        self.steps, self.baselines, self.reduce, self.batch_size = steps, baselines, reduce, batch_size
        self.segmenter = segmenter if segmenter is not None else Felzenszwalb()
        self.area_threshold, self.min_pixel_diff = area_threshold, min_pixel_diff

    @property
    def method_name(self) -> str:
        return "XRAI" if self.explainer is None else f"XRAI({self.explainer.method_name})"

    def baselines_for(self, batch: Tensor) -> list[Union[str, Tensor]]:
        """The Integrated Gradients baselines: PAIR's black and white, (N, 1, 1, 1) per-image
        minimum and maximum of the model input, or the ``baselines`` given."""
        if self.baselines is not None:
            return list(self.baselines)
        return [batch.amin(dim=(1, 2, 3), keepdim=True), batch.amax(dim=(1, 2, 3), keepdim=True)]

    def base_attributions(self, batch: Tensor, target: Target) -> tuple[Tensor, dict]:
        """For fixed targets: ((N, K, H, W) float64 channel-reduced attributions at the input's size,
        averaged over the baselines for Integrated Gradients; the inner method's "layer" and its
        (N, K) "zero_gradient" and "disconnected" flags, true where they hold for every baseline)."""
        if self.explainer is not None:
            explainers = [self.explainer]
        else:
            explainers = [IntegratedGradients(self.model, baseline=baseline, steps=self.steps,
                                              batch_size=self.batch_size, output=self.output, normalize=None)
                          for baseline in self.baselines_for(batch)]
            for explainer in explainers:  # they start at, and add to, the pass sizes that fitted before
                explainer.rows_that_fit = self.rows_that_fit
        collected: list[Tensor] = []
        flags: dict = {"zero_gradient": None, "disconnected": None, "layer": None}
        for explainer in explainers:
            explainer.forward_call = self.forward_call
            try:
                inner = explainer.attribute(batch, target, None)
            finally:
                explainer.forward_call = None
            if inner.attributions is not None:
                values = inner.attributions.detach().double()
            else:  # CAM methods: one map per target, at the layer's resolution
                values = upsample_maps(inner.maps.detach(), batch.shape[-2:]).double()[:, :, None]
            collected.append(values)
            for key in ("zero_gradient", "disconnected"):
                value = getattr(inner, key)
                if value is not None:
                    flags[key] = value if flags[key] is None else flags[key] & value
            flags["layer"] = inner.layer
        mean = torch.stack(collected).mean(dim=0)
        reduced = mean.amax(dim=2) if self.reduce == "max" else reduce_channels(mean, self.reduce)
        return reduced, flags

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
        fixed = selected.target_function or selected.class_indices
        attributions, flags = self.base_attributions(batch, fixed)
        bad = ~torch.isfinite(attributions).flatten(2).all(dim=2)
        if bad.any():
            pairs = ", ".join(f"image {n}, target {k}" for n, k in bad.nonzero().tolist()[:6])
            raise ValueError(f"XRAI's attributions hold NaN or inf ({pairs}): a gradient overflowed inside the model. "
                             "Check the input's range.")
        targets = attributions.shape[1]
        maps = torch.zeros_like(attributions, dtype=torch.float32)
        gains = torch.zeros_like(attributions, dtype=torch.float32)
        ranks = torch.zeros(attributions.shape, dtype=torch.long, device=batch.device)
        for image in range(count):
            masks = self.segmenter(batch[image].detach())
            for column in range(targets):
                if bool(attributions[image, column].eq(0).all()):
                    continue  # nothing to rank by: an empty map, and the base method says why
                regions = rank_regions(attributions[image, column], masks.to(batch.device),
                                       area_threshold=self.area_threshold, min_pixel_diff=self.min_pixel_diff)
                maps[image, column] = regions.ranking_map().float()
                gains[image, column] = regions.gain_map().float()
                ranks[image, column] = regions.rank_map()
        return Attribution(
            maps=maps,
            selected=selected,
            layer=flags["layer"],
            diagnostics={"ranks": ranks, "gains": gains, "base_attributions": attributions.float()},
            zero_gradient=flags["zero_gradient"],
            disconnected=flags["disconnected"],
        )
