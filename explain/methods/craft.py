"""CRAFT (Fel et al., "CRAFT: Concept Recursive Activation FacTorization for Explainability", CVPR 2023): which
concepts a class is made of, how much each matters, and where each one is in an image.

1. Concept discovery (``fit``). Each image of a class is cut into a grid of patches (``patch_size`` pixels, stride
   ``patch_stride``: 80 % of the patch, as the authors' code), each patch is resized to the image's size and run
   through the model up to ``layer``; its activations, averaged over the positions of a feature map, are the rows of
   A (patches × C), non-negative (a layer after a ReLU). Non-negative matrix factorisation A ≈ U W gives the concept
   bank W (r × C, each row a concept's channel profile, scaled to length 1) and each patch's coefficients U
   (patches × r).
2. Importance (``importance``). An image's coefficients u are its activation at each position of the layer's
   feature map, written in the concept bank: the non-negative least-squares solution of a ≈ u W with W fixed (the
   NMF transform). Quasi-Monte-Carlo masks m ∈ [0, 1)^r scale them; the activations (m ⊙ u) W replace the layer's
   output and the model runs on, giving the class logit f(m). The total Sobol index of concept j is the share of
   the logit's variance over the masks that involves m_j, estimated with Jansen's estimator on a Saltelli design
   (``sobol_masks``, ``jansen_total_indices``), and averaged over the images.
3. Concept maps (``concept_maps``): each concept's coefficient at each position of an image's feature map,
   upsampled bilinearly to the image (the maps the authors' ``transform`` gives and their figures draw).

    craft = explain.CRAFT(model, "layer4", concepts=10).fit(dog_images)
    importance = craft.importance(dog_images, target=208)       # (10,) total Sobol indices
    craft.ranking                                                # concepts by importance, largest first
    craft.top_patches(int(craft.ranking[0]))                     # the patches that show the top concept
    maps = craft.concept_maps(dog_images[:4])                    # (4, 10, H, W) ≥ 0

The rest of the model runs from the layer by a forward hook that replaces the layer's output with the reconstructed
activations, on copies of the image (one per mask): the part before the layer runs again for each copy, which is
always right whatever the rest of the model reads (a residual connection around the layer included), at the cost of
``designs · (r + 2)`` full forward passes per image, ``batch_size`` per pass.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.capture import (
    LayerOutputError,
    LayerSpec,
    check_hookable,
    eager_model,
    find_layers,
    model_device,
    model_dtype,
    model_input_channels,
    run_model,
)
from ..core.scope import CallScope
from ..core.targets import OutputSelector, select_output
from ..io.inputs import Preprocess, PreprocessSpec, as_preprocess, prepare_inputs
from ..io.loaded_model import ModelSource, loaded_model_parts
from .factorization import nmf
from .maps import upsample_maps
from .options import is_whole_number
from .tcav import ImageSet, folder_images


def _whole_number(name: str, value: object, least: int) -> int:
    """``value`` as an int (a Python or numpy integer, or a 0-d integer tensor), refused where it is not one (a bool,
    a float) or below ``least``."""
    if not is_whole_number(value) or int(value) < least:  # type: ignore[call-overload]
        raise ValueError(f"{name} must be a whole number ≥ {least}; got {value!r}.")
    return int(value)  # type: ignore[call-overload]


# ------------------------------------------------------------------ the Sobol design and estimator


def sobol_masks(dimensions: int, designs: int, seed: int = 0) -> Tensor:
    """Saltelli's design for total Sobol indices of ``dimensions`` variables uniform on [0, 1): matrices A and B
    (designs × dimensions each, the two halves of a scrambled Sobol sequence of 2 · dimensions, seeded by ``seed``)
    and, for each variable i, A with column i taken from B. Returns (designs · (dimensions + 2), dimensions) in
    float64: the rows of A, then of B, then of each A_B^(i) in turn (the order ``jansen_total_indices`` reads)."""
    _whole_number("dimensions", dimensions, 1)
    _whole_number("designs", designs, 2)
    points = torch.quasirandom.SobolEngine(2 * dimensions, scramble=True, seed=seed).draw(designs, dtype=torch.float64)
    first, second = points[:, :dimensions], points[:, dimensions:]
    mixed = first.repeat(dimensions, 1).view(dimensions, designs, dimensions).clone()
    for index in range(dimensions):
        mixed[index, :, index] = second[:, index]
    return torch.cat([first, second, mixed.reshape(-1, dimensions)])


def jansen_total_indices(outputs: Tensor, designs: int, dimensions: int) -> Tensor:
    """Jansen's estimator (1999) of the total Sobol indices from a model's outputs on ``sobol_masks``'s rows:
    S_T,i = mean over the designs of (f(A) − f(A_B^(i)))² / (2 Var f), Var f the variance (1/n) of the outputs on A
    and B together. outputs: (designs · (dimensions + 2),) or (..., designs · (dimensions + 2)) for several models
    at once. Returns (dimensions,) (or (..., dimensions)) in float64, ≥ 0; 0 where the outputs do not vary. For one
    variable its total index is 1 exactly where the outputs vary (all of the variance involves it): the estimator's
    sampling noise (e.g. 0.79 for 1) is not returned."""
    outputs = outputs.double()
    if outputs.shape[-1] != designs * (dimensions + 2):
        raise ValueError(f"outputs must hold designs · (dimensions + 2) = {designs * (dimensions + 2)} values per "
                         f"model (A, B, then each A_B^(i)); got {outputs.shape[-1]}.")
    on_a, on_b = outputs[..., :designs], outputs[..., designs:2 * designs]
    on_mixed = outputs[..., 2 * designs:].reshape(*outputs.shape[:-1], dimensions, designs)
    variance = torch.cat([on_a, on_b], dim=-1).var(dim=-1, unbiased=False)
    spread = ((on_a[..., None, :] - on_mixed) ** 2).mean(dim=-1) / 2  # (..., dimensions)
    if dimensions == 1:
        spread = variance[..., None].expand_as(spread)
    return torch.where(variance[..., None] > 0, spread / variance[..., None].clamp_min(1e-300),
                       torch.zeros_like(spread))


# ------------------------------------------------------------------ NMF with a fixed concept bank


def nmf_transform(activations: Tensor, concept_bank: Tensor, *, iterations: int = 2000,
                  tolerance: float = 1e-12) -> Tensor:
    """The coefficients U ≥ 0 of ``activations`` (M, C) in a fixed ``concept_bank`` W (r, C): the non-negative
    least-squares solution of min ‖A − U W‖_F, each row on its own (the NMF transform), by the same hierarchical
    alternating least-squares updates as ``nmf``'s, from the clamped least-squares solution. Stops when an
    iteration changes U by less than ``tolerance`` times its largest value. Returns (M, r) in float64."""
    values, bank = activations.double(), concept_bank.double().to(activations.device)
    gram, products = bank @ bank.T, values @ bank.T  # (r, r), (M, r)
    coefficients = (values @ torch.linalg.pinv(bank)).clamp_min(0)
    for _ in range(iterations):
        previous = coefficients.clone()
        for j in range(bank.shape[0]):
            update = (products[:, j] - coefficients @ gram[:, j]) / gram[j, j].clamp_min(1e-12)
            coefficients[:, j] = (coefficients[:, j] + update).clamp_min(0)
        change = float((coefficients - previous).abs().max())
        if change <= tolerance * max(float(coefficients.abs().max()), 1e-300):
            break
    return coefficients


# ------------------------------------------------------------------ CRAFT


class CRAFT:
    """CRAFT's concepts of one class at ``layer`` of ``model`` (see the module docstring).

    model: a module or ``explain.load_model``'s result (its preprocessing is used); run in eval mode during each
        call and left as found. layer: the layer whose output is factorised; its output must be a non-negative
        (N, C, h, w) feature map or (N, C) vector (after a ReLU), read by nothing else in the model.
    concepts: r, the size of the concept bank. patch_size: the side of the square patches in input pixels
        (default: 30 % of the image's shorter side, the authors' 64 pixels of 224); patch_stride: the grid's step
        (default: 80 % of the patch). batch_size: images (patches, masked copies) per forward pass.
    iterations, tolerance, seed: of the factorisation (``explain.methods.factorization.nmf``); seed also draws the
        Sobol design. preprocess: as for the explainers. output: which part of the model's output holds the logits
        (automatic: a tensor, HuggingFace's ``.logits``, a dict's "logits"; a key, index or callable picks).
    Images (``fit``, ``importance``...) are a folder of image files or anything ``explain()`` takes. Each call runs in
    the model's own precision (an enclosing autocast is turned off: bfloat16 activations change the factorisation).

    After ``fit``: ``concept_bank`` (r, C) ≥ 0 with rows of length 1; ``patch_coefficients`` (P, r) ≥ 0;
    ``patches`` (P, p, p, 3) uint8 crops of the display images; ``patch_activations`` (P, C);
    ``relative_error`` ‖A − U W‖_F / ‖A‖_F. After ``importance``: ``concept_importance`` (r,) and ``ranking`` (r,)
    the concepts by importance, largest first.
    """

    def __init__(self, model: ModelSource, layer: LayerSpec, *, concepts: int = 10, patch_size: Optional[int] = None,
                 patch_stride: Optional[int] = None, batch_size: int = 64, iterations: int = 1000,
                 tolerance: float = 1e-7, seed: int = 0, preprocess: PreprocessSpec = None,
                 output: OutputSelector = None):
        module, loaded_preprocess, _, loaded_output = loaded_model_parts(model, output=output)
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(module).__name__}.")
        check_hookable(module)
        self.model: nn.Module = eager_model(module, type(self).__name__)
        found = find_layers(self.model, layer)
        if len(found) != 1:
            raise ValueError(f"CRAFT factorises one layer; {layer!r} selects {len(found)}.")
        self.layer_name, self.layer = found[0]
        self.concepts = _whole_number("concepts", concepts, 1)
        self.patch_size = None if patch_size is None else _whole_number("patch_size", patch_size, 1)
        self.patch_stride = None if patch_stride is None else _whole_number("patch_stride", patch_stride, 1)
        self.batch_size = _whole_number("batch_size", batch_size, 1)
        self.iterations = _whole_number("iterations", iterations, 1)
        self.seed = _whole_number("seed", seed, 0)
        if not isinstance(tolerance, numbers.Real) or isinstance(tolerance, bool) or not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be a number in [0, 1); got {tolerance!r}.")
        self.tolerance: float = float(tolerance)
        self.preprocess: Preprocess = as_preprocess(preprocess if preprocess is not None else loaded_preprocess)
        self.output: OutputSelector = loaded_output
        self.concept_bank: Optional[Tensor] = None
        self.patch_coefficients: Optional[Tensor] = None
        self.patch_activations: Optional[Tensor] = None
        self.patches: Optional[np.ndarray] = None
        self.relative_error: Optional[float] = None
        self.concept_importance: Optional[Tensor] = None
        self.ranking: Optional[Tensor] = None

    # ------------------------------------------------------------------ the layer's activations

    def _prepared(self, images: ImageSet) -> tuple[Tensor, Tensor]:
        """The model batch (N, C, H, W) and display images (N, H, W, 3) in [0, 1] of ``images`` (a folder: its image
        files, sorted)."""
        if isinstance(images, (str, Path)) and Path(images).is_dir():
            images = folder_images(images)
        prepared = prepare_inputs(images, self.preprocess, model_device(self.model), model_dtype(self.model),
                                  channels=model_input_channels(self.model))
        return prepared.batch, prepared.images

    def _checked_output(self, output: object) -> Tensor:
        if not isinstance(output, Tensor) or output.dim() not in (2, 4):
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            tokens = isinstance(output, Tensor) and output.dim() == 3
            raise LayerOutputError(f"layer {self.layer_name!r} gives {shape}; CRAFT needs a layer whose output is a "
                                   "(N, C, h, w) feature map or an (N, C) vector (a CNN's stage after a ReLU, or its "
                                   "pooled features)" + (
                                       ". Tokens (N, tokens, D) of a transformer are not one: they take negative "
                                       "values (after a LayerNorm or GELU), which the non-negative factorisation "
                                       "cannot take; use CRAFT on a CNN, or TCAV to test a named concept at a "
                                       "token layer." if tokens else "."))
        return output

    def _activations(self, batch: Tensor) -> Tensor:
        """The layer's output for ``batch`` ((N, C, h, w) or (N, C), float64), checked non-negative."""
        recorded: list[Tensor] = []
        with CallScope(self.model, eval_mode=True) as scope, torch.no_grad():
            self._full_precision(scope)
            scope.forward_hook(self.layer, lambda module, args, output: recorded.append(
                self._checked_output(output).detach().double()))
            for start in range(0, batch.shape[0], self.batch_size):
                count = len(recorded)
                run_model(self.model, batch[start:start + self.batch_size])
                if len(recorded) == count:
                    raise LayerOutputError(
                        f"layer {self.layer_name!r} did not run in the model's forward pass (a module the forward "
                        "never calls, such as an auxiliary head that runs in training only: CRAFT runs the model in "
                        "eval mode): give a layer the prediction is computed through (`explain layers`).")
                if len(recorded) != count + 1:
                    raise LayerOutputError(
                        f"layer {self.layer_name!r} ran {len(recorded) - count} times in one forward pass; CRAFT "
                        "needs a layer that runs once (give the layer the prediction reads, not a shared module).")
        activations = torch.cat(recorded)
        smallest = float(activations.min())
        if smallest < 0:
            raise ValueError(f"layer {self.layer_name!r} has negative activations (min {smallest:.3g}); CRAFT's "
                             "non-negative factorisation needs a non-negative layer, such as one after a ReLU "
                             "(`explain layers MODEL` lists the layers); it is refused rather than clamped. A model "
                             "with no ReLU layer (SiLU, GELU or hard-swish activations: EfficientNet, ConvNeXt, "
                             "MobileNetV3) cannot be factorised by CRAFT.")
        return activations

    def _full_precision(self, scope: CallScope) -> None:
        """Autocast off for the scope: activations, factorisation and logits in the model's own precision."""
        scope.enter(torch.autocast(model_device(self.model).type, enabled=False))

    def _fitted_bank(self) -> Tensor:
        if self.concept_bank is None:
            raise RuntimeError("CRAFT has no concept bank yet: call fit(class_images) first.")
        return self.concept_bank

    # ------------------------------------------------------------------ 1. concept discovery

    def _grid(self, height: int, width: int) -> tuple[int, list[tuple[int, int]]]:
        size = self.patch_size if self.patch_size is not None else max(1, round(0.3 * min(height, width)))
        if size > min(height, width):
            raise ValueError(f"patch_size {size} is larger than the images ({height}×{width}); give a smaller one.")
        stride = self.patch_stride if self.patch_stride is not None else max(1, int(0.8 * size))
        corners = [(top, left) for top in range(0, height - size + 1, stride)
                   for left in range(0, width - size + 1, stride)]
        return size, corners

    def fit(self, class_images: ImageSet) -> "CRAFT":
        """Discover the concepts of ``class_images`` (a folder, or anything ``explain()`` takes; one size after
        preprocessing):
        patches of a grid, resized to the image's size, their layer activations averaged over positions, factorised
        into ``concepts`` concepts. Returns self (see the class docstring for what it then holds)."""
        batch, display = self._prepared(class_images)
        height, width = batch.shape[-2:]
        size, corners = self._grid(height, width)
        if display.shape[1:3] != (height, width):  # display images at the model input's size, for the crops
            display = F.interpolate(display.permute(0, 3, 1, 2), size=(height, width), mode="bilinear",
                                    align_corners=False).permute(0, 2, 3, 1)
        rows = [(image, top, left) for image in range(batch.shape[0]) for top, left in corners]
        if len(rows) < self.concepts:
            raise ValueError(f"the images give {len(rows)} patches, fewer than the {self.concepts} concepts asked: "
                             "give more images, a smaller patch_size or patch_stride, or fewer concepts.")
        activations: list[Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            crops = torch.stack([batch[image, :, top:top + size, left:left + size]
                                 for image, top, left in rows[start:start + self.batch_size]])
            resized = F.interpolate(crops.float(), size=(height, width), mode="bilinear", align_corners=False)
            layer_output = self._activations(resized.to(batch.dtype))
            activations.append(layer_output.mean(dim=(2, 3)) if layer_output.dim() == 4 else layer_output)
        matrix = torch.cat(activations)  # (P, C)
        if self.concepts > matrix.shape[1]:
            raise ValueError(f"concepts={self.concepts} is more than layer {self.layer_name!r}'s {matrix.shape[1]} "
                             "channels: a bank of more concepts than channels is not unique (an activation has many "
                             "sets of coefficients, so its maps and importances would be arbitrary); give concepts ≤ "
                             f"{matrix.shape[1]}.")
        if not bool((matrix > 0).any()):
            raise ValueError(f"layer {self.layer_name!r} is zero on every patch: there is nothing to factorise; "
                             "give a layer that responds to these images.")
        rank = int(torch.linalg.matrix_rank(matrix, rtol=1e-6))
        if rank < self.concepts:
            warn_at_callers_line(
                f"the {matrix.shape[0]} patches' activations at layer {self.layer_name!r} span only {rank} "
                f"dimension{'s' if rank > 1 else ''}, fewer than the {self.concepts} concepts asked (patches that "
                "look alike, e.g. of constant images, or channels that are copies of each other): the bank is not "
                "unique, so how the concepts share those dimensions, and their maps and importances, are arbitrary. "
                f"Give more varied images, or concepts ≤ {rank}.")
        coefficients, bank, error = nmf(matrix, self.concepts, iterations=self.iterations, tolerance=self.tolerance,
                                        seed=self.seed)
        lengths = bank.norm(dim=1).clamp_min(1e-12)  # each concept's profile of length 1, U scaled to match
        self.concept_bank = (bank / lengths[:, None]).float()
        self.patch_coefficients = (coefficients * lengths).float()
        self.patch_activations = matrix.float()
        self.relative_error = error
        self.patches = np.stack([(display[image, top:top + size, left:left + size].clamp(0, 1) * 255).round()
                                 .byte().cpu().numpy() for image, top, left in rows])
        self.concept_importance = self.ranking = None
        return self

    def top_patches(self, concept: int, count: int = 6) -> np.ndarray:
        """(count, p, p, 3) uint8: the patches of ``fit`` with the largest coefficient of ``concept``, largest
        first (what the concept looks like)."""
        bank = self._fitted_bank()
        if not is_whole_number(concept) or not 0 <= int(concept) < bank.shape[0]:
            raise ValueError(f"concept must be in 0 … {bank.shape[0] - 1}; got {concept!r}.")
        if not is_whole_number(count) or int(count) < 1:
            raise ValueError(f"count must be a whole number ≥ 1 (patches to return); got {count!r}.")
        concept, count = int(concept), int(count)
        assert self.patch_coefficients is not None and self.patches is not None
        order = self.patch_coefficients[:, concept].argsort(descending=True)[:count]
        return self.patches[order.numpy()]

    # ------------------------------------------------------------------ 3. concept coefficients and maps

    def _coefficients_of(self, activations: Tensor) -> Tensor:
        """(N, r, h, w) or (N, r): the NMF transform of each position's activation."""
        bank = self._fitted_bank()
        if activations.shape[1] != bank.shape[1]:
            raise ValueError(f"layer {self.layer_name!r} gives {activations.shape[1]} channels but the concept bank "
                             f"has {bank.shape[1]}: fit and explain with the same model and layer.")
        if activations.dim() == 2:
            return nmf_transform(activations, bank)
        count, channels, height, width = activations.shape
        flat = activations.permute(0, 2, 3, 1).reshape(-1, channels)
        return nmf_transform(flat, bank).view(count, height, width, -1).permute(0, 3, 1, 2)

    def concept_coefficients(self, images: ImageSet) -> Tensor:
        """The concepts' coefficients in each image: (N, r, h, w) at the layer's positions ((N, r) for a vector
        layer), ≥ 0, float64; the activation at each position ≈ Σ_j coefficient_j · concept_bank[j]."""
        self._fitted_bank()
        batch, _ = self._prepared(images)
        return self._coefficients_of(self._activations(batch))

    def concept_maps(self, images: ImageSet) -> Tensor:
        """(N, r, H, W) ≥ 0 float32: each concept's coefficient map (``concept_coefficients``) upsampled bilinearly
        to the input's size; comparable across images and concepts (not normalised)."""
        self._fitted_bank()
        batch, _ = self._prepared(images)
        coefficients = self._coefficients_of(self._activations(batch))
        if coefficients.dim() != 4:
            raise ValueError(f"layer {self.layer_name!r} gives (N, C) vectors: there is no map to draw; give a layer "
                             "with a (N, C, h, w) feature map for concept maps.")
        return upsample_maps(coefficients, batch.shape[-2:]).clamp_min(0)

    # ------------------------------------------------------------------ 2. importance

    def importance(self, class_images: ImageSet, target: int, *, designs: int = 32) -> Tensor:
        """The total Sobol index of each concept for class ``target``'s logit, averaged over ``class_images``:
        (r,) float64, ≥ 0 (about 1 for a concept the logit depends on alone, 0 for one it ignores; the indices
        of interacting concepts add to more than 1). designs: rows of A and B of the Sobol design
        (``designs · (r + 2)`` forward passes per image). Also sets ``concept_importance`` and ``ranking``."""
        bank = self._fitted_bank()
        _whole_number("designs", designs, 2)
        if not is_whole_number(target):  # a 0-d integer tensor too, as argmax gives
            raise TypeError(f"target must be a class index (an int); got {type(target).__name__}.")
        target = int(target)
        batch, _ = self._prepared(class_images)
        coefficients = self._coefficients_of(self._activations(batch))  # (N, r, h, w) or (N, r)
        masks = sobol_masks(bank.shape[0], designs, self.seed).to(coefficients.device)
        count, per_image = batch.shape[0], masks.shape[0]
        rows = torch.cartesian_prod(torch.arange(count), torch.arange(per_image))  # (N · masks, 2)
        bank64 = bank.double().to(coefficients.device)
        scores: list[Tensor] = []
        with CallScope(self.model, eval_mode=True) as scope, torch.no_grad():
            self._full_precision(scope)
            replacement: list[Tensor] = []

            def replace(module: nn.Module, args: object, output: object) -> Tensor:
                output = self._checked_output(output)
                reconstructed = replacement.pop()
                if output.shape[1:] != reconstructed.shape[1:]:
                    raise LayerOutputError(
                        f"layer {self.layer_name!r} gives {tuple(output.shape[1:])} per image here but "
                        f"{tuple(reconstructed.shape[1:])} for these images before: it must run once per forward.")
                return reconstructed.to(device=output.device, dtype=output.dtype)

            scope.forward_hook(self.layer, replace)
            for start in range(0, rows.shape[0], self.batch_size):
                images, mask_rows = rows[start:start + self.batch_size].T
                masked = coefficients[images] * masks[mask_rows].view(len(images), -1, *[1] * (coefficients.dim() - 2))
                replacement.append(torch.einsum("nr...,rc->nc...", masked, bank64))
                output = run_model(self.model, batch[images.to(batch.device)])
                if replacement:
                    raise LayerOutputError(f"layer {self.layer_name!r} did not run in the forward pass.")
                logits = select_output(output, self.output)
                if not isinstance(logits, Tensor) or logits.dim() != 2:
                    raise ValueError("CRAFT's importance reads a class logit: the model must return (N, classes) "
                                     f"scores; got {type(logits).__name__}"
                                     f"{tuple(logits.shape) if isinstance(logits, Tensor) else ''} (pass output=, a "
                                     "key, index or callable, to say which part of the model's output they are).")
                if not 0 <= target < logits.shape[1]:
                    raise ValueError(f"target {target} is not a class of the model's {logits.shape[1]} outputs.")
                scores.append(logits[:, target].double().cpu())
        per_image_indices = jansen_total_indices(torch.cat(scores).view(count, per_image), designs, bank.shape[0])
        importance = per_image_indices.mean(dim=0)
        self.concept_importance = importance
        self.ranking = importance.argsort(descending=True)
        return importance

    def __repr__(self) -> str:
        fitted = "" if self.concept_bank is None else f", fitted on {len(self.concept_bank)} concepts"
        return f"CRAFT(layer={self.layer_name!r}, concepts={self.concepts}{fitted})"
