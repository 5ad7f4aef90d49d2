"""How LRP follows a forward pass: the call-scoped rule that gives every torch function on the input's path its LRP
rule (see ``explain.methods.lrp`` for what each kind of function gets).

``_Trace`` is a ``Rule`` of ``explain.core.rules`` whose mode sees every torch function the forward calls (``CallRules``
only routes the functions of its table; LRP must also follow the path through the others and notice those it has
no rule for). It marks the tensors that depend on the input (a weak, identity-keyed table) and turns each call on
them into ``_Relevance.apply(rule, *path_tensors)``: an autograd function whose forward is the call itself and
whose backward is the rule. Hooks registered through the scope (on this thread only) name the module of each call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..core.caller import warn_at_callers_line
from ..core.capture import ModelInputError
from ..core.rules import CallRules, Rule, function_name, signature_of, tensors_in, torch_functions, writes_in_place
from ..core.scope import CallScope
from ._lrp_rules import BatchNormStatistics, Composite, Flat, LinearRule, ZBox, fold_batch_norm, proportional

# ------------------------------------------------------------------ which torch function gets which rule


LAYERS: dict[Callable, str] = {
    F.linear: "linear",
    **{function: "convolution" for function in (F.conv1d, F.conv2d, F.conv3d)},
    **{function: "transposed" for function in (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)},
}
"""Linear layers: their rule comes from the composite."""
ACTIVATIONS = torch_functions(
    "relu", "relu_", "relu6", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "selu", "selu_",
    "celu", "celu_", "gelu", "silu", "mish", "softplus", "hardswish", "hardsigmoid", "sigmoid", "sigmoid_", "tanh",
    "tanh_", "threshold", "threshold_", "clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_min_", "clamp_max",
    "clamp_max_", "prelu", "rrelu", "rrelu_", "logsigmoid", "softsign", "tanhshrink", "softshrink", "hardshrink",
)
"""Elementwise nonlinearities of one path tensor: relevance passes unchanged."""
ADDITIONS = torch_functions("add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "subtract", "__sub__",
                       "__rsub__", "__isub__", "rsub")
"""Sums: the relevance is split in proportion to the terms (one path term: it passes unchanged)."""
SCALINGS = torch_functions("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__", "div", "div_", "divide",
                      "true_divide", "true_divide_", "__truediv__", "__itruediv__", "neg", "neg_", "negative",
                      "__neg__")
"""Products: by a constant, relevance passes unchanged; of two path tensors, no rule (but see ``GATES``)."""
MULTIPLICATIONS = torch_functions("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__")
GATES = torch_functions("sigmoid", "sigmoid_", "hardsigmoid")
"""Activations whose output is a gate: in a product with a path tensor that is not a gate (squeeze-and-excitation's
x · σ(W s), CBAM's, ECA's), the gate is held constant and all the relevance passes to the gated tensor, as LRP treats
the gates of LSTMs (Arras et al. 2017, "signal-take-all") and as AttnLRP treats these gates."""
SUMS = torch_functions("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                  "adaptive_avg_pool3d", "mean", "sum", "interpolate", "upsample", "upsample_bilinear",
                  "upsample_nearest", "fold")
"""Linear functions with non-negative weights and no bias: relevance split in proportion to the contributions."""
ROUTING = torch_functions(
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "squeeze", "squeeze_", "unsqueeze",
    "unsqueeze_", "permute", "transpose", "transpose_", "t", "movedim", "moveaxis", "swapaxes", "swapdims",
    "contiguous", "clone", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda", "expand",
    "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave", "narrow", "select", "index_select", "gather",
    "take_along_dim", "masked_fill", "where", "__getitem__", "__setitem__", "copy_", "chunk", "split",
    "split_with_sizes", "tensor_split", "unbind", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "flip", "roll", "rot90", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "pad",
    "constant_pad_nd", "unfold", "max", "amax", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_",
    "requires_grad_", "detach",
)
"""Functions that only move, copy or select values: the plain gradient routes the relevance."""

PRODUCT_NAMES = ("mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__", "div", "div_", "divide",
                 "true_divide", "true_divide_", "__truediv__", "__itruediv__")
"""The endings of the unruled calls that are a product (or quotient) of two path tensors: AttnLRP has a rule for
products (its uniform rule; a gate held constant)."""
TRANSFORMER_FUNCTIONS = ("scaled_dot_product_attention", "multi_head_attention_forward", "softmax", "log_softmax",
                         "layer_norm", "rms_norm", "group_norm", "matmul", "bmm", "baddbmm", "einsum")
"""The endings of the unruled calls (``CallTrace.where``'s "module: function") that mark a transformer's attention,
softmax and norms: where LRP meets them, its warning names AttnLRP, which has rules for them."""

KINDS: dict[Callable, str] = {
    **{function: "route" for function in ROUTING},
    **{function: "pass" for function in ACTIVATIONS},
    **{function: "sum" for function in SUMS},
    **{function: "add" for function in ADDITIONS},
    **{function: "scale" for function in SCALINGS},
    **LAYERS,
    F.batch_norm: "batch_norm",
}

@dataclass(frozen=True)
class _Slot:
    index: int


def _template(value: Any, slots: dict[int, _Slot]) -> Any:
    """The arguments with each path tensor replaced by its slot."""
    if isinstance(value, Tensor):
        return slots.get(id(value), value)
    if type(value) in (list, tuple):
        return type(value)(_template(item, slots) for item in value)
    if type(value) is dict:
        return {key: _template(item, slots) for key, item in value.items()}
    return value


def _fill(value: Any, values: Sequence[Tensor]) -> Any:
    if isinstance(value, _Slot):
        return values[value.index]
    if type(value) in (list, tuple):
        return type(value)(_fill(item, values) for item in value)
    if type(value) is dict:
        return {key: _fill(item, values) for key, item in value.items()}
    return value


class _Call:
    """One call of a torch function on the relevance path, replayable with other values for its path tensors:
    ``call(*values)``. An in-place function writes into a copy of its target, never into a value given."""

    def __init__(self, function: Callable, args: tuple, kwargs: dict, path: Sequence[Tensor],
                 target: Optional[int]):
        slots = {id(tensor): _Slot(index) for index, tensor in enumerate(path)}
        self.function, self.target = function, target
        self.args, self.kwargs = _template(args, slots), _template(kwargs, slots)

    def __call__(self, *values: Tensor) -> Tensor:
        if self.target is not None:
            values = tuple(value.clone() if index == self.target else value for index, value in enumerate(values))
        return self.function(*_fill(self.args, values), **_fill(self.kwargs, values))


# ------------------------------------------------------------------ the rules of single calls


class _Passes:
    """The backward pass running (one per explained target) and the relevance each one started from."""

    def __init__(self) -> None:
        self.index = 0
        self.output_sums: dict[int, Tensor] = {}


def _row_sums(tensor: Tensor, rows: int) -> Optional[Tensor]:
    """(rows,) float64 sums over everything but the first dimension; None if the first dimension is not ``rows``."""
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        return None
    return tensor.detach().reshape(rows, -1).double().sum(dim=1)


class _CallRule(ABC):
    """The LRP rule of one call on the relevance path; its forward is the call itself."""

    keeps_inputs: ClassVar[bool] = True
    """Whether the backward needs the inputs' values (saved), or only their shapes."""

    def __init__(self, call: _Call, name: str, passes: _Passes):
        self.call, self.name, self.passes = call, name, passes
        self.sums: dict[int, tuple[Tensor, Tensor]] = {}

    @abstractmethod
    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        """The relevance at each path input (shapes ``shapes``; values ``inputs`` when the rule keeps them), given
        the relevance at the output."""

    def record(self, relevance: Tensor, sent: Sequence[Optional[Tensor]]) -> None:
        """Keep Σ relevance received and Σ relevance passed on, per row, for this backward pass."""
        rows = relevance.shape[0] if relevance.dim() else 0
        received = _row_sums(relevance, rows)
        parts = [_row_sums(part, rows) for part in sent if part is not None]
        summed = [part for part in parts if part is not None]
        if received is not None and summed and len(summed) == len(parts):
            self.sums[self.passes.index] = (received, torch.stack(summed).sum(dim=0))


class _PassRule(_CallRule):
    """Relevance passes unchanged (summed back over dimensions the call broadcast)."""

    keeps_inputs = False

    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        (shape,) = shapes
        return [relevance if relevance.shape == shape else relevance.sum_to_size(shape)]


class _ProportionalRule(_CallRule):
    """A sum or an average of its inputs: each gets the relevance in proportion to its contribution."""

    def __init__(self, call: _Call, name: str, passes: _Passes, stabilizer: float):
        super().__init__(call, name, passes)
        self.stabilizer = stabilizer

    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        sent: list[Optional[Tensor]] = list(proportional(self.call, inputs, relevance, self.stabilizer))
        self.record(relevance, sent)
        return sent


class _LayerRule(_CallRule):
    """A convolution or fully connected layer: the composite's rule, with the BatchNorm that reads its output folded in
    (``norm``, set when that BatchNorm runs)."""

    def __init__(self, call: _Call, name: str, passes: _Passes, rule: LinearRule,
                 layer: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor], weight: Tensor, bias: Optional[Tensor],
                 transposed: bool, groups: int):
        super().__init__(call, name, passes)
        self.rule, self.layer, self.weight, self.bias = rule, layer, weight, bias
        self.transposed, self.groups = transposed, groups
        self.norm: Optional[BatchNormStatistics] = None
        self.output_version = -1
        self._folded: Optional[tuple[Tensor, Tensor]] = None

    def parameters(self) -> tuple[Tensor, Optional[Tensor]]:
        """(weight, bias) of the layer as the rule sees it: with the BatchNorm folded in, new tensors."""
        if self.norm is None:
            return self.weight, self.bias
        if self._folded is None:
            self._folded = fold_batch_norm(self.weight, self.bias, self.norm, self.transposed, self.groups)
        return self._folded

    def redistribute(self, relevance: Tensor, inputs: Sequence[Tensor],
                     shapes: Sequence[torch.Size]) -> list[Optional[Tensor]]:
        weight, bias = self.parameters()
        sent: list[Optional[Tensor]] = [self.rule.relevance(self.layer, inputs[0], weight, bias, relevance)]
        self.record(relevance, sent)
        return sent


class _Relevance(torch.autograd.Function):
    """Forward: the call, exactly as the model makes it; backward: its rule's relevance at the path inputs."""

    @staticmethod
    def forward(ctx: Any, rule: _CallRule, *inputs: Tensor) -> Tensor:
        ctx.rule, ctx.shapes = rule, [tensor.shape for tensor in inputs]
        if rule.keeps_inputs:
            ctx.save_for_backward(*inputs)
        output = rule.call(*inputs)
        return output.clone() if any(output is tensor for tensor in inputs) else output

    @staticmethod
    def backward(ctx: Any, relevance: Tensor) -> tuple[Optional[Tensor], ...]:
        try:
            inputs = ctx.saved_tensors
        except RuntimeError as error:
            raise RuntimeError(
                f"LRP needs the input of {ctx.rule.name} in the backward pass, but the model changed it in place "
                "after that call; make that in-place operation out of place (e.g. nn.ReLU(inplace=False))."
            ) from error
        return (None, *ctx.rule.redistribute(relevance, inputs, ctx.shapes))


class _OutputRelevance(torch.autograd.Function):
    """Forward: identity; backward: R = output ⊙ ∂score/∂output, the relevance the propagation starts from (for a
    class score, the logit at that class and zero elsewhere). Its Σ per image is kept for ``output_relevance``: per
    row of a batch-first tensor, or all of it for image ``image`` of ``images`` (a tensor of one image, as the
    per-image dicts of torchvision's detectors hold, whose first dimension is its detections, not the batch)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, passes: _Passes, image: Optional[int] = None, images: int = 0) -> Tensor:
        ctx.passes, ctx.image, ctx.images = passes, image, images
        ctx.save_for_backward(output)
        return output.clone()

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, None, None, None]:
        (output,) = ctx.saved_tensors
        relevance = gradient * output
        sums: Optional[Tensor]
        if ctx.image is not None:
            one_image = torch.zeros(ctx.images, dtype=torch.float64, device=relevance.device)
            one_image[ctx.image] = relevance.detach().double().sum()
            sums = one_image
        else:
            sums = _row_sums(relevance, relevance.shape[0] if relevance.dim() else 0)
        if sums is not None:  # summed over the output's tensors (a detector's boxes and scores)
            earlier = ctx.passes.output_sums.get(ctx.passes.index)
            same_rows = earlier is not None and earlier.shape == sums.shape
            ctx.passes.output_sums[ctx.passes.index] = earlier + sums if same_rows else sums
        return relevance, None, None, None


def _each_tensor(output: Any, function: Callable[[Tensor], Tensor]) -> Any:
    """``output`` with ``function`` applied to each tensor in it: nested dicts (transformers' ModelOutput rebuilt as
    its own type), lists and tuples (named tuples too); anything else as it is."""
    if isinstance(output, Tensor):
        return function(output)
    if isinstance(output, Mapping):
        items = {key: _each_tensor(value, function) for key, value in output.items()}
        if type(output) is dict:
            return items
        try:
            return type(output)(**items)
        except TypeError:
            return items
    if isinstance(output, (list, tuple)):
        values = [_each_tensor(value, function) for value in output]
        if isinstance(output, tuple) and hasattr(output, "_fields"):
            return type(output)(*values)
        return type(output)(values) if type(output) in (list, tuple) else values
    return output


def _box_bound(bound: Tensor, inputs: Tensor, which: str) -> Tensor:
    """A z^B bound shaped to broadcast to the first layer's (N, C, ...) input: one value per channel, a scalar, or a
    tensor that broadcasts as given."""
    bound = bound.to(device=inputs.device, dtype=inputs.dtype)
    if bound.dim() == 1 and inputs.dim() >= 2 and bound.numel() == inputs.shape[1] and bound.numel() > 1:
        return bound.view(1, -1, *(1,) * (inputs.dim() - 2))
    try:
        torch.broadcast_shapes(bound.shape, inputs.shape)
    except RuntimeError:
        raise ModelInputError(
            f"{which} has shape {tuple(bound.shape)}, which fits neither the channels of the first convolution's "
            f"input {tuple(inputs.shape)} nor broadcasts to it: give one value per channel or a tensor that "
            "broadcasts to that input."
        ) from None
    return bound


# ------------------------------------------------------------------ following the forward pass


def _routes_a_gate(func: Callable, args: tuple, path: Sequence[Tensor], gates: WeakIdKeyDictionary) -> bool:
    """Whether a routing call moves a gate's values: its path tensors are all gates, or it is ``g.expand_as(x)``
    (``view_as``, ``reshape_as``, ``type_as``) of a gate ``g``, whose other tensor only gives the shape."""
    if function_name(func).endswith("_as") and args and isinstance(args[0], Tensor):
        return args[0] in gates
    return all(tensor in gates for tensor in path)


def mark_on_path(path: Any, value: Any) -> bool:
    """Mark the floating-point tensors of ``value`` that require grad in ``path`` (a weak tensor-keyed mapping);
    whether there were any."""
    found = False
    for tensor in tensors_in(value):
        if tensor.is_floating_point() and tensor.requires_grad:
            path[tensor] = True
            found = True
    return found


class _Trace(Rule):
    """The LRP rules of one call: follows the tensors that depend on the input through the forward pass and gives
    each torch function called on them its rule. One instance per call; the module names come from hooks."""

    functions = frozenset(KINDS)
    sees_every_call = True  # the input's path runs through functions it has no rule for too: noticed, named

    def __init__(self, composite: Composite, stabilizer: float, low: Optional[Tensor], high: Optional[Tensor],
                 hold_gates: bool = False):
        self.composite, self.stabilizer, self.low, self.high = composite, stabilizer, low, high
        self.hold_gates = hold_gates
        self.path: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.layer_outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.passes = _Passes()
        self.modules: list[str] = [""]
        self.recorded: list[_CallRule] = []
        self.unruled: dict[str, None] = {}
        self.gates: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """The path tensors that are gates (``GATES``): outputs of a sigmoid or hard sigmoid, and views of them."""
        self.gate_products: dict[str, None] = {}
        """The products of a gate and a path tensor that is not one, left without a rule (``hold_gates`` off)."""
        self.first_done = False
        self.layer_count = 0
        self.outside_box = False

    # -- module names

    def entering(self, name: str) -> Callable[..., None]:
        def push(module: nn.Module, args: tuple) -> None:
            self.modules.append(name)

        return push

    def leaving(self, module: nn.Module, args: tuple, output: Any) -> None:
        if len(self.modules) > 1:
            self.modules.pop()

    def where(self, function: Callable) -> str:
        return f"{self.modules[-1] or 'model'}: {function_name(function)}"

    # -- the path

    def follow(self, value: Any) -> bool:
        """Mark the floating-point tensors of ``value`` that require grad as on the path; whether there were any."""
        return mark_on_path(self.path, value)

    def compute(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        seen: dict[int, Tensor] = {}
        for tensor in tensors_in((args, kwargs)):
            if tensor in self.path:
                seen.setdefault(id(tensor), tensor)
        if not seen:
            return func(*args, **kwargs)
        path = list(seen.values())
        if func in MULTIPLICATIONS and len(path) > 1:
            gated = [tensor for tensor in path if tensor not in self.gates]
            if gated and len(gated) < len(path):  # x · gate
                if self.hold_gates:  # the gate is a constant of the call (a weight): R_x = R
                    path = gated
                else:
                    self.gate_products.setdefault(self.where(func))
        kind = KINDS.get(func)
        in_place = writes_in_place(func, args, kwargs)
        target = args[0] if args else kwargs.get("input")
        target_index = next((i for i, tensor in enumerate(path) if tensor is target), None) if in_place else None
        rule = None
        if kind not in (None, "route") and (not in_place or target_index is not None):
            rule = self.rule_for(func, kind, args, kwargs, path, target_index)
        if rule is None:
            result = func(*args, **kwargs)
            followed = self.follow(result) | (in_place and self.follow(target))
            if followed and kind != "route":
                self.unruled.setdefault(self.where(func))
            if kind == "route" and _routes_a_gate(func, args, path, self.gates):
                for tensor in tensors_in(result):
                    self.gates[tensor] = True
            return result
        inputs = list(path)
        if target_index is not None and rule.keeps_inputs:  # the saved value must outlive the in-place write
            inputs[target_index] = inputs[target_index].clone()
        result = _Relevance.apply(rule, *inputs)
        if target_index is not None:
            result = path[target_index].copy_(result)
        self.follow(result)
        if func in GATES:
            self.gates[result] = True
        if isinstance(rule, _LayerRule):
            rule.output_version = result._version
            self.layer_outputs[result] = rule
        return result

    def rule_for(self, func: Callable, kind: str, args: tuple, kwargs: dict, path: list[Tensor],
                 target: Optional[int]) -> Optional[_CallRule]:
        """The rule of one call on the path, or None where there is none."""
        call = _Call(func, args, kwargs, path, target)
        name = self.where(func)
        if kind in ("convolution", "transposed", "linear"):
            return self.layer_rule(func, kind, call, name, args, kwargs, path)
        if kind == "batch_norm":
            signature = signature_of(func)
            bound = signature.bind(*args, **kwargs) if signature is not None else None
            if bound is None or len(path) != 1 or path[0] is not bound.arguments.get("input"):
                return None
            bound.apply_defaults()
            self.fold(bound.arguments)
            return _PassRule(call, name, self.passes)
        if kind in ("pass", "scale", "add") and len(path) == 1:  # one path operand: elementwise
            return _PassRule(call, name, self.passes)
        if kind in ("sum", "add"):
            rule = _ProportionalRule(call, name, self.passes, self.stabilizer)
            self.recorded.append(rule)
            return rule
        return None  # a product of two path tensors

    def layer_rule(self, func: Callable, kind: str, call: _Call, name: str, args: tuple, kwargs: dict,
                   path: list[Tensor]) -> Optional[_LayerRule]:
        options = dict(kwargs)
        first_three = list(args[:3]) + [options.pop(key, None) for key in ("input", "weight", "bias")[len(args):]]
        inputs, weight, bias = first_three
        if len(path) != 1 or path[0] is not inputs or not isinstance(weight, Tensor):
            return None  # weights that depend on the input: no LRP rule
        rest = args[3:]
        groups = int(args[6] if len(args) > 6 else options.get("groups", 1))

        def layer(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
            return func(x, w, b, *rest, **options)

        if not self.first_done and kind in self.composite.first_kinds:
            self.first_done = True
            rule = self.first_rule(inputs)
        else:
            rule = self.composite.linear if kind == "linear" else self.composite.convolution
        self.layer_count += 1
        layer_rule = _LayerRule(call, name, self.passes, rule, layer, weight.detach(),
                                None if bias is None else bias.detach(), kind == "transposed", groups)
        self.recorded.append(layer_rule)
        return layer_rule

    def first_rule(self, inputs: Tensor) -> LinearRule:
        if self.composite.first == "flat":
            return Flat(self.stabilizer)
        assert self.low is not None and self.high is not None, "LRP gives a z^B composite its box (LRP._box)"
        low, high = _box_bound(self.low, inputs, "low"), _box_bound(self.high, inputs, "high")
        tolerance = 1e-4 * float((high - low).abs().max())
        values = inputs.detach()
        self.outside_box |= bool(((values < low - tolerance) | (values > high + tolerance)).any())
        return ZBox(low, high, self.stabilizer)

    def fold(self, arguments: dict) -> None:
        """Fold a BatchNorm into the layer whose output it reads directly (that output unchanged since)."""
        inputs = arguments["input"]
        layer = self.layer_outputs.get(inputs)
        if layer is None or layer.output_version != inputs._version or layer.norm is not None:
            return
        mean, var = arguments["running_mean"], arguments["running_var"]
        if arguments["training"] or mean is None or var is None:  # batch statistics, as batch_norm computes them
            dimensions = [dim for dim in range(inputs.dim()) if dim != 1]
            mean, var = inputs.detach().mean(dimensions), inputs.detach().var(dimensions, unbiased=False)
        weight, bias = arguments["weight"], arguments["bias"]
        layer.norm = BatchNormStatistics(mean.detach().clone(), var.detach().clone(),
                                         None if weight is None else weight.detach().clone(),
                                         None if bias is None else bias.detach().clone(), float(arguments["eps"]))

    # -- after the forward

    def start(self, output: Any) -> Any:
        """The model's output, with the backward pass starting from R = output ⊙ ∂score/∂output: for a tensor of
        scores, and for each floating-point tensor of a detector's output (a dict, a list, a transformers
        ModelOutput), whose score is read from its structure (``explain.detection``). A list of dicts is one dict
        per image (torchvision's detectors): its tensors' relevance is summed per image. A tensor of the output that
        depends on the input off the path this trace followed (through a call it could not see) gets a warning: its
        relevance would reach the input through the plain gradient, so the map is not LRP."""
        if isinstance(output, Tensor) and output.is_floating_point():
            return _OutputRelevance.apply(output, self.passes) if output.requires_grad else output
        started, untraced = [False], [0]

        def starter(image: Optional[int], images: int) -> Callable[[Tensor], Tensor]:
            def start_tensor(tensor: Tensor) -> Tensor:
                if not tensor.is_floating_point() or not tensor.requires_grad:
                    return tensor
                started[0] = True
                untraced[0] += tensor not in self.path
                return _OutputRelevance.apply(tensor, self.passes, image, images)

            return start_tensor

        if isinstance(output, Tensor):
            structured = output
        elif type(output) in (list, tuple) and output and all(isinstance(item, Mapping) for item in output):
            structured = type(output)(_each_tensor(item, starter(image, len(output)))
                                      for image, item in enumerate(output))
        else:
            structured = _each_tensor(output, starter(None, 0))
        if not started[0]:
            raise ValueError(
                f"LRP starts from the model's output scores, a floating-point tensor; this model returns "
                f"{type(output).__name__}{'' if isinstance(output, Tensor) else ' holding none in the graph'}. Pass "
                "output= to select the tensor of scores (or instances= for a detector)."
            )
        if untraced[0]:
            warn_at_callers_line(
                f"LRP: {untraced[0]} tensor(s) of the model's {type(output).__name__} output depend on the input "
                "through functions it cannot follow (not torch functions it sees, such as iterating over the batch "
                "or custom operators): the relevance reaching the input from them follows the plain gradient, so the "
                "map is not LRP. Explain a model whose forward is made of torch functions, or use a gradient method "
                "(Grad-CAM, ODAM, D-RISE).", RuntimeWarning)
        return structured

    def unruled_text(self) -> str:
        """What the calls without a rule are, and what to do about them ("" where there are none)."""
        if not self.unruled:
            return ""
        names = list(self.unruled)
        listed = ", ".join(names[:6])
        if len(names) > 6:
            counts = Counter(name.rsplit(": ", 1)[-1] for name in names)
            listed += f" and {len(names) - 6} more (in all: " + ", ".join(f"{function} ×{count}"
                                                               for function, count in counts.most_common()) + ")"
        text = (f"it has no rule for {listed} on the input's path: there the relevance follows the plain gradient, "
                "so the map is not LRP and relevance is not conserved (rules cover convolutions, linear layers, "
                "BatchNorm, elementwise activations, sums, average pooling and reshaping)")
        transformer = any(name.endswith(TRANSFORMER_FUNCTIONS) for name in names)
        products = any(name.endswith(PRODUCT_NAMES) for name in names if name not in self.gate_products)
        if transformer or products:
            what = ("a transformer's attention, softmax or normalisation" if transformer else
                    "products of two tensors that both depend on the input")
            text += (f". Among them are {what}: explain it with AttnLRP (explain.AttnLRP, --method attnlrp), whose "
                     "rules cover them, in one backward pass as LRP")
        if self.gate_products:
            gates = list(self.gate_products)
            text += (f". {len(gates)} of them ({', '.join(gates[:2])}{', ...' if len(gates) > 2 else ''}) multiply a "
                     "tensor by a sigmoid gate computed from it (squeeze-and-excitation): pass hold_gates=True "
                     "(--option hold_gates=true) to hold the gates constant, so that the gated tensor keeps all the "
                     "relevance (as LRP treats an LSTM's gates, and as AttnLRP does)")
        return text

    def gaps(self, output: Any) -> list[str]:
        """Where the map is not LRP: calls without a rule, no linear layer, inputs outside the z^B box."""
        problems = [self.unruled_text()] if self.unruled else []
        if isinstance(output, Tensor) and output.requires_grad and output not in self.path:
            problems.append("the model's output depends on the input through functions it cannot follow (not "
                            "torch functions), so the map is not LRP")
        elif self.layer_count == 0 and isinstance(output, Tensor) and output in self.path:
            problems.append("it found no convolution or linear layer on the input's path, so no LRP rule applied")
        if self.outside_box:
            problems.append(
                f"the first convolution's input lies outside the box [low, high] that the {self.composite.name} "
                "composite's z^B rule assumes (by default the preprocess's normalisation of pixel values in [0, 1]), "
                "which makes its relevance unreliable: pass low= and high= in model-input units, or another "
                "composite such as 'epsilon_plus'"
            )
        return problems

    def warn_about_gaps(self, output: Any, method: str, problems: Optional[list[str]] = None) -> None:
        """Warn where the map is not LRP (``gaps``, or the problems given, found earlier)."""
        problems = self.gaps(output) if problems is None else problems
        if problems:
            warn_at_callers_line(f"{method}: " + "; ".join(problems) + ".", RuntimeWarning)

    def non_finite_error(self, pairs: Sequence[Sequence[int]], method: str, dtype: torch.dtype) -> ValueError:
        """The error for maps with NaN or inf where relevance went through calls without a rule: those calls are
        the likely cause (the plain gradient there need not stay bounded), not the model's precision."""
        listed = ", ".join(f"image {n}, target {k}" for n, k in pairs[:6]) + (" and more" if len(pairs) > 6 else "")
        return ValueError(
            f"{method} computed a map with NaN or inf values ({listed}): the relevance overflowed on its way back "
            f"through the model, where {self.unruled_text()}."
            + (f" The model also runs in {dtype}, whose range is small: float32 gives the relevance more room."
               if dtype in (torch.float16, torch.bfloat16) else "")
        )

    def layer_diagnostics(self, count: int, targets: int) -> dict[str, Any]:
        """Per rule-carrying call, in forward order: Σ relevance received and passed on, (N, K, L) each."""
        recorded = [rule for rule in self.recorded
                    if rule.sums and all(len(received) == count for received, _ in rule.sums.values())]
        received = torch.full((count, targets, len(recorded)), float("nan"), dtype=torch.float64)
        sent = received.clone()
        for index, rule in enumerate(recorded):
            for k, (into, out_of) in rule.sums.items():
                received[:, k, index], sent[:, k, index] = into.cpu(), out_of.cpu()
        return {"layers": [rule.name for rule in recorded], "layer_output_relevance": received,
                "layer_input_relevance": sent, "unruled": list(self.unruled)}

    def output_relevance(self, count: int, targets: int) -> Tensor:
        """(N, K) float64: Σ relevance each backward pass started from (NaN where none ran)."""
        sums = torch.full((count, targets), float("nan"), dtype=torch.float64)
        for k, values in self.passes.output_sums.items():
            if len(values) == count:
                sums[:, k] = values.cpu()
        return sums


class _RelevanceRules(CallScope[_Trace]):
    """``with _RelevanceRules(model, trace):`` — this thread's forward passes run with the LRP rules of ``trace``
    (hooks on the model's modules tell it where each call is); all removed when the block ends."""

    def __init__(self, model: nn.Module, trace: _Trace):
        super().__init__(model)
        self.model_traced = model
        self.trace = trace

    def setup(self) -> _Trace:
        for name, module in self.model_traced.named_modules():
            self.forward_pre_hook(module, self.trace.entering(name))
            self.forward_hook(module, self.trace.leaving)
        self.enter(CallRules([self.trace]))
        return self.trace
