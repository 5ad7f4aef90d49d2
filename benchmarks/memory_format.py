"""Channels-last or the usual layout: which runs a model's forward and input gradient faster on the CPU.

    python benchmarks/memory_format.py [--models resnet18 resnet50 ...] [--rows 1 2 4 8 16 32] [--sizes 224]

For each model (random weights, 224×224 or each of ``--sizes``) and number of rows, one process times, in turn
round after round, a no-grad forward and a forward with the gradient of one class score at the input (what the
gradient methods run per chunk), once with the batch in the usual contiguous layout and once with a
channels-last copy, and reports the medians' ratio (below 1: channels-last is faster) and the time per
row. ``explain.core.memory_format`` chooses the layout from these tables. Writes the "Memory layout of the
model's input (CPU)" section of benchmarks/RESULTS.md (with other ``--sizes`` than 224: "... by image size (CPU)").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_fresh_process, write_section  # noqa: E402

MODELS = ["resnet18", "resnet50", "vgg11", "densenet121", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny",
          "vit_b_16"]


def measure(model_name: str, rows: int, repeats: int, size: int = 224) -> dict:
    """In a fresh process: {"forward"|"gradient": {"contiguous"|"channels_last": median seconds}}."""
    import time

    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, weights=None).eval()
    batch = torch.randn(rows, 3, size, size)
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}

    def forward(layout):
        with torch.no_grad():
            model(batch.clone(memory_format=layout))

    def gradient(layout):
        inputs = batch.clone(memory_format=layout).requires_grad_(True)
        torch.autograd.grad(model(inputs)[:, 3].sum(), inputs)

    figures: dict[str, dict[str, float]] = {}
    for kind, call in (("forward", forward), ("gradient", gradient)):
        times: dict[str, list[float]] = {name: [] for name in formats}
        for layout in formats.values():  # warm-up: oneDNN builds its kernels on the first call of a shape
            call(layout)
        for _ in range(repeats):
            for name, layout in formats.items():
                started = time.perf_counter()
                call(layout)
                times[name].append(time.perf_counter() - started)
        figures[kind] = {name: statistics.median(values) for name, values in times.items()}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", nargs="+", type=int, default=[224], help="image sizes (square, pixels)")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.measure:
        import json

        import torch

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        model_name, rows, repeats, size = arguments.measure
        print(json.dumps(measure(model_name, int(rows), int(repeats), int(size))))
        return
    lines = [
        f"torchvision models with random weights, {' / '.join(f'{size}×{size}' for size in arguments.sizes)} "
        f"inputs, CPU, {os.environ.get('BENCH_THREADS', '2')} "
        f"threads. Each cell: time with a channels-last copy of the batch ÷ time with the usual layout (median of "
        f"{arguments.repeats} rounds, both called in turn in one process per model and row count; below 1: "
        "channels-last is faster), for a no-grad forward / a forward and the gradient of one score at the input; "
        "in brackets the gradient's milliseconds per row with the usual layout.",
        "",
        "| model | size | " + " | ".join(f"{rows} rows" for rows in arguments.rows) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in arguments.rows) + " |",
    ]
    command = [sys.executable, __file__]
    for model_name, size in [(model_name, size) for model_name in arguments.models for size in arguments.sizes]:
        cells = []
        for rows in arguments.rows:
            figures = measure_in_fresh_process(command + ["--measure", model_name, str(rows), str(arguments.repeats),
                                                          str(size)], f"{model_name} {size} px {rows} rows")
            if figures is None:
                cells.append("failed")
                continue
            forward, gradient = figures["forward"], figures["gradient"]
            cells.append(f"{forward['channels_last'] / forward['contiguous']:.2f} / "
                         f"{gradient['channels_last'] / gradient['contiguous']:.2f} "
                         f"({gradient['contiguous'] / rows * 1000:.0f})")
        lines.append(f"| {model_name} | {size} | " + " | ".join(cells) + " |")
    sizes = "" if arguments.sizes == [224] else f" --sizes {' '.join(map(str, arguments.sizes))}"
    lines += ["", f"Command: `python benchmarks/memory_format.py --models {' '.join(arguments.models)} --rows "
              f"{' '.join(map(str, arguments.rows))} --repeats {arguments.repeats}{sizes}`."]
    title = "Memory layout of the model's input (CPU)" if not sizes else \
        "Memory layout of the model's input by image size (CPU)"
    write_section(title, "\n".join(lines))


if __name__ == "__main__":
    main()
