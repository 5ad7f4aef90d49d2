"""Attention probabilities recorded through any attention implementation.

``capture_attention`` records the attention probabilities
A = softmax(QKᵀ·scale + mask), (N, heads, T_q, T_k), of every attention layer of a model,
inside the autograd graph, so that both A and ∂y/∂A are available, whatever computes them:

- ``F.scaled_dot_product_attention`` (timm's fused attention, HuggingFace ``sdpa``): computed
  step by step instead of by the fused kernel; masks (boolean or additive), ``is_causal``,
  ``scale=``, dropout and grouped heads (``enable_gqa``) as the kernel takes them;
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
  torchvision's ViT, with ``need_weights=False`` or not): computed from its arguments, with
  key-padding and attention masks, ``bias_k``/``bias_v``, ``add_zero_attn`` and separate
  projection weights;
- eager implementations (timm ``fused_attn=False``, HuggingFace ``eager``): a softmax over the
  last dimension of (N, heads, T_q, T_k) scores computed from a product QKᵀ of two activations,
  recorded as computed; a softmax of anything else (a CNN's feature map) is not attention.

The recording is a call-scoped rule (``explain.core.rules``). The model's output with recording on
equals its fused output to float rounding. Only
attention computed inside the model's own forward is recorded: the innermost module of the
model on the Python call stack names each record (``"blocks.3.attn"``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import TypeIs

from .caller import warn_at_callers_line
from .capture import LayerSpec, eager_model, find_layers, no_gradient_reason
from .rules import CallRules, Rule
from .scope import CallScope


def calling_module(modules: dict[int, str]) -> Optional[str]:
    """The name of the innermost module among ``modules`` (``id(module)`` → name) whose code is
    on the Python call stack of this thread, found through the ``self`` of each frame; None when
    no such module is running."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            name = modules.get(id(frame.f_locals.get("self")))
            if name is not None:
                return name
        frame = frame.f_back
    return None


# ------------------------------------------------------------------ attention computed step by step


def _softmax_of_scores(scores: Tensor, masked: bool) -> Tensor:
    """softmax over the last dimension; with a mask, rows masked entirely give zeros, as the fused
    kernels do. Half-precision scores are normalised in float32 and cast back.

    Under a function mode (rules that see the steps, such as DeepLIFT's) it is computed with torch's own
    functions; otherwise as one autograd function that keeps only its result for the backward pass: one
    (…, L, S) matrix per layer in the scores' dtype instead of two (masked), or a float32 and a
    half-precision one (half precision)."""
    if torch._C._len_torch_function_stack() > 0:
        dtype = scores.dtype
        blocked = torch.isneginf(scores).all(dim=-1, keepdim=True) if masked else None
        if blocked is not None:
            scores = scores.masked_fill(blocked, 0.0)
        if dtype in (torch.float16, torch.bfloat16):
            probabilities = scores.softmax(dim=-1, dtype=torch.float32).to(dtype)
        else:
            probabilities = scores.softmax(dim=-1)
        return probabilities if blocked is None else probabilities.masked_fill(blocked, 0.0)
    return _SoftmaxKeepingOnlyItsResult.apply(scores, masked)


def _normalisation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SoftmaxKeepingOnlyItsResult(torch.autograd.Function):
    """softmax(scores) over the last dimension (rows of -inf only give zeros when ``masked``), saving only the
    result P: the gradient is P ⊙ (g − Σ_j g_j P_j), zero on the zeroed rows."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor, masked: bool) -> Tensor:
        probabilities = scores.softmax(dim=-1, dtype=_normalisation_dtype(scores.dtype))
        if masked:  # softmax of a row of -inf only is NaN
            probabilities = probabilities.masked_fill_(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
        probabilities = probabilities.to(scores.dtype)
        ctx.save_for_backward(probabilities)
        return probabilities

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor, None]:
        (probabilities,) = ctx.saved_tensors
        dtype = _normalisation_dtype(probabilities.dtype)
        weights, upstream = probabilities.to(dtype), gradient.to(dtype)
        scores_gradient = weights * (upstream - (upstream * weights).sum(dim=-1, keepdim=True))
        return scores_gradient.to(probabilities.dtype), None


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """``F.scaled_dot_product_attention`` step by step: (output (..., L, E_v), probabilities (..., L, S)).

    attn_mask: boolean (True: may attend) or additive, broadcastable to (..., L, S);
    is_causal: query i attends keys j ≤ i (top-left aligned); scale: default 1/√E;
    enable_gqa: key and value have fewer heads (dimension -3) than the query, shared by groups.
    Rows that may attend nothing get zero probabilities (and a zero output).
    """
    if is_causal and attn_mask is not None:
        raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask cannot be given with is_causal=True.")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = torch.where(attn_mask, scores, torch.tensor(float("-inf"), dtype=scores.dtype,
                                                                 device=scores.device))
        else:
            scores = scores + attn_mask
    probabilities = _softmax_of_scores(scores, masked=attn_mask is not None)
    weights = F.dropout(probabilities, dropout_p) if dropout_p > 0 else probabilities
    return torch.matmul(weights.to(value.dtype), value), probabilities


def _additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """nn.MultiheadAttention's masks (boolean: True = may *not* attend, or additive) as additive masks."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


AttentionCore = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], float, bool], tuple[Tensor, Optional[Tensor]]]
"""(query, key, value (N, heads, L or S, d), additive mask or None, dropout_p, probabilities needed) → (output
(N, heads, L, d), probabilities (N, heads, L, S), or None when not needed): attention over heads."""


def recording_core(record: Callable[[Tensor], None]) -> AttentionCore:
    """Attention computed step by step (``attend``), its probabilities handed to ``record``."""

    def core(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], dropout_p: float,
             needed: bool) -> tuple[Tensor, Optional[Tensor]]:
        output, probabilities = attend(query, key, value, mask, dropout_p)
        record(probabilities)
        return output, probabilities

    return core


def multi_head_attention(
    core: AttentionCore,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Optional[Tensor],
    in_proj_bias: Optional[Tensor],
    bias_k: Optional[Tensor],
    bias_v: Optional[Tensor],
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    training: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    attn_mask: Optional[Tensor] = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None,
    k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None,
    static_k: Optional[Tensor] = None,
    static_v: Optional[Tensor] = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``F.multi_head_attention_forward`` step by step (same arguments after ``core``, same results), its
    attention over heads computed by ``core`` (``recording_core``: step by step, the probabilities recorded)."""
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    target_length, batch_size, embed_dim = query.shape
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    head_dim = embed_dim // num_heads
    biases = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
    weights: Sequence[Tensor]
    if use_separate_proj_weight:
        assert q_proj_weight is not None and k_proj_weight is not None and v_proj_weight is not None, (
            "use_separate_proj_weight is True but q_proj_weight, k_proj_weight or v_proj_weight is None")
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        assert in_proj_weight is not None, "use_separate_proj_weight is False but in_proj_weight is None"
        weights = in_proj_weight.chunk(3)
    if not use_separate_proj_weight and in_proj_weight is not None and query is key and key is value:  # one packed
        q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    else:
        q, k, v = (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    attn_mask = _additive_mask(attn_mask, q.dtype)
    key_padding_mask = _additive_mask(key_padding_mask, q.dtype)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)  # (1 or N·heads, L, S)
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.repeat(1, batch_size, 1)])
        v = torch.cat([v, bias_v.repeat(1, batch_size, 1)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))

    def heads(x: Tensor, static: Optional[Tensor]) -> Tensor:  # (S, N, E) → (N, heads, S, d)
        if static is not None:
            return static.view(batch_size, num_heads, -1, head_dim)
        return x.reshape(x.shape[0], batch_size * num_heads, head_dim).transpose(0, 1).view(
            batch_size, num_heads, -1, head_dim)

    q, k, v = heads(q, None), heads(k, static_k), heads(v, static_v)
    if add_zero_attn:
        zeros = torch.zeros(batch_size, num_heads, 1, head_dim, dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    source_length = k.shape[2]
    mask = None
    if attn_mask is not None:
        mask = attn_mask.view(-1, num_heads if attn_mask.shape[0] > 1 else 1, target_length, source_length)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch_size, 1, 1, source_length)
        mask = padding if mask is None else mask + padding
    output, probabilities = core(q, k, v, mask, dropout_p if training else 0.0, need_weights)
    output = output.permute(2, 0, 1, 3).reshape(target_length * batch_size, embed_dim)
    output = F.linear(output, out_proj_weight, out_proj_bias).view(target_length, batch_size, -1)
    returned = None
    if need_weights and probabilities is not None:
        returned = probabilities.mean(dim=1) if average_attn_weights else probabilities
    if not batched:
        output = output.squeeze(1)
        returned = None if returned is None else returned.squeeze(0)
    return output, returned


def _attend_with_heads(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                       *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """``attend``, with (N, L, E) inputs computed as one head, so that the probabilities are (N, 1, L, S)."""
    if query.dim() != 3:
        return attend(query, key, value, attn_mask, *args, **kwargs)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.unsqueeze(1)
    output, probabilities = attend(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), attn_mask, *args,
                                   **kwargs)
    return output.squeeze(1), probabilities


class StepwiseAttention(Rule):
    """Attention computed step by step (``attend``) instead of by the fused kernels, which have no second
    derivative: for methods that differentiate twice (Shapley-CAM's Hessian-vector product). Equal to the
    fused attention to float rounding; nothing is recorded."""

    functions: ClassVar[frozenset[Callable[..., Any]]] = frozenset(
        {F.scaled_dot_product_attention, F.multi_head_attention_forward})

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is F.scaled_dot_product_attention:
            return _attend_with_heads(*args, **kwargs)[0]
        return stepwise_multi_head_attention(*args, **kwargs)


def stepwise_multi_head_attention(*args: Any, **kwargs: Any) -> tuple[Tensor, Optional[Tensor]]:
    """``F.multi_head_attention_forward`` (same arguments, same results) computed step by step, nothing recorded."""
    return multi_head_attention(recording_core(lambda probabilities: None), *args, **kwargs)


# ------------------------------------------------------------------ recording attention


@dataclass
class AttentionRecord:
    """One attention call: ``module``, the innermost module of the model that made it (``""`` for
    the model itself); ``probabilities`` (N, heads, T_q, T_k), rows summing to 1 (0 for rows that
    may attend nothing); ``grad``, ∂loss/∂probabilities after a backward pass when recorded;
    ``source``: "scaled_dot_product_attention", "multi_head_attention_forward" or "softmax"."""

    module: str
    probabilities: Tensor
    source: str
    grad: Optional[Tensor] = None
    _no_grad_reason: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    """Why no gradient can reach ``probabilities`` (they require none), when ``grads=True`` asked for one."""


Positions = Union[int, slice, Sequence[int]]
"""Attention calls by position in call order: an int, a slice or ints (negative from the end)."""
BlockSpec = Union[None, Positions, LayerSpec, Sequence[LayerSpec]]
"""Which attention calls to record: None (all); positions in call order (an int, a slice or ints;
negative from the end, ``slice(-4, None)`` for the last four); or modules (names, globs, modules
or a module type, see ``find_layers``) inside which the attention is computed."""

_SOFTMAX: frozenset[Callable[..., Any]] = frozenset({F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax})
_PRODUCTS: frozenset[Callable[..., Any]] = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm,
                                                      Tensor.bmm, torch.baddbmm, Tensor.baddbmm, torch.einsum})
"""Products of two tensors: the scores QKᵀ of eager attention are one (``q @ k.transpose(-2, -1)``)."""


def _is_positions(blocks: BlockSpec) -> TypeIs[Positions]:
    if isinstance(blocks, (int, slice)) and not isinstance(blocks, bool):
        return True
    return isinstance(blocks, (list, tuple, range)) and len(blocks) > 0 and all(
        isinstance(item, int) and not isinstance(item, bool) for item in blocks)


def _scores_key(shape: Sequence[int]) -> tuple[int, int, int]:
    """What ties a softmax's input to the product QKᵀ it was computed from (scaled, masked, a
    position bias added, reshaped to heads): its number of elements and its last two sizes."""
    return math.prod(shape), shape[-2], shape[-1]


def _within(name: str, container: str) -> bool:
    """Whether module ``name`` is ``container`` or inside it ("" is the model)."""
    return not container or name == container or name.startswith(container + ".")


@dataclass(frozen=True)
class SkippedSoftmax:
    """A softmax inside the model that is not recorded as attention: the module that computed it,
    the shape of its input, the dimension it normalised and why it is not attention."""

    module: str
    shape: tuple[int, ...]
    dim: Any
    reason: str

    def __str__(self) -> str:
        where = repr(self.module) if self.module else "the model"
        return f"a softmax over dim={self.dim} of a {self.shape} tensor in {where} ({self.reason})"


class AttentionRecorder(Rule):
    """The rule behind ``capture_attention``: computes attention step by step inside ``model``
    (or inside the selected modules of it) and records the probabilities.

    Eager attention is a softmax over the last dimension of (N, heads, T_q, T_k) scores that a
    module computed from a product of two activations, QKᵀ (``q @ k.transpose(-2, -1)``,
    ``torch.matmul``, ``bmm``, ``einsum``), scaled, masked or biased after it. Any other
    softmax (a CNN's softmax over the last axis of a feature map) is not attention: it is listed
    in ``skipped`` instead."""

    functions: ClassVar[frozenset[Callable[..., Any]]] = _SOFTMAX.union(
        _PRODUCTS, {F.scaled_dot_product_attention, F.multi_head_attention_forward})

    def __init__(self, model: nn.Module, modules: Optional[Sequence[str]] = None, *, softmax: bool = True):
        self.names = {id(module): name for name, module in model.named_modules()}
        self.selected = None if modules is None else set(modules)
        self.softmax = softmax
        self.records: list[AttentionRecord] = []
        self.skipped: list[SkippedSoftmax] = []
        self.scores: dict[tuple[int, int, int], set[str]] = {}
        """Per ``_scores_key`` of a product of two activations, the modules that computed one."""
        self.on_record: Optional[Callable[[AttentionRecord], None]] = None

    def _module(self) -> Optional[str]:
        """The module making the current call, if the call is one to record."""
        name = calling_module(self.names)
        if name is None or self.selected is None:
            return name
        parts = name.split(".")
        ancestors = {".".join(parts[:length]) for length in range(len(parts) + 1)}
        return name if ancestors & self.selected else None

    def _record(self, module: str, probabilities: Tensor, source: str) -> None:
        record = AttentionRecord(module, probabilities, source)
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func in _SOFTMAX:
            return self._softmax(func, args, kwargs)
        if func in _PRODUCTS:
            return self._product(func, args, kwargs)
        module = self._module()
        if module is None:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            output, probabilities = _attend_with_heads(*args, **kwargs)
            self._record(module, probabilities, "scaled_dot_product_attention")
            return output
        return multi_head_attention(recording_core(lambda probabilities: self._record(
            module, probabilities, "multi_head_attention_forward")), *args, **kwargs)

    def _product(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A product, computed as it is; one of two activations (both batched, ≥ 3 dimensions: not a
        weight matrix) with a square or rectangular (…, T_q, T_k) result is remembered as scores."""
        result = func(*args, **kwargs)
        operands = [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)]
        if self.softmax and isinstance(result, Tensor) and result.dim() >= 3 and len(operands) >= 2 and all(
                operand.dim() >= 3 for operand in operands[-2:]):
            module = self._module()
            if module is not None:
                self.scores.setdefault(_scores_key(result.shape), set()).add(module)
        return result

    def _from_scores(self, module: str, shape: Sequence[int]) -> bool:
        """Whether a softmax of this shape in ``module`` normalises scores computed as a product in the
        same attention layer: in a module that contains it, or inside its parent (the module itself, or
        one beside it: Swin's softmax is a module next to the code that computes the scores)."""
        parent = module.rpartition(".")[0]
        return any(_within(parent, computed_in) or _within(computed_in, parent)
                   for computed_in in self.scores.get(_scores_key(shape), ()))

    def _softmax(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        result = func(*args, **kwargs)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not self.softmax or not isinstance(result, Tensor):
            return result
        module = self._module()
        if module is None:
            return result
        shape = tuple(result.shape)
        if result.dim() < 3:  # a classifier's probabilities: not worth a mention
            return result
        if result.dim() != 4 or dim not in (-1, 3):
            self.skipped.append(SkippedSoftmax(module, shape, dim, "attention is a softmax over the last "
                                               "dimension of 4-dimensional (N, heads, T, T) scores"))
        elif not self._from_scores(module, shape):
            self.skipped.append(SkippedSoftmax(module, shape, dim, "its input is not a product of queries and "
                                               "keys, QKᵀ, computed in that module"))
        else:
            self._record(module, result, "softmax")
        return result


class CapturedAttention:
    """What ``capture_attention`` recorded: the selected attention calls, in call order.

    ``records`` (AttentionRecord each), ``probabilities`` (N, heads, T_q, T_k) each, ``grads``
    (same shapes, after a backward pass inside the block; None before), ``modules`` (names);
    ``skipped``: the softmaxes seen that are not attention;
    indexing and iteration go over ``records``.
    """

    def __init__(self, recorder: AttentionRecorder, positions: Optional[Positions]):
        self._recorder = recorder
        self._positions = positions

    @property
    def records(self) -> list[AttentionRecord]:
        records = self._recorder.records
        if self._positions is None:
            return list(records)
        if isinstance(self._positions, slice):
            return records[self._positions]
        positions = [self._positions] if isinstance(self._positions, int) else list(self._positions)
        for position in positions:
            if not -len(records) <= position < len(records):
                raise IndexError(f"attention block {position} does not exist: {len(records)} attention "
                                 "call(s) were recorded.")
        return [records[position] for position in positions]

    @property
    def probabilities(self) -> list[Tensor]:
        return [record.probabilities for record in self.records]

    @property
    def computed(self) -> int:
        """How many attention calls were recorded inside the selected modules (all of them for positions), before
        the positions choose among them."""
        return len(self._recorder.records)

    @property
    def grads(self) -> list[Optional[Tensor]]:
        """∂loss/∂probabilities of each record after a backward pass inside the block (``grads=True``); a
        warning says why for records that can have none (the forward ran under ``torch.no_grad()``)."""
        records = self.records
        reasons = [record._no_grad_reason for record in records if record.grad is None and record._no_grad_reason]
        if reasons:
            warn_at_callers_line(
                f"{len(reasons)} of the {len(records)} attention records have no gradient (None): {reasons[0]}, so "
                "no backward pass can reach the probabilities. Run the model with gradients on inside the "
                "capture_attention block (not under torch.no_grad() or torch.inference_mode()); for a frozen "
                "model, call x.requires_grad_() on the input."
            )
        return [record.grad for record in records]

    @property
    def modules(self) -> list[str]:
        return [record.module for record in self.records]

    @property
    def skipped(self) -> list[SkippedSoftmax]:
        """The softmaxes over 3 or more dimensions inside the model that are not attention (not
        over the last dimension of (N, heads, T, T) scores computed as QKᵀ), in call order."""
        return list(self._recorder.skipped)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> AttentionRecord:
        return self.records[index]

    def __iter__(self) -> Iterator[AttentionRecord]:
        return iter(self.records)

    def __repr__(self) -> str:
        rows = ", ".join(f"{record.module!r}: {tuple(record.probabilities.shape)}" for record in self.records)
        return f"CapturedAttention([{rows}])"


class AttentionBlock(CallScope[CapturedAttention]):
    """The ``with`` block of ``capture_attention``: the recording rule for this thread, removed at its end."""

    def __init__(self, recorder: AttentionRecorder, captured: CapturedAttention, *, grads: bool, detach: bool):
        super().__init__()
        self.recorder, self.captured = recorder, captured
        self.grads, self.detach = grads, detach
        recorder.on_record = self._keep

    def _keep(self, record: AttentionRecord) -> None:
        in_graph = record.probabilities
        if self.detach:
            record.probabilities = in_graph.detach()
        if self.grads and in_graph.requires_grad:
            def store(gradient: Tensor) -> None:
                record.grad = gradient.detach() if self.detach else gradient

            self.add_undo(in_graph.register_hook(store).remove)
        elif self.grads:
            record._no_grad_reason = no_gradient_reason()

    def setup(self) -> CapturedAttention:
        self.enter(CallRules([self.recorder]))
        return self.captured


def capture_attention(
    model: nn.Module,
    blocks: BlockSpec = None,
    *,
    grads: bool = False,
    detach: bool = True,
    softmax: bool = True,
) -> AttentionBlock:
    """Record the attention probabilities of the model's attention layers while the block runs it.

    blocks: which attention calls: None (all), positions in call order (``slice(-4, None)``:
        the last four; ``-1``: the last), or the modules that compute them (a name, a glob such
        as ``"blocks.*"``, a module, a module type, or a list of these; their submodules count).
        Attention outside the selected modules keeps its fused kernel.
    grads: also record ∂loss/∂probabilities when a backward pass runs inside the block (the
        last backward's, for several); reading ``grads`` warns when the forward ran without
        gradients (``torch.no_grad()``), so that none can come.
    detach: True stores detached tensors; False keeps them in the autograd graph, so that
        ``torch.autograd.grad(score, captured.probabilities)`` works.
    softmax: also record eager attention: a softmax over the last dimension of (N, heads, T_q,
        T_k) scores that the module computed as a product QKᵀ of two activations; other softmaxes
        are not attention (``attention.skipped`` lists them).

    ``with capture_attention(...) as attention`` gives a ``CapturedAttention``. It works in
    this thread only, on every forward pass inside the block; nothing stays on the model when
    the block ends, also on an exception or an interrupt. A torch.compile'd model is refused
    (``eager_model``)::

        with explain.capture_attention(vit, slice(-4, None), grads=True) as attention:
            vit(x)[0, 3].backward()
        attention.probabilities[-1], attention.grads[-1]     # (N, heads, T, T) each
    """
    if eager_model(model, "capture_attention") is not model:
        raise TypeError(
            "capture_attention cannot record inside code that torch.compile runs (compiled code runs no "
            "call-scoped rule): pass the original module, compiled._orig_mod (the same weights), and run that "
            "inside the block."
        )
    positions: Optional[Positions] = None
    modules: Optional[list[str]] = None
    if _is_positions(blocks):
        positions = blocks
    elif blocks is not None:
        modules = [name for name, _ in find_layers(model, blocks)]
    recorder = AttentionRecorder(model, modules, softmax=softmax)
    return AttentionBlock(recorder, CapturedAttention(recorder, positions), grads=grads, detach=detach)
