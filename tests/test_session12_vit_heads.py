"""Attention methods on vision transformers with unusual heads (session 12): a head that pools the class and register
tokens with the patches (timm ``pool_include_prefix=True``) is read as every token's row, checked against rollouts by
hand; an attention-pooling head (timm ``global_pool='map'``, HF SigLIP's), whose weights of the tokens are its own
attention, is read as the mean of the pooled tokens' rows with a warning at the caller's line, which ``row=``
silences; SigLIP's classifier, which averages the tokens and not the head's output, gets no warning."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import explain
from tests.conftest import assert_state_equal, model_state
from tests.test_issue26_attention import attention_by_hand

os.environ.setdefault("HF_HUB_OFFLINE", "1")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _vit(**options: object) -> torch.nn.Module:
    """A tiny timm ViT (2 blocks, 8 px patches, 32 px: 4 × 4 patches), random weights, float64."""
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=5, **options).eval().double()


def _rollouts_by_hand(blocks: list[torch.Tensor], read) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout, gradient rollout) rows (N, T) by the papers' formulas, image by image: Abnar & Zuidema's
    R = Π (0.5·mean_h A + 0.5·I) and Chefer et al.'s R ← R + mean_h (∂y/∂A ⊙ A)⁺ R, then ``read`` (T, T) → (T,)."""
    count, _, tokens, _ = blocks[0].shape
    identity = torch.eye(tokens, dtype=torch.float64)
    rows: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for image in range(count):
        rollout, weighted = identity, identity
        for block in blocks:
            rollout = (0.5 * block[image].mean(dim=0) + 0.5 * identity) @ rollout
            weighted = weighted + (block.grad[image] * block[image]).clamp(min=0).mean(dim=0) @ weighted
        rows[0].append(read(rollout).detach())
        rows[1].append(read(weighted).detach())
    return torch.stack(rows[0]), torch.stack(rows[1])


@pytest.mark.parametrize("options, prefix", [(dict(class_token=False, reg_tokens=2, global_pool="avg"), 2),
                                             (dict(global_pool="avg"), 1)])
def test_a_head_that_pools_the_prefix_tokens_too_is_read_as_every_tokens_row(options, prefix):
    """timm's pool_include_prefix=True averages the register (or class) tokens with the patches: the head reads
    every token, so the row is the mean of all T rows (before: the patch tokens' rows only, the rollout 2 % to 3 %
    of its largest value off, silently)."""
    model = _vit(pool_include_prefix=True, **options)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    blocks = attention_by_hand(model, x.clone(), target=3)
    rollout, weighted = _rollouts_by_hand(blocks, lambda relevance: relevance.mean(dim=0)[prefix:].reshape(4, 4))
    patches_only = _rollouts_by_hand(blocks, lambda relevance: relevance[prefix:].mean(dim=0)[prefix:].reshape(4, 4))
    assert (rollout - patches_only[0]).abs().max() > 1e-2 * rollout.abs().max()  # the two readings differ here
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an average of the tokens: nothing to warn about
        found = explain.AttentionRollout(model, normalize=None).explain(x).low_res_maps[0][:, 0]
        found_weighted = explain.GradientAttentionRollout(model, normalize=None).explain(x, target=3)
    torch.testing.assert_close(found.double(), rollout, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(found_weighted.low_res_maps[0][:, 0].double(), weighted, rtol=1e-6, atol=1e-9)
    explicit = explain.AttentionRollout(model, row="all", normalize=None).explain(x).low_res_maps[0][:, 0]
    torch.testing.assert_close(explicit, found)
    assert_state_equal(before, model_state(model))


@pytest.mark.parametrize("options, row, prefix", [
    (dict(global_pool="map"), "mean", 1),  # the class token is not pooled: the patch tokens' rows
    (dict(global_pool="map", class_token=False, reg_tokens=1, pool_include_prefix=True), "all", 1),  # timm test_vit3
])
@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.GradientAttentionRollout,
                                    explain.TransformerAttribution])
def test_an_attention_pooling_head_is_read_as_the_pooled_tokens_rows_with_a_warning(options, row, prefix, method):
    """global_pool='map' weighs the tokens by its own attention to a learned query, not a row of the blocks'
    relevance: with the blocks chosen, "auto" reads the mean of the rows of the tokens the head pools (before:
    silently, and the patch tokens only where the head also pools the register token), warning at the caller's
    line; row= names that reading and silences the warning."""
    model = _vit(**options)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    blocks = attention_by_hand(model, x.clone(), target=2)
    read = (lambda relevance: relevance[prefix:].mean(dim=0)[prefix:].reshape(4, 4)) if row == "mean" else (
        lambda relevance: relevance.mean(dim=0)[prefix:].reshape(4, 4))
    by_hand = dict(zip((explain.AttentionRollout, explain.GradientAttentionRollout), _rollouts_by_hand(blocks, read)))
    before = model_state(model)
    with pytest.warns(UserWarning, match=rf"{method.__name__}\(row='auto'\) reads the mean of .*pools the tokens with "
                                         rf"attention \('attn_pool'.*Pass row='{row}'") as caught:
        auto = method(model, blocks="blocks", normalize=None).explain(x, target=2).low_res_maps[0][:, 0]
    assert [record.filename for record in caught if "attn_pool" in str(record.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explicit = method(model, blocks="blocks", row=row, normalize=None).explain(x, target=2).low_res_maps[0][:, 0]
    torch.testing.assert_close(explicit, auto)
    if method in by_hand:
        torch.testing.assert_close(auto.double(), by_hand[method], rtol=1e-6, atol=1e-9)
    assert_state_equal(before, model_state(model))


def _siglip(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2)
    if kind == "vision":
        return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**vision)).eval()
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100,
                bos_token_id=0, eos_token_id=1)
    return transformers.SiglipForImageClassification(transformers.SiglipConfig(
        vision_config=vision, text_config=text, num_labels=5)).eval()


def test_siglip_warns_where_its_attention_pooling_head_is_read_and_not_where_its_classifier_averages_the_tokens():
    """SiglipVisionModel's pooler_output is its attention-pooling head's: "auto" warns. SiglipForImageClassification
    computes that head too but classifies the mean of the tokens, which the mean of the rows is: no warning, and
    the same map as row='mean'."""
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    tower = _siglip("vision")
    with pytest.warns(UserWarning, match=r"pools the tokens with attention \('head'.*Pass row='mean'"):
        explain.GradientAttentionRollout(tower, blocks="encoder", output="pooler_output").explain(x, target=0)
    classifier = _siglip("classifier")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = explain.GradientAttentionRollout(classifier, blocks="vision_model.encoder").explain(x, target=1)
    mean = explain.GradientAttentionRollout(classifier, blocks="vision_model.encoder", row="mean").explain(x, target=1)
    torch.testing.assert_close(auto.maps, mean.maps)
