"""Build time and size of a concept atlas (``explain concepts DIR``): the watermark demo model's layer3 (64 concepts)
over N held-out images, LRP relevance maximisation with 8 references per concept (and 8 activation references).

    python benchmarks/concept_atlas.py [--images 10000] [--batch-size 64] [--write]

Reported: the build's wall time (per-image measurement, then the patches), a rerun's (nothing left to compute), a
lookup's (load the atlas, read one concept's patches), the folder's size by part, and a plain forward pass over the
same images as the floor.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder  # noqa: E402
from explain.dataset_tools.concept_atlas import build_atlas, image_files, load_atlas  # noqa: E402
from explain.io.inputs import Normalize, prepare_inputs  # noqa: E402


def size_of(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    model = load_watermark_demo()
    with tempfile.TemporaryDirectory() as scratch:
        data = write_watermark_folder(Path(scratch) / "images", count=arguments.images)
        files, _ = image_files(data)
        started = time.perf_counter()
        with torch.no_grad():
            for start in range(0, len(files), arguments.batch_size):
                model(prepare_inputs(files[start:start + arguments.batch_size], Normalize(), torch.device("cpu"),
                                     torch.float32).batch)
        forward = time.perf_counter() - started
        out = Path(scratch) / "atlas"
        started = time.perf_counter()
        build_atlas(model, "layer3", data, out, top=8, batch_size=arguments.batch_size, progress=False)
        build = time.perf_counter() - started
        started = time.perf_counter()
        build_atlas(model, "layer3", data, out, top=8, batch_size=arguments.batch_size, progress=False)
        rerun = time.perf_counter() - started
        started = time.perf_counter()
        atlas = load_atlas(out)
        patches = atlas.patches(21)
        lookup = time.perf_counter() - started
        sizes = {part: size_of(out / part) for part in ("batches", "patches")}
        total = size_of(out)
        shutil.rmtree(out)
    body = (f"`python benchmarks/concept_atlas.py --images {arguments.images} --batch-size {arguments.batch_size}"
            f"{' --write' if arguments.write else ''}`: the watermark demo model's layer3 (64 concepts), "
            f"{arguments.images} held-out 64 px images (PNG files), LRP (its default composite, epsilon_gamma_box), "
            "8 relevance and 8 activation references per concept.\n\n"
            "| | seconds | per image (ms) | × a plain forward pass |\n| --- | ---: | ---: | ---: |\n"
            f"| plain forward pass over the images (floor, files read) | {forward:.1f} | "
            f"{1000 * forward / arguments.images:.2f} | 1.0 |\n"
            f"| build (relevance and activations per image, then the patches) | {build:.1f} | "
            f"{1000 * build / arguments.images:.2f} | {build / forward:.1f} |\n"
            f"| rerun of a finished build (nothing to compute) | {rerun:.1f} | | |\n"
            f"| lookup: load the atlas, read one concept's {len(patches)} patches | {lookup:.3f} | | |\n\n"
            f"Size: {total / 2**20:.1f} MiB in all (per-batch measurements {sizes['batches'] / 2**20:.1f} MiB, patches "
            f"{sizes['patches'] / 2**20:.2f} MiB, atlas.json and atlas.html the rest).")
    print(body)
    if arguments.write:
        write_section("Concepts: building a concept atlas", body)


if __name__ == "__main__":
    main()
