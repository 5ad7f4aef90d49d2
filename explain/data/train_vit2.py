"""Train the second demo transformer on synthetic images and write its weights next to this file.

    python -m explain.data.train_vit2           # about five minutes on 2 CPU cores

Another recipe than ``train_vit`` (the first demo transformer): a plain ViT (``DemoViT2``: patch
embedding, six blocks), training seed ``SEED`` (the data and the initialisation), and augmentations
that move and recolour the image instead of flipping and turning it: a random translation of up
to ``SHIFT`` pixels (half a patch, so objects sit anywhere relative to the patch grid; the edges are
repeated) and a colour jitter (brightness, contrast, saturation). Deterministic for a given seed and
thread count. Held-out evaluation data (tests, benchmarks) uses ``EVALUATION_SEED``, as for the
other demo models. The weights are stored in float16 (about 0.6 MB) and loaded as float32.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from ..io.inputs import Normalize
from .demo import save_half_weights
from .demo_vit2 import VIT2_WEIGHTS_PATH, DemoViT2, load_demo_vit2
from .synthetic import make_dataset
from .train import accuracy, fit_transformer

SEED = 2
SHIFT = 4
BRIGHTNESS, CONTRAST, SATURATION = 0.25, 0.25, 0.4
"""Colour jitter: each factor is drawn uniformly from [1 − value, 1 + value], per image."""


def translate(images: Tensor, generator: torch.Generator, shift: int = SHIFT) -> Tensor:
    """Move each image of (N, C, H, W) by its own random (dy, dx) in [−shift, shift] pixels, the
    uncovered border filled by repeating the edge pixels: (N, C, H, W)."""
    count, _, height, width = images.shape
    padded = F.pad(images, (shift, shift, shift, shift), mode="replicate")
    offsets = torch.randint(0, 2 * shift + 1, (2, count), generator=generator)
    rows = offsets[0].view(-1, 1) + torch.arange(height)  # (N, H) rows of the padded image to read
    columns = offsets[1].view(-1, 1) + torch.arange(width)  # (N, W)
    picked = padded[torch.arange(count).view(-1, 1, 1), :, rows[:, :, None], columns[:, None, :]]  # (N, H, W, C)
    return picked.permute(0, 3, 1, 2)


def jitter_colours(images: Tensor, generator: torch.Generator) -> Tensor:
    """Random brightness, contrast and saturation per image of (N, 3, H, W) in [0, 1]: the same shape
    and range. Colour carries no class information in the data set, so the class is kept."""
    count = images.shape[0]

    def factors(spread: float) -> Tensor:
        return 1 + spread * (2 * torch.rand(count, 1, 1, 1, generator=generator) - 1)

    gray_weights = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    images = images * factors(BRIGHTNESS)
    mean_gray = (images * gray_weights).sum(1, keepdim=True).mean(dim=(2, 3), keepdim=True)
    images = (images - mean_gray) * factors(CONTRAST) + mean_gray
    gray = (images * gray_weights).sum(1, keepdim=True)
    images = (images - gray) * factors(SATURATION) + gray
    return images.clamp(0, 1)


def normalize(images: Tensor) -> Tensor:
    """(N, 3, H, W) in [0, 1] → the model's input (ImageNet mean and std, the default preprocess)."""
    statistics = Normalize()
    return (images - torch.tensor(statistics.mean).view(1, 3, 1, 1)) / torch.tensor(statistics.std).view(1, 3, 1, 1)


def train(samples: int = 16000, epochs: int = 14, batch_size: int = 64, seed: int = SEED,
          learning_rate: float = 2e-3) -> DemoViT2:
    """A ``DemoViT2`` trained on ``samples`` synthetic images of seed ``seed`` for ``epochs`` epochs
    (AdamW with weight decay 0.05 on the weights, none on biases, norms and the class token, one-cycle schedule, label
    smoothing 0.05, gradients clipped to norm 1), in eval mode."""
    torch.manual_seed(seed)
    data = make_dataset(samples, seed=seed)
    images = torch.from_numpy(data.images).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W) uint8
    labels = torch.from_numpy(data.labels)
    model = DemoViT2()
    decay = [p for name, p in model.named_parameters() if p.dim() > 1 and name != "cls_token"]  # weights
    no_decay = [p for name, p in model.named_parameters() if p.dim() <= 1 or name == "cls_token"]  # biases, norms
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=learning_rate)
    steps = epochs * (samples // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)

    def batch_loss(index: Tensor) -> Tensor:
        batch = jitter_colours(translate(images[index].float() / 255, generator), generator)
        return F.cross_entropy(model(normalize(batch)), labels[index], label_smoothing=0.05)

    fit_transformer(model, optimizer, schedule, samples, epochs, batch_size, generator, batch_loss)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, default=1, help="small tensors: one thread is as fast, and "
                        "not slowed down by other processes on a shared machine")
    parser.add_argument("--out", default=str(VIT2_WEIGHTS_PATH))
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    started = time.perf_counter()
    model = train(arguments.samples, arguments.epochs, seed=arguments.seed)
    seconds = time.perf_counter() - started
    save_half_weights(model, arguments.out)
    reloaded = load_demo_vit2(arguments.out)
    print(f"trained in {seconds:.0f} s; held-out accuracy {accuracy(reloaded):.3f} (float16 weights); "
          f"weights written to {arguments.out}")


if __name__ == "__main__":
    main()
