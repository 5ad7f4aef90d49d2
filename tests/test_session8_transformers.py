"""Transformer explanation methods attacked as a hostile user would (session 8): reduced precision in Transformer
attribution's relevance pass, and the error that names the blocks to roll out when an attention-pooling head (timm's
``global_pool='map'``, SigLIP's head) or another tower computes attention of another shape."""

from __future__ import annotations

import warnings

import pytest
import torch

import explain

timm = pytest.importorskip("timm")


def _vit(**options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=64, depth=3,
                             **options).eval()


def _largest_difference(maps: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest |difference| of each image's map, as a share of that image's reference maximum."""
    return float(((maps - reference).abs().amax(dim=(1, 2)) / reference.abs().amax(dim=(1, 2))).max())


def test_transformer_attribution_under_bfloat16_autocast_stays_near_float32():
    """The authors' divisions in the relevance pass round badly in bfloat16 (before: up to 0.23 of the map's
    maximum on this model, silently); the relevance pass now runs outside autocast, and only the gradient pass
    rounds, as gradient-weighted rollout's does (≤ 0.01)."""
    model, x = _vit(), torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    reference = explain.TransformerAttribution(model).explain(x, target=[1, 2, 3]).maps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # autocast alone: the relevance is float32, nothing to warn about
        with torch.autocast("cpu", dtype=torch.bfloat16):
            maps = explain.TransformerAttribution(model).explain(x, target=[1, 2, 3]).maps
    assert _largest_difference(maps, reference) < 0.03


def test_transformer_attribution_of_a_bfloat16_model_warns_at_the_callers_line():
    model, x = _vit(), torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    reference = explain.TransformerAttribution(model).explain(x, target=[1, 2]).maps
    model = model.bfloat16()
    with pytest.warns(RuntimeWarning, match=r"TransformerAttribution ran in bfloat16 \(the model's dtype\).*"
                                            r"model\.float\(\)") as caught:
        maps = explain.TransformerAttribution(model).explain(x.bfloat16(), target=[1, 2]).maps
    assert [record.filename for record in caught if "ran in bfloat16" in str(record.message)] == [__file__]
    assert _largest_difference(maps, reference) < 1.0  # still a map of this model: rounded, not another one


def _rollout_by_hand(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Abnar & Zuidema's rollout over timm's blocks from eager attention: Â = row-normalised 0.5 E_h[A] + 0.5 I,
    R = Â_L ⋯ Â_1, read as the mean of the patch tokens' rows (the MAP head pools the patch tokens), (N, 4, 4)."""
    recorded: list[torch.Tensor] = []
    handles = []
    for block in model.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(
            lambda module, inputs, output: recorded.append(inputs[0].detach())))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle, block in zip(handles, model.blocks):
            handle.remove()
            block.attn.fused_attn = True
    tokens = recorded[0].shape[-1]
    identity = torch.eye(tokens)
    rollout = identity.expand(x.shape[0], tokens, tokens)
    for attention in recorded:
        mixed = 0.5 * attention.mean(dim=1) + 0.5 * identity
        rollout = (mixed / mixed.sum(dim=-1, keepdim=True)) @ rollout
    return rollout[:, 1:, 1:].mean(dim=1).reshape(x.shape[0], 4, 4)


def test_an_attention_pooling_head_is_named_with_the_blocks_to_roll_out():
    """timm's global_pool='map' computes a 1 × 16 attention after the 17 × 17 blocks: the error names where each
    shape was computed and the blocks= that keeps the blocks (before: only the shapes, and CLIP's example), and that
    blocks= gives the rollout computed by hand."""
    model = _vit(global_pool="map")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"not self-attention over the same tokens.*choose the image's blocks.*"
                                         r"1 × 16 in 'attn_pool'.*blocks='blocks' keeps the 17 × 17 self-attention"):
        explain.AttentionRollout(model).explain(x, target=1)
    explanation = explain.AttentionRollout(model, blocks="blocks").explain(x, target=1)
    torch.testing.assert_close(explanation.low_res_maps[0][:, 0], _rollout_by_hand(model, x))


def _registers_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, num_classes=5, img_size=28, depth=2,
                             embed_dim=48, num_heads=2).eval()


def test_a_reshape_that_contradicts_the_patch_embedding_is_warned_about_and_a_bool_refused():
    """The patch embedding (14 px, stride = kernel) cuts a 28 × 28 image into 2 × 2 patches: reshape=(1, 4) fits the
    token count but puts each token on another patch's pixels (before: silently); True is not a grid size (before:
    taken as 1)."""
    model, x = _registers_vit(), torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"reshape=\(1, 4\) lays the 4 patch tokens.*2 × 2 patches of 14×14 pixels.*"
                                         r"pass reshape=\(2, 2\)") as caught:
        transposed = explain.AttentionRollout(model, reshape=(1, 4)).explain(x, target=1)
    assert [record.filename for record in caught if "lays the 4 patch tokens" in str(record.message)] == [__file__]
    stated = explain.AttentionRollout(model).explain(x, target=1)
    torch.testing.assert_close(transposed.low_res_maps[0].flatten(), stated.low_res_maps[0].flatten())  # same values
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grid the model states: no warning
        explain.AttentionRollout(model, reshape=(2, 2)).explain(x, target=1)
    with pytest.raises(ValueError, match=r"reshape=\(h, w\) takes two positive ints.*got \(True, 4\)"):
        explain.AttentionRollout(model, reshape=(True, 4)).explain(x, target=1)


@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.TransformerAttribution])
def test_blocks_that_choose_no_attention_say_so(method):
    """Before: 'found no attention in the model's forward pass ... Attention methods need a transformer', on a
    transformer whose blocks= chose none of its attention."""
    model, x = _registers_vit(), torch.randn(1, 3, 28, 28)
    with pytest.raises(ValueError, match=r"blocks=slice\(5, None, None\) chooses none of the 2 attention call\(s\) "
                                         r"the model computed.*blocks=None"):
        method(model, blocks=slice(5, None)).explain(x, target=1)
    with pytest.raises(ValueError, match=r"blocks=.*Linear.* chooses modules inside which no attention is computed"):
        method(model, blocks=torch.nn.Linear).explain(x, target=1)


def _placed_by_hand(grid_maps: torch.Tensor, spanned: tuple[int, int], read: tuple[int, int],
                    input_size: tuple[int, int]) -> torch.Tensor:
    """The (N, K, h, w) grid maps spread bilinearly over the ``spanned`` top-left pixels, kept on the pixels the
    patch embedding ``read`` and inside the input, 0 elsewhere."""
    spread = torch.nn.functional.interpolate(grid_maps.float(), size=spanned, mode="bilinear", align_corners=False)
    placed = torch.zeros(*grid_maps.shape[:2], *input_size)
    rows, columns = min(spanned[0], read[0], input_size[0]), min(spanned[1], read[1], input_size[1])
    placed[..., :rows, :columns] = spread[..., :rows, :columns]
    return placed


def test_swin_maps_lie_on_the_pixels_its_patches_read():
    """torchvision's swin_t cuts a 67 × 67 image into 16 × 16 patches of 4 px and never reads the last 3 rows and
    columns; HuggingFace's Swin pads it to 68 × 68 (17 × 17 patches). Before, Transformer attribution's and LeGrad's
    maps were stretched over the whole 67 px (every patch a little off, the unread border given values)."""
    torchvision = pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 67, 67, generator=torch.Generator().manual_seed(3))
    tv = torchvision.models.swin_t(num_classes=5).eval()
    hf = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 1], window_size=4,
        num_labels=5)).eval()
    cases = [  # model, method, grid, pixels a token spans, pixels the patches read
        (tv, explain.TransformerAttribution, (16, 16), 4, 64),
        (tv, explain.LeGrad, (2, 2), 32, 64),     # the last stage, after 3 merges
        (hf, explain.TransformerAttribution, (17, 17), 4, 68),
        (hf, explain.LeGrad, (9, 9), 8, 68),      # 17 → 9 tokens: the merge pads the odd grid to 18
    ]
    for model, method, grid, stride, read in cases:
        explanation = method(model, normalize=None).explain(x, target=1)
        grid_maps = explanation.low_res_maps[0]
        assert tuple(grid_maps.shape[-2:]) == grid
        spanned = (grid[0] * stride, grid[1] * stride)
        expected = _placed_by_hand(grid_maps, spanned, (read, read), (67, 67))
        torch.testing.assert_close(explanation.maps, expected[:, 0])
