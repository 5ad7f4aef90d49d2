"""DeepLIFT's backward rules as autograd functions: the rescale rule at a nonlinearity, linearised functions, and max
pooling and max reductions between the input's and the reference's maxima."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor


class RescaledNonlinearity(torch.autograd.Function):
    """y = f(z); backward: grad · m with the rescale rule's multiplier m = (f(z) − f(z'))/(z − z')
    (f'(z) where |Δz| < eps), summed back to z's shape where f broadcasts z against a constant. The
    multipliers are computed in the forward and kept alone (not the inputs and outputs, which later
    in-place operations could change).

    function: f, never writing into its argument; in_place: None, or f as the model called it, in place (``relu_``):
    then z is overwritten with f(z), as that call does, and the reference z' (the rule's own copy) with f(z'),
    without copies."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, function: Callable[[Tensor], Tensor],
                in_place: Optional[Callable[[Tensor], Tensor]], reference: Tensor, eps: float) -> Tensor:
        delta = inputs - reference
        large = delta.abs() >= eps  # False for NaN differences too, of infinite inputs such as masked scores
        everywhere = bool(large.all())
        derivative: Optional[Tensor] = None
        if in_place is None:
            outputs, reference_outputs = function(inputs), function(reference)
            if not everywhere:
                derivative = _derivative(function, inputs, outputs.shape)
        else:
            if not everywhere:  # f'(z) before z is overwritten
                derivative = _derivative(function, inputs, inputs.shape)
            ctx.mark_dirty(inputs)
            outputs, reference_outputs = in_place(inputs), in_place(reference)
            assert outputs is inputs, "an in-place call returns the tensor it wrote into"
        rescaled = (outputs - reference_outputs) / delta
        if derivative is not None:
            rescaled = torch.where(large, rescaled, derivative)
        ctx.input_shape = inputs.shape
        ctx.save_for_backward(rescaled)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        (grad_output,) = grad_outputs  # one output, one gradient
        (multipliers,) = ctx.saved_tensors
        # contiguous: the product takes the incoming gradient's strides, which for a feature map read as tokens
        # (``x.flatten(2).transpose(1, 2)``, as LeViT does) are ones torch 2.14's CPU BatchNorm backward gets wrong
        return (grad_output * multipliers).sum_to_size(ctx.input_shape).contiguous(), None, None, None, None


def _derivative(function: Callable[[Tensor], Tensor], inputs: Tensor, shape: torch.Size) -> Tensor:
    """f'(z) elementwise, of the shape of f's output, by autograd (zero where f has no derivative)."""
    with torch.enable_grad():
        leaf = inputs.detach().expand(shape).clone().requires_grad_(True)
        outputs = function(leaf)
        if not outputs.requires_grad:  # a step function (sign, floor): zero almost everywhere
            return torch.zeros(shape, dtype=outputs.dtype, device=outputs.device)
        (derivative,) = torch.autograd.grad(outputs.sum(), leaf)
    return derivative


class Linearized(torch.autograd.Function):
    """A call whose value is computed as it is and whose backward is that of a linear map of its
    inputs' differences (a rule's multipliers): ``Linearized.apply(compute, linear_map, *inputs)``.
    The map is evaluated at zero differences, so infinite values (masked scores) do not enter it."""

    @staticmethod
    def forward(ctx: Any, compute: Callable[..., Tensor], linear_map: Callable[..., Tensor],
                *inputs: Tensor) -> Tensor:
        ctx.linear_map = linear_map
        ctx.inputs = [(tensor.shape, tensor.dtype, tensor.device) for tensor in inputs]
        return compute(*inputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], ...]:
        (grad_output,) = grad_outputs
        with torch.enable_grad():
            points = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
                      for shape, dtype, device in ctx.inputs]
            mapped = ctx.linear_map(*points)
            grads = torch.autograd.grad(mapped, points, grad_output, allow_unused=True)
        grads = tuple(torch.zeros_like(point) if grad is None else grad for point, grad in zip(points, grads))
        return (None, None, *grads)


class MaxPoolRule(torch.autograd.Function):
    """Max pooling of z, with the pooling of z' (Shrikumar et al.'s rule): with y = pool(z),
    y' = pool(z') and u = max(y, y'), grad · (u − y') goes back to the positions of z's maxima and
    grad · (y − u) to those of z''s maxima, and each position's sum is divided by its Δz. Positions
    shared by overlapping windows (a 3×3 pool of stride 2) add up their windows' shares, so the
    multipliers sum exactly to the pooled difference. Where |Δz| < eps, the pooling's ordinary
    gradient (grad sent to z's maxima)."""

    eps = 1e-10

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, reference: Tensor, pool: Callable[..., Any], options: dict[str, Any],
                spatial: int) -> Tensor:
        outputs, indices = pool(inputs, return_indices=True, **options)
        reference_outputs, reference_indices = pool(reference, return_indices=True, **options)
        ctx.input_shape, ctx.spatial = inputs.shape, spatial
        ctx.save_for_backward(inputs - reference, outputs, reference_outputs, indices, reference_indices)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        (grad_output,) = grad_outputs  # one output, one gradient
        delta, y, y_ref, indices, reference_indices = ctx.saved_tensors
        larger = torch.max(y, y_ref)
        shares = (_to_maxima(grad_output * (larger - y_ref), indices, ctx.input_shape, ctx.spatial)
                  + _to_maxima(grad_output * (y - larger), reference_indices, ctx.input_shape, ctx.spatial))
        small = delta.abs() < MaxPoolRule.eps
        rescaled = shares / torch.where(small, torch.ones_like(delta), delta)
        ordinary = _to_maxima(grad_output, indices, ctx.input_shape, ctx.spatial)  # max pooling's own backward
        return torch.where(small, ordinary, rescaled), None, None, None, None


def _to_maxima(values: Tensor, indices: Tensor, input_shape: torch.Size, spatial: int) -> Tensor:
    """(..., *pooled) values added up at the input positions their windows' maxima came from
    (``indices`` as max pooling returns them, over the last ``spatial`` dimensions): (..., *input spatial)."""
    leading = input_shape[:len(input_shape) - spatial]
    spread = torch.zeros(*leading, input_shape[len(leading):].numel(), dtype=values.dtype, device=values.device)
    spread.scatter_add_(-1, indices.flatten(len(leading)), values.flatten(len(leading)))
    return spread.view(input_shape)


class MaxReductionRule(torch.autograd.Function):
    """max (``sign`` 1) or min (``sign`` −1) of z over ``dims``: the rule of max pooling with one window
    covering those dimensions. Returns the values with the reduced dimensions kept (size 1)."""

    eps = 1e-10

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, reference: Tensor, dims: tuple[int, ...], sign: int) -> Tensor:
        windows, reference_windows = (_windows(sign * tensor, dims) for tensor in (inputs, reference))
        y, indices = windows.max(dim=-1, keepdim=True)
        y_ref, reference_indices = reference_windows.max(dim=-1, keepdim=True)
        ctx.dims, ctx.sign, ctx.input_shape = dims, sign, inputs.shape
        ctx.save_for_backward(windows - reference_windows, y, y_ref, indices, reference_indices)
        return (sign * y).view([1 if dim in dims else size for dim, size in enumerate(inputs.shape)])

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        (grad_output,) = grad_outputs
        delta, y, y_ref, indices, reference_indices = ctx.saved_tensors
        grad = ctx.sign * grad_output.reshape(y.shape)  # the gradient of max(sign · z)
        larger = torch.max(y, y_ref)
        shares = torch.zeros_like(delta).scatter_add_(-1, indices, grad * (larger - y_ref))
        shares.scatter_add_(-1, reference_indices, grad * (y - larger))
        small = delta.abs() < MaxReductionRule.eps
        ordinary = torch.zeros_like(delta).scatter_add_(-1, indices, grad)
        windows = torch.where(small, ordinary, shares / torch.where(small, torch.ones_like(delta), delta))
        return ctx.sign * _unwindowed(windows, ctx.input_shape, ctx.dims), None, None, None


def _windows(tensor: Tensor, dims: tuple[int, ...]) -> Tensor:
    """The reduced dimensions moved to the end and flattened into one: (..., window)."""
    kept = [dim for dim in range(tensor.dim()) if dim not in dims]
    return tensor.permute(*kept, *dims).flatten(len(kept))


def _unwindowed(windows: Tensor, shape: torch.Size, dims: tuple[int, ...]) -> Tensor:
    """The inverse of ``_windows``: back to ``shape``."""
    kept = [dim for dim in range(len(shape)) if dim not in dims]
    order = kept + list(dims)
    unflattened = windows.unflatten(-1, [shape[dim] for dim in dims])
    return unflattened.permute(*sorted(range(len(order)), key=order.__getitem__))
