"""How faithful and how well localised is each method? Ground truth from the synthetic data set.

    python benchmarks/quality.py [--images 100] [--models demo demo-vit]   # minutes on 2 CPU cores, no download

Evaluates every registered CNN method on the shipped demo model (CAMs at ``layer4``),
plus baselines that look at no model (a random map, a centred Gaussian, Sobel
edges of the image, the true mask), on held-out images of the data set the model
was trained on, with every metric of ``explain.metrics``; then runs the cascading
randomisation sanity check. Grad-CAM with the CAM options (smooth="augment", smooth="eigen",
layer3 and layer4 combined) adds rows; RandomCAM (random channel weights) is the floor that
every method must beat, and the methods that do not are listed. Writes the "Quality" section of
benchmarks/RESULTS.md and benchmarks/quality.png; then the "Deep feature factorisation" section
(layer4 into 4 concepts) and docs/factorization.png.

The shipped demo transformer (``demo-vit``) is evaluated likewise with the methods that suit a
transformer: attention rollout, gradient-weighted rollout, Grad-CAM and Score-CAM at the last
block's first norm, saliency and Integrated Gradients. Writes the "Quality: demo transformer"
section and docs/transformer.png (images × methods).
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
from explain.data import CLASS_NAMES, load_demo_model, load_demo_vit, make_dataset  # noqa: E402
from explain.data.train import EVALUATION_SEED, to_model_input  # noqa: E402
from explain.methods.perturbation import PerturbationCAM  # noqa: E402

FIGURE = Path(__file__).with_name("quality.png")
TRANSFORMER_FIGURE = Path(__file__).resolve().parent.parent / "docs" / "transformer.png"
TOLERANCE = 4  # pixels at 64 px, as TorchRay's 15 px at 224 px
CURVE_STEPS = 16
ROAD_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)
SANITY_METHODS = ("gradcam", "gradcam++", "scorecam", "saliency", "integratedgradients", "guidedbackprop",
                  "guidedgradcam", "randomcam",
                  # issue 17's methods
                  "gradientshap", "deeplift", "guidedig", "blurig", "xrai", "lrp", "layerintegratedgradients",
                  "layerconductance")
TRANSFORMER_METHODS = ("attentionrollout", "gradientrollout", "gradcam", "scorecam", "saliency", "integratedgradients")
TRANSFORMER_LAYER = "blocks.3.norm1"  # the last block's first norm, Grad-CAM's automatic choice
TRANSFORMER_STAGES = ["head", "norm", "blocks.3", "blocks.2", "blocks.1", "blocks.0", "stem"]
OPTION_ROWS = {  # CAM options of issue 16, as extra rows: (method, constructor options)
    "gradcam, smooth=augment": ("gradcam", {"layer": "layer4", "smooth": "augment"}),
    "gradcam, smooth=eigen": ("gradcam", {"layer": "layer4", "smooth": "eigen"}),
    "gradcam, layer3+4 mean": ("gradcam", {"layer": ["layer3", "layer4"]}),
    "gradcam, layer3+4 raw mean": ("gradcam", {"layer": ["layer3", "layer4"], "normalize_layers": False}),
    "gradcam, layer3+4 product": ("gradcam", {"layer": ["layer3", "layer4"], "combine": "product"}),
}
LOCALISATION = ("pointing", "energy PG", "mass acc.", "rank acc.")
FLOOR = "randomcam"
FACTORIZATION_FIGURE = Path(__file__).resolve().parent.parent / "docs" / "factorization.png"


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


def build(name: str, model, layer: str = "layer4"):
    """A registered method on a demo model: CAMs at ``layer``, no progress bars."""
    cls = explain.get_method(name)
    options = {"progress": False} if issubclass(cls, PerturbationCAM) else {}
    return cls(model, layer, **options) if cls.needs_layer else cls(model, **options)


def cnn_methods() -> list[str]:
    return [name for name in sorted(explain.REGISTRY) if not getattr(explain.get_method(name), "needs_attention",
                                                                         False)]


def method_maps(model, batch: torch.Tensor, labels: torch.Tensor, names=None,
                layer: str = "layer4") -> dict[str, tuple[torch.Tensor, float]]:
    """Each method's maps of the true class (default: every registered CNN method), and seconds per image."""
    results = {}
    for name in names or cnn_methods():
        explainer = build(name, model, layer)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = explainer.explain(batch, target=labels.tolist()).maps
        results[name] = (maps, (time.perf_counter() - started) / len(batch))
        print(f"  {name}: {results[name][1] * 1000:.1f} ms per image", flush=True)
    return results


def option_maps(model, batch: torch.Tensor, labels: torch.Tensor) -> dict[str, tuple[torch.Tensor, float]]:
    """Maps of the true class with the CAM options of OPTION_ROWS, and seconds per image."""
    results = {}
    for label, (name, options) in OPTION_ROWS.items():
        options = dict(options)
        explainer = explain.get_method(name)(model, options.pop("layer"), **options)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = explainer.explain(batch, target=labels.tolist()).maps
        results[label] = (maps, (time.perf_counter() - started) / len(batch))
        print(f"  {label}: {results[label][1] * 1000:.1f} ms per image", flush=True)
    return results


def below_floor(rows: dict[str, dict[str, float]], baselines: set[str]) -> list[str]:
    """Lines naming, per localisation metric, the methods that do not beat RandomCAM (the floor)."""
    floor = rows[FLOOR]
    lines = []
    for metric in LOCALISATION:
        losing = [name for name, values in rows.items()
                  if name not in baselines and name != FLOOR and values[metric] <= floor[metric]]
        lines.append(f"- {metric} (RandomCAM {floor[metric]:.3f}): "
                     + (", ".join(f"{name} {rows[name][metric]:.3f}" for name in losing) or "every method beats it"))
    return lines


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


def sanity(model, batch, labels, names=SANITY_METHODS, layer: str = "layer4", stages=None) -> dict[str, list]:
    results = {}
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # randomised copies may give empty maps
            results[name] = metrics.cascading_randomization(build(name, model, layer), batch, labels.tolist(),
                                                            stages=stages)
    return results


def figure(rows: dict[str, dict[str, float]], stages: dict[str, list]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.6), layout="constrained", width_ratios=(2, 1))
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


def result_tables(rows: dict[str, dict[str, float]], all_maps: dict, stages: dict[str, list]) -> list[str]:
    """The metrics table (one row per map) and the sanity-check table, as markdown lines."""
    columns = list(next(iter(rows.values())))
    lines = [
        "| map | ms / image | " + " | ".join(columns) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for name, values in rows.items():
        seconds = all_maps[name][1]
        timing = "–" if seconds is None else f"{seconds * 1000:.1f}"
        lines.append(f"| {name} | {timing} | " + " | ".join(f"{values[c]:.3f}" for c in columns) + " |")
    first = next(iter(stages.values()))
    lines += [
        "",
        f"Sanity check, cascading randomisation on {len(first[0].ssim)} images: mean Spearman rank correlation "
        "(of |map|) / SSIM between the trained model's maps and the randomised copy's, after each stage "
        "(top layer first).",
        "",
        "| method | " + " | ".join(stage.layer for stage in first) + " |",
        "| --- | " + " | ".join("---:" for _ in first) + " |",
    ]
    for name, results in stages.items():
        cells = [f"{stage.rank_correlation.mean():.2f} / {stage.ssim.mean():.2f}" for stage in results]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def held_out(model, count: int):
    data = make_dataset(count, seed=EVALUATION_SEED)
    batch = to_model_input(data.images)
    labels = torch.from_numpy(data.labels)
    with torch.no_grad():
        accuracy = (model(batch).argmax(1) == labels).float().mean().item()
    print(f"{len(data)} held-out images, model accuracy {accuracy:.3f}", flush=True)
    return data, batch, labels, accuracy


def metric_notes(arguments: argparse.Namespace, data, elapsed: float) -> str:
    return (
        f"Pointing game with a {TOLERANCE} px tolerance (TorchRay's 15 px at 224 px). Deletion (zero substrate) "
        f"and insertion (blurred substrate) in {CURVE_STEPS} steps; "
        f"ROAD at {', '.join(f'{s:.0%}' for s in ROAD_SHARES)} removed, noisy linear imputation, on the first "
        f"{arguments.road_images} images; probabilities throughout. "
        f"Object (mask) area: {data.masks.mean():.1%} of the image on average. Run time {elapsed:.0f} s."
    )


def cnn_section(arguments: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = load_demo_model()
    data, batch, labels, accuracy = held_out(model, arguments.images)
    all_maps = {name: (maps, None) for name, maps in baseline_maps(data.images, data.masks).items()}
    baselines = set(all_maps)
    all_maps.update(method_maps(model, batch, labels))
    all_maps.update(option_maps(model, batch, labels))
    rows = {}
    for name, (maps, _) in all_maps.items():
        rows[name] = evaluate(model, batch, labels, data.masks, maps, arguments.road_images)
        print(f"  evaluated {name}", flush=True)
    sanity_count = arguments.sanity_images
    stages = sanity(model, batch[:sanity_count], labels[:sanity_count])
    figure(rows, stages)
    lines = [
        f"The shipped demo model (held-out accuracy {accuracy:.3f}) on {len(data)} held-out synthetic images "
        f"(seed {EVALUATION_SEED}); maps of the true class; CAMs at `layer4`. "
        + metric_notes(arguments, data, time.perf_counter() - started),
        "",
        *result_tables(rows, all_maps, stages),
        "", "Methods that do not beat RandomCAM (random channel weights, the floor), per localisation metric:", "",
        *below_floor(rows, baselines),
        "", "![quality](quality.png)", "", "Command: `python benchmarks/quality.py --models demo`.",
    ]
    write_section("Quality", "\n".join(lines))
    print("\n".join(lines))


def factorization_section(arguments: argparse.Namespace, concepts: int = 4) -> None:
    """Deep feature factorisation of the demo model's layer4 over the held-out images: reconstruction
    error, how often a concept's map peaks on the deciding object; writes docs/factorization.png."""
    model = load_demo_model()
    data = make_dataset(arguments.images, seed=EVALUATION_SEED)
    started = time.perf_counter()
    result = explain.DeepFeatureFactorization(model, "layer4", concepts=concepts,
                                              class_names=CLASS_NAMES).factorize(list(data.images))
    seconds = time.perf_counter() - started
    masks = torch.from_numpy(data.masks)
    hits = torch.stack([metrics.pointing_game(result.maps[:, j], masks, tolerance=3) for j in range(concepts)])
    concept_of_class = result.concept_probabilities.argmax(dim=0)
    class_hits = hits[concept_of_class[torch.from_numpy(data.labels)], torch.arange(len(data))]
    shown = np.concatenate([np.nonzero(data.labels == label)[0][:2] for label in range(len(CLASS_NAMES))])
    FACTORIZATION_FIGURE.parent.mkdir(exist_ok=True)
    result.figure(shown).savefig(FACTORIZATION_FIGURE, dpi=110)
    lines = [
        f"`DeepFeatureFactorization(model, \"layer4\", concepts={concepts})` on the demo model's {len(data)} held-out "
        f"images (seed {EVALUATION_SEED}), one factorisation of the whole batch in {seconds:.2f} s.",
        "",
        f"- Relative reconstruction error ‖A − W H‖ / ‖A‖: {result.relative_error:.3f}.",
        "- Pointing game (peak within 3 px of the object), per concept: "
        + ", ".join(f"concept {j + 1} {hits[j].mean():.2f}" for j in range(concepts))
        + f"; the concept that the classifier links to the image's class: {class_hits.mean():.2f}; "
        f"any of the {concepts} concepts: {hits.amax(0).mean():.2f}.",
        "- Classes per concept (softmax of the classifier on the concept's channel profile): "
        + "; ".join(result.labels()) + ".",
        "", "![factorization](../docs/factorization.png)", "",
        "Command: `python benchmarks/quality.py --models demo`.",
    ]
    write_section("Deep feature factorisation", "\n".join(lines))
    print("\n".join(lines))


def transformer_figure(model, data, count: int = 6) -> None:
    """docs/transformer.png: ``count`` held-out images (rows) × the transformer methods (columns)."""
    images = list(data.images[:count])
    explanations = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in TRANSFORMER_METHODS:
            explainer = explain.get_method(name)
            options = {"progress": False} if issubclass(explainer, PerturbationCAM) else {}
            layer = (TRANSFORMER_LAYER,) if explainer.needs_layer else ()
            explanations.append(explainer(model, *layer, class_names=CLASS_NAMES, **options).explain(
                images, target=data.labels[:count].tolist()))
    fig = explain.figure(explanations, colorbar=True)
    fig.suptitle("The demo transformer (conv stem + 4 blocks, held-out accuracy ≥ 0.95): maps of the true class; "
                 "the filled shape is the class, rings, bars and boxes are distractors", fontsize=8)
    TRANSFORMER_FIGURE.parent.mkdir(exist_ok=True)
    fig.savefig(TRANSFORMER_FIGURE, dpi=110)


def transformer_section(arguments: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = load_demo_vit()
    data, batch, labels, accuracy = held_out(model, arguments.images)
    baselines = baseline_maps(data.images, data.masks)
    all_maps = {name: (baselines[name], None) for name in ("random map", "centred Gaussian", "true mask")}
    all_maps.update(method_maps(model, batch, labels, TRANSFORMER_METHODS, TRANSFORMER_LAYER))
    rows = {}
    for name, (maps, _) in all_maps.items():
        rows[name] = evaluate(model, batch, labels, data.masks, maps, arguments.road_images)
        print(f"  evaluated {name}", flush=True)
    sanity_count = arguments.sanity_images
    stages = sanity(model, batch[:sanity_count], labels[:sanity_count], TRANSFORMER_METHODS, TRANSFORMER_LAYER,
                    TRANSFORMER_STAGES)
    transformer_figure(model, data)
    lines = [
        f"The shipped demo transformer (`explain.data.load_demo_vit()`, held-out accuracy {accuracy:.3f}) on "
        f"{len(data)} held-out synthetic images (seed {EVALUATION_SEED}); maps of the true class; Grad-CAM and "
        f"Score-CAM at `{TRANSFORMER_LAYER}` (the last block's first norm, Grad-CAM's automatic layer); rollouts "
        "over all four blocks (mean head fusion, no discarding). " + metric_notes(arguments, data,
                                                                                  time.perf_counter() - started),
        "",
        *result_tables(rows, all_maps, stages),
        "", "![transformer](../docs/transformer.png)", "",
        "Command: `python benchmarks/quality.py --models demo-vit`.",
    ]
    write_section("Quality: demo transformer", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--road-images", type=int, default=50, help="ROAD's imputation is the slowest metric")
    parser.add_argument("--sanity-images", type=int, default=24)
    parser.add_argument("--models", nargs="+", choices=("demo", "demo-vit"), default=["demo", "demo-vit"])
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    if "demo" in arguments.models:
        factorization_section(arguments)
        cnn_section(arguments)
    if "demo-vit" in arguments.models:
        transformer_section(arguments)


if __name__ == "__main__":
    main()
