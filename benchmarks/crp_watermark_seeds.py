"""CRP on the watermark demonstration at several training seeds: for tagged "square" images, is the most relevant
concept of layer3 one whose reference images (relevance maximisation over held-out images) put their conditional
relevance on the tag?

    python benchmarks/crp_watermark_seeds.py [--seeds 0 1 2] [--images 200] [--write]

Seed 0: the shipped weights; other seeds: ``explain.data.train_watermark.train(seed=...)``. For each model: the channel
most often the top concept of 8 tagged squares, its 8 relevance references among ``--images`` held-out images, and
for the references that carry the tag the share of the concept's positive conditional relevance inside the tag's box.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402
from explain.data.demo_watermark import load_watermark_demo, watermark_held_out  # noqa: E402
from explain.data.train_watermark import train  # noqa: E402
from explain.methods.concepts import concept_references  # noqa: E402
from explain.metrics import energy_pointing_game  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    data = watermark_held_out(arguments.images)
    tag_pixels = torch.from_numpy((data.images != data.clean_images).any(axis=-1))
    tagged = [image for image, flag in zip(data.images, data.watermarked) if flag][:8]
    rows = []
    for seed in arguments.seeds:
        model = load_watermark_demo() if seed == 0 else train(seed=seed)
        crp = explain.ConceptRelevance(model, "layer3")
        top = crp.explain(tagged, concepts=1)
        concept = int(torch.mode(top.class_indices[:, 0]).values)
        share_top = float((top.class_indices[:, 0] == concept).float().mean())
        references = concept_references(crp, list(data.images), concepts=[concept], top=8)
        carrying = [int(index) for index in references.images[0] if bool(tag_pixels[int(index)].any())]
        shares = []
        if carrying:
            explanation = crp.explain([data.images[index] for index in carrying], concepts=[concept])
            # the share of each map's positive relevance inside the tag's bounding box
            shares = energy_pointing_game(explanation.raw_maps[:, 0], tag_pixels[carrying]).tolist()
        rows.append(f"| {seed} | {concept} | {share_top:.2f} | {len(carrying)} / 8 | "
                    f"{min(shares) if shares else float('nan'):.2f} – {max(shares) if shares else float('nan'):.2f} |")
    table = "\n".join(["| seed | top concept (layer3) | share of the 8 tagged squares where it is top | references "
                       "carrying the tag | share of its relevance in the tag's box (min – max) |",
                       "| ---: | ---: | ---: | ---: | ---: |", *rows])
    body = (f"`python benchmarks/crp_watermark_seeds.py --seeds {' '.join(map(str, arguments.seeds))} --images "
            f"{arguments.images}{' --write' if arguments.write else ''}`: CRP (LRP, its default composite) of 8 tagged "
            f"held-out squares, references among {arguments.images} held-out images (8 per concept).\n\n" + table)
    print(body)
    if arguments.write:
        write_section("Concepts: CRP of the watermark at three seeds", body)


if __name__ == "__main__":
    main()
