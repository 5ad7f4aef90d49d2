"""The attribution methods of issue 17 next to the peer that computes the same thing, same model and batch.

    python benchmarks/attribution_speed.py [--model resnet18] [--batches 1 8] [--device cpu]

Time: for each (method, batch), one fresh process builds our explainer and the peers', calls each
once, then calls them in turn (ours, peer, ours, peer, ..., with a no-grad forward in each round)
and takes each one's median: what loads the machine meanwhile slows both sides alike. Memory: the
peak growth of one call (RSS on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA), in a fresh
process per implementation. The same work on both sides: the same number of steps, samples and
baselines, the same targets; PAIR's ``saliency`` takes one image at a time, so its rows loop over
the batch. Where ours computes a diagnostic that the peer computes only on request (GradientSHAP's
completeness check), both are measured with it and without it.
Writes the "Attribution methods next to their peers" section of benchmarks/RESULTS.md; rows measured
again (``--methods``, ``--batches``) replace those of earlier runs, kept in attribution_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_fresh_process, seconds_of  # noqa: E402

STEPS, SAMPLES, REFERENCES, NOISE = 32, 16, 4, 0.1
LAYER = "layer3"
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {  # method → (our variant, the peer's doing the same work)
    "integratedgradients": (("ours", "captum"),),
    "gradientshap": (("ours", "captum, convergence delta"), ("ours, no completeness check", "captum")),
    "deeplift": (("ours", "captum"),),
    "deepliftshap": (("ours", "captum"),),
    "layerintegratedgradients": (("ours", "captum"),),
    "layerconductance": (("ours", "captum"),),
    "smoothgrad": (("ours", "captum"),),
    "lrp": (("ours", "zennit"),),
    "guidedig": (("ours", "saliency"),),
    "blurig": (("ours", "saliency"),),
}


def implementations(method: str) -> list[str]:
    """Every implementation measured for a method, ours first, each once."""
    ours = [mine for mine, _ in PAIRS[method]]
    peers = [theirs for _, theirs in PAIRS[method]]
    return list(dict.fromkeys(ours + peers))
SLOW = {"guidedig", "blurig"}  # batch 1 only: per-image paths, PAIR loops in numpy


def references(batch):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(REFERENCES, *batch.shape[1:], generator=generator).to(batch.device)


def ours(method: str, model, batch, classes, variant: str = "ours", **extra: Any) -> Callable[[], Any]:
    """Our call; extra: options beyond the setting's (``batch_size``)."""
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
    if variant == "ours, no completeness check":
        options["check_completeness"] = False
    options.update(extra)
    cls = explain.get_method(method)
    explainer = cls(model, LAYER, **options) if cls.needs_layer else cls(model, **options)
    return lambda: explainer.explain(batch, target=classes).maps


def captum(method: str, model, batch, classes, variant: str = "captum") -> Callable[[], Any]:
    import captum.attr as attr
    import torch

    target = torch.tensor(classes, device=batch.device)
    layer = dict(model.named_modules())[LAYER]
    if method == "integratedgradients":
        delta = variant == "captum, convergence delta"
        return lambda: attr.IntegratedGradients(model).attribute(batch, target=target, n_steps=STEPS,
                                                                 method="riemann_middle",
                                                                 return_convergence_delta=delta)
    if method == "gradientshap":
        base = references(batch)
        delta = variant == "captum, convergence delta"
        return lambda: attr.GradientShap(model).attribute(batch, base, target=target, n_samples=SAMPLES, stdevs=NOISE,
                                                          return_convergence_delta=delta)
    if method == "deeplift":
        hookable = relu_per_call(model)
        return lambda: attr.DeepLift(hookable).attribute(batch, torch.zeros_like(batch), target=target)
    if method == "deepliftshap":
        base, hookable = references(batch), relu_per_call(model)
        return lambda: attr.DeepLiftShap(hookable).attribute(batch, base, target=target)
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


def relu_per_call(model):
    """A traced copy of the model computing the same function, each ReLU call its own module and not
    in place: Captum's DeepLift hooks modules and refuses a ReLU module that runs more than once per
    forward (torchvision's resnet blocks call theirs twice). Ours needs no such copy."""
    import copy

    import torch.fx
    from torch import nn

    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    for index, node in enumerate(traced.graph.nodes):
        if node.op == "call_module" and isinstance(traced.get_submodule(node.target), nn.ReLU):
            node.target = f"relu_call_{index}"
            traced.add_submodule(node.target, nn.ReLU())
    traced.recompile()
    return traced.eval()


def zennit(method: str, model, batch, classes, variant: str = "zennit") -> Callable[[], Any]:
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


def pair(method: str, model, batch, classes, variant: str = "saliency") -> Callable[[], Any]:
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


def setting(model_name: str, batch_size: int, device_name: str):
    """(model, batch, classes, device) as every measurement process builds them: same seed, same data."""
    import torch
    import torchvision

    torch.manual_seed(0)
    device = torch.device(device_name)
    model = torchvision.models.get_model(model_name, weights=None).eval().to(device)
    batch = torch.randn(batch_size, 3, 224, 224, device=device)
    with torch.no_grad():
        classes = model(batch).argmax(1).tolist()
    return model, batch, classes, device


def build(implementation: str, method: str, model, batch, classes) -> Callable[[], Any]:
    """The call that one implementation (e.g. "ours", "captum, convergence delta") makes."""
    library = implementation.split(",")[0]
    maker = {"ours": ours, "captum": captum, "zennit": zennit, "saliency": pair}[library]
    return maker(method, model, batch, classes, implementation)


def measure_memory(model_name: str, batch_size: int, method: str, implementation: str, device_name: str) -> dict:
    """In a fresh process: the peak memory growth of one call (method "forward": of a no-grad forward)."""
    import resource

    import psutil
    import torch

    model, batch, classes, device = setting(model_name, batch_size, device_name)
    if method == "forward":
        def call():
            with torch.no_grad():
                return model(batch)
    else:
        call = build(implementation, method, model, batch, classes)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        growth = torch.cuda.max_memory_allocated() - before
    else:
        before = psutil.Process().memory_info().rss
        call()
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"growth": max(growth, 0)}


def measure_times(model_name: str, batch_size: int, method: str, device_name: str, repeats: int) -> dict:
    """In a fresh process: {implementation: median seconds of a call} and "forward": a no-grad forward's,
    the implementations called in turn, round after round, after one call each to warm up. An
    implementation that fails (a peer refusing the model) is left out, its error under "failed"."""
    import statistics

    import torch

    model, batch, classes, device = setting(model_name, batch_size, device_name)

    def forward():
        with torch.no_grad():
            return model(batch)

    calls: dict[str, Callable[[], Any]] = {}
    failed: dict[str, str] = {}
    for implementation in implementations(method):
        try:
            call = build(implementation, method, model, batch, classes)
            call()
            calls[implementation] = call
        except Exception as error:  # a peer refusing the model: reported, the others still measured
            failed[implementation] = f"{type(error).__name__}: {str(error)[:300]}"
    calls["forward"] = forward
    forward()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(seconds_of(call, device))
    return {**{name: statistics.median(values) for name, values in times.items()}, "rounds": times,
            "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", default=list(PAIRS))
    parser.add_argument("--repeats", type=int, help="timed rounds per method and batch (default: 9 at batch 1, "
                        "where a call takes seconds, else 5)")
    parser.add_argument("--memory", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--times", nargs=4, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.memory or arguments.times:
        import torch

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        if arguments.memory:
            model_name, batch, method, implementation = arguments.memory
            figures = measure_memory(model_name, int(batch), method, implementation, arguments.device)
        else:
            model_name, batch, method, repeats = arguments.times
            figures = measure_times(model_name, int(batch), method, arguments.device, int(repeats))
        print(json.dumps(figures))
        return
    rows = []
    for batch in arguments.batches:
        command = [sys.executable, __file__, "--device", arguments.device]
        forward_seconds = []
        for method in arguments.methods:
            if method in SLOW and batch > 1:
                continue
            repeats = arguments.repeats or (9 if batch == 1 else 5)
            times = measure_in_fresh_process(command + ["--times", arguments.model, str(batch), method, str(repeats)],
                                             f"{method} b{batch} times")
            if times is None:
                continue
            forward_seconds.append(times["forward"])
            for implementation in implementations(method):
                if implementation not in times:
                    continue
                label = f"{method} {implementation} b{batch} memory"
                memory = measure_in_fresh_process(
                    command + ["--memory", arguments.model, str(batch), method, implementation], label)
                if memory is not None:
                    rows.append({"batch": batch, "method": method, "implementation": implementation,
                                 "method_s": times[implementation], "forward_s": times["forward"],
                                 "rounds": times["rounds"][implementation], "repeats": repeats, **memory})
            write(rows, arguments.model, arguments.device)  # after each method: a run cut short keeps its rows
        if arguments.device == "cpu" or not forward_seconds:
            continue  # on the CPU a no-grad forward's RSS growth is within the allocator's noise (< 1 MiB at batch 1)
        memory = measure_in_fresh_process(command + ["--memory", arguments.model, str(batch), "forward", "torch"],
                                          f"forward b{batch} memory")
        if memory is not None:
            seconds = statistics.median(forward_seconds)
            rows.append({"batch": batch, "method": "forward", "implementation": "torch (no grad)",
                         "method_s": seconds, "forward_s": seconds, **memory})
    write(rows, arguments.model, arguments.device)


def merged_with_earlier(rows: list[dict], model: str, device: str) -> list[dict]:
    """The rows of this run plus those of earlier runs on the same model and device that this run did
    not measure again (kept in benchmarks/attribution_speed.json), in method order."""
    store = Path(__file__).with_name("attribution_speed.json")
    earlier: dict = json.loads(store.read_text()) if store.exists() else {}
    key = f"{model} {device}"
    by_row = {(r["method"], r["implementation"], r["batch"]): r for r in earlier.get(key, [])}
    by_row.update({(r["method"], r["implementation"], r["batch"]): r for r in rows})
    order = {method: index for index, method in enumerate(["forward", *PAIRS])}
    def position(row: dict) -> tuple:
        known = implementations(row["method"]) if row["method"] in PAIRS else []
        rank = known.index(row["implementation"]) if row["implementation"] in known else len(known)
        return row["batch"], order.get(row["method"], len(order)), rank

    merged = sorted(by_row.values(), key=position)
    earlier[key] = merged
    store.write_text(json.dumps(earlier, indent=1) + "\n")
    return merged


def write(rows: list[dict], model: str, device: str) -> None:
    from common import write_section

    rows = merged_with_earlier(rows, model, device)
    rounds_per_batch = sorted({(r["batch"], r["repeats"]) for r in rows if r.get("repeats")})
    repeats = ", ".join(f"{count} at batch {batch}" for batch, count in rounds_per_batch)

    lines = [
        f"{model} (random weights), 224×224 inputs, {device.upper()}, {os.environ.get('BENCH_THREADS', '2')} threads; "
        f"{STEPS} steps for the path methods (midpoint rule for Integrated Gradients on both sides), {SAMPLES} "
        f"samples and σ = {NOISE} for GradientSHAP and SmoothGrad, {REFERENCES} reference inputs for the SHAP "
        f"variants, layer methods at `{LAYER}`, LRP with the EpsilonPlus composite and BatchNorm folded. Time: "
        f"median over rounds ({repeats}), each calling ours, the peers' and a no-grad forward in turn in one process; "
        "× forward: divided by the forward's median. Memory: peak growth of one call in a fresh process (RSS on "
        "CPU; allocated memory on CUDA), × forward (CUDA): divided by a no-grad forward's, measured alike.",
        "",
        "| method | batch | implementation | time (s) | × forward | × peer's time | memory growth (MiB) | × forward |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rounds = {(r["method"], r["batch"], r["implementation"]): r.get("rounds") for r in rows}
    medians = {(r["method"], r["batch"], r["implementation"]): r["method_s"] for r in rows}
    forward_memory = {r["batch"]: r["growth"] for r in rows if r["method"] == "forward"}
    for row in rows:
        counterpart = {theirs: mine for mine, theirs in PAIRS.get(row["method"], ())}.get(row["implementation"])
        mine, theirs = rounds.get((row["method"], row["batch"], counterpart)), row.get("rounds")
        versus = "–"
        if mine and theirs:  # ours and the peer were called in the same rounds: the ratio round by round
            ratios = sorted(a / b for a, b in zip(mine, theirs))
            versus = f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})"
        elif counterpart is not None and (row["method"], row["batch"], counterpart) in medians:
            versus = f"{medians[(row['method'], row['batch'], counterpart)] / row['method_s']:.2f}"
        floor = forward_memory.get(row["batch"])
        memory_ratio = f"{row['growth'] / floor:.1f}" if floor else "–"
        lines.append(f"| {row['method']} | {row['batch']} | {row['implementation']} | {row['method_s']:.3f} | "
                     f"{row['method_s'] / row['forward_s']:.1f} | {versus} | {row['growth'] / 2**20:.0f} | "
                     f"{memory_ratio} |")
    lines += ["", "× peer's time, on a peer's row: the time of ours doing the same work (the row above it, or "
              "for GradientSHAP: ours with its completeness check next to Captum with its convergence delta, ours "
              "without next to Captum without) divided by the peer's in the same round; the median over the rounds "
              "and, in brackets, the lowest and highest (below 1: ours is faster).", "",
              f"Command: `python benchmarks/attribution_speed.py --device {device}`."]
    write_section(f"Attribution methods next to their peers ({device.upper()})", "\n".join(lines))


if __name__ == "__main__":
    main()
