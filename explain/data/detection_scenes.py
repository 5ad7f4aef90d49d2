"""Synthetic detection scenes with a known answer: several objects per image, each with its class, box and mask.

Each scene (96×96 RGB by default) holds two to four *objects*, filled discs, squares, triangles and crosses
(the four shapes of ``explain.data.synthetic``, drawn by the same code), and zero to two distractors (rings and
bars) that are not objects. Sizes (radius 7 to 16 px at 96 px, in proportion at other sizes), rotations and
colours are random; the background is a random dark colour with noise, as in ``explain.data.synthetic``. No two
things touch: the boxes of objects and distractors are at least ``MIN_GAP`` px apart. In about two thirds of the
scenes (at least half, the choice made from the seed) two objects share a class, the *twins*, placed at least
``TWIN_GAP`` px apart (two cells of an 8 px feature grid) so that per-instance maps can tell them apart; every
other object in a scene has a class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .synthetic import CLASS_NAMES, _draw, _object_colour

DETECTION_CLASS_NAMES = CLASS_NAMES
"""The object classes, ("disc", "square", "triangle", "cross"): label i is ``DETECTION_CLASS_NAMES[i]``."""
DETECTION_DISTRACTOR_KINDS = ("ring", "bar")
SCENE_SIZE = 96
RADIUS_RANGE = (7.0, 16.0)
"""Object and distractor radii in pixels at ``SCENE_SIZE``; scaled by size / SCENE_SIZE at other sizes."""
MIN_GAP = 2
"""Empty pixel columns or rows at least between the boxes of any two things in a scene."""
TWIN_GAP = 16
"""Empty pixel columns or rows at least between the boxes of the two twins, at ``SCENE_SIZE`` (scaled)."""


@dataclass
class DetectionScenes:
    """``images``: (N, S, S, 3) uint8 RGB. Per image i, for its M_i objects: ``boxes[i]`` (M_i, 4) float32
    (x0, y0, x1, y1) in pixels, right and bottom exclusive (x1 = the last column + 1), the exact bounding box of
    the mask; ``labels[i]`` (M_i,) int64 class indices into ``DETECTION_CLASS_NAMES``; ``masks[i]``
    (M_i, S, S) bool, the object's pixels. ``twins``: (N,) bool, whether two objects of image i share a class
    (the twins are the first two objects of the image)."""

    images: np.ndarray
    boxes: list[np.ndarray]
    labels: list[np.ndarray]
    masks: list[np.ndarray]
    twins: np.ndarray

    def __len__(self) -> int:
        return len(self.images)


def _gap(box: np.ndarray, other: np.ndarray) -> float:
    """Empty columns or rows between two (x0, y0, x1, y1) exclusive boxes; ≤ 0 where they overlap or touch."""
    return max(other[0] - box[2], box[0] - other[2], other[1] - box[3], box[1] - other[3])


def _bounding_box(mask: np.ndarray) -> np.ndarray:
    rows, columns = np.nonzero(mask)
    return np.array([columns.min(), rows.min(), columns.max() + 1, rows.max() + 1], np.float32)


def _try_place(rng: np.random.Generator, kind: str, radius: float, size: int, placed: list[np.ndarray],
               gaps: list[float]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(mask (S, S) bool, box) of ``kind`` drawn at a random centre and angle, its box at least ``gaps[j]`` px
    from ``placed[j]``; None where 100 tries found no such place."""
    for _ in range(100):
        center = rng.uniform(radius + 1, size - radius - 2, size=2)
        angle = rng.uniform(0, 2 * np.pi)
        canvas = np.zeros((size, size), np.uint8)
        _draw(canvas, kind, center, radius, angle, (1,))
        mask = canvas.astype(bool)
        if not mask.any():
            continue
        box = _bounding_box(mask)
        if all(_gap(box, other) >= gap for other, gap in zip(placed, gaps)):
            return mask, box
    return None


def make_scene(rng: np.random.Generator, twins: bool, size: int = SCENE_SIZE
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One scene: (image (S, S, 3) uint8, boxes (M, 4) float32, labels (M,) int64, masks (M, S, S) bool); with
    ``twins``, objects 0 and 1 share a class and all others differ, else all M classes differ."""
    scale = size / SCENE_SIZE
    twin_gap = max(MIN_GAP, round(TWIN_GAP * scale))
    while True:  # until every object of the drawn layout found a place
        count = int(rng.integers(2, 5))
        if twins:
            classes = rng.permutation(len(DETECTION_CLASS_NAMES))[: count - 1]
            labels = np.concatenate([classes[:1], classes]).astype(np.int64)
        else:
            labels = rng.permutation(len(DETECTION_CLASS_NAMES))[:count].astype(np.int64)
        masks: list[np.ndarray] = []
        boxes: list[np.ndarray] = []
        for index, label in enumerate(labels):
            radius = rng.uniform(*RADIUS_RANGE) * scale
            gaps = [float(twin_gap if twins and index == 1 and other == 0 else MIN_GAP) for other in range(index)]
            placement = _try_place(rng, DETECTION_CLASS_NAMES[label], radius, size, boxes, gaps)
            if placement is None:
                break
            masks.append(placement[0])
            boxes.append(placement[1])
        if len(masks) == count:
            break
    background = rng.integers(0, 100, size=3)
    image = np.empty((size, size, 3), np.float32)
    image[:] = background
    image += rng.normal(0.0, 10.0, size=(size, size, 3))
    image = np.clip(image, 0, 255).astype(np.uint8)
    for mask in masks:
        image[mask] = _object_colour(rng, background)
    taken = list(boxes)
    for _ in range(int(rng.integers(0, 3))):
        kind = DETECTION_DISTRACTOR_KINDS[int(rng.integers(len(DETECTION_DISTRACTOR_KINDS)))]
        radius = rng.uniform(*RADIUS_RANGE) * scale
        placement = _try_place(rng, kind, radius, size, taken, [float(MIN_GAP)] * len(taken))
        if placement is None:
            continue
        image[placement[0]] = _object_colour(rng, background)
        taken.append(placement[1])
    return image, np.stack(boxes), labels, np.stack(masks)


def make_detection_scenes(count: int, seed: int, size: int = SCENE_SIZE) -> DetectionScenes:
    """``count`` scenes of side ``size`` px, reproducible from ``seed``; round(2/3 × count) of them (at least
    half, at random) hold twins."""
    if count < 0:
        raise ValueError(f"count is the number of scenes, at least 0; got {count}.")
    if size < 48:
        raise ValueError(f"scenes of side {size} px are too small for four objects apart; use at least 48 (96 as "
                         f"the demo detector was trained).")
    rng = np.random.default_rng(seed)
    twins = rng.permutation(count) < (2 * count + 1) // 3
    images = np.empty((count, size, size, 3), np.uint8)
    boxes: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for index in range(count):
        images[index], scene_boxes, scene_labels, scene_masks = make_scene(rng, bool(twins[index]), size)
        boxes.append(scene_boxes)
        labels.append(scene_labels)
        masks.append(scene_masks)
    return DetectionScenes(images=images, boxes=boxes, labels=labels, masks=masks, twins=twins)
