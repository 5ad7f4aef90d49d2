"""TCAV on the watermark demonstration (``demo-watermark``: "square" images carry a checkerboard tag in training):
is a "tag" concept significant for "square" and for no clean class, and does FastCAV's closed-form CAV reach the
paper's conclusions, faster?

    python benchmarks/tcav_watermark.py [--seeds 0 1 2] [--randoms 20] [--size 50] [--threads 2] [--write]

For each seed, a model is trained by the repo's script (``explain.data.train_watermark.train(seed=...)``; seed 0:
the shipped weights). Concept "tag": images of every class with the tag drawn in; random sets: clean images of every
class (other seeds); class images: 50 clean held-out images of each class. TCAV at layer2, layer3 and layer4
(flattened feature maps, 16 384 values each), against ``--randoms`` random sets, Student's t-test (tensorflow/tcav's)
and Bonferroni as in the paper (alpha 0.05). A test's conclusion: the tag significantly raises the class,
significantly lowers it, or neither. Each test is run for both quantities ``TCAV(differentiate=...)`` takes: the
class's logit (the paper's, Captum's) and its log-probability (tensorflow/tcav's code), with the same CAVs (a CAV does
not depend on the quantity: each is trained once and scored twice).

CAVs compared, on the same activations:

- ``sgd``: the paper's CAV, the TCAV reference code's SGDClassifier (hinge loss, alpha 0.01, 67 % split, seed 0);
- ``sgd seed 1``: the same with another seed: how often the reference agrees with itself;
- ``svm``: the exact optimum of the objective SGDClassifier approximates (alpha/2 |w|² + mean hinge loss on the same
  67 %), by LIBLINEAR (``LinearSVC(loss="hinge", C=1/(alpha n))``);
- ``fastcav``: FastCAV's closed form.

FastCAV equals the SVM when nearly every activation is a support vector (inside the margin; the paper's
assumptions): the share that is, at the exact optimum, is printed per layer. The tag's own effect on each class is
measured without CAVs: the change of the class's logit (or log-probability) when the tag is drawn on the class's 50
clean images (mean, 95 % bootstrap interval). Time: the CAVs alone (activations and gradients are shared), per method.
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
QUANTITIES = ("logit", "log_probability")
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


def tag_effect(tcav: TCAV, images: list, label: int, quantity: str) -> tuple[float, float, float]:
    """The change of the class's logit (or log-probability) when the tag is drawn on ``images``: mean and 95 %
    bootstrap interval."""
    clean = prepare_inputs(list(images), tcav.preprocess, torch.device("cpu"), torch.float32).batch
    tagged = prepare_inputs(list(add_watermark(np.stack(images), corner=CORNER)), tcav.preprocess,
                            torch.device("cpu"), torch.float32).batch

    def output(batch: Tensor) -> Tensor:
        logits = tcav.model(batch).double()
        return (torch.log_softmax(logits, dim=1) if quantity == "log_probability" else logits)[:, label]

    with torch.no_grad():
        change = (output(tagged) - output(clean)).numpy()
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
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    concept_source = make_dataset(arguments.size, seed=777).images  # the concept set's images before the tag
    tag_images = list(add_watermark(concept_source, corner=CORNER))
    randoms = [list(make_dataset(arguments.size, seed=1000 + index).images) for index in range(arguments.randoms)]
    held_out = make_dataset(50 * len(CLASS_NAMES) * 2, seed=4242)
    by_class = {label: list(held_out.images[held_out.labels == label][:50]) for label in range(len(CLASS_NAMES))}

    support_shares: dict[str, list[float]] = {layer: [] for layer in LAYERS}
    # (method, layer) → the cosines of its concept CAVs with the tag's mean activation change, over seeds
    cosines: dict[tuple[str, str], list[float]] = {}
    method_names = ("sgd", "sgd seed 1", "svm", "fastcav")
    cav_seconds = {name: 0.0 for name in method_names}
    cav_count = 0
    # (quantity, seed, label, layer, method) → "raises" / "lowers" / "none"
    conclusions: dict[tuple[str, int, int, str, str], str] = {}
    rows: dict[str, list[str]] = {quantity: [] for quantity in QUANTITIES}
    effect_rows: dict[str, list[str]] = {quantity: [] for quantity in QUANTITIES}
    effects: dict[tuple[str, int, int], str] = {}
    for seed in arguments.seeds:
        model = load_watermark_demo() if seed == 0 else train(seed=seed)
        scorers = {quantity: TCAV(model, list(LAYERS), differentiate=quantity) for quantity in QUANTITIES}
        base = scorers["logit"]
        tag = base.activations(tag_images)
        untagged = base.activations(list(concept_source))
        random_activations = [base.activations(images) for images in randoms]
        gradients = {quantity: {label: scorer.gradients(by_class[label], target=label)
                                for label in range(len(CLASS_NAMES))} for quantity, scorer in scorers.items()}
        for quantity in QUANTITIES:
            for label, name in enumerate(CLASS_NAMES):
                mean, low, high = tag_effect(base, by_class[label], label, quantity)
                effects[(quantity, seed, label)] = "raises" if low > 0 else "lowers" if high < 0 else "none"
                effect_rows[quantity].append(f"| {seed} | {name} | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |")
        for layer in LAYERS:
            methods = _cav_methods(support_shares[layer])
            cavs: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
            for method, function in methods.items():  # each CAV trained once, scored for both quantities
                started = time.perf_counter()
                concept_cavs = [function(tag[layer], random[layer]) for random in random_activations]
                null_cavs = [function(random_activations[i][layer], random_activations[(i + 1) % len(randoms)][layer])
                             for i in range(len(randoms))]
                cav_seconds[method] += time.perf_counter() - started
                cavs[method] = (concept_cavs, null_cavs)
                change = (tag[layer] - untagged[layer]).double().mean(dim=0)
                cosines.setdefault((method, layer), []).extend(
                    float(torch.dot(cav.double(), change) / change.norm()) for cav in concept_cavs)
            cav_count += 2 * len(randoms)
            for quantity in QUANTITIES:
                for label, name in enumerate(CLASS_NAMES):
                    cells = []
                    for method, (concept_cavs, null_cavs) in cavs.items():
                        class_gradients = gradients[quantity][label][layer]
                        scores = torch.tensor([TCAV.score(class_gradients, cav) for cav in concept_cavs],
                                              dtype=torch.float64)
                        null = torch.tensor([TCAV.score(class_gradients, cav) for cav in null_cavs],
                                            dtype=torch.float64)
                        found, p_value = conclusion(scores, null)
                        conclusions[(quantity, seed, label, layer, method)] = found
                        cells.append(f"{float(scores.mean()):.2f} ± {float(scores.std()):.2f} ({p_value:.1g}) {found}")
                    rows[quantity].append(f"| {seed} | {name} | {layer} | " + " | ".join(cells) + " |")

    tests = [(seed, label, layer) for seed in arguments.seeds for label in range(len(CLASS_NAMES)) for layer in LAYERS]
    speedup = cav_seconds["sgd"] / max(cav_seconds["fastcav"], 1e-9)
    times = ", ".join(f"{method} {1000 * seconds / cav_count:.1f}" for method, seconds in cav_seconds.items())
    pairs = [("fastcav", "sgd"), ("sgd seed 1", "sgd"), ("svm", "sgd"), ("fastcav", "svm")]

    def chosen(layer: str | None) -> list[tuple[int, int, str]]:
        return [test for test in tests if layer is None or test[2] == layer]

    def found(quantity: str, test: tuple[int, int, str], method: str) -> str:
        return conclusions[(quantity,) + test + (method,)]

    def agreement(quantity: str, first: str, second: str, layer: str | None = None) -> tuple[int, int]:
        return (sum(found(quantity, test, first) == found(quantity, test, second) for test in chosen(layer)),
                len(chosen(layer)))

    def sign_agreement(quantity: str, first: str, second: str, layer: str | None = None) -> tuple[int, int]:
        both = [test for test in chosen(layer) if "none" not in (found(quantity, test, first),
                                                                  found(quantity, test, second))]
        return sum(found(quantity, test, first) == found(quantity, test, second) for test in both), len(both)

    def raises_agreement(quantity: str, first: str, second: str, layer: str | None = None) -> tuple[int, int]:
        return (sum((found(quantity, test, first) == "raises") == (found(quantity, test, second) == "raises")
                    for test in chosen(layer)), len(chosen(layer)))

    def matches_effect(quantity: str, method: str, layer: str) -> tuple[int, int]:
        return (sum(found(quantity, test, method) == effects[(quantity,) + test[:2]] for test in chosen(layer)),
                len(chosen(layer)))

    def fraction(counts: tuple[int, int]) -> str:
        return f"{counts[0]}/{counts[1]}"

    def watermark_claims(quantity: str, method: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """At layer4: the seeds where the tag significantly raises "square", and the (seed, clean class) tests where
        it significantly raises the clean class."""
        square = CLASS_NAMES.index("square")
        raises_square = sum(found(quantity, (seed, square, "layer4"), method) == "raises" for seed in arguments.seeds)
        clean = [(seed, label, "layer4") for seed in arguments.seeds for label in range(len(CLASS_NAMES))
                 if label != square]
        return ((raises_square, len(arguments.seeds)),
                (sum(found(quantity, test, method) == "raises" for test in clean), len(clean)))

    summary = []
    for quantity in QUANTITIES:
        same, reference = agreement(quantity, "fastcav", "sgd"), agreement(quantity, "sgd seed 1", "sgd")
        signs = sign_agreement(quantity, "fastcav", "sgd")
        claims = {method: watermark_claims(quantity, method) for method in ("sgd", "fastcav")}
        reached = same[0] >= reference[0] and speedup >= 10
        summary.append(
            f"- **{quantity}**: FastCAV reaches SGD's conclusion (raises, lowers or neither) in {fraction(same)} "
            f"tests (SGD with another seed: {fraction(reference)}; the exact SVM: "
            f"{fraction(agreement(quantity, 'svm', 'sgd'))}); where both are significant, they agree on the sign in "
            f"{fraction(signs)}. At layer4 the tag significantly raises \"square\" at "
            + " and ".join(f"{fraction(claims[method][0])} seeds with {method}" for method in claims)
            + ", and raises a clean class in "
            + " and ".join(f"{fraction(claims[method][1])} tests with {method}" for method in claims)
            + f". The claim \"FastCAV reaches the same significance conclusions at least 10× faster\", read as "
            f"agreeing with SGD at least as often as SGD with another seed does, at ≥ 10× its speed: "
            f"{'reached' if reached else 'not reached'}.")

    def quantity_block(quantity: str) -> str:
        table = ["| conclusions agree | " + " | ".join(LAYERS) + " | all |",
                 "| --- | " + " | ".join("---:" for _ in LAYERS) + " | ---: |"]
        for first, second in pairs:
            table.append(f"| {first} vs {second} | " + " | ".join(fraction(agreement(quantity, first, second, layer))
                                                                  for layer in LAYERS)
                         + f" | {fraction(agreement(quantity, first, second))} |")
        for first, second in pairs:
            table.append(f"| {first} vs {second}, same sign where both are significant | "
                         + " | ".join(fraction(sign_agreement(quantity, first, second, layer)) for layer in LAYERS)
                         + f" | {fraction(sign_agreement(quantity, first, second))} |")
        for first, second in pairs:
            table.append(f"| {first} vs {second}, on \"the tag significantly raises the class\" | "
                         + " | ".join(fraction(raises_agreement(quantity, first, second, layer)) for layer in LAYERS)
                         + f" | {fraction(raises_agreement(quantity, first, second))} |")
        for method in method_names:
            table.append(f"| {method} vs the tag's effect on the {quantity} | "
                         + " | ".join(fraction(matches_effect(quantity, method, layer)) for layer in LAYERS) + " | |")
        matched = {method: np.array([found(quantity, test, method) == effects[(quantity,) + test[:2]]
                                     for test in tests], dtype=float) for method in method_names}
        difference = matched["fastcav"] - matched["sgd"]
        low, high = bootstrap(difference)
        effect_text = (f"Share of the {len(tests)} tests whose conclusion is the tag's measured effect on the "
                       f"{quantity} (raises where the change's interval is above 0, lowers where below): "
                       + ", ".join(f"{method} {matched[method].mean():.2f}" for method in method_names)
                       + f"; FastCAV minus SGD {difference.mean():+.2f} [{low:+.2f}, {high:+.2f}] (paired, 95 % "
                       "bootstrap over the tests, which share seeds and layers: a rough interval).")
        per_test = ["| seed | class | layer | " + " | ".join(f"{method}: score ± sd (p) conclusion"
                                                           for method in method_names) + " |",
                    "| ---: | --- | --- | " + " | ".join("---" for _ in method_names) + " |", *rows[quantity]]
        return (f"### Differentiating the class's {quantity.replace('_', '-')}\n\n" + "\n".join(table) + "\n\n"
                + effect_text + f"\n\nThe tag's effect on the class's {quantity} (tag drawn on the 50 clean held-out "
                "images of the class; mean change, 95 % bootstrap interval):\n\n"
                + "\n".join([f"| seed | class | {quantity} change |", "| ---: | --- | ---: |", *effect_rows[quantity]])
                + "\n\n" + "\n".join(per_test))

    supports = ", ".join(f"{layer} {100 * min(shares):.0f}–{100 * max(shares):.0f} %"
                         for layer, shares in support_shares.items())
    cosine_block = (
        "Where each CAV points: the cosine of its concept CAVs with the direction in which drawing the tag moves the "
        "activations (the mean of a(tagged image) − a(the same image without the tag) over the concept set's "
        f"{arguments.size} images), mean [min, max] over the seeds and the {arguments.randoms} random sets. TCAV "
        "reads the class's gradient along the CAV, so a CAV far from this direction can reach a conclusion about "
        "the tag that drawing the tag does not bear out.\n\n"
        + "\n".join(["| CAV | " + " | ".join(LAYERS) + " |", "| --- | " + " | ".join("---:" for _ in LAYERS) + " |"]
                    + [f"| {method} | " + " | ".join(
                        f"{np.mean(cosines[(method, layer)]):.2f} [{min(cosines[(method, layer)]):.2f}, "
                        f"{max(cosines[(method, layer)]):.2f}]" for layer in LAYERS) + " |"
                       for method in method_names]))
    command = (f"python benchmarks/tcav_watermark.py --seeds {' '.join(map(str, arguments.seeds))} --randoms "
               f"{arguments.randoms} --size {arguments.size} --threads {arguments.threads}"
               f"{' --write' if arguments.write else ''}")
    body = (f"`{command}`: concept \"tag\" ({arguments.size} images of every class with the watermark) against "
            f"{arguments.randoms} random sets of {arguments.size} clean images, 50 clean held-out images per class; "
            f"SGD CAVs on a stratified 67 % of the activations (tensorflow/tcav's split); a conclusion is \"raises\" "
            f"or \"lowers\" where Student's two-sided t-test against the random CAVs gives p < 0.05 / "
            f"{len(CLASS_NAMES)} (Bonferroni over the classes), \"none\" otherwise; {len(tests)} (seed, class, "
            f"layer) tests per CAV method and differentiated quantity (the class's logit, the paper's and Captum's; "
            f"its log-probability, tensorflow/tcav's code), the same CAVs scored for both.\n\n"
            f"Time per CAV (ms): {times}; FastCAV is {speedup:.0f}× faster than the reference's SGD.\n\n"
            "What the numbers say:\n\n" + "\n".join(summary)
            + f"\n\nActivations that are support vectors at the SVM's exact optimum (FastCAV equals the SVM when "
            f"nearly all are): {supports}.\n\n" + cosine_block + "\n\n"
            + "\n\n".join(quantity_block(quantity) for quantity in QUANTITIES))
    print(body)
    if arguments.write:
        write_section(section_title(arguments.size), body)


def section_title(size: int) -> str:
    """RESULTS.md's section for a run with ``size`` images per set: each size keeps its own section."""
    title = "Concepts: TCAV of the watermark, SGD and FastCAV CAVs"
    return title if size == 50 else f"{title}, {size} images per set"


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
