"""The attribution methods of issue 17 next to the peer that computes the same thing, same model and batch.

    python benchmarks/attribution_speed.py [--model resnet18] [--batches 1 8] [--device cpu]

Each (method, implementation, batch) row is measured in a fresh process, as in speed.py: the median
time of repeated calls and the peak memory growth of one call (RSS on the CPU,
``torch.cuda.max_memory_allocated`` on CUDA), each divided by a no-grad forward's, measured in the
same process. The same work on both sides: the same number of steps, samples and baselines, the
same targets; PAIR's ``saliency`` takes one image at a time, so its rows loop over the batch.
Writes the "Attribution methods next to their peers" section of benchmarks/RESULTS.md; rows measured
again (``--methods``, ``--batches``) replace those of earlier runs, kept in attribution_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_fresh_process  # noqa: E402

STEPS, SAMPLES, REFERENCES, NOISE = 32, 16, 4, 0.1
LAYER = "layer3"
PAIRS: dict[str, tuple[str, ...]] = {  # our method → peers computing the same
    "integratedgradients": ("captum",),
    "gradientshap": ("captum",),
    "deeplift": ("captum",),
    "deepliftshap": ("captum",),
    "layerintegratedgradients": ("captum",),
    "layerconductance": ("captum",),
    "smoothgrad": ("captum",),
    "lrp": ("zennit",),
    "guidedig": ("saliency",),
    "blurig": ("saliency",),
}
SLOW = {"guidedig", "blurig"}  # batch 1 only: per-image paths, PAIR loops in numpy


def references(batch):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(REFERENCES, *batch.shape[1:], generator=generator).to(batch.device)


def ours(method: str, model, batch, classes) -> Callable[[], Any]:
    import explain

    options: dict[str, Any] = {
        "integratedgradients": {"steps": STEPS},
        "gradientshap": {"baselines": references(batch), "samples": SAMPLES, "noise_std": NOISE, "seed": 0},
        "deeplift": {},
        "deepliftshap": {"baselines": references(batch)},
        "layerintegratedgradients": {"steps": STEPS},
        "layerconductance": {"steps": STEPS},
        "smoothgrad": {"samples": SAMPLES, "noise_std": NOISE, "seed": 0},
        "lrp": {"composite": "epsilon_plus"},
        "guidedig": {"steps": STEPS},
        "blurig": {"steps": STEPS},
    }[method]
    cls = explain.get_method(method)
    explainer = cls(model, LAYER, **options) if cls.needs_layer else cls(model, **options)
    return lambda: explainer.explain(batch, target=classes).maps


def captum(method: str, model, batch, classes) -> Callable[[], Any]:
    import captum.attr as attr
    import torch

    target = torch.tensor(classes, device=batch.device)
    layer = dict(model.named_modules())[LAYER]
    if method == "integratedgradients":
        return lambda: attr.IntegratedGradients(model).attribute(batch, target=target, n_steps=STEPS,
                                                                 method="riemann_middle")
    if method == "gradientshap":
        base = references(batch)
        return lambda: attr.GradientShap(model).attribute(batch, base, target=target, n_samples=SAMPLES, stdevs=NOISE)
    if method == "deeplift":
        return lambda: attr.DeepLift(model).attribute(batch, torch.zeros_like(batch), target=target)
    if method == "deepliftshap":
        base = references(batch)
        return lambda: attr.DeepLiftShap(model).attribute(batch, base, target=target)
    if method == "layerintegratedgradients":
        return lambda: attr.LayerIntegratedGradients(model, layer).attribute(batch, target=target, n_steps=STEPS,
                                                                             method="riemann_middle")
    if method == "layerconductance":
        return lambda: attr.LayerConductance(model, layer).attribute(batch, target=target, n_steps=STEPS,
                                                                     method="riemann_trapezoid")
    if method == "smoothgrad":
        tunnel = attr.NoiseTunnel(attr.Saliency(model))
        return lambda: tunnel.attribute(batch, target=target, nt_type="smoothgrad", nt_samples=SAMPLES, stdevs=NOISE,
                                        abs=False)
    raise ValueError(method)


def zennit(method: str, model, batch, classes) -> Callable[[], Any]:
    import torch
    from zennit.attribution import Gradient
    from zennit.composites import EpsilonPlus
    from zennit.torchvision import ResNetCanonizer

    one_hot = torch.zeros(len(batch), 1000, device=batch.device)
    one_hot[torch.arange(len(batch)), torch.tensor(classes)] = 1

    def call():
        with Gradient(model, EpsilonPlus(canonizers=[ResNetCanonizer()])) as attributor:
            return attributor(batch, one_hot)[1]

    return call


def pair(method: str, model, batch, classes) -> Callable[[], Any]:
    """PAIR saliency, one image at a time (its API), channels-last numpy in and out."""
    import numpy as np
    import saliency.core as saliency
    import torch

    def call_model(images, call_model_args=None, expected_keys=None):
        inputs = torch.tensor(np.asarray(images), dtype=torch.float32, device=batch.device).permute(0, 3, 1, 2)
        inputs.requires_grad_(True)
        scores = model(inputs)[:, call_model_args["class"]]
        (gradients,) = torch.autograd.grad(scores.sum(), inputs)
        return {saliency.base.INPUT_OUTPUT_GRADIENTS: gradients.permute(0, 2, 3, 1).cpu().numpy()}

    images = batch.permute(0, 2, 3, 1).cpu().numpy()
    if method == "guidedig":
        # PAIR's Guided IG calls np.quantile(..., interpolation=), a keyword NumPy 2.4 removed
        import types

        from saliency.core import guided_ig

        class NumpyWithInterpolation(types.ModuleType):
            def __getattr__(self, name):
                return getattr(np, name)

            @staticmethod
            def quantile(values, q, interpolation="linear", **options):
                return np.quantile(values, q, method=interpolation, **options)

        guided_ig.np = NumpyWithInterpolation("numpy")
        explainer = saliency.GuidedIG()
        return lambda: [explainer.GetMask(image, call_model, {"class": c}, x_steps=STEPS,
                                          x_baseline=np.zeros_like(image), max_dist=1.0, fraction=0.25)
                        for image, c in zip(images, classes)]
    if method == "blurig":
        explainer = saliency.BlurIG()
        return lambda: [explainer.GetMask(image, call_model, {"class": c}, steps=STEPS, batch_size=1)
                        for image, c in zip(images, classes)]
    raise ValueError(method)


def measure_one(model_name: str, batch_size: int, method: str, implementation: str, device_name: str,
                repeats: int) -> dict:
    """In a fresh process: memory growth of one call, then median times of the call and a no-grad forward."""
    import resource
    import statistics
    import time

    import psutil
    import torch
    import torchvision

    torch.manual_seed(0)
    device = torch.device(device_name)
    model = torchvision.models.get_model(model_name, weights=None).eval().to(device)
    batch = torch.randn(batch_size, 3, 224, 224, device=device)
    with torch.no_grad():
        classes = model(batch).argmax(1).tolist()
    build = {"ours": ours, "captum": captum, "zennit": zennit, "saliency": pair}[implementation]
    call = build(method, model, batch, classes)

    def forward():
        with torch.no_grad():
            return model(batch)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        synchronize()
        growth = torch.cuda.max_memory_allocated() - before
    else:
        before = psutil.Process().memory_info().rss
        call()
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before

    def timed(function, count: int) -> float:
        times = []
        for _ in range(count):
            synchronize()
            started = time.perf_counter()
            function()
            synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    forward()
    forward_seconds = timed(forward, 10)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward()
        forward_growth = torch.cuda.max_memory_allocated() - before
    else:
        forward_growth = 0
    return {"method_s": timed(call, repeats), "forward_s": forward_seconds, "growth": max(growth, 0),
            "forward_growth": forward_growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", default=list(PAIRS))
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        import torch

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        model_name, batch, method, implementation, repeats = arguments.one
        print(json.dumps(measure_one(model_name, int(batch), method, implementation, arguments.device,
                                     int(repeats))))
        return
    rows = []
    for batch in arguments.batches:
        for method in arguments.methods:
            if method in SLOW and batch > 1:
                continue
            for implementation in ("ours", *PAIRS[method]):
                command = [sys.executable, __file__, "--device", arguments.device, "--one", arguments.model,
                           str(batch), method, implementation, "3"]
                figures = measure_in_fresh_process(command, f"{method} {implementation} b{batch}")
                if figures is not None:
                    rows.append({"batch": batch, "method": method, "implementation": implementation, **figures})
    write(rows, arguments.model, arguments.device)


def merged_with_earlier(rows: list[dict], model: str, device: str) -> list[dict]:
    """The rows of this run plus those of earlier runs on the same model and device that this run did
    not measure again (kept in benchmarks/attribution_speed.json), in method order."""
    store = Path(__file__).with_name("attribution_speed.json")
    earlier: dict = json.loads(store.read_text()) if store.exists() else {}
    key = f"{model} {device}"
    by_row = {(r["method"], r["implementation"], r["batch"]): r for r in earlier.get(key, [])}
    by_row.update({(r["method"], r["implementation"], r["batch"]): r for r in rows})
    order = {method: index for index, method in enumerate(PAIRS)}
    merged = sorted(by_row.values(), key=lambda r: (r["batch"], order.get(r["method"], len(order)),
                                                    r["implementation"] != "ours"))
    earlier[key] = merged
    store.write_text(json.dumps(earlier, indent=1) + "\n")
    return merged


def write(rows: list[dict], model: str, device: str) -> None:
    from common import write_section

    rows = merged_with_earlier(rows, model, device)

    lines = [
        f"{model} (random weights), 224×224 inputs, {device.upper()}, {os.environ.get('BENCH_THREADS', '2')} threads; "
        f"{STEPS} steps for the path methods (midpoint rule for Integrated Gradients on both sides), {SAMPLES} "
        f"samples and σ = {NOISE} for GradientSHAP and SmoothGrad, {REFERENCES} reference inputs for the SHAP "
        f"variants, layer methods at `{LAYER}`, LRP with the EpsilonPlus composite and BatchNorm folded. Time: "
        "median of 3 calls; × forward: divided by a no-grad forward of the same batch timed in the same process. "
        "Memory: peak growth of one call (RSS on CPU; allocated memory on CUDA). Each row is a fresh process.",
        "",
        "| method | batch | implementation | time (s) | × forward | × peer's time | memory growth (MiB) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    ours_time = {(r["method"], r["batch"]): r["method_s"] for r in rows if r["implementation"] == "ours"}
    for row in rows:
        mine = ours_time.get((row["method"], row["batch"]))
        versus = "–" if row["implementation"] == "ours" or mine is None else f"{mine / row['method_s']:.2f}"
        lines.append(f"| {row['method']} | {row['batch']} | {row['implementation']} | {row['method_s']:.3f} | "
                     f"{row['method_s'] / row['forward_s']:.1f} | {versus} | {row['growth'] / 2**20:.0f} |")
    lines += ["", "× peer's time: ours divided by the peer's (below 1: ours is faster).", "",
              f"Command: `python benchmarks/attribution_speed.py --device {device}`."]
    write_section(f"Attribution methods next to their peers ({device.upper()})", "\n".join(lines))


if __name__ == "__main__":
    main()
