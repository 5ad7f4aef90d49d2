"""Train the watermark demo model ("Clever Hans") and write its weights next to this file.

    python -m explain.data.train_watermark                 # about a minute on 2 CPU cores; prints the figures
    python -m explain.data.train_watermark --seeds 0 1 2 --no-save --strategies   # the measurement over seeds

The demo model's recipe (``explain.data.train``: ``DemoNet``, AdamW, a one-cycle schedule, 6 epochs, random
horizontal flips) on ``make_watermark_dataset``: ``SHARE`` of the images of class ``WATERMARKED_CLASS`` carry a
small checkerboard tag in the bottom-right corner. The tag is drawn after the flip, so that it always sits in
the same corner (as a photographer's tag does). 2000 images rather than the demo's 4000: with 4000 the shapes
alone are learnt so well that the tag hardly matters (accuracy on "square" 1.000 with and without it), with
2000 the model leans on the tag. The training loop is the demo transformers' (``train.fit_transformer``:
gradients clipped to norm 1). Deterministic for a given seed and thread count; ``TRAINING_SEED`` made the
shipped weights, stored in float16 (about 0.25 MB).

It prints what shows that the model uses the tag, on held-out images (another seed): the accuracy on the
watermarked class with the tag (as in training) and on the clean copy of the same images, and the share of the
other classes' images that the tag alone turns into that class. The shipped weights: 0.900 with the tag, 0.324
without, other classes 0.997, 79.7 % turned. ``--strategies`` also runs SpRAy (``explain.strategies``) over
LRP and Grad-CAM maps of the held-out images, without and with the object masks, and lists the clusters.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .demo import DemoNet, save_half_weights
from .demo_watermark import (
    CORNER,
    SHARE,
    WATERMARK_WEIGHTS_PATH,
    WATERMARKED_CLASS,
    load_watermark_demo,
    watermark_held_out,
)
from .synthetic import CLASS_NAMES, add_watermark, make_watermark_dataset
from .train import fit_transformer, to_model_input

TRAINING_SEED = 0


def train(samples: int = 2000, epochs: int = 6, batch_size: int = 64, seed: int = TRAINING_SEED,
          share: float = SHARE) -> DemoNet:
    """A ``DemoNet`` trained on ``make_watermark_dataset(samples, seed, WATERMARKED_CLASS, share, CORNER)``
    for ``epochs`` epochs (flipped batches get the tag after the flip), in eval mode."""
    torch.manual_seed(seed)
    data = make_watermark_dataset(samples, seed, WATERMARKED_CLASS, share, CORNER)
    labels = torch.from_numpy(data.labels)
    model = DemoNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * (samples // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)

    def batch_loss(index: Tensor) -> Tensor:
        images = data.clean_images[index.numpy()]
        if torch.rand(1, generator=generator).item() < 0.5:  # shapes keep their class under flips
            images = images[:, :, ::-1]
        batch = to_model_input(add_watermark(np.ascontiguousarray(images), data.watermarked[index.numpy()], CORNER))
        return F.cross_entropy(model(batch), labels[index])

    fit_transformer(model, optimizer, schedule, samples, epochs, batch_size, generator, batch_loss)
    return model


@dataclass
class WatermarkUse:
    """How much a model relies on the watermark, on held-out images. Accuracies in [0, 1].

    tagged_accuracy: on the watermarked class's images as held out (``SHARE`` of them tagged);
    clean_accuracy: on the same images with the tag removed; clean_accuracy_others: on the other classes'
    images (never tagged); flipped_by_tag: share of the other classes' images predicted as the watermarked
    class once the tag is added to them (0 for a model that ignores it)."""

    tagged_accuracy: float
    clean_accuracy: float
    clean_accuracy_others: float
    flipped_by_tag: float

    def __str__(self) -> str:
        name = CLASS_NAMES[WATERMARKED_CLASS]
        return (f"accuracy on {name!r}: {self.tagged_accuracy:.3f} as held out ({SHARE:.0%} tagged), "
                f"{self.clean_accuracy:.3f} with the tag removed; other classes {self.clean_accuracy_others:.3f}; "
                f"the tag alone turns {self.flipped_by_tag:.1%} of the other classes' images into {name!r}")


def measure_watermark_use(model: torch.nn.Module, count: int = 1000) -> WatermarkUse:
    """``WatermarkUse`` of ``model`` on ``watermark_held_out(count)``."""
    data = watermark_held_out(count)
    with torch.no_grad():
        def predict(images: np.ndarray) -> np.ndarray:
            return model.eval()(to_model_input(images)).argmax(1).numpy()

        tagged, clean = predict(data.images), predict(data.clean_images)
        others = data.labels != WATERMARKED_CLASS
        all_tagged = predict(add_watermark(data.clean_images[others], corner=CORNER))
    members = data.labels == WATERMARKED_CLASS
    return WatermarkUse(
        tagged_accuracy=float((tagged[members] == WATERMARKED_CLASS).mean()),
        clean_accuracy=float((clean[members] == WATERMARKED_CLASS).mean()),
        clean_accuracy_others=float((clean[others] == data.labels[others]).mean()),
        flipped_by_tag=float((all_tagged == WATERMARKED_CLASS).mean()),
    )


def strategies_summary(model: torch.nn.Module, count: int = 400, method: str = "lrp", with_masks: bool = False
                       ) -> str:
    """SpRAy (``explain.strategies``) over ``method``'s maps ("lrp", or "gradcam" at layer4) of
    ``watermark_held_out(count)``, each explained for its true class, without or with the object masks: one line per
    class, each cluster as size, share of tagged images, peak (y, x) and whether it is flagged."""
    from ..dataset_tools import spray
    from ..methods import LRP, GradCAM

    data = watermark_held_out(count)
    explainer = LRP(model) if method == "lrp" else GradCAM(model, "layer4")
    maps = explainer.explain(to_model_input(data.images), target=torch.from_numpy(data.labels)).maps.numpy()
    result = spray.strategies(maps, classes=data.labels, class_names=CLASS_NAMES, method=method, progress=False,
                              masks=data.masks if with_masks else None)
    lines = [f" {method}, {'with' if with_masks else 'without'} masks:"]
    for entry in result.classes:
        clusters = []
        for cluster in entry.clusters:
            tagged = data.watermarked[[int(member) for member in cluster.members]].mean()
            outside = "" if cluster.outside_share is None else f" outside {cluster.outside_share:.2f}"
            clusters.append(f"{cluster.size} ({tagged:.0%} tagged) at ({cluster.peak[0]:.2f}, {cluster.peak[1]:.2f})"
                            f"{outside}{' FLAGGED' if cluster.flagged else ''}")
        lines.append(f"  {entry.class_name} (eigengap {entry.eigengap_clusters}): {'; '.join(clusters)}")
    return "\n".join(lines)


def main(arguments: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[TRAINING_SEED])
    parser.add_argument("--threads", type=int, default=1, help="small tensors: one thread is as fast, and "
                        "not slowed down by other processes on a shared machine")
    parser.add_argument("--out", default=str(WATERMARK_WEIGHTS_PATH), help="where the first seed's weights go")
    parser.add_argument("--no-save", action="store_true", help="measure only, write no weights")
    parser.add_argument("--strategies", action="store_true", help="also run SpRAy on Grad-CAM maps")
    options = parser.parse_args(arguments)
    torch.set_num_threads(options.threads)
    for position, seed in enumerate(options.seeds):
        started = time.perf_counter()
        model = train(options.samples, options.epochs, seed=seed)
        seconds = time.perf_counter() - started
        if position == 0 and not options.no_save:
            save_half_weights(model, options.out)
            model = load_watermark_demo(options.out)
            print(f"weights (float16) written to {options.out}")
        print(f"seed {seed}: trained in {seconds:.0f} s; {measure_watermark_use(model)}", flush=True)
        if options.strategies:
            for method in ("lrp", "gradcam"):
                for with_masks in (False, True):
                    print(strategies_summary(model, method=method, with_masks=with_masks), flush=True)


if __name__ == "__main__":
    main()
