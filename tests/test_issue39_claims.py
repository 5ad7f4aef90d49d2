"""Issue 39, point 2: benchmarks/claims.py's paired bootstrap and per-image metrics, against cases whose answer is
known: a constant difference, the normal approximation of a mean's interval, the pooled statistics of
benchmarks/quality.py (which claims.py resamples per image), and the verdict's sides."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_PATH = list(sys.path)
sys.path.insert(0, str(BENCHMARKS))
try:
    import claims  # noqa: E402
    import quality  # noqa: E402
finally:
    sys.path[:] = _PATH  # benchmarks/ (which the scripts also add) stays off sys.path for the other tests


def test_a_constant_paired_difference_has_an_interval_of_one_point():
    base = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 10  # large spread between images
    interval = claims.paired_bootstrap(claims.mean_statistic, base + 0.25, base, strata=[20, 30])
    assert interval.estimate == pytest.approx(0.25)
    assert interval.low == pytest.approx(0.25) and interval.high == pytest.approx(0.25)
    assert interval.per_stratum == pytest.approx([0.25, 0.25])


@pytest.mark.parametrize("count", [400, 900])
def test_the_interval_of_a_mean_matches_the_normal_approximation(count):
    """Values ±1 in equal numbers: mean 0, standard error 1/√n, so the 95 % interval is about ±1.96/√n."""
    values = torch.tensor([1.0, -1.0]).repeat(count // 2)
    interval = claims.paired_bootstrap(claims.mean_statistic, values, None, strata=[count])
    half_width = 1.96 / math.sqrt(count)
    assert interval.estimate == pytest.approx(0.0, abs=1e-12)
    assert interval.low == pytest.approx(-half_width, rel=0.12)
    assert interval.high == pytest.approx(half_width, rel=0.12)


def test_pairing_removes_the_spread_between_images():
    """first = x + noise, second = x: the paired interval has the width of the noise's mean (0.1 · 1.96/√n · 2), not
    of x's (10 times larger)."""
    generator = torch.Generator().manual_seed(2)
    count = 600
    images = torch.randn(count, generator=generator)
    noise = 0.1 * torch.randn(count, generator=generator)
    paired = claims.paired_bootstrap(claims.mean_statistic, images + noise, images, strata=[count])
    expected_width = 2 * 1.96 * noise.std().item() / math.sqrt(count)
    assert paired.high - paired.low == pytest.approx(expected_width, rel=0.15)
    assert paired.estimate == pytest.approx(noise.mean().item(), abs=1e-6)


def test_resampling_stays_within_each_stratum_and_is_reproducible():
    indices = claims.resample_indices([3, 5], resamples=400, seed=7)
    assert indices.shape == (400, 8)
    assert bool((indices[:, :3] < 3).all()) and bool(((indices[:, 3:] >= 3) & (indices[:, 3:] < 8)).all())
    assert set(indices[:, :3].flatten().tolist()) == {0, 1, 2}  # every image can be drawn
    assert torch.equal(indices, claims.resample_indices([3, 5], resamples=400, seed=7))
    values = torch.tensor([1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0])
    interval = claims.paired_bootstrap(claims.mean_statistic, values, None, strata=[3, 5])
    assert interval.per_stratum == [1.0, 5.0]
    assert interval.low == interval.high == pytest.approx(3.5)  # a stratified draw keeps the 3 : 5 weights


@pytest.mark.parametrize("map_size", [16, 64])
def test_pooled_iou_over_every_image_is_quality_py_s_miou(map_size):
    """claims.py resamples per-image pixel counts; on all images it gives the mIoU of quality.segmentation_scores
    (pooled over images, not a mean of per-image IoUs), with maps at the masks' size or upsampled from 16 px."""
    generator = torch.Generator().manual_seed(3)
    maps = torch.rand(9, map_size, map_size, generator=generator)
    masks = torch.rand(9, 64, 64, generator=generator) > torch.linspace(0.3, 0.99, 9).view(9, 1, 1)  # objects of 1–70 %
    parts = quality.segmentation_parts(maps, masks)
    counts = torch.cat([parts.intersections, parts.unions], dim=1)
    pooled = claims.pooled_iou_statistic(counts, torch.arange(9)[None]).item()
    assert pooled == pytest.approx(quality.segmentation_scores(maps, masks)["mIoU"], abs=1e-6)
    per_image_mean = (parts.intersections.double() / parts.unions.double()).mean().item()
    assert pooled != pytest.approx(per_image_mean, abs=1e-2)  # the pooled statistic differs from a per-image mean


def test_per_image_perturbation_auc_averages_to_quality_py_s_auc():
    """The positive and negative AUC per image (100 × trapezoid of the 0/1 correctness curve) average to
    quality.perturbation_scores' AUC of the accuracy curve."""
    from explain.data import make_dataset
    from explain.data.train import to_model_input

    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 5, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 4)).eval()
    data = make_dataset(8, seed=5)
    batch = to_model_input(data.images)
    with torch.no_grad():
        labels = model(batch).argmax(dim=1)  # right on the clean images, so the curves fall as pixels go
    images = claims.ImageSet(5, data.images, data.masks, batch, labels)
    maps = torch.rand(8, 64, 64, generator=torch.Generator().manual_seed(6))
    pooled = quality.perturbation_scores(model, batch, maps, labels)
    for metric in ("pos. AUC ↓", "neg. AUC ↑"):
        values = claims.per_image(metric, model, images, maps, "unused", "unused", "transformers")
        assert values.shape == (8,)
        assert values.mean().item() == pytest.approx(pooled[metric], abs=1e-4)


def test_the_verdict_reads_each_metric_s_direction():
    above = claims.Interval(estimate=0.1, low=0.05, high=0.15, per_stratum=[0.1, 0.1])
    straddles = claims.Interval(estimate=0.1, low=-0.01, high=0.2, per_stratum=[0.1, 0.1])
    split = claims.Interval(estimate=0.1, low=0.02, high=0.2, per_stratum=[0.3, -0.01])
    assert claims.verdict(above, "mIoU", ">") == "holds"  # higher is better: A − B > 0 is A better
    assert claims.verdict(above, "ROAD MoRF ↓", ">") == "reversed"  # lower is better: A − B > 0 is A worse
    assert claims.verdict(above, "ROAD MoRF ↓", "<") == "holds"
    assert claims.verdict(straddles, "mIoU", ">") == "no measurable difference"
    assert claims.verdict(split, "mIoU", ">") == "no measurable difference"  # one seed disagrees
    assert claims.verdict(straddles, "mIoU", "=") == "holds" and claims.verdict(above, "mIoU", "=") == "differs"
    assert claims.verdict(above, "mIoU", "?") == ""


def test_every_claim_names_a_metric_with_a_direction_and_a_known_part():
    keys = [item.key for item in claims.CLAIMS]
    assert len(keys) == len(set(keys))
    for item in claims.CLAIMS:
        assert item.metric in claims.HIGHER_IS_BETTER, item.key
        assert item.part in ("cnn", "transformers", "vlm") and item.expected in (">", "<", "=", "?", ""), item.key
