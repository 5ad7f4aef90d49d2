"""Attributions at the input: saliency, input × gradient, Integrated Gradients.

Each computes per-channel attributions (N, K, C, H, W) from ∂score/∂input, taken
with ``torch.autograd.grad`` with respect to the input only (no parameter
gradient), and reduces the channels to one map per image and target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from ..core.targets import SelectedTargets, Target, select_targets
from ..core.units import BoundUnits
from ..io.blur import reflect_blur
from ..io.explanation import Diagnostic
from ..io.loaded_model import ModelSource
from .base import Explainer, PerThread
from .maps import Attribution, Flags
from .options import bool_option, check_finite_reference, int_option, number_option
from .passes import checked_batch_size, rows_per_pass
from .registry import register
from .signatures import ExplainerOptions

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
) -> tuple[Tensor, Tensor, Flags]:
    """∂scores/∂inputs for each of K scores per row.

    forward: runs the model on the inputs; scores_of: the model's output → (R, K) scores.
    Returns ((R, K, C, H, W) gradients, (R, K) scores, (R, K) bool: whether the score does not
    depend on the input at all, its gradient then being zeros; a function that makes it, all False,
    where every score depends on the input). Rows do not interact in eval mode, so one backward
    pass per target gives every row its own gradient.
    """
    if not inputs.is_floating_point():
        raise TypeError(f"gradients need a floating-point input; got {inputs.dtype}.")
    with torch.enable_grad():
        inputs = inputs.detach().requires_grad_(True)
        scores = scores_of(forward(inputs))
        gradients: list[Tensor] = []
        unreachable: list[bool] = []
        for target_index in range(scores.shape[1]):
            # one target: ∂(Σ_r score_r)/∂inputs, with the sum's gradient (ones) given rather than computed
            score = scores if scores.shape[1] == 1 else scores[:, target_index].sum()
            gradient: Optional[Tensor] = None
            if score.requires_grad:
                (gradient,) = torch.autograd.grad(
                    score, inputs, grad_outputs=torch.ones_like(score) if scores.shape[1] == 1 else None,
                    retain_graph=target_index < scores.shape[1] - 1, allow_unused=True
                )
            gradients.append(torch.zeros_like(inputs) if gradient is None else gradient)
            unreachable.append(gradient is None)
    shape, device = scores.shape, inputs.device
    disconnected: Flags = torch.tensor(unreachable, device=device).expand(shape[0], -1) if any(unreachable) \
        else lambda: torch.zeros(shape, dtype=torch.bool, device=device)
    stacked = gradients[0].unsqueeze(1) if len(gradients) == 1 else torch.stack(gradients, dim=1)
    return stacked, scores.detach(), disconnected


def flag_values(flags: Flags) -> Tensor:
    """Flags as a tensor, computed now if given as a function (``Flags``)."""
    return flags() if callable(flags) else flags


def detached_output(value: Any) -> Any:
    """A model output with its tensors detached (lists, tuples and dicts kept)."""
    if isinstance(value, Tensor):
        return value.detach()
    if type(value) in (list, tuple):
        return type(value)(detached_output(item) for item in value)
    if isinstance(value, dict):  # HuggingFace's ModelOutput too, which is built from keywords
        items = {key: detached_output(item) for key, item in value.items()}
        try:
            return type(value)(**items)
        except TypeError:
            return items
    return value


# ------------------------------------------------------------------ leading rows folded into a pass


class UnsplitOutput(Exception):
    """The model's output for a batch is not one row (or list item) per input row, so a folded pass cannot be
    split into its parts (``output_parts``); the method then runs those rows' forwards on their own."""


def output_parts(output: object, sizes: Sequence[int]) -> list[object]:
    """A model's output for a batch of sum(sizes) rows, split into consecutive parts of these sizes: a tensor's
    rows, or a list's items (one per row, as torchvision's detection models return them). UnsplitOutput for any
    other output."""
    total = sum(sizes)
    if isinstance(output, Tensor) and output.dim() > 0 and output.shape[0] == total:
        return list(output.split(list(sizes)))
    if isinstance(output, list) and len(output) == total:
        starts = np.cumsum([0, *sizes]).tolist()
        return [output[start:stop] for start, stop in zip(starts, starts[1:])]
    raise UnsplitOutput


def fold_leading_rows(explainer: Explainer, leading: int, batch_size: Optional[int], device: torch.device,
                      target: Target, row_values: Optional[int] = None) -> bool:
    """Whether a call's first pass also carries ``leading`` rows whose forward a method needs besides its copies of
    the images (the images themselves, to choose the targets; baselines and references, to score them): one
    forward and one backward instead of extra no-grad forwards. Yes while they are at most as many as the pass's
    own rows (a first pass at most twice a pass's size), unless a pass of this explainer has run out of memory on
    the device (``Explainer.rows_that_fit``): then a pass keeps the size that fitted and those forwards run alone.
    Never for a hidden unit as the target (``explain.Channel``, ``explain.Neuron``): its values are read from the
    unit's layer in the whole forward, not from the rows' parts of the output."""
    return (not isinstance(target, BoundUnits) and str(device) not in explainer.rows_that_fit
            and leading <= rows_per_pass(batch_size, device, row_values))


def folded_input_gradients(forward: Callable[[Tensor], object], leading: Sequence[Tensor], copies: Tensor,
                           select: Callable[[list[object]], Callable[[object], Tensor]]) -> tuple[Tensor, Flags]:
    """∂scores/∂copies for R copies of the images (path points, noisy copies), their forward made together with
    leading rows whose output decides what is scored (the images, to choose the targets; baselines, to score them):
    one forward of the leading rows and the copies, then one backward per target from the copies' scores alone.

    forward: the model on a batch; leading: the leading rows, in parts (images, baselines, ...) that go first, in
    order; select: the output of each part (detached) → a function of the copies' output giving their (R, K)
    scores. Returns ((R, K, C, H, W) gradients, (R, K) bool where the score does not depend on the input, as
    ``input_gradients``). Raises UnsplitOutput, before any backward, for an output that is not one row per input
    row."""
    sizes = [len(part) for part in leading]
    lead = sum(sizes)

    def scores_of(output: object) -> Tensor:
        scores_of_copies = select(output_parts(detached_output(output), [*sizes, len(copies)])[:-1])
        return scores_of_copies(output[lead:])  # type: ignore[index]  # a tensor or list, as output_parts checked

    # the whole batch is the leaf: the leading rows' gradients (zero) are dropped after, not sliced inside the graph
    gradients, _, disconnected = input_gradients(forward, torch.cat([*leading, copies]), scores_of)
    return gradients[lead:], disconnected


def all_zero(attributions: Tensor) -> Callable[[], Tensor]:
    """(N, K, ...) → (N, K) bool, computed when called: whether each image's attributions for a target are all zero
    (needed only to say why a map is empty, see ``Attribution``)."""
    return lambda: attributions.flatten(2).eq(0).all(dim=2)


class GradientOptions(ExplainerOptions, total=False):
    """The keyword options every method that attributes to input pixels takes (see ``GradientExplainer``),
    for ``**options: Unpack[GradientOptions]``."""

    reduce: str


class GradientExplainer(Explainer):
    """Base of the methods that attribute to input pixels.

    reduce: how the colour channels become one map: "maxabs" (default), "sumabs" or "sum"
        (signed). The per-channel attributions stay on ``Explanation.attributions``.
    """

    _disconnected: PerThread[Flags] = PerThread()
    """During a call: (N, K) bool, where the score does not depend on the input at all."""

    def reads_pixel_gradients(self) -> bool:
        return True

    def __init__(self, model: ModelSource, *, reduce: str = "maxabs", **options: Unpack[ExplainerOptions]):
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

    def copies_gradients(self, copies: Tensor, selected: SelectedTargets, images: Tensor) -> tuple[Tensor, Flags]:
        """For R rows, row r a copy of image ``images[r]`` (a path point, a noisy sample): ((R, K, C, H, W)
        ∂score/∂input for that image's K targets, (R, K) bool where the score does not depend on the input)."""
        gradients, _, unreachable = input_gradients(lambda inputs: self.forward(inputs, images), copies,
                                                    lambda output: selected.scores_for(output, images))
        return gradients, unreachable

    def attributions_of_gradients(self, batch: Tensor, gradients: Tensor) -> Optional[Tensor]:
        """For a method whose attributions are a function of the batch and its gradient alone (saliency, input ×
        gradient; they define this and write ``attribute`` with it): the (R, K, C, H, W) attributions of a
        (R, C, H, W) batch from its (R, K, C, H, W) ∂score/∂input, so that a wrapper (``SmoothGrad``) can take the
        gradients in passes of its own. None for the other methods."""
        return None

    def folded_gradients(self, leading: Sequence[Tensor], leading_images: Optional[Tensor], copies: Tensor,
                         images: Tensor, select: Callable[[list[object]], SelectedTargets]) -> tuple[Tensor, Flags]:
        """``copies_gradients`` for R copies with leading rows in the same forward (``folded_input_gradients``):
        row l of the leading rows (their parts one after the other) is a row of image ``leading_images[l]`` (None:
        of image l; needed only for a call with other forward arguments), copy r one of image ``images[r]``.
        select: the output of each leading part (detached) → the targets, whose scores on each copy (for its
        image) are differentiated."""
        every_image = None
        if self._forward_call is not None:
            if leading_images is None:
                leading_images = torch.arange(sum(len(part) for part in leading), device=images.device)
            every_image = torch.cat([leading_images.to(images.device), images])

        def scores_for_copies(leading_outputs: list[object]) -> Callable[[object], Tensor]:
            selected = select(leading_outputs)
            return lambda output: selected.scores_for(output, images)

        return folded_input_gradients(lambda inputs: self.forward(inputs, every_image), leading, copies,
                                      scores_for_copies)

    def attribution_from(self, attributions: Tensor, selected: SelectedTargets, *, zero_gradient: Flags,
                         baseline_is_input: Optional[Flags] = None, **diagnostics: Diagnostic) -> Attribution:
        """An Attribution of (N, K, C, H, W) input attributions, reduced over channels to the maps;
        zero_gradient: (N, K) bool, where the gradient at the input was zero everywhere;
        baseline_is_input: (N,) bool, where a path method's baseline equals the image (either may be a function
        that computes it, see ``Attribution``)."""
        disconnected, self._disconnected = self._disconnected, None
        # an input or baseline that requires grad (the caller's) must not carry its graph into the results
        attributions = attributions.detach()
        diagnostics = {key: value.detach() if isinstance(value, Tensor) else value
                       for key, value in diagnostics.items()}
        return Attribution(
            maps=reduce_channels(attributions, self.reduce),
            selected=selected,
            attributions=attributions,
            diagnostics=diagnostics,
            zero_gradient=zero_gradient,
            disconnected=disconnected,
            baseline_is_input=baseline_is_input,
            nonnegative_maps=self.reduce != "sum",  # "maxabs" and "sumabs" reduce |attributions|
        )


@register
class Saliency(GradientExplainer):
    """Saliency (Simonyan et al. 2014): ∂y_c/∂x; the map is max_c |∂y/∂x_c| by default."""

    name = "saliency"
    summary = "Saliency: gradient of the score with respect to the input pixels"
    records_the_forward = False  # only differentiates the output

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(self.attributions_of_gradients(batch, gradients), selected,
                                     zero_gradient=all_zero(gradients))

    def attributions_of_gradients(self, batch: Tensor, gradients: Tensor) -> Tensor:
        return gradients


@register
class InputXGradient(GradientExplainer):
    """Input × gradient: x ⊙ ∂y_c/∂x."""

    name = "inputxgradient"
    summary = "Input × gradient: the input times the gradient of the score"
    records_the_forward = False  # only differentiates the output

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        gradients, selected = self.gradients(batch, target, topk)
        return self.attribution_from(self.attributions_of_gradients(batch, gradients), selected,
                                     zero_gradient=all_zero(gradients))

    def attributions_of_gradients(self, batch: Tensor, gradients: Tensor) -> Tensor:
        return batch[:, None] * gradients


BASELINES = ("zeros", "blur")


def baseline_like(baseline: Union[str, Tensor], batch: Optional[Tensor]) -> Tensor:
    """The baseline x' for a (N, C, H, W) batch, same shape: "zeros" (zero model input), "blur"
    (the input blurred by a Gaussian of σ = max(H, W) / 8, reflected at the edges: any image size) or a
    finite tensor broadcastable to the batch.
    With ``batch`` None, only checks the kind of baseline (and returns an empty tensor)."""
    if isinstance(baseline, str) and baseline not in BASELINES:
        raise ValueError(f"baseline must be 'zeros', 'blur' or a tensor; got {baseline!r}.")
    if not isinstance(baseline, (str, Tensor)):
        fix = (f" For a constant baseline give a 0-d tensor: baseline=torch.tensor({baseline!r})."
               if isinstance(baseline, (int, float)) and not isinstance(baseline, bool) else
               " For a baseline computed from the images, compute it first and give the tensor: baseline=f(images)."
               if callable(baseline) else "")
        raise TypeError(f"baseline must be 'zeros', 'blur' or a tensor; got {type(baseline).__name__}.{fix}")
    if isinstance(baseline, Tensor) and baseline.dim() in (1, 2):  # (C,) broadcasts along the width: say which
        raise ValueError(
            f"the baseline has shape {tuple(baseline.shape)}: a baseline is a (C, H, W) or (N, C, H, W) tensor in the "
            "model's input space (after preprocessing), or a number as a 0-d tensor; per-channel values are "
            "baseline.view(-1, 1, 1), one value per pixel for all channels baseline[None].")
    if isinstance(baseline, Tensor) and baseline.is_meta:
        raise ValueError("the baseline is on the meta device (a shape without values): give a tensor with values, "
                         "e.g. torch.zeros(C, H, W), or baseline='zeros' / 'blur'.")
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


INCOMPLETE = 0.5
"""The share of y(x) − y(x′) that a path method's attributions may miss before it warns: its discretisation error
shrinks with more points (a few percent at the default steps on CNNs); missing half or more means the points did not
sample where the score changes."""

BASELINE_ADVICE = ("Where the score jumps next to the baseline, as in a model that normalises its input's scale away "
                   "(a LayerNorm after a stem convolution without bias, as timm's ConvNeXt: y(αx) hardly changes for "
                   "α > 0 and y(0) differs), more points do not help: use another baseline (baseline='blur', or the "
                   "data mean).")


def warn_about_incompleteness(method: str, completeness_error: Tensor, score_change: Tensor, scores: Tensor,
                              allowed: float, what: str, advice: str) -> None:
    """One RuntimeWarning naming the (image, target) pairs whose attributions miss more than ``allowed`` of the score
    change y(x) − y(x′) (beyond what rounding of the scores explains). completeness_error, score_change, scores:
    (N, K); what: the points used (e.g. "32 steps"); advice: what to do. Pairs whose attributions are all 0 (their sum
    exactly 0: the empty-map warning says why), that are not finite (an input or score with NaN, refused by the call's
    checks) or whose score does not change (within rounding: no share of it can be missed) are left out. The check
    runs on the host, in Python (three operations dispatched, whatever N, K)."""
    errors, changes, values = torch.stack([completeness_error.double(), score_change.double(),
                                           scores.detach().double().to(score_change.device)]).tolist()
    rounding = 1e3 * torch.finfo(torch.float32).eps  # float32 scores of ~1000 differ by ulps of 1000, whatever Δ

    def misses(error: float, change: float, value: float) -> bool:
        if not (math.isfinite(error) and math.isfinite(change)) or error + change == 0:
            return False
        noise = rounding * max(abs(value) + abs(change), 1.0)
        return abs(change) > noise and abs(error) > max(allowed * abs(change), noise)  # no share of a change of 0

    missed = [(n, k) for n, row in enumerate(errors) for k, error in enumerate(row)
              if misses(error, changes[n][k], values[n][k])]
    if not missed:
        return
    pairs = ", ".join(f"image {n}, target {k}: they sum to {errors[n][k] + changes[n][k]:.3g}, y(x) − y(x′) = "
                      f"{changes[n][k]:.3g}" for n, k in missed[:6])
    more = f" and {len(missed) - 6} more" if len(missed) > 6 else ""
    warn_at_callers_line(
        f"{method}: the attributions miss more than {100 * allowed:g}% of the score change ({pairs}{more}; "
        f"diagnostics['completeness_error']): with {what} the path integral did not sample where the score changes, "
        f"so the map is not to be trusted. {advice}", RuntimeWarning)


RULE_ALIASES = {"riemann": "midpoint", "riemann_middle": "midpoint", "riemann_left": "left",
                "riemann_right": "right", "riemann_trapezoid": "trapezoid"}
"""Other spellings of the rules (Captum's names; "riemann" was this toolkit's midpoint rule)."""


def integration_nodes(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Points α in [0, 1] and weights (summing to 1) for ∫₀¹ f(α) dα ≈ Σ w_i f(α_i).

    rule: "midpoint", "left", "right", "trapezoid" (Riemann sums; the trapezoid rule needs
    steps ≥ 2) or "gausslegendre"; Captum's names ("riemann_middle", ...) are accepted too.
    """
    rule = RULE_ALIASES.get(rule, rule)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
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


@dataclass
class PathIntegral:
    """``IntegratedGradients.path_integral``'s result for M images and K targets: integral (M, K, C, H, W) float64;
    disconnected (M, K) bool, where the score depends on the input at no point of the path (a function that computes
    it); selected: the targets; baseline_scores (M, K), y(x'), where the targets were selected on the way."""

    integral: Tensor
    disconnected: Flags
    selected: SelectedTargets
    baseline_scores: Optional[Tensor]


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
        model: ModelSource,
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
        if tolerance is not None:
            tolerance = number_option("tolerance (a relative completeness error)", tolerance, allow_minimum=False)
        if int_option("max_steps", max_steps, 1) < steps:
            raise ValueError(f"max_steps ({max_steps}) must be at least steps ({steps}).")
        self.baseline, self.steps, self.batch_size = baseline, steps, batch_size
        self.rule = RULE_ALIASES.get(rule, rule)
        self.tolerance, self.max_steps = tolerance, int(max_steps)
        self.multiply_by_inputs = bool_option("multiply_by_inputs", multiply_by_inputs)

    def baseline_for(self, batch: Tensor) -> Tensor:
        """The baseline x' for a (N, C, H, W) batch, same shape."""
        return baseline_like(self.baseline, batch)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = self.baseline_for(batch)
        path = self.path_integral(batch, baseline, (target, topk), self.steps)
        integral, disconnected, selected = path.integral, path.disconnected, path.selected
        assert path.baseline_scores is not None, "a path that selects its targets scores its baseline too"
        score_change = selected.scores.double() - path.baseline_scores.double()
        difference = (batch - baseline)[:, None].double()
        steps = torch.full((count,), self.steps, dtype=torch.long)
        while self.tolerance is not None:  # each image's steps doubled until it alone is complete enough
            completeness_error = (difference * integral).sum(dim=(2, 3, 4)) - score_change
            relative = completeness_error.abs() / score_change.abs().clamp_min(1e-12)
            unfinished = (relative > self.tolerance).any(dim=1).cpu() & (2 * steps <= self.max_steps)
            if not bool(unfinished.any()):
                break
            disconnected = flag_values(disconnected)
            images = unfinished.nonzero()[:, 0]
            for doubled in torch.unique(2 * steps[images]).tolist():  # images at the same steps: one pass
                these = images[2 * steps[images] == doubled]
                on_device = these.to(batch.device)
                again = self.path_integral(batch, baseline, selected, doubled, on_device)
                integral[on_device] = again.integral
                disconnected[on_device] = flag_values(again.disconnected)
                steps[these] = doubled
        completeness_error = (difference * integral).sum(dim=(2, 3, 4)) - score_change
        if self.tolerance is None:
            warn_about_incompleteness(self.method_name, completeness_error, score_change, selected.scores, INCOMPLETE,
                                      f"{self.steps} steps", "Use more steps, or tolerance= (which doubles them up to "
                                      f"max_steps where needed). {BASELINE_ADVICE}")
        else:  # the images that reached max_steps without the tolerance
            reached = f"{int(steps.max())} steps (max_steps={self.max_steps}; tolerance={self.tolerance:g} not reached)"
            warn_about_incompleteness(self.method_name, completeness_error, score_change, selected.scores,
                                      self.tolerance, reached, f"Raise max_steps. {BASELINE_ADVICE}")
        attributions = (difference * integral if self.multiply_by_inputs else integral).to(batch.dtype)
        self._disconnected = disconnected
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(integral),
                                     baseline_is_input=lambda: difference.flatten(1).eq(0).all(dim=1),
                                     completeness_error=completeness_error.float(), score_change=score_change.float(),
                                     steps=steps.to(batch.device))

    def path_integral(self, batch: Tensor, baseline: Tensor, targets: SelectedTargets | tuple[Target, Optional[int]],
                      steps: int, images: Optional[Tensor] = None) -> PathIntegral:
        """∫₀¹ ∂y/∂x(x' + α(x − x')) dα by the rule with ``steps`` points, for the ``images`` given (indices
        into the batch; default all). targets: selected already, or (target, topk) to select them on the images'
        forward, which then also scores the baselines: both forwards are rows of the first pass
        (``fold_leading_rows``), or, where they are not, no-grad forwards of their own before it."""
        if images is None:
            images = torch.arange(batch.shape[0], device=batch.device)
        count = len(images)
        nodes, node_weights = integration_nodes(steps, self.rule)
        alphas = torch.as_tensor(nodes, dtype=batch.dtype, device=batch.device)
        weights = torch.as_tensor(node_weights, dtype=torch.float64, device=batch.device)
        position_of_row = torch.arange(count, device=batch.device).repeat_interleave(steps)
        image_of_row = images[position_of_row]
        step_of_row = torch.arange(steps, device=batch.device).repeat(count)
        difference = batch - baseline
        ends: dict[str, Any] = {}  # "selected" targets and "baseline_scores" (N, K), once known
        if isinstance(targets, SelectedTargets):
            ends["selected"] = targets
        target = None if isinstance(targets, SelectedTargets) else targets[0]

        def select(image_output: object, baseline_output: object) -> SelectedTargets:
            assert not isinstance(targets, SelectedTargets), "targets to select"
            ends["selected"] = select_targets(image_output, targets[0], targets[1], batch_size=batch.shape[0])
            ends["baseline_scores"] = ends["selected"].scores_for(baseline_output, images)
            return ends["selected"]

        def weighted_gradients(rows: slice) -> tuple[Tensor, Flags]:  # the rows' terms of the sum, float64
            images_of_rows, steps_of_rows = image_of_row[rows], step_of_row[rows]
            points = baseline[images_of_rows] + alphas[steps_of_rows].view(-1, 1, 1, 1) * difference[images_of_rows]
            gradients: Optional[Tensor] = None
            if "selected" not in ends and fold_leading_rows(self, 2 * count, self.batch_size, batch.device, target,
                                                                  batch.shape[1:].numel()):
                try:  # the images and baselines as the first rows of this pass: they choose and score the targets
                    gradients, unreachable = self.folded_gradients(
                        [batch, baseline], None if self._forward_call is None else images.repeat(2), points,
                        images_of_rows, lambda outputs: select(*outputs))
                except UnsplitOutput:
                    pass  # an output that is not one row per input: its own forwards below
            if gradients is None:
                if "selected" not in ends:
                    with torch.no_grad():
                        select(self.call_model(batch), self.call_model(baseline))
                gradients, unreachable = self.copies_gradients(points, ends["selected"], images_of_rows)
            return gradients.double() * weights[steps_of_rows].view(-1, 1, 1, 1, 1), unreachable

        integral: Optional[Tensor] = None  # (count, K, C, H, W) float64, once K is known
        unreachable_rows: list[tuple[Tensor, Flags]] = []
        for rows, (terms, unreachable) in self.row_passes(len(image_of_row), self.batch_size, batch.device,
                                                          weighted_gradients, batch.shape[1:].numel()):
            if integral is None:
                integral = torch.zeros(count, *terms.shape[1:], dtype=torch.float64, device=batch.device)
            integral.index_add_(0, position_of_row[rows], terms)
            unreachable_rows.append((position_of_row[rows], unreachable))
        assert integral is not None, "steps ≥ 1: at least one pass ran"
        targets_count = integral.shape[1]

        def disconnected() -> Tensor:  # (count, K) bool: the score depends on the input at no point of the path
            flags = torch.ones(count, targets_count, dtype=torch.bool, device=batch.device)
            for positions, unreachable in unreachable_rows:
                flags[positions] &= flag_values(unreachable)
            return flags

        return PathIntegral(integral, disconnected, ends["selected"], ends.get("baseline_scores"))


def sum_per_image(total: Optional[Tensor], values: Tensor, image_of_row: Tensor, count: int) -> Tensor:
    """``total`` (N, ...) float64 (None: zeros) plus the (R, ...) values of rows, row r added to image
    ``image_of_row[r]``."""
    if count == 1:  # every row is the one image's
        part = values.sum(dim=0, keepdim=True, dtype=torch.float64)
        return part if total is None else total.add_(part)
    if total is None:
        total = torch.zeros(count, *values.shape[1:], dtype=torch.float64, device=values.device)
    return total.index_add_(0, image_of_row.to(values.device), values.double())


def every_row(rows: list[tuple[Tensor, Flags]], count: int) -> Callable[[], Tensor]:
    """(N, K) bool, computed when called: where a flag holds for every row of the image. rows: for each pass, the
    image of each row and the (R, K) flags there (or a function that makes them)."""

    def compute() -> Tensor:
        not_holding: Optional[Tensor] = None  # per image, the rows where the flag does not hold
        for image_of_row, flags in rows:
            values = flag_values(flags)
            if not_holding is None:
                not_holding = torch.zeros(count, *values.shape[1:], dtype=torch.long, device=values.device)
            not_holding.index_add_(0, image_of_row.to(values.device), (~values).long())
        assert not_holding is not None, "at least one pass"
        return not_holding == 0

    return compute
