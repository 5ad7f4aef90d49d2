"""Integrated Gradients along paths other than the straight line.

Guided IG (Kapishnikov et al. 2021, "Guided Integrated Gradients: an adaptive path method for
removing noise"): a path from the baseline to the input, chosen step by step, that moves the
features whose gradient is smallest in magnitude first.

Blur IG (Xu et al. 2020, "Attribution in scale and space"): the path of decreasing Gaussian blur,
from the image blurred with σ = max_sigma to the image itself.

Both are path methods: the attributions sum to y(x) − y(start of the path) up to the error of the
discrete sum, which ``Explanation.diagnostics["completeness_error"]`` reports (not warned about, unlike Integrated
Gradients, except where the sum misses more than ``GROSSLY_INCOMPLETE`` times the score change). Their sums
converge slowly or not at all as their authors' code computes them: on the demo CNN Guided IG (a left sum along a
path chosen from the gradient at each step) misses 62 % of the score change at 8 steps and 157 % at 32 and 64; Blur
IG misses up to 64 % at 16 steps, 30 % at 50, 37 % at 100 and 8 % at 200 (with ``sqrt=True`` up to 16 times the
score change, which warns: 17–21× on a small CNN whose score barely changes along the path). They follow Google
PAIR's ``saliency`` 0.2 (its option names and its discretisation), computed in float64 along the
path, on the model's device, with the model's calls batched over images and targets.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from ..core.targets import SelectedTargets, Target, select_targets
from ..io.blur import gaussian_blur
from ..io.loaded_model import ModelSource
from .gradients import (
    BASELINE_ADVICE,
    GradientExplainer,
    baseline_like,
    flag_values,
    input_gradients,
    warn_about_incompleteness,
)
from .maps import Attribution, Flags
from .options import bool_option, check_finite_reference, int_option, number_option
from .passes import checked_batch_size, rows_per_pass
from .registry import register

GROSSLY_INCOMPLETE = 10.0
"""The multiple of y(x) − y(x′) by which Guided IG's and Blur IG's attributions may miss it before they warn (neither is
complete by design, see the module's docstring; 10× the score change is a path that sampled an exploding gradient, or
points that did not follow the score along the path)."""

CLOSE_ENOUGH = 1e-9
"""Relative and absolute tolerance at which a Guided IG step has reached its L1 target (PAIR's EPSILON)."""


def guided_ig_paths(
    inputs: Tensor,
    baselines: Tensor,
    gradient_at: Callable[[Tensor], Tensor],
    steps: int,
    fraction: float,
    max_dist: float,
) -> Tensor:
    """Guided IG attributions of R independent rows, each on its own adaptive path.

    inputs, baselines: (R, D) float64, the end and the start of each path.
    gradient_at: (R, D) points → (R, D) float64 gradients of each row's own score.
    steps: the path is walked in ``steps`` steps; after step s every row's L1 distance to its
    input is (1 − s/steps) of the total. In a step, the features with the smallest |gradient|
    (at most the ``fraction``-quantile of all features' |gradient|, those already at the step's
    upper bound counting as infinite) move toward the input, as far as that bound allows, until
    the L1 target is reached; a feature never strays more than ``max_dist`` (in the path's relative
    position α ∈ [0, 1]) from the straight line: those that fall behind α − max_dist are
    pulled up to it. The gradient is taken once per step, at the step's starting point.
    Each sub-step but a step's last puts at least one more feature at its bound, so a step ends
    after at most D + 1 sub-steps. A row whose input equals its baseline stays there (attributions 0).
    Returns (R, D) float64 attributions: Σ over moves of (Δx ⊙ gradient).
    Raises ValueError where an input or baseline holds NaN or inf (or their distance overflows).
    """
    rows, features = inputs.shape
    difference = inputs - baselines
    moves_toward_input = difference != 0
    l1_total = difference.abs().sum(dim=1)
    if not bool(torch.isfinite(l1_total).all()):
        bad = (~torch.isfinite(l1_total)).nonzero()[:, 0].tolist()
        raise ValueError(f"Guided IG's path is undefined for rows {bad[:8]}: the input or the baseline holds NaN or "
                         "inf, or the distance between them overflows. Give finite inputs and baselines.")
    rank_of_threshold = math.floor(fraction * (features - 1)) + 1  # numpy's quantile(..., method="lower")
    x = baselines.clone()
    attributions = torch.zeros_like(inputs)
    for step in range(steps):
        gradient = gradient_at(x)
        candidates = gradient.clone()
        alpha = (step + 1.0) / steps
        alpha_min, alpha_max = max(alpha - max_dist, 0.0), min(alpha + max_dist, 1.0)
        x_min = baselines + difference * alpha_min
        x_max = baselines + difference * alpha_max
        l1_target = l1_total * (1 - (step + 1) / steps)
        moving = torch.ones(rows, dtype=torch.bool, device=inputs.device)
        sub_steps = 0
        while bool(moving.any()):
            sub_steps += 1
            if sub_steps > features + 1:  # cannot happen (see above): a bug, not an endless loop
                raise RuntimeError(f"Guided IG's step {step + 1} of {steps} did not reach its L1 target in "
                                   f"{features + 1} sub-steps; please report this with the model and inputs.")
            x_old = x
            relative_position = torch.where(moves_toward_input, (x - baselines) / difference, alpha_max)
            x = torch.where((relative_position < alpha_min) & moving[:, None], x_min, x)
            l1_current = (x - inputs).abs().sum(dim=1)
            reached = (l1_current - l1_target).abs() <= torch.clamp(
                CLOSE_ENOUGH * torch.maximum(l1_current.abs(), l1_target.abs()), min=CLOSE_ENOUGH)
            still = moving & ~reached
            candidates = torch.where(x == x_max, math.inf, candidates)
            magnitude = candidates.abs()
            threshold = magnitude.kthvalue(rank_of_threshold, dim=1).values
            selected = (magnitude <= threshold[:, None]) & (candidates != math.inf) & still[:, None]
            l1_selected = ((x - x_max).abs() * selected).sum(dim=1)
            gamma = torch.where(l1_selected > 0, (l1_current - l1_target) / l1_selected, math.inf)
            saturated = gamma > 1.0
            partial_step = x + (x_max - x) * gamma.clamp(0.0, 1.0)[:, None]
            x = torch.where(selected, torch.where(saturated[:, None], x_max, partial_step), x)
            attributions += (x - x_old) * gradient
            moving = still & saturated & selected.any(dim=1)  # a row with nothing left to move stops
    return attributions


@register
class GuidedIG(GradientExplainer):
    """Guided Integrated Gradients (Kapishnikov et al. 2021): Integrated Gradients along an
    adaptive path that, at each step, moves the features with the smallest |∂y/∂x| first.

    baseline: the start of the path, as IntegratedGradients takes it: "zeros" (default),
        "blur" or a tensor broadcastable to the batch.
    steps: the path's steps, one gradient each (PAIR's ``x_steps``; default 200 as PAIR).
    fraction: the fraction of features moved in each sub-step (default 0.25).
    max_dist: how far (in relative position α ∈ [0, 1]) a feature may deviate from the straight
        line; 0 gives Integrated Gradients (the left Riemann sum), 1 the unbounded Guided IG.
    batch_size: rows (image × target paths) per forward/backward pass;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    Each image and target has its own path (the path follows the target's gradient); the
    gradient of every path is taken in one batched pass per step.
    A baseline with NaN or inf is refused (ValueError); one equal to an image gives that image
    zero attributions and a RuntimeWarning saying so.
    ``Explanation.diagnostics``: "completeness_error" (N, K) Σ attributions − (y(x) − y(x')),
    "score_change" (N, K) y(x) − y(x').
    """

    name = "guidedig"
    summary = "Guided IG: integrated gradients along an adaptive path that moves low-gradient features first"
    records_the_forward = False  # only differentiates the output

    def __init__(
        self,
        model: ModelSource,
        *,
        baseline: Union[str, Tensor] = "zeros",
        steps: int = 200,
        fraction: float = 0.25,
        max_dist: float = 0.02,
        batch_size: Optional[int] = None,
        **options,
    ):
        super().__init__(model, **options)
        baseline_like(baseline, None)  # validates its kind
        if isinstance(baseline, Tensor):
            check_finite_reference(baseline, "the baseline")
        self.baseline = baseline
        self.steps = int_option("steps", steps, 1)
        if number_option("fraction", fraction) == 0 or fraction > 1:
            raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}.")
        if number_option("max_dist", max_dist) > 1:
            raise ValueError(f"max_dist must be in [0, 1]; got {max_dist!r}.")
        self.fraction, self.max_dist = float(fraction), float(max_dist)
        self.batch_size = checked_batch_size(batch_size)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = baseline_like(self.baseline, batch)
        check_finite_reference(baseline, f"the baseline (as {batch.dtype} model input)")
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
            baseline_scores = selected.scores_for(self.call_model(baseline),
                                                  torch.arange(count, device=batch.device))
        targets = selected.scores.shape[1]
        image_of_row = torch.arange(count, device=batch.device).repeat_interleave(targets)  # row = (image, target)
        target_of_row = torch.arange(targets, device=batch.device).repeat(count)
        disconnected = torch.ones(len(image_of_row), dtype=torch.bool, device=batch.device)
        zero_gradient = torch.ones(len(image_of_row), dtype=torch.bool, device=batch.device)  # all along the path

        def gradients_of(rows: slice, points: Tensor) -> tuple[Tensor, Tensor]:
            gradient, unreachable = self.row_gradients(points[rows].view(-1, *batch.shape[1:]).to(batch.dtype),
                                                       selected, image_of_row[rows], target_of_row[rows])
            return gradient.flatten(1).double(), unreachable

        def gradient_at(points: Tensor) -> Tensor:  # one step of every path; its passes show no bar of their own
            gradients = []
            for rows, (gradient, unreachable) in self.row_passes(len(points), self.batch_size, batch.device,
                                                                 lambda rows: gradients_of(rows, points),
                                                                 batch.shape[1:].numel()):
                gradients.append(gradient)
                disconnected[rows] &= unreachable
                zero_gradient[rows] &= gradient.eq(0).all(dim=1)
            bar.update()
            return torch.cat(gradients)

        inputs, starts = batch.double().flatten(1)[image_of_row], baseline.double().flatten(1)[image_of_row]
        per_pass = rows_per_pass(self.batch_size, batch.device, batch.shape[1:].numel())
        passes = self.steps * -(-len(image_of_row) // per_pass)
        with self.progress_bar(passes, self.steps, "step") as bar:
            attributions = guided_ig_paths(inputs, starts, gradient_at, self.steps, self.fraction, self.max_dist)
        attributions = attributions.view(count, targets, *batch.shape[1:])
        score_change = selected.scores.detach().double() - baseline_scores.double()
        completeness_error = attributions.sum(dim=(2, 3, 4)) - score_change
        # not complete by design (it misses up to 157 % on the demo CNN): a warning only where the sum is off by orders
        # of magnitude, as where the gradient explodes at the baseline (ConvNeXt at the zero input: 1e10 × Δy)
        warn_about_incompleteness(
            self.method_name, completeness_error, score_change, selected.scores, GROSSLY_INCOMPLETE,
            f"{self.steps} steps", "Guided IG takes each step's gradient at its start, the first at the baseline "
            f"itself, where this model's gradient is far larger than along the rest of the path. {BASELINE_ADVICE}")
        self._disconnected = disconnected.view(count, targets)
        return self.attribution_from(attributions.to(batch.dtype), selected,
                                     zero_gradient=zero_gradient.view(count, targets),
                                     baseline_is_input=inputs[::targets].eq(starts[::targets]).all(dim=1),
                                     completeness_error=completeness_error.float(), score_change=score_change.float())

    def row_gradients(self, points: Tensor, selected: SelectedTargets, images: Tensor,
                      columns: Tensor) -> tuple[Tensor, Tensor]:
        """For R rows, row r a point on the path of image ``images[r]`` and target ``columns[r]``:
        ((R, C, H, W) ∂score/∂input of each row's own target, (R,) bool: the score does not depend
        on the input)."""

        def scores_of(output):
            return selected.scores_for(output, images).gather(1, columns[:, None])

        def forward(inputs):
            return self.forward(inputs, images)

        gradients, _, unreachable = input_gradients(forward, points, scores_of)
        return gradients[:, 0], flag_values(unreachable)[:, 0]


@register
class BlurIG(GradientExplainer):
    """Blur Integrated Gradients (Xu et al. 2020): Integrated Gradients along the path of
    decreasing Gaussian blur, x(σ) = the image blurred with σ, from σ = max_sigma to σ = 0:

        attribution = −∫₀^max_sigma ∂y/∂x(x(σ)) ⊙ ∂x(σ)/∂σ dσ,

    as PAIR's ``saliency`` computes it: a left Riemann sum over ``steps`` values of σ, with
    ∂x/∂σ ≈ (x(σ + grad_step) − x(σ)) / grad_step. The blur acts on the model input (after
    preprocessing), per channel, with zeros outside the image (scipy's mode="constant").

    max_sigma: the largest blur, in pixels, finite and > 0 (default 50 as PAIR); a σ beyond the
        image's size blurs it toward zero (zeros outside the image).
    steps: points on the path (default 100 as PAIR).
    grad_step: the finite-difference step in σ for ∂x/∂σ (default 0.01 as PAIR).
    sqrt: PAIR's square-root spacing, σ_i = √(i · max_sigma / steps) (the path then starts at
        σ = √max_sigma).
    batch_size: points per forward/backward pass (every target of a point in the same pass);
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``Explanation.diagnostics``: "completeness_error" (N, K) Σ attributions − (y(x) − y(x(σ_max))),
    "score_change" (N, K) y(x) − y(x(σ_max)); a RuntimeWarning where it exceeds ``GROSSLY_INCOMPLETE`` times the
    score change.
    """

    name = "blurig"
    summary = "Blur IG: integrated gradients along a path of decreasing Gaussian blur"
    records_the_forward = False  # only differentiates the output

    def __init__(
        self,
        model: ModelSource,
        *,
        max_sigma: float = 50.0,
        steps: int = 100,
        grad_step: float = 0.01,
        sqrt: bool = False,
        batch_size: Optional[int] = None,
        **options,
    ):
        super().__init__(model, **options)
        self.max_sigma = number_option("max_sigma", max_sigma, allow_minimum=False)
        self.steps = int_option("steps", steps, 1)
        self.grad_step = number_option("grad_step", grad_step, allow_minimum=False)
        self.sqrt = bool_option("sqrt", sqrt)
        self.batch_size = checked_batch_size(batch_size)

    def sigmas(self) -> list[float]:
        """The steps + 1 values of σ that bound the Riemann sum's intervals, from 0 up."""
        positions = [index * self.max_sigma / self.steps for index in range(self.steps + 1)]
        return [math.sqrt(value) for value in positions] if self.sqrt else positions

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        sigmas = self.sigmas()
        widths = [sigmas[index + 1] - sigmas[index] for index in range(self.steps)]
        images64 = batch.double()
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
            most_blurred = gaussian_blur(images64, [sigmas[-1]] * count).to(batch.dtype)
            blurred_scores = selected.scores_for(self.call_model(most_blurred),
                                                 torch.arange(count, device=batch.device))
        targets = selected.scores.shape[1]
        image_of_row = torch.arange(count, device=batch.device).repeat_interleave(self.steps)
        step_of_row = list(range(self.steps)) * count
        integral = torch.zeros(count, targets, *batch.shape[1:], dtype=torch.float64, device=batch.device)
        disconnected = torch.ones(count, targets, dtype=torch.bool, device=batch.device)
        nonzero_gradients = torch.zeros(count, targets, dtype=torch.float64, device=batch.device)  # points, per pair

        def path_terms(rows: slice) -> tuple[Tensor, Flags]:  # the rows' terms of the integral, float64
            images, at_steps = image_of_row[rows], step_of_row[rows]
            originals = images64[images]
            points = gaussian_blur(originals, [sigmas[step] for step in at_steps])
            further = gaussian_blur(originals, [sigmas[step] + self.grad_step for step in at_steps])
            velocity = (further - points) / self.grad_step  # ∂x/∂σ
            weights = torch.tensor([widths[step] for step in at_steps], dtype=torch.float64, device=batch.device)
            gradients, unreachable = self.copies_gradients(points.to(batch.dtype), selected, images)
            nonzero_gradients.index_add_(0, images, gradients.flatten(2).ne(0).any(dim=2).double())
            return gradients.double() * (velocity * weights.view(-1, 1, 1, 1))[:, None], unreachable

        for rows, (terms, unreachable) in self.row_passes(len(image_of_row), self.batch_size, batch.device,
                                                          path_terms, batch.shape[1:].numel()):
            integral.index_add_(0, image_of_row[rows], terms)
            disconnected[image_of_row[rows]] &= flag_values(unreachable)
        attributions = -integral
        score_change = selected.scores.detach().double() - blurred_scores.double()
        completeness_error = attributions.sum(dim=(2, 3, 4)) - score_change
        # not complete by design (it misses up to 64 % at 16 steps on the demo CNN): a warning only where the sum is
        # off by more than GROSSLY_INCOMPLETE times the score change (a score that changes little from the blurred
        # image to the image, while the sampled path's gradients do not: 17–21× on a small CNN with sqrt=True)
        spacing = ", square-root spacing" if self.sqrt else ""
        warn_about_incompleteness(
            self.method_name, completeness_error, score_change, selected.scores, GROSSLY_INCOMPLETE,
            f"{self.steps} steps{spacing}", "Blur IG is a left Riemann sum with ∂x/∂σ by finite differences "
            "(PAIR's discretisation): its points did not follow the score along the blur path. Use more steps "
            "(with sqrt=False: square-root spacing leaves the first interval, σ from 0 to √(max_sigma / steps), "
            "unsampled), or a smaller max_sigma.")
        self._disconnected = disconnected
        attribution = self.attribution_from(attributions.to(batch.dtype), selected,
                                            zero_gradient=nonzero_gradients == 0,
                                            baseline_is_input=lambda: most_blurred.eq(batch).flatten(1).all(dim=1),
                                            completeness_error=completeness_error.float(),
                                            score_change=score_change.float())
        attribution.empty_reason = (
            f"the path's {self.steps} point(s) gave no attribution: blurring them further (∂x/∂σ) changes nothing "
            f"where they lie, as at σ near max_sigma = {self.max_sigma:g} on a small image. Use more steps, or a "
            "smaller max_sigma")
        return attribution
