"""Faithfulness: does the model's score follow what the map calls relevant?

Inputs are anything ``explain()`` accepts (made into model input by ``preprocess``,
default ImageNet normalisation) or a model-ready (N, C, H, W) tensor; maps are
an Explanation or (N, H, W) tensor, one per image, resized to the input. Pixels are
removed or imputed in model-input space. The class scored is the explanation's, else
``target``, else each image's top class; ``output=`` picks the scores in a model output that is not a
plain tensor (a HuggingFace ``ImageClassifierOutput``: automatic; a key, an index or a callable, as the
explainers take it). Refused with a ValueError that says what was
wrong: maps with NaN or inf (named), another number of maps than images (none is
ignored), and every option outside what it takes (named, with its value).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import torch
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.memory_format import channels_last_copies, may_be_layout_error, model_batch, usual_layout_only
from ..core.targets import OutputSelector, Target
from ..io.blur import reflect_blur
from ..io.inputs import Inputs, PreprocessSpec
from ..methods.options import int_option, number_option
from ._common import MapsLike, as_maps, check_count, class_scores, fixed_classes, model_inputs, ranking, short_repr
from .axiomatic import BASELINES, baseline_for

Substrate = Union[str, float, Tensor, Callable[[Tensor], Tensor]]
"""What removed pixels become: "zeros", "blur", "noise", "minimum", "maximum", "mean", a number, a tensor
or a callable batch → tensor (see ``substrate_for``)."""

SUBSTRATES = ("zeros", "blur", "noise", *BASELINES[1:])
SCORES = ("probability", "logit")


@dataclass
class Curve:
    """fractions: (S,) share of pixels changed at each step; curves: (N, S) scores;
    area: (N,) normalised area under the curve (trapezoid over fractions in [0, 1])."""

    fractions: Tensor
    curves: Tensor
    area: Tensor


def check_substrate(substrate: object) -> None:
    """Refuse a substrate that is not one of ``SUBSTRATES``, a finite number, a tensor or a callable, naming it
    briefly."""
    if isinstance(substrate, Tensor) or callable(substrate) or (isinstance(substrate, str) and substrate in SUBSTRATES):
        return
    if isinstance(substrate, numbers.Real) and not isinstance(substrate, bool) and math.isfinite(substrate):
        return
    raise ValueError(f"substrate must be one of {', '.join(map(repr, SUBSTRATES))}, a finite number, a tensor in "
                     f"model-input space (broadcastable to the (N, C, H, W) batch) or a callable batch → tensor; got "
                     f"{short_repr(substrate)}.")


def substrate_for(batch: Tensor, substrate: Substrate, seed: int = 0) -> Tensor:
    """What removed pixels become, (N, C, H, W) like the batch: "zeros" (zero model input: the mean
    colour under ImageNet normalisation), "blur" (Gaussian, σ = max(H, W) / 16, kernel 2⌈3σ⌉ + 1,
    reflected at the edges, as RISE's insertion; any image size, see ``explain.io.blur.reflect_blur``),
    "noise" (uniform in each image's value range, seeded: one (C, H, W) draw u in [0, 1) shared by every
    image, image n's noise low_n + (high_n − low_n) · u, so that an image gets the same noise alone as at any
    place in any batch, as ROAD's), "minimum" / "maximum" / "mean" (each image's smallest / largest / mean
    value over its channels and pixels; Quantus's "black" is the minimum), a number, a tensor broadcastable
    to the batch (e.g. a (C, H, W) fill image in model-input space) or a callable ``batch -> tensor`` of the
    same shape. NaN or inf in a given substrate is refused."""
    check_substrate(substrate)
    if isinstance(substrate, numbers.Real) or isinstance(substrate, str) and substrate in BASELINES[1:]:
        return baseline_for(batch, substrate)
    if isinstance(substrate, Tensor) or callable(substrate):
        result = substrate if isinstance(substrate, Tensor) else substrate(batch)
        where = "the substrate tensor" if isinstance(substrate, Tensor) else "the substrate callable's result"
        if not isinstance(result, Tensor):
            raise ValueError(f"a substrate callable must return a tensor shaped like its input batch "
                             f"{tuple(batch.shape)}; it returned {short_repr(result)}.")
        try:
            result = result.to(batch.device, batch.dtype).expand_as(batch)
        except RuntimeError:
            raise ValueError(f"{where} has shape {tuple(result.shape)}, which does not broadcast to the batch "
                             f"{tuple(batch.shape)}: give (C, H, W) or (N, C, H, W) in model-input space.") from None
        if not bool(torch.isfinite(result).all()):
            raise ValueError(f"{where} holds NaN or inf: removed pixels must become finite values.")
        return result
    if substrate == "zeros":
        return torch.zeros_like(batch)
    if substrate == "blur":
        return reflect_blur(batch, max(batch.shape[-2:]) / 16)
    generator = torch.Generator().manual_seed(seed)  # "noise"
    low = batch.amin(dim=(1, 2, 3), keepdim=True)
    high = batch.amax(dim=(1, 2, 3), keepdim=True)
    draw = torch.rand(1, *batch.shape[1:], generator=generator)  # the same for every image: alone as in a batch
    return low + (high - low) * draw.to(batch.device, batch.dtype)


def check_score_options(score: object, batch_size: object) -> None:
    """Refuse a ``score`` other than "probability" / "logit" or a ``batch_size`` that is not an int ≥ 1."""
    if not isinstance(score, str) or score not in SCORES:
        raise ValueError(f"score must be 'probability' or 'logit'; got {short_repr(score)}.")
    int_option("batch_size", batch_size, 1)


def _prepared(model: nn.Module, inputs: Inputs, maps: MapsLike, target: Target, preprocess: PreprocessSpec,
              output: OutputSelector) -> tuple[Tensor, Tensor, Tensor]:
    """(model batch (N, C, H, W), maps resized to it (N, H, W), classes to score (N,)); one map per image."""
    batch = model_inputs(model, inputs, preprocess)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    return batch, heat, fixed_classes(model, batch, maps, target, output)


def _area(fractions: Tensor, curves: Tensor) -> Tensor:
    widths = fractions[1:] - fractions[:-1]
    return ((curves[:, 1:] + curves[:, :-1]) / 2 * widths).sum(dim=1) / (fractions[-1] - fractions[0])


def step_counts(features: int, steps: int, device: torch.device) -> Tensor:
    """(steps + 1,) how many of ``features`` are changed after each of ``steps`` equal steps: round(s · F / steps)."""
    return torch.round(torch.arange(steps + 1, device=device) * features / steps)


RowImages = Callable[[Tensor, Tensor], Tensor]
"""(image indices (B,), step indices (B,)) → the (B, C, H, W) perturbed model inputs of those rows."""


def perturbed_scores(model: nn.Module, images: Tensor, steps: Tensor, perturbed: RowImages, classes: Tensor,
                     score: str, batch_size: int, output: OutputSelector) -> Tensor:
    """(R,) score of ``classes[images[r]]`` on row r's perturbed input, ``perturbed(images, steps)``: the rows
    (R,) are made and scored ``batch_size`` at a time (across images), so memory holds one pass's inputs.
    Each pass goes to the model in the memory layout that runs it fastest (channels-last for a CNN on the
    CPU, ``explain.core.memory_format``); a model that refuses that layout is run again in the usual one."""

    def scores() -> Tensor:
        results: list[Tensor] = []
        for start in range(0, images.shape[0], batch_size):
            image, step = images[start: start + batch_size], steps[start: start + batch_size]
            rows = model_batch(model, perturbed(image, step))
            results.append(class_scores(model, rows, classes[image], score, batch_size, output))
        return torch.cat(results)

    copies_before = channels_last_copies()
    try:
        return scores()
    except (RuntimeError, AssertionError, ValueError) as error:
        if channels_last_copies() == copies_before or not may_be_layout_error(error):
            raise
    with usual_layout_only():
        return scores()


def grid_scores(model: nn.Module, steps: int, perturbed: RowImages, classes: Tensor, score: str, batch_size: int,
                output: OutputSelector) -> Tensor:
    """(N, steps) scores of ``perturbed_scores`` over every image n and step s (rows image-major), N = len(classes)."""
    rows = torch.arange(classes.shape[0] * steps, device=classes.device)
    scores = perturbed_scores(model, rows // steps, rows % steps, perturbed, classes, score, batch_size, output)
    return scores.view(-1, steps)


def _perturbation_curve(
    model: nn.Module, batch: Tensor, heat: Tensor, classes: Tensor, steps: int, start_from_substrate: bool,
    substrate: Substrate, score: str, batch_size: int, output: OutputSelector,
) -> Curve:
    pixels = batch.shape[-2] * batch.shape[-1]
    fill = substrate_for(batch, substrate)
    ranks = ranking(heat).to(batch.device)[:, None]  # (N, 1, H, W), 0 = most relevant
    counts = step_counts(pixels, steps, batch.device)

    def perturbed(image: Tensor, step: Tensor) -> Tensor:
        changed = ranks[image] < counts[step].view(-1, 1, 1, 1)  # the most relevant pixels first
        if start_from_substrate:  # insertion: the relevant pixels are put back into the substrate
            return torch.where(changed, batch[image], fill[image])
        return torch.where(changed, fill[image], batch[image])  # deletion: they are replaced by the substrate

    fractions = (counts / pixels).cpu()
    curves_tensor = grid_scores(model, steps + 1, perturbed, classes, score, batch_size, output).cpu()
    return Curve(fractions=fractions, curves=curves_tensor, area=_area(fractions, curves_tensor))


def deletion(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    steps: int = 32,
    substrate: Substrate = "zeros",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Curve:
    """Deletion (Petsiuk et al. 2018): the score as the most relevant pixels are replaced by the
    substrate, in ``steps`` equal steps. Area in [0, 1] for probabilities; lower is better."""
    int_option("steps", steps, 1)
    check_substrate(substrate)
    check_score_options(score, batch_size)
    batch, heat, classes = _prepared(model, inputs, maps, target, preprocess, output)
    return _perturbation_curve(model, batch, heat, classes, steps, False, substrate, score, batch_size, output)


def insertion(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    steps: int = 32,
    substrate: Substrate = "blur",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Curve:
    """Insertion (Petsiuk et al. 2018): the score as the most relevant pixels are put back into
    the substrate (a blurred image by default, any image size). Area in [0, 1] for probabilities;
    higher is better."""
    int_option("steps", steps, 1)
    check_substrate(substrate)
    check_score_options(score, batch_size)
    batch, heat, classes = _prepared(model, inputs, maps, target, preprocess, output)
    return _perturbation_curve(model, batch, heat, classes, steps, True, substrate, score, batch_size, output)


# ------------------------------------------------------------------ ROAD


DIRECT_WEIGHT, DIAGONAL_WEIGHT = 1 / 6, 1 / 12
"""ROAD's linear imputation: direct neighbours weigh 1/6, diagonal ones 1/12."""


def neighbour_sum(values: Tensor) -> Tensor:
    """Σ_j w_j x_j over each pixel's 8 neighbours inside the image, (..., H, W) → (..., H, W).
    (Shifted slices of a zero-padded copy: much faster than a one-channel conv2d.)"""
    padded = torch.nn.functional.pad(values, (1, 1, 1, 1))
    height, width = values.shape[-2:]
    direct = (padded[..., :height, 1:-1] + padded[..., 2:, 1:-1]
              + padded[..., 1:-1, :width] + padded[..., 1:-1, 2:])
    diagonal = (padded[..., :height, :width] + padded[..., :height, 2:]
                + padded[..., 2:, :width] + padded[..., 2:, 2:])
    return DIRECT_WEIGHT * direct + DIAGONAL_WEIGHT * diagonal


NOISE_SCALES = ("range", "absolute")
"""ROAD's imputation noise: standard deviation ``noise`` × each image's value range ("range", the default: the
authors' noise of ``noise`` on the [0, 1] image, carried to the model input's scale) or ``noise`` itself on the model
input ("absolute", as Quantus and pytorch-grad-cam add it)."""


def check_noise_scale(noise_scale: object) -> None:
    if not isinstance(noise_scale, str) or noise_scale not in NOISE_SCALES:
        raise ValueError(f"noise_scale must be 'range' (noise × each image's value range, the default) or 'absolute' "
                         f"(standard deviation noise on the model input, as Quantus); got {short_repr(noise_scale)}.")


def noisy_linear_imputation(
    batch: Tensor, removed: Tensor, noise: float = 0.01, seed: int = 0, iterations: int = 400, tolerance: float = 1e-4,
    noise_scale: str = "range",
) -> Tensor:
    """Replace the ``removed`` pixels ((N, H, W) bool) of ``batch`` (N, C, H, W) by the solution of
    x_i = Σ_j w_ij x_j / Σ_j w_ij over each pixel's neighbours j (ROAD, Rong et al. 2022), solved
    by conjugate gradients for all images and channels at once (until the residual is below
    ``tolerance`` relative to the right-hand side, at most ``iterations``), then add Gaussian noise to the
    imputed pixels: of standard deviation ``noise`` × the image's value range (``noise_scale="range"``) or
    ``noise`` (``"absolute"``, as Quantus adds it to the tensor it imputes). Seeded; the same draw for every
    image, so that an image is imputed alike alone and in any batch."""
    check_noise_scale(noise_scale)
    count, channels, height, width = batch.shape
    image = batch.float().reshape(count * channels, 1, height, width)
    unknown = removed.to(batch.device).repeat_interleave(channels, dim=0)[:, None].float()
    known = 1.0 - unknown
    degree = neighbour_sum(torch.ones_like(image))  # Σ_j w_ij over the neighbours inside the image

    def operator(values: Tensor) -> Tensor:  # (D − W) restricted to the unknown pixels: symmetric, positive
        values = values * unknown
        return (degree * values - neighbour_sum(values)) * unknown + 1e-7 * values

    right_side = neighbour_sum(image * known) * unknown
    isolated = degree == 0  # a 1 × 1 image's pixel has no neighbour: it is imputed as 0
    start = torch.where(isolated, 0.0, right_side / torch.where(isolated, 1.0, degree))
    solution = (image * known + start) * unknown  # start: mean of known neighbours
    residual = right_side - operator(solution)
    direction = residual.clone()
    residual_norm = (residual * residual).sum(dim=(1, 2, 3), keepdim=True)
    scale = (right_side * right_side).sum(dim=(1, 2, 3), keepdim=True).clamp_min(1e-30)
    for _ in range(iterations):
        # each image's channels stop at their own tolerance, not the batch's slowest: an image alone as in a batch
        active = (residual_norm / scale).sqrt() >= tolerance
        if not bool(active.any()):
            break
        applied = operator(direction)
        step = residual_norm / (direction * applied).sum(dim=(1, 2, 3), keepdim=True).clamp_min(1e-30)
        step = torch.where(active, step, 0.0)  # a converged row stays as it is (its residual too)
        solution = solution + step * direction
        residual = residual - step * applied
        new_norm = (residual * residual).sum(dim=(1, 2, 3), keepdim=True)
        direction = residual + new_norm / residual_norm.clamp_min(1e-30) * direction
        residual_norm = new_norm
    imputed = image * known + solution * unknown
    if noise > 0:
        generator = torch.Generator().manual_seed(seed)
        jitter = torch.randn(1, channels, height, width, generator=generator)  # the same for every image: an
        jitter = jitter.expand(count, -1, -1, -1).reshape(imputed.shape).to(batch.device)  # image alone as in a batch
        deviation = torch.full((count * channels,), float(noise), device=batch.device)
        if noise_scale == "range":
            spread = (batch.amax(dim=(1, 2, 3)) - batch.amin(dim=(1, 2, 3))).float().repeat_interleave(channels)
            deviation = deviation * spread
        imputed = imputed + jitter * deviation.view(-1, 1, 1, 1) * unknown
    return imputed.reshape(batch.shape).to(batch.dtype)


def road(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    order: str = "morf",
    percentages: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    noise: float = 0.01,
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
    noise_scale: str = "range",
) -> Curve:
    """ROAD, RemOve And Debias (Rong et al. 2022): the score after removing a share of the pixels,
    "morf" most relevant first (lower area is better) or "lerf" least relevant first (higher is
    better), the removed pixels filled by noisy linear imputation so that the removal's shape
    does not leak class information. ``area`` is the mean score over the percentages.

    The imputation works on the model input. The authors (github.com/tleemann/road_evaluation,
    ``NoisyLinearImputer`` with noise 0.01, run on the [0, 1] image before it is normalised) add Gaussian noise
    of standard deviation 0.01 in pixel units. On the model input, whose scale this function does not know, the
    default ``noise_scale="range"`` draws ``noise`` × each image's value range: 0.01 for a [0, 1] image of full
    range, about 0.044 on an ImageNet-normalised one (0.01 / 0.226), as the authors' pixel noise becomes there.
    ``noise_scale="absolute"`` draws ``noise`` itself on the model input, as Quantus and pytorch-grad-cam do
    (their numbers are reproduced with it)."""
    if not isinstance(order, str) or order not in ("morf", "lerf"):
        raise ValueError(f"order must be 'morf' or 'lerf'; got {short_repr(order)}.")
    if isinstance(percentages, (str, bytes)) or not isinstance(percentages, Iterable):
        raise ValueError(f"percentages must be a sequence of shares in [0, 1]; got {short_repr(percentages)}.")
    percentages = [number_option("each of percentages", share) for share in percentages]
    if not percentages or max(percentages) > 1:
        raise ValueError(f"percentages must be one or more shares in [0, 1]; got {short_repr(percentages)}.")
    number_option("noise", noise)
    check_noise_scale(noise_scale)
    check_score_options(score, batch_size)
    batch, heat, classes = _prepared(model, inputs, maps, target, preprocess, output)
    ranks = ranking(heat if order == "morf" else -heat).to(batch.device)
    pixels = heat.shape[-1] * heat.shape[-2]
    curves: list[Tensor] = []
    for share in percentages:
        imputed = noisy_linear_imputation(batch, ranks < round(share * pixels), noise=noise,
                                          noise_scale=noise_scale)
        curves.append(class_scores(model, imputed, classes, score, batch_size, output).cpu())
    curves_tensor = torch.stack(curves, dim=1)
    return Curve(fractions=torch.tensor(list(percentages)), curves=curves_tensor, area=curves_tensor.mean(dim=1))


# ------------------------------------------------------------------ confidence change


@dataclass
class ConfidenceChange:
    """drop: (N,) max(0, Y − O) / Y; increase: (N,) 1 where O > Y; Y the class probability on the
    image, O on the image multiplied by its map. Average drop = 100 · mean(drop), lower is better;
    increase in confidence = 100 · mean(increase), higher is better."""

    drop: Tensor
    increase: Tensor


def confidence_change(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> ConfidenceChange:
    """Average drop and increase in confidence (Chattopadhyay et al. 2018): the model sees only
    what the map keeps, the input multiplied by the map (clipped to [0, 1], with a warning naming the maps that
    reach outside it) in model-input space."""
    check_score_options("probability", batch_size)
    batch, heat, classes = _prepared(model, inputs, maps, target, preprocess, output)
    flat = heat.flatten(1)
    outside = (flat.amin(dim=1) < -1e-6) | (flat.amax(dim=1) > 1 + 1e-6)
    if bool(outside.any()):
        indices = outside.nonzero()[:, 0].tolist()
        named = ", ".join(map(str, indices[:8])) + (" and more" if len(indices) > 8 else "")
        warn_at_callers_line(
            f"confidence_change multiplies each image by its map clipped to [0, 1], but map"
            f"{'s' if len(indices) > 1 else ''} {named} reach{'' if len(indices) > 1 else 'es'} outside it "
            f"(values in [{float(flat.min()):.3g}, {float(flat.max()):.3g}]): clipping changes what the map keeps. "
            "Give maps scaled to [0, 1] (an Explanation's normalised maps of an unsigned method, or "
            "m.clamp_min(0) / m.amax()).")
    heat = heat.clamp(0, 1)
    original = class_scores(model, batch, classes, "probability", batch_size, output)
    masked = class_scores(model, batch * heat[:, None].to(batch.dtype), classes, "probability", batch_size, output)
    drop = (original - masked).clamp_min(0) / original.clamp_min(1e-12)
    return ConfidenceChange(drop=drop.cpu(), increase=(masked > original).float().cpu())
