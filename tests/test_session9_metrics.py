"""Session 9: metrics attacked as a researcher who will publish the numbers.

Deterministic metrics (no user-given generator) must score an image alike alone and in any batch: the
seeded tie-breaking order (``ranking``, ``top_k_pixels``) and ROAD's imputation noise used to be drawn
once per row of the batch, so a constant (or plateaued) map, or any map under ROAD, scored differently
depending on which images it was evaluated with. Also checked by hand: deletion's curve and trapezoid
area on a linear model.
"""

from __future__ import annotations

import torch
from torch import nn

from explain import metrics
from explain.metrics._common import ranking


class Linear(nn.Module):
    """Logits W · flatten(x) + b."""

    def __init__(self, values: int, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(values, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def tiny() -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(0)
    return Linear(3 * 4 * 4).eval(), torch.randn(3, 3, 4, 4)


def test_ranking_of_a_map_does_not_depend_on_the_rest_of_the_batch():
    maps = torch.zeros(3, 4, 4)
    maps[1, 0, :2] = 1.0  # two tied maxima, the rest tied
    together = ranking(maps)
    for index in range(3):
        assert torch.equal(ranking(maps[index: index + 1])[0], together[index])
    # still a permutation per map, relevant pixels first, and seeded
    assert sorted(together[1].flatten().tolist()) == list(range(16))
    assert set(together[1, 0, :2].tolist()) == {0, 1}
    assert torch.equal(ranking(maps, seed=3), ranking(maps, seed=3))


def test_deletion_and_insertion_of_constant_maps_alone_as_in_a_batch():
    model, images = tiny()
    constant = torch.ones(3, 4, 4)
    for metric in (metrics.deletion, metrics.insertion):
        together = metric(model, images, constant, steps=4, substrate="zeros").area
        alone = torch.cat([metric(model, images[i: i + 1], constant[i: i + 1], steps=4, substrate="zeros").area
                           for i in range(3)])
        assert torch.allclose(together, alone, atol=1e-6), (metric.__name__, together, alone)


def test_road_alone_as_in_a_batch():
    model, images = tiny()
    maps = torch.randn(3, 4, 4)
    together = metrics.road(model, images, maps, percentages=(0.25, 0.5))
    alone = [metrics.road(model, images[i: i + 1], maps[i: i + 1], percentages=(0.25, 0.5)) for i in range(3)]
    assert torch.allclose(together.curves, torch.cat([curve.curves for curve in alone]), atol=1e-6)


def test_top_k_intersection_and_rank_accuracy_alone_as_in_a_batch():
    maps = torch.ones(4, 6, 6)
    masks = torch.zeros(4, 6, 6, dtype=torch.bool)
    masks[:, :3, :3] = True
    together = metrics.top_k_intersection(maps, masks, k=5)
    alone = torch.cat([metrics.top_k_intersection(maps[i: i + 1], masks[i: i + 1], k=5) for i in range(4)])
    assert torch.equal(together, alone)
    together = metrics.relevance_rank_accuracy(maps, masks)
    alone = torch.cat([metrics.relevance_rank_accuracy(maps[i: i + 1], masks[i: i + 1]) for i in range(4)])
    assert torch.equal(together, alone)


def test_deletion_by_hand_on_a_linear_model():
    """Logit 1·a + 2·b + 3·c + 4·d on a ones image; the map removes a, b, c, d in that order: logits 10, 9, 7,
    4, 0 at fractions 0, ¼, ½, ¾, 1 (steps + 1 points), trapezoid area ¼ · (9.5 + 8 + 5.5 + 2) = 6.25."""
    model = Linear(4, 2)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]))
        model.fc.bias.zero_()
    curve = metrics.deletion(model, torch.ones(1, 1, 2, 2), torch.tensor([[[4.0, 3.0], [2.0, 1.0]]]), target=0,
                             steps=4, score="logit")
    assert curve.fractions.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert curve.curves.tolist() == [[10.0, 9.0, 7.0, 4.0, 0.0]]
    assert abs(float(curve.area[0]) - 6.25) < 1e-6


def test_confidence_change_warns_at_the_callers_line_when_maps_are_not_in_0_1():
    """The image is multiplied by the map clipped to [0, 1]: a raw (or signed) map was silently clipped, e.g. a
    gradient map of peak 5 kept every pixel it touched whole, and a signed one dropped its negative half."""
    import warnings

    model, images = tiny()
    scaled = torch.rand(3, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.confidence_change(model, images, scaled)  # in [0, 1]: no warning
    raw = scaled.clone()
    raw[1] *= 5.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        change = metrics.confidence_change(model, images, raw)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "map 1 reaches outside" in messages[0] and "[0, 1]" in messages[0], messages
    assert caught[0].filename == __file__
    # the value itself is unchanged: the map clipped, by hand
    probabilities = torch.softmax(model(images), dim=1)
    classes = probabilities.argmax(dim=1)
    original = probabilities.gather(1, classes[:, None])[:, 0]
    masked = torch.softmax(model(images * raw.clamp(0, 1)[:, None]), dim=1).gather(1, classes[:, None])[:, 0]
    assert torch.allclose(change.drop, ((original - masked).clamp_min(0) / original).detach(), atol=1e-6)


def test_maps_not_in_the_inputs_proportions_are_refused_not_stretched():
    """A transposed map of a 4 × 6 image (6 × 4) was resized onto it without a word; a coarser grid in the
    input's proportions (2 × 3, or a layer's rounded 3 × 4 grid) is still resized, as before."""
    import pytest
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Linear(4 * 6, 2).eval()
    images = torch.randn(2, 1, 4, 6)
    maps = torch.rand(2, 4, 6)
    with pytest.raises(ValueError, match=r"6 × 4 do not have the shape of the 4 × 6 input.*transpose"):
        metrics.deletion(model, images, maps.transpose(-1, -2), steps=2)
    with pytest.raises(ValueError, match="proportions"):
        metrics.faithfulness_estimate(model, images, torch.rand(2, 4, 2), steps=2)
    coarse = torch.rand(2, 2, 3)
    resized = F.interpolate(coarse[:, None], size=(4, 6), mode="bilinear", align_corners=False)[:, 0]
    for grid in (coarse, torch.rand(2, 3, 4)):
        metrics.deletion(model, images, grid, steps=2)  # accepted
    assert torch.equal(metrics.deletion(model, images, coarse, steps=3).curves,
                       metrics.deletion(model, images, resized, steps=3).curves)


def test_randomisation_leaves_every_devices_generator_as_found():
    """``reinitialize`` seeded with ``torch.manual_seed`` inside ``fork_rng(devices=[])``: the CPU's generator was
    restored, but CUDA's (and MPS's) were reseeded for good, or, CUDA not yet in use, a seed was queued that
    CUDA applies when first used: a user's later GPU draws (dropout, SmoothGrad noise) repeated from the
    metric's seed. The re-initialised weights are still the seed's."""
    import pytest

    from explain.metrics.sanity import reinitialize

    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None or torch.cuda.is_initialized():
        pytest.skip("needs torch's lazy CUDA seed queue, CUDA not yet in use")
    queued = list(tracker.get_calls())
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    cpu_state = torch.get_rng_state()
    reinitialize(first, 7)
    reinitialize(second, 7)
    assert tracker.get_calls() == queued  # nothing queued for CUDA
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(first.weight, second.weight) and torch.equal(first.bias, second.bias)
    torch.manual_seed(7)
    expected = nn.Linear(3, 2)
    assert torch.equal(first.weight, expected.weight)  # the seed's draws, as before the fix


def test_randomisation_leaves_the_cuda_generator_as_found():
    import pytest

    from explain.metrics.sanity import reinitialize

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer, again = nn.Linear(3, 2).cuda(), nn.Linear(3, 2).cuda()
    state = torch.cuda.get_rng_state()
    reinitialize(layer, 7)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    reinitialize(again, 7)
    assert torch.equal(layer.weight, again.weight)
