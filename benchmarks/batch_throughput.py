"""Dataset runs: ``explain batch`` against a plain DataLoader loop, in images per second.

    python benchmarks/batch_throughput.py --device cpu --model resnet18 --images 64 --size 128 --batch-size 16
    python benchmarks/batch_throughput.py --device cuda --model resnet50 --images 1024 --size 256 --batch-size 64 \
        --write

A folder of ``--images`` JPEGs of ``--size`` px is made in a temporary folder; then, in turn round after round
(``--repeats``), each of these explains or runs it, and its images per second (the median over the rounds) is
reported:

- ``explain.run``: Grad-CAM at layer4 (``explain.cli.make_explainer``, as the command builds it) over the folder
  through the Python entry point, the model already built, into a fresh output folder;
- ``explain batch``: the command line, ``python -m explain batch DIR --model M --weights random --device D``, its
  whole wall time (start-up, importing the package and building the model included);
- ``DataLoader loop``: a ``torch.utils.data.DataLoader`` with ``--workers`` worker processes (pinned memory on
  CUDA) that decodes and preprocesses each image as the command does, feeding
  ``explain.GradCAM(model, "layer4").explain(batch)`` and saving each image's map as one float16 .npy (the loop
  of issue 40);
- ``no-grad forward``: the same DataLoader feeding the model's forward pass alone, without gradients.

The models have random weights (torchvision ``weights=None``). ``explain batch`` and ``explain.run`` get
``--workers`` where the installed explain takes it (an earlier version decodes in its own process). The disk
bytes per image of the maps ``explain.run`` wrote (the files' sizes, and the blocks they take) are reported too.
With ``--write``, the "Dataset runs: explain batch against a DataLoader loop (DEVICE)" section of
benchmarks/RESULTS.md is written. To measure another copy of the package (an earlier commit), put it first on
PYTHONPATH: ``git archive HEAD explain | tar -x -C /tmp/head; PYTHONPATH=/tmp/head python benchmarks/...``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402
from explain.cli import make_explainer  # noqa: E402
from explain.io.inputs import load_image  # noqa: E402

MODES = ("explain.run", "explain batch", "DataLoader loop", "no-grad forward")


def make_images(folder: Path, count: int, size: int, seed: int = 0) -> list[Path]:
    """``count`` JPEGs of size × size px (smooth colour fields with noise, as photographs decode), sorted."""
    generator = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        coarse = generator.uniform(0, 255, size=(8, 8, 3)).astype(np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC), np.float32)
        pixels = np.clip(field + generator.normal(0, 12, size=field.shape), 0, 255).astype(np.uint8)
        path = folder / f"image{index:06d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


class FileImages(torch.utils.data.Dataset):
    """Each file decoded (``explain.load_image``) and preprocessed as ``explain batch`` does."""

    def __init__(self, files: list[Path], preprocess: Callable):
        self.files, self.preprocess = files, preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.preprocess(load_image(self.files[index]))


def disk_bytes(folder: Path) -> tuple[int, int]:
    """(the sizes of the files under ``folder``, the bytes of the blocks they take) summed."""
    size = blocks = 0
    for path in folder.rglob("*"):
        if path.is_file():
            status = path.stat()
            size += status.st_size
            blocks += status.st_blocks * 512
    return size, blocks


def takes_workers() -> bool:
    """Whether the installed explain's ``run`` takes ``workers=`` (and the command ``--workers``)."""
    return "workers" in inspect.signature(explain.run).parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="a torchvision model (default: resnet50 on CUDA, resnet18 "
                        "on the CPU)")
    parser.add_argument("--images", type=int, default=None, help="default: 1024 on CUDA, 64 on the CPU")
    parser.add_argument("--size", type=int, default=None, help="the JPEGs' side in px (default: 256 on CUDA, 128 on "
                        "the CPU)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 64 on CUDA, 16 on the CPU")
    parser.add_argument("--workers", type=int, default=min(8, max((os.cpu_count() or 1) - 1, 0)),
                        help="DataLoader worker processes (default: min(8, CPU cores - 1))")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON: images/s by run, and the "
                        "maps' bytes per image (files, blocks)")
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    on_gpu = device.type == "cuda"
    model_name = arguments.model or ("resnet50" if on_gpu else "resnet18")
    count = arguments.images or (1024 if on_gpu else 64)
    size = arguments.size or (256 if on_gpu else 128)
    batch_size = arguments.batch_size or (64 if on_gpu else 16)
    workers = arguments.workers

    loaded = explain.load_model(model_name, "random")
    loaded.model.to(device)
    runner = make_explainer("gradcam", loaded, "layer4")
    looped = explain.GradCAM(loaded.model, "layer4")
    with_workers = takes_workers()
    work = Path(tempfile.mkdtemp(prefix="batch-throughput-"))
    try:
        files = make_images(work / "images", count, size)
        warm_folder = work / "warm"
        warm_folder.mkdir()
        for path in files[: 2 * batch_size]:
            shutil.copy(path, warm_folder / path.name)
        loader = torch.utils.data.DataLoader(FileImages(files, loaded.preprocess), batch_size=batch_size,
                                             num_workers=workers, pin_memory=on_gpu)
        options = {"workers": workers} if with_workers else {}
        command = [sys.executable, "-m", "explain", "batch", str(work / "images"), "--model", model_name, "--weights",
                   "random", "--device", str(device), "--batch-size", str(batch_size), "--no-progress"]
        if with_workers:
            command += ["--workers", str(workers)]
        maps_disk: list[tuple[int, int]] = []

        def sync() -> None:
            if on_gpu:
                torch.cuda.synchronize(device)

        def run_python(round_number: int) -> None:
            out = work / f"run-{round_number}"
            explain.run(runner, work / "images", out, batch_size=batch_size, progress=False, **options)
            maps_disk.append(disk_bytes(out / "maps"))
            shutil.rmtree(out)

        def run_command(round_number: int) -> None:
            out = work / f"command-{round_number}"
            completed = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True)
            if completed.returncode != 0:
                raise RuntimeError(f"explain batch failed:\n{completed.stderr[-2000:]}")
            shutil.rmtree(out)

        def run_loop(round_number: int) -> None:
            out = work / f"loop-{round_number}"
            out.mkdir()
            written = 0
            for batch in loader:
                maps = looped.explain(batch.to(device, non_blocking=True)).maps.half().cpu().numpy()
                for one in maps:
                    np.save(out / f"{written:08d}.npy", one)
                    written += 1
            shutil.rmtree(out)

        def run_forward(round_number: int) -> None:
            with torch.no_grad():
                for batch in loader:
                    loaded.model(batch.to(device, non_blocking=True))
            sync()

        calls = {"explain.run": run_python, "explain batch": run_command, "DataLoader loop": run_loop,
                 "no-grad forward": run_forward}
        # warm-up: kernels chosen, files in the page cache, the worker code imported
        explain.run(runner, warm_folder, work / "warm-out", batch_size=batch_size, progress=False, **options)
        first = next(iter(loader))
        looped.explain(first.to(device))
        with torch.no_grad():
            loaded.model(first.to(device))
        sync()
        times: dict[str, list[float]] = {mode: [] for mode in arguments.modes}
        for round_number in range(arguments.repeats):
            for mode in arguments.modes:
                sync()
                started = time.perf_counter()
                calls[mode](round_number)
                sync()
                times[mode].append(time.perf_counter() - started)
                print(f"round {round_number + 1}, {mode}: {count / times[mode][-1]:.1f} images/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rates = {mode: count / statistics.median(values) for mode, values in times.items()}
    reference = rates.get("DataLoader loop")
    lines = [f"{count} JPEGs of {size} px, {model_name} (random weights) Grad-CAM at layer4, batch {batch_size}, "
             f"{workers} DataLoader worker(s), {device}; the median of {arguments.repeats} round(s), interleaved. "
             f"explain {'with' if with_workers else 'without (an earlier version)'} --workers.",
             "", "| run | images/s | of the DataLoader loop's |", "| --- | ---: | ---: |"]
    for mode, rate in rates.items():
        share = f"{rate / reference:.0%}" if reference else ""
        lines.append(f"| {mode} | {rate:.1f} | {share} |")
    if maps_disk:
        size_bytes, block_bytes = maps_disk[-1]
        lines += ["", f"Maps on disk (explain.run): {size_bytes / count:.0f} bytes per image in files, "
                  f"{block_bytes / count:.0f} bytes per image in disk blocks."]
    body = "\n".join(lines)
    print(body)
    if arguments.json:
        print(json.dumps({"images_per_second": rates, "maps_bytes_per_image": [value / count for value in maps_disk[-1]]
                          if maps_disk else None}))
    if arguments.write:
        write_section(f"Dataset runs: explain batch against a DataLoader loop ({device.type.upper()})", body)


if __name__ == "__main__":
    main()
