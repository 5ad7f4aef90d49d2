"""``explain.evaluate``: a method × metric table over a data set, for comparing explanation methods.

    result = explain.evaluate(model, ["gradcam", "saliency", "lrp", "integratedgradients"], (images, labels, masks),
                              metrics=["deletion", "insertion", "pointing_game", "sparseness"], out="evaluation/")
    print(result.markdown())           # mean ± spread per method and metric, and each method's mean rank

Each batch is explained once per method (for its labels), and every metric is computed on those maps; the values
of every image are kept. Metrics disagree with each other, so the methods are also ranked per metric (1 = best,
ties share their mean rank) and the ranks averaged across metrics, as LATEC does (Klein et al. 2024). ``METRICS``
holds every metric of ``explain.metrics`` that gives one value per image, by name, with settings that keep its
cost sane (``Metric.with_options`` changes them); a metric that draws random numbers draws them from a generator
seeded with the batch's index. A mean is over the images where the metric is defined (a NaN value is left out).

With ``out``, the run is resumable like ``explain batch``: each (batch, method)'s values (and the seconds each metric
took) go to OUT/evaluation.csv in one write, after which a kill loses nothing; a rerun computes only what is
missing. OUT/evaluation.json records the settings and, before each batch is computed, its fingerprint (a rerun
with other methods, metrics, batch size, model weights or data is an error that says what differs; a folder whose
record holds no value yet binds nothing), and the end of the run writes OUT/evaluation.md (the table) and
OUT/evaluation.png (the figure: each method's rank per metric).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import metrics
from ..core.caller import warn_at_callers_line
from ..core.capture import model_device, preserved_model_state
from ..core.layers import default_layer
from ..detection import Instances, InstanceSpec, InstanceTarget, detect
from ..detection.candidates import check_detector
from ..detection.instances import MIN_IOU, given_boxes
from ..io.explanation import Explanation
from ..io.loaded_model import LoadedModel, loaded_model_parts
from ..methods.base import Explainer, progress_shown_by_caller
from ..methods.options import int_option
from ..methods.registry import get_method
from ..methods.signatures import setting_text
from .index import append_rows
from .run_folder import write_atomically

FIELDS = ["batch", "method", "metric", "image", "value", "seconds"]
"""The values file's columns; "image" is the position in the batch (of the instance slot, image × K + instance, when
a detector is evaluated per instance)."""
SETTINGS_FILE = "evaluation.json"
VALUES_FILE = "evaluation.csv"
EvaluationBatch = Union[tuple[Tensor, Optional[Tensor]], tuple[Tensor, Optional[Tensor], Optional[Tensor]]]
"""(inputs (N, C, H, W) model input, labels (N,) class indices (None for a detector's instances)[, masks (N, H, W)
bool of the objects or None])."""


@dataclass
class MetricInput:
    """What a metric is computed from: the model, the explainer, the model-input batch (N, C, H, W), the maps
    explaining ``targets`` (N,), the objects' masks (N, H, W) when the data has them, and the batch's index in
    the data (0 first), which seeds ``generator``."""

    model: nn.Module
    explainer: Explainer
    inputs: Tensor
    explanation: Explanation
    targets: Tensor
    masks: Optional[Tensor]
    batch: int = 0

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with the batch's index: a metric that draws its random numbers from it draws the
        same ones for every method of the batch and in every run, so a resumed evaluation equals an uninterrupted
        one, and other ones for each batch."""
        return torch.Generator().manual_seed(self.batch)


DEFAULT_METRICS = ("deletion", "insertion", "road", "pointing_game", "sparseness")
"""What ``evaluate`` computes when no metrics are named."""
DEFAULT_INSTANCE_METRICS = ("instance_deletion", "instance_insertion", "instance_pointing_game", "instance_energy")
"""What ``evaluate(..., instances=...)`` computes for a detector when no metrics are named."""

Compute = Callable[[MetricInput], Tensor]
"""A metric's values for a batch: MetricInput → (N,) one value per image."""
Adapter = Callable[..., Tensor]
"""How ``evaluate`` calls a function of ``explain.metrics``: (MetricInput, **options) → (N,) values."""


@dataclass(frozen=True)
class Metric:
    """A metric as ``evaluate`` runs it: its name, whether higher or lower is better, what it measures (one line),
    the function giving (N,) values for a batch, whether it needs object masks, and whether it applies to a
    method's explanation (completeness needs input attributions: a CAM's values are NaN there, shown as "–").

    The registry's metrics also hold their ``options`` (the settings their ``adapter`` calls the function of
    ``explain.metrics`` with), which ``with_options`` changes. ``per_instance`` metrics score the instances of a
    detector (``evaluate(..., instances=...)``): one value per explained instance, not per image."""

    name: str
    better: str
    measures: str
    compute: Compute
    needs_masks: bool = False
    applies: Callable[[Explanation], bool] = lambda explanation: True
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    adapter: Optional[Adapter] = None
    per_instance: bool = False

    def with_options(self, **changes: Any) -> Metric:
        """This metric with other settings, e.g. ``METRICS["faithfulness_correlation"].with_options(runs=200)``.
        Its name then says them, "faithfulness_correlation(runs=200)", so a table shows what was computed and a
        resumed run never mixes values of two settings (a registry metric's name says every setting that differs from
        the registry's, in the order of ``options``). Only the options in ``options`` can change."""
        if self.adapter is None:
            raise ValueError(f"metric {self.name!r} has no options to change: build a Metric with the settings you "
                             "want instead.")
        unknown = [key for key in changes if key not in self.options]
        if unknown:
            raise ValueError(f"metric {self.name!r} takes the options {', '.join(self.options) or '(none)'}; got "
                             f"{', '.join(unknown)}.")
        changed = {key: value for key, value in changes.items() if repr(value) != repr(self.options[key])}
        if not changed:
            return self
        options = {**self.options, **changed}
        base = METRICS.get(self.name.split("(", 1)[0])
        if base is not None and base.adapter is self.adapter:  # a registry metric: named by all its changed settings
            changed = {key: value for key, value in options.items() if repr(value) != repr(base.options[key])}
            if not changed:
                return base
        else:
            base = self
        shown = ", ".join(f"{key}={value!r}" for key, value in changed.items())
        return replace(self, name=f"{base.name}({shown})", measures=f"{base.measures}; with {shown}",
                       compute=_bound(self.adapter, options), options=options)


def _bound(adapter: Adapter, options: Mapping[str, Any]) -> Compute:
    def compute(given: MetricInput) -> Tensor:
        return adapter(given, **options).detach().double().cpu().reshape(-1)

    return compute


def _entry(name: str, better: str, measures: str, adapter: Adapter, *, needs_masks: bool = False,
           applies: Optional[Callable[[Explanation], bool]] = None, per_instance: bool = False,
           **options: Any) -> Metric:
    """A registry entry: ``adapter`` called with ``options``."""
    return Metric(name, better, measures, _bound(adapter, options), needs_masks,
                  applies if applies is not None else (lambda explanation: True), options=options, adapter=adapter,
                  per_instance=per_instance)


def _per_instance(function: Callable[..., Tensor]) -> Adapter:
    """For the detection metrics, whose M values are the instances present (``explain.metrics.instance_boxes``'
    order): (N · K,) values, one per instance slot of the explanation (image-major), NaN for padding."""

    def adapter(given: MetricInput, **options: Any) -> Tensor:
        boxes = given.explanation.boxes
        assert boxes is not None, "per-instance metrics run on explanations of instances"
        present = ~boxes.isnan().any(dim=-1).flatten().cpu()
        slots = torch.full((present.shape[0],), math.nan, dtype=torch.float64)
        if bool(present.any()):
            slots[present] = function(given, **options).detach().double().cpu().reshape(-1)
        return slots

    return adapter


def _instance_curve(function: Callable[..., Any]) -> Callable[..., Tensor]:
    return lambda given, **options: function(given.model, given.inputs, given.explanation, **options).area


def _instance_localisation(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    return lambda given, **options: function(*metrics.instance_boxes(given.explanation), **options)


def _scored(function: Callable[..., Any], pick: Optional[Callable[[Any], Tensor]] = None, *,
            seeded: bool = False) -> Adapter:
    """For the metrics that score perturbed images with the model: function(model, inputs, maps, target,
    **options, output=the explainer's output selector[, generator=the batch's]), its field ``pick``."""

    def adapter(given: MetricInput, **options: Any) -> Tensor:
        if seeded:
            options["generator"] = given.generator()
        result = function(given.model, given.inputs, given.explanation, given.targets, output=given.explainer.output,
                          **options)
        return pick(result) if pick is not None else result

    return adapter


def _perturbed(function: Callable[..., Any], pick: Optional[Callable[[Any], Tensor]] = None, *,
               seeded: bool = False) -> Adapter:
    """For the metrics that explain other inputs with the explainer and compare with the batch's maps:
    function(explainer, inputs, explanation=the batch's, **options[, generator=the batch's]), its field ``pick``."""

    def adapter(given: MetricInput, **options: Any) -> Tensor:
        if seeded:
            options["generator"] = given.generator()
        result = function(given.explainer, given.inputs, explanation=given.explanation, **options)
        return pick(result) if pick is not None else result

    return adapter


def _explained(function: Callable[..., Any], pick: Callable[[Any], Tensor]) -> Adapter:
    """For the metrics that explain the images again themselves: function(explainer, inputs, targets, **options)."""
    return lambda given, **options: pick(function(given.explainer, given.inputs, given.targets, **options))


def _localisation(function: Callable[..., Tensor]) -> Adapter:
    def adapter(given: MetricInput, **options: Any) -> Tensor:
        assert given.masks is not None, "needs_masks metrics run only with masks"
        return function(given.explanation, given.masks, **options)

    return adapter


def _of_maps(function: Callable[..., Tensor]) -> Adapter:
    return lambda given, **options: function(given.explanation, **options)


def _completeness(given: MetricInput) -> Tensor:
    return metrics.completeness(given.model, given.inputs, given.explanation, given.targets,
                                output=given.explainer.output).relative_error.abs()


def _patch_size(inputs: Tensor, grid: int) -> int:
    """The side of the square patches that cut the longer side of the (N, C, H, W) images into ``grid`` patches."""
    return -(-max(inputs.shape[-2:]) // int_option("grid", grid, 1))


def _region_perturbation(given: MetricInput, *, grid: int, regions: int) -> Tensor:
    return metrics.region_perturbation(given.model, given.inputs, given.explanation, given.targets,
                                       patch_size=_patch_size(given.inputs, grid), regions=regions,
                                       output=given.explainer.output).aopc


def _selectivity(given: MetricInput, *, grid: int) -> Tensor:
    return metrics.selectivity(given.model, given.inputs, given.explanation, given.targets,
                               patch_size=_patch_size(given.inputs, grid), output=given.explainer.output).area


def _non_sensitivity(given: MetricInput, *, grid: int) -> Tensor:
    return metrics.non_sensitivity(given.model, given.inputs, given.explanation, given.targets,
                                   patch_size=_patch_size(given.inputs, grid), output=given.explainer.output)


def _sensitivity_n(given: MetricInput, *, runs: int, subset_sizes: Optional[Sequence[int]]) -> Tensor:
    """The mean over the n of the correlations (Quantus's summary of a sensitivity-n curve is per n)."""
    return metrics.sensitivity_n(given.model, given.inputs, given.explanation, given.targets, runs=runs,
                                 subset_sizes=subset_sizes, generator=given.generator(),
                                 output=given.explainer.output).correlations.mean(dim=1)


def _sufficiency(given: MetricInput, *, threshold: float) -> Tensor:
    """Among the images of the batch; NaN for a batch of one image, which has no other to compare with."""
    if given.inputs.shape[0] < 2:
        return torch.full((1,), math.nan)
    return metrics.sufficiency(given.model, given.inputs, given.explanation, threshold=threshold,
                               output=given.explainer.output)


def _continuity(given: MetricInput, *, shares: Sequence[float]) -> Tensor:
    """Translations of ``shares`` of the image's width, rounded to whole pixels (0 left out)."""
    width = given.inputs.shape[-1]
    shifts = list(dict.fromkeys(round(share * width) for share in shares if round(share * width) != 0))
    return metrics.continuity(given.explainer, given.inputs, explanation=given.explanation, shifts=shifts)


def _relative_representation_stability(given: MetricInput, **options: Any) -> Tensor:
    """The representation is the output of the layer a CAM explains by default (``explain.core.layers.default_layer``:
    the last feature maps of a CNN, the last block's first norm of a transformer)."""
    layer = default_layer(given.model, given.inputs, run=given.explainer.call_model)
    return metrics.relative_representation_stability(given.explainer, given.inputs, layers=layer,
                                                     explanation=given.explanation, generator=given.generator(),
                                                     **options)


@contextmanager
def _randomised_models_may_give_empty_maps() -> Iterator[None]:
    """Hides the explainers' warning about maps that are zero everywhere: a randomised model's map may well be, and
    the randomisation metrics measure just that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*maps that are zero everywhere", category=RuntimeWarning)
        yield


def _randomisation(adapter: Adapter) -> Adapter:
    def quiet(given: MetricInput, **options: Any) -> Tensor:
        with _randomised_models_may_give_empty_maps():
            return adapter(given, **options)

    return quiet


def _mean_rank_correlation(stages: Sequence[metrics.RandomizationStage]) -> Tensor:
    """(N,) the Spearman correlation with the trained model's maps, averaged over the randomisation stages (as
    Quantus's ``return_average_correlation``)."""
    if not stages:
        raise ValueError("no layer was randomised: none of the model's top-level layers with parameters runs in its "
                         "forward. Pass a Metric that calls the function with stages= naming the layers.")
    return torch.stack([stage.rank_correlation for stage in stages]).mean(dim=0)


def _smooth_mprt(given: MetricInput, **options: Any) -> Tensor:
    return _mean_rank_correlation(metrics.smooth_mprt(given.explainer, given.inputs, given.targets,
                                                      generator=given.generator(), **options))


def _arcc(given: MetricInput) -> Tensor:
    return metrics.arcc(given.explainer, given.inputs, given.explanation, given.targets).arcc


_ROAD_PERCENTAGES = (0.1, 0.3, 0.5, 0.7, 0.9)
_area = attrgetter("area")

METRICS: dict[str, Metric] = {metric.name: metric for metric in [
    # faithfulness: the score as what the map calls relevant is removed or changed
    _entry("deletion", "lower", "faithfulness: probability as the most relevant pixels are deleted (area, 16 "
           "steps)", _scored(metrics.deletion, _area), steps=16),
    _entry("insertion", "higher", "faithfulness: probability as the most relevant pixels are inserted into a blurred "
           "image (area, 16 steps)", _scored(metrics.insertion, _area), steps=16),
    _entry("road", "lower", "faithfulness: probability as the most relevant pixels are imputed from their neighbours "
           "(ROAD, area over 10–90 %)", _scored(metrics.road, _area), percentages=_ROAD_PERCENTAGES),
    _entry("road_combined", "higher", "faithfulness: (probability with the least relevant pixels imputed − with the "
           "most relevant imputed) / 2, mean over 10–90 % (ROAD combined)", _scored(metrics.road_combined),
           percentages=_ROAD_PERCENTAGES),
    _entry("confidence_drop", "lower", "faithfulness: the probability lost when the image is multiplied by its map",
           _scored(metrics.confidence_change, attrgetter("drop"))),
    _entry("confidence_increase", "higher", "faithfulness: 1 where the probability rises when the image is "
           "multiplied by its map", _scored(metrics.confidence_change, attrgetter("increase"))),
    _entry("masked_score_change", "higher", "faithfulness: the logit's change when the image is multiplied by its map",
           _scored(metrics.masked_score_change, attrgetter("change"))),
    _entry("faithfulness_correlation", "higher", "faithfulness: Pearson correlation, over 50 random subsets of 224 "
           "pixels, of the map's sum over a subset with the logit's drop when it is zeroed",
           _scored(metrics.faithfulness_correlation, seeded=True), runs=50, subset_size=224),
    _entry("faithfulness_estimate", "higher", "faithfulness: Pearson correlation, over 32 groups of pixels in order "
           "of relevance, of a group's map sum with the logit's drop when it alone is zeroed",
           _scored(metrics.faithfulness_estimate), steps=32),
    _entry("monotonicity", "higher", "faithfulness: 1 where the probability never falls as 32 groups of pixels, least "
           "relevant first, are put back into a zeroed image", _scored(metrics.monotonicity, attrgetter("monotonic")),
           steps=32),
    _entry("monotonicity_correlation", "higher", "faithfulness: Spearman correlation, over 16 groups of pixels, of a "
           "group's |map| sum with the probability's mean squared change when it is set to random values (4 draws)",
           _scored(metrics.monotonicity_correlation, seeded=True), steps=16, samples=4),
    _entry("region_perturbation", "higher", "faithfulness: mean probability drop (AOPC) as the 16 most relevant "
           "patches of an 8 × 8 grid are zeroed one after another", _region_perturbation, grid=8, regions=16),
    _entry("selectivity", "lower", "faithfulness: area under the probability as the patches of an 8 × 8 grid are "
           "zeroed, most relevant first", _selectivity, grid=8),
    _entry("irof", "higher", "faithfulness: area over the probability (relative to the image's) as SLIC superpixels "
           "(about 100) are set to the image's mean, most relevant first", _scored(metrics.irof,
                                                                                 attrgetter("area_over_curve"))),
    _entry("sensitivity_n", "higher", "faithfulness: faithfulness_correlation for random subsets of n pixels (16 "
           "each), averaged over 8 n from 1 pixel to 80 % of them", _sensitivity_n, runs=16, subset_sizes=None),
    _entry("infidelity", "lower", "faithfulness: mean squared error of the attributions' prediction Iᵀa of the "
           "logit's change under 32 Gaussian perturbations I (σ 0.1), a rescaled at best",
           _scored(metrics.infidelity, seeded=True), samples=32, noise=0.1, normalize=True),
    _entry("sufficiency", "higher", "faithfulness: share of the other images of the batch with a close map (within "
           "0.6 of the batch's largest distance) that get the same predicted class", _sufficiency, threshold=0.6),
    _entry("arcc", "higher", "faithfulness: harmonic mean of coherency (the masked image's map matches), 1 − "
           "complexity and ROAD combined over 20–80 % (ARCC)", _arcc),
    # axiomatic
    _entry("completeness", "lower", "axiomatic: |Σ map − (logit − logit at the zero input)| / |logit change|",
           _completeness, applies=lambda explanation: explanation.attributions is not None),
    _entry("non_sensitivity", "lower", "axiomatic: number of patches of an 8 × 8 grid where 'the map is zero' and "
           "'zeroing the patch leaves the probability' disagree", _non_sensitivity, grid=8),
    _entry("input_invariance", "higher", "axiomatic: 1 where the map is unchanged when a constant shift of the input "
           "is absorbed by the first layer", _explained(metrics.input_invariance, attrgetter("invariant"))),
    # randomisation
    _entry("random_logit", "lower", "randomisation: SSIM of the map for the class and for a random other class",
           _perturbed(metrics.random_logit, attrgetter("similarity"), seeded=True)),
    _entry("efficient_mprt", "higher", "randomisation: relative rise of the raw map's histogram entropy (100 bins) "
           "when every layer is randomised (eMPRT)",
           _randomisation(_perturbed(metrics.efficient_mprt, attrgetter("rise"))), bins=100),
    _entry("cascading_randomization", "lower", "randomisation: Spearman correlation of |map| with the trained "
           "model's as layers are randomised top down, mean over the stages (MPRT)",
           _randomisation(_explained(metrics.cascading_randomization, _mean_rank_correlation))),
    _entry("smooth_mprt", "lower", "randomisation: cascading randomisation bottom up on maps averaged over 8 noisy "
           "copies (σ 0.1 of the range), Spearman correlation, mean over the stages (sMPRT)",
           _randomisation(_smooth_mprt), samples=8, noise_level=0.1),
    # robustness: the map as the input moves a little
    _entry("max_sensitivity", "lower", "robustness: largest ‖Φ(x + δ) − Φ(x)‖ / ‖Φ(x)‖ of the raw map over 10 "
           "copies, δ uniform in ±0.2", _perturbed(metrics.max_sensitivity, seeded=True), samples=10, radius=0.2),
    _entry("avg_sensitivity", "lower", "robustness: mean ‖Φ(x + δ) − Φ(x)‖ / ‖Φ(x)‖ of the raw map over 10 copies, δ "
           "uniform in ±0.2", _perturbed(metrics.avg_sensitivity, seeded=True), samples=10, radius=0.2),
    _entry("local_lipschitz_estimate", "lower", "robustness: largest ‖Φ(x) − Φ(x')‖ / ‖x − x'‖ over 10 copies with "
           "Gaussian noise (σ 0.1)", _perturbed(metrics.local_lipschitz_estimate, seeded=True), samples=10, std=0.1),
    _entry("relative_input_stability", "lower", "robustness: largest relative change of the map over the input's, "
           "10 copies with noise uniform in ±0.2 that keep the prediction",
           _perturbed(metrics.relative_input_stability, seeded=True), samples=10, radius=0.2),
    _entry("relative_output_stability", "lower", "robustness: largest relative change of the map over the logits' "
           "change, 10 copies with noise uniform in ±0.2 that keep the prediction",
           _perturbed(metrics.relative_output_stability, seeded=True), samples=10, radius=0.2),
    _entry("relative_representation_stability", "lower", "robustness: largest relative change of the map over that "
           "of the default CAM layer's output, 10 copies with noise uniform in ±0.2 that keep the prediction",
           _relative_representation_stability, samples=10, radius=0.2),
    _entry("continuity", "lower", "robustness: largest ‖Φ(x) − Φ(x')‖₁ / ‖x − x'‖ over 6 horizontal translations "
           "x' (±1/16, ±1/8, ±1/4 of the width)", _continuity, shares=(-0.25, -0.125, -0.0625, 0.0625, 0.125, 0.25)),
    # localisation: against the objects' masks
    _entry("pointing_game", "higher", "localisation: 1 where the map's maximum lies on the object or within "
           "tolerance pixels of it (0: on it; TorchRay's protocol takes 15 px at 224 px, about 4 px at 64 px)",
           _localisation(metrics.pointing_game), needs_masks=True, tolerance=0.0),
    _entry("energy_pointing_game", "higher", "localisation: share of the positive relevance in the object's box",
           _localisation(metrics.energy_pointing_game), needs_masks=True),
    _entry("relevance_mass_accuracy", "higher", "localisation: share of the positive relevance on the object",
           _localisation(metrics.relevance_mass_accuracy), needs_masks=True),
    _entry("relevance_rank_accuracy", "higher", "localisation: share of the object among the top-|object| pixels",
           _localisation(metrics.relevance_rank_accuracy), needs_masks=True),
    _entry("top_k_intersection", "higher", "localisation: share of the top 1000 pixels on the object",
           _localisation(metrics.top_k_intersection), needs_masks=True, k=1000),
    _entry("auc", "higher", "localisation: ROC AUC of the map as a detector of the object's pixels",
           _localisation(metrics.auc), needs_masks=True),
    # detection: one value per explained instance (evaluate(..., instances=...))
    _entry("instance_deletion", "lower", "detection: D-RISE's deletion, the instance's best similarity (IoU × class "
           "cosine × objectness) to the detections as its most relevant pixels are zeroed (area, 16 steps)",
           _per_instance(_instance_curve(metrics.instance_deletion)), per_instance=True, steps=16),
    _entry("instance_insertion", "higher", "detection: D-RISE's insertion, the instance's best similarity to the "
           "detections as its most relevant pixels are put back into a blurred image (area, 16 steps)",
           _per_instance(_instance_curve(metrics.instance_insertion)), per_instance=True, steps=16),
    _entry("instance_pointing_game", "higher", "detection: 1 where the instance's map peaks inside its own box",
           _per_instance(_instance_localisation(metrics.pointing_game)), per_instance=True),
    _entry("instance_energy", "higher", "detection: share of the instance map's positive relevance inside its own box",
           _per_instance(_instance_localisation(metrics.energy_pointing_game)), per_instance=True),
    # complexity: how concentrated the map is
    _entry("sparseness", "higher", "complexity: Gini index of |map| (1: all relevance on one pixel)",
           _of_maps(metrics.sparseness)),
    _entry("complexity", "lower", "complexity: entropy of |map| / Σ|map|", _of_maps(metrics.complexity)),
    _entry("effective_complexity", "lower", "complexity: number of pixels whose |map| exceeds 1e-5 of its peak",
           _of_maps(metrics.effective_complexity), eps=1e-5),
]}
"""The metrics ``evaluate`` knows, by name, with the settings it uses (each function's docstring says more; the
settings keep the cost to tens of forward or explainer passes per image, and ``Metric.with_options`` changes them).
Every function of ``explain.metrics`` that gives one value per image is here but two, which need what evaluate's
per-image batches do not have:

- ``focus`` scores maps of 2 × 2 mosaics of images of two classes (``make_mosaics``): its values are per mosaic,
  not per image of the data, a batch may hold no class twice, and a model with a fixed input size cannot take a
  mosaic of twice its size. Run it on mosaics with ``explain.metrics.focus``.
- ``consistency`` compares each image with the other images that have the same discrete explanation (the same
  top-5 pixels): that takes a large set of images, and within a batch almost no two share one (the values would be
  NaN). Run it on the whole data set with ``explain.metrics.consistency``.

Random draws (subsets, noise, other classes) come from ``MetricInput.generator``, seeded with the batch's index."""


@dataclass
class Evaluation:
    """The values of an evaluation: ``values[method][metric]`` (images,) float64 in data order; ``seconds``, the
    time each metric took in all per method; ``metrics`` the Metric of each name, in the order asked."""

    methods: list[str]
    metrics: list[Metric]
    values: dict[str, dict[str, Tensor]]
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def mean(self, method: str, metric: str) -> float:
        """The mean over the images where the metric is defined (not NaN); NaN where it is defined on none."""
        return float(self.values[method][metric].nanmean())

    def spread(self, method: str, metric: str) -> float:
        """The standard error of the mean over the images where the metric is defined."""
        values = self.values[method][metric]
        values = values[~values.isnan()]
        return float(values.std() / math.sqrt(len(values))) if len(values) > 1 else 0.0

    def ranks(self) -> dict[str, dict[str, float]]:
        """``ranks[method][metric]``: 1 for the best mean, ties sharing their mean rank; NaN where the metric does
        not apply to the method (ranked among the methods it applies to)."""
        ranks: dict[str, dict[str, float]] = {method: {} for method in self.methods}
        for metric in self.metrics:
            sign = -1.0 if metric.better == "higher" else 1.0
            means = {method: sign * self.mean(method, metric.name) for method in self.methods}
            applicable = [mean for mean in means.values() if not math.isnan(mean)]
            for method, mean in means.items():
                ranks[method][metric.name] = math.nan if math.isnan(mean) else 1 + sum(
                    other < mean for other in applicable) + (sum(other == mean for other in applicable) - 1) / 2
        return ranks

    def mean_rank(self) -> dict[str, float]:
        """Each method's rank averaged over the metrics that apply to it (lower is better)."""
        ranks = self.ranks()
        mean_ranks = {}
        for method in self.methods:
            applicable = [rank for rank in ranks[method].values() if not math.isnan(rank)]
            mean_ranks[method] = sum(applicable) / len(applicable) if applicable else math.nan
        return mean_ranks

    def _best_first(self, mean_rank: Mapping[str, float]) -> list[str]:
        """The methods by mean rank, best first; those no metric applies to (NaN) last."""
        return sorted(self.methods, key=lambda name: (math.isnan(mean_rank[name]), mean_rank[name]))

    def within_error(self) -> dict[str, list[list[str]]]:
        """Per metric, the methods it applies to in groups whose order the data does not settle, best first:
        walking the methods from the best mean on, a method joins the group of the current group's first (best)
        method when their means differ by at most the standard error of the difference, √(se₁² + se₂²) (the
        ``spread`` of each), else it starts the next group. A group of one is a method set apart from the others;
        the table marks the members of larger groups with ≈ and the figure gives them one colour."""
        groups: dict[str, list[list[str]]] = {}
        for metric in self.metrics:
            sign = -1.0 if metric.better == "higher" else 1.0
            means = {method: self.mean(method, metric.name) for method in self.methods}
            ordered = sorted((method for method in self.methods if not math.isnan(means[method])),
                             key=lambda method: sign * means[method])
            metric_groups: list[list[str]] = []
            for method in ordered:
                if metric_groups:
                    leader = metric_groups[-1][0]
                    error = math.hypot(self.spread(method, metric.name), self.spread(leader, metric.name))
                    if abs(means[method] - means[leader]) <= error:
                        metric_groups[-1].append(method)
                        continue
                metric_groups.append([method])
            groups[metric.name] = metric_groups
        return groups

    def ranks_within_error(self) -> dict[str, dict[str, float]]:
        """``ranks[method][metric]`` as ``ranks`` gives them, but each group of ``within_error`` sharing the mean of
        its members' ranks (the figure's colours): methods whose difference lies inside the error rank alike."""
        ranks: dict[str, dict[str, float]] = {method: {} for method in self.methods}
        for name, metric_groups in self.within_error().items():
            for method in self.methods:
                ranks[method][name] = math.nan
            position = 1
            for group in metric_groups:
                shared = position + (len(group) - 1) / 2
                for method in group:
                    ranks[method][name] = shared
                position += len(group)
        return ranks

    def _tied(self) -> dict[str, set[str]]:
        """Per metric, the methods whose mean lies within the error of another's (``within_error``'s groups of
        two or more)."""
        return {name: {method for group in metric_groups if len(group) > 1 for method in group}
                for name, metric_groups in self.within_error().items()}

    def markdown(self) -> str:
        """The table: a row per method, a column per metric headed by its name, ↑ (higher is better) or ↓, and its
        settings (``Metric.options``); in a cell, the mean ± standard error and the rank, with ≈ where the
        difference from another method lies inside the error (``within_error``); the mean rank last."""
        ranks, mean_rank, tied = self.ranks(), self.mean_rank(), self._tied()
        header = "| method | " + " | ".join(metric_heading(metric) for metric in self.metrics)
        lines = [header + " | mean rank |", "| --- |" + " ---: |" * (len(self.metrics) + 1)]
        for method in self._best_first(mean_rank):
            cells = ["–" if math.isnan(ranks[method][m.name]) else
                     f"{self.mean(method, m.name):.3f} ± {self.spread(method, m.name):.3f} ({ranks[method][m.name]:g}"
                     f"{' ≈' if method in tied[m.name] else ''})" for m in self.metrics]
            shown = "–" if math.isnan(mean_rank[method]) else f"{mean_rank[method]:.2f}"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {shown} |")
        return "\n".join(lines)

    def notes_markdown(self) -> str:
        """What the table's marks mean, and each metric's settings and what it measures, one line each."""
        lines = ["Mean ± standard error over the images (rank, 1 = best). ≈: walking a column from the best mean, "
                 "the methods whose mean differs from the best of their group by at most the standard error of the "
                 "difference, √(se₁² + se₂²), form a group; the members of a group of two or more are marked ≈ (the "
                 "data do not settle their order) and share a colour in the figure.", "",
                 "Metrics and their settings:", ""]
        for metric in self.metrics:
            settings = metric_settings(metric)
            lines.append(f"- {metric_name(metric)} ({'higher' if metric.better == 'higher' else 'lower'} is better; "
                         f"{settings or 'no settings'}): {metric.measures}")
        return "\n".join(lines)

    def cost_markdown(self) -> str:
        """Seconds per image of each metric, per method."""
        count = len(next(iter(next(iter(self.values.values())).values())))
        lines = ["| metric | " + " | ".join(self.methods) + " |", "| --- |" + " ---: |" * len(self.methods)]
        for metric in self.metrics:
            lines.append(f"| {metric.name} | " + " | ".join(
                f"{self.seconds.get(method, {}).get(metric.name, 0.0) / count:.4f}" for method in self.methods) + " |")
        return "\n".join(lines)

    def figure(self) -> Any:
        """A matplotlib figure: a cell per method and metric holding the mean (≈ where the difference from another
        method lies inside the error), coloured by rank with each ``within_error`` group sharing one colour; the
        metrics' settings under their names, the mean rank beside each method's."""
        import textwrap

        import matplotlib.pyplot as plt

        ranks, mean_rank, tied = self.ranks_within_error(), self.mean_rank(), self._tied()
        order = self._best_first(mean_rank)
        grid = [[ranks[method][metric.name] for metric in self.metrics] for method in order]
        labels = [f"{metric_name(m)} {'↑' if m.better == 'higher' else '↓'}"
                  + "".join("\n" + line for line in textwrap.wrap(metric_settings(m), 24)) for m in self.metrics]
        longest = max(len(line) for label in labels for line in label.splitlines())  # rotated 45°: its height
        lines = max(len(label.splitlines()) for label in labels)
        figure, axes = plt.subplots(figsize=(1.1 * len(self.metrics) + 2.5,
                                             0.55 * len(order) + 0.8 + 0.04 * longest + 0.1 * lines))
        image = axes.imshow(grid, cmap="RdYlGn_r", vmin=1, vmax=max(len(order), 2), aspect="auto")
        for row, method in enumerate(order):
            for column, metric in enumerate(self.metrics):
                mean = self.mean(method, metric.name)
                mark = " ≈" if method in tied[metric.name] else ""
                axes.text(column, row, "–" if math.isnan(mean) else f"{mean:.2f}{mark}", ha="center", va="center",
                          fontsize=8)
        axes.set_xticks(range(len(self.metrics)), labels, rotation=45, ha="right", fontsize=8)
        shown = {method: "–" if math.isnan(rank) else f"{rank:.1f}" for method, rank in mean_rank.items()}
        axes.set_yticks(range(len(order)), [f"{method} ({shown[method]})" for method in order], fontsize=8)
        figure.colorbar(image, ax=axes, label="rank (1 = best)")
        axes.set_title("methods × metrics: mean value, coloured by rank (mean rank in brackets); ≈: inside the\n"
                       "standard error of another ≈ method, which shares its colour", fontsize=9)
        figure.tight_layout()
        return figure


def metric_name(metric: Metric) -> str:
    """A metric's name without the settings that ``Metric.with_options`` writes into it."""
    return metric.name.split("(", 1)[0] if metric.options else metric.name


def metric_settings(metric: Metric) -> str:
    """Every setting a metric computes with, "tolerance=0.0" or "steps=16, samples=4" ("" for none)."""
    return ", ".join(f"{key}={value!r}" for key, value in metric.options.items())


def metric_heading(metric: Metric) -> str:
    """A metric's column heading: its name, ↑ or ↓ (higher or lower is better) and its settings."""
    settings = metric_settings(metric)
    return f"{metric_name(metric)} {'↑' if metric.better == 'higher' else '↓'}" + (f" ({settings})" if settings else "")


def _class_indices(labels: Any) -> Tensor:
    """The data's labels as a tensor of class indices; class names and other values are refused, saying so."""
    try:
        tensor = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is None or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        shown = f"{type(labels).__name__}" + (f" of {tensor.dtype}" if tensor is not None else "")
        raise ValueError(f"the data's labels must be class indices, (N,) integers; got a {shown}. Map class names "
                         "to indices first, e.g. with the model's config.label2id (HuggingFace) or the index of "
                         "each name in your class list.")
    return tensor.long()


def _batches(data: Union[EvaluationBatch, Iterable[EvaluationBatch]], batch_size: int, labels_needed: bool = True
             ) -> Iterator[tuple[Tensor, Optional[Tensor], Optional[Tensor]]]:
    """The data as (inputs, labels, masks or None) batches: a single (inputs, labels[, masks]) tuple is cut into
    batches of ``batch_size``; an iterable (a DataLoader) gives its own batches. Masks may be numpy arrays; tensors
    made inside the caller's ``torch.inference_mode()`` are copied into ordinary ones (autograd refuses them).
    Without ``labels_needed`` (detectors' instances), the labels are not read: None is yielded."""
    if not labels_needed:
        if isinstance(data, Tensor):
            data = (data, None)
        if isinstance(data, tuple) and len(data) in (2, 3) and isinstance(data[0], Tensor):
            data = [(data[0][start:start + batch_size], None) for start in range(0, data[0].shape[0], batch_size)]
        for position, batch in enumerate(data):
            inputs = batch if isinstance(batch, Tensor) else batch[0] if isinstance(batch, (tuple, list)) and batch \
                else None
            if not isinstance(inputs, Tensor) or inputs.dim() != 4:
                raise ValueError(f"batch {position} of the data holds no (N, C, H, W) images: give images, "
                                 "(images, None) or a DataLoader of (images, anything).")
            yield _ordinary(inputs, None, None)
        return
    if isinstance(data, tuple) and len(data) in (2, 3) and isinstance(data[0], Tensor):
        inputs, labels = data[0], _class_indices(data[1])
        masks = None if len(data) == 2 or data[2] is None else torch.as_tensor(data[2])
        if inputs.dim() != 4 or labels.shape != (inputs.shape[0],):
            raise ValueError(f"data must be (inputs (N, C, H, W), labels (N,)[, masks (N, H, W)]); got inputs of "
                             f"shape {tuple(inputs.shape)} and labels of shape {tuple(labels.shape)}.")
        if masks is not None and (masks.dim() != 3 or masks.shape[0] != inputs.shape[0]):
            raise ValueError(f"masks must be (N, H, W) for the {inputs.shape[0]} images; got shape "
                             f"{tuple(masks.shape)}.")
        for start in range(0, inputs.shape[0], batch_size):
            yield _ordinary(inputs[start:start + batch_size], labels[start:start + batch_size],
                            None if masks is None else masks[start:start + batch_size])
        return
    for position, batch in enumerate(data):
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3) or not isinstance(batch[0], Tensor):
            raise ValueError(f"batch {position} of the data is not (inputs, labels[, masks]): evaluate needs each "
                             "image's class to explain and score.")
        masks = None if len(batch) == 2 or batch[2] is None else torch.as_tensor(batch[2])
        yield _ordinary(batch[0], torch.as_tensor(batch[1]), masks)


def _detected(model: nn.Module, inputs: Tensor, instances: InstanceSpec) -> Instances:
    """The batch's instances (one forward pass without a graph, the model left as found); none (K = 0) where
    nothing in the batch is selected. Given boxes that no detection overlaps by the IoU the explanations find an
    instance at (``InstanceTarget.min_iou``) are padding, said in a warning: their maps would be empty and their
    values those of an empty map."""
    batch = inputs.to(_device_of(model))
    with torch.no_grad(), preserved_model_state(model):
        output = model(batch)
    try:
        found: Optional[Instances] = detect(model, batch, instances, output, warn_unmatched=False)  # warned below
    except ValueError as error:
        if not str(error).startswith("no instance selected"):
            raise
        found = None
    if isinstance(instances, Tensor):  # given boxes: those no detection overlaps are left out, with a word
        if found is not None:
            target = InstanceTarget(found, model, batch.shape[-2:])
            present = found.present & ~target.empty_regions(output).to(found.present.device)
            found = replace(found, present=present) if bool(present.any()) else None
        given = instances.shape[-2] * batch.shape[0]
        missing = given if found is None else int((~found.present).sum())
        if missing:
            warn_at_callers_line(
                f"{missing} of the {given} given boxes in a batch of {batch.shape[0]} images overlap no detection of "
                f"the model by IoU ≥ {MIN_IOU}: their values are NaN and "
                "left out of the means. Give boxes the model detects, or instances='all' / k.", RuntimeWarning)
    return found if found is not None else _no_instances(batch.shape[0])


def _no_instances(images: int) -> Instances:
    """Instances of ``images`` images with none in any (K = 0)."""
    empty = torch.zeros(images, 0)
    return Instances(empty[..., None].expand(-1, -1, 4), empty.long(), empty, empty.bool())


def _given_boxes(instances: Optional[InstanceSpec]) -> Optional[InstanceSpec]:
    """``instances`` with boxes given as an ndarray or nested lists read as a float32 tensor, one box (4,) as (1, 4);
    the other specs as given."""
    if isinstance(instances, Instances) or not given_boxes(instances):
        return instances
    try:
        boxes = torch.as_tensor(instances, dtype=torch.float32).detach().cpu()
    except (ValueError, TypeError) as error:
        raise ValueError(f"boxes for instances must be one (K, 4) array of x0, y0, x1, y1 for every image; torch "
                         f"could not read them: {error}") from None
    return boxes[None] if boxes.dim() == 1 else boxes


def _check_kinds(model: nn.Module, chosen: list[Metric], instances: Optional[InstanceSpec]) -> None:
    """Per-instance metrics with instances, per-image metrics without; a clear error for a mix, a classifier given
    instances, or instances the evaluation cannot hold for every batch."""
    if instances is None:
        wrong = [metric.name for metric in chosen if metric.per_instance]
        if wrong:
            raise ValueError(f"the metrics {wrong} score detected instances: give instances= (\"all\", k, a score "
                             "threshold) to evaluate a detector per instance.")
        return
    check_detector(model)
    if isinstance(instances, Instances) or (isinstance(instances, Tensor) and instances.dim() != 2):
        raise ValueError("evaluate takes instances as \"all\", k, a score threshold or (K, 4) boxes for every image "
                         "(each batch's own are detected); Instances or (N, K, 4) boxes belong to one batch: explain "
                         "it with explainer.explain(images, instances=...) and use explain.metrics directly.")
    wrong = [metric.name for metric in chosen if not metric.per_instance]
    if wrong:
        per_instance = [name for name, metric in METRICS.items() if metric.per_instance]
        raise ValueError(f"the metrics {wrong} score a class per image, not a detected instance; with instances= "
                         f"use the per-instance metrics: {', '.join(per_instance)}.")


def _instances_text(instances: InstanceSpec) -> str:
    """How the record names the instances (boxes by their fingerprint)."""
    if isinstance(instances, Tensor):
        return f"boxes {_fingerprint([instances])}"
    return repr(instances)


def _device_of(model: nn.Module) -> torch.device:
    return model_device(model)


def _named_method(name: str, module: nn.Module, parts: dict[str, Any], model: Union[nn.Module, LoadedModel]
                  ) -> Explainer:
    """The method ``name`` with its defaults on ``module``, with a loaded model's parts, and its CAM layer where the
    loaded model names one (the demos' own: the demo detector's heads would otherwise be taken for the layer)."""
    make = get_method(name)
    options = dict(parts)
    layer = model.default_layer if isinstance(model, LoadedModel) else None
    if layer is not None and getattr(make, "needs_layer", False):
        options["layer"] = layer
    return make(module, **options)


def _image_count(data: Union[EvaluationBatch, Iterable[EvaluationBatch]]) -> Optional[int]:
    """How many images ``data`` holds, for the progress bar, where that is known without reading it: one
    (inputs, labels[, masks]) tuple, a list of such batches, or a DataLoader (anything with a sized ``dataset``; the
    last, partial batch left out with ``drop_last``); None otherwise."""
    if isinstance(data, tuple) and len(data) in (2, 3) and isinstance(data[0], Tensor):
        return int(data[0].shape[0]) if data[0].dim() > 0 else None
    dataset = getattr(data, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        count, batch_size = len(dataset), getattr(data, "batch_size", None)
        if getattr(data, "drop_last", False) and isinstance(batch_size, int) and batch_size > 0:
            count -= count % batch_size
        return count
    if isinstance(data, (list, tuple)) and all(isinstance(batch, (tuple, list)) and batch
                                               and isinstance(batch[0], Tensor) and batch[0].dim() > 0
                                               for batch in data):
        return sum(int(batch[0].shape[0]) for batch in data)
    return None


def _ordinary(*tensors: Optional[Tensor]) -> Any:
    """The tensors, those made inside ``torch.inference_mode()`` copied (called outside it)."""
    return tuple(tensor.clone() if tensor is not None and tensor.is_inference() else tensor for tensor in tensors)


def _fingerprint(tensors: Iterable[Optional[Tensor]]) -> str:
    """A short SHA-256 of the tensors' shapes, dtypes and values: tells a batch or a model from another."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            hasher.update(b"None;")
            continue
        tensor = tensor.detach().cpu()
        hasher.update(f"{tuple(tensor.shape)} {tensor.dtype};".encode())
        try:
            hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a quantised or otherwise unusual tensor: its serialisation
            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            hasher.update(buffer.getvalue())
    return hasher.hexdigest()[:16]


def _model_fingerprint(model: nn.Module) -> str:
    """The model's class and a fingerprint of its parameters and buffers (shapes, and at most 4096 values of each,
    evenly spaced: weights trained or loaded otherwise differ nearly everywhere), as the record names the model
    without reading every weight of a large one."""
    tensors = [value for value in model.state_dict().values() if isinstance(value, Tensor)]
    samples = [value.detach().flatten()[:: max(1, value.numel() // 4096)] for value in tensors]
    return f"{type(model).__name__} {_fingerprint(samples + [torch.tensor(value.shape) for value in tensors])}"


def _explainers(model: Union[nn.Module, LoadedModel],
                methods: Union[str, Explainer, Sequence[Union[str, Explainer]], Mapping[str, Explainer]]
                ) -> dict[str, Explainer]:
    if isinstance(methods, (str, Explainer)):
        methods = [methods]
    # a loaded model: the methods named take its module with its preprocessing, class names and output selector
    module, preprocess, class_names, output = loaded_model_parts(model)
    parts: dict[str, Any] = {key: value for key, value in (("preprocess", preprocess), ("class_names", class_names),
                                                           ("output", output)) if value is not None}
    explainers: dict[str, Explainer] = {}
    if isinstance(methods, Mapping):
        for name, explainer in methods.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"method names must be non-empty strings; got {name!r}.")
            if not isinstance(explainer, Explainer):
                raise ValueError(f"method {name!r} is not an explainer ({type(explainer).__name__}): a mapping takes "
                                 "name → explainer built on the model.")
            explainers[name] = explainer
    else:
        for method in methods:
            explainer = _named_method(method, module, parts, model) if isinstance(method, str) else method
            if not isinstance(explainer, Explainer):
                raise ValueError(f"method {method!r} is neither a method's name nor an explainer.")
            name = method if isinstance(method, str) else explainer.name
            if name in explainers:
                raise ValueError(f"method {name!r} is given twice; give a mapping name → explainer to compare two "
                                 "settings of one method.")
            explainers[name] = explainer
    if not explainers:
        raise ValueError("evaluate needs at least one method.")
    for name, explainer in explainers.items():
        if explainer.model is not module and getattr(module, "_orig_mod", None) is not explainer.model:
            raise ValueError(f"the explainer of method {name!r} ({type(explainer).__name__}) explains another model "
                             "than the one given: the metrics would score the given model on another's maps.")
    return explainers


def _metrics(names: Union[str, Metric, Sequence[Union[str, Metric]]]) -> list[Metric]:
    chosen: list[Metric] = []
    for name in [names] if isinstance(names, (str, Metric)) else names:
        if isinstance(name, Metric):
            chosen.append(name)
        elif name in METRICS:
            chosen.append(METRICS[name])
        else:
            raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)} (or pass an "
                             "explain.dataset_tools.evaluation.Metric).")
    if not chosen:
        raise ValueError("evaluate needs at least one metric.")
    twice = [name for name in dict.fromkeys(metric.name for metric in chosen)
             if sum(metric.name == name for metric in chosen) > 1]
    if twice:
        raise ValueError(f"a metric is given twice: {', '.join(twice)}.")
    return chosen


def _read_record(record: Path) -> dict[str, Any]:
    """The settings an earlier run recorded (and its batches' fingerprints); a ValueError naming the file when it is
    not such a record."""
    if not record.exists():
        return {}
    try:
        earlier = json.loads(record.read_text(encoding="utf-8"))
    except ValueError as error:  # not JSON, not UTF-8
        raise ValueError(f"{record} is not a readable evaluation record ({error}); delete the folder's "
                         f"{SETTINGS_FILE} and {VALUES_FILE} to start afresh, or give another folder.") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("batches", {}), dict):
        raise ValueError(f"{record} is not an evaluation record (a JSON object of the settings); delete the "
                         f"folder's {SETTINGS_FILE} and {VALUES_FILE} to start afresh, or give another folder.")
    return earlier


def _read_values(values_file: Path) -> tuple[str, list[dict[str, str]]]:
    """The values file's text and its whole rows (a kill may have torn the last line); a ValueError naming the file
    and the line for what is not a row of values."""
    text = values_file.read_text(encoding="utf-8") if values_file.exists() else ""
    reader = csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1]))
    advice = "delete it to compute the evaluation afresh, or give another folder."
    if reader.fieldnames is not None and list(reader.fieldnames) != FIELDS:
        raise ValueError(f"{values_file} is not an evaluation's values file: its first line is "
                         f"{','.join(reader.fieldnames)!r}, not {','.join(FIELDS)!r}; {advice}")
    rows = []
    for row in reader:
        try:
            int(row["batch"]), int(row["image"]), float(row["value"]), float(row["seconds"])
        except (TypeError, ValueError):
            raise ValueError(f"{values_file}, line {reader.line_num}: not a row of values "
                             f"({','.join(str(value) for value in row.values())!r}); {advice}") from None
        rows.append(row)
    return text, rows


def _done(out: Path, settings: dict[str, Any], metric_names: Sequence[str]
          ) -> tuple[dict[tuple[int, str], list[dict[str, str]]], dict[str, str]]:
    """The rows of every (batch, method) that an earlier run finished (every metric, once for each of the same
    images; in metric then image order), and the fingerprints of the batches it took, after checking that it used
    the same settings. A record that holds no value binds nothing. The values file is rewritten without unfinished
    groups (a kill during their write) and rows written twice."""
    earlier = _read_record(out / SETTINGS_FILE)
    values_file = out / VALUES_FILE
    text, rows = _read_values(values_file)
    if not rows:
        return {}, {}
    if not earlier:
        raise ValueError(f"{out} holds values ({VALUES_FILE}) but no record of their settings ({SETTINGS_FILE}); "
                         f"delete {VALUES_FILE} to start afresh, or give another folder.")
    differences = [f"{key}: {earlier.get(key)!r} earlier, {value!r} now" for key, value in settings.items()
                   if earlier.get(key) != value and key != "explainers"]
    earlier_explainers = earlier.get("explainers")
    if earlier_explainers != settings["explainers"]:
        if isinstance(earlier_explainers, list) and len(earlier_explainers) == len(settings["methods"]):
            differences += [f"method {name!r}: {before} earlier, {now} now" for name, before, now
                            in zip(settings["methods"], earlier_explainers, settings["explainers"]) if before != now]
        else:
            differences.append(f"explainers: {earlier_explainers!r} earlier, {settings['explainers']!r} now")
    if differences:
        raise ValueError(f"{out} holds an evaluation with other settings ({'; '.join(differences)}); rerun with "
                         "the earlier settings to resume it, or give another folder.")
    groups: dict[tuple[int, str], dict[tuple[str, int], dict[str, str]]] = {}
    for row in rows:  # a row written twice (two runs at once in one folder) counts once
        groups.setdefault((int(row["batch"]), row["method"]), {}).setdefault((row["metric"], int(row["image"])), row)
    complete = {}
    for key, unique in groups.items():
        images = len({image for _, image in unique})
        wanted = [(name, image) for name in metric_names for image in range(images)]
        if images > 0 and len(unique) == len(wanted) and all(pair in unique for pair in wanted):
            complete[key] = [unique[pair] for pair in wanted]
    kept_rows = sum(len(group) for group in complete.values())
    if kept_rows != len(rows) or not text.endswith("\n"):  # keep only the complete groups, each row once
        kept = io.StringIO()
        writer = csv.DictWriter(kept, FIELDS, lineterminator="\n")
        writer.writeheader()
        for group in complete.values():
            writer.writerows(group)
        write_atomically(values_file, lambda path: path.write_text(kept.getvalue(), encoding="utf-8"))
    return complete, {str(key): str(value) for key, value in earlier.get("batches", {}).items()}


def evaluate(
    model: Union[nn.Module, LoadedModel],
    methods: Union[str, Explainer, Sequence[Union[str, Explainer]], Mapping[str, Explainer]],
    data: Union[EvaluationBatch, Iterable[EvaluationBatch], Tensor],
    metrics: Union[str, Metric, Sequence[Union[str, Metric]], None] = None,
    *,
    instances: Optional[InstanceSpec] = None,
    out: Union[str, Path, None] = None,
    batch_size: int = 8,
    progress: bool = True,
) -> Evaluation:
    """Evaluate each method with each metric over ``data``; every image's value kept (see the module docstring).

    model: a module, or what ``explain.load_model`` returns (the methods named then take its preprocessing, class
        names and output selector; the metrics score its module).
    methods: registry names ("gradcam", ...; built with their defaults on ``model``, at a loaded model's own CAM
        layer where it names one), explainers, or a mapping
        name → explainer. data: (inputs (N, C, H, W) model input, labels (N,)[, masks (N, H, W) bool]) or a
        DataLoader of such batches, in a fixed order (resuming relies on it); with ``instances``, also the images
        alone, (images, None) or a DataLoader of (images, anything). metrics: names of ``METRICS`` or
        ``Metric`` objects; localisation metrics need masks; None: ``DEFAULT_METRICS`` (``DEFAULT_INSTANCE_METRICS``
        with ``instances``). out: a folder for the resumable record, the table and the figure. batch_size: images
        per batch when ``data`` is one tuple.
    instances: a detector evaluated per detected instance: "all", k, a score threshold or (K, 4) boxes for every
        image (``explain.detection.InstanceSpec``). Each batch's instances are detected once and every method
        explains those same instances; the labels may be None; the metrics are the per-instance ones
        (``Metric.per_instance``), and a value is kept per instance slot (image × K + instance; NaN for an image
        with fewer instances than K).

    A resumed run checks that it has the earlier run's methods (their names, explainer classes and settings),
    metrics, batch size, model (its parameters' fingerprint) and data (each batch's fingerprint, recorded before it
    is computed): anything else is a ValueError naming what differs.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number ≥ 1; got {batch_size!r}.")
    default = DEFAULT_METRICS if instances is None else DEFAULT_INSTANCE_METRICS
    explainers, chosen = _explainers(model, methods), _metrics(default if metrics is None else metrics)
    if isinstance(model, LoadedModel):  # the explainers built on it hold its parts; the metrics need the module
        model = model.model
    instances = _given_boxes(instances)  # an ndarray or lists of boxes: the tensor they hold
    _check_kinds(model, chosen, instances)
    names = [metric.name for metric in chosen]
    settings: dict[str, Any] = {"methods": list(explainers), "metrics": names, "batch_size": batch_size,
                                "explainers": [setting_text(explainer) for explainer in explainers.values()]}
    if instances is not None:
        settings["instances"] = _instances_text(instances)
    folder = None if out is None else Path(out)
    done: dict[tuple[int, str], list[dict[str, str]]] = {}
    record: Optional[dict[str, Any]] = None
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} is a file; give a folder for the evaluation (it is created if missing).")
        folder.mkdir(parents=True, exist_ok=True)
        settings["model"] = _model_fingerprint(model)
        done, batches = _done(folder, settings, names)
        record = {**settings, "batches": batches}
        _write_record(folder, record)
    per_batch: dict[tuple[int, str], dict[str, Tensor]] = {}
    seconds: dict[str, dict[str, float]] = {method: dict.fromkeys(names, 0.0) for method in explainers}
    with torch.inference_mode(False), progress_shown_by_caller(), \
            tqdm(desc="evaluate", unit="image", total=_image_count(data), disable=not progress) as bar:
        _run(model, explainers, chosen, data, batch_size, done, per_batch, seconds, folder, record, bar, instances)
    if not per_batch:
        raise ValueError("the data holds no images.")
    if instances is not None and not any(len(next(iter(batch.values()))) for batch in per_batch.values()):
        raise ValueError(f"instances={instances!r} selects no instance in any image of the data: give a lower score "
                         "threshold, or k for each image's k highest-scoring detections.")
    values = {method: {name: torch.cat([per_batch[key][name] for key in sorted(per_batch) if key[1] == method])
                       for name in names} for method in explainers}
    result = Evaluation(list(explainers), chosen, values, seconds)
    if folder is not None:
        _write_summary(result, folder)
    return result


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    write_atomically(folder / SETTINGS_FILE, lambda path: path.write_text(json.dumps(record, indent=1)))


def _run(model: nn.Module, explainers: dict[str, Explainer], chosen: list[Metric],
         data: Union[EvaluationBatch, Iterable[EvaluationBatch]], batch_size: int,
         done: dict[tuple[int, str], list[dict[str, str]]], per_batch: dict[tuple[int, str], dict[str, Tensor]],
         seconds: dict[str, dict[str, float]], folder: Optional[Path], record: Optional[dict[str, Any]],
         bar: Any, instances: Optional[InstanceSpec] = None) -> None:
    """Every batch × method: taken from an earlier run's rows, or explained and measured (``_evaluate_batch``).
    With ``instances``, each batch's instances are detected first, and the values are per instance slot."""
    names = [metric.name for metric in chosen]
    for index, (inputs, labels, masks) in enumerate(_batches(data, batch_size, labels_needed=instances is None)):
        found = None if instances is None else _detected(model, inputs, instances)
        slots = len(inputs) if found is None else found.present.numel()
        if masks is None and any(metric.needs_masks for metric in chosen):
            needing = [metric.name for metric in chosen if metric.needs_masks]
            raise ValueError(f"the metrics {needing} need the objects' masks: give data as (inputs, labels, masks).")
        if record is not None:
            assert folder is not None, "a record is kept with a folder"
            fingerprint, recorded = _fingerprint((inputs, labels, masks)), record["batches"].get(str(index))
            stored = [len(done[(index, method)]) // len(names) for method in explainers if (index, method) in done]
            if (recorded is not None and recorded != fingerprint) or any(count != slots for count in stored):
                raise ValueError(f"batch {index} of the data differs from the one the evaluation in {folder} holds "
                                 f"(other images, labels or masks, another order, or {len(inputs)} images instead "
                                 "of the earlier run's); give the earlier data to resume it, or another folder.")
            if recorded is None and len(stored) < len(explainers):  # recorded before any of its rows is written
                record["batches"][str(index)] = fingerprint
                _write_record(folder, record)
        for method, explainer in explainers.items():
            if (index, method) in done:
                rows = done[(index, method)]
                per_batch[(index, method)] = {
                    name: torch.tensor([float(row["value"]) for row in rows if row["metric"] == name],
                                       dtype=torch.float64) for name in names}
                for row in rows:
                    seconds[method][row["metric"]] += float(row["seconds"]) / max(1, slots)
                continue
            if slots == 0:  # no instance detected in the batch: nothing to explain or score
                per_batch[(index, method)] = {name: torch.zeros(0, dtype=torch.float64) for name in names}
                continue
            per_batch[(index, method)] = _evaluate_batch(model, explainer, chosen, inputs, labels, masks,
                                                        seconds[method], folder, index, method, found)
        bar.update(len(inputs))


def _evaluate_batch(model: nn.Module, explainer: Explainer, chosen: list[Metric], inputs: Tensor,
                    labels: Optional[Tensor], masks: Optional[Tensor], seconds: dict[str, float],
                    folder: Optional[Path], index: int, method: str, found: Optional[Instances] = None
                    ) -> dict[str, Tensor]:
    """One batch explained by one method (for its labels, or the ``found`` instances) and every metric computed on
    its maps; their rows appended in one write. The batch goes to the model's device first (the first parameter's or
    buffer's; data are read on the CPU)."""
    device = _device_of(model)
    inputs = inputs.to(device)
    masks = None if masks is None else masks.to(device)
    if found is None:
        assert labels is not None, "labels are read for class explanations"
        labels = labels.to(device)
        explanation = explainer.explain(inputs, target=labels)
        slots = inputs.shape[0]
    else:
        explanation = explainer.explain(inputs, instances=found)
        labels, slots = found.classes.flatten(), found.present.numel()
    given = MetricInput(model, explainer, inputs, explanation, labels, masks, index)
    values: dict[str, Tensor] = {}
    spent: dict[str, float] = {}
    for metric in chosen:
        started = time.perf_counter()
        if not metric.applies(explanation):
            values[metric.name] = torch.full((slots,), math.nan, dtype=torch.float64)
            spent[metric.name] = 0.0
            continue
        values[metric.name] = torch.as_tensor(metric.compute(given)).detach().double().cpu().reshape(-1)
        spent[metric.name] = time.perf_counter() - started
        seconds[metric.name] += spent[metric.name]
        if values[metric.name].shape[0] != slots:
            raise RuntimeError(f"metric {metric.name} gave {values[metric.name].shape[0]} values for "
                               f"{slots} {'images' if found is None else 'instance slots'}.")
    if folder is not None:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if not (folder / VALUES_FILE).exists() or (folder / VALUES_FILE).stat().st_size == 0:
            writer.writerow(FIELDS)
        for name, batch_values in values.items():
            for position, value in enumerate(batch_values.tolist()):
                writer.writerow([index, method, name, position, repr(value), repr(spent[name])])
        with open(folder / VALUES_FILE, "ab") as values_file:
            append_rows(values_file, buffer.getvalue().encode("utf-8"))
    return values


def _write_summary(result: Evaluation, folder: Path) -> None:
    import matplotlib.pyplot as plt

    table = (f"{result.markdown()}\n\n{result.notes_markdown()}\n\nSeconds per image of each metric:\n\n"
             f"{result.cost_markdown()}\n")
    write_atomically(folder / "evaluation.md", lambda path: path.write_text(table, encoding="utf-8"))
    figure = result.figure()
    try:
        write_atomically(folder / "evaluation.png", lambda path: figure.savefig(path, dpi=120, format="png"))
    finally:
        plt.close(figure)
