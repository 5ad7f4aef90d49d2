"""Complexity: how concentrated is a map? A few strong pixels are easier to read than a haze.

Each function takes maps (an Explanation, whose normalised maps are used, or a (N, H, W) /
(H, W) tensor), works on their magnitude |map| (the sign does not count), and returns one
value per image, (N,) float on the maps' device. Maps with NaN or inf are refused, naming them.
An all-zero map scores the worst value (as a constant one): it shows nothing.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..methods.options import bool_option, number_option
from ._common import MapsLike, as_maps


def _magnitudes(maps: MapsLike) -> Tensor:
    """(N, P) |map| of each image, flattened."""
    heat = as_maps(maps)
    return heat.reshape(heat.shape[0], -1).abs()


def _wide(values: Tensor) -> Tensor:
    """``values`` in float64, for sums over many pixels, except on devices without it (Apple's MPS)."""
    return values.double() if values.device.type != "mps" else values


def sparseness(maps: MapsLike) -> Tensor:
    """Gini index of |map| (Chalasani et al. 2020, after Hurley and Rickard 2009), in [0, 1 − 1/P]
    for P pixels, higher is better (sparser): 1 − 1/P for a map with one non-zero pixel, 0 for a
    constant (or all-zero) map. With |map| sorted ascending, a₁ ≤ … ≤ a_P:
    G = Σᵢ (2i − P − 1) aᵢ / (P Σᵢ aᵢ)."""
    magnitude = _magnitudes(maps)
    pixels = magnitude.shape[1]
    if magnitude.device.type == "cpu":  # NumPy's vectorised sort: several times faster than torch's there
        ascending = torch.from_numpy(np.sort(magnitude.numpy(), axis=1))
    else:
        ascending = magnitude.sort(dim=1).values
    ascending = _wide(ascending)
    weights = 2 * torch.arange(1, pixels + 1, device=ascending.device, dtype=ascending.dtype) - pixels - 1
    total = ascending.sum(dim=1)
    gini = (ascending * weights).sum(dim=1) / (pixels * total.clamp_min(torch.finfo(total.dtype).tiny))
    return torch.where(total > 0, gini, torch.zeros_like(gini)).float()


def complexity(maps: MapsLike) -> Tensor:
    """Entropy of the map's share of magnitude per pixel, pᵢ = |mᵢ| / Σⱼ |mⱼ| (Bhatt et al. 2020):
    −Σᵢ pᵢ ln pᵢ in nats, in [0, ln P] for P pixels, lower is better (simpler): 0 for a map with one
    non-zero pixel, ln P for a constant (or all-zero) map."""
    magnitude = _wide(_magnitudes(maps))
    total = magnitude.sum(dim=1, keepdim=True)
    share = magnitude / total.clamp_min(torch.finfo(total.dtype).tiny)
    entropy = -torch.special.xlogy(share, share).sum(dim=1)  # 0 ln 0 = 0
    return torch.where(total[:, 0] > 0, entropy, torch.full_like(entropy, math.log(magnitude.shape[1]))).float()


def effective_complexity(maps: MapsLike, eps: float = 1e-5, normalise: bool = True) -> Tensor:
    """The number of pixels whose |map| exceeds ``eps`` (Nguyen and Martínez 2020), in [0, P] for P
    pixels, lower is better (fewer pixels said to matter); 0 for an all-zero map.

    normalise: divide each map by its largest |value| first (default), so that ``eps`` is a share of
    the map's peak whatever the method's scale; False compares the raw values with ``eps``.
    """
    magnitude = _magnitudes(maps)
    eps = number_option("eps", eps)
    if bool_option("normalise", normalise):
        peak = magnitude.amax(dim=1, keepdim=True)
        magnitude = magnitude / peak.clamp_min(torch.finfo(peak.dtype).tiny)  # an all-zero map stays zero
    return (magnitude > eps).sum(dim=1).float()
