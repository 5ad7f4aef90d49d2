"""Measure the HTML report of a large batch run: its size on disk and the time to write it.

    OMP_NUM_THREADS=1 python tools/report_size.py [--images 10000] [--targets 1] [--size 224] [--no-overlays]

Writes a synthetic batch output folder (index.csv with the label columns, maps/<id>.npy float16
(K, S, S) and overlays/<id>.png of K captioned panels, as explain batch writes them; 256 distinct pictures
from explain.data's shapes, hard-linked under every image's name to spare the disk), then writes
its report twice (the second run reuses the thumbnails) and prints one line for
benchmarks/RESULTS.md: the page, the data files, the thumbnails, their total, and both times.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from explain.batch import FIELDS, RUN_RECORD, RunRecord
from explain.html_report import report
from PIL import Image

from explain import render
from explain.data import make_dataset

DISTINCT = 256
CLASS_NAMES = [f"class {index}" for index in range(10)]


def write_run(out: Path, images: int, targets: int, size: int, overlays: bool, seed: int = 0) -> None:
    """A batch output folder of ``images`` images (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    data = make_dataset(DISTINCT, seed=seed, size=size)
    base = out / "base"
    for folder in (base, out / "maps", out / "overlays"):
        folder.mkdir(parents=True)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for picture in range(DISTINCT):
        maps = np.stack([np.exp(-((yy - rng.random()) ** 2 + (xx - rng.random()) ** 2) * 10) for _ in range(targets)])
        np.save(base / f"{picture}.npy", maps.astype(np.float16))
        panels = render.overlay(data.images[picture], maps)
        captions = [[f"predicted: class {k} ({k})", "score 5.12, p 0.931", "GradCAM @ layer4"] for k in range(targets)]
        Image.fromarray(render.captioned_panels(panels, captions)).save(base / f"{picture}.png")
    rows = []
    for position in range(images):
        picture = position % DISTINCT
        image_id = f"images__{position:06d}.png-{position * 2654435761 % 2**32:08x}"
        os.link(base / f"{picture}.npy", out / "maps" / f"{image_id}.npy")
        if overlays:
            os.link(base / f"{picture}.png", out / "overlays" / f"{image_id}.png")
        label = int(rng.integers(len(CLASS_NAMES)))
        predicted = label if rng.random() < 0.8 else int(rng.integers(len(CLASS_NAMES)))
        confidence = float(rng.uniform(0.1, 1.0))
        for k in range(targets):
            target = (predicted + k) % len(CLASS_NAMES)
            rows.append({"id": image_id, "image": f"images/{position:06d}.png", "target": target, "k": k,
                         "targets": targets, "class_name": CLASS_NAMES[target], "score": f"{rng.normal(5, 2):.6g}",
                         "probability": f"{confidence if k == 0 else rng.random() / 10:.6g}",
                         "map": f"maps/{image_id}.npy", "label": label, "label_name": CLASS_NAMES[label],
                         "predicted": predicted, "predicted_name": CLASS_NAMES[predicted],
                         "confidence": repr(confidence), "correct": int(label == predicted),
                         "role": "predicted" if k == 0 else "topk"})
    with open(out / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
    record = RunRecord("gradcam", "GradCAM", CLASS_NAMES, {"mode": "both"}, "class folders")
    (out / RUN_RECORD).write_text(record.to_text(), encoding="utf-8")


def folder_size(folder: Path, pattern: str) -> tuple[int, int]:
    """(bytes, files) of the files under ``folder`` matching ``pattern``."""
    files = [path for path in folder.glob(pattern) if path.is_file()]
    return sum(path.stat().st_size for path in files), len(files)


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.0f} KB"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--targets", type=int, default=1, help="maps per image (K)")
    parser.add_argument("--size", type=int, default=224, help="image and map side in pixels")
    parser.add_argument("--no-overlays", action="store_true", help="thumbnails from the maps, not overlay PNGs")
    parser.add_argument("--keep", type=Path, help="write the run here and keep it (default: a temporary folder)")
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temporary:
        out = arguments.keep or Path(temporary) / "out"
        started = time.perf_counter()
        write_run(out, arguments.images, arguments.targets, arguments.size, not arguments.no_overlays)
        print(f"synthetic run written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        first = report(out)
        again = report(out)
        page = first.page.stat().st_size
        data, data_files = folder_size(out / "report", "data-*/*.js")
        thumbs, thumb_files = folder_size(out / "report", "thumbs-*/*/*.jpg")
        assets, _ = folder_size(out / "report", "report.*")
        total = page + data + thumbs + assets
        source = "maps" if arguments.no_overlays else "overlay PNGs"
        print(f"| report of {arguments.images:,} images (K = {arguments.targets}, {arguments.size} px, thumbnails from "
              f"{source}) | page {megabytes(page)} | data {megabytes(data)} in {data_files} .js files | thumbnails "
              f"{megabytes(thumbs)} ({thumb_files:,} JPEG, 160 px) | total {megabytes(total)} | written in "
              f"{first.seconds:.1f} s, again in {again.seconds:.1f} s "
              f"({again.thumbnails_reused:,} thumbnails reused) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
