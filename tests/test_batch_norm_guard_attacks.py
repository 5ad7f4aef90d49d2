"""Attacks on the BatchNorm gradient guard (``explain.methods._eval_batch_norm``): torch 2.14's CPU BatchNorm backward
(eval mode, and InstanceNorm's, the same kernel) is wrong for a one-row batch whose incoming gradient has the strides
of a feature map read as tokens; every explainer call hands the norm's backward a contiguous gradient (a pre-hook on
the norm output's autograd node). Each test checks the map against the same function with the norm written out
((x − μ) / √(σ² + ε) · γ + β in plain tensor operations: no norm kernel) and against the image's row in a batch:
an in-place edit of the norm's output, timm's BatchNormAct2d (the node is the activation's), BatchNorm1d/3d, the
second derivative (Shapley-CAM), two threads at once, autocast, no_grad / inference_mode, a backward that raises,
and the gradient methods not covered by test_issue39_batchnorm.py on timm LeViT and XCiT.

Three layouts are wrong in torch's kernel at any batch size, and were missed while the guard took one-row outputs
only: a BatchNorm read ``transpose(1, 3)`` from a one-pixel-high or -wide feature map, and InstanceNorm (one row of
N · C channels inside, whatever N) read sequence-first or called on one unbatched image."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from conftest import assert_state_equal, errors_in_threads, guarded_first_derivative, model_state
from torch import Tensor, nn

import explain

Edit = Callable[[Tensor, Tensor], Tensor]
Read = Callable[[Tensor], Tensor]


def randomized(model: nn.Module) -> nn.Module:
    """Every norm with random running statistics and affine parameters (a trained network's, not 0 and 1)."""
    generator = torch.Generator().manual_seed(1)
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.3)
                module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            if isinstance(module, norm_types) and module.weight is not None:
                module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(module.num_features, generator=generator) * 0.3)
    return model.eval()


def written_out(norm: nn.Module, features: Tensor) -> Tensor:
    """``norm(features)`` in plain tensor operations: eval-mode BatchNorm (running statistics), InstanceNorm (each
    channel of each image by its own biased statistics; a (C, ...) input is one unbatched image), or timm's
    BatchNormAct2d (the BatchNorm, then its drop and activation)."""
    instance = isinstance(norm, nn.modules.instancenorm._InstanceNorm)
    unbatched = instance and features.dim() == norm._get_no_batch_dim()
    channel_axis = 0 if unbatched else 1
    shape = (-1,) + (1,) * (features.dim() - channel_axis - 1)
    if instance:
        dims = tuple(range(channel_axis + 1, features.dim()))
        mean = features.mean(dim=dims, keepdim=True)
        variance = features.var(dim=dims, keepdim=True, unbiased=False)
    else:
        mean, variance = norm.running_mean.view(shape), norm.running_var.view(shape)
    normalized = (features - mean) / (variance + norm.eps).sqrt()
    if norm.weight is not None:
        normalized = normalized * norm.weight.view(shape) + norm.bias.view(shape)
    if hasattr(norm, "act"):  # timm's BatchNormAct2d
        normalized = norm.act(norm.drop(normalized))
    return normalized


class NormThenRead(nn.Module):
    """conv (4 × 4 patches) → norm → ``edit(normalized, features)`` → ``read`` (a tensor whose last axis is the
    channels, its batch at ``batch_axis``) → LayerNorm → linear → mean over the tokens: (N, 5) scores.
    ``written_out=True``: the same function with the norm written out (``written_out``), the reference."""

    def __init__(self, norm: nn.Module, read: Read = lambda y: y.flatten(2).transpose(1, 2),
                 edit: Edit = lambda normalized, features: normalized, batch_axis: int = 0) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 4, stride=4), norm
        self.token_norm, self.head = nn.LayerNorm(8), nn.Linear(8, 5)
        self.read, self.edit, self.batch_axis, self.written_out = read, edit, batch_axis, False

    def forward(self, x: Tensor) -> Tensor:
        features = self.conv(x)
        normalized = written_out(self.norm, features) if self.written_out else self.norm(features)
        scores = self.head(self.token_norm(self.read(self.edit(normalized, features))))
        return scores.movedim(self.batch_axis, 0).flatten(1, -2).mean(1)


def gradient_written_out(model: nn.Module, x: Tensor, target: int) -> Tensor:
    """∂ score[target] / ∂ x for every image of x, the norm written out (no norm kernel): (N, 3, H, W). ``model``
    has a ``written_out`` flag (``NormThenRead`` and the models below)."""
    model.written_out = True
    try:
        leaf = x.clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(leaf)[:, target].sum(), leaf)
    finally:
        model.written_out = False
    return gradient


def assert_saliency_alone_and_in_batch_written_out(model: nn.Module, x: Tensor, target: int = 2) -> None:
    """Saliency's per-channel gradient of image 0 alone, and of every image of the batch ``x``, equals the gradient
    of the function with the norm written out (float64: to 1e-10 of the largest), and the model is left as found."""
    before = model_state(model)
    saliency = explain.Saliency(model, normalize=None)
    alone = saliency.explain(x[:1], target=target).attributions[0, 0]
    in_batch = saliency.explain(x, target=[target] * x.shape[0]).attributions[:, 0]
    expected = gradient_written_out(model, x, target)
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(alone, expected[0], rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(in_batch, expected, rtol=0, atol=1e-10 * scale)
    assert_state_equal(before, model_state(model))


def torch_kernel_is_wrong_here() -> bool:
    """The premise: torch's own BatchNorm2d backward at batch 1 is wrong for the tokens' gradient layout."""
    norm = randomized(nn.BatchNorm2d(8).double())
    x = torch.randn(1, 8, 2, 2, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, 4, 8, dtype=torch.float64).transpose(1, 2).reshape(1, 8, 2, 2)
    (gradient,) = torch.autograd.grad(norm(x), x, grad)
    return not torch.allclose(gradient, grad * (norm.weight / (norm.running_var + norm.eps).sqrt()).view(1, -1, 1, 1))


def test_the_premise_an_in_place_residual_after_the_norm_is_wrong_without_the_guard():
    """Without an explainer (no guard), ``out += features`` after a BatchNorm read as tokens gives one image a gradient
    far from the written-out one (add_'s backward passes the tokens' strides on): the in-place cases below are
    meaningful. Skipped where this torch's kernel is right."""
    if not torch_kernel_is_wrong_here():
        pytest.skip("this torch's BatchNorm backward is right for the layout: nothing to work around")
    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.BatchNorm2d(8), edit=lambda y, f: y.__iadd__(f)).double())
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(leaf)[0, 2], leaf)
    expected = gradient_written_out(model, x, 2)
    assert float((gradient - expected).abs().max()) > 0.1 * float(expected.abs().max())


IN_PLACE_EDITS: dict[str, Edit] = {
    "ReLU(inplace=True)": lambda y, f: nn.ReLU(inplace=True)(y),
    "out += features": lambda y, f: y.__iadd__(f),
    "out.relu_()": lambda y, f: y.relu_(),
    "out.mul_(2).add_(1)": lambda y, f: y.mul_(2).add_(1),
    "out[:, :4] *= 3": lambda y, f: (y[:, :4].mul_(3), y)[1],
}
NORMS: dict[str, Callable[[], nn.Module]] = {
    "BatchNorm2d": lambda: nn.BatchNorm2d(8),
    "InstanceNorm2d": lambda: nn.InstanceNorm2d(8, affine=True),
}


@pytest.mark.parametrize("edit", sorted(IN_PLACE_EDITS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_an_in_place_edit_of_the_norms_output_before_it_is_read_as_tokens(norm, edit):
    """The pre-hook is put on the norm output's node when the module returns, before an in-place edit rebases the
    output onto the edit's node: the norm's backward still gets a contiguous gradient (BatchNorm2d: a node of its
    own; InstanceNorm2d: a view of the one-row BatchNorm inside, which the edit turns into CopySlices)."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(NORMS[norm](), edit=IN_PLACE_EDITS[edit]).double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(3, 3, 8, 8, dtype=torch.float64))


def timm_batch_norm_act(**options) -> nn.Module:
    timm_layers = pytest.importorskip("timm.layers")
    return timm_layers.BatchNormAct2d(8, **options)


@pytest.mark.parametrize("options", [{"act_layer": nn.GELU}, {"apply_act": False},
                                     {"apply_act": False, "drop_layer": nn.Dropout},
                                     {"act_kwargs": {"inplace": True}}],
                         ids=["gelu", "no-activation", "no-activation-dropout", "relu-inplace"])
def test_timm_batch_norm_act_read_as_tokens(options):
    """timm's BatchNormAct2d (F.batch_norm, drop, activation in one module): the module output's node is the
    activation's (or the BatchNorm's own without one); the contiguous gradient it gets reaches the BatchNorm as such."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(timm_batch_norm_act(**options)).double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(2, 3, 8, 12, dtype=torch.float64))


class VolumeTokens(nn.Module):
    """conv3d over (1, H, W) volumes → BatchNorm3d → read as tokens, or conv1d over the flattened image →
    BatchNorm1d → ``transpose(1, 2)``; then LayerNorm → linear → mean over tokens."""

    def __init__(self, dimensions: int) -> None:
        super().__init__()
        self.dimensions, self.written_out = dimensions, False
        self.conv = nn.Conv3d(1, 8, 2, stride=2) if dimensions == 3 else nn.Conv1d(3, 8, 2, stride=2)
        self.norm = nn.BatchNorm3d(8) if dimensions == 3 else nn.BatchNorm1d(8)
        self.token_norm, self.head = nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        features = self.conv(x[:, None] if self.dimensions == 3 else x.flatten(2))
        normalized = written_out(self.norm, features) if self.written_out else self.norm(features)
        return self.head(self.token_norm(normalized.flatten(2).transpose(1, 2))).mean(1)


@pytest.mark.parametrize("dimensions", [1, 3])
def test_batch_norm_1d_and_3d_read_as_tokens(dimensions):
    """BatchNorm3d (the same kernel, wrong the same way at one row) and BatchNorm1d on (1, C, L) read transposed:
    the image alone and in a batch get the written-out gradient."""
    torch.manual_seed(0)
    model = randomized(VolumeTokens(dimensions).double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(2, 3, 4, 8, dtype=torch.float64))


class ResidualTokens(nn.Module):
    """conv → conv → GELU → BatchNorm2d → ``+=`` the features (in place) → tokens → LayerNorm → tanh → linear
    → mean: not linear after the first conv, so its second derivative is not zero."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 8, 2, stride=2), nn.Conv2d(8, 8, 2, stride=2)
        self.norm, self.token_norm, self.head = nn.BatchNorm2d(8), nn.LayerNorm(8), nn.Linear(8, 5)
        self.written_out = False

    def forward(self, x: Tensor) -> Tensor:
        features = nn.functional.gelu(self.conv2(self.conv(x)))
        normalized = written_out(self.norm, features) if self.written_out else self.norm(features)
        normalized += features
        return self.head(self.token_norm(normalized.flatten(2).transpose(1, 2)).tanh()).mean(1)


def test_the_second_derivative_with_an_in_place_edit_is_the_written_out_one():
    """Shapley-CAM's double backward: with the guard (a call scope's), the Hessian-vector product of a one-row model
    (BatchNorm, in-place residual, tokens) equals the written-out model's and a central difference of the guarded
    first derivative along the same direction."""
    torch.manual_seed(0)
    model = randomized(ResidualTokens().double())
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    first_derivative = guarded_first_derivative(model)
    direction = torch.randn_like(x)
    (product,) = torch.autograd.grad((first_derivative(x) * direction).sum(), x)
    model.written_out = True
    (gradient,) = torch.autograd.grad(model(x)[0, 2], x, create_graph=True)
    (expected,) = torch.autograd.grad((gradient * direction).sum(), x)
    model.written_out = False
    torch.testing.assert_close(product, expected, rtol=0, atol=1e-10 * float(expected.abs().max()))
    step = 1e-5
    with torch.no_grad():
        plus, minus = (x + step * direction).requires_grad_(True), (x - step * direction).requires_grad_(True)
    difference = (first_derivative(plus) - first_derivative(minus)).detach() / (2 * step)
    torch.testing.assert_close(difference, product, rtol=0, atol=1e-6 * float(product.abs().max()))
    assert not model.norm._forward_hooks


def test_shapley_cam_alone_and_in_a_batch_equals_the_written_out_model():
    """Shapley-CAM at the first conv (before the BatchNorm and its in-place residual): the map of an image alone and
    its row in a batch of three equal Shapley-CAM of the written-out model (no BatchNorm kernel to guard)."""
    torch.manual_seed(0)
    model = randomized(ResidualTokens().double())
    x = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    before = model_state(model)
    explainer = explain.ShapleyCAM(model, layer="conv", relu=False, normalize=None)
    alone = explainer.explain(x[:1], target=2).raw_maps[0]
    in_batch = explainer.explain(x, target=2).raw_maps
    model.written_out = True
    expected = explain.ShapleyCAM(model, layer="conv", relu=False, normalize=None).explain(x, target=2).raw_maps
    model.written_out = False
    scale = float(expected.abs().max())
    torch.testing.assert_close(alone, expected[0], rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(in_batch, expected, rtol=0, atol=1e-10 * scale)
    assert_state_equal(before, model_state(model))


def test_two_threads_explaining_the_same_model_at_once():
    """One thread explains image 0 alone, the other the batch of three, 10 times each at the same time: every map
    is the written-out gradient (the scope's hooks act on its own thread's passes; the pre-hooks on its own graph),
    and no hook is left on the model."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.BatchNorm2d(8), edit=lambda y, f: y.__iadd__(f)).double())
    x = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    expected = gradient_written_out(model, x, 2)
    before = model_state(model)
    saliency = explain.Saliency(model, normalize=None)
    results: dict[int, list[Tensor]] = {0: [], 1: []}

    def work(index: int) -> None:
        for _ in range(10):
            batch = x[:1] if index == 0 else x
            results[index].append(saliency.explain(batch, target=[2] * batch.shape[0]).attributions[:, 0])

    assert errors_in_threads(work, 2) == []
    scale = float(expected.abs().max())
    for maps in results[0]:
        torch.testing.assert_close(maps, expected[:1], rtol=0, atol=1e-10 * scale)
    for maps in results[1]:
        torch.testing.assert_close(maps, expected, rtol=0, atol=1e-10 * scale)
    assert_state_equal(before, model_state(model))


def test_inside_no_grad_inference_mode_and_autocast():
    """A call made inside the caller's no_grad() or inference_mode() gets the written-out gradient (float64); under
    CPU autocast (bfloat16 convolutions, float32 model) the image alone gets its row of the batch (the unguarded
    kernel is 1.9 of the map's largest value off there)."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.BatchNorm2d(8)).double())
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    expected = gradient_written_out(model, x, 2)[0]
    saliency = explain.Saliency(model, normalize=None)
    with torch.no_grad():
        in_no_grad = saliency.explain(x[:1], target=2).attributions[0, 0]
        assert not torch.is_grad_enabled()
    with torch.inference_mode():
        in_inference_mode = saliency.explain(x[:1], target=2).attributions[0, 0]
        assert torch.is_inference_mode_enabled()
    scale = float(expected.abs().max())
    torch.testing.assert_close(in_no_grad, expected, rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(in_inference_mode, expected, rtol=0, atol=1e-10 * scale)

    single = randomized(NormThenRead(nn.BatchNorm2d(8)))
    before = model_state(single)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alone = explain.Saliency(single, normalize=None).explain(x[:1].float(), target=2).attributions[0, 0]
        in_batch = explain.Saliency(single, normalize=None).explain(x.float(), target=[2, 2]).attributions[0, 0]
    torch.testing.assert_close(alone, in_batch, rtol=0, atol=1e-2 * float(in_batch.abs().max()))
    assert_state_equal(before, model_state(single))


class RaisingBackward(torch.autograd.Function):
    """The identity, whose backward raises: a call that fails after the guard's pre-hooks are on the graph."""

    @staticmethod
    def forward(ctx, tokens: Tensor) -> Tensor:
        return tokens.clone()

    @staticmethod
    def backward(ctx, gradient: Tensor) -> Tensor:
        raise RuntimeError("the backward failed")


def test_a_backward_that_raises_leaves_the_model_as_found_and_the_next_call_right():
    """The backward raises between the head and the BatchNorm: no hook or flag stays on the model, and the next call
    (the raising function switched off) gets the written-out gradient."""
    torch.manual_seed(0)
    switch = {"raise": True}
    model = randomized(NormThenRead(nn.BatchNorm2d(8), read=lambda y: (
        RaisingBackward.apply(y.flatten(2).transpose(1, 2)) if switch["raise"] else y.flatten(2).transpose(1, 2))))
    model.double().train()
    before = model_state(model)
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="the backward failed"):
        explain.Saliency(model).explain(x, target=2)
    assert_state_equal(before, model_state(model))
    switch["raise"] = False
    model.eval()
    assert_saliency_alone_and_in_batch_written_out(model, torch.cat([x, torch.rand_like(x)]))


# ------------------------------------------------------------------ timm LeViT and XCiT, the other gradient methods


def timm_model(name: str) -> tuple[nn.Module, int, str]:
    """LeViT (the stem's BatchNorm read as tokens) or XCiT (the patch embedding's and the blocks' local patch
    interaction), tiny, random weights and norm statistics, float64; its size and a layer before such a BatchNorm
    (test_issue39_batchnorm's models)."""
    from test_issue39_batchnorm import MODELS

    return MODELS[name]()


@pytest.mark.parametrize("name", ["levit", "xcit"])
def test_timm_tokens_models_noise_methods_one_row_per_pass_equal_their_batched_passes(name, one_torch_thread):
    """SmoothGrad and GradientSHAP draw the same noise whether a pass holds one sample (batch_size=1: one-row passes,
    which the guard fixes) or all of them (several rows: torch's kernel is right there): the maps are equal (without
    the guard 0.75 and 0.9 of the largest value apart on LeViT). Layer-CAM, guided backpropagation and LRP: the image
    alone gets its row of a batch of three. The model is left as found."""
    torch.manual_seed(0)
    model, size, layer = timm_model(name)
    x = torch.rand(3, 3, size, size, dtype=torch.float64)
    before = model_state(model)
    baselines = torch.zeros(2, 3, size, size, dtype=torch.float64)
    for cls, options in ((explain.SmoothGrad, {"samples": 3}),
                         (explain.GradientShap, {"samples": 3, "baselines": baselines})):
        one_row = cls(model, normalize=None, batch_size=1, **options).explain(x[:1], target=1).raw_maps[0]
        several_rows = cls(model, normalize=None, **options).explain(x[:1], target=1).raw_maps[0]
        scale = float(several_rows.abs().max())
        assert scale > 0
        torch.testing.assert_close(one_row, several_rows, rtol=0, atol=1e-9 * scale, msg=cls.__name__)
    for cls, options in ((explain.LayerCAM, {"layer": layer}), (explain.GuidedBackprop, {}), (explain.LRP, {})):
        alone = cls(model, normalize=None, **options).explain(x[:1], target=1).raw_maps[0]
        in_batch = cls(model, normalize=None, **options).explain(x, target=1).raw_maps[0]
        scale = float(in_batch.abs().max())
        assert scale > 0
        torch.testing.assert_close(alone, in_batch, rtol=1e-4, atol=1e-9 * scale, msg=cls.__name__)
    assert_state_equal(before, model_state(model))


# ------------------------------------------------------------------ layouts the guard misses today (one-row test)


def transposed_1_3(y: Tensor) -> Tensor:
    return y.transpose(1, 3)  # (N, C, H, W) → (N, W, H, C): channels last, W-major


def sequence_first(y: Tensor) -> Tensor:
    return y.flatten(2).permute(2, 0, 1)  # (N, C, H, W) → (H·W, N, C), as nn.MultiheadAttention(batch_first=False)


@pytest.mark.parametrize("size", [(4, 16), (16, 4)], ids=["one-pixel-high", "one-pixel-wide"])
def test_batch_norm_read_transposed_1_3_from_a_one_pixel_high_feature_map_in_a_batch(size):
    """BatchNorm2d → ``transpose(1, 3)`` of a 1 × 4 (or 4 × 1) feature map: at batches of 2 the gradient reaching
    the BatchNorm has strides (16, 1, 8, 8), which torch's kernel also gets wrong (1.8 of the largest value off);
    the image alone (guarded) is right, so alone and in a batch differ."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.BatchNorm2d(8), read=transposed_1_3).double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(2, 3, *size, dtype=torch.float64))


def test_instance_norm_read_sequence_first_in_a_batch():
    """InstanceNorm2d → ``flatten(2).permute(2, 0, 1)`` (sequence first): in a batch of two the (2, C, H, W)
    gradient of strides (C, 1, …) reshapes without a copy to the one-row (1, 2C, H, W) BatchNorm inside, whose
    backward is then wrong (1.9 of the largest value off); alone it is guarded and right."""
    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.InstanceNorm2d(8, affine=True), read=sequence_first, batch_axis=1).double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(2, 3, 8, 8, dtype=torch.float64))


class PerImageInstanceNorm(nn.Module):
    """conv → for each image: InstanceNorm2d of the unbatched (C, h, w) map → tokens → LayerNorm → linear → mean."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 4, stride=4), nn.InstanceNorm2d(8, affine=True)
        self.token_norm, self.head = nn.LayerNorm(8), nn.Linear(8, 5)
        self.written_out = False

    def forward(self, x: Tensor) -> Tensor:
        rows: list[Tensor] = []
        for image in self.conv(x):
            normalized = written_out(self.norm, image) if self.written_out else self.norm(image)
            rows.append(self.head(self.token_norm(normalized.flatten(1).t())).mean(0))
        return torch.stack(rows)


def test_instance_norm_of_one_unbatched_image_read_as_tokens():
    """A model that normalises each image on its own (InstanceNorm2d of a (C, h, w) map): every image, alone or
    in a batch, passes a one-row BatchNorm inside whose gradient has the tokens' strides (1.7 of the largest value
    off), so alone and in a batch agree with each other but not with the written-out gradient."""
    torch.manual_seed(0)
    model = randomized(PerImageInstanceNorm().double())
    assert_saliency_alone_and_in_batch_written_out(model, torch.rand(2, 3, 8, 8, dtype=torch.float64))


@pytest.mark.parametrize("read", [lambda y: y.flatten(2).transpose(1, 2), transposed_1_3], ids=["tokens", "transposed"])
def test_a_channels_last_batch_gets_channels_last_gradients_at_its_norms_and_the_written_out_map(read):
    """A batch that the CPU gives the model channels-last (4 rows of 128 px, float32): the norm's output is
    channels-last, so its gradient is made channels-last (not contiguous: no copy), and every image's gradient still
    equals the written-out function's; the batch did go channels-last."""
    from explain.core.memory_format import channels_last_copies

    torch.manual_seed(0)
    model = randomized(NormThenRead(nn.BatchNorm2d(8), read=read))
    x = torch.rand(4, 3, 128, 128) if read is not transposed_1_3 else torch.rand(4, 3, 4, 4096)
    before, copies = model_state(model), channels_last_copies()
    attributions = explain.Saliency(model, normalize=None).explain(x, target=[2] * 4).attributions[:, 0]
    assert channels_last_copies() > copies
    expected = gradient_written_out(model, x, 2)
    torch.testing.assert_close(attributions, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert_state_equal(before, model_state(model))
    # the pre-hook passes a channels-last gradient on as it is (no copy) and lays any other out channels-last
    from explain.methods._eval_batch_norm import _channels_last_first

    channels_last = torch.randn(4, 8, 2, 2).contiguous(memory_format=torch.channels_last)
    assert _channels_last_first((channels_last, None))[0] is channels_last
    contiguous = torch.randn(4, 8, 2, 2)
    laid_out = _channels_last_first((contiguous, None))[0]
    assert laid_out.is_contiguous(memory_format=torch.channels_last) and torch.equal(laid_out, contiguous)
