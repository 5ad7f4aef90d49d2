"""Issue 39, points 3 and 7: IS-CAM and SS-CAM against their papers and against torchcam 0.5; CAM's
classifier="auto".

IS-CAM / SS-CAM. Both papers build on Score-CAM's mask s(Up(A_k)): channel k upsampled to the input, then
min-max normalised (Score-CAM's reference code and IS-CAM's authors' code do the same). IS-CAM (Naidu et al.
2020) scores the masks c_i · M_k, c_i = Σ_{j=0..i-1} j/N, i = 1..N, and takes α_k = (1/N) Σ_i of the scores;
SS-CAM (Wang et al. 2020) takes the mean score of M_k + noise. The by-hand references below loop over images,
channels and masks. torchcam 0.5 normalises each channel at the layer's resolution before upsampling (with
1e-8 added to the range) and scales IS-CAM's masks by c_i = i (i + 1)/(2N): the tests pin both differences by
rebuilding torchcam's maps from ours with only those two things changed, and measure where the normalisation
order matters.

CAM's classifier="auto": the nn.Linear (or 1 × 1 conv) whose output is the model's output, never a hidden
layer; a clear error otherwise.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import assert_state_equal, model_state
from torch import nn

import explain
import explain.methods.perturbation as perturbation

# ---------------------------------------------------------------- helpers


def quiet(method, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # empty maps of random networks, peers' own warnings
        return method(*args, **options)


def per_map_correlation(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each pair of maps (N, h, w) → (N,), in float64."""
    a, b = first.double().flatten(1), second.double().flatten(1)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-300)


class StridedConvGapLinear(nn.Module):
    """conv (stride ``stride``) → ReLU → mean over positions → linear: the layer ``conv`` is ``stride`` times
    smaller than the input, so the masks are upsampled by that factor."""

    def __init__(self, stride: int = 2, channels: int = 5, classes: int = 6, scale: float = 1.0):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, stride=stride, padding=1)
        self.fc = nn.Linear(channels, classes)
        with torch.no_grad():
            self.fc.weight.mul_(scale)  # a confident classifier: logits that differ by several units

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def tiny(stride: int = 2, size: int = 8, scale: float = 4.0):
    torch.manual_seed(0)
    return StridedConvGapLinear(stride, scale=scale).eval(), torch.randn(3, 3, size, size)


def upsampled(maps: torch.Tensor, size) -> torch.Tensor:
    """(..., h, w) → (..., H, W), bilinear with align_corners=False (as the papers' code and torchcam)."""
    shape = maps.shape
    flat = maps.reshape(-1, 1, *shape[-2:]).double()
    return F.interpolate(flat, size=tuple(size), mode="bilinear", align_corners=False).reshape(*shape[:-2], *size)


def minmax(maps: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """(A − min A) / (max A − min A) over the last two dimensions; a constant map gives zeros."""
    low = maps.amin(dim=(-2, -1), keepdim=True)
    span = maps.amax(dim=(-2, -1), keepdim=True) - low
    if eps:
        return (maps - low) / (span + eps)  # torchcam's _normalize
    return torch.where(span > 0, (maps - low) / torch.where(span > 0, span, 1.0), 0.0)


def paper_masks(activations: torch.Tensor, size) -> torch.Tensor:
    """Score-CAM's s(Up(A_k)): upsampled to the input, then min-max normalised. (N, C, h, w) → (N, C, H, W)."""
    return minmax(upsampled(activations, size))


def torchcam_masks(activations: torch.Tensor, size) -> torch.Tensor:
    """torchcam 0.5's masks: min-max normalised at the layer's resolution (range + 1e-8), then upsampled."""
    return upsampled(minmax(activations.double(), eps=1e-8), size)


def paper_scales(steps: int) -> list[float]:
    """IS-CAM's c_i = Σ_{j=0..i-1} j / N for i = 1..N (the first is 0: a blank image)."""
    return [sum(j / steps for j in range(i)) for i in range(1, steps + 1)]


def score_weighted_maps(model, x, activations, classes, masked_inputs_of) -> torch.Tensor:
    """Σ_k softmax_k(α) A_k with α_k = the mean model score of class c over ``masked_inputs_of(n, k)`` (a list
    of (C, H, W) inputs): a loop over images, channels and inputs. No ReLU (compared with relu=False)."""
    maps = []
    for n, c in enumerate(classes):
        alphas = []
        for k in range(activations.shape[1]):
            with torch.no_grad():
                scores = [float(model(masked[None].float())[0, c]) for masked in masked_inputs_of(n, k)]
            alphas.append(sum(scores) / len(scores))
        weights = torch.tensor(alphas, dtype=torch.float64).softmax(0)
        maps.append((weights[:, None, None] * activations[n].double()).sum(0))
    return torch.stack(maps)


def layer_output(model: nn.Module, layer: str, x: torch.Tensor) -> torch.Tensor:
    stash = []
    handle = dict(model.named_modules())[layer].register_forward_hook(lambda m, i, o: stash.append(o.detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return stash[0].double()


# ---------------------------------------------------------------- IS-CAM and SS-CAM: the papers, by hand


@pytest.mark.parametrize("steps, size", [(4, 8), (3, 12)])
def test_is_cam_is_the_papers_integral_over_masks_upsampled_then_normalised(steps, size):
    """α_k = (1/N) Σ_{i=1..N} y_c(c_i M_k ⊙ X), c_i = Σ_{j<i} j/N, M_k = s(Up(A_k)); every one of the N masks
    scored here, the blank first one too (which ours skips: it shifts every α_k alike)."""
    model, x = tiny(size=size)
    classes = [0, 3, 5]
    a = layer_output(model, "conv", x)
    masks = paper_masks(a, x.shape[-2:])
    by_hand = score_weighted_maps(model, x, a, classes,
                                  lambda n, k: [x[n] * scale * masks[n, k] for scale in paper_scales(steps)])
    result = explain.ISCAM(model, "conv", steps=steps, relu=False, normalize=None).explain(x, target=classes)
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("size", [8, 12])
def test_ss_cam_is_the_papers_mean_over_noisy_masks_upsampled_then_normalised(size):
    """α_k = (1/S) Σ_s y_c((M_k + σ ε_s) ⊙ X), M_k = s(Up(A_k)), ε_s the draws given (one per image, channel and
    pixel)."""
    model, x = tiny(size=size)
    classes = [1, 2, 4]
    a = layer_output(model, "conv", x)
    masks = paper_masks(a, x.shape[-2:])
    noise = [torch.randn(3, 5, size, size, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    given = iter(noise)
    result = explain.SSCAM(model, "conv", samples=2, noise_std=0.3, noise_draws=lambda shape: next(given),
                           relu=False, normalize=None).explain(x, target=classes)
    by_hand = score_weighted_maps(model, x, a, classes,
                                  lambda n, k: [x[n] * (masks[n, k] + 0.3 * z[n, k].double()) for z in noise])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


def test_is_cam_needs_two_steps():
    model, x = tiny()
    with pytest.raises(ValueError, match="steps must be an int of at least 2"):
        explain.ISCAM(model, "conv", steps=1)


# ---------------------------------------------------------------- where the normalisation order matters


def test_normalising_before_or_after_upsampling_differs_only_where_an_even_factor_misses_an_extreme():
    """Bilinear upsampling (align_corners=False) by an integer factor s samples source coordinates (i + ½)/s − ½,
    clamped to the edges. It is linear and keeps constants, so torchcam's mask is ours mapped affinely,
    a · M + b with a = range(Up A)/range(A) ≤ 1 and b ≥ 0; they are equal when Up takes both extremes of A:
    always for an odd s (every pixel centre is sampled) and for maps of at most 2 pixels a side (every pixel is
    on an edge, reached by the clamped samples); for an even s an interior extreme is never sampled (the nearest
    samples are 1/(2s) of a pixel away on each axis) and the two masks differ."""
    torch.manual_seed(3)
    a = torch.rand(4, 6, 6, dtype=torch.float64)
    a[:, 2, 3] = 2.0  # an interior maximum
    corners = torch.rand(4, 2, 2, dtype=torch.float64)
    for maps, size in [(a, (18, 18)), (a, (30, 30)), (corners, (64, 64)), (corners, (7, 9))]:
        torch.testing.assert_close(torchcam_masks(maps, size), paper_masks(maps, size), atol=1e-7, rtol=0)
    for size in [(12, 12), (24, 24)]:  # s = 2 and 4
        ours, theirs = paper_masks(a, size), torchcam_masks(a, size)
        up = upsampled(a, size)
        span = a.amax(dim=(1, 2)) - a.amin(dim=(1, 2))
        scale = (up.amax(dim=(1, 2)) - up.amin(dim=(1, 2))) / span
        shift = (up.amin(dim=(1, 2)) - a.amin(dim=(1, 2))) / span
        torch.testing.assert_close(theirs, scale[:, None, None] * ours + shift[:, None, None], atol=1e-7, rtol=0)
        s = size[0] // 6
        assert (theirs.amax(dim=(1, 2)) < 1 - 1 / (4 * s)).all()  # the interior maximum is not reached
        assert (theirs.amax(dim=(1, 2)) > 1 - 1 / s).all()  # but no sample is farther than 1/(2s) pixel from it


class TorchcamScales(explain.ISCAM):
    """Ours with torchcam 0.5's IS-CAM masks, c_i = Σ_{j=1..i} j/N, still divided by N."""

    def mask_scales(self) -> list[float]:
        return [step * (step + 1) / (2 * self.steps) for step in range(1, self.steps + 1)]


def normalised_at_layer_resolution(activation, images, channels, size):
    """torchcam 0.5's masks in place of ``perturbation.input_masks``: normalised, then upsampled."""
    return torchcam_masks(activation[images, channels][:, None], size).float()


def our_maps(monkeypatch, method, model, layer, x, classes, torchcam_order: bool, **options) -> torch.Tensor:
    with monkeypatch.context() as patch:
        if torchcam_order:
            patch.setattr(perturbation, "input_masks", normalised_at_layer_resolution)
        explainer = method(model, layer, normalize=None, progress=False, batch_size=512, **options)
        return quiet(explainer.explain, x, target=classes).low_res_maps[0][:, 0].double()


def peer(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (pip install --no-deps torchcam==0.5.0)")


def torchcam_maps(method, model, layer, x, classes, **options) -> torch.Tensor:
    """(N, h, w) raw low-resolution maps of a torchcam extractor."""
    with quiet(method, model, layer, **options) as extractor:
        with torch.no_grad():
            model(x)
        return quiet(extractor, class_idx=classes, normalized=False)[0].detach().double()


class Confident(nn.Module):
    """A random-weights model's logits times ``temperature``: logits that differ by tens of units, as a trained
    classifier's do, so that the softmax over channels is peaked (random weights give logits within ±1)."""

    def __init__(self, model: nn.Module, temperature: float):
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, x):
        return self.model(x) * self.temperature


def confident_resnet18() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # BatchNorm statistics as after training (the initial ones are the identity)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.2, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.normal_(0, 0.2, generator=generator)
    return Confident(model, 30.0).eval()


def torchcam_case(case: str) -> tuple[nn.Module, str, torch.Tensor, list[int]]:
    """(model, layer, images, classes) of a comparison with torchcam."""
    if case == "resnet18 relu":  # the stem's output: 32 × 32 maps of a 64 px image, upsampled × 2
        model, layer = confident_resnet18(), "model.relu"
        torch.manual_seed(2)
        return model, layer, torch.randn(2, 3, 64, 64), [3, 7]
    stride, size = {"maps 2x2": (2, 4), "maps 3x3 up x3": (3, 9), "maps 4x4 up x2": (2, 8)}[case]
    model, x = tiny(stride=stride, size=size)
    return model, "conv", x, [0, 3, 5]


# where both orders give the same masks (maps of 2 px a side, an odd factor) and where they do not
TORCHCAM_CASES = [("maps 2x2", False), ("maps 3x3 up x3", False), ("maps 4x4 up x2", True),
                  ("resnet18 relu", True)]


@pytest.mark.parametrize("case, orders_differ", TORCHCAM_CASES)
def test_torchcam_is_cam_is_ours_with_its_scales_and_masks_normalised_at_layer_resolution(monkeypatch, case,
                                                                                           orders_differ):
    methods = peer("torchcam.methods")
    model, layer, x, classes = torchcam_case(case)
    theirs = torchcam_maps(methods.ISCAM, model, layer, x, classes, num_samples=3, batch_size=512)
    tolerance = dict(rtol=2e-3, atol=1e-5 * float(theirs.abs().max()))
    rebuilt = our_maps(monkeypatch, TorchcamScales, model, layer, x, classes, torchcam_order=True, steps=3)
    torch.testing.assert_close(rebuilt, theirs, **tolerance)
    same_order = our_maps(monkeypatch, TorchcamScales, model, layer, x, classes, torchcam_order=False, steps=3)
    agreement = per_map_correlation(same_order, theirs)
    print(f"{case}: IS-CAM with torchcam's scales, masks upsampled then normalised, against torchcam: "
          f"{agreement.tolist()}")
    if orders_differ:
        assert not torch.allclose(same_order, theirs, **tolerance)  # the order alone changes the map
    else:
        torch.testing.assert_close(same_order, theirs, **tolerance)
    if case == "resnet18 relu":
        assert agreement.min() < 0.9  # and by much on a confident classifier
    ours = our_maps(monkeypatch, explain.ISCAM, model, layer, x, classes, torchcam_order=False, steps=3)
    print(f"{case}: IS-CAM (the paper's) against torchcam: {per_map_correlation(ours, theirs).tolist()}")
    assert not torch.allclose(ours, theirs, **tolerance)  # the scales alone differ


@pytest.mark.parametrize("case, orders_differ", TORCHCAM_CASES)
def test_torchcam_ss_cam_is_ours_with_masks_normalised_at_layer_resolution(monkeypatch, case, orders_differ):
    """Same noise (torchcam draws Normal(0, σ).sample((N, C, H, W)) from torch's global generator per sample)."""
    methods = peer("torchcam.methods")
    model, layer, x, classes = torchcam_case(case)
    channels = layer_output(model, layer, x).shape[1]
    torch.manual_seed(7)
    normal = torch.distributions.normal.Normal(0.0, 2.0)
    draws = [normal.sample((len(x), channels, *x.shape[-2:])) / 2.0 for _ in range(2)]

    def ours(torchcam_order: bool) -> torch.Tensor:
        replay = iter(draws)
        return our_maps(monkeypatch, explain.SSCAM, model, layer, x, classes, torchcam_order, samples=2,
                        noise_std=2.0, noise_draws=lambda shape: next(replay))

    torch.manual_seed(7)
    theirs = torchcam_maps(methods.SSCAM, model, layer, x, classes, num_samples=2, std=2.0, batch_size=512)
    tolerance = dict(rtol=2e-3, atol=1e-5 * float(theirs.abs().max()))
    torch.testing.assert_close(ours(torchcam_order=True), theirs, **tolerance)
    upsampled_first = ours(torchcam_order=False)
    agreement = per_map_correlation(upsampled_first, theirs)
    print(f"{case}: SS-CAM (the paper's) against torchcam, same noise: {agreement.tolist()}")
    if orders_differ:
        assert not torch.allclose(upsampled_first, theirs, **tolerance)
    else:
        torch.testing.assert_close(upsampled_first, theirs, **tolerance)
    if case == "resnet18 relu":
        assert agreement.min() < 0.9


# ---------------------------------------------------------------- CAM's classifier="auto"


def cam_by_hand(weights: torch.Tensor, feature_maps: torch.Tensor, classes) -> torch.Tensor:
    """The CAM paper's M_c = Σ_k w_c,k A_k: the classifier's row for the class times the feature maps."""
    return torch.einsum("nk,nkhw->nhw", weights.detach().double()[list(classes)], feature_maps.double())


def test_mobilenet_v3_classifier_is_the_last_linear_layer_not_the_hidden_one():
    """torchvision's MobileNetV3 pools ``features`` (576 channels) into Linear(576 → 1024), Hardswish, Dropout,
    Linear(1024 → classes): no layer's pooled output is read by the classifier, so CAM refuses, naming it."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=1100).eval()
    x = torch.randn(2, 3, 64, 64)
    before = model_state(model)
    with pytest.raises(ValueError, match=r"classifier 'classifier\.3' takes 1024 features, but layer 'features' "
                                         r"has 576 channels.*Grad-CAM.*'classifier\.0'"):
        explain.ClassActivationMapping(model, "features").explain(x, target=[3, 1050])
    with pytest.raises(ValueError, match=r"'classifier\.0' has 1024 outputs, but the model's output has 1100 "
                                         "classes"):
        explain.ClassActivationMapping(model, "features", classifier="classifier.0").explain(x, target=[3, 1050])
    with pytest.raises(ValueError, match="class index 1100 is out of range: the model has 1100 classes"):
        explain.ClassActivationMapping(model, "features").explain(x, target=[3, 1100])
    assert_state_equal(before, model_state(model))
    # the rule on MobileNetV2, whose classifier reads the pooled features: Dropout, Linear(1280 → classes)
    v2 = torchvision.models.mobilenet_v2(weights=None, num_classes=10).eval()
    result = explain.ClassActivationMapping(v2, "features", relu=False, normalize=None).explain(x, target=[2, 9])
    by_hand = cam_by_hand(v2.classifier[1].weight, layer_output(v2, "features", x), [2, 9])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


def tiny_dinov2_config():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64, image_size=28, patch_size=14,
                                                   num_labels=5)


def test_dinov2_classifier_is_not_read_as_the_last_blocks_mlp():
    """Dinov2ForImageClassification's classifier reads the class token joined with the mean patch token (64
    features for 32 channels); the last block's mlp.fc1 takes 32 features but is a hidden layer."""
    transformers, config = tiny_dinov2_config()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 28, 28)
    classifier = transformers.Dinov2ForImageClassification(config).eval()
    with pytest.raises(ValueError, match=r"classifier 'classifier' takes 64 features, but layer "
                                         r"'dinov2\.encoder\.layer\.1' has 32 channels"):
        explain.ClassActivationMapping(classifier, "dinov2.encoder.layer.1").explain(x, target=[1, 2])
    backbone = transformers.Dinov2Model(config).eval()  # no classifier at all: its output is a LayerNorm's
    before = model_state(backbone)
    with pytest.raises(ValueError, match=r"found no nn\.Linear or 1 × 1 nn\.Conv2d whose output is the model's "
                                         r"output.*'encoder\.layer\.1\.mlp\.fc1'.*classifier='NAME'"):
        explain.ClassActivationMapping(backbone, "encoder.layer.1", output="pooler_output").explain(x, target=[1, 2])
    assert_state_equal(before, model_state(backbone))


class HeadThenAuxiliary(nn.Module):
    """conv → mean → Linear(8 → 5) → Dropout → reshape; an auxiliary Linear(8 → 3), defined after the head,
    whose output the forward discards (as a training-only head)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)
        self.drop = nn.Dropout(0.3)
        self.auxiliary = nn.Linear(8, 3)

    def forward(self, x):
        pooled = self.conv(x).mean(dim=(2, 3))
        self.auxiliary(pooled)  # computed, not returned
        return self.drop(self.head(pooled)).reshape(len(x), 1, 5).squeeze(1)


class HiddenLinearAfterPooling(nn.Module):
    """conv (8 channels) → mean → Linear(8 → 16) → ReLU → Linear(16 → 5), optionally a sigmoid after it."""

    def __init__(self, sigmoid: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
        self.sigmoid = sigmoid

    def forward(self, x):
        scores = self.head(self.conv(x).mean(dim=(2, 3)))
        return scores.sigmoid() if self.sigmoid else scores


def test_auto_takes_the_layer_whose_output_is_the_models_output():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = HeadThenAuxiliary().eval()
    result = explain.ClassActivationMapping(model, "conv", relu=False, normalize=None).explain(x, target=[4, 1])
    by_hand = cam_by_hand(model.head.weight, layer_output(model, "conv", x), [4, 1])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)

    hidden = HiddenLinearAfterPooling().eval()
    before = model_state(hidden)
    with pytest.raises(ValueError, match=r"classifier 'head\.2' takes 16 features, but layer 'conv' has 8 channels"
                                         r".*'head\.0'"):
        explain.ClassActivationMapping(hidden, "conv").explain(x, target=[1, 2])
    assert_state_equal(before, model_state(hidden))

    scored = HiddenLinearAfterPooling(sigmoid=True).eval()  # the output is computed from the logits: not found
    with pytest.raises(ValueError, match=r"found no nn\.Linear.*'head\.0'.*name it: classifier='NAME'"):
        explain.ClassActivationMapping(scored, "conv").explain(x, target=[1, 2])
    pooled_head = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                nn.Linear(8, 5), nn.Sigmoid()).eval()
    named = explain.ClassActivationMapping(pooled_head, "0", classifier="3", relu=False, normalize=None)
    result = named.explain(x, target=[0, 4])  # named, a classifier whose output a sigmoid follows is used
    by_hand = cam_by_hand(pooled_head[3].weight, layer_output(pooled_head, "0", x), [0, 4])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-6)


def test_auto_on_timm_efficientnet_reads_the_classifier_after_the_pooled_head():
    """timm's EfficientNet: conv_head (1 × 1, 320 → 1280) → bn2 → pool → Dropout → classifier(1280 → classes)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=7).eval()
    x = torch.randn(2, 3, 64, 64)
    result = explain.ClassActivationMapping(model, "bn2", relu=False, normalize=None).explain(x, target=[1, 6])
    by_hand = cam_by_hand(model.classifier.weight, layer_output(model, "bn2", x), [1, 6])
    torch.testing.assert_close(result.low_res_maps[0][:, 0].double(), by_hand, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"classifier 'classifier' takes 1280 features, but layer 'blocks' has 320 "
                                         r"channels.*'conv_head'"):
        explain.ClassActivationMapping(model, "blocks").explain(x)
