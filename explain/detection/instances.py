"""Detected instances and the scalar explained for each: found again in every forward a method makes.

A detection is (box, class, score). A method explaining it runs the detector on the image, and often on perturbed,
masked or interpolated copies, where boxes move. In every forward, an instance's scalar is the class score of the
candidate most similar to it (D-RISE's similarity of Petsiuk et al. 2021: IoU of the boxes × cosine of the class
vectors × objectness), among the candidates whose box overlaps the instance's by at least ``min_iou``. Where none
does, the instance has disappeared from that forward: it is scored 0 there and the call says so (``missing``),
never silently.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn
from torchvision.ops import batched_nms, box_iou

from ..core.call_record import explained_batch_shape
from ..core.caller import warn_at_callers_line
from ..core.capture import preserved_model_state
from .candidates import Candidates, candidates_of, detector_family

DEFAULT_SCORE_THRESHOLD = 0.3
"""``instances="all"``: the detections whose score reaches this."""

NMS_IOU = 0.5
"""Detections of one class overlapping by more than this IoU are one instance (the higher score kept), for the
families whose output is before non-maximum suppression (YOLO, the {"boxes", "scores"} models)."""

MIN_IOU = 0.5
"""The overlap with an instance's box below which a candidate is not that instance (``InstanceTarget``'s
``min_iou``)."""

QUANTITIES = ("score", "x0", "y0", "x1", "y1")
"""What an ``InstanceTarget`` explains of its instance: its class score, or one coordinate of its box (ODAM's
box maps)."""


@dataclass
class Instances:
    """K instances per image of N images (padded where an image has fewer).

    boxes: (N, K, 4) x0, y0, x1, y1 in the input's pixels; classes: (N, K) long; scores: (N, K) the detector's
    scores (NaN where given by the caller); present: (N, K) bool, False for padding.
    """

    boxes: Tensor
    classes: Tensor
    scores: Tensor
    present: Tensor

    @property
    def count(self) -> int:
        """K, the instances per image (with padding)."""
        return self.boxes.shape[1]


InstanceSpec = Union[str, int, float, Tensor, np.ndarray, Instances]
"""What ``explain(..., instances=...)`` takes: "all" (every detection scoring at least
``DEFAULT_SCORE_THRESHOLD``), an int k (each image's k highest-scoring detections, whatever their score), a float in
(0, 1) (the detections scoring at least that), boxes ((K, 4) for every image or (N, K, 4), x0, y0, x1, y1 in the
input's pixels, a tensor, an ndarray or nested lists: each explained as the class of the detection that overlaps it
most), or ``Instances``."""


def given_boxes(spec: Any) -> bool:
    """Whether ``spec`` gives boxes (a tensor, an ndarray, or a non-empty list or tuple)."""
    return isinstance(spec, (Tensor, np.ndarray)) or (isinstance(spec, (list, tuple)) and len(spec) > 0)


def final_detections(candidates: Candidates, family: Optional[str], iou_threshold: float = NMS_IOU
                     ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per image, the detector's final detections (boxes (D, 4), classes (D,), scores (D,)), highest score first: its
    own output for torchvision (already after NMS and its score threshold), each query's best class for DETR-style
    models (which need no NMS), each candidate's best class after per-class NMS for the others. Detections whose
    box has no area (clipped to a side of the image: a random-weight FCOS or RetinaNet has many) are left out: no
    box overlaps them, so no forward could find them again; so are those whose box or scores are not finite."""
    found = []
    with torch.no_grad():
        for boxes, scores, valid in zip(candidates.boxes, candidates.scores, candidates.valid):
            valid = valid & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1]) & scores.isfinite().all(dim=-1)
            best, classes = scores[valid].max(dim=-1)
            boxes = boxes[valid]
            if family not in ("torchvision", "huggingface"):
                kept = batched_nms(boxes.float(), best.float(), classes, iou_threshold)
                boxes, best, classes = boxes[kept], best[kept], classes[kept]
            order = best.argsort(descending=True)
            found.append((boxes[order].detach(), classes[order], best[order].detach()))
    return found


def _padded(rows: list[tuple[Tensor, Tensor, Tensor]], device: torch.device) -> Instances:
    count = max((len(classes) for _, classes, _ in rows), default=0)
    images = len(rows)
    boxes = torch.zeros(images, count, 4, device=device)
    classes = torch.zeros(images, count, dtype=torch.long, device=device)
    scores = torch.full((images, count), float("nan"), device=device)
    present = torch.zeros(images, count, dtype=torch.bool, device=device)
    for image, (image_boxes, image_classes, image_scores) in enumerate(rows):
        found = len(image_classes)
        boxes[image, :found] = image_boxes.float()
        classes[image, :found] = image_classes
        scores[image, :found] = image_scores.float()
        present[image, :found] = True
    return Instances(boxes, classes, scores, present)


def unusable_boxes(boxes: Tensor) -> Tensor:
    """(..., 4) boxes x0, y0, x1, y1 → (...) bool: True where a box is not finite or has no area."""
    return ~torch.isfinite(boxes).all(dim=-1) | (boxes[..., 2] <= boxes[..., 0]) | (boxes[..., 3] <= boxes[..., 1])


def check_instances(instances: Instances, images: Optional[int] = None, classes: Optional[int] = None,
                    values: bool = True) -> None:
    """A clear error for ``Instances`` a detector's output cannot score: shapes or dtypes that disagree, and
    (``values``) another number of images than ``images`` or class indices outside [0, ``classes``), each checked
    where given."""
    if not isinstance(instances, Instances):
        raise TypeError(f"instances must be explain.detection.Instances; got {type(instances).__name__}.")
    boxes, labels, present = instances.boxes, instances.classes, instances.present
    shape = tuple(boxes.shape)
    if (boxes.dim() != 3 or shape[-1] != 4 or tuple(labels.shape) != shape[:2]
            or tuple(present.shape) != shape[:2] or tuple(instances.scores.shape) != shape[:2]):
        raise ValueError(f"Instances need boxes (N, K, 4) and classes, scores, present (N, K); got boxes {shape}, "
                         f"classes {tuple(labels.shape)}, scores {tuple(instances.scores.shape)}, present "
                         f"{tuple(present.shape)}.")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or present.dtype != torch.bool:
        raise ValueError(f"Instances need integer classes and bool present; got {labels.dtype} and {present.dtype}.")
    if not values:
        return
    if images is not None and shape[0] != images:
        raise ValueError(f"the Instances are for {shape[0]} image(s), the batch explained has {images}: give one row "
                         "of instances per image (detect them on this batch: explain.detection.detect).")
    kept = boxes[present]
    bad = unusable_boxes(kept)
    if bad.any():
        index = tuple(present.nonzero()[int(bad.nonzero()[0])].tolist())
        raise ValueError(f"instance {index}'s box is {boxes[index].tolist()}: the box of an instance present must be "
                         "finite x0, y0, x1, y1 in the input's pixels with x1 > x0 and y1 > y0 (mark padding with "
                         "present=False).")
    wanted = labels[present]
    if wanted.numel():
        low, high = int(wanted.min()), int(wanted.max())
        if low < 0:
            raise ValueError(f"an instance's class index is {low}: class indices are ≥ 0.")
        if classes is not None and high >= classes:
            raise ValueError(f"an instance's class index is {high}: the detector scores {classes} classes, indices 0 "
                             f"to {classes - 1}.")


def select_instances(candidates: Candidates, family: Optional[str], spec: InstanceSpec,
                     size: Optional[Sequence[int]] = None) -> Instances:
    """The instances ``spec`` names (see ``InstanceSpec``) among the detections of each image; ``size``: (H, W) of
    the input, where given boxes lying wholly outside it are padding."""
    device = candidates.boxes.device
    if isinstance(spec, Instances):
        check_instances(spec, candidates.boxes.shape[0], candidates.classes)
        return spec
    if isinstance(spec, (Tensor, np.ndarray)) and spec.ndim == 0:  # a number held in a tensor: k or a threshold
        spec = spec.item()
    if isinstance(spec, (list, tuple)) and not spec:
        raise ValueError(f"instances={spec!r} gives no box: give boxes x0, y0, x1, y1 ((K, 4), K ≥ 1), or "
                         "instances='all' / k / a score threshold for the detector's detections.")
    if given_boxes(spec):
        try:
            boxes = torch.as_tensor(spec, dtype=torch.float32, device=device)
        except (ValueError, TypeError) as error:
            raise ValueError(f"boxes for instances must be one (K, 4) or (N, K, 4) array of x0, y0, x1, y1 (the same "
                             f"K for every image: give explain.detection.Instances, with present=False for padding, "
                             f"for different counts per image); torch could not read them: {error}") from None
        return _instances_at_boxes(candidates, boxes, size)
    final = final_detections(candidates, family)
    if isinstance(spec, str):
        if spec != "all":
            raise ValueError(f"instances must be 'all', an int k (top k), a score threshold in (0, 1), boxes or "
                             f"Instances; got {spec!r}.")
        threshold = DEFAULT_SCORE_THRESHOLD
        return _padded([(b[s >= threshold], c[s >= threshold], s[s >= threshold]) for b, c, s in final], device)
    if isinstance(spec, bool) or not isinstance(spec, numbers.Real):
        raise TypeError(f"instances must be 'all', an int k, a score threshold, boxes or Instances; got "
                        f"{type(spec).__name__}.")
    if isinstance(spec, numbers.Integral):
        if spec < 1:
            raise ValueError(f"instances=k takes each image's k highest-scoring detections: k must be ≥ 1; got {spec}.")
        return _padded([(b[:spec], c[:spec], s[:spec]) for b, c, s in final], device)
    least = float(spec)
    if not 0 < least < 1:
        raise ValueError(f"a score threshold for instances must be in (0, 1); got {spec}.")
    return _padded([(b[s >= least], c[s >= least], s[s >= least]) for b, c, s in final], device)


def wholly_outside(boxes: Tensor, size: Sequence[int]) -> Tensor:
    """(..., 4) boxes x0, y0, x1, y1 → (...) bool: True where a box lies wholly outside an input of ``size`` (H, W)."""
    height, width = int(size[-2]), int(size[-1])
    return (boxes[..., 0] >= width) | (boxes[..., 1] >= height) | (boxes[..., 2] <= 0) | (boxes[..., 3] <= 0)


def _instances_at_boxes(candidates: Candidates, boxes: Tensor, size: Optional[Sequence[int]] = None) -> Instances:
    """Boxes given by the caller, each with the class of the candidate that overlaps it most (score × IoU); boxes
    lying wholly outside an input of ``size`` (H, W), where given, are padding."""
    images = candidates.boxes.shape[0]
    if boxes.dim() == 1:
        boxes = boxes[None]
    if boxes.dim() == 2:
        boxes = boxes.expand(images, *boxes.shape)
    if boxes.dim() != 3 or boxes.shape[-1] != 4 or boxes.shape[0] != images:
        raise ValueError(f"boxes for instances must be (4,), (K, 4) for every image or (N, K, 4) with N = {images}, "
                         f"x0, y0, x1, y1 in the input's pixels; got {tuple(boxes.shape)}.")
    bad = unusable_boxes(boxes)
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"box {index} for instances is {boxes[index].tolist()}: a box must be finite x0, y0, x1, y1 "
                         "in the input's pixels with x1 > x0 and y1 > y0.")
    with torch.no_grad():
        overlaps = torch.stack([box_iou(given, found.float()) for given, found in zip(boxes, candidates.boxes)])
        agreement = overlaps[..., None] * candidates.scores.float()[:, None] * candidates.valid[:, None, :, None]
        best = agreement.flatten(2).max(dim=-1)
        classes = best.indices % candidates.classes
        present = best.values > 0
        if size is not None:  # a candidate reaching past the image's side does not make an outside box an instance
            present &= ~wholly_outside(boxes, size)
    return Instances(boxes.clone(), classes, torch.full(classes.shape, float("nan"), device=boxes.device), present)


def detect(model: nn.Module, batch: Tensor, spec: InstanceSpec = "all", output: Any = None,
           warn_unmatched: bool = True) -> Instances:
    """The instances ``spec`` names (``InstanceSpec``) in a prepared (N, C, H, W) batch, found with one forward pass
    without a graph in eval mode (the model's modes restored after), or in ``output``, the model's eval-mode output
    for ``batch``, when given. Given boxes that overlap no detection are padding, said in a warning
    (``warn_unmatched``); a ValueError starting "no instance selected" where nothing is selected in any image."""
    if output is None:
        with torch.no_grad(), preserved_model_state(model):
            output = model(batch)
    family = detector_family(model)
    candidates = candidates_of(output, model, batch.shape[-2:], family)
    instances = select_instances(candidates, family, spec, batch.shape[-2:])
    if given_boxes(spec) and instances.count:
        unmatched = (~instances.present).nonzero().tolist()
        outside = wholly_outside(instances.boxes, batch.shape[-2:])
        shown = ", ".join(f"({image}, {index}) {[round(value, 1) for value in instances.boxes[image, index].tolist()]}"
                          + (f" (wholly outside the {batch.shape[-2]} × {batch.shape[-1]} input)"
                             if outside[image, index] else "")
                          for image, index in unmatched[:6]) + (" …" if len(unmatched) > 6 else "")
        if len(unmatched) == instances.present.numel():
            raise ValueError(f"no instance selected by the boxes given: none overlaps a detection of the detector (a "
                             f"candidate with a score > 0), so there is nothing to explain. (image, box): {shown}. "
                             f"{_BOX_ADVICE}")
        if unmatched and warn_unmatched:
            warn_at_callers_line(f"boxes given for instances overlap no detection of the detector (no candidate with "
                                 f"a score > 0 overlaps them): their maps are empty and drawn as 'no instance'. "
                                 f"(image, box): {shown}. {_BOX_ADVICE}", RuntimeWarning)
    broken = _non_finite_images(candidates)
    if broken and len(broken) < candidates.boxes.shape[0]:
        warn_at_callers_line(f"the detector's output holds NaN or infinite boxes or scores for image(s) "
                             f"{', '.join(map(str, broken[:8]))}{' …' if len(broken) > 8 else ''}: their detections "
                             "that are not finite are not explained. Check those images (NaN or infinite pixels?).",
                             RuntimeWarning)
    if not instances.present.any():
        if len(broken) == candidates.boxes.shape[0]:
            raise ValueError(f"no instance selected by instances={spec!r}: the detector's output holds NaN or "
                             "infinite boxes or scores for every image. Check the images (NaN or infinite pixels?) "
                             "and the model's weights.")
        if family == "torchvision" and not candidates.valid.any():
            raise ValueError(f"no instance selected by instances={spec!r}: {type(model).__name__} returned no "
                             "detection at all for these images. torchvision detectors drop the detections scoring "
                             f"below their own threshold ({_torchvision_threshold(model)}) before explain sees them: "
                             "build the detector with a lower one (box_score_thresh=0.0 for Faster / Mask / Keypoint "
                             "R-CNN, score_thresh=0.0 for RetinaNet, FCOS, SSD), or check that the images are what "
                             "the detector expects.")
        best = float(candidates.scores.max()) if candidates.scores.numel() else float("nan")
        raise ValueError(f"no instance selected by instances={spec!r} in any image (no detection reaches the score "
                         f"threshold, or no box was given; the highest score is {best:.3g}): give a lower threshold, "
                         "or instances=k for each image's k highest-scoring detections.")
    return instances


def _non_finite_images(candidates: Candidates) -> list[int]:
    """The images whose output holds a box or a score that is not finite (among its valid candidates)."""
    with torch.no_grad():
        finite = candidates.boxes.isfinite().all(dim=-1) & candidates.scores.isfinite().all(dim=-1)
        return (candidates.valid & ~finite).any(dim=-1).nonzero()[:, 0].tolist()


_BOX_ADVICE = ("Give boxes x0, y0, x1, y1 in the model input's pixels where the detector finds something, or "
               "instances='all' / k for its detections.")


def _torchvision_threshold(model: nn.Module) -> str:
    """A torchvision detector's own score threshold, as its attribute's path and value."""
    for path in ("roi_heads.score_thresh", "score_thresh"):
        module: Any = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, (int, float)):
            return f"model.{path} = {module}"
    return "unknown"


class InstanceTarget:
    """Target of an explanation: K detected instances per image, each scored in every forward by the candidate most
    similar to it (see the module's docstring).

    instances: the reference instances (``Instances``, in the input's pixels). model: the detector (its family says
    how to read its output). input_size: (H, W) of the model input the instances' boxes are in, or None: inside an
    ``explain`` call, the size of the batch explained (a size given that differs from it is refused: the boxes
    would be read in another input's pixels); outside one, needed for transformers detectors (whose boxes are
    fractions of the input). quantity: "score" (the matched candidate's class score)
    or a box coordinate "x0", "y0", "x1", "y1" (ODAM's box maps). weight_by_iou: the class score times the IoU of
    the matched box with the instance's (the box's agreement; in the graph through the box). min_iou: the overlap
    below which a candidate is not the instance.
    Called on the model's output for the N images, returns (N, K) scores; ``scores_for_rows`` scores copies.
    """

    def __init__(self, instances: Instances, model: nn.Module, input_size: Optional[Sequence[int]] = None,
                 quantity: str = "score", weight_by_iou: bool = False, min_iou: float = MIN_IOU):
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {', '.join(QUANTITIES)}; got {quantity!r}.")
        if not 0 <= min_iou < 1:
            raise ValueError(f"min_iou must be in [0, 1); got {min_iou!r}.")
        check_instances(instances, values=False)
        self.instances = instances
        self.model = model
        self.family = detector_family(model)
        self.input_size = None if input_size is None else _size_pair(input_size)
        self.quantity = quantity
        self.weight_by_iou = bool(weight_by_iou)
        self.min_iou = float(min_iou)
        self.missing = torch.zeros(instances.present.shape, dtype=torch.long)
        self.scored = torch.zeros(instances.present.shape, dtype=torch.long)
        self._checked = False  # the instances' class indices against the detector's classes, on the first output

    def for_call(self) -> InstanceTarget:
        """A copy for one call: the same instances and settings, its own counts of missing instances (a target
        given to several calls, or threads, counts each call alone)."""
        return InstanceTarget(self.instances, self.model, self.input_size, self.quantity, self.weight_by_iou,
                              self.min_iou)

    def candidates(self, output: Any) -> Candidates:
        """The candidates of the model's output (for rows of the input's size: ``size``)."""
        candidates = candidates_of(output, self.model, self.size(), self.family)
        if not self._checked:
            check_instances(self.instances, classes=candidates.classes)
            self._checked = True
        return candidates

    def size(self) -> tuple[int, int]:
        """(H, W) of the inputs whose output is read: the batch of the ``explain`` call in progress, else
        ``input_size``. A clear error where the two differ, or where neither is known and the detector's boxes are
        fractions of the input (transformers)."""
        explained = _explained_size()
        if explained is not None:
            if self.input_size is not None and self.input_size != explained:
                raise ValueError(f"the InstanceTarget was made with input_size={self.input_size}, but the batch "
                                 f"explained is {explained[0]} × {explained[1]} pixels (after preprocessing): its "
                                 "instances' boxes would be read in another input's pixels. Give the boxes in the "
                                 "pixels of the model-input batch explained and input_size=batch.shape[-2:] (or leave "
                                 "input_size out): detect them on that batch, explain.detection.detect(model, batch).")
            return explained
        if self.input_size is not None:
            return self.input_size
        if self.family == "huggingface":
            raise ValueError(f"{type(self.model).__name__}'s boxes are fractions of its input, and this InstanceTarget "
                             "was called outside an explain call without input_size: give input_size=(H, W), the "
                             "model-input batch's batch.shape[-2:].")
        return (0, 0)  # not read: the other families give boxes in pixels

    def similarity(self, candidates: Candidates, image_index: Tensor, gated: bool = True) -> tuple[Tensor, Tensor]:
        """D-RISE's similarity of each candidate of each row to each instance of the row's image, (R, K, P):
        IoU × cos(one-hot class, class vector) × objectness, 0 for padding and (``gated``) for candidates
        overlapping less than ``min_iou`` (D-RISE's own weights are not gated); and the IoUs (R, K, P), in the
        graph."""
        references = self.instances.boxes[image_index.to(self.instances.boxes.device)]  # (R, K, 4)
        boxes = candidates.boxes
        overlaps = _pairwise_iou(references.to(boxes), boxes)  # (R, K, P)
        classes = self.instances.classes[image_index.to(self.instances.classes.device)].to(boxes.device)
        with torch.no_grad():
            probabilities = candidates.probabilities.detach().float()
            norms = probabilities.norm(dim=-1).clamp_min(1e-12)  # (R, P)
            of_class = candidates.probabilities.detach().float().gather(
                2, classes[:, None, :].expand(-1, probabilities.shape[1], -1).clamp(max=probabilities.shape[-1] - 1)
            ).transpose(1, 2)  # (R, K, P)
            similarity = overlaps.detach().float() * of_class / norms[:, None] * candidates.objectness.detach()[:, None]
            least = max(self.min_iou, 1e-12) if gated else 1e-12
            usable = (overlaps.detach() >= least) & candidates.valid[:, None]
            similarity = torch.where(usable, similarity, torch.zeros_like(similarity))
        return similarity, overlaps

    def scores_for_rows(self, output: Any, image_index: Tensor) -> Tensor:
        """(R, K) the instances' scalars on the model's output for R rows, row r a copy of image ``image_index[r]``;
        0 (in the graph) where an instance is not found, counted in ``missing``."""
        return self._scores(self.candidates(output), image_index)

    def _scores(self, candidates: Candidates, image_index: Tensor) -> Tensor:
        similarity, overlaps = self.similarity(candidates, image_index)
        rows, count = similarity.shape[:2]
        if similarity.shape[-1] == 0:
            matched = torch.zeros(rows, count, dtype=torch.long, device=similarity.device)
            found = torch.zeros(rows, count, dtype=torch.bool, device=similarity.device)
        else:
            best = similarity.max(dim=-1)
            matched, found = best.indices, best.values > 0
        classes = self.instances.classes[image_index.to(self.instances.classes.device)].to(matched.device)
        if similarity.shape[-1] == 0:
            values = candidates.scores.sum() * torch.zeros(rows, count, device=similarity.device)
        elif self.quantity == "score":
            scores = candidates.scores.gather(1, matched[..., None].expand(-1, -1, candidates.classes))  # (R, K, C)
            values = scores.gather(2, classes[..., None].clamp(max=candidates.classes - 1))[..., 0]
            if self.weight_by_iou:
                values = values * overlaps.gather(2, matched[..., None])[..., 0].to(values.dtype)
        else:
            coordinate = QUANTITIES.index(self.quantity) - 1
            values = candidates.boxes.gather(1, matched[..., None].expand(-1, -1, 4))[..., coordinate]
        present = self.instances.present[image_index.to(self.instances.present.device)].to(found.device)
        values = torch.where(found & present, values, values * 0)
        with torch.no_grad():
            index = image_index.cpu()
            self.scored.index_add_(0, index, present.cpu().long())
            self.missing.index_add_(0, index, (present & ~found).cpu().long())
        return values

    def __call__(self, output: Any) -> Tensor:
        candidates = self.candidates(output)
        self._check_images(candidates.boxes.shape[0])
        return self._scores(candidates, torch.arange(candidates.boxes.shape[0], device=candidates.boxes.device))

    def _check_images(self, images: int) -> None:
        held = self.instances.present.shape[0]
        if images != held and _explained_images() == held:
            raise ValueError(f"the method scored the instances on {images} rows that are not the {held} image(s) "
                             "explained (windows, crops or rescaled copies of them, as SESS makes): an instance's box "
                             "is in the images' own pixels and cannot be found in them. Explain instances with a "
                             "method that runs the detector on whole images (Grad-CAM, ODAM, D-RISE, Saliency, ...).")
        if images != held:
            raise ValueError(f"the InstanceTarget holds instances for {self.instances.present.shape[0]} image(s), the "
                             f"batch explained has {images}: give one row of instances per image (detect them on this "
                             "batch: explain.detection.detect).")

    def empty_regions(self, output: Any) -> Tensor:
        """(N, K) bool: padding (an image with fewer instances than K) and instances not found in ``output``."""
        with torch.no_grad():
            candidates = self.candidates(output)
            self._check_images(candidates.boxes.shape[0])
            similarity, _ = self.similarity(candidates, torch.arange(candidates.boxes.shape[0],
                                                                    device=candidates.boxes.device))
            found = similarity.amax(dim=-1) > 0 if similarity.shape[-1] else torch.zeros(
                similarity.shape[:2], dtype=torch.bool, device=similarity.device)
        return ~(found & self.instances.present.to(found.device))

    def empty_region_advice(self) -> str:
        return ("no detection of the instance's class overlaps its box by the IoU min_iou="
                f"{self.min_iou}. Give the "
                "instances the model detects (instances='all', a number, a score threshold), or lower min_iou")

    def explained_boxes(self) -> Tensor:
        """(N, K, 4) the instances' boxes, NaN for padding (``Explanation.boxes``)."""
        boxes = self.instances.boxes.float().clone()
        boxes[~self.instances.present] = float("nan")
        return boxes

    def warn_about_missing(self, method: str) -> None:
        """One warning when instances disappeared from some of the forwards of the call (perturbed copies)."""
        missing = (self.missing > 0) & (self.scored > self.missing)
        if not missing.any():
            return
        pairs = missing.nonzero().tolist()
        shown = ", ".join(f"({image}, {instance}): {int(self.missing[image, instance])} of "
                          f"{int(self.scored[image, instance])}" for image, instance in pairs[:6])
        warn_at_callers_line(
            f"{method}: instances disappeared from some of the forward passes it made (perturbed or interpolated "
            f"copies of the image: no candidate of the instance's class overlapped its box by IoU ≥ "
            f"{self.min_iou}), and were scored 0 there. (image, instance): passes without it: {shown}"
            f"{' …' if len(pairs) > 6 else ''}.", RuntimeWarning)

    def __repr__(self) -> str:
        return (f"InstanceTarget({self.instances.count} instance(s) per image, quantity={self.quantity!r}, "
                f"weight_by_iou={self.weight_by_iou}, min_iou={self.min_iou})")


def _size_pair(size: Sequence[int]) -> tuple[int, int]:
    """``input_size`` as (H, W), checked."""
    try:
        pair = tuple(int(side) for side in size)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(f"input_size must be (H, W) in pixels, the model-input batch's batch.shape[-2:]; got "
                         f"{size!r}.")
    return (pair[0], pair[1])


def _explained_size() -> Optional[tuple[int, int]]:
    """(H, W) of the batch of this thread's ``explain`` call in progress, or None outside one."""
    shape = explained_batch_shape()
    return None if shape is None else (shape[-2], shape[-1])


def _explained_images() -> Optional[int]:
    """N, the images of this thread's ``explain`` call in progress, or None outside one."""
    shape = explained_batch_shape()
    return None if shape is None else shape[0]


def _pairwise_iou(references: Tensor, boxes: Tensor) -> Tensor:
    """(R, K, 4) and (R, P, 4) x0, y0, x1, y1 → (R, K, P) IoU, differentiable in both."""
    left_top = torch.maximum(references[:, :, None, :2], boxes[:, None, :, :2])
    right_bottom = torch.minimum(references[:, :, None, 2:], boxes[:, None, :, 2:])
    sides = (right_bottom - left_top).clamp(min=0)
    intersection = sides[..., 0] * sides[..., 1]
    area_references = ((references[..., 2] - references[..., 0]).clamp(min=0)
                       * (references[..., 3] - references[..., 1]).clamp(min=0))
    area_boxes = (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)
    union = area_references[:, :, None] + area_boxes[:, None, :] - intersection
    return intersection / union.clamp_min(1e-12)
