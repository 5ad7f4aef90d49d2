"""Gaussian blur of image batches, for images of any size.

One separable blur, written as a (size × size) matrix per axis: an image (C, H, W) blurred is
B_H @ image @ B_Wᵀ. Row i of B holds the Gaussian's taps i − r … i + r (σ in pixels, truncated at
radius r, normalised to sum 1 over the 2r + 1 taps); a tap that falls outside the signal is
either dropped ("zeros": the signal is zero outside, scipy's mode="constant") or reflected about
the edge pixels ("reflect": … c b | a b c d | c b a …, torch's reflect padding, scipy's
mode="mirror"), as many times as needed, so that a kernel wider than the image is well defined
(torch's reflect padding refuses a pad ≥ the image's side; a side of one pixel stays as it is).
The matrix form also costs O(H²W + HW²) per channel whatever σ, where a convolution costs
O(HW r²).

``gaussian_blur`` blurs each image with its own σ (Blur IG's path); ``reflect_blur`` is
torchvision's ``gaussian_blur(images, kernel_size=2⌈3σ⌉ + 1, sigma=σ)`` for any image size
(the "blur" substrate of the metrics and the "blur" baseline of Integrated Gradients).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

BOUNDARIES = ("zeros", "reflect")


def reflected_index(index: Tensor, size: int) -> Tensor:
    """Indices anywhere on the line folded into [0, size) by reflection about the edge pixels
    (period 2·(size − 1); every index is 0 for a side of one pixel)."""
    if size == 1:
        return torch.zeros_like(index)
    period = 2 * (size - 1)
    folded = index.remainder(period)
    return torch.where(folded >= size, period - folded, folded)


TAPS_PER_CHUNK = 1 << 16
"""Kernel taps computed at a time: a σ far beyond the image's size costs time, not memory."""


def kernel_taps(size: int, sigmas: Tensor, radii: Tensor, boundary: str) -> tuple[Tensor, Tensor]:
    """The taps of S truncated, normalised Gaussians that reach a signal of length ``size``:
    (offsets (T,) long, weights (S, T)). "zeros": the offsets within ±(size − 1) (the others fall
    outside wherever they start); "reflect": every tap, folded onto the offsets 0 … 2(size − 1) − 1
    (the reflection's period) that it lands on alike."""
    widest = int(radii.max().item()) if sigmas.numel() else 0
    period = max(2 * (size - 1), 1)
    reach = min(widest, size - 1)
    kept = (torch.arange(period, device=sigmas.device) if boundary == "reflect"
            else torch.arange(-reach, reach + 1, device=sigmas.device))
    weights = torch.zeros(sigmas.shape[0], len(kept), dtype=sigmas.dtype, device=sigmas.device)
    total = torch.zeros(sigmas.shape[0], 1, dtype=sigmas.dtype, device=sigmas.device)
    safe = torch.where(sigmas > 0, sigmas, 1.0)
    for start in range(-widest, widest + 1, TAPS_PER_CHUNK):
        offsets = torch.arange(start, min(start + TAPS_PER_CHUNK, widest + 1), device=sigmas.device)
        values = offsets.to(sigmas.dtype)
        gauss = torch.where(values.abs() <= radii, torch.exp(-0.5 * values**2 / safe**2), 0.0)  # (S, chunk)
        total += gauss.sum(dim=1, keepdim=True)
        if boundary == "reflect":
            weights.index_add_(1, offsets.remainder(period), gauss)
        else:
            inside = offsets.abs() <= reach
            weights.index_add_(1, offsets[inside] + reach, gauss[:, inside])
    return kept, weights / total


def blur_matrices(size: int, sigmas: Tensor, radii: Tensor, boundary: str = "zeros") -> Tensor:
    """(S, size, size) matrices B_s with B_s @ v the signal v (length ``size``) blurred by a Gaussian
    of σ = ``sigmas[s]`` pixels truncated at radius ``radii[s]`` (a whole number of pixels), the taps
    normalised to sum 1, outside the signal zeros or the signal reflected (``boundary``). σ = 0 (or
    radius 0) gives the identity. dtype and device: the sigmas'."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be one of {BOUNDARIES}; got {boundary!r}.")
    sigmas = sigmas.reshape(-1, 1)
    radii = radii.to(sigmas.dtype).reshape(-1, 1)
    count = sigmas.shape[0]
    offsets, taps = kernel_taps(size, sigmas, radii, boundary)
    positions = torch.arange(size, device=sigmas.device).view(-1, 1) + offsets.view(1, -1)  # (size, T)
    if boundary == "reflect":
        sources, weights = reflected_index(positions, size), taps[:, None, :].expand(count, size, -1)
    else:
        inside = (positions >= 0) & (positions < size)
        sources, weights = positions.clamp(0, size - 1), taps[:, None, :] * inside
    matrices = torch.zeros(count, size, size, dtype=sigmas.dtype, device=sigmas.device)
    matrices.scatter_add_(2, sources.expand(count, -1, -1), weights.contiguous())
    identity = torch.eye(size, dtype=sigmas.dtype, device=sigmas.device).expand_as(matrices)
    return torch.where(((sigmas > 0) & (radii > 0)).view(-1, 1, 1), matrices, identity)


def gaussian_blur(images: Tensor, sigmas: Union[Tensor, Sequence[float], float], *, boundary: str = "zeros",
                  radii: Optional[Union[Tensor, Sequence[int], int]] = None) -> Tensor:
    """Blur each of R images (R, C, H, W) with its own σ (in pixels, along H and W, not across channels).

    sigmas: R values, or one for every image; radii: each kernel's radius in pixels (R or one), default
    ⌊4σ + 0.5⌋ (scipy's truncate=4.0); boundary: "zeros" (scipy's mode="constant", the default)
    or "reflect" (scipy's "mirror"). Same shape and dtype; computed in float32, or float64 for
    float64 images (integer images rounded to their dtype).
    """
    if images.dim() != 4:
        raise ValueError(f"images must be (R, C, H, W); got shape {tuple(images.shape)}.")
    compute = torch.promote_types(images.dtype, torch.float32) if images.is_floating_point() else torch.float32
    sigma_values = _per_image(sigmas, images.shape[0], "sigmas")
    if not torch.isfinite(sigma_values).all() or bool((sigma_values < 0).any()):
        raise ValueError(f"a blur's σ must be finite and ≥ 0; got {sigma_values.unique().tolist()[:4]}.")
    if radii is None:
        radius_values = torch.floor(4.0 * sigma_values + 0.5)
    else:
        radius_values = _per_image(radii, images.shape[0], "radii")
        if not torch.isfinite(radius_values).all() or bool((radius_values < 0).any()):
            raise ValueError(f"a blur's radius must be a whole number of pixels ≥ 0; got "
                             f"{radius_values.unique().tolist()[:4]}.")
    kernels, kernel_of_image = torch.unique(torch.stack([sigma_values, radius_values], dim=1), dim=0,
                                            return_inverse=True)  # each distinct blur's matrices built once
    kernels = kernels.to(images.device, compute)
    rows = blur_matrices(images.shape[-2], kernels[:, 0], kernels[:, 1], boundary)[kernel_of_image]
    columns = blur_matrices(images.shape[-1], kernels[:, 0], kernels[:, 1], boundary)[kernel_of_image]
    blurred = rows[:, None] @ images.to(compute) @ columns[:, None].transpose(-1, -2)
    if not images.is_floating_point():  # integer pixels (uint8) rounded, as torchvision rounds them, not truncated
        blurred = blurred.round()
    return blurred.to(images.dtype)


def _per_image(values: Union[Tensor, Sequence[float], float], count: int, name: str) -> Tensor:
    """``values`` (one, or one per image) as (count,) float64; a ValueError when there are neither."""
    flat = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1).cpu()
    if flat.numel() not in (1, count):
        raise ValueError(f"{name} takes one value for every image or one per image ({count}); got {flat.numel()}.")
    return flat.expand(count)


def reflect_blur(images: Tensor, sigma: float) -> Tensor:
    """(N, C, H, W) images blurred by a Gaussian of σ pixels, kernel 2⌈3σ⌉ + 1 taps, reflected at the
    edges: torchvision's ``gaussian_blur(images, [k, k], [σ, σ])`` with k = 2⌈3σ⌉ + 1 (equal to it up
    to rounding where torchvision runs), and defined for every image size, 1 × 1 included."""
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"a blur's σ must be finite and ≥ 0; got {sigma!r}.")
    return gaussian_blur(images, sigma, boundary="reflect", radii=math.ceil(3 * sigma))
