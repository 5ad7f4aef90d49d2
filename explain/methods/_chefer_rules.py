"""How Chefer, Gur & Wolf (2021a, "Transformer interpretability beyond attention visualization") propagate relevance
through a transformer: the LRP behind their Transformer attribution, as their code computes it
(hila-chefer/Transformer-Explainability: ``modules/layers_ours.py``, ``baselines/ViT/ViT_LRP.py``), written for the
torch functions any model calls rather than for their ViT's own modules.

Relevance starts at the model's output as ∂score/∂output (for a class: 1 at that class, their one-hot vector) and
flows back through these rules. Notation: x⁺ = max(x, 0), x⁻ = min(x, 0); "a ⊘ b" is their safe division,
a / (b + 10⁻⁹), and 0 where b = 0.

- Linear layers, convolutions and a product of a path tensor by a constant matrix: α1β0 without the bias,
  R_i = Σ_j (x⁺_i w⁺_ij + x⁻_i w⁻_ij) · R_j ⊘ Σ_i' (x⁺_i' w⁺_i'j + x⁻_i' w⁻_i'j)   (their ``Linear``, α = 1).
- A sum of two tensors on the path (a residual connection, a = x, b = f(x)): LRP-0 shares
  a ⊙ R ⊘ (a + b) and b ⊙ R ⊘ (a + b), each rescaled so that the two totals split the image's total relevance in
  proportion to the magnitudes of their own totals, Σ R · |Σ a| ⊘ (|Σ a| + |Σ b|)   (their ``Add``).
- A product of two tensors on the path (attention's QKᵀ and A·V; a gate): each operand gets its LRP-0 share of the
  product, halved: for O = A·V, R_A = A ⊙ ((R_O ⊘ O)·Vᵀ) / 2 and R_V = V ⊙ (Aᵀ·(R_O ⊘ O)) / 2 (their ``einsum``
  followed by ``/= 2``). R_A is the relevance of the attention probabilities that Transformer attribution weights
  by their gradient.
- Sums, means, average pooling and interpolation of one path tensor: LRP-0, x ⊙ ∂⟨z, R ⊘ z⟩/∂x (their
  ``RelPropSimple``).
- Softmax, GELU and every other elementwise activation, normalisation layers (LayerNorm, RMSNorm, GroupNorm,
  BatchNorm), dropout, products by a scalar or an elementwise constant, sums with a constant: the relevance passes
  unchanged (their identity ``RelProp``); a normalisation's divisor (``sqrt``, ``rsqrt``, ``var``, a norm) is held
  constant.
- Reshaping, slicing, concatenation, reading the class token: the plain gradient routes the relevance (their
  ``IndexSelect``, ``Clone``: a tensor used twice receives the sum of the two relevances).

Fused attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``) is computed step by step under the
rules, so that each step gets its rule; every attention softmax's probabilities are handed to ``on_attention`` with
the name of the module computing them.

Their ``Add`` sums over the whole tensor of their batch of one image. Here each image's sums are its own when the
tensor's first dimension holds the images (every timm, torchvision and HuggingFace vision transformer); where that
cannot be told (a sequence-first layout, or a dimension as long as the batch), ``OneImageAtATime`` is raised
during the forward pass and the method propagates each image alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..core.attention import _attend_with_heads, calling_module, stepwise_multi_head_attention
from ..core.rules import CallRules, Rule, function_name, tensors_in, torch_functions, writes_in_place
from ..core.scope import CallScope
from ._attnlrp_rules import _detached
from ._lrp_rules import LayerFunction, LinearRule, _terms
from ._lrp_trace import (
    ACTIVATIONS,
    ADDITIONS,
    ROUTING,
    SCALINGS,
    SUMS,
    _Call,
    _CallRule,
    _LayerRule,
    _Passes,
    _PassRule,
    _Relevance,
    mark_on_path,
)

SAFE_DIVISION_EPSILON = 1e-9
"""Their ``safe_divide``'s ε."""


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / (denominator + 10⁻⁹), and 0 where the denominator is 0: the division of the authors' code."""
    return numerator / (denominator + SAFE_DIVISION_EPSILON) * denominator.ne(0).to(denominator.dtype)


@dataclass(frozen=True)
class AlphaOneBetaZero(LinearRule):
    """LRP-α1β0 as Chefer et al. compute it: R_i = Σ_j (x⁺_i w⁺_ij + x⁻_i w⁻_ij) · R_j ⊘ z⁺_j with
    z⁺_j = Σ_i' (x⁺_i' w⁺_i'j + x⁻_i' w⁻_i'j); the bias takes no share. Conserves relevance where z⁺_j > 0."""

    name: ClassVar[str] = "alpha1beta0"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        terms = [(x.clamp(min=0), weight.clamp(min=0), None), (x.clamp(max=0), weight.clamp(max=0), None)]
        with torch.enable_grad():
            (positive, negative), leaves = _terms(layer, terms)
            z = positive + negative
            gradients = torch.autograd.grad(z, leaves, safe_divide(relevance, z.detach()))
        return terms[0][0] * gradients[0] + terms[1][0] * gradients[1]


def lrp_zero_shares(function: Callable[..., Tensor], inputs: Sequence[Tensor], relevance: Tensor) -> list[Tensor]:
    """x_k ⊙ ∂⟨z, R ⊘ z⟩/∂x_k for z = function(x_1, ..., x_n): each input's LRP-0 share of z's relevance."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        z = function(*leaves)
        gradients = torch.autograd.grad(z, leaves, safe_divide(relevance, z.detach()), allow_unused=True)
    return [torch.zeros_like(x) if gradient is None else x * gradient for x, gradient in zip(inputs, gradients)]


class _SharedRule(_CallRule):
    """Each path input's LRP-0 share of the call's relevance, divided by ``factors`` (2 for a product of two path
    tensors, their halving; 1 for a sum or pooling of one)."""

    def __init__(self, call: _Call, name: str, passes: _Passes, factors: int):
        super().__init__(call, name, passes)
        self.factors = factors

    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        shares = lrp_zero_shares(self.call, inputs, relevance)
        return [share / self.factors if self.factors != 1 else share for share in shares]


class _NormalisedSumRule(_CallRule):
    """Their ``Add``: the terms' LRP-0 shares, each rescaled so that its total over the image is the image's total
    relevance times |its own total| ⊘ Σ_terms |total|. ``images``: the tensors' first dimension holds the images
    (sums per row); 1 means the whole tensor is one image's."""

    def __init__(self, call: _Call, name: str, passes: _Passes, images: int):
        super().__init__(call, name, passes)
        self.images = images

    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        shares = lrp_zero_shares(self.call, inputs, relevance)
        totals = [share.reshape(self.images, -1).sum(dim=1) for share in shares]
        magnitude = torch.stack([total.abs() for total in totals]).sum(dim=0)
        relevance_total = relevance.reshape(self.images, -1).sum(dim=1)
        sent: list[Optional[Tensor]] = []
        for share, total in zip(shares, totals):
            wanted = safe_divide(total.abs(), magnitude) * relevance_total
            factor = safe_divide(wanted, total)
            sent.append(share * factor.view(-1, *(1,) * (share.dim() - 1)) if self.images > 1 else share * factor)
        return sent


class OneImageAtATime(Exception):
    """Raised during the forward pass where a sum's images cannot be told apart in a batch (their first dimension
    does not hold them): the caller propagates each image alone."""


LAYERS: dict[Callable[..., Any], bool] = {
    F.linear: False, F.conv1d: False, F.conv2d: False, F.conv3d: False,
    F.conv_transpose1d: True, F.conv_transpose2d: True, F.conv_transpose3d: True,
}
"""Linear layers and convolutions (True: transposed)."""
MATRIX_PRODUCTS = torch_functions("matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum")
MULTIPLICATIONS = torch_functions("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__")
SOFTMAXES = torch_functions("softmax", "_softmax", "log_softmax")
NORMS = torch_functions("layer_norm", "rms_norm", "group_norm", "instance_norm", "batch_norm", "normalize")
DIVISORS = torch_functions("rsqrt", "rsqrt_", "sqrt", "sqrt_", "var", "std", "var_mean", "std_mean", "norm",
                           "vector_norm", "linalg_vector_norm") | {torch.linalg.vector_norm, torch.linalg.norm}
"""A normalisation's divisor: held constant (its result leaves the path)."""
DIVISIONS = torch_functions("div", "div_", "divide", "true_divide", "true_divide_", "__truediv__", "__itruediv__")
"""x / y: a divisor on the path is held constant (a normalisation written out, ``x / x.norm()``)."""
PASSING = ACTIVATIONS | SOFTMAXES | NORMS | SCALINGS | ADDITIONS | torch_functions(
    "dropout", "erf", "exp", "log", "pow", "__pow__", "square", "abs", "reciprocal")
"""Elementwise functions of one path tensor (and normalisations): relevance passes unchanged."""


def _is_attention_softmax(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A softmax over the last dimension of (N, heads, T_q, T_k) scores."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(result, Tensor) and result.dim() == 4 and dim in (-1, 3)


class CheferRules(Rule):
    """The rules of one relevance pass: follows the tensors that depend on the input through the forward pass and
    gives each call on them its rule (the module docstring lists them). One instance per pass.

    images: how many images the forward pass holds. on_attention: called with each attention's (N, heads, T_q, T_k)
    probabilities, in the graph, and the name of the module computing it. ``unruled`` names the calls after the
    first recorded attention that have no rule (there the relevance follows the plain gradient)."""

    sees_every_call = True

    def __init__(self, model: nn.Module, images: int, on_attention: Callable[[Tensor, str], None]):
        self.images = images
        self.on_attention = on_attention
        self.names = {id(module): name for name, module in model.named_modules()}
        self.path: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.passes = _Passes()
        self.mode: Optional[CallRules] = None
        self.attention_calls = 0
        self.applied: Counter[str] = Counter()
        self.unruled: dict[str, int] = {}
        """Calls without a rule → how many attention softmaxes the forward had computed before the first of them."""

    def where(self, function: Callable[..., Any]) -> str:
        return f"{calling_module(self.names) or 'model'}: {function_name(function)}"

    def follow(self, value: Any) -> bool:
        """Mark the floating-point tensors of ``value`` that require grad as on the path; whether there were any."""
        return mark_on_path(self.path, value)

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        occurrences = [tensor for tensor in tensors_in((args, kwargs)) if tensor in self.path]
        if not occurrences:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention or func is F.multi_head_attention_forward:
            assert self.mode is not None, "CheferScope gives the rules their mode"
            self.applied["attention"] += 1
            with self.mode:  # step by step, each step with its rule
                if func is F.scaled_dot_product_attention:
                    return _attend_with_heads(*args, **kwargs)[0]
                return stepwise_multi_head_attention(*args, **kwargs)
        if func in DIVISORS or _is_square_root(func, args, kwargs):
            self.applied["divisor"] += 1
            return _detached(func(*args, **kwargs))
        if func in DIVISIONS and len(args) > 1 and isinstance(args[1], Tensor) and args[1] in self.path:
            args = (args[0], args[1].detach(), *args[2:])  # the divisor held constant
            occurrences = [tensor for tensor in tensors_in((args, kwargs)) if tensor in self.path]
            if not occurrences:
                return func(*args, **kwargs)
        path = list({id(tensor): tensor for tensor in occurrences}.values())
        in_place = writes_in_place(func, args, kwargs)
        target = args[0] if args else kwargs.get("input")
        target_index = next((i for i, tensor in enumerate(path) if tensor is target), None) if in_place else None
        rule = None
        if func not in ROUTING and (not in_place or target_index is not None):
            rule = self._rule_for(func, args, kwargs, path, len(occurrences), target_index)
        if rule is None:
            result = func(*args, **kwargs)
            followed = self.follow(result) | (in_place and self.follow(target))
            if followed and func not in ROUTING:
                self.unruled.setdefault(self.where(func), self.attention_calls)
            return result
        inputs = list(path)
        if target_index is not None and rule.keeps_inputs:  # the saved value must outlive the in-place write
            inputs[target_index] = inputs[target_index].clone()
        result = _Relevance.apply(rule, *inputs)
        if target_index is not None:
            result = path[target_index].copy_(result)
        self.follow(result)
        if func in SOFTMAXES and _is_attention_softmax(result, args, kwargs):
            self.attention_calls += 1
            self.on_attention(result, calling_module(self.names) or "")
        return result

    def _rule_for(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  path: list[Tensor], factors: int, target: Optional[int]) -> Optional[_CallRule]:
        """The rule of one call on the path, or None where there is none."""
        call = _Call(func, args, kwargs, path, target)
        name = self.where(func)
        if func in LAYERS:
            return self._layer_rule(func, call, name, args, kwargs, path)
        if func in MATRIX_PRODUCTS or func in MULTIPLICATIONS:
            if factors > 1:
                self.applied["product"] += 1
                return _SharedRule(call, name, self.passes, factors)
            if func in MATRIX_PRODUCTS:
                return self._constant_product_rule(func, call, name, args, kwargs, path[0])
        if func in ADDITIONS and factors > 1:
            self._check_images(args, kwargs, func)
            self.applied["sum"] += 1
            return _NormalisedSumRule(call, name, self.passes, self.images)
        if func in SUMS and factors == 1:
            self.applied["pooling"] += 1
            return _SharedRule(call, name, self.passes, 1)
        if func in PASSING and factors == 1:
            self.applied["identity"] += 1
            return _PassRule(call, name, self.passes)
        return None

    def _layer_rule(self, func: Callable[..., Any], call: _Call, name: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any], path: list[Tensor]) -> Optional[_LayerRule]:
        options = dict(kwargs)
        inputs, weight, _ = list(args[:3]) + [options.pop(key, None) for key in ("input", "weight", "bias")[len(args):]]
        if len(path) != 1 or path[0] is not inputs or not isinstance(weight, Tensor):
            return None  # weights that depend on the input: no rule
        rest = args[3:]

        def layer(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
            return func(x, w, None, *rest, **options)

        self.applied["alpha1beta0"] += 1
        groups = int(args[6] if len(args) > 6 else options.get("groups", 1))
        return _LayerRule(call, name, self.passes, AlphaOneBetaZero(), layer, weight.detach(), None, LAYERS[func],
                          groups)

    def _constant_product_rule(self, func: Callable[..., Any], call: _Call, name: str, args: tuple[Any, ...],
                               kwargs: dict[str, Any], inputs: Tensor) -> Optional[_LayerRule]:
        """x·W with W a constant matrix (a projection written as a product, scores against text embeddings): α1β0,
        W read as the weights."""
        constants = [tensor for tensor in tensors_in((args, kwargs)) if tensor is not inputs]
        if len(constants) != 1 or not constants[0].is_floating_point():
            return None
        with_weight = _Call(func, args, kwargs, [inputs, constants[0]], None)

        def layer(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
            return with_weight(x, w)

        self.applied["alpha1beta0"] += 1
        return _LayerRule(call, name, self.passes, AlphaOneBetaZero(), layer, constants[0].detach(), None, False, 1)

    def _check_images(self, args: tuple[Any, ...], kwargs: dict[str, Any], func: Callable[..., Any]) -> None:
        """A sum's per-image totals need the images along the first dimension of every term (any layout for one
        image)."""
        if self.images == 1:
            return
        for tensor in tensors_in((args, kwargs)):
            if tensor in self.path and (tensor.dim() == 0 or tensor.shape[0] != self.images
                                        or self.images in tensor.shape[1:]):
                raise OneImageAtATime(self.where(func))


def _is_square_root(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """x ** 0.5 or x ** -0.5: a norm's divisor computed as a power (HuggingFace CLIP's ``_get_vector_norm``)."""
    if function_name(func) not in ("pow", "__pow__"):
        return False
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    return isinstance(exponent, (int, float)) and abs(exponent) == 0.5


class CheferScope(CallScope[CheferRules]):
    """``with CheferScope(model, rules):`` — this thread's forward passes run with Chefer et al.'s rules; removed
    when the block ends."""

    def __init__(self, model: nn.Module, rules: CheferRules):
        super().__init__(model)
        self.rules = rules

    def setup(self) -> CheferRules:
        self.rules.mode = CallRules([self.rules])
        self.enter(self.rules.mode)
        return self.rules
