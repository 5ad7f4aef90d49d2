"""Session 9: attention methods on heads that read two things (DeiT distilled, HF DINOv2) and on a single patch,
each against a rollout computed by hand from attention recorded independently (hooks, ``output_attentions``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import Tensor, nn

import explain

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def rollout_rows(blocks: list[Tensor]) -> Tensor:
    """(N, T, T) attention rollout by hand: per image, Â = mean over heads + I, rows renormalised, R ← Â R."""
    count, _, tokens, _ = blocks[0].shape
    rolled = []
    for image in range(count):
        relevance = torch.eye(tokens, dtype=torch.float64)
        for block in blocks:
            fused = block[image].double().mean(dim=0) + torch.eye(tokens, dtype=torch.float64)
            relevance = (fused / fused.sum(dim=1, keepdim=True)) @ relevance
        rolled.append(relevance)
    return torch.stack(rolled)


def timm_attention(model: nn.Module, x: Tensor) -> list[Tensor]:
    """Each timm block's attention probabilities, recorded by hooks on ``attn_drop`` of an eager copy of the model."""
    eager = copy.deepcopy(model)
    recorded: list[Tensor] = []
    for block in eager.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_hook(lambda module, args, output: recorded.append(args[0].detach()))
    with torch.no_grad():
        eager(x)
    return recorded


def tiny_deit_distilled() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=48, depth=3,
                             num_classes=5).eval()


def test_timm_deit_distilled_head_is_the_mean_of_two_linear_heads():
    """What "auto" relies on: the logits are (head(norm(z)[:, 0]) + head_dist(norm(z)[:, 1])) / 2, linear in each
    token's normalised output, so each of the two tokens carries half of every score."""
    model = tiny_deit_distilled()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        tokens = model.forward_features(x)  # the final norm applied to every token
        by_hand = (model.head(tokens[:, 0]) + model.head_dist(tokens[:, 1])) / 2
        torch.testing.assert_close(model(x), by_hand)


@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.GradientAttentionRollout])
def test_auto_reads_the_mean_of_the_class_and_distillation_rows_of_timm_deit_distilled(method):
    model = tiny_deit_distilled()
    x = torch.randn(2, 3, 48, 48)
    before = model_state(model)
    auto = method(model, normalize=None).explain(x, target=1)
    assert_state_equal(before, model_state(model))
    class_row = method(model, normalize=None, row="class").explain(x, target=1)
    if method is explain.AttentionRollout:
        rolled = rollout_rows(timm_attention(model, x))  # (N, T, T); 2 prefix tokens, a 3 × 3 grid
        expected = ((rolled[:, 0] + rolled[:, 1]) / 2)[:, 2:].reshape(2, 3, 3).float()
        torch.testing.assert_close(auto.low_res_maps[0][:, 0], expected, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(class_row.low_res_maps[0][:, 0], rolled[:, 0, 2:].reshape(2, 3, 3).float(),
                                   rtol=1e-4, atol=1e-6)
    assert not torch.allclose(auto.low_res_maps[0], class_row.low_res_maps[0])


def hf_config(cls, **extra):
    return cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
               patch_size=8, num_labels=5, attn_implementation="eager", **extra)


def randomised_tokens(model: nn.Module) -> nn.Module:
    """HF initialises the class, distillation and position embeddings to zeros, which makes the first two tokens
    equal: random values make their rows differ."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embeddings." in name and "patch_embeddings" not in name:
                parameter.normal_(std=0.5)
    return model


def hf_rollout(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        attentions = model(x, output_attentions=True).attentions
    return rollout_rows(list(attentions))


def test_auto_reads_the_mean_of_the_class_and_distillation_rows_of_hf_deit_with_teacher():
    from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    teacher = randomised_tokens(DeiTForImageClassificationWithTeacher(hf_config(DeiTConfig)).eval())
    rolled = hf_rollout(teacher, x)
    auto = explain.AttentionRollout(teacher, normalize=None).explain(x)
    expected = ((rolled[:, 0] + rolled[:, 1]) / 2)[:, 2:].reshape(2, 4, 4).float()
    torch.testing.assert_close(auto.low_res_maps[0][:, 0], expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(expected, rolled[:, 0, 2:].reshape(2, 4, 4).float(), rtol=1e-3, atol=1e-5)
    for output, token in (("cls_logits", 0), ("distillation_logits", 1)):  # one head: the token it reads
        one = explain.AttentionRollout(teacher, normalize=None, output=output).explain(x)
        torch.testing.assert_close(one.low_res_maps[0][:, 0], rolled[:, token, 2:].reshape(2, 4, 4).float(),
                                   rtol=1e-4, atol=1e-6)
    plain = randomised_tokens(DeiTForImageClassification(hf_config(DeiTConfig)).eval())  # reads the class token only
    rolled = hf_rollout(plain, x)
    auto = explain.AttentionRollout(plain, normalize=None).explain(x)
    torch.testing.assert_close(auto.low_res_maps[0][:, 0], rolled[:, 0, 2:].reshape(2, 4, 4).float(), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("registers", [0, 2])
def test_auto_on_hf_dinov2_reads_the_class_row_and_warns_that_the_head_also_reads_the_patch_mean(registers):
    from transformers import (
        Dinov2Config,
        Dinov2ForImageClassification,
        Dinov2WithRegistersConfig,
        Dinov2WithRegistersForImageClassification,
    )

    torch.manual_seed(0)
    if registers:
        model = Dinov2WithRegistersForImageClassification(
            hf_config(Dinov2WithRegistersConfig, num_register_tokens=registers)).eval()
    else:
        model = Dinov2ForImageClassification(hf_config(Dinov2Config)).eval()
    randomised_tokens(model)
    prefix = 1 + registers
    x = torch.randn(1, 3, 32, 32)
    rolled = hf_rollout(model, x)
    with pytest.warns(UserWarning, match="row='class' or row='mean'") as caught:
        auto = explain.AttentionRollout(model, normalize=None).explain(x)
    assert caught[0].filename == __file__  # points at the user's line
    torch.testing.assert_close(auto.low_res_maps[0][:, 0], rolled[:, 0, prefix:].reshape(1, 4, 4).float(),
                               rtol=1e-4, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = explain.AttentionRollout(model, normalize=None, row="mean").explain(x)
        explain.LeGrad(model, row="class").explain(x)
    expected = rolled[:, prefix:, prefix:].mean(dim=1).reshape(1, 4, 4).float()
    torch.testing.assert_close(mean.low_res_maps[0][:, 0], expected, rtol=1e-4, atol=1e-6)
    with pytest.warns(UserWarning, match="Dinov2ForImageClassification") as caught:
        explain.LeGrad(model, row="auto").explain(x)
    assert len([w for w in caught if "Dinov2" in str(w.message)]) == 1  # once per call, not per layer or target


@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.GradientAttentionRollout, explain.LeGrad,
                                    explain.TransformerAttribution])
def test_a_single_patch_is_refused_not_explained_by_a_constant_map(method):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, depth=2, num_classes=5,
                              dynamic_img_size=True).eval()
    before = model_state(model)
    with pytest.raises(ValueError, match=r"single patch \(1 × 1\).*larger input"):
        method(model).explain(torch.randn(1, 3, 16, 16), target=1)
    assert_state_equal(before, model_state(model))
    two = method(model).explain(torch.randn(1, 3, 16, 32), target=1)  # 1 × 2 patches: a map that can vary
    assert two.low_res_maps[0].shape[-2:] == (1, 2)


def test_legrad_refuses_a_swin_whose_last_stage_is_a_single_token():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=2,
                              depths=(1, 1, 1, 1), embed_dim=16, num_heads=(1, 1, 1, 1), num_classes=3).eval()
    with pytest.raises(ValueError, match="single patch"):  # 32 px / 4 = 8 → 4 → 2 → 1 tokens a side
        explain.LeGrad(model).explain(torch.randn(1, 3, 32, 32), target=0)
