"""Axiomatic properties: does an attribution obey what a faithful one must?

completeness: the attributions add up to the change of the score from a baseline;
non_sensitivity: the features with zero attribution are exactly those the score does not depend on;
input_invariance: a constant shift of the input, absorbed by the model's first layer (so the
model computes the same function of the image), leaves the map unchanged.

Inputs are anything ``explain()`` accepts (made into model input by ``preprocess``, default
ImageNet normalisation) or a model-ready (N, C, H, W) tensor; the class scored is the
explanation's, else ``target``, else each image's top class; ``output=`` picks the scores in a
model output that is not a plain tensor. Results are one value per image, on the model's device.
Refused with an error that says what was wrong: maps or attributions with NaN or inf, another
number of them than images (none is ignored), and every option outside what it takes.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.capture import find_layers, model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import OutputSelector, Target, class_probabilities, select_targets
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec, prepare_inputs
from ..methods.base import Explainer
from ..methods.options import int_option, number_option
from ..methods.passes import autocast_dtype
from ._common import (
    MapsLike,
    as_maps,
    as_tensor,
    check_count,
    check_explained_classes,
    check_finite,
    class_scores,
    explained_classes,
    model_inputs,
    model_scores,
    run_model,
    short_repr,
    warn_if_probabilities,
)

Baseline = Union[str, float, Tensor]
"""What a removed input becomes: "zeros", "minimum", "maximum", "mean", a number or a tensor (see ``baseline_for``)."""

BASELINES = ("zeros", "minimum", "maximum", "mean")
SCORES = ("probability", "logit")


def baseline_for(batch: Tensor, baseline: Baseline) -> Tensor:
    """The baseline x' for a (N, C, H, W) model batch, same shape, in model-input space: "zeros"
    (zero model input: the mean colour under ImageNet normalisation), "minimum" / "maximum" / "mean"
    (each image's smallest / largest / mean value over all its channels and pixels; Quantus calls the
    minimum "black" and the maximum "white"), a number, or a finite tensor broadcastable to the batch
    (e.g. a (C, H, W) image)."""
    if isinstance(baseline, str):
        if baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, a number or a tensor; got {baseline!r}.")
        if baseline == "zeros":
            return torch.zeros_like(batch)
        flat = batch.reshape(batch.shape[0], -1)
        if baseline == "minimum":
            per_image = flat.amin(dim=1)
        elif baseline == "maximum":
            per_image = flat.amax(dim=1)
        else:
            per_image = flat.mean(dim=1)
        return per_image.view(-1, 1, 1, 1).expand_as(batch)
    if isinstance(baseline, numbers.Real) and not isinstance(baseline, bool):
        if not math.isfinite(baseline):
            raise ValueError(f"baseline must be a finite number; got {baseline!r}.")
        return torch.full_like(batch, float(baseline))
    if isinstance(baseline, Tensor):
        if not bool(torch.isfinite(baseline).all()):
            raise ValueError("the baseline tensor holds NaN or inf: give finite values in model-input space.")
        try:
            return baseline.to(batch.device, batch.dtype).expand_as(batch)
        except RuntimeError:
            raise ValueError(f"the baseline tensor has shape {tuple(baseline.shape)}, which does not broadcast to "
                             f"the batch {tuple(batch.shape)}: give (C, H, W) or (N, C, H, W) in model-input "
                             "space.") from None
    raise ValueError(f"baseline must be one of {BASELINES}, a number or a tensor; got {short_repr(baseline)}.")


def _check_score(score: object) -> str:
    if not isinstance(score, str) or score not in SCORES:
        raise ValueError(f"score must be 'probability' or 'logit'; got {short_repr(score)}.")
    return score


def _classes_and_scores(model: nn.Module, batch: Tensor, source: MapsLike, target: Target, score: str,
                        batch_size: int, output: OutputSelector) -> tuple[Tensor, Tensor]:
    """(N,) classes to score (the explanation's, else ``target``, else each image's top class) and (N,)
    their scores on ``batch`` ("logit" or "probability", ``class_scores``), from one pass through the model."""
    explained = explained_classes(source, target)
    if explained is not None:
        classes = explained.to(batch.device)
        return classes, class_scores(model, batch, classes, score, batch_size, output)
    with torch.no_grad(), preserved_model_state(model):
        logits = torch.cat([model_scores(model(rows), output, rows.shape[0]).float()
                            for rows in batch.split(batch_size)])
    selected = select_targets(logits, target, None, batch_size=batch.shape[0])
    if selected.class_indices is None or selected.class_indices.shape[1] != 1:
        raise ValueError("this metric scores one class per image: give one class index (or none, for the top class) "
                         "per image, not a callable or several targets.")
    classes = selected.class_indices[:, 0].to(batch.device)
    check_explained_classes(source, classes)
    if score == "probability":
        warn_if_probabilities(logits)
    values = class_probabilities(logits) if score == "probability" else logits
    return classes, values.gather(1, classes[:, None])[:, 0]


# ------------------------------------------------------------------ completeness


@dataclass
class Completeness:
    """Per image, (N,) each: attribution_sum Σ attributions; score_change f(x) − f(x'); error their
    difference (0 for complete attributions, the better the closer); relative_error
    |error| / |score_change| (≥ 0, lower is better)."""

    attribution_sum: Tensor
    score_change: Tensor
    error: Tensor
    relative_error: Tensor


def _attribution_sums(attributions: MapsLike) -> Tensor:
    """(N,) float64 Σ of each image's attributions: an Explanation's per-channel ``attributions``
    (one target per image), or a (N, C, H, W) / (N, H, W) tensor."""
    if isinstance(attributions, Explanation):
        if attributions.attributions is None:
            raise ValueError(f"this {attributions.method} explanation holds no attributions of the input's values "
                             "(CAM-like maps live at a layer's resolution and do not add up to a score): completeness "
                             "applies to input attributions such as Integrated Gradients' or DeepLIFT's.")
        if attributions.attributions.shape[1] != 1:
            raise ValueError("this explanation has several targets per image; pass one target's attributions with its "
                             "classes, e.g. explanation.attributions[:, k] and target=explanation.targets[:, k].")
        values = attributions.attributions[:, 0]
    else:
        values = as_tensor(attributions, "attributions must be an Explanation or a (N, C, H, W) / (N, H, W) tensor")
        if values.dim() not in (3, 4) or values.shape[0] == 0:
            raise ValueError(f"attributions must be (N, C, H, W) or (N, H, W) with N ≥ 1; got shape "
                             f"{tuple(values.shape)}.")
    values = values.detach()
    check_finite(values, "attribution map", "completeness needs finite attributions.")
    return values.reshape(values.shape[0], -1).double().sum(dim=1)


def completeness(
    model: nn.Module,
    inputs: Inputs,
    attributions: MapsLike,
    target: Target = None,
    *,
    baseline: Baseline = "zeros",
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Completeness:
    """Completeness (Sundararajan et al. 2017; summation-to-delta, Shrikumar et al. 2017): how far the
    sum of the attributions is from f(x) − f(x'), the change of the class score from the baseline x' to
    the image x. The attributions are raw, in the score's units: an Explanation's per-channel
    ``attributions`` (never its normalised maps), or a (N, C, H, W) / (N, H, W) tensor.

    baseline: the x' the attribution method used (Integrated Gradients' default is "zeros"): "zeros" (zero
        model input), "minimum" / "maximum" / "mean" (each image's smallest / largest / mean value over its
        channels and pixels; Quantus's "black" is the minimum), a number, or a tensor broadcastable to the
        (N, C, H, W) batch, in model-input space. score: "logit" (default, as the paper) or "probability".
    """
    score = _check_score(score)
    int_option("batch_size", batch_size, 1)
    sums = _attribution_sums(attributions)
    batch = model_inputs(model, inputs, preprocess)
    check_count(sums.shape[0], "attribution maps", batch.shape[0], "images")
    classes, at_image = _classes_and_scores(model, batch, attributions, target, score, batch_size, output)
    reference = baseline_for(batch, baseline)
    at_baseline = class_scores(model, reference, classes, score, batch_size, output)
    change = (at_image - at_baseline).double()  # in the scores' own precision, then widened
    sums = sums.to(change.device)
    error = sums - change
    return Completeness(attribution_sum=sums, score_change=change, error=error,
                        relative_error=error.abs() / change.abs().clamp_min(1e-12))


# ------------------------------------------------------------------ non-sensitivity

FEATURES = ("pixels", "elements")


def non_sensitivity(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    map_eps: float = 1e-5,
    score_eps: float = 1e-5,
    baseline: Baseline = "zeros",
    features: str = "pixels",
    patch_size: int = 1,
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Non-sensitivity (Nguyen and Martínez 2020): the number of features in the symmetric difference
    of the set the map calls irrelevant (|map| / max |map| < ``map_eps``) and the set the score does
    not depend on (replacing the feature by the baseline moves the score by less than ``score_eps``).
    (N,) float in [0, number of features], lower is better, 0 when the two sets agree.

    baseline: what a feature is replaced by, as for ``completeness`` (default "zeros").
    features: "pixels" (default: a pixel's channels are replaced together, H·W features) or "elements"
        (each channel of each pixel on its own, C·H·W features, the map's value shared by the channels;
        Quantus 0.6's choice). patch_size: p > 1 makes each p × p patch one feature (its attribution the
        patch's largest |map|), for ⌈H/p⌉·⌈W/p⌉ (× C) features.
    Costs one forward pass per feature and image, ``batch_size`` perturbed images per pass.
    """
    map_eps = number_option("map_eps", map_eps)
    score_eps = number_option("score_eps", score_eps)
    if not isinstance(features, str) or features not in FEATURES:
        raise ValueError(f"features must be 'pixels' or 'elements'; got {short_repr(features)}.")
    patch_size = int_option("patch_size", patch_size, 1)
    score = _check_score(score)
    int_option("batch_size", batch_size, 1)
    batch = model_inputs(model, inputs, preprocess)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    classes, original = _classes_and_scores(model, batch, maps, target, score, batch_size, output)
    fill = baseline_for(batch, baseline)
    count, channels, height, width = batch.shape

    magnitude = heat.abs()
    peak = magnitude.flatten(1).amax(dim=1).view(-1, 1, 1)
    magnitude = magnitude / peak.clamp_min(torch.finfo(peak.dtype).tiny)
    patch_magnitude = F.max_pool2d(magnitude[:, None], patch_size, ceil_mode=True).flatten(1)  # (N, F_spatial)
    columns = -(-width // patch_size)
    rows = torch.arange(height, device=batch.device) // patch_size
    feature_of_pixel = rows[:, None] * columns + torch.arange(width, device=batch.device)[None, :] // patch_size
    spatial_features = patch_magnitude.shape[1]
    if features == "elements":  # feature c·F_spatial + f: channel c of spatial feature f
        channel_offset = torch.arange(channels, device=batch.device).view(-1, 1, 1) * spatial_features
        feature_id = channel_offset + feature_of_pixel
        said_irrelevant = (patch_magnitude < map_eps).repeat(1, channels)
    else:
        feature_id = feature_of_pixel.expand(channels, height, width)
        said_irrelevant = patch_magnitude < map_eps
    feature_count = said_irrelevant.shape[1]

    insensitive = torch.empty(count * feature_count, dtype=torch.bool, device=batch.device)
    for start in range(0, count * feature_count, batch_size):  # rows (image, feature), image-major
        row = torch.arange(start, min(start + batch_size, count * feature_count), device=batch.device)
        image, feature = row // feature_count, row % feature_count
        replaced = feature_id[None] == feature.view(-1, 1, 1, 1)  # (B, C, H, W)
        perturbed = torch.where(replaced, fill[image], batch[image])
        moved = class_scores(model, perturbed, classes[image], score, batch_size, output) - original[image]
        insensitive[row] = moved.abs() < score_eps
    disagree = insensitive.view(count, feature_count) ^ said_irrelevant
    return disagree.sum(dim=1).float()


# ------------------------------------------------------------------ input invariance


@dataclass
class InputInvariance:
    """Per image, (N,) each: invariant 1.0 where every value of the shifted input's raw map is close to
    the original's (|shifted − original| ≤ atol + rtol · |shifted|), else 0.0 (higher is better);
    difference the largest |shifted − original| over the raw map (≥ 0, lower is better)."""

    invariant: Tensor
    difference: Tensor


def _first_layer(model: nn.Module, batch: Tensor, layer: Optional[str], options: Mapping[str, Any]
                 ) -> tuple[str, nn.Module]:
    """The layer that absorbs the shift: ``layer`` by name, else the first module with parameters of its
    own that the forward runs (with the model's other inputs of ``options``, as ``explain`` takes them). Refused
    when it does not take the model's input as it is."""
    if layer is not None:
        candidates = find_layers(model, [layer])
    else:
        candidates = [(name, module) for name, module in model.named_modules()
                      if name and any(True for _ in module.parameters(recurse=False))]
        if not candidates:
            raise ValueError("the model has no layer with parameters to absorb the input's shift.")
    seen: list[tuple[str, nn.Module, object]] = []

    def record(name: str, module: nn.Module, args: tuple[object, ...]) -> None:
        if not seen:
            seen.append((name, module, args[0] if args else None))

    handles = [module.register_forward_pre_hook(lambda module, args, name=name: record(name, module, args))
               for name, module in candidates]
    try:
        with torch.no_grad(), preserved_model_state(model):
            run_model(model, batch, options, batch.shape[0])
    finally:
        for handle in handles:
            handle.remove()
    if not seen:
        raise ValueError(f"the layer {layer!r} never ran in the model's forward: name the layer the input goes to.")
    name, module, layer_input = seen[0]
    if not isinstance(layer_input, Tensor) or layer_input.shape != batch.shape or not torch.equal(layer_input, batch):
        raise ValueError(f"the first layer with parameters, {name!r}, does not take the model's input as it is (the "
                         "model computes something before it): input invariance shifts the input of the layer that "
                         "absorbs the shift. Name that layer with layer=, or explain a model whose first operation "
                         "is that layer.")
    return name, module


def input_invariance(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    shift: float = -1.0,
    layer: Optional[str] = None,
    atol: float = 1e-4,
    rtol: float = 1e-5,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> InputInvariance:
    """Input invariance (Kindermans et al. 2017): explain x + ``shift`` with a copy of the model whose
    first layer absorbs the shift, f₂(x + m) = f(x) for every x, and compare the raw maps with x's.

    The copy's first layer (``layer``, default: the first module with parameters the forward runs,
    which must take the model input as it is) subtracts ℓ(m) − ℓ(0) from its output: exact for any
    layer affine in its input (convolution with any padding, linear, normalisation), where changing
    the bias alone (the paper's construction) is exact only away from a convolution's zero padding.
    The copy's scores are checked against the model's. The given model is not changed.
    Gradients and CAMs are invariant, and so is Integrated Gradients from a baseline that moves with the
    input ("blur"); from "zeros" it is not, nor is Input × Gradient (its map changes by m · gradient).
    """
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or not math.isfinite(shift):
        raise ValueError(f"shift must be a finite number (added to every input value); got {short_repr(shift)}.")
    atol = number_option("atol", atol)
    rtol = number_option("rtol", rtol)
    options = dict(explain_options or {})
    model = explainer.model
    batch = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model),
                           channels=model_input_channels(model)).batch
    original = explainer.explain(batch, target, **options)
    if original.map_grid.shape[1] != 1:
        raise ValueError("input invariance takes one target per image; give one class (or none) per image.")
    classes = original.class_indices[:, 0] if original.class_indices is not None else target

    with torch.inference_mode(False):  # a copy made in the caller's inference_mode would hold inference tensors
        shifted_explainer = copy.deepcopy(explainer)  # copies the model too, and the layers' references into it
    shifted_model = shifted_explainer.model
    name, first = _first_layer(shifted_model, batch, layer, options)
    with torch.no_grad(), preserved_model_state(shifted_model):
        zeros = torch.zeros_like(batch[:1])
        correction = first(zeros + shift) - first(zeros)  # ℓ(x + m) − (ℓ(m) − ℓ(0)) = ℓ(x) for an affine ℓ
    handle = first.register_forward_hook(lambda module, args, result: result - correction)
    try:
        shifted = shifted_explainer.explain(batch + shift, classes, **options)
    finally:
        handle.remove()
    expected, obtained = original.scores.float(), shifted.scores.float()  # the explained scores, f(x) and f₂(x + m)
    gaps = (obtained - expected).abs().flatten(1).amax(dim=1)
    gap = gaps.max().item()
    model_precision = model_dtype(shifted_model)
    precision = autocast_dtype(batch.device.type) or (
        model_precision if model_precision in (torch.float16, torch.bfloat16) else None)
    tolerance = 1e-4 if precision is None else 8 * torch.finfo(precision).eps  # rounding of the shift's two paths
    # each image against its own scores' scale: whether it is refused does not depend on the other images
    allowed = tolerance * expected.abs().flatten(1).amax(dim=1).clamp_min(1.0)
    if not bool((gaps <= allowed).all()):
        if precision is not None:
            raise ValueError(
                f"the model copy whose layer {name!r} absorbs the shift gives scores {gap:.3g} away from the model's "
                f"on the shifted input, more than {precision} rounding explains: compute input invariance outside "
                "torch.autocast, on model.float().")
        raise ValueError(f"the model copy whose layer {name!r} absorbs the shift does not give the model's scores on "
                         f"the shifted input (largest difference {gap:.3g}): that layer is not affine in its input. "
                         "Name the model's first affine layer (a convolution or linear layer) with layer=.")
    before, after = original.raw_map_grid[:, 0], shifted.raw_map_grid[:, 0]
    close = (after - before).abs() <= atol + rtol * after.abs()
    return InputInvariance(invariant=close.flatten(1).all(dim=1).float(),
                           difference=(after - before).abs().flatten(1).amax(dim=1))
