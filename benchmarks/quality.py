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

The two shipped demo transformers (``demo-vit``: conv stem and 4 blocks; ``demo-vit2``: a plain
ViT, 8 px patch embedding and 6 blocks, another seed and other augmentations) are evaluated likewise
with the methods that suit a transformer: attention rollout, gradient-weighted rollout, Grad-CAM and
Score-CAM at the last block's first norm, saliency, Integrated Gradients, and issue 27's methods
(AttnLRP, Transformer Attribution, its AttnLRP-relevance variant AttnLRPRollout, LeGrad) once they are
registered. On top of the metrics above, the protocol of Chefer et al. 2021 ("Transformer Interpretability
Beyond Attention Visualization", section 4): segmentation (each map thresholded at its mean: pixel accuracy,
mean IoU over background and foreground, mean average precision) and positive and negative perturbation (the
accuracy as 0–90 % of the pixels are blacked out, most or least relevant first; area under the
curve). Writes the "Quality: demo transformer" section and docs/transformer.png (images × methods,
one block per model).

    python benchmarks/quality.py --transformer-only --threads 1   # both transformers only: 6 minutes on 2
                                                                   # shared CPU cores (44 with 5 other jobs)
"""

from __future__ import annotations

import argparse
import inspect
import io
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402
from explain import metrics  # noqa: E402
from explain.data import CLASS_NAMES, load_demo_model, load_demo_vit, load_demo_vit2, make_dataset  # noqa: E402
from explain.data.train import EVALUATION_SEED, to_model_input  # noqa: E402
from explain.metrics._common import ranking  # noqa: E402

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
TRANSFORMER_METHODS_WHEN_REGISTERED = ("attnlrp", "transformerattribution", "attnlrprollout", "legrad")
"""Issue 27's methods: evaluated as soon as ``explain.REGISTRY`` holds them, so a re-run picks them up."""
PERTURBATION_FRACTIONS = tuple(step / 10 for step in range(10))
"""Chefer et al. 2021's perturbation test: 0 %, 10 %, …, 90 % of the pixels removed."""
SEGMENTATION = ("pixel acc.", "mIoU", "mAP")
PERTURBATION = ("pos. AUC ↓", "neg. AUC ↑")
SUMMARY = (*SEGMENTATION, *PERTURBATION, "pointing", "energy PG", "ROAD MoRF ↓")
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
    return cls(model, layer, **quiet(cls)) if cls.needs_layer else cls(model, **quiet(cls))


def quiet(cls: type) -> dict[str, bool]:
    """``progress=False`` for a method that takes the option (a progress bar per call), else nothing."""
    return {"progress": False} if "progress" in inspect.signature(cls.__init__).parameters else {}


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


def metrics_table(rows: dict[str, dict[str, float]], all_maps: Optional[dict] = None) -> list[str]:
    """One row per map: its metrics, after its milliseconds per image (– for a baseline) when
    ``all_maps`` (name → (maps, seconds per image or None)) is given, as markdown lines."""
    columns = list(next(iter(rows.values())))
    timed = all_maps is not None
    lines = [
        "| map | " + ("ms / image | " if timed else "") + " | ".join(columns) + " |",
        "| --- | " + ("---: | " if timed else "") + " | ".join("---:" for _ in columns) + " |",
    ]
    for name, values in rows.items():
        cells = [cell(column, values[column]) for column in columns]
        if all_maps is not None:
            seconds = all_maps[name][1]
            cells.insert(0, "–" if seconds is None else f"{seconds * 1000:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def cell(column: str, value: float) -> str:
    """A metric's value as a table cell: perturbation AUCs (0–90) to one decimal, the others to three."""
    return f"{value:.1f}" if column in PERTURBATION else f"{value:.3f}"


def sanity_table(stages: dict[str, list]) -> list[str]:
    """The cascading randomisation's mean rank correlation / SSIM per method and stage, as markdown lines."""
    first = next(iter(stages.values()))
    lines = [
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


def result_tables(rows: dict[str, dict[str, float]], all_maps: dict, stages: dict[str, list]) -> list[str]:
    """The metrics table (one row per map) and the sanity-check table, as markdown lines."""
    return [*metrics_table(rows, all_maps), "", *sanity_table(stages)]


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


# ------------------------------------------------------------------ transformers


@dataclass(frozen=True)
class Transformer:
    """A shipped demo transformer to evaluate. name: its ``explain.load_model`` name; embedding: the
    module before the blocks (the last stage of the sanity check); recipe: one line for the tables."""

    name: str
    load: Callable[[], nn.Module]
    embedding: str
    recipe: str


TRANSFORMERS = {
    "demo-vit": Transformer("demo-vit", load_demo_vit, "stem", "conv stem, 4 blocks, trained with flips and quarter "
                            "turns (`python -m explain.data.train_vit`)"),
    "demo-vit2": Transformer("demo-vit2", load_demo_vit2, "patch_embed", "8 px patch embedding (one strided "
                             "convolution), 6 blocks, another seed, trained with translations and colour jitter "
                             "(`python -m explain.data.train_vit2`)"),
}


def transformer_methods() -> tuple[str, ...]:
    """The methods the transformer section runs: TRANSFORMER_METHODS and those of
    TRANSFORMER_METHODS_WHEN_REGISTERED that ``explain.REGISTRY`` holds now."""
    return TRANSFORMER_METHODS + tuple(name for name in TRANSFORMER_METHODS_WHEN_REGISTERED if name in explain.REGISTRY)


def last_block_layer(model: nn.Module) -> str:
    """The last block's first norm, ``blocks.{B−1}.norm1``: Grad-CAM's automatic layer on a ViT."""
    return f"blocks.{len(model.blocks) - 1}.norm1"


def sanity_stages(model: nn.Module, embedding: str) -> list[str]:
    """The cascading randomisation's stages, top first: head, final norm, each block, the embedding."""
    return ["head", "norm", *(f"blocks.{index}" for index in reversed(range(len(model.blocks)))), embedding]


def segmentation_scores(maps: Tensor, masks: Tensor) -> dict[str, float]:
    """Chefer et al. 2021's segmentation test (their ``imagenet_seg_eval.py``) on (N, H, W) maps and
    (N, H, W) bool object masks. Each map is resized to the mask (bilinear), scaled to [0, 1] by its
    minimum and maximum, and thresholded at its mean: above is foreground. Returns, each in [0, 1],
    higher better: "pixel acc.", the share of all pixels labelled right (pooled over the images);
    "mIoU", the mean over background and foreground of the pooled intersection over union; "mAP",
    the mean over images of the average precision of the two-class scores (1 − map for the
    background, map for the foreground) against the one-hot mask."""
    parts = segmentation_parts(maps, masks)
    return {
        "pixel acc.": (parts.correct.sum() / (parts.pixels * len(parts.correct))).item(),
        "mIoU": (parts.intersections.sum(dim=0).float() / parts.unions.sum(dim=0).float()).mean().item(),
        "mAP": parts.average_precision.mean().item(),
    }


@dataclass
class SegmentationParts:
    """Per image, what ``segmentation_scores`` pools: ``intersections`` and ``unions`` (N, 2) int64 pixel counts of
    background and foreground, ``correct`` (N,) int64 pixels labelled right out of ``pixels`` per image,
    ``average_precision`` (N,) in [0, 1]. benchmarks/claims.py resamples images from them."""

    intersections: Tensor
    unions: Tensor
    correct: Tensor
    pixels: int
    average_precision: Tensor


def segmentation_parts(maps: Tensor, masks: Tensor) -> SegmentationParts:
    """The per-image counts of Chefer et al.'s segmentation test (see ``segmentation_scores``)."""
    maps = maps.detach().float().cpu()
    masks = masks.bool().cpu()
    if maps.shape[-2:] != masks.shape[-2:]:
        maps = F.interpolate(maps[:, None], size=masks.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    low = maps.amin(dim=(1, 2), keepdim=True)
    spread = maps.amax(dim=(1, 2), keepdim=True) - low
    scaled = torch.where(spread > 0, (maps - low) / spread.clamp_min(1e-12), 0.0)  # a constant map: all background
    foreground = scaled > scaled.mean(dim=(1, 2), keepdim=True)
    intersections = torch.stack([(~foreground & ~masks).sum(dim=(1, 2)), (foreground & masks).sum(dim=(1, 2))], 1)
    unions = torch.stack([(~foreground | ~masks).sum(dim=(1, 2)), (foreground | masks).sum(dim=(1, 2))], 1)
    scores = torch.cat([1 - scaled, scaled], dim=1).flatten(1)  # (N, 2·H·W): background rows, then foreground
    labels = torch.cat([~masks, masks], dim=1).flatten(1)
    return SegmentationParts(intersections=intersections, unions=unions,
                             correct=(foreground == masks).sum(dim=(1, 2)), pixels=masks.shape[-1] * masks.shape[-2],
                             average_precision=average_precision(scores, labels))


def average_precision(scores: Tensor, labels: Tensor) -> Tensor:
    """(N, P) scores and (N, P) bool labels → (N,) average precision in [0, 1]: Σ_k (R_k − R_{k−1}) P_k
    over the distinct score thresholds, highest first (precision P_k and recall R_k of the pixels
    scoring at least the k-th threshold), as scikit-learn's ``average_precision_score``; 0 for a
    row without positives."""
    count, length = scores.shape
    order = scores.argsort(dim=1, descending=True, stable=True)
    sorted_scores = scores.gather(1, order)
    hits = labels.gather(1, order).float()
    precision = hits.cumsum(dim=1) / torch.arange(1, length + 1)
    positions = torch.arange(length).expand(count, -1)
    group_ends = torch.ones_like(hits, dtype=torch.bool)  # the last position of each run of equal scores
    group_ends[:, :-1] = sorted_scores[:, 1:] != sorted_scores[:, :-1]
    end_of_group = torch.where(group_ends, positions, length).flip(1).cummin(dim=1).values.flip(1)
    # each positive adds 1 / (positives) of recall at the precision of its threshold (its run's end)
    return (hits * precision.gather(1, end_of_group)).sum(dim=1) / hits.sum(dim=1).clamp_min(1)


def perturbation_accuracy(model: nn.Module, batch: Tensor, maps: Tensor, labels: Tensor, order: str,
                          rows_per_pass: int = 250) -> Tensor:
    """Chefer et al. 2021's perturbation test (their ``pertubation_eval_from_hdf5.py``): the model's
    accuracy on ``labels`` (N,) as each fraction of PERTURBATION_FRACTIONS of the pixels of ``batch``
    (N, C, H, W, model input) is blacked out (black before normalisation), the most relevant pixels
    of ``maps`` (N, H, W, at the input's size) first for order "positive", the least relevant first
    for "negative"; ties in a seeded random order. Returns (S,) accuracies in [0, 1]."""
    return perturbation_correct(model, batch, maps, labels, order, rows_per_pass).float().mean(dim=1)


def perturbation_correct(model: nn.Module, batch: Tensor, maps: Tensor, labels: Tensor, order: str,
                         rows_per_pass: int = 250) -> Tensor:
    """Per image, what ``perturbation_accuracy`` averages: (S, N) bool, the prediction at each fraction of
    PERTURBATION_FRACTIONS removed equals the label."""
    count, _, height, width = batch.shape
    black = to_model_input(np.zeros((1, 1, 1, 3), np.uint8))  # (1, C, 1, 1)
    ranks = ranking(maps if order == "positive" else -maps)  # (N, H, W), 0 = removed first
    fractions = torch.tensor(PERTURBATION_FRACTIONS)
    removed = ranks[None] < torch.round(fractions * height * width).view(-1, 1, 1, 1)  # (S, N, H, W)
    perturbed = torch.where(removed[:, :, None], black, batch[None]).flatten(0, 1)  # (S·N, C, H, W)
    with torch.no_grad():
        predictions = torch.cat([model(rows).argmax(dim=1) for rows in perturbed.split(rows_per_pass)])
    return predictions.view(len(fractions), count) == labels


def perturbation_scores(model: nn.Module, batch: Tensor, maps: Tensor, labels: Tensor) -> dict[str, float]:
    """Positive and negative perturbation AUC: 100 × the area under the accuracy curve over the fraction
    removed, 0 to 0.9 (trapezoid; at most 90). Positive (most relevant removed first): lower is better;
    negative (least relevant first): higher is better."""
    fractions = torch.tensor(PERTURBATION_FRACTIONS)
    return {f"{sign}. AUC {arrow}": 100 * torch.trapezoid(perturbation_accuracy(model, batch, maps, labels, order),
                                                          fractions).item()
            for sign, arrow, order in (("pos", "↓", "positive"), ("neg", "↑", "negative"))}


@dataclass
class TransformerResults:
    """One transformer's evaluation: held-out accuracy, maps and seconds per image per map, the
    Chefer et al. protocol's and the other metrics' rows, the sanity check's stages, the Grad-CAM layer."""

    accuracy: float
    all_maps: dict[str, tuple[Tensor, Optional[float]]]
    protocol: dict[str, dict[str, float]]
    rows: dict[str, dict[str, float]]
    stages: dict[str, list]
    layer: str


def evaluate_transformer(transformer: Transformer, model: nn.Module, data, batch: Tensor, labels: Tensor,
                         accuracy: float, arguments: argparse.Namespace) -> TransformerResults:
    """Every metric of the transformer section for one model on the held-out data."""
    layer = last_block_layer(model)
    methods = transformer_methods()
    baselines = baseline_maps(data.images, data.masks)
    all_maps = {name: (baselines[name], None) for name in ("random map", "centred Gaussian", "true mask")}
    all_maps.update(method_maps(model, batch, labels, methods, layer))
    masks = torch.from_numpy(data.masks)
    protocol, rows = {}, {}
    for name, (maps, _) in all_maps.items():
        protocol[name] = {**segmentation_scores(maps, masks), **perturbation_scores(model, batch, maps, labels)}
        rows[name] = evaluate(model, batch, labels, data.masks, maps, arguments.road_images)
        print(f"  evaluated {name}", flush=True)
    sanity_count = arguments.sanity_images
    stages = sanity(model, batch[:sanity_count], labels[:sanity_count], methods, layer,
                    sanity_stages(model, transformer.embedding))
    return TransformerResults(accuracy, all_maps, protocol, rows, stages, layer)


def model_figure(model: nn.Module, data, title: str, count: int) -> np.ndarray:
    """``count`` held-out images (rows) × the transformer methods (columns) for one model, as an
    (H, W, 4) RGBA array in [0, 1] drawn at 110 dpi."""
    images = list(data.images[:count])
    explanations = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in transformer_methods():
            explainer = explain.get_method(name)
            layer = (last_block_layer(model),) if explainer.needs_layer else ()
            explanations.append(explainer(model, *layer, class_names=CLASS_NAMES, **quiet(explainer)).explain(
                images, target=data.labels[:count].tolist()))
    fig = explain.figure(explanations, colorbar=True)
    fig.suptitle(title, fontsize=8)
    encoded = io.BytesIO()
    fig.savefig(encoded, format="png", dpi=110)
    encoded.seek(0)
    return plt.imread(encoded, format="png")


def transformer_figure(panels: list[np.ndarray]) -> None:
    """docs/transformer.png: the models' figures one above the other (narrower ones padded in white)."""
    width = max(panel.shape[1] for panel in panels)
    padded = [np.pad(panel, ((0, 0), (0, width - panel.shape[1]), (0, 0)), constant_values=1.0) for panel in panels]
    TRANSFORMER_FIGURE.parent.mkdir(exist_ok=True)
    plt.imsave(TRANSFORMER_FIGURE, np.concatenate(padded, axis=0))


def summary_table(results: dict[str, TransformerResults]) -> list[str]:
    """The main metrics of every map on every model side by side: cells "model 1 / model 2 / …"."""
    names = list(dict.fromkeys(name for result in results.values() for name in result.rows))
    lines = ["| map | " + " | ".join(SUMMARY) + " |", "| --- | " + " | ".join("---:" for _ in SUMMARY) + " |"]
    for name in names:
        cells = []
        for metric in SUMMARY:
            values = [({**result.protocol[name], **result.rows[name]}[metric] if name in result.rows else None)
                      for result in results.values()]
            cells.append(" / ".join("–" if value is None else cell(metric, value) for value in values))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def protocol_notes() -> str:
    """How the segmentation and perturbation columns are computed, for the section's first paragraph."""
    return (
        "Chefer et al. 2021 (\"Transformer Interpretability Beyond Attention Visualization\", section 4), on the "
        "synthetic data's object masks instead of ImageNet-segmentation: each map, min-max scaled, is thresholded "
        "at its mean into a foreground prediction; pixel accuracy and the IoU of background and foreground are "
        "pooled over all images' pixels (mIoU: their mean), mAP is the mean over images of the average precision "
        "of the two-class scores (1 − map, map) against the one-hot mask. Perturbation: 0, 10, …, 90 % of the "
        "pixels blacked out, most relevant first (positive) or least relevant first (negative), accuracy on the "
        "true class at each step; AUC = 100 × trapezoid area over the fraction removed (at most 90; positive: "
        "lower is better, negative: higher is better). All maps are of the true class."
    )


def transformer_section(arguments: argparse.Namespace) -> None:
    started = time.perf_counter()
    results: dict[str, TransformerResults] = {}
    panels = []
    for name in arguments.models:
        if name not in TRANSFORMERS:
            continue
        print(f"{name}:", flush=True)
        transformer = TRANSFORMERS[name]
        model = transformer.load()
        data, batch, labels, accuracy = held_out(model, arguments.images)
        results[name] = evaluate_transformer(transformer, model, data, batch, labels, accuracy, arguments)
        panels.append(model_figure(model, data, f"{name} ({transformer.recipe.split(' (')[0]}; held-out "
                                   f"accuracy {accuracy:.2f}): maps of the true class; the filled shape is the "
                                   "class, rings, bars and boxes are distractors", arguments.figure_images))
    transformer_figure(panels)
    models = " / ".join(f"`{name}`" for name in results)
    lines = [
        f"The shipped demo transformers on {arguments.images} held-out synthetic images (seed {EVALUATION_SEED}); "
        + "; ".join(f"`{name}`: {TRANSFORMERS[name].recipe}, held-out accuracy {result.accuracy:.3f}"
                    for name, result in results.items())
        + ". Maps of the true class; Grad-CAM and Score-CAM at the last block's first norm (Grad-CAM's automatic "
        "layer); rollouts over all blocks (mean head fusion, no discarding). "
        + protocol_notes() + " " + metric_notes(arguments, data, time.perf_counter() - started),
        "",
        f"Both models side by side, each cell {models}:",
        "",
        *summary_table(results),
    ]
    for name, result in results.items():
        lines += [
            "", f"### {name}", "",
            f"`explain.load_model(\"{name}\")`, Grad-CAM and Score-CAM at `{result.layer}`. Segmentation and "
            "perturbation (Chefer et al. 2021):",
            "",
            *metrics_table(result.protocol),
            "", "Localisation and faithfulness (as in the CNN's section):", "",
            *result_tables(result.rows, result.all_maps, result.stages),
        ]
    threads = "" if arguments.threads == 2 else f" --threads {arguments.threads}"
    lines += ["", "![transformer](../docs/transformer.png)", "",
              f"Command: `python benchmarks/quality.py --transformer-only{threads}`."]
    write_section("Quality: demo transformer", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--road-images", type=int, default=50, help="ROAD's imputation is the slowest metric")
    parser.add_argument("--sanity-images", type=int, default=24)
    parser.add_argument("--figure-images", type=int, default=4, help="rows per transformer in docs/transformer.png")
    parser.add_argument("--models", nargs="+", choices=("demo", *TRANSFORMERS), default=["demo", *TRANSFORMERS])
    parser.add_argument("--threads", type=int, default=2, help="torch threads; 1 is not slowed down by other "
                        "processes on a shared machine (with 2 threads on 2 busy cores, a conv stem's gradients "
                        "can take 10× as long)")
    parser.add_argument("--transformer-only", action="store_true",
                        help="only the transformer section, both transformers (same as --models demo-vit demo-vit2)")
    arguments = parser.parse_args()
    if arguments.transformer_only:
        arguments.models = list(TRANSFORMERS)
    torch.set_num_threads(arguments.threads)
    if "demo" in arguments.models:
        factorization_section(arguments)
        cnn_section(arguments)
    if any(name in TRANSFORMERS for name in arguments.models):
        transformer_section(arguments)


if __name__ == "__main__":
    main()
