"""Which AttnLRP settings localise and rank best? The γ question, measured on both shipped transformers.

    python benchmarks/attnlrp_rules.py [--images 100]     # a few minutes on 2 CPU cores, no download

AttnLRP's maps depend on the rule of the linear layers (LRP-0, or LRP-γ with γ chosen per model in lxt's
examples) and of the patch embedding's convolution, on CP-LRP versus the softmax rule, and on how the signed
relevance of the colour channels becomes a map. Each setting is run on the held-out synthetic images of both shipped
transformers (``demo-vit``: convolutional stem, 4 blocks; ``demo-vit2``: patch embedding, 6 blocks, another seed
and augmentation) and scored with Chefer et al.'s segmentation test (pixel accuracy, mIoU, mAP) and perturbation
test (positive AUC, lower better; negative AUC, higher better), from benchmarks/quality.py. Writes the "AttnLRP
settings" section of benchmarks/RESULTS.md; the default of ``explain.AttnLRP`` is the setting chosen from it.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402
from quality import TRANSFORMERS, held_out, perturbation_scores, segmentation_scores  # noqa: E402

import explain  # noqa: E402

SETTINGS: dict[str, dict] = {  # reduce="sumabs" (the default) unless the row says "signed"
    "LRP-0 (default)": {},
    "LRP-0, signed (reduce=\"sum\")": {"reduce": "sum"},
    "linear γ 0.05": {"linear_gamma": 0.05},
    "linear γ 0.25": {"linear_gamma": 0.25},
    "linear γ 1": {"linear_gamma": 1.0},
    "conv γ 0.25": {"conv_gamma": 0.25},
    "conv γ 0.25, linear γ 0.05": {"conv_gamma": 0.25, "linear_gamma": 0.05},
    "conv γ 0.25, signed": {"conv_gamma": 0.25, "reduce": "sum"},
    "CP-LRP": {"conservative": True},
    "CP-LRP, conv γ 0.25": {"conservative": True, "conv_gamma": 0.25},
}
COLUMNS = ("pixel acc.", "mIoU", "mAP", "pos. AUC ↓", "neg. AUC ↑")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--models", nargs="+", default=list(TRANSFORMERS), choices=list(TRANSFORMERS))
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    lines = [
        f"{arguments.images} held-out synthetic images per model, maps of the true class. Segmentation test: the map "
        "thresholded at its mean against the object mask; perturbation test: accuracy as 0–90 % of the pixels are "
        "blacked out, most relevant first (positive, lower better) or least relevant first (negative, higher "
        "better), area × 100.",
        "",
    ]
    for name in arguments.models:
        transformer = TRANSFORMERS[name]
        model = transformer.load().eval()
        data, batch, labels, accuracy = held_out(model, arguments.images)
        masks = torch.from_numpy(data.masks)
        lines += [f"**{name}** ({transformer.recipe}; accuracy {accuracy:.2f})", "",
                  "| setting | " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
        for label, options in SETTINGS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                maps = explain.AttnLRP(model, **options).explain(batch, target=labels.tolist()).maps
            scores = {**segmentation_scores(maps, masks), **perturbation_scores(model, batch, maps, labels)}
            print(f"{name} {label}: {scores}", flush=True)
            lines.append(f"| {label} | " + " | ".join(f"{scores[column]:.3f}" if column in COLUMNS[:3]
                                                      else f"{scores[column]:.1f}" for column in COLUMNS) + " |")
        lines.append("")
    lines.append(f"Command: `python benchmarks/attnlrp_rules.py --images {arguments.images}` "
                 f"({time.perf_counter() - started:.0f} s).")
    write_section("AttnLRP settings", "\n".join(lines))


if __name__ == "__main__":
    main()
