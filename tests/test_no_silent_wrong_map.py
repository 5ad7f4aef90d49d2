"""No silent wrong map (issue 13): the caller's contexts, odd shapes, models that do odd things.
Each case gets the correct map (checked against a computation written here) or an error or
warning that names the cause and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from conftest import ConvGapLinear, SmallCNN, assert_state_equal, class_scores, gradcam_by_hand, model_state
from test_reliability import CNN_METHODS, build
from torch import nn

import explain

GRADIENT_METHODS = ["saliency", "inputxgradient", "integratedgradients", "smoothgrad", "vargrad", "guidedbackprop",
                    "deconvnet"]


def quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return function(*args, **kwargs)


# ------------------------------------------------------------------ 1. the caller's inference_mode()


@pytest.mark.parametrize("name", CNN_METHODS)
def test_every_method_inside_inference_mode_gives_the_map_it_gives_outside(name):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    outside = quietly(build(name, model, "features.6").explain, x, target=[1, 3]).raw_maps
    assert outside.abs().amax() > 0
    with torch.inference_mode():
        inference_input = x.clone()  # an inference tensor, as a user's pipeline makes it there
        inside = quietly(build(name, model, "features.6").explain, inference_input, target=[1, 3])
        assert torch.is_inference_mode_enabled()
    torch.testing.assert_close(inside.raw_maps, outside)


def test_gradcam_inside_inference_mode_equals_the_hand_computation():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    x = torch.randn(3, 3, 10, 10)
    expected = gradcam_by_hand(model, model.conv, x, class_scores([0, 2, 1]))
    with torch.inference_mode():
        explanation = explain.GradCAM(model, "conv", normalize=None).explain(x, target=[0, 2, 1])
    torch.testing.assert_close(explanation.raw_maps, expected)


def test_a_model_built_inside_inference_mode_is_refused_with_the_fix():
    with torch.inference_mode():
        model = SmallCNN().eval()
    with pytest.raises(RuntimeError, match="created inside torch.inference_mode.*outside"):
        explain.GradCAM(model, "features.6").explain(torch.randn(1, 3, 16, 16))


# ------------------------------------------------------------------ 2. layouts decided by the module


class OddShapeCNN(nn.Module):
    """conv 3 → 16, kernel 12, stride 4: a 64 × 56 input gives (N, 16, 14, 12), which also reads as
    channels last (16 × 14 positions of 12 channels, the input's aspect ratio exactly)."""

    def __init__(self, then_identity: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 12, stride=4)
        self.after = nn.Identity() if then_identity else nn.ReLU()
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.after(self.conv(x)).mean(dim=(2, 3)))


def test_a_convolution_output_that_also_fits_channels_last_is_read_channels_first():
    torch.manual_seed(0)
    model = OddShapeCNN().eval()
    x = torch.randn(2, 3, 64, 56)
    explanation = explain.GradCAM(model, "conv", normalize=None).explain(x, target=[0, 2])
    assert explanation.low_res_maps[0].shape[-2:] == (14, 12)
    torch.testing.assert_close(explanation.raw_maps, gradcam_by_hand(model, model.conv, x, class_scores([0, 2])))


def test_an_ambiguous_shape_with_nothing_to_decide_asks_for_reshape():
    torch.manual_seed(0)
    model = OddShapeCNN(then_identity=True).eval()
    x = torch.randn(2, 3, 64, 56)
    with pytest.raises(ValueError, match=r"\(2, 16, 14, 12\).*reshape='channels_first'"):
        explain.GradCAM(model, "after").explain(x)
    explanation = explain.GradCAM(model, "after", normalize=None, reshape="channels_first").explain(x, target=[0, 2])
    torch.testing.assert_close(explanation.raw_maps, gradcam_by_hand(model, model.after, x, class_scores([0, 2])))


def test_a_block_that_permutes_back_after_a_channels_last_mlp_is_read_channels_first():
    """ConvNeXt-like: the last Linear has out_features == channels, found at dimension 1."""
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(num_classes=4).eval()
    x = torch.randn(1, 3, 64, 64)
    explanation = explain.GradCAM(model, "features.7.2", normalize=None).explain(x, target=1)
    assert explanation.low_res_maps[0].shape[-2:] == (2, 2)
    torch.testing.assert_close(explanation.raw_maps,
                               gradcam_by_hand(model, model.features[7][2], x, class_scores([1])))


# ------------------------------------------------------------------ 3. gradient methods: no dependence on the input


class NoGradBackbone(nn.Module):
    """The backbone runs under no_grad inside forward: the score does not depend on the input."""

    def __init__(self):
        super().__init__()
        self.backbone = SmallCNN()

    def forward(self, x):
        with torch.no_grad():
            features = self.backbone.features(x).mean(dim=(2, 3))
        return self.backbone.head(features)


@pytest.mark.parametrize("name", GRADIENT_METHODS)
def test_gradient_methods_warn_when_the_score_does_not_depend_on_the_input(name):
    torch.manual_seed(0)
    model = NoGradBackbone().eval()
    x = torch.randn(2, 3, 16, 16)
    with pytest.warns(RuntimeWarning, match=r"\(0, 0\), \(1, 0\).*does not depend on the input.*no_grad"):
        explanation = build(name, model, None).explain(x)
    assert explanation.maps.abs().amax() == 0
    detached = SmallCNN().eval()
    with pytest.warns(RuntimeWarning, match="does not depend on the input.*detached"):
        build(name, detached, None).explain(x, target=lambda output: output[:, 0].detach())


# ------------------------------------------------------------------ 4. NaN and inf scores


@pytest.mark.parametrize("name", CNN_METHODS)
def test_a_nan_target_raises_naming_the_image_and_target(name):
    model = SmallCNN().eval()

    def nan_for_the_second_image(output):
        scores = output[:, 0].clone()
        scores[1] = float("nan")
        return scores

    with pytest.raises(ValueError, match=r"not finite \(image 1, target 0: nan\)"):
        build(name, model, "features.6").explain(torch.randn(2, 3, 16, 16), target=nan_for_the_second_image)


@pytest.mark.parametrize("name", CNN_METHODS)
def test_a_finite_input_that_overflows_inside_the_model_raises(name):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16).clamp(-1, 1) * 3e38  # finite, but the convolutions' sums overflow
    with pytest.raises(ValueError, match=r"(not finite \(image 0, target 0: (nan|-?inf)|NaN or inf values).*overflow"):
        build(name, model, "features.6").explain(x, target=[0, 1])


# ------------------------------------------------------------------ 5. zero maps although a gradient path exists


def test_torchvisions_zero_initialised_vit_head_gets_a_warning_saying_why():
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2,
                                               hidden_dim=16, mlp_dim=16, num_classes=3).eval()
    assert vit.heads.head.weight.abs().amax() == 0
    with pytest.warns(RuntimeWarning, match=r"\(0, 0\).*zero everywhere although.*zero-initialised"):
        explain.GradCAM(vit).explain(torch.randn(1, 3, 32, 32))
    with pytest.warns(RuntimeWarning, match="zero everywhere although.*zero-initialised"):
        explain.Saliency(vit).explain(torch.randn(1, 3, 32, 32))


def test_the_last_vit_blocks_output_gets_a_warning_saying_why():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                               hidden_dim=16, mlp_dim=16, num_classes=3).eval()
    nn.init.normal_(vit.heads.head.weight)
    with pytest.warns(RuntimeWarning, match="only the class token reaches the head"):
        explanation = explain.GradCAM(vit, "encoder.layers.encoder_layer_1").explain(torch.randn(1, 3, 32, 32))
    assert explanation.maps.abs().amax() == 0


def test_a_map_negative_everywhere_before_the_relu_gets_a_warning_pointing_to_relu_false():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    with torch.no_grad():
        model.conv.weight.zero_()
        model.conv.bias.fill_(1.0)  # every activation is 1
        model.fc.weight.fill_(-1.0)  # every class is evidence against: the CAM is negative everywhere
    with pytest.warns(RuntimeWarning, match="≤ 0 everywhere before the ReLU.*relu=False"):
        explanation = explain.GradCAM(model, "conv").explain(torch.randn(1, 3, 8, 8), target=0)
    assert explanation.maps.abs().amax() == 0
    signed = explain.GradCAM(model, "conv", relu=False, normalize=None).explain(torch.randn(1, 3, 8, 8), target=0)
    torch.testing.assert_close(signed.raw_maps, torch.full((1, 8, 8), -4.0 / 64))  # Σ_k w_k A_k / (h w)


def test_a_useful_map_gets_no_warning():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        explain.GradCAM(ConvGapLinear().eval(), "conv", relu=False).explain(torch.randn(2, 3, 8, 8))


# ------------------------------------------------------------------ 6. a layer whose batch dimension is not N


class FoldsPatchesIntoTheBatch(nn.Module):
    """MobileViT-like: 2 × 2 patches are folded into the batch dimension inside a block."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.inside = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        features = self.stem(x)
        n, c, h, w = features.shape
        patches = features.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
        folded = patches.reshape(n * 4, c, h // 2, w // 2)
        unfolded = self.inside(folded).reshape(n, 2, 2, c, h // 2, w // 2).permute(0, 3, 4, 1, 5, 2)
        return self.fc(unfolded.reshape(n, c, h, w).mean(dim=(2, 3)))


def test_a_given_layer_whose_batch_dimension_is_not_n_raises():
    model = FoldsPatchesIntoTheBatch().eval()
    with pytest.raises(explain.LayerNotRunError, match=r"\(8, 4, 4, 4\).*not the batch size 2"):
        explain.GradCAM(model, "inside").explain(torch.randn(2, 3, 8, 8))


# ------------------------------------------------------------------ 8. a model that edits its input in place


class EditsItsInput(nn.Module):
    """Normalises its input in place (x -= mean; x *= 2), as some user models do."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.cnn = SmallCNN()

    def forward(self, x):
        if self.in_place:
            x -= 0.5
            x *= 2
        else:
            x = (x - 0.5) * 2
        return self.cnn(x)


@pytest.mark.parametrize("name", CNN_METHODS)
def test_a_model_that_edits_its_input_in_place_gets_the_maps_of_the_same_model_without(name):
    torch.manual_seed(0)
    in_place, out_of_place = EditsItsInput(True).eval(), EditsItsInput(False).eval()
    out_of_place.load_state_dict(in_place.state_dict())
    x = torch.randn(2, 3, 16, 16)
    original = x.clone()
    expected = quietly(build(name, out_of_place, "cnn.features.6").explain, x, target=[1, 3])
    explanation = quietly(build(name, in_place, "cnn.features.6").explain, x, target=[1, 3])
    assert torch.equal(x, original), "the caller's tensor was changed"
    torch.testing.assert_close(explanation.raw_maps, expected.raw_maps)


# ------------------------------------------------------------------ 9. float16 models


def test_guided_gradcam_on_a_float16_model_equals_the_float32_map():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    expected = explain.GuidedGradCAM(model, "features.6").explain(x, target=[1, 3]).maps
    half = explain.GuidedGradCAM(model.half(), "features.6").explain(x, target=[1, 3])
    assert half.maps.dtype == torch.float32 and half.attributions.dtype == torch.float32
    assert (half.maps.flatten(1).amax(1) == 1).all(), "a float16 map underflowed"
    assert (half.maps - expected).abs().amax() < 0.1  # float16 activations: close, not equal
    correlation = torch.corrcoef(torch.stack([half.maps.flatten(), expected.flatten()]))[0, 1]
    assert correlation > 0.999


# ------------------------------------------------------------------ 10. modules whose train() does more


def test_an_fx_feature_extractor_in_train_mode_comes_back_running_its_train_graph():
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    extractor = create_feature_extractor(torchvision.models.resnet18(num_classes=3), {"layer4": "features",
                                                                                       "fc": "logits"})
    extractor.train()
    graph, code = extractor.graph, extractor.code
    assert graph is extractor.train_graph
    before = model_state(extractor)
    explain.GradCAM(extractor, "layer4.1.conv2", output="logits").explain(torch.randn(2, 3, 64, 64))
    assert_state_equal(before, model_state(extractor))
    assert extractor.graph is extractor.train_graph and extractor.code == code


# ------------------------------------------------------------------ 18. clear errors


def test_bad_layers_baselines_edits_and_torchscript_models_get_clear_errors():
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16)
    with pytest.raises(ValueError, match="list of layers is empty"):
        explain.GradCAM(model, [])
    with pytest.raises(TypeError, match="layer is given by its name.*got int 4"):
        explain.GradCAM(model, 4)
    with pytest.raises(ValueError, match=r"baseline has shape \(3, 8, 8\).*does not broadcast"):
        explain.IntegratedGradients(model, baseline=torch.zeros(3, 8, 8)).explain(x)
    with pytest.raises(TypeError, match="returned NoneType, not a tensor.*return t"):
        with explain.edit(model, "features.6", lambda t: None):
            model(x)
    for compiled in (torch.jit.script(ConvGapLinear().eval()), torch.jit.trace(ConvGapLinear().eval(), x)):
        with pytest.raises(TypeError, match="TorchScript.*forward hooks.*original nn.Module"):
            explain.GradCAM(compiled, "conv")
        with pytest.raises(TypeError, match="TorchScript"):
            explain.Saliency(compiled)
        with pytest.raises(TypeError, match="TorchScript"):
            explain.capture(compiled, "conv")
