"""Per-call overhead next to the peers: the operations a call dispatches and the time of a call too small for its
arithmetic to matter.

    python benchmarks/overhead.py [--device cpu|cuda] [--rounds 40] [--methods gradcam saliency ...] [--write]

1. ATen operations dispatched per call (a ``TorchDispatchMode`` that counts them; on a GPU each is a kernel launch
   or a view), torchvision resnet50 (random weights) at 224 px, batch 1, target given. With ``--device cuda`` the
   CUDA kernels the profiler sees per call are counted too.
2. The median time of a call on resnet18 at 32 px, batch 1, every implementation called in turn in each round
   (interleaved, one process), after a warm-up call each; the ratio to the fastest peer, and to a no-grad forward.

The same work on both sides (benchmarks/attribution_speed.py's settings): Grad-CAM at ``layer4`` upsampled to the
input (Captum's ``LayerGradCam`` with ``LayerAttribution.interpolate``, torchcam's ``GradCAM``), saliency (Captum's
``Saliency``), Integrated Gradients with 32 steps (riemann_middle), SmoothGrad with 16 samples, GradientSHAP with 16
samples and 4 references, DeepLIFT against a zero baseline (Captum's on a traced copy whose every ReLU call is its own
module, as it needs), LRP ε+ with zennit's ResNet canonizer. ``--write`` writes the section "Per-call overhead next
to the peers (CPU)" or "(CUDA)" of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attribution_speed  # noqa: E402
from common import seconds_of, write_section  # noqa: E402

import explain  # noqa: E402

Call = Callable[[], Any]
METHODS = ("gradcam", "saliency", "integratedgradients", "smoothgrad", "gradientshap", "deeplift", "lrp")
PEERS = {"gradcam": ("captum", "torchcam"), "lrp": ("zennit",)}
"""The peers of each method (Captum alone where not listed)."""


class CountOperations(TorchDispatchMode):
    """Counts the ATen operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def gradcam(library: str, model: torch.nn.Module, batch: torch.Tensor, classes: list[int]) -> Call:
    target = torch.tensor(classes, device=batch.device)
    if library == "explain":
        explainer = explain.GradCAM(model, "layer4")
        return lambda: explainer.explain(batch, target=classes).maps
    if library == "captum":
        from captum.attr import LayerAttribution, LayerGradCam

        attribution = LayerGradCam(model, model.layer4)
        return lambda: LayerAttribution.interpolate(attribution.attribute(batch, target=target,
                                                                          relu_attributions=True), batch.shape[-2:])
    from torchcam.methods import GradCAM as TorchcamGradCAM

    def torchcam_gradcam() -> Any:
        with TorchcamGradCAM(model, target_layer="layer4") as extractor:
            return extractor(classes, model(batch))

    return torchcam_gradcam


def saliency(library: str, model: torch.nn.Module, batch: torch.Tensor, classes: list[int]) -> Call:
    if library == "explain":
        explainer = explain.Saliency(model)
        return lambda: explainer.explain(batch, target=classes).maps
    from captum.attr import Saliency

    target = torch.tensor(classes, device=batch.device)
    attribution = Saliency(model)
    return lambda: attribution.attribute(batch.clone().requires_grad_(True), target=target)


def build(method: str, library: str, model: torch.nn.Module, batch: torch.Tensor, classes: list[int]) -> Call:
    if method == "gradcam":
        return gradcam(library, model, batch, classes)
    if method == "saliency":
        return saliency(library, model, batch, classes)
    if library == "explain":
        return attribution_speed.ours(method, model, batch, classes)
    if library == "zennit":
        return attribution_speed.zennit(method, model, batch, classes)
    return attribution_speed.captum(method, model, batch, classes)


def operations(call: Call) -> int:
    call()  # warm-up: lazy initialisation is not per call
    with CountOperations() as counter:
        call()
    return counter.count


def cuda_kernels(call: Call) -> int:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        call()
        torch.cuda.synchronize()
    return sum(1 for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def median_times(calls: dict[str, Call], rounds: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call, the calls made in turn in every round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(seconds_of(call, device))
    return {name: statistics.median(values) for name, values in times.items()}


def setting(name: str, size: int, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval().to(device)
    batch = torch.randn(1, 3, size, size, device=device)
    with torch.no_grad():
        classes = model(batch).argmax(1).tolist()
    return model, batch, classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    device = torch.device(arguments.device)
    big = setting("resnet50", 224, device)
    small = setting("resnet18", 32, device)
    rows = []
    for method in arguments.methods:
        libraries = ("explain", *PEERS.get(method, ("captum",)))
        counted = {library: operations(build(method, library, *big)) for library in libraries}
        kernels = ({library: cuda_kernels(build(method, library, *big)) for library in libraries}
                   if device.type == "cuda" else {})
        model, batch, classes = small

        def forward(model: torch.nn.Module = model, batch: torch.Tensor = batch) -> Any:
            with torch.no_grad():
                return model(batch)

        calls = {library: build(method, library, *small) for library in libraries}
        times = median_times({**calls, "forward": forward}, arguments.rounds, device)
        peers = [library for library in libraries if library != "explain"]
        fewest = min(peers, key=lambda library: counted[library])
        fastest = min(peers, key=lambda library: times[library])
        row = {"method": method, "operations": counted, "kernels": kernels, "times": times,
               "operations_ratio": counted["explain"] / counted[fewest], "fewest": fewest,
               "time_ratio": times["explain"] / times[fastest], "fastest": fastest}
        rows.append(row)
        print(f"{method}: operations {counted} {kernels or ''}; ms " +
              ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in times.items()), flush=True)
    if arguments.write:
        write(rows, device, arguments.threads)


def write(rows: list[dict], device: torch.device, threads: int | None = None) -> None:
    kernels = device.type == "cuda"
    header = ("| method | explain ops | peers' ops | ratio to the fewest |" + (" explain kernels | peers' kernels |"
              if kernels else "") + " explain ms | peers' ms | ratio to the fastest | × forward |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for row in rows:
        peers = [library for library in row["operations"] if library != "explain"]
        cells = [row["method"], str(row["operations"]["explain"]),
                 ", ".join(f"{library} {row['operations'][library]}" for library in peers),
                 f"{row['operations_ratio']:.2f} ({row['fewest']})"]
        if kernels:
            cells += [str(row["kernels"]["explain"]),
                      ", ".join(f"{library} {row['kernels'][library]}" for library in peers)]
        times = row["times"]
        cells += [f"{times['explain'] * 1e3:.2f}",
                  ", ".join(f"{library} {times[library] * 1e3:.2f}" for library in peers),
                  f"{row['time_ratio']:.2f} ({row['fastest']})", f"{times['explain'] / times['forward']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    name = "CUDA" if kernels else "CPU"
    option = f" --threads {threads}" if threads else ""
    body = (f"`python benchmarks/overhead.py --device {device.type}{option} --write`: operations dispatched per call "
            "on resnet50, 224 px, batch 1 (ATen operations, views included); the median time of a call on resnet18, "
            "32 px, batch 1, interleaved with the peers' calls and a no-grad forward.\n\n" + "\n".join(lines))
    write_section(f"Per-call overhead next to the peers ({name})", body)


if __name__ == "__main__":
    main()
