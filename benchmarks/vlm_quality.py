"""Do the vision-language maps point at what the answer came from? The shipped demo LLaVA (explain.data.demo_vlm)
names the colour of the one shape in each scene, and its vision encoder keeps every image token to its own patch:
the shape's colour is in the shape's tokens only (the model may still read the background's, e.g. to rule colours
out).

    python benchmarks/vlm_quality.py [--scenes 200] [--figure docs/figures/vlm_tokens.png]

For each method of GenerationExplainer over held-out scenes: the answer's accuracy; the pointing game (the map's
maximum on a token cell that the shape touches: the maps' resolution); the energy (share of the positive relevance)
on the token cells the shape touches, next to those cells' share of the image (what a map spread evenly would get).
The same numbers for the untrained model (same architecture, random weights) are the floor. Optionally draws the
docs figure: scenes × methods.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from explain import GenerationExplainer
from explain.data.demo_vlm import IMAGE_SIZE, PATCH_SIZE, QUESTIONS, Scene, build_model, held_out_scenes, load_vlm_demo
from explain.vlm.view import display_maps

METHODS = ("input_x_gradient", "attention", "attnlrp")
LABELS = {"input_x_gradient": "input × gradient", "attention": "gradient × attention", "attnlrp": "AttnLRP"}


def shape_cells(scene: Scene) -> np.ndarray:
    """(64, 64) bool: the token cells (8×8 px) that the shape's pixels touch."""
    touched = scene.mask().reshape(IMAGE_SIZE // PATCH_SIZE, PATCH_SIZE, IMAGE_SIZE // PATCH_SIZE, PATCH_SIZE)
    cells = touched.any(axis=(1, 3))
    return np.kron(cells, np.ones((PATCH_SIZE, PATCH_SIZE), dtype=bool)).astype(bool)


def measure(model: torch.nn.Module, processor: object, scenes: list[Scene]) -> dict[str, dict[str, float]]:
    rows = {}
    for method in METHODS:
        explainer = GenerationExplainer(model, processor, method=method)
        right, pointing, energy, share = 0, [], [], []
        started = time.perf_counter()
        for scene in scenes:
            explanation = explainer.explain(scene.image, QUESTIONS["color"], max_new_tokens=2)
            right += explanation.class_names[:1] == [scene.color]
            values = explanation.raw_maps[0, 0].detach().cpu().numpy()
            cells = shape_cells(scene)
            pointing.append(bool(cells.flat[int(values.argmax())]))
            positive = np.clip(values, 0, None)
            energy.append(float(positive[cells].sum() / max(positive.sum(), 1e-30)))
            share.append(float(cells.mean()))
        rows[method] = {"accuracy": right / len(scenes), "pointing": float(np.mean(pointing)),
                        "energy": float(np.mean(energy)), "share": float(np.mean(share)),
                        "ms": 1000 * (time.perf_counter() - started) / len(scenes)}
    return rows


def draw(model: torch.nn.Module, processor: object, scenes: list[Scene], path: Path) -> None:
    """Scenes in rows: the image, then each method's map of the answer's colour word (red: positive relevance,
    blue: negative, for the signed methods; the colour map's scale for the attention), the shape outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Ellipse, Rectangle

    from explain.io import render

    scale = 256 / IMAGE_SIZE
    figure, axes = plt.subplots(len(scenes), len(METHODS) + 1, figsize=(1.9 * (len(METHODS) + 1), 1.9 * len(scenes)),
                                squeeze=False)
    for row, scene in enumerate(scenes):
        axes[row, 0].imshow(np.array(scene.image.resize((256, 256), resample=0)))
        axes[row, 0].set_title(QUESTIONS["color"], fontsize=8)
        left, top, right, bottom = (scale * value for value in scene.box)
        for column, method in enumerate(METHODS, start=1):
            explanation = GenerationExplainer(model, processor, method=method).explain(
                scene.image, QUESTIONS["color"], max_new_tokens=2)
            values, cmap = display_maps(explanation)
            big = torch.nn.functional.interpolate(values[:1, None], size=(256, 256), mode="nearest")[0, 0]
            axes[row, column].imshow(render.colorize(big, cmap).numpy())
            outline = Rectangle if scene.shape == "square" else Ellipse
            if outline is Rectangle:
                patch = Rectangle((left, top), right - left + scale, bottom - top + scale, fill=False, lw=1.2)
            else:
                patch = Ellipse(((left + right + scale) / 2, (top + bottom + scale) / 2), right - left + scale,
                                bottom - top + scale, fill=False, lw=1.2)
            axes[row, column].add_patch(patch)
            axes[row, column].set_title(f"{LABELS[method]}: \"{explanation.class_names[0]}\"", fontsize=8)
    for axis in axes.flat:
        axis.axis("off")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument("--figure", type=Path, help="also draw a scene of each colour × the methods to this PNG")
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    scenes = held_out_scenes(arguments.scenes)
    trained, processor = load_vlm_demo()
    torch.manual_seed(0)
    untrained = build_model()
    print(f"{time.strftime('%Y-%m-%d')}, {arguments.scenes} held-out scenes; python {' '.join(sys.argv)}")
    print("| model | method | answer right | pointing game | energy on the shape's cells | cells' share | ms |")
    print("|---|---|---|---|---|---|---|")
    for name, model in (("demo-vlm", trained), ("untrained", untrained)):
        for method, row in measure(model, processor, scenes).items():
            print(f"| {name} | {LABELS[method]} | {row['accuracy']:.3f} | {row['pointing']:.3f} | {row['energy']:.3f} "
                  f"| {row['share']:.3f} | {row['ms']:.0f} |")
    if arguments.figure is not None:
        pool = held_out_scenes(40, seed=2024)
        one_per_colour = list({scene.color: scene for scene in reversed(pool)}.values())  # the first of each colour
        draw(trained, processor, sorted(one_per_colour, key=lambda scene: pool.index(scene)), arguments.figure)
        print(f"figure: {arguments.figure}")


if __name__ == "__main__":
    main()
