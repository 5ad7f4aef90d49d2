"""AttnLRP (Achtibat et al., ICML 2024): layer-wise relevance propagation for transformers in one forward and one
backward pass per target, as input × a modified gradient (see ``explain.methods._attnlrp_rules`` for the rules).

Same results as lxt 2.x (its "efficient" gradient × input mode, with zennit's γ rule for the linear layers when
``linear_gamma`` / ``conv_gamma`` are given; but for lxt's ε in the identity rule's y / (x + ε), left out where y(0) = 0
and given x's sign elsewhere, ``_attnlrp_rules.identity_divisor``: ~1e-9 apart on a small DINOv2), without patching
any module: the rules act on this call's forward pass
only, through fused attention kernels too (only the query, key and value gradients are rescaled, so no
(N, heads, T, T) matrix is made), on any model built from torch functions: ViT, DeiT, DINOv2 with registers, CLIP and
SigLIP towers, Swin's window attention, hybrids with convolutional stems, and CNNs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from ..core.targets import Target, select_targets
from ..io.loaded_model import ModelSource
from ._attnlrp_rules import AttnLrpRules, AttnLrpScope
from .gradients import GradientExplainer, all_zero
from .lrp import names_recorded_below
from .maps import Attribution
from .options import bool_option, number_option
from .registry import register
from .signatures import ExplainerOptions


def _gamma_option(value: Any, label: str) -> Optional[float]:
    return None if value is None else number_option(label, value)


@register
class AttnLRP(GradientExplainer):
    """AttnLRP (Achtibat et al. 2024): the score's relevance propagated to the input pixels with LRP rules for
    attention (softmax, the products QKᵀ and A·V), normalisation and activations, computed as the input times a
    modified gradient in one backward pass per target.

    conservative: CP-LRP (Ali et al. 2022): no relevance through the softmax; the attention weights are held constant.
    linear_gamma: γ of LRP-γ for the linear layers (None or 0: LRP-0, the plain gradient, as lxt without zennit).
    conv_gamma: γ of LRP-γ for the convolutions (a ViT's patch embedding, a hybrid's stem; None or 0: LRP-0).
    reduce: how the (N, K, C, H, W) relevance becomes a map: "sumabs" (default, Σ_c |R_c|, maps in [0, 1]; on
        both shipped transformers it localises far better than the signed sum, see benchmarks/RESULTS.md, "AttnLRP
        settings"), "sum" (the signed relevance of each pixel, maps in [−1, 1]) or "maxabs".

    The relevance starts at the score (for a class, its logit); for a hidden unit (``explain.Neuron``,
    ``explain.Channel``) at its layer's output z as z ⊙ ∂score/∂z, which sums to the unit's value.
    ``Explanation.attributions`` (N, K, C, H, W) is the relevance at the input. ``Explanation.diagnostics``:
    "relevance_sum" (N, K) Σ input relevance; "output_relevance" (N, K) the score; "conservation_error" (N, K) their
    difference (what the biases took: LRP-0 gives each bias its share; and the constant y(0) of an activation with
    y(0) ≠ 0 used otherwise than as a gate), all three float64 whatever the model's precision; "rules" how many
    calls each rule was applied to, as "name: count" ("uniform", "gate" (a product whose sigmoid-like gate was held
    constant), "softmax", "attention", "norm", "identity", "shifted identity" (the identity rule of y − y(0), for
    sigmoid, hard sigmoid, softplus, exp), "linear", "convolution", "gamma"); "unruled" the calls on the input's
    path without a rule (a warning names them).

    CNNs with squeeze-and-excitation gates (EfficientNet, MobileNetV3, RegNetY; x · σ(W s)): the gate is held
    constant, so the gated features keep all the relevance and none flows through the gate's branch (see
    ``explain.methods._attnlrp_rules``).
    """

    name = "attnlrp"
    summary = "AttnLRP: LRP for transformers (attention, norms, GELU) in one backward pass, through fused attention"

    def __init__(self, model: ModelSource, *, conservative: bool = False, linear_gamma: Optional[float] = None,
                 conv_gamma: Optional[float] = None, reduce: str = "sumabs", **options: Unpack[ExplainerOptions]):
        super().__init__(model, reduce=reduce, **options)
        self.conservative = bool_option("conservative", conservative)
        self.linear_gamma = _gamma_option(linear_gamma, "linear_gamma")
        self.conv_gamma = _gamma_option(conv_gamma, "conv_gamma")

    def rules(self) -> AttnLrpRules:
        """The rules of one call."""
        return AttnLrpRules(self.model, conservative=self.conservative, linear_gamma=self.linear_gamma,
                            conv_gamma=self.conv_gamma)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        rules = self.rules()
        with torch.enable_grad():
            inputs = batch.detach().requires_grad_(True)
            # the rules act on the forward only; autograd keeps them
            # a hidden unit: the modified gradient at its layer's output z is ∂score/∂z, so the relevance there is
            # z ⊙ ∂score/∂z and only the rules below it apply; only the calls below it are warned of
            with AttnLrpScope(self.model, rules), names_recorded_below(self.model, target, rules.unruled) as below:
                rules.follow(inputs)
                output = self.call_model(inputs)
                # the score too: a cosine similarity to a reference holds the embedding's norm constant
                selected = select_targets(output, target, topk, batch_size=count)
            if below is not None:  # a hidden unit: the calls above its layer take no part in its relevance
                rules.unruled = {name: None for name in rules.unruled if name in below}
            self._warn_about_gaps(rules)
            targets = selected.scores.shape[1]
            relevances, disconnected = [], []
            for k in range(targets):
                score = selected.scores[:, k].sum()
                gradient = None
                if score.requires_grad:
                    (gradient,) = torch.autograd.grad(score, inputs, retain_graph=k < targets - 1, allow_unused=True)
                relevances.append(torch.zeros_like(inputs) if gradient is None else inputs.detach() * gradient)
                disconnected.append(torch.full((count,), gradient is None, dtype=torch.bool, device=batch.device))
        attributions = torch.stack(relevances, dim=1)
        selected.scores = selected.scores.detach()
        self._disconnected = torch.stack(disconnected, dim=1)
        relevance_sum = attributions.detach().double().flatten(2).sum(dim=2).cpu()
        output_relevance = selected.scores.double().cpu()
        return self.attribution_from(
            attributions, selected, zero_gradient=all_zero(attributions), relevance_sum=relevance_sum,
            output_relevance=output_relevance, conservation_error=relevance_sum - output_relevance,
            rules=[f"{rule}: {count}" for rule, count in sorted(rules.applied.items())], unruled=list(rules.unruled),
        )

    def _warn_about_gaps(self, rules: AttnLrpRules) -> None:
        if not rules.unruled:
            return
        names = list(rules.unruled)
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        warn_at_callers_line(
            f"{self.method_name}: no AttnLRP rule for {listed} on the input's path: there the relevance follows the "
            "plain gradient, so relevance is not conserved there (rules cover attention, softmax, products, norms, "
            "elementwise activations, linear layers, convolutions, sums, pooling and reshaping).", RuntimeWarning)
