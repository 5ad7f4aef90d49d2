"""Train the demo transformer on synthetic images and write its weights next to this file.

    python -m explain.data.train_vit            # a few minutes on 2 CPU cores

Deterministic for a given seed and thread count. Training data uses seeds 0..; held-out
evaluation data (tests, benchmarks) uses ``EVALUATION_SEED``, as for the demo CNN.
The weights are stored in float16 (under 0.4 MB) and loaded as float32.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from .demo import save_half_weights
from .demo_vit import VIT_WEIGHTS_PATH, DemoViT, load_demo_vit
from .synthetic import make_dataset
from .train import TRAINING_SEED, accuracy, fit_transformer, to_model_input


def augment(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random flip and quarter turn of the whole batch: every class is a shape that keeps its class."""
    if torch.rand(1, generator=generator).item() < 0.5:
        batch = batch.flip(-1)
    turns = int(torch.randint(4, (1,), generator=generator).item())
    return torch.rot90(batch, turns, dims=(-2, -1))


def train(samples: int = 6000, epochs: int = 16, batch_size: int = 64, seed: int = TRAINING_SEED) -> DemoViT:
    torch.manual_seed(seed)
    data = make_dataset(samples, seed=seed)
    inputs, labels = to_model_input(data.images), torch.from_numpy(data.labels)
    model = DemoViT()
    decay = [p for name, p in model.named_parameters() if p.dim() > 1 and "pos_embed" not in name]
    no_decay = [p for name, p in model.named_parameters() if p.dim() <= 1 or "pos_embed" in name]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=2e-3)
    steps = epochs * (samples // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.15)
    generator = torch.Generator().manual_seed(seed)

    def batch_loss(index: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(augment(inputs[index], generator)), labels[index], label_smoothing=0.05)

    fit_transformer(model, optimizer, schedule, samples, epochs, batch_size, generator, batch_loss)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="small tensors: one thread is as fast, and "
                        "not slowed down by other processes on a shared machine")
    parser.add_argument("--out", default=str(VIT_WEIGHTS_PATH))
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    started = time.perf_counter()
    model = train(arguments.samples, arguments.epochs)
    seconds = time.perf_counter() - started
    save_half_weights(model, arguments.out)
    reloaded = load_demo_vit(arguments.out)
    print(f"trained in {seconds:.0f} s; held-out accuracy {accuracy(reloaded):.3f} (float16 weights); "
          f"weights written to {arguments.out}")


if __name__ == "__main__":
    main()
