"""The documentation's SpRAy figure: the watermark demo's flagged strategy next to a clean one.

    python tools/strategies_figure.py            # writes docs/figures/strategies_watermark.png (about 20 s)

LRP maps (pixel-precise, the method SpRAy was introduced with) of the watermark demo model on 400 held-out
images, each explained for its true class; ``explain.strategies`` without masks. Row 1: the flagged cluster of
"square" (the images carrying the corner tag), its mean map and its most typical members with their maps;
row 2: the same for the class's clean cluster (the images without the tag, where the model looks at the shape).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from explain.spray import Cluster, strategies

import explain
from explain.data.demo_watermark import WATERMARKED_CLASS, load_watermark_demo, watermark_held_out
from explain.data.synthetic import CLASS_NAMES
from explain.data.train import to_model_input

OUT = Path(__file__).resolve().parents[1] / "docs" / "figures" / "strategies_watermark.png"
EXAMPLES = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--images", type=int, default=400)
    options = parser.parse_args()
    torch.set_num_threads(1)
    data = watermark_held_out(options.images)
    model = load_watermark_demo()
    maps = explain.LRP(model).explain(to_model_input(data.images), target=torch.from_numpy(data.labels)).maps
    result = strategies(maps.numpy(), classes=data.labels, class_names=CLASS_NAMES, method="lrp", progress=False)
    entry = next(entry for entry in result.classes if entry.class_index == WATERMARKED_CLASS)
    flagged = next(cluster for cluster in entry.clusters if cluster.flagged)
    clean = next(cluster for cluster in entry.clusters if not cluster.flagged)
    figure, axes = plt.subplots(2, EXAMPLES + 1, figsize=(1.6 * (EXAMPLES + 1), 4.5), gridspec_kw={"hspace": 0.45})
    for row, cluster in enumerate((flagged, clean)):
        draw_row(axes[row], cluster, data.images, maps.numpy(), data.watermarked)
    figure.suptitle(f"SpRAy on the watermark demo: class {CLASS_NAMES[WATERMARKED_CLASS]!r} "
                    f"({entry.images} held-out images, LRP), {len(entry.clusters)} clusters by the eigengap",
                    fontsize=9)
    figure.subplots_adjust(left=0.03, right=0.99, top=0.84, bottom=0.02, wspace=0.08)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(options.out, dpi=110)
    print(f"wrote {options.out}")


def draw_row(axes: np.ndarray, cluster: Cluster, images: np.ndarray, maps: np.ndarray, watermarked: np.ndarray
             ) -> None:
    members = [int(member) for member in cluster.members]
    tagged = watermarked[members].mean()
    axes[0].imshow(cluster.mean_map, cmap="jet", vmin=0, vmax=1)
    status = "FLAGGED" if cluster.flagged else "not flagged"
    axes[0].set_title(f"mean map, cluster {cluster.cluster}\n{cluster.size} images, {tagged:.0%} tagged",
                      fontsize=7)
    axes[0].set_ylabel(status, fontsize=8, color="crimson" if cluster.flagged else "black")
    overlays = np.asarray(explain.overlay(images[members[:EXAMPLES]], maps[members[:EXAMPLES]]))
    for axis, overlay, member in zip(axes[1:], overlays, members):
        axis.imshow(overlay)
        axis.set_title(f"#{member}" + (" (tag)" if watermarked[member] else ""), fontsize=7)
    for axis in axes:
        axis.set_xticks([])
        axis.set_yticks([])


if __name__ == "__main__":
    main()
