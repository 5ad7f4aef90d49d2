"""Hostile-user checks of deep feature factorisation and XRAI's segmentation: the "auto" classifier is
the nn.Linear that returns the model's output (not a hidden layer of an MLP head, a projection or a
transformer's MLP), degenerate layers and options are refused with a clear message, the result matches
pytorch-grad-cam's DFF and PAIR's segmentation where the computation is the same, and the greedy region
selection matches a slow by-hand loop."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import SmallCNN, assert_state_equal, model_state
from torch import nn

import explain
from explain.methods.xrai import Felzenszwalb, rank_regions

X = torch.rand(3, 3, 12, 20, generator=torch.Generator().manual_seed(0))


class Features(nn.Module):
    """conv → ReLU (16 channels) → mean over positions → ``head``; ``extra`` modules are registered after it."""

    def __init__(self, head: nn.Module, **extra: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.head = head
        for name, module in extra.items():
            self.add_module(name, module)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def factorize(model, layer="features.1", **options):
    options.setdefault("iterations", 100)
    return explain.DeepFeatureFactorization(model, layer, concepts=2, **options).factorize(X)


def test_auto_classifier_skips_a_projection_registered_after_the_classifier():
    model = Features(nn.Linear(16, 5), projection=nn.Linear(16, 8)).eval()  # the old lookup took `projection`
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = factorize(model)
    with torch.no_grad():
        expected = model.head(result.concepts)
    torch.testing.assert_close(result.concept_scores, expected)


def test_auto_classifier_is_not_the_hidden_layer_of_an_mlp_head():
    model = Features(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))).eval()
    with pytest.warns(UserWarning, match=r"no classifier.*head\.0.*hidden layers"):
        result = factorize(model)
    assert result.concept_scores is None  # the old lookup scored "classes" that were head.0's 32 hidden units
    assert result.top_classes() == [[], []]
    explicit = factorize(model, classifier=model.head)
    with torch.no_grad():
        torch.testing.assert_close(explicit.concept_scores, model.head(explicit.concepts))


class Tokens(nn.Module):
    """A transformer-like model: a class token and 3 × 5 patch tokens, a ReLU MLP (8 → 4) on every token, a
    head on the class token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patches = nn.Conv2d(3, 8, 4, stride=4)
        self.cls_token = nn.Parameter(torch.ones(1, 1, 8))
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = self.act(torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1))
        return self.head(self.fc2(tokens)[:, 0])


def test_a_transformer_mlp_layer_is_not_scored_by_its_projection_and_its_class_token_is_dropped():
    model = Tokens().eval()
    with pytest.warns(UserWarning, match=r"no classifier.*fc2"):
        result = factorize(model, "act")
    assert result.concept_scores is None  # the old lookup gave (2, 4) "class" scores from fc2
    # the class token is not a position: A ≈ W H over the 3 × 5 patch tokens only
    with torch.no_grad():
        tokens = model.act(model.patches(X).flatten(2).transpose(1, 2)).double()  # (N, 15, 8)
    reconstruction = torch.einsum("kc,nkhw->nhwc", result.concepts.double(), result.low_res_maps.double())
    error = float((reconstruction.reshape(3, 15, 8) - tokens).norm() / tokens.norm())
    assert result.low_res_maps.shape == (3, 2, 3, 5)
    assert error == pytest.approx(result.relative_error, rel=1e-5)


def test_auto_classifier_warns_when_the_layer_is_not_pooled_straight_into_it():
    class Deeper(Features):
        def forward(self, x):
            return self.head(self.more(self.features(x)).mean(dim=(2, 3)))

    model = Deeper(nn.Linear(16, 5), more=nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())).eval()
    with pytest.warns(UserWarning, match=r"'head'.*not the layer's average"):
        factorize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        factorize(model, "more.1")  # pooled straight into the head: no warning
        with torch.autocast("cpu", dtype=torch.bfloat16):  # nor from bfloat16 rounding
            factorize(model, "more.1")


def test_a_layer_that_is_zero_everywhere_is_refused():
    model = Features(nn.Linear(16, 5)).eval()
    with torch.no_grad():
        model.features[0].weight.zero_()
        model.features[0].bias.fill_(-1.0)
    with pytest.raises(ValueError, match="0 everywhere"):  # was: maps of 0 and "concepts" scored by the bias alone
        factorize(model)


def test_options_are_checked_and_more_concepts_than_channels_are_refused():
    model = Features(nn.Linear(16, 5)).eval()
    for options, match in [({"iterations": 0}, "iterations"), ({"concepts": 2.5}, "concepts"),
                           ({"concepts": True}, "concepts"), ({"tolerance": float("nan")}, "tolerance")]:
        with pytest.raises(ValueError, match=match):
            explain.DeepFeatureFactorization(model, "features.1", **options)
    with pytest.raises(TypeError, match="classifier"):
        explain.DeepFeatureFactorization(model, "features.1", classifier="head")
    with pytest.raises(ValueError, match=r"\(2, classes\)"):
        factorize(model, classifier=lambda profiles: profiles.sum(dim=1))
    with pytest.raises(ValueError, match="concepts ≤ 16"):
        explain.DeepFeatureFactorization(model, "features.1", concepts=17, classifier=None,
                                                  iterations=3).factorize(X[:1])


def test_the_model_is_left_as_found_with_the_auto_classifier_also_when_the_forward_fails():
    model = SmallCNN().train()
    before = model_state(model)
    result = explain.DeepFeatureFactorization(model, "features.8", concepts=2).factorize(X)
    assert result.concept_scores.shape == (2, 5)
    assert_state_equal(before, model_state(model))

    class Failing(Features):
        def forward(self, x):
            self.features(x)
            raise RuntimeError("boom")

    failing = Failing(nn.Linear(16, 5)).train()
    before = model_state(failing)
    with pytest.raises(RuntimeError, match="boom"):  # ModelInputError is a RuntimeError
        explain.DeepFeatureFactorization(failing, "features.1").factorize(X)
    assert_state_equal(before, model_state(failing))


def test_one_concept_equals_pytorch_grad_cam_s_dff():
    """For k = 1, non-negative matrix factorisation is unique up to scale (the leading singular pair), so our
    heat map (peak 1) equals pytorch-grad-cam's H / max H; for k = 3 we reconstruct at least as well."""
    gradcam = pytest.importorskip("pytorch_grad_cam.feature_factorization.deep_feature_factorization")
    model = Features(nn.Linear(16, 5)).eval()
    with torch.no_grad():
        model.features[0].bias.copy_(-model.features[0].bias.abs())
    images = torch.cat([X, torch.zeros(1, 3, 12, 20)])  # all channels 0 on the black image (negative biases)
    with torch.no_grad():
        activations = model.features(images).numpy().astype(np.float64)
    assert (activations.min(axis=(0, 2, 3)) == 0).all()  # grad-cam's per-channel shift is 0: the same problem
    ours = explain.DeepFeatureFactorization(model, "features.1", concepts=1).factorize(images)
    _, theirs = gradcam.dff(activations.copy(), n_components=1)
    np.testing.assert_allclose(ours.low_res_maps[:, 0].numpy(), theirs[:, 0] / theirs.max(), atol=2e-3)
    ours = explain.DeepFeatureFactorization(model, "features.1", concepts=3).factorize(images)
    concepts, maps = gradcam.dff(activations.copy(), n_components=3)
    their_error = np.linalg.norm(activations - np.einsum("ck,nkhw->nchw", concepts, maps)) / np.linalg.norm(activations)
    assert ours.relative_error <= their_error * 1.001


# ------------------------------------------------------------------ XRAI's segmentation and greedy selection


def test_felzenszwalb_takes_one_channel_images_with_or_without_the_channel_dimension():
    image = torch.rand(1, 40, 56, generator=torch.Generator().manual_seed(1))
    segments = Felzenszwalb()(image)
    assert torch.equal(Felzenszwalb()(image[0]), segments)  # was: a RuntimeError from permute
    try:
        from saliency.core import xrai as pair_xrai
    except ImportError:
        return
    theirs = [mask for mask in pair_xrai._get_segments_felzenszwalb(image.permute(1, 2, 0).numpy()) if mask.any()]
    assert np.array_equal(segments.numpy(), np.stack(theirs))


def test_felzenszwalb_refuses_channels_last_and_non_finite_images_and_segments_4_channels_quietly():
    image = torch.rand(3, 20, 24, generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="channels last"):  # was: (18, 20, 3) masks of a 20 × 3 "image"
        Felzenszwalb()(image.permute(1, 2, 0))
    broken = image.clone()
    broken[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):  # was: one segment, as for a constant image
        Felzenszwalb()(broken)
    four = torch.rand(4, 20, 24, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was: scikit-image's "third dimension of 4" warning, once per scale
        segments = Felzenszwalb()(four)
    try:
        from saliency.core import xrai as pair_xrai
    except ImportError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = [mask for mask in pair_xrai._get_segments_felzenszwalb(four.permute(1, 2, 0).numpy()) if mask.any()]
    assert np.array_equal(segments.numpy(), np.stack(theirs))


def greedy_by_hand(attribution: np.ndarray, masks: np.ndarray, min_pixel_diff: int) -> list[tuple[set, float]]:
    """XRAI's greedy step, slowly: repeatedly drop the segments adding < min_pixel_diff new pixels and add the one
    whose new pixels have the highest mean attribution (the first on a tie); the rest is a last region."""
    covered = np.zeros(attribution.shape, dtype=bool)
    remaining = list(range(len(masks)))
    regions = []
    while True:
        remaining = [i for i in remaining if (masks[i] & ~covered).sum() >= min_pixel_diff]
        if not remaining:
            break
        gains = [attribution[masks[i] & ~covered].mean() for i in remaining]
        best = remaining[int(np.argmax(gains))]
        new = masks[best] & ~covered
        regions.append((set(zip(*np.nonzero(new))), attribution[new].mean()))
        covered |= masks[best]
        remaining.remove(best)
    if not covered.all():
        regions.append((set(zip(*np.nonzero(~covered))), attribution[~covered].mean()))
    return regions


def test_greedy_selection_equals_a_slow_loop_on_overlapping_segments():
    generator = np.random.default_rng(4)
    for _ in range(5):
        attribution = generator.normal(size=(9, 11))
        masks = np.zeros((12, 9, 11), dtype=bool)
        for mask in masks:  # random overlapping rectangles
            top, left = generator.integers(0, 7), generator.integers(0, 9)
            mask[top:top + generator.integers(2, 6), left:left + generator.integers(2, 6)] = True
        regions = rank_regions(torch.from_numpy(attribution), torch.from_numpy(masks), min_pixel_diff=3)
        expected = greedy_by_hand(attribution, masks, 3)
        assert len(regions.masks) == len(expected)
        for mask, gain, (pixels, their_gain) in zip(regions.masks.numpy(), regions.gains.tolist(), expected):
            assert set(zip(*np.nonzero(mask))) == pixels
            assert gain == pytest.approx(their_gain, rel=1e-12)
