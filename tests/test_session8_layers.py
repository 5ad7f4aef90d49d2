"""Session 8, attacked: layer names written as Python reaches the module ("features[-1]", "layer4[-1].conv2",
"features.-1"), the name a wrapper's prefix explains, a top-level layer that runs twice, the permute for a
channels-last input, a model that fails on a later pass of a call, and probabilities="sigmoid"."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import explain
from explain.core.capture import LayerNotFoundError, LayerNotRunError, ModelInputError, find_layers, run_model


def small_cnn(classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
    model.pool = nn.AdaptiveAvgPool2d(1)
    model.flat = nn.Flatten()
    model.fc = nn.Linear(6, classes)
    return model.eval()


def names(model: nn.Module, spec: object) -> list[str]:
    return [name for name, _ in find_layers(model, spec)]  # type: ignore[arg-type]


# 1. Python-style layer names


def test_python_style_names_are_the_dotted_names():
    model = small_cnn()
    assert names(model, "features[2]") == ["features.2"]
    assert names(model, "features[-1]") == names(model, "features.-1") == ["features.3"]
    assert names(model, "features[ -2 ]") == ["features.2"]
    assert find_layers(model, "features[-1]")[0][1] is model.features[-1]
    resnet = torchvision.models.resnet18(num_classes=3)
    assert names(resnet, "layer4[-1].conv2") == ["layer4.1.conv2"]
    assert find_layers(resnet, "layer4[-1].conv2")[0][1] is resnet.layer4[-1].conv2
    assert names(resnet, "layer4[0].downsample[0]") == ["layer4.0.downsample.0"]
    blocks = nn.Module()
    blocks.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    assert names(blocks, "heads['b']") == names(blocks, 'heads["b"]') == ["heads.b"]


def test_real_globs_still_work():
    resnet = torchvision.models.resnet18(num_classes=3)
    assert names(resnet, "layer[34]") == ["layer3", "layer4"]
    assert names(resnet, "layer[4]") == ["layer4"]  # no module "layer" to index: a character class
    assert names(resnet, "layer4.*.conv2") == ["layer4.0.conv2", "layer4.1.conv2"]
    assert names(small_cnn(), "features.[02]") == ["features.0", "features.2"]


def test_a_python_style_name_that_reaches_no_module_says_why():
    model = small_cnn()
    with pytest.raises(LayerNotFoundError, match=r"'features' \(Sequential\) has 4 children.*\[-9\]"):
        find_layers(model, "features[-9]")
    with pytest.raises(LayerNotFoundError, match=r"'features.2' is a Conv2d, not a Sequential or ModuleList"):
        find_layers(model, "features[2][-1]")
    with pytest.raises(LayerNotFoundError, match="Closest names"):  # a typo in a dotted name: as before
        find_layers(model, "featurs.2")


def test_gradcam_at_a_python_style_layer_is_gradcam_by_hand():
    model = small_cnn()
    x = torch.randn(2, 3, 12, 12)
    explanation = explain.GradCAM(model, "features[-1]", normalize=None).explain(x, target=[1, 3])
    assert explanation.layer == "features.3"
    activation = model.features(x).detach().requires_grad_(True)
    scores = model.fc(model.flat(model.pool(activation)))
    gradient, = torch.autograd.grad(scores[[0, 1], [1, 3]].sum(), activation)
    by_hand = F.relu((gradient.mean(dim=(2, 3), keepdim=True) * activation).sum(dim=1))
    torch.testing.assert_close(explanation.raw_maps, by_hand.detach(), rtol=1e-5, atol=1e-6)


def test_a_name_of_the_wrapped_model_says_the_wrappers_prefix():
    model = small_cnn()
    parallel = nn.DataParallel(model)
    with pytest.raises(LayerNotFoundError, match=r"DataParallel.*'module\.features\.3'.*model\.module"):
        find_layers(parallel, "features.3")
    with pytest.raises(LayerNotFoundError, match=r"'module\.features\.3'"):
        find_layers(parallel, "features[-1]")
    with pytest.raises(LayerNotFoundError, match=r"torch\.compile.*'_orig_mod\.features\.2'"):
        find_layers(torch.compile(model), "features.2")
    holder = nn.Module()
    holder.net = model
    with pytest.raises(LayerNotFoundError, match=r"holds one module, 'net'.*'net\.features\.\*'"):
        find_layers(holder, "features.*")
    with pytest.raises(LayerNotFoundError) as refused:  # no wrapped model has it either: no such sentence
        find_layers(parallel, "features.7")
    assert "start with" not in str(refused.value)


# 2. a top-level layer that runs twice


class TwiceUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 3, 1)
        self.block = nn.Sequential(nn.Conv2d(3, 3, 1))
        self.block.shared = nn.ReLU()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c(self.c(x))
        x = self.block.shared(self.block[0](self.block.shared(x)))
        return self.fc(x.mean(dim=(2, 3)))


def test_a_layer_that_runs_twice_is_told_a_parent_only_where_it_has_one():
    model = TwiceUsed().eval()
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(LayerNotRunError) as top:
        explain.GradCAM(model, "c").explain(x)
    assert "ran more than once" in str(top.value) and "parent block" not in str(top.value)
    assert "another layer" in str(top.value)
    with pytest.raises(LayerNotRunError, match=r"parent block \('block'\)"):
        explain.GradCAM(model, "block.shared").explain(x)


# 3. channels-last input


def test_a_channel_mismatch_of_a_channels_last_input_says_the_permute():
    model = small_cnn()
    image = torch.rand(1, 3, 10, 12)
    with pytest.warns(UserWarning, match="channels-last"), pytest.raises(ModelInputError) as refused:
        explain.Saliency(model).explain(image.permute(0, 2, 3, 1))
    assert "x.permute(0, 3, 1, 2)" in str(refused.value) and "(H, W, 3) ndarray" in str(refused.value)
    four = nn.Sequential(nn.Conv2d(4, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModelInputError, match=r"x\.permute\(0, 3, 1, 2\) \(channels first\)\.") as four_refused:
            explain.Saliency(four).explain(torch.rand(1, 9, 9, 4))
    assert "ndarray" not in str(four_refused.value)  # a 4-channel image is no (H, W, 3) array
    with pytest.raises(ModelInputError) as wrong:  # another channel count, not channels-last: no permute
        explain.Saliency(model).explain(torch.rand(1, 5, 10, 12))
    assert "permute" not in str(wrong.value) and "another size or channel count" in str(wrong.value)


# 4. a model that fails on a later pass


class FailsOnCall(nn.Module):
    """The small CNN, raising on its ``fail_on``-th forward, or on any batch of more than ``max_rows`` rows."""

    def __init__(self, fail_on: int | None = None, max_rows: int | None = None) -> None:
        super().__init__()
        self.net = small_cnn()
        self.fail_on, self.max_rows, self.calls = fail_on, max_rows, 0
        self.raised: list[BaseException] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on or (self.max_rows is not None and x.shape[0] > self.max_rows):
            error = RuntimeError(f"refused call {self.calls}")
            self.raised.append(error)
            raise error
        return self.net(x)


def test_a_failure_on_a_later_pass_of_the_same_shape_says_so():
    model = FailsOnCall(fail_on=2).eval()  # Finer-CAM: two passes of the image itself
    with pytest.raises(ModelInputError) as refused:
        explain.FinerCAM(model, "net.features.2").explain(torch.randn(1, 3, 8, 8))
    text = str(refused.value)
    assert "pass 2" in text and "ran on in pass 1" in text and "refused call 2" in text
    assert "another size" not in text and "size is not the cause" in text
    assert refused.value.__cause__ is model.raised[0]  # the model's own exception, chained


def test_a_failure_on_a_batch_of_copies_says_so_and_the_advice_works():
    x = torch.randn(1, 3, 8, 8)
    model = FailsOnCall(max_rows=1).eval()
    with pytest.raises(ModelInputError) as refused:  # Score-CAM: the image, then batches of masked copies
        explain.ScoreCAM(model, "net.features.2").explain(x)
    text = str(refused.value)
    assert "pass 2" in text and "batch of" in text and "(1, 3, 8, 8) ran in pass 1" in text
    assert "batch_size=" in text and "another size" not in text
    assert refused.value.__cause__ is model.raised[0]
    # Integrated Gradients' first pass is of copies alone: the size may be the cause too, and the rows are said
    with pytest.raises(ModelInputError, match=r"shape \(7, 3, 8, 8\).*another size.*The input was a batch of 7 rows "
                                              r"\(the method's copies of the image explained.*batch_size="):
        explain.IntegratedGradients(FailsOnCall(max_rows=1).eval(), steps=5).explain(x)
    one_row = explain.IntegratedGradients(FailsOnCall(max_rows=1).eval(), steps=5, batch_size=1).explain(x)
    usual = explain.IntegratedGradients(small_cnn(), steps=5).explain(x)
    torch.testing.assert_close(one_row.raw_maps, usual.raw_maps, rtol=1e-4, atol=1e-6)


def test_a_first_pass_failure_and_one_outside_a_call_keep_the_size_advice():
    linear = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2)).eval()
    with pytest.raises(ModelInputError, match="another size or channel count") as refused:
        explain.Saliency(linear).explain(torch.randn(1, 3, 6, 6))
    assert "of this call" not in str(refused.value)
    with pytest.raises(ModelInputError, match="another size or channel count"):
        run_model(linear, torch.randn(2, 3, 6, 6))


# 5. probabilities="sigmoid"


def test_sigmoid_probabilities_are_each_classes_sigmoid():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    logits = model(x).detach()
    sigmoid = explain.GradCAM(model, "features[-1]", probabilities="sigmoid").explain(x, topk=3)
    torch.testing.assert_close(sigmoid.probabilities, torch.sigmoid(logits).gather(1, sigmoid.class_indices))
    assert sigmoid.probability_function == "sigmoid" and sigmoid[1].probability_function == "sigmoid"
    assert "<th>sigmoid probability</th>" in sigmoid._repr_html_()
    softmax = explain.GradCAM(model, "features[-1]").explain(x, topk=3)
    torch.testing.assert_close(softmax.probabilities, torch.softmax(logits, dim=1).gather(1, softmax.class_indices))
    assert softmax.probability_function == "softmax" and "<th>probability</th>" in softmax._repr_html_()
    torch.testing.assert_close(sigmoid.maps, softmax.maps)  # the maps do not change
    one_logit = small_cnn(classes=1)
    binary = explain.Saliency(one_logit).explain(x)
    torch.testing.assert_close(binary.probabilities, torch.sigmoid(one_logit(x).detach()))


def test_the_probabilities_option_is_checked_and_not_a_setting():
    model = small_cnn()
    with pytest.raises(ValueError, match=r"probabilities must be 'softmax'.*or 'sigmoid'.*got 'logistic'"):
        explain.Saliency(model, probabilities="logistic")
    assert explain.Saliency(model, probabilities="sigmoid").settings() == explain.Saliency(model).settings()
    with pytest.raises(ValueError, match="FinerCAM's scores are its own"):
        explain.FinerCAM(model, "features.2", probabilities="sigmoid")


def test_sigmoid_probabilities_pass_through_wrappers_and_compare():
    model = small_cnn()
    x = torch.randn(1, 3, 8, 8)
    expected = torch.sigmoid(model(x).detach())
    inner = explain.SmoothGrad(explain.Saliency(model, probabilities="sigmoid"), samples=2).explain(x, target=2)
    outer = explain.SmoothGrad(model, samples=2, probabilities="sigmoid").explain(x, target=2)
    # Guided Grad-CAM builds its CAM and guided backprop without the option: its own is taken
    guided = explain.GuidedGradCAM(model, "features.2", probabilities="sigmoid").explain(x, target=2)
    for explanation in (inner, outer, guided):
        torch.testing.assert_close(explanation.probabilities, expected[:, 2:3])
        assert explanation.probability_function == "sigmoid"
    with pytest.raises(ValueError, match=r"probabilities='softmax' and the explainer it wraps probabilities='sigmoid'"):
        explain.SmoothGrad(explain.Saliency(model, probabilities="sigmoid"), samples=2,
                           probabilities="softmax").explain(x)
    with pytest.raises(ValueError, match="scores are its own"):  # a wrapped CAM's option that Finer-CAM cannot take
        explain.FinerCAM(model, cam=explain.GradCAM(model, "features.2", probabilities="sigmoid")).explain(x)
    compared = explain.compare(model, x, ["saliency", "gradcam"], layer="features[-1]", target=4,
                               method_options={"probabilities": "sigmoid"})
    for explanation in compared.explanations:
        torch.testing.assert_close(explanation.probabilities, expected[:, 4:5])
