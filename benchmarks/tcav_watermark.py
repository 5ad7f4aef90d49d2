"""TCAV on the watermark demonstration (``demo-watermark``: "square" images carry a checkerboard tag in training):
is a "tag" concept significant for "square" and for no clean class, with the paper's SGD-trained CAVs and with
FastCAV's closed-form ones, and how much faster is FastCAV for the same conclusions?

    python benchmarks/tcav_watermark.py [--seeds 0 1 2] [--randoms 20] [--size 50] [--write]

For each seed, a model is trained by the repo's script (``explain.data.train_watermark.train(seed=...)``; seed 0:
the shipped weights). Concept "tag": images of every class with the tag drawn in; random sets: clean images of every
class (other seeds); class images: 50 clean held-out images of each class. TCAV at layer2, layer3 and layer4
(flattened feature maps, 16 384 to 4 096 values), against ``--randoms`` random sets, t-test and Bonferroni as in
the paper (alpha 0.05). Time: the CAVs alone (the activations and gradients are shared), per method.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

from explain.data.demo_watermark import CORNER, load_watermark_demo  # noqa: E402
from explain.data.synthetic import CLASS_NAMES, add_watermark, make_dataset  # noqa: E402
from explain.data.train_watermark import train  # noqa: E402
from explain.methods.tcav import TCAV, _two_sided_t_test  # noqa: E402

LAYERS = ("layer2", "layer3", "layer4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--randoms", type=int, default=20)
    parser.add_argument("--size", type=int, default=50, help="images per concept and random set")
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    tag_images = list(add_watermark(make_dataset(arguments.size, seed=777).images, corner=CORNER))
    randoms = [list(make_dataset(arguments.size, seed=1000 + index).images) for index in range(arguments.randoms)]
    held_out = make_dataset(50 * len(CLASS_NAMES) * 2, seed=4242)
    by_class = {label: list(held_out.images[held_out.labels == label][:50]) for label in range(len(CLASS_NAMES))}
    rows, agreements, cav_seconds = [], 0, {"sgd": 0.0, "fastcav": 0.0}
    raised: dict[tuple[str, str], list[str]] = {}
    agree_by_layer: dict[str, int] = {}
    tests_count = 0
    for seed in arguments.seeds:
        model = load_watermark_demo() if seed == 0 else train(seed=seed)
        base = TCAV(model, list(LAYERS))
        tag = base.activations(tag_images)
        random_activations = [base.activations(images) for images in randoms]
        for label, name in enumerate(CLASS_NAMES):
            gradients = base.gradients(by_class[label], target=label)
            conclusions = {}
            for method in ("sgd", "fastcav"):
                tcav = TCAV(model, list(LAYERS), cav=method)
                for layer in LAYERS:
                    started = time.perf_counter()
                    concept_cavs = [tcav.cav(tag[layer], random[layer]) for random in random_activations]
                    null_cavs = [tcav.cav(random_activations[i][layer],
                                          random_activations[(i + 1) % len(randoms)][layer])
                                 for i in range(len(randoms))]
                    cav_seconds[method] += time.perf_counter() - started
                    scores = torch.tensor([TCAV.score(gradients[layer], cav) for cav in concept_cavs],
                                          dtype=torch.float64)
                    null = torch.tensor([TCAV.score(gradients[layer], cav) for cav in null_cavs], dtype=torch.float64)
                    p_value = _two_sided_t_test(scores, null)
                    significant = p_value < 0.05 / len(CLASS_NAMES)
                    direction = "raises" if float(scores.mean()) > 0.5 else "lowers"
                    conclusions[(method, layer)] = direction if significant else "none"
                    if direction == "raises" and significant:
                        raised.setdefault((method, layer), []).append(f"{name}@{seed}")
                    rows.append(f"| {seed} | {name} | {layer} | {method} | {float(scores.mean()):.2f} ± "
                                f"{float(scores.std()):.2f} | {float(null.mean()):.2f} | {p_value:.2g} | "
                                f"{'yes' if significant else 'no'} |")
            for layer in LAYERS:
                tests_count += 1
                agreements += conclusions[("sgd", layer)] == conclusions[("fastcav", layer)]
                agree_by_layer[layer] = agree_by_layer.get(layer, 0) + int(
                    conclusions[("sgd", layer)] == conclusions[("fastcav", layer)])
    speedup = cav_seconds["sgd"] / max(cav_seconds["fastcav"], 1e-9)
    table = "\n".join(["| seed | class | layer | CAV | TCAV score (mean ± sd) | null mean | p | significant |",
                       "| ---: | --- | --- | --- | ---: | ---: | ---: | --- |", *rows])
    body = (f"`python benchmarks/tcav_watermark.py --seeds {' '.join(map(str, arguments.seeds))} --randoms "
            f"{arguments.randoms} --size {arguments.size}{' --write' if arguments.write else ''}`: concept \"tag\" "
            f"({arguments.size} images of every class with the watermark) against {arguments.randoms} random sets "
            f"of {arguments.size} clean images, 50 clean held-out images per class, significance at 0.05 / "
            f"{len(CLASS_NAMES)} (Bonferroni over the classes). CAV time in all: SGD {cav_seconds['sgd']:.1f} s, "
            f"FastCAV {cav_seconds['fastcav']:.2f} s ({speedup:.0f}× faster). The two reach the same conclusion "
            f"(significantly raises the class, significantly lowers it, or neither) in {agreements} of "
            f"{tests_count} (seed, class, layer) tests; by layer: "
            + ", ".join(f"{layer} {count}/{tests_count // len(LAYERS)}" for layer, count in agree_by_layer.items())
            + ". Where the tag significantly raises a class (class@seed): "
            + "; ".join(f"{method} {layer}: {', '.join(found) or 'none'}" for (method, layer), found in
                        sorted(raised.items())) + ".\n\n" + table)
    print(body)
    if arguments.write:
        write_section("Concepts: TCAV of the watermark, SGD and FastCAV CAVs", body)


if __name__ == "__main__":
    main()
