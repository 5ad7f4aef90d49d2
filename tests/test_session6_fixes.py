"""Found by the sixth session's model-zoo sweep: the automatic layer of a ConvNeXt whose first stage has as many
channels as pixels per side, and warnings that pointed inside the package."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import explain

torchvision = pytest.importorskip("torchvision")


def small_convnext(first_channels: int) -> nn.Module:
    """torchvision's ConvNeXt, two stages: ``first_channels`` channels at 1/4 of the input, then twice as many."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    settings = [CNBlockConfig(first_channels, 2 * first_channels, 1), CNBlockConfig(2 * first_channels, None, 1)]
    return ConvNeXt(settings, num_classes=5).eval()


@pytest.mark.parametrize("first_channels, size", [(16, 64), (24, 96)])
def test_a_convnext_whose_first_stage_has_as_many_channels_as_pixels_per_side_is_explained_at_its_last_stage(
        first_channels: int, size: int) -> None:
    # the first stage's (N, C, C, C) output reads channels-last as well as channels-first: it was taken for a
    # transformer's block, and its LayerNorm chosen (features.1.0.block.2) instead of the last stage
    model = small_convnext(first_channels)
    explanation = explain.GradCAM(model).explain(torch.rand(1, 3, size, size), target=1)
    assert explanation.layer == "features"
    # at another size the same model is read the same way
    assert explain.GradCAM(model).explain(torch.rand(1, 3, size + 32, size + 32), target=1).layer == "features"


def test_a_swin_whose_first_stage_is_as_ambiguous_still_gets_its_last_blocks_first_norm() -> None:
    # Swin-T at 384 px: stage 0 is 96 channels on 96 × 96 too; its last block is not ambiguous, and is chosen
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4],
                            num_classes=5).eval()
    explanation = explain.GradCAM(model).explain(torch.rand(1, 3, 64, 64), target=1)  # stage 0: 16 on 16 × 16
    assert explanation.layer == "features.3.0.norm1"


def caught(call: Callable[[], object]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        call()
    return [warning for warning in found if issubclass(warning.category, RuntimeWarning)]


def test_guided_methods_warn_about_a_model_without_relu_at_the_callers_line() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 3, padding=1), nn.SiLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()
    for explainer in (explain.GuidedGradCAM(model, "2"), explain.GuidedBackprop(model)):
        call = lambda explainer=explainer: explainer.explain(torch.rand(1, 3, 8, 8), target=1)  # noqa: E731
        found = [warning for warning in caught(call) if "no ReLU" in str(warning.message)]
        assert found and all(warning.filename == __file__ for warning in found), [w.filename for w in found]


def test_ablation_cam_warns_about_a_full_forward_fallback_at_the_callers_line() -> None:
    class Tail(nn.Module):  # the part after the layer reads the model's input again: cannot be replayed alone
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            features = torch.relu(self.conv(x))
            return self.head((features * x.mean(1, keepdim=True)).mean((2, 3)))

    torch.manual_seed(0)
    model = Tail().eval()
    found = [warning for warning in caught(
        lambda: explain.AblationCAM(model, "conv").explain(torch.rand(2, 3, 8, 8), target=1))
        if "replay" in str(warning.message)]
    assert found and all(warning.filename == __file__ for warning in found), [w.filename for w in found]


def test_a_colormap_object_draws_as_its_name_and_anything_else_is_refused_clearly(tmp_path) -> None:
    import matplotlib
    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3)).eval()
    explanation = explain.GradCAM(model, "1").explain(torch.rand(1, 3, 16, 16), target=1)
    by_name = explanation.overlay(cmap="magma")
    by_object = explanation.overlay(cmap=matplotlib.colormaps["magma"])
    assert np.array_equal(by_name, by_object)
    assert not np.array_equal(by_name, explanation.overlay(cmap="jet"))
    # a listed colour map made by the user (no registered name): its own colours are used
    two_colours = matplotlib.colors.ListedColormap([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    picture = explanation.overlay(alpha=1.0, cmap=two_colours)
    assert set(map(tuple, picture.reshape(-1, 3).tolist())) <= {(255, 0, 0), (0, 0, 255)}
    explanation.save(tmp_path / "magma.png", cmap=matplotlib.colormaps["magma"])
    assert (tmp_path / "magma.png").stat().st_size > 0
    with pytest.raises(ValueError, match="not a matplotlib colour map"):
        explanation.overlay(cmap="no-such-map")
    with pytest.raises(TypeError, match="name .* or a matplotlib.colors.Colormap"):
        explanation.overlay(cmap=3)  # type: ignore[arg-type]


def test_deeplifts_warning_about_an_unruled_operation_points_at_the_callers_line() -> None:
    class Sorting(nn.Module):  # torch.sort has no DeepLIFT rule
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.sort(self.conv(x).flatten(2), dim=2).values.mean(2))

    torch.manual_seed(0)
    model = Sorting().eval()
    for images in (torch.rand(1, 3, 8, 8), torch.rand(2, 3, 6, 6)):
        found = [warning for warning in caught(lambda images=images: explain.DeepLift(model).explain(images, target=1))
                 if "no DeepLIFT rule" in str(warning.message)]
        assert found and all(warning.filename == __file__ for warning in found), [w.filename for w in found]
