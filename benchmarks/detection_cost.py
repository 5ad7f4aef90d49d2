"""Per-instance explanations of detectors: time per instance and peak memory next to a no-grad forward, and D-RISE
with its masks batched on the device next to the research implementations' masking scheme (one mask made with
OpenCV on the CPU and one forward per masked image), on the same number of masks.

    python benchmarks/detection_cost.py [--size 320] [--masks 64] [--threads 1] [--write]

Models: Ultralytics YOLOv8n (from its YAML, when ultralytics is installed) and torchvision's Faster R-CNN with a
MobileNetV3 FPN, random weights. Memory: the peak resident memory of a fresh process running one setting, minus
the same process's after loading the model (on the CPU; ``--device cuda`` gives the peak CUDA memory instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_fresh_process, median_seconds, write_section  # noqa: E402

os.environ.setdefault("YOLO_OFFLINE", "1")


def build(name: str, size: int) -> tuple[torch.nn.Module, str]:
    """(model, a CAM layer) with random weights."""
    torch.manual_seed(0)
    if name == "yolov8n":
        from ultralytics.nn.tasks import DetectionModel

        return DetectionModel("yolov8n.yaml", nc=80, verbose=False).eval(), "model.9"
    import torchvision

    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=91, min_size=size, max_size=size, box_score_thresh=0.0)
    return model.eval(), "backbone.body.16"


def research_masks_drise(model: torch.nn.Module, image: torch.Tensor, masks: int, grid: int, probability: float,
                         target, seed: int = 0) -> torch.Tensor:
    """D-RISE as the research implementations run it: for each mask, a grid drawn with NumPy, resized bilinearly
    with OpenCV to (grid + 1) cells and cropped at a random shift, the image multiplied by it, one forward pass;
    the weight is the best similarity (the same ``InstanceTarget`` as ours, so only the masking scheme differs)."""
    import cv2

    generator = np.random.default_rng(seed)
    height, width = image.shape[-2:]
    cell_height, cell_width = math.ceil(height / grid), math.ceil(width / grid)
    saliency = torch.zeros(target.instances.count, height, width, dtype=torch.float64)
    for _ in range(masks):
        cells = (generator.random((grid, grid)) < probability).astype(np.float32)
        upsampled = cv2.resize(cells, ((grid + 1) * cell_width, (grid + 1) * cell_height),
                               interpolation=cv2.INTER_LINEAR)
        y, x = generator.integers(0, cell_height), generator.integers(0, cell_width)
        mask = torch.from_numpy(np.ascontiguousarray(upsampled[y:y + height, x:x + width]))
        with torch.no_grad():
            output = model((image * mask)[None])
            similarity, _ = target.similarity(target.candidates(output), torch.zeros(1, dtype=torch.long))
        weights = similarity.amax(dim=-1)[0] if similarity.shape[-1] else torch.zeros(target.instances.count)
        saliency += weights.double()[:, None, None] * mask.double()
    return saliency


def one_setting(name: str, setting: str, size: int, masks: int, threads: int) -> dict:
    """Time and peak memory of one setting, in this (fresh) process."""
    import explain
    from explain.detection import InstanceTarget, detect

    torch.set_num_threads(threads)
    model, layer = build(name, size)
    image = torch.rand(3, size, size, generator=torch.Generator().manual_seed(1))
    batch = image[None]
    with torch.no_grad():
        model(batch)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if setting == "forward":
        def call():
            with torch.no_grad():
                model(batch)
    elif setting.startswith(("gradcam", "odam")):
        method, instances = setting.split("-")
        explainer = (explain.GradCAM if method == "gradcam" else explain.ODAM)(model, layer, progress=False)
        found = detect(model, batch, int(instances))

        def call():
            explainer.explain(batch, instances=found)
    elif setting == "drise":
        explainer = explain.DRISE(model, masks=masks, progress=False)

        def call():
            explainer.explain(batch, instances=1)
    else:  # "drise-research": the same instance and similarity, masks made and applied one at a time
        target = InstanceTarget(detect(model, batch, 1), model, (size, size))

        def call():
            research_masks_drise(model, image, masks, 16, 0.5, target)
    seconds = median_seconds(call, repeats=3, warmup=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_mib": (peak - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=320)
    parser.add_argument("--masks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="write the table to benchmarks/RESULTS.md")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        print(json.dumps(one_setting(*arguments.one, arguments.size, arguments.masks, arguments.threads)))
        return
    models = ["fasterrcnn_mobilenet"]
    try:
        import ultralytics  # noqa: F401

        models.insert(0, "yolov8n")
    except ImportError:
        print("ultralytics is not installed: YOLOv8n is left out", flush=True)
    settings = ["forward", "gradcam-1", "gradcam-4", "odam-4", "drise", "drise-research"]
    rows = []
    for name in models:
        figures = {}
        for setting in settings:
            command = [sys.executable, __file__, "--one", name, setting, "--size", str(arguments.size), "--masks",
                       str(arguments.masks), "--threads", str(arguments.threads)]
            figures[setting] = measure_in_fresh_process(command, f"{name} {setting}")
        forward = figures["forward"]
        if forward is None:
            continue
        for setting in settings[1:]:
            measured = figures[setting]
            if measured is None:
                continue
            instances = int(setting.split("-")[1]) if setting.startswith(("gradcam", "odam")) else 1
            rows.append(f"| {name} | {setting} | {measured['seconds'] * 1000:.0f} | "
                        f"{measured['seconds'] / forward['seconds'] / instances:.2f} | "
                        f"{measured['peak_mib']:.0f} | {forward['peak_mib']:.0f} |")
    table = "\n".join(["| model | setting | ms per call | × forward per instance | peak MiB | forward's peak MiB |",
                       "| --- | --- | ---: | ---: | ---: | ---: |", *rows])
    body = (f"`python benchmarks/detection_cost.py --size {arguments.size} --masks {arguments.masks} --threads "
            f"{arguments.threads}{' --write' if arguments.write else ''}`: one {arguments.size} × {arguments.size} "
            "image, random weights, median of 3 calls, each setting in a fresh process. Peak MiB: the process's "
            "peak resident memory over the calls minus its own after loading the model and one forward. "
            "gradcam-K / odam-K: K instances in one call. drise: our D-RISE (masks made on the device in one "
            f"tensor, {arguments.masks} masks, forward passes batched); drise-research: the research "
            "implementations' scheme, one mask made with OpenCV and one forward pass per masked image, on the same "
            "number of masks and with the same similarity.\n\n" + table)
    print(body)
    if arguments.write:
        write_section("Detectors: time per instance and D-RISE's masking", body)


if __name__ == "__main__":
    main()
