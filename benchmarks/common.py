"""Helpers shared by the benchmarks: timing, machine description, writing RESULTS.md sections."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    import numpy as np

RESULTS = Path(__file__).with_name("RESULTS.md")


def median_seconds(function: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def seconds_of(call: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call, waiting for the GPU's queued work before and after on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure_in_fresh_process(command: list[str], label: str) -> Optional[dict]:
    """Run one measurement command in a fresh process: the JSON object its last output line holds,
    printed with ``label``; None (and the error's tail printed) when it failed."""
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        print(f"{label}: failed\n{completed.stderr[-1500:]}", flush=True)
        return None
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    print(f"{label}: {figures}", flush=True)
    return figures


def machine() -> str:
    """One line: CPU model, cores, threads torch uses, torch version, and the GPU if any."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


def write_section(title: str, body: str) -> None:
    """Replace (or append) the ``## title`` section of RESULTS.md, stamped with date and machine."""
    stamp = f"Measured {datetime.date.today().isoformat()} on {machine()}."
    section = f"## {title}\n\n{stamp}\n\n{body.strip()}\n"
    header = "# Benchmark results\n\nWritten by the scripts in benchmarks/.\n"
    text = RESULTS.read_text() if RESULTS.exists() else header
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")


def bootstrap(values: "np.ndarray", draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95 % bootstrap interval of the mean of ``values`` (``draws`` resamples, seeded)."""
    import numpy as np

    generator = np.random.default_rng(seed)
    means = [values[generator.integers(0, len(values), len(values))].mean() for _ in range(draws)]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))
