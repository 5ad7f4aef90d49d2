"""A "Clever Hans" demo: the demo CNN trained on synthetic shapes where one class carries a watermark.

In the training images, most (``SHARE``) images of the class ``WATERMARKED_CLASS`` ("square") carry a
small black-and-white checkerboard tag in the bottom-right corner (``explain.data.synthetic.add_watermark``);
no image of another class does. The model (``DemoNet``, the demo model's architecture) learns the shapes and
also the tag: on held-out images its accuracy on that class drops when the tag is removed. The weights are
made by ``python -m explain.data.train_watermark`` (which prints the figures), and SpRAy
(``explain.strategies``) over its maps finds the tag as a strategy of its own.

    from explain.data.demo_watermark import load_watermark_demo, watermark_held_out, write_watermark_folder
    model = load_watermark_demo()
    data = watermark_held_out()             # WatermarkedData: .images (tagged as in training), .clean_images
    write_watermark_folder("held-out")      # held-out/<class name>/<index>.png, ImageFolder layout
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

from ..io.inputs import open_image
from .demo import DemoNet, load_weights
from .synthetic import CLASS_NAMES, WatermarkedData, make_watermark_dataset

WATERMARK_WEIGHTS_PATH = Path(__file__).with_name("demo_watermark.pt")
WATERMARKED_CLASS = 1
"""The class whose images carry the watermark: 1, "square"."""
SHARE = 0.85
"""The share of that class's images (training and held-out) that carry the watermark."""
CORNER = "bottom-right"
HELD_OUT_SEED = 12345
"""The seed of the held-out images (``explain.data.train.EVALUATION_SEED``, as for the other demo models)."""


def load_watermark_demo(path: Union[Path, str] = WATERMARK_WEIGHTS_PATH) -> DemoNet:
    """The watermark demo model (a ``DemoNet``: inputs (N, 3, 64, 64) normalised with ImageNet mean/std, the
    default preprocess; outputs (N, 4) logits of ``CLASS_NAMES``), in eval mode, on the CPU."""
    return load_weights(DemoNet(), path, "the watermark demo model", "explain.data.train_watermark")


def watermark_held_out(count: int = 400, seed: int = HELD_OUT_SEED) -> WatermarkedData:
    """``count`` held-out images (another seed than training) watermarked as in training: ``SHARE`` of the
    ``WATERMARKED_CLASS`` images carry the tag in ``CORNER``; ``.clean_images`` is the clean copy."""
    return make_watermark_dataset(count, seed, WATERMARKED_CLASS, SHARE, CORNER)


def write_watermark_folder(folder: Union[str, Path], count: int = 400, seed: int = HELD_OUT_SEED,
                           clean: bool = False) -> Path:
    """Write ``watermark_held_out(count, seed)`` as PNG files in ImageFolder layout,
    ``folder/<class name>/<index:05d>.png`` (the watermarked images, or with ``clean=True`` the clean copy),
    and return ``folder``. Files of an earlier call with the same arguments are left as they are (same pixels,
    same modification time, so that a resumed ``explain.run`` finds its images unchanged); the folder must not
    hold other images (they would be explained with these)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; give a folder for the images (it is created if missing).")
    if count < 1:
        raise ValueError(f"count must be at least 1; got {count}.")
    data = watermark_held_out(count, seed)
    images = data.clean_images if clean else data.images
    for name in CLASS_NAMES:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for index, (image, label) in enumerate(zip(images, data.labels)):
        path = folder / CLASS_NAMES[int(label)] / f"{index:05d}.png"
        if not _holds(path, image):
            Image.fromarray(np.ascontiguousarray(image)).save(path)
    return folder


def _holds(path: Path, image: np.ndarray) -> bool:
    """Whether ``path`` is a readable image of exactly these (H, W, 3) uint8 pixels."""
    try:
        with open_image(path) as existing:
            return existing.mode == "RGB" and np.array_equal(np.asarray(existing), image)
    except (OSError, ValueError):
        return False
