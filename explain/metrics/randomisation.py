"""Randomisation: does the map change when what it should depend on changes?

``random_logit`` (Sixt et al. 2020) explains each image for its class and for another class
drawn at random, and measures how alike the two maps are: a method whose map hardly depends
on the class explained (modified backpropagation rules often reconstruct the image) scores
high. ``cascading_randomization`` (in ``explain.metrics.sanity``) randomises the model instead, and
so do Hedström et al.'s repairs of it (2023): ``efficient_mprt`` compares the complexity of the maps
before and after randomising the whole model, ``smooth_mprt`` runs the cascading test on maps
denoised over noisy copies of the images.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ..core.capture import model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import Target
from ..io.explanation import Explanation
from ..io.inputs import Inputs, prepare_inputs
from ..methods.base import Explainer
from ..methods.options import int_option, number_option
from ._common import as_tensor, check_count, model_scores, run_model, short_repr
from .complexity import _wide
from .robustness import NoiseSamples, Perturb, Reference, add_noise, check_noise, explained_reference
from .sanity import ORDERS, RandomizationStage, Randomize, _magnitude, default_stages, randomized_copies, spearman

Similarity = Union[str, Callable[[Tensor, Tensor], Tensor]]
"""How alike two sets of (N, H, W) maps are: "ssim", "spearman" or a callable (first, second) → (N,)."""

SIMILARITIES = ("ssim", "spearman")


@dataclass
class RandomLogit:
    """similarity: (N,) how alike each image's map for its class and for the other class are, lower is
    better (the map depends on the class); classes: (N,) the classes explained first; other_classes:
    (N,) the classes they were compared with."""

    similarity: Tensor
    classes: Tensor
    other_classes: Tensor


def _gaussian_blur_valid(values: Tensor, window: int, sigma: float) -> Tensor:
    """(..., H, W) → (..., H − window + 1, W − window + 1): a normalised Gaussian window, no padding, applied
    along rows then columns as ``window`` shifted, weighted slices (exact, and much faster on the CPU in
    float64 than a 2-D convolution)."""
    offsets = torch.arange(window, dtype=values.dtype, device=values.device) - window // 2
    gaussian = torch.exp(-(offsets**2) / (2 * sigma**2))
    weights = (gaussian / gaussian.sum()).tolist()
    height, width = values.shape[-2:]
    rows = sum(weight * values[..., k: height - window + 1 + k, :] for k, weight in enumerate(weights))
    assert isinstance(rows, Tensor)
    blurred = sum(weight * rows[..., k: width - window + 1 + k] for k, weight in enumerate(weights))
    assert isinstance(blurred, Tensor)
    return blurred


def _ssim(first: Tensor, second: Tensor, window: int = 11, sigma: float = 1.5) -> Tensor:
    """``explain.metrics.ssim`` of each pair of (N, H, W) maps in [0, 1] (equal to it, tested), computed
    with a separable Gaussian window on the maps' device: 10× faster on the CPU at 224 px."""
    wide = torch.float64 if first.device.type != "mps" else torch.float32
    x, y = first.to(wide), second.to(wide)
    window = min(window, x.shape[-1], x.shape[-2])
    window -= 1 - window % 2  # odd, and no larger than the maps
    means = _gaussian_blur_valid(torch.stack([x, y, x * x, y * y, x * y]), window, sigma)
    mean_x, mean_y = means[0], means[1]
    var_x, var_y = means[2] - mean_x**2, means[3] - mean_y**2
    covariance = means[4] - mean_x * mean_y
    c1, c2 = 0.01**2, 0.03**2
    index = ((2 * mean_x * mean_y + c1) * (2 * covariance + c2)) / ((mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2))
    return index.mean(dim=(1, 2)).float()


def _check_other_classes(other_classes: object, classes: Tensor, class_count: int) -> Tensor:
    others = as_tensor(other_classes, "other_classes must be a (N,) tensor or list of class indices")
    if others.dim() != 1 or others.is_floating_point() or others.is_complex() or others.dtype == torch.bool:
        raise ValueError(f"other_classes must be (N,) integer class indices, one per image; got "
                         f"{short_repr(other_classes)}.")
    check_count(others.shape[0], "other classes", classes.shape[0], "images")
    others = others.to(classes.device, torch.long)
    outside = (others < 0) | (others >= class_count)
    if bool(outside.any()):
        raise ValueError(f"other_classes {others[outside].tolist()[:8]} lie outside the model's {class_count} "
                         f"classes (0 … {class_count - 1}).")
    same = others == classes
    if bool(same.any()):
        indices = same.nonzero()[:, 0].tolist()
        raise ValueError(f"other_classes repeats the class explained for image{'s' if len(indices) > 1 else ''} "
                         f"{', '.join(map(str, indices[:8]))}: the other class must differ from it.")
    return others


def random_logit(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    other_classes: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    similarity: Similarity = "ssim",
    explanation: Optional[Explanation] = None,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> RandomLogit:
    """Random logit test (Sixt et al. 2020): the similarity of each image's map for its class (``target``,
    default the top class) and for another class, the raw maps' magnitudes compared.

    other_classes: (N,) the other class of each image; default: drawn uniformly among the model's other
        classes from ``generator`` (a CPU ``torch.Generator``; default one seeded with 0, so the same
        classes each call; seed your own for other draws). One draw u in 0 … K − 2 (K classes) is shared
        by every image of the batch (as the tie order of ``explain.metrics._common.ranking`` and ROAD's
        noise are): image n's other class is u, or u + 1 where u ≥ its class, uniform over the classes
        other than its own, and the one it gets alone, at any place in any batch, from a generator in the
        same state.
    similarity: "ssim" (default: SSIM, Gaussian window of σ 1.5, of |map| / max |map|, in [-1, 1]; as
        ``explain.metrics.ssim``), "spearman" (rank correlation of |map|, in [-1, 1]) or a callable
        (first, second) → (N,) given the raw (N, H, W) maps.
    explanation: the images' explanation for their classes by this explainer, when already computed (one
        class per image; ``target`` is then left out): only the other classes are explained.
    """
    if isinstance(similarity, str) and similarity not in SIMILARITIES or not (
            isinstance(similarity, str) or callable(similarity)):
        raise ValueError(f"similarity must be 'ssim', 'spearman' or a callable (first maps, second maps) → (N,); got "
                         f"{short_repr(similarity)}.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (on the CPU); got {short_repr(generator)}.")
    options = dict(explain_options or {})
    model = explainer.model
    reference = explained_reference(explainer, inputs, target, explanation, options, "the random logit test")
    batch, classes = reference.batch, reference.classes
    with torch.no_grad(), preserved_model_state(model):
        class_count = model_scores(run_model(model, batch, options, batch.shape[0]), explainer.output,
                                   batch.shape[0]).shape[1]
    if class_count < 2:
        raise ValueError("the model has a single output class: there is no other class to compare with.")
    if other_classes is None:
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        offset = torch.randint(0, class_count - 1, (1,), generator=generator).to(batch.device)  # shared by the images
        others = offset + (offset >= classes).long()  # uniform over the classes other than the image's own
    else:
        others = _check_other_classes(other_classes, classes, class_count)
    second = explainer.explain(batch, others, **options)
    first_maps, second_maps = reference.maps, second.raw_map_grid[:, 0]
    if callable(similarity):
        values = similarity(first_maps, second_maps)
        if not isinstance(values, Tensor) or tuple(values.shape) != (classes.shape[0],):
            raise ValueError(f"the similarity callable must return a (N,) tensor, one value per image; it returned "
                             f"{short_repr(values)}.")
    elif similarity == "ssim":
        values = _ssim(_magnitude(first_maps), _magnitude(second_maps))
    else:
        values = spearman(first_maps.abs(), second_maps.abs())
    return RandomLogit(similarity=values.to(batch.device), classes=classes, other_classes=others)


# ------------------------------------------------------------------ eMPRT and sMPRT (Hedström et al. 2023)


def histogram_counts(values: Tensor, bins: int) -> Tensor:
    """(N, P) values → (N, bins) long counts of each row in ``bins`` equal bins from its smallest to its
    largest value, the last bin closed (a constant row: one bin a unit wide around it), as ``numpy.histogram``
    computes them in the values' own precision, edge cases included (tested)."""
    low, high = values.amin(dim=1, keepdim=True), values.amax(dim=1, keepdim=True)
    constant = low == high
    low, high = torch.where(constant, low - 0.5, low), torch.where(constant, high + 0.5, high)
    edges = torch.arange(bins + 1, dtype=values.dtype, device=values.device) * ((high - low) / bins) + low
    edges[:, -1] = high[:, 0]
    index = ((values - low) / (high - low) * bins).long()
    index = torch.where(index == bins, bins - 1, index)
    index = index - (values < edges.gather(1, index)).long()  # the division can land a value one bin off
    index = index + ((values >= edges.gather(1, index + 1)) & (index != bins - 1)).long()
    return torch.zeros(values.shape[0], bins, dtype=torch.long, device=values.device).scatter_add_(
        1, index, torch.ones_like(index))


def discrete_entropy(maps: Tensor, bins: int = 100) -> Tensor:
    """(N, H, W) maps → (N,) float64 Shannon entropy (nats) of the histogram of each map's values in
    ``bins`` equal bins (``histogram_counts``), in [0, ln bins]: 0 for a constant map."""
    counts = histogram_counts(maps.reshape(maps.shape[0], -1), bins)
    shares = _wide(counts) / counts.sum(dim=1, keepdim=True)
    plogp = torch.where(shares > 0, shares * shares.clamp_min(1e-300).log(), 0.0).sum(dim=1)
    return 0.0 - plogp  # 0 − x: +0 for a constant map (−x would give −0, and a division by it −inf)


@dataclass
class EfficientMPRT:
    """rise: (N,) (H_random − H_trained) / H_trained, the relative rise of the maps' discrete entropy when
    the whole model is randomised, higher is better (a method whose map follows the model turns to noise);
    inf (NaN) where the trained model's map is constant. entropy, randomized_entropy: (N,) the two entropies,
    in [0, ln bins]. layers: the layers randomised, in order."""

    rise: Tensor
    entropy: Tensor
    randomized_entropy: Tensor
    layers: list[str]


def _check_randomize(randomize: Optional[Randomize]) -> None:
    if randomize is not None and not callable(randomize):
        raise TypeError(f"randomize must be a callable (layer, stage index) that re-initialises the layer in place; "
                        f"got {short_repr(randomize)}.")


def efficient_mprt(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    bins: int = 100,
    stages: Optional[Sequence[str]] = None,
    seed: int = 0,
    randomize: Optional[Randomize] = None,
    explanation: Optional[Explanation] = None,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> EfficientMPRT:
    """Efficient model parameter randomisation test, eMPRT (Hedström et al. 2023): how much more complex
    (the discrete entropy of the histogram of its raw values, ``discrete_entropy``) each image's map
    becomes when every layer of the model is randomised. Two explanations per image, the randomised one on
    a deep copy; the given model is not changed.

    bins: histogram bins (Quantus 0.6: 100). stages: the layers randomised (default: the model's top-level
        children that have parameters, so every layer below them), bottom up, ``randomize`` (layer, stage
        index) re-initialising each (default ``explain.metrics.sanity.reinitialize(layer, seed + index)``).
    explanation: the images' explanation by this explainer, when already computed (``target`` left out).
    """
    _check_randomize(randomize)
    bins = int_option("bins", bins, 1)
    options = dict(explain_options or {})
    reference = explained_reference(explainer, inputs, target, explanation, options, "eMPRT")
    stages_run = deque(randomized_copies(  # every stage randomised, then one explanation of the randomised model
        explainer, reference.batch, default_stages(explainer.model) if stages is None else stages, order="bottom_up",
        seed=seed, randomize=randomize, explain_options=options), maxlen=1)
    if not stages_run:
        raise ValueError("none of the stages runs in the model's forward: name layers the model runs.")
    _, layers, randomized = stages_run[0]
    after = randomized.explain(reference.batch, reference.classes, **options).raw_map_grid[:, 0]
    before_entropy, after_entropy = discrete_entropy(reference.maps, bins), discrete_entropy(after, bins)
    rise = torch.where(before_entropy > 0, (after_entropy - before_entropy) / before_entropy.clamp_min(1e-300),
                       torch.where(after_entropy > 0, float("inf"), float("nan")))  # a constant map: 0 / 0 or inf
    return EfficientMPRT(rise=rise, entropy=before_entropy,
                         randomized_entropy=after_entropy, layers=layers)


def _smoothed_maps(explainer: Explainer, reference: Reference, count: int, perturb: Perturb, batch_size: int,
                   options: Mapping[str, Any]) -> Tensor:
    """(N, H, W) the mean of the raw maps of ``count`` copies of each image (the last: the image itself)."""
    total = torch.zeros_like(reference.maps)
    images_count = reference.batch.shape[0]
    for start in range(0, count * images_count, batch_size):
        rows = torch.arange(start, min(start + batch_size, count * images_count), device=reference.batch.device)
        samples, images = rows // images_count, rows % images_count
        maps = explainer.explain(perturb(samples, images), reference.classes[images], **options).raw_map_grid[:, 0]
        for sample in samples.unique().tolist():  # added sample after sample, as a running mean
            chosen = samples == sample
            total[images[chosen]] += maps[chosen].to(total.device) / count
    return total


def smooth_mprt(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    samples: int = 50,
    noise_level: float = 0.1,
    noise: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    stages: Optional[Sequence[str]] = None,
    order: str = "bottom_up",
    seed: int = 0,
    randomize: Optional[Randomize] = None,
    batch_size: int = 32,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> list[RandomizationStage]:
    """Smooth model parameter randomisation test, sMPRT (Hedström et al. 2023): the cascading
    randomisation test (``cascading_randomization``) on maps denoised as SmoothGrad does, each the mean of
    the raw maps of ``samples`` copies of the image, S − 1 with Gaussian noise of standard deviation
    ``noise_level`` × (the image's largest − smallest value) and the image itself. One RandomizationStage
    per layer: Spearman rank correlation of |map| and SSIM of |map| / its peak against the trained
    model's, in [-1, 1], lower after randomisation is better.

    noise: the (S − 1, N, C, H, W) offsets, instead of drawing them from ``generator`` (a CPU
        ``torch.Generator``, default seeded with 0): one standard normal (C, H, W) draw per sample, shared by
        every image of the batch and scaled by each image's spread, so that an image's maps are the ones it
        gets alone, at any place in any batch (``explain.metrics.robustness``); every stage uses the same
        draws.
    stages, order ("bottom_up", the paper's recommendation, or "top_down"), seed, randomize: which layers
        are randomised, cumulatively, and how (``explain.metrics.sanity.randomized_copies``).
    Costs S · N explained copies per stage and for the trained model, ``batch_size`` per call.
    """
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be 'top_down' or 'bottom_up'; got {short_repr(order)}.")
    _check_randomize(randomize)
    count = int_option("samples", samples, 1)
    noise_level = number_option("noise_level", noise_level)
    int_option("batch_size", batch_size, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (on the CPU); got {short_repr(generator)}.")
    options = dict(explain_options or {})
    model = explainer.model
    batch = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model),
                           channels=model_input_channels(model)).batch
    reference = explained_reference(explainer, batch, target, None, options, "sMPRT")  # and the classes explained
    flat = batch.reshape(batch.shape[0], -1)
    spread = (flat.amax(dim=1) - flat.amin(dim=1)) * noise_level
    if count > 1 and noise is not None:
        given, _ = check_noise(noise, count - 1, batch)
    elif noise is not None:
        raise ValueError("samples = 1 averages the image alone: give no noise, or more samples.")
    else:
        given = None
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    start_state = generator.get_state()

    def smoothed(current: Explainer) -> Tensor:
        generator.set_state(start_state)  # the same draws for every stage
        source = NoiseSamples(given, lambda generator: torch.randn(batch.shape[1:], generator=generator,
                                                                   dtype=torch.float64), generator, spread.double())

        def perturb(sample_rows: Tensor, image_rows: Tensor) -> Tensor:
            noisy = sample_rows < count - 1
            rows = batch[image_rows].clone()
            if bool(noisy.any()):
                rows[noisy] = add_noise(batch[image_rows[noisy]], source.rows(sample_rows[noisy], image_rows[noisy]))
            return rows
        return _smoothed_maps(current, reference, count, perturb, batch_size, options)

    trained = _magnitude(smoothed(explainer))
    results: list[RandomizationStage] = []
    for name, layers, randomized in randomized_copies(
            explainer, batch, default_stages(model) if stages is None else stages, order=order, seed=seed,
            randomize=randomize, explain_options=options):
        current = _magnitude(smoothed(randomized))
        results.append(RandomizationStage(layer=name, layers=layers, rank_correlation=spearman(trained, current),
                                          ssim=_ssim(trained, current)))
    return results
