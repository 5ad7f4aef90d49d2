"""How faithful and how well localised is each method? Ground truth from the synthetic data set.

    python benchmarks/quality.py [--images 100]       # a few minutes on 2 CPU cores, no download

Evaluates every registered method on the shipped demo model (CAMs at ``layer4``),
plus baselines that look at no model (a random map, a centred Gaussian, Sobel
edges of the image, the true mask), on held-out images of the data set the model
was trained on, with every metric of ``explain.metrics``; then runs the cascading
randomisation sanity check. Writes the "Quality" section of benchmarks/RESULTS.md
and benchmarks/quality.png.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402
from explain import metrics  # noqa: E402
from explain.data import load_demo_model, make_dataset  # noqa: E402
from explain.data.train import EVALUATION_SEED, to_model_input  # noqa: E402
from explain.methods.perturbation import PerturbationCAM  # noqa: E402

FIGURE = Path(__file__).with_name("quality.png")
TOLERANCE = 4  # pixels at 64 px, as TorchRay's 15 px at 224 px
CURVE_STEPS = 16
ROAD_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)
SANITY_METHODS = ("gradcam", "gradcam++", "scorecam", "saliency", "integratedgradients", "guidedbackprop",
                  "guidedgradcam")


def baseline_maps(images: np.ndarray, masks: np.ndarray) -> dict[str, torch.Tensor]:
    """Maps that look at no model: they set the floor (and, for the mask, the ceiling)."""
    count, height, width = masks.shape
    rows, columns = torch.meshgrid(torch.arange(height) - (height - 1) / 2, torch.arange(width) - (width - 1) / 2,
                                   indexing="ij")
    gaussian = torch.exp(-(rows**2 + columns**2) / (2 * (height / 4) ** 2))
    gray = torch.from_numpy(images).float().mean(dim=3)[:, None] / 255
    sobel_x = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]])
    edges = torch.hypot(F.conv2d(gray, sobel_x.view(1, 1, 3, 3), padding=1),
                        F.conv2d(gray, sobel_x.t().reshape(1, 1, 3, 3), padding=1))[:, 0]
    generator = torch.Generator().manual_seed(0)
    return {
        "random map": torch.rand(count, height, width, generator=generator),
        "centred Gaussian": gaussian.expand(count, -1, -1).clone(),
        "Sobel edges": edges,
        "true mask": torch.from_numpy(masks).float(),
    }


def build(name: str, model):
    """A registered method on the demo model: CAMs at layer4, no progress bars."""
    cls = explain.get_method(name)
    options = {"progress": False} if issubclass(cls, PerturbationCAM) else {}
    return cls(model, "layer4", **options) if cls.needs_layer else cls(model, **options)


def method_maps(model, batch: torch.Tensor, labels: torch.Tensor) -> dict[str, tuple[torch.Tensor, float]]:
    """Every registered method's maps of the true class, and seconds per image."""
    results = {}
    for name in sorted(explain.REGISTRY):
        explainer = build(name, model)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = explainer.explain(batch, target=labels.tolist()).maps
        results[name] = (maps, (time.perf_counter() - started) / len(batch))
        print(f"  {name}: {results[name][1] * 1000:.1f} ms per image", flush=True)
    return results


def evaluate(model, batch, labels, masks, maps, road_images: int) -> dict[str, float]:
    masks_tensor = torch.from_numpy(masks)
    target = labels.tolist()
    change = metrics.confidence_change(model, batch, maps, target)
    road_batch, road_maps, road_target = batch[:road_images], maps[:road_images], target[:road_images]
    return {
        "pointing": metrics.pointing_game(maps, masks_tensor, tolerance=TOLERANCE).mean().item(),
        "energy PG": metrics.energy_pointing_game(maps, masks_tensor).mean().item(),
        "mass acc.": metrics.relevance_mass_accuracy(maps, masks_tensor).mean().item(),
        "rank acc.": metrics.relevance_rank_accuracy(maps, masks_tensor).mean().item(),
        "deletion ↓": metrics.deletion(model, batch, maps, target, steps=CURVE_STEPS).area.mean().item(),
        "insertion ↑": metrics.insertion(model, batch, maps, target, steps=CURVE_STEPS).area.mean().item(),
        "ROAD MoRF ↓": metrics.road(model, road_batch, road_maps, road_target,
                                    percentages=ROAD_SHARES).area.mean().item(),
        "ROAD LeRF ↑": metrics.road(model, road_batch, road_maps, road_target, order="lerf",
                                    percentages=ROAD_SHARES).area.mean().item(),
        "avg drop % ↓": 100 * change.drop.mean().item(),
        "increase % ↑": 100 * change.increase.mean().item(),
    }


def sanity(model, batch, labels) -> dict[str, list]:
    results = {}
    for name in SANITY_METHODS:
        results[name] = metrics.cascading_randomization(build(name, model), batch, labels.tolist())
    return results


def figure(rows: dict[str, dict[str, float]], stages: dict[str, list]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    names = list(rows)
    positions = np.arange(len(names))
    for offset, metric in zip((-0.2, 0.0, 0.2), ("pointing", "mass acc.", "deletion ↓")):
        left.bar(positions + offset, [rows[name][metric] for name in names], width=0.2, label=metric)
    left.set_xticks(positions, names, rotation=60, ha="right", fontsize=8)
    left.set_ylabel("score")
    left.set_title("Localisation and deletion on held-out synthetic images")
    left.legend(fontsize=8)
    for name, results in stages.items():
        right.plot([stage.layer for stage in results], [stage.rank_correlation.mean().item() for stage in results],
                   marker="o", label=name)
    right.axhline(0, color="gray", linewidth=0.5)
    right.set_xlabel("randomised down to (cascading, top layer first)")
    right.set_ylabel("Spearman rank correlation with trained maps")
    right.set_title("Sanity check (Adebayo et al. 2018)")
    right.legend(fontsize=8)
    fig.savefig(FIGURE, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--road-images", type=int, default=50, help="ROAD's imputation is the slowest metric")
    parser.add_argument("--sanity-images", type=int, default=24)
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    model = load_demo_model()
    data = make_dataset(arguments.images, seed=EVALUATION_SEED)
    batch = to_model_input(data.images)
    labels = torch.from_numpy(data.labels)
    with torch.no_grad():
        accuracy = (model(batch).argmax(1) == labels).float().mean().item()
    print(f"{len(data)} held-out images, model accuracy {accuracy:.3f}", flush=True)

    all_maps = {name: (maps, None) for name, maps in baseline_maps(data.images, data.masks).items()}
    all_maps.update(method_maps(model, batch, labels))
    rows = {}
    for name, (maps, _) in all_maps.items():
        rows[name] = evaluate(model, batch, labels, data.masks, maps, arguments.road_images)
        print(f"  evaluated {name}", flush=True)
    sanity_count = arguments.sanity_images
    stages = sanity(model, batch[:sanity_count], labels[:sanity_count])
    figure(rows, stages)
    elapsed = time.perf_counter() - started

    columns = list(next(iter(rows.values())))
    lines = [
        f"The shipped demo model (held-out accuracy {accuracy:.3f}) on {len(data)} held-out synthetic images "
        f"(seed {EVALUATION_SEED}); maps of the true class; CAMs at `layer4`. Pointing game with a {TOLERANCE} px "
        "tolerance (TorchRay's 15 px at 224 px). Deletion (zero substrate) and insertion (blurred "
        f"substrate) in {CURVE_STEPS} steps; "
        f"ROAD at {', '.join(f'{s:.0%}' for s in ROAD_SHARES)} removed, noisy linear imputation, on the first "
        f"{arguments.road_images} images; probabilities throughout. "
        f"Object (mask) area: {data.masks.mean():.1%} of the image on average. Run time {elapsed:.0f} s.",
        "",
        "| map | ms / image | " + " | ".join(columns) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for name, values in rows.items():
        seconds = all_maps[name][1]
        timing = "–" if seconds is None else f"{seconds * 1000:.1f}"
        lines.append(f"| {name} | {timing} | " + " | ".join(f"{values[c]:.3f}" for c in columns) + " |")
    lines += [
        "",
        f"Sanity check, cascading randomisation on {sanity_count} images: mean Spearman rank correlation "
        "(of |map|) / SSIM between the trained model's maps and the randomised copy's, after each stage "
        "(top layer first).",
        "",
        "| method | " + " | ".join(stage.layer for stage in next(iter(stages.values()))) + " |",
        "| --- | " + " | ".join("---:" for _ in next(iter(stages.values()))) + " |",
    ]
    for name, results in stages.items():
        cells = [f"{stage.rank_correlation.mean():.2f} / {stage.ssim.mean():.2f}" for stage in results]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "![quality](quality.png)", "", "Command: `python benchmarks/quality.py`."]
    write_section("Quality", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
