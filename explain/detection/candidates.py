"""A detector's output as candidates: every box it proposes with its class scores, before non-maximum suppression
where the detector has a stage before it.

The families read here (``detector_family``):

    "torchvision"   Faster / Mask R-CNN, RetinaNet, FCOS, SSD (``torchvision.models.detection``): eval-mode output, a
                    list of dicts with "boxes", "labels", "scores" per image (after its own NMS and score threshold)
    "huggingface"   DETR-style models of transformers (DETR, Conditional / Deformable DETR, RT-DETR, ...): ``logits``
                    (N, Q, C) with sigmoid class scores, or (N, Q, C + 1) with a softmax and a last no-object class,
                    and ``pred_boxes`` (N, Q, 4) centre x, y, width, height in [0, 1] of the input
    "ultralytics"   YOLOv8 / YOLO11 ``DetectionModel`` (not end-to-end heads): (N, 4 + C, A) centre x, y, width,
                    height in input pixels and sigmoid class scores per anchor, first of its eval-mode output
    "boxes-scores"  any model returning {"boxes": (N, P, 4) x0, y0, x1, y1 in input pixels, "scores": (N, P, C) in
                    [0, 1]} (the shipped demo detector)

Every tensor stays in the autograd graph: a candidate's class score or box coordinate is what a gradient method
explains.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

FAMILIES = ("torchvision", "huggingface", "ultralytics", "boxes-scores")

HUGGINGFACE_DETECTORS = ("detr", "conditional_detr", "deformable_detr", "rt_detr", "rt_detr_v2", "dab_detr", "d_fine",
                         "deta", "yolos", "table-transformer")
"""``config.model_type`` of the transformers detectors whose output has ``logits`` and ``pred_boxes``."""


@dataclass
class Candidates:
    """The boxes a detector proposes for R images (rows) and their class scores.

    boxes: (R, P, 4) x0, y0, x1, y1 in the input's pixels. scores: (R, P, C) each class's score in [0, 1], the
    scalar explained for an instance of that class (sigmoid or softmax probability; for torchvision's output, the
    detection's score at its label and 0 elsewhere). probabilities: (R, P, C') the class vector of D-RISE's
    similarity (with the no-object class where the detector has one). objectness: (R, P) in [0, 1]. valid: (R, P)
    bool, False for the padding of images with fewer detections.
    """

    boxes: Tensor
    scores: Tensor
    probabilities: Tensor
    objectness: Tensor
    valid: Tensor

    @property
    def classes(self) -> int:
        """C, the number of classes a score is given for."""
        return self.scores.shape[-1]


def detector_family(model: nn.Module) -> Optional[str]:
    """The detector family of ``model`` (see the module's docstring), or None when it is not a detector read here
    (then only a model returning {"boxes", "scores"} is taken, decided on its output)."""
    module = type(model).__module__
    if module.startswith("torchvision.models.detection"):
        return "torchvision"
    if module.startswith("ultralytics"):
        return "ultralytics"
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in HUGGINGFACE_DETECTORS:
        return "huggingface"
    return None


def check_detector(model: nn.Module) -> None:
    """A clear error for models a detection explanation cannot read: Ultralytics' ``YOLO`` wrapper (its forward
    predicts from files and runs NMS: give its ``.model``) and end-to-end YOLO heads (NMS-free outputs)."""
    if type(model).__name__ in ("YOLO", "Model", "RTDETR") and hasattr(model, "predictor"):
        raise TypeError(f"this is Ultralytics' {type(model).__name__} wrapper, whose forward runs its own "
                        "preprocessing and NMS: explain its network, `yolo.model` (a DetectionModel).")
    if detector_family(model) == "ultralytics":
        layers: Any = getattr(model, "model", None)
        head = layers[-1] if layers is not None and len(layers) else None
        if getattr(head, "end2end", False):
            raise ValueError("this YOLO model has an end-to-end (NMS-free) head, whose output is already its final "
                             "detections; explain reads the per-anchor scores of YOLOv8 / YOLO11 Detect heads.")


class _StraightThroughClamp(torch.autograd.Function):
    """``values.clamp(low, high)`` forward (the same values), the gradient passed on unchanged backward."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, low: float, high: float) -> Tensor:
        return values.clamp(min=low, max=high)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, None, None]:
        return gradient, None, None


def _straight_through_clip(boxes: Tensor, size: tuple[int, int]) -> Tensor:
    """torchvision's ``clip_boxes_to_image`` (the same values), whose gradient is that of the unclipped boxes."""
    height, width = size
    boxes_x = _StraightThroughClamp.apply(boxes[..., 0::2], 0, width)
    boxes_y = _StraightThroughClamp.apply(boxes[..., 1::2], 0, height)
    return torch.stack((boxes_x, boxes_y), dim=boxes.dim()).reshape(boxes.shape)


_unclipped = threading.local()  # depth: this thread's calls inside ``unclipped_box_gradients``
_unclipped_lock = threading.Lock()
_unclipped_state: dict[str, Any] = {"users": 0, "original": None}


@contextmanager
def unclipped_box_gradients() -> Iterator[None]:
    """Inside, in this thread, torchvision detectors' boxes clipped to the image keep their values and take the
    gradient of the box before clipping: a coordinate clipped to an image side is otherwise a constant (0 or the
    side) whose gradient is 0, and its map empty. The unclipped coordinate is the box head's own regression, what
    ODAM's authors differentiate. torchvision's ``ops.boxes.clip_boxes_to_image`` is replaced while some thread is
    inside (other threads get the original) and restored after."""
    import torchvision
    from torchvision.ops import boxes as box_ops

    with _unclipped_lock:
        if _unclipped_state["users"] == 0:
            original: Callable[[Tensor, tuple[int, int]], Tensor] = box_ops.clip_boxes_to_image

            def clip_boxes_to_image(boxes: Tensor, size: tuple[int, int]) -> Tensor:
                if getattr(_unclipped, "depth", 0) and not torchvision._is_tracing():
                    return _straight_through_clip(boxes, size)
                return original(boxes, size)

            _unclipped_state["original"], _unclipped_state["patched"] = original, clip_boxes_to_image
            box_ops.clip_boxes_to_image = clip_boxes_to_image
        _unclipped_state["users"] += 1
    _unclipped.depth = getattr(_unclipped, "depth", 0) + 1
    try:
        yield
    finally:
        _unclipped.depth -= 1
        with _unclipped_lock:
            _unclipped_state["users"] -= 1
            if _unclipped_state["users"] == 0:
                if box_ops.clip_boxes_to_image is _unclipped_state["patched"]:  # not replaced again since
                    box_ops.clip_boxes_to_image = _unclipped_state["original"]
                _unclipped_state["original"] = _unclipped_state["patched"] = None


def _xywh_to_xyxy(boxes: Tensor) -> Tensor:
    centre, size = boxes[..., :2], boxes[..., 2:]
    return torch.cat([centre - size / 2, centre + size / 2], dim=-1)


def _from_lists(output: Sequence[Mapping[str, Tensor]], classes: int) -> Candidates:
    """torchvision's list of per-image dicts, padded to the most detections of an image."""
    if not isinstance(output, (list, tuple)) or not all(
            isinstance(item, Mapping) and all(key in item for key in ("boxes", "labels", "scores")) for item in output):
        keys = f" with keys {sorted(str(key) for key in output)}" if isinstance(output, Mapping) else ""
        raise ValueError(f"a torchvision detector's eval-mode output is a list of dicts with 'boxes', 'labels' and "
                         f"'scores' per image; got {type(output).__name__}{keys} (in training mode it returns its "
                         "losses): run it in eval mode (model.eval()).")
    count = max((len(item["scores"]) for item in output), default=0)
    reference = output[0]["scores"] if output else torch.zeros(0)
    rows = len(output)
    boxes = reference.new_zeros(rows, count, 4)
    scores = reference.new_zeros(rows, count, classes)
    valid = torch.zeros(rows, count, dtype=torch.bool, device=reference.device)
    box_rows, score_rows = [], []
    for row, item in enumerate(output):
        found = len(item["scores"])
        padding = count - found
        box_rows.append(torch.cat([item["boxes"], item["boxes"].new_zeros(padding, 4)]))
        one_hot = torch.nn.functional.one_hot(item["labels"].long(), classes).to(item["scores"].dtype)
        score_rows.append(torch.cat([one_hot * item["scores"][:, None], one_hot.new_zeros(padding, classes)]))
        valid[row, :found] = True
    if rows:
        boxes, scores = torch.stack(box_rows), torch.stack(score_rows)
    return Candidates(boxes, scores, scores, scores.amax(dim=-1) if count else scores.new_zeros(rows, 0), valid)


def torchvision_classes(model: nn.Module) -> int:
    """The number of class indices (labels) of a torchvision detector, background included."""
    for path in ("roi_heads.box_predictor.cls_score", "head.classification_head"):
        module: Any = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, nn.Linear):
            return module.out_features
        if module is not None and hasattr(module, "num_classes"):
            return int(module.num_classes)
        if module is not None and hasattr(module, "num_columns"):  # SSD, SSDlite: a column per class
            return int(module.num_columns)
    raise ValueError(f"explain cannot find the number of classes of {type(model).__name__} (a torchvision detector "
                     "without roi_heads.box_predictor or head.classification_head).")


def huggingface_candidates(output: Any, model: nn.Module, input_size: Sequence[int]) -> Candidates:
    """A transformers detector's ``logits`` and ``pred_boxes`` as candidates (one per query)."""
    logits, boxes = output["logits"], output["pred_boxes"]
    height, width = input_size
    scale = boxes.new_tensor([width, height, width, height])
    corners = _xywh_to_xyxy(boxes) * scale
    config: Any = model.config
    labels = int(config.num_labels)
    if logits.shape[-1] == labels + 1:  # DETR: softmax over the classes and a last "no object"
        probabilities = logits.softmax(dim=-1)
        scores = probabilities[..., :-1]
        objectness = torch.ones_like(scores[..., 0])
    else:  # sigmoid class scores (focal loss): Conditional / Deformable DETR, RT-DETR
        probabilities = scores = logits.sigmoid()
        objectness = scores.amax(dim=-1)
    valid = torch.ones(scores.shape[:2], dtype=torch.bool, device=scores.device)
    return Candidates(corners, scores, probabilities, objectness, valid)


def ultralytics_candidates(output: Any) -> Candidates:
    """A YOLOv8 / YOLO11 Detect head's (N, 4 + C, A) decoded output as candidates (one per anchor)."""
    decoded = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(decoded, Tensor) or decoded.dim() != 3:
        raise ValueError("a YOLO DetectionModel's eval-mode output starts with (N, 4 + classes, anchors); got "
                         f"{type(decoded).__name__}. Explain the DetectionModel in eval mode (yolo.model).")
    rows = decoded.transpose(1, 2)  # (N, A, 4 + C)
    scores = rows[..., 4:]
    valid = torch.ones(scores.shape[:2], dtype=torch.bool, device=scores.device)
    return Candidates(_xywh_to_xyxy(rows[..., :4]), scores, scores, scores.amax(dim=-1), valid)


def candidates_of(output: Any, model: nn.Module, input_size: Sequence[int], family: Optional[str] = None
                  ) -> Candidates:
    """The candidates of a detector's ``output`` for an input of ``input_size`` (H, W) pixels; ``family``: as
    ``detector_family(model)`` (given: not looked up again)."""
    family = detector_family(model) if family is None else family
    if family == "torchvision":
        return _from_lists(output, torchvision_classes(model))
    if family == "huggingface":
        return huggingface_candidates(output, model, input_size)
    if family == "ultralytics":
        return ultralytics_candidates(output)
    if isinstance(output, Mapping) and isinstance(output.get("boxes"), Tensor) and isinstance(
            output.get("scores"), Tensor) and output["boxes"].dim() == 3 and output["scores"].dim() == 3:
        scores = output["scores"]
        valid = torch.ones(scores.shape[:2], dtype=torch.bool, device=scores.device)
        return Candidates(output["boxes"], scores, scores, scores.amax(dim=-1), valid)
    raise ValueError(
        f"explain cannot read detections from {type(model).__name__}'s output ({type(output).__name__}). It reads "
        "torchvision detectors, transformers DETR-style detectors (logits and pred_boxes), Ultralytics YOLOv8 / "
        "YOLO11 DetectionModels, and any model that returns {'boxes': (N, P, 4) x0, y0, x1, y1 in pixels, "
        "'scores': (N, P, classes) in [0, 1]}. instances= explains a detector's detections: for a classifier, "
        "give target= (a class index, or None for the top class) instead.")
