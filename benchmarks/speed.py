"""Time and peak memory of each method as multiples of one no-grad forward of the same model and batch.

    python benchmarks/speed.py [--models resnet50 vgg16 vit_b_16] [--batches 1 16] [--device cpu]
    python benchmarks/speed.py --transformers     # attention methods and the rest on vit_b_16, timm vit_small, swin_t

Each (model, batch, method) is measured in a fresh process: its peak memory growth
(RSS on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA) over the memory held
before the call, and its median time over repeated calls next to a no-grad forward
timed in the same process. Peers (pytorch-grad-cam, Captum, torchcam) are measured
alike when installed (``pip install -e ".[bench]"``). Random weights, 224 px inputs.
``BENCH_INTERLEAVED=1`` (with ``--one``) times the method and a forward in turns and adds the median of the
per-pair ratios ("ratio"): steadier on a shared machine, where the load moves between two runs of repeats.
Writes the "Speed and memory" section of benchmarks/RESULTS.md; with ``--transformers``, the
"Speed and memory: transformers" section (torchvision vit_b_16 with its zero head re-initialised,
timm vit_small_patch16_224, torchvision swin_t; CAMs at the automatic layer, the last block's first norm). Methods
that cannot explain a model (the rollouts on Swin's window attention) leave no row.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_in_fresh_process, seconds_of  # noqa: E402

LAYERS = {"resnet50": "layer4", "vgg16": "features.29", "vit_b_16": None}
OURS = ("gradcam", "gradcam++", "hirescam", "layercam", "eigencam", "saliency", "guidedbackprop", "ablationcam",
        "scorecam")
PEERS = ("pytorch-grad-cam", "captum", "torchcam")
SLOW = {"scorecam", "ablationcam", "integratedgradients"}  # one forward per channel or per step: batch 1 only
TRANSFORMERS = {"vit_b_16": None, "vit_small_patch16_224": None, "swin_t": None}  # layer None: the automatic one
TRANSFORMER_METHODS = ("attentionrollout", "gradientrollout", "transformerattribution", "legrad", "attnlrp",
                       "gradcam", "saliency", "integratedgradients", "scorecam")
TIMM_MODELS = {"vit_small_patch16_224"}


def build_model(name: str):
    """A torchvision or timm model with random weights; classifier heads that start at zero are
    re-initialised, so that gradients are not zero."""
    import torch
    import torchvision

    if name in TIMM_MODELS:
        import timm

        model = timm.create_model(name, pretrained=False)
    else:
        model = torchvision.models.get_model(name, weights=None)
    head = getattr(getattr(model, "heads", None), "head", None)
    if isinstance(head, torch.nn.Linear):
        torch.nn.init.normal_(head.weight, std=0.01)
    return model.eval()


def build_call(method: str, model, layer_name: str | None, batch, device):
    """A zero-argument function that computes one Grad-CAM-like map for every image of the batch."""
    import torch

    if method == "forward":
        def forward():
            with torch.no_grad():
                return model(batch)
        return forward
    if method in PEERS:
        return build_peer(method, model, layer_name, batch)
    import explain

    cls = explain.get_method(method)
    options = {"progress": False} if method in ("scorecam", "ablationcam") else {}
    explainer = cls(model, layer_name, **options) if cls.needs_layer else cls(model, **options)
    return lambda: explainer.explain(batch).maps


def build_peer(peer: str, model, layer_name: str, batch):
    import torch

    layer = dict(model.named_modules())[layer_name]
    with torch.no_grad():
        classes = model(batch).argmax(1).tolist()
    if peer == "pytorch-grad-cam":
        from pytorch_grad_cam import GradCAM as PeerGradCAM
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        cam = PeerGradCAM(model=model, target_layers=[layer])
        targets = [ClassifierOutputTarget(c) for c in classes]
        return lambda: cam(input_tensor=batch, targets=targets)
    if peer == "captum":
        from captum.attr import LayerAttribution, LayerGradCam

        attribution = LayerGradCam(model, layer)
        target = torch.tensor(classes)

        def captum_gradcam():
            maps = attribution.attribute(batch, target=target, relu_attributions=True)
            return LayerAttribution.interpolate(maps, batch.shape[-2:])

        return captum_gradcam
    if peer == "torchcam":
        from torchcam.methods import GradCAM as TorchcamGradCAM

        def torchcam_gradcam():
            with TorchcamGradCAM(model, target_layer=layer_name) as extractor:
                scores = model(batch)
                return extractor(classes, scores)

        return torchcam_gradcam
    raise ValueError(peer)


def measure_one(model_name: str, batch_size: int, method: str, device_name: str, repeats: int) -> dict:
    """Run in a fresh process: memory of one call, then median times of the method and a forward."""
    import psutil
    import torch

    torch.manual_seed(0)
    device = torch.device(device_name)
    model = build_model(model_name).to(device)
    batch = torch.randn(batch_size, 3, 224, 224, device=device)
    call = build_call(method, model, {**LAYERS, **TRANSFORMERS}[model_name], batch, device)
    forward = build_call("forward", model, None, batch, device)
    started = time.perf_counter()
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
    first_call_seconds = time.perf_counter() - started

    def timed(function) -> float:
        function()
        times = []
        for _ in range(repeats):
            times.append(seconds_of(function, device))
        return statistics.median(times)

    if os.environ.get("BENCH_INTERLEAVED") == "1" and method not in SLOW:
        # on a shared machine the load moves between two runs of repeats: time the method and a forward in
        # turns, and take the median of the per-pair ratios as well
        call(), forward()
        pairs = [(seconds_of(call, device), seconds_of(forward, device)) for _ in range(repeats)]
        return {"method_s": statistics.median(pair[0] for pair in pairs),
                "forward_s": statistics.median(pair[1] for pair in pairs),
                "ratio": statistics.median(pair[0] / pair[1] for pair in pairs), "growth": max(growth, 0)}
    # slow methods (hundreds of forwards): the first call is the measurement
    method_seconds = first_call_seconds if method in SLOW else timed(call)
    forward_seconds = timed(forward)
    return {"method_s": method_seconds, "forward_s": forward_seconds, "growth": max(growth, 0)}


def available_peers() -> list[str]:
    found = []
    for peer, module in (("pytorch-grad-cam", "pytorch_grad_cam"), ("captum", "captum"), ("torchcam", "torchcam")):
        try:
            __import__(module)
            found.append(peer)
        except ImportError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(LAYERS))
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--transformers", action="store_true", help="the transformer benchmark (see above)")
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "BATCH", "METHOD", "REPEATS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        import torch

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        model_name, batch, method, repeats = arguments.one
        print(json.dumps(measure_one(model_name, int(batch), method, arguments.device, int(repeats))))
        return
    batches = arguments.batches or ([1, 32] if arguments.device.startswith("cuda") else [1, 16])
    if arguments.transformers:
        models, methods = list(TRANSFORMERS), list(arguments.methods or TRANSFORMER_METHODS)
    else:
        models, methods = arguments.models, list(arguments.methods or OURS) + available_peers()
    results = []
    for model_name in models:
        for batch in batches:
            configs = ["forward"] + [m for m in methods if not (m in SLOW and batch > 1)]
            if not arguments.transformers and LAYERS[model_name] is None:  # the CNN benchmark's ViT row
                configs = [m for m in configs if m in ("forward", "saliency", "guidedbackprop")]
            for method in configs:
                repeats = 15 if batch == 1 else 3
                if method in SLOW:
                    repeats = 1
                command = [sys.executable, __file__, "--device", arguments.device, "--one", model_name, str(batch),
                           method, str(repeats)]
                figures = measure_in_fresh_process(command, f"{model_name} b{batch} {method}")
                if figures is not None:
                    results.append({"model": model_name, "batch": batch, "method": method, **figures})
    write(results, arguments.device, arguments.transformers)


def write(results: list[dict], device: str, transformers: bool = False) -> None:
    from common import write_section

    lines = [
        f"Random weights, 224×224 inputs, {device.upper()}, {os.environ.get('BENCH_THREADS', '2')} threads. "
        "Time: median of repeated calls, divided by the median no-grad forward timed in the same process. "
        "Memory: peak growth during one call (RSS on CPU) over the memory held before it, divided by the no-grad "
        "forward's growth measured the same way. Each row is a fresh process. Peers' Grad-CAM where installed.",
        "",
        "| model | batch | method | time (s) | × forward | memory growth (MiB) | × forward |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    floors = {(r["model"], r["batch"]): r for r in results if r["method"] == "forward"}
    for row in results:
        floor = floors.get((row["model"], row["batch"]))
        if floor is None:
            continue
        time_ratio = row["method_s"] / row["forward_s"]
        memory_ratio = row["growth"] / max(floor["growth"], 1)
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['method']} | {row['method_s']:.3f} | {time_ratio:.2f} | "
            f"{row['growth'] / 2**20:.0f} | {memory_ratio:.2f} |"
        )
    if transformers:
        lines[0] += (" torchvision vit_b_16 (zero head re-initialised), timm vit_small_patch16_224 and torchvision "
                     "swin_t; Grad-CAM and "
                     "Score-CAM at the automatic layer (the last block's first norm); rollouts over all blocks; "
                     "Integrated Gradients with its default steps.")
        lines += ["", "Command: `python benchmarks/speed.py --transformers`."]
        write_section(f"Speed and memory: transformers ({device.upper()})", "\n".join(lines))
        return
    lines += ["", "Command: `python benchmarks/speed.py`."]
    write_section(f"Speed and memory ({device.upper()})", "\n".join(lines))


if __name__ == "__main__":
    main()
