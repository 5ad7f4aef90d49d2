"""Randomisation: does the map change when what it should depend on changes?

``random_logit`` (Sixt et al. 2020) explains each image for its class and for another class
drawn at random, and measures how alike the two maps are: a method whose map hardly depends
on the class explained (modified backpropagation rules often reconstruct the image) scores
high. ``cascading_randomization`` (in ``explain.metrics.sanity``) randomises the model instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import Tensor

from ..capture import model_device, model_dtype, preserved_model_state
from ..explanation import Explanation
from ..inputs import Inputs, prepare_inputs
from ..methods.base import Explainer
from ..targets import Target, select_output
from ._common import as_tensor, check_count, short_repr
from .sanity import _magnitude, spearman

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
        classes each call; seed your own for other draws).
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
    batch = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model)).batch
    if explanation is None:
        first = explainer.explain(batch, target, **options)
    elif not isinstance(explanation, Explanation):
        raise TypeError(f"explanation must be an Explanation (of these images by this explainer); got "
                        f"{short_repr(explanation)}.")
    elif target is not None:
        raise ValueError("give target or explanation, not both: the explanation's classes are the ones explained.")
    else:
        first = explanation
        check_count(len(first), "explained images", batch.shape[0], "images")
    if first.class_indices is None or first.class_indices.shape[1] != 1:
        raise ValueError("the random logit test explains one class per image: give a class (or none, for the top "
                         "class) per image, not a callable or several targets.")
    classes = first.class_indices[:, 0].to(batch.device)
    with torch.no_grad(), preserved_model_state(model):
        class_count = select_output(model(batch[:1]), explainer.output).shape[1]
    if class_count < 2:
        raise ValueError("the model has a single output class: there is no other class to compare with.")
    if other_classes is None:
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        offsets = torch.randint(0, class_count - 1, (classes.shape[0],), generator=generator).to(batch.device)
        others = offsets + (offsets >= classes).long()  # uniform over the classes other than the image's own
    else:
        others = _check_other_classes(other_classes, classes, class_count)
    second = explainer.explain(batch, others, **options)
    first_maps, second_maps = first.raw_map_grid[:, 0], second.raw_map_grid[:, 0]
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
