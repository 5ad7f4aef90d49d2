"""Testing with Concept Activation Vectors (TCAV; Kim et al., ICML 2018), with the SVM-style CAVs of the paper or
FastCAV's closed-form ones (Schmalwasser et al., ICML 2025).

A concept is a set of example images (a folder of "striped" textures, of images with a watermark); a random set is
images without it. At a layer l, a concept activation vector (CAV) v is the normal of a linear boundary between the
concept's activations and a random set's, pointing to the concept. The conceptual sensitivity of class k for an image x
is S(x) = ∇h_{l,k}(f_l(x)) · v, where h_{l,k} is class k's logit (the paper's and Captum's choice, the default) or its
log-probability, log softmax (log sigmoid for a one-logit output; ``differentiate="log_probability"``: what
tensorflow/tcav's code does, which counts the images where the gradient of the class's cross-entropy loss has a negative
dot product with v); the TCAV score of the concept for class k is the share of the class's images with S(x) > 0. A score
means something only against chance: TCAV is repeated against R random sets (R CAVs, R scores), and the same is done
with random sets in place of the concept (R null scores); a two-sided Student's t-test (pooled variance, as
tensorflow/tcav's ``scipy.stats.ttest_ind``) of the scores against the null scores gives the p-value, significant below
``alpha`` divided by the number of concepts tested (Bonferroni, the correction the paper's text applies).

    tcav = explain.TCAV(model, ["layer3", "layer4"], cav="fastcav")
    result = tcav.test("images/zebra", target=340, concepts={"striped": "concepts/striped"},
                       randoms=["random/0", "random/1", "random/2", ...])
    print(result.markdown())

CAVs: "sgd" (the default: a linear classifier trained by scikit-learn's SGDClassifier with the TCAV reference code's
settings, alpha 0.01, on a stratified 67 % of the activations: the paper's CAV), "fastcav" (closed form: the mean of
the concept's activations after the mean of all the activations is subtracted, normalised; on the model's device; far
faster, but its conclusions differ from the paper's CAV's where few activations are support vectors:
benchmarks/RESULTS.md, "Concepts: TCAV of the watermark"), or a function (concept (P, D), random (Q, D)) → (D,) CAV.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.capture import (
    ActivationCapture,
    LayerNotRunError,
    find_layers,
    model_device,
    model_dtype,
    model_input_channels,
)
from ..core.scope import CallScope
from ..core.targets import OutputSelector, select_output
from ..io.inputs import Inputs, PreprocessSpec, as_preprocess, folder_images, prepare_inputs
from ..io.loaded_model import ModelSource, loaded_model_parts

CavMethod = Union[str, Callable[[Tensor, Tensor], Tensor]]
DIFFERENTIATED = ("logit", "log_probability")
"""What ``TCAV(differentiate=...)`` takes the directional derivative of: the class's logit (the paper, Captum) or its
log-probability, log softmax of the logits (tensorflow/tcav's code, through the class's cross-entropy loss)."""
SPLIT_FROM = 5
"""The fewest images of each set (concept, random) from which the CAV is trained on a held-out split as the TCAV
reference code trains it (``training_split``); a set of fewer is warned about (``TCAV.test``)."""
ImageSet = Union[str, Path, Inputs]
"""A set of images: a folder of image files, or anything ``explain()`` accepts (a list of paths, a tensor...)."""


def fastcav(concept: Tensor, random: Tensor) -> Tensor:
    """FastCAV's closed-form CAV (D,): with μ the mean of all P + Q activations, the mean of (a − μ) over the P
    concept activations, normalised to length 1. concept: (P, D); random: (Q, D)."""
    centre = torch.cat([concept, random]).mean(dim=0)
    direction = (concept - centre).mean(dim=0)
    length = direction.norm()
    if not length > 0:
        raise ValueError("the concept's and the random set's activations have the same mean, so FastCAV has no "
                         "direction (a zero CAV would score 0 on every image): give sets of different images, or a "
                         "layer whose activations differ between them (not one that is constant, e.g. zero after "
                         "a ReLU).")
    return direction / length


def training_split(concept: Tensor, random: Tensor, seed: int = 0) -> tuple[Any, Any]:
    """What the TCAV reference code trains its CAV on: the concept's (label 1) and the random set's (label 0)
    activations as float64 NumPy (features (M, D), labels (M,)), a stratified 67 % of them where each set has at
    least ``SPLIT_FROM`` = 5 (every one of them below: too few to hold a third of each set out), as tensorflow/tcav's
    ``cav.py`` (``test_size=0.33``) and Captum (``test_split_ratio=0.33``) split them (the held-out 33 %, whose
    accuracy the reference reports, is not used here)."""
    from sklearn.model_selection import train_test_split

    features = torch.cat([concept, random]).double().cpu().numpy()
    labels = np.array([1] * concept.shape[0] + [0] * random.shape[0])
    if min(concept.shape[0], random.shape[0]) >= SPLIT_FROM:
        features, _, labels, _ = train_test_split(features, labels, test_size=0.33, stratify=labels, random_state=seed)
    return features, labels


def sgd_cav(concept: Tensor, random: Tensor, seed: int = 0) -> Tensor:
    """The TCAV paper's CAV (D,): the normal of a linear classifier trained to tell the concept's activations (label
    1) from the random set's (label 0) by scikit-learn's SGDClassifier (hinge loss, alpha 0.01, max_iter 1000, tol
    1e-3), on a stratified 67 % of the activations as the reference code (tensorflow/tcav's cav.py) trains it,
    pointing to the concept, normalised to length 1."""
    from sklearn.linear_model import SGDClassifier

    features, labels = training_split(concept, random, seed)
    classifier = SGDClassifier(alpha=0.01, max_iter=1000, tol=1e-3, random_state=seed).fit(features, labels)
    direction = torch.as_tensor(classifier.coef_[0], dtype=concept.dtype, device=concept.device)
    length = direction.norm()
    if not length > 0 or not bool(torch.isfinite(length)):
        raise ValueError(f"the SGD classifier between the concept's and the random set's activations has weights "
                         f"{'of 0' if length == 0 else 'that are not finite'}, so there is no CAV (a zero CAV would "
                         "score 0 on every image): give a layer whose activations differ between the sets (not one "
                         "that is constant, e.g. zero after a ReLU).")
    return direction / length


def concept_activation_vector(concept: Tensor, random: Tensor, method: CavMethod = "sgd", seed: int = 0
                              ) -> Tensor:
    """The CAV (D,) of ``concept`` (P, D) against ``random`` (Q, D) activations by ``method``."""
    if callable(method):
        return method(concept, random)
    if method == "fastcav":
        return fastcav(concept, random)
    if method == "sgd":
        return sgd_cav(concept, random, seed)
    raise ValueError(f"cav must be 'fastcav', 'sgd' or a function (concept, random) → CAV; got {method!r}.")


def class_index(target: Any) -> int:
    """A class index as an int: an int, a NumPy integer or a one-element integer tensor; a bool, a float or a string
    is refused (``logits[:, True]`` would sum every class)."""
    if isinstance(target, (bool, np.bool_)) or (isinstance(target, Tensor) and not (
            target.numel() == 1 and not target.is_floating_point() and target.dtype != torch.bool)):
        raise TypeError(f"target must be a class index (an int); got {target!r}.")
    if isinstance(target, Tensor):
        return int(target.item())
    if not isinstance(target, numbers.Integral):
        raise TypeError(f"target must be a class index (an int); got {target!r}.")
    return operator.index(target)


def log_probabilities(logits: Tensor) -> Tensor:
    """(N, C) logits → (N, C) log-probabilities: log softmax over the C classes; for one column (a binary classifier's
    logit, trained with a sigmoid) log sigmoid, the log-probability of its positive class, as
    ``explain.core.targets.class_probabilities`` (a log softmax over one column is 0 whatever the input, which would
    make every directional derivative 0 and every score 0)."""
    return torch.nn.functional.logsigmoid(logits) if logits.shape[1] == 1 else torch.log_softmax(logits, dim=1)


@dataclass
class ConceptTest:
    """TCAV of one concept at one layer for one class: ``scores`` (R,) against each random set, ``null_scores``
    (R,) of random sets in the concept's place, the two-sided Student's t-test's ``p_value``, and whether it is
    ``significant`` (p below alpha / the number of concepts)."""

    concept: str
    layer: str
    scores: Tensor
    null_scores: Tensor
    p_value: float
    significant: bool

    @property
    def mean(self) -> float:
        return float(self.scores.mean())


@dataclass
class TCAVResult:
    """Every (concept, layer) test for the class ``target``."""

    target: int
    tests: list[ConceptTest]
    alpha: float

    def markdown(self) -> str:
        lines = ["| concept | layer | TCAV score (mean ± sd) | null (mean ± sd) | p | significant |",
                 "| --- | --- | ---: | ---: | ---: | --- |"]
        for test in self.tests:
            lines.append(f"| {test.concept} | {test.layer} | {test.mean:.3f} ± {float(test.scores.std()):.3f} | "
                         f"{float(test.null_scores.mean()):.3f} ± {float(test.null_scores.std()):.3f} | "
                         f"{test.p_value:.2g} | {'yes' if test.significant else 'no'} |")
        return "\n".join(lines)

    def test(self, concept: str, layer: str) -> ConceptTest:
        for test in self.tests:
            if test.concept == concept and test.layer == layer:
                return test
        raise KeyError(f"no test of {concept!r} at {layer!r}.")


class TCAV:
    """Concept activation vectors and TCAV scores at ``layers`` of ``model``.

    model: a module or ``explain.load_model``'s result (its preprocessing is used); it must return (N, classes) logits.
    layers: names of ``model.named_modules()``, globs, modules or module types (``explain.core.capture.find_layers``),
    each run once per forward pass; each layer's output is flattened per image into its activation vector (recorded as
    the layer returns it: an in-place operation after the layer changes neither it nor its gradient). output: which
    part of the model's output holds the logits (automatic: a tensor, HuggingFace's ``.logits``, a dict's "logits").
    cav: "sgd" (the paper's), "fastcav" or a function (see the module docstring). differentiate: the class output whose
    directional derivative along the CAV is counted, "logit" (the default: the paper's definition, as Captum) or
    "log_probability" (log softmax of the logits, log sigmoid of a one-logit output: what tensorflow/tcav's code counts,
    as the gradient of the class's cross-entropy loss pointing against the CAV). The two differ where raising the
    concept raises other classes' logits more than the class's own. batch_size: images per forward pass. seed: the SGD
    classifier's.
    """

    def __init__(self, model: ModelSource, layers: Any, *, cav: CavMethod = "sgd",
                 differentiate: str = "logit", preprocess: PreprocessSpec = None, batch_size: int = 32,
                 seed: int = 0, output: OutputSelector = None):
        module, loaded_preprocess, _, loaded_output = loaded_model_parts(model, output=output)
        self.model: nn.Module = module
        self.preprocess = as_preprocess(preprocess if preprocess is not None else loaded_preprocess)
        self.output = loaded_output
        found = find_layers(self.model, layers)  # names, globs, modules or module types
        self.layer_names = [name for name, _ in found]
        self.layers = [layer for _, layer in found]
        if not callable(cav) and cav not in ("fastcav", "sgd"):
            raise ValueError(f"cav must be 'fastcav', 'sgd' or a function (concept, random) → CAV; got {cav!r}.")
        if not isinstance(differentiate, str) or differentiate not in DIFFERENTIATED:
            raise ValueError(f"differentiate must be 'logit' (the TCAV paper's, Captum's) or 'log_probability' "
                             f"(log softmax of the logits, tensorflow/tcav's code); got {differentiate!r}.")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number ≥ 1; got {batch_size!r}.")
        self.cav_method = cav
        self.differentiate = differentiate
        self.batch_size = batch_size
        self.seed = seed

    # ------------------------------------------------------------------ activations and gradients

    def _images(self, images: ImageSet) -> list[Any]:
        """The set as a list of single images (a folder's image files, sorted)."""
        if isinstance(images, (str, Path)) and Path(images).is_dir():
            return folder_images(images)
        if isinstance(images, Tensor) and images.dim() == 4:
            items = list(images)
        elif isinstance(images, (list, tuple)):
            items = list(images)
        else:
            items = [images]
        if not items:
            raise ValueError("a set of images is empty: give at least one image.")
        return items

    def _batches(self, images: ImageSet) -> list[Tensor]:
        items = self._images(images)
        device, dtype = model_device(self.model), model_dtype(self.model)
        channels = model_input_channels(self.model)
        try:
            return [prepare_inputs(items[start:start + self.batch_size], self.preprocess, device, dtype, channels).batch
                    for start in range(0, len(items), self.batch_size)]
        except ValueError as error:  # an image that cannot be read, of another size...: named with its set by test
            raise ImageSetError(str(error)) from error

    def _logits_and_layers(self, batch: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The model's (N, classes) logits for a batch and each layer's output as the layer returned it
        (``ActivationCapture``: the rest of the forward gets a copy, so an in-place operation after the layer,
        ``ReLU(inplace=True)`` or torchvision's ``out += identity``, changes neither the activations nor the tensor
        differentiated; a layer that does not run exactly once, or returns no tensor, is refused)."""
        try:
            with ActivationCapture(self.model, list(zip(self.layer_names, self.layers)),
                                   graph_from_first_layer=False) as capture:
                logits = self._logits(batch)
                outputs = capture.activations()
        except LayerNotRunError as error:  # TCAV's refusals of its arguments are ValueErrors
            raise ValueError(str(error)) from error
        for name, output in zip(self.layer_names, outputs):
            if output.dim() == 0 or output.shape[0] != batch.shape[0]:
                raise ValueError(f"layer {name}'s output {tuple(output.shape)} does not hold the {batch.shape[0]} "
                                 "images of the batch along its first dimension (a sequence-first layer, such as "
                                 "nn.MultiheadAttention without batch_first, or a reduction over the batch): its "
                                 "rows are not images' activations. Give a layer whose output is (N, ...).")
        return logits, outputs

    @staticmethod
    def _per_image(output: Tensor) -> Tensor:
        """A layer's (N, ...) output as (N, D) activation vectors (an (N,) output: one value per image)."""
        return output.detach().reshape(output.shape[0], -1)

    def _logits(self, batch: Tensor) -> Tensor:
        """The model's (N, classes) logits for a batch (its output selected as ``output`` says)."""
        logits = select_output(self.model(batch), self.output)
        if not isinstance(logits, Tensor) or logits.dim() != 2:
            raise ValueError("TCAV differentiates a class logit: the model must return (N, classes) scores; got "
                             f"{type(logits).__name__}" + (f" of shape {tuple(logits.shape)}"
                                                           if isinstance(logits, Tensor) else "") + ".")
        return logits

    def _full_precision(self, scope: CallScope) -> None:
        """Autocast off for the scope: CAVs and directional derivatives in the model's own precision (bfloat16
        activations change which side of a CAV a gradient falls)."""
        scope.enter(torch.autocast(model_device(self.model).type, enabled=False))

    def activations(self, images: ImageSet) -> dict[str, Tensor]:
        """Each layer's activations of the set, layer name → (N, D) on the model's device."""
        gathered: dict[str, list[Tensor]] = {name: [] for name in self.layer_names}
        with CallScope(self.model, eval_mode=True) as scope:
            self._full_precision(scope)
            with torch.no_grad():
                for batch in self._batches(images):
                    _, outputs = self._logits_and_layers(batch)
                    for name, output in zip(self.layer_names, outputs):
                        gathered[name].append(self._per_image(output))
        return {name: torch.cat(values) for name, values in gathered.items()}

    def gradients(self, images: ImageSet, target: int) -> dict[str, Tensor]:
        """∂(class ``target``'s logit, or log-probability with ``differentiate="log_probability"``)/∂(layer's output)
        for each image of the set, layer name → (N, D)."""
        target = class_index(target)
        gathered: dict[str, list[Tensor]] = {name: [] for name in self.layer_names}
        with CallScope(self.model, eval_mode=True) as scope:
            if torch.is_inference_mode_enabled():
                scope.enter(torch.inference_mode(False))
            self._full_precision(scope)
            scope.frozen_parameters(self.model)
            with torch.enable_grad():
                for batch in self._batches(images):
                    logits, layer_outputs = self._logits_and_layers(batch.detach().requires_grad_(True))
                    if not 0 <= target < logits.shape[1]:
                        raise ValueError(f"target {target} is not a class of the model's {logits.shape[1]} outputs.")
                    if self.differentiate == "log_probability":  # row-wise: each image's own
                        logits = log_probabilities(logits)
                    for name, output in zip(self.layer_names, layer_outputs):
                        if not output.requires_grad:
                            raise ValueError(f"layer {name}'s output carries no gradient: the model computes it under "
                                             "torch.no_grad() or detaches it, so no class output can be "
                                             "differentiated at it. Give a layer the prediction is computed through "
                                             "with gradients.")
                    grads = torch.autograd.grad(logits[:, target].sum(), layer_outputs, allow_unused=True)
                    for name, grad in zip(self.layer_names, grads):
                        if grad is None:
                            raise ValueError(f"class {target}'s {self.differentiate} does not depend on layer "
                                             f"{name} through gradients (the layer does not feed the class, or the "
                                             "model uses its output under torch.no_grad() or detached): give a "
                                             "layer the prediction is computed through with gradients.")
                        gathered[name].append(self._per_image(grad))
        return {name: torch.cat(values) for name, values in gathered.items()}

    # ------------------------------------------------------------------ the test

    def cav(self, concept: Tensor, random: Tensor) -> Tensor:
        """The CAV (D,) of concept (P, D) against random (Q, D) activations."""
        return concept_activation_vector(concept, random, self.cav_method, self.seed)

    def _named_cav(self, concept: Tensor, random: Tensor, layer: str, sets: str) -> Tensor:
        """``cav``, with a refusal naming the layer and the sets it was refused for."""
        try:
            return self.cav(concept, random)
        except ValueError as error:
            raise ValueError(f"at layer {layer}, {sets}: {error}") from None

    @staticmethod
    def score(gradients: Tensor, cav: Tensor) -> float:
        """TCAV score: the share of the images (rows of ``gradients``) whose directional derivative along ``cav`` is
        positive."""
        return float(((gradients @ cav.to(gradients)) > 0).double().mean())

    def test(self, class_images: ImageSet, target: int, concepts: Mapping[str, ImageSet],
             randoms: Sequence[ImageSet], alpha: float = 0.05) -> TCAVResult:
        """TCAV of each concept at each layer for class ``target`` over ``class_images``, against each random set of
        ``randoms`` (at least 2), with the significance test of the module docstring."""
        if isinstance(randoms, (str, Path, Tensor)) or not isinstance(randoms, Sequence):
            raise ValueError(f"randoms must be a list of random sets (folders or lists of images), at least 2; got "
                             f"{type(randoms).__name__} {str(randoms)[:80]!r}: give [set_0, set_1, ...].")
        if len(randoms) < 2:
            raise ValueError("TCAV's significance test needs at least 2 random sets (the paper uses many more).")
        if not isinstance(concepts, Mapping):
            raise ValueError(f"concepts must map each concept's name to its images, {{name: images}}; got "
                             f"{type(concepts).__name__}: give e.g. {{'striped': 'concepts/striped'}}.")
        if not concepts:
            raise ValueError("give at least one concept: {name: images}.")
        if (not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or math.isnan(alpha)
                or not 0 < alpha < 1):
            raise ValueError(f"alpha must be a significance level in (0, 1), e.g. 0.05; got {alpha!r}.")
        sets = {"the class images": class_images, **{f"concept {name!r}": images for name, images in concepts.items()},
                **{f"random set {index}": images for index, images in enumerate(randoms)}}
        listed: dict[str, list[Any]] = {}  # each set's images, a folder's listed once
        for role, images in sets.items():
            try:
                listed[role] = self._images(images)
            except ValueError as error:
                raise ValueError(f"{role}: {error}") from None
        _warn_of_small_sets({role: len(items) for role, items in listed.items() if role != "the class images"})
        gradients = _naming_the_set("the class images", lambda: self.gradients(listed["the class images"], target))
        random_activations = [
            _naming_the_set(f"random set {index}", lambda role=f"random set {index}": self.activations(listed[role]))
            for index in range(len(randoms))]
        tests: list[ConceptTest] = []
        bonferroni = alpha / len(concepts)
        concept_activations = {
            name: _naming_the_set(f"concept {name!r}", lambda role=f"concept {name!r}": self.activations(listed[role]))
            for name in concepts}
        recorded = {**{f"concept {name!r}": values for name, values in concept_activations.items()},
                    **{f"random set {index}": values for index, values in enumerate(random_activations)}}
        _check_sets(gradients, recorded)
        for layer in self.layer_names:
            null = torch.tensor([self.score(gradients[layer], self._named_cav(
                random_activations[index][layer], random_activations[(index + 1) % len(randoms)][layer], layer,
                f"random set {index} against random set {(index + 1) % len(randoms)}"))
                for index in range(len(randoms))], dtype=torch.float64)
            for name, activations in concept_activations.items():
                scores = torch.tensor([self.score(gradients[layer], self._named_cav(
                    activations[layer], random[layer], layer, f"concept {name!r} against random set {index}"))
                    for index, random in enumerate(random_activations)], dtype=torch.float64)
                p_value = _two_sided_t_test(scores, null)
                tests.append(ConceptTest(name, layer, scores, null, p_value,
                                         not math.isnan(p_value) and p_value < bonferroni))
        return TCAVResult(target, tests, alpha)


class ImageSetError(ValueError):
    """A set's images could not be made into a batch (a file that is no image, RGBA or 16-bit pixels, images of
    several sizes)."""


def _warn_of_small_sets(sizes: Mapping[str, int]) -> None:
    """Warn of the concept and random sets (role → number of images) with fewer than ``SPLIT_FROM`` images: their
    CAVs are trained on every image, none held out as the reference code holds out a third, and a direction fitted to
    so few activations mostly tells those images apart, so the scores and the test say little about the concept."""
    small = [f"{role} has {size} image{'s' if size != 1 else ''}" for role, size in sizes.items() if size < SPLIT_FROM]
    if small:
        warn_at_callers_line(
            f"{', '.join(small)}: fewer than {SPLIT_FROM} images. A CAV is trained on a stratified 67 % of each set's "
            f"images (the TCAV reference code's split) only from {SPLIT_FROM} images on; these sets' CAVs are fitted "
            "to every image, none held out, and a direction fitted to so few activations tells those images apart "
            "more than it finds the concept: the scores and their significance say little. Give each concept and "
            "random set more images (tens; the more, the steadier the CAVs).")


def _naming_the_set(role: str, read: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """``read()``, with an error about the set's images (``ImageSetError``) naming the set."""
    try:
        return read()
    except ImageSetError as error:
        raise ValueError(f"{role}: {error}") from None


def _check_sets(gradients: dict[str, Tensor], activations: dict[str, dict[str, Tensor]]) -> None:
    """Refuse sets whose activations cannot make a CAV with the others: another width at a layer than the class
    images' gradients (images of another size), or equal to another set's (the same images twice: no direction
    separates them, and a CAV between them would be noise or zero)."""
    for layer, gradient in gradients.items():
        for role, values in activations.items():
            if values[layer].shape[1] != gradient.shape[1]:
                raise ValueError(
                    f"{role} has {values[layer].shape[1]} activations per image at layer {layer}, the class images "
                    f"{gradient.shape[1]}: the sets' images differ in size. Give images of one size, or a preprocess "
                    "that resizes them (explain.load_model's, or torchvision's weights.transforms()).")
    roles = list(activations)
    rows_in_order = {role: {layer: _rows_in_a_fixed_order(values[layer]) for layer in gradients}
                     for role, values in activations.items()}
    for first_index, first in enumerate(roles):
        for second in roles[first_index + 1:]:
            if all(torch.equal(rows_in_order[first][layer], rows_in_order[second][layer]) for layer in gradients):
                raise ValueError(f"{first} and {second} have equal activations at every layer: a CAV between them "
                                 "has no direction. They are the same images, or the layers give all images the "
                                 "same activations (constant, e.g. zero after a ReLU). Give each set its own images "
                                 "(the same images in another order are the same set), and layers that respond to "
                                 "them.")


def _rows_in_a_fixed_order(values: Tensor) -> Tensor:
    """The rows of ``values`` (N, D) sorted by a fixed projection: the same images in another order give the same
    tensor."""
    generator = torch.Generator().manual_seed(0)
    projection = torch.randn(values.shape[1], dtype=torch.float64, generator=generator).to(values.device)
    return values[(values.double() @ projection).argsort(stable=True)]


def _two_sided_t_test(scores: Tensor, null: Tensor) -> float:
    """Student's two-sided t-test of two samples' means, with their pooled variance (scipy's ``ttest_ind`` with its
    default ``equal_var=True``, as tensorflow/tcav's ``utils.py`` calls it); where both samples are constant (pooled
    variance 0, where scipy gives nan): 1 if they are equal, 0 if they differ."""
    from scipy import stats

    constant_scores, constant_null = bool((scores == scores[0]).all()), bool((null == null[0]).all())
    if constant_scores and constant_null:
        return 1.0 if float(scores[0]) == float(null[0]) else 0.0
    with warnings.catch_warnings():
        if constant_scores or constant_null:  # its variance is exactly 0, not a precision loss scipy warns about
            warnings.filterwarnings("ignore", message="Precision loss occurred in moment calculation")
        return float(stats.ttest_ind(scores.numpy(), null.numpy()).pvalue)
