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


# A watermark ("Clever Hans") variant: one class carries a small tag in a corner in most of its images.

WATERMARK_SIZE = 6
"""Side of the watermark in pixels: a 3×3 checkerboard of 2×2-pixel white and black squares."""
WATERMARK_MARGIN = 2
"""Pixels between the watermark and the image's edges."""
WATERMARK_CORNERS = ("top-left", "top-right", "bottom-left", "bottom-right")


def watermark_box(corner: str = "bottom-right", size: int = IMAGE_SIZE) -> tuple[int, int, int, int]:
    """The watermark's pixels in an image of side ``size``: (x0, y0, x1, y1), inclusive, as ``SyntheticData.boxes``."""
    if corner not in WATERMARK_CORNERS:
        raise ValueError(f"corner must be one of {', '.join(WATERMARK_CORNERS)}; got {corner!r}.")
    if size < WATERMARK_SIZE + 2 * WATERMARK_MARGIN:
        raise ValueError(f"images of side {size} are too small for the {WATERMARK_SIZE}-pixel watermark and its "
                         f"{WATERMARK_MARGIN}-pixel margin; use at least {WATERMARK_SIZE + 2 * WATERMARK_MARGIN}.")
    far = size - WATERMARK_MARGIN - WATERMARK_SIZE
    x0 = far if corner.endswith("right") else WATERMARK_MARGIN
    y0 = far if corner.startswith("bottom") else WATERMARK_MARGIN
    return x0, y0, x0 + WATERMARK_SIZE - 1, y0 + WATERMARK_SIZE - 1


def add_watermark(images: np.ndarray, stamped: Optional[np.ndarray] = None, corner: str = "bottom-right"
                  ) -> np.ndarray:
    """A copy of ``images`` ((N, S, S, 3) uint8 RGB) with the watermark drawn over the ``corner`` of the images
    where ``stamped`` ((N,) bool; default: all) is true."""
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be (N, S, S, 3) uint8 RGB; got {images.dtype} of shape {images.shape}.")
    stamped = np.ones(len(images), bool) if stamped is None else np.asarray(stamped, bool)
    if stamped.shape != (len(images),):
        raise ValueError(f"stamped must be one flag per image, ({len(images)},); got shape {stamped.shape}.")
    x0, y0, x1, y1 = watermark_box(corner, images.shape[1])
    squares = np.arange(WATERMARK_SIZE) // 2
    white = (squares[:, None] + squares[None, :]) % 2 == 0  # (S_w, S_w): a checkerboard of 2×2-pixel squares
    pattern = np.where(white[..., None], 255, 0).astype(np.uint8)
    result = images.copy()
    result[stamped, y0 : y1 + 1, x0 : x1 + 1] = pattern
    return result


@dataclass
class WatermarkedData(SyntheticData):
    """``SyntheticData`` whose ``images`` carry the watermark where ``watermarked`` ((N,) bool) is true, only ever
    in images of class ``watermarked_class``; ``clean_images``: the same images without it (N, S, S, 3) uint8;
    ``corner``: where the watermark sits. ``masks`` and ``boxes`` are the key object's, as in ``SyntheticData``."""

    clean_images: np.ndarray
    watermarked: np.ndarray
    watermarked_class: int
    corner: str

    def clean(self) -> SyntheticData:
        """The clean copy: the same images, labels, masks and boxes, without any watermark."""
        return SyntheticData(images=self.clean_images, labels=self.labels, masks=self.masks, boxes=self.boxes)


def make_watermark_dataset(count: int, seed: int, watermarked_class: int = 1, share: float = 0.85,
                           corner: str = "bottom-right", size: int = IMAGE_SIZE) -> WatermarkedData:
    """``make_dataset(count, seed, size)`` where round(``share`` × n) of the n images of class ``watermarked_class``
    (chosen at random, reproducibly from ``seed``) carry the watermark in ``corner``; no other image does."""
    if not 0 <= watermarked_class < len(CLASS_NAMES):
        raise ValueError(f"watermarked_class must be a class index in 0..{len(CLASS_NAMES) - 1} "
                         f"({', '.join(CLASS_NAMES)}); got {watermarked_class}.")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share is the fraction of the class's images that carry the watermark, in [0, 1]; "
                         f"got {share}.")
    watermark_box(corner, size)  # checks the corner and the size
    data = make_dataset(count, seed, size)
    members = np.flatnonzero(data.labels == watermarked_class)
    rng = np.random.default_rng([seed, 1])  # apart from the images' own random stream
    chosen = rng.choice(members, size=int(round(share * len(members))), replace=False)
    watermarked = np.zeros(count, bool)
    watermarked[chosen] = True
    return WatermarkedData(images=add_watermark(data.images, watermarked, corner), labels=data.labels,
                           masks=data.masks, boxes=data.boxes, clean_images=data.images, watermarked=watermarked,
                           watermarked_class=watermarked_class, corner=corner)
