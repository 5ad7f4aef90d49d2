"""Cost of each CAM method in units of one no-grad forward pass of the same model, same run.

    python benchmarks/cam_cost.py            # resnet18, layer4, 1 image of 224 px, CPU

Also the CAM options (smooth="augment": 6 passes; smooth="eigen": an SVD per map; two layers
combined) and FullGrad, which needs the gradient at the input and at every conv and BatchNorm.

Score-CAM is also compared with a naive loop of one forward per channel (the
definition, as other libraries run it), and Ablation-CAM with full forwards of
ablated copies (what it falls back to when the tail cannot be replayed alone).
Writes the "CAM cost" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_section  # noqa: E402

import explain  # noqa: E402


def naive_scorecam(model: torch.nn.Module, x: torch.Tensor, layer: torch.nn.Module, target: int) -> torch.Tensor:
    """Score-CAM by its definition: one forward per channel, no batching, no deduplication."""
    with explain.capture(model, layer) as captured, torch.no_grad():
        model(x)
    activation = captured[next(iter(captured))].output[0]
    scores = []
    with torch.no_grad():
        for channel in activation:
            upsampled = F.interpolate(channel[None, None], size=x.shape[-2:], mode="bilinear", align_corners=False)
            low, high = upsampled.min(), upsampled.max()
            mask = (upsampled - low) / (high - low) if high > low else torch.zeros_like(upsampled)
            scores.append(model(x * mask)[0, target])
    weights = torch.stack(scores).softmax(0)
    return torch.relu((weights[:, None, None] * activation).sum(0))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        forward = median_seconds(lambda: model(x), repeats=20, warmup=3)
    rows = []

    def measure(label: str, function, repeats: int) -> float:
        seconds = median_seconds(function, repeats=repeats, warmup=1)
        rows.append((label, seconds))
        print(f"{label}: {seconds * 1000:.0f} ms = {seconds / forward:.1f} forwards", flush=True)
        return seconds

    for name in ("gradcam", "gradcam++", "xgradcam", "hirescam", "layercam", "eigencam", "eigengradcam",
                 "gradcamelementwise", "shapleycam", "kpcacam", "fem", "randomcam"):
        explainer = explain.get_method(name)(model, "layer4")
        measure(explainer.method_name, lambda explainer=explainer: explainer.explain(x, target=1), repeats=10)
    for label, options in (("smooth='augment'", {"smooth": "augment"}), ("smooth='eigen'", {"smooth": "eigen"})):
        explainer = explain.GradCAM(model, "layer4", **options)
        measure(f"GradCAM, {label}", lambda explainer=explainer: explainer.explain(x, target=1), repeats=10)
    both = explain.GradCAM(model, ["layer3", "layer4"])
    measure("GradCAM, layer3 + layer4 (normalised mean)", lambda: both.explain(x, target=1), repeats=10)
    fullgrad = explain.FullGrad(model)
    measure("FullGrad (whole network, no layer)", lambda: fullgrad.explain(x, target=1), repeats=10)
    ablation = explain.AblationCAM(model, "layer4", progress=False)
    measure("AblationCAM (replays the tail after layer4)", lambda: ablation.explain(x, target=1), repeats=5)
    fallback = explain.AblationCAM(model, "layer4", progress=False)
    fallback._ablated_scores_replaying_tail = _raise_replay_not_possible
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measure("AblationCAM, full forwards (fallback path)", lambda: fallback.explain(x, target=1), repeats=1)
    score = explain.ScoreCAM(model, "layer4", progress=False)
    measure("ScoreCAM (batched, distinct masks only)", lambda: score.explain(x, target=1), repeats=2)
    measure("ScoreCAM, naive loop over channels", lambda: naive_scorecam(model, x, model.layer4, 1), repeats=1)

    lines = [
        "resnet18 (random weights), target layer `layer4` (512 channels), 1 image of 224×224, CPU.",
        f"One no-grad forward: {forward * 1000:.1f} ms (median of 20).",
        "",
        "| method | time | in no-grad forwards |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {label} | {seconds * 1000:.0f} ms | {seconds / forward:.1f} |" for label, seconds in rows]
    lines += ["", "Command: `python benchmarks/cam_cost.py`."]
    write_section("CAM cost", "\n".join(lines))


def _raise_replay_not_possible(*args, **kwargs):
    from explain.methods.perturbation import _ReplayNotPossible

    raise _ReplayNotPossible("forced by the benchmark to time the fallback")


if __name__ == "__main__":
    main()
