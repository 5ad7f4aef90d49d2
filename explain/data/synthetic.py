"""Synthetic images with a known answer: the class is the shape of one object among distractors.

Each image (64×64 RGB by default) holds one *key* object, a filled disc,
square, triangle or cross (the class), and one to three distractors (rings,
bars and hollow boxes) that appear equally often in every class and so carry
no label information. Positions, sizes, rotations and colours are random, the
background is a random dark colour with noise and objects are brighter, so "where the object is" cannot be
read off the image statistics. The key object's pixel mask and box are the
ground truth for localisation metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import cv2
import numpy as np

CLASS_NAMES = ("disc", "square", "triangle", "cross")
DISTRACTOR_KINDS = ("ring", "bar", "box")
IMAGE_SIZE = 64


@dataclass
class SyntheticData:
    """images: (N, S, S, 3) uint8 RGB; labels: (N,) int64; masks: (N, S, S) bool, the key
    object's pixels; boxes: (N, 4) int (x0, y0, x1, y1), inclusive, of the key object."""

    images: np.ndarray
    labels: np.ndarray
    masks: np.ndarray
    boxes: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _polygon(center: np.ndarray, radius: float, angle: float, kind: str) -> np.ndarray:
    if kind == "square":
        corners = np.deg2rad([45, 135, 225, 315]) + angle
        points = np.stack([np.cos(corners), np.sin(corners)], 1) * radius
    elif kind == "triangle":
        corners = np.deg2rad([90, 210, 330]) + angle
        points = np.stack([np.cos(corners), np.sin(corners)], 1) * radius
    else:  # cross: a plus sign of arm half-width radius / 3
        arm, width = radius, radius / 3
        points = np.array(
            [[-width, -arm], [width, -arm], [width, -width], [arm, -width], [arm, width], [width, width],
             [width, arm], [-width, arm], [-width, width], [-arm, width], [-arm, -width], [-width, -width]]
        )
        rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        points = points @ rotation.T
    return np.round(points + center).astype(np.int32)


def _draw(canvas: np.ndarray, kind: str, center: np.ndarray, radius: float, angle: float,
          colour: Union[np.ndarray, Sequence[int]]) -> None:
    colour = tuple(int(value) for value in colour)
    centre = (int(round(center[0])), int(round(center[1])))
    if kind == "disc":
        cv2.circle(canvas, centre, int(round(radius)), colour, thickness=-1)
    elif kind in ("square", "triangle", "cross"):
        cv2.fillPoly(canvas, [_polygon(center, radius, angle, kind)], colour)
    elif kind == "ring":
        cv2.circle(canvas, centre, int(round(radius)), colour, thickness=2)
    elif kind == "box":
        cv2.polylines(canvas, [_polygon(center, radius, angle, "square")], True, colour, thickness=2)
    elif kind == "bar":
        offset = radius * np.array([np.cos(angle), np.sin(angle)])
        start, end = np.round(center - offset).astype(int), np.round(center + offset).astype(int)
        cv2.line(canvas, tuple(int(v) for v in start), tuple(int(v) for v in end), colour, thickness=3)


def _object_colour(rng: np.random.Generator, background: np.ndarray) -> np.ndarray:
    """A random colour clearly brighter than the (dark) background; key objects and
    distractors draw from the same distribution, so colour says nothing about the class."""
    while True:
        colour = rng.integers(0, 256, size=3)
        if colour.max() >= 150 and colour.mean() >= background.mean() + 70:
            return colour


def _place(rng: np.random.Generator, placed: list[tuple[np.ndarray, float]], radius: float, size: int
           ) -> Optional[np.ndarray]:
    """A centre where a circle of ``radius`` stays inside the image and clear of placed objects."""
    for _ in range(200):
        center = rng.uniform(radius + 1, size - radius - 2, size=2)
        if all(np.linalg.norm(center - other) > radius + other_radius + 2 for other, other_radius in placed):
            return center
    return None


def make_image(rng: np.random.Generator, label: int, size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """One image of class ``label``: (image (S, S, 3) uint8, mask (S, S) bool)."""
    background = rng.integers(0, 100, size=3)
    image = np.empty((size, size, 3), np.float32)
    image[:] = background
    image += rng.normal(0.0, 10.0, size=(size, size, 3))
    image = np.clip(image, 0, 255).astype(np.uint8)
    mask = np.zeros((size, size), np.uint8)
    placed: list[tuple[np.ndarray, float]] = []
    while True:  # the key object first, so that it always fits
        radius = rng.uniform(7.0, 14.0)
        center = _place(rng, placed, radius, size)
        if center is not None:
            break
    angle = rng.uniform(0, 2 * np.pi)
    colour = _object_colour(rng, background)
    _draw(image, CLASS_NAMES[label], center, radius, angle, colour)
    _draw(mask, CLASS_NAMES[label], center, radius, angle, (1,))
    placed.append((center, radius))
    for _ in range(rng.integers(1, 4)):
        distractor_radius = rng.uniform(7.0, 14.0)
        distractor_center = _place(rng, placed, distractor_radius, size)
        if distractor_center is None:
            continue
        kind = DISTRACTOR_KINDS[rng.integers(len(DISTRACTOR_KINDS))]
        _draw(image, kind, distractor_center, distractor_radius, rng.uniform(0, 2 * np.pi),
              _object_colour(rng, background))
        placed.append((distractor_center, distractor_radius))
    return image, mask.astype(bool)


def make_dataset(count: int, seed: int, size: int = IMAGE_SIZE) -> SyntheticData:
    """``count`` images with balanced random classes, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % len(CLASS_NAMES)).astype(np.int64)
    images = np.empty((count, size, size, 3), np.uint8)
    masks = np.empty((count, size, size), bool)
    boxes = np.empty((count, 4), np.int64)
    for index, label in enumerate(labels):
        images[index], masks[index] = make_image(rng, int(label), size)
        rows, columns = np.nonzero(masks[index])
        boxes[index] = (columns.min(), rows.min(), columns.max(), rows.max())
    return SyntheticData(images=images, labels=labels, masks=masks, boxes=boxes)
