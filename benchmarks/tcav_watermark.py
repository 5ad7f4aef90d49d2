"""TCAV on the watermark demonstration (``demo-watermark``: "square" images carry a checkerboard tag in training):
is a "tag" concept significant for "square" and for no clean class, and does FastCAV's closed-form CAV reach the
paper's conclusions, faster?

    python benchmarks/tcav_watermark.py [--seeds 0 1 2] [--randoms 20] [--size 50] [--write]

For each seed, a model is trained by the repo's script (``explain.data.train_watermark.train(seed=...)``; seed 0:
the shipped weights). Concept "tag": images of every class with the tag drawn in; random sets: clean images of every
class (other seeds); class images: 50 clean held-out images of each class. TCAV at layer2, layer3 and layer4
(flattened feature maps, 16 384 values each), against ``--randoms`` random sets, t-test and Bonferroni as in the
paper (alpha 0.05). A test's conclusion: the tag significantly raises the class, significantly lowers it, or neither.

CAVs compared, on the same activations:

- ``sgd``: the paper's CAV, the TCAV reference code's SGDClassifier (hinge loss, alpha 0.01, 80 % split, seed 0);
- ``sgd seed 1``: the same with another seed: how often the reference agrees with itself;
- ``svm``: the exact optimum of the objective SGDClassifier approximates (alpha/2 |w|² + mean hinge loss on the same
  80 %), by LIBLINEAR (``LinearSVC(loss="hinge", C=1/(alpha n))``);
- ``fastcav``: FastCAV's closed form.

FastCAV equals the SVM when nearly every activation is a support vector (inside the margin; the paper's
assumptions): the share that is, at the exact optimum, is printed per layer. The tag's own effect on each class is
measured without CAVs: the class logit's change when the tag is drawn on the class's 50 clean images (mean, 95 %
bootstrap interval). Time: the CAVs alone (activations and gradients are shared), per method.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap, write_section  # noqa: E402

from explain.data.demo_watermark import CORNER, load_watermark_demo  # noqa: E402
from explain.data.synthetic import CLASS_NAMES, add_watermark, make_dataset  # noqa: E402
from explain.data.train_watermark import train  # noqa: E402
from explain.io.inputs import prepare_inputs  # noqa: E402
from explain.methods.tcav import TCAV, _two_sided_t_test, fastcav, sgd_cav, training_split  # noqa: E402

LAYERS = ("layer2", "layer3", "layer4")
ALPHA = 0.01  # the TCAV reference code's SGDClassifier alpha


def exact_svm(concept: Tensor, random: Tensor) -> tuple[Tensor, float]:
    """The exact minimiser of alpha/2 |w|² + mean hinge loss on ``sgd_cav``'s split (its CAV, normalised), and the
    share of the training activations that are support vectors (margin ≤ 1)."""
    from sklearn.svm import LinearSVC

    features, labels = training_split(concept, random, seed=0)
    classifier = LinearSVC(loss="hinge", C=1 / (ALPHA * len(labels)), tol=1e-8, max_iter=200_000).fit(features,
                                                                                                   labels)
    margins = classifier.decision_function(features) * (2 * labels - 1)
    direction = torch.as_tensor(classifier.coef_[0], dtype=concept.dtype)
    return direction / direction.norm(), float((margins <= 1 + 1e-6).mean())


def tag_effect(tcav: TCAV, images: list, label: int) -> tuple[float, float, float]:
    """The class logit's change when the tag is drawn on ``images``: mean and 95 % bootstrap interval."""
    clean = prepare_inputs(list(images), tcav.preprocess, torch.device("cpu"), torch.float32).batch
    tagged = prepare_inputs(list(add_watermark(np.stack(images), corner=CORNER)), tcav.preprocess,
                            torch.device("cpu"), torch.float32).batch
    with torch.no_grad():
        change = (tcav.model(tagged)[:, label] - tcav.model(clean)[:, label]).double().numpy()
    low, high = bootstrap(change)
    return float(change.mean()), low, high


def conclusion(scores: Tensor, null: Tensor) -> tuple[str, float]:
    p_value = _two_sided_t_test(scores, null)
    if not p_value < 0.05 / len(CLASS_NAMES):
        return "none", p_value
    return ("raises" if float(scores.mean()) > float(null.mean()) else "lowers"), p_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--randoms", type=int, default=20)
    parser.add_argument("--size", type=int, default=50, help="images per concept and random set")
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    tag_images = list(add_watermark(make_dataset(arguments.size, seed=777).images, corner=CORNER))
    randoms = [list(make_dataset(arguments.size, seed=1000 + index).images) for index in range(arguments.randoms)]
    held_out = make_dataset(50 * len(CLASS_NAMES) * 2, seed=4242)
    by_class = {label: list(held_out.images[held_out.labels == label][:50]) for label in range(len(CLASS_NAMES))}

    support_shares: dict[str, list[float]] = {layer: [] for layer in LAYERS}
    method_names = ("sgd", "sgd seed 1", "svm", "fastcav")
    cav_seconds = {name: 0.0 for name in method_names}
    cav_count = 0
    conclusions: dict[tuple[int, int, str, str], str] = {}
    rows, effect_rows = [], []
    effects: dict[tuple[int, int], str] = {}
    for seed in arguments.seeds:
        model = load_watermark_demo() if seed == 0 else train(seed=seed)
        base = TCAV(model, list(LAYERS))
        tag = base.activations(tag_images)
        random_activations = [base.activations(images) for images in randoms]
        gradients = {label: base.gradients(by_class[label], target=label) for label in range(len(CLASS_NAMES))}
        for label, name in enumerate(CLASS_NAMES):
            mean, low, high = tag_effect(base, by_class[label], label)
            effects[(seed, label)] = "raises" if low > 0 else "lowers" if high < 0 else "none"
            effect_rows.append(f"| {seed} | {name} | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |")
        for layer in LAYERS:
            methods = _cav_methods(support_shares[layer])
            cavs: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
            for method, function in methods.items():
                started = time.perf_counter()
                concept_cavs = [function(tag[layer], random[layer]) for random in random_activations]
                null_cavs = [function(random_activations[i][layer], random_activations[(i + 1) % len(randoms)][layer])
                             for i in range(len(randoms))]
                cav_seconds[method] += time.perf_counter() - started
                cavs[method] = (concept_cavs, null_cavs)
            cav_count += 2 * len(randoms)
            for label, name in enumerate(CLASS_NAMES):
                cells = []
                for method, (concept_cavs, null_cavs) in cavs.items():
                    scores = torch.tensor([TCAV.score(gradients[label][layer], cav) for cav in concept_cavs],
                                          dtype=torch.float64)
                    null = torch.tensor([TCAV.score(gradients[label][layer], cav) for cav in null_cavs],
                                        dtype=torch.float64)
                    found, p_value = conclusion(scores, null)
                    conclusions[(seed, label, layer, method)] = found
                    cells.append(f"{float(scores.mean()):.2f} ± {float(scores.std()):.2f} ({p_value:.1g}) {found}")
                rows.append(f"| {seed} | {name} | {layer} | " + " | ".join(cells) + " |")

    tests = [(seed, label, layer) for seed in arguments.seeds for label in range(len(CLASS_NAMES)) for layer in LAYERS]

    def agreement(first: str, second: str, layer: str | None = None) -> str:
        chosen = [test for test in tests if layer is None or test[2] == layer]
        same = sum(conclusions[test + (first,)] == conclusions[test + (second,)] for test in chosen)
        return f"{same}/{len(chosen)}"

    def matches_effect(method: str, layer: str) -> str:
        chosen = [test for test in tests if test[2] == layer]
        same = sum(conclusions[test + (method,)] == effects[test[:2]] for test in chosen)
        return f"{same}/{len(chosen)}"

    def raises_agreement(first: str, second: str, layer: str | None = None) -> str:
        chosen = [test for test in tests if layer is None or test[2] == layer]
        same = sum((conclusions[test + (first,)] == "raises") == (conclusions[test + (second,)] == "raises")
                   for test in chosen)
        return f"{same}/{len(chosen)}"

    pairs = [("fastcav", "sgd"), ("sgd seed 1", "sgd"), ("svm", "sgd"), ("fastcav", "svm")]
    agreement_table = ["| conclusions agree | " + " | ".join(LAYERS) + " | all |",
                       "| --- | " + " | ".join("---:" for _ in LAYERS) + " | ---: |"]
    for first, second in pairs:
        agreement_table.append(f"| {first} vs {second} | " + " | ".join(agreement(first, second, layer)
                                                                        for layer in LAYERS)
                               + f" | {agreement(first, second)} |")
    for first, second in pairs:
        agreement_table.append(f"| {first} vs {second}, on \"the tag significantly raises the class\" | "
                               + " | ".join(raises_agreement(first, second, layer) for layer in LAYERS)
                               + f" | {raises_agreement(first, second)} |")
    for method in method_names:
        agreement_table.append(f"| {method} vs the tag's effect on the logit | "
                               + " | ".join(matches_effect(method, layer) for layer in LAYERS) + " | |")
    matched = {method: np.array([conclusions[test + (method,)] == effects[test[:2]] for test in tests], dtype=float)
               for method in method_names}
    difference = matched["fastcav"] - matched["sgd"]
    low, high = bootstrap(difference)
    effect_text = (f"Share of the {len(tests)} tests whose conclusion is the tag's measured effect on the logit "
                   "(raises where the change's interval is above 0, lowers where below): "
                   + ", ".join(f"{method} {matched[method].mean():.2f}" for method in method_names)
                   + f"; FastCAV minus SGD {difference.mean():+.2f} [{low:+.2f}, {high:+.2f}] (paired, 95 % bootstrap "
                   "over the tests, which share seeds and layers: a rough interval).")
    supports = ", ".join(f"{layer} {100 * min(shares):.0f}–{100 * max(shares):.0f} %"
                         for layer, shares in support_shares.items())
    times = ", ".join(f"{method} {1000 * seconds / cav_count:.1f}" for method, seconds in cav_seconds.items())
    speedup = cav_seconds["sgd"] / max(cav_seconds["fastcav"], 1e-9)
    table = "\n".join(["| seed | class | layer | " + " | ".join(f"{method}: score ± sd (p) conclusion"
                                                                 for method in method_names) + " |",
                       "| ---: | --- | --- | " + " | ".join("---" for _ in method_names) + " |", *rows])
    body = (f"`python benchmarks/tcav_watermark.py --seeds {' '.join(map(str, arguments.seeds))} --randoms "
            f"{arguments.randoms} --size {arguments.size}{' --write' if arguments.write else ''}`: concept \"tag\" "
            f"({arguments.size} images of every class with the watermark) against {arguments.randoms} random sets "
            f"of {arguments.size} clean images, 50 clean held-out images per class; a conclusion is \"raises\" or "
            f"\"lowers\" where the t-test against the random CAVs gives p < 0.05 / {len(CLASS_NAMES)} (Bonferroni "
            f"over the classes), \"none\" otherwise; {len(tests)} (seed, class, layer) tests per CAV method.\n\n"
            f"Time per CAV (ms): {times}; FastCAV is {speedup:.0f}× faster than the reference's SGD.\n\n"
            + "\n".join(agreement_table) + "\n\n" + effect_text
            + f"\n\nActivations that are support vectors at the SVM's exact optimum (FastCAV equals the SVM when "
            f"nearly all are): {supports}.\n\nThe tag's effect on the class logit (tag drawn on the 50 clean "
            f"held-out images of the class; mean change, 95 % bootstrap interval):\n\n"
            + "\n".join(["| seed | class | logit change |", "| ---: | --- | ---: |", *effect_rows])
            + "\n\n" + table)
    print(body)
    if arguments.write:
        write_section("Concepts: TCAV of the watermark, SGD and FastCAV CAVs", body)


def _cav_methods(support_shares: list[float]) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    """The CAV methods compared, by name; the exact SVM appends its support-vector shares to ``support_shares``."""

    def svm(concept: Tensor, random: Tensor) -> Tensor:
        direction, share = exact_svm(concept, random)
        support_shares.append(share)
        return direction

    return {"sgd": lambda concept, random: sgd_cav(concept, random, seed=0),
            "sgd seed 1": lambda concept, random: sgd_cav(concept, random, seed=1),
            "svm": svm, "fastcav": fastcav}


if __name__ == "__main__":
    main()
