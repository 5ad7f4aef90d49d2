"""Integrated Gradients: which integration rule is most accurate at a given number of steps?

For resnet18 and densenet121 (random weights, BatchNorm statistics calibrated on random
images so that activations have a realistic scale), each rule at 16 and 32 steps is compared
with a 512-step reference (Gauss-Legendre) on the same images and targets:

- relative L2 error of the attributions, ‖a − a_ref‖ / ‖a_ref‖;
- relative completeness error, |Σ a − (y(x) − y(x'))| / |y(x) − y(x')|.

    python benchmarks/ig_rules.py            # writes the "Integrated Gradients rules" section of RESULTS.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).parent))
from common import write_section  # noqa: E402

import explain  # noqa: E402
from explain.methods.gradients import RULES  # noqa: E402

SIZE, IMAGES, REFERENCE_STEPS = 128, 2, 512


def calibrated(name: str) -> torch.nn.Module:
    """A torchvision model with random weights whose BatchNorm statistics match random images."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=10)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 3, SIZE, SIZE))
    return model.eval()


def main() -> None:
    torch.set_num_threads(2)
    rows = ["| model | rule | steps | relative L2 to the 512-step reference | relative completeness error (max) |",
            "| --- | --- | --- | --- | --- |"]
    for name in ("resnet18", "densenet121"):
        model = calibrated(name)
        x = torch.randn(IMAGES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        targets = [1, 7][:IMAGES]
        reference = explain.IntegratedGradients(model, steps=REFERENCE_STEPS, rule="gausslegendre",
                                                batch_size=16).explain(x, target=targets)
        reference_attributions = reference.attributions.double()
        for steps in (16, 32):
            for rule in RULES:
                result = explain.IntegratedGradients(model, steps=steps, rule=rule, batch_size=16).explain(
                    x, target=targets)
                difference = (result.attributions.double() - reference_attributions).flatten(1).norm(dim=1)
                relative_l2 = difference / reference_attributions.flatten(1).norm(dim=1)
                completeness = (result.diagnostics["completeness_error"].abs()
                                / result.diagnostics["score_change"].abs()).amax()
                l2_text = ", ".join(f"{value:.3f}" for value in relative_l2.tolist())
                rows.append(f"| {name} | {rule} | {steps} | {l2_text} | {float(completeness):.3f} |")
                print(rows[-1], flush=True)
    body = (f"{IMAGES} random {SIZE} px images per model, one target each; reference: Gauss-Legendre with "
            f"{REFERENCE_STEPS} steps. Lower is better in both columns.\n\n" + "\n".join(rows))
    write_section("Integrated Gradients rules", body)


if __name__ == "__main__":
    main()
