"""Issue 26, items 11, 21 and 22: what a result says and how it is shown.

11: a region target (segmentation pixels, a detection box) whose region is empty warns that the
region is empty, not that the gradient vanished. 21: figure normalisation per method, cheap
defaults for compare(), method_options passed by signature, figures that a notebook shows by
themselves, Explanation indexing. 22: class names as targets, uint8 tensors as images.
"""

from __future__ import annotations

import warnings

import matplotlib
import numpy as np
import pytest
import torch
import torchvision
from conftest import ConvGapLinear, SmallCNN, assert_state_equal, gradcam_by_hand, model_state
from PIL import Image
from torch import nn

import explain
from explain.core.targets import class_index, class_indices_for_names, model_class_names
from explain.io import render
from explain.methods.compare import CHEAP_METHODS

matplotlib.use("Agg")


def caught(function, *args, **kwargs):
    """(result, [RuntimeWarning messages]) of a call."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = function(*args, **kwargs)
    return result, [str(record.message) for record in records if issubclass(record.category, RuntimeWarning)]


# ------------------------------------------------------------------ 11. an empty target region


class PixelClassifier(nn.Module):
    """(N, 3, H, W) → (N, 3, H, W) logits: class 0 = 0.5, class 1 = 1 − x₀, class 2 = 4·x₀ − 1.
    A pixel is class 2 where x₀ > 0.4; an image whose channel 0 is 0 has no class-2 pixel."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.weight[1, 0], self.conv.weight[2, 0] = -1.0, 4.0
            self.conv.bias.copy_(torch.tensor([0.5, 1.0, -1.0]))

    def forward(self, x):
        return self.conv(x)


def two_images() -> torch.Tensor:
    x = torch.zeros(2, 3, 8, 8, dtype=torch.float64)
    x[1, 0, 2:5, 3:6] = 1.0  # image 1: class 2 is predicted on a 3 × 3 patch; image 0: nowhere
    return x


def test_a_segmentation_class_predicted_nowhere_is_blamed_on_the_empty_region_not_the_gradient():
    model = PixelClassifier().double().eval()
    x = two_images()
    before = model_state(model)
    explanation, messages = caught(explain.Saliency(model, normalize=None).explain, x,
                                   target=explain.SegmentationTarget(2))
    assert_state_equal(before, model_state(model))
    # by hand: ∂/∂x of Σ over the class-2 pixels of (4·x₀ − 1) is 4 on those pixels of channel 0 (max over channels)
    expected = torch.zeros(2, 8, 8, dtype=torch.float64)
    expected[1, 2:5, 3:6] = 4.0
    torch.testing.assert_close(explanation.raw_maps.double(), expected)
    assert len(messages) == 1
    message = messages[0]
    assert "(0, 0)" in message and "(1, 0)" not in message  # image 0 only: image 1's region is not empty
    assert "region is empty" in message and "no pixel is predicted as class 2" in message
    assert "Choose a class that the model predicts" in message and "mask=" in message
    assert "vanishes" not in message and "zero-initialised" not in message


def test_an_empty_mask_and_a_cam_method_on_a_torchvision_segmentation_model():
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        predicted = model(x)["out"].argmax(1)
    absent = next(c for c in range(3) if not (predicted == c).any())  # random weights: one class wins everywhere
    _, messages = caught(explain.GradCAM(model, "backbone.16").explain, x, target=explain.SegmentationTarget(absent))
    assert len(messages) == 1 and "(0, 0), (1, 0)" in messages[0]
    assert f"no pixel is predicted as class {absent}" in messages[0] and "vanishes" not in messages[0]
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    mask[1, 10:20, 10:20] = True  # image 0's mask is empty
    explanation, messages = caught(explain.GradCAM(model, "backbone.16", normalize=None).explain, x,
                                   target=explain.SegmentationTarget(int(predicted[1, 15, 15]), mask))
    assert len(messages) == 1 and "(0, 0)" in messages[0] and "(1, 0)" not in messages[0]
    assert "mask given to SegmentationTarget" in messages[0] and "selects no pixel" in messages[0]
    assert explanation.raw_maps[0].abs().max() == 0 and explanation.raw_maps[1].abs().max() > 0


class BoxDetector(nn.Module):
    """A torchvision-style detector: two fixed boxes per image, classes 1 and 2, scored by a conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        scores = self.conv(x).mean(dim=(2, 3)).sigmoid()  # (N, 2)
        boxes = torch.tensor([[0.0, 0.0, 8.0, 8.0], [8.0, 8.0, 16.0, 16.0]])
        return [{"boxes": boxes, "labels": torch.tensor([1, 2]), "scores": row} for row in scores]


def test_a_detection_target_matching_no_box_says_so():
    torch.manual_seed(0)
    model = BoxDetector().eval()
    x = torch.rand(2, 3, 16, 16)
    found, messages = caught(explain.Saliency(model).explain, x, target=explain.DetectionTarget([0, 0, 8, 8], 1))
    assert messages == [] and found.raw_maps.abs().amax(dim=(1, 2)).min() > 0
    boxes = torch.tensor([[0.0, 0.0, 8.0, 8.0], [0.0, 0.0, 8.0, 8.0]])
    explanation, messages = caught(explain.Saliency(model).explain, x, target=explain.DetectionTarget(boxes, 2))
    assert explanation.maps.abs().max() == 0
    assert len(messages) == 1 and "(0, 0), (1, 0)" in messages[0]
    assert "no predicted box of class 2 overlaps the box" in messages[0] and "lower min_iou" in messages[0]
    assert "vanishes" not in messages[0]


# ------------------------------------------------------------------ 21. figures, compare(), indexing


def panel_pixels(fig, row: int, column: int, columns: int) -> np.ndarray:
    return np.asarray(fig.axes[row * columns + column].get_images()[0].get_array())


def test_method_normalisation_keeps_every_method_visible_on_its_own_scale():
    torch.manual_seed(0)
    model = ConvGapLinear(channels=6, classes=3).eval()
    images = torch.rand(2, 3, 12, 12)
    small = explain.Saliency(model).explain(images, target=0)
    large = explain.GradCAM(model, "conv", relu=False).explain(images, target=0)
    large.raw_map_grid = large.raw_map_grid * 1e4  # a raw scale 10⁴ times the other method's
    for normalize in ("row", "method"):
        fig = explain.figure([small, large], normalize=normalize, signed=False)
        for explanation, column in ((small, 1), (large, 2)):
            scale = float(explanation.raw_map_grid[:, 0].abs().max())  # the method's largest value, both images
            for image in range(2):
                values = (explanation.raw_map_grid[image, 0].clamp_min(0) / scale).clamp(0, 1)
                expected = render.overlay(explanation.images[image], values, alpha=0.5, cmap="jet")
                np.testing.assert_array_equal(panel_pixels(fig, image, column, 3), expected)
        small_panel = panel_pixels(fig, 0, 1, 3).astype(int) - (small.images[0].numpy() * 255).round()
        assert np.abs(small_panel).max() > 30  # not blanked by the other method's scale


def test_compare_defaults_cost_a_forward_and_a_backward_pass_per_image():
    model = SmallCNN().eval()
    rows: list[int] = []
    handle = model.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[0]))
    images = torch.rand(2, 3, 16, 16)
    try:
        _, explanations = explain.compare(model, images)
        for name in CHEAP_METHODS:
            rows.clear()
            cls = explain.get_method(name)
            (cls(model, None) if cls.needs_layer else cls(model)).explain(images)
            assert sum(rows) <= 3 * len(images), f"{name} ran the model on {sum(rows)} rows for 2 images"
    finally:
        handle.remove()
    assert [e.method for e in explanations] == [explain.get_method(name).__name__ for name in CHEAP_METHODS]


def test_method_options_go_to_the_methods_that_take_them():
    torch.manual_seed(0)
    model = ConvGapLinear(channels=4, classes=3).eval()
    images = torch.rand(2, 3, 10, 10)
    names = ["ant", "bee", "cat"]
    fig, (cam, ig) = explain.compare(model, images, methods=("gradcam", "integratedgradients"), layer="conv",
                                     target=1, method_options={"steps": 3, "relu": False, "class_names": names})
    alone_cam = explain.GradCAM(model, "conv", relu=False).explain(images, target=1)
    alone_ig = explain.IntegratedGradients(model, steps=3).explain(images, target=1)
    torch.testing.assert_close(cam.raw_maps, alone_cam.raw_maps)
    torch.testing.assert_close(ig.raw_maps, alone_ig.raw_maps)
    assert cam.class_names == names and ig.class_names == names and "bee" in cam.title(0)
    with pytest.raises(ValueError, match=r"\['stepz'\] is taken by none of the methods.*Did you mean 'steps'"):
        explain.compare(model, images, methods=("gradcam", "integratedgradients"), layer="conv",
                        method_options={"stepz": 3})


def test_figures_show_in_a_notebook_by_themselves():
    from IPython.core.formatters import DisplayFormatter

    model = ConvGapLinear().eval()
    images = torch.rand(2, 3, 10, 10)
    formats = DisplayFormatter().format  # what a Jupyter kernel sends for a cell's result, without %matplotlib
    explanation = explain.GradCAM(model, "conv").explain(images)
    for result in (explain.figure([explanation]), explanation.figure()):
        data, _ = formats(result)
        assert data["image/png"].startswith(b"\x89PNG"), type(result)
    data, _ = formats(explanation)
    assert 'src="data:image/png;base64,' in data["text/html"] and "image/png" not in data  # the figure once
    comparison = explain.compare(model, images, methods=("gradcam", "saliency"), layer="conv")
    for result in (comparison, comparison[0]):
        data, _ = formats(result)
        assert data["image/png"].startswith(b"\x89PNG"), type(result)
    figure, explanations = comparison  # still unpacks as before
    assert figure is comparison.figure and explanations is comparison.explanations


def test_an_explanation_is_indexed_by_image_and_every_field_follows():
    torch.manual_seed(0)
    model = ConvGapLinear(channels=4, classes=5).eval()
    pixels = list(np.random.default_rng(0).integers(0, 256, size=(4, 10, 10, 3), dtype=np.uint8))
    for method, images in ((explain.IntegratedGradients(model, steps=4), torch.rand(4, 3, 10, 10)),
                           (explain.GradCAM(model, "conv"), pixels)):
        whole = method.explain(images, topk=2)
        assert len(whole) == 4
        cases = ((1, [1]), (-1, [3]), (slice(1, 3), [1, 2]), ([3, 0], [3, 0]), (slice(None, None, -2), [3, 1]),
                 (torch.tensor([True, False, False, True]), [0, 3]))
        for index, rows in cases:
            part = whole[index]
            alone = method.explain([images[row] for row in rows], topk=2)
            assert len(part) == len(rows)
            torch.testing.assert_close(part.maps, alone.maps)
            torch.testing.assert_close(part.raw_maps, alone.raw_maps)
            torch.testing.assert_close(part.scores, alone.scores)
            torch.testing.assert_close(part.images, alone.images)
            assert torch.equal(part.targets, alone.targets) and part.keep_target_dim
            torch.testing.assert_close(part.probabilities, alone.probabilities)
            for name, value in alone.diagnostics.items():
                torch.testing.assert_close(part.diagnostics[name], value)
            if alone.attributions is not None:
                torch.testing.assert_close(part.attributions, alone.attributions)
            if alone.low_res_maps is not None:
                torch.testing.assert_close(part.low_res_maps[0], alone.low_res_maps[0])
        assert [float(one.scores[0, 0]) for one in whole] == whole.scores[:, 0].tolist()
        with pytest.raises(IndexError, match="out of range for an explanation of 4 images"):
            whole[4]
        with pytest.raises(TypeError, match="indexed by image only"):
            whole[0, 1]


# ------------------------------------------------------------------ 22. class names, uint8 tensors


IMAGENET_LIKE = ["tench, Tinca tinca", "tabby, tabby cat", "crane", "tiger cat", "crane"]


def test_class_names_become_indices_with_did_you_mean_and_clear_errors():
    assert class_index("tabby", IMAGENET_LIKE) == 1 and class_index("Tabby Cat", IMAGENET_LIKE) == 1
    assert class_index("tiger cat", IMAGENET_LIKE) == 3 and class_index("TENCH", IMAGENET_LIKE) == 0
    assert class_indices_for_names(["tabby", 3], IMAGENET_LIKE) == [1, 3]
    assert class_indices_for_names([["tabby", "tench"], [0, "tiger cat"]], IMAGENET_LIKE) == [[1, 0], [0, 3]]
    assert class_indices_for_names(np.array(["tabby", "tench"]), IMAGENET_LIKE) == [1, 0]
    assert class_indices_for_names([2, 0], None) == [2, 0]
    with pytest.raises(ValueError, match="no class is called 'tabbby'.*Did you mean 'tabby, tabby cat'"):
        class_index("tabbby", IMAGENET_LIKE)
    with pytest.raises(ValueError, match=r"matches 2 classes: 2 \('crane'\), 4 \('crane'\). Give the index"):
        class_index("crane", IMAGENET_LIKE)
    with pytest.raises(ValueError, match="class names are not known: pass class_names= to the explainer"):
        class_indices_for_names("tabby", None)


def test_a_class_name_target_explains_that_class():
    torch.manual_seed(0)
    model = ConvGapLinear(classes=5).eval()
    x = torch.rand(2, 3, 8, 8)
    names = ["tench", "tabby, tabby cat", "crane", "tiger cat", "goldfish"]
    explainer = explain.GradCAM(model, "conv", class_names=names, normalize=None)
    by_name = explainer.explain(x, target="tabby")
    by_name_each = explainer.explain(x, target=["tiger cat", "goldfish"])
    torch.testing.assert_close(by_name.raw_maps, gradcam_by_hand(model, model.conv, x, lambda out: out[:, 1]))
    assert by_name.targets.tolist() == [1, 1] and by_name_each.targets.tolist() == [3, 4]
    with pytest.raises(ValueError, match="Did you mean 'tiger cat'"):
        explainer.explain(x, target="tiger kat")
    with pytest.raises(ValueError, match="class_names="):
        explain.Saliency(model).explain(x, target="tabby")


def test_the_models_own_class_names_are_used():
    import timm
    import transformers

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3,
                                    id2label={0: "ant", 1: "bee", 2: "cat"}, label2id={"ant": 0, "bee": 1, "cat": 2})
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(config).eval()
    assert model_class_names(vit) == ["ant", "bee", "cat"]
    placeholders = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2))
    assert model_class_names(placeholders) is None
    x = torch.rand(1, 3, 16, 16)
    by_name = explain.Saliency(vit).explain(x, target="bee")
    torch.testing.assert_close(by_name.raw_maps, explain.Saliency(vit).explain(x, target=1).raw_maps)
    imagenet = timm.create_model("resnet18", pretrained=False)
    assert model_class_names(imagenet)[281] == "tabby, tabby cat"
    assert model_class_names(timm.create_model("resnet18", pretrained=False, num_classes=5)) is None


def test_uint8_tensors_are_images_and_other_integer_tensors_get_a_dtype_error():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    pixels = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    by_tensor = explain.GradCAM(model, "features.6").explain(pixels)
    float_input = explain.Normalize()(pixels.double() / 255).float()  # by hand: / 255, ImageNet statistics
    by_hand = explain.GradCAM(model, "features.6").explain(float_input)
    torch.testing.assert_close(by_tensor.raw_maps, by_hand.raw_maps)
    assert torch.equal(by_tensor.images * 255, pixels.permute(0, 2, 3, 1).float())  # the pixels, exactly
    # a PIL pipeline gets the same image as from a PIL image
    from torchvision import transforms

    pipeline = transforms.Compose([transforms.Resize(8), transforms.ToTensor(),
                                   transforms.Normalize((0.5,) * 3, (0.25,) * 3)])
    explainer = explain.GradCAM(model, "features.6", preprocess=pipeline, relu=False)
    from_pil = explainer.explain(Image.fromarray(pixels[0].permute(1, 2, 0).numpy()))
    torch.testing.assert_close(explainer.explain(pixels[0]).raw_maps, from_pil.raw_maps)
    for wrong in (pixels.long(), pixels.bool(), pixels[0].int()):
        with pytest.raises(TypeError, match=r"must be floating point.*x.float\(\) / 255"):
            explain.GradCAM(model, "features.6").explain(wrong)
    with pytest.raises(ValueError, match=r"channels-last.*permute\(0, 3, 1, 2\)"):
        explain.GradCAM(model, "features.6").explain(pixels.permute(0, 2, 3, 1))
