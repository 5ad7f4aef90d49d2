"""A BatchNorm without running statistics normalises with the batch's own statistics, also in eval mode: the images
of one call (and the copies a method runs together) change each other's maps. A call warns where that happens."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import explain


def tiny(track_running_stats: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=track_running_stats),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


def test_two_images_through_batch_statistics_warn_and_their_maps_do_depend_on_each_other() -> None:
    model, images = tiny(False), torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="track_running_stats=False.*change each other's maps"):
        together = explain.Saliency(model).explain(images, target=0).raw_maps
    alone = explain.Saliency(model).explain(images[:1], target=0).raw_maps
    assert not torch.allclose(together[:1], alone)  # the premise: the warning is not idle


def test_one_image_with_one_pass_and_running_statistics_do_not_warn() -> None:
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.Saliency(tiny(False)).explain(images[:1], target=0)
        explain.IntegratedGradients(tiny(True), steps=8).explain(images, target=0)


def test_ss_cam_gives_an_image_the_same_map_alone_and_anywhere_in_its_batch() -> None:
    """SS-CAM's seeded noise is one image's draw per sample, shared by the batch's images: an image's map does not
    depend on the other images of its call (it drew noise of the batch's shape, so each image got other draws)."""
    model = tiny(True)
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    explainer = explain.SSCAM(model, "0", samples=3, noise_std=0.5, normalize=None, progress=False)
    together = explainer.explain(images, target=[0, 1, 2]).raw_maps
    reordered = explainer.explain(images[[2, 0, 1]], target=[2, 0, 1]).raw_maps
    for index in range(3):
        alone = explainer.explain(images[index:index + 1], target=index).raw_maps
        torch.testing.assert_close(together[index], alone[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(reordered, together[[2, 0, 1]], rtol=1e-5, atol=1e-7)
