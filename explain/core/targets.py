"""Turn "what to explain" (a class, top-k classes, a callable) into one scalar per image and target."""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn

from .call_record import keep_for_call, kept_for_call
from .caller import warn_at_callers_line
from .checks import check

ClassRef = Union[int, str]
"""A class, by index or by name."""

Target = Union[None, ClassRef, Sequence[ClassRef], Sequence[Sequence[ClassRef]], Tensor, Callable[[Any], Tensor]]
"""What to explain for each image.

- ``None``: the top-1 class of each image;
- an ``int``: that class for every image;
- a sequence of N ints: one class per image;
- a sequence of N sequences of K ints (or an (N, K) tensor): K classes per image;
- class names wherever an int may stand (``"tabby"``, one name per image, K per image), when the
  explainer knows the model's class names (its ``class_names=``, or the model's own: a HuggingFace
  ``config.id2label``, a timm ImageNet classifier's labels); see ``class_index``;
- a callable ``f(output) -> Tensor[N]`` (or ``Tensor[N, K]``): any scalar(s) per image,
  computed from the model's output (segmentation, detection, embedding targets).
  Perturbation methods (Score-CAM, Ablation-CAM) apply it to outputs of batches of
  perturbed copies, so it must score each row of the output on its own.
"""


OutputSelector = Union[None, str, int, Callable[[Any], Any]]
"""Which part of a model's output holds the scores: None (automatic), a key or attribute name,
an index, or a callable output → scores."""


def is_detector_output(output: Any) -> bool:
    """Whether ``output`` holds detections' boxes with their class scores, as a whole: a transformers detector's
    output (``logits`` and ``pred_boxes``) or a {"boxes": (N, P, 4), "scores": (N, P, C)} dict."""
    if isinstance(getattr(output, "pred_boxes", None), Tensor) and isinstance(getattr(output, "logits", None), Tensor):
        return True
    return isinstance(output, Mapping) and all(isinstance(output.get(key), Tensor) and output[key].dim() == 3
                                               for key in ("boxes", "scores"))


def select_output(output: Any, selector: OutputSelector = None) -> Any:
    """The part of a model's output that targets are read from.

    Automatic (selector None): a tensor as it is; a dict's "out" (torchvision segmentation) or
    "logits" entry, or its only tensor; an object's ``.logits`` (HuggingFace ModelOutput); a
    tuple's or list's first tensor; a list of dicts (torchvision detection) and detectors' outputs
    (``is_detector_output``) as they are, for a callable target. A key, attribute name, index or callable picks
    explicitly.
    """
    if callable(selector):
        return selector(output)
    if isinstance(selector, str):
        if isinstance(output, Mapping) and selector in output:
            return output[selector]
        if hasattr(output, selector) and not callable(getattr(output, selector)):  # a dict's .values is no output
            return getattr(output, selector)
        keys = f" (its keys: {', '.join(map(repr, output))})" if isinstance(output, Mapping) else ""
        raise ValueError(f"the model's output has no key or attribute {selector!r}{keys}.")
    if isinstance(selector, int):
        return _indexed(output, selector)
    if isinstance(output, Tensor):
        return output
    if is_detector_output(output):
        return output  # boxes with their class scores: for an instance target (explain.detection)
    if isinstance(output, Mapping):
        for key in ("out", "logits"):
            if key in output:
                return output[key]
        tensors = [key for key, value in output.items() if isinstance(value, Tensor)]
        if len(tensors) == 1:
            return output[tensors[0]]
        raise ValueError(
            f"the model returns a dict with keys {list(output)}; pass output=KEY to say which holds the scores."
        )
    if isinstance(getattr(output, "logits", None), Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        if isinstance(output[0], Tensor):
            _warn_if_another_could_be_the_scores(output)
            return output[0]
        if all(isinstance(item, Mapping) for item in output):
            return output  # detection: a list of dicts, for a callable target
    raise ValueError(
        f"cannot find the scores in a model output of type {type(output).__name__}; pass output= "
        "(a key, an index or a callable)."
    )


def _indexed(output: Any, index: int) -> Any:
    """``output[index]`` for output=INDEX: a clear error where the output has no such item, and for a tensor (whose
    index would pick one image of the batch, not a part of the output)."""
    if isinstance(output, Tensor):
        raise ValueError(f"output={index} selects an item of a tuple or list, but the model returns a tensor "
                         f"{tuple(output.shape)} (indexing it would pick image {index} of the batch): leave output= "
                         "out, or pass a callable.")
    if isinstance(output, Mapping):
        if index in output:
            return output[index]
        raise ValueError(f"the model returns a dict without key {index} (its keys: {', '.join(map(repr, output))}): "
                         "pass output=KEY.")
    if isinstance(output, (tuple, list)):
        if -len(output) <= index < len(output):
            return output[index]
        raise ValueError(f"output={index} is out of range: the model returns a {type(output).__name__} of "
                         f"{len(output)} items.")
    return output[index]


def _warn_if_another_could_be_the_scores(output: Sequence[Any]) -> None:
    """Warn when a tuple's first tensor, taken as the scores, is one of several (N, width) tensors of different
    widths, such as a model's (embedding, logits): which holds the class scores cannot be told from the output."""
    first = output[0]
    if first.dim() != 2:
        return
    others = [index for index, item in enumerate(output[1:], start=1)
              if isinstance(item, Tensor) and item.dim() == 2 and item.shape[0] == first.shape[0]
              and item.shape[1] != first.shape[1]]
    if others:
        shapes = ", ".join(f"[{index}] {tuple(output[index].shape)}" for index in [0, *others])
        warn_at_callers_line(
            f"the model returns a {type(output).__name__} of several (N, width) tensors ({shapes}); the first is "
            f"taken as the class scores. If they are another, pass output=INDEX to the explainer (e.g. output="
            f"{others[0]}); pass output=0 to keep the first and silence this warning.")


@dataclass
class SelectedTargets:
    """The scalars to explain, selected from the model's output.

    scores: (N, K) tensor, still connected to the autograd graph when the output is.
    class_indices: (N, K) long tensor of class indices, or None for callable targets.
    keep_target_dim: whether maps keep a K dimension, (N, K, H, W), or drop it, (N, H, W).
    probabilities: (N, K) probabilities of the explained classes (``class_probabilities``: softmax, or sigmoid
        for a one-column output), None for callable targets.
    empty_region: (N, K) bool, where a ``RegionTarget``'s region (pixels, a box) is empty on the
        explained images, so that its score is 0 whatever the input; None for other targets.
    empty_region_advice: the region target's own words on what empty means and what to do.
    """

    scores: Tensor
    class_indices: Optional[Tensor]
    keep_target_dim: bool
    probabilities: Optional[Tensor] = None
    target_function: Optional[Callable[[Any], Tensor]] = None
    empty_region: Optional[Tensor] = None
    empty_region_advice: str = ""

    def scores_for(self, output: Any, image_index: Tensor) -> Tensor:
        """The same targets' scores on another forward pass, e.g. of perturbed copies.

        output: the model's output for R rows, row r being a copy of image ``image_index[r]``.
        Returns (R, K). A callable target is applied to the rows as they are, so it must
        score each row on its own.
        """
        rows_target = getattr(self.target_function, "scores_for_rows", None)
        if rows_target is not None:  # a target whose scalar depends on the image each row is a copy of
            return rows_target(output, image_index)
        if self.target_function is not None:
            scores = self.target_function(output)
            return scores.reshape(scores.shape[0], -1)
        assert self.class_indices is not None, "targets without a target function are classes"
        return output.gather(1, self.class_indices[image_index].to(output.device))


@runtime_checkable
class RegionTarget(Protocol):
    """A target that scores a region of the model's output (pixels, a box). Where the region is
    empty the score is 0 whatever the input, so the map is empty too: the pipeline asks the target
    (``empty_regions``) and its warning blames the region, in the target's words (``empty_region_advice``),
    instead of the gradient."""

    def __call__(self, output: Any) -> Tensor: ...

    def empty_regions(self, output: Any) -> Tensor:
        """(N,) bool: the images whose region is empty in ``output``."""
        ...

    def empty_region_advice(self) -> str:
        """What an empty region means for this target and what to do about it."""
        ...


class SegmentationTarget:
    """Semantic segmentation: the sum of class ``class_index``'s logits over a pixel mask.

    mask: (H, W) for every image or (N, H, W) one per image, at the logits' resolution (SegFormer's are at 1/4
    of the input's): bool, 0/1 integers, or floats in [0, 1] (each pixel's weight in the sum). None: the pixels
    where ``class_index`` is the predicted class on the explained images; methods that score copies of the
    images (Integrated Gradients, SmoothGrad, Score-CAM...) keep those pixels for every copy
    (``scores_for_rows``), as they keep a given mask, so the score is one function of the output along the path.
    Those pixels belong to the ``explain`` call in progress (``keep_for_call``), not to the target: one target may
    serve calls in several threads at once, and keeps nothing of a call after it.
    Called on (N, classes, H, W) segmentation logits, returns (N,) scores, summed in float32 at least (no float16
    overflow). An image where the mask selects no pixel (no pixel predicted as the class) scores 0: a zero map
    and a warning that says so (``RegionTarget``).
    """

    def __init__(self, class_index: int, mask: Optional[Tensor] = None):
        if isinstance(class_index, Tensor) and class_index.numel() == 1 and not class_index.is_floating_point() \
                and class_index.dtype != torch.bool:
            class_index = int(class_index.item())
        if not _is_integer(class_index):
            raise TypeError(f"SegmentationTarget's class must be an int (a class index); got {class_index!r}. For a "
                            "class name, look its index up in the model's labels (a HuggingFace config.label2id).")
        self.class_index = int(class_index)
        self.mask = None if mask is None else _checked_mask(mask)

    def region(self, output: Tensor, image_index: Optional[Tensor] = None) -> Tensor:
        """(N, H, W) or (H, W): the weight of each pixel's logit in the sum (the mask, or the predicted pixels).
        image_index: for rows that are copies of the images, the image of each row (its mask is the row's)."""
        if not isinstance(output, Tensor) or output.dim() != 4:
            found = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"SegmentationTarget needs (N, classes, H, W) logits; the selected output is {found}. "
                             "Pass output= (a key, an index or a callable) to the explainer to select them.")
        if not 0 <= self.class_index < output.shape[1]:
            raise ValueError(f"SegmentationTarget's class {self.class_index} is out of range: the output has "
                             f"{output.shape[1]} classes (0 to {output.shape[1] - 1}).")
        if self.mask is None:
            return output.detach().argmax(dim=1) == self.class_index
        mask = self.mask
        if mask.shape[-2:] != output.shape[-2:]:
            height, width = output.shape[-2:]
            raise ValueError(
                f"SegmentationTarget's mask is {tuple(mask.shape[-2:])} but the logits are ({height}, {width}) (the "
                "model's output, not its input, which some models' logits are smaller than: SegFormer's are at 1/4). "
                "Give the mask at the logits' size, e.g. torch.nn.functional.interpolate(mask[None, None].float(), "
                f"size=({height}, {width}), mode='area')[0, 0] (each logit's share of the mask).")
        images = output.shape[0] if image_index is None else int(image_index.max()) + 1 if len(image_index) else 0
        if mask.dim() == 3 and mask.shape[0] != 1 and (mask.shape[0] != images if image_index is None
                                                       else mask.shape[0] < images):
            raise ValueError(f"SegmentationTarget's mask holds {mask.shape[0]} masks, for a batch of {images} "
                             "images: give one (H, W) mask for all, or one per image (N, H, W).")
        mask = mask.to(output.device)
        if mask.dim() == 3 and mask.shape[0] != 1 and image_index is not None:
            return mask[image_index.to(output.device)]
        return mask

    def __call__(self, output: Tensor) -> Tensor:
        region = self.region(output)
        if self.mask is None:  # the explained images: their predicted pixels are kept for copies of them
            keep_for_call(self, region)
        return self._summed(output, region)

    def scores_for_rows(self, output: Tensor, image_index: Tensor) -> Tensor:
        """(R, 1) the scores of R rows, row r a copy of image ``image_index[r]``, over that image's mask or its
        predicted pixels (those of this thread's call in progress on the images, where known), not the copy's own."""
        region = self.region(output, image_index)
        predicted = kept_for_call(self) if self.mask is None else None
        if predicted is not None and predicted.shape[-2:] == output.shape[-2:] and len(image_index) \
                and int(image_index.max()) < predicted.shape[0]:
            region = predicted.to(output.device)[image_index.to(output.device)]
        return self._summed(output, region)[:, None]

    def for_copies(self, flip: bool) -> "SegmentationTarget":
        """The target of copies of the images of this thread's call in progress (smooth="augment"): its region fixed
        as a mask (the mask given, or the pixels predicted as the class on those images), mirrored left-right where
        the copies are flipped horizontally, so that it covers the same part of the scene in each copy."""
        region = self.mask if self.mask is not None else kept_for_call(self)
        if region is None:
            return self
        return SegmentationTarget(self.class_index, region.flip(-1) if flip else region)

    def _summed(self, output: Tensor, region: Tensor) -> Tensor:
        logits = output[:, self.class_index]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # 64 × 64 float16 logits of 20 overflow
        return (logits.to(dtype) * region.to(dtype)).sum(dim=(1, 2))

    def empty_regions(self, output: Tensor) -> Tensor:
        selected = self.region(output).flatten(-2).ne(0).any(dim=-1)  # (N,), or () for one (H, W) mask
        return ~selected.expand(output.shape[0])

    def empty_region_advice(self) -> str:
        if self.mask is None:
            return (f"no pixel is predicted as class {self.class_index} (SegmentationTarget({self.class_index}) "
                    "without a mask explains the pixels predicted as its class). Choose a class that the model "
                    "predicts somewhere in the image (output.argmax(1).unique() lists them), or pass mask= to say "
                    "which pixels to explain")
        return f"the mask given to SegmentationTarget({self.class_index}) selects no pixel of the image: pass a mask " \
               "that covers the region to explain"

    def __repr__(self) -> str:
        mask = "" if self.mask is None else f", mask of shape {tuple(self.mask.shape)}"
        return f"SegmentationTarget(class_index={self.class_index}{mask})"


def _checked_mask(mask: Any) -> Tensor:
    """A SegmentationTarget's mask as a bool or float32 tensor of weights, outside the graph and any inference
    mode; a clear error for a mask that is not (H, W) or (N, H, W) of 0/1 (or [0, 1]) values."""
    try:
        tensor = torch.as_tensor(mask).detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"SegmentationTarget's mask must be a tensor or an array; got {type(mask).__name__}."
                        ) from error
    if tensor.dim() not in (2, 3):
        hint = " (for (N, 1, H, W), give mask[:, 0])" if tensor.dim() == 4 and tensor.shape[1] == 1 else ""
        raise ValueError(f"SegmentationTarget's mask must be (H, W) or (N, H, W); got {tuple(tensor.shape)}{hint}.")
    with torch.inference_mode(False):
        if tensor.dtype == torch.bool:
            return tensor.clone()
        if tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype in INTEGER_DTYPES):
            raise TypeError(f"SegmentationTarget's mask must be bool, integer 0/1 or float in [0, 1]; got "
                            f"{str(tensor.dtype)[len('torch.'):]}.")
        weights = tensor.to(torch.float32, copy=True)  # a copy: not the caller's tensor, nor an inference tensor
        if not bool(weights.isfinite().all()):
            raise ValueError("SegmentationTarget's mask holds NaN or inf values: give bool, 0/1 or weights in [0, 1].")
        low, high = float(weights.min()), float(weights.max())
        if tensor.is_floating_point() and 0 <= low and high <= 1:
            return weights
        if not tensor.is_floating_point() and 0 <= low and high <= 1:
            return tensor.bool()
    raise ValueError(
        f"SegmentationTarget's mask holds values from {low:g} to {high:g}: it must be bool, 0/1, or weights in "
        "[0, 1] (each pixel's weight in the sum of the class's logits). For an image mask saved as 0/255 give "
        "mask > 0; for a label map give labels == CLASS.")


INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class EmbeddingSimilarity:
    """Cosine similarity between the model's embeddings (N, D) and reference embeddings: explains
    what makes an image similar to a reference (CLIP image-text similarity, retrieval).

    reference: (D,), one reference for every image → (N,) scores, one map per image;
        (K, D), K references (K text prompts, say) for every image → (N, K) scores, K maps per image
        in one call; (N, K, D), K references of each image's own → (N, K) scores.
    A 2-D reference is always K references for every image (for one reference per image, give
    (N, 1, D)). (D,) and (K, D) score each row of the output on its own, so they work with every
    method; (N, K, D) needs the rows to be the N images themselves, so not with the methods that
    score batches of copies (Score-CAM, Ablation-CAM, Integrated Gradients, SmoothGrad).
    """

    def __init__(self, reference: Tensor):
        self.reference = torch.as_tensor(reference).detach()
        if self.reference.dim() not in (1, 2, 3):
            raise ValueError(f"the reference must be (D,), (K, D) or (N, K, D); got {tuple(self.reference.shape)}.")

    def __call__(self, output: Tensor) -> Tensor:
        if not isinstance(output, Tensor) or output.dim() != 2:
            raise ValueError("EmbeddingSimilarity needs (N, D) embeddings; pass output= to select them.")
        reference = self.reference.to(output.device, output.dtype)
        if reference.shape[-1] != output.shape[1]:
            raise ValueError(f"the reference has {reference.shape[-1]} dimensions but the embeddings have "
                             f"{output.shape[1]}.")
        if reference.dim() == 1:
            return torch.nn.functional.cosine_similarity(output, reference.expand_as(output), dim=1)
        if reference.dim() == 3 and reference.shape[0] != output.shape[0]:
            raise ValueError(f"an (N, K, D) reference holds references for {reference.shape[0]} images; the output "
                             f"has {output.shape[0]} rows. Give (K, D) references shared by every image.")
        references = reference if reference.dim() == 3 else reference.unsqueeze(0)
        return torch.nn.functional.cosine_similarity(output.unsqueeze(1), references, dim=-1)  # (N, K)

    def __repr__(self) -> str:
        return f"EmbeddingSimilarity(reference of shape {tuple(self.reference.shape)})"


class DetectionTarget:
    """Object detection: the score of the predicted box of class ``class_index`` that overlaps
    ``box`` best (IoU), for torchvision-style outputs (a list of dicts with "boxes", "labels" and
    "scores", one per image). box: (4,) x0, y0, x1, y1 for every image, or (N, 4).
    An image with no box of that class overlapping by at least ``min_iou`` (and by more than 0)
    scores 0: a zero map and a warning that says so (``RegionTarget``).
    """

    def __init__(self, box: Sequence[float], class_index: int, min_iou: float = 0.0):
        self.box = torch.as_tensor(box, dtype=torch.float32)
        self.class_index = int(class_index)
        self.min_iou = min_iou

    def matches(self, output: Sequence[Mapping[str, Tensor]]) -> list[Optional[Tensor]]:
        """Per image, the index (among its detections) of the best-overlapping box of the class, or None."""
        from torchvision.ops import box_iou

        if not isinstance(output, (list, tuple)) or not all(isinstance(item, Mapping) for item in output):
            raise ValueError("DetectionTarget needs a list of dicts with 'boxes', 'labels' and 'scores' per image.")
        boxes = self.box.expand(len(output), 4) if self.box.dim() == 1 else self.box
        found: list[Optional[Tensor]] = []
        for image, detections in enumerate(output):
            candidates = (detections["labels"] == self.class_index).nonzero()[:, 0]
            best: Optional[Tensor] = None
            if len(candidates):
                overlaps = box_iou(boxes[image : image + 1].to(detections["boxes"]),
                                   detections["boxes"][candidates].detach())[0]
                if overlaps.max() >= self.min_iou and overlaps.max() > 0:
                    best = candidates[overlaps.argmax()]
            found.append(best)
        return found

    def __call__(self, output: Sequence[Mapping[str, Tensor]]) -> Tensor:
        scores = [detections["scores"][best] if best is not None else detections["scores"].sum() * 0.0
                  for detections, best in zip(output, self.matches(output))]  # no match: zero, still in the graph
        return torch.stack(scores)

    def empty_regions(self, output: Sequence[Mapping[str, Tensor]]) -> Tensor:
        return torch.tensor([best is None for best in self.matches(output)])

    def empty_region_advice(self) -> str:
        return (f"no predicted box of class {self.class_index} overlaps the box {self.box.tolist()} (IoU > 0 and "
                f"at least min_iou={self.min_iou}). Choose a class and a box that the model detects (each "
                "output[n]['labels'] and ['boxes']), or lower min_iou")

    def __repr__(self) -> str:
        return f"DetectionTarget(box={self.box.tolist()}, class_index={self.class_index})"


def _is_integer(value: object) -> bool:
    return isinstance(value, (Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def _contains_names(target: Any) -> bool:
    """Whether a class target names a class anywhere (a str, or a str inside a list or tuple)."""
    if isinstance(target, str):
        return True
    if isinstance(target, np.ndarray):
        return target.dtype.kind in "US"
    return isinstance(target, (list, tuple)) and any(_contains_names(item) for item in target)


def class_index(name: str, class_names: Optional[Sequence[str]]) -> int:
    """The index of the class called ``name`` (case-insensitive) among ``class_names``.

    A name matches a class's whole name, or one of its comma-separated synonyms (ImageNet's
    "tabby, tabby cat" is found as "tabby" and as "tabby cat"). Raises ValueError for a name that
    matches no class (with the closest names) or several, and when no class names are known.
    """
    if class_names is None:
        raise ValueError(
            f"target {name!r} is a class name, but the model's class names are not known: pass class_names= to "
            "the explainer (one name per class, e.g. torchvision's weights.meta['categories']), or give the class "
            "index as an int."
        )
    key = " ".join(name.lower().split())
    whole = [" ".join(str(known).lower().split()) for known in class_names]
    found = [index for index, known in enumerate(whole)
             if key == known or key in (part.strip() for part in known.split(","))]
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(f"{index} ({class_names[index]!r})" for index in found)
        raise ValueError(f"the class name {name!r} matches {len(found)} classes: {listed}. Give the index instead.")
    synonyms = {part.strip(): known for known in whole for part in [known, *known.split(",")]}
    close = difflib.get_close_matches(key, list(synonyms), n=3, cutoff=0.6)
    suggestions = [class_names[whole.index(synonyms[match])] for match in close]
    hint = f" Did you mean {', '.join(repr(str(name)) for name in dict.fromkeys(suggestions))}?" if close else ""
    raise ValueError(f"no class is called {name!r} among the model's {len(class_names)} class names.{hint}")


def class_indices_for_names(target: Target, class_names: Optional[Sequence[str]]) -> Target:
    """``target`` with every class name replaced by its index (``class_index``): a name, a list of
    one name per image, or K names per image, mixed with ints as one likes. Other targets are
    returned as they are."""
    if not _contains_names(target):
        return target

    def indices(item: Any) -> Any:
        if isinstance(item, str):
            return class_index(item, class_names)
        if isinstance(item, np.ndarray):
            return indices(item.tolist())
        if isinstance(item, (list, tuple)):
            return [indices(part) for part in item]
        return item

    return indices(target)


CLASS_HEADS = ("ForImageClassification", "ForSemanticSegmentation")
"""HuggingFace model classes whose ``config.id2label`` names their outputs (a backbone's names its features
nothing: its config may still carry labels, from the classifier it was cut from)."""


def model_class_names(model: nn.Module) -> Optional[list[str]]:
    """The class names a model carries, or None: a HuggingFace classifier's or segmenter's
    ``config.id2label`` (not its "LABEL_0" placeholders), a timm model's ``pretrained_cfg["label_names"]``
    or, for a timm ImageNet classifier, the ImageNet class descriptions ("tabby, tabby cat")."""
    labels = getattr(getattr(model, "config", None), "id2label", None)
    if isinstance(labels, Mapping) and labels and type(model).__name__.endswith(CLASS_HEADS):
        hf_names = [str(labels[index]) for index in sorted(labels)]
        if not all(name == f"LABEL_{index}" for index, name in enumerate(hf_names)):
            return hf_names
    pretrained_cfg = getattr(model, "pretrained_cfg", None)
    if not isinstance(pretrained_cfg, Mapping) or not type(model).__module__.startswith("timm."):
        return None
    names = pretrained_cfg.get("label_names")
    if names is None:
        from timm.data import infer_imagenet_subset

        subset = infer_imagenet_subset(model)
        names = None if subset is None else imagenet_descriptions(subset)
    return [str(name) for name in names] if names is not None and len(names) == model.num_classes else None


@functools.lru_cache(maxsize=4)
def imagenet_descriptions(subset: str) -> tuple[str, ...]:
    """timm's descriptions of an ImageNet subset's classes ("tabby, tabby cat"), read once per subset."""
    from timm.data import ImageNetInfo

    return tuple(ImageNetInfo(subset).label_descriptions())


def _class_index_tensor(target: Any, batch_size: int, device: torch.device) -> tuple[Tensor, bool]:
    """(N, K) indices from an int, a sequence of ints or a nested sequence; and whether K is kept. An int's are made
    on ``device`` (the model output's: no copy from the host), the others on the CPU."""
    if _contains_names(target):
        raise TypeError(f"target {target!r} names classes: here the target must be class indices. An explainer that "
                        "knows the model's class names (Explainer(..., class_names=...)) turns names into indices.")
    if _is_integer(target):
        return torch.full((batch_size, 1), int(target), dtype=torch.long, device=device), False
    if isinstance(target, (list, tuple)) and len(target) == batch_size and all(_is_integer(item) for item in target):
        indices = torch.tensor([[int(item)] for item in target], dtype=torch.long)  # one class per image, as (N, 1)
        if indices.is_inference():  # as below
            with torch.inference_mode(False):
                indices = indices.clone()
        return indices, False
    try:
        indices = torch.as_tensor(target).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            "target must be None, an int, a sequence of ints (one per image), a sequence of "
            f"sequences of ints (K per image, the same K for all) or a callable; got {target!r}."
        ) from error
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"class targets must be integers; got {target!r}.")
    indices = indices.long()
    if indices.is_inference():  # made in the caller's inference_mode: autograd cannot keep it for gather's backward
        with torch.inference_mode(False):
            indices = indices.clone()
    if indices.dim() == 0:
        return indices.expand(batch_size).reshape(batch_size, 1).clone(), False
    if indices.dim() > 2:
        raise ValueError(f"class targets have {indices.dim()} dimensions; give at most (N, K).")
    if indices.shape[0] != batch_size:
        raise ValueError(
            f"{indices.shape[0]} targets were given for a batch of {batch_size} images. Give one "
            "target per image, a single int for all images, or target=None for each image's top class."
        )
    if indices.dim() == 1:
        return indices.reshape(batch_size, 1), False
    return indices, True


def select_targets(
    output: Any, target: Target = None, topk: Optional[int] = None, batch_size: Optional[int] = None
) -> SelectedTargets:
    """Select the scalar(s) to explain from a model's output.

    output: the model's output; (N, C) class scores for class targets, anything a
        callable target understands otherwise.
    Returns SelectedTargets with (N, K) scores.
    """
    if callable(target) and not isinstance(target, Tensor):
        if topk is not None:
            raise ValueError("topk selects classes; it cannot be combined with a callable target.")
        scores = target(output)
        if not isinstance(scores, Tensor) or scores.dim() not in (1, 2):
            shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise ValueError(
                f"a target callable must return a tensor of shape (N,) or (N, K); it returned {shape}."
            )
        if batch_size is not None and scores.shape[0] != batch_size:
            raise ValueError(
                f"the target callable returned {scores.shape[0]} scores for a batch of {batch_size} images."
            )
        if not scores.is_floating_point():
            raise TypeError(
                f"the target callable must return floating-point scores; got {str(scores.dtype)[len('torch.'):]}. "
                "Integer and bool scores have no gradient: return the score itself (lambda out: out[:, 0], not "
                "out[:, 0].long() or out[:, 0] > 0), or call .float() on the logits you compare."
            )
        keep = scores.dim() == 2
        scores = scores.reshape(scores.shape[0], -1)
        check_finite_scores(scores)
        selected = SelectedTargets(scores, None, keep, target_function=target)
        if isinstance(target, RegionTarget):
            with torch.no_grad():
                empty = target.empty_regions(output).to(scores.device, torch.bool)
            selected.empty_region = empty.reshape(scores.shape[0], -1).expand_as(scores)
            selected.empty_region_advice = target.empty_region_advice()
        return selected

    if not isinstance(output, Tensor) or output.dim() != 2:
        returned = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ValueError(
            f"class targets need a model output of shape (N, num_classes); this model returns {returned}. "
            "Pass a callable target, f(output) -> Tensor[N], that selects the score to explain"
            + (". For a detector, explain its detections: explain(image, instances='all' | k | a score threshold | "
               "boxes)." if is_detector_output(output) or (isinstance(output, (list, tuple)) and output
                                                           and isinstance(output[0], Mapping)) else ".")
        )
    count, num_classes = output.shape
    if batch_size is not None and count != batch_size:
        raise ValueError(f"the model returned {count} rows of scores for a batch of {batch_size} images.")
    if topk is not None:
        if target is not None:
            raise ValueError("give either target or topk, not both.")
        if not _is_integer(topk) or not 1 <= topk <= num_classes:
            raise ValueError(f"topk must be an int between 1 and the number of classes ({num_classes}); got {topk!r}.")
        indices = output.detach().topk(int(topk), dim=1).indices
        keep = True
    elif target is None:
        indices = output.detach().argmax(dim=1, keepdim=True)
        keep = False
    else:
        indices, keep = _class_index_tensor(target, count, output.device)
        _check_class_range(target, indices, num_classes)
        indices = indices.to(output.device)
    scores = output.gather(1, indices)
    check_finite_scores(scores)
    with torch.no_grad():  # outside the graph (no detached copy of the output needed)
        probabilities = class_probabilities(output.float()).gather(1, indices)
    return SelectedTargets(scores, indices, keep, probabilities)


def class_probabilities(output: Tensor) -> Tensor:
    """(N, C) class scores (logits) → (N, C) probabilities in [0, 1]: the softmax over the C classes; for one
    column (C = 1, a binary classifier's logit, trained with a sigmoid) the sigmoid, the probability of its
    positive class (a softmax over one column is 1 whatever the input)."""
    return output.sigmoid() if output.shape[1] == 1 else output.softmax(dim=1)


def _check_class_range(target: Any, indices: Tensor, num_classes: int) -> None:
    """Raise when a class index is outside [0, num_classes); read from ``target`` itself when it is Python ints
    (no tensor operation), else from the (CPU) index tensor."""
    if _is_integer(target):
        values: Sequence[int] = [int(target)]
    elif isinstance(target, (list, tuple)) and all(_is_integer(item) for item in target):
        values = [int(item) for item in target]
    else:
        values = [value for row in indices.tolist() for value in row]  # (N, K) on the CPU: read, no operation
    outside = [value for value in values if not 0 <= value < num_classes]
    if outside:
        raise ValueError(f"class index {outside[0]} is out of range: the model has {num_classes} classes (0 to "
                         f"{num_classes - 1}).")


def check_finite_scores(scores: Tensor) -> None:
    """Raise when a score to explain is NaN or inf, naming the images and targets: a map of it
    would be meaningless (all zeros, or a normal-looking map of an overflow). Decided at the end of an explainer
    call (``explain.core.checks``)."""
    with torch.no_grad():
        values = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    check(values, lambda host: _raise_if_not_finite(host, scores.shape))


def _raise_if_not_finite(host: list[float], shape: Sequence[int]) -> None:
    targets = shape[1] if len(shape) > 1 else 1
    bad = [(i // targets, i % targets, value) for i, value in enumerate(host) if not math.isfinite(value)]
    if bad:
        listed = ", ".join(f"image {n}, target {k}: {value}" for n, k, value in bad[:6])
        raise ValueError(
            f"the score to explain is not finite ({listed}). The model's output overflowed (check the input's "
            "range and preprocessing; float16 overflows above 65504: run the model in float32) or the target "
            "callable returned NaN or inf."
        )
