"""Session 12: each metric value is for the right (image, class) pair, and ROAD imputes an image alone as in a batch.

- An Explanation given with a ``target`` that differs from the classes it explains was scored on the target's
  class without a word (a map of class 0 judged by class 3's score); the explainer metrics already refused
  ``target`` with ``explanation``. The model + maps metrics now refuse a differing target, naming the image and both
  classes, and score an agreeing one as the explanation alone.
- completeness, non_sensitivity, infidelity and the faithfulness_breadth metrics scored each image's top class for
  the explanation of a hidden unit (no class indices), where deletion and ROAD refused it.
- A top-k explanation's error now says to pass the target's classes with its maps (without them, the top class is
  scored).
- ROAD's conjugate gradients stopped when the batch's slowest image converged, so an image alone stopped earlier
  than beside a harder one (1.7e-5 apart on a [0, 1] image); each image now stops at its own tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import explain
from explain import metrics

HEIGHT, WIDTH = 12, 10  # not square


class TinyCNN(nn.Module):
    """Conv → ReLU → linear, 6 classes, float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * HEIGHT * WIDTH, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def setting() -> tuple[nn.Module, Tensor, explain.Saliency]:
    model = TinyCNN().double().eval()
    images = torch.randn(3, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return model, images, explain.Saliency(model, reduce="sum", normalize=None)


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(5)


CLASS_METRICS = {  # name → (model, images, maps, target) → one value per image
    "deletion": lambda m, x, e, t: metrics.deletion(m, x, e, t, steps=4).area,
    "road": lambda m, x, e, t: metrics.road(m, x, e, t, percentages=(0.5,)).area,
    "masked_score_change": lambda m, x, e, t: metrics.masked_score_change(m, x, e, t).change,
    "completeness": lambda m, x, e, t: metrics.completeness(m, x, e, t).error,
    "non_sensitivity": lambda m, x, e, t: metrics.non_sensitivity(m, x, e, t, patch_size=4),
    "faithfulness_estimate": lambda m, x, e, t: metrics.faithfulness_estimate(m, x, e, t, steps=4),
    "faithfulness_correlation": lambda m, x, e, t: metrics.faithfulness_correlation(
        m, x, e, t, runs=4, subset_size=8, generator=generator()),
    "monotonicity_correlation": lambda m, x, e, t: metrics.monotonicity_correlation(
        m, x, e, t, steps=4, samples=2, generator=generator()),
    "region_perturbation": lambda m, x, e, t: metrics.region_perturbation(m, x, e, t, patch_size=4, regions=3).aopc,
    "infidelity": lambda m, x, e, t: metrics.infidelity(m, x, e, t, samples=3, generator=generator()),
}


@pytest.mark.parametrize("name", list(CLASS_METRICS))
def test_an_explanation_is_never_scored_on_a_class_it_does_not_explain(name):
    model, images, saliency = setting()
    score = CLASS_METRICS[name]
    explained = saliency.explain(images, [0, 1, 2])
    with pytest.raises(ValueError, match=r"class 4 of image 1.*explains class 1 \(2 images so\)"):
        score(model, images, explained, torch.tensor([0, 4, 5]))
    # the explanation's own classes, given or not, score as the same maps given as a tensor with those classes
    attributions = explained.attributions[:, 0] if name in ("completeness", "infidelity") else explained.maps
    by_tensor = score(model, images, attributions, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(score(model, images, explained, None), by_tensor, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(score(model, images, explained, torch.tensor([0, 1, 2])), by_tensor, rtol=1e-6,
                               atol=1e-9)
    # a tensor of maps scored on other classes on purpose is still taken
    assert score(model, images, attributions, torch.tensor([3, 4, 5])).shape == (3,)


@pytest.mark.parametrize("name", ["completeness", "non_sensitivity", "faithfulness_estimate", "infidelity",
                                  "region_perturbation", "deletion"])
def test_a_hidden_units_explanation_needs_the_class_to_score(name):
    """Each image's top class would be another score than the unit's the maps explain."""
    model, images, saliency = setting()
    score = CLASS_METRICS[name]
    unit = saliency.explain(images, explain.Channel("conv", 1))
    assert unit.class_indices is None
    with pytest.raises(ValueError, match="no class indices: it explains a hidden unit"):
        score(model, images, unit, None)
    attributions = unit.attributions[:, 0] if name in ("completeness", "infidelity") else unit.maps
    torch.testing.assert_close(score(model, images, unit, torch.tensor([2, 2, 3])),
                               score(model, images, attributions, torch.tensor([2, 2, 3])), rtol=1e-6, atol=1e-9)


def test_a_top_k_explanation_is_scored_one_target_at_a_time_with_its_classes():
    model, images, saliency = setting()
    top2 = saliency.explain(images, topk=2)
    with pytest.raises(ValueError, match=r"explanation.maps\[:, k\] and target=explanation.targets\[:, k\]"):
        metrics.deletion(model, images, top2, steps=4)
    with pytest.raises(ValueError, match=r"target=explanation.targets\[:, k\]"):
        metrics.completeness(model, images, top2)
    with pytest.raises(ValueError, match=r"target=explanation.targets\[:, k\]"):
        metrics.infidelity(model, images, top2, samples=2)
    # the second target's maps with its classes score as that class explained alone
    second = saliency.explain(images, top2.targets[:, 1])
    torch.testing.assert_close(metrics.deletion(model, images, top2.maps[:, 1], top2.targets[:, 1], steps=4).area,
                               metrics.deletion(model, images, second, steps=4).area)


def dense_imputation(image: Tensor, removed: Tensor) -> Tensor:
    """ROAD's imputation by hand: per channel, the removed pixels solve x_i Σ_j w_ij = Σ_j w_ij x_j over the 8
    neighbours j inside the image (w = 1/6 direct, 1/12 diagonal), one dense linear system in float64."""
    channels, height, width = image.shape
    unknown = removed.flatten().nonzero()[:, 0].tolist()
    where = {pixel: row for row, pixel in enumerate(unknown)}
    result = image.double().clone()
    for channel in range(channels):
        matrix = torch.zeros(len(unknown), len(unknown), dtype=torch.float64)
        right = torch.zeros(len(unknown), dtype=torch.float64)
        for row, pixel in enumerate(unknown):
            y, x = divmod(pixel, width)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if (dy, dx) == (0, 0) or not (0 <= ny < height and 0 <= nx < width):
                        continue
                    weight = 1 / 6 if dy == 0 or dx == 0 else 1 / 12
                    matrix[row, row] += weight
                    if ny * width + nx in where:
                        matrix[row, where[ny * width + nx]] -= weight
                    else:
                        right[row] += weight * float(image[channel, ny, nx])
        result[channel].view(-1)[unknown] = torch.linalg.solve(matrix, right)
    return result


def test_road_imputes_an_image_alone_as_beside_a_harder_one():
    """Image a: a 4 × 4 hole in a [0, 1] image, quick to fill. Image b: 80 % of a ±100 image removed, slow. Before,
    a beside b went on iterating until b converged and came out 1.7e-5 from a alone."""
    draws = torch.Generator().manual_seed(0)
    a = torch.rand(1, 3, 16, 16, generator=draws)
    b = torch.randn(1, 3, 16, 16, generator=draws) * 100
    hole = torch.zeros(1, 16, 16, dtype=torch.bool)
    hole[0, 4:8, 4:8] = True
    most = torch.rand(1, 16, 16, generator=draws) > 0.2
    alone = metrics.noisy_linear_imputation(a, hole, noise=0.0)
    beside = metrics.noisy_linear_imputation(torch.cat([a, b]), torch.cat([hole, most]), noise=0.0)
    reversed_order = metrics.noisy_linear_imputation(torch.cat([b, a]), torch.cat([most, hole]), noise=0.0)
    torch.testing.assert_close(beside[:1], alone, rtol=0, atol=1e-7)
    torch.testing.assert_close(reversed_order[1:], alone, rtol=0, atol=1e-7)
    # and it is ROAD's solution, to the solver's tolerance
    torch.testing.assert_close(alone[0].double(), dense_imputation(a[0], hole[0]), rtol=0, atol=1e-4)
    torch.testing.assert_close(beside[1].double(), dense_imputation(b[0], most[0]), rtol=0, atol=0.1)  # of ±300


def test_a_coarse_map_against_full_size_masks_says_to_resize_the_map():
    """A 6 × 5 CAM grid of a 12 × 10 image against the image's masks: the error says how to resize the maps, and
    doing so gives Arras et al.'s relevance mass accuracy, positive relevance inside / all positive relevance."""
    grid = torch.tensor([[1.0, -2.0, 0.0, 3.0, 1.0]] * 6)[None] * torch.arange(1.0, 7.0)[None, :, None]
    masks = torch.zeros(1, HEIGHT, WIDTH)
    masks[0, 2:8, 4:9] = 1
    with pytest.raises(ValueError, match=r"maps are coarser than the masks.*interpolate\(maps\[:, None\], "
                                         r"size=masks.shape\[-2:\], mode='bilinear'\)"):
        metrics.relevance_mass_accuracy(grid, masks)
    resized = torch.nn.functional.interpolate(grid[:, None], size=masks.shape[-2:], mode="bilinear")[:, 0]
    positive = resized.clamp_min(0)
    expected = (positive * masks).sum() / positive.sum()
    torch.testing.assert_close(metrics.relevance_mass_accuracy(resized, masks), expected[None])
