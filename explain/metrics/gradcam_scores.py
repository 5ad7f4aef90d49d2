"""The scores of pytorch-grad-cam 1.5.7's metrics module that the other metrics do not give as such.

- ROADMostRelevantFirst(p), ROADLeastRelevantFirst(p) and their Averages: ``road(order=..., percentages=
  [1 − p/100])`` (the peer reports the score's change, ``road`` the score after the removal).
- ROADCombined: ``road_combined``, (LeRF − MoRF) / 2 averaged over the shares removed.
- CamMultImageConfidenceChange, DropInConfidence, IncreaseInConfidence: ``masked_score_change``, the change,
  its drop max(0, −change) and its increase change > 0 (``confidence_change`` is the paper's average drop,
  relative to the score).
- Complexity, Coherency, ARCC: ``arcc``, Poppi et al.'s complexity and coherency, ROAD combined, and their
  harmonic mean.

Inputs, maps and targets are taken as by the faithfulness metrics (``explain.metrics.road``): anything
``explain()`` accepts, an Explanation or (N, H, W) maps, one class per image (the explanation's, else
``target``, else the top class). Each returns one value per image, on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..core.targets import OutputSelector, Target
from ..io.inputs import Inputs, PreprocessSpec
from ..methods.base import Explainer
from ._common import MapsLike, as_maps, check_count, class_scores, fixed_classes, model_inputs
from .faithfulness import check_score_options, road

ROAD_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def road_combined(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    percentages: Sequence[float] = ROAD_SHARES,
    noise: float = 0.01,
    score: str = "probability",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """ROAD combined (pytorch-grad-cam's ``ROADCombined``): (LeRF − MoRF) / 2, the mean over ``percentages``
    (shares of the pixels removed, by noisy linear imputation) of the score with the least relevant pixels
    removed minus the score with the most relevant removed, halved. (N,), in [−0.5, 0.5] for probabilities,
    higher is better: removing what the map calls relevant costs more than removing the rest."""
    areas = [road(model, inputs, maps, target, order=order, percentages=percentages, noise=noise, score=score,
                  batch_size=batch_size, preprocess=preprocess, output=output).area for order in ("lerf", "morf")]
    return (areas[0] - areas[1]) / 2


@dataclass
class MaskedScoreChange:
    """change: (N,) the class's score on the image multiplied by its map minus the score on the image
    (pytorch-grad-cam's ``CamMultImageConfidenceChange``); drop: max(0, −change) (its ``DropInConfidence``,
    not divided by the score, unlike the paper's average drop in ``confidence_change``); increase: 1 where
    change > 0 (its ``IncreaseInConfidence``)."""

    change: Tensor
    drop: Tensor
    increase: Tensor


def masked_score_change(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    target: Target = None,
    *,
    score: str = "logit",
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> MaskedScoreChange:
    """The change in the class's score ("logit", default as pytorch-grad-cam's ``ClassifierOutputTarget``,
    or "probability") when the model input is multiplied by the map (taken as it is, in model-input space)."""
    check_score_options(score, batch_size)
    batch = model_inputs(model, inputs, preprocess)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    classes = fixed_classes(model, batch, maps, target, output)
    before = class_scores(model, batch, classes, score, batch_size, output)
    after = class_scores(model, batch * heat[:, None].to(batch.dtype), classes, score, batch_size, output)
    change = (after - before).cpu()
    return MaskedScoreChange(change=change, drop=(-change).clamp_min(0), increase=(change > 0).float())


@dataclass
class ARCC:
    """Per image (N,): complexity, mean |map| of the [0, 1] map (lower is simpler); coherency,
    (ρ + 1) / 2 with ρ the Pearson correlation between the map and the map of the image multiplied by it
    (higher: the explanation explains itself); road, ROAD combined (``road_combined``); arcc, the
    harmonic mean 3 / (1/coherency + 1/(1 − complexity) + 1/clip(2 · road, 0, 1)), in [0, 1], higher is
    better (Poppi et al. 2021's ADCC with ROAD for the average drop, as pytorch-grad-cam's ``ARCC``)."""

    complexity: Tensor
    coherency: Tensor
    road: Tensor
    arcc: Tensor


def arcc(
    explainer: Explainer,
    inputs: Inputs,
    maps: Optional[MapsLike] = None,
    target: Target = None,
    *,
    percentages: Sequence[float] = (0.2, 0.4, 0.6, 0.8),
    noise: float = 0.01,
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
) -> ARCC:
    """ARCC of ``explainer``'s maps (``maps``: given, an Explanation or (N, H, W) in [0, 1]; None: explained
    here) of one class per image. Coherency explains the masked images again with ``explainer`` for the same
    classes; ROAD uses probabilities. ``preprocess``: the explainer's when None."""
    preprocess = explainer.preprocess if preprocess is None else preprocess
    model = explainer.model
    batch = model_inputs(model, inputs, preprocess)
    if maps is None:
        maps = explainer.explain(batch, target)
    heat = as_maps(maps, batch.shape[-2:]).to(batch.device)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    check_unit_maps(heat)
    classes = fixed_classes(model, batch, maps, target, explainer.output)
    again = as_maps(explainer.explain(batch * heat[:, None].to(batch.dtype), classes.tolist()),
                    batch.shape[-2:]).to(batch.device)
    complexity = heat.abs().flatten(1).mean(dim=1).cpu()
    coherency = ((pearson(again, heat) + 1) / 2).cpu()
    combined = road_combined(model, batch, heat, classes.tolist(), percentages=percentages, noise=noise,
                             batch_size=batch_size, output=explainer.output)
    scaled_road = (2 * combined).clamp(0, 1)
    harmonic = 3 / (1 / (coherency + 1e-8) + 1 / (1 - complexity + 1e-8) + 1 / (scaled_road + 1e-8))
    return ARCC(complexity=complexity, coherency=coherency, road=combined, arcc=harmonic)


def check_unit_maps(heat: Tensor) -> None:
    """Refuse (N, H, W) maps with a value beyond [−1, 1], naming them: ARCC's complexity, the mean |map|, would
    exceed 1 and its 1 − complexity turn negative, so that the harmonic mean leaves [0, 1] without a word."""
    beyond = heat.abs().flatten(1).amax(dim=1) > 1 + 1e-6
    if bool(beyond.any()):
        indices = beyond.nonzero()[:, 0].tolist()
        named = ", ".join(map(str, indices[:8])) + (" and more" if len(indices) > 8 else "")
        raise ValueError(
            f"arcc takes maps in [0, 1], but map{'s' if len(indices) > 1 else ''} {named} reach"
            f"{'' if len(indices) > 1 else 'es'} beyond it (values in [{float(heat.min()):.3g}, "
            f"{float(heat.max()):.3g}]): the complexity, mean |map|, would exceed 1 and ARCC leave [0, 1]. Give "
            "the Explanation (its normalised maps), or maps scaled to [0, 1], e.g. m.clamp_min(0) / m.amax().")


def pearson(first: Tensor, second: Tensor) -> Tensor:
    """(N,) Pearson correlation of each pair of maps (N, H, W); 0 where a map is constant."""
    a = first.double().flatten(1)
    b = second.double().flatten(1)
    a, b = a - a.mean(dim=1, keepdim=True), b - b.mean(dim=1, keepdim=True)
    norms = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(norms > 0, (a * b).sum(dim=1) / norms.clamp_min(1e-300), 0.0).float()
