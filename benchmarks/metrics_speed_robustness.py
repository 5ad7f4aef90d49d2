"""The robustness and randomisation metrics of issue 29 (second tranche) next to Quantus 0.6, the same work
side by side in one process.

    python benchmarks/metrics_speed_robustness.py [--threads 1] [--size 224] [--batch 8] [--samples 3]
                                                  [--steps 8] [--small 64] [--repeats 1] [--device cpu]

resnet18 with random weights on ``--device`` (Quantus is given the same device), ``--batch`` synthetic images of
``--size`` px, a different class explained for each, signed gradient maps (our Saliency, Σ over channels,
wrapped as Quantus's explain_func) on both sides. Both sides get the same random draws: Quantus's numpy noise,
drawn after np.random.seed, is given to ours as ``noise``; its layer re-initialisation to ours as ``randomize``.
``--samples`` noisy copies per image, ``--steps`` translations for continuity; sMPRT re-explains the images
after each of resnet18's 41 resettable layers, at ``--small`` px. Each metric is called once on each side, then
in turn (ours, Quantus, ...) ``--repeats`` times, each side's median kept. The last column is the largest
relative |ours − Quantus| over the batch (NaN where Quantus returns NaN and we do not: see
tests/test_metrics_robustness.py). The explainer's own passes dominate these metrics: the row "Saliency alone"
is one explanation of the batch, so a metric's floor is about (copies per image) × that.
Prints a markdown table; with ``--write``, also puts it in benchmarks/RESULTS.md ("Metrics next to Quantus 0.6
(CPU): robustness and randomisation", or "(CUDA)"). Needs ``pip install --no-deps "quantus==0.6.*"`` and
``pip install pandas cachetools``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metrics_speed  # noqa: E402
from common import machine, write_section  # noqa: E402
from metrics_speed import device_label, explain_func, markdown_table, numpy_of, quantus_metric, side_by_side  # noqa: E402

import explain  # noqa: E402
from explain.data import make_dataset  # noqa: E402
from explain.data.train import to_model_input  # noqa: E402
from explain.metrics import randomisation, robustness  # noqa: E402
from explain.metrics.sanity import reinitialize  # noqa: E402


def quantus_noise(kind: str, samples: int, shape: torch.Size, seed: int, device: torch.device,
                  **parameters: float) -> torch.Tensor:
    """The (S, N, C, H, W) offsets Quantus 0.6 draws after np.random.seed(seed), one (N, C·H·W) array a sample,
    on ``device``."""
    state = np.random.get_state()
    np.random.seed(seed)
    values = getattr(np.random, kind)(size=(samples, shape[0], int(np.prod(shape[1:]))), **parameters)
    np.random.set_state(state)
    return torch.from_numpy(values).view(samples, *shape).to(device)


def relative_difference(ours: torch.Tensor, theirs: Any) -> str:
    mine, other = ours.detach().cpu().double().numpy(), np.asarray(theirs, dtype=np.float64)
    return f"{np.nanmax(np.abs(mine - other) / np.maximum(np.abs(other), 1e-12)):.1e} (relative)"


def quantus_randomize(layer: torch.nn.Module, index: int) -> None:
    """Quantus 0.6's re-initialisation (seed 42): torch.manual_seed(43) before each layer's reset."""
    reinitialize(layer, 43)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=3, help="noisy copies per image (Quantus's default: 200)")
    parser.add_argument("--steps", type=int, default=8, help="continuity's translations (Quantus's default: 28)")
    parser.add_argument("--small", type=int, default=64, help="input size for sMPRT (42 explanations per sample)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model runs, for both sides")
    parser.add_argument("--write", action="store_true", help="also write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    metrics_speed.QUANTUS_DEVICE = args.device
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval().to(device)
    images = to_model_input(make_dataset(args.batch, seed=5, size=args.size).images).to(device)
    targets = torch.arange(args.batch, device=device) * (1000 // args.batch)  # a different class for each image
    saliency = explain.Saliency(model, reduce="sum", normalize=None)
    explained = saliency.explain(images, targets)
    x, y, a = numpy_of(images), numpy_of(targets), numpy_of(explained.raw_map_grid[:, 0][:, None])
    samples, shape = args.samples, images.shape
    rows: list[tuple[str, float, Optional[float], str]] = []

    def measure(name: str, ours: Callable[[], Any], theirs: Optional[Callable[[], Any]],
                agreement: Callable[[Any, Any], str] = relative_difference) -> None:
        our_seconds, their_seconds, ours_result, theirs_result = side_by_side(ours, theirs, args.repeats)
        agreed = agreement(ours_result, theirs_result) if theirs is not None else ""
        rows.append((name, our_seconds, their_seconds, agreed))
        shown = f"{their_seconds:.3f}" if their_seconds is not None else "n/a"
        print(f"{name}: ours {our_seconds:.3f} s, Quantus {shown} s, {agreed}", flush=True)

    def quantus_call(name: str, seed: int = 7, **options: Any) -> Callable[[], Any]:
        def call() -> Any:
            np.random.seed(seed)
            return quantus_metric(name, **options)(model, x, y, a_batch=a, explain_func=explain_func)
        return call

    measure("Saliency alone (the batch once)", lambda: saliency.explain(images, targets), None)
    uniform = quantus_noise("uniform", samples, shape, 7, device, low=-0.2, high=0.2)
    measure(f"max_sensitivity ({samples} samples)",
            lambda: robustness.max_sensitivity(saliency, images, noise=uniform, explanation=explained),
            quantus_call("MaxSensitivity", nr_samples=samples))
    measure(f"avg_sensitivity ({samples} samples)",
            lambda: robustness.avg_sensitivity(saliency, images, noise=uniform, explanation=explained),
            quantus_call("AvgSensitivity", nr_samples=samples))
    gaussian = quantus_noise("normal", samples, shape, 7, device, loc=0.0, scale=0.1)
    measure(f"local_lipschitz_estimate ({samples} samples)",
            lambda: robustness.local_lipschitz_estimate(saliency, images, noise=gaussian, explanation=explained),
            quantus_call("LocalLipschitzEstimate", nr_samples=samples, normalise=False))
    one_sided = quantus_noise("uniform", samples, shape, 7, device, low=0.02, high=0.2)
    measure(f"relative_input_stability ({samples} samples)",
            lambda: robustness.relative_input_stability(saliency, images, noise=one_sided, explanation=explained),
            quantus_call("RelativeInputStability", nr_samples=samples))
    measure(f"relative_output_stability ({samples} samples)",
            lambda: robustness.relative_output_stability(saliency, images, noise=one_sided, explanation=explained),
            quantus_call("RelativeOutputStability", nr_samples=samples))
    measure(f"relative_representation_stability ({samples} samples, layer4)",
            lambda: robustness.relative_representation_stability(saliency, images, layers="layer4.1",
                                                                 noise=one_sided, explanation=explained),
            quantus_call("RelativeRepresentationStability", nr_samples=samples, layer_names=["layer4.1"]))
    measure(f"continuity ({args.steps} translations)",
            lambda: robustness.continuity(saliency, images, shifts=robustness.quantus_shifts(args.size, args.steps),
                                          explanation=explained),
            quantus_call("Continuity", nr_steps=args.steps, abs=False, normalise=False))
    measure("consistency (first 5 signs, as Quantus)",
            lambda: robustness.consistency(model, images, explained,
                                           discretise=lambda maps: maps.abs().flatten(1)[:, :5].sign()),
            lambda: quantus_metric("Consistency")(model, x, y, a_batch=a))

    resettable = [name for name, module in model.named_modules() if hasattr(module, "reset_parameters")]
    measure("efficient_mprt (every layer)",
            lambda: randomisation.efficient_mprt(saliency, images, targets, stages=resettable,
                                                 randomize=quantus_randomize).rise,
            lambda: quantus_metric("EfficientMPRT")(model, x, y, a_batch=None, explain_func=explain_func))

    import quantus

    small = F.interpolate(images, size=(args.small, args.small), mode="bilinear", align_corners=False)
    small_x = numpy_of(small)
    unit = np.random.RandomState(5).randn(samples - 1, *small_x.shape)
    spread = 0.1 * (small_x.max(axis=(1, 2, 3), keepdims=True) - small_x.min(axis=(1, 2, 3), keepdims=True))

    def quantus_smooth_mprt() -> Any:
        calls = []

        def fixed_randn(*size: int) -> np.ndarray:  # the same draws for every layer, as ours
            calls.append(size)
            return unit[(len(calls) - 1) % (samples - 1)].copy()
        real_randn, real_explain = np.random.randn, quantus.explain
        np.random.randn = fixed_randn
        quantus.explain = lambda model, inputs, targets, **kwargs: explain_func(model, inputs, targets)
        try:
            return quantus_metric("SmoothMPRT", nr_samples=samples)(model, small_x, y, a_batch=None,
                                                                   explain_func=explain_func)
        finally:
            np.random.randn, quantus.explain = real_randn, real_explain

    def last_layer(ours: list[Any], theirs: Any) -> str:
        return relative_difference(torch.stack([stage.rank_correlation.cpu() for stage in ours]),
                                   [theirs[stage.layer] for stage in ours])
    measure(f"smooth_mprt ({len(resettable)} layers, {samples} samples, {args.small} px)",
            lambda: randomisation.smooth_mprt(saliency, small, targets, samples=samples,
                                              noise=torch.from_numpy(unit * spread).to(device), stages=resettable,
                                              randomize=quantus_randomize),
            quantus_smooth_mprt, last_layer)

    where = device_label(device)
    setting = (f"resnet18 (random weights), {args.batch} images of {args.size} px, {where}, {machine()}; median of "
               f"{args.repeats} interleaved call(s) after one each, on a shared machine.")
    table = markdown_table(rows, "max relative difference", digits=3)
    print(f"\n{setting}\n\n{table}")
    if args.write:
        command = f"python benchmarks/metrics_speed_robustness.py --threads {args.threads} --device {args.device}"
        write_section(f"Metrics next to Quantus 0.6 ({where}): robustness and randomisation",
                      f"`{command}`: {setting}\n\n{table}")


if __name__ == "__main__":
    main()
