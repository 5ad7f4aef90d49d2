"""Shared helpers of the metrics: maps and masks as batched tensors, model scores."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.capture import model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import OutputSelector, Target, class_probabilities, select_output, select_targets
from ..io.explanation import Explanation
from ..io.inputs import Inputs, PreprocessSpec, as_preprocess, prepare_inputs

MapsLike = Union[Explanation, Tensor]
"""Maps to evaluate: an Explanation (one target per image) or a (N, H, W) / (H, W) tensor."""


def short_repr(value: object) -> str:
    """``value`` for an error message: a tensor or array by its shape and dtype (never its values),
    anything else by a repr cut to 80 characters."""
    if isinstance(value, (Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def as_tensor(values: object, expected: str) -> Tensor:
    """A tensor, numpy array or nested list as a tensor; anything else a TypeError: "``expected``; got …"."""
    try:
        return torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{expected}; got {short_repr(values)}.") from None


def check_finite(values: Tensor, what: str, advice: str) -> None:
    """Refuse (N, ...) values with NaN or inf, naming ``what`` and the indices n that hold them."""
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    if bool(bad.any()):
        indices = bad.nonzero()[:, 0].tolist()
        plural = len(indices) > 1
        raise ValueError(f"{what}{'s' if plural else ''} {', '.join(map(str, indices[:8]))}"
                         f"{' and more' if len(indices) > 8 else ''} hold{'' if plural else 's'} NaN or inf values: "
                         f"{advice}")


def check_count(count: int, what: str, expected: int, expected_what: str) -> None:
    """Refuse ``count`` ``what`` where there are ``expected`` ``expected_what``: one each, no extra ignored."""
    if count != expected:
        raise ValueError(f"{count} {what} for {expected} {expected_what}: give exactly one per "
                         f"{expected_what.rstrip('s')} (none is ignored, none repeated).")


def as_maps(maps: MapsLike, size: Optional[Sequence[int]] = None) -> Tensor:
    """An Explanation (one target per image) or a (N, H, W) / (H, W) tensor → (N, H, W) float,
    resized bilinearly to ``size`` when given (refused when not in its proportions, ``check_aspect``). Maps with
    NaN or inf are refused, naming them."""
    if isinstance(maps, Explanation):
        if maps.keep_target_dim and maps.map_grid.shape[1] != 1:
            raise ValueError(
                "this explanation has several targets per image; pass one target's maps with its classes, e.g. "
                "explanation.maps[:, k] and target=explanation.targets[:, k] (without target, the metrics that score "
                "classes score each image's top class)."
            )
        maps = maps.map_grid[:, 0]
    maps = as_tensor(maps, "maps must be an Explanation or a (N, H, W) tensor").detach().float()
    if maps.dim() == 2:
        maps = maps[None]
    if maps.dim() != 3 or maps.shape[0] == 0:
        raise ValueError(f"maps must be (N, H, W) with N ≥ 1; got shape {tuple(maps.shape)}.")
    check_finite(maps, "map", "such a map ranks no pixels and scores nothing. Check how it was computed (a "
                 "method's maps are finite; torch.nan_to_num replaces NaN and inf).")
    if size is not None and tuple(maps.shape[-2:]) != tuple(size):
        check_aspect(maps.shape[-2:], size)
        maps = F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return maps


def check_aspect(map_size: Sequence[int], size: Sequence[int]) -> None:
    """Refuse (h, w) maps whose shape is not the (H, W) input's at a lower or higher resolution: more than one
    cell off either way (a layer's grid rounds H / stride up or down). A transposed map, or one of other images,
    would otherwise be stretched onto the input without a word."""
    (height, width), (target_height, target_width) = map_size, size
    if abs(height - target_height * width / target_width) > 1 + 1e-9 or \
            abs(width - target_width * height / target_height) > 1 + 1e-9:
        raise ValueError(f"maps of {height} × {width} do not have the shape of the {target_height} × {target_width} "
                         f"input (at any resolution): they would be stretched onto it. Give maps of these images, "
                         f"(N, H, W) with H, W in the input's proportions (a transposed map: maps.transpose(-1, -2)).")


def check_boxes(boxes: Tensor, size: Sequence[int]) -> Tensor:
    """(N, 4) boxes → the same as (N, 4) long, after refusing (naming the box) any that is not
    whole-number inclusive pixel coordinates (x0, y0, x1, y1) with 0 ≤ x0 ≤ x1 ≤ W − 1 and
    0 ≤ y0 ≤ y1 ≤ H − 1. Normalised coordinates (fractions in [0, 1]) are an error that says
    to scale them: they are never guessed."""
    height, width = size
    if boxes.dtype == torch.bool or boxes.is_complex():
        raise ValueError(f"boxes must be pixel coordinates (x0, y0, x1, y1), whole numbers; got {short_repr(boxes)}. "
                         "A mask is (N, H, W), at the maps' size.")
    for index, box in enumerate(boxes.tolist()):
        shown = f"box {index} ({', '.join(f'{value:g}' for value in box)})"
        if not all(math.isfinite(value) for value in box):
            raise ValueError(f"{shown} holds NaN or inf.")
        if any(value != round(value) for value in box):
            if all(0 <= value <= 1 for value in box):
                raise ValueError(f"{shown} looks normalised to [0, 1]: boxes are pixel coordinates (x0, y0, x1, y1), "
                                 f"inclusive, of the {height} × {width} maps. Scale them, e.g. (boxes * "
                                 f"torch.tensor([{width - 1}, {height - 1}, {width - 1}, {height - 1}])).round().")
            raise ValueError(f"{shown} has fractional coordinates: boxes are whole pixel coordinates (x0, y0, x1, y1), "
                             "inclusive. Round them to the pixels you mean, e.g. boxes.round().")
        x0, y0, x1, y1 = box
        if x1 < x0 or y1 < y0:
            raise ValueError(f"{shown} is empty (x1 < x0 or y1 < y0): boxes are (x0, y0, x1, y1), the inclusive "
                             "pixel coordinates of the top-left and bottom-right corners.")
        if x0 < 0 or y0 < 0 or x1 > width - 1 or y1 > height - 1:
            raise ValueError(f"{shown} reaches outside the {height} × {width} maps: coordinates are inclusive pixels, "
                             f"0 ≤ x0 ≤ x1 ≤ {width - 1} and 0 ≤ y0 ≤ y1 ≤ {height - 1} (for an exclusive end, "
                             "subtract 1 from x1 and y1; to keep the part inside, clamp the box).")
    return boxes.round().long()


def boxes_to_masks(boxes: Tensor, size: Sequence[int]) -> Tensor:
    """(N, 4) boxes (x0, y0, x1, y1), inclusive pixel coordinates inside the image (see
    ``check_boxes``) → (N, H, W) bool masks."""
    boxes = check_boxes(torch.as_tensor(boxes), size)
    rows = torch.arange(size[0], device=boxes.device).view(1, -1, 1)
    columns = torch.arange(size[1], device=boxes.device).view(1, 1, -1)
    x0, y0, x1, y1 = (boxes[:, i].view(-1, 1, 1) for i in range(4))
    return (columns >= x0) & (columns <= x1) & (rows >= y0) & (rows <= y1)


def instance_boxes(explanation: Explanation) -> tuple[Tensor, Tensor]:
    """A detection explanation's maps and boxes, one row per explained instance, for the localisation metrics
    (``pointing_game(*instance_boxes(e))``: each instance's map scored against its own box).

    Returns (maps (M, H, W), boxes (M, 4)): the M instances present (padding left out), their boxes as the metrics
    take them, whole inclusive pixel coordinates inside the image (the pixels the box covers: x0, y0 rounded down,
    x1, y1 rounded up minus one, clipped to the image)."""
    if explanation.boxes is None:
        raise ValueError("instance_boxes takes the explanation of detected instances (explain(image, instances=...)); "
                         "this explanation has no boxes. For a class's map, give the object's boxes or masks.")
    maps = explanation.map_grid.flatten(0, 1)
    boxes = explanation.boxes.flatten(0, 1).to(maps.device)
    present = ~boxes.isnan().any(dim=-1)
    maps, boxes = maps[present], boxes[present]
    height, width = maps.shape[-2:]
    limits = boxes.new_tensor([width - 1, height - 1, width - 1, height - 1])
    covered = torch.cat([boxes[:, :2].floor(), boxes[:, 2:].ceil() - 1], dim=1)
    covered = torch.minimum(covered.clamp(min=0), limits)
    covered[:, 2:] = torch.maximum(covered[:, 2:], covered[:, :2])  # a box thinner than a pixel covers one pixel
    return maps, covered.long()


def as_masks(masks_or_boxes: Tensor, size: Sequence[int], count: int) -> Tensor:
    """(N, H, W) masks (any dtype, non-zero = inside) or (N, 4) boxes (``check_boxes``) → (N, H, W)
    bool masks, one for each of ``count`` maps. Refused, with what was wrong: another number of
    masks than maps, masks of another size, NaN or inf, an empty mask or box, a box outside the
    maps or not in whole pixel coordinates."""
    region = as_tensor(masks_or_boxes, "masks_or_boxes must be (N, H, W) masks or (N, 4) boxes")
    if region.dim() == 2 and region.shape[1] == 4:
        if tuple(region.shape) == tuple(size):
            raise ValueError(f"masks_or_boxes of shape {tuple(region.shape)} could be boxes or one mask of the "
                             f"{size[0]}×{size[1]} maps: pass masks as (N, H, W) (mask[None] for one), or boxes "
                             "as the masks they cover: explain.metrics.boxes_to_masks(boxes, maps_size).")
        check_count(region.shape[0], "boxes", count, "maps")
        return boxes_to_masks(region, size)
    if region.dim() == 2:
        region = region[None]
    if region.dim() == 3 and region.shape[-2] > size[0] and region.shape[-1] > size[1]:
        raise ValueError(f"masks of {region.shape[-2]} × {region.shape[-1]} for maps of {size[0]} × {size[1]}: the "
                         "maps are coarser than the masks (a layer's grid). Resize the maps to the masks' size, e.g. "
                         "torch.nn.functional.interpolate(maps[:, None], size=masks.shape[-2:], mode='bilinear')"
                         "[:, 0], or pass the Explanation (its maps are at the image's size).")
    if region.dim() != 3 or tuple(region.shape[-2:]) != tuple(size):
        raise ValueError(f"masks must be (N, H, W) at the maps' size {tuple(size)}, or (N, 4) boxes; "
                         f"got shape {tuple(region.shape)}.")
    check_count(region.shape[0], "masks", count, "maps")
    if region.is_floating_point() or region.is_complex():
        check_finite(region, "mask", "a mask is non-zero inside the object, zero outside.")
    masks = region != 0
    empty = ~masks.flatten(1).any(dim=1)
    if bool(empty.any()):
        indices = empty.nonzero()[:, 0].tolist()
        raise ValueError(f"mask{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices[:8]))} "
                         f"{'is' if len(indices) == 1 else 'are'} empty: "
                         "there is no object to point at. Leave those images out of the evaluation.")
    return masks


def run_model(model: nn.Module, inputs: Tensor, options: Mapping[str, Any], count: int,
              images: Optional[Tensor] = None) -> Any:
    """The model's output for ``inputs``, given the model's other inputs as ``explain`` takes them in ``options``
    (``forward_args``, ``forward_kwargs``, ``input_position``, ``per_image``: CLIP's prompts). count: the number of
    images explained; images: (R,) which image each row of ``inputs`` is a copy of (None: row n is image n), so
    that per-image inputs follow their image."""
    from ..core.forward_call import ForwardCall

    call = ForwardCall.stated(options.get("forward_args", ()), options.get("forward_kwargs") or {},
                              options.get("input_position", 0), count, options.get("per_image"))
    if call is None:
        return model(inputs)
    if images is not None:
        call = call.for_rows(images)
    args, kwargs = call.arguments(inputs)
    return model(*args, **kwargs)


def model_inputs(model: nn.Module, inputs: Inputs, preprocess: PreprocessSpec) -> Tensor:
    """Anything ``explain()`` accepts → the (N, C, H, W) model batch on the model's device."""
    return prepare_inputs(inputs, as_preprocess(preprocess, model), model_device(model), model_dtype(model),
                          channels=model_input_channels(model)).batch


def fixed_classes(model: nn.Module, batch: Tensor, maps: MapsLike, target: Target, output: OutputSelector = None
                  ) -> Tensor:
    """(N,) classes to score: the explanation's, else ``target``, else each image's top class; ``output``
    picks the scores in the model's output (``model_scores``). An Explanation without class indices (of a hidden
    unit, or a callable score) needs ``target``."""
    explained = explained_classes(maps, target)
    if explained is not None:
        return explained.to(batch.device)
    with torch.no_grad(), preserved_model_state(model):
        selected = select_targets(model_scores(model(batch), output, batch.shape[0]), target, None,
                                  batch_size=batch.shape[0])
    if selected.class_indices is None:
        raise ValueError("faithfulness metrics score classes: give class targets, not a callable.")
    if selected.class_indices.shape[1] != 1:
        raise ValueError("faithfulness metrics take one class per image.")
    check_explained_classes(maps, selected.class_indices[:, 0])
    return selected.class_indices[:, 0]


def explained_classes(maps: MapsLike, target: Target) -> Optional[Tensor]:
    """(N,) the classes an Explanation's maps explain, where no ``target`` is given; None for a tensor of maps
    or a given ``target`` (the caller resolves it, then ``check_explained_classes``). An Explanation without class
    indices (of a hidden unit, or a callable score) and no ``target`` is refused: scoring each image's top class
    instead would measure another score than the one explained."""
    if not isinstance(maps, Explanation) or target is not None:
        return None
    if maps.class_indices is None:
        raise ValueError(
            f"the {maps.method} explanation has no class indices: it explains a hidden unit (explain.Neuron, "
            "explain.Channel) or a score given as a callable, which these metrics do not score (they read "
            "classes from the model's output), and scoring each image's top class instead would measure "
            "another score than the one explained. Give target= (the class to score), or explain a class.")
    return maps.class_indices[:, 0]


def check_explained_classes(maps: MapsLike, classes: Tensor) -> None:
    """Refuse (N,) ``classes`` to score that differ from those an Explanation's maps explain: a map for one class
    would be scored on another class's score without a word."""
    if not isinstance(maps, Explanation) or maps.class_indices is None:
        return
    explained = maps.class_indices[:, 0].to(classes.device)
    differ = (explained != classes).nonzero()[:, 0].tolist()
    if differ:
        index = differ[0]
        raise ValueError(
            f"target asks for class {int(classes[index])} of image {index}, but this {maps.method} explanation's map "
            f"of it explains class {int(explained[index])} ({len(differ)} image{'s' if len(differ) > 1 else ''} "
            "so): the map would be scored on a class it does not explain. Leave target out (the explanation's "
            "classes are scored), explain the classes you mean, or pass the maps as a tensor (explanation.maps) to "
            "score them on other classes on purpose.")


def model_scores(output: Any, selector: OutputSelector, rows: int) -> Any:
    """The scores ``selector`` picks in a model's output for ``rows`` images (``select_output``); one score per
    image, (N,) (or () for one image: a model that squeezes its (N, 1) output), read as one column, (N, 1): a
    binary classifier's logit."""
    scores = select_output(output, selector)
    if not isinstance(scores, Tensor):
        return scores
    one_per_image = scores.dim() == 1 and scores.shape[0] == rows or scores.dim() == 0 and rows == 1
    return scores.reshape(rows, 1) if one_per_image else scores


def decisions(scores: Tensor) -> Tensor:
    """(N, C) class scores → (N,) what the model decides for each image, for telling whether two images (or an
    image and its perturbed copy) get the same prediction: the top class; for one column (a binary classifier's
    logit, where the top class is always 0) whether the logit is positive (1) or not (0)."""
    return (scores[:, 0] > 0).long() if scores.shape[1] == 1 else scores.argmax(dim=1)


PROBABILITY_TOLERANCE = 1e-3
"""How far from 1 a row of class scores may sum (float16 rounding) and still be read as probabilities."""


def warn_if_probabilities(scores: Tensor) -> None:
    """Warn, at the caller's line, where (R, C) scores with C ≥ 2 already are probabilities (every row in [0, 1],
    summing to 1): the model applies its own softmax, and the softmax taken again for ``score="probability"`` is
    nearly uniform (≈ 1 / C whatever the input), so every map would score about the same. The message holds no
    numbers, so that Python's default filter shows it once per calling line."""
    if scores.dim() != 2 or scores.shape[1] < 2 or scores.shape[0] == 0:
        return
    in_range = bool(((scores >= 0) & (scores <= 1)).all())
    if in_range and bool(((scores.double().sum(dim=1) - 1).abs() <= PROBABILITY_TOLERANCE).all()):
        warn_at_callers_line(
            "the model's outputs already are probabilities (each row in [0, 1], summing to 1: the model applies "
            "its own softmax), and score='probability' takes their softmax again, which is nearly uniform "
            "(about 1 / classes whatever the input): every map would score about the same. Give the model without "
            "its final softmax (its logits), or, where the metric takes it, score='logit' to score its outputs as "
            "they are.")


def class_scores(model: nn.Module, batch: Tensor, classes: Tensor, score: str, batch_size: int,
                 output_selector: OutputSelector = None) -> Tensor:
    """(R,) score of ``classes[r]`` on row r of ``batch``: "probability" (``explain.core.targets.class_probabilities``:
    the softmax over the classes, the sigmoid of a one-column output) or "logit" of the scores ``output_selector``
    picks in the model's output (``model_scores``)."""
    if score not in ("probability", "logit"):
        raise ValueError(f"score must be 'probability' or 'logit'; got {score!r}.")
    results: list[Tensor] = []
    with torch.no_grad(), preserved_model_state(model):
        for start in range(0, batch.shape[0], batch_size):
            rows = batch[start : start + batch_size]
            output = model_scores(model(rows), output_selector, rows.shape[0]).float()
            if score == "probability":
                warn_if_probabilities(output)
                output = class_probabilities(output)
            results.append(output.gather(1, classes[start : start + batch_size, None].to(output.device))[:, 0])
    return torch.cat(results)


def ranking(maps: Tensor, seed: int = 0) -> Tensor:
    """(N, H, W) maps → (N, H, W) rank of each pixel, 0 for the most relevant.
    Ties are broken by a seeded random order, so a constant map ranks pixels at random. The order is the
    same for every map, so a map's ranks do not depend on the other maps of the batch (an image scores the
    same alone as in any batch)."""
    count = maps.shape[0]
    flat = maps.reshape(count, -1)
    generator = torch.Generator().manual_seed(seed)
    shuffle = torch.randperm(flat.shape[1], generator=generator).to(flat.device).expand(count, -1)
    order_in_shuffle = torch.argsort(-flat.gather(1, shuffle), dim=1, stable=True)
    order = shuffle.gather(1, order_in_shuffle)  # pixel indices, most relevant first
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(flat.shape[1], device=flat.device).expand(count, -1))
    return ranks.reshape(maps.shape)
