"""A researcher's first hour: inputs, outputs and targets that used to give a confusing error or a silent wrong map."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import explain
from explain import GradCAM, Normalize


class TinyNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(6, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x).mean((2, 3)))


def gradcam_by_hand(model: nn.Module, layer: nn.Module, x: Tensor, cls: int, scores=lambda out: out) -> Tensor:
    """ReLU(Σ_k mean(dY/dA_k) A_k) with plain autograd, for image 0."""
    activations: list[Tensor] = []
    handle = layer.register_forward_hook(lambda module, inputs, output: activations.append(output))
    with torch.enable_grad():
        y = scores(model(x))
    handle.remove()
    (gradient,) = torch.autograd.grad(y[0, cls], activations[0])
    return F.relu((gradient.mean((2, 3), keepdim=True) * activations[0]).sum(1))[0].detach()


@pytest.fixture
def net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().eval()


def test_a_url_is_refused_as_a_url_not_a_mangled_missing_file(net):
    with pytest.raises(ValueError, match=r"'https://example.com/cat.jpg' is a URL.*Download it first"):
        GradCAM(net, "features.2").explain("https://example.com/cat.jpg")


def test_a_folder_is_refused_as_a_folder(net, tmp_path: Path):
    with pytest.raises(IsADirectoryError, match="is a folder, not an image file.*explain batch"):
        GradCAM(net, "features.2").explain(tmp_path)


def test_a_five_dimensional_tensor_gets_the_reshape_hint(net):
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 8, 8\).*x.flatten\(0, 1\)"):
        GradCAM(net, "features.2").explain(torch.rand(1, 2, 3, 8, 8))


def test_a_float_tensor_of_0_255_pixels_warns_and_the_uint8_route_is_right(net):
    pixels = torch.randint(0, 256, (3, 10, 10), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    pixels[0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    explainer = GradCAM(net, "features.2", normalize=None)
    with pytest.warns(UserWarning, match=r"spans \[0, 255\]: it looks like 0-255 pixels") as caught:
        explainer.explain(pixels.float(), target=1)
    assert all(Path(record.filename).name == Path(__file__).name for record in caught)  # points at the user's line
    with pytest.warns(UserWarning, match="looks like 0-255 pixels"):  # the same, as a batch
        explainer.explain(pixels.float()[None].expand(2, -1, -1, -1), target=1)
    # the fixes the warning names: a uint8 tensor, or the normalised float tensor; both silent and right by hand
    model_input = Normalize()(pixels.float() / 255)
    expected = gradcam_by_hand(net, net.features[2], model_input[None], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_uint8 = explainer.explain(pixels, target=1).raw_maps[0]
        from_float = explainer.explain(model_input, target=1).raw_maps[0]
    torch.testing.assert_close(from_uint8, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(from_float, expected, rtol=1e-4, atol=1e-6)


def test_normalised_and_unit_range_tensors_do_not_warn(net):
    explainer = GradCAM(net, "features.2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explainer.explain(torch.rand(3, 8, 8))  # [0, 1]: a model with its normalisation inside takes it
        explainer.explain(Normalize()(torch.rand(3, 8, 8)))


class EmbeddingAndLogits(nn.Module):
    """Returns (embedding (N, 6), logits (N, 5)): the first tensor is not the class scores."""

    def __init__(self, net: TinyNet, logits_first: bool = False):
        super().__init__()
        self.net = net
        self.logits_first = logits_first

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        embedding = self.net.features(x).mean((2, 3))
        logits = self.net.fc(embedding)
        return (logits, embedding) if self.logits_first else (embedding, logits)


def test_a_tuple_of_tensors_of_different_widths_warns_which_was_taken(net):
    model = EmbeddingAndLogits(net)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"\[0\] \(1, 6\), \[1\] \(1, 5\).*output=1"):
        GradCAM(model, "net.features.2").explain(x, target=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = GradCAM(model, "net.features.2", normalize=None, output=1).explain(x, target=1)
        GradCAM(model, "net.features.2", output=0).explain(x, target=1)  # stated: silent
    expected = gradcam_by_hand(model, net.features[2], x, 1, scores=lambda out: out[1])
    torch.testing.assert_close(chosen.raw_maps[0], expected, rtol=1e-4, atol=1e-6)
    assert chosen.class_indices.tolist() == [[1]]


def test_a_tuple_of_equal_widths_such_as_logits_and_aux_logits_is_silent(net):
    class LogitsAndAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            logits = self.net(x)
            return logits, 0.5 * logits

    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = GradCAM(LogitsAndAux(), "net.features.2", normalize=None).explain(x, target=2)
    torch.testing.assert_close(e.raw_maps[0], gradcam_by_hand(net, net.features[2], x, 2), rtol=1e-4, atol=1e-6)


def test_a_bgr_array_is_read_as_rgb_and_its_reversed_view_works(net):
    """cv2 gives BGR: image[..., ::-1] (a negative-stride view) is the documented fix, and it must be read as is."""
    rgb = np.random.default_rng(4).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    bgr = np.ascontiguousarray(rgb[..., ::-1])
    explainer = GradCAM(net, "features.2", normalize=None)
    from_view = explainer.explain(bgr[..., ::-1], target=0).raw_maps[0]
    model_input = Normalize()(torch.from_numpy(rgb).permute(2, 0, 1) / 255.0)
    expected = gradcam_by_hand(net, net.features[2], model_input[None], 0)
    torch.testing.assert_close(from_view, expected, rtol=1e-4, atol=1e-6)


def test_class_names_of_another_length_than_the_outputs_warn(net):
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="scores have 5 classes and class_names has 3 names") as caught:
        e = GradCAM(net, "features.2", class_names=["a", "b", "c"]).explain(x)
    assert all(Path(record.filename).name == Path(__file__).name for record in caught)
    assert e.class_indices.tolist() == [[int(net(x).argmax())]]  # the map itself is still the top class's
    torch.manual_seed(0)
    binary = TinyNet(classes=1).eval()
    with pytest.warns(UserWarning, match="one-logit binary model's score is its positive class"):
        GradCAM(binary, "features.2", class_names=["negative", "positive"]).explain(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradCAM(net, "features.2", class_names=list("abcde")).explain(x)
        GradCAM(binary, "features.2", class_names=["positive"]).explain(x)


def test_an_inf_tensor_is_refused_as_non_finite_not_called_pixels(net):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="NaN or inf"):
            GradCAM(net, "features.2").explain(torch.full((3, 6, 6), float("inf")))


def test_a_channels_last_float_tensor_is_named_as_such(net):
    image = torch.rand(8, 9, 3, generator=torch.Generator().manual_seed(6))
    with pytest.warns(UserWarning, match=r"\(8, 9, 3\) looks channels-last.*x.permute\(2, 0, 1\)"):
        with pytest.raises(explain.ModelInputError):  # the model then fails on it: 8 channels where it takes 3
            GradCAM(net, "features.2").explain(image)
    with pytest.warns(UserWarning, match=r"\(2, 8, 9, 3\) looks channels-last.*x.permute\(0, 3, 1, 2\)"):
        with pytest.raises(explain.ModelInputError):
            GradCAM(net, "features.2").explain(image[None].expand(2, -1, -1, -1))
    with warnings.catch_warnings():  # the fix it names: silent, and the map is the channels-first image's
        warnings.simplefilter("error")
        fixed = GradCAM(net, "features.2", normalize=None).explain(image.permute(2, 0, 1), target=3).raw_maps[0]
    torch.testing.assert_close(fixed, gradcam_by_hand(net, net.features[2], image.permute(2, 0, 1)[None], 3),
                               rtol=1e-4, atol=1e-6)
