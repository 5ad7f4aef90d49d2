"""How AttnLRP follows a forward pass: the call-scoped rule that gives every torch function on the input's path the
modified gradient of its LRP rule (Achtibat et al., ICML 2024, "AttnLRP: Attention-aware layer-wise relevance
propagation for transformers"), so that relevance = input × (modified gradient), one backward pass per target.

In this "gradient × input" form a rule is a change of a call's backward only (its forward is computed exactly as the
model computes it):

- elementwise activations (GELU, SiLU, tanh, ...), as functions or as parameter-free activation modules (CLIP's
  QuickGELU, HuggingFace's activation classes): the identity rule, ∂ → y / x (paper, eq. 9). Where y(0) ≠ 0
  (sigmoid, hard sigmoid, softplus, exp) y / x is unbounded near x = 0, and the LRP-0 layer below would pass that
  on (a sigmoid whose input is 1e-9 multiplies its relevance by 5e8): such a function gets the identity rule of
  y − y(0), ∂ → (y − y(0)) / x, bounded by the function's slope; the constant y(0) keeps its share, as a bias does.
  Where y(0) = 0 the ratio is y / x itself (0 at x = 0), bounded at any scale of x; elsewhere the divisor is
  x + ε·sign(x), never below ε in size (``identity_divisor``);
- a product of two tensors on the path (attention's QKᵀ and A·V, a gated MLP's product): the uniform rule, each
  factor's gradient divided by the number of factors on the path (eq. 7). A gate, the output of an activation with
  y(0) ≠ 0 (a squeeze-and-excitation block's x · σ(W s), CBAM's, ECA's), is held constant in a product with a
  tensor that is not one: all the relevance goes to the gated tensor (the gate is a weight: Arras et al.'s
  "signal-take-all" for LSTM gates, CP-LRP's constant attention, lxt's CP gated MLP). The uniform rule would send
  half into the gate, whose identity rule divides by a pre-activation near 0; gated MLPs whose gate is SiLU or
  GELU (y(0) = 0) keep the uniform rule, as lxt does; through a fused
  ``scaled_dot_product_attention`` this is the gradient of the query and key divided by 4 and of the value by 2
  (by 2 and 1 where one operand is a constant), and no (N, heads, T, T) matrix is materialised;
- softmax: its plain gradient, which in this form is the softmax rule R_i = x_i (R_i − s_i Σ_j R_j) (eq. 13); CP-LRP
  (Ali et al. 2022) instead stops the gradient through the softmax (``conservative=True``);
- LayerNorm, RMSNorm, GroupNorm, ``F.normalize`` (Swin v2's cosine attention), a cosine similarity (a score against
  a reference embedding) and a norm's denominator (``rsqrt``, ``sqrt``, ``x ** ±0.5``, ``var``, ``std``, ``norm``):
  the identity rule of normalisation, the divisor held constant (eq. 10);
- linear layers and convolutions: the plain gradient (LRP-0 with the bias absorbing its share), or LRP-γ
  (``linear_gamma``, ``conv_gamma``, as lxt with zennit's Gamma rule);
- sums, means, pooling, reshaping, slicing, a product by a constant: the plain gradient, which is their LRP rule.

Any other function on the path keeps its plain gradient and is named in a warning. Nothing is written to the model.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..core.attention import attend, calling_module, multi_head_attention
from ..core.rules import Rule, function_name, tensors_in, torch_functions, writes_in_place
from ..core.scope import CallScope
from ._lrp_rules import Gamma, stabilize
from ._lrp_trace import ACTIVATIONS, ADDITIONS, ROUTING, SCALINGS, SUMS

IDENTITY_EPSILON = 1e-10
"""The ε of the identity rule's (y − y(0)) / (x + ε·sign(x)) where y(0) ≠ 0 (lxt's ε; see ``identity_divisor``)."""
GATES_FOLLOW = ROUTING
"""Functions whose result is a gate when their input is one (a gate reshaped, expanded or cast)."""

EXACT_ACTIVATIONS = torch_functions("relu", "relu_", "leaky_relu", "leaky_relu_", "threshold", "threshold_", "prelu",
                                    "rrelu", "rrelu_")
"""Activations that are linear through 0 on each side: y / x is their gradient, so they keep it (also in place)."""
PRODUCTS = torch_functions("matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "mm", "bilinear")
"""Products of two operands: the uniform rule when both are on the path, the plain gradient otherwise."""
MULTIPLICATIONS = torch_functions("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__")
SOFTMAXES = torch_functions("softmax", "log_softmax", "_softmax")
NORMS = torch_functions("layer_norm", "rms_norm", "group_norm", "instance_norm", "normalize")
COSINES = torch_functions("cosine_similarity")
"""Cosine similarity (an embedding's score against a reference): the norms held constant, a product."""
DIVISORS = torch_functions("rsqrt", "rsqrt_", "sqrt", "sqrt_", "var", "std", "var_mean", "std_mean", "norm",
                           "vector_norm", "linalg_vector_norm") | {torch.linalg.vector_norm, torch.linalg.norm}
"""A normalisation's divisor: its value is held constant (not followed), the identity rule of normalisation."""
POWERS = torch_functions("pow", "__pow__", "square", "exp", "log", "erf", "abs", "reciprocal")
"""Elementwise functions of one path tensor besides the activations: the identity rule too."""
LAYERS = torch_functions("linear", "conv1d", "conv2d", "conv3d")
PLAIN = ROUTING | ADDITIONS | SUMS | torch_functions(
    "batch_norm", "dropout", "contiguous", "cumsum", "index_add", "scatter", "scatter_add", "masked_scatter",
    "layer_norm_backward", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "avg_pool2d", "roll", "pad", "flatten",
    "new_zeros", "new_ones", "new_empty", "zero_", "fill_", "sum_to_size", "__iter__", "__len__", "dim", "size",
    "numel", "is_floating_point", "__format__", "__bool__", "__index__", "__int__", "__float__", "tolist", "item",
    "detach_", "requires_grad_", "data_ptr", "element_size", "stride", "storage_offset", "is_contiguous",
    "__get__", "__set__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt",
    "ge", "isnan", "isinf", "isfinite", "argmax", "argmin", "argsort", "topk", "sort", "any", "all", "sign", "floor",
    "ceil", "round", "trunc",
)
"""Functions whose plain gradient routes relevance as their LRP rule does (or that have no gradient)."""

_ACTIVATION_MODULE = re.compile(r"(?i)(gelu|silu|swish|mish|relu|elu|sigmoid|tanh|softplus|hardswish|activation)$")


def is_activation_module(module: nn.Module) -> bool:
    """An elementwise activation module computed from several torch calls (CLIP's QuickGELU x·σ(1.702x),
    HuggingFace's ``NewGELUActivation``): no parameters, no submodules, an activation's class name. Softmax modules
    are not."""
    name = type(module).__name__
    return (bool(_ACTIVATION_MODULE.search(name)) and "softmax" not in name.lower()
            and next(module.parameters(recurse=False), None) is None and next(module.children(), None) is None)


# ------------------------------------------------------------------ the modified gradients


def ratio_of(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator (in place in ``numerator``), 0 where the denominator is 0: an input of exactly 0 whose
    ε (1e-10) is below float16's smallest number, so x + ε is 0 too; its relevance, x times a factor, is 0 as in
    float32 (where the rules give 0 / ε = 0), not 0 / 0."""
    return numerator.div_(denominator).masked_fill_(denominator == 0, 0)


def identity_divisor(inputs: Tensor, at_zero: Optional[float]) -> Tensor:
    """The divisor of the identity rule's (y − y(0)) / x. Where y(0) = 0 (GELU, SiLU, hard swish, tanh), x itself:
    y / x is then bounded by the function's slope at any scale of x, where lxt's y / (x + ε) shrinks the ratio of
    activations far below ε (torchvision's EfficientNet-B0 with random weights, whose SiLU inputs are ~1e-14: the
    relevance vanished, 6e-6 of the logit at the input instead of all of it). Elsewhere (y(0) ≠ 0, or None: not
    finite or not known) x + ε·sign(x), at least ε in size: y − y(0) holds rounding errors (an ulp of y(0)) that a
    tiny x would blow up, and lxt's x + ε is 0 at x = −ε (in torchvision's MobileNetV3 with random weights, hard swish
    inputs near −1e-10 made the input's relevance 900 times the logit). x = 0 gives 0 (``ratio_of``)."""
    return inputs if at_zero == 0.0 else stabilize(inputs, IDENTITY_EPSILON)


class IdentityRule(torch.autograd.Function):
    """Forward: the elementwise function, exactly; backward: ∂ → ∂ · (y − y(0)) / x (AttnLRP's identity rule, of
    y − y(0) where y(0) ≠ 0; the divisor as ``identity_divisor`` gives it), with y recomputed from the saved input (as
    the plain backward of GELU keeps its input, so no more memory). at_zero: y(0), None where it is not finite."""

    @staticmethod
    def forward(ctx: Any, function: Callable[[Tensor], Tensor], inputs: Tensor,
                at_zero: Optional[float] = 0.0) -> Tensor:
        ctx.function, ctx.at_zero = function, at_zero
        ctx.save_for_backward(inputs)
        return function(inputs)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[None, Tensor, None]:
        (inputs,) = ctx.saved_tensors
        with torch.no_grad():
            values = ctx.function(inputs)
            if ctx.at_zero:
                values = values.sub_(ctx.at_zero)
            ratio = ratio_of(values, identity_divisor(inputs, ctx.at_zero))
        return None, ratio.mul_(gradient), None


class IdentityOfValues(torch.autograd.Function):
    """Forward: ``output`` (an activation module's result, computed beside the graph); backward from it to
    ``inputs``: ∂ · (output − y(0)) / inputs, the divisor as ``identity_divisor`` gives it."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, output: Tensor, at_zero: Optional[float] = 0.0) -> Tensor:
        shifted = output - at_zero if at_zero else output.clone()
        ctx.save_for_backward(ratio_of(shifted, identity_divisor(inputs, at_zero)))
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, None, None]:
        (ratio,) = ctx.saved_tensors
        return gradient * ratio, None, None


def value_at_zero(function: Callable[[Tensor], Tensor], like: Tensor) -> Optional[float]:
    """f(0) of an elementwise function of tensors like ``like``: computed on a one-element zero on the CPU, so no
    device sync (on ``like``'s device where the call has another tensor argument that must be there). None, the
    plain identity rule with its divisor kept from 0 (``identity_divisor``), where f(0) is not finite (log, 1/x) or a
    one-element zero is not an input the function takes."""
    for zero in (torch.zeros(1, dtype=like.dtype), like.new_zeros(1)):
        try:
            value = function(zero)
            break
        except (RuntimeError, TypeError, ValueError, IndexError):
            continue
    else:
        return None
    if not isinstance(value, Tensor) or value.numel() != 1:
        return None
    number = float(value.reshape(()))
    return number if math.isfinite(number) else None


class ScaledGradient(torch.autograd.Function):
    """Forward: identity; backward: the gradient times ``factor`` (the uniform rule's 1/2 per factor)."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, None]:
        return gradient * ctx.factor, None


def scaled_gradient(tensor: Tensor, factor: float) -> Tensor:
    """``tensor``, its gradient multiplied by ``factor`` (unchanged tensors for a factor of 1)."""
    return tensor if factor == 1 else ScaledGradient.apply(tensor, factor)


class Surrogate(torch.autograd.Function):
    """Forward: the call, exactly; backward: the gradient of ``surrogate`` (the same function with its divisor held
    constant) at the same input, recomputed in the backward pass."""

    @staticmethod
    def forward(ctx: Any, exact: Callable[[Tensor], Tensor], surrogate: Callable[[Tensor], Tensor],
                inputs: Tensor) -> Tensor:
        ctx.surrogate = surrogate
        ctx.save_for_backward(inputs)
        return exact(inputs)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[None, None, Tensor]:
        (inputs,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = inputs.detach().requires_grad_(True)
            (result,) = torch.autograd.grad(ctx.surrogate(leaf), leaf, gradient)
        return None, None, result


class LayerNormIdentity(torch.autograd.Function):
    """Forward: the layer norm, by the kernel ``F.layer_norm`` runs, which also gives 1/σ; backward: the gradient
    with the divisor σ held constant, written out: ∂_in = (g − mean(g)) / σ with g = ∂ · weight, the mean over the
    normalised dimensions (the same as ``Surrogate`` of the layer norm, keeping 1/σ instead of the input)."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                eps: float) -> Tensor:
        output, _, reciprocal_std = torch.native_layer_norm(inputs, shape, weight, bias, eps)
        ctx.dims = tuple(range(-len(shape), 0))
        ctx.save_for_backward(weight, reciprocal_std)
        return output

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Optional[Tensor], ...]:
        weight, reciprocal_std = ctx.saved_tensors
        weighted = gradient * weight if weight is not None else gradient.clone()
        weighted -= weighted.mean(ctx.dims, keepdim=True)
        return weighted.mul_(reciprocal_std.to(weighted.dtype)), None, None, None, None


class GammaGradient(torch.autograd.Function):
    """Forward: a linear layer or convolution, exactly; backward: LRP-γ in gradient × input form, as lxt's patch of
    zennit computes it: R_out = ∂ · y, R_in = γ-rule(R_out), ∂_in = R_in / stab(x)."""

    @staticmethod
    def forward(ctx: Any, layer: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor], rule: Gamma, inputs: Tensor,
                weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        output = layer(inputs, weight, bias)
        ctx.layer, ctx.rule = layer, rule
        ctx.save_for_backward(inputs, weight, bias, output)
        return output

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Optional[Tensor], ...]:
        inputs, weight, bias, output = ctx.saved_tensors
        relevance = ctx.rule.relevance(ctx.layer, inputs.detach(), weight.detach(),
                                       None if bias is None else bias.detach(), gradient * output)
        return None, None, ratio_of(relevance, stabilize(inputs.detach(), IDENTITY_EPSILON)), None, None


def _norm_surrogate(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> Optional[Callable[[Tensor], Tensor]]:
    """The normalisation with its divisor held constant, as a function of its input; None when the call's form is
    not one this knows."""
    name = function_name(func)
    values = list(args) + [None] * 6
    if name == "layer_norm":
        shape = kwargs.get("normalized_shape", values[1])
        weight, bias = kwargs.get("weight", values[2]), kwargs.get("bias", values[3])
        eps = kwargs.get("eps", values[4] if values[4] is not None else 1e-5)
        dims = tuple(range(-len(shape), 0))

        def layer_norm(x: Tensor) -> Tensor:
            centred = x - x.mean(dims, keepdim=True)
            divisor = (centred.pow(2).mean(dims, keepdim=True) + eps).sqrt().detach()
            y = centred / divisor
            y = y if weight is None else y * weight
            return y if bias is None else y + bias

        return layer_norm
    if name == "rms_norm":
        shape = kwargs.get("normalized_shape", values[1])
        weight, eps = kwargs.get("weight", values[2]), kwargs.get("eps", values[3])
        dims = tuple(range(-len(shape), 0))

        def rms_norm(x: Tensor) -> Tensor:
            epsilon = torch.finfo(x.dtype).eps if eps is None else eps
            y = x / (x.pow(2).mean(dims, keepdim=True) + epsilon).sqrt().detach()
            return y if weight is None else y * weight

        return rms_norm
    if name == "group_norm":
        groups = kwargs.get("num_groups", values[1])
        weight, bias = kwargs.get("weight", values[2]), kwargs.get("bias", values[3])
        eps = kwargs.get("eps", values[4] if values[4] is not None else 1e-5)

        def group_norm(x: Tensor) -> Tensor:
            grouped = x.reshape(x.shape[0], groups, -1)
            centred = grouped - grouped.mean(-1, keepdim=True)
            y = (centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt().detach()).reshape(x.shape)
            shape = [1, -1] + [1] * (x.dim() - 2)
            y = y if weight is None else y * weight.reshape(shape)
            return y if bias is None else y + bias.reshape(shape)

        return group_norm
    if name == "normalize":  # x / max(‖x‖_p, eps) along dim (Swin v2's cosine attention)
        p = kwargs.get("p", 2.0 if values[1] is None else values[1])
        dim = kwargs.get("dim", 1 if values[2] is None else values[2])
        eps = kwargs.get("eps", 1e-12 if values[3] is None else values[3])

        def normalize(x: Tensor) -> Tensor:
            return x / x.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(x).detach()

        return normalize
    return None


def _call_on(func: Callable[..., Any], rest_args: tuple[Any, ...], rest_kwargs: dict[str, Any],
             inputs: Tensor) -> Any:
    """``func(inputs, *rest_args, **rest_kwargs)``."""
    return func(inputs, *rest_args, **rest_kwargs)


# ------------------------------------------------------------------ following the forward pass


class AttnLrpRules(Rule):
    """The AttnLRP rules of one call: follows the tensors that depend on the input through the forward pass and
    gives each torch function called on them the modified gradient of its rule. One instance per call.

    conservative: CP-LRP, no gradient through the softmax (the attention weights held constant);
    linear_gamma, conv_gamma: γ of LRP-γ for linear layers and convolutions (None: LRP-0, the plain gradient);
    on_attention: called with the (N, heads, T_q, T_k) probabilities of each attention and the name of the module
        computing it; the attention is then computed step by step in the graph (None: fused attention stays fused).
    ``applied`` counts the rules used by name; ``unruled`` names the calls on the path that have none."""

    sees_every_call = True

    def __init__(self, model: nn.Module, *, conservative: bool = False, linear_gamma: Optional[float] = None,
                 conv_gamma: Optional[float] = None,
                 on_attention: Optional[Callable[[Tensor, str], None]] = None):
        self.conservative = conservative
        self.linear_rule = None if not linear_gamma else Gamma(linear_gamma)
        self.conv_rule = None if not conv_gamma else Gamma(conv_gamma)
        self.on_attention = on_attention
        self.path: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.names = {id(module): name for name, module in model.named_modules()}
        """``id(module)`` → name, for ``calling_module``: the module of a call is read from the Python stack, only
        where a name is needed (a warning, an attention record), so no hook runs on every module."""
        self.activations = [module for module in model.modules() if is_activation_module(module)]
        self.inside_activation = 0
        self.inputs_before: list[Optional[Tensor]] = []
        """Per activation module running, a copy of its input in the graph when it writes in place, else None."""
        self.gates: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """The path tensors that are gates: outputs of an activation with y(0) ≠ 0, and views of them."""
        self.applied: Counter[str] = Counter()
        self.unruled: dict[str, None] = {}

    # -- module names, and activation modules handled whole

    def current_module(self) -> str:
        """The name of the innermost module of the model running now ("" for the model itself)."""
        return calling_module(self.names) or ""

    def entering(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Before an activation module: counted, so that its inner calls run plainly."""
        self.inside_activation += 1
        in_place = getattr(module, "inplace", False) and args and isinstance(args[0], Tensor)
        self.inputs_before.append(args[0].clone() if in_place and args[0] in self.path else None)

    def leaving(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """After an activation module: its output, wired to its input by the identity rule."""
        self.inside_activation -= 1
        before = self.inputs_before.pop() if self.inputs_before else None
        if self.inside_activation or len(args) != 1 or not isinstance(args[0], Tensor) or args[0] not in self.path:
            return None
        if not isinstance(output, Tensor) or output.shape != args[0].shape:
            name = self.names.get(id(module), "") or "model"
            self.unruled.setdefault(f"{name}: {type(module).__name__} (not elementwise)")
            return None
        inputs = args[0] if before is None else before
        at_zero = value_at_zero(module.forward, inputs)  # the module's own forward: no hook runs
        self.applied["shifted identity" if at_zero else "identity"] += 1
        # an in-place module (nn.SiLU(inplace=True)) has overwritten its input: the rule needs the input before
        result = IdentityOfValues.apply(inputs, output.detach(), at_zero)
        self.follow(result)
        if at_zero:
            self.gates[result] = True
        return result

    def where(self, function: Callable[..., Any]) -> str:
        return f"{self.current_module() or 'model'}: {function_name(function)}"

    # -- the path

    def follow(self, value: Any) -> None:
        for tensor in tensors_in(value):
            if tensor.is_floating_point() and tensor.requires_grad:
                self.path[tensor] = True

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.inside_activation:
            return func(*args, **kwargs)
        occurrences = [tensor for tensor in tensors_in((args, kwargs)) if tensor in self.path]  # h * h: two
        if not occurrences:
            return func(*args, **kwargs)
        path = list({id(tensor): tensor for tensor in occurrences}.values())
        result = self._ruled(func, args, kwargs, path, len(occurrences))
        self.follow(result)
        if func in GATES_FOLLOW and _routes_a_gate(func, args, path, self.gates):
            for tensor in tensors_in(result):
                if tensor in self.path:
                    self.gates[tensor] = True
        return result

    def _ruled(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               path: list[Tensor], factors: int) -> Any:
        """The call with its rule; ``path``: its distinct tensors on the path, ``factors``: their occurrences."""
        if func in PLAIN or (func in SCALINGS and len(path) == 1 and func not in MULTIPLICATIONS):
            return func(*args, **kwargs)
        if func in MULTIPLICATIONS or func in PRODUCTS:
            if factors == 1:  # a product by a constant or a weight: linear
                return func(*args, **kwargs)
            return self._product(func, args, kwargs, path)
        if func in SOFTMAXES:
            self.applied["softmax"] += 1
            result = func(*args, **kwargs)
            if self.on_attention is not None and _is_attention_softmax(result, args, kwargs):
                self.on_attention(result, self.current_module())
            return result.detach() if self.conservative else result
        if func is F.scaled_dot_product_attention:
            self.applied["attention"] += 1
            return self._attention(_operands_on(path, args, kwargs), *args, **kwargs)
        if func is F.multi_head_attention_forward:  # q, k, v are projections of its query, key and value
            self.applied["attention"] += 1
            on_path = _operands_on(path, args, kwargs)
            return multi_head_attention(lambda *core_args: self._core(on_path, *core_args), *args, **kwargs)
        if func in DIVISORS or _is_square_root(func, args, kwargs):
            self.applied["norm"] += 1
            return _detached(func(*args, **kwargs))
        if func in NORMS:
            return self._norm(func, args, kwargs, path)
        if func in COSINES and len(path) == 1:
            return self._cosine_similarity(func, args, kwargs, path[0])
        if func in LAYERS:
            return self._layer(func, args, kwargs, path)
        if (func in ACTIVATIONS or func in POWERS) and len(path) == 1:
            return self._activation(func, args, kwargs, path[0])
        result = func(*args, **kwargs)
        if any(isinstance(tensor, Tensor) and tensor.is_floating_point() and tensor.requires_grad
               for tensor in tensors_in(result)):
            self.unruled.setdefault(self.where(func))
        return result

    def _product(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 path: list[Tensor]) -> Any:
        """A product of path tensors: the uniform rule; a gate times a tensor that is not one: the gate held
        constant (then the uniform rule among the other factors, if several)."""
        in_place = writes_in_place(func, args, kwargs)
        target = args[0]
        if in_place:  # h *= g: computed out of place on a copy, written back (a rescaled factor cannot be written)
            copy = target.clone()
            if target in self.gates:
                self.gates[copy] = True
            args = tuple(copy if arg is target else arg for arg in args)
            path = [copy if tensor is target else tensor for tensor in path]
        gates = [tensor for tensor in path if tensor in self.gates]
        if gates and len(gates) < len(path):
            self.applied["gate"] += 1
            args, kwargs = _held(args, gates), _held(kwargs, gates)
            path = [tensor for tensor in path if not any(tensor is gate for gate in gates)]
        factors = sum(1 for tensor in tensors_in((args, kwargs)) if any(tensor is on for on in path))
        if factors > 1:
            self.applied["uniform"] += 1
            args, kwargs = _scaled(args, path, 1 / factors), _scaled(kwargs, path, 1 / factors)
        if in_place:
            return target.copy_(torch.mul(*args, **kwargs))
        return func(*args, **kwargs)

    def _activation(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    inputs: Tensor) -> Any:
        if func in EXACT_ACTIVATIONS:
            return func(*args, **kwargs)
        in_place = writes_in_place(func, args, kwargs)
        target = args[0] if args else kwargs.get("input")
        if in_place and target is not inputs:
            self.applied["identity"] += 1
            return func(*args, **kwargs)
        rest_args, rest_kwargs = args[1:], dict(kwargs)
        if not args:
            rest_kwargs.pop("input", None)
        if in_place:  # computed out of place on a copy, then written back where the model expects it
            out_of_place = _out_of_place(func)
            rest_kwargs.pop("inplace", None)

            def function(x: Tensor) -> Tensor:
                return out_of_place(x.clone(), *rest_args, **rest_kwargs)
        else:

            def function(x: Tensor) -> Tensor:
                return func(x, *rest_args, **rest_kwargs)

        at_zero = value_at_zero(function, inputs)
        self.applied["shifted identity" if at_zero else "identity"] += 1
        result = IdentityRule.apply(function, inputs.clone() if in_place else inputs, at_zero)
        if in_place:
            result = inputs.copy_(result)
        if at_zero:
            self.gates[result] = True
        return result

    def _norm(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              path: list[Tensor]) -> Any:
        inputs = args[0] if args else kwargs.get("input")
        surrogate = _norm_surrogate(func, args, kwargs)
        if surrogate is None or len(path) != 1 or path[0] is not inputs:
            self.unruled.setdefault(self.where(func))
            return func(*args, **kwargs)
        self.applied["norm"] += 1
        rest_args, rest_kwargs = args[1:], {key: value for key, value in kwargs.items() if key != "input"}
        exact = partial(_call_on, func, rest_args, rest_kwargs)
        if function_name(func) == "layer_norm":
            values = list(args) + [None] * 5
            shape = kwargs.get("normalized_shape", values[1])
            weight, bias = kwargs.get("weight", values[2]), kwargs.get("bias", values[3])
            eps = kwargs.get("eps", values[4] if values[4] is not None else 1e-5)
            return LayerNormIdentity.apply(inputs, list(shape), None if weight is None else weight.detach(),
                                           None if bias is None else bias.detach(), eps)
        return Surrogate.apply(exact, surrogate, inputs)

    def _cosine_similarity(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                           inputs: Tensor) -> Any:
        """x1·x2 / (‖x1‖ ‖x2‖) with the norms held constant, as a function of the one operand on the path."""
        values = list(args) + [kwargs.get(name) for name in ("x1", "x2", "dim", "eps")[len(args):]]
        first, second = values[0], values[1]
        dim = 1 if values[2] is None else values[2]
        eps = 1e-8 if values[3] is None else values[3]
        if not (isinstance(first, Tensor) and isinstance(second, Tensor)):
            self.unruled.setdefault(self.where(func))
            return func(*args, **kwargs)
        first_on_path = inputs is first
        other = second if first_on_path else first

        def exact(x: Tensor) -> Tensor:
            return func(x, other, dim, eps) if first_on_path else func(other, x, dim, eps)

        def similarity(x: Tensor) -> Tensor:
            norms = x.norm(dim=dim).clamp_min(eps) * other.norm(dim=dim).clamp_min(eps)
            return (x * other).sum(dim) / norms.detach()

        self.applied["norm"] += 1
        return Surrogate.apply(exact, similarity, inputs)

    def _layer(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               path: list[Tensor]) -> Any:
        rule = self.linear_rule if func is F.linear else self.conv_rule
        options = dict(kwargs)
        named = [options.pop(key, None) for key in ("input", "weight", "bias")[len(args):]]
        inputs, weight, bias = list(args[:3]) + named
        if len(path) != 1 or path[0] is not inputs or not isinstance(weight, Tensor):
            if len(path) > 1 or (path and path[0] is not inputs):
                self.unruled.setdefault(self.where(func) + " (its weight depends on the input)")
            return func(*args, **kwargs)
        self.applied["linear" if func is F.linear else "convolution"] += 1
        if rule is None:
            return func(*args, **kwargs)
        self.applied["gamma"] += 1
        rest = args[3:]
        return GammaGradient.apply(lambda x, w, b: func(x, w, b, *rest, **options), rule, inputs, weight.detach(),
                                   None if bias is None else bias.detach())

    # -- attention

    def _attention(self, on_path: tuple[bool, bool, bool], query: Tensor, key: Tensor, value: Tensor,
                   attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
        """``scaled_dot_product_attention`` with the uniform rule on its two products (fused where nothing is
        recorded)."""
        query, key, value, output_share = self._attention_operands(query, key, value, on_path,
                                                                   self.on_attention is not None)
        if self.on_attention is None:
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
        if query.dim() == 3:  # (N, L, E): one head
            mask = attn_mask.unsqueeze(1) if attn_mask is not None and attn_mask.dim() == 3 else attn_mask
            output, probabilities = attend(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, dropout_p,
                                           is_causal, scale, enable_gqa)
            output = output.squeeze(1)
        else:
            output, probabilities = attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        self.on_attention(probabilities, self.current_module())
        return scaled_gradient(output, output_share)

    def _core(self, on_path: tuple[bool, bool, bool], query: Tensor, key: Tensor, value: Tensor,
              mask: Optional[Tensor], dropout_p: float, needed: bool) -> tuple[Tensor, Optional[Tensor]]:
        """``nn.MultiheadAttention``'s attention over heads (``explain.core.attention.AttentionCore``)."""
        recorded = self.on_attention is not None
        query, key, value, output_share = self._attention_operands(query, key, value, on_path, recorded)
        if not recorded and not needed:
            return F.scaled_dot_product_attention(query, key, value, mask, dropout_p), None
        output, probabilities = attend(query, key, value, mask, dropout_p)
        if self.on_attention is not None:
            self.on_attention(probabilities, self.current_module())
        return scaled_gradient(output, output_share), probabilities

    def _attention_operands(self, query: Tensor, key: Tensor, value: Tensor, on_path: tuple[bool, bool, bool],
                            recorded: bool) -> tuple[Tensor, Tensor, Tensor, float]:
        """The uniform rule on softmax(QKᵀ)·V: A·V splits its relevance between A and V (each ½ when both depend
        on the input), QKᵀ splits A's between Q and K (each ½ when both do); CP-LRP holds Q and K constant.
        Returns the operands and the gradient share of the output. Fused, every share is put on the operands
        (Q and K get both splits, V A·V's). Step by step (``recorded``), A·V's split is put on the output, so that
        the gradient reaching A, whose relevance is recorded, includes it as in an eager attention."""
        if self.conservative:
            return query.detach(), key.detach(), value, 1.0
        scores_on_path = on_path[0] or on_path[1]
        weights_share = 1 / max(1, scores_on_path + on_path[2])
        scores_share = 1 / max(1, on_path[0] + on_path[1])
        if recorded:
            return scaled_gradient(query, scores_share), scaled_gradient(key, scores_share), value, weights_share
        share = weights_share * scores_share
        return scaled_gradient(query, share), scaled_gradient(key, share), scaled_gradient(value, weights_share), 1.0


def _operands_on(path: list[Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, bool, bool]:
    """Which of an attention call's query, key and value (its first three arguments) depend on the input."""
    operands = list(args[:3]) + [kwargs.get(name) for name in ("query", "key", "value")[len(args):]]
    on = [any(operand is tensor for tensor in path) for operand in operands]
    return on[0], on[1], on[2]


def _scaled(value: Any, path: list[Tensor], factor: float) -> Any:
    """The arguments with each path tensor's gradient scaled by ``factor``."""
    if isinstance(value, Tensor):
        return scaled_gradient(value, factor) if any(value is tensor for tensor in path) else value
    if type(value) in (list, tuple):
        return type(value)(_scaled(item, path, factor) for item in value)
    if type(value) is dict:
        return {key: _scaled(item, path, factor) for key, item in value.items()}
    return value


def _held(value: Any, gates: list[Tensor]) -> Any:
    """The arguments with each of ``gates`` detached: held constant, no relevance through it."""
    if isinstance(value, Tensor):
        return value.detach() if any(value is gate for gate in gates) else value
    if type(value) in (list, tuple):
        return type(value)(_held(item, gates) for item in value)
    if type(value) is dict:
        return {key: _held(item, gates) for key, item in value.items()}
    return value


def _routes_a_gate(func: Callable[..., Any], args: tuple[Any, ...], path: list[Tensor],
                   gates: WeakIdKeyDictionary) -> bool:
    """Whether a routing call moves a gate's values: its path tensors are all gates, or it is ``g.expand_as(x)``
    (``view_as``, ``reshape_as``, ``type_as``) of a gate ``g``, whose other tensor only gives the shape."""
    if function_name(func).endswith("_as") and args and isinstance(args[0], Tensor):
        return args[0] in gates
    return all(tensor in gates for tensor in path)


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if type(value) in (list, tuple):
        return type(value)(_detached(item) for item in value)
    return value


def _out_of_place(func: Callable[..., Any]) -> Callable[..., Any]:
    """The out-of-place form of an in-place activation (``F.gelu`` for ``Tensor.gelu_``), or the function itself
    called with ``inplace=False``."""
    name = function_name(func)
    if name.endswith("_"):
        base = name[:-1]
        for namespace in (F, torch, Tensor):
            found = getattr(namespace, base, None)
            if callable(found):
                return found
    return func


def _is_square_root(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """x ** 0.5 or x ** -0.5: a norm's divisor computed as a power (CLIP's ``_get_vector_norm``), held constant as
    ``sqrt`` and ``rsqrt`` are."""
    if func not in POWERS or function_name(func) not in ("pow", "__pow__"):
        return False
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    return isinstance(exponent, (int, float)) and abs(exponent) == 0.5


def _is_attention_softmax(result: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A softmax over the last dimension of (N, heads, T_q, T_k) scores."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(result, Tensor) and result.dim() == 4 and dim in (-1, 3)


class AttnLrpScope(CallScope[AttnLrpRules]):
    """``with AttnLrpScope(model, rules):`` — this thread's forward passes run with the AttnLRP rules (hooks on the
    model's modules say where each call is and handle activation modules whole); all removed when the block ends."""

    def __init__(self, model: nn.Module, rules: AttnLrpRules):
        super().__init__(model)
        self.model_traced = model
        self.rules = rules

    def setup(self) -> AttnLrpRules:
        from ..core.rules import CallRules

        for module in self.rules.activations:
            self.forward_pre_hook(module, self.rules.entering)
            self.forward_hook(module, self.rules.leaving)
        self.enter(CallRules([self.rules]))
        return self.rules
