"""Expected gradients / GradientSHAP (Erion et al. 2021; Lundberg & Lee 2017): Integrated Gradients
with the baseline drawn from a distribution and the integral estimated by sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..targets import SelectedTargets, Target, select_targets
from .base import Attribution, checked_batch_size, register
from .gradients import GradientExplainer, GradientOptions, all_zero
from .options import bool_option, check_finite_reference, int_option, number_option, random_generator, seed_option


def check_references(baselines: Optional[Tensor]) -> None:
    """Refuse reference inputs that are not a finite (B, C, H, W) tensor with B ≥ 1 (None: the zero input)."""
    if baselines is not None and (not isinstance(baselines, Tensor) or baselines.dim() != 4 or len(baselines) < 1):
        shape = tuple(baselines.shape) if isinstance(baselines, Tensor) else type(baselines).__name__
        raise ValueError(f"baselines must be a (B, C, H, W) tensor of reference inputs, B ≥ 1, or None; got {shape}.")
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
    check_finite_reference(references, f"baselines (cast to the model's {batch.dtype})")
    return references


@dataclass
class PathSamples:
    """The random draws of one call, for S samples per image (rows ordered image by image).

    baseline_index: (N·S,) which reference each sample uses; alphas: (N·S,) positions on the
    path in [0, 1]; noise: (N·S, C, H, W) Gaussian noise added to the image.
    """

    baseline_index: Tensor
    alphas: Tensor
    noise: Tensor


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
        from torch's global random state (``torch.manual_seed`` before the call repeats them).
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

    def __init__(self, model: nn.Module, baselines: Optional[Tensor] = None, *, samples: int = 25,
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
        (``random_generator``: a fresh seed for None)."""
        rows = batch.shape[0] * self.samples
        device = batch.device
        generator = random_generator(self.seed, device)
        baseline_index = torch.randint(1 if self.baselines is None else len(self.baselines), (rows,),
                                       generator=generator, device=device)
        alphas = torch.rand(rows, generator=generator, dtype=torch.float64, device=device)
        if self.noise_std == 0:
            noise = torch.zeros((rows, *batch.shape[1:]), device=device, dtype=batch.dtype)
        else:
            noise = torch.randn((rows, *batch.shape[1:]), generator=generator, device=device) * self.noise_std
        return PathSamples(baseline_index, alphas, noise.to(batch.dtype))

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
        return self.attribute_with(batch, selected, self.draw(batch))

    def reference_scores(self, references: Tensor, image_of_row: Tensor, reference_of_row: Tensor,
                         selected: SelectedTargets) -> Tensor:
        """(N, K) float64 sums over each image's drawn rows of y(x'), the score of the row's reference.
        A reference's output is the same for every image unless the call has per-image forward
        arguments: then one no-grad forward per distinct (image, reference) pair, else one per
        distinct reference (16 samples from 4 references cost 4 forwards, whatever the batch)."""
        shared = self._forward_call is None
        key_of_row = reference_of_row if shared else image_of_row * len(references) + reference_of_row
        keys, row_to_key = torch.unique(key_of_row, return_inverse=True)
        row_scores = torch.empty(len(key_of_row), selected.scores.shape[1], dtype=torch.float64,
                                 device=image_of_row.device)

        def chunk_scores(chunk_keys: slice) -> tuple[Tensor, Tensor]:
            """((R,) bool: the rows whose key is in the chunk, (R, K) float64: their scores there)."""
            chunk = keys[chunk_keys]
            in_chunk = (row_to_key >= chunk_keys.start) & (row_to_key < chunk_keys.stop)
            scores = torch.zeros_like(row_scores)
            with torch.no_grad():
                if shared:  # one output per reference, scored for the target of each image drawing it
                    output = self.call_model(references[chunk])
                    for image in torch.unique(image_of_row[in_chunk]):
                        rows = in_chunk & (image_of_row == image)
                        image_scores = selected.scores_for(output, image.expand(len(chunk))).double()
                        scores[rows] = image_scores[row_to_key[rows] - chunk_keys.start]
                else:
                    images = chunk // len(references)
                    output = self.call_model(references[chunk % len(references)], rows=images)
                    pair_scores = selected.scores_for(output, images).double()
                    scores[in_chunk] = pair_scores[row_to_key[in_chunk] - chunk_keys.start]
            return in_chunk, scores

        for _, (in_chunk, scores) in self.row_passes(len(keys), self.batch_size, image_of_row.device, chunk_scores):
            row_scores[in_chunk] = scores[in_chunk]
        sums = torch.zeros(selected.scores.shape, dtype=torch.float64, device=row_scores.device)
        return sums.index_add_(0, image_of_row, row_scores)

    def attribute_with(self, batch: Tensor, selected: SelectedTargets, samples: PathSamples) -> Attribution:
        """The attributions for given draws (``draw`` makes them; a test may give a peer's)."""
        count, targets = batch.shape[0], selected.scores.shape[1]
        baselines = references_for(self.baselines, batch)
        per_image = len(samples.alphas) // count
        image_of_row = torch.arange(count, device=batch.device).repeat_interleave(per_image)
        total = torch.zeros(count, targets, *batch.shape[1:], dtype=torch.float64, device=batch.device)
        disconnected = torch.ones(count, targets, dtype=torch.bool, device=batch.device)
        empty_path = torch.ones(count, dtype=torch.bool, device=batch.device)  # every draw's reference = its input

        def path_terms(rows: slice) -> tuple[Tensor, Tensor, Tensor]:  # the rows' terms of the expectation, float64
            images = image_of_row[rows]
            references = baselines[samples.baseline_index[rows]]
            noisy = batch[images] + samples.noise[rows]
            alphas = samples.alphas[rows].to(batch.dtype).view(-1, 1, 1, 1)
            points = alphas * noisy + (1 - alphas) * references
            gradients, unreachable = self.copies_gradients(points, selected, images)
            if self.multiply_by_inputs:
                gradients = (noisy - references)[:, None] * gradients
            return gradients.double(), unreachable, (noisy - references).flatten(1).eq(0).all(dim=1)

        for rows, (terms, unreachable, empty) in self.row_passes(len(image_of_row), self.batch_size, batch.device,
                                                                 path_terms):
            total.index_add_(0, image_of_row[rows], terms)
            disconnected[image_of_row[rows]] &= unreachable
            empty_path[image_of_row[rows]] &= empty
        attributions = (total / per_image).to(batch.dtype)
        self._disconnected = disconnected
        if not self.check_completeness:
            return self.attribution_from(attributions, selected, zero_gradient=all_zero(total),
                                         baseline_is_input=empty_path)
        baseline_scores = self.reference_scores(baselines, image_of_row, samples.baseline_index, selected)
        score_change = selected.scores.detach().double() - baseline_scores / per_image
        completeness_error = attributions.double().sum(dim=(2, 3, 4)) - score_change
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(total),
                                     baseline_is_input=empty_path, completeness_error=completeness_error.float(),
                                     score_change=score_change.float())
