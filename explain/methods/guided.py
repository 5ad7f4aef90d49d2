"""Guided backpropagation, deconvnet and Guided Grad-CAM: ReLUs with a rewritten backward pass.

During a call only, a call-scoped rule (``explain.core.rules``) reroutes every ReLU
of the forward pass through an autograd function with the method's backward
rule. It catches ``nn.ReLU`` modules (in place or not, reused or not) and the
functional calls ``F.relu``, ``torch.relu``, ``Tensor.relu`` and their in-place
variants inside ``forward``; no module of the model is replaced. (Libraries that
only swap ``nn.ReLU`` modules silently return the plain gradient for a model
that calls ``F.relu``.) ``clamp(min=0)`` and other non-ReLU spellings are not caught.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from ..core.capture import LayerSpec, find_layers
from ..core.rules import CallRules, Rule, function_name, torch_functions
from ..core.scope import CallScope
from ..core.targets import Target
from ..io.loaded_model import ModelSource
from .base import PerThread
from .cam import CAM, GradCAM
from .gradients import GradientExplainer, GradientOptions, all_zero, reduce_channels
from .maps import Attribution, Flags, flags_of, upsample_maps
from .registry import register

RULES = ("guided", "deconvnet")


class RectifierWithRule(torch.autograd.Function):
    """ReLU forward; backward by a rule: "guided" passes grad⁺ where the input was positive,
    "deconvnet" passes grad⁺ everywhere (the forward input's sign is ignored).

    It saves what torch's ReLU saves, its output (positive exactly where the input was), so that a
    model that runs with torch's ReLU runs with this one, and ``torch.utils.checkpoint``, which
    recomputes a block with the plain ReLU during the backward pass, hands back the same tensor."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, rule: str, in_place: bool) -> Tensor:
        ctx.rule = rule
        if in_place:
            ctx.mark_dirty(inputs)
            rectified = inputs.clamp_(min=0)
        else:
            rectified = inputs.clamp(min=0)
        ctx.save_for_backward(rectified)
        return rectified

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor, None, None]:
        (grad_output,) = grad_outputs  # one output, one gradient
        (rectified,) = ctx.saved_tensors
        positive_grad = grad_output.clamp(min=0)
        if ctx.rule == "guided":
            positive_grad = positive_grad * (rectified > 0)
        return positive_grad, None, None


OTHER_ACTIVATIONS = torch_functions(
    "gelu", "silu", "silu_", "mish", "hardswish", "hardswish_", "hardtanh", "hardtanh_", "relu6", "elu", "elu_",
    "selu", "selu_", "celu", "celu_", "leaky_relu", "leaky_relu_", "prelu", "rrelu", "rrelu_", "softplus", "glu",
    "threshold", "threshold_", "tanhshrink", "hardshrink", "softshrink")
"""Activations that take a ReLU's place, whose backward pass the rules leave plain: counted, for the warning about a
map guided only at the ReLUs (MobileNetV3's hardswish, EfficientNet's SiLU, a transformer's GELU). Squashing
functions (sigmoid, tanh, hard-sigmoid) are not counted: a ReLU network uses them as gates (squeeze-and-excitation)
or at its output, where the papers' rule, defined at ReLUs, leaves them plain too."""


class RectifierRule(Rule):
    """Every ReLU (``F.relu``, ``torch.relu``, ``Tensor.relu`` and their in-place forms, which
    ``nn.ReLU`` modules call) back-propagates by ``rule``; ``calls`` counts the ReLUs rerouted,
    ``others`` the calls of other activations (``OTHER_ACTIVATIONS``, by name) on tensors that
    require grad, which are computed plainly."""

    RECTIFIERS: ClassVar[frozenset[Callable[..., Any]]] = frozenset(
        {F.relu, torch.relu, Tensor.relu, torch.relu_, Tensor.relu_})
    IN_PLACE: ClassVar[frozenset[Callable[..., Any]]] = frozenset({torch.relu_, Tensor.relu_})
    functions: ClassVar[frozenset[Callable[..., Any]]] = RECTIFIERS | (OTHER_ACTIVATIONS - RECTIFIERS)

    def __init__(self, rule: str):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}; got {rule!r}.")
        self.rule = rule
        self.calls = 0
        self.others: Counter[str] = Counter()

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        inputs = args[0]
        if func not in self.RECTIFIERS:
            if isinstance(inputs, Tensor) and inputs.requires_grad:
                name = function_name(func)
                self.others["hardtanh (ReLU6)" if name == "hardtanh" else name] += 1
            return func(*args, **kwargs)
        in_place = func in self.IN_PLACE or bool(kwargs.get("inplace", args[1] if len(args) > 1 else False))
        self.calls += 1
        return RectifierWithRule.apply(inputs, self.rule, in_place)


class relu_backward_rule(CallScope[RectifierRule]):  # noqa: N801 - used like a function, as torch.no_grad is
    """``with relu_backward_rule("guided") as rule:`` — within the block, every ReLU of this thread's
    forward passes back-propagates by the rule ("guided" or "deconvnet"). ``rule.calls`` counts
    the ReLUs it rerouted. The rule is removed when the block ends, also on an interrupt."""

    def __init__(self, rule: str):
        super().__init__()
        self.rule = RectifierRule(rule)

    def setup(self) -> RectifierRule:
        self.enter(CallRules([self.rule]))
        return self.rule


class _RectifiedGradient(GradientExplainer):
    rule = "guided"
    _relu_calls: PerThread[int] = PerThread(0)
    _other_activations: PerThread[Counter[str]] = PerThread()
    reported_as: Optional[str] = None
    """The method named in warnings (GuidedGradCAM for the guided backprop inside it); None: this class."""

    def forward(self, inputs: Tensor, rows: Optional[Tensor] = None) -> object:
        """The model's forward with every ReLU rerouted; the rule is active during the forward only
        (the backward pass uses the autograd function recorded then), so a target callable that
        runs another explainer sees the model's plain ReLUs."""
        with relu_backward_rule(self.rule) as rule:
            output = super().forward(inputs, rows)
        self._relu_calls = (self._relu_calls or 0) + rule.calls
        self._other_activations = (self._other_activations or Counter()) + rule.others
        return output

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        self._relu_calls, self._other_activations = 0, Counter()
        try:
            gradients, selected = self.gradients(batch, target, topk)
        finally:
            relu_calls, self._relu_calls = self._relu_calls or 0, 0
            others, self._other_activations = self._other_activations or Counter(), None
        self.warn_of_plain_activations(relu_calls, others)
        return self.attribution_from(gradients, selected, zero_gradient=all_zero(gradients),
                                     relu_calls=torch.tensor(relu_calls))

    def warn_of_plain_activations(self, relu_calls: int, others: Counter[str]) -> None:
        """Warn when the map is the plain gradient (no ReLU ran), or is guided at some activations
        only (ReLUs next to hardswish, SiLU, GELU... whose backward stays plain)."""
        method = self.reported_as or type(self).__name__
        ran = ", ".join(f"{name} ×{count}" for name, count in sorted(others.items(), key=lambda item: -item[1]))
        if relu_calls == 0:
            found = f"; it ran {ran}" if others else ""
            warn_at_callers_line(
                f"{method} found no ReLU in the model's forward pass (GELU, SiLU and clamp(min=0) are not "
                f"ReLUs{found}), so its map is the plain gradient (saliency).",
                RuntimeWarning,
            )
        elif others:
            warn_at_callers_line(
                f"{method} rewrote the backward pass of {relu_calls} ReLU call(s) only: the model also ran "
                f"{ran}, whose backward pass stays the plain gradient, so its map is {self.rule} at the ReLUs and "
                "a plain gradient elsewhere (the methods are defined for ReLU networks).",
                RuntimeWarning,
            )


@register
class GuidedBackprop(_RectifiedGradient):
    """Guided backpropagation (Springenberg et al. 2015): at every ReLU only positive gradients
    flow back, and only where the forward input was positive."""

    name = "guidedbackprop"
    summary = "Guided backprop: gradient with negative signals stopped at every ReLU"
    rule = "guided"


@register
class Deconvnet(_RectifiedGradient):
    """Deconvnet (Zeiler & Fergus 2014): at every ReLU the backward pass rectifies the gradient
    itself, whatever the sign of the forward input."""

    name = "deconvnet"
    summary = "Deconvnet: backward pass with ReLUs applied to the gradient"
    rule = "deconvnet"


@register
class GuidedGradCAM(GradientExplainer):
    """Guided Grad-CAM (Selvaraju et al. 2017): guided backprop ⊙ an upsampled CAM.

    layer: the CAM's target layer (None: chosen automatically). cam: the CAM method, a class
        (default GradCAM) or a CAM instance built on the same model.
    """

    name = "guidedgradcam"
    summary = "Guided Grad-CAM: guided backprop multiplied by the (upsampled) Grad-CAM"
    needs_layer = True

    def __init__(
        self,
        model: ModelSource,
        layer: Union[LayerSpec, Sequence[LayerSpec], None] = None,
        *,
        cam: Union[type[CAM], CAM] = GradCAM,
        **options: Unpack[GradientOptions],
    ):
        super().__init__(model, **options)
        if isinstance(cam, CAM):
            if cam.model is not model:
                raise ValueError("the CAM given to GuidedGradCAM must be built on the same model.")
            if layer is not None:
                _check_same_layers(self.model, layer, cam)
            self.cam = cam
        elif isinstance(cam, type) and issubclass(cam, CAM):
            self.cam = cam(model, layer, normalize=None, output=self.output)  # layer None: chosen on first call
        else:
            raise TypeError(f"cam must be a CAM class or instance; got {cam!r}.")
        self.guided = GuidedBackprop(model, reduce=self.reduce, output=self.output)
        self.guided.reported_as = type(self).__name__

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        self.cam._forward_call = self.guided._forward_call = self._forward_call
        try:
            cam = self.cam.attribute(batch, target, topk)
            selected = cam.selected
            fixed_targets = selected.target_function or selected.class_indices
            guided = self.guided.attribute(batch, fixed_targets, None)
        finally:
            self.cam._forward_call = self.guided._forward_call = None
        # products in float32: a float16 model's guided gradients times a map in [0, 1] would underflow
        cam_maps = upsample_maps(cam.maps, batch.shape[-2:]).float()  # (N, K, H, W)
        assert guided.attributions is not None, "guided backprop returns its attributions at the input"
        attributions = guided.attributions.float() * cam_maps[:, :, None]
        return Attribution(
            maps=reduce_channels(attributions, self.reduce),
            selected=selected,
            low_res_maps=cam.low_res_maps,
            layer=cam.layer,
            attributions=attributions,
            zero_gradient=_either(cam.zero_gradient, guided.zero_gradient),
            disconnected=_either(cam.disconnected, guided.disconnected),
            negative_everywhere=cam.negative_everywhere,
        )


def _check_same_layers(model: nn.Module, layer: Union[LayerSpec, Sequence[LayerSpec]], cam: CAM) -> None:
    """Refuse a ``layer`` that the given CAM instance would not use (it runs on its own layers)."""
    asked = [name for name, _ in find_layers(model, layer)]
    if cam.layers is not None and asked == cam.layer_names:
        return
    has = f"layer(s) {cam.layer_names}" if cam.layers is not None else "no layer (chosen on the first call)"
    raise ValueError(
        f"GuidedGradCAM got layer {asked} and a {type(cam).__name__} built with {has}; the CAM runs on its own "
        f"layers. Drop layer= (the CAM's are used), or build the CAM on the layer you want: "
        f"cam={type(cam).__name__}(model, {asked[0]!r})."
    )


def _either(first: Optional[Flags], second: Optional[Flags]) -> Optional[Flags]:
    if first is None or second is None:
        return first if second is None else second

    def either() -> Tensor:
        computed, other = flags_of(first), flags_of(second)
        assert computed is not None and other is not None, "both flags are given"
        return computed | other.to(computed.device)

    return either
