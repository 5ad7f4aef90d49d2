"""Attributions at the input: saliency, input × gradient, Integrated Gradients.

Each computes per-channel attributions (N, K, C, H, W) from ∂score/∂input, taken
with ``torch.autograd.grad`` with respect to the input only (no parameter
gradient), and reduces the channels to one map per image and target.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import numpy as np
import torch
import torchvision.transforms.functional as TF
from torch import Tensor, nn

from ..targets import SelectedTargets, Target, select_targets
from .base import Attribution, Explainer, PerThread, register

REDUCTIONS = ("maxabs", "sumabs", "sum")
RULES = ("riemann", "gausslegendre")


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
        gradients, disconnected = [], []
        for target_index in range(scores.shape[1]):
            score = scores[:, target_index].sum()
            gradient = None
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


class GradientExplainer(Explainer):
    """Base of the methods that attribute to input pixels.

    reduce: how the colour channels become one map: "maxabs" (default), "sumabs" or "sum"
        (signed). The per-channel attributions stay on ``Explanation.attributions``.
    """

    disconnected: PerThread[Tensor] = PerThread()
    """During a call: (N, K) bool, where the score does not depend on the input at all."""

    def __init__(self, model: nn.Module, *, reduce: str = "maxabs", **options):
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
        depend on the input is kept for the warning about empty maps (``self.disconnected``)."""
        selection: dict[str, SelectedTargets] = {}

        def scores_of(output):
            selection["targets"] = select_targets(output, target, topk, batch_size=batch.shape[0])
            return selection["targets"].scores

        gradients, scores, self.disconnected = input_gradients(self.forward, batch, scores_of)
        selected = selection["targets"]
        selected.scores = scores
        return gradients, selected

    def attribution_from(self, attributions: Tensor, selected: SelectedTargets, *, zero_gradient: Tensor,
                         **diagnostics: Tensor) -> Attribution:
        """An Attribution of (N, K, C, H, W) input attributions, reduced over channels to the maps;
        zero_gradient: (N, K) bool, where the gradient at the input was zero everywhere."""
        disconnected, self.disconnected = self.disconnected, None
        return Attribution(
            maps=reduce_channels(attributions, self.reduce),
            selected=selected,
            attributions=attributions,
            diagnostics=diagnostics,
            zero_gradient=zero_gradient,
            disconnected=disconnected,
        )


@register
class Saliency(GradientExplainer):
    """Saliency (Simonyan et al. 2014): ∂y_c/∂x; the map is max_c |∂y/∂x_c| by default."""

    name = "saliency"
    summary = "Saliency: gradient of the score with respect to the input pixels"

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(gradients, selected, zero_gradient=all_zero(gradients))


@register
class InputXGradient(GradientExplainer):
    """Input × gradient: x ⊙ ∂y_c/∂x."""

    name = "inputxgradient"
    summary = "Input × gradient: the input times the gradient of the score"

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(batch[:, None] * gradients, selected, zero_gradient=all_zero(gradients))


def integration_nodes(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Points α in (0, 1) and weights (summing to 1) for ∫₀¹ f(α) dα ≈ Σ w_i f(α_i)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}.")
    if rule == "riemann":  # midpoint rule
        return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "gausslegendre":
        points, weights = np.polynomial.legendre.leggauss(steps)
        return (points + 1) / 2, weights / 2
    raise ValueError(f"rule must be one of {RULES}; got {rule!r}.")


@register
class IntegratedGradients(GradientExplainer):
    """Integrated Gradients (Sundararajan et al. 2017): (x − x') ⊙ ∫₀¹ ∂y/∂x(x' + α(x − x')) dα.

    baseline: "zeros" (default, zero model input), "blur" (the input blurred by a wide
        Gaussian) or a tensor broadcastable to the batch.
    steps: integration points; rule: "gausslegendre" (default) or "riemann" (midpoint).
    batch_size: interpolated inputs per forward/backward pass (bounds memory).
    ``Explanation.diagnostics["completeness_error"]`` (N, K) is Σ attributions −
    (y(x) − y(x')), and ``["score_change"]`` is y(x) − y(x').
    """

    name = "integratedgradients"
    summary = "Integrated Gradients: gradients integrated along a path from a baseline (complete)"

    def __init__(
        self,
        model: nn.Module,
        *,
        baseline: Union[str, Tensor] = "zeros",
        steps: int = 32,
        rule: str = "gausslegendre",
        batch_size: int = 32,
        **options,
    ):
        super().__init__(model, **options)
        integration_nodes(steps, rule)  # validates
        if isinstance(baseline, str) and baseline not in ("zeros", "blur"):
            raise ValueError(f"baseline must be 'zeros', 'blur' or a tensor; got {baseline!r}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
        self.baseline, self.steps, self.rule, self.batch_size = baseline, steps, rule, batch_size

    def baseline_for(self, batch: Tensor) -> Tensor:
        """The baseline x' for a (N, C, H, W) batch, same shape."""
        if isinstance(self.baseline, Tensor):
            baseline = self.baseline.to(batch.device, batch.dtype)
            try:
                return baseline.expand_as(batch)
            except RuntimeError:
                raise ValueError(
                    f"the baseline has shape {tuple(baseline.shape)}, which does not broadcast to the batch "
                    f"{tuple(batch.shape)}: give a (C, H, W) or (N, C, H, W) tensor in the model's input space "
                    "(after preprocessing), or baseline='zeros' / 'blur'."
                ) from None
        if self.baseline == "zeros":
            return torch.zeros_like(batch)
        sigma = max(batch.shape[-2:]) / 8
        kernel = 2 * math.ceil(3 * sigma) + 1
        return TF.gaussian_blur(batch, kernel_size=[kernel, kernel], sigma=[sigma, sigma])

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = self.baseline_for(batch)
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
            baseline_output = self.call_model(baseline)
            baseline_scores = selected.scores_for(baseline_output, torch.arange(count, device=batch.device))
        alphas, weights = integration_nodes(self.steps, self.rule)
        alphas = torch.as_tensor(alphas, dtype=batch.dtype, device=batch.device)
        weights = torch.as_tensor(weights, dtype=torch.float64, device=batch.device)
        image_of_row = torch.arange(count, device=batch.device).repeat_interleave(self.steps)
        step_of_row = torch.arange(self.steps, device=batch.device).repeat(count)
        integral = torch.zeros(count, selected.scores.shape[1], *batch.shape[1:], dtype=torch.float64,
                               device=batch.device)
        difference = batch - baseline
        disconnected = torch.ones(count, selected.scores.shape[1], dtype=torch.bool, device=batch.device)
        for start in range(0, len(image_of_row), self.batch_size):
            images = image_of_row[start : start + self.batch_size]
            steps = step_of_row[start : start + self.batch_size]
            points = baseline[images] + alphas[steps].view(-1, 1, 1, 1) * difference[images]
            def scores_of(output, images=images):
                return selected.scores_for(output, images)

            def forward(inputs, images=images):
                return self.forward(inputs, images)

            gradients, _, unreachable = input_gradients(forward, points, scores_of)
            integral.index_add_(0, images, gradients.double() * weights[steps].view(-1, 1, 1, 1, 1))
            disconnected[images] &= unreachable
        attributions = (difference[:, None].double() * integral).to(batch.dtype)
        score_change = selected.scores.detach().float() - baseline_scores.float()
        completeness_error = attributions.double().sum(dim=(2, 3, 4)).float() - score_change
        self.disconnected = disconnected
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(integral),
                                     completeness_error=completeness_error, score_change=score_change)
