"""Expected gradients / GradientSHAP (Erion et al. 2021; Lundberg & Lee 2017): Integrated Gradients
with the baseline drawn from a distribution and the integral estimated by sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.checks import check_finite
from ..core.targets import SelectedTargets, Target, select_targets
from ..io.loaded_model import ModelSource
from .gradients import (
    GradientExplainer,
    GradientOptions,
    UnsplitOutput,
    all_zero,
    every_row,
    fold_leading_rows,
    sum_per_image,
)
from .maps import Attribution, Flags
from .options import bool_option, check_finite_reference, int_option, number_option, random_generator, seed_option
from .passes import checked_batch_size
from .registry import register


def check_references(baselines: Optional[Tensor]) -> None:
    """Refuse reference inputs that are not a finite (B, C, H, W) tensor with B ≥ 1 (None: the zero input)."""
    if baselines is not None and (not isinstance(baselines, Tensor) or baselines.dim() != 4 or len(baselines) < 1):
        shape = tuple(baselines.shape) if isinstance(baselines, Tensor) else type(baselines).__name__
        hint = (" For one reference image give baselines[None] (a batch of one)."
                if isinstance(baselines, Tensor) and baselines.dim() == 3 else "")
        raise ValueError(f"baselines must be a (B, C, H, W) tensor of reference inputs, B ≥ 1, or None; got "
                         f"{shape}.{hint}")
    if baselines is not None and baselines.is_meta:
        raise ValueError("the baselines are on the meta device (a shape without values): give reference inputs with "
                         "values, e.g. a batch of (preprocessed) training images.")
    if baselines is not None:
        check_finite_reference(baselines, "baselines")


def references_for(baselines: Optional[Tensor], batch: Tensor) -> Tensor:
    """(B, C, H, W) references on the batch's device and dtype (the zero input for None)."""
    if baselines is None:
        return torch.zeros_like(batch[:1])
    if baselines.shape[1:] != batch.shape[1:]:
        raise ValueError(f"the baselines are {tuple(baselines.shape[1:])} per image but the inputs are "
                         f"{tuple(batch.shape[1:])}; give baselines of the model input's shape.")
    references = baselines.to(batch.device, batch.dtype)
    if references.dtype != baselines.dtype:  # finite as given (checked when the explainer was made); the cast too?
        name = f"baselines (cast to the model's {batch.dtype})"
        check_finite(references, lambda values: check_finite_reference(values, name))  # at the call's end
    return references


@dataclass
class PathSamples:
    """The random draws of one call, for S samples per image (rows ordered image by image).

    baseline_index: (N·S,) which reference each sample uses; alphas: (N·S,) positions on the
    path in [0, 1]; noise: (N·S, C, H, W) Gaussian noise added to the image, None for none.
    """

    baseline_index: Tensor
    alphas: Tensor
    noise: Optional[Tensor]


class DrawnReferences:
    """The references drawn in a call, for their scores y(b) (GradientSHAP's completeness check): a reference's
    output is the same for every image unless the call has per-image forward arguments (``shared`` False), so the
    model runs once per distinct reference drawn (16 samples from 4 references: 4 rows, whatever the batch),
    else once per distinct (image, reference) pair.

    references: (B, C, H, W); image_of_row, reference_of_row: (R,) the image and reference of each drawn row."""

    def __init__(self, references: Tensor, image_of_row: Tensor, reference_of_row: Tensor, shared: bool):
        self.references, self.image_of_row, self.shared = references, image_of_row, shared
        key_of_row = reference_of_row if shared else image_of_row * len(references) + reference_of_row
        self.keys, self.row_to_key = torch.unique(key_of_row, return_inverse=True)

    def inputs(self) -> Tensor:
        """(len(keys), C, H, W): the reference of each key."""
        return self.references[self.keys if self.shared else self.keys % len(self.references)]

    def images_of_inputs(self, count: int) -> Tensor:
        """The image each model row is for: ``count`` images first (0 … count − 1), then each key's (any image for
        shared references: their forward arguments are the same for every image)."""
        key_images = torch.zeros_like(self.keys) if self.shared else self.keys // len(self.references)
        return torch.cat([torch.arange(count, device=self.keys.device), key_images]) if count else key_images

    def key_scores(self, output: object, selected: SelectedTargets, chunk: slice) -> Tensor:
        """The output of keys ``chunk`` as it is, for ``row_scores`` (class scores are read per row's image there);
        a callable target's (len, K) scores at once, per-image keys' scores for their image."""
        if selected.target_function is not None:
            return selected.scores_for(output, self.keys[chunk]).double()
        if not self.shared:
            return selected.scores_for(output, self.keys[chunk] // len(self.references)).double()
        assert isinstance(output, Tensor), "class targets read (rows, classes) scores"
        return output.double()

    def row_scores(self, key_output: Tensor, selected: SelectedTargets) -> Tensor:
        """(R, K) float64 y(b) of each drawn row, from ``key_scores`` of every key."""
        if selected.target_function is None and self.shared:  # each row reads its image's classes
            return selected.scores_for(key_output[self.row_to_key], self.image_of_row)
        return key_output[self.row_to_key]

    def scores(self, output: object, selected: SelectedTargets) -> Tensor:
        """(R, K) float64 y(b) of each drawn row, from the model's (detached) output on ``inputs()``."""
        return self.row_scores(self.key_scores(output, selected, slice(None)), selected)


@register
class GradientShap(GradientExplainer):
    """Expected gradients / GradientSHAP: the mean over samples s of
    (x + ε_s − b_s) ⊙ ∂y/∂x at b_s + α_s (x + ε_s − b_s), with b_s drawn uniformly from the
    references, α_s ~ U(0, 1) and ε_s ~ N(0, noise_std²). Its expectation is the mean of
    Integrated Gradients over the references (for noise_std = 0).

    baselines: (B, C, H, W) reference inputs, e.g. a batch of (preprocessed) training images,
        as expected gradients proper takes them; None (default): the zero input alone, which
        makes this a sampled Integrated Gradients from zero.
    samples: draws per image (Captum's n_samples); noise_std: the noise's standard deviation
        in model-input units (Captum's stdevs).
    seed: an int: same seed and device, same draws (default 0); None: fresh draws each call, seeded
        from torch's global random state (``torch.manual_seed`` before the call repeats them). Every image
        of a call gets the same draws: an image's map does not depend on the rest of the batch.
    multiply_by_inputs: False gives the mean gradient itself.
    batch_size: samples per forward/backward pass; None (default): 16 on the CPU, 256 on a GPU (halved
        where memory runs out; ``ROWS_PER_PASS``).
    check_completeness: True (default) reports ``diagnostics["completeness_error"]`` (N, K):
        Σ attributions − mean over the drawn references of (y(x) − y(b)), which shrinks as
        ``samples`` grows, and ``"score_change"``. It costs one no-grad forward per distinct
        reference drawn (per distinct image and reference with ``forward_args``): at 16 samples
        from 4 references on one image, 4 forwards against 16 forward/backward passes. False
        skips them, as Captum does unless asked for its convergence delta.
    """

    name = "gradientshap"
    summary = "GradientSHAP / expected gradients: gradients at random points between the input and random references"
    records_the_forward = False  # only differentiates the output

    def __init__(self, model: ModelSource, baselines: Optional[Tensor] = None, *, samples: int = 25,
                 noise_std: float = 0.0, seed: Optional[int] = 0, multiply_by_inputs: bool = True,
                 batch_size: Optional[int] = None, check_completeness: bool = True, **options: Unpack[GradientOptions]):
        super().__init__(model, **options)
        check_references(baselines)
        self.baselines = baselines
        self.samples = int_option("samples", samples, 1)
        self.noise_std = number_option("noise_std", noise_std)
        self.seed = seed_option(seed)
        self.multiply_by_inputs = bool_option("multiply_by_inputs", multiply_by_inputs)
        self.batch_size = checked_batch_size(batch_size)
        self.check_completeness = bool_option("check_completeness", check_completeness)

    def draw(self, batch: Tensor) -> PathSamples:
        """The call's random draws, from a generator seeded with ``seed`` on the batch's device (drawing a
        GPU batch's noise on the CPU would cost more than its gradients): same seed and device, same draws
        (``random_generator``: a fresh seed for None). Every image of the batch gets the same ``samples`` draws,
        so that an image's map does not depend on the other images of the batch, nor on its place among them."""
        count, device = batch.shape[0], batch.device
        generator = random_generator(self.seed, device)
        baseline_index = torch.randint(1 if self.baselines is None else len(self.baselines), (self.samples,),
                                       generator=generator, device=device)
        alphas = torch.rand(self.samples, generator=generator, dtype=torch.float64, device=device)
        if self.noise_std == 0:
            return PathSamples(baseline_index.repeat(count), alphas.repeat(count), None)
        noise = torch.randn((self.samples, *batch.shape[1:]), generator=generator, device=device) * self.noise_std
        return PathSamples(baseline_index.repeat(count), alphas.repeat(count),
                           noise.to(batch.dtype).repeat(count, *(1,) * (batch.dim() - 1)))

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        return self.attribute_with(batch, (target, topk), self.draw(batch))

    def attribute_with(self, batch: Tensor, targets: SelectedTargets | tuple[Target, Optional[int]],
                       samples: PathSamples) -> Attribution:
        """The attributions for given draws (``draw`` makes them; a test may give a peer's). targets: selected
        already, or (target, topk) to select them on the images' forward, which is then made with the first pass
        of the path (``fold_leading_rows``), together with the references' forward of the completeness check."""
        count = batch.shape[0]
        baselines = references_for(self.baselines, batch)
        per_image = len(samples.alphas) // count
        image_of_row = torch.arange(count * per_image, device=batch.device) // per_image
        ends: dict[str, Any] = {}  # "selected": the targets; "reference_scores": (R, K) y(b) of each drawn row
        if isinstance(targets, SelectedTargets):
            ends["selected"] = targets
        target, topk = (None, None) if isinstance(targets, SelectedTargets) else targets
        references = DrawnReferences(baselines, image_of_row, samples.baseline_index, self._forward_call is None) \
            if self.check_completeness else None

        def select(outputs: list[object]) -> SelectedTargets:
            """The targets, from the outputs of the leading rows: the images', then the references', if any."""
            ends["selected"] = select_targets(outputs[0], target, topk, batch_size=count)
            if references is not None:
                ends["reference_scores"] = references.scores(outputs[1], ends["selected"])
            return ends["selected"]

        def path_terms(rows: slice) -> tuple[Tensor, Flags]:  # the rows' terms of the expectation, float64
            every = rows.start == 0 and rows.stop == len(image_of_row)  # one pass: no slicing
            images = image_of_row if every else image_of_row[rows]
            references_of_rows = baselines[samples.baseline_index if every else samples.baseline_index[rows]]
            noisy = batch if count == 1 else batch[images]  # the one image broadcasts
            if samples.noise is not None:
                noisy = noisy + (samples.noise if every else samples.noise[rows])
            alphas = (samples.alphas if every else samples.alphas[rows]).to(batch.dtype).view(-1, 1, 1, 1)
            difference = noisy - references_of_rows
            points = references_of_rows + alphas * difference
            gradients: Optional[Tensor] = None
            if "selected" not in ends:
                leading = count + (0 if references is None else len(references.keys))
                if fold_leading_rows(self, leading, self.batch_size, batch.device, target, batch.shape[1:].numel()):
                    try:  # the images (and the references scored) as the first rows of this pass
                        gradients, unreachable = self.folded_gradients(
                            [batch] if references is None else [batch, references.inputs()],
                            None if references is None or self._forward_call is None
                            else references.images_of_inputs(count), points, images, select)
                    except UnsplitOutput:
                        pass  # an output that is not one row per input: its own forwards below
            if gradients is None:
                if "selected" not in ends:
                    with torch.no_grad():
                        ends["selected"] = select_targets(self.call_model(batch), target, topk, batch_size=count)
                gradients, unreachable = self.copies_gradients(points, ends["selected"], images)
            if self.multiply_by_inputs:
                gradients = difference[:, None] * gradients
            return gradients, unreachable

        total: Optional[Tensor] = None  # (N, K, C, H, W) float64
        unreachable_rows: list[tuple[Tensor, Flags]] = []
        for rows, (terms, unreachable) in self.row_passes(len(image_of_row), self.batch_size, batch.device,
                                                          path_terms, batch.shape[1:].numel()):
            images = image_of_row if rows.stop - rows.start == len(image_of_row) else image_of_row[rows]
            total = sum_per_image(total, terms, images, count)
            unreachable_rows.append((images, unreachable))
        assert total is not None, "samples ≥ 1: at least one pass ran"
        selected: SelectedTargets = ends["selected"]
        attributions = (total / per_image).to(batch.dtype)
        self._disconnected = every_row(unreachable_rows, count)

        def empty_path() -> Tensor:  # (N,) bool: every draw's reference equals its (noisy) input
            noisy = batch[image_of_row] if samples.noise is None else batch[image_of_row] + samples.noise
            same = (noisy - baselines[samples.baseline_index]).flatten(1).eq(0).all(dim=1)
            return every_row([(image_of_row, same[:, None])], count)()[:, 0]

        if references is None:
            return self.attribution_from(attributions, selected, zero_gradient=all_zero(total),
                                         baseline_is_input=empty_path)
        if "reference_scores" not in ends:
            ends["reference_scores"] = self.reference_scores(references, selected)
        baseline_scores = sum_per_image(None, ends["reference_scores"], image_of_row, count)
        score_change = selected.scores.double() - baseline_scores / per_image
        completeness_error = total.sum(dim=(2, 3, 4)) / per_image - score_change
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(total),
                                     baseline_is_input=empty_path, completeness_error=completeness_error.float(),
                                     score_change=score_change.float())

    def reference_scores(self, references: DrawnReferences, selected: SelectedTargets) -> Tensor:
        """(R, K) float64 y(b) of each drawn row's reference, from no-grad forwards of the distinct references (or
        distinct (image, reference) pairs, ``DrawnReferences``), ``rows_per_pass`` at a time: where the references
        were not rows of the first pass."""
        parts: list[Tensor] = []
        keys = len(references.keys)

        def chunk_scores(chunk: slice) -> Tensor:
            with torch.no_grad():
                images = None if references.shared else references.images_of_inputs(0)[chunk]
                return references.key_scores(self.call_model(references.inputs()[chunk], rows=images), selected,
                                             chunk)

        for _, scores in self.row_passes(keys, self.batch_size, references.keys.device, chunk_scores,
                                         references.references.shape[1:].numel()):
            parts.append(scores)
        return references.row_scores(torch.cat(parts) if len(parts) > 1 else parts[0], selected)
