"""Faithfulness by feature: does the score move with the features the map calls relevant?

faithfulness_correlation and sensitivity_n remove random subsets of features, faithfulness_estimate
and monotonicity_correlation one group of features at a time, monotonicity puts them back into the
substrate cumulatively; each compares the score's changes with the map. infidelity compares the
score's change under random perturbations I with Iᵀ·attributions; sufficiency asks whether images
with alike explanations get the same prediction. (Removing regions: ``explain.metrics.regions``.)

A feature is a pixel (``features="pixels"``, default: its channels are replaced together, H·W
features, row-major) or one channel of a pixel (``features="elements"``, C·H·W features in the
input's channel-major order, the map's value shared by the channels: what Quantus 0.6 counts).
Inputs are anything ``explain()`` accepts (made into model input by ``preprocess``, default
ImageNet normalisation) or a model-ready (N, C, H, W) tensor; maps are an Explanation or (N, H, W)
tensor, one per image, resized to the input. The class scored is the explanation's, else ``target``,
else each image's top class; ``output=`` picks the scores in a model output that is not a plain
tensor. Random draws come from ``generator`` (a CPU ``torch.Generator``; default one seeded with 0,
so the same draws each call) or are given outright (``subsets=``, ``noise=``, ``perturbations=``).
The draws are made once per call and shared by every image of the batch (as the tie order of
``explain.metrics._common.ranking`` and ROAD's noise are): each image still gets fresh random subsets
or noise in every run, and its score is the one it gets alone, at any place in any batch, from a
generator in the same state. (They are those a batch of one image draws.)
Results are one value per image on the model's device. Refused with a ValueError that says what was
wrong: maps with NaN or inf (named), another number of maps than images (none is ignored), draws of
the wrong shape or range, and every option outside what it takes (named, with its value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..core.capture import preserved_model_state
from ..core.targets import OutputSelector, Target
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec
from ..methods.options import bool_option, int_option, number_option
from ._common import (
    MapsLike,
    as_maps,
    as_tensor,
    check_count,
    check_finite,
    decisions,
    model_inputs,
    model_scores,
    ranking,
    short_repr,
)
from .axiomatic import FEATURES, _classes_and_scores
from .complexity import _wide
from .faithfulness import (
    Substrate,
    check_score_options,
    check_substrate,
    grid_scores,
    step_counts,
    substrate_for,
)
from .sanity import spearman

# ------------------------------------------------------------------ shared


@dataclass
class _Setting:
    """What every metric here starts from: the (N, C, H, W) model batch, the (N, H, W) maps resized to it,
    the (N,) classes scored and their (N,) scores on the unperturbed images."""

    batch: Tensor
    heat: Tensor
    classes: Tensor
    original: Tensor


def _setting(model: nn.Module, inputs: Inputs, maps: MapsLike, target: Target, score: str, batch_size: int,
             preprocess: PreprocessSpec, output: OutputSelector) -> _Setting:
    check_score_options(score, batch_size)
    batch = model_inputs(model, inputs, preprocess)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    classes, original = _classes_and_scores(model, batch, maps, target, score, batch_size, output)
    return _Setting(batch, heat, classes, original)


def _check_features(features: object) -> str:
    if not isinstance(features, str) or features not in FEATURES:
        raise ValueError(f"features must be 'pixels' or 'elements'; got {short_repr(features)}.")
    return features


def _feature_shape(batch: Tensor, features: str) -> tuple[int, int, int]:
    """How one image's features lie over its input: (1, H, W) for pixels, (C, H, W) for elements."""
    _, channels, height, width = batch.shape
    return (channels if features == "elements" else 1, height, width)


def _relevance(heat: Tensor, batch: Tensor, features: str) -> Tensor:
    """(N, H, W) maps → (N, F) each feature's relevance: the map's value at its pixel."""
    return heat[:, None].expand(-1, _feature_shape(batch, features)[0], -1, -1).reshape(heat.shape[0], -1)


def _generator(generator: Optional[torch.Generator]) -> torch.Generator:
    if generator is None:
        return torch.Generator().manual_seed(0)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (on the CPU); got {short_repr(generator)}.")
    return generator


@dataclass
class _Steps:
    """The features cut into ``steps`` equal runs in order of relevance. shape: how one image's features lie
    over its input, (1, H, W) or (C, H, W); relevance: (N, F); step_of: (N, F) the run of each feature, in
    [0, steps); sums: (N, steps) the relevance of each run (float64 but on MPS)."""

    shape: tuple[int, int, int]
    relevance: Tensor
    step_of: Tensor
    sums: Tensor


def _steps(setting: _Setting, features: str, steps: int, descending: bool, magnitude: bool = False) -> _Steps:
    """The features in order of relevance (|map| where ``magnitude``; the most relevant first when
    ``descending``; ties in a seeded random order) cut into ``steps`` runs, round(s · F / steps) features
    before run s."""
    relevance = _relevance(setting.heat, setting.batch, features)
    relevance = relevance.abs() if magnitude else relevance
    count, feature_count = relevance.shape
    if steps > feature_count:
        raise ValueError(f"steps = {steps} is more than the {feature_count} features: give at most {feature_count}.")
    ranks = ranking((relevance if descending else -relevance)[:, None]).view_as(relevance)
    boundaries = step_counts(feature_count, steps, relevance.device)[1:].contiguous()
    step_of = torch.searchsorted(boundaries, ranks.to(boundaries.dtype), right=True)
    wide = _wide(relevance)
    sums = torch.zeros(count, steps, dtype=wide.dtype, device=relevance.device).scatter_add_(1, step_of, wide)
    return _Steps(_feature_shape(setting.batch, features), relevance, step_of, sums)


def _pearson(first: Tensor, second: Tensor) -> Tensor:
    """Pearson correlation of each pair of rows, (N, S) each → (N,) in [-1, 1], computed in float64 (but on
    MPS; 0 where a row is constant: nothing to correlate)."""
    a, b = _wide(first), _wide(second)
    a, b = a - a.mean(dim=1, keepdim=True), b - b.mean(dim=1, keepdim=True)
    denominator = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(denominator > 0, (a * b).sum(dim=1) / denominator.clamp_min(1e-300), 0.0).float()


# ------------------------------------------------------------------ random subsets


def _draw_subsets(count: int, runs: int, size: int, feature_count: int, generator: torch.Generator) -> Tensor:
    """(count, runs, size) long: for each run, ``size`` distinct features drawn uniformly, the same subsets for
    each of the ``count`` images (so an image's subsets do not depend on its place in the batch or on the
    other images)."""
    chunk = max(1, 2**22 // feature_count)  # bounds the random keys held at once
    subsets = [torch.rand(min(chunk, runs - start), feature_count, generator=generator).topk(size, dim=1).indices
               for start in range(0, runs, chunk)]
    return torch.cat(subsets).view(1, runs, size).expand(count, -1, -1)


def _check_subsets(subsets: object, count: int, feature_count: int, name: str) -> Tensor:
    values = as_tensor(subsets, f"{name} must be a (N, runs, size) tensor of feature indices")
    if values.dim() != 3 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{name} must be (N, runs, size) integer feature indices; got {short_repr(subsets)}.")
    check_count(values.shape[0], f"images' {name}", count, "images")
    if values.shape[1] < 2 or values.shape[2] < 1:
        raise ValueError(f"{name} must hold at least 2 runs of at least 1 feature each (a correlation needs two "
                         f"points); got shape {tuple(values.shape)}.")
    values = values.long()
    if bool(((values < 0) | (values >= feature_count)).any()):
        raise ValueError(f"{name} holds indices outside the {feature_count} features (0 … {feature_count - 1}).")
    ordered = values.sort(dim=2).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{name} repeats a feature within a subset: each subset is a set of distinct features.")
    return values


def _subset_correlation(model: nn.Module, setting: _Setting, subsets: Tensor, features: str, fill: Tensor,
                        score: str, batch_size: int, output: OutputSelector) -> Tensor:
    """(N,) Pearson correlation over each image's subsets (N, R, k) between the map's sum over the subset and
    the score's drop when the subset is replaced by ``fill``."""
    batch = setting.batch
    runs = subsets.shape[1]
    shape = _feature_shape(batch, features)
    relevance = _relevance(setting.heat, batch, features)
    subsets = subsets.to(batch.device)

    def perturbed(image: Tensor, run: Tensor) -> Tensor:
        removed = torch.zeros(image.shape[0], relevance.shape[1], dtype=torch.bool, device=batch.device)
        removed.scatter_(1, subsets[image, run], True)
        return torch.where(removed.view(-1, *shape), fill[image], batch[image])

    scores = grid_scores(model, runs, perturbed, setting.classes, score, batch_size, output)
    drops = setting.original[:, None] - scores
    sums = _wide(relevance.gather(1, subsets.flatten(1)).view_as(subsets)).sum(dim=2)
    return _pearson(sums, drops)


def faithfulness_correlation(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    runs: int = 100,
    subset_size: int = 224,
    subsets: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    features: str = "pixels",
    substrate: Substrate = "zeros",
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Faithfulness correlation (Bhatt et al. 2020): over ``runs`` random subsets S of ``subset_size``
    features, the Pearson correlation between the map's sum over S and the score's drop
    f(x) − f(x with S replaced by the substrate). (N,) in [-1, 1], higher is better; 0 where either
    is constant.

    subsets: (N, runs, subset_size) the features of each subset (indices into the H·W pixels or C·H·W
        elements, see the module; runs and subset_size are then its shape); default drawn uniformly from
        ``generator``, ``runs`` subsets shared by every image of the batch (see the module).
    substrate: what removed features become (``substrate_for``; Quantus's "black" is "minimum").
    score: "logit" (default, as Quantus) or "probability". Costs N · runs forward passes.
    """
    features = _check_features(features)
    check_substrate(substrate)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    feature_count = _relevance(setting.heat[:1], setting.batch, features).shape[1]
    if subsets is None:
        runs = int_option("runs", runs, 2)
        subset_size = int_option("subset_size", subset_size, 1)
        if subset_size > feature_count:
            raise ValueError(f"subset_size = {subset_size} is more than the {feature_count} features.")
        chosen = _draw_subsets(setting.batch.shape[0], runs, subset_size, feature_count, _generator(generator))
    else:
        chosen = _check_subsets(subsets, setting.batch.shape[0], feature_count, "subsets")
    fill = substrate_for(setting.batch, substrate)
    return _subset_correlation(model, setting, chosen, features, fill, score, batch_size, output).to(
        setting.batch.device)


@dataclass
class SensitivityN:
    """subset_sizes: (K,) the n; correlations: (N, K) per image and n, the Pearson correlation over random
    subsets of n features between the map's sum over the subset and the score's drop when it is removed;
    in [-1, 1], higher is better, 1 for attributions that add up to every such drop (sensitivity-n)."""

    subset_sizes: Tensor
    correlations: Tensor


def sensitivity_n(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    subset_sizes: Optional[Sequence[int]] = None,
    runs: int = 100,
    subsets: Optional[Sequence[Tensor]] = None,
    generator: Optional[torch.Generator] = None,
    features: str = "pixels",
    substrate: Substrate = "zeros",
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> SensitivityN:
    """Sensitivity-n (Ancona et al. 2018): for each n, ``faithfulness_correlation`` with subsets of n
    features, image by image. Ancona et al. show that attributions of a linear model by Input × Gradient,
    ε-LRP, DeepLIFT (Rescale) or Integrated Gradients from the substrate reach 1 for every n.

    subset_sizes: the n (default: 8 sizes spread geometrically from 1 to 80 % of the features).
    subsets: one (N, runs, n) tensor of feature indices per n (default drawn from ``generator``, n by n in
        the order of ``subset_sizes``, shared by every image of the batch as in ``faithfulness_correlation``).
    Costs N · runs forward passes per n.
    """
    features = _check_features(features)
    check_substrate(substrate)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    count = setting.batch.shape[0]
    feature_count = _relevance(setting.heat[:1], setting.batch, features).shape[1]
    if subsets is not None:
        if isinstance(subsets, Tensor) or not isinstance(subsets, Sequence) or not subsets:
            raise ValueError(f"subsets must be a sequence of (N, runs, n) tensors, one per n; got "
                             f"{short_repr(subsets)}.")
        chosen = [_check_subsets(values, count, feature_count, f"subsets[{index}]")
                  for index, values in enumerate(subsets)]
        sizes = [values.shape[2] for values in chosen]
        if subset_sizes is not None and list(subset_sizes) != sizes:
            raise ValueError(f"subset_sizes {list(subset_sizes)} disagree with the subsets' sizes {sizes}: give one.")
    else:
        runs = int_option("runs", runs, 2)
        if subset_sizes is None:
            spread = torch.logspace(0, math.log10(max(1.0, 0.8 * feature_count)), 8, dtype=torch.float64)
            sizes = sorted(set(spread.round().long().tolist()))
        elif isinstance(subset_sizes, (str, bytes)) or not isinstance(subset_sizes, Sequence) or not subset_sizes:
            raise ValueError(f"subset_sizes must be a sequence of ints in [1, {feature_count}]; got "
                             f"{short_repr(subset_sizes)}.")
        else:
            sizes = [int_option("each of subset_sizes", size, 1) for size in subset_sizes]
            if max(sizes) > feature_count:
                raise ValueError(f"subset_sizes holds {max(sizes)}, more than the {feature_count} features.")
        drawing = _generator(generator)
        chosen = [_draw_subsets(count, runs, size, feature_count, drawing) for size in sizes]
    fill = substrate_for(setting.batch, substrate)
    correlations = [_subset_correlation(model, setting, values, features, fill, score, batch_size, output)
                    for values in chosen]
    return SensitivityN(subset_sizes=torch.tensor(sizes), correlations=torch.stack(correlations, dim=1).to(
        setting.batch.device))


# ------------------------------------------------------------------ features in order of relevance


def faithfulness_estimate(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    steps: int = 32,
    features: str = "pixels",
    substrate: Substrate = "zeros",
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Faithfulness estimate (Alvarez-Melis and Jaakkola 2018): the features, most relevant first, cut into
    ``steps`` equal groups; the Pearson correlation over the groups between the map's sum over a group and
    the score's drop when that group alone is replaced by the substrate. (N,) in [-1, 1], higher is better.
    Quantus's ``features_in_step = k`` is ``steps = F / k`` here. Costs N · steps forward passes."""
    features = _check_features(features)
    check_substrate(substrate)
    steps = int_option("steps", steps, 2)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    batch = setting.batch
    ordered = _steps(setting, features, steps, descending=True)
    fill = substrate_for(batch, substrate)

    def perturbed(image: Tensor, step: Tensor) -> Tensor:
        removed = (ordered.step_of[image] == step[:, None]).view(-1, *ordered.shape)
        return torch.where(removed, fill[image], batch[image])

    scores = grid_scores(model, steps, perturbed, setting.classes, score, batch_size, output)
    return _pearson(ordered.sums, setting.original[:, None] - scores).to(batch.device)


@dataclass
class Monotonicity:
    """monotonic: (N,) 1.0 where the score never falls from one step to the next, else 0.0, higher is better;
    fractions: (S,) share of the features restored after each step; curves: (N, S) the scores."""

    monotonic: Tensor
    fractions: Tensor
    curves: Tensor


def monotonicity(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    steps: int = 32,
    features: str = "pixels",
    substrate: Substrate = "zeros",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Monotonicity:
    """Monotonicity (Arya et al. 2019): starting from the substrate, the image's features are put back
    in ``steps`` equal groups, least relevant first; ``monotonic`` 1.0 where the score never falls from one
    step to the next (from the first step's score on, as Quantus), else 0.0. The map is taken as given
    (signed; Quantus takes |map| by default: pass map.abs() for that). Costs N · steps forward passes."""
    features = _check_features(features)
    check_substrate(substrate)
    steps = int_option("steps", steps, 1)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    batch = setting.batch
    ordered = _steps(setting, features, steps, descending=False)
    fill = substrate_for(batch, substrate)

    def perturbed(image: Tensor, step: Tensor) -> Tensor:
        restored = (ordered.step_of[image] <= step[:, None]).view(-1, *ordered.shape)
        return torch.where(restored, batch[image], fill[image])

    curves = grid_scores(model, steps, perturbed, setting.classes, score, batch_size, output)
    feature_count = ordered.relevance.shape[1]
    fractions = step_counts(feature_count, steps, batch.device)[1:] / feature_count
    return Monotonicity(monotonic=(curves.diff(dim=1) >= 0).all(dim=1).float(), fractions=fractions, curves=curves)


def monotonicity_correlation(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    steps: int = 32,
    samples: int = 16,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    features: str = "pixels",
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Monotonicity correlation (Nguyen and Martínez 2020): the features cut into ``steps`` equal groups in
    order of |map|; for each group, the mean squared change of the score when that group alone is replaced
    by random values (``samples`` draws); the Spearman correlation over the groups between the group's
    |map| sum and that change. (N,) in [-1, 1], higher is better.

    noise: the values the group's features take, broadcastable to (N, steps, samples, C) in model-input
        space (one value per channel, shared by the group's pixels; for single-pixel groups, one per
        element); default uniform in each image's value range, drawn from ``generator``: one (steps, samples,
        C) draw u in [0, 1) shared by every image of the batch, image n's values low_n + (high_n − low_n) · u
        (see the module). Quantus 0.6 draws
        one value per image, step and sample, uniform in [0, 1]: pass those as (N, steps, samples, 1).
    Costs N · steps · samples forward passes.

    The correlation ranks the groups' changes, which can be as small as the score's rounding: on a small CNN whose
    groups change the probability by ~1e-9, float32 and float64 (or two devices, two kernels) ordered two of them
    differently and gave 0.624 and 0.629. Compare values across machines in float64, or with more ``samples``.
    """
    features = _check_features(features)
    steps = int_option("steps", steps, 2)
    samples = int_option("samples", samples, 1)
    setting = _setting(model, inputs, maps, target, score, batch_size, preprocess, output)
    batch = setting.batch
    count, channels = batch.shape[:2]
    ordered = _steps(setting, features, steps, descending=False, magnitude=True)
    if noise is None:
        low = batch.flatten(1).amin(dim=1).view(-1, 1, 1, 1).cpu()
        high = batch.flatten(1).amax(dim=1).view(-1, 1, 1, 1).cpu()
        draws = torch.rand(1, steps, samples, channels, generator=_generator(generator))  # shared by the images
        values = (low + (high - low) * draws).to(batch.device, batch.dtype)
    else:
        given = as_tensor(noise, "noise must be a tensor broadcastable to (N, steps, samples, C)").to(batch.device,
                                                                                                      batch.dtype)
        try:
            values = given.expand(count, steps, samples, channels)
        except RuntimeError:
            raise ValueError(f"noise has shape {tuple(given.shape)}, which does not broadcast to (N, steps, samples, "
                             f"C) = {(count, steps, samples, channels)}.") from None
        check_finite(values, "noise for image", "give finite replacement values in model-input space.")

    def perturbed(image: Tensor, row: Tensor) -> Tensor:
        step, sample = row // samples, row % samples
        replaced = (ordered.step_of[image] == step[:, None]).view(-1, *ordered.shape)
        return torch.where(replaced, values[image, step, sample].view(-1, channels, 1, 1), batch[image])

    scores = grid_scores(model, steps * samples, perturbed, setting.classes, score, batch_size, output)
    changes = _wide(scores.view(count, steps, samples) - setting.original.view(-1, 1, 1)).pow(2).mean(dim=2)
    return spearman(ordered.sums, changes).to(batch.device)


# ------------------------------------------------------------------ infidelity


def _attributions(attributions: MapsLike, batch: Tensor) -> Tensor:
    """(N, C, H, W) or (N, 1, H, W) attributions at the input's size: an Explanation's per-channel
    ``attributions`` (one target), else its raw maps; or a (N, C, H, W) / (N, H, W) tensor (maps resized)."""
    if isinstance(attributions, Explanation):
        if attributions.raw_map_grid.shape[1] != 1:
            raise ValueError("this explanation has several targets per image; pass one target's attributions with its "
                             "classes, e.g. explanation.attributions[:, k] (or explanation.raw_map_grid[:, k]) and "
                             "target=explanation.targets[:, k].")
        if attributions.attributions is not None:
            values = attributions.attributions[:, 0].detach().float()
        else:
            values = as_maps(attributions.raw_map_grid[:, 0], batch.shape[-2:])[:, None]
    else:
        values = as_tensor(attributions, "attributions must be an Explanation or a (N, C, H, W) / (N, H, W) "
                                         "tensor").detach().float()
        if values.dim() != 4:
            values = as_maps(values, batch.shape[-2:])[:, None]
        elif values.shape[1:] != batch.shape[1:]:
            raise ValueError(f"(N, C, H, W) attributions must have the input's shape {tuple(batch.shape[1:])} per "
                             f"image; got {tuple(values.shape)} (give (N, H, W) maps to have them resized).")
    check_finite(values, "attribution map", "infidelity needs finite attributions.")
    check_count(values.shape[0], "attribution maps", batch.shape[0], "images")
    return values.to(batch.device)


def infidelity(
    model: nn.Module,
    inputs: Inputs,
    attributions: MapsLike,
    target: Target = None,
    *,
    samples: int = 64,
    noise: float = 0.1,
    perturbations: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    normalize: bool = False,
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Infidelity (Yeh et al. 2019): E_I[(Iᵀa − (f(x) − f(x − I)))²] over perturbations I, a the
    attributions: how far the attributions' prediction of each score change is from the change.
    (N,) ≥ 0, lower is better, 0 for a linear model's gradient. a: (N, C, H, W) per value, or (N, H, W)
    maps shared by the channels (resized to the input); an Explanation gives its per-channel
    ``attributions`` where it holds them, else its raw maps. Depends on the attributions' scale: give
    raw attributions in the score's units, or ``normalize=True``.

    perturbations: the I, (N, S, C, H, W) or (S, C, H, W) for every image, in model-input space; default
        ``samples`` Gaussian perturbations of standard deviation ``noise`` per value (Yeh et al.'s noisy
        baseline), drawn from ``generator``: one seed per sample, so the draws do not depend on
        ``batch_size``, and the S perturbations shared by every image of the batch (see the module).
    normalize: scale the attributions by the β that minimises the infidelity, β = E[Iᵀa · Δf] / E[(Iᵀa)²]
        (Yeh et al.'s code; Captum's ``normalize``), to compare methods whatever their scale.
    Costs N · S forward passes.
    """
    normalize = bool_option("normalize", normalize)
    check_score_options(score, batch_size)
    batch = model_inputs(model, inputs, preprocess)
    values = _attributions(attributions, batch)
    classes, original = _classes_and_scores(model, batch, attributions, target, score, batch_size, output)
    count = batch.shape[0]
    if perturbations is None:
        samples = int_option("samples", samples, 1)
        noise = number_option("noise", noise)
        seeds = torch.randint(0, 2**62, (samples,), generator=_generator(generator))  # shared by the images

        def perturbation(image: Tensor, sample: Tensor) -> Tensor:
            needed, where = sample.cpu().unique(return_inverse=True)
            drawn = torch.stack([torch.randn(batch.shape[1:], generator=torch.Generator().manual_seed(int(seeds[s])))
                                 for s in needed.tolist()])
            return (drawn[where] * noise).to(batch.device, batch.dtype)
    else:
        given = as_tensor(perturbations, "perturbations must be a (N, S, C, H, W) or (S, C, H, W) tensor")
        if given.dim() == 4:
            given = given[None].expand(count, *given.shape)
        if given.dim() != 5 or given.shape[2:] != batch.shape[1:] or given.shape[1] == 0:
            raise ValueError(f"perturbations must be (N, S, C, H, W) or (S, C, H, W) with (C, H, W) = "
                             f"{tuple(batch.shape[1:])}, the input's; got {short_repr(perturbations)}.")
        check_count(given.shape[0], "images' perturbations", count, "images")
        check_finite(given, "perturbations of image", "give finite perturbations in model-input space.")
        given = given.to(batch.device, batch.dtype)
        samples = given.shape[1]

        def perturbation(image: Tensor, sample: Tensor) -> Tensor:
            return given[image, sample]

    scores = grid_scores(model, samples, lambda image, sample: batch[image] - perturbation(image, sample), classes,
                         score, batch_size, output)
    changes = _wide(original[:, None] - scores)
    rows = torch.arange(count * samples, device=batch.device).split(batch_size)
    projected = torch.cat([(_wide(values[row // samples]) * _wide(perturbation(row // samples, row % samples)))
                           .flatten(1).sum(dim=1) for row in rows]).view(count, samples)  # Iᵀa
    if normalize:
        power = (projected * projected).mean(dim=1, keepdim=True)
        beta = torch.where(power > 0, (projected * changes).mean(dim=1, keepdim=True) / power.clamp_min(1e-300), 1.0)
        projected = projected * beta
    return (projected - changes).pow(2).mean(dim=1).float().to(batch.device)


# ------------------------------------------------------------------ sufficiency

DISTANCES = ("seuclidean", "euclidean")


def sufficiency(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    *,
    threshold: float = 0.6,
    distance: str = "seuclidean",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Sufficiency (Dasgupta et al. 2022): of the other images whose map lies within ``threshold`` of this
    image's, the share the model predicts the same class for (its top class, whatever was explained; for a
    one-column output, a binary classifier's logit, the same side of 0: ``decisions``).
    (N,) in [0, 1], higher is better; 0 where no other map is that close. Needs at least two images; the
    images are compared with each other, so pass the set evaluated together.

    threshold: a share of the largest distance between two of the maps, in [0, 1] (Quantus's convention).
    distance: "seuclidean" (default, as Quantus: Euclidean over the pixels, each divided by its standard
        deviation over the maps; pixels equal in every map are left out) or "euclidean".
    """
    threshold = number_option("threshold", threshold)
    if not isinstance(distance, str) or distance not in DISTANCES:
        raise ValueError(f"distance must be 'seuclidean' or 'euclidean'; got {short_repr(distance)}.")
    batch_size = int_option("batch_size", batch_size, 1)
    batch = model_inputs(model, inputs, preprocess)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    count = heat.shape[0]
    check_count(count, "maps", batch.shape[0], "images")
    if count < 2:
        raise ValueError("sufficiency compares each image's map with the other images' maps: give at least 2 images.")
    flat = _wide(heat.flatten(1))
    if distance == "seuclidean":
        spread = flat.std(dim=0)
        varying = spread > 0
        flat = flat[:, varying] / spread[varying]
    distances = torch.cdist(flat, flat)
    largest = distances.max()
    distances = distances / largest if largest > 0 else distances
    close = distances <= threshold
    close.fill_diagonal_(False)
    with torch.no_grad(), preserved_model_state(model):
        predicted = torch.cat([decisions(model_scores(model(rows), output, rows.shape[0]))
                               for rows in batch.split(batch_size)])
    same = predicted[:, None] == predicted[None, :]
    neighbours = close.sum(dim=1)
    agreeing = (close & same).sum(dim=1)
    return torch.where(neighbours > 0, agreeing / neighbours.clamp_min(1), 0.0).float().to(batch.device)
