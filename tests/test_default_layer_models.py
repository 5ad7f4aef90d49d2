"""The layer chosen when none is given, on the models people use (timm, HuggingFace), built from
configs with random weights (nothing is downloaded), and the model's other inputs honoured when
layers are listed or searched.

Every case checks the chosen layer by name, that Grad-CAM gives one map per image, and that the
map equals Grad-CAM computed by hand at that layer (conftest.gradcam_by_hand).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import timm
import torch
import transformers
from conftest import gradcam_by_hand
from torch import nn

import explain
from explain.core.layers import default_layer

transformers.logging.set_verbosity_error()


def hf_vit(image_size: int = 32) -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=image_size, patch_size=8, num_labels=5))


def hf_deit() -> nn.Module:  # class and distillation tokens
    return transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=5))


def hf_swin() -> nn.Module:  # window 2: attention runs on (N × windows) rows in the early stages
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 2], num_heads=[1, 1, 2, 2],
        window_size=2, num_labels=5))


def hf_swinv2() -> nn.Module:
    return transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 2], num_heads=[1, 1, 2, 2],
        window_size=2, num_labels=5))


def hf_segformer() -> nn.Module:
    return transformers.SegformerForSemanticSegmentation(transformers.SegformerConfig(
        depths=[1, 1, 1, 2], hidden_sizes=[8, 16, 24, 32], num_attention_heads=[1, 1, 2, 2],
        decoder_hidden_size=16, num_labels=3))


def hf_convnext() -> nn.Module:
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 2], num_labels=5))


CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   image_size=32, patch_size=8)


def hf_clip() -> nn.Module:
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=CLIP_VISION, projection_dim=16))


def hf_clip_vision() -> nn.Module:
    return transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(**CLIP_VISION, projection_dim=16))


def timm_model(name: str, **kwargs) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=5, **kwargs)


def timm_levit() -> nn.Module:
    """LeViT at 128 px (its attention biases fix the input size): 8 × 8, 4 × 4 and 2 × 2 tokens."""
    model = timm.create_model("levit_128s", pretrained=False, num_classes=5, img_size=128, embed_dim=(16, 24, 32),
                              key_dim=4, num_heads=(1, 2, 2), depth=(1, 1, 2))
    for module in model.modules():  # timm's std-0.02 init shrinks activations to ~1e-4 by the last stage
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(module.weight, std=module.weight[0].numel() ** -0.5)
    return model


TIMM_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
TEXTS = torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]])  # as many texts as images: the text tower has N rows too
SEGMENT = torch.zeros(16, 16, dtype=torch.bool)  # Segformer's logits are at 1/4 of the input
SEGMENT[4:12, 2:9] = True


@dataclass
class Case:
    """A model, its input size, the layer expected, and how it is explained. grid: (prefix tokens,
    h, w) of the layer's token output, or "channels_first" / "channels_last" for maps."""

    build: Callable[[], nn.Module]
    size: int
    layer: str
    grid: Any
    target: Any = field(default_factory=lambda: [1, 3])
    score: Callable[[Any], torch.Tensor] = lambda output: output.logits[[0, 1], [1, 3]]
    output: Any = None
    forward_kwargs: Optional[dict] = None
    input_position: Any = 0


CASES = {
    "hf-vit": Case(hf_vit, 32, "vit.layers.1.layernorm_before", (1, 4, 4)),
    "hf-deit": Case(hf_deit, 32, "deit.layers.1.layernorm_before", (2, 4, 4)),
    "hf-clip": Case(hf_clip, 32, "vision_model.encoder.layers.1.layer_norm1", (1, 4, 4), target=[0, 1],
                    score=lambda output: output.logits_per_image[[0, 1], [0, 1]], output="logits_per_image",
                    forward_kwargs={"input_ids": TEXTS}, input_position="pixel_values"),
    "hf-clip-vision": Case(hf_clip_vision, 32, "vision_model.encoder.layers.1.layer_norm1", (1, 4, 4),
                           target=lambda embeds: embeds[:, 0] - embeds[:, 1],
                           score=lambda output: output.image_embeds[:, 0] - output.image_embeds[:, 1],
                           output="image_embeds"),
    "hf-swin": Case(hf_swin, 64, "swin.encoder.layers.3.blocks.1.layernorm_before", (0, 2, 2)),
    "hf-swinv2": Case(hf_swinv2, 64, "swinv2.encoder.layers.3.blocks.1.layernorm_before", (0, 2, 2)),
    "hf-segformer": Case(hf_segformer, 64, "segformer.stages.3.blocks.1.layernorm_before", (0, 2, 2),
                         target=explain.SegmentationTarget(1, SEGMENT),
                         score=lambda output: (output.logits[:, 1] * SEGMENT).sum(dim=(1, 2))),
    "hf-convnext": Case(hf_convnext, 64, "convnext.encoder.stages.3", "channels_first"),
    "timm-vit": Case(timm_model("vit_tiny_patch16_224", **TIMM_VIT), 32, "blocks.1.norm1", (1, 4, 4),
                     score=lambda output: output[[0, 1], [1, 3]]),
    "timm-deit": Case(timm_model("deit_tiny_distilled_patch16_224", **TIMM_VIT), 32, "blocks.1.norm1", (2, 4, 4),
                      score=lambda output: output[[0, 1], [1, 3]]),
    "timm-levit": Case(timm_levit, 128, "stages", (0, 2, 2), score=lambda output: output[[0, 1], [1, 3]]),
    "timm-mobilevit": Case(timm_model("mobilevit_xxs"), 64, "final_conv", "channels_first",
                           score=lambda output: output[[0, 1], [1, 3]]),
    "timm-convnext": Case(timm_model("convnext_atto", depths=(1, 1, 1, 2), dims=(8, 16, 24, 32)), 64, "stages",
                          "channels_first", score=lambda output: output[[0, 1], [1, 3]]),
    "timm-resnet": Case(timm_model("resnet10t"), 64, "layer4", "channels_first",
                        score=lambda output: output[[0, 1], [1, 3]]),
}


def to_grid(grid: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's output as (N, C, h, w), written out from the case's grid."""
    if grid == "channels_first":
        return lambda tensor: tensor
    if grid == "channels_last":
        return lambda tensor: tensor.permute(0, 3, 1, 2)
    prefix, height, width = grid
    return lambda tokens: tokens[:, prefix:].reshape(tokens.shape[0], height, width, -1).permute(0, 3, 1, 2)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_automatic_layer_is_the_one_a_practitioner_picks(case: Case):
    torch.manual_seed(0)
    model = case.build().eval()
    x = torch.randn(2, 3, case.size, case.size)
    forward_kwargs = case.forward_kwargs or {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # random weights: some maps may be all zero
        explanation = explain.GradCAM(model, output=case.output, normalize=None).explain(
            x, target=case.target, forward_kwargs=forward_kwargs, input_position=case.input_position)
    assert explanation.layer == case.layer
    assert explanation.maps.shape == (2, case.size, case.size)  # one map per image

    def run(batch: torch.Tensor) -> Any:
        if case.input_position == 0:
            return model(batch, **forward_kwargs)
        return model(**{case.input_position: batch}, **forward_kwargs)

    layer = dict(model.named_modules())[case.layer]
    expected = gradcam_by_hand(run, layer, x, case.score, to_grid(case.grid))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)
    assert expected.abs().sum() > 0


class PatchBlock(nn.Module):
    """A pre-norm residual block, named as timm names them."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.mlp = nn.Linear(channels, channels)

    def forward(self, x):
        return x + self.mlp(self.norm1(x))


class PatchTransformer(nn.Module):
    """MobileViT-like: the transformer blocks run on (N × 4) rows, one per position in 2 × 2 patches."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(PatchBlock(8), PatchBlock(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        features = self.stem(x)  # (N, 8, 8, 8)
        n, c, h, w = features.shape
        patches = features.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1).reshape(n * 4, -1, c)
        return self.head(self.blocks(patches).reshape(n, -1, c).mean(1))


def test_layers_whose_batch_is_not_the_images_are_not_chosen():
    model = PatchTransformer().eval()
    x = torch.randn(1, 3, 16, 16)
    assert default_layer(model, x) == "stem"
    assert explain.GradCAM(model).explain(x).maps.shape == (1, 16, 16)


class PositionMap(nn.Module):
    """A learned (N, C, h, w) map added to the features: spatial, N rows, but the same for every image."""

    def __init__(self):
        super().__init__()
        self.map = nn.Parameter(torch.randn(1, 6, 8, 8))

    def forward(self, features):
        return self.map.expand(features.shape[0], -1, -1, -1)


class ConvWithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.position = PositionMap()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        features = self.conv(x)
        return self.head((features + self.position(features)).mean(dim=(2, 3)))


def test_layers_that_do_not_depend_on_the_image_are_not_chosen():
    x = torch.randn(2, 3, 16, 16)
    assert default_layer(ConvWithPositions().eval(), x) == "conv"
    with pytest.raises(ValueError, match="pass one explicitly"):  # nothing spatial at all
        default_layer(nn.Sequential(nn.Flatten(), nn.Linear(768, 2)), x)


class ImageAndText(nn.Module):
    """Two inputs: an image and per-image text features."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.text = nn.Linear(6, 4)

    def forward(self, image, text):
        return (self.conv(image).mean(dim=(2, 3)) * self.text(text))[:, :3]


class TextThenImage(nn.Module):
    """The same model with the image as the second positional argument."""

    def __init__(self):
        super().__init__()
        self.inner = ImageAndText()

    def forward(self, text, image):
        return self.inner(image, text)


def shapes(infos: list) -> dict:
    return {info.name: info.output_shapes for info in infos}


def test_list_layers_and_the_automatic_layer_run_the_model_with_its_other_inputs():
    model, x, text = ImageAndText().eval(), torch.randn(2, 3, 8, 8), torch.randn(2, 6)
    listed = shapes(explain.list_layers(model, (3, 8, 8), 2, forward_args=(text,)))
    assert listed["conv"] == [(2, 4, 8, 8)] and listed["text"] == [(2, 4)]
    assert shapes(explain.list_layers(model, example=x[:1], forward_args=(text[:1],)))["conv"] == [(1, 4, 8, 8)]
    assert shapes(explain.list_layers(model, example=x, forward_kwargs={"text": text},
                                      input_position="image"))["conv"] == [(2, 4, 8, 8)]
    swapped = TextThenImage().eval()
    assert shapes(explain.list_layers(swapped, example=x, forward_args=(text,),
                                      input_position=1))["inner.conv"] == [(2, 4, 8, 8)]
    explanation = explain.GradCAM(swapped).explain(x, forward_args=(text,), input_position=1)
    assert explanation.layer == "inner.conv" and explanation.maps.shape == (2, 8, 8)


def test_clip_layers_listed_with_its_texts():
    model = hf_clip().eval()
    x, texts = torch.randn(2, 3, 32, 32), torch.tensor([[1, 5, 2], [1, 6, 2], [1, 7, 2]])
    infos = {info.name: info for info in explain.list_layers(
        model, example=x, forward_kwargs={"input_ids": texts}, input_position="pixel_values")}
    assert infos["vision_model.encoder.layers.1.layer_norm1"].output_shapes == [(2, 17, 32)]
    assert infos["text_model.encoder.layers.1.layer_norm1"].output_shapes == [(3, 3, 32)]
    explanation = explain.GradCAM(model, output="logits_per_image").explain(
        x, target=[2, 0], forward_kwargs={"input_ids": texts}, input_position="pixel_values")
    assert explanation.layer == "vision_model.encoder.layers.1.layer_norm1"
    assert explanation.maps.shape == (2, 32, 32)


def test_vit_at_another_size_with_interpolated_position_embeddings():
    torch.manual_seed(0)
    model = hf_vit(image_size=32).eval()
    x = torch.randn(2, 3, 48, 48)  # 6 × 6 patches instead of 4 × 4
    interpolate = {"interpolate_pos_encoding": True}
    infos = {info.name: info for info in explain.list_layers(model, example=x, forward_kwargs=interpolate)}
    assert infos["vit.layers.1.layernorm_before"].output_shapes == [(2, 37, 32)]
    explanation = explain.GradCAM(model, normalize=None).explain(x, target=[1, 3], forward_kwargs=interpolate)
    assert explanation.layer == "vit.layers.1.layernorm_before"
    layer = model.vit.layers[1].layernorm_before
    expected = gradcam_by_hand(lambda batch: model(batch, **interpolate), layer, x,
                               lambda output: output.logits[[0, 1], [1, 3]], to_grid((1, 6, 6)))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_a_model_missing_its_other_inputs_gives_a_clear_error():
    model, x = ImageAndText().eval(), torch.randn(2, 3, 8, 8)
    with pytest.raises(explain.ModelInputError, match="forward_args"):
        explain.list_layers(model, (3, 8, 8))
    with pytest.raises(explain.ModelInputError, match="forward_args"):
        default_layer(model, x)
    with pytest.raises(explain.ModelInputError, match="forward_args"):
        explain.GradCAM(model).explain(x)
    with pytest.raises(explain.ModelInputError, match="input_ids"):  # CLIP without its texts
        explain.list_layers(hf_clip().eval(), example=torch.randn(1, 3, 32, 32), input_position="pixel_values")
    with pytest.raises(explain.ModelInputError, match=r"48\*48.*forward_kwargs"):  # the model's reason, and ours
        explain.list_layers(hf_vit().eval(), example=torch.randn(1, 3, 48, 48))
