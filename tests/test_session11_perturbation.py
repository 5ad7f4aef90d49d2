"""Session 11: the perturbation CAMs (Score-CAM, IS-CAM, SS-CAM, Ablation-CAM) and Smooth Grad-CAM++ under
hostile use, each against an independent slow computation written from its paper (one forward per channel).

Peer: pytorch-grad-cam 1.5.7 (``pip install --no-deps grad-cam==1.5.7``; skipped when absent). Its Ablation-CAM
divides by y, ours by |y| (equal where y > 0); its Score-CAM upsamples with align_corners=True (the authors'
code, like ours, with align_corners=False), so the two agree where the layer has the input's resolution.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_equal, model_state
from torch import Tensor, nn

import explain


def peer(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (pip install --no-deps grad-cam==1.5.7)")


class ConvPoolLinear(nn.Module):
    """conv → ReLU (the explained layer, ``act``) → optional BatchNorm → global max pool → linear."""

    def __init__(self, channels: int = 5, classes: int = 3, norm: nn.Module | None = None, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, stride=stride)
        self.act = nn.ReLU()
        self.norm = norm or nn.Identity()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(self.act(self.conv(x))).amax(dim=(2, 3)))

    def features(self, x: Tensor) -> Tensor:
        return self.act(self.conv(x))


def score_cam_by_hand(model: ConvPoolLinear, image: Tensor, target: int, scales: tuple[float, ...] = (1.0,),
                      divisor: int = 1, align_corners: bool = False) -> Tensor:
    """Score-CAM (Wang et al. 2020, Algorithm 1), one masked input per forward pass: M_k = s(Up(A_k)),
    α_k = softmax over k of Σ_c f^c(c M_k ∘ X) / divisor, map ReLU(Σ_k α_k A_k). IS-CAM: scales c_i."""
    with torch.no_grad():
        features = model.features(image[None])[0]
        scores = []
        for channel in features:
            upsampled = F.interpolate(channel[None, None], size=image.shape[-2:], mode="bilinear",
                                      align_corners=align_corners)[0, 0]
            span = upsampled.max() - upsampled.min()
            mask = (upsampled - upsampled.min()) / span if span > 0 else torch.zeros_like(upsampled)
            scores.append(sum(model((scale * mask * image)[None])[0, target] for scale in scales) / divisor)
        weights = torch.stack(scores).softmax(dim=0)
        return torch.relu((weights[:, None, None] * features).sum(0))


def ablation_cam_by_hand(model: ConvPoolLinear, image: Tensor, target: int) -> tuple[Tensor, Tensor]:
    """Ablation-CAM weights (y − y_k)/|y| (the paper's (y − y_k)/y where y > 0) and the map before ReLU, one image
    alone and one ablated channel per forward pass."""
    with torch.no_grad():
        features = model.features(image[None])
        y = model.fc(model.norm(features).amax(dim=(2, 3)))[0, target]
        weights = []
        for channel in range(features.shape[1]):
            ablated = features.clone()
            ablated[:, channel] = 0
            weights.append((y - model.fc(model.norm(ablated).amax(dim=(2, 3)))[0, target]) / y.abs())
        weights_tensor = torch.stack(weights)
        return weights_tensor, (weights_tensor[:, None, None] * features[0]).sum(0)


def low_res(explanation: explain.Explanation) -> Tensor:
    assert explanation.low_res_maps is not None
    return explanation.low_res_maps[0]


# ---------------------------------------------------------------- Ablation-CAM: the sign of the score


def opposing_halves_model() -> ConvPoolLinear:
    """Channel 0 copies the image's channel 0, channel 1 its channel 1; class 0's logit is max A_0 − max A_1 − 10 < 0:
    channel 0 supports class 0 (ablating it lowers the logit), channel 1 speaks against it."""
    model = ConvPoolLinear(channels=2, classes=2)
    with torch.no_grad():
        model.conv.weight.zero_()
        model.conv.bias.zero_()
        model.conv.weight[0, 0, 1, 1] = 1.0
        model.conv.weight[1, 1, 1, 1] = 1.0
        model.fc.weight.copy_(torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
        model.fc.bias.copy_(torch.tensor([-10.0, 0.0]))
    return model.eval()


def opposing_halves_image() -> Tensor:
    image = torch.zeros(3, 8, 8)
    image[0, :, :4] = 2.0  # the supporting channel on the left
    image[1, :, 4:] = 1.0  # the opposing channel on the right
    return image


def test_ablation_cam_weights_divide_by_the_magnitude_of_a_negative_score():
    """y = 2 − 1 − 10 = −9. The paper's (y − y_k)/y would weigh the supporting channel 0 by 2/(−9) < 0 and the
    opposing channel 1 by 1/9 > 0: a map of the right half, what speaks against class 0. (y − y_k)/|y| keeps the
    signs of the drops: the left half. Before: the map (after ReLU) was the right half."""
    model = opposing_halves_model()
    image = opposing_halves_image()
    explanation = explain.AblationCAM(model, "act", relu=False, progress=False).explain(image, target=0)
    weights, by_hand = ablation_cam_by_hand(model, image, 0)
    torch.testing.assert_close(weights, torch.tensor([2 / 9, -1 / 9]))  # (y − y_k)/|y|
    maps = low_res(explanation)[0, 0]
    torch.testing.assert_close(maps, by_hand)
    assert bool((maps[:, :4] > 0).all()) and bool((maps[:, 4:] < 0).all())
    relu_map = low_res(explain.AblationCAM(model, "act", progress=False).explain(image, target=0))[0, 0]
    assert bool((relu_map[:, :4] > 0).all()) and bool((relu_map[:, 4:] == 0).all())


def test_ablation_cam_equals_pytorch_grad_cam_where_the_score_is_positive_and_differs_in_sign_where_negative():
    """pytorch-grad-cam 1.5.7 divides by y: equal maps (before ReLU) where y > 0, negated where y < 0."""
    peer("pytorch_grad_cam")
    from pytorch_grad_cam import AblationCAM as PeerAblationCAM

    torch.manual_seed(0)
    model = ConvPoolLinear(channels=4, classes=4).eval()
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        logits = model(images)
    targets = [1, 2]
    scores = logits[torch.arange(2), targets]
    assert bool((scores > 0).any()) and bool((scores < 0).any()), "the test needs a positive and a negative score"
    ours = low_res(explain.AblationCAM(model, "act", relu=False, progress=False).explain(images, target=targets))

    class Logit:
        def __init__(self, index: int):
            self.index = index

        def __call__(self, output: Tensor) -> Tensor:
            return output[self.index]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        their = PeerAblationCAM(model, [model.act], batch_size=3)
        features = model.features(images).detach()
        weights = torch.as_tensor(their.get_cam_weights(images, model.act, [Logit(t) for t in targets],
                                                        features.numpy(), None))
    their_maps = (weights[:, :, None, None] * features).sum(1)
    torch.testing.assert_close(ours[:, 0], their_maps * scores.sign()[:, None, None], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- Score-CAM family: batches and chunks


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_score_cam_equals_the_paper_image_by_image_whatever_the_batch_size(batch_size: int):
    """Two images, a target each, 6 channels (one all-zero, one a duplicate of another): batch sizes that do not
    divide the 2 × 6 masks give the slow one-mask-per-pass computation."""
    torch.manual_seed(1)
    model = ConvPoolLinear(channels=6, classes=3, stride=2).eval()
    with torch.no_grad():
        model.conv.weight[5] = model.conv.weight[4]
        model.conv.bias[5] = model.conv.bias[4]
        model.conv.weight[3] = 0.0
        model.conv.bias[3] = -1.0
    images = torch.randn(2, 3, 8, 8)
    targets = [2, 0]
    maps = low_res(explain.ScoreCAM(model, "act", batch_size=batch_size, progress=False).explain(images,
                                                                                                 target=targets))
    for index, target in enumerate(targets):
        torch.testing.assert_close(maps[index, 0], score_cam_by_hand(model, images[index], target))


def test_score_cam_equals_pytorch_grad_cam_at_the_input_s_resolution_and_the_authors_upsampling_elsewhere():
    """pytorch-grad-cam upsamples with align_corners=True; the Score-CAM authors' code (and ours) with False. At a
    layer of the input's resolution nothing is upsampled and the two agree; at half resolution ours is the
    by-hand map with align_corners=False, not with True."""
    peer("pytorch_grad_cam")
    from pytorch_grad_cam import ScoreCAM as PeerScoreCAM

    torch.manual_seed(2)
    images = torch.randn(2, 3, 8, 8)
    targets = [1, 2]

    class Logit:
        def __init__(self, index: int):
            self.index = index

        def __call__(self, output: Tensor) -> Tensor:
            return output[self.index]

    model = ConvPoolLinear(channels=5, classes=3).eval()
    ours = low_res(explain.ScoreCAM(model, "act", relu=False, progress=False).explain(images, target=targets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        features = model.features(images).detach()
        weights = torch.as_tensor(PeerScoreCAM(model, [model.act]).get_cam_weights(
            images, model.act, [Logit(t) for t in targets], features.numpy(), None))
    torch.testing.assert_close(ours[:, 0], (weights[:, :, None, None] * features).sum(1), rtol=1e-4, atol=1e-6)

    strided = ConvPoolLinear(channels=5, classes=3, stride=2).eval()
    maps = low_res(explain.ScoreCAM(strided, "act", progress=False).explain(images, target=targets))
    for index, target in enumerate(targets):
        torch.testing.assert_close(maps[index, 0], score_cam_by_hand(strided, images[index], target))
        assert not torch.allclose(maps[index, 0], score_cam_by_hand(strided, images[index], target,
                                                                    align_corners=True), atol=1e-5)


# ---------------------------------------------------------------- BatchNorm with the batch's statistics


def batch_statistics_model() -> ConvPoolLinear:
    """A BatchNorm without running statistics after the explained layer: even in eval mode it normalises each
    forward pass by its own batch, so copies scored in one pass change each other's scores."""
    torch.manual_seed(3)
    return ConvPoolLinear(channels=5, classes=3, norm=nn.BatchNorm2d(5, track_running_stats=False), stride=2).eval()


@pytest.mark.parametrize("batch_size", [1, 4, 32])
def test_score_cam_scores_each_masked_copy_alone_through_batch_statistics(batch_size: int):
    """Before: the map changed with batch_size (each masked copy normalised with the other copies of its pass)."""
    model = batch_statistics_model()
    image = torch.randn(3, 8, 8)
    state = model_state(model)
    maps = low_res(explain.ScoreCAM(model, "act", batch_size=batch_size, progress=False).explain(image, target=1))
    assert_state_equal(state, model_state(model))
    torch.testing.assert_close(maps[0, 0], score_cam_by_hand(model, image, 1))


def test_is_cam_and_ss_cam_score_each_masked_copy_alone_through_batch_statistics():
    model = batch_statistics_model()
    image = torch.randn(3, 8, 8)
    steps = 3
    scales = tuple(i * (i - 1) / (2 * steps) for i in range(2, steps + 1))
    is_cam = low_res(explain.ISCAM(model, "act", steps=steps, batch_size=8, progress=False).explain(image, target=0))
    torch.testing.assert_close(is_cam[0, 0], score_cam_by_hand(model, image, 0, scales, divisor=steps))
    # SS-CAM with no noise is Score-CAM
    ss_cam = low_res(explain.SSCAM(model, "act", samples=2, noise_std=0.0, batch_size=8,
                                   progress=False).explain(image, target=0))
    torch.testing.assert_close(ss_cam[0, 0], score_cam_by_hand(model, image, 0))


def test_ablation_cam_runs_each_image_and_ablated_copy_alone_through_batch_statistics():
    """Before: the replay (or the fallback's copies) normalised ablated copies together, and y came from the batch of
    both images; now each image and each of its ablated copies runs alone, with a warning that the tail is not
    replayed, and the maps are the one-image-at-a-time computation."""
    model = batch_statistics_model()
    images = torch.randn(2, 3, 8, 8)
    targets = [0, 2]
    with pytest.warns(RuntimeWarning, match="statistics of the batch"):
        maps = low_res(explain.AblationCAM(model, "act", relu=False, batch_size=4, progress=False).explain(
            images, target=targets))
    for index, target in enumerate(targets):
        torch.testing.assert_close(maps[index, 0], ablation_cam_by_hand(model, images[index], target)[1])


# ---------------------------------------------------------------- options and state


@pytest.mark.parametrize("value", [0, -3, 2.5, "8"])
def test_ablation_cam_rejects_a_replay_batch_size_that_is_not_a_positive_int(value: object):
    """Before: 0 and negative values were silently replaced, "8" failed mid-call with a TypeError."""
    with pytest.raises(ValueError, match="replay_batch_size must be an int of at least 1"):
        explain.AblationCAM(ConvPoolLinear().eval(), "act", replay_batch_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [
    lambda model: explain.ScoreCAM(model, "act", batch_size=2, progress=False),
    lambda model: explain.SSCAM(model, "act", samples=2, batch_size=2, progress=False),
    lambda model: explain.AblationCAM(model, "act", replay_batch_size=2, progress=False),
    lambda model: explain.SmoothGradCAMPlusPlus(model, "act", samples=3, progress=False),
])
def test_an_interrupt_in_a_forward_hook_mid_run_leaves_the_model_as_found(make: Callable[[nn.Module], object]):
    """A KeyboardInterrupt raised by the user's hook on the third forward pass: the model in train mode with a
    frozen parameter comes back exactly so (modes, requires_grad, hooks, grad mode)."""
    model = ConvPoolLinear(channels=5, norm=nn.BatchNorm2d(5)).train()
    model.conv.weight.requires_grad_(False)
    calls = [0]

    def interrupt(module: nn.Module, args: object, output: Tensor) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt

    handle = model.fc.register_forward_hook(interrupt)
    state = model_state(model)
    with pytest.raises(KeyboardInterrupt):
        make(model).explain(torch.randn(2, 3, 8, 8), target=[0, 1])  # type: ignore[attr-defined]
    assert_state_equal(state, model_state(model))
    handle.remove()
