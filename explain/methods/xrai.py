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

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.targets import Target, select_targets
from ..io.loaded_model import LoadedModel
from .base import Explainer
from .gradients import REDUCTIONS, IntegratedGradients, baseline_like, reduce_channels
from .maps import Attribution, flags_of, upsample_maps
from .options import check_finite_reference, int_option, number_option
from .passes import checked_batch_size, rows_per_pass
from .registry import register

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
    Called with a (C, H, W) image (or an (H, W) one: one channel), returns (M, H, W) bool masks on
    the image's device: the segments of every scale, in order of scale then label; a constant
    image is one segment.
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
        if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence) or not scales:
            raise ValueError(f"scales must be a sequence of at least one Felzenszwalb scale; got {scales!r}.")
        self.scales = tuple(number_option("each of scales", scale, allow_minimum=False) for scale in scales)
        self.sigma = number_option("sigma", sigma)
        self.min_size = int_option("min_size", min_size, 0)
        if size is not None and (not isinstance(size, Sequence) or len(size) != 2):
            raise ValueError(f"size must be None or a (height, width) pair of ints of at least 1; got {size!r}.")
        self.size = None if size is None else (int_option("size[0]", size[0], 1), int_option("size[1]", size[1], 1))
        ends = list(value_range) if isinstance(value_range, Sequence) else []
        if not (len(ends) == 2 and all(isinstance(end, numbers.Real) and math.isfinite(end) for end in ends)
                and ends[0] < ends[1]):
            raise ValueError(f"value_range must be a (low, high) pair of finite numbers, low < high; "
                             f"got {value_range!r}.")
        self.value_range = (float(ends[0]), float(ends[1]))
        self.dilation_radius = int_option("dilation_radius", dilation_radius, 0)

    def __call__(self, image: Tensor) -> Tensor:
        try:
            from skimage.segmentation import felzenszwalb
            from skimage.transform import resize
        except ImportError as error:
            raise ImportError("XRAI's segmentation needs scikit-image: pip install scikit-image.") from error

        image = checked_image(image)
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
            with warnings.catch_warnings():  # more than 3 channels are meant: scikit-image warns that they may not be
                warnings.filterwarnings("ignore", "Got image with third dimension", RuntimeWarning)
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


def checked_image(image: object) -> Tensor:
    """A segmenter's image as (C, H, W): an (H, W) tensor is one channel; anything else, an image that looks
    channels last ((H, W, C) with C ≤ 4 < H) or one holding NaN or inf is a ValueError saying what to pass."""
    if not isinstance(image, Tensor):
        raise TypeError(f"Felzenszwalb segments a (C, H, W) tensor; got {type(image).__name__}.")
    if image.dim() == 2:
        image = image[None]
    if image.dim() != 3:
        raise ValueError(f"Felzenszwalb segments one (C, H, W) image; got shape {tuple(image.shape)} (for a batch, "
                         "call it on each image).")
    if image.shape[-1] <= 4 < image.shape[0]:
        raise ValueError(f"Felzenszwalb segments a channels-first (C, H, W) image; shape {tuple(image.shape)} looks "
                         "channels last (H, W, C): pass image.permute(2, 0, 1).")
    if image.is_floating_point() and not bool(torch.isfinite(image).all()):
        raise ValueError("the image holds NaN or inf values, which Felzenszwalb cannot segment.")
    return image


def candidate_masks(segments: object, size: Sequence[int]) -> Tensor:
    """A segmenter's output → (M, H, W) bool candidate regions at the image's ``size``.

    Takes (M, H, W) masks (bool, or any dtype holding only 0 and 1; a tensor or a numpy array),
    an (H, W) label map (integers, one region per distinct value, as scikit-image's segmenters
    return) or a single (H, W) bool mask. Anything else is a ValueError saying what was given.
    """
    height, width = size
    if not isinstance(segments, (Tensor, np.ndarray)):
        raise TypeError(f"the segmenter must return (M, H, W) masks or an (H, W) label map as a tensor or a numpy "
                        f"array; it returned {type(segments).__name__}.")
    segments = torch.as_tensor(segments)
    if segments.dim() not in (2, 3) or tuple(segments.shape[-2:]) != (height, width):
        raise ValueError(f"the segmenter returned shape {tuple(segments.shape)} for a {height} × {width} image: it "
                         f"must return (M, {height}, {width}) masks or a ({height}, {width}) label map, at the model "
                         "input's size (resize its output back if it segments a resized image).")
    if segments.dim() == 2:
        if segments.dtype == torch.bool:
            return segments[None]
        if segments.is_floating_point() and not bool((segments == segments.round()).all()):
            raise ValueError("the segmenter returned an (H, W) map of fractional values: a label map holds one whole "
                             "number per region.")
        labels = segments.long()
        return labels[None] == labels.unique()[:, None, None]
    if segments.shape[0] == 0:
        raise ValueError("the segmenter returned no mask (shape (0, H, W)): XRAI needs at least one candidate region.")
    if segments.dtype != torch.bool:
        if not bool(((segments == 0) | (segments == 1)).all()):
            raise ValueError(f"the segmenter returned (M, H, W) = {tuple(segments.shape)} values other than 0 and 1: "
                             "masks are bool (True inside the region). A label map is (H, W), one whole number per "
                             "pixel.")
        segments = segments != 0
    return segments


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
    segmenter: (C, H, W) model input → (M, H, W) bool candidate regions (overlapping or not), or
        an (H, W) integer label map (one region per label, as scikit-image's segmenters return),
        used as given (``candidate_masks``); default ``Felzenszwalb()`` (PAIR's scales, resize to
        224 px and 5-pixel dilation).
    area_threshold: stop adding regions once this fraction of the image is covered (default 1.0).
    min_pixel_diff: segments adding fewer new pixels than this are dropped (default 50 as PAIR,
        meant for 224 px images: an image of fewer pixels is a ValueError, lower it).
    A ranking of a single region (a constant map: no segment had ``min_pixel_diff`` pixels, or the
    first one added covered the whole image, as the default's 5-pixel dilation does on tiny
    images) comes with a RuntimeWarning naming the images, the cause and the fix.
    batch_size: interpolated inputs per forward/backward pass of Integrated Gradients;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``Explanation.diagnostics``: "ranks" (N, K, H, W) long, 1 for the first region added;
    "gains" (N, K, H, W) each region's gain (PAIR's XRAI heatmap); "base_attributions"
    (N, K, H, W) the channel-reduced attributions the regions were ranked by.
    """

    name = "xrai"
    summary = "XRAI: regions of an over-segmentation ranked by integrated-gradients density"
    records_the_forward = False  # the wrapped method checks the model for itself

    def reads_pixel_gradients(self) -> bool:
        return self.explainer is None or self.explainer.reads_pixel_gradients()

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
        elif isinstance(explainer, (nn.Module, LoadedModel)):  # a LoadedModel: Explainer takes its parts
            model = explainer
        else:
            raise TypeError(f"XRAI takes a model or an explainer; got {type(explainer).__name__}.")
        super().__init__(model, **options)
        if reduce not in XRAI_REDUCTIONS:
            raise ValueError(f"reduce must be one of {XRAI_REDUCTIONS}; got {reduce!r}.")
        self.batch_size = checked_batch_size(batch_size)
        self.steps = int_option("steps", steps, 1)
        if number_option("area_threshold", area_threshold) > 1:
            raise ValueError(f"area_threshold must be in [0, 1]; got {area_threshold!r}.")
        self.area_threshold = float(area_threshold)
        self.min_pixel_diff = int_option("min_pixel_diff", min_pixel_diff, 0)
        if baselines is not None:
            if not isinstance(baselines, (list, tuple)) or len(baselines) == 0:
                given = (f"a tensor of shape {tuple(baselines.shape)}" if isinstance(baselines, Tensor)
                         else repr(baselines))
                raise ValueError(f"baselines must be a list of at least one baseline, each 'zeros', 'blur' or a tensor "
                                 f"(e.g. baselines=[tensor]), or None for black and white; got {given}.")
            for index, baseline in enumerate(baselines):
                if isinstance(baseline, Tensor) and baseline.is_meta:
                    raise ValueError(f"baselines[{index}] is on the meta device (a shape without values), so no "
                                     "path starts from it. Give a tensor with values, e.g. torch.zeros(C, H, W), on "
                                     "the CPU or the model's device.")
                baseline_like(baseline, None)  # validates its kind
                if isinstance(baseline, Tensor):
                    check_finite_reference(baseline, f"baselines[{index}]")
        if segmenter is not None and not callable(segmenter):
            raise TypeError(f"segmenter must be a callable (C, H, W) image → (M, H, W) masks or an (H, W) label map; "
                            f"got {type(segmenter).__name__}.")
        self.baselines, self.reduce = baselines, reduce
        self.segmenter = segmenter if segmenter is not None else Felzenszwalb()

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
        averaged over the baselines for Integrated Gradients; the inner method's "layer", its
        (N, K) "zero_gradient" and "disconnected" flags and (N,) "baseline_is_input", true where they hold for
        every baseline)."""
        if self.explainer is not None:
            explainers = [self.explainer]
        else:
            explainers = [IntegratedGradients(self.model, baseline=baseline, steps=self.steps,
                                              batch_size=self.batch_size, output=self.output, normalize=None,
                                              class_names=self.class_names)
                          for baseline in self.baselines_for(batch)]
            for explainer in explainers:  # they start at, and add to, the pass sizes that fitted before
                explainer.rows_that_fit = self.rows_that_fit
        collected: list[Tensor] = []
        flags: dict = {"zero_gradient": None, "disconnected": None, "baseline_is_input": None, "layer": None}
        passes = len(explainers) * -(-self.steps * batch.shape[0] // rows_per_pass(self.batch_size, batch.device,
                                                                                    batch.shape[1:].numel()))
        with self.progress_bar(passes, len(explainers), "baseline") as bar:  # the inner methods show none
            for explainer in explainers:
                explainer._forward_call = self._forward_call
                try:
                    inner = explainer.attribute(batch, target, None)
                finally:
                    explainer._forward_call = None
                bar.update()
                collected.append(self.channel_values(inner, batch))
                for key in ("zero_gradient", "disconnected", "baseline_is_input"):  # each: where every baseline's holds
                    value = flags_of(getattr(inner, key))
                    if value is not None:
                        flags[key] = value if flags[key] is None else flags[key] & value
                flags["layer"] = inner.layer
        mean = torch.stack(collected).mean(dim=0)
        reduced = mean.amax(dim=2) if self.reduce == "max" else reduce_channels(mean, self.reduce)
        return reduced, flags

    @staticmethod
    def channel_values(inner: Attribution, batch: Tensor) -> Tensor:
        """(N, K, C, H, W) float64 per-channel attributions at the input's size of an inner method's result
        (C = 1 for a CAM's maps)."""
        if inner.attributions is not None:
            return inner.attributions.detach().double()
        return upsample_maps(inner.maps.detach(), batch.shape[-2:]).double()[:, :, None]  # one map per target

    def single_region_cause(self, masks: Tensor) -> str:
        """Why ``rank_regions`` found one region only in these (M, H, W) candidates, and what to do."""
        largest = int(masks.flatten(1).sum(dim=1).max())
        if largest < max(self.min_pixel_diff, 1):
            return (f"no candidate segment has min_pixel_diff={self.min_pixel_diff} pixels (the largest has "
                    f"{largest}). Pass a smaller min_pixel_diff, or a segmenter of larger regions.")
        return ("the first segment added covers the whole image (Felzenszwalb's segments are dilated by "
                "dilation_radius pixels, 5 by default, which covers a small image). Pass a segmenter of smaller "
                "regions, e.g. segmenter=Felzenszwalb(dilation_radius=1), or explain a larger image.")

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
        pixels = batch.shape[-2] * batch.shape[-1]
        if self.min_pixel_diff > pixels:
            raise ValueError(f"min_pixel_diff={self.min_pixel_diff} is more than the {batch.shape[-2]} × "
                             f"{batch.shape[-1]} image's {pixels} pixels, so no region can be added and the map "
                             f"would be constant. Pass a smaller min_pixel_diff (PAIR's 50 is meant for 224 px "
                             f"images: about 1/1000 of the image, here min_pixel_diff={max(1, pixels // 1000)}).")
        single_region: dict[str, list[str]] = {}
        maps = torch.zeros_like(attributions, dtype=torch.float32)
        gains = torch.zeros_like(attributions, dtype=torch.float32)
        ranks = torch.zeros(attributions.shape, dtype=torch.long, device=batch.device)
        for image in range(count):
            masks = candidate_masks(self.segmenter(batch[image].detach()), batch.shape[-2:]).to(batch.device)
            for column in range(targets):
                if bool(attributions[image, column].eq(0).all()):
                    continue  # nothing to rank by: an empty map, and the base method says why
                regions = rank_regions(attributions[image, column], masks,
                                       area_threshold=self.area_threshold, min_pixel_diff=self.min_pixel_diff)
                if regions.masks.shape[0] == 1:
                    single_region.setdefault(self.single_region_cause(masks), []).append(f"({image}, {column})")
                maps[image, column] = regions.ranking_map().float()
                gains[image, column] = regions.gain_map().float()
                ranks[image, column] = regions.rank_map()
        for cause, where in single_region.items():
            more = " and more" if len(where) > 8 else ""
            warn_at_callers_line(f"{self.method_name} ranked a single region, so the map is constant, for (image, "
                                 f"target) {', '.join(where[:8])}{more}: {cause}", RuntimeWarning)
        return Attribution(
            maps=maps,
            selected=selected,
            layer=flags["layer"],
            diagnostics={"ranks": ranks, "gains": gains, "base_attributions": attributions.float()},
            zero_gradient=flags["zero_gradient"],
            disconnected=flags["disconnected"],
            baseline_is_input=flags["baseline_is_input"],  # a constant image equals its black and white baselines
            baseline_advice="baselines=[...] with a tensor or a constant other than the image's value",
        )
