"""Segmentation targets against by-hand sums and autograd: masks of every kind (and the bad ones), copies of the
images (Integrated Gradients, Score-CAM), output selectors, SegFormer's 1/4-resolution logits, caller contexts."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn

import explain
from explain import SegmentationTarget, select_output


class TinyFCN(nn.Module):
    """conv → ReLU → 1 × 1 head, and a separate auxiliary head, as torchvision's {"out", "aux"}."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Conv2d(6, classes, 1)
        self.aux = nn.Conv2d(3, classes, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.head(self.relu(self.conv(x))), "aux": self.aux(x)}


def tiny() -> tuple[TinyFCN, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyFCN().eval()
    x = torch.randn(2, 3, 16, 16)
    mask = torch.zeros(16, 16, dtype=torch.bool)
    mask[2:9, 4:12] = True
    return model, x, mask


def input_gradient(score_of, x: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(score_of(leaf).sum(), leaf)
    return gradient


def quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


# ---------------------------------------------------------------- masks: the score is the by-hand sum, or refused


def test_bool_uint8_float_and_per_image_masks_give_the_by_hand_sum():
    model, x, mask = tiny()
    with torch.no_grad():
        logits = model(x)["out"]
    by_hand = (logits[:, 1] * mask).sum(dim=(1, 2))
    for given in (mask, mask.to(torch.uint8), mask.long(), mask.float(), mask.numpy(), mask.tolist()):
        torch.testing.assert_close(SegmentationTarget(1, given)(logits), by_hand)
    per_image = torch.stack([mask, ~mask])
    torch.testing.assert_close(SegmentationTarget(1, per_image)(logits),
                               torch.stack([(logits[0, 1] * mask).sum(), (logits[1, 1] * ~mask).sum()]))
    soft = torch.linspace(0, 1, 256).reshape(16, 16)  # weights in [0, 1]
    torch.testing.assert_close(SegmentationTarget(2, soft)(logits), (logits[:, 2] * soft).sum(dim=(1, 2)))


@pytest.mark.parametrize("mask, words", [
    (torch.ones(16, 16, dtype=torch.uint8) * 255, "mask > 0"),     # an image mask saved as 0/255: was 255 × the sum
    (torch.arange(256).reshape(16, 16) % 3, "labels == CLASS"),     # a label map: was weighted by the class ids
    (torch.full((16, 16), 2.0), "weights in [0, 1]"),
    (torch.full((16, 16), float("nan")), "NaN"),                    # was a NaN score, blamed on the model
])
def test_masks_that_are_not_0_1_are_refused(mask, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SegmentationTarget(1, mask)(torch.randn(1, 3, 16, 16))


def test_a_mask_with_a_channel_dimension_is_refused_not_read_as_many_targets():
    logits = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"mask\[:, 0\]"):  # was (N, W) scores: 16 targets per image
        SegmentationTarget(1, torch.ones(2, 1, 16, 16))(logits)


def test_as_many_masks_as_images_or_a_clear_error():
    with pytest.raises(ValueError, match="holds 3 masks, for a batch of 2 images"):  # was a broadcasting error
        SegmentationTarget(1, torch.ones(3, 16, 16, dtype=torch.bool))(torch.randn(2, 3, 16, 16))


@pytest.mark.parametrize("class_index", [1.7, True, "cat"])
def test_a_class_that_is_not_an_int_is_refused(class_index):
    with pytest.raises(TypeError, match="must be an int"):  # 1.7 and True were read as class 1
        SegmentationTarget(class_index, torch.ones(16, 16))


def test_class_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        SegmentationTarget(3)(torch.randn(1, 3, 8, 8))


def test_float16_logits_are_summed_without_overflow():
    logits = torch.full((1, 3, 64, 64), 20.0, dtype=torch.float16)  # 64 · 64 · 20 = 81920 > 65504
    score = SegmentationTarget(1, torch.ones(64, 64))(logits)  # was inf: "the score is not finite"
    assert score.dtype == torch.float32 and score.item() == 81920.0


def test_a_float_mask_made_in_inference_mode_works_outside_it():
    model, x, mask = tiny()
    with torch.inference_mode():
        made = mask.float()
    explanation = explain.Saliency(model, normalize=None).explain(x, target=SegmentationTarget(1, made))
    gradient = input_gradient(lambda leaf: (model(leaf)["out"][:, 1] * mask).sum(dim=(1, 2)), x)
    torch.testing.assert_close(explanation.raw_maps, gradient.abs().amax(dim=1))


# ---------------------------------------------------------------- methods that score copies of the images


def test_integrated_gradients_keeps_the_predicted_pixels_of_the_image_along_the_path():
    model, x, _ = tiny()
    with torch.no_grad():
        logits, at_baseline = model(x)["out"], model(torch.zeros_like(x))["out"]
    cls = int(logits.argmax(1).flatten().mode().values)
    region = logits.argmax(1) == cls
    by_hand = (logits[:, cls] * region).sum(dim=(1, 2)) - (at_baseline[:, cls] * region).sum(dim=(1, 2))
    explanation = explain.IntegratedGradients(model, steps=64, normalize=None).explain(
        x, target=SegmentationTarget(cls))
    # was y(x) over x's predicted pixels − y(x') over the baseline's own: attributions missing 50 % of it
    torch.testing.assert_close(explanation.diagnostics["score_change"][:, 0], by_hand, rtol=1e-4, atol=1e-4)
    assert explanation.diagnostics["completeness_error"].abs().max() < 0.01 * by_hand.abs().min()


def test_per_image_masks_with_methods_that_score_copies():
    model, x, mask = tiny()
    masks = torch.stack([mask, ~mask])
    for method in (lambda: explain.IntegratedGradients(model, steps=8, normalize=None),
                   lambda: explain.ScoreCAM(model, "relu", normalize=None)):
        together = quiet(method().explain, x, target=SegmentationTarget(1, masks))  # was a broadcasting error
        for n in range(2):
            alone = quiet(method().explain, x[n : n + 1], target=SegmentationTarget(1, masks[n]))
            torch.testing.assert_close(together.raw_maps[n], alone.raw_maps[0], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- output selectors


def test_output_selectors_that_pick_nothing_say_so():
    output = {"out": torch.randn(1, 3, 8, 8), "aux": torch.randn(1, 3, 8, 8)}
    with pytest.raises(ValueError, match="without key 0"):  # was KeyError: 0
        select_output(output, 0)
    with pytest.raises(ValueError, match="out of range"):  # was IndexError
        select_output((output["out"],), 3)
    with pytest.raises(ValueError, match="model returns a tensor"):  # was image 0 of the batch, silently
        select_output(output["out"], 0)
    with pytest.raises(ValueError, match="no key or attribute 'values'"):  # was the dict's .values method
        select_output(output, "values")
    assert select_output(output, "aux") is output["aux"] and select_output((output["out"],), -1) is output["out"]


def test_the_aux_head_when_asked_for_and_out_otherwise():
    model, x, mask = tiny()
    for key in ("out", "aux"):
        explanation = explain.Saliency(model, normalize=None, output=key if key == "aux" else None).explain(
            x, target=SegmentationTarget(0, mask))
        gradient = input_gradient(lambda leaf, key=key: (model(leaf)[key][:, 0] * mask).sum(dim=(1, 2)), x)
        torch.testing.assert_close(explanation.raw_maps, gradient.abs().amax(dim=1))
        torch.testing.assert_close(explanation.scores[:, 0], (model(x)[key][:, 0] * mask).sum(dim=(1, 2)).detach())


# ---------------------------------------------------------------- models


def tiny_segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 1], mlp_ratios=[2, 2],
                             decoder_hidden_size=16, num_labels=3)
    return SegformerForSemanticSegmentation(config).eval()


def test_segformer_quarter_resolution_logits():
    model = tiny_segformer()
    x = torch.randn(2, 3, 64, 64)
    at_input = torch.zeros(64, 64)
    at_input[8:40, 16:48] = 1
    with pytest.raises(ValueError, match=r"logits are \(16, 16\).*interpolate"):  # said how to fix it
        explain.Saliency(model).explain(x, target=SegmentationTarget(1, at_input))
    mask = torch.nn.functional.interpolate(at_input[None, None], size=(16, 16), mode="area")[0, 0]  # as advised
    explanation = explain.Saliency(model, normalize=None).explain(x, target=SegmentationTarget(1, mask))
    gradient = input_gradient(lambda leaf: (model(pixel_values=leaf).logits[:, 1] * mask).sum(dim=(1, 2)), x)
    torch.testing.assert_close(explanation.raw_maps, gradient.abs().amax(dim=1), rtol=1e-4, atol=1e-7)


def test_lraspp_gradients_equal_autograd_under_inference_mode():
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4).eval()
    model.backbone.requires_grad_(False)  # a frozen backbone: left frozen
    frozen = [p.requires_grad for p in model.parameters()]
    x = torch.randn(1, 3, 32, 32)
    mask = torch.zeros(32, 32, dtype=torch.bool)
    mask[5:20, 10:25] = True
    with torch.enable_grad():
        gradient = input_gradient(lambda leaf: (model(leaf)["out"][:, 2] * mask).sum(dim=(1, 2)), x)
    with torch.inference_mode():
        explanation = explain.Saliency(model, normalize=None).explain(x, target=SegmentationTarget(2, mask))
    torch.testing.assert_close(explanation.raw_maps, gradient.abs().amax(dim=1), rtol=1e-4, atol=1e-6)
    assert [p.requires_grad for p in model.parameters()] == frozen and not model.training
    assert not any(module._forward_hooks or module._backward_hooks or module._forward_pre_hooks
                   for module in model.modules())


def test_seg_eigen_cam_is_the_signed_first_component_of_abs_gradient_times_activation():
    model, x, mask = tiny()
    target = SegmentationTarget(1, mask)
    activations = model.relu(model.conv(x)).detach().requires_grad_(True)
    (gradients,) = torch.autograd.grad(target(model.head(activations)).sum(), activations)
    terms = (gradients.abs() * activations).detach().double()
    expected = []
    for image in terms:
        samples = image.reshape(6, -1).T
        samples = samples - samples.mean(dim=0)
        projection = samples @ torch.linalg.svd(samples, full_matrices=False).Vh[0]
        signed = -projection if projection.min().abs() > projection.max().abs() else projection
        expected.append(signed.reshape(16, 16))
    for context in (torch.enable_grad, torch.no_grad):
        with context():
            explanation = explain.SegEigenCAM(model, "relu", relu=False, normalize=None).explain(x, target=target)
        torch.testing.assert_close(explanation.raw_maps.double(), torch.stack(expected), rtol=1e-4, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = explain.SegEigenCAM(model, "relu", relu=False, normalize=None).explain(x, target=target)
    assert low.raw_maps.dtype == torch.float32
    assert (low.raw_maps.double() - torch.stack(expected)).abs().max() <= 0.02 * torch.stack(expected).abs().max()


def test_an_empty_mask_gives_a_zero_map_and_says_why():
    model, x, _ = tiny()
    with pytest.warns(RuntimeWarning, match="selects no pixel"):
        explanation = explain.GradCAM(model, "relu", normalize=None).explain(
            x, target=SegmentationTarget(1, torch.zeros(16, 16)))
    assert explanation.scores.eq(0).all() and explanation.raw_maps.eq(0).all()
