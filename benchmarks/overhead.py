"""Per-call overhead next to the peers: the operations a call dispatches and the time of a call too small for its
arithmetic to matter.

    python benchmarks/overhead.py [--device cpu|cuda] [--rounds 40] [--methods gradcam saliency ...] [--write]

1. ATen operations dispatched per call (a ``TorchDispatchMode`` that counts them; on a GPU each is a kernel launch
   or a view), torchvision resnet50 (random weights) at 224 px, batch 1, target given. With ``--device cuda`` the
   CUDA kernels the profiler sees per call are counted too.
2. The median time of a call on resnet18 at 32 px, batch 1, every implementation called in turn in each round
   (interleaved, one process), after a warm-up call each; the ratio to the peer's, and to a no-grad forward.

The settings are benchmarks/attribution_speed.py's: Grad-CAM at ``layer4`` upsampled to the input (Captum's
``LayerGradCam`` with ``LayerAttribution.interpolate``, torchcam's ``GradCAM``), saliency (Captum's ``Saliency``),
Integrated Gradients with 32 steps (riemann_middle), SmoothGrad with 16 samples, GradientSHAP with 16 samples and 4
references, DeepLIFT against a zero baseline (Captum's on a traced copy whose every ReLU call is its own module, as it
needs), LRP ε+ with zennit's ResNet canonizer. Each explain call also scores the image itself (``scores``,
``probabilities``) and Integrated Gradients and GradientSHAP (by default) check completeness, y(x) − y(baseline):
Captum does that work only with ``return_convergence_delta=True``, so those two are measured against Captum both ways
("captum, convergence delta" does the same work as ours), and GradientSHAP also with ``check_completeness=False``.

On a CPU a call is also counted as a GPU runs it (column "as on a GPU"): one pass for all rows (``batch_size=256``,
the GPU's default) and no channels-last copy of the input (the CPU's layout choice for images of 128 px and more,
``explain.core.memory_format``); those are the operations a GPU dispatches (kernels, and views that launch none).
``--write`` writes the section "Per-call overhead next to the peers (CPU)" or "(CUDA)" of benchmarks/RESULTS.md.
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
PEERS = {"gradcam": ("captum", "torchcam", "plain torch"), "saliency": ("captum", "plain torch"), "lrp": ("zennit",),
         "integratedgradients": ("captum", "captum, convergence delta"),
         "gradientshap": ("captum", "captum, convergence delta")}
"""The peers of each method (Captum alone where not listed); "plain torch" is the floor: the method written in a few
lines of torch, without an explainer's checks, normalisation and kept scores (its excess is our per-call overhead)."""
OUR_VARIANTS = {"gradientshap": ("explain", "explain, no completeness check")}
"""Our variants of a method (explain's defaults alone where not listed); each is a row, against every peer."""
AS_ON_A_GPU = {"integratedgradients", "smoothgrad", "gradientshap"}
"""The methods whose passes' size depends on the device (``explain.methods.passes.rows_per_pass``)."""


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
    if library == "plain torch":
        return lambda: plain_gradcam(model, batch, target)
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
    target = torch.tensor(classes, device=batch.device)
    if library == "plain torch":
        return lambda: plain_saliency(model, batch, target)
    from captum.attr import Saliency

    attribution = Saliency(model)
    return lambda: attribution.attribute(batch.clone().requires_grad_(True), target=target)


def plain_saliency(model: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The floor: saliency written in a few lines of torch (max over the channels of |∂y/∂x|, no checks, no
    normalisation, no scores kept)."""
    inputs = batch.detach().requires_grad_(True)
    scores = model(inputs).gather(1, target[:, None])
    (gradient,) = torch.autograd.grad(scores.sum(), inputs)
    return gradient.abs().amax(dim=1)


def plain_gradcam(model: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The floor: Grad-CAM at ``layer4`` written in a few lines of torch (a forward hook keeps the activations, one
    gradient, channel weights, ReLU, upsampling; no checks, no normalisation, the model's flags not touched)."""
    kept: list[torch.Tensor] = []
    handle = model.layer4.register_forward_hook(lambda module, args, output: kept.append(output))
    try:
        scores = model(batch).gather(1, target[:, None])
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(scores.sum(), kept[0])
    with torch.no_grad():
        weights = gradient.mean(dim=(2, 3), keepdim=True)
        maps = torch.relu((weights * kept[0]).sum(dim=1, keepdim=True))
        return torch.nn.functional.interpolate(maps, size=batch.shape[-2:], mode="bilinear", align_corners=False)


def build(method: str, library: str, model: torch.nn.Module, batch: torch.Tensor, classes: list[int],
          **ours_options: Any) -> Call:
    """A call of ``method`` by ``library`` (or a variant of it, see ``PEERS``, ``OUR_VARIANTS``); ours_options: our
    explainer's options beyond the setting's."""
    if method == "gradcam":
        return gradcam(library, model, batch, classes)
    if method == "saliency":
        return saliency(library, model, batch, classes)
    if library == "explain":
        return attribution_speed.ours(method, model, batch, classes, **ours_options)
    if library == "explain, no completeness check":
        return attribution_speed.ours(method, model, batch, classes, "ours, no completeness check", **ours_options)
    if library == "zennit":
        return attribution_speed.zennit(method, model, batch, classes)
    return attribution_speed.captum(method, model, batch, classes, library)


def as_on_a_gpu(method: str, library: str, model: torch.nn.Module, batch: torch.Tensor, classes: list[int]) -> Call:
    """Our call as a GPU makes it: every row in one pass (the GPU's 256 rows), the input in its usual layout."""
    from explain.core.memory_format import usual_layout_only

    call = build(method, library, model, batch, classes, **({"batch_size": 256} if method in AS_ON_A_GPU else {}))

    def in_the_usual_layout() -> Any:
        with usual_layout_only():
            return call()

    return in_the_usual_layout


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


def pairs(method: str) -> list[tuple[str, str]]:
    """(our variant, peer) rows of a method: each of our variants against each peer, except that our variant without
    the completeness check meets only the peer that does not compute it either."""
    rows = []
    for ours in OUR_VARIANTS.get(method, ("explain",)):
        for peer in PEERS.get(method, ("captum",)):
            if ours == "explain, no completeness check" and peer != "captum":
                continue
            rows.append((ours, peer))
    return rows


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
        libraries = list(dict.fromkeys(library for pair in pairs(method) for library in pair))
        counted = {library: operations(build(method, library, *big)) for library in libraries}
        ours = [library for library in libraries if library.startswith("explain")]
        as_on_gpu = ({library: operations(as_on_a_gpu(method, library, *big)) for library in ours}
                     if device.type == "cpu" else {})
        kernels = ({library: cuda_kernels(build(method, library, *big)) for library in libraries}
                   if device.type == "cuda" else {})
        model, batch, classes = small

        def forward(model: torch.nn.Module = model, batch: torch.Tensor = batch) -> Any:
            with torch.no_grad():
                return model(batch)

        calls = {library: build(method, library, *small) for library in libraries}
        times = median_times({**calls, "forward": forward}, arguments.rounds, device)
        for mine, peer in pairs(method):
            row = {"method": method, "ours": mine, "peer": peer, "operations": counted[mine],
                   "peer_operations": counted[peer], "as_on_a_gpu": as_on_gpu.get(mine),
                   "kernels": kernels.get(mine), "peer_kernels": kernels.get(peer), "ms": times[mine] * 1e3,
                   "peer_ms": times[peer] * 1e3, "forward_ms": times["forward"] * 1e3}
            rows.append(row)
            print(f"{method} ({mine} / {peer}): operations {row['operations']} / {row['peer_operations']}"
                  + (f" (as on a GPU {row['as_on_a_gpu']})" if row["as_on_a_gpu"] is not None else "")
                  + (f", kernels {row['kernels']} / {row['peer_kernels']}" if kernels else "")
                  + f"; ms {row['ms']:.2f} / {row['peer_ms']:.2f} (forward {row['forward_ms']:.2f})", flush=True)
    if arguments.write:
        write(rows, device, arguments.threads)


def write(rows: list[dict], device: torch.device, threads: int | None = None) -> None:
    cpu, kernels = device.type == "cpu", device.type == "cuda"
    header = ("| method | ours | peer | ours ops | peer ops | ratio |"
              + (" ours ops as on a GPU | ratio |" if cpu else "")
              + (" ours kernels | peer kernels | ratio |" if kernels else "")
              + " ours ms | peer ms | ratio | ours × forward |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for row in rows:
        cells = [row["method"], row["ours"], row["peer"], str(row["operations"]), str(row["peer_operations"]),
                 f"{row['operations'] / row['peer_operations']:.2f}"]
        if cpu:
            cells += [str(row["as_on_a_gpu"]), f"{row['as_on_a_gpu'] / row['peer_operations']:.2f}"]
        if kernels:
            cells += [str(row["kernels"]), str(row["peer_kernels"]), f"{row['kernels'] / row['peer_kernels']:.2f}"]
        cells += [f"{row['ms']:.2f}", f"{row['peer_ms']:.2f}", f"{row['ms'] / row['peer_ms']:.2f}",
                  f"{row['ms'] / row['forward_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    name = "CUDA" if kernels else "CPU"
    option = f" --threads {threads}" if threads else ""
    body = (f"`python benchmarks/overhead.py --device {device.type}{option} --write`: operations dispatched per call "
            "on resnet50, 224 px, batch 1 (ATen operations, views included"
            + ("; \"as on a GPU\": every row in one pass and no channels-last copy of the input, as a GPU runs the "
               "call" if cpu else "")
            + "); the median time of a call on resnet18, 32 px, batch 1, interleaved with the peers' calls and a "
            "no-grad forward. \"captum, convergence delta\" computes y(x) − y(baseline) as ours does by default "
            "(completeness).\n\n" + "\n".join(lines))
    write_section(f"Per-call overhead next to the peers ({name})", body)


if __name__ == "__main__":
    main()
