"""Robustness: does the map stay put when the input moves a little?

Each metric but ``consistency`` explains copies of the images moved a little (noise, a translation)
and compares their maps with the images' own, all copies of all images through the explainer in
chunks of ``batch_size`` rows. Maps are the explainer's raw maps (``Explanation.raw_map_grid``), the
class explained at a copy is the image's (``target``, default its top class). Results are one value
per image, (N,) float on the model's device.

| function | range | better |
| --- | --- | --- |
| max_sensitivity, avg_sensitivity | [0, ∞) | lower |
| local_lipschitz_estimate | [0, ∞) | lower |
| relative_input_stability, relative_output_stability, relative_representation_stability | [0, ∞) | lower |
| continuity | [0, ∞) | lower |
| consistency | [0, 1] (NaN where no other image has the same explanation) | higher |

Noise is drawn from ``generator`` (a CPU ``torch.Generator``; default one seeded with 0, so the same
draws each call), one (C, H, W) draw per sample, shared by every image of the batch (as the tie order of
``explain.metrics._common.ranking`` and ROAD's noise are), so that an image scores the same alone as at any
place in any batch, from a generator in the same state (the draws are those a batch of one image gets); or
given as ``noise``: the (S, N, C, H, W) offsets added to the model batch (in model-input space), S samples
of each image. With
``keep_prediction``, copies whose top class differs from the image's (``decisions``: for a one-column output,
whose logit changes sign) are left out; an image with no copy left scores NaN. Refused with an error that says
what was wrong: callable or several targets, an explanation of other images, noise of another shape or with NaN,
options outside what they take.
``batch_size``: copies per explainer call; ``explain_options``: keyword arguments of every explainer call.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..core.capture import find_layers, model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import OutputSelector, Target
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec, prepare_inputs
from ..methods.base import Explainer
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
    run_model,
    short_repr,
)
from .axiomatic import Baseline, baseline_for
from .complexity import _wide

STABILITY_EPS = 1e-6
"""Agarwal et al.'s ε_min: the smallest denominator of the relative stabilities, and what a zero value
of the map, input or representation is replaced by when it divides."""


# ------------------------------------------------------------------ the images, their maps, their copies


@dataclass
class Reference:
    """The images and what the metrics compare copies with: batch (N, C, H, W) model input; maps (N, H, W)
    raw maps; classes (N,) the classes explained; logits (N, K) and representations (N, D), when asked for."""

    batch: Tensor
    maps: Tensor
    classes: Tensor
    logits: Optional[Tensor] = None
    representations: Optional[Tensor] = None


@dataclass
class Copies:
    """One chunk of R perturbed copies: samples and images (R,) which sample of which image each row is;
    inputs (R, C, H, W); maps (R, H, W) raw maps for the image's class; logits (R, K) and representations
    (R, D), when asked for."""

    samples: Tensor
    images: Tensor
    inputs: Tensor
    maps: Tensor
    logits: Optional[Tensor] = None
    representations: Optional[Tensor] = None


Perturb = Callable[[Tensor, Tensor], Tensor]
"""(samples, images) (R,) each → (R, C, H, W) the copies: sample ``samples[r]`` of image ``images[r]``."""


def explained_reference(explainer: Explainer, inputs: Inputs, target: Target, explanation: Optional[Explanation],
                        options: Mapping[str, Any], metric: str) -> Reference:
    """The model batch, its raw maps and classes: ``explanation``'s when given (of these images by this
    explainer, one class each), else explained here for ``target``."""
    model = explainer.model
    batch = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model),
                           channels=model_input_channels(model)).batch
    if explanation is None:
        explained = explainer.explain(batch, target, **options)
    elif not isinstance(explanation, Explanation):
        raise TypeError(f"explanation must be an Explanation (of these images by this explainer); got "
                        f"{short_repr(explanation)}.")
    elif target is not None:
        raise ValueError("give target or explanation, not both: the explanation's classes are the ones explained.")
    else:
        explained = explanation
        check_count(len(explained), "explained images", batch.shape[0], "images")
        if explained.method != explainer.method_name:
            raise ValueError(f"the explanation was made by {explained.method}, not by this explainer "
                             f"({explainer.method_name}): give this explainer's explanation of these images, or none.")
    if explained.class_indices is None or explained.class_indices.shape[1] != 1:
        raise ValueError(f"{metric} explains one class per image: give a class (or none, for the top class) per "
                         "image, not a callable or several targets.")
    if explained.raw_map_grid.shape[-2:] != batch.shape[-2:]:
        raise ValueError(f"the explanation's maps are {tuple(explained.raw_map_grid.shape[-2:])}, the images "
                         f"{tuple(batch.shape[-2:])}: give the explanation of these images.")
    if explanation is not None:
        _check_scores_of_this_model(explainer, batch, explained, options)
    return Reference(batch=batch, maps=explained.raw_map_grid[:, 0].to(batch.device),
                     classes=explained.class_indices[:, 0].to(batch.device))


def _check_scores_of_this_model(explainer: Explainer, batch: Tensor, explained: Explanation,
                                options: Mapping[str, Any]) -> None:
    """Refuse an explanation whose scores are not this model's outputs for these images (another model's, or of
    other images), from one forward with the model's other inputs of ``options``. Skipped for methods whose scores
    are not the model's outputs (Finer-CAM's contrastive scores)."""
    if not explainer.scores_are_outputs:
        return
    assert explained.class_indices is not None, "checked by the caller"
    outputs = forward_outputs(explainer.model, batch, explainer.output, options=options, count=batch.shape[0])[0]
    classes = explained.class_indices[:, :1].to(outputs.device)
    expected, given = outputs.gather(1, classes).float(), explained.scores[:, :1].to(outputs.device).float()
    if not torch.allclose(given, expected, rtol=2e-2, atol=2e-2 * max(1.0, float(expected.abs().max()))):
        raise ValueError(f"the explanation's scores ({given.flatten()[:4].tolist()}) are not this model's outputs for "
                         f"these images ({expected.flatten()[:4].tolist()}): give this explainer's explanation of "
                         "these images, or none.")


def forward_outputs(model: nn.Module, inputs: Tensor, output: OutputSelector,
                    layers: Sequence[tuple[str, nn.Module]] = (), options: Optional[Mapping[str, Any]] = None,
                    count: Optional[int] = None, images: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(R, K) scores the model outputs for ``inputs`` (``model_scores``) and, when ``layers`` are given,
    (R, D) their outputs flattened and concatenated, in the order they ran; no graph is built. options, count,
    images: the model's other inputs as ``explain`` takes them, for ``count`` images, row r a copy of image
    ``images[r]`` (``run_model``)."""
    recorded: list[Tensor] = []

    def record(name: str, result: object) -> None:
        if not isinstance(result, Tensor):
            raise ValueError(f"the layer {name!r} returns {type(result).__name__}, not a tensor: name a layer whose "
                             "output is one tensor.")
        recorded.append(result.detach().reshape(result.shape[0], -1).clone())  # before an in-place op changes it

    handles = [module.register_forward_hook(lambda module, args, result, name=name: record(name, result))
               for name, module in layers]
    try:
        with torch.no_grad(), preserved_model_state(model):
            scores = model_scores(run_model(model, inputs, options or {}, inputs.shape[0] if count is None else count,
                                            images), output, inputs.shape[0])
    finally:
        for handle in handles:
            handle.remove()
    if layers and not recorded:
        names = ", ".join(repr(name) for name, _ in layers)
        raise ValueError(f"the layer{'s' if len(layers) > 1 else ''} {names} never ran in the model's forward: name "
                         "a layer the forward runs.")
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"the model's output (after the explainer's output selector) must be (N, classes) scores; "
                         f"got {short_repr(scores)}.")
    return scores.float(), (torch.cat(recorded, dim=1) if layers else None)


class NoiseSamples:
    """Additive noise for S samples of N images: the given (S, N, C, H, W) ``noise``, or ``draw(generator)``
    called once per sample in order (its (C, H, W) draw, shared by every image, times the image's ``scale``
    where given), so the draws depend neither on the chunking nor on an image's place in the batch or the
    other images. scale: (N,) each image's factor on the drawn noise (not on given noise)."""

    def __init__(self, noise: Optional[Tensor], draw: Callable[[torch.Generator], Tensor],
                 generator: torch.Generator, scale: Optional[Tensor] = None) -> None:
        self.noise, self.draw, self.generator, self.scale = noise, draw, generator, scale
        self.drawn: dict[int, Tensor] = {}

    def rows(self, samples: Tensor, images: Tensor) -> Tensor:
        """(R, C, H, W) noise of sample ``samples[r]`` of image ``images[r]`` (samples in increasing order)."""
        if self.noise is not None:
            return self.noise[samples.to(self.noise.device), images.to(self.noise.device)]
        first, last = int(samples[0]), int(samples[-1])
        for sample in [sample for sample in self.drawn if sample < first]:
            del self.drawn[sample]
        for sample in range(max(self.drawn, default=first - 1) + 1, last + 1):
            self.drawn[sample] = self.draw(self.generator)
        drawn = torch.stack([self.drawn[int(sample)] for sample in samples])
        if self.scale is None:
            return drawn
        return drawn * self.scale.to(drawn.device, drawn.dtype)[images.to(drawn.device)].view(-1, 1, 1, 1)


def check_noise(noise: object, samples: Optional[int], batch: Tensor) -> tuple[Optional[Tensor], int]:
    """(the given noise, where it is, or None; the number of samples S), after refusing noise that is not
    (S, N, C, H, W) finite offsets or whose S disagrees with ``samples``."""
    if noise is None:
        return None, 50 if samples is None else int_option("samples", samples, 1)
    offsets = as_tensor(noise, "noise must be a (S, N, C, H, W) tensor of offsets added to the model batch")
    if offsets.dim() != 5 or tuple(offsets.shape[1:]) != tuple(batch.shape) or offsets.shape[0] == 0:
        raise ValueError(f"noise must be (S, N, C, H, W) = (S, {', '.join(map(str, batch.shape))}) offsets, S ≥ 1 "
                         f"samples of each image of the model batch; got shape {tuple(offsets.shape)}.")
    if not offsets.is_floating_point():
        raise ValueError(f"noise must be floating-point offsets; got dtype {offsets.dtype}.")
    check_finite(offsets.flatten(0, 1), "noise row", "give finite offsets (row s · N + n is sample s of image n).")
    if samples is not None and int_option("samples", samples, 1) != offsets.shape[0]:
        raise ValueError(f"samples = {samples} but the noise holds {offsets.shape[0]} samples of each image: give one "
                         "(the noise's first dimension is the number of samples).")
    return offsets, offsets.shape[0]


def add_noise(batch: Tensor, noise: Tensor) -> Tensor:
    """batch + noise, added in float64 (float32 on Apple's MPS) and rounded once to the batch's dtype."""
    return (_wide(batch) + noise.to(batch.device, _wide(batch).dtype)).to(batch.dtype)


def over_copies(
    explainer: Explainer,
    reference: Reference,
    count: int,
    perturb: Perturb,
    measure: Callable[[Copies], Tensor],
    *,
    batch_size: int,
    options: Mapping[str, Any],
    keep_prediction: bool,
    logits: bool = False,
    layers: Sequence[tuple[str, nn.Module]] = (),
) -> Tensor:
    """(S, N) float64 ``measure`` of each of ``count`` = S copies of each image, ``perturb(samples, images)``
    making the copies; NaN where ``keep_prediction`` and the copy's top class is not the image's. Copies go
    through the explainer (and, when logits, layers or the prediction are needed, one forward without a
    graph) ``batch_size`` rows at a time, sample-major."""
    model = explainer.model
    images_count = reference.batch.shape[0]
    needs_forward = logits or bool(layers) or keep_prediction
    if needs_forward:
        reference.logits, reference.representations = forward_outputs(model, reference.batch, explainer.output, layers,
                                                                      options, images_count)
    values = torch.empty(count * images_count, dtype=torch.float64, device=reference.batch.device)
    for start in range(0, count * images_count, batch_size):
        rows = torch.arange(start, min(start + batch_size, count * images_count), device=reference.batch.device)
        samples, images = rows // images_count, rows % images_count
        inputs = perturb(samples, images)
        maps = explainer.explain(inputs, reference.classes[images], **options).raw_map_grid[:, 0].to(rows.device)
        copies = Copies(samples=samples, images=images, inputs=inputs, maps=maps)
        if needs_forward:
            copies.logits, copies.representations = forward_outputs(model, inputs, explainer.output, layers, options,
                                                                    images_count, images)
        measured = measure(copies).to(values.dtype)
        if keep_prediction:
            assert copies.logits is not None and reference.logits is not None
            changed = decisions(copies.logits) != decisions(reference.logits)[images]
            measured = torch.where(changed, torch.nan, measured)
        values[rows] = measured
    return values.view(count, images_count)


def largest(values: Tensor) -> Tensor:
    """(S, N) → (N,) float32: the largest value over the samples that are not NaN, NaN where none is."""
    kept = ~values.isnan()
    top = torch.where(kept, values, -torch.inf).amax(dim=0)
    return torch.where(kept.any(dim=0), top, torch.nan).float()


def average(values: Tensor) -> Tensor:
    """(S, N) → (N,) float32: the mean over the samples that are not NaN, NaN where none is."""
    return values.nanmean(dim=0).float()


def norms(values: Tensor, order: float = 2.0) -> Tensor:
    """(R, ...) → (R,) float64 norm of each row (computed in float64; float32 on Apple's MPS)."""
    return torch.linalg.vector_norm(_wide(values.reshape(values.shape[0], -1)), ord=order, dim=1)


def relative_change(before: Tensor, after: Tensor) -> Tensor:
    """(before − after) / before elementwise, a zero ``before`` replaced by ε_min (Agarwal et al. 2022)."""
    before, after = _wide(before), _wide(after)
    return (before - after) / torch.where(before == 0, STABILITY_EPS, before)


def _common_options(batch_size: object, keep_prediction: object, generator: object) -> None:
    int_option("batch_size", batch_size, 1)
    bool_option("keep_prediction", keep_prediction)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (on the CPU); got {short_repr(generator)}.")


def noisy_copies(reference: Reference, noise: object, samples: Optional[int], generator: Optional[torch.Generator],
                 draw: Callable[[torch.Generator, torch.Size], Tensor]) -> tuple[int, Perturb]:
    """(S, perturb) for ``over_copies``: each copy is its image plus its noise row (given, or drawn by
    ``draw(generator, (C, H, W))`` one sample at a time, shared by the images: ``NoiseSamples``)."""
    given, count = check_noise(noise, samples, reference.batch)
    source = NoiseSamples(given, lambda generator: draw(generator, reference.batch.shape[1:]),
                          generator if generator is not None else torch.Generator().manual_seed(0))

    def perturb(sample_rows: Tensor, image_rows: Tensor) -> Tensor:
        return add_noise(reference.batch[image_rows], source.rows(sample_rows, image_rows))
    return count, perturb


def uniform_noise(radius: float) -> Callable[[torch.Generator, torch.Size], Tensor]:
    """Draws offsets uniform in [−radius, radius] on the CPU generator given."""
    return lambda generator, shape: (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * radius


# ------------------------------------------------------------------ sensitivity (Yeh et al. 2019)


def _sensitivities(explainer: Explainer, inputs: Inputs, target: Target, samples: Optional[int], radius: float,
                   noise: Optional[Tensor], generator: Optional[torch.Generator], relative: bool,
                   keep_prediction: bool, explanation: Optional[Explanation], batch_size: int,
                   explain_options: Optional[Mapping[str, Any]], metric: str) -> Tensor:
    """(S, N) ‖Φ(x + δ) − Φ(x)‖ (/ ‖Φ(x)‖ when relative) of each noise sample δ."""
    radius = number_option("radius", radius)
    relative = bool_option("relative", relative)
    _common_options(batch_size, keep_prediction, generator)
    options = dict(explain_options or {})
    reference = explained_reference(explainer, inputs, target, explanation, options, metric)
    count, perturb = noisy_copies(reference, noise, samples, generator, uniform_noise(radius))
    scale = norms(reference.maps) if relative else torch.ones(reference.maps.shape[0], dtype=torch.float64)
    scale = scale.to(reference.batch.device)

    def measure(copies: Copies) -> Tensor:
        return norms(copies.maps - reference.maps[copies.images]) / scale[copies.images]
    return over_copies(explainer, reference, count, perturb, measure, batch_size=batch_size, options=options,
                       keep_prediction=keep_prediction)


def max_sensitivity(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: Optional[int] = None,
    radius: float = 0.2,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    relative: bool = True,
    keep_prediction: bool = False,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Max-sensitivity (Yeh et al. 2019): the largest change of the map over S copies of each image with
    noise δ uniform in [−radius, radius] on every input value, ‖Φ(x + δ) − Φ(x)‖₂ / ‖Φ(x)‖₂. (N,) in
    [0, ∞), lower is better; 0 for a map that does not move. ``relative=False`` leaves out the division,
    as the paper's definition (the map's own units then count); NaN (inf) where the map is all zeros.

    samples: S, default 50 (Quantus 0.6: 200), or the noise's S. radius: in model-input units (Quantus's
    ``lower_bound``, 0.2). noise, generator, keep_prediction: see the module. explanation: the images'
    explanation by this explainer, when already computed (``target`` is then left out).
    Costs S · N explained copies, ``batch_size`` per explainer call.
    """
    return largest(_sensitivities(explainer, inputs, target, samples, radius, noise, generator, relative,
                                  keep_prediction, explanation, batch_size, explain_options, "max-sensitivity"))


def avg_sensitivity(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: Optional[int] = None,
    radius: float = 0.2,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    relative: bool = True,
    keep_prediction: bool = False,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Average sensitivity (Yeh et al. 2019): as ``max_sensitivity``, the mean over the S copies instead
    of the largest. (N,) in [0, ∞), lower is better."""
    return average(_sensitivities(explainer, inputs, target, samples, radius, noise, generator, relative,
                                  keep_prediction, explanation, batch_size, explain_options, "average sensitivity"))


# ------------------------------------------------------------------ local Lipschitz estimate


def local_lipschitz_estimate(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: Optional[int] = None,
    std: float = 0.1,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep_prediction: bool = False,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Local Lipschitz estimate (Alvarez-Melis and Jaakkola 2018): the largest ‖Φ(x) − Φ(x')‖₂ / ‖x − x'‖₂
    over S copies x' = x + δ of each image, δ Gaussian of standard deviation ``std`` (model-input units) on
    every input value. (N,) in [0, ∞) in map units per input unit, lower is better.

    samples: S, default 50 (Quantus 0.6: 200), or the noise's S. noise, generator, keep_prediction,
    explanation: as ``max_sensitivity``. Quantus 0.6 divides the maps by the batch's peak by default
    (normalise=True): give it normalise=False to compute this.
    """
    std = number_option("std", std, allow_minimum=False)
    _common_options(batch_size, keep_prediction, generator)
    options = dict(explain_options or {})
    reference = explained_reference(explainer, inputs, target, explanation, options, "the local Lipschitz estimate")
    count, perturb = noisy_copies(reference, noise, samples, generator,
                                  lambda generator, shape: torch.randn(shape, generator=generator,
                                                                       dtype=torch.float64) * std)

    def measure(copies: Copies) -> Tensor:
        moved = copies.inputs - reference.batch[copies.images]
        return norms(copies.maps - reference.maps[copies.images]) / norms(moved)
    return largest(over_copies(explainer, reference, count, perturb, measure, batch_size=batch_size, options=options,
                               keep_prediction=keep_prediction))


# ------------------------------------------------------------------ relative stability (Agarwal et al. 2022)


def _relative_stability(explainer: Explainer, inputs: Inputs, target: Target, samples: Optional[int], radius: float,
                        noise: Optional[Tensor], generator: Optional[torch.Generator], keep_prediction: bool,
                        explanation: Optional[Explanation], batch_size: int,
                        explain_options: Optional[Mapping[str, Any]], metric: str,
                        denominator: Callable[[Reference, Copies], Tensor], logits: bool = False,
                        layers: Sequence[tuple[str, nn.Module]] = ()) -> Tensor:
    """max over the copies of ‖(e_x − e_x') / e_x‖₂ / max(denominator, ε_min)."""
    radius = number_option("radius", radius, allow_minimum=False)
    _common_options(batch_size, keep_prediction, generator)
    options = dict(explain_options or {})
    reference = explained_reference(explainer, inputs, target, explanation, options, metric)
    count, perturb = noisy_copies(reference, noise, samples, generator, uniform_noise(radius))

    def measure(copies: Copies) -> Tensor:
        change = norms(relative_change(reference.maps[copies.images], copies.maps))
        return change / denominator(reference, copies).clamp_min(STABILITY_EPS)
    return largest(over_copies(explainer, reference, count, perturb, measure, batch_size=batch_size, options=options,
                               keep_prediction=keep_prediction, logits=logits, layers=layers))


def relative_input_stability(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: Optional[int] = None,
    radius: float = 0.2,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep_prediction: bool = True,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Relative input stability (Agarwal et al. 2022): the largest, over S noisy copies x' of each image,
    ‖(e_x − e_x') / e_x‖₂ / max(‖(x − x') / x‖₂, ε_min), elementwise divisions, a zero divisor replaced by
    ε_min = 1e-6. (N,) in [0, ∞), lower is better.

    samples: S, default 50 (Quantus 0.6: 200), or the noise's S. radius: the noise δ is uniform in
        [−radius, radius] on every input value (Quantus 0.6 draws it in [0.02, 0.2], one-sided: give its
        draws as ``noise`` to compare). keep_prediction (default True, as the paper's neighbourhood): copies
        whose top class changed are left out, where Quantus 0.6 returns NaN for the image. noise, generator,
        explanation: as ``max_sensitivity``.
    """
    return _relative_stability(explainer, inputs, target, samples, radius, noise, generator, keep_prediction,
                               explanation, batch_size, explain_options, "relative input stability",
                               lambda reference, copies: norms(relative_change(reference.batch[copies.images],
                                                                               copies.inputs)))


def relative_output_stability(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: Optional[int] = None,
    radius: float = 0.2,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep_prediction: bool = True,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Relative output stability (Agarwal et al. 2022): the largest, over S noisy copies x' of each image,
    ‖(e_x − e_x') / e_x‖₂ / max(‖h(x) − h(x')‖₂, ε_min), h the model's output scores (logits).
    (N,) in [0, ∞), lower is better. Options as ``relative_input_stability``. Costs one forward without a
    graph per copy, besides its explanation.
    """
    def denominator(reference: Reference, copies: Copies) -> Tensor:
        assert reference.logits is not None and copies.logits is not None
        return norms(reference.logits[copies.images] - copies.logits)
    return _relative_stability(explainer, inputs, target, samples, radius, noise, generator, keep_prediction,
                               explanation, batch_size, explain_options, "relative output stability", denominator,
                               logits=True)


def relative_representation_stability(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    layers: Union[str, Sequence[str]],
    samples: Optional[int] = None,
    radius: float = 0.2,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep_prediction: bool = True,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Relative representation stability (Agarwal et al. 2022): the largest, over S noisy copies x' of each
    image, ‖(e_x − e_x') / e_x‖₂ / max(‖(L_x − L_x') / L_x‖₂, ε_min), L the outputs of ``layers`` (a name,
    glob or list, as ``explain.core.capture.find_layers``), flattened and concatenated. (N,) in [0, ∞), lower is
    better. Options as ``relative_input_stability``. Costs one forward without a graph per copy, besides
    its explanation. (Quantus 0.6 records every layer by default, and a layer's output after a following
    in-place ReLU has changed it.)
    """
    found = find_layers(explainer.model, [layers] if isinstance(layers, str) else list(layers))

    def denominator(reference: Reference, copies: Copies) -> Tensor:
        assert reference.representations is not None and copies.representations is not None
        return norms(relative_change(reference.representations[copies.images], copies.representations))
    return _relative_stability(explainer, inputs, target, samples, radius, noise, generator, keep_prediction,
                               explanation, batch_size, explain_options, "relative representation stability",
                               denominator, layers=found)


# ------------------------------------------------------------------ continuity (Montavon et al. 2018)

DIRECTIONS = ("x", "y")


def quantus_shifts(size: int, steps: int = 28) -> list[int]:
    """The translations Quantus 0.6's Continuity runs for an image ``size`` pixels wide: −size + k · d for
    k = 1 … steps, d = (2 · size + 1) // steps, without 0 (the image itself)."""
    step = (2 * size + 1) // steps
    return list(dict.fromkeys(shift for shift in (-size + step * k for k in range(1, steps + 1)) if shift != 0))


def translate(images: Tensor, shifts: Tensor, fill: Tensor, direction: str) -> Tensor:
    """(R, C, H, W) images moved by ``shifts[r]`` pixels (positive: right for "x", down for "y"), the
    uncovered part taken from ``fill`` (R, C, H, W)."""
    axis = 3 if direction == "x" else 2
    size = images.shape[axis]
    positions = torch.arange(size, device=images.device)
    source = positions.view(1, -1) - shifts.view(-1, 1)  # (R, size): where each output pixel comes from
    inside = (source >= 0) & (source < size)
    shape = [images.shape[0], 1, 1, 1]
    shape[axis] = size
    index = source.clamp(0, size - 1).view(shape).expand_as(images)
    moved = images.gather(axis, index)
    return torch.where(inside.view(shape), moved, fill)


def continuity(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    shifts: Optional[Sequence[int]] = None,
    direction: str = "x",
    fill: Baseline = "minimum",
    keep_prediction: bool = False,
    explanation: Optional[Explanation] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """Continuity (Montavon et al. 2018): the largest ‖Φ(x) − Φ(x')‖₁ / ‖x − x'‖₂ over translations x' of
    each image. (N,) in [0, ∞) in map units per input unit, lower is better.

    shifts: the translations in pixels, non-zero (positive: right for direction "x", down for "y"); default
        those of Quantus 0.6 for the image's size (``quantus_shifts``: 28 steps across −W … W, 0 left out).
    fill: what the uncovered pixels become: "minimum" (default; each image's smallest value, Quantus's
        "black"), "maximum", "mean", "zeros", a number or a tensor (see ``explain.metrics.axiomatic``).
    keep_prediction: translations that change the image's top class are left out (Quantus 0.6 compares
        with the class explained instead, and returns NaN where any did). Quantus 0.6 takes |map| / the
        batch's peak by default (abs, normalise): give it abs=False, normalise=False to compute this.
    """
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'x' (along the rows) or 'y' (along the columns); got "
                         f"{short_repr(direction)}.")
    _common_options(batch_size, keep_prediction, None)
    options = dict(explain_options or {})
    reference = explained_reference(explainer, inputs, target, explanation, options, "continuity")
    size = reference.batch.shape[3 if direction == "x" else 2]
    if shifts is None:
        shifts = quantus_shifts(size)
    if isinstance(shifts, (str, bytes)) or not isinstance(shifts, Sequence) or not shifts or not all(
            isinstance(shift, numbers.Integral) and not isinstance(shift, bool) and shift != 0 for shift in shifts):
        raise ValueError(f"shifts must be a non-empty list of non-zero whole pixel translations; got "
                         f"{short_repr(shifts)}.")
    moves = torch.tensor([int(shift) for shift in shifts], device=reference.batch.device)
    filled = baseline_for(reference.batch, fill)

    def perturb(samples: Tensor, images: Tensor) -> Tensor:
        return translate(reference.batch[images], moves[samples], filled[images], direction)

    def measure(copies: Copies) -> Tensor:
        moved = copies.inputs - reference.batch[copies.images]
        return norms(copies.maps - reference.maps[copies.images], 1.0) / norms(moved)
    return largest(over_copies(explainer, reference, len(moves), perturb, measure, batch_size=batch_size,
                               options=options, keep_prediction=keep_prediction))


# ------------------------------------------------------------------ consistency (Dasgupta et al. 2022)

Discretise = Callable[[Tensor], Tensor]
"""(N, H, W) maps → (N,) or (N, D) discrete explanations: images whose rows are equal have the same one."""


def top_pixels(maps: Tensor, count: int) -> Tensor:
    """(N, H, W) maps → (N, count) the flat indices of each map's ``count`` largest |values|, ascending
    (a set: the order among them does not count; ties at the boundary go to the lower index)."""
    magnitude = maps.abs().reshape(maps.shape[0], -1)
    order = torch.argsort(-magnitude, dim=1, stable=True)
    return order[:, :count].sort(dim=1).values


def consistency(
    model: nn.Module,
    inputs: Inputs,
    maps: MapsLike,
    *,
    top: int = 5,
    discretise: Optional[Discretise] = None,
    batch_size: int = 64,
    preprocess: PreprocessSpec = None,
    output: OutputSelector = None,
) -> Tensor:
    """Consistency (Dasgupta et al. 2022): for each image, the share of the other images with the same
    discrete explanation that the model also gives the same top class (``decisions``: for a one-column output, the
    same side of 0). (N,) in [0, 1], higher is better; NaN where no other image has the same explanation
    (Quantus 0.6 gives 0 there).

    top: an explanation is the set of its map's ``top`` most relevant pixels (largest |map|). discretise: a
        callable (N, H, W) maps → (N,) or (N, D) discrete explanations, instead (equal rows: the same one).
    The images are compared among those given: pass many, with the same classes represented.
    """
    int_option("batch_size", batch_size, 1)
    heat = as_maps(maps)
    batch = model_inputs(model, inputs, preprocess)
    check_count(heat.shape[0], "maps", batch.shape[0], "images")
    if discretise is None:
        labels = top_pixels(heat, int_option("top", top, 1))
    elif not callable(discretise):
        raise TypeError(f"discretise must be a callable (N, H, W) maps → (N,) or (N, D) labels; got "
                        f"{short_repr(discretise)}.")
    else:
        labels = discretise(heat)
        if not isinstance(labels, Tensor) or labels.dim() not in (1, 2) or labels.shape[0] != heat.shape[0]:
            raise ValueError(f"discretise must return (N,) or (N, D) labels, one row per map; it returned "
                             f"{short_repr(labels)}.")
    labels = labels.reshape(labels.shape[0], -1).to(batch.device)
    predictions = torch.cat([decisions(forward_outputs(model, batch[start: start + batch_size], output)[0])
                             for start in range(0, batch.shape[0], batch_size)])
    others = ~torch.eye(batch.shape[0], dtype=torch.bool, device=batch.device)
    same_explanation = (labels[:, None, :] == labels[None, :, :]).all(dim=2) & others
    same_prediction = predictions[:, None] == predictions[None, :]
    peers = same_explanation.sum(dim=1)
    agreeing = (same_explanation & same_prediction).sum(dim=1)
    return torch.where(peers > 0, agreeing / peers.clamp_min(1), torch.nan).float()


__all__ = [
    "avg_sensitivity",
    "consistency",
    "continuity",
    "local_lipschitz_estimate",
    "max_sensitivity",
    "quantus_shifts",
    "relative_input_stability",
    "relative_output_stability",
    "relative_representation_stability",
    "top_pixels",
]

