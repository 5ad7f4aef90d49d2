"""Each metric against a case worked out by hand."""

from __future__ import annotations

import pytest
import torch
from conftest import ConvGapLinear, assert_state_equal, model_state
from torch import nn

import explain
from explain import metrics
from explain.metrics.sanity import average_ranks

SIZE = (16, 16)


def square_mask(count: int = 1) -> torch.Tensor:
    mask = torch.zeros(count, *SIZE, dtype=torch.bool)
    mask[:, 4:12, 4:12] = True  # a quarter of the image
    return mask


def test_a_map_equal_to_the_mask_scores_one_everywhere():
    mask = square_mask(3)
    heat = mask.float()
    for metric in (metrics.pointing_game, metrics.energy_pointing_game, metrics.relevance_mass_accuracy,
                   metrics.relevance_rank_accuracy):
        assert metric(heat, mask).tolist() == [1.0, 1.0, 1.0], metric.__name__
    boxes = torch.tensor([[4, 4, 11, 11]] * 3)
    assert metrics.energy_pointing_game(heat, boxes).tolist() == [1.0] * 3


def test_random_maps_score_near_the_mask_area_fraction():
    torch.manual_seed(0)
    mask = square_mask(400)
    heat = torch.rand(400, *SIZE)
    for metric in (metrics.energy_pointing_game, metrics.relevance_mass_accuracy, metrics.relevance_rank_accuracy):
        assert abs(metric(heat, mask).mean().item() - 0.25) < 0.01, metric.__name__
    assert abs(metrics.pointing_game(heat, mask).mean().item() - 0.25) < 0.06


def test_pointing_game_tolerance_is_a_euclidean_radius_and_constant_maps_miss():
    mask = torch.zeros(1, *SIZE, dtype=torch.bool)
    mask[0, 8, 8] = True
    heat = torch.zeros(1, *SIZE)
    heat[0, 8, 11] = 1.0  # 3 px to the right
    assert metrics.pointing_game(heat, mask, tolerance=2).item() == 0
    assert metrics.pointing_game(heat, mask, tolerance=3).item() == 1
    heat[0, 8, 11], heat[0, 11, 11] = 0.0, 1.0  # 3√2 ≈ 4.24 px away diagonally
    assert metrics.pointing_game(heat, mask, tolerance=4).item() == 0
    assert metrics.pointing_game(heat, mask, tolerance=4.3).item() == 1
    assert metrics.pointing_game(torch.ones(1, *SIZE), torch.ones(1, *SIZE)).item() == 0


def test_relevance_metrics_by_hand():
    mask = torch.tensor([[[1, 1], [0, 0]]], dtype=torch.bool)
    heat = torch.tensor([[[3.0, -1.0], [1.0, 0.0]]])
    assert metrics.relevance_mass_accuracy(heat, mask).item() == pytest.approx(3 / 4)  # positive mass only
    assert metrics.relevance_rank_accuracy(heat, mask).item() == pytest.approx(1 / 2)  # top-2: 3.0 in, 1.0 out


class MeanModel(nn.Module):
    """Logits (mean of x, −mean of x): the score of class 0 is the mean pixel value."""

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3))
        return torch.stack([mean, -mean], dim=1)


def test_constant_map_deletion_and_insertion_curves_are_what_the_substrate_gives():
    image = torch.full((1, 3, *SIZE), 2.0)
    constant = torch.ones(1, *SIZE)
    steps = 8
    removed_share = torch.arange(steps + 1) / steps
    deleted = metrics.deletion(MeanModel(), image, constant, target=0, steps=steps, substrate="zeros", score="logit")
    torch.testing.assert_close(deleted.fractions, removed_share)
    torch.testing.assert_close(deleted.curves[0], 2.0 * (1 - removed_share))
    assert deleted.area.item() == pytest.approx(1.0)  # mean of a line from 2 to 0
    inserted = metrics.insertion(MeanModel(), image, constant, target=0, steps=steps, substrate="zeros", score="logit")
    torch.testing.assert_close(inserted.curves[0], 2.0 * removed_share)
    filled = metrics.deletion(MeanModel(), image, constant, target=0, steps=steps, score="logit",
                              substrate=lambda batch: torch.full_like(batch, 5.0))
    torch.testing.assert_close(filled.curves[0], 2.0 + 3.0 * removed_share)


def test_deletion_follows_the_maps_order():
    image = torch.zeros(1, 1, 2, 2)
    image[0, 0] = torch.tensor([[4.0, 3.0], [2.0, 1.0]])
    heat = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])  # relevance: bottom-right first
    curve = metrics.deletion(MeanModel(), image, heat, target=0, steps=4, substrate="zeros", score="logit")
    torch.testing.assert_close(curve.curves[0], torch.tensor([10.0, 9.0, 7.0, 4.0, 0.0]) / 4)


def test_noisy_linear_imputation_reproduces_a_linear_ramp_inside_the_image():
    rows, columns = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    ramp = (0.3 * rows - 0.2 * columns + 1.0).expand(1, 3, 16, 16).clone()
    removed = torch.zeros(1, 16, 16, dtype=torch.bool)
    removed[0, 3:13, 5:11] = True
    imputed = metrics.noisy_linear_imputation(ramp, removed, noise=0.0)
    torch.testing.assert_close(imputed, ramp, rtol=0, atol=1e-3)  # the solver stops at a 1e-4 relative residual
    noisy = metrics.noisy_linear_imputation(ramp, removed, noise=0.01)
    assert torch.equal(noisy[:, :, ~removed[0]], ramp[:, :, ~removed[0]])  # known pixels are kept
    assert 0 < (noisy - ramp)[:, :, removed[0]].std() < 0.1


def test_road_removes_the_most_or_least_relevant_share():
    image = torch.zeros(1, 1, 16, 16)
    image[0, 0, :, 8:] = 10.0  # right half bright
    heat = torch.zeros(1, 16, 16)
    heat[0, :, 8:] = 1.0  # the map points at the right half
    morf = metrics.road(MeanModel(), image, heat, target=0, percentages=[0.5], noise=0.0, score="logit")
    lerf = metrics.road(MeanModel(), image, heat, target=0, order="lerf", percentages=[0.5], noise=0.0, score="logit")
    # removing the bright half and imputing from the dark half leaves a dark image, and vice versa
    assert morf.area.item() == pytest.approx(0.0, abs=1e-3)
    assert lerf.area.item() == pytest.approx(10.0, abs=1e-3)


def test_confidence_change_by_hand():
    image = torch.full((2, 1, 2, 2), 1.0)
    heat = torch.tensor([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    change = metrics.confidence_change(MeanModel(), image, heat, target=0)
    y = torch.softmax(torch.tensor([1.0, -1.0]), 0)[0]  # logits (1, −1) on the image
    o = torch.tensor(0.5)  # logits (0, 0) on the image masked to zero
    torch.testing.assert_close(change.drop, torch.stack([torch.tensor(0.0), (y - o) / y]))
    assert change.increase.tolist() == [0.0, 0.0]


def test_metrics_accept_an_explanation_and_use_its_targets():
    torch.manual_seed(0)
    model = ConvGapLinear().eval()
    x = torch.randn(2, 3, 8, 8)
    explanation = explain.GradCAM(model, "conv").explain(x, target=[2, 1])
    from_explanation = metrics.deletion(model, x, explanation, steps=4)
    from_tensor = metrics.deletion(model, x, explanation.maps, target=[2, 1], steps=4)
    torch.testing.assert_close(from_explanation.curves, from_tensor.curves)
    with torch.no_grad():
        torch.testing.assert_close(from_explanation.curves[:, 0], model(x).softmax(1)[[0, 1], [2, 1]])
    many = explain.GradCAM(model, "conv").explain(x, topk=2)
    with pytest.raises(ValueError, match="several targets"):
        metrics.deletion(model, x, many)


def test_rank_helpers_by_hand():
    assert average_ranks(torch.tensor([[1.0, 2.0, 2.0, 3.0]])).tolist() == [[1.0, 2.5, 2.5, 4.0]]
    values = torch.rand(3, 50)
    torch.testing.assert_close(metrics.spearman(values, values), torch.ones(3))
    torch.testing.assert_close(metrics.spearman(values, -values), -torch.ones(3))
    torch.testing.assert_close(metrics.spearman(values, values ** 3), torch.ones(3))  # monotone: ranks equal
    maps = torch.rand(2, 16, 16)
    torch.testing.assert_close(metrics.ssim(maps, maps), torch.ones(2))
    assert (metrics.ssim(maps, torch.rand(2, 16, 16)) < 0.3).all()


def test_cascading_randomization_top_layer_first_on_a_copy():
    torch.manual_seed(0)
    model = ConvGapLinear(channels=6).eval()
    x = torch.randn(4, 3, 8, 8)
    before = model_state(model)
    stages = metrics.cascading_randomization(explain.EigenCAM(model, "conv"), x)
    assert_state_equal(before, model_state(model))  # the model given is not changed
    assert [stage.layer for stage in stages] == ["fc", "conv"]
    assert stages[1].layers == ["fc", "conv"]
    # Eigen-CAM at conv ignores fc: randomising fc leaves its maps exactly as they were
    torch.testing.assert_close(stages[0].rank_correlation, torch.ones(4))
    torch.testing.assert_close(stages[0].ssim, torch.ones(4))
    assert (stages[1].rank_correlation < 0.99).all()
    gradcam = metrics.cascading_randomization(explain.GradCAM(model, "conv"), x)
    assert (gradcam[0].rank_correlation < 0.99).all()  # Grad-CAM's weights come from fc
