"""Models whose output is not a plain tensor, built-in targets, and mixed precision."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import ConvGapLinear, class_scores, gradcam_by_hand
from torch import nn

import explain


def test_deeplabv3_with_a_segmentation_target():
    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4, aux_loss=False).eval()
    x = torch.randn(2, 3, 64, 64)
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[10:40, 20:50] = True
    explanation = explain.GradCAM(model, "backbone.16", normalize=None).explain(
        x, target=explain.SegmentationTarget(2, mask))
    assert explanation.targets is None and explanation.scores.shape == (2, 1)
    expected = gradcam_by_hand(model, model.backbone["16"], x, lambda out: (out["out"][:, 2] * mask).sum(dim=(1, 2)))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        logits = model(x)["out"]
    predicted = explain.SegmentationTarget(1)(logits)  # no mask: the pixels predicted as class 1
    torch.testing.assert_close(predicted, (logits[:, 1] * (logits.argmax(1) == 1)).sum(dim=(1, 2)))


@dataclass
class ModelOutput:
    """Shaped like a HuggingFace output object."""

    logits: torch.Tensor
    hidden_states: tuple = ()


class HuggingFaceStyle(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values):
        return ModelOutput(logits=self.inner(pixel_values), hidden_states=(pixel_values,))


class TupleOutput(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x), x.mean()


class TwoHeads(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        logits = self.inner(x)
        return {"species": logits, "colour": -logits}


def test_outputs_that_are_not_a_plain_tensor():
    torch.manual_seed(0)
    inner = ConvGapLinear().eval()
    x = torch.randn(2, 3, 8, 8)
    plain = explain.GradCAM(inner, "conv", normalize=None).explain(x, target=[0, 2]).raw_maps
    for wrapper in (HuggingFaceStyle, TupleOutput):
        model = wrapper(inner).eval()
        result = explain.GradCAM(model, "inner.conv", normalize=None).explain(x, target=[0, 2])
        torch.testing.assert_close(result.raw_maps, plain)
    heads = TwoHeads(inner).eval()
    with pytest.raises(ValueError, match="keys \\['species', 'colour'\\].*output=KEY"):
        explain.GradCAM(heads, "inner.conv").explain(x)
    colour = explain.GradCAM(heads, "inner.conv", normalize=None, relu=False, output="colour").explain(x, target=[0, 2])
    torch.testing.assert_close(colour.raw_maps, -explain.GradCAM(inner, "conv", normalize=None, relu=False).explain(
        x, target=[0, 2]).raw_maps)
    by_callable = explain.Saliency(heads, output=lambda out: out["species"]).explain(x, target=[0, 2])
    torch.testing.assert_close(by_callable.maps, explain.Saliency(inner).explain(x, target=[0, 2]).maps)


def test_embedding_similarity_target():
    torch.manual_seed(0)
    embedder = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    reference = torch.randn(5)
    result = explain.GradCAM(embedder, "0", normalize=None).explain(x, target=explain.EmbeddingSimilarity(reference))
    expected = gradcam_by_hand(embedder, embedder[0], x, lambda out: F.cosine_similarity(out, reference[None], dim=1))
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(result.scores[:, 0], F.cosine_similarity(embedder(x), reference[None], dim=1))


def test_maps_under_bf16_autocast_on_cpu_match_float32_and_are_float32():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    reference = explain.GradCAM(model, "layer4").explain(x, target=[1, 2]).maps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = explain.GradCAM(model, "layer4").explain(x, target=[1, 2])
    assert mixed.maps.dtype == torch.float32 and mixed.scores.dtype == torch.float32
    assert (mixed.maps - reference).abs().max() < 0.1  # bf16 keeps about 3 significant digits
    assert torch.corrcoef(torch.stack([mixed.maps.flatten(), reference.flatten()]))[0, 1] > 0.99


class TwoInputs(nn.Module):
    """An image and a per-image conditioning vector that scales the feature maps."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, condition, image, *, offset=0.0):
        features = torch.relu(self.conv(image) * condition[:, :, None, None] + offset)
        return self.fc(features.mean(dim=(2, 3)))


class Conditioned(nn.Module):
    """The same network with one image's condition fixed, as a one-input model (for reference)."""

    def __init__(self, two_inputs, condition, offset):
        super().__init__()
        self.two_inputs, self.condition, self.offset = two_inputs, condition, offset

    def forward(self, image):
        return self.two_inputs(self.condition.expand(len(image), -1), image, offset=self.offset)


@pytest.mark.parametrize("name", ["gradcam", "scorecam", "ablationcam", "saliency", "integratedgradients",
                                  "guidedgradcam", "smoothgrad"])
def test_a_model_with_several_inputs(name):
    torch.manual_seed(0)
    model = TwoInputs().eval()
    images, conditions = torch.randn(2, 3, 8, 8), torch.rand(2, 4) + 0.5
    cls = explain.get_method(name)

    def build(target_model, layer):
        options = {"progress": False} if name in ("scorecam", "ablationcam") else {}
        if name == "smoothgrad":  # its noise depends on the batch: without noise it must match per image
            options = {"noise": 0.0, "samples": 2}
        return cls(target_model, layer, **options) if cls.needs_layer else cls(target_model, **options)

    with warnings.catch_warnings():  # Ablation-CAM cannot replay the tail here: the condition multiplies it
        warnings.simplefilter("ignore", RuntimeWarning)
        result = build(model, "conv").explain(images, target=[0, 2], forward_args=(conditions,),
                                              input_position=1, forward_kwargs={"offset": 0.1}, per_image=[0])
    for i in range(2):  # each image alone, through a one-input model with its condition baked in
        alone = build(Conditioned(model, conditions[i : i + 1], 0.1), "two_inputs.conv").explain(
            images[i : i + 1], target=[0, 2][i])
        torch.testing.assert_close(result.maps[i : i + 1], alone.maps, rtol=1e-4, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        keyword = build(model, "conv").explain(images, target=[0, 2], input_position="image",
                                               forward_kwargs={"condition": conditions, "offset": 0.1},
                                               per_image=["condition"])
    torch.testing.assert_close(keyword.maps, result.maps)


def test_fasterrcnn_with_a_detection_target():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=5, min_size=128, max_size=160, box_score_thresh=0.0,
        rpn_post_nms_top_n_test=100, box_detections_per_img=20).eval()
    x = torch.rand(2, 3, 128, 128)
    box = [20.0, 30.0, 90.0, 100.0]
    explanation = explain.GradCAM(model, "backbone.body.16", normalize=None).explain(
        x, target=explain.DetectionTarget(box, class_index=1))

    def best_match_score(output):  # by hand: the class-1 box with the highest IoU, image by image
        scores = []
        for detections in output:
            keep = detections["labels"] == 1
            overlaps = torchvision.ops.box_iou(torch.tensor([box]), detections["boxes"][keep])[0]
            scores.append(detections["scores"][keep][overlaps.argmax()])
        return torch.stack(scores)

    expected = gradcam_by_hand(model, model.backbone.body["16"], x, best_match_score)
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-7)
    assert explanation.raw_maps.abs().sum() > 0
    none = explain.DetectionTarget(box, class_index=4, min_iou=1.1)  # nothing can match
    assert explain.GradCAM(model, "backbone.body.16").explain(x, target=none).maps.abs().max() == 0


def test_a_bfloat16_model_gives_float32_maps_close_to_float32():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    low = torchvision.models.resnet18(num_classes=5).eval()
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    x = torch.randn(2, 3, 64, 64)
    reference = explain.GradCAM(model, "layer4").explain(x, target=[1, 2]).maps
    result = explain.GradCAM(low, "layer4").explain(x, target=[1, 2])  # the input is cast to the model's dtype
    assert result.maps.dtype == torch.float32 and (result.maps - reference).abs().max() < 0.1
    assert next(low.parameters()).dtype == torch.bfloat16


def test_a_timm_vision_transformer_when_timm_is_installed():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=96, num_classes=5).eval()
    torch.nn.init.normal_(vit.head.weight, std=0.5)
    x = torch.randn(2, 3, 96, 96)
    explanation = explain.GradCAM(vit, normalize=None).explain(x, target=[1, 3])
    assert explanation.layer == "blocks.11.norm1"

    def to_grid(tokens):  # by hand for this model: 1 class token, then 6 × 6 patches of 16 px
        return tokens[:, 1:].reshape(2, 6, 6, -1).permute(0, 3, 1, 2)

    expected = gradcam_by_hand(vit, vit.blocks[11].norm1, x, class_scores([1, 3]), to_grid)
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_convnext_tiny_at_its_automatic_layer():
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(num_classes=6).eval()
    x = torch.randn(2, 3, 64, 64)
    explanation = explain.GradCAM(model, normalize=None).explain(x, target=[0, 5])
    assert explanation.layer == "features"
    expected = gradcam_by_hand(model, model.features, x, class_scores([0, 5]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-7)
    assert expected.abs().sum() > 0
