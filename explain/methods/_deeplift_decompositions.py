"""Functions that DeepLIFT computes as their elementwise steps (norms, normalisations, attention, GLU), so that
each step gets its own rule (``COMPOSITES``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

from ..core.attention import attend, stepwise_multi_head_attention


def _float_steps(inputs: Tensor) -> Tensor:
    """Half-precision inputs normalised in float32, as torch's normalisation kernels do."""
    return inputs.float() if inputs.dtype in (torch.float16, torch.bfloat16) else inputs


def _normalized(inputs: Tensor, dims: tuple[int, ...], eps: float, centred: bool = True) -> Tensor:
    values = _float_steps(inputs)
    if centred:
        values = values - values.mean(dims, keepdim=True)
    return scaled(values, torch.rsqrt((values * values).mean(dims, keepdim=True) + eps)).to(inputs.dtype)


def scaled(values: Tensor, scale: Tensor) -> Tensor:
    """values · scale: a normalisation's last step, its centred values times 1/σ. A function of its own (one
    that torch function modes see, as ``F.layer_norm``) so that DeepLIFT gives it the rule of normalisations
    (``DeepLiftRules._scaled``) rather than that of products."""
    if has_torch_function_variadic(values, scale):
        return handle_torch_function(scaled, (values, scale), values, scale)
    return values * scale


def layer_norm_steps(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    result = _normalized(input, tuple(range(-len(shape), 0)), eps)
    result = result if weight is None else result * weight
    return result if bias is None else result + bias


def rms_norm_steps(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
              eps: Optional[float] = None) -> Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    result = _normalized(input, tuple(range(-len(shape), 0)), eps, centred=False)
    return result if weight is None else result * weight


def _channel_affine(result: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    shape = [1, -1] + [1] * (result.dim() - 2)
    result = result if weight is None else result * weight.view(shape)
    return result if bias is None else result + bias.view(shape)


def group_norm_steps(input: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                eps: float = 1e-5) -> Tensor:
    grouped = input.reshape(input.shape[0], num_groups, -1)
    return _channel_affine(_normalized(grouped, (-1,), eps).reshape(input.shape), weight, bias)


def instance_norm_steps(input: Tensor, running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                   weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, use_input_stats: bool = True,
                   momentum: float = 0.1, eps: float = 1e-5) -> Any:
    if use_input_stats:
        return _channel_affine(_normalized(input, tuple(range(2, input.dim())), eps), weight, bias)
    if running_mean is None or running_var is None:
        return NotImplemented
    shape = [1, -1] + [1] * (input.dim() - 2)  # running statistics: linear
    normalized = (input - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
    return _channel_affine(normalized, weight, bias)


def attention_steps(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
               enable_gqa: bool = False) -> Tensor:
    return attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]


def glu_steps(input: Tensor, dim: int = -1) -> Tensor:
    first, second = input.chunk(2, dim)
    return first * torch.sigmoid(second)


def _p_norm(inputs: Tensor, p: Any, dim: Any, keepdim: bool) -> Any:
    """‖inputs‖_p over ``dim`` (all dimensions for None) in elementwise steps; NotImplemented for
    p = ±inf, 0 or a matrix norm."""
    if p is None or p == "fro":
        p = 2
    if isinstance(p, str) or not math.isfinite(p) or p <= 0:
        return NotImplemented
    dims = tuple(range(inputs.dim())) if dim is None else dim
    if p == 2:
        return torch.sqrt((inputs * inputs).sum(dims, keepdim=keepdim))
    if p == 1:
        return inputs.abs().sum(dims, keepdim=keepdim)
    return inputs.abs().pow(p).sum(dims, keepdim=keepdim).pow(1 / p)


def norm_steps(input: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, out: Any = None,
          dtype: Any = None) -> Any:
    if out is not None:
        return NotImplemented
    return _p_norm(input if dtype is None else input.to(dtype), p, dim, keepdim)


def vector_norm_steps(x: Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None,
                 out: Any = None) -> Any:
    return norm_steps(x, ord, dim, keepdim, out, dtype)


def normalize_steps(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None) -> Any:
    norm = norm_steps(input, p, dim, True, out)
    return norm if norm is NotImplemented else input / norm.clamp_min(eps)


COMPOSITES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.layer_norm: layer_norm_steps,
    F.group_norm: group_norm_steps,
    F.rms_norm: rms_norm_steps,
    F.instance_norm: instance_norm_steps,
    F.scaled_dot_product_attention: attention_steps,
    F.multi_head_attention_forward: stepwise_multi_head_attention,
    F.glu: glu_steps,
    F.normalize: normalize_steps,
    torch.norm: norm_steps,
    Tensor.norm: norm_steps,
    torch.linalg.vector_norm: vector_norm_steps,
}
"""Functions computed step by step, each step by its rule (with the same arguments and result)."""
