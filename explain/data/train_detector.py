"""Train the demo detector on synthetic detection scenes and write its weights next to this file.

    python -m explain.data.train_detector           # about a minute and a half on one CPU thread

FCOS-like targets on the detector's 8 px grid: a cell is positive for an object when its centre lies inside
the object's box and at most ``CENTRE_RADIUS`` px (in x and in y) from the box's centre (so the cell holding
the centre always is); every other cell is background. Losses: sigmoid focal loss on the class logits of all
cells (summed, divided by the number of positive cells) plus the GIoU loss of the positive cells' boxes.
Augmentation: random horizontal and vertical flips (the shapes keep their class). Training scenes use seed
``SEED``; held-out evaluation (tests, the figures printed here) uses ``EVALUATION_SEED``, as for the other demo
models. Deterministic for a given seed and thread count. The weights are stored in float16 and loaded as float32.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import Tensor
from torchvision.ops import batched_nms, box_iou, generalized_box_iou_loss, sigmoid_focal_loss

from .demo import save_half_weights
from .demo_detector import DETECTOR_STRIDE, DETECTOR_WEIGHTS_PATH, DemoDetector, cell_centres, load_demo_detector
from .detection_scenes import DETECTION_CLASS_NAMES, make_detection_scenes
from .train import EVALUATION_SEED, fit_transformer, to_model_input

SEED = 0
CENTRE_RADIUS = 8.0
"""Positive cells lie at most this many pixels from the object's box centre, in x and in y (one cell)."""


def assign_targets(boxes: list[np.ndarray], labels: list[np.ndarray], size: int) -> tuple[Tensor, Tensor]:
    """Per scene and grid cell of an (S/8, S/8) grid: (classes (N, S/8, S/8) int64, the positive object's class
    or −1 for background; target boxes (N, S/8, S/8, 4) float32, its box, zeros for background)."""
    grid = size // DETECTOR_STRIDE
    centres = cell_centres(grid, grid).numpy()  # (P, 2)
    classes = np.full((len(boxes), grid * grid), -1, np.int64)
    targets = np.zeros((len(boxes), grid * grid, 4), np.float32)
    for index, (scene_boxes, scene_labels) in enumerate(zip(boxes, labels)):
        for box, label in zip(scene_boxes, scene_labels):
            inside = ((centres[:, 0] > box[0]) & (centres[:, 0] < box[2])
                      & (centres[:, 1] > box[1]) & (centres[:, 1] < box[3]))
            near = np.abs(centres - (box[:2] + box[2:]) / 2).max(axis=1) <= CENTRE_RADIUS
            positive = inside & near
            classes[index, positive] = label
            targets[index, positive] = box
    return (torch.from_numpy(classes).view(-1, grid, grid), torch.from_numpy(targets).view(-1, grid, grid, 4))


def flip(images: Tensor, classes: Tensor, targets: Tensor, horizontal: bool, vertical: bool
         ) -> tuple[Tensor, Tensor, Tensor]:
    """Images (N, 3, S, S), classes (N, g, g) and target boxes (N, g, g, 4) mirrored left-right and/or
    upside-down, boxes (x0, y0, x1, y1) mirrored with them (S − x1, y0, S − x0, y1)."""
    size = images.shape[-1]
    if horizontal:
        images, classes, targets = images.flip(-1), classes.flip(-1), targets.flip(-2)
        targets = torch.stack([size - targets[..., 2], targets[..., 1], size - targets[..., 0], targets[..., 3]], -1)
    if vertical:
        images, classes, targets = images.flip(-2), classes.flip(-2), targets.flip(-3)
        targets = torch.stack([targets[..., 0], size - targets[..., 3], targets[..., 2], size - targets[..., 1]], -1)
    return images, classes, targets


def detection_loss(model: DemoDetector, inputs: Tensor, classes: Tensor, targets: Tensor) -> Tensor:
    """Focal loss (α 0.25, γ 2) of all cells' class logits over the number of positive cells, plus the mean
    GIoU loss of the positive cells' boxes; ``classes`` (N, g, g) with −1 for background, ``targets``
    (N, g, g, 4)."""
    outputs = model.forward_logits(inputs)
    classes, targets = classes.flatten(1), targets.flatten(1, 2)  # (N, P), (N, P, 4)
    positive = classes >= 0
    one_hot = torch.zeros_like(outputs["logits"])
    one_hot[positive] = torch.nn.functional.one_hot(classes[positive], one_hot.shape[-1]).float()
    positives = max(1, int(positive.sum()))
    classification = sigmoid_focal_loss(outputs["logits"], one_hot, reduction="sum") / positives
    boxes = generalized_box_iou_loss(outputs["boxes"][positive], targets[positive], reduction="sum") / positives
    return classification + boxes


def train(samples: int = 4000, epochs: int = 6, batch_size: int = 32, seed: int = SEED,
          learning_rate: float = 3e-3) -> DemoDetector:
    """A ``DemoDetector`` trained on ``samples`` scenes of seed ``seed`` for ``epochs`` epochs (AdamW, weight
    decay 1e-4, one-cycle schedule, gradients clipped to norm 1, random flips), in eval mode."""
    if samples < batch_size or epochs < 1:
        raise ValueError(f"training needs at least one batch: samples ({samples}) ≥ batch_size ({batch_size}) and "
                         f"epochs ({epochs}) ≥ 1.")
    torch.manual_seed(seed)
    scenes = make_detection_scenes(samples, seed=seed)
    size = scenes.images.shape[1]
    inputs = to_model_input(scenes.images)
    classes, targets = assign_targets(scenes.boxes, scenes.labels, size)
    del scenes
    model = DemoDetector()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=1e-4)
    steps = epochs * (samples // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.15)
    generator = torch.Generator().manual_seed(seed)

    def batch_loss(index: Tensor) -> Tensor:
        horizontal, vertical = (torch.rand(2, generator=generator) < 0.5).tolist()
        batch = flip(inputs[index], classes[index], targets[index], horizontal, vertical)
        return detection_loss(model, *batch)

    fit_transformer(model, optimizer, schedule, samples, epochs, batch_size, generator, batch_loss)
    return model


def _detections(boxes: Tensor, scores: Tensor, score_threshold: float, iou_threshold: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """One image's (P, 4) boxes and (P, C) scores → the (cell, class) pairs scoring at least ``score_threshold``
    that survive per-class NMS at ``iou_threshold``: (boxes (D, 4), scores (D,), labels (D,)), best first."""
    cells, labels = torch.nonzero(scores >= score_threshold, as_tuple=True)
    kept = batched_nms(boxes[cells], scores[cells, labels], labels, iou_threshold)  # sorted by score
    return boxes[cells[kept]], scores[cells[kept], labels[kept]], labels[kept]


def evaluate(model: DemoDetector, count: int = 200, seed: int = EVALUATION_SEED, score_threshold: float = 0.3,
             iou_threshold: float = 0.5) -> tuple[float, float]:
    """(recall, precision) at IoU 0.5 on ``count`` scenes of ``seed``, after NMS at ``iou_threshold`` of the
    detections scoring at least ``score_threshold``: each detection, best first, matches the unmatched object of
    its class with the highest IoU if that IoU is at least 0.5 (a true positive), else it is a false positive."""
    scenes = make_detection_scenes(count, seed=seed)
    with torch.no_grad():
        outputs = model.eval()(to_model_input(scenes.images))
    found = detected = objects = 0
    for index in range(count):
        boxes, _, labels = _detections(outputs["boxes"][index], outputs["scores"][index], score_threshold,
                                       iou_threshold)
        truth_boxes = torch.from_numpy(scenes.boxes[index])
        truth_labels = torch.from_numpy(scenes.labels[index])
        overlaps = box_iou(boxes, truth_boxes)  # (D, M)
        matched = torch.zeros(len(truth_labels), dtype=torch.bool)
        for detection in range(len(boxes)):
            candidates = (truth_labels == labels[detection]) & ~matched
            overlap = torch.where(candidates, overlaps[detection], torch.zeros_like(overlaps[detection]))
            if len(overlap) and overlap.max() >= 0.5:
                matched[overlap.argmax()] = True
        found += int(matched.sum())
        detected += len(boxes)
        objects += len(truth_labels)
    return found / max(1, objects), found / max(1, detected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="small tensors: one thread is nearly as fast, and "
                        "not slowed down by other processes on a shared machine (the weights depend on the count)")
    parser.add_argument("--out", default=str(DETECTOR_WEIGHTS_PATH))
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    started = time.perf_counter()
    model = train(arguments.samples, arguments.epochs, seed=arguments.seed)
    seconds = time.perf_counter() - started
    save_half_weights(model, arguments.out)
    recall, precision = evaluate(load_demo_detector(arguments.out))
    print(f"trained in {seconds:.0f} s; held-out recall@0.5 {recall:.3f}, precision@0.5 {precision:.3f} "
          f"(200 scenes of seed {EVALUATION_SEED}, score ≥ 0.3, NMS at IoU 0.5, float16 weights; classes "
          f"{', '.join(DETECTION_CLASS_NAMES)}); weights written to {arguments.out}")


if __name__ == "__main__":
    main()
