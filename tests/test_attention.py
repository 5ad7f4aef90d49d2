"""Attention computed step by step equals the fused kernels, with every option they take; the
capture API records what it is asked for, in this thread only, and leaves nothing behind."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import explain
from explain.core.attention import attend
from explain.core.rules import Rule, call_rules


def probabilities_by_hand(q, k, mask=None, scale=None, causal=False):
    """softmax(QKᵀ·scale + mask) by the formula; boolean masks: True may attend."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that may attend nothing: zeros


def sdpa_cases():
    torch.manual_seed(0)
    n, h, length, dim = 2, 4, 5, 8
    q, k, v = (torch.randn(n, h, length, dim) for _ in range(3))
    boolean = torch.rand(length, length) > 0.3
    boolean[:, 0] = True
    blocked_row = boolean.clone()
    blocked_row[2] = False
    additive = torch.randn(n, 1, length, length)
    grouped_k, grouped_v = torch.randn(n, 2, length, dim), torch.randn(n, 2, length, dim)
    return {
        "plain": ((q, k, v), {}, {}),
        "boolean mask": ((q, k, v), {"attn_mask": boolean}, {"mask": boolean}),
        "a row that attends nothing": ((q, k, v), {"attn_mask": blocked_row}, {"mask": blocked_row}),
        "additive mask": ((q, k, v), {"attn_mask": additive}, {"mask": additive}),
        "is_causal": ((q, k, v), {"is_causal": True}, {"causal": True}),
        "scale": ((q, k, v), {"scale": 0.3}, {"scale": 0.3}),
        "grouped heads": ((q, grouped_k, grouped_v), {"enable_gqa": True}, {}),
        "no heads dimension": ((q[0], k[0], v[0]), {"scale": 0.5}, {"scale": 0.5}),
    }


class CallsAttention(nn.Module):
    """A model that calls F.scaled_dot_product_attention with given options."""

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.options)


@pytest.mark.parametrize("case", list(sdpa_cases()))
def test_scaled_dot_product_attention_step_by_step_equals_the_fused_kernel(case):
    (q, k, v), options, hand = sdpa_cases()[case]
    fused = F.scaled_dot_product_attention(q, k, v, **options)
    output, probabilities = attend(q, k, v, **options)
    torch.testing.assert_close(output, fused, rtol=1e-5, atol=1e-6)
    key = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) if options.get("enable_gqa") else k
    expected = probabilities_by_hand(q, key, **hand)
    torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)
    # and recorded in the autograd graph of a model that calls the kernel
    model = CallsAttention(**options)
    q, k, v = (tensor.clone().requires_grad_(True) for tensor in (q, k, v))
    weights = torch.randn(fused.shape)
    with explain.capture_attention(model, grads=True) as attention:
        recorded_output = model(q, k, v)
        (recorded_output * weights).sum().backward()
    torch.testing.assert_close(recorded_output.detach(), fused, rtol=1e-5, atol=1e-6)
    (record,) = attention
    assert record.module == "" and record.source == "scaled_dot_product_attention"
    by_hand = probabilities_by_hand(q.detach(), key, **hand).requires_grad_(True)
    value = v.detach().repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3) if options.get("enable_gqa") else v
    ((by_hand @ value.detach()) * weights).sum().backward()
    expected_shape = expected.shape if expected.dim() == 4 else (expected.shape[0], 1, *expected.shape[1:])
    torch.testing.assert_close(record.probabilities, expected.reshape(expected_shape), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.grad, by_hand.grad.reshape(expected_shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(sdpa_cases()))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_step_by_step_attention_gradients_follow_the_formula_and_keep_one_attention_matrix(case, dtype):
    """∂/∂(q, k, v) of attend's output equal autograd of softmax(QKᵀ·scale + mask)·V by hand (float64: 1e-10;
    bfloat16 inputs: within bf16 rounding of the float64 answer), and the graph keeps one (L, S) float matrix
    per call, in the inputs' dtype: the probabilities (not a float32 copy too, nor a second one for the mask)."""
    (q, k, v), options, hand = sdpa_cases()[case]
    weights = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    key_heads = q.shape[-3] // k.shape[-3] if options.get("enable_gqa") else 1
    exact = [tensor.double().requires_grad_(True) for tensor in (q, k, v)]
    expanded_k, expanded_v = (tensor.repeat_interleave(key_heads, dim=-3) for tensor in exact[1:])
    mask = hand.get("mask")
    hand = {**hand, "mask": mask.double() if mask is not None and mask.is_floating_point() else mask}
    ((probabilities_by_hand(exact[0], expanded_k, **hand) @ expanded_v) * weights).sum().backward()

    inputs = [tensor.to(dtype).requires_grad_(True) for tensor in (q, k, v)]
    options = {name: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
               for name, value in options.items()}
    square = q.shape[-2] * k.shape[-2]
    kept: list[torch.Tensor] = []

    def keep(tensor):
        if tensor.is_floating_point() and tensor.shape[-2:].numel() == square:
            kept.append(tensor)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        output, probabilities = attend(*inputs, **options)
    (output.double() * weights).sum().backward()
    storages = {tensor.untyped_storage().data_ptr(): tensor.dtype for tensor in kept}  # views share one storage
    assert list(storages.values()) == [dtype], [(tuple(tensor.shape), tensor.dtype) for tensor in kept]
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 0.05, "atol": 0.05}
    for ours, theirs in zip(inputs, exact):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tolerance)


def multihead_cases():
    """(description, MultiheadAttention options, call keyword arguments, batched)."""
    length, source, batch = 5, 6, 2
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[1, -2:] = True
    forbidden = torch.zeros(length, source, dtype=torch.bool)
    forbidden[0, 1:3] = True
    causal = nn.Transformer.generate_square_subsequent_mask(length)
    return [
        ("self-attention, batch first", dict(batch_first=True), {}, "self"),
        ("sequence first", dict(), {}, "self"),
        ("key padding and boolean attention masks", dict(batch_first=True),
         dict(key_padding_mask=padding, attn_mask=forbidden), "cross"),
        ("additive 3-D mask, per-head weights", dict(batch_first=True),
         dict(attn_mask=torch.randn(batch * 2, length, source), average_attn_weights=False), "cross"),
        ("bias_k, bias_v and a zero attention slot", dict(batch_first=True, add_bias_kv=True, add_zero_attn=True),
         dict(key_padding_mask=padding), "cross"),
        ("separate key and value dimensions", dict(batch_first=True, kdim=3, vdim=7), {}, "cross"),
        ("causal mask with the is_causal hint", dict(batch_first=True), dict(attn_mask=causal, is_causal=True),
         "self"),
        ("unbatched", dict(), {}, "unbatched"),
    ]


@pytest.mark.parametrize("case", multihead_cases(), ids=lambda case: case[0])
def test_multi_head_attention_step_by_step_equals_torch_and_its_own_weights(case):
    _, options, call, kind = case
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, **options).eval()
    batch_first = options.get("batch_first", False)
    kdim, vdim = options.get("kdim", 8), options.get("vdim", 8)

    def shaped(tokens, dim):
        if kind == "unbatched":
            return torch.randn(tokens, dim)
        return torch.randn(2, tokens, dim) if batch_first else torch.randn(tokens, 2, dim)

    query = shaped(5, 8)
    key, value = (query, query) if kind in ("self", "unbatched") else (shaped(6, kdim), shaped(6, vdim))
    with torch.no_grad():
        expected, weights = attention(query, key, value, need_weights=True, **call)  # torch's own eager path
        fused, _ = attention(query, key, value, need_weights=False, **call)
    with torch.no_grad(), explain.capture_attention(attention) as captured:
        recorded, recorded_weights = attention(query, key, value, need_weights=True, **call)
        without_weights, none = attention(query, key, value, need_weights=False, **call)
    torch.testing.assert_close(recorded, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recorded_weights, weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(without_weights, fused, rtol=1e-5, atol=1e-6)
    assert none is None and len(captured) == 2 and captured.modules == ["", ""]
    per_head = captured.probabilities[0]
    average = call.get("average_attn_weights", True)
    torch.testing.assert_close(per_head.mean(1) if average else per_head, weights.reshape(
        -1, *weights.shape[-(2 if average else 3):]), rtol=1e-5, atol=1e-6)


def test_capture_selects_blocks_by_position_and_by_module_and_ignores_attention_outside_the_model():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=3, num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    every = ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    for blocks, expected in [(None, every), (slice(-2, None), every[1:]), (-1, every[2:]), ([0, 2], every[::2]),
                             ("blocks.1", every[1:2]), ("blocks.*", every), (model.blocks[0], every[:1]),
                             (type(model.blocks[0].attn), every)]:
        with torch.no_grad(), explain.capture_attention(model, blocks) as attention:
            model(x)
            F.scaled_dot_product_attention(*torch.randn(3, 1, 2, 4, 8))  # not the model's: not recorded
        assert attention.modules == expected, blocks
    with explain.capture_attention(model, 5) as attention:
        model(x)
    with pytest.raises(IndexError, match="3 attention call"):
        _ = attention.probabilities
    with pytest.raises(explain.LayerNotFoundError):
        with explain.capture_attention(model, "blocks.7"):
            pass


def test_capture_is_for_this_thread_only_and_leaves_no_mode_on():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=1, num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), explain.capture_attention(model) as attention:
        other = threading.Thread(target=lambda: model(x))
        other.start()
        other.join()
    assert len(attention) == 0
    with pytest.raises(KeyError):
        with explain.capture_attention(model):
            raise KeyError("the user's code failed")
    assert torch._C._len_torch_function_stack() == 0


def test_a_rule_computes_its_functions_during_the_block_only():
    class Doubled(Rule):
        functions = frozenset({torch.tanh, torch.Tensor.tanh})

        def compute(self, func, args, kwargs):
            return 2 * func(*args, **kwargs)

    x = torch.randn(4)
    with call_rules(Doubled()) as mode:
        inside = torch.tanh(x), x.tanh(), torch.sigmoid(x)
    assert isinstance(mode, explain.core.attention.CallRules)
    torch.testing.assert_close(inside[0], 2 * x.tanh())
    torch.testing.assert_close(inside[1], 2 * x.tanh())
    torch.testing.assert_close(inside[2], x.sigmoid())
    torch.testing.assert_close(torch.tanh(x), x.tanh())
    with pytest.raises(ValueError, match="two rules"):
        call_rules(Doubled(), Doubled())
