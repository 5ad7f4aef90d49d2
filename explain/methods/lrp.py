"""Layer-wise relevance propagation (Bach et al. 2015; Montavon et al. 2019) with zennit's composites.

During the model's forward pass only, a call-scoped rule (``explain.core.rules``) sees every torch function that the
forward calls and follows the tensors that depend on the input (the relevance path). Each call on that path is
computed exactly as the model computes it, through an autograd function whose backward is the call's LRP rule, so
that ``autograd.grad`` carries relevance instead of gradients:

- convolutions and fully connected layers (``F.conv*d``, ``F.conv_transpose*d``, ``F.linear``): the composite's rule
  (see ``LRP``). A BatchNorm that reads a layer's output directly is folded into that layer's rule, as zennit's
  canonizers (``SequentialMergeBatchNorm``, ``ResNetCanonizer``) do: the folded weights are new tensors, the
  module's parameters are only read;
- BatchNorm otherwise (DenseNet's BatchNorms after a concatenation), ReLU and the other elementwise activations,
  modules or functional calls alike, and elementwise arithmetic with one operand on the path (x·a + b): the
  relevance passes unchanged (zennit's ``Pass``);
- sums of path tensors (ResNet's in-place ``out += identity``, ``torch.add``), average pooling, means and
  interpolation: the relevance is split in proportion to each input's contribution (zennit's ``Norm``; for the
  residual sum, its ResNet canonizer's rule);
- reshaping, slicing, concatenation (DenseNet), max pooling and dropout: the plain gradient routes the relevance
  (a concatenation gives each part the relevance of its channels; max pooling gives it to the maximum).

DenseNet: each dense layer's second BatchNorm reads its first convolution's output and is folded into it; the
BatchNorms that read a concatenation (norm1 of every dense layer, the transitions' and norm5) pass relevance
unchanged, so their scale and shift do not reweight it; the functional ``F.relu`` and ``F.adaptive_avg_pool2d`` at
its end get their rules too. (zennit's composites leave those two functional calls to the plain gradient, and its
``SequentialMergeBatchNorm`` fails on DenseNet: it pairs each layer's last convolution with the next layer's
BatchNorm, whose input is a concatenation.)

A squeeze-and-excitation gate x · σ(W s) (EfficientNet, MobileNetV3, RegNetY): by default (``hold_gates=True``) the
gate (the output of a sigmoid or hard sigmoid, or a view of it) is held constant, a weight of the product, so x keeps
all the relevance and none flows into the gate's branch: the "signal-take-all" rule of LRP for an LSTM's gates (Arras
et al. 2017, "Explaining recurrent neural network predictions in sentiment analysis"), and what AttnLRP does with such
gates. With ``hold_gates=False`` the product has no rule (as in zennit, whose relevance follows the gradient there:
on torchvision's EfficientNet-B0, RegNetY and MobileNetV3 with random weights it overflows or sums to up to 1e17
times the score) and a warning names it.

Anything else on the path (another product of two path tensors, softmax, layer norm, attention) has no rule: the call
is computed plainly, its relevance follows the gradient there, and LRP warns, naming the function and the module (and
AttnLRP or ``hold_gates`` where they cover it). Where a map holds NaN or inf and relevance went through such calls,
the error names them. No module is replaced and nothing is written to the model.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.scope import CallScope
from ..core.targets import Target, select_targets
from ..core.units import BoundUnits
from ..io.loaded_model import ModelSource
from ._lrp_rules import COMPOSITES, Composite, make_composite
from ._lrp_trace import _RelevanceRules, _Trace
from .gradients import GradientExplainer, all_zero
from .maps import Attribution
from .options import bool_option
from .registry import register

__all__ = ["COMPOSITES", "LRP", "Composite", "make_composite"]

VANISHED = 1e-6
"""Relevance at the input below this share of the score's: it vanished on the way (a warning says where)."""

NEAR_EPSILON = 1e3
"""A score below this many times max(epsilon, stabilizer) is small enough that they absorb a visible share of it."""

ABSORBED = 0.1
"""The share of a score near epsilon whose loss is said: less is within what the rules' biases take anyway (random
weights: torchvision's resnet18 ~2 %, timm's resnet10t ~30 %, whatever epsilon is; their scores, far above epsilon,
get no warning), more (timm's efficientnet_b0 with random weights: ~25 %, all of it ε's) changes the map visibly."""


@contextmanager
def names_recorded_below(model: nn.Module, target: Target, *records: dict[str, None]
                         ) -> Iterator[Optional[dict[str, None]]]:
    """For a hidden unit, a dict filled during the forward pass with the names in ``records`` (the calls without a rule,
    gate products) when the unit's layer made its output: the calls after it are above the unit and take no part in
    its relevance. None for other targets, with no scope entered (the usual call stays as cheap as before)."""
    if not isinstance(target, BoundUnits):
        yield None
        return
    below: dict[str, None] = {}

    def at_the_unit(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        for record in records:
            below.update(record)

    with CallScope(model) as scope:
        scope.forward_hook(target.module, at_the_unit)
        yield below


@register
class LRP(GradientExplainer):
    """Layer-wise relevance propagation (Bach et al. 2015) with zennit's composites (Montavon et al. 2019): the score
    is redistributed backwards layer by layer, each layer by its rule, down to the input pixels. Equal to zennit 0.5
    with its canonizers (BatchNorm folded into the preceding layer, ResNet's residual sums split in proportion).

    composite: which rule each layer gets, named as zennit names its composites ("epsilon_gamma_box" or
        "EpsilonGammaBox"; case, "_" and "-" do not matter):
        "epsilon_gamma_box" (default): z^B for the first convolution, γ for the other convolutions, ε for the fully
            connected layers;
        "epsilon_plus": z⁺ for convolutions, ε for fully connected layers;
        "epsilon_alpha2_beta1": α2β1 for convolutions, ε for fully connected layers;
        "epsilon_plus_flat", "epsilon_alpha2_beta1_flat": the same, with the flat rule for the first layer.
        Elementwise activations and unfolded BatchNorms pass relevance unchanged; residual sums, average pooling
        and means split it in proportion to the contributions (see ``explain.methods.lrp``).
    epsilon: ε of the ε rule (fully connected layers).
    gamma: γ of the γ rule (convolutions, "epsilon_gamma_box").
    stabilizer: the small ε that keeps the other rules' divisions finite (zennit's ``stabilizer``).
    low, high: the z^B rule's box of model-input values: floats, one value per channel, or tensors that broadcast to
        the input; None: the preprocess's normalisation of pixels in [0, 1] (with the default ImageNet ``Normalize``,
        low = −mean/std and high = (1 − mean)/std per channel). A warning says when an input lies outside.
    reduce: how the (N, K, C, H, W) relevance becomes a map: "sumabs" (default) Σ_c |R_c|; "sum" Σ_c R_c, the signed
        relevance of each pixel (the maps then lie in [−1, 1]); or "maxabs".
    hold_gates: True (default): hold each squeeze-and-excitation gate (a sigmoid's or hard sigmoid's output times a
        tensor that is not one) constant, so that the gated tensor keeps all the relevance (see
        ``explain.methods.lrp``); False: such a product has no rule, and a warning names it.

    The relevance starts at the model's output as output ⊙ ∂score/∂output: for a class target, the logit of that
    class (zennit's attributor given one-hot × output). For a hidden unit (``explain.Neuron``, ``explain.Channel``)
    it starts at its layer's output z as z ⊙ ∂score/∂z (a neuron: its value there, 0 elsewhere; a channel's mean:
    z_c,p / positions), which sums to the unit's value, and only the rules of the layers below it apply (as CRP and
    zennit start at an intermediate layer). ``Explanation.attributions`` (N, K, C, H, W) is the relevance
    at the input. ``Explanation.diagnostics``: "relevance_sum" (N, K) Σ input relevance; "output_relevance" (N, K)
    the relevance the propagation started from (the score, for class targets); "conservation_error" (N, K) their
    difference: what the biases, ε and the stabilisers absorbed (these three float64 whatever the model's precision);
    "layers" the calls with a redistributing rule in forward order, with "layer_output_relevance" and
    "layer_input_relevance" (N, K, L), the relevance each received and passed on (float64); "unruled" the calls on
    the input's path that have no LRP rule (a warning names them). A warning says when the relevance vanished on the
    way, and when a score within 1e3 × max(epsilon, stabilizer) lost more than a tenth of it (ε's share; not where
    calls without a rule changed the sum: their warning says so).

    One difference from zennit: its folded BatchNorm still computes x / √(1 + eps), not x, so zennit explains a
    slightly rescaled model (~1e-4 apart after resnet18's 20 BatchNorms); here the model is computed as it is.
    """

    name = "lrp"
    summary = "LRP: the score redistributed layer by layer with zennit's rule composites (z^B-γ-ε by default)"

    def __init__(
        self,
        model: ModelSource,
        composite: str = "epsilon_gamma_box",
        *,
        epsilon: float = 1e-6,
        gamma: float = 0.25,
        stabilizer: float = 1e-6,
        low: Union[float, Sequence[float], Tensor, None] = None,
        high: Union[float, Sequence[float], Tensor, None] = None,
        reduce: str = "sumabs",
        hold_gates: bool = True,
        **options: Any,
    ):
        super().__init__(model, reduce=reduce, **options)
        self.hold_gates = bool_option("hold_gates", hold_gates)
        for label, value in (("epsilon", epsilon), ("stabilizer", stabilizer), ("gamma", gamma)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{label} must be a non-negative number; got {value!r}.")
        self.composite = make_composite(composite, float(epsilon), float(gamma), float(stabilizer))
        self.epsilon, self.stabilizer = float(epsilon), float(stabilizer)
        self.low, self.high = self._box(low, high)

    def _box(self, low: Any, high: Any) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The z^B box as float64 tensors (None when the composite has no z^B rule)."""
        if self.composite.first != "zbox":
            return None, None
        if (low is None) != (high is None):
            raise ValueError("give both low and high, or neither.")
        if low is None:
            mean, std = getattr(self.preprocess, "mean", None), getattr(self.preprocess, "std", None)
            if mean is None or std is None:
                raise ValueError(
                    f"the {self.composite.name} composite's z^B rule needs the box of the model's input values: pass "
                    "low= and high= (one value per channel, in model-input units), or a preprocess with mean and std "
                    "(such as explain.Normalize), or choose composite='epsilon_plus'."
                )
            mean = torch.as_tensor(mean, dtype=torch.float64).flatten()
            std = torch.as_tensor(std, dtype=torch.float64).flatten()
            return (0 - mean) / std, (1 - mean) / std
        low = torch.as_tensor(low, dtype=torch.float64)
        high = torch.as_tensor(high, dtype=torch.float64)
        if not bool((low <= high).all()):
            raise ValueError("low must not exceed high.")
        return low, high

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        trace = _Trace(self.composite, self.stabilizer, self.low, self.high, self.hold_gates)
        with torch.enable_grad():
            inputs = batch.detach().requires_grad_(True)
            # the rules act on the forward only; autograd keeps them
            with _RelevanceRules(self.model, trace), \
                    names_recorded_below(self.model, target, trace.unruled, trace.gate_products) as below:
                trace.follow(inputs)
                output = self.call_model(inputs)
            if below is not None:  # a hidden unit: the calls above its layer take no part in its relevance
                trace.unruled = {name: None for name in trace.unruled if name in below}
                trace.gate_products = {name: None for name in trace.gate_products if name in below}
            problems = trace.gaps(output)
            if isinstance(target, BoundUnits):  # a hidden unit: the relevance starts at its layer's output
                target.read_through(output, lambda z: trace.start(z) if z.is_floating_point() else z)
            else:
                output = trace.start(output)
            selected = select_targets(output, target, topk, batch_size=count)
            targets = selected.scores.shape[1]
            relevances, disconnected = [], []
            for k in range(targets):
                trace.passes.index = k
                score = selected.scores[:, k].sum()
                relevance = None
                if score.requires_grad:
                    (relevance,) = torch.autograd.grad(score, inputs, retain_graph=k < targets - 1, allow_unused=True)
                relevances.append(torch.zeros_like(inputs) if relevance is None else relevance)
                disconnected.append(torch.full((count,), relevance is None, dtype=torch.bool, device=batch.device))
        attributions = torch.stack(relevances, dim=1)
        selected.scores = selected.scores.detach()
        self._disconnected = torch.stack(disconnected, dim=1)
        relevance_sum = attributions.detach().double().flatten(2).sum(dim=2).cpu()
        non_finite = ~torch.isfinite(relevance_sum)  # float32 relevance sums overflow in float64 only if inf or NaN
        if trace.unruled and bool(non_finite.any()):
            raise trace.non_finite_error(non_finite.nonzero().tolist(), self.method_name, attributions.dtype)
        trace.warn_about_gaps(output, self.method_name, problems)
        output_relevance = trace.output_relevance(count, targets)
        layers = trace.layer_diagnostics(count, targets)
        scored = output_relevance != 0
        kept = relevance_sum / output_relevance.where(scored, torch.ones_like(output_relevance))  # share at the input
        vanished = scored & (kept.abs() <= VANISHED)
        masked_pass = getattr(self._thread_state, "empty_maps_expected", False)  # CRP's: loses relevance by design
        empty = all_zero(attributions)
        attribution = self.attribution_from(
            attributions, selected, zero_gradient=lambda: empty() & ~vanished.to(attributions.device),
            relevance_sum=relevance_sum, output_relevance=output_relevance,
            conservation_error=relevance_sum - output_relevance, **layers,
        )
        if bool(vanished.any()):
            reason = self._vanished_reason(vanished, relevance_sum, output_relevance, layers)
            attribution.empty_reason = reason  # the maps that are all zero: their warning says why
            # maps that are all zero in float32 (as a float64 remnant of 1e-60 is) get the empty-map warning
            nonzero = vanished & ~all_zero(attributions.float())().cpu()
            if bool(nonzero.any()) and not masked_pass:
                pairs = ", ".join(f"({n}, {k})" for n, k in nonzero.nonzero().tolist()[:8])
                warn_at_callers_line(f"{self.method_name}: the maps of (image, target) {pairs} hold almost no "
                                     f"relevance: {reason}.", RuntimeWarning)
        if not masked_pass and not trace.unruled:  # with calls without a rule, their warning says why it changed
            self._warn_if_epsilon_absorbed(kept, output_relevance, scored & ~vanished)
        return attribution

    def _warn_if_epsilon_absorbed(self, kept: Tensor, output_relevance: Tensor, checked: Tensor) -> None:
        """A warning where a score within ``NEAR_EPSILON`` × max(epsilon, stabilizer) lost more than ``ABSORBED`` of
        its relevance on the way to the input: at such a score ε and the stabiliser take that share, so the map shows
        only what they left. kept: (N, K) the share of each score's relevance that reached the input; checked: the
        (N, K) to check (scored, and not vanished, which has its own warning)."""
        small = max(self.epsilon, self.stabilizer)
        absorbed = checked & (output_relevance.abs() < NEAR_EPSILON * small) & (kept < 1 - ABSORBED)
        if not bool(absorbed.any()):
            return
        found = absorbed.nonzero().tolist()
        pairs = ", ".join(f"({n}, {k})" for n, k in found[:8]) + (" …" if len(found) > 8 else "")
        n, k = found[0]
        warn_at_callers_line(
            f"{self.method_name}: the maps of (image, target) {pairs} lost a large share of their relevance on the "
            f"way to the input (image {n}, target {k}: {1 - float(kept[n, k]):.0%} of the score's "
            f"{float(output_relevance[n, k]):.3g}; diagnostics['conservation_error']). The score is within "
            f"{NEAR_EPSILON:g}× epsilon={self.epsilon:g} / stabilizer={self.stabilizer:g}, which then likely absorb "
            "a visible share of it at each layer (as in EfficientNet and MobileNet with random weights, whose "
            "activations are tiny), so the map shows only what they left; the rules' biases take a share too, and "
            "a rerun with smaller epsilon= and stabilizer= (e.g. 1e-30) tells which. Load trained weights, or pass "
            "those smaller values.", RuntimeWarning)

    def _vanished_reason(self, vanished: Tensor, relevance_sum: Tensor, output_relevance: Tensor,
                         layers: dict[str, Any]) -> str:
        """Why the relevance of the first vanished (image, target) did not reach the input: the first layer of the
        backward pass that passed on less than 1e-3 of what it received, and what to do."""
        n, k = vanished.nonzero()[0].tolist()
        received, sent = layers["layer_output_relevance"][n, k], layers["layer_input_relevance"][n, k]
        shares = (sent.abs() / received.abs()).nan_to_num(nan=1.0, posinf=1.0)
        where, small = "", max(self.epsilon, self.stabilizer)
        tiny = float(output_relevance[n, k].abs()) < NEAR_EPSILON * small  # a score ε absorbs a visible share of
        losing = (shares < 1e-3).nonzero()
        if len(losing):  # the last in forward order: where the backward pass first lost it
            index = int(losing[-1])
            tiny |= float(received[index].abs()) < NEAR_EPSILON * small
            where = (f"; {layers['layers'][index]} passed on {float(shares[index]):.2g} of the relevance it received "
                     f"({float(received[index]):.3g} → {float(sent[index]):.3g})")
        cause = (f"The model's activations are far smaller than epsilon={self.epsilon:g} and "
                 f"stabilizer={self.stabilizer:g}, which then absorb the relevance (as in torchvision's EfficientNet "
                 "and MobileNet with random weights, whose depthwise convolutions are initialised so small that the "
                 "activations shrink ~100× per stage; zennit gives the same). Load trained weights, or pass smaller "
                 "epsilon= and stabilizer= (e.g. 1e-30)") if tiny else (
                 "The rules' biases and stabilisers, or calls without a rule, lost it: the map does not show where "
                 "the score comes from")
        return (f"the relevance vanished on its way to the input (image {n}, target {k}: the score's relevance is "
                f"{float(output_relevance[n, k]):.3g}, the input's {float(relevance_sum[n, k]):.3g}{where}). "
                + cause)
