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

DIRECT_TAPS = 1 << 16
"""A kernel reaching further than this many taps (and, "reflect", than ``DIRECT_PERIODS`` reflection periods) has
its sums in closed form (``progression_sums``): the cost of a blur does not grow with σ."""

DIRECT_PERIODS = 160
"""Beyond this many periods a kernel's σ is over 4 periods (its reach being at most ``VANISHING_SIGMAS`` σ): wide
enough for ``progression_sums`` to be exact to float64 rounding."""

VANISHING_SIGMAS = 40
"""Taps beyond 40 σ are exactly 0 in float32 and float64 (exp(−800) underflows): a radius is cut there."""

EULER_MACLAURIN = ((1 / 12, 1), (-1 / 720, 3), (1 / 30240, 5))
"""(B₂ₖ / (2k)!, 2k − 1) of the Euler–Maclaurin corrections kept by ``progression_sums``."""


def progression_sums(first: Tensor, last: Tensor, step: int, sigmas: Tensor) -> Tensor:
    """Σ exp(−x² / 2σ²) over x = first, first + step, …, last (float64, elementwise; last − first a multiple of
    step), by the Euler–Maclaurin formula: the integral over [first, last] / step, the mean of the two end taps and
    the corrections up to the fifth derivative at the ends. For σ ≥ 4 steps the error is below float64 rounding
    (the next correction is ~10⁻¹²·e^(−(end/σ)²/2) of the sum, the aliasing term e^(−2π²σ²/step²) < 10⁻¹³⁰)."""
    scale = sigmas * math.sqrt(2.0)
    total = sigmas * math.sqrt(math.pi / 2) / step * (torch.erf(last / scale) - torch.erf(first / scale))

    def derivative(x: Tensor, order: int) -> Tensor:  # d^order/dx^order exp(−x²/2σ²) = (−1/σ)^order He(x/σ) e^…
        u = x / sigmas
        hermite = {1: u, 3: u**3 - 3 * u, 5: u**5 - 10 * u**3 + 15 * u}[order]
        return (-1.0 / sigmas) ** order * hermite * torch.exp(-0.5 * u**2)

    total = total + 0.5 * (torch.exp(-0.5 * (first / sigmas) ** 2) + torch.exp(-0.5 * (last / sigmas) ** 2))
    for coefficient, order in EULER_MACLAURIN:
        total = total + coefficient * step**order * (derivative(last, order) - derivative(first, order))
    return total


def closed_form_taps(kept: Tensor, period: int, sigmas: Tensor, radii: Tensor, boundary: str
                     ) -> tuple[Tensor, Tensor]:
    """``kernel_taps``'s (weights (S, T), totals (S, 1)) before normalising, float64, for kernels of σ ≥ 4 periods
    ("reflect") or σ ≥ 1000 ("zeros"): the taps that reach the signal and the sum of every tap in closed form."""
    sigmas, radii, offsets = sigmas.double(), radii.double(), kept.double().view(1, -1)
    if boundary == "zeros":
        weights = torch.where(offsets.abs() <= radii, torch.exp(-0.5 * (offsets / sigmas) ** 2), 0.0)
        return weights, progression_sums(-radii, radii, 1, sigmas)
    # "reflect": the taps j + m·period, m whole, within ±radius, fold onto offset j
    first = offsets + period * torch.ceil((-radii - offsets) / period)
    last = offsets + period * torch.floor((radii - offsets) / period)
    weights = progression_sums(first, last, period, sigmas)
    return weights, weights.sum(dim=1, keepdim=True)


def kernel_taps(size: int, sigmas: Tensor, radii: Tensor, boundary: str) -> tuple[Tensor, Tensor]:
    """The taps of S truncated, normalised Gaussians that reach a signal of length ``size``:
    (offsets (T,) long, weights (S, T)). "zeros": the offsets within ±(size − 1) (the others fall
    outside wherever they start); "reflect": every tap, folded onto the offsets 0 … 2(size − 1) − 1
    (the reflection's period) that it lands on alike. The taps are summed one by one up to
    ``DIRECT_TAPS`` (``DIRECT_PERIODS`` periods, "reflect"), in closed form beyond: the cost does not
    grow with σ (σ = 10⁶ costs what σ = 10⁴ costs)."""
    period = max(2 * (size - 1), 1)
    positive = sigmas > 0
    safe = torch.where(positive, sigmas, 1.0)
    # σ = 0 gives the identity (``blur_matrices``); taps beyond 40 σ are exactly 0
    reaches = torch.where(positive, torch.minimum(radii, torch.ceil(VANISHING_SIGMAS * safe)), 0.0)
    limit = max(DIRECT_TAPS, DIRECT_PERIODS * period) if boundary == "reflect" else DIRECT_TAPS
    closed = reaches > limit  # (S, 1)
    direct_reaches = torch.where(closed, 0.0, reaches)
    # one host synchronisation for the three bounds the loop needs
    direct, farthest, any_closed = (torch.stack([direct_reaches.max(), reaches.max(), closed.any().to(reaches.dtype)])
                                    .tolist() if sigmas.numel() else (0.0, 0.0, 0.0))
    widest, reach = int(direct), min(int(farthest), size - 1)
    kept = (torch.arange(period, device=sigmas.device) if boundary == "reflect"
            else torch.arange(-reach, reach + 1, device=sigmas.device))
    weights = torch.zeros(sigmas.shape[0], len(kept), dtype=sigmas.dtype, device=sigmas.device)
    total = torch.zeros(sigmas.shape[0], 1, dtype=sigmas.dtype, device=sigmas.device)
    for start in range(-widest, widest + 1, TAPS_PER_CHUNK):
        offsets = torch.arange(start, min(start + TAPS_PER_CHUNK, widest + 1), device=sigmas.device)
        values = offsets.to(sigmas.dtype)
        gauss = torch.where(values.abs() <= direct_reaches, torch.exp(-0.5 * values**2 / safe**2), 0.0)  # (S, chunk)
        total += gauss.sum(dim=1, keepdim=True)
        if boundary == "reflect":
            weights.index_add_(1, offsets.remainder(period), gauss)
        else:
            inside = offsets.abs() <= reach
            weights.index_add_(1, offsets[inside] + reach, gauss[:, inside])
    if any_closed:
        rows = closed[:, 0]
        wide_weights, wide_total = closed_form_taps(kept, period, sigmas[rows], reaches[rows], boundary)
        weights[rows], total[rows] = wide_weights.to(weights.dtype), wide_total.to(total.dtype)
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
    sigma_values = sigma_values.clamp(max=1e30)  # float32's range; beyond 10⁶ times the image a blur no longer changes
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
