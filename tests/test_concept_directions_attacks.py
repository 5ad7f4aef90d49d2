"""CRP with directions as concepts and ``principal_directions``, attacked as a hostile user would: an in-place
operation after the layer, more principal directions than the features span, channel dimensions that are not one,
channels-last (Swin) outputs, another thread running the model meanwhile, activation references of tokens, directions
given as a list of tensors. Each is compared with a by-hand computation: the virtual inspection layer of Vielhaben et
al. (2024) inserted into a copy of the model (h = U a, a = Uᵀ h, the relevance at h read and masked with a tensor
hook), numpy's SVD of the features captured with a plain hook, or the projections u_k · a computed here."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from conftest import assert_complete_basis_conserves, assert_state_equal, model_state
from torch import nn

import explain
from explain.core.capture import LayerOutputError
from explain.methods.concepts import _crop, concept_references, principal_directions


def random_basis(size: int, seed: int) -> torch.Tensor:
    """A random orthonormal basis (size, size) in float64, one direction per row."""
    matrix = torch.randn(size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(matrix).Q.T.contiguous()


class VirtualInspection(nn.Module):
    """``module`` followed by the virtual inspection layer h = U a (``encode``), a = Uᵀ h (``decode``) over the
    channel dimension ``dim``: two bias-free linear maps, so that LRP (ε → 0) and AttnLRP pass relevance through them
    as LRP-0. h is channels last."""

    def __init__(self, module: nn.Module, basis: torch.Tensor, dim: int):
        super().__init__()
        size = basis.shape[0]
        self.module, self.dim = module, dim
        self.encode = nn.Linear(size, size, bias=False, dtype=basis.dtype)
        self.decode = nn.Linear(size, size, bias=False, dtype=basis.dtype)
        with torch.no_grad():
            self.encode.weight.copy_(basis)
            self.decode.weight.copy_(basis.T)

    def forward(self, *args):
        features = self.module(*args).movedim(self.dim, -1)
        return self.decode(self.encode(features)).movedim(-1, self.dim)


def with_virtual_layer(model: nn.Module, layer: str, basis: torch.Tensor, dim: int) -> nn.Module:
    """A copy of ``model`` with ``layer`` wrapped in a VirtualInspection of ``basis``."""
    virtual = copy.deepcopy(model)
    parent_name, _, child = layer.rpartition(".")
    parent = virtual.get_submodule(parent_name) if parent_name else virtual
    setattr(parent, child, VirtualInspection(getattr(parent, child), basis.to(next(model.parameters()).dtype), dim))
    return virtual


def virtual_by_hand(virtual: nn.Module, encode: str, method: str, options: dict, image: torch.Tensor, label: int,
                    keep: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input relevance (C, H, W), relevance of each unit of h (K,)) of ``method`` for ``label`` through the virtual
    layer, with the relevance at h kept on unit ``keep`` alone (None: all). LRP's backward carries relevance; AttnLRP's
    carries gradients, the relevance being h ⊙ gradient."""
    module = virtual.get_submodule(encode)
    seen: dict[str, torch.Tensor] = {}

    def on_output(_module, _args, h):
        if not h.requires_grad:
            return

        def on_flowing(flowing):
            relevance = flowing * h.detach() if method == "attnlrp" else flowing
            seen["relevance"] = relevance.detach().double().reshape(-1, h.shape[-1]).sum(dim=0)
            if keep is None:
                return flowing
            mask = torch.zeros(h.shape[-1], dtype=flowing.dtype)
            mask[keep] = 1
            return flowing * mask

        h.register_hook(on_flowing)

    added = []  # added as the layer starts: after the method's own hooks
    handle = module.register_forward_pre_hook(
        lambda _module, _args: added.append(module.register_forward_hook(on_output)) if not added else None)
    try:
        explanation = explain.get_method(method)(virtual, **options).explain(image[None], target=label)
    finally:
        handle.remove()
        for late in added:
            late.remove()
    return explanation.attributions[0, 0], seen["relevance"]


def captured_output(model: nn.Module, layer: str, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s output in a plain no-grad forward of ``model`` on ``x``, copied before anything after it runs."""
    seen = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda _module, _args, output: seen.update(output=output.detach().clone()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen["output"]


def numpy_principal_directions(features: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` right singular vectors of the centred (positions, C) features, each signed so that the
    mean feature projects on it positively."""
    _, _, right = np.linalg.svd(features - features.mean(axis=0), full_matrices=False)
    signs = np.where(features.mean(axis=0) @ right[:count].T < 0, -1.0, 1.0)
    return right[:count] * signs[:, None]


# ------------------------------------------------------------------ models


def cnn_with_in_place_relu() -> nn.Module:
    """conv → BatchNorm (the concept layer "1") → ReLU(inplace=True) → conv → ReLU → pool → linear, float64; the
    BatchNorm's statistics are set so that its output has negative values, which the in-place ReLU overwrites."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(6, 4))
    with torch.no_grad():
        model[1].running_mean.normal_(generator=torch.Generator().manual_seed(1))
        model[1].running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(2))
    return model.eval().double()


def resnet18() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=4).eval().double()


def small_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=4).eval()


def small_swin() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, window_size=7,
                             embed_dim=16, depths=(1, 1), num_heads=(2, 2), num_classes=4).eval()


class ChannelsLastMixer(nn.Module):
    """conv stem → (N, h, w, C) → a Linear over the channels (the layer "mixer", output channels last, h = w = 8,
    C = 6) → back to channels first → pool → linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.mixer = nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.Linear(6, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, images):
        mixed = self.mixer(self.stem(images).permute(0, 2, 3, 1))
        return self.head(nn.functional.gelu(mixed).mean(dim=(1, 2)))


LRP_ZERO = {"composite": "epsilon_plus", "epsilon": 1e-12}  # the ε rule with ε → 0 at the virtual layer: LRP-0

IN_PLACE_CASES = {
    "cnn-lrp": (cnn_with_in_place_relu, "1", "lrp", LRP_ZERO, 16),
    "cnn-attnlrp": (cnn_with_in_place_relu, "1", "attnlrp", {}, 16),
    "resnet18-lrp": (resnet18, "layer1.0.bn1", "lrp", LRP_ZERO, 32),
    "resnet18-attnlrp": (resnet18, "layer1.0.bn1", "attnlrp", {}, 32),
}


# ------------------------------------------------------------------ the tests


@pytest.mark.filterwarnings("ignore:layer layer1.0.bn1 does not carry all the relevance")  # inside a residual branch
@pytest.mark.parametrize("case", sorted(IN_PLACE_CASES))
def test_an_in_place_relu_after_the_layer_leaves_each_directions_relevance_and_map_the_virtual_layers(case):
    """The directions' rule reads the layer's output a (c = R / a for LRP, and u_k · a for R_k): a ReLU(inplace=True)
    right after the layer (a BatchNorm here, as in every torchvision ResNet block) must not change the a it reads.
    R_k and each conditional map equal the virtual inspection layer's inserted after the layer, by hand."""
    build, layer, method, options, size = IN_PLACE_CASES[case]
    model = build()
    x = torch.rand(2 if size == 16 else 1, 3, size, size, generator=torch.Generator().manual_seed(3),
                   dtype=torch.float64)
    channels = model.get_submodule(layer).num_features
    basis = random_basis(channels, seed=4)
    before = model_state(model)
    e = explain.ConceptRelevance(model, layer, method, directions=basis[:5], **options).explain(x, concepts=2)
    assert_state_equal(before, model_state(model))
    virtual = with_virtual_layer(model, layer, basis, dim=1)
    for image in range(x.shape[0]):
        label = int(e.diagnostics["explained_class"][image])
        _, at_h = virtual_by_hand(virtual, f"{layer}.encode", method, options, x[image], label, keep=None)
        scale = float(at_h.abs().max())
        torch.testing.assert_close(e.diagnostics["layer_relevance"][image] / scale, at_h[:5] / scale, atol=1e-7,
                                   rtol=1e-6)
        for m in range(2):
            expected, _ = virtual_by_hand(virtual, f"{layer}.encode", method, options, x[image], label,
                                          keep=int(e.class_indices[image, m]))
            scale = float(expected.abs().max())
            torch.testing.assert_close(e.attributions[image, m] / scale, expected / scale, atol=1e-7, rtol=1e-6)


def test_an_in_place_activation_after_the_layer_leaves_attnlrps_channel_relevance_activation_times_gradient():
    """The same rule for channels with AttnLRP, whose R_c = Σ a ⊙ g reads the layer's output: a LeakyReLU(inplace=True)
    after the convolution (negative values scaled by 0.1 in place, where the gradient is not 0) leaves R_c that of
    the convolution's own output, by hand with a tensor hook on a copy of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.LeakyReLU(0.1, inplace=True), nn.Conv2d(6, 5, 3),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)).eval().double()
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64) - 0.5
    e = explain.ConceptRelevance(model, "0", "attnlrp").explain(x, concepts=2)
    seen = {}

    def on_output(_module, _args, output):
        if output.requires_grad:
            activation = output.detach().clone()
            output.register_hook(lambda gradient: seen.update(r=(gradient * activation).double().sum(dim=(2, 3))))

    handle = model[0].register_forward_hook(on_output)
    try:
        explain.AttnLRP(model).explain(x, target=e.diagnostics["explained_class"].tolist())
    finally:
        handle.remove()
    assert bool((captured_output(model, "0", x) < 0).any()), "the in-place activation changes some values"
    torch.testing.assert_close(e.diagnostics["layer_relevance"], seen["r"], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("build, layer", [(cnn_with_in_place_relu, "1"), (resnet18, "layer1.0.bn1")])
def test_principal_directions_and_activation_references_read_the_layer_before_an_in_place_relu(build, layer):
    """principal_directions is the SVD of the layer's own output, and an activation reference's value is the largest
    projection u_k · a over its positions, with a the layer's output before the in-place ReLU that follows it."""
    model = build()
    x = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    output = captured_output(model, layer, x)
    assert bool((output < 0).any())
    features = output.movedim(1, -1).reshape(-1, output.shape[1]).numpy()
    directions = principal_directions(model, layer, x, count=3)
    np.testing.assert_allclose(directions.numpy(), numpy_principal_directions(features, 3), atol=1e-8)
    crp = explain.ConceptRelevance(model, layer, composite="epsilon_plus", directions=directions)
    references = concept_references(crp, list(x), top=2, mode="activation")
    largest = torch.einsum("nchw,kc->nkhw", output, directions).flatten(2).amax(dim=2)  # (N, K) by hand
    best = largest.topk(2, dim=0)
    assert torch.equal(references.images, best.indices.T)
    torch.testing.assert_close(references.values.double(), best.values.T, atol=1e-5, rtol=1e-5)


def test_principal_directions_refuses_more_directions_than_the_features_span():
    """P positions (images × positions per image) of centred features span at most P − 1 directions: asking for more
    is refused (it returned fewer rows than asked, or arbitrary ones), and up to P − 1 equal numpy's SVD. A numpy
    integer is a count like any other."""
    torch.manual_seed(0)
    vectors = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="3 positions.*at most 2 directions.*count ≤ 2"):
        principal_directions(vectors, "1", x, count=3)
    features = captured_output(vectors, "1", x).double().numpy()
    np.testing.assert_allclose(principal_directions(vectors, "1", x, count=np.int64(2)).numpy(),
                               numpy_principal_directions(features, 2), atol=1e-8)
    # the same rule on a feature map: one image, a 2 × 2 map of 16 channels, 4 positions
    pooled = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                           nn.Linear(64, 3)).eval()
    one = x[:1]
    with pytest.raises(ValueError, match="4 positions.*at most 3 directions"):
        principal_directions(pooled, "1", one, count=4)
    output = captured_output(pooled, "1", one)
    np.testing.assert_allclose(principal_directions(pooled, "1", one, count=3).numpy(),
                               numpy_principal_directions(output.movedim(1, -1).reshape(-1, 16).double().numpy(), 3),
                               atol=1e-8)


def test_a_channel_dim_that_is_not_a_channel_dimension_is_refused_and_the_model_left_as_found():
    """channel_dim 0 is the batch, and 4, 5 or −5 are no dimension of an (N, C, H, W) output: refused (5 was read as 1
    and −5 as 3, 0 and 4 as the batch), by CRP with directions or channels and by principal_directions; the same for
    (N, T, D) tokens."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(6, 3)).eval()
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    vit = small_vit()
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    for model, layer, method, inputs, bad in ((cnn, "0", "lrp", x, (0, 4, 5, -5)),
                                              (vit, "blocks.0", "attnlrp", images, (0, 3, -3))):
        channels = captured_output(model, layer, inputs).shape[-1 if method == "attnlrp" else 1]
        before = model_state(model)
        for channel_dim in bad:
            for directions in (None, torch.eye(channels)[:2]):
                with pytest.raises(LayerOutputError, match=f"channel_dim={channel_dim} is not a channel dimension"):
                    explain.ConceptRelevance(model, layer, method, channel_dim=channel_dim,
                                             directions=directions).explain(inputs, concepts=1)
            with pytest.raises(LayerOutputError, match="dimension 0 is the batch"):
                principal_directions(model, layer, inputs, count=1, channel_dim=channel_dim)
        assert_state_equal(before, model_state(model))


@pytest.mark.parametrize("build, layer, size", [(small_swin, "layers.0", 56), (ChannelsLastMixer, "mixer", 16)])
def test_channels_last_outputs_default_to_their_channels(build, layer, size):
    """A Swin stage's output is (N, h, w, C): its concepts lie along the last dimension, whose size is the stage's
    linear layers' (it was read as dimension 1, the height): principal_directions is the SVD of the (N h w, C) features
    by default, and CRP's defaults equal channel_dim=-1, for directions and for channels."""
    model = build().eval()
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(10))
    output = captured_output(model, layer, x)
    assert output.shape[1] != output.shape[3]
    features = output.reshape(-1, output.shape[3]).double().numpy()
    directions = principal_directions(model, layer, x, count=3)
    np.testing.assert_allclose(directions.numpy(), numpy_principal_directions(features, 3), atol=1e-6)
    for given in ({"directions": directions}, {}):
        default = explain.ConceptRelevance(model, layer, "attnlrp", **given).explain(x, concepts=2)
        stated = explain.ConceptRelevance(model, layer, "attnlrp", channel_dim=-1, **given).explain(x, concepts=2)
        assert default.diagnostics["layer_relevance"].shape == (2, 3 if given else output.shape[3])
        assert torch.equal(default.class_indices, stated.class_indices)
        torch.testing.assert_close(default.attributions, stated.attributions)


def run_in_another_thread_while(model: nn.Module, trigger: nn.Module, other_input: torch.Tensor):
    """A hook on ``trigger`` that, each time it runs in the thread that made it, runs a no-grad forward pass of
    ``model`` on ``other_input`` in another thread and waits for it: another thread's inference in the middle of
    every forward pass of the call, deterministically. Returns the hook's handle."""
    owner = threading.get_ident()

    def serve_once(_module, _args, _output):
        if threading.get_ident() != owner:
            return
        outputs = []

        def serve():
            with torch.no_grad():
                outputs.append(model(other_input))

        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        assert outputs, "the other thread's forward ran"

    return trigger.register_forward_hook(serve_once)


@pytest.mark.parametrize("model_name", ["cnn", "vit"])
def test_principal_directions_and_activation_references_ignore_another_threads_forward_passes(model_name):
    """Another thread runs the model (on other images) in the middle of each of the call's forward passes, after the
    concept layer: principal_directions and activation references are what they are without it (the other thread's
    layer output was counted as a second run, or replaced the call's)."""
    if model_name == "cnn":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)).eval()
        layer, size, last = "2", 12, model[6]
    else:
        model = small_vit()
        layer, size, last = "blocks.1", 32, model.head
    x = torch.rand(4, 3, size, size, generator=torch.Generator().manual_seed(11))
    other = 5 * torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(12))
    expected = principal_directions(model, layer, x, count=2)
    crp = explain.ConceptRelevance(model, layer, "attnlrp", directions=expected)
    expected_references = concept_references(crp, list(x), top=2, mode="activation") if model_name == "cnn" else None
    handle = run_in_another_thread_while(model, last, other)
    try:
        torch.testing.assert_close(principal_directions(model, layer, x, count=2), expected, atol=0, rtol=0)
        if expected_references is not None:
            references = concept_references(crp, list(x), top=2, mode="activation")
            assert torch.equal(references.images, expected_references.images)
            torch.testing.assert_close(references.values, expected_references.values, atol=0, rtol=0)
    finally:
        handle.remove()


def test_activation_references_of_a_layer_without_feature_maps_are_refused_before_the_set_runs():
    """mode="activation" crops where a concept is active on the image: for vectors (N, D) it is refused after the
    first forward pass, naming the layer's output and mode='relevance' (it ran the model over the whole set first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    images = list(torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(13)))
    crp = explain.ConceptRelevance(model, "1", "lrp", directions=random_basis(16, seed=14)[:3])
    forwards = [0]
    handle = model.get_submodule("1").register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with pytest.raises(ValueError, match=r"layer 1 gives \(2, 16\): use mode='relevance'"):
            concept_references(crp, images, top=2, mode="activation", batch_size=2)
    finally:
        handle.remove()
    assert forwards[0] == 1


def test_activation_references_of_patch_tokens_are_where_each_direction_is_largest_on_the_patch_grid():
    """Tokens (N, 1 + 16, D) of a ViT with a 4 × 4 patch grid: an image's activation value for direction k is the
    largest u_k · token over its patch tokens (the class token does not lie on the image), by hand; the references
    are the images with the largest values, and each patch is cut where that direction is active on the grid."""
    model = small_vit()
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(13))
    basis = random_basis(16, seed=14)[:3]
    crp = explain.ConceptRelevance(model, "blocks.1", "attnlrp", directions=basis)
    references = concept_references(crp, list(images), top=2, mode="activation", batch_size=4)
    seen = {}
    handle = model.blocks[1].register_forward_hook(lambda _m, _a, output: seen.update(out=output.detach()))
    with torch.no_grad():
        model(images)
    handle.remove()
    projected = seen["out"][:, 1:].double() @ basis.T  # (6, 16 patches, 3)
    largest = projected.amax(dim=1)  # (6, 3)
    best = largest.topk(2, dim=0)
    assert references.images.tolist() == best.indices.T.tolist()
    torch.testing.assert_close(references.values.double(), best.values.T, atol=1e-5, rtol=1e-5)
    from explain.io.inputs import prepare_inputs

    shown = prepare_inputs(list(images), crp.explainer.preprocess, torch.device("cpu"), torch.float32).display.get()
    pictures = (shown.clamp(0, 1) * 255).round().byte().numpy()  # the images as the references show them
    for concept in range(3):
        for rank, image in enumerate(best.indices[:, concept].tolist()):
            grid = projected[image, :, concept].view(1, 1, 4, 4).float()  # the direction on the 4 × 4 patches
            heat = torch.nn.functional.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=False)[0, 0]
            np.testing.assert_array_equal(references.patches[concept][rank], _crop(pictures[image], heat))


def test_directions_as_a_list_of_tensors_equal_the_stacked_tensor_and_complex_ones_are_refused():
    """A list of concept vectors (one tensor each, e.g. CAVs) is the (K, C) matrix of its rows (it was refused with
    torch's "only one element tensors can be converted"); one vector in a list is that vector; complex directions
    are refused (their imaginary part was dropped with a warning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(6, 3)).eval()
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(15))
    basis = random_basis(6, seed=16).float()
    stacked = explain.ConceptRelevance(model, "0", composite="epsilon_plus", directions=basis[:3]).explain(
        x, concepts=None)
    listed = explain.ConceptRelevance(model, "0", composite="epsilon_plus",
                                      directions=[basis[0], basis[1], basis[2]]).explain(x, concepts=None)
    torch.testing.assert_close(listed.diagnostics["layer_relevance"], stacked.diagnostics["layer_relevance"])
    torch.testing.assert_close(listed.attributions, stacked.attributions)
    single = explain.ConceptRelevance(model, "0", composite="epsilon_plus", directions=[basis[4]]).explain(
        x, concepts=None)
    vector = explain.ConceptRelevance(model, "0", composite="epsilon_plus", directions=basis[4]).explain(
        x, concepts=None)
    torch.testing.assert_close(single.attributions, vector.attributions)
    with pytest.raises(ValueError, match="complex"):
        explain.ConceptRelevance(model, "0", composite="epsilon_plus", directions=basis[:2].to(torch.complex64))


@pytest.mark.parametrize("case", ["resnet18-lrp-layer2", "deit-attnlrp-block"])
def test_a_complete_basis_of_directions_conserves_the_unconditional_map_on_other_models(case):
    """Conservation over a complete basis (K = C) on models other than test_concepts.py's: a torchvision ResNet-18's
    layer2 with LRP, and a distilled DeiT's last block (class and distillation tokens) with AttnLRP: the conditional
    input relevances add up to the unconditional one, and the R_k to the channels' R_c."""
    if case.startswith("resnet18"):
        model, layer, method, options, size = resnet18().float(), "layer2", "lrp", {"composite": "epsilon_plus"}, 32
        channels = 128
    else:
        timm = pytest.importorskip("timm")
        torch.manual_seed(0)
        model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, num_classes=4,
                                  embed_dim=24, num_heads=2, depth=2).eval()
        layer, method, options, size, channels = "blocks.1", "attnlrp", {}, 32, 24
    x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(17))
    assert_complete_basis_conserves(model, layer, method, options, x, random_basis(channels, seed=18))


def test_principal_directions_of_a_training_model_leave_it_training_with_its_batchnorm_statistics():
    """A model in train mode (BatchNorm, dropout): the features are the eval-mode model's (running statistics, no
    dropout), and the model is left in train mode with its running statistics and batch counters as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                          nn.Conv2d(8, 6, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    model.train()
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(19))
    before = model_state(model)
    directions = principal_directions(model, "4", x, count=4)
    assert_state_equal(before, model_state(model))
    assert model.training and model[1].training
    output = captured_output(copy.deepcopy(model).eval(), "4", x)
    np.testing.assert_allclose(directions.numpy(),
                               numpy_principal_directions(output.movedim(1, -1).reshape(-1, 6).double().numpy(), 4),
                               atol=1e-6)
