"""Issue 39, point 6 and two items of point 14: token maps on the pixels the patch embedding reads; start_block.

- 6: a ViT whose patch embedding is one convolution with stride = kernel = p reads only the input's top-left
  h·p × w·p pixels of an (H, W) input (HuggingFace DINOv2 at any size, HF ViT with ``interpolate_pos_encoding``, a
  timm ``img_size`` that is not a multiple of p), or reads an input padded at the bottom and right (timm's
  ``dynamic_img_pad``). The token maps of gradient rollout, TransformerAttribution, LeGrad and Grad-CAM on a block's
  tokens are the token grid upsampled onto those h·p × w·p pixels and 0 on the rest: 0 where the model reads nothing
  (as its gradient is), and on the pixels it reads, the map of the image cropped to them (where the grid spans the
  whole input, which is unambiguous); with padding, the map of the padded image cropped back.
- 14: ``start_block`` is an int (numpy ints too), not a bool or a float, for every attention method.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from torch import Tensor, nn

import explain
from explain.core.layouts import token_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

METHODS = ["gradientrollout", "transformerattribution", "legrad", "gradcam"]


def dinov2(attention: str = "sdpa") -> nn.Module:
    """A tiny HuggingFace DINOv2 classifier (patch 14, random weights, float64): any input size runs, the
    convolution dropping the pixels past the last whole patch."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, patch_size=14, image_size=28, num_labels=3,
                                       attn_implementation=attention)
    return transformers.Dinov2ForImageClassification(config).eval().double()


def hf_vit() -> nn.Module:
    """A tiny HuggingFace ViT classifier (patch 8, 32 px, random weights, float64), run with
    interpolate_pos_encoding=True at other sizes."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    patch_size=8, image_size=32, num_labels=3)
    return transformers.ViTForImageClassification(config).eval().double()


def timm_vit(**options) -> nn.Module:
    """A tiny timm ViT (patch 8, random weights, float64)."""
    torch.manual_seed(0)
    options = {"depth": 2, "embed_dim": 32, "num_heads": 2, "num_classes": 3, "patch_size": 8, **options}
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **options).eval().double()


def explainer(method: str, model: nn.Module, block: str) -> explain.Explainer:
    """The method; Grad-CAM on ``block``'s tokens (a block before the last where the head reads the class token
    alone, whose last block's patch tokens get no gradient)."""
    if method == "gradcam":
        return explain.GradCAM(model, block)
    return explain.get_method(method)(model)


def raw_map(method: explain.Explainer, image: Tensor, **call) -> tuple[Tensor, Tensor]:
    """(the raw map of target 0 at the input's size (H, W), the low-resolution map on the token grid (h, w))."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: empty-map warnings are beside the point here
        explanation = method.explain(image, 0, **call)
    return explanation.raw_map_grid[0, 0], explanation.low_res_maps[0][0, 0].float()


def placed_by_hand(grid_map: Tensor, covered: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """The grid map upsampled (bilinear, align_corners=False, as every map is upsampled) onto the top-left
    covered rows × columns, cropped to the input, 0 past them."""
    spread = F.interpolate(grid_map[None, None], size=covered, mode="bilinear", align_corners=False)[0, 0]
    placed = torch.zeros(size)
    rows, columns = min(covered[0], size[0]), min(covered[1], size[1])
    placed[:rows, :columns] = spread[:rows, :columns]
    return placed


# (model, GradCAM's block, patch size, input size, the pixels the patch grid spans, the forward's keyword arguments)
CROPPING = {
    "hf-dinov2-41x41": (dinov2, "dinov2.encoder.layer.1", 14, (41, 41), (28, 28), {}),
    "hf-dinov2-41x60": (dinov2, "dinov2.encoder.layer.1", 14, (41, 60), (28, 56), {}),
    "hf-vit-interpolate-37x45": (hf_vit, "vit.layers.0", 8, (37, 45), (32, 40),
                                 {"forward_kwargs": {"interpolate_pos_encoding": True}}),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CROPPING))
def test_a_map_is_zero_where_the_patch_embedding_reads_nothing_and_the_cropped_images_map_elsewhere(case, method,
                                                                                                    one_torch_thread):
    build, block, patch, size, covered, call = CROPPING[case]
    model = build()
    torch.manual_seed(1)
    image = torch.rand(1, 3, *size, dtype=torch.float64)
    before = model_state(model)
    full, grid_map = raw_map(explainer(method, model, block), image, **call)
    cropped, _ = raw_map(explainer(method, model, block), image[..., : covered[0], : covered[1]], **call)
    assert_state_equal(before, model_state(model))
    rows, columns = covered
    assert grid_map.shape == (rows // patch, columns // patch)
    assert full[:rows, :columns].abs().sum() > 0
    assert full[rows:, :].abs().sum() == 0 and full[:, columns:].abs().sum() == 0  # mass fraction outside: exactly 0
    torch.testing.assert_close(full, placed_by_hand(grid_map, covered, size), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(full[:rows, :columns], cropped, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_a_timm_img_size_that_is_not_a_multiple_of_the_patch_reads_the_top_left_whole_patches(method,
                                                                                             one_torch_thread):
    """timm at img_size=37 with 8-px patches: a 4 × 4 grid over the top-left 32 × 32 pixels; on them, the map of
    the same weights at img_size=32 on the cropped image."""
    model, twin = timm_vit(img_size=37), timm_vit(img_size=32)
    twin.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    image = torch.rand(1, 3, 37, 37, dtype=torch.float64)
    full, grid_map = raw_map(explainer(method, model, "blocks.0"), image)
    cropped, _ = raw_map(explainer(method, twin, "blocks.0"), image[..., :32, :32])
    assert grid_map.shape == (4, 4) and full.abs().sum() > 0
    assert full[32:, :].abs().sum() == 0 and full[:, 32:].abs().sum() == 0
    torch.testing.assert_close(full, placed_by_hand(grid_map, (32, 32), (37, 37)), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(full[:32, :32], cropped, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_a_timm_vit_that_pads_its_input_is_explained_as_the_padded_image_cropped_back(method, one_torch_thread):
    """timm's dynamic_img_pad pads a 37 × 30 input with zeros to 40 × 32 (a 5 × 4 grid of 8-px patches): the map is
    the padded image's map (whose grid spans it) cropped to the input, not the grid stretched over 37 × 30."""
    model = timm_vit(img_size=32, dynamic_img_size=True, dynamic_img_pad=True)
    torch.manual_seed(1)
    image = torch.rand(1, 3, 37, 30, dtype=torch.float64)
    full, grid_map = raw_map(explainer(method, model, "blocks.0"), image)
    padded, _ = raw_map(explainer(method, model, "blocks.0"), F.pad(image, (0, 2, 0, 3)))
    assert grid_map.shape == (5, 4) and full.abs().sum() > 0
    torch.testing.assert_close(full, padded[:37, :30], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(full, placed_by_hand(grid_map, (40, 32), (37, 30)), rtol=1e-6, atol=1e-12)


def test_gradcam_and_gradient_rollout_of_dinov2_by_hand_on_the_covered_pixels(one_torch_thread):
    """By hand on HF DINOv2 (eager attention, its probabilities returned and differentiated) at 41 × 60: Grad-CAM
    on the last block's patch tokens, ReLU(Σ_c mean(∂y/∂A_c) A_c), and gradient rollout, R ← R + E_h[(∇A ⊙ A)⁺] R,
    the class token's row; each on the 2 × 4 grid, upsampled onto the top-left 28 × 56 pixels, 0 elsewhere."""
    model = dinov2("eager")
    torch.manual_seed(1)
    image = torch.rand(1, 3, 41, 60, dtype=torch.float64)
    captured = {}
    hook = model.dinov2.encoder.layer[1].register_forward_hook(
        lambda module, args, output: captured.update(tokens=output[0] if isinstance(output, tuple) else output))
    try:
        output = model(image, output_attentions=True)
    finally:
        hook.remove()
    tokens, attentions = captured["tokens"], output.attentions
    for probabilities in attentions:
        probabilities.retain_grad()
    tokens.retain_grad()
    output.logits[0, 0].backward()
    gradient, activation = tokens.grad[0, 1:], tokens.detach()[0, 1:]  # (4·2 patches, D)
    gradcam_grid = torch.relu(activation @ gradient.mean(dim=0)).reshape(2, 4)
    relevance = torch.eye(9, dtype=torch.float64)
    for probabilities in attentions:
        weighted = (probabilities.grad[0] * probabilities.detach()[0]).clamp(min=0).mean(dim=0)
        relevance = relevance + weighted @ relevance
    rollout_grid = relevance[0, 1:].reshape(2, 4)
    for method, grid_map in (("gradcam", gradcam_grid), ("gradientrollout", rollout_grid)):
        found, _ = raw_map(explainer(method, model, "dinov2.encoder.layer.1"), image)
        torch.testing.assert_close(found, placed_by_hand(grid_map.float(), (28, 56), (41, 60)), rtol=1e-5,
                                   atol=1e-9)
        assert found[28:].sum() == 0 and found[:, 56:].sum() == 0


def test_layouts_state_the_pixels_the_grid_spans_only_where_the_patch_size_is_known():
    """The covered pixels come from the patch embedding (h·p × w·p), for the grid it gives; None where the grid
    spans the input exactly, and where the grid is only inferred from the token count (no patch size known)."""
    model = dinov2()
    assert token_layout(5, (41, 41), model=model, whole_sequence=True).covered == (28, 28)
    assert token_layout(9, (41, 60), model=model, whole_sequence=True).covered == (28, 56)
    assert token_layout(8, (41, 60), model=model).covered == (28, 56)  # the patch embedding's output: no prefix
    assert token_layout(9, (41, 60), reshape=(2, 4), model=model, whole_sequence=True).covered == (28, 56)
    assert token_layout(5, (28, 28), model=model, whole_sequence=True).covered is None
    assert token_layout(5, (41, 41)).covered is None and token_layout(5, (41, 41)).grid == (2, 2)
    padded = timm_vit(img_size=32, dynamic_img_size=True, dynamic_img_pad=True)
    assert token_layout(21, (37, 30), model=padded, whole_sequence=True).covered == (40, 32)


# ------------------------------------------------------------------ 14: start_block


def small_vit() -> nn.Module:
    return timm_vit(img_size=16)


@pytest.mark.parametrize("method", ["gradientrollout", "attentionrollout", "transformerattribution", "legrad"])
@pytest.mark.parametrize("bad", [1.5, True, False, 1.0, "1", None])
def test_start_block_that_is_not_an_int_is_a_clear_error(method, bad):
    with pytest.raises(ValueError, match=r"start_block must be an int: the first block used.*got"):
        explain.get_method(method)(small_vit(), start_block=bad)


@pytest.mark.parametrize("method", ["gradientrollout", "transformerattribution", "legrad"])
def test_start_block_takes_numpy_ints_as_the_same_ints(method, one_torch_thread):
    model = small_vit()
    torch.manual_seed(1)
    image = torch.rand(1, 3, 16, 16, dtype=torch.float64)
    for numpy_value, value in ((np.int64(1), 1), (np.int32(-1), -1)):
        with_numpy = explain.get_method(method)(model, start_block=numpy_value)
        assert type(with_numpy.start_block) is int
        torch.testing.assert_close(raw_map(with_numpy, image)[0],
                                   raw_map(explain.get_method(method)(model, start_block=value), image)[0])
