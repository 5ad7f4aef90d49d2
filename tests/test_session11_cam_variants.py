"""Finer-CAM, FEM, Shapley-CAM and Random-CAM as a hostile user calls them, smooth="augment" with a
SegmentationTarget, and the default CAM layer of torchvision's segmentation models.

Each map is checked against an independent slow computation on a tiny model (the paper's formula, written
with autograd by hand), and against pytorch-grad-cam 1.5.7 where it computes the same map (an optional test
dependency: ``pip install --no-deps grad-cam==1.5.7``; those tests are skipped without it). Where ours
deliberately differs (FEM's weights, Random-CAM's draws) the test shows how.
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
import torch
import torchvision
from conftest import assert_state_equal, model_state
from torch import nn

import explain
from explain.core.layers import default_layer
from explain.core.targets import DetectionTarget, SegmentationTarget
from explain.methods.cam import AUGMENTATIONS


def grad_cam_peer():
    """pytorch-grad-cam, or a skip that says how to install it."""
    for needed in ("cv2", "ttach", "sklearn", "pytorch_grad_cam"):
        try:
            importlib.import_module(needed)
        except ImportError:
            pytest.skip(f"{needed} is not installed (pytorch-grad-cam: pip install --no-deps grad-cam==1.5.7)")
    return importlib.import_module("pytorch_grad_cam")


def quiet(method, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blank maps of random networks, the peer's own warnings
        return method(*args, **options)


class CurvedTail(nn.Module):
    """conv → ReLU → conv → GELU → mean → linear: a tail after ``conv`` that is not piecewise linear, so that
    Shapley-CAM's Hessian term is not zero and Finer-CAM's softmax weights move."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, classes)

    def tail(self, a: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.gelu(self.conv2(torch.relu(a))).mean((2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.conv(x))


def curved_case(seed: int = 0):
    torch.manual_seed(seed)
    return CurvedTail().eval(), torch.randn(3, 3, 8, 8)


def minmax(maps: torch.Tensor) -> torch.Tensor:
    """pytorch-grad-cam's scaling of a map: ReLU, then min-max to [0, 1] per map."""
    maps = torch.relu(maps.double()).flatten(-2)
    low, high = maps.amin(-1, keepdim=True), maps.amax(-1, keepdim=True)
    return ((maps - low) / (high - low).clamp_min(1e-7)).reshape(-1, 8, 8)


def gradcam_of_weights(weights: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k A_k for (N, C) weights and (N, C, h, w) activations."""
    return (weights[:, :, None, None] * a).sum(1)


# --- Shapley-CAM: Grad-CAM weights from G − ½ H A ------------------------------------------------------------------

def rest(classes):
    """The paper's ReST target: the logit plus its log-softmax."""
    rows = torch.arange(len(classes))
    return lambda output: output[rows, classes] + output.log_softmax(1)[rows, classes]


def slow_shapley(model: CurvedTail, x: torch.Tensor, classes) -> torch.Tensor:
    """Per image, w = mean over positions of ∂y/∂A − ½ (∂²y/∂A²) A, by torch.autograd.functional.hvp."""
    maps = []
    for n, c in enumerate(classes):
        a = model.conv(x[n: n + 1]).detach()

        def score(a: torch.Tensor, c: int = c) -> torch.Tensor:
            output = model.tail(a)
            return output[0, c] + output.log_softmax(1)[0, c]

        gradient = torch.autograd.grad(score(a.requires_grad_()), a)[0]
        _, hessian_product = torch.autograd.functional.hvp(score, a.detach(), a.detach())
        maps.append(gradcam_of_weights((gradient - 0.5 * hessian_product).mean((2, 3)), a.detach()))
    return torch.cat(maps)


def test_shapley_cam_is_grad_cam_of_the_gradient_minus_half_the_hessian_vector_product():
    model, x = curved_case()
    classes = [1, 3, 4]
    result = explain.ShapleyCAM(model, "conv", normalize=None, relu=False).explain(x, target=rest(classes))
    by_hand = slow_shapley(model, x, classes)
    torch.testing.assert_close(result.raw_maps, by_hand, rtol=1e-4, atol=1e-7)
    grad_cam = explain.GradCAM(model, "conv", normalize=None, relu=False).explain(x, target=rest(classes))
    assert (grad_cam.raw_maps - by_hand).abs().amax() > 0.05 * by_hand.abs().amax()  # the Hessian term counts


def test_shapley_cam_equals_pytorch_grad_cam():
    grad_cam = grad_cam_peer()
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputReST

    model, x = curved_case()
    classes = [1, 3, 4]
    ours = explain.ShapleyCAM(model, "conv", normalize=None, relu=False).explain(x, target=rest(classes))
    with quiet(grad_cam.ShapleyCAM, model, [model.conv]) as peer:
        theirs = quiet(peer, x, targets=[ClassifierOutputReST(c) for c in classes])
    np.testing.assert_allclose(minmax(ours.raw_maps).numpy(), theirs, atol=1e-4)


# --- Finer-CAM ----------------------------------------------------------------------------------------------------

def slow_finer(model: CurvedTail, x: torch.Tensor, classes, alpha: float = 1.0, ranks=(1, 2, 3)) -> torch.Tensor:
    """Per image: the classes ordered by |y_d − y_c| (c itself first), the score Σ_j p_j (y_c − α y_dj) / Σ_j p_j
    over the classes at ``ranks``, and Grad-CAM at ``conv`` of it, one image at a time."""
    maps = []
    for n, c in enumerate(classes):
        a = model.conv(x[n: n + 1]).detach().requires_grad_()
        output = model.tail(a)[0]
        values = output.detach().tolist()
        order = sorted(range(len(values)), key=lambda d: (d != c, abs(values[d] - values[c]), d))
        near = [order[rank] for rank in ranks]
        p = output.softmax(0)[near]
        score = (p * (output[c] - alpha * output[near])).sum() / (p.sum() + 1e-9)
        gradient = torch.autograd.grad(score, a)[0]
        maps.append(gradcam_of_weights(gradient.mean((2, 3)), a.detach()))
    return torch.cat(maps)


def test_finer_cam_of_a_batch_with_different_targets_is_each_images_by_hand():
    model, x = curved_case()
    classes = [4, 0, 2]
    result = explain.FinerCAM(model, "conv", normalize=None, relu=False, alpha=0.7).explain(x, target=classes)
    torch.testing.assert_close(result.raw_maps, slow_finer(model, x, classes, alpha=0.7), rtol=1e-4, atol=1e-8)


def test_finer_cam_equals_pytorch_grad_cam_per_image():
    grad_cam = grad_cam_peer()
    model, x = curved_case()
    classes = [4, 0, 2]
    ours = explain.FinerCAM(model, "conv", normalize=None, relu=False).explain(x, target=classes)
    theirs = []
    for n, c in enumerate(classes):  # the peer's target_idx is one class for the whole batch
        with quiet(grad_cam.FinerCAM, model, [model.conv]) as peer:
            theirs.append(quiet(peer, x[n: n + 1], target_idx=c)[0])
    np.testing.assert_allclose(minmax(ours.raw_maps).numpy(), np.stack(theirs), atol=1e-4)


# --- FEM ----------------------------------------------------------------------------------------------------------

def slow_fem_maps(a: np.ndarray, k: float) -> tuple[np.ndarray, np.ndarray]:
    """(ours, the peer's) by loops over channels: the paper's Σ_k μ_k 1[A_k > μ_k + k σ_k], and pytorch-grad-cam's
    Σ_k mean(1[A_k > μ_k + k σ_k]) A_k (the binary maps' share as the weight, the activations as the maps)."""
    paper, peer = np.zeros(a.shape[::2][:1] + a.shape[2:]), np.zeros(a.shape[::2][:1] + a.shape[2:])
    for n in range(a.shape[0]):
        for channel in a[n]:
            mu, sigma = channel.mean(), channel.std()
            binary = (channel > mu + k * sigma).astype(np.float64)
            paper[n] += mu * binary
            peer[n] += binary.mean() * channel
    return paper, peer


def test_fem_is_the_papers_formula_and_pytorch_grad_cam_swaps_weights_and_maps():
    model, x = curved_case()
    a = torch.relu(model.conv(x)).detach()
    relu_model = nn.Sequential()  # FEM of the ReLU's output, the paper's non-negative features
    relu_model.conv, relu_model.relu, relu_model.tail = model.conv, nn.ReLU(), nn.Sequential(
        nn.Conv2d(6, 6, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))
    relu_model.eval()
    paper, peer_formula = slow_fem_maps(a.double().numpy(), k=1.0)
    ours = explain.FEM(relu_model, "relu", normalize=None, relu=False, k=1.0).explain(x, target=0)
    np.testing.assert_allclose(ours.raw_maps.numpy(), paper, rtol=1e-5, atol=1e-7)
    assert np.abs(paper - peer_formula).max() > 0.1 * np.abs(paper).max()  # the two formulas differ
    try:
        grad_cam = grad_cam_peer()
    except pytest.skip.Exception:
        return
    with quiet(grad_cam.FEM, relu_model, [relu_model.relu], k=1.0) as peer:
        theirs = quiet(peer, x, targets=None)
    np.testing.assert_allclose(theirs, minmax(torch.from_numpy(peer_formula)).numpy(), atol=1e-4)


def test_fem_refuses_a_k_that_is_not_a_finite_non_negative_number():
    model, _ = curved_case()
    for bad in ("2", float("nan"), -1.0, None):
        with pytest.raises(ValueError, match="k must be a finite number ≥ 0"):
            explain.FEM(model, "conv", k=bad)


# --- Random-CAM ---------------------------------------------------------------------------------------------------

def test_random_cam_is_pytorch_grad_cams_formula_with_its_seeded_weights(monkeypatch):
    """The peer draws new weights per image and call from numpy's global generator; ours draws one set from
    ``seed``, shared by every image, target and call. Given our weights, the peer's map is ours."""
    model, x = curved_case()
    ours = explain.RandomCAM(model, "conv", normalize=None, relu=False, seed=5).explain(x, target=[0, 1, 2])
    weights = torch.rand(6, generator=torch.Generator().manual_seed(5)) * 2 - 1
    a = model.conv(x).detach()
    torch.testing.assert_close(ours.raw_maps, gradcam_of_weights(weights.expand(3, -1), a), rtol=1e-5, atol=1e-7)
    try:
        grad_cam = grad_cam_peer()
    except pytest.skip.Exception:
        return
    monkeypatch.setattr(np.random, "uniform", lambda low, high, size: np.tile(weights.numpy(), (size[0], 1)))
    with quiet(grad_cam.RandomCAM, model, [model.conv]) as peer:
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
        theirs = quiet(peer, x, targets=[ClassifierOutputTarget(c) for c in (0, 1, 2)])
    np.testing.assert_allclose(minmax(ours.raw_maps).numpy(), theirs, atol=1e-4)


def test_random_cam_refuses_a_seed_that_is_not_an_int():
    model, _ = curved_case()
    for bad in (None, 1.5, "a", True):
        with pytest.raises(ValueError, match="RandomCAM's seed must be an int"):
            explain.RandomCAM(model, "conv", seed=bad)


# --- the four methods in the caller's contexts --------------------------------------------------------------------

VARIANTS = {
    "finercam": lambda model: explain.FinerCAM(model, "conv", normalize=None),
    "finercam-shapley": lambda model: explain.FinerCAM(model, "conv", cam=explain.ShapleyCAM, normalize=None),
    "fem": lambda model: explain.FEM(model, "conv", normalize=None, k=1.0),
    "shapleycam": lambda model: explain.ShapleyCAM(model, "conv", normalize=None),
    "randomcam": lambda model: explain.RandomCAM(model, "conv", normalize=None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_in_no_grad_inference_mode_and_autocast_with_a_batch_of_different_targets(name):
    """The batch's maps are each image's alone; no_grad and inference_mode give the same maps, bfloat16 autocast
    maps within 2 % of their maximum; the model is left as found after each call."""
    model, x = curved_case()
    make = VARIANTS[name]
    classes = [1, 3, 4]
    before = model_state(model)
    reference = quiet(make(model).explain, x, target=classes).raw_maps
    alone = torch.cat([quiet(make(model).explain, x[n: n + 1], target=[c]).raw_maps for n, c in enumerate(classes)])
    torch.testing.assert_close(reference, alone, rtol=1e-4, atol=1e-6 * float(reference.abs().max()))
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            got = quiet(make(model).explain, x, target=classes).raw_maps
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = quiet(make(model).explain, x, target=classes).raw_maps.float()
        a = model.conv(x).detach()  # the layer's output as the model computes it under autocast
    if name == "fem":  # a threshold: a value within rounding of μ + kσ may fall on either side of it
        paper, _ = slow_fem_maps(a.double().numpy(), k=1.0)
        expected = torch.relu(torch.from_numpy(paper)).float()
        torch.testing.assert_close(low, expected, rtol=1e-2, atol=1e-3 * float(expected.abs().max()))
    else:
        assert float((low - reference).abs().max()) <= 0.02 * float(reference.abs().max())
    assert_state_equal(before, model_state(model))


# --- smooth="augment" with a SegmentationTarget -----------------------------------------------------------------

class TinyFCN(nn.Module):
    """conv 3 × 3 → ReLU → 1 × 1 head: logits at the input's size; the logit at column j reads ``conv``'s output
    at column j only."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Conv2d(6, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)))


def fcn_case():
    torch.manual_seed(0)
    return TinyFCN().eval(), torch.randn(2, 3, 8, 8)


def augmented_hirescam_by_hand(model: TinyFCN, x: torch.Tensor, class_index: int, region: torch.Tensor):
    """smooth="augment" HiResCAM at ``conv`` of Σ region ⊙ logits, region (N, H, W) in the images' own frame:
    for each copy the region is mirrored with the image, the map Σ_k G_k A_k mapped back, and the copies averaged."""
    total = torch.zeros(x.shape[0], *x.shape[-2:])
    for flip, factor in AUGMENTATIONS:
        copy = (x * factor).flip(-1) if flip else x * factor
        mask = region.flip(-1) if flip else region
        a = model.conv(copy).detach().requires_grad_()
        score = (model.head(torch.relu(a))[:, class_index] * mask).sum()
        gradient = torch.autograd.grad(score, a)[0]
        hires = (gradient * a).sum(1).detach()
        total += hires.flip(-1) if flip else hires
    return total / len(AUGMENTATIONS)


def test_augment_mirrors_a_segmentation_mask_with_the_flipped_copies():
    """A left-half mask: the logits there read ``conv`` on the left half only, so HiResCAM's map is 0 on the right
    half. Scored with the unmirrored mask, the flipped copies put their evidence on the right half."""
    model, x = fcn_case()
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:, :4] = True
    result = explain.HiResCAM(model, "conv", smooth="augment", normalize=None, relu=False).explain(
        x, target=SegmentationTarget(1, mask))
    expected = augmented_hirescam_by_hand(model, x, 1, mask.expand(2, -1, -1).float())
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-5, atol=1e-7)
    assert float(result.raw_maps[..., 4:].abs().max()) == 0.0
    assert float(result.raw_maps[..., :4].abs().max()) > 0


def test_augment_with_one_mask_per_image_is_each_image_alone():
    model, x = fcn_case()
    masks = torch.zeros(2, 8, 8)
    masks[0, :, :3] = 1.0
    masks[1, 2:6, 5:] = 0.5
    explainer = explain.GradCAM(model, "conv", smooth="augment", normalize=None, relu=False)
    batch = explainer.explain(x, target=SegmentationTarget(2, masks)).raw_maps
    alone = torch.cat([explainer.explain(x[n: n + 1], target=SegmentationTarget(2, masks[n])).raw_maps
                       for n in range(2)])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-7)


def test_augment_keeps_the_pixels_predicted_on_the_unchanged_images_mirrored_for_every_copy():
    model, x = fcn_case()
    with torch.no_grad():
        predicted = (model(x).argmax(1) == 0).float()
    assert 0 < predicted.sum() < predicted.numel()
    result = explain.HiResCAM(model, "conv", smooth="augment", normalize=None, relu=False).explain(
        x, target=SegmentationTarget(0))
    expected = augmented_hirescam_by_hand(model, x, 0, predicted)
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-5, atol=1e-7)


def test_augment_refuses_a_box_target_whose_box_a_flip_would_move():
    model, x = fcn_case()
    before = model_state(model)
    with pytest.raises(ValueError, match="smooth='augment'.*DetectionTarget.*smooth=None"):
        explain.GradCAM(model, "conv", smooth="augment").explain(x, target=DetectionTarget([0, 0, 4, 4], 1))
    assert_state_equal(before, model_state(model))


# --- the default CAM layer of segmentation models -----------------------------------------------------------------

SEGMENTATION_DEFAULTS = {
    "fcn_resnet50": "backbone.layer4",
    "deeplabv3_mobilenet_v3_large": "backbone.16",
    "lraspp_mobilenet_v3_large": "backbone.16",
}


@pytest.mark.parametrize("name", list(SEGMENTATION_DEFAULTS))
def test_the_default_layer_of_a_torchvision_segmentation_model_is_its_last_backbone_stage(name):
    """Not ``classifier``, the head whose output is the logits themselves (before: ``classifier`` for FCN and
    LRASPP, ``classifier.3`` for DeepLabV3)."""
    torch.manual_seed(0)
    model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None,
                                                           num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    assert default_layer(model, x, run=lambda batch: model(batch)["out"]) == SEGMENTATION_DEFAULTS[name]


class BackboneAndHead(nn.Module):
    def __init__(self, dense: bool):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.classifier = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.classifier(self.backbone(x))
        return logits if self.dense else logits.mean((2, 3))


def test_the_backbone_rule_applies_to_dense_outputs_only():
    """A model with a ``backbone`` that outputs (N, K, h, w) logits: its backbone's last layer; the same model
    pooled to (N, K) class scores keeps the family's rule (the last layer that gives maps)."""
    x = torch.randn(1, 3, 8, 8)
    assert explain.GradCAM(BackboneAndHead(dense=True).eval()).default_layer_name(x) == "backbone"
    assert explain.GradCAM(BackboneAndHead(dense=False).eval()).default_layer_name(x) == "classifier"
