"""DeepLIFT's rules (see ``explain.methods.deeplift``): which torch function gets which rule during
the images' forward, paired call by call with the baselines' forward, and the autograd functions
that carry the multipliers."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.attention import calling_module
from ..core.capture import ModelInputError
from ..core.rules import CallRules, Rule, function_name, signature_of, tensors_in, torch_functions, writes_in_place
from ..core.scope import CallScope
from ._deeplift_backward import Linearized, MaxPoolRule, MaxReductionRule, RescaledNonlinearity
from ._deeplift_decompositions import (
    COMPOSITES,
    scaled,
)
from .gradients import detached_output

# ------------------------------------------------------------------ which torch function gets which rule


def _property_getters(*names: str) -> set[Callable[..., Any]]:
    """The getters of these ``Tensor`` properties, which is what a mode sees of ``x.T``."""
    return {getattr(Tensor, name).__get__ for name in names}


ELEMENTWISE = torch_functions(
    "relu", "relu_", "relu6", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "selu", "selu_",
    "celu", "celu_", "gelu", "silu", "mish", "softplus", "hardswish", "hardsigmoid", "sigmoid", "sigmoid_", "expit",
    "tanh", "tanh_", "threshold", "threshold_", "clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_min_",
    "clamp_max", "clamp_max_", "prelu", "rrelu", "rrelu_", "logsigmoid", "log_sigmoid", "softsign", "tanhshrink",
    "softshrink", "hardshrink", "exp", "exp_", "exp2", "exp2_", "expm1", "expm1_", "log", "log_", "log2", "log2_",
    "log10", "log10_", "log1p", "log1p_", "logit", "logit_", "sqrt", "sqrt_", "rsqrt", "rsqrt_", "reciprocal",
    "reciprocal_", "square", "square_", "pow", "pow_", "__pow__", "__rpow__", "__ipow__", "float_power", "abs", "abs_",
    "absolute", "__abs__", "sin", "sin_", "cos", "cos_", "tan", "atan", "atan_", "arctan", "sinh", "cosh", "asinh",
    "erf", "erf_", "erfc", "erfinv", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "nan_to_num",
    "maximum", "minimum", "fmax", "fmin", "remainder", "fmod", "__mod__", "floor_divide", "__floordiv__",
    "__rfloordiv__", "atan2", "hypot", "xlogy", "special_expit", "special_erf", "special_erfc", "special_logit",
    "special_log1p", "special_expm1", "special_exp2",
)
"""Elementwise functions of one tensor that depends on the input (their other arguments constants):
the rescale rule."""
PRODUCTS = torch_functions("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__", "matmul", "__matmul__",
                           "__rmatmul__", "bmm", "mm", "mv", "outer", "ger", "dot", "inner", "einsum")
"""Linear in each of two tensors: a product of two that depend on the input gets the rule of products."""
DIVISIONS = torch_functions("div", "div_", "divide", "true_divide", "true_divide_", "__truediv__", "__rtruediv__",
                            "__itruediv__", "__rdiv__", "__div__")
"""a / b: linear in a; with b depending on the input, the rule of quotients."""
DIVIDED_BY_SELF = torch_functions("__rtruediv__", "__rdiv__")
"""Quotients whose first argument is the divisor (``2 / x``)."""
MAX_POOLS: dict[Callable[..., Any], tuple[tuple[str, ...], int]] = {
    F.max_pool1d: (("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"), 1),
    F.max_pool2d: (("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"), 2),
    F.max_pool3d: (("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"), 3),
    F.adaptive_max_pool1d: (("output_size", "return_indices"), 1),
    F.adaptive_max_pool2d: (("output_size", "return_indices"), 2),
    F.adaptive_max_pool3d: (("output_size", "return_indices"), 3),
}
"""Max pooling: its positional parameters after the input, and its number of spatial dimensions."""
MAXIMA = torch_functions("amax", "max")
MINIMA = torch_functions("amin", "min")
SOFTMAXES: dict[Callable[..., Any], str] = {
    **dict.fromkeys(torch_functions("softmax"), "softmax"),
    **dict.fromkeys(torch_functions("log_softmax"), "log_softmax"),
    **dict.fromkeys(torch_functions("softmin"), "softmin"),
}
LAYERS = torch_functions("linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                         "conv_transpose3d", "addmm", "addbmm", "baddbmm", "addmv", "tensordot", "kron")
"""Linear in the input when their weights do not depend on it (no rule where they do)."""
LINEAR = torch_functions(
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "subtract", "__sub__", "__rsub__", "__isub__",
    "rsub", "neg", "neg_", "negative", "__neg__", "positive", "__pos__", "sum", "nansum", "mean", "nanmean", "cumsum",
    "diff", "trace", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "interpolate", "upsample", "upsample_bilinear", "upsample_nearest", "fold", "unfold",
    "pad", "constant_pad_nd", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel",
    "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "permute", "transpose", "transpose_", "t", "t_", "movedim",
    "moveaxis", "swapaxes", "swapdims", "adjoint", "contiguous", "clone", "to", "type", "type_as", "float", "double",
    "half", "bfloat16", "cpu", "cuda", "expand", "expand_as", "broadcast_to", "sum_to_size", "as_strided", "repeat",
    "tile", "repeat_interleave", "narrow", "select", "index_select", "gather", "take", "take_along_dim",
    "masked_fill", "masked_fill_", "masked_select", "masked_scatter", "masked_scatter_", "where", "__getitem__",
    "__setitem__", "copy_", "index_put", "index_put_", "index_add", "index_add_", "index_copy", "index_copy_",
    "scatter", "scatter_", "scatter_add", "scatter_add_", "chunk", "split", "split_with_sizes", "tensor_split",
    "hsplit", "vsplit", "unbind", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "flip",
    "fliplr", "flipud", "roll", "rot90", "diag", "diagonal", "diag_embed", "tril", "triu", "pixel_shuffle",
    "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "dropout", "dropout_", "dropout1d", "dropout2d",
    "dropout3d", "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
    "feature_dropout", "feature_dropout_", "requires_grad_", "retain_grad", "zero_", "fill_", "align_as",
) | _property_getters("T", "mT", "H", "mH", "real")
"""Linear functions (given the values of their integer and boolean arguments): their own gradient is exact."""
CONSTANT = torch_functions("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
                           "randint_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor")
"""Functions whose result does not depend on the values of their tensor arguments."""
NO_VALUES = torch_functions("register_hook", "retain_grad", "register_post_accumulate_grad_hook", "dim", "size",
                            "numel", "is_floating_point", "is_complex", "element_size", "data_ptr", "stride",
                            "is_contiguous", "get_device") | _property_getters("shape", "device", "dtype", "ndim",
                                                                             "requires_grad", "is_cuda", "grad_fn")
"""Functions that compute no values from their tensors (hooks, sizes, flags): computed as they are, unpaired."""
CUTS = torch_functions("detach", "detach_") | _property_getters("data")
"""Functions through which no gradient flows."""
VALUE_READS = torch_functions("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
                              "__complex__")
"""Functions that turn tensor values into Python values, which DeepLIFT cannot follow."""


# ------------------------------------------------------------------ the rules' autograd functions


# ------------------------------------------------------------------ the record of the baselines' forward


PLAIN = object()
"""What a rule returns for a call to be computed as it is."""

GRADIENTS_OFF = ("and what follows it there: computed with gradients off, inside a custom torch.autograd.Function "
                 "(whose own backward gives the gradient, as in timm's memory-efficient SwishMe, HardSwishMe, MishMe) "
                 "or a torch.no_grad() block, where DeepLIFT's rules cannot reach the gradient")
"""Why a call on the input's path computed while autograd records nothing gets no rule."""


@dataclass
class _Call:
    """One call of the baselines' forward on tensors that depend on the input: the function, the
    shapes of those tensors, and what its rule needs of their values (copies, taken before the call)."""

    function: Callable[..., Any]
    shapes: tuple[torch.Size, ...]
    references: list[Any] = field(default_factory=list)
    selectors: list[Tensor] = field(default_factory=list)


def _replaced(value: Any, replacement: Callable[[int, Tensor], Optional[Tensor]], counter: list[int]) -> Any:
    """``value`` (a call's arguments) with the n-th tensor met (in the order of ``tensors_in``) replaced by
    ``replacement(n, tensor)`` where that is not None."""
    if isinstance(value, Tensor):
        index = counter[0]
        counter[0] += 1
        replaced = replacement(index, value)
        return value if replaced is None else replaced
    if isinstance(value, (list, tuple)):
        items = [_replaced(item, replacement, counter) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples take fields
    if type(value) is dict:
        return {key: _replaced(item, replacement, counter) for key, item in value.items()}
    return value


class _Replay:
    """A call made again with other values at some of its tensor occurrences (in the order of
    ``tensors_in``): ``replay(*values)``. An in-place call writes into a copy, never into a value given."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 occurrences: Sequence[int], in_place: bool):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.occurrences, self.in_place = list(occurrences), in_place

    def __call__(self, *values: Any) -> Any:
        if self.in_place:
            values = tuple(value.clone() if index == 0 and isinstance(value, Tensor) else value
                           for index, value in enumerate(values))
        chosen = dict(zip(self.occurrences, values))
        counter = [0]
        args = _replaced(self.args, lambda index, _: chosen.get(index), counter)
        kwargs = _replaced(self.kwargs, lambda index, _: chosen.get(index), counter)
        return self.function(*args, **kwargs)


def _occurrences(value: Any, tensor: Tensor) -> list[int]:
    """The positions (in the order of ``tensors_in``) at which ``tensor`` itself appears in ``value``."""
    return [index for index, seen in enumerate(tensors_in(value)) if seen is tensor]


def _mean(value: Any, reference: Any) -> Any:
    """(value + reference) / 2 for tensors that depend on the input; a constant as it is."""
    return value if reference is None else (value.detach() + reference) / 2


class _TensorSet:
    """Tensors by identity, held weakly: ``tensor in tensors`` for one that is alive and was added. (An id-keyed
    dict of weak references: a lookup makes no weak reference, as ``WeakIdKeyDictionary``'s does, and DeepLIFT looks
    up every tensor of every call of both forwards.)"""

    def __init__(self) -> None:
        self._references: dict[int, weakref.ref[Tensor]] = {}

    def add(self, tensor: Tensor) -> None:
        self._references[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor: object) -> bool:
        reference = self._references.get(id(tensor))
        return reference is not None and reference() is tensor


def _tensors_of(value: Any, found: list[Tensor]) -> list[Tensor]:
    """``found`` with the tensors of a call's arguments or results appended, in ``tensors_in``'s order."""
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors_of(item, found)
    elif type(value) is dict:
        for item in value.values():
            _tensors_of(item, found)
    return found


class DeepLiftRules(Rule):
    """DeepLIFT's rules for one pair of forward passes: the baselines' (``explaining`` False), recorded
    call by call, then the images' (``explaining`` True), whose calls get their rules from the record.
    Follows the tensors that depend on the input (``follow``) through every torch function called;
    ``unruled`` names the nonlinear calls on them that got no rule, with why, for the warning."""

    sees_every_call = True

    def __init__(self, eps: float, module_names: dict[int, str]):
        self.eps = eps
        self.module_names = module_names
        self.dependent = _TensorSet()
        self.record: list[_Call] = []
        self.explaining = False
        self.position = 0
        self.unruled: dict[str, str] = {}
        self.gradients_off: set[str] = set()
        """The modules that computed on the input's path with gradients off (named once each in ``unruled``)."""
        self.mode: Optional[CallRules] = None
        """The mode this rule is in: entered again to compute a function step by step."""
        self.paused = False

    # -- the two passes

    def follow(self, tensor: Tensor) -> None:
        """Mark a tensor as the input: what is computed from it depends on the input."""
        self.dependent.add(tensor)

    def explain_next(self, reference_output: Any) -> Any:
        """The next forward pass is the images': pair its calls with the baselines' forward just recorded.
        Returns the baselines' output detached (its graph is not needed)."""
        self.paused = True
        try:
            reference_output = detached_output(reference_output)
        finally:
            self.paused = False
        self.explaining, self.position = True, 0
        return reference_output

    def check_paired(self) -> None:
        """After the images' forward: every call of the baselines' forward had its pair."""
        if self.position != len(self.record):
            missing = self.record[self.position]
            raise ModelInputError(self._unpaired(f"the images' forward ended where the baselines' went on with "
                                                 f"{function_name(missing.function)}"))

    def _unpaired(self, what: str) -> str:
        return (f"DeepLIFT runs the model on the baselines, then on the images, and pairs their operations one by "
                f"one; {what}. The model computes other operations for other input values (control flow that "
                f"depends on them), which DeepLIFT cannot pair: explain it with IntegratedGradients instead.")

    def _pair(self, func: Callable[..., Any], dependent: list[Tensor]) -> _Call:
        shapes = tuple(tensor.shape for tensor in dependent)
        if not self.explaining:
            self.record.append(_Call(func, shapes))
            return self.record[-1]
        if self.position >= len(self.record):
            raise ModelInputError(self._unpaired(f"{self._where(func)} in the images' forward has no pair in the "
                                                 f"baselines' forward, which ended before"))
        call = self.record[self.position]
        self.position += 1
        if call.function != func or call.shapes != shapes:
            raise ModelInputError(self._unpaired(
                f"{self._where(func)} on {[tuple(shape) for shape in shapes]} in the images' forward met "
                f"{function_name(call.function)} on {[tuple(shape) for shape in call.shapes]} in the baselines'"))
        return call

    def _where(self, func: Callable[..., Any]) -> str:
        module = calling_module(self.module_names)
        return f"{module or 'model'}: {function_name(func)}"

    def _no_rule(self, func: Callable[..., Any], why: str) -> None:
        if self.explaining:
            self.unruled.setdefault(self._where(func), why)

    # -- every call

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.paused or func in CONSTANT or func in NO_VALUES:
            return func(*args, **kwargs)
        dependent = list({id(tensor): tensor for tensor in _tensors_of((args, kwargs), [])
                          if tensor in self.dependent}.values())
        if not dependent:  # parameters, constants: computed plainly, exact there
            return func(*args, **kwargs)
        call = self._pair(func, dependent)
        if func in VALUE_READS:
            self._compare(call, dependent, func, True, "it reads the input's values as Python numbers")
            return func(*args, **kwargs)
        in_place = writes_in_place(func, args, kwargs)
        selectors = [tensor for tensor in dependent if not tensor.is_floating_point()]
        if selectors and not self.explaining:
            self._compare(call, selectors, func, True)
        values = [tensor for tensor in dependent if tensor.is_floating_point()]
        result = self._rule(func, args, kwargs, call, values, in_place) if values else PLAIN
        if result is PLAIN:
            result = func(*args, **kwargs)
        if selectors and self.explaining:
            self._compare(call, selectors, func, any(tensor.is_floating_point() for tensor in tensors_in(result)))
        for tensor in _tensors_of(result, []):
            self.dependent.add(tensor)
        if in_place and args and isinstance(args[0], Tensor):
            self.dependent.add(args[0])
            if args[0]._base is not None:
                self.dependent.add(args[0]._base)
        return result

    def _compare(self, call: _Call, tensors: list[Tensor], func: Callable[..., Any], matters: bool,
                 why: str = "it depends on the input through comparisons or indices, which have no gradient") -> None:
        """Tensors that depend on the input but carry no gradient (masks, indices; values read as numbers) must be
        the same in both forwards for the call to be exact: on the baselines' forward, record them; on the
        images', where they differ and it ``matters`` (the call computes floating-point values from them), the
        call gets no rule."""
        if not self.explaining:
            with torch.no_grad():
                call.selectors = [tensor.clone() for tensor in tensors]
        elif matters and any(not torch.equal(tensor, reference) for tensor, reference in zip(tensors, call.selectors)):
            self._no_rule(func, why)

    def _references(self, call: _Call, tensors: Sequence[Optional[Tensor]]) -> list[Any]:
        """On the baselines' forward, record copies of these tensors (None: a constant); on the images',
        the copies recorded at the paired call."""
        if not self.explaining:
            with torch.no_grad():  # copies outside the graph
                call.references = [None if tensor is None else tensor.clone() for tensor in tensors]
        return call.references

    def _rule(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
              values: list[Tensor], in_place: bool) -> Any:
        """The call computed with its rule (on the baselines' forward: plainly, with what the rule of the
        images' forward needs recorded); ``PLAIN`` where it is to be computed plainly."""
        if not torch.is_grad_enabled():  # the model's own no-grad block, or a custom autograd.Function's forward
            result = func(*args, **kwargs)
            module = calling_module(self.module_names) or "model"
            if self.explaining and module not in self.gradients_off and any(
                    tensor.is_floating_point() for tensor in tensors_in(result)):
                self.gradients_off.add(module)  # one entry per module: a custom function runs several steps
                self._no_rule(func, GRADIENTS_OFF)
            return result
        composite = COMPOSITES.get(func)
        if composite is not None:
            assert self.mode is not None, "deeplift_rules gives the rule its mode"
            with self.mode:  # the steps get their own rules, and are paired step by step
                result = composite(*args, **kwargs)
            if result is NotImplemented:
                self._no_rule(func, "DeepLIFT has no rule for these arguments")
                return PLAIN
            return result
        if func is scaled:
            return self._scaled(args, call, values)
        if func in SOFTMAXES:
            return self._softmax(func, args, kwargs, call, values)
        if func in MAX_POOLS:
            return self._max_pool(func, args, kwargs, call, values)
        if func in MAXIMA or func in MINIMA:
            reduction = _max_reduction(func, args, kwargs)
            if reduction is not None:
                return self._max_reduction(func, args, kwargs, call, values, *reduction)
        if func in DIVISIONS:
            return self._division(func, args, kwargs, call, values, in_place)
        if func in PRODUCTS:
            return self._product(func, args, kwargs, call, values, in_place)
        if func in ELEMENTWISE or func in MAXIMA or func in MINIMA:
            return self._elementwise(func, args, kwargs, call, values, in_place)
        if func in LINEAR:
            return PLAIN
        if func in LAYERS:
            if len(values) > 1:
                self._no_rule(func, "its weights depend on the input")
            return PLAIN
        if func is F.batch_norm:
            return self._batch_norm(func, args, kwargs, values)
        if func in CUTS:
            self._no_rule(func, "no gradient flows through it")
            return PLAIN
        result = func(*args, **kwargs)
        if any(tensor.is_floating_point() for tensor in tensors_in(result)):
            self._no_rule(func, "DeepLIFT has no rule for it")
        return result

    # -- the rules

    def _elementwise(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                     values: list[Tensor], in_place: bool) -> Any:
        if len(values) != 1 or (in_place and args[0] is not values[0]):
            self._no_rule(func, "it is a nonlinear function of several tensors that depend on the input")
            return PLAIN
        (inputs,) = values
        (reference,) = self._references(call, [inputs])
        if not self.explaining:
            return PLAIN
        occurrences = _occurrences((args, kwargs), inputs)
        single = _Single(_Replay(func, args, kwargs, occurrences, in_place), len(occurrences))
        if in_place and inputs._base is None:  # the call's own in-place write (a view's is copied back below)
            writes = _Single(_Replay(func, args, kwargs, occurrences, False), len(occurrences))
            return RescaledNonlinearity.apply(inputs, single, writes, reference, self.eps)
        result = RescaledNonlinearity.apply(inputs, single, None, reference, self.eps)
        return inputs.copy_(result) if in_place else result

    def _product(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                 values: list[Tensor], in_place: bool) -> Any:
        """Δ(a ∘ b) = Δa ∘ b̄ + ā ∘ Δb for ∘ linear in each of a and b (exact)."""
        occurrences = [index for index, tensor in enumerate(tensors_in((args, kwargs))) if tensor in self.dependent
                       and tensor.is_floating_point()]
        if len(occurrences) == 1:
            return PLAIN  # a product with a constant: linear
        if len(occurrences) != 2 or (in_place and occurrences[0] != 0):
            self._no_rule(func, "it multiplies more than two tensors that depend on the input")
            return PLAIN
        operands = [list(tensors_in((args, kwargs)))[index] for index in occurrences]
        same = operands[0] is operands[1]  # a square, x * x: one copy
        references = self._references(call, operands[:1] if same else operands)
        if not self.explaining:
            return PLAIN
        means = [_mean(operand, reference) for operand, reference in zip(operands, references * 2 if same
                                                                         else references)]
        replay = _Replay(func, args, kwargs, occurrences, in_place)

        def linear_map(first: Tensor, second: Tensor) -> Tensor:
            return replay(first, means[1]) + replay(means[0], second)

        result = Linearized.apply(replay, linear_map, *operands)
        return operands[0].copy_(result) if in_place else result

    def _division(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                  values: list[Tensor], in_place: bool) -> Any:
        """Δ(a / b) = Δa · mean(1/b) + ā · Δ(1/b), Δ(1/b) = −Δb / (b b') (exact)."""
        if len(args) + len(kwargs) < 2:
            return PLAIN
        operands = list(args[:2]) + [kwargs[name] for name in ("input", "other") if name in kwargs][:2 - len(args)]
        numerator, denominator = operands[::-1] if func in DIVIDED_BY_SELF else operands
        if kwargs.get("rounding_mode") is not None or len(args) > 2:
            self._no_rule(func, "a division with rounding is a step function")
            return PLAIN
        if not (isinstance(denominator, Tensor) and denominator in self.dependent):
            return PLAIN  # divided by a constant: linear
        numerator_follows = isinstance(numerator, Tensor) and numerator in self.dependent
        reference_numerator, reference_denominator = self._references(
            call, [numerator if numerator_follows else None, denominator])
        if not self.explaining:
            return PLAIN
        reciprocal = 1 / denominator.detach()
        reference_reciprocal = 1 / reference_denominator
        mean_reciprocal = (reciprocal + reference_reciprocal) / 2
        multiplier = -reciprocal * reference_reciprocal  # Δ(1/b) / Δb, also where Δb = 0
        mean_numerator = _mean(numerator, reference_numerator)

        def linear_map(*differences: Tensor) -> Tensor:
            change = mean_numerator * (multiplier * differences[-1])
            return change + differences[0] * mean_reciprocal if numerator_follows else change

        inputs = [numerator, denominator] if numerator_follows else [denominator]
        target = args[0] if in_place else None

        def compute(*_: Tensor) -> Tensor:
            return func(args[0].clone(), *args[1:], **kwargs) if in_place else func(*args, **kwargs)

        result = Linearized.apply(compute, linear_map, *inputs)
        return target.copy_(result) if target is not None else result

    def _scaled(self, args: tuple[Any, ...], call: _Call, values: list[Tensor]) -> Any:
        """A normalisation's y = c · r, c its centred values, r = 1/σ per token (``scaled``). The rule of
        products would give Δy = Δc · r̄ + c̄ · Δr, exact but unusable where one side's tokens are (nearly)
        constant across channels, as those of the zero baseline are: there r' = 1/√eps (316 for a LayerNorm's
        eps = 1e-5), so Δc gets the multiplier r̄ ≈ 158/σ's worth of signal and Δr takes it back, two terms
        ~150 times larger than Δy and of opposite signs. Through a few normalisations in sequence the
        multipliers grow by that factor each time (1e14 after 8 LayerNorms) and the attributions, though
        summing to Δy in exact arithmetic, lose it to rounding. So Δy is split in the order that keeps the
        smaller scale: Δy = Δc · r + c' · Δr where r ≤ r' (the image's tokens vary more than the baseline's),
        Δy = Δc · r' + c · Δr elsewhere, each exact. Against a baseline whose tokens are constant (c' = 0) this
        is Δy = Δc · r, the normalisation held at the image's scale (the LayerNorm rule of Ali et al. 2022,
        which treats σ as a constant), and the scale's change gets no share, having none to give."""
        values_in, scale = args
        if len(values) != 2 or not all(isinstance(tensor, Tensor) and tensor in self.dependent
                                       for tensor in (values_in, scale)):
            return PLAIN  # a product with a constant: linear
        reference_values, reference_scale = self._references(call, [values_in, scale])
        if not self.explaining:
            return PLAIN
        image_smaller = scale.detach().abs() <= reference_scale.abs()
        kept_scale = torch.where(image_smaller, scale.detach(), reference_scale)
        kept_values = torch.where(image_smaller, reference_values, values_in.detach())

        def linear_map(values_difference: Tensor, scale_difference: Tensor) -> Tensor:
            return values_difference * kept_scale + kept_values * scale_difference

        return Linearized.apply(lambda *_: values_in * scale, linear_map, values_in, scale)

    def _softmax(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                 values: list[Tensor]) -> Any:
        """softmax(z) = e · (1/Σe), e = exp(z − c) with c shared by z and z': exp and the reciprocal by the
        rescale rule, the product by the rule of products (exact); log-softmax = z − c − log Σe likewise."""
        kind = SOFTMAXES[func]
        bound = _bound(func, args, kwargs, ("input", "dim", "dtype"))
        inputs, dim, dtype = bound.get("input"), bound.get("dim"), bound.get("dtype")
        if not isinstance(inputs, Tensor) or len(values) != 1 or values[0] is not inputs:
            self._no_rule(func, "DeepLIFT has no rule for these arguments")
            return PLAIN
        (reference,) = self._references(call, [inputs])
        if not self.explaining:
            return PLAIN
        if dim is None:  # softmax's legacy implicit dimension
            dim = 0 if inputs.dim() in (0, 1, 3) else 1
        sign = -1 if kind == "softmin" else 1
        z, z_ref = (sign * tensor.detach().to(dtype or tensor.dtype) for tensor in (inputs, reference))
        shift = torch.maximum(z.amax(dim, keepdim=True), z_ref.amax(dim, keepdim=True))
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        e, e_ref = torch.exp(z - shift), torch.exp(z_ref - shift)
        delta = z - z_ref
        small = ~(delta.abs() >= self.eps)
        exp_multiplier = torch.where(small, e, (e - e_ref) / torch.where(small, torch.ones_like(delta), delta))
        total, total_ref = e.sum(dim, keepdim=True), e_ref.sum(dim, keepdim=True)
        if kind == "log_softmax":
            total_delta = total - total_ref
            flat = ~(total_delta.abs() >= self.eps * total)
            log_multiplier = torch.where(flat, 1 / total, (torch.log(total) - torch.log(total_ref))
                                         / torch.where(flat, torch.ones_like(total), total_delta))

            def linear_map(difference: Tensor) -> Tensor:
                difference = difference.to(z.dtype)
                return difference - log_multiplier * (exp_multiplier * difference).sum(dim, keepdim=True)
        else:
            both = total * total_ref
            reciprocal_multiplier = torch.where(both > 0, -1 / both, torch.zeros_like(both))
            mean_reciprocal = torch.where(both > 0, (1 / total + 1 / total_ref) / 2, torch.zeros_like(both))
            mean_e = (e + e_ref) / 2

            def linear_map(difference: Tensor) -> Tensor:
                change = exp_multiplier * (sign * difference.to(z.dtype))
                return mean_e * (reciprocal_multiplier * change.sum(dim, keepdim=True)) + mean_reciprocal * change

        return Linearized.apply(lambda _: func(*args, **kwargs), linear_map, inputs)

    def _max_pool(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                  values: list[Tensor]) -> Any:
        names, spatial = MAX_POOLS[func]
        options = dict(zip(names, args[1:]))
        options.update(kwargs)
        inputs = args[0] if args else options.pop("input", None)
        if options.pop("return_indices", False) or len(values) != 1 or values[0] is not inputs:
            self._no_rule(func, "DeepLIFT has no rule for these arguments")
            return PLAIN
        if options.get("stride", 0) is None:
            options.pop("stride")
        (reference,) = self._references(call, [inputs])
        if not self.explaining:
            return PLAIN
        return MaxPoolRule.apply(inputs, reference, func, options, spatial)

    def _max_reduction(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
                       values: list[Tensor], dims: tuple[int, ...], keepdim: bool, with_indices: bool) -> Any:
        inputs = args[0]
        if len(values) != 1 or values[0] is not inputs:
            self._no_rule(func, "DeepLIFT has no rule for these arguments")
            return PLAIN
        (reference,) = self._references(call, [inputs])
        if not self.explaining:
            return PLAIN
        plain = func(*args, **kwargs)
        sign = -1 if func in MINIMA else 1
        dims = tuple(sorted(dim % inputs.dim() for dim in dims)) if dims else tuple(range(inputs.dim()))
        kept = MaxReductionRule.apply(inputs, reference, dims, sign)
        reduced = kept if keepdim else kept.squeeze(dims) if dims else kept
        if not with_indices:
            return reduced.reshape(plain.shape)
        return type(plain)((reduced.reshape(plain[0].shape), plain[1]))

    def _batch_norm(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    values: list[Tensor]) -> Any:
        bound = _bound(func, args, kwargs, ("input", "running_mean", "running_var", "weight", "bias", "training",
                                            "momentum", "eps"))
        if bound.get("training") or bound.get("running_mean") is None or bound.get("running_var") is None:
            self._no_rule(func, "it normalises by the statistics of the batch, which mixes the images")
        return PLAIN  # eval mode: z · s + t per channel, linear, its own gradient exact


class _Single:
    """A replayed call as a function of the one tensor it is elementwise in (at every place it appears)."""

    def __init__(self, replay: _Replay, count: int):
        self.replay, self.count = replay, count

    def __call__(self, value: Tensor) -> Tensor:
        return self.replay(*([value] * self.count))


def _bound(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           names: Sequence[str]) -> dict[str, Any]:
    """A call's arguments by name: through the signature of a Python function, else positionally in the
    order ``names`` gives (built-ins' order) with keywords as given."""
    signature = signature_of(func)
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return {}
        bound.apply_defaults()
        return dict(bound.arguments)
    return {**dict(zip(names, args)), **kwargs}


def _max_reduction(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> Optional[tuple[tuple[int, ...], bool, bool]]:
    """(dims, keepdim, whether it returns indices too) of a max/min/amax/amin over dimensions; None
    for ``max(a, b)`` of two tensors (elementwise)."""
    if len(args) > 1 and isinstance(args[1], Tensor) or isinstance(kwargs.get("other"), Tensor):
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", ())
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    name = function_name(func)
    if name in ("max", "min"):
        if dim == ():
            return (), False, False
        return (int(dim),), keepdim, True
    return (tuple(dim) if isinstance(dim, (tuple, list)) else (int(dim),)), keepdim, False


# ------------------------------------------------------------------ functions computed step by step


class deeplift_rules(CallScope[DeepLiftRules]):  # noqa: N801 - used like a function, as torch.no_grad is
    """``with deeplift_rules(eps, module_names) as rules:`` — this thread's forward passes run with
    DeepLIFT's rules (``DeepLiftRules``); removed when the block ends."""

    def __init__(self, eps: float = 1e-10, module_names: Optional[dict[int, str]] = None):
        super().__init__()
        self.rules = DeepLiftRules(eps, module_names or {})

    def setup(self) -> DeepLiftRules:
        self.rules.mode = CallRules([self.rules])
        self.enter(self.rules.mode)
        return self.rules
