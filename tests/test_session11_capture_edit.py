"""Session 11: explain.capture / edit / capture_attention / compare used as a hostile user would."""

from __future__ import annotations

import collections
import gc
import threading
import warnings
import weakref

import pytest
import torch
from conftest import assert_state_equal, hook_count, model_state
from torch import nn

import explain
from explain.core.capture import LayerNotRunError, ModelInputError


class ConvReluHead(nn.Module):
    """conv → ReLU(inplace=True) → mean → fc: the in-place ReLU right after the hooked layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.conv(x)).mean((2, 3)))


def _conv_gradient_by_hand(model: ConvReluHead, x: torch.Tensor, column: int) -> torch.Tensor:
    conv = model.conv(x).detach().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model.fc(torch.relu(conv).mean((2, 3)))[:, column].sum(), conv)
    return gradient


def test_grads_capture_keeps_no_forward_graph_alive_inside_the_block():
    # a loop of forwards inside one grads=True block: each pass's layer output (and the graph it holds) must be
    # freed with the pass, not kept by the gradient hook until the block ends
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    x = torch.randn(2, 3, 8, 8)
    outputs: list[weakref.ref] = []
    spy = model.conv.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    try:
        with explain.capture(model, "conv", grads=True) as captured:
            for _ in range(3):
                model(x)[:, 1].sum().backward()
            gc.collect()
            alive = [ref() is not None for ref in outputs]
    finally:
        spy.remove()
    assert alive == [False, False, False]
    assert len(captured["conv"].calls) == 3  # and every call's gradient was still recorded, equal to autograd's
    for gradient in captured["conv"].grads:
        torch.testing.assert_close(gradient, _conv_gradient_by_hand(model, x, 1))


def test_captured_tensors_are_freed_after_the_block_when_the_user_keeps_no_reference():
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    with explain.capture(model, "conv", grads=True) as captured:
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    output, gradient = weakref.ref(captured["conv"].output), weakref.ref(captured["conv"].grad)
    del captured
    assert output() is None and gradient() is None  # no cycle: freed by reference counting alone


def test_two_backward_passes_record_the_last_gradient():
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    x = torch.randn(2, 3, 8, 8)
    with explain.capture(model, "conv", grads=True) as captured:
        scores = model(x)
        scores[:, 0].sum().backward(retain_graph=True)
        scores[:, 1].sum().backward()
    torch.testing.assert_close(captured["conv"].grad, _conv_gradient_by_hand(model, x, 1))


def test_nested_captures_of_one_layer_both_record_the_true_output_and_gradient_before_an_inplace_relu():
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    x = torch.randn(2, 3, 8, 8)
    with explain.capture(model, "conv", grads=True) as outer:
        with explain.capture(model, "conv", grads=True, detach=False) as inner:
            model(x)[:, 0].sum().backward()
    expected = model.conv(x).detach()
    assert (expected < 0).any()  # the in-place ReLU after the layer would have zeroed these
    for captured in (outer, inner):
        torch.testing.assert_close(captured["conv"].output.detach(), expected)
        torch.testing.assert_close(captured["conv"].grad, _conv_gradient_by_hand(model, x, 0))
    assert hook_count(model) == 0


class DefaultDictLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> collections.defaultdict:
        result: collections.defaultdict = collections.defaultdict(list)
        result["scaled"] = 3 * x
        return result


class DefaultDictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.parts = DefaultDictLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.parts(self.linear(x))["scaled"] ** 2).sum(-1)


def test_a_layer_returning_a_defaultdict_is_recorded_with_its_gradient():
    torch.manual_seed(0)
    model = DefaultDictNet()
    x = torch.randn(2, 3)
    with explain.capture(model, "parts", grads=True) as captured:
        model(x).sum().backward()
    scaled = 3 * model.linear(x).detach()
    record = captured["parts"]
    assert type(record.output) is collections.defaultdict and record.output.default_factory is list
    torch.testing.assert_close(record.output["scaled"], scaled)
    torch.testing.assert_close(record.grad["scaled"], 2 * scaled)  # d(sum s²)/ds = 2s


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_reading_grad_after_a_forward_without_gradients_warns_at_the_users_line(mode):
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    with explain.capture(model, "conv", grads=True) as captured:
        with mode():
            model(torch.randn(1, 3, 8, 8))
    with pytest.warns(UserWarning, match=mode.__name__) as caught:
        assert captured["conv"].grad is None
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="no gradient"):
        assert captured["conv"].grads == [None]


def test_no_warning_when_the_gradient_came_or_was_not_asked_for():
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with explain.capture(model, "conv", grads=True) as captured:
            model(torch.randn(1, 3, 8, 8)).sum().backward()
        assert captured["conv"].grad is not None
        with explain.capture(model, "conv") as plain:
            with torch.no_grad():
                model(torch.randn(1, 3, 8, 8))
        assert plain["conv"].grad is None


def test_a_layer_that_did_not_run_says_so_without_pointing_at_calls():
    model = ConvReluHead().eval()
    with explain.capture(model, ["conv", "fc"]) as captured:
        model.conv(torch.randn(1, 3, 8, 8))
    with pytest.raises(LayerNotRunError, match="'fc' did not run") as raised:
        _ = captured["fc"].output
    assert ".calls[i]" not in str(raised.value)


def test_exceptions_and_interrupts_in_the_body_leave_the_model_as_found():
    torch.manual_seed(0)
    model = ConvReluHead().train()
    model.fc.weight.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    before = model_state(model)
    blocks = (lambda: explain.capture(model, ["conv", "fc"], grads=True, detach=False),
              lambda: explain.edit(model, "conv", lambda t: 2 * t, grad_fn=lambda g: 3 * g))
    for error in (ValueError, KeyboardInterrupt):
        for block in blocks:
            with pytest.raises(error):
                with block():
                    model(x).sum().backward()
                    raise error
            model.zero_grad(set_to_none=True)
            assert_state_equal(before, model_state(model))


def test_two_threads_capturing_one_model_record_only_their_own_passes():
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    inputs = [torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)]
    problems: list[str] = []

    def work(index: int) -> None:
        for _ in range(10):
            with explain.capture(model, "conv", grads=True) as captured:
                model(inputs[index])[:, index].sum().backward()
            if len(captured["conv"].calls) != 1 or not torch.allclose(
                    captured["conv"].grad, _conv_gradient_by_hand(model, inputs[index], index)):
                problems.append(f"thread {index}")

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert problems == [] and hook_count(model) == 0


# ------------------------------------------------------------------ capture_attention


def test_capture_attention_of_fused_timm_and_hf_sdpa_vits_equals_softmax_qk_by_hand():
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                            num_classes=3).eval()
    assert vit.blocks[1].attn.fused_attn
    x = torch.randn(2, 3, 32, 32)
    with explain.capture(vit, "blocks.1.attn.qkv") as captured, explain.capture_attention(vit) as attention:
        vit(x)
    qkv = captured["blocks.1.attn.qkv"].output
    q, k, _ = qkv.reshape(2, qkv.shape[1], 3, vit.blocks[1].attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(attention.probabilities[1], (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1))

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3,
                                    attn_implementation="sdpa")
    hf = transformers.ViTForImageClassification(config).eval()
    # the query and key projections of the second block (q_proj, k_proj in transformers 5; query, key before)
    query, key = (next(name for name, _ in hf.named_modules() if name.endswith(ends))
                  for ends in (("1.attention.q_proj", "1.attention.attention.query"),
                               ("1.attention.k_proj", "1.attention.attention.key")))
    images = torch.randn(2, 3, 16, 16)
    with explain.capture(hf, [query, key]) as captured, explain.capture_attention(hf) as attention:
        hf(images)
    q, k = (captured[name].output.reshape(2, 5, 2, 8).transpose(1, 2) for name in (query, key))
    torch.testing.assert_close(attention.probabilities[1], (q @ k.transpose(-2, -1) / 8 ** 0.5).softmax(-1))
    assert [record.source for record in attention] == ["scaled_dot_product_attention"] * 2


def _tiny_timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, depth=2,
                             num_classes=3).eval()


def test_nested_capture_attention_records_the_same_probabilities_in_both():
    vit = _tiny_timm_vit()
    x = torch.randn(1, 3, 16, 16)
    with explain.capture_attention(vit) as outer:
        with explain.capture_attention(vit, "blocks.1") as inner:
            vit(x)
    assert outer.modules == ["blocks.0.attn", "blocks.1.attn"] and inner.modules == ["blocks.1.attn"]
    torch.testing.assert_close(outer.probabilities[1], inner.probabilities[0])
    assert hook_count(vit) == 0 and torch._C._len_torch_function_stack() == 0


def test_capture_attention_grads_after_a_no_grad_forward_warn_at_the_users_line():
    vit = _tiny_timm_vit()
    with explain.capture_attention(vit, grads=True) as attention:
        with torch.no_grad():
            vit(torch.randn(1, 3, 16, 16))
    with pytest.warns(UserWarning, match="torch.no_grad") as caught:
        assert attention.grads == [None, None]
    assert caught[0].filename == __file__


# ------------------------------------------------------------------ compare


def test_compare_keeps_the_model_error_of_a_model_input_error():
    model = ConvReluHead().eval()
    with pytest.raises(ModelInputError, match="compare: method 'saliency'") as raised:
        explain.compare(model, torch.rand(1, 5, 16, 16), ["saliency"])
    assert isinstance(raised.value.model_error, RuntimeError)
    assert "channels" in str(raised.value.model_error)


def test_compare_gives_the_same_figure_for_the_same_inputs():
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = ConvReluHead().eval()
    x = torch.rand(2, 3, 16, 16)
    first = explain.compare(model, x, ["gradcam", "saliency"], layer="conv")
    second = explain.compare(model, x, ["gradcam", "saliency"], layer="conv")
    assert first._repr_png_() == second._repr_png_()
    for one, other in zip(first.explanations, second.explanations):
        torch.testing.assert_close(one.maps, other.maps)
