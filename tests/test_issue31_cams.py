"""The CAMs of issue 31, each against a by-hand computation and against its peer.

Peers: pytorch-grad-cam 1.5.7 (Finer-CAM, Seg-Eigen-CAM, SESS; installed with --no-deps, see
tests/test_peer_gradcam.py) and torchcam 0.5 (CAM, Smooth Grad-CAM++; ``pip install --no-deps torchcam==0.5.0``,
its other needs are the toolkit's). A peer's tests are skipped when it is missing. IS-CAM and SS-CAM differ
from torchcam's (it normalises each mask before upsampling it; its IS-CAM masks go one step further):
tests/test_issue39_cams.py pins both differences and says where they matter.
Where a method draws noise, the peer's draws are replayed: torch's global generator is seeded, the same
draws are taken in the peer's order and handed to our ``noise_draws``, then the peer runs from the same seed.

By hand: a conv → ReLU → average pool → linear model, whose gradient at the conv's output A is
∂y_c/∂A_k = W[c, k] · 1[A > 0] / (h w) in closed form; loops over channels for the perturbation CAMs.
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import ConvGapLinear, assert_state_equal, gradcam_by_hand, model_state
from torch import nn

import explain
from explain.io.blur import gaussian_blur

# ---------------------------------------------------------------- helpers


def peer(module: str):
    """The peer library, or a skip that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (pip install --no-deps "
                    f"{'torchcam==0.5.0' if module.startswith('torchcam') else 'grad-cam==1.5.7'})")


def grad_cam_peer():
    for needed in ("cv2", "ttach", "sklearn"):
        peer(needed)
    return peer("pytorch_grad_cam")


def per_map_correlation(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each pair of maps (..., H, W) → (...), in float64; 1 where both are constant."""
    a = first.detach().double().flatten(-2)
    b = torch.as_tensor(np.asarray(second)).double().reshape(a.shape)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    both_constant = (a.norm(dim=-1) == b.norm(dim=-1)).double()
    return torch.where(norms > 0, (a * b).sum(-1) / norms.clamp_min(1e-300), both_constant)


def trained_like(model: nn.Module) -> nn.Module:
    """BatchNorm statistics and affine parameters drawn as after training (the initial ones are the identity)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.2, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.normal_(0, 0.2, generator=generator)
    return model.eval()


def network(name: str) -> nn.Module:
    torch.manual_seed(0)
    return trained_like(getattr(torchvision.models, name)(num_classes=10))


def batch_and_classes(model: nn.Module, size: int) -> tuple[torch.Tensor, list[int]]:
    """Three images and three different classes: each image's top class, made distinct."""
    torch.manual_seed(2)
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        ranked = model(x).argsort(dim=1, descending=True).tolist()
    classes: list[int] = []
    for order in ranked:
        classes.append(next(c for c in order if c not in classes))
    return x, classes


def quiet(method, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # empty maps of random networks, peers' own warnings
        return method(*args, **options)


def upsampled(maps: torch.Tensor, size: int) -> torch.Tensor:
    """(N, h, w) → (N, size, size), bilinear as the toolkit upsamples."""
    return F.interpolate(maps[:, None].float(), size=(size, size), mode="bilinear", align_corners=False)[:, 0]


def replay_normal(seed: int, std: float, shapes: list[tuple[int, ...]]):
    """(draws for our noise_draws, N(0, 1)) and a function that re-seeds the global generator for the peer:
    the peer draws Normal(0, std).sample(shape) in this order from torch's global generator."""
    torch.manual_seed(seed)
    normal = torch.distributions.normal.Normal(0.0, std)
    draws = iter([normal.sample(shape) / std for shape in shapes])
    return (lambda shape: next(draws)), (lambda: torch.manual_seed(seed))


# ---------------------------------------------------------------- the tiny model, by hand


def tiny(classes: int = 6, size: int = 8, relu: bool = True):
    torch.manual_seed(0)
    model = ConvGapLinear(channels=5, classes=classes, relu=relu).eval()
    return model, torch.randn(3, 3, size, size)


def conv_output(model: ConvGapLinear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.conv(x).double()


def closed_form_gradients(model: ConvGapLinear, a: torch.Tensor, classes) -> torch.Tensor:
    """∂y_c/∂A for the conv → ReLU → mean → linear model: W[c, k] · 1[A > 0] / (h w), (N, C, h, w)."""
    weights = model.fc.weight.detach().double()[torch.as_tensor(classes)]  # (N, C)
    return weights[:, :, None, None] * (a > 0) / (a.shape[-1] * a.shape[-2])


def test_cam_is_the_classifier_weighted_sum_of_the_feature_maps():
    model, x = tiny()
    classes = [0, 3, 5]
    a = conv_output(model, x)
    by_hand = torch.einsum("nc,nchw->nhw", model.fc.weight.detach().double()[classes], a)
    result = explain.ClassActivationMapping(model, "conv", relu=False, normalize=None).explain(x, target=classes)
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-5, atol=1e-6)
    named = explain.ClassActivationMapping(model, "conv", classifier="fc", normalize=None).explain(x, target=classes)
    torch.testing.assert_close(named.low_res_maps[0][:, 0].double(), by_hand.clamp_min(0), rtol=1e-5, atol=1e-6)
    # without the ReLU after the layer, the class score is the map's mean plus the bias: Grad-CAM's map times h·w
    linear = ConvGapLinear(channels=5, classes=6, relu=False).eval()
    cam = explain.ClassActivationMapping(linear, "conv", relu=False, normalize=None).explain(x, target=classes)
    grad_cam = explain.GradCAM(linear, "conv", relu=False, normalize=None).explain(x, target=classes)
    torch.testing.assert_close(cam.raw_maps, grad_cam.raw_maps * 64, rtol=1e-4, atol=1e-5)
    assert explain.get_method("cam") is explain.ClassActivationMapping and explain.CAM is explain.methods.cam.CAM


def test_seg_eigen_cam_is_the_principal_component_of_gradient_magnitude_times_activation_signed_by_eq_13():
    model, x = tiny()
    classes = [1, 2, 4]
    a = conv_output(model, x)
    g = closed_form_gradients(model, a, classes)
    result = explain.SegEigenCAM(model, "conv", relu=False, normalize=None).explain(x, target=classes)
    for n in range(3):
        samples = (g[n].abs() * a[n]).reshape(5, -1).T.numpy()  # positions × channels
        centred = samples - samples.mean(0)
        _, vectors = np.linalg.eigh(centred.T @ centred)
        projection = centred @ vectors[:, -1]
        if abs(projection.min()) > abs(projection.max()):  # Eq. 13: the larger side is positive
            projection = -projection
        np.testing.assert_allclose(result.low_res_maps[0][n, 0].numpy().ravel(), projection, rtol=1e-4, atol=1e-6)


def smooth_gradcampp_by_hand(model, x, classes, noise, std):
    """The paper's Smooth Grad-CAM++ (α's numerator the mean squared gradient) with the tiny model's
    closed-form gradients at each noisy copy; A the image's own activations."""
    a = conv_output(model, x)
    derivatives = [closed_form_gradients(model, conv_output(model, x + std * z), classes) for z in noise]
    d1, d2, d3 = (sum(g.pow(p) for g in derivatives) / len(noise) for p in (1, 2, 3))
    denominator = 2 * d2 + a.sum(dim=(2, 3), keepdim=True) * d3
    alpha = torch.where(denominator != 0, d2 / torch.where(denominator != 0, denominator, 1.0), 0.0)
    weights = (alpha * d1.clamp_min(0)).sum(dim=(2, 3))
    return torch.einsum("nc,nchw->nhw", weights, a)


def test_smooth_gradcampp_averages_the_derivatives_over_the_noisy_copies_it_is_given():
    model, x = tiny()
    classes = [0, 3, 5]
    noise = [torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    given = iter(noise)
    result = explain.SmoothGradCAMPlusPlus(model, "conv", samples=3, noise_std=0.5, noise_draws=lambda s: next(given),
                                           relu=False, normalize=None).explain(x, target=classes)
    by_hand = smooth_gradcampp_by_hand(model, x, classes, noise, 0.5)
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-7)
    # seeded by default: the same map twice, another with another seed
    first, again, other = (explain.SmoothGradCAMPlusPlus(model, "conv", seed=seed, normalize=None).explain(x)
                           for seed in (0, 0, 1))
    torch.testing.assert_close(first.raw_maps, again.raw_maps)
    assert not torch.equal(first.raw_maps, other.raw_maps)


def score_cam_family_by_hand(model, x, classes, masks_of):
    """ReLU-free Σ_k softmax_k(mean score) A_k with loops: ``masks_of(n, k, mask)`` lists the masks
    scored for image n, channel k whose min-max normalised map is ``mask``."""
    a = conv_output(model, x)
    maps = []
    for n, c in enumerate(classes):
        scores = []
        for k in range(a.shape[1]):
            channel = a[n, k]
            span = channel.max() - channel.min()
            mask = (channel - channel.min()) / span if span > 0 else torch.zeros_like(channel)
            with torch.no_grad():
                scores.append(np.mean([float(model((x[n] * m.float())[None])[0, c]) for m in masks_of(n, k, mask)]))
        weights = torch.tensor(scores, dtype=torch.float64).softmax(0)
        maps.append((weights[:, None, None] * a[n]).sum(0))
    return torch.stack(maps)


def test_is_cam_averages_the_scores_of_masks_of_growing_strength():
    model, x = tiny()
    classes = [0, 3, 5]
    steps = 4
    strengths = [sum(range(i)) / steps for i in range(1, steps + 1)]  # the paper's 0, 1/4, 3/4, 6/4
    by_hand = score_cam_family_by_hand(model, x, classes, lambda n, k, mask: [s * mask for s in strengths])
    result = explain.ISCAM(model, "conv", steps=steps, relu=False, normalize=None).explain(x, target=classes)
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


def test_ss_cam_averages_the_scores_of_noisy_masks_it_is_given():
    model, x = tiny()
    classes = [0, 3, 5]
    noise = [torch.randn(3, 5, 8, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    given = iter(noise)
    result = explain.SSCAM(model, "conv", samples=2, noise_std=0.3, noise_draws=lambda s: next(given), relu=False,
                           normalize=None).explain(x, target=classes)
    by_hand = score_cam_family_by_hand(model, x, classes,
                                       lambda n, k, mask: [mask + 0.3 * z[n, k].double() for z in noise])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


def test_finer_cam_is_grad_cam_of_the_score_against_the_closest_classes():
    model, x = tiny(classes=8, relu=False)  # no in-place ReLU on the output the by-hand hook keeps
    classes = [0, 3, 5]
    with torch.no_grad():
        logits = model(x)
    compared = []
    for n, c in enumerate(classes):  # the other classes by |y_d − y_c|, closest first
        others = sorted((d for d in range(8) if d != c), key=lambda d: abs(float(logits[n, d] - logits[n, c])))
        compared.append(others[:3])
    rows = torch.arange(3)
    wanted, near = torch.tensor(classes), torch.tensor(compared)

    def finer_score(output):
        p = output.softmax(1)[rows[:, None], near]
        differences = output[rows, wanted][:, None] - 0.5 * output[rows[:, None], near]
        return (p * differences).sum(1) / (p.sum(1) + 1e-9)

    by_hand = gradcam_by_hand(model, model.conv, x, finer_score)
    result = explain.FinerCAM(model, "conv", alpha=0.5, normalize=None).explain(x, target=classes)
    torch.testing.assert_close(result.raw_maps, by_hand, rtol=1e-4, atol=1e-6)
    assert result.diagnostics["compared_classes"][:, 0].tolist() == compared
    assert result.class_indices[:, 0].tolist() == classes
    torch.testing.assert_close(result.scores[:, 0], finer_score(logits).detach())


def test_sess_of_one_window_is_the_blurred_normalised_cam():
    model, x = tiny(size=16)
    classes = [0, 3, 5]
    result = explain.SESS(model, "conv", scales=[16], normalize=None).explain(x, target=classes)
    grad_cam = explain.GradCAM(model, "conv", normalize=None).explain(x, target=classes).raw_maps.double()
    low = grad_cam.flatten(1).amin(1)[:, None, None]
    normalised = (grad_cam - low) / (grad_cam.flatten(1).amax(1)[:, None, None] - low)
    taps = np.exp(-0.5 * (np.arange(-5, 6) / 5.0) ** 2)
    taps /= taps.sum()
    for n in range(3):
        padded = np.pad(normalised[n].numpy(), 5, mode="reflect")  # OpenCV's BORDER_REFLECT_101
        rows_blurred = np.stack([np.convolve(row, taps, mode="valid") for row in padded])
        blurred = np.stack([np.convolve(column, taps, mode="valid") for column in rows_blurred.T]).T
        np.testing.assert_allclose(result.raw_maps[n].numpy(), blurred, rtol=1e-4, atol=1e-6)


def test_sess_windows_cover_the_image_with_the_last_window_moved_back_inside():
    from explain.methods.cam_wrappers import window_starts

    assert window_starts(100, 40, 40) == [0, 40, 60]
    assert window_starts(64, 64, 64) == [0]
    assert window_starts(96, 32, 64) == [0, 32]


# ---------------------------------------------------------------- bad input, state


def test_bad_options_and_targets_are_refused_with_what_to_do():
    model, x = tiny()
    with pytest.raises(ValueError, match=r"shape it is asked for, \(3, 3, 8, 8\)"):
        explain.SmoothGradCAMPlusPlus(model, "conv", noise_draws=lambda s: torch.zeros(2)).explain(x)
    with pytest.raises(ValueError, match="NaN or inf"):
        explain.SSCAM(model, "conv", samples=1, noise_draws=lambda s: torch.full(s, float("nan"))).explain(x)
    with pytest.raises(ValueError, match="targets are classes"):
        explain.FinerCAM(model, "conv").explain(x, target=lambda output: output[:, 0])
    with pytest.raises(ValueError, match="differentiates the score"):
        explain.FinerCAM(model, "conv", cam=explain.ScoreCAM)
    with pytest.raises(ValueError, match="same model"):
        explain.FinerCAM(model, "conv", cam=explain.GradCAM(ConvGapLinear(), "conv"))
    with pytest.raises(ValueError, match="every scale must be at least the window, 8 px"):
        explain.SESS(model, "conv", scales=[6]).explain(x)
    with pytest.raises(ValueError, match="pool must be one of"):
        explain.SESS(model, "conv", pool="median")
    with pytest.raises(ValueError, match=r"pre_filter must be a share in \[0, 1\)"):
        explain.SESS(model, "conv", pre_filter=1.0)
    with pytest.raises(ValueError, match="steps must be an int of at least 2"):
        explain.ISCAM(model, "conv", steps=0)
    with pytest.raises(ValueError, match="targets are classes"):
        explain.ClassActivationMapping(model, "conv").explain(x, target=lambda output: output[:, 0])
    with pytest.raises(TypeError, match="nn.Linear or a 1 × 1 nn.Conv2d"):
        explain.ClassActivationMapping(model, "conv", classifier=model.pool)
    head = nn.Sequential(nn.Conv2d(3, 7, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(7, 4))
    inside = nn.Sequential(nn.Identity(), head).eval()  # layer "0" has the input's 3 channels
    with pytest.raises(ValueError, match="takes 7 features, but layer '0' has 3 channels"):
        explain.ClassActivationMapping(inside, "0", classifier="1.3").explain(x)
    with pytest.raises(ValueError, match="classifier '1.3' takes 7 features, but layer '0' has 3 channels"):
        explain.ClassActivationMapping(inside, "0").explain(x)


@pytest.mark.parametrize("method, options", [
    (explain.ClassActivationMapping, {}), (explain.SegEigenCAM, {}), (explain.SmoothGradCAMPlusPlus, {}),
    (explain.ISCAM, {"steps": 2}), (explain.SSCAM, {"samples": 2}), (explain.FinerCAM, {}),
    (explain.SESS, {"scales": [8, 10]})], ids=lambda value: getattr(value, "name", ""))
def test_the_model_is_left_as_found(method, options):
    model, x = tiny()
    model.train()
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = method(model, "conv", **options).explain(x, topk=2)
    assert_state_equal(before, model_state(model))
    assert result.maps.shape == (3, 2, 8, 8) and torch.isfinite(result.maps).all()


# ---------------------------------------------------------------- against torchcam 0.5


def torchcam_maps(method, model, layer, x, classes, **options) -> torch.Tensor:
    """(N, h, w) raw (unnormalised) low-resolution maps of a torchcam extractor."""
    with quiet(method, model, layer, **options) as extractor:
        with torch.set_grad_enabled(method.__name__ == "SmoothGradCAMpp"):
            model(x)
        return quiet(extractor, class_idx=classes, normalized=False)[0].detach()


@pytest.mark.parametrize("name, layer, classifier", [("resnet18", "layer4", "fc"),
                                                     ("mobilenet_v2", "features", "classifier.1")])
def test_cam_equals_torchcam(name, layer, classifier):
    methods = peer("torchcam.methods")
    model = network(name)
    x, classes = batch_and_classes(model, 128)
    ours = quiet(explain.ClassActivationMapping(model, layer, relu=False, normalize=None).explain, x, target=classes)
    theirs = torchcam_maps(methods.CAM, model, layer, x, classes, fc_layer=classifier)
    agreement = per_map_correlation(ours.low_res_maps[0][:, 0], theirs)
    print(f"{name} CAM against torchcam: {agreement.tolist()}")  # torchcam's CAM is signed (the paper's)
    assert agreement.min() >= 0.999


GRADIENT_CASES = [("resnet18", "layer4", 128), ("mobilenet_v2", "features", 96)]


def captured_pass(model: nn.Module, layer: str, x: torch.Tensor, classes) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, ∂y/∂A) at the layer for one forward pass, by a plain hook and autograd."""
    stash = []
    handle = dict(model.named_modules())[layer].register_forward_hook(lambda m, i, o: stash.append(o))
    try:
        output = model(x)
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(output[torch.arange(len(classes)), torch.tensor(classes)].sum(), stash[0])
    return stash[0].detach().double(), gradient.double()


@pytest.mark.parametrize("name, layer, size", GRADIENT_CASES)
def test_smooth_gradcampp_differs_from_torchcam_which_keeps_the_last_copy_and_sums_a_d3_over_positions(
        name, layer, size):
    """With the same draws, torchcam 0.5's map is Σ_k w_k A_k,last with w_k = Σ_ij α_ij ReLU(G_last,ij) and
    α = D_2 / (2 D_2 + Σ_ab A_ab D_3,ab): the last noisy copy's activations and gradient instead of the
    image's activations and the mean gradient (the paper averages every derivative over the copies, and
    explains the image's A), and Σ_ab A_ab D_3,ab instead of Grad-CAM++'s Σ_ab A_ab · D_3,ij."""
    methods = peer("torchcam.methods")
    model = network(name)
    x, classes = batch_and_classes(model, size)
    draws, reseed = replay_normal(11, 0.3, [tuple(x.shape)] * 4)
    noise = [draws(tuple(x.shape)) for _ in range(4)]
    replay = iter(noise)
    explainer = explain.SmoothGradCAMPlusPlus(model, layer, noise_draws=lambda s: next(replay), normalize=None)
    ours = quiet(explainer.explain, x, target=classes)
    reseed()
    theirs = torchcam_maps(methods.SmoothGradCAMpp, model, layer, x, classes, num_samples=4, std=0.3)

    clean, _ = captured_pass(model, layer, x, classes)
    passes = [captured_pass(model, layer, x + 0.3 * z, classes) for z in noise]
    d1, d2, d3 = (sum(g.pow(p) for _, g in passes) / 4 for p in (1, 2, 3))
    last_a, last_g = passes[-1]
    peer_alpha = d2 / (2 * d2 + (d3 * clean).sum(dim=(2, 3), keepdim=True) + 1e-8)
    peer_formula = torch.relu(((peer_alpha * last_g.clamp_min(0)).sum(dim=(2, 3))[:, :, None, None] * last_a).sum(1))
    paper_alpha = d2 / (2 * d2 + clean.sum(dim=(2, 3), keepdim=True) * d3)
    paper_alpha = torch.nan_to_num(paper_alpha, nan=0.0, posinf=0.0, neginf=0.0)
    paper = torch.relu(((paper_alpha * d1.clamp_min(0)).sum(dim=(2, 3))[:, :, None, None] * clean).sum(1))

    assert per_map_correlation(peer_formula, theirs).min() >= 0.999  # the peer computes what is written above
    assert per_map_correlation(ours.low_res_maps[0][:, 0], paper).min() >= 0.9999  # we compute the paper's
    against = per_map_correlation(ours.low_res_maps[0][:, 0], theirs)
    print(f"{name} Smooth Grad-CAM++ against torchcam (same noise): {against.tolist()}")
    assert against.min() < 0.99999  # two maps


# ---------------------------------------------------------------- against pytorch-grad-cam 1.5.7


def grad_cam_maps(model: nn.Module, cam, x: torch.Tensor, targets) -> np.ndarray:
    with quiet(lambda: cam) as running:
        return quiet(running, x, targets)


@pytest.mark.parametrize("name, layer, size", GRADIENT_CASES)
def test_seg_eigen_cam_equals_pytorch_grad_cam(name, layer, size):
    grad_cam = grad_cam_peer()
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = network(name)
    x, classes = batch_and_classes(model, size)
    ours = quiet(explain.SegEigenCAM(model, layer, normalize=None).explain, x, target=classes)
    module = dict(model.named_modules())[layer]
    targets = [ClassifierOutputTarget(c) for c in classes]
    theirs = grad_cam_maps(model, grad_cam.SegEigenCAM(model, [module]), x, targets)
    agreement = per_map_correlation(ours.raw_maps, theirs)
    print(f"{name} Seg-Eigen-CAM against pytorch-grad-cam: {agreement.tolist()}")
    assert agreement.min() >= 0.999


@pytest.mark.parametrize("name, layer, size", GRADIENT_CASES)
def test_finer_cam_equals_pytorch_grad_cam(name, layer, size):
    grad_cam = grad_cam_peer()
    model = network(name)
    x, classes = batch_and_classes(model, size)
    ours = quiet(explain.FinerCAM(model, layer, normalize=None).explain, x, target=classes)
    module = dict(model.named_modules())[layer]
    theirs = []
    for n, c in enumerate(classes):  # the peer's target_idx is one class for the batch: one image at a time
        with quiet(grad_cam.FinerCAM, model, [module]) as finer:
            theirs.append(quiet(finer, x[n: n + 1], target_idx=c)[0])
    agreement = per_map_correlation(ours.raw_maps, np.stack(theirs))
    print(f"{name} Finer-CAM against pytorch-grad-cam: {agreement.tolist()}; compared classes "
          f"{ours.diagnostics['compared_classes'][:, 0].tolist()}")
    assert agreement.min() >= 0.999


@pytest.mark.parametrize("name, layer, softmax, pre_filter", [("resnet18", "layer4", True, 0.25),
                                                              ("mobilenet_v2", "features", False, 0.0)])
def test_sess_equals_pytorch_grad_cam(name, layer, softmax, pre_filter):
    """The random mobilenet scores every window alike (its windows' scores tie to float precision, so
    which ones a pre-filter drops is rounding noise): it is checked without pre-filter, on logits."""
    grad_cam = grad_cam_peer()
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = network(name)
    x, classes = batch_and_classes(model, 64)
    explainer = explain.SESS(model, layer, scales=[64, 80, 96], stride=32, pre_filter=pre_filter,
                             softmax_scores=softmax, normalize=None, progress=False)
    ours = quiet(explainer.explain, x, target=classes)
    module = dict(model.named_modules())[layer]
    sess = grad_cam.SESS(model, [module], scales=[64, 80, 96], step_size=32, pre_filter_ratio=pre_filter,
                         use_softmax_scores=softmax)
    theirs = grad_cam_maps(model, sess, x, [ClassifierOutputTarget(c) for c in classes])
    agreement = per_map_correlation(ours.raw_maps, theirs)
    print(f"{name} SESS against pytorch-grad-cam: {agreement.tolist()}")
    assert agreement.min() >= 0.999


def test_gaussian_blur_of_sess_is_opencv_s():
    cv2 = peer("cv2")
    image = torch.rand(1, 1, 20, 17, generator=torch.Generator().manual_seed(0))
    ours = gaussian_blur(image, 5.0, boundary="reflect", radii=5)[0, 0].numpy()
    np.testing.assert_allclose(ours, cv2.GaussianBlur(image[0, 0].numpy(), (11, 11), 5.0, 0), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- pytorch-grad-cam's metrics module


def test_masked_score_change_equals_pytorch_grad_cam_s_cam_mult_image_scores():
    grad_cam_peer()
    from pytorch_grad_cam.metrics.cam_mult_image import (
        CamMultImageConfidenceChange,
        DropInConfidence,
        IncreaseInConfidence,
    )
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from explain.metrics.gradcam_scores import masked_score_change

    model = network("resnet18")
    x, classes = batch_and_classes(model, 64)
    maps = quiet(explain.GradCAM(model, "layer4", normalize="minmax").explain, x, target=classes).maps
    targets = [ClassifierOutputTarget(c) for c in classes]
    ours = masked_score_change(model, x, maps, classes)
    for mine, theirs in ((ours.change, CamMultImageConfidenceChange()), (ours.drop, DropInConfidence()),
                         (ours.increase, IncreaseInConfidence())):
        np.testing.assert_allclose(mine.numpy(), theirs(x, maps.numpy(), targets, model), rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # by hand: the logit of the image times its map minus the logit of the image
        rows = torch.arange(3)
        by_hand = model(x * maps[:, None])[rows, classes] - model(x)[rows, classes]
    torch.testing.assert_close(ours.change, by_hand, rtol=1e-4, atol=1e-5)


SHARES = (0.3, 0.7)  # shares of the pixels ROAD removes (noisy linear imputation is the slow part)


def test_arcc_has_pytorch_grad_cam_s_complexity_and_coherency_and_is_their_harmonic_mean_with_road():
    grad_cam = grad_cam_peer()
    from pytorch_grad_cam.metrics.arcc import Coherency, Complexity
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from explain.metrics.gradcam_scores import arcc, road_combined

    model = network("resnet18")
    x, classes = batch_and_classes(model, 64)
    targets = [ClassifierOutputTarget(c) for c in classes]
    peer_cam = grad_cam.GradCAM(model, [model.layer4])
    maps = quiet(peer_cam, x, targets)  # (N, H, W) min-max normalised, as our GradCAM with normalize="minmax"
    ours = quiet(arcc, explain.GradCAM(model, "layer4", normalize="minmax"), x, torch.from_numpy(maps), classes,
                 percentages=SHARES)
    np.testing.assert_allclose(ours.complexity.numpy(), Complexity()(maps), rtol=1e-5)
    np.testing.assert_allclose(ours.coherency.numpy(), quiet(Coherency(), x, maps, targets, model, peer_cam),
                               rtol=1e-4, atol=1e-5)
    combined = road_combined(model, x, torch.from_numpy(maps), classes, percentages=SHARES)
    lerf = explain.metrics.road(model, x, torch.from_numpy(maps), classes, order="lerf",
                                percentages=SHARES).area
    morf = explain.metrics.road(model, x, torch.from_numpy(maps), classes, percentages=SHARES).area
    torch.testing.assert_close(combined, (lerf - morf) / 2)
    torch.testing.assert_close(ours.road, combined)
    parts = [ours.coherency, 1 - ours.complexity, (2 * combined).clamp(0, 1)]
    torch.testing.assert_close(ours.arcc, 3 / sum(1 / (part + 1e-8) for part in parts))
    assert ((ours.arcc >= 0) & (ours.arcc <= 1)).all()
