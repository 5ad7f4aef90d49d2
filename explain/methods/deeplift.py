"""DeepLIFT with the rescale rule (Shrikumar et al. 2017) and DeepLIFT-SHAP.

The model runs twice with the same call-scoped rule (``explain.core.rules``) active: on the baselines x'
first, then on the images x. The rule follows the tensors that depend on the input through every
torch function the forward calls and pairs each such call of the images' forward with the same call
of the baselines' forward (the same function, in the same order, on tensors of the same shapes), so
each element of an input z meets its own reference value z' whatever the layout: batch first,
sequence first, heads folded into the batch. A call whose inputs do not depend on the input (a
parameter, a constant: ``softplus(temperature)``, ``logit_scale.exp()``) is computed plainly, its
gradient being exact there. On the images' forward each call gets its DeepLIFT rule:

- an elementwise nonlinearity y = f(z) (every activation torch has, in functional, module,
  ``Tensor`` method and in-place forms, also ``exp``, ``sqrt``, ``pow``, ``clamp``, ...): the
  rescale rule, multiplier Δy/Δz = (f(z) − f(z'))/(z − z') (f'(z) where |Δz| < eps);
- a product of two tensors that both depend on the input (``a * b``, ``a @ b``, ``einsum``:
  squeeze-excitation gates, attention): Δ(ab) = Δa·b̄ + ā·Δb with ā = (a + a')/2, which is exact;
  a quotient a / b likewise, with 1/b by the rescale rule;
- max pooling and max/min over dimensions: the pair of maxima's rule;
- softmax, log-softmax: exp by the rescale rule, its sum, the reciprocal by the rescale rule,
  the product as above, with a shift shared by x and x';
- layer, group, RMS and instance normalisation, attention (``scaled_dot_product_attention``,
  ``nn.MultiheadAttention``), ``glu``, ``normalize`` and p-norms: computed step by step, each
  step by its rule; a normalisation's last step, y = c · r (centred values times r = 1/σ), gets
  Δy = Δc · r + c' · Δr where r ≤ r', Δy = Δc · r' + c · Δr elsewhere (exact, and free of the
  baseline's 1/√eps where its tokens are constant across channels, as the zero baseline's are);
- linear functions (convolutions, linear layers, BatchNorm in eval mode, sums, pooling by
  averages, reshaping, indexing): their own gradient, which is exact.

``autograd.grad`` then gives the multipliers m at the input, and the attributions (x − x') ⊙ m sum
to y(x) − y(x') ("summation to delta"). A nonlinear function that gets no rule (``sort``,
``logsumexp``, a ``where`` whose condition depends on the input, ...) keeps its plain gradient and
is named in one warning per call, as the summation may then fail there. No module is replaced.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar, Iterator, Optional, Union

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from ..core.targets import SelectedTargets, Target, select_targets
from ..io.loaded_model import ModelSource
from ._deeplift_rules import deeplift_rules, detached_output
from .expected_gradients import check_references, references_for
from .gradients import GradientExplainer, GradientOptions, all_zero, baseline_like
from .maps import Attribution
from .options import number_option
from .passes import checked_batch_size
from .registry import register

# ------------------------------------------------------------------ the methods


@contextlib.contextmanager
def checkpoints_refused(method: str) -> Iterator[None]:
    """Within the block, a non-reentrant ``torch.utils.checkpoint`` in the model raises, saying why: it recomputes its
    block during the backward pass with the model's plain functions and hands their saved tensors to DeepLIFT's rules
    (SiLU's input as the multipliers: attributions that do not sum to the score change, or torch's CheckpointError).
    Where the caller's own saved-tensor hooks are active (``torch.autograd.graph.save_on_cpu``), they are left so."""
    scope = contextlib.ExitStack()
    try:
        scope.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(
            f"{method} cannot follow the model through torch.utils.checkpoint: the model's forward calls it (timm's "
            "and HuggingFace's checkpointing flags are switched off during a call already), and a checkpoint "
            "recomputes its block during the backward pass without DeepLIFT's rules. Call the block without "
            "checkpoint while explaining, or explain with IntegratedGradients."))
    except RuntimeError:  # hooks of the caller's are active: disabling them would refuse the caller's own
        pass
    with scope:
        yield


@register
class DeepLift(GradientExplainer):
    """DeepLIFT, rescale rule (Shrikumar et al. 2017): (x − x') ⊙ the multipliers of the score,
    back-propagated with Δy/Δz in place of each nonlinearity's derivative (see the module's
    docstring for the rule each kind of function gets).

    baseline: "zeros" (default), "blur" or a tensor broadcastable to the batch (see
        IntegratedGradients). eps: |Δz| below which the ordinary derivative is used.
    ``Explanation.diagnostics["summation_error"]`` (N, K) is Σ attributions − (y(x) − y(x')),
    zero up to rounding where every nonlinear function got its rule; ``["score_change"]`` is
    y(x) − y(x'). A ``RuntimeWarning`` names the functions that got none, another says where the
    attributions do not sum to the score change although every function had its rule (multipliers grown
    through the layers against a degenerate baseline), and attributions that overflow raise.
    The model runs on the baselines, then on the images; the targets (top-1, top-k) and scores come
    from the images' forward. A model whose rows depend on each other in eval mode (batch
    statistics computed inside its forward) has no per-image DeepLIFT.
    """

    name = "deeplift"
    summary = "DeepLIFT: differences from a baseline propagated with the rescale rule (sums to the score change)"

    def __init__(self, model: ModelSource, *, baseline: Union[str, Tensor] = "zeros", eps: float = 1e-10,
                 **options: Unpack[GradientOptions]):
        super().__init__(model, **options)
        baseline_like(baseline, None)  # validates
        self.baseline, self.eps = baseline, number_option("eps", eps)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = baseline_like(self.baseline, batch)
        unruled: dict[str, str] = {}
        attributions, score_change, disconnected, selected = self.rescaled(
            batch, baseline, (target, topk), torch.arange(count, device=batch.device), unruled)
        self.warn_about_unruled(unruled)
        self._disconnected = disconnected
        summation_error = attributions.double().sum(dim=(2, 3, 4)) - score_change
        self.check_summation(attributions, summation_error, score_change, selected.scores, unruled)
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(attributions),
                                     baseline_is_input=lambda: batch.eq(baseline).flatten(1).all(dim=1),
                                     summation_error=summation_error.float(), score_change=score_change.float())

    def rescaled(self, inputs: Tensor, baselines: Tensor, targets: SelectedTargets | tuple[Target, Optional[int]],
                 image_of_row: Tensor, unruled: dict[str, str]) -> tuple[Tensor, Tensor, Tensor, SelectedTargets]:
        """DeepLIFT of R rows against their own baselines, row r being a copy of image
        ``image_of_row[r]``: ((R, K, C, H, W) attributions, (R, K) y(x) − y(x') in float64,
        (R, K) bool where the score does not depend on the input, the targets). targets: selected
        already, or (target, topk) to select on the images' forward (R = N images). ``unruled``
        gets the functions that had no rule, with why."""
        rows = len(inputs)
        module_names = {id(module): name for name, module in self.model.named_modules()}
        # both forwards with a graph alike (models take other paths without one)
        with torch.enable_grad(), checkpoints_refused(self.method_name):
            images = inputs.detach().requires_grad_(True)
            references = baselines.detach().requires_grad_(True)
            with deeplift_rules(self.eps, module_names) as rules:
                rules.follow(references)
                reference_output = rules.explain_next(self.call_model(references, rows=image_of_row))
                rules.follow(images)
                output = self.call_model(images, rows=image_of_row)
                rules.check_paired()
            unruled.update(rules.unruled)
            if isinstance(targets, SelectedTargets):
                selected = targets
            else:
                selected = select_targets(detached_output(output), *targets, batch_size=rows)
            scores = selected.scores_for(output, image_of_row)  # (R, K)
            with torch.no_grad():
                reference_scores = selected.scores_for(reference_output, image_of_row)
            multipliers, disconnected = [], []
            for k in range(scores.shape[1]):
                gradient = None
                if scores.requires_grad:
                    (gradient,) = torch.autograd.grad(scores[:, k].sum(), images,
                                                      retain_graph=k < scores.shape[1] - 1, allow_unused=True)
                multipliers.append(torch.zeros_like(inputs) if gradient is None else gradient)
                disconnected.append(torch.full((rows,), gradient is None, dtype=torch.bool, device=inputs.device))
        score_change = (scores.detach() - reference_scores).double()
        attributions = (inputs - baselines)[:, None] * torch.stack(multipliers, dim=1)
        return attributions, score_change, torch.stack(disconnected, dim=1), selected

    def warn_about_unruled(self, unruled: dict[str, str]) -> None:
        """One warning naming the nonlinear functions on the input's path that had no DeepLIFT rule."""
        if not unruled:
            return
        named = [f"{name} ({why})" for name, why in unruled.items()]
        listed = "; ".join(named[:6]) + (f"; and {len(named) - 6} more" if len(named) > 6 else "")
        warn_at_callers_line(
            f"{self.method_name}: no DeepLIFT rule for {listed}. There the multipliers are the plain gradient, so "
            "the attributions need not sum to y(x) − y(x′) (diagnostics['summation_error'] says by how much).",
            RuntimeWarning)

    def check_summation(self, attributions: Tensor, summation_error: Tensor, score_change: Tensor, scores: Tensor,
                        unruled: dict[str, str]) -> None:
        """Raise where the attributions overflowed although the scores did not, and warn where they do not sum
        to y(x) − y(x′) although every function got its rule: DeepLIFT's multipliers then grew through the
        layers until rounding (or the float range) lost the score change, as they can where the baseline's
        activations are degenerate (tokens constant across channels divided by a norm computed by hand,
        ``x / x.std()``: the rule of quotients then multiplies by the baseline's huge 1/σ')."""
        advice = ("A baseline that is not constant across channels (baseline='blur', the data mean, or "
                  "DeepLiftShap with real images as baselines) avoids this, as does IntegratedGradients.")
        overflowed = ~torch.isfinite(attributions).flatten(2).all(dim=2) & torch.isfinite(score_change)
        if overflowed.any():
            pairs = ", ".join(f"image {n}, target {k}: y(x) − y(x′) = {score_change[n, k].item():.3g}"
                              for n, k in overflowed.nonzero().tolist()[:6])
            raise ValueError(
                f"{self.method_name}: the attributions hold NaN or inf ({pairs}) although the model's scores are "
                "finite: DeepLIFT's multipliers, not the model, overflowed, growing from layer to layer against "
                f"this baseline. {advice}")
        if unruled:
            return  # the warning about the functions without a rule says already that the summation may fail
        epsilon = torch.finfo(attributions.dtype).eps
        # rounding: float32 scores of ~1000 differ by ulps of 1000, whatever Δ; |y(x)| + |Δ| bounds |y(x′)| too
        magnitude = (scores.detach().double().abs().to(score_change.device) + score_change.abs()).clamp_min(1)
        tolerance = torch.maximum(1e-2 * score_change.abs(), 1e3 * epsilon * magnitude)
        wrong = summation_error.abs() > tolerance
        if wrong.any():
            pairs = ", ".join(f"image {n}, target {k}: the attributions sum to "
                              f"{(summation_error[n, k] + score_change[n, k]).item():.3g}, y(x) − y(x′) = "
                              f"{score_change[n, k].item():.3g}" for n, k in wrong.nonzero().tolist()[:6])
            warn_at_callers_line(
                f"{self.method_name}: the attributions do not sum to the score change ({pairs}; "
                "diagnostics['summation_error']): DeepLIFT's multipliers grew from layer to layer against this "
                f"baseline until rounding lost the score change, so the map is not to be trusted. {advice}",
                RuntimeWarning)


@register
class DeepLiftShap(DeepLift):
    """DeepLIFT-SHAP (Lundberg & Lee 2017): the mean of DeepLIFT attributions over a distribution
    of baselines.

    baselines: (B, C, H, W) reference inputs (e.g. a batch of training images, preprocessed);
        every image is explained against each of them and the attributions averaged. None:
        the zero input alone (then this equals DeepLift).
    batch_size: image-baseline pairs per forward/backward pass;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``diagnostics["summation_error"]``: Σ attributions − mean over baselines of (y(x) − y(b)).
    """

    name = "deepliftshap"
    summary = "DeepLIFT-SHAP: DeepLIFT averaged over a distribution of baselines"

    not_options: ClassVar[tuple[str, ...]] = ("baseline",)
    """DeepLift's single baseline is replaced by ``baselines``."""

    def __init__(self, model: ModelSource, baselines: Optional[Tensor] = None, *, eps: float = 1e-10,
                 batch_size: Optional[int] = None, **options: Unpack[GradientOptions]):
        check_references(baselines)
        checked_batch_size(batch_size)
        super().__init__(model, eps=eps, **options)
        self.baselines, self.batch_size = baselines, batch_size

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
        baselines = references_for(self.baselines, batch)
        pairs = torch.cartesian_prod(torch.arange(count), torch.arange(len(baselines))).to(batch.device)
        total = torch.zeros(count, selected.scores.shape[1], *batch.shape[1:], dtype=torch.float64,
                            device=batch.device)
        change = torch.zeros(count, selected.scores.shape[1], dtype=torch.float64, device=batch.device)
        disconnected = torch.ones(count, selected.scores.shape[1], dtype=torch.bool, device=batch.device)
        unruled: dict[str, str] = {}

        def pair_attributions(rows: slice) -> tuple[Tensor, Tensor, Tensor]:
            images, references = pairs[rows].unbind(1)
            attributions, score_change, unreachable, _ = self.rescaled(batch[images], baselines[references],
                                                                       selected, images, unruled)
            return attributions.double(), score_change, unreachable

        for rows, (attributions, score_change, unreachable) in self.row_passes(len(pairs), self.batch_size,
                                                                               batch.device, pair_attributions,
                                                                               batch.shape[1:].numel()):
            images = pairs[rows, 0]
            total.index_add_(0, images, attributions)
            change.index_add_(0, images, score_change)
            disconnected[images] &= unreachable
        self.warn_about_unruled(unruled)
        attributions = (total / len(baselines)).to(batch.dtype)
        score_change = change / len(baselines)
        self._disconnected = disconnected
        summation_error = attributions.double().sum(dim=(2, 3, 4)) - score_change
        self.check_summation(attributions, summation_error, score_change, selected.scores, unruled)
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(attributions),
                                     summation_error=summation_error.float(), score_change=score_change.float())
