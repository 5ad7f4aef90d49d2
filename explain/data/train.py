"""Train the demo model on synthetic images and write its weights next to this file.

    python -m explain.data.train            # about a minute on 2 CPU cores

Deterministic for a given seed. Training data uses seeds 0..; held-out
evaluation data (tests, benchmarks) uses ``EVALUATION_SEED``.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..io.inputs import Normalize
from .demo import WEIGHTS_PATH, DemoNet
from .synthetic import make_dataset

TRAINING_SEED = 0
EVALUATION_SEED = 12345


def to_model_input(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 ndarray → (N, 3, H, W) normalised float tensor (the default preprocess)."""
    normalize = Normalize()
    batch = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(normalize.mean).view(1, 3, 1, 1)
    std = torch.tensor(normalize.std).view(1, 3, 1, 1)
    return (batch - mean) / std


def accuracy(model: nn.Module, count: int = 1000, seed: int = EVALUATION_SEED) -> float:
    data = make_dataset(count, seed=seed)
    with torch.no_grad():
        predictions = model.eval()(to_model_input(data.images)).argmax(1)
    return (predictions == torch.from_numpy(data.labels)).float().mean().item()


def fit_transformer(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                    samples: int, epochs: int, batch_size: int, generator: torch.Generator,
                    batch_loss: Callable[[Tensor], Tensor]) -> nn.Module:
    """The demo transformers' training loop: per epoch a shuffled order of the ``samples`` (drawn from
    ``generator``), per batch of indices ``batch_loss(index)`` (the augmented batch's loss, drawing from the same
    generator), gradients clipped to norm 1, one optimiser and schedule step. Returns the model in eval mode."""
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=generator)
        for start in range(0, samples - batch_size + 1, batch_size):
            loss = batch_loss(order[start : start + batch_size])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        print(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}", flush=True)
    return model.eval()


def train(samples: int = 4000, epochs: int = 6, batch_size: int = 64, seed: int = TRAINING_SEED) -> DemoNet:
    torch.manual_seed(seed)
    data = make_dataset(samples, seed=seed)
    inputs, labels = to_model_input(data.images), torch.from_numpy(data.labels)
    model = DemoNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = epochs * (samples // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=generator)
        for start in range(0, samples - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            batch = inputs[index]
            flip = torch.rand(1, generator=generator).item() < 0.5  # shapes keep their class under flips
            if flip:
                batch = batch.flip(-1)
            loss = F.cross_entropy(model(batch), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        print(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default=str(WEIGHTS_PATH))
    arguments = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.perf_counter()
    model = train(arguments.samples, arguments.epochs)
    torch.save(model.state_dict(), arguments.out)
    print(f"trained in {time.perf_counter() - started:.0f} s; held-out accuracy {accuracy(model):.3f}; "
          f"weights written to {arguments.out}")


if __name__ == "__main__":
    main()
