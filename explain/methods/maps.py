"""From a method's raw maps to an Explanation's: the ``Attribution`` a method returns, normalisation and upsampling, and
the checks on maps (finite; empty, and why)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import (
    Callable,
    Optional,
    Sequence,
    Union,
)

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.caller import warn_at_callers_line
from ..core.targets import (
    SelectedTargets,
)
from ..io.explanation import Diagnostic

NORMALIZATIONS = ("max", "minmax", None)


Flags = Union[Tensor, Callable[[], Tensor]]
"""A (N, K) or (N,) bool tensor, or a function that computes it when it is needed."""


def flags_of(flags: Optional[Flags]) -> Optional[Tensor]:
    """The flags, computed now if given as a function."""
    return flags() if callable(flags) else flags


@dataclass
class Attribution:
    """What a method computes for a batch.

    maps: (N, K, h, w) raw maps, at any resolution (upsampled to the input's afterwards).
    selected: the targets explained and their scores.
    low_res_maps: per layer, (N, K, h, w) maps at the layer's resolution (CAM methods).
    layer: the layer name(s), for the Explanation.
    attributions: (N, K, C, H, W) per-channel attributions at the input (gradient methods).
    diagnostics: method-specific figures, e.g. Integrated Gradients' completeness error.
    zero_gradient: (N, K) bool, where ∂score/∂(layer or input) was zero everywhere (why a map
        may be empty); None when the method takes no gradient.
    disconnected: (N, K) bool, where the score does not depend on the layer or input at all.
    negative_everywhere: (N, K) bool, where a map was ≤ 0 everywhere, and not all zero, before
        its ReLU (CAM methods).
    baseline_is_input: (N,) bool, where a path method's baseline equals the image (a path of length 0).
    empty_reason: why a map of this call that is zero everywhere is so, when the method knows it better than
        the generic "the layer's activations are zero" (FEM: a threshold no value can reach).
    baseline_advice: how to give this method a baseline that differs from the image, where ``baseline_is_input``
        holds (the path methods' ``baseline=``; XRAI's ``baselines=``).
    The flags (zero_gradient, disconnected, negative_everywhere, baseline_is_input) may also be given as functions
    that compute them: they are needed only to say why a map is empty, so they are computed only then.
    nonnegative_maps: the method's maps are ≥ 0 (or NaN) by construction (e.g. |gradient| reduced over channels), so
        their largest |value| is their largest value (``map_extremes``).
    """

    maps: Tensor
    selected: SelectedTargets
    low_res_maps: Optional[list[Tensor]] = None
    layer: Optional[str | list[str]] = None
    attributions: Optional[Tensor] = None
    diagnostics: dict[str, Diagnostic] = field(default_factory=dict)
    zero_gradient: Optional[Flags] = None
    disconnected: Optional[Flags] = None
    negative_everywhere: Optional[Flags] = None
    baseline_is_input: Optional[Flags] = None
    empty_reason: Optional[str] = None
    baseline_advice: str = "baseline='zeros' unless the image is black, 'blur' on a larger image, or a tensor"
    nonnegative_maps: bool = False


def without_graph(tensor: Tensor) -> Tensor:
    """``tensor`` out of the autograd graph (detached only if it is in one: a detach is an operation per call)."""
    return tensor.detach() if tensor.requires_grad else tensor


def normalize_maps(maps: Tensor, how: Optional[str], extremes: Optional[Tensor] = None) -> Tensor:
    """Normalise each (H, W) map of (..., H, W) on its own.

    "max": divide by the largest |value| (non-negative maps → [0, 1], signed → [-1, 1],
    zero stays zero); "minmax": (m - min) / (max - min) → [0, 1]; None: unchanged.
    An all-zero (or constant, for "minmax") map becomes all zeros, never NaN.
    extremes: ``map_extremes(maps, how)`` when the caller has it already.
    """
    if how is None:
        return maps
    if how not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {how!r}.")
    extremes = map_extremes(maps, how) if extremes is None else extremes
    tiny = torch.finfo(maps.dtype).tiny
    if how == "max":  # a map whose largest |value| is 0 is 0 everywhere: 0 / tiny = 0
        largest = extremes if extremes.dim() == maps.dim() else extremes.view(*extremes.shape, 1, 1)
        return maps / largest.clamp_min(tiny)
    # likewise a map whose span is 0 equals its minimum everywhere
    flat = maps.reshape(*maps.shape[:-2], -1)
    low, high = extremes.unbind(-1)
    normalized = (flat - low.unsqueeze(-1)) / (high - low).clamp_min(tiny).unsqueeze(-1)
    return normalized.reshape(maps.shape)


def map_extremes(maps: Tensor, how: Optional[str], nonnegative: bool = False, keepdim: bool = False) -> Tensor:
    """Per (H, W) map of (..., H, W), what its normalisation divides by: the largest |value| (..., ) for "max" and
    None ((..., 1, 1) with ``keepdim``, as ``normalize_maps`` divides by it: one operation fewer), (minimum,
    maximum) (..., 2) for "minmax". NaN or inf in a map makes its extremes NaN or inf, and an all-zero map's
    extremes are 0. nonnegative: the maps are known to be ≥ 0 (or NaN) everywhere, so their largest value is their
    largest |value| (one operation fewer)."""
    if how == "minmax":
        low, high = torch.aminmax(maps.reshape(*maps.shape[:-2], -1), dim=-1)
        return torch.stack([low, high], dim=-1)
    return (maps if nonnegative else maps.abs()).amax(dim=(-2, -1), keepdim=keepdim)


def upsample_maps(maps: Tensor, size: Sequence[int]) -> Tensor:
    """(N, K, h, w) → (N, K, H, W), bilinear (align_corners=False), float32."""
    maps = maps.float()
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps, size=tuple(size), mode="bilinear", align_corners=False)


def check_finite_maps(raw_maps: Tensor, method: str) -> None:
    """Raise when a map holds NaN or inf (a non-finite gradient or perturbation score)."""
    bad = ~torch.isfinite(raw_maps).flatten(2).all(dim=2)  # (N, K)
    if bad.any():
        raise non_finite_maps_error(bad.nonzero().tolist(), method)


def non_finite_maps_error(pairs: Sequence[Sequence[int]], method: str) -> ValueError:
    listed = ", ".join(f"image {n}, target {k}" for n, k in pairs[:6])
    return ValueError(
        f"{method} computed a map with NaN or inf values ({listed}): a gradient or a score overflowed inside "
        "the model. Check the input's range, and run a float16 model in float32 or under autocast."
    )


def checked_map_extremes(values: list[float], shape: Sequence[int], how: Optional[str], method: str) -> list[bool]:
    """From the maps' extremes on the host (``map_extremes``, flattened; ``shape`` theirs): raise when a map holds
    NaN or inf; else whether each (image, target) map is zero everywhere, in row-major order."""
    per_map = 2 if how == "minmax" else 1
    images, targets = shape[0], shape[1]
    rows = [values[i * per_map : (i + 1) * per_map] for i in range(images * targets)]
    bad = [(i // targets, i % targets) for i, row in enumerate(rows) if not all(math.isfinite(v) for v in row)]
    if bad:
        raise non_finite_maps_error(bad, method)
    return [all(v == 0 for v in row) for row in rows]


EMPTY_MAP_REASONS = {
    "empty_region": "the target's region is empty in this image, so the score explained is 0: {region}",
    "empty_path": (
        "the baseline equals the image, so the path from it has length 0 and every attribution is 0 "
        "(they add up to y(x) − y(x') = 0). Give a baseline that differs from the image ({baseline_advice})"
    ),
    "disconnected": (
        "the score does not depend on {where} (autograd finds no path): a detached or constant target, or a "
        "model that runs that part under no_grad or detach() inside forward. Check the target and the layer"
    ),
    "zero_gradient": (
        "the gradient of the score at {where} is zero everywhere although the score depends on it: it vanishes "
        "on the way (a zero-initialised classifier head, such as torchvision's untrained ViT heads; a "
        "transformer block's output, after which only the class token reaches the head). Load trained "
        "weights, or choose an earlier layer"
    ),
    "negative": (
        "the map is ≤ 0 everywhere before the ReLU: the layer holds only evidence against this target. "
        "relu=False shows that evidence; or try another layer or method"
    ),
    "other": "the map is zero everywhere (e.g. the layer's activations are all zero for this image)",
}


def warn_about_empty_maps(empty_map: Tensor, attribution: "Attribution", method: str) -> None:
    """One RuntimeWarning naming the images and targets whose map is zero everywhere (``empty_map``, (N, K) bool on
    the host), and why; also those whose target region (a ``RegionTarget``'s pixels or box) is empty, whatever
    their map. The method's flags are computed here, when a map is empty."""
    empty_region = attribution.selected.empty_region
    empty_region = torch.zeros_like(empty_map) if empty_region is None else empty_region.cpu()
    if not (empty_map | empty_region).any():
        return
    where = "the target layer's output" if attribution.low_res_maps is not None else "the input"
    empty_path = flags_of(attribution.baseline_is_input)
    empty_path = None if empty_path is None else empty_path.cpu()[:, None].expand_as(empty_map)
    given = [("empty_region", empty_region), ("empty_path", empty_path),
             ("disconnected", flags_of(attribution.disconnected)),
             ("zero_gradient", flags_of(attribution.zero_gradient)),
             ("negative", flags_of(attribution.negative_everywhere))]
    checks = [(name, None if flags is None else flags.cpu()) for name, flags in given]
    groups: dict[str, list[str]] = {}
    for n, k in (empty_map | empty_region).nonzero().tolist():
        reason = next((name for name, flags in checks if flags is not None and bool(flags[n, k])), "other")
        groups.setdefault(reason, []).append(f"({n}, {k})")
    reasons = dict(EMPTY_MAP_REASONS, other=attribution.empty_reason or EMPTY_MAP_REASONS["other"])
    lines = [
        f"(image, target) {', '.join(pairs[:8])}{' and more' if len(pairs) > 8 else ''}: "
        + reasons[reason].format(where=where, region=attribution.selected.empty_region_advice,
                                 baseline_advice=attribution.baseline_advice) + "."
        for reason, pairs in groups.items()
    ]
    heading = ("returned maps that are zero everywhere" if bool(empty_map[empty_region].all())
               else "explained targets whose region is empty")
    warn_at_callers_line(f"{method} {heading}. " + " ".join(lines), RuntimeWarning)
