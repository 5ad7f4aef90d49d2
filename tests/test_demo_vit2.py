"""The second shipped demo transformer (``demo-vit2``): a plain ViT that the toolkit reads as a timm ViT."""

from __future__ import annotations

import torch

import explain
from explain import metrics
from explain.data import DemoViT2, load_demo_vit2, make_dataset
from explain.data.demo_vit2 import VIT2_WEIGHTS_PATH
from explain.data.train import EVALUATION_SEED, accuracy, to_model_input
from explain.data.train_vit2 import jitter_colours, train, translate

ACCURACY_BAR = 0.9
"""Held-out accuracy the shipped weights must reach (``python -m explain.data.train_vit2`` prints it)."""


def test_the_weights_are_small_float16_and_load_through_load_model():
    assert VIT2_WEIGHTS_PATH.stat().st_size < 1_000_000
    state = torch.load(VIT2_WEIGHTS_PATH, map_location="cpu", weights_only=True)
    assert {value.dtype for value in state.values() if value.is_floating_point()} == {torch.float16}
    loaded = explain.load_model("demo-vit2")
    assert isinstance(loaded.model, DemoViT2) and not loaded.model.training
    assert loaded.class_names == ["disc", "square", "triangle", "cross"] and loaded.input_size == (3, 64, 64)
    reference = load_demo_vit2()
    batch = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(batch), reference(batch))
    random = explain.load_model("demo-vit2", weights="random")
    assert random.random_weights and isinstance(random.model, DemoViT2)


def test_the_model_is_a_plain_vit_with_fused_attention():
    model = load_demo_vit2()
    convolutions = [module for module in model.modules() if isinstance(module, torch.nn.Conv2d)]
    assert len(convolutions) == 1 and convolutions[0].kernel_size == convolutions[0].stride == (8, 8)
    assert len(model.blocks) == 6 and model.cls_token.shape == (1, 1, 64)
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            model(torch.randn(1, 3, 64, 64))
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert calls == [(1, 4, 65, 16)] * 6  # (N, heads, 1 + 8·8 tokens, head dim) in every block
    with torch.no_grad():  # other input sizes interpolate the position embeddings
        assert model(torch.randn(1, 3, 96, 64)).shape == (1, 4)


def test_the_held_out_accuracy_is_above_the_bar():
    assert accuracy(load_demo_vit2(), count=500, seed=EVALUATION_SEED) >= ACCURACY_BAR


def test_gradcam_and_attention_rollout_read_its_layout_and_point_at_the_object():
    model = load_demo_vit2()
    data = make_dataset(32, seed=EVALUATION_SEED)
    batch, masks = to_model_input(data.images), torch.from_numpy(data.masks)
    target = data.labels.tolist()
    gradcam = explain.GradCAM(model)  # automatic layer: the last block's first norm, tokens on the 8×8 grid
    assert gradcam.explain(batch[:1], target=target[:1]).layer == "blocks.5.norm1"
    pointing = {}
    for explainer in (gradcam, explain.AttentionRollout(model), explain.GradientAttentionRollout(model)):
        explanation = explainer.explain(batch, target=target)
        assert explanation.maps.shape == (32, 64, 64) and torch.isfinite(explanation.maps).all()
        assert (explanation.maps.flatten(1).std(dim=1) > 0).all()
        pointing[type(explainer).__name__] = metrics.pointing_game(explanation, masks, tolerance=4).mean().item()
    assert pointing["AttentionRollout"] >= 0.8 and pointing["GradientAttentionRollout"] >= 0.8, pointing
    assert pointing["GradCAM"] >= 0.5, pointing  # 8×8 tokens, the last block: coarser, 0.62 as shipped


def test_training_is_deterministic_and_the_augmentations_keep_shape_and_range():
    first, second = train(samples=96, epochs=1, batch_size=32), train(samples=96, epochs=1, batch_size=32)
    for (name, value), other in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(value, other), name
    images = torch.rand(3, 3, 64, 64)
    generator = torch.Generator().manual_seed(0)
    moved = translate(images, generator, shift=4)
    recoloured = jitter_colours(images, generator)
    assert moved.shape == recoloured.shape == images.shape
    assert 0 <= recoloured.min() and recoloured.max() <= 1
    unmoved = translate(images, torch.Generator().manual_seed(0), shift=0)
    assert torch.equal(unmoved, images)
