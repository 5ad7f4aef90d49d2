"""The metrics of issue 29 next to Quantus 0.6, the same work side by side in one process.

    python benchmarks/metrics_speed.py [--threads 1] [--size 224] [--batch 8] [--repeats 5] [--device cpu]

resnet18 with random weights on ``--device`` (Quantus is given the same device), ``--batch`` synthetic images of
``--size`` px with their object masks, a different class explained for each, signed gradient maps (Σ over
channels) computed once and given to both sides; where a metric explains (input invariance, random logit), both
sides run the same explainer of ours. Each metric is called once on each side, then in turn (ours, Quantus,
ours, ...) and each side's median is kept: what loads the machine meanwhile slows both alike. The last column is
the largest |ours − Quantus| over the batch, from the same calls, with settings under which both compute the
same thing (see tests/test_metrics_breadth.py for why the defaults differ), or the share of equal verdicts where
Quantus returns booleans. Non-sensitivity runs one forward per input element: at ``--small`` px.
Prints a markdown table; with ``--write``, also puts it in benchmarks/RESULTS.md ("Metrics next to Quantus 0.6
(CPU): faithfulness, localisation, complexity, axiomatic", or "(CUDA)").
Needs ``pip install --no-deps "quantus==0.6.*"`` and
``pip install pandas cachetools scikit-image``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_section  # noqa: E402

import explain  # noqa: E402
from explain import metrics  # noqa: E402
from explain.data import make_dataset  # noqa: E402
from explain.data.train import to_model_input  # noqa: E402

QUANTUS_DEVICE = "cpu"
"""The device Quantus's metrics are called with (``--device``): they move each batch there and back."""


def quantus_metric(name: str, **options: Any) -> Callable[..., Any]:
    """Quantus's metric ``name`` built with ``options``, called on QUANTUS_DEVICE."""
    import quantus

    warnings.filterwarnings("ignore", module="quantus")
    metric = getattr(quantus, name)(disable_warnings=True, **options)
    return lambda *arguments, **keywords: metric(*arguments, device=QUANTUS_DEVICE, **keywords)


def numpy_of(values: torch.Tensor) -> np.ndarray:
    """A tensor on any device as a numpy array (what Quantus is given)."""
    return values.detach().cpu().numpy()


def explain_func(model: torch.nn.Module, inputs: np.ndarray, targets: np.ndarray, **kwargs: Any) -> np.ndarray:
    """Quantus's explain_func: our signed gradient map, raw, (N, 1, H, W), computed on the model's device."""
    device = next(model.parameters()).device
    explainer = explain.Saliency(model, reduce="sum", normalize=None)
    batch = torch.as_tensor(np.asarray(inputs), dtype=torch.float32, device=device)
    classes = torch.as_tensor(np.asarray(targets), device=device).long()
    return numpy_of(explainer.explain(batch, classes).raw_map_grid[:, 0][:, None])


def ssim_2d(shape: tuple[int, int]) -> Callable[..., list[float]]:
    """Quantus similarity_func: 2-D SSIM (Gaussian window, σ 1.5, data range 1), as ``explain.metrics.ssim``."""
    from skimage.metrics import structural_similarity

    def similarity(first: np.ndarray, second: np.ndarray, batched: bool = True, **kwargs: Any) -> list[float]:
        return [structural_similarity(a.reshape(shape).astype(np.float64), b.reshape(shape).astype(np.float64),
                                      gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0)
                for a, b in zip(first, second)]
    return similarity


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, waiting for the GPU's queued work before and after where CUDA is in use."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = call()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def side_by_side(ours: Callable[[], Any], theirs: Optional[Callable[[], Any]], repeats: int
                 ) -> tuple[float, Optional[float], Any, Any]:
    """(our median seconds, Quantus's or None, our last result, Quantus's last result)."""
    ours_result, theirs_result = ours(), theirs() if theirs is not None else None  # warm-up
    our_times, their_times = [], []
    for _ in range(repeats):
        seconds, ours_result = timed(ours)
        our_times.append(seconds)
        if theirs is not None:
            seconds, theirs_result = timed(theirs)
            their_times.append(seconds)
    return (statistics.median(our_times), statistics.median(their_times) if their_times else None, ours_result,
            theirs_result)


def largest_difference(ours: torch.Tensor, theirs: Any) -> str:
    return f"{np.abs(ours.detach().cpu().double().numpy() - np.asarray(theirs, dtype=np.float64)).max():.1e}"


def device_label(device: torch.device) -> str:
    """"CPU" or "CUDA": the word the RESULTS.md section titles use."""
    return "CUDA" if device.type == "cuda" else "CPU"


Record = Callable[[str, Callable[[], Any], Optional[Callable[[], Any]], Callable[[Any, Any], str]], None]
"""record(name, ours, theirs, agreement): time one call of each side and keep a row."""


def markdown_table(rows: list[tuple[str, float, Optional[float], str]], agreement: str, digits: int) -> str:
    """The markdown table of (metric, our seconds, Quantus's seconds or None, agreement) rows."""
    lines = [f"| metric | explain (s) | Quantus 0.6 (s) | Quantus / explain | agreement ({agreement}) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, our_seconds, their_seconds, agreed in rows:
        their_text = f"{their_seconds:.{digits}f}" if their_seconds is not None else "n/a"
        ratio = f"{their_seconds / our_seconds:.1f}×" if their_seconds is not None else "n/a"
        lines.append(f"| {name} | {our_seconds:.{digits}f} | {their_text} | {ratio} | {agreed} |")
    return "\n".join(lines)


def faithfulness_rows(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, heat: torch.Tensor,
                      record: Record) -> None:
    """The faithfulness metrics of issue 29's second part on the same work: the same maps, draws, baselines
    (Quantus's "black" is "minimum") and forward passes, ``len(images)`` rows per pass on both sides (Quantus
    passes the whole batch; ours ``batch_size=N``). Quantus steps through the C·H·W values k at a time, k
    dividing H·W: ours take ``features="elements"`` and the same number of steps (at 224 px no k keeps whole
    pixels, so the two break ties between a pixel's channels differently at the few step boundaries)."""
    count, channels, height, width = images.shape
    device = images.device
    x, y, a = numpy_of(images), numpy_of(targets), numpy_of(heat[:, None])
    values = channels * height * width

    def draws(seed: int, make: Callable[[], np.ndarray]) -> np.ndarray:
        state = np.random.get_state()
        np.random.seed(seed)
        result = make()
        np.random.set_state(state)
        return result

    def quantus_subsets() -> np.ndarray:  # per run: np.random.choice per image, then the baseline's N uniforms
        runs = []
        for _ in range(12):
            runs.append(np.stack([np.random.choice(values, 224, replace=False) for _ in range(count)]))
            np.random.uniform(size=count)
        return np.stack(runs, axis=1)
    subsets = torch.from_numpy(draws(7, quantus_subsets)).to(device)

    def seeded(seed: int, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            np.random.seed(seed)
            return call()
        return run
    record("faithfulness_correlation (12 runs)",
           lambda: metrics.faithfulness_correlation(model, images, heat, targets, subsets=subsets, features="elements",
                                                    substrate="minimum", batch_size=count),
           seeded(7, lambda: quantus_metric("FaithfulnessCorrelation", nr_runs=12, subset_size=224,
                                            return_aggregate=False)(model, x, y, a)), largest_difference)
    step = height * width // 8  # 24 steps of 1/8 of H·W values
    record("faithfulness_estimate (24 steps)",
           lambda: metrics.faithfulness_estimate(model, images, heat, targets, steps=24, features="elements",
                                                 substrate="minimum", batch_size=count),
           lambda: quantus_metric("FaithfulnessEstimate", features_in_step=step)(model, x, y, a), largest_difference)

    flat = x.reshape(count, -1)

    def put_back(arr: np.ndarray, indices: np.ndarray, **kwargs: Any) -> np.ndarray:
        """Arya et al.'s step: the image's own values back (Quantus 0.6's default writes the baseline again)."""
        restored = arr.copy()
        rows = np.arange(count)[:, None]
        restored[rows, indices] = flat[rows, indices]
        return restored

    def verdicts(ours: Any, theirs: Any) -> str:
        return f"same verdict {(numpy_of(ours.monotonic) == np.asarray(theirs, dtype=float)).mean():.0%}"
    record("monotonicity (24 steps, features put back)",
           lambda: metrics.monotonicity(model, images, heat.abs(), targets, steps=24, features="elements",
                                        substrate="minimum", batch_size=count),
           lambda: quantus_metric("Monotonicity", features_in_step=step, perturb_func=put_back)(model, x, y, a),
           verdicts)
    noise = torch.from_numpy(draws(3, lambda: np.random.uniform(size=(12, 2, count)))).permute(2, 0, 1)[..., None]
    noise = noise.float().to(device)
    record("monotonicity_correlation (12 steps × 2)",
           lambda: metrics.monotonicity_correlation(model, images, heat, targets, steps=12, samples=2,
                                                    noise=noise, features="elements", batch_size=count),
           seeded(3, lambda: quantus_metric("MonotonicityCorrelation", features_in_step=2 * step, nr_samples=2)(
               model, x, y, a)), largest_difference)

    def drops(ours: Any, theirs: Any) -> str:
        return largest_difference(ours.curves[:, :1] - ours.curves[:, 1:], theirs)
    record("region_perturbation (16 px, 24 regions)",
           lambda: metrics.region_perturbation(model, images, heat, targets, patch_size=16, regions=24,
                                               substrate="minimum", batch_size=count),
           lambda: quantus_metric("RegionPerturbation", patch_size=16, regions_evaluation=24)(model, x, y, a), drops)
    record("selectivity (32 px, 49 patches)",
           lambda: metrics.selectivity(model, images, heat, targets, patch_size=32, substrate="minimum",
                                       batch_size=count),
           lambda: quantus_metric("Selectivity", patch_size=32)(model, x, y, a),
           lambda ours, theirs: largest_difference(ours.curves[:, 1:], theirs))
    sensitivity_sizes = [values // 672, values * 10 // 672, values * 100 // 672]  # 224, 2240, 22400 at 224 px
    record("sensitivity_n (3 sizes × 8 runs; Quantus: 24 cumulative steps, another measure)",
           lambda: metrics.sensitivity_n(model, images, heat, targets, subset_sizes=sensitivity_sizes, runs=8,
                                         features="elements", substrate="minimum", batch_size=count),
           lambda: quantus_metric("SensitivityN", features_in_step=step)(model, x, y, a),
           lambda ours, theirs: "not comparable")

    class Grey(torch.nn.Module):  # Quantus 0.6's IROF needs one-channel images
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.model(batch.expand(-1, 3, -1, -1))
    grey_model, grey = Grey().eval(), images.mean(dim=1, keepdim=True)
    grey_heat = explain.Saliency(grey_model, reduce="sum", normalize=None).explain(grey, targets).raw_map_grid[:, 0]

    def quantus_irof() -> Any:
        if not hasattr(np, "trapz"):  # NumPy 2 renamed it np.trapezoid; Quantus 0.6 calls the old name
            np.trapz = np.trapezoid  # type: ignore[attr-defined]
        return quantus_metric("IROF", perturb_baseline="black", return_aggregate=False)(
            grey_model, numpy_of(grey), y, numpy_of(grey_heat[:, None]))

    def irof_agreement(ours: Any, theirs: Any) -> str:
        segments = torch.tensor([curve.shape[0] - 1 for curve in ours.curves], device=device)
        first = torch.stack([curve[1] for curve in ours.curves])
        return largest_difference(segments * ours.area_over_curve + (1 + first) / 2, theirs)
    record("irof (grey, SLIC, ~100 segments)",
           lambda: metrics.irof(grey_model, grey, grey_heat, targets, substrate=float(grey.min()), batch_size=count),
           quantus_irof, irof_agreement)

    patch = height // 4  # 16 patches of 56 px at 224 px
    grid, patch_count = metrics.patch_grid(height, width, patch)
    grid = grid.to(device)
    lowest = images.flatten(1).amin(dim=1).view(-1, 1, 1, 1)
    perturbed, perturbations = images, []
    for patch in range(patch_count):  # Quantus's perturbations: the grid's patches replaced cumulatively
        perturbed = torch.where(grid == patch, lowest, perturbed)
        perturbations.append(images - perturbed)
    stacked = torch.stack(perturbations, dim=1)
    record(f"infidelity ({patch_count} patches of {patch} px)",
           lambda: metrics.infidelity(model, images, heat, targets, perturbations=stacked, batch_size=count),
           lambda: quantus_metric("Infidelity", perturb_patch_sizes=[patch], n_perturb_samples=1)(model, x, y, a),
           largest_difference)
    twins = torch.cat([heat, heat[torch.arange(count, device=device).roll(1)] * 1.01]).abs()
    both = torch.cat([images, images])
    record("sufficiency (16 images)",
           lambda: metrics.sufficiency(model, both, twins, batch_size=2 * count),
           lambda: quantus_metric("Sufficiency")(model, numpy_of(both), np.concatenate([y, y]),
                                                 numpy_of(twins[:, None])),
           largest_difference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--small", type=int, default=16, help="input size for non-sensitivity (one pass per element)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model runs, for both sides")
    parser.add_argument("--write", action="store_true", help="also write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    global QUANTUS_DEVICE
    QUANTUS_DEVICE = args.device
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval().to(device)
    data = make_dataset(args.batch, seed=5, size=args.size)
    images = to_model_input(data.images).to(device)
    masks = torch.from_numpy(data.masks).to(device)
    targets = torch.arange(args.batch, device=device) * (1000 // args.batch)  # a different class for each image
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    explained = saliency.explain(images, targets)  # given to both sides where a metric takes the maps
    heat = explained.raw_map_grid[:, 0]
    x, y, a, s = numpy_of(images), numpy_of(targets), numpy_of(heat[:, None]), numpy_of(masks[:, None].float())
    rows: list[tuple[str, float, Optional[float], str]] = []

    def measure(name: str, ours: Callable[[], Any], theirs: Optional[Callable[[], Any]],
                agreement: Callable[[Any, Any], str], repeats: int = args.repeats) -> None:
        our_seconds, their_seconds, ours_result, theirs_result = side_by_side(ours, theirs, repeats)
        agreed = agreement(ours_result, theirs_result) if theirs is not None else "Quantus fails"
        rows.append((name, our_seconds, their_seconds, agreed))
        shown = f"{their_seconds:.4f}" if their_seconds is not None else "n/a"
        print(f"{name}: ours {our_seconds:.4f} s, Quantus {shown} s, {agreed}", flush=True)

    measure("top_k_intersection (k=1000)", lambda: metrics.top_k_intersection(heat, masks, k=1000),
            lambda: quantus_metric("TopKIntersection", k=1000)(model, x, y, a, s), largest_difference)
    measure("auc", lambda: metrics.auc(heat, masks), lambda: quantus_metric("AUC")(model, x, y, a, s),
            largest_difference)

    tiles = to_model_input(make_dataset(2 * args.batch, seed=6, size=args.size // 2).images).to(device)
    tile_labels = torch.from_numpy(make_dataset(2 * args.batch, seed=6, size=args.size // 2).labels).to(device)
    mosaics = metrics.make_mosaics(tiles, tile_labels, count=args.batch)
    mosaic_maps = saliency.explain(mosaics.images, mosaics.targets).raw_map_grid[:, 0]
    positions = mosaics.positions.int().tolist()
    measure("focus", lambda: metrics.focus(mosaic_maps, mosaics.positions),
            lambda: quantus_metric("Focus")(model, numpy_of(mosaics.images), numpy_of(mosaics.targets),
                                            numpy_of(mosaic_maps[:, None]), custom_batch=positions), largest_difference)

    measure("sparseness", lambda: metrics.sparseness(heat), lambda: quantus_metric("Sparseness")(model, x, y, a),
            largest_difference)
    measure("complexity", lambda: metrics.complexity(heat), lambda: quantus_metric("Complexity")(model, x, y, a),
            largest_difference)
    peaks = heat.abs().amax(dim=(1, 2), keepdim=True)
    scaled = heat / peaks  # each map's peak 1 on both sides (Quantus would divide by the batch's)
    measure("effective_complexity", lambda: metrics.effective_complexity(scaled, normalise=False),
            lambda: quantus_metric("EffectiveComplexity", normalise=False)(model, x, y, numpy_of(scaled[:, None])),
            largest_difference)

    integrated = explain.IntegratedGradients(model, steps=8).explain(images, targets)
    attributions = integrated.attributions[:, 0]

    def verdicts(ours: metrics.Completeness, theirs: Any) -> str:
        same = (numpy_of(ours.error == 0) == np.asarray(theirs, dtype=bool)).mean()
        return f"same verdict {same:.0%}"
    measure("completeness", lambda: metrics.completeness(model, images, attributions, targets, baseline="minimum"),
            lambda: quantus_metric("Completeness", normalise=False)(model, x, y, numpy_of(attributions)), verdicts)

    small = F.interpolate(images, size=(args.small, args.small), mode="bilinear", align_corners=False)
    small_heat = saliency.explain(small, targets).raw_map_grid[:, 0]
    small_heat = small_heat / small_heat.abs().amax(dim=(1, 2), keepdim=True)
    measure(f"non_sensitivity ({args.small} px, elements)",
            lambda: metrics.non_sensitivity(model, small, small_heat, targets, baseline="minimum", features="elements"),
            lambda: quantus_metric("NonSensitivity", normalise=False)(model, numpy_of(small), y,
                                                                       numpy_of(small_heat[:, None])),
            largest_difference, repeats=1)

    measure("input_invariance (saliency)", lambda: metrics.input_invariance(saliency, images, targets), None,
            lambda ours, theirs: "")

    class_count = 1000
    state = np.random.get_state()
    np.random.seed(42)  # Quantus's draws (seed=42): an index among the classes other than the target
    offsets = np.random.randint(0, class_count - 1, args.batch)
    np.random.set_state(state)
    others = torch.from_numpy(offsets + (offsets >= y)).long().to(device)  # the same classes, given to ours

    def quantus_random_logit() -> Any:
        metric = quantus_metric("RandomLogit", num_classes=class_count, seed=42, abs=True,
                                normalise_func_kwargs={"normalise_axes": (1, 2, 3)},
                                similarity_func=ssim_2d((args.size, args.size)))
        return metric(model, x, y, a, explain_func=explain_func)
    measure("random_logit (ssim)",
            lambda: metrics.random_logit(saliency, images, other_classes=others, explanation=explained).similarity,
            quantus_random_logit, largest_difference, repeats=3)

    def best_of_two(name: str, ours: Callable[[], Any], theirs: Optional[Callable[[], Any]],
                    agreement: Callable[[Any, Any], str]) -> None:
        """The faster of two interleaved calls each side (ours, Quantus, ours, Quantus), no warm-up: these
        cost hundreds of forward passes, the model is warm already, and the faster call is the one the
        machine's other load slowed least."""
        our_times, their_times = [], []
        for _ in range(2):
            seconds, ours_result = timed(ours)
            our_times.append(seconds)
            if theirs is not None:
                seconds, theirs_result = timed(theirs)
                their_times.append(seconds)
        agreed = agreement(ours_result, theirs_result) if theirs is not None else "Quantus fails"
        their_seconds = min(their_times) if their_times else None
        rows.append((name, min(our_times), their_seconds, agreed))
        print(f"{name}: ours {min(our_times):.2f} s, Quantus {their_seconds or float('nan'):.2f} s, {agreed}",
              flush=True)
    def forward() -> Any:
        with torch.inference_mode():
            return model(images)
    forward()
    rows.append(("a forward pass of the batch alone (the floor: a metric of n forwards costs n of these)",
                 min(timed(forward)[0] for _ in range(3)), None, "no Quantus counterpart"))
    faithfulness_rows(model, images, targets, heat, best_of_two)

    where = device_label(device)
    setting = (f"resnet18 (random weights), {args.batch} images of {args.size} px, {where}, {machine()}; median of "
               f"{args.repeats} interleaved calls (random logit 3, non-sensitivity 1) on a shared machine.")
    table = markdown_table(rows, "max abs difference", digits=4)
    note = ("The faithfulness rows (from faithfulness_correlation on) are the faster of two interleaved calls each "
            "side: both sides run the same forward passes, N rows per pass, which take most of the time; ours give "
            "the model channels-last batches (explain.core.memory_format).")
    print(f"\n{setting}\n\n{table}\n\n{note}")
    if args.write:
        command = f"python benchmarks/metrics_speed.py --threads {args.threads} --device {args.device}"
        write_section(f"Metrics next to Quantus 0.6 ({where}): faithfulness, localisation, complexity, axiomatic",
                      f"`{command}`: {setting}\n\n{table}\n\n{note}")


if __name__ == "__main__":
    main()
