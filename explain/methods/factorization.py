"""Deep feature factorisation (Collins, Achanta & Süsstrunk 2018): what does a layer group together?

A layer's non-negative activations over a batch of images, A (C channels × N·h·w positions),
are factorised by non-negative matrix factorisation, A ≈ W H, into k concepts: column j of W
(C,) is concept j's channel profile, row j of H where it is present, one heat map per
concept and image. Through the classifier, each concept's profile (as if an image were made of
that concept alone) gives the classes it scores highest. A model-debugging tool: it needs no
target and explains a batch, not an image, so it returns a ``Factorization``, not an
``Explanation``.

    dff = DeepFeatureFactorization(model, "layer4", concepts=4)
    result = dff.factorize(images)
    result.maps             # (N, k, H, W) in [0, 1]
    result.top_classes()    # per concept, [(class, probability), ...]
    result.figure().savefig("concepts.png")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.capture import (
    LayerOutputError,
    LayerSpec,
    capture,
    check_hookable,
    eager_model,
    find_layers,
    map_tensors,
    model_device,
    model_dtype,
    model_input_channels,
    run_model,
)
from ..core.layouts import Reshape, infer_layout
from ..core.scope import CallScope
from ..io.inputs import Inputs, PreprocessSpec, as_preprocess, prepare_inputs
from ..io.render import image_as_float, label_text
from .maps import upsample_maps
from .options import int_option, is_whole_number, number_option

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PALETTE = np.array([  # matplotlib's tab10, as RGB in [0, 1]
    (0.122, 0.467, 0.706), (1.000, 0.498, 0.055), (0.173, 0.627, 0.173), (0.839, 0.153, 0.157),
    (0.580, 0.404, 0.741), (0.549, 0.337, 0.294), (0.890, 0.467, 0.761), (0.498, 0.498, 0.498),
    (0.737, 0.741, 0.133), (0.090, 0.745, 0.812),
])


def nmf(matrix: Tensor, components: int, *, iterations: int = 1000, tolerance: float = 1e-7,
        seed: int = 0) -> tuple[Tensor, Tensor, float]:
    """Non-negative matrix factorisation V ≈ W H (Frobenius loss) by hierarchical alternating least
    squares (Cichocki & Phan 2009): each column of W and row of H in turn is the exact non-negative
    least-squares update with the others fixed.

    matrix: (m, n) ≥ 0. Returns W (m, k) ≥ 0, H (k, n) ≥ 0 in float64 and the relative error
    ‖V − W H‖_F / ‖V‖_F. Stops when an iteration lowers the relative error by less than ``tolerance``.
    The start is drawn from a generator seeded with ``seed``: same seed, same factors.
    """
    values = matrix.double()
    generator = torch.Generator().manual_seed(seed)
    scale = float((values.mean() / components).sqrt())
    rows, columns = values.shape
    left = (torch.rand(rows, components, generator=generator, dtype=torch.float64) * scale).to(values.device)
    right = (torch.rand(components, columns, generator=generator, dtype=torch.float64) * scale).to(values.device)
    norm = float(values.norm()) or 1.0
    error, previous = float("inf"), float("inf")
    for _ in range(iterations):
        products, gram = left.T @ values, left.T @ left
        for j in range(components):
            right[j] = (right[j] + (products[j] - gram[j] @ right) / gram[j, j].clamp_min(1e-12)).clamp_min(0)
        products, gram = values @ right.T, right @ right.T
        for j in range(components):
            left[:, j] = (left[:, j] + (products[:, j] - left @ gram[:, j]) / gram[j, j].clamp_min(1e-12)).clamp_min(0)
        error = float((values - left @ right).norm()) / norm
        if previous - error < tolerance:
            break
        previous = error
    return left, right, error


@dataclass
class Factorization:
    """Deep feature factorisation of one layer over N images into k concepts.

    concepts: (k, C) each concept's channel profile, scaled so that its heat maps peak at 1 over
        the batch (the layer's activation where the concept is strongest).
    low_res_maps: (N, k, h, w) ≥ 0, each concept's presence at the layer's resolution (A ≈ concepts
        ᵀ · maps at every position).
    maps: (N, k, H, W) in [0, 1], upsampled to the input (comparable across images and concepts).
    relative_error: ‖A − W H‖_F / ‖A‖_F of the factorisation.
    concept_scores: (k, classes) the classifier's logits for each concept profile, or None.
    images: (N, H, W, 3) display images in [0, 1]. layer: the layer's name.
    Concepts are ordered by their total presence in the batch, largest first.
    """

    concepts: Tensor
    low_res_maps: Tensor
    maps: Tensor
    relative_error: float
    images: Tensor
    layer: str
    concept_scores: Optional[Tensor] = None
    class_names: Optional[Sequence[str]] = None

    def __len__(self) -> int:
        return self.maps.shape[0]

    @property
    def concept_probabilities(self) -> Optional[Tensor]:
        """(k, classes) softmax of ``concept_scores``."""
        return None if self.concept_scores is None else self.concept_scores.float().softmax(dim=1)

    def top_classes(self, count: int = 2) -> list[list[tuple[int, float]]]:
        """For each concept, its ``count`` highest-scoring classes as (class index, probability)."""
        if self.concept_probabilities is None:
            return [[] for _ in range(len(self.concepts))]
        top = self.concept_probabilities.topk(min(count, self.concept_probabilities.shape[1]), dim=1)
        return [list(zip(indices.tolist(), values.tolist())) for values, indices in zip(*top)]

    def labels(self, count: int = 2, least: float = 0.01) -> list[str]:
        """One legend line per concept: 'concept j: class p, class p' (up to ``count`` classes of
        probability ≥ ``least``)."""
        lines: list[str] = []
        for j, top in enumerate(self.top_classes(count)):
            shown = [f"{label_text(index, self.class_names)} {p:.2f}" for index, p in top if p >= least]
            lines.append(f"concept {j + 1}" + (": " + ", ".join(shown) if shown else ""))
        return lines

    def overlay(self, alpha: float = 0.8) -> np.ndarray:
        """(N, H, W, 3) uint8: each pixel tinted with the colour of its strongest concept, as strongly as
        that concept is present relative to the image's strongest presence (a pixel where no concept
        is present keeps the image)."""
        maps = self.maps.detach().float().cpu()
        strength, concept = maps.max(dim=1)  # (N, H, W)
        peak = strength.flatten(1).amax(1).clamp_min(1e-12)
        strength = strength / peak[:, None, None]
        colours = torch.from_numpy(PALETTE[np.arange(maps.shape[1]) % len(PALETTE)]).float()[concept]
        weight = (alpha * strength)[..., None]
        blended = image_as_float(self.images).cpu() * (1 - weight) + colours * weight
        return (blended.clamp(0, 1) * 255).round().to(torch.uint8).numpy()

    def figure(self, indices: Optional[Sequence[int]] = None, alpha: float = 0.8, classes: int = 2,
               panel_size: float = 1.6) -> "Figure":
        """Images (top row) over their concept overlays (bottom row), with a legend giving each
        concept's colour and the classes it scores highest. indices: which images (default: the
        first 8)."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        indices = list(range(min(8, len(self)))) if indices is None else list(indices)
        overlays = self.overlay(alpha)
        images = (image_as_float(self.images).cpu().numpy() * 255).round().astype(np.uint8)
        figure = Figure(figsize=(panel_size * len(indices), 2 * panel_size + 0.5 + 0.2 * len(self.concepts)),
                        layout="constrained")
        axes = figure.subplots(2, len(indices), squeeze=False)
        for column, index in enumerate(indices):
            for row, picture in enumerate((images[index], overlays[index])):
                axes[row, column].imshow(picture)
                axes[row, column].set_axis_off()
        handles = [Patch(color=PALETTE[j % len(PALETTE)], label=label) for j, label in enumerate(self.labels(classes))]
        figure.legend(handles=handles, loc="outside lower center", ncols=min(2, len(handles)), fontsize=8,
                      frameon=False)
        figure.suptitle(f"Deep feature factorisation of {self.layer} into {len(self.concepts)} concepts "
                        f"(relative reconstruction error {self.relative_error:.3f})", fontsize=9)
        return figure


class DeepFeatureFactorization:
    """Deep feature factorisation (Collins et al. 2018) of a layer's activations over a batch.

    model: any ``nn.Module``; run in eval mode during ``factorize`` and left as found.
    layer: the layer whose output is factorised; it must be non-negative (after a ReLU).
    concepts: k, the number of concepts (an int, numpy integer or 0-d integer tensor): at most the layer's channels
        and its positions over the batch, the most dimensions its activations span (more is refused).
    classifier: the module (or callable (k, C) → (k, classes)) that turns a concept's channel
        profile into class scores; "auto" (default): the ``nn.Linear`` taking C features whose
        output is the model's output (a ResNet's ``fc``; not a hidden layer of an MLP head nor a
        projection), found in the forward pass; a warning when there is none (no class scores) or
        when its input is not the layer's average or maximum over positions (the scores then skip
        the modules in between); None: no class scores.
    iterations, tolerance, seed: of the factorisation (see ``nmf``).
    preprocess, reshape, class_names: as for the explainers.
    """

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec,
        *,
        concepts: int = 4,
        classifier: Union[Literal["auto"], nn.Module, Callable[[Tensor], Tensor], None] = "auto",
        iterations: int = 1000,
        tolerance: float = 1e-7,
        seed: int = 0,
        preprocess: PreprocessSpec = None,
        reshape: Reshape = None,
        class_names: Optional[Sequence[str]] = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
        check_hookable(model)
        model = eager_model(model, type(self).__name__)  # torch.compile(model): the module it wraps
        found = find_layers(model, layer)
        if len(found) != 1:
            raise ValueError(f"deep feature factorisation needs one layer; {layer!r} selects {len(found)}.")
        concepts = int(concepts) if is_whole_number(concepts) else concepts
        concepts, iterations = int_option("concepts", concepts, 1), int_option("iterations", iterations, 1)
        tolerance, seed = number_option("tolerance", tolerance), int_option("seed", seed, 0)
        if not (classifier is None or (isinstance(classifier, str) and classifier == "auto") or callable(classifier)):
            raise TypeError(f"classifier must be 'auto', None or a module/callable (k, C) → (k, classes) such as "
                            f"model.fc; got {classifier!r}.")
        self.model, (self.layer_name, self.module) = model, found[0]
        self.concepts, self.classifier, self.iterations = concepts, classifier, iterations
        self.tolerance, self.seed, self.reshape, self.class_names = tolerance, seed, reshape, class_names
        self.preprocess = as_preprocess(preprocess)

    def _run_recording_heads(self, batch: Tensor) -> tuple[object, list[tuple[str, nn.Linear, Tensor, Tensor]]]:
        """Run the model; with classifier="auto", also record every ``nn.Linear`` call (name, module,
        input, output), in call order, for ``_auto_classifier``."""
        calls: list[tuple[str, nn.Linear, Tensor, Tensor]] = []
        handles = []
        if isinstance(self.classifier, str):
            for name, module in self.model.named_modules():
                if isinstance(module, nn.Linear):
                    handles.append(module.register_forward_hook(
                        lambda module, args, output, name=name: calls.append((name, module, args[0], output))
                        if args and isinstance(args[0], Tensor) and isinstance(output, Tensor) else None))
        try:
            output = run_model(self.model, batch)
        finally:
            for handle in handles:
                handle.remove()
        return output, calls

    def _auto_classifier(self, activations: Tensor, output: object,
                         calls: list[tuple[str, nn.Linear, Tensor, Tensor]]) -> Optional[nn.Linear]:
        """The last ``nn.Linear`` called that takes the layer's C channels and returns one of the model's
        output tensors (its class scores); None, with a warning, when there is none. Warns when its
        input is not the layer's activations averaged (or max-pooled) over positions."""
        channels = activations.shape[1]
        outputs: list[Tensor] = []
        map_tensors(output, outputs.append)
        heads = [(name, module, given) for name, module, given, result in calls
                 if module.in_features == channels
                 and any(result is tensor or (result.shape == tensor.shape and torch.equal(result, tensor))
                         for tensor in outputs)]
        if not heads:
            taking = sorted({name for name, module, _, _ in calls if module.in_features == channels})
            seen = (f" ({', '.join(taking)} take {channels} features but return no output of the model: hidden "
                    "layers or projections, not the classifier)" if taking else "")
            warn_at_callers_line(
                f"DeepFeatureFactorization found no classifier for layer {self.layer_name!r}: no nn.Linear taking its "
                f"{channels} channels returns the model's output{seen}, so concept_scores is None. Pass "
                "classifier=MODULE (a callable (k, C) → (k, classes)), or classifier=None to silence this.")
            return None
        name, head, given = heads[-1]
        pooled = [activations.mean(dim=(2, 3)), activations.amax(dim=(2, 3))]
        precision = max(1e-3, 8 * torch.finfo(given.dtype).eps) if given.is_floating_point() else 1e-3  # autocast
        given = given.detach().double()
        if not any(given.shape == pool.shape and torch.allclose(given, pool, rtol=precision, atol=precision * float(
                pool.abs().max().clamp_min(1e-12))) for pool in pooled):
            warn_at_callers_line(
                f"DeepFeatureFactorization scores the concepts of layer {self.layer_name!r} with {name!r} (the "
                f"nn.Linear returning the model's output), but its input is not the layer's average or maximum over "
                f"positions: the scores skip what the model does in between (more layers, a norm, a class token). "
                f"Pass classifier=... (e.g. nn.Sequential(model.norm, model.head)) to score them through that, or "
                f"classifier={name!r}'s module itself / None to silence this.")
        return head

    def factorize(self, inputs: Inputs) -> Factorization:
        """Factorise the layer's activations over ``inputs`` (anything ``explain`` takes: paths, PIL
        images, arrays, tensors, a list of these) into the concepts."""
        with CallScope(self.model, eval_mode=True), torch.no_grad():
            prepared = prepare_inputs(inputs, self.preprocess, model_device(self.model), model_dtype(self.model),
                                      channels=model_input_channels(self.model))
            with capture(self.model, self.module) as captured:
                model_output, linear_calls = self._run_recording_heads(prepared.batch)
            output = captured[self.layer_name].output
            if not isinstance(output, Tensor):
                raise LayerOutputError(f"layer {self.layer_name!r} returned a {type(output).__name__}, not a tensor; "
                                       "deep feature factorisation needs a layer whose output is a tensor.")
            layout = infer_layout(output, prepared.batch.shape[-2:], self.reshape, self.layer_name, self.module,
                                  model=self.model)
            activations = layout.apply(output).double()  # (N, C, h, w)
            if not bool(torch.isfinite(activations).all()):
                raise ValueError(f"layer {self.layer_name!r} has NaN or inf activations on these inputs: the model "
                                 "overflowed; check the input's range and the model's dtype.")
            if activations.min() < 0:
                raise ValueError(
                    f"layer {self.layer_name!r} has negative activations (min {float(activations.min()):.3g}); "
                    "non-negative matrix factorisation needs a non-negative layer, such as one after a ReLU (not "
                    "the BatchNorm or convolution before it, nor a GELU, which dips below 0). `explain layers MODEL` "
                    "lists the layers."
                )
            if not bool(activations.any()):
                raise ValueError(f"layer {self.layer_name!r} is 0 everywhere on these inputs (dead ReLUs?): there is "
                                 "nothing to factorise. Choose another layer or other images.")
            count, channels, height, width = activations.shape
            if self.concepts > min(channels, count * height * width):
                raise ValueError(
                    f"DeepFeatureFactorization into concepts={self.concepts} of layer {self.layer_name!r}, which has "
                    f"{channels} channels at {count * height * width} positions: the activations span at most "
                    f"{min(channels, count * height * width)} dimensions, so more concepts reconstruct them exactly "
                    "while splitting them arbitrarily (the maps and class scores would mean nothing). Pass concepts ≤ "
                    f"{min(channels, count * height * width)}"
                    + (", or more images." if count * height * width < channels else "."))
            matrix = activations.transpose(0, 1).reshape(channels, -1)  # (C, N·h·w)
            profiles, presence, error = nmf(matrix, self.concepts, iterations=self.iterations,
                                            tolerance=self.tolerance, seed=self.seed)
            peaks = presence.amax(dim=1)
            if not bool((peaks > 0).all()):
                empty = (peaks <= 0).sum()
                warn_at_callers_line(
                    f"DeepFeatureFactorization of layer {self.layer_name!r}: {int(empty)} of the {self.concepts} "
                    "concepts are absent from every image (all-zero maps, and class scores that are only the "
                    "classifier's bias). Pass fewer concepts.", RuntimeWarning)
            peaks = peaks.clamp_min(1e-12)  # scale each concept to peak at 1
            profiles, presence = profiles * peaks, presence / peaks[:, None]
            order = presence.sum(dim=1).argsort(descending=True)
            profiles, presence = profiles[:, order], presence[order]
            low_res = presence.reshape(-1, count, height, width).transpose(0, 1).float()  # (N, k, h, w)
            classifier = (self._auto_classifier(activations, model_output, linear_calls)
                          if isinstance(self.classifier, str) else self.classifier)
            scores = None if classifier is None else classifier(profiles.T.to(model_dtype(self.model)))
            if scores is not None and (not isinstance(scores, Tensor) or scores.dim() != 2
                                       or scores.shape[0] != self.concepts):
                given = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
                raise ValueError(f"the classifier must map the ({self.concepts}, {channels}) concept profiles to "
                                 f"({self.concepts}, classes) scores; it returned {given}.")
            scores = None if scores is None else scores.float()
        maps = upsample_maps(layout.to_input(low_res, prepared.batch.shape[-2:]), prepared.batch.shape[-2:]).clamp(0, 1)
        return Factorization(concepts=profiles.T.float(), low_res_maps=low_res, maps=maps, relative_error=error,
                             images=prepared.images, layer=self.layer_name, concept_scores=scores,
                             class_names=self.class_names)

    def __repr__(self) -> str:
        return f"DeepFeatureFactorization(layer={self.layer_name!r}, concepts={self.concepts})"

