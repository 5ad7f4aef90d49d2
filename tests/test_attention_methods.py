"""Attention rollout and gradient-weighted rollout, each against a slow by-hand implementation
(explicit loops over images, blocks and heads) fed with attention computed by hand; batches,
K targets and K prompts per image; CLIP; the shipped demo transformer."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import SmallCNN
from test_attention_models import FAMILIES, ImageEmbedding, hf_clip, run_by_hand

import explain

pytest.importorskip("timm")


def fused_heads(block, image, fusion):
    per_head = torch.stack([block[image, head] for head in range(block.shape[1])])
    return {"mean": per_head.sum(0) / block.shape[1], "max": per_head.max(0).values,
            "min": per_head.min(0).values}[fusion]


def rollout_by_hand(blocks, prefix, fusion="mean", discard_ratio=0.0):
    """(N, patches): for each image, block after block, Â = fused + I with rows renormalised, R ← Â R."""
    count, _, tokens, _ = blocks[0].shape
    maps = []
    for image in range(count):
        relevance = torch.eye(tokens)
        for block in blocks:
            fused = fused_heads(block, image, fusion).clone()
            discarded = int(discard_ratio * tokens * tokens)
            if discarded:
                flat = fused.view(-1)
                flat[flat.argsort()[:discarded]] = 0.0
            with_residual = fused + torch.eye(tokens)
            relevance = (with_residual / with_residual.sum(dim=1, keepdim=True)) @ relevance
        row = relevance[0] if prefix else relevance.mean(dim=0)
        maps.append(row[prefix:])
    return torch.stack(maps)


def gradient_rollout_by_hand(blocks, prefix):
    """(N, patches): for each image, block after block, Ā = mean_h (∂y/∂A ⊙ A)⁺, R ← R + Ā R from R = I."""
    count, heads, tokens, _ = blocks[0].shape
    maps = []
    for image in range(count):
        relevance = torch.eye(tokens)
        for block in blocks:
            weighted = sum((block.grad[image, head] * block[image, head]).clamp(min=0) for head in range(heads))
            relevance = relevance + (weighted / heads) @ relevance
        row = relevance[0] if prefix else relevance.mean(dim=0)
        maps.append(row[prefix:])
    return torch.stack(maps)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_both_methods_equal_a_slow_implementation_by_hand(name):
    family = FAMILIES[name]
    model = family.build()
    torch.manual_seed(2)
    x = torch.randn(2, 3, family.size, family.size)
    targets = [[1, 4], [2, 0]]  # K = 2 targets per image
    rollout = explain.AttentionRollout(model, normalize=None).explain(x, target=targets)
    gradient = explain.GradientAttentionRollout(model, normalize=None).explain(x, target=targets)
    grid = rollout.low_res_maps[0].shape[-2:]
    assert rollout.diagnostics["attention_blocks"] == family.names
    with torch.no_grad():
        _, blocks = run_by_hand(family, model, x)
    expected = rollout_by_hand(blocks, family.prefix).reshape(2, *grid)
    for k in range(2):
        torch.testing.assert_close(rollout.low_res_maps[0][:, k], expected, rtol=1e-5, atol=1e-6)
        _, blocks = run_by_hand(family, model, x, targets=[row[k] for row in targets])
        by_hand = gradient_rollout_by_hand(blocks, family.prefix).reshape(2, *grid)
        torch.testing.assert_close(gradient.low_res_maps[0][:, k], by_hand, rtol=1e-4, atol=1e-7)
        assert by_hand.abs().sum() > 0
    assert gradient.raw_maps.shape == (2, 2, family.size, family.size)


def test_rollout_options_head_fusion_discard_ratio_and_start_block():
    family = FAMILIES["timm-fused"]
    model = family.build()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        _, blocks = run_by_hand(family, model, x)
    for fusion, ratio, start in [("max", 0.0, 0), ("min", 0.5, 0), ("mean", 0.9, 1), ("mean", 0.0, -1)]:
        with warnings.catch_warnings():  # discarding half of the min-fused weights may empty a map
            warnings.simplefilter("ignore", RuntimeWarning)
            maps = explain.AttentionRollout(model, head_fusion=fusion, discard_ratio=ratio, start_block=start,
                                            normalize=None).explain(x).low_res_maps[0][:, 0]
        expected = rollout_by_hand(blocks[start:], 1, fusion, ratio).reshape(2, 3, 3)
        torch.testing.assert_close(maps, expected, rtol=1e-5, atol=1e-6, msg=f"{fusion} {ratio} {start}")
    with pytest.raises(ValueError, match="head_fusion"):
        explain.AttentionRollout(model, head_fusion="median")
    with pytest.raises(ValueError, match="start_block=2"):
        explain.AttentionRollout(model, start_block=2).explain(x)


@pytest.mark.parametrize("name", ["hf-vit-sdpa", "transformer-encoder"])
@pytest.mark.parametrize("method", ["attentionrollout", "gradientrollout"])
def test_a_batch_with_different_targets_equals_each_image_alone(name, method):
    family = FAMILIES[name]
    model = family.build()
    torch.manual_seed(3)
    x = torch.randn(4, 3, family.size, family.size)
    targets = [0, 3, 1, 4]
    explainer = explain.get_method(method)(model, normalize=None)
    together = explainer.explain(x, target=targets)
    alone = torch.cat([explainer.explain(x[i : i + 1], target=targets[i]).raw_maps for i in range(4)])
    torch.testing.assert_close(together.raw_maps, alone, rtol=1e-4, atol=1e-7)
    topk = explainer.explain(x, topk=3)
    assert topk.maps.shape == (4, 3, family.size, family.size)


def clip_inputs():
    clip = hf_clip()
    torch.manual_seed(4)
    pixels, prompts = torch.randn(2, 3, 32, 32), torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        texts = clip.get_text_features(input_ids=prompts).pooler_output  # (K, D)
    return clip, pixels, prompts, texts


@pytest.mark.parametrize("method", ["gradientrollout", "gradcam"])
def test_clip_k_prompts_per_image_in_one_call_equal_k_separate_calls(method):
    clip, pixels, _, texts = clip_inputs()
    embedder = ImageEmbedding(clip).eval()
    cls = explain.get_method(method)
    layer = ("clip.vision_model.encoder.layers.1.layer_norm1",) if cls.needs_layer else ()
    explainer = cls(embedder, *layer, normalize=None)
    together = explainer.explain(pixels, target=explain.EmbeddingSimilarity(texts))
    assert together.maps.shape == (2, 3, 32, 32)
    with torch.no_grad():
        image_embeddings = embedder(pixels)
    similarities = torch.nn.functional.cosine_similarity(image_embeddings[:, None], texts[None], dim=-1)
    torch.testing.assert_close(together.scores, similarities, rtol=1e-5, atol=1e-6)
    for k in range(3):
        alone = explainer.explain(pixels, target=explain.EmbeddingSimilarity(texts[k]))
        torch.testing.assert_close(together.raw_maps[:, k], alone.raw_maps, rtol=1e-4, atol=1e-7)
    assert together.raw_maps.abs().sum() > 0


def test_clip_model_with_prompts_as_classes_explains_the_image_tower_only():
    clip, pixels, prompts, _ = clip_inputs()
    explainer = explain.GradientAttentionRollout(clip, blocks="vision_model", output="logits_per_image",
                                                 normalize=None)
    call = dict(forward_kwargs={"input_ids": prompts}, input_position="pixel_values")
    together = explainer.explain(pixels, target=[[0, 1, 2], [0, 1, 2]], **call)
    assert all(name.startswith("vision_model.") for name in together.diagnostics["attention_blocks"])
    for k in range(3):
        alone = explainer.explain(pixels, target=k, **call)
        torch.testing.assert_close(together.raw_maps[:, k], alone.raw_maps, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="same tokens of the 2 image"):  # image and text attention together
        explain.AttentionRollout(clip, output="logits_per_image").explain(pixels, **call)


def test_embedding_similarity_shapes_and_errors():
    output = torch.randn(2, 4)
    assert explain.EmbeddingSimilarity(torch.randn(4))(output).shape == (2,)
    assert explain.EmbeddingSimilarity(torch.randn(3, 4))(output).shape == (2, 3)
    per_image = torch.randn(2, 1, 4)
    torch.testing.assert_close(explain.EmbeddingSimilarity(per_image)(output)[:, 0],
                               torch.nn.functional.cosine_similarity(output, per_image[:, 0], dim=1))
    with pytest.raises(ValueError, match="5 dimensions"):
        explain.EmbeddingSimilarity(torch.randn(5))(output)
    with pytest.raises(ValueError, match="references for 3 images"):
        explain.EmbeddingSimilarity(torch.randn(3, 2, 4))(output)


def test_models_without_whole_image_attention_get_errors_that_point_to_gradcam():
    timm = pytest.importorskip("timm")
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    swin = SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2),
                           num_classes=3).eval()
    with pytest.raises(ValueError, match="window attention.*GradCAM"):
        explain.GradientAttentionRollout(swin).explain(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="no attention.*GradCAM"):
        explain.AttentionRollout(SmallCNN().eval()).explain(torch.randn(1, 3, 16, 16))
    assert timm is not None


def test_the_demo_transformer_is_accurate_and_gradient_rollout_points_at_least_as_well_as_gradcam():
    from explain import metrics
    from explain.data import load_demo_vit, make_dataset
    from explain.data.train import EVALUATION_SEED, accuracy, to_model_input

    model = load_demo_vit()
    assert accuracy(model, count=200) >= 0.95
    data = make_dataset(64, seed=EVALUATION_SEED)
    batch, masks = to_model_input(data.images), torch.from_numpy(data.masks)
    pointing = {}
    for name in ("gradientrollout", "attentionrollout", "gradcam"):
        explanation = explain.get_method(name)(model).explain(batch, target=data.labels.tolist())
        pointing[name] = metrics.pointing_game(explanation, masks, tolerance=4).mean().item()
    assert pointing["gradientrollout"] >= pointing["gradcam"] and pointing["gradientrollout"] >= 0.9, pointing
    # the registry's other routes: figures, SmoothGrad wrapping
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        figure, explanations = explain.compare(model, list(data.images[:2]),
                                               methods=("attentionrollout", "gradientrollout", "gradcam"))
    assert len(explanations) == 3 and figure is not None
    smooth = explain.SmoothGrad(explain.GradientAttentionRollout(model), samples=2).explain(batch[:2])
    assert smooth.maps.shape == (2, 64, 64) and torch.isfinite(smooth.maps).all()
