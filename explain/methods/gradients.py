"""Attributions at the input: saliency, input × gradient, Integrated Gradients.

Each computes per-channel attributions (N, K, C, H, W) from ∂score/∂input, taken
with ``torch.autograd.grad`` with respect to the input only (no parameter
gradient), and reduces the channels to one map per image and target.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..blur import reflect_blur
from ..explanation import Diagnostic
from ..targets import SelectedTargets, Target, select_targets
from .base import Attribution, Explainer, ExplainerOptions, PerThread, checked_batch_size, register
from .options import check_finite_reference

REDUCTIONS = ("maxabs", "sumabs", "sum")
RULES = ("midpoint", "left", "right", "trapezoid", "gausslegendre")


def reduce_channels(attributions: Tensor, how: str) -> Tensor:
    """(N, K, C, H, W) → (N, K, H, W): "maxabs" max_c |a_c| (default), "sumabs" Σ_c |a_c|,
    "sum" Σ_c a_c (signed)."""
    if how == "maxabs":
        return attributions.abs().amax(dim=2)
    if how == "sumabs":
        return attributions.abs().sum(dim=2)
    if how == "sum":
        return attributions.sum(dim=2)
    raise ValueError(f"reduce must be one of {REDUCTIONS}; got {how!r}.")


def input_gradients(
    forward: Callable[[Tensor], object], inputs: Tensor, scores_of: Callable[[object], Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """∂scores/∂inputs for each of K scores per row.

    forward: runs the model on the inputs; scores_of: the model's output → (R, K) scores.
    Returns ((R, K, C, H, W) gradients, (R, K) scores, (R, K) bool: whether the score does not
    depend on the input at all, its gradient then being zeros). Rows do not interact in eval
    mode, so one backward pass per target gives every row its own gradient.
    """
    if not inputs.is_floating_point():
        raise TypeError(f"gradients need a floating-point input; got {inputs.dtype}.")
    with torch.enable_grad():
        inputs = inputs.detach().requires_grad_(True)
        scores = scores_of(forward(inputs))
        gradients: list[Tensor] = []
        disconnected: list[Tensor] = []
        for target_index in range(scores.shape[1]):
            score = scores[:, target_index].sum()
            gradient: Optional[Tensor] = None
            if score.requires_grad:
                (gradient,) = torch.autograd.grad(
                    score, inputs, retain_graph=target_index < scores.shape[1] - 1, allow_unused=True
                )
            gradients.append(torch.zeros_like(inputs) if gradient is None else gradient)
            disconnected.append(torch.full(scores.shape[:1], gradient is None, dtype=torch.bool, device=inputs.device))
    return torch.stack(gradients, dim=1), scores.detach(), torch.stack(disconnected, dim=1)


def all_zero(attributions: Tensor) -> Tensor:
    """(N, K, ...) → (N, K) bool: whether each image's attributions for a target are all zero."""
    return attributions.flatten(2).eq(0).all(dim=2)


class GradientOptions(ExplainerOptions, total=False):
    """The keyword options every method that attributes to input pixels takes (see ``GradientExplainer``),
    for ``**options: Unpack[GradientOptions]``."""

    reduce: str


class GradientExplainer(Explainer):
    """Base of the methods that attribute to input pixels.

    reduce: how the colour channels become one map: "maxabs" (default), "sumabs" or "sum"
        (signed). The per-channel attributions stay on ``Explanation.attributions``.
    """

    _disconnected: PerThread[Tensor] = PerThread()
    """During a call: (N, K) bool, where the score does not depend on the input at all."""

    def reads_pixel_gradients(self) -> bool:
        return True

    def __init__(self, model: nn.Module, *, reduce: str = "maxabs", **options: Unpack[ExplainerOptions]):
        super().__init__(model, **options)
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}; got {reduce!r}.")
        self.reduce = reduce

    def forward(self, inputs: Tensor, rows: Optional[Tensor] = None) -> object:
        """The model's forward pass, as the method runs it (guided methods change its ReLUs).
        rows: for a batch of copies, the image each row is a copy of."""
        return self.call_model(inputs, rows)

    def gradients(self, batch: Tensor, target: Target, topk: Optional[int]) -> tuple[Tensor, SelectedTargets]:
        """((N, K, C, H, W) ∂score/∂input, the selected targets) for a batch; where the score does not
        depend on the input is kept for the warning about empty maps (``self._disconnected``)."""
        selection: dict[str, SelectedTargets] = {}

        def scores_of(output: object) -> Tensor:
            selection["targets"] = select_targets(output, target, topk, batch_size=batch.shape[0])
            return selection["targets"].scores

        gradients, scores, self._disconnected = input_gradients(self.forward, batch, scores_of)
        selected = selection["targets"]
        selected.scores = scores
        return gradients, selected

    def copies_gradients(self, copies: Tensor, selected: SelectedTargets, images: Tensor) -> tuple[Tensor, Tensor]:
        """For R rows, row r a copy of image ``images[r]`` (a path point, a noisy sample): ((R, K, C, H, W)
        ∂score/∂input for that image's K targets, (R, K) bool where the score does not depend on the input)."""
        gradients, _, unreachable = input_gradients(lambda inputs: self.forward(inputs, images), copies,
                                                    lambda output: selected.scores_for(output, images))
        return gradients, unreachable

    def attribution_from(self, attributions: Tensor, selected: SelectedTargets, *, zero_gradient: Tensor,
                         baseline_is_input: Optional[Tensor] = None, **diagnostics: Diagnostic) -> Attribution:
        """An Attribution of (N, K, C, H, W) input attributions, reduced over channels to the maps;
        zero_gradient: (N, K) bool, where the gradient at the input was zero everywhere;
        baseline_is_input: (N,) bool, where a path method's baseline equals the image."""
        disconnected, self._disconnected = self._disconnected, None
        return Attribution(
            maps=reduce_channels(attributions, self.reduce),
            selected=selected,
            attributions=attributions,
            diagnostics=diagnostics,
            zero_gradient=zero_gradient,
            disconnected=disconnected,
            baseline_is_input=baseline_is_input,
        )


@register
class Saliency(GradientExplainer):
    """Saliency (Simonyan et al. 2014): ∂y_c/∂x; the map is max_c |∂y/∂x_c| by default."""

    name = "saliency"
    summary = "Saliency: gradient of the score with respect to the input pixels"
    records_the_forward = False  # only differentiates the output

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(gradients, selected, zero_gradient=all_zero(gradients))


@register
class InputXGradient(GradientExplainer):
    """Input × gradient: x ⊙ ∂y_c/∂x."""

    name = "inputxgradient"
    summary = "Input × gradient: the input times the gradient of the score"
    records_the_forward = False  # only differentiates the output

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(batch[:, None] * gradients, selected, zero_gradient=all_zero(gradients))


BASELINES = ("zeros", "blur")


def baseline_like(baseline: Union[str, Tensor], batch: Optional[Tensor]) -> Tensor:
    """The baseline x' for a (N, C, H, W) batch, same shape: "zeros" (zero model input), "blur"
    (the input blurred by a Gaussian of σ = max(H, W) / 8, reflected at the edges: any image size) or a
    finite tensor broadcastable to the batch.
    With ``batch`` None, only checks the kind of baseline (and returns an empty tensor)."""
    if isinstance(baseline, str) and baseline not in BASELINES:
        raise ValueError(f"baseline must be 'zeros', 'blur' or a tensor; got {baseline!r}.")
    if not isinstance(baseline, (str, Tensor)):
        raise TypeError(f"baseline must be 'zeros', 'blur' or a tensor; got {type(baseline).__name__}.")
    if batch is None:
        return torch.empty(0)
    if isinstance(baseline, Tensor):
        baseline = baseline.to(batch.device, batch.dtype)
        check_finite_reference(baseline, f"the baseline (as {batch.dtype} model input)")
        try:
            return baseline.expand_as(batch)
        except RuntimeError:
            raise ValueError(
                f"the baseline has shape {tuple(baseline.shape)}, which does not broadcast to the batch "
                f"{tuple(batch.shape)}: give a (C, H, W) or (N, C, H, W) tensor in the model's input space "
                "(after preprocessing), or baseline='zeros' / 'blur'."
            ) from None
    if baseline == "zeros":
        return torch.zeros_like(batch)
    return reflect_blur(batch, max(batch.shape[-2:]) / 8)


RULE_ALIASES = {"riemann": "midpoint", "riemann_middle": "midpoint", "riemann_left": "left",
                "riemann_right": "right", "riemann_trapezoid": "trapezoid"}
"""Other spellings of the rules (Captum's names; "riemann" was this toolkit's midpoint rule)."""


def integration_nodes(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Points α in [0, 1] and weights (summing to 1) for ∫₀¹ f(α) dα ≈ Σ w_i f(α_i).

    rule: "midpoint", "left", "right", "trapezoid" (Riemann sums; the trapezoid rule needs
    steps ≥ 2) or "gausslegendre"; Captum's names ("riemann_middle", ...) are accepted too.
    """
    rule = RULE_ALIASES.get(rule, rule)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int of at least 1; got {steps!r}.")
    if rule == "midpoint":
        return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "left":
        return np.arange(steps) / steps, np.full(steps, 1.0 / steps)
    if rule == "right":
        return (np.arange(steps) + 1.0) / steps, np.full(steps, 1.0 / steps)
    if rule == "trapezoid":
        if steps < 2:
            raise ValueError("the trapezoid rule needs at least 2 steps.")
        weights = np.full(steps, 1.0 / (steps - 1))
        weights[[0, -1]] /= 2
        return np.linspace(0.0, 1.0, steps), weights
    if rule == "gausslegendre":
        points, weights = np.polynomial.legendre.leggauss(steps)
        return (points + 1) / 2, weights / 2
    raise ValueError(f"rule must be one of {RULES} (or {', '.join(RULE_ALIASES)}); got {rule!r}.")


@register
class IntegratedGradients(GradientExplainer):
    """Integrated Gradients (Sundararajan et al. 2017): (x − x') ⊙ ∫₀¹ ∂y/∂x(x' + α(x − x')) dα.

    baseline: "zeros" (default, zero model input), "blur" (the input blurred by a wide
        Gaussian) or a tensor broadcastable to the batch.
    steps: integration points (≥ 1).
    rule: "midpoint" (default; chosen by measurement, see benchmarks/ig_rules.py), "left",
        "right", "trapezoid" or "gausslegendre".
    tolerance: None, or a relative completeness error to reach: each image's steps are doubled (up to
        ``max_steps``) until its |Σ attributions − (y(x) − y(x'))| ≤ tolerance · |y(x) − y(x')| for every
        target, so an image's attributions are those it gets explained alone.
    multiply_by_inputs: True (default) gives (x − x') ⊙ the integral (complete attributions);
        False the path-integrated gradient itself.
    batch_size: interpolated inputs per forward/backward pass (bounds memory);
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``Explanation.diagnostics``: "completeness_error" (N, K) Σ attributions − (y(x) − y(x')),
    "score_change" (N, K) y(x) − y(x'), "steps" (N,) the number of steps each image used.
    """

    name = "integratedgradients"
    summary = "Integrated Gradients: gradients integrated along a path from a baseline (complete)"
    records_the_forward = False  # only differentiates the output

    def __init__(
        self,
        model: nn.Module,
        *,
        baseline: Union[str, Tensor] = "zeros",
        steps: int = 32,
        rule: str = "midpoint",
        tolerance: Optional[float] = None,
        max_steps: int = 1024,
        multiply_by_inputs: bool = True,
        batch_size: Optional[int] = None,
        **options: Unpack[GradientOptions],
    ):
        super().__init__(model, **options)
        integration_nodes(steps, rule)  # validates
        baseline_like(baseline, None)  # validates
        checked_batch_size(batch_size)
        if tolerance is not None and not tolerance > 0:
            raise ValueError(f"tolerance must be positive (a relative completeness error); got {tolerance!r}.")
        if max_steps < steps:
            raise ValueError(f"max_steps ({max_steps}) must be at least steps ({steps}).")
        self.baseline, self.steps, self.batch_size = baseline, steps, batch_size
        self.rule = RULE_ALIASES.get(rule, rule)
        self.tolerance, self.max_steps, self.multiply_by_inputs = tolerance, max_steps, multiply_by_inputs

    def baseline_for(self, batch: Tensor) -> Tensor:
        """The baseline x' for a (N, C, H, W) batch, same shape."""
        return baseline_like(self.baseline, batch)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = self.baseline_for(batch)
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
            baseline_output = self.call_model(baseline)
            baseline_scores = selected.scores_for(baseline_output, torch.arange(count, device=batch.device))
        score_change = selected.scores.detach().double() - baseline_scores.double()
        difference = (batch - baseline)[:, None].double()
        integral, disconnected = self.path_integral(batch, baseline, selected, self.steps)
        steps = torch.full((count,), self.steps, dtype=torch.long)
        while self.tolerance is not None:  # each image's steps doubled until it alone is complete enough
            completeness_error = (difference * integral).sum(dim=(2, 3, 4)) - score_change
            relative = completeness_error.abs() / score_change.abs().clamp_min(1e-12)
            unfinished = (relative > self.tolerance).any(dim=1).cpu() & (2 * steps <= self.max_steps)
            if not bool(unfinished.any()):
                break
            images = unfinished.nonzero()[:, 0]
            for doubled in torch.unique(2 * steps[images]).tolist():  # images at the same steps: one pass
                these = images[2 * steps[images] == doubled]
                on_device = these.to(batch.device)
                integral[on_device], disconnected[on_device] = self.path_integral(batch, baseline, selected, doubled,
                                                                                   on_device)
                steps[these] = doubled
        completeness_error = (difference * integral).sum(dim=(2, 3, 4)) - score_change
        attributions = (difference * integral if self.multiply_by_inputs else integral).to(batch.dtype)
        self._disconnected = disconnected
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(integral),
                                     baseline_is_input=difference.flatten(1).eq(0).all(dim=1),
                                     completeness_error=completeness_error.float(), score_change=score_change.float(),
                                     steps=steps.to(batch.device))

    def path_integral(self, batch: Tensor, baseline: Tensor, selected: SelectedTargets, steps: int,
                      images: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """∫₀¹ ∂y/∂x(x' + α(x − x')) dα by the rule with ``steps`` points, for the ``images`` given (indices
        into the batch; default all): ((len(images), K, C, H, W) float64, (len(images), K) bool where the
        score does not depend on the input at any point)."""
        if images is None:
            images = torch.arange(batch.shape[0], device=batch.device)
        count = len(images)
        nodes, node_weights = integration_nodes(steps, self.rule)
        alphas = torch.as_tensor(nodes, dtype=batch.dtype, device=batch.device)
        weights = torch.as_tensor(node_weights, dtype=torch.float64, device=batch.device)
        position_of_row = torch.arange(count, device=batch.device).repeat_interleave(steps)
        image_of_row = images[position_of_row]
        step_of_row = torch.arange(steps, device=batch.device).repeat(count)
        integral = torch.zeros(count, selected.scores.shape[1], *batch.shape[1:], dtype=torch.float64,
                               device=batch.device)
        difference = batch - baseline
        disconnected = torch.ones(count, selected.scores.shape[1], dtype=torch.bool, device=batch.device)

        def weighted_gradients(rows: slice) -> tuple[Tensor, Tensor]:  # the rows' terms of the sum, float64
            images, steps_of_rows = image_of_row[rows], step_of_row[rows]
            points = baseline[images] + alphas[steps_of_rows].view(-1, 1, 1, 1) * difference[images]
            gradients, unreachable = self.copies_gradients(points, selected, images)
            return gradients.double() * weights[steps_of_rows].view(-1, 1, 1, 1, 1), unreachable

        for rows, (terms, unreachable) in self.row_passes(len(image_of_row), self.batch_size, batch.device,
                                                          weighted_gradients):
            integral.index_add_(0, position_of_row[rows], terms)
            disconnected[position_of_row[rows]] &= unreachable
        return integral, disconnected
