"""Hidden units (explain.Channel, explain.Neuron) on token, channels-last and (N, C) layers, checked against a
by-hand reading of the layer's output (a plain forward hook) and autograd; their misuse gives clear errors."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import transformers
from conftest import assert_state_equal, hook_count, model_state
from torch import nn

import explain

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def recorded(model, layer, x):
    """(the layer's output, the input it was computed from, with a graph), by a plain forward hook."""
    stash = {}
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(lambda m, a, out: stash.__setitem__("out", out.clone()))
    x = x.clone().requires_grad_(True)
    try:
        model(x)
    finally:
        handle.remove()
    return stash["out"], x


def by_hand(model, layer, x, value_of):
    """(the unit's value per image, ∂Σ value/∂x) by hand."""
    out, inputs = recorded(model, layer, x)
    value = value_of(out)
    (gradient,) = torch.autograd.grad(value.sum(), inputs)
    return value.detach(), gradient


@pytest.fixture(scope="module")
def swin():
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                             embed_dim=16, depths=(1, 1), num_heads=(1, 1), num_classes=5).eval()


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, num_classes=5).eval()


def test_a_channel_of_a_channels_last_layer_is_its_last_axis(swin):
    x = torch.randn(2, 3, 32, 32)
    before = model_state(swin)
    out, _ = recorded(swin, "layers.1", x)
    assert out.shape == (2, 4, 4, 32)  # (N, h, w, C): dim 1 would silently be a row of the grid
    value, gradient = by_hand(swin, "layers.1", x, lambda out: out[..., 3].mean(dim=(1, 2)))
    result = explain.Saliency(swin).explain(x, target=explain.Channel("layers.1", 3))
    torch.testing.assert_close(result.scores[:, 0], value)
    torch.testing.assert_close(result.attributions[:, 0], gradient)
    at = explain.Saliency(swin).explain(x, target=explain.Channel("layers.1", 3, position=(1, 2)))
    torch.testing.assert_close(at.scores[:, 0], out[:, 1, 2, 3].detach())
    assert_state_equal(before, model_state(swin))
    assert hook_count(swin) == 0


def test_a_channel_of_tokens_is_a_feature_over_every_token_with_the_class_token(vit):
    x = torch.randn(2, 3, 32, 32)
    value, gradient = by_hand(vit, "blocks.0", x, lambda out: out[..., 7].mean(dim=1))  # 5 tokens, class included
    result = explain.Saliency(vit).explain(x, target=explain.Channel("blocks.0", 7))
    torch.testing.assert_close(result.scores[:, 0], value)
    torch.testing.assert_close(result.attributions[:, 0], gradient)
    out, _ = recorded(vit, "blocks.0", x)
    class_token = explain.Saliency(vit).explain(x, target=explain.Channel("blocks.0", 7, position=(0,)))
    torch.testing.assert_close(class_token.scores[:, 0], out[:, 0, 7].detach())
    neuron = explain.Saliency(vit).explain(x, target=explain.Neuron("blocks.0", (0, 7)))
    torch.testing.assert_close(neuron.scores[:, 0], out[:, 0, 7].detach())
    explicit = explain.Saliency(vit).explain(x, target=explain.Channel("blocks.0", 3, dim=1))  # token 3, asked for
    torch.testing.assert_close(explicit.scores[:, 0], out[:, 3].mean(dim=1).detach())


def test_integrated_gradients_of_a_unit_scores_the_images_not_the_baseline():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=4)
    model = transformers.ViTForImageClassification(config).eval()
    x = torch.randn(2, 3, 32, 32)
    unit = explain.Neuron("vit.layers.0", (3, 5))
    result = explain.IntegratedGradients(model, steps=4).explain(x, target=unit)
    value, _ = by_hand(model, "vit.layers.0", x, lambda out: out[:, 3, 5])
    torch.testing.assert_close(result.scores[:, 0], value)  # was the zero baseline's value for every image
    expected = torch.zeros_like(x)
    for alpha in (torch.arange(4) + 0.5) / 4:  # midpoint rule, zero baseline
        expected += by_hand(model, "vit.layers.0", alpha * x, lambda out: out[:, 3, 5])[1] / 4
    torch.testing.assert_close(result.attributions[:, 0], x * expected, rtol=1e-4, atol=1e-6)


def test_convnext_norm_is_channels_last_and_its_block_channels_first():
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=3, conv_mlp=False).eval()
    x = torch.randn(1, 3, 32, 32)
    for layer, value_of in [("stages.0.blocks.0.norm", lambda out: out[..., 5].mean(dim=(1, 2))),
                            ("stages.0.blocks.0", lambda out: out[:, 5].mean(dim=(1, 2)))]:
        value, gradient = by_hand(model, layer, x, value_of)
        result = explain.Saliency(model).explain(x, target=explain.Channel(layer, 5))
        torch.testing.assert_close(result.scores[:, 0], value)
        torch.testing.assert_close(result.attributions[:, 0], gradient)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16, bias=False), nn.ReLU(),
                         nn.Linear(16, 4, bias=False)).eval()


def test_a_channel_of_a_flat_layer_is_its_value():
    model, x = mlp(), torch.randn(2, 3, 8, 8)
    value, gradient = by_hand(model, "3", x, lambda out: out[:, 2])
    result = explain.Saliency(model).explain(x, target=explain.Channel("3", 2))
    torch.testing.assert_close(result.scores[:, 0], value)
    torch.testing.assert_close(result.attributions[:, 0], gradient)


def test_lrp_of_a_hidden_unit_is_gradient_times_input_on_a_bias_free_relu_mlp():
    model, x = mlp(), torch.randn(2, 3, 8, 8)
    value, gradient = by_hand(model, "1", x, lambda out: out[:, [4, 9]])  # before the ReLU: LRP-ε = x · ∂y/∂x
    method = explain.LRP(model, "epsilon_plus", normalize=None, reduce="sum")
    lrp = method.explain(x, target=explain.Neuron("1", [4, 9]))
    torch.testing.assert_close(lrp.scores, value)
    for k, hidden in enumerate([4, 9]):
        _, gradient = by_hand(model, "1", x, lambda out, hidden=hidden: out[:, hidden])
        torch.testing.assert_close(lrp.raw_maps[:, k], (x * gradient).sum(1), rtol=1e-4, atol=1e-5)


def test_negative_channels_per_image_count_from_the_end(vit):
    x = torch.randn(2, 3, 32, 32)
    out, _ = recorded(vit, "blocks.0", x)
    result = explain.Saliency(vit).explain(x, target=explain.Channel("blocks.0", [[-1, 2], [0, -192]]))
    expected = out.mean(dim=1)[:, [[191, 2], [0, 0]]].detach()
    torch.testing.assert_close(result.scores, torch.stack([expected[0, 0], expected[1, 1]]))


class Permuted(nn.Module):
    """A convolution whose output a parameter-free module permutes: nothing in that module tells its layout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.permute = PermuteLast()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.permute(self.conv(x)).mean(dim=(1, 2)))


class PermuteLast(nn.Module):
    def forward(self, x):
        return x.permute(0, 2, 3, 1)


def test_misused_channels_are_explained():
    model, x = mlp(), torch.randn(2, 3, 8, 8)
    permuted, image = Permuted().eval(), torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="position=.* needs 0 index"):
        explain.Saliency(model).explain(x, target=explain.Channel("1", 2, position=(1,)))
    vit_like = explain.Saliency(permuted)
    with pytest.raises(ValueError, match="position=.* needs 2 index"):  # was a silently (N, w) "score" per image
        vit_like.explain(image, target=explain.Channel("conv", 2, position=(1,)))
    with pytest.raises(ValueError, match="position .* out of range"):
        vit_like.explain(image, target=explain.Channel("conv", 2, position=(9, 0)))
    with pytest.raises(ValueError, match="dim=4 is not a channel dimension"):
        vit_like.explain(image, target=explain.Channel("conv", 2, dim=4))
    with pytest.raises(ValueError, match="pass dim=1 .* or dim=-1"):  # (1, 8, 8, 8): either way round
        vit_like.explain(image, target=explain.Channel("permute", 2))
    out, _ = recorded(permuted, "permute", image)
    given = vit_like.explain(image, target=explain.Channel("permute", 2, dim=-1))
    torch.testing.assert_close(given.scores[:, 0], out[..., 2].mean(dim=(1, 2)).detach())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="cannot score a hidden unit"):
            explain.metrics.deletion(model, x, torch.rand(2, 8, 8), target=explain.Channel("1", 2), steps=2)
    assert hook_count(model) == 0 and hook_count(permuted) == 0


# ---------------------------------------------------------------- LRP of a hidden unit, by hand
# The relevance starts at the unit's layer output z as R = z ⊙ ∂score/∂z (a neuron: its value there, 0 elsewhere; a
# channel's mean: z_c,p / positions) and goes down by the rules of the layers below only (CRP, zennit).


def deep_mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 10, bias=False), nn.ReLU(), nn.Linear(10, 8, bias=False),
                         nn.ReLU(), nn.Linear(8, 3, bias=False)).eval()


def epsilon_rule(a, weight, relevance, epsilon):
    """LRP-ε (LRP-0 for ε = 0) of z = W a, written out: R_i = Σ_j a_i w_ji R_j / (z_j + ε sign z_j)."""
    z = a @ weight.T
    stabilized = z + epsilon * torch.where(z >= 0, 1.0, -1.0)
    return (a[:, None, :] * weight[None] * (relevance / stabilized)[:, :, None]).sum(1)


def mlp_unit_by_hand(model, x, relevance_at_3, epsilon):
    """The input relevance (N, 3, 4, 4) from the relevance at layer "3"'s output: ε through "3", the ReLU passes it,
    ε through "1"."""
    a0 = x.flatten(1)
    a1 = torch.relu(a0 @ model[1].weight.T)
    r1 = epsilon_rule(a1, model[3].weight.detach(), relevance_at_3, epsilon)
    return epsilon_rule(a0, model[1].weight.detach(), r1, epsilon).view_as(x)


@pytest.mark.filterwarnings("ignore:.*lost a large share:RuntimeWarning")  # ε = 0.1 takes some: as it should
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_lrp_of_mlp_units_starts_at_their_layer_by_the_epsilon_rule(epsilon):
    model, x = deep_mlp(), torch.randn(2, 3, 4, 4)
    before = model_state(model)
    z3 = model[:4](x).detach()
    method = explain.LRP(model, "epsilon_plus", epsilon=epsilon, normalize=None, reduce="sum")
    neuron = method.explain(x, target=explain.Neuron("3", [2, 5]))
    positive = int((z3 > 0).all(dim=0).nonzero()[0])  # a unit the ReLU after it passes in both images
    after_relu = method.explain(x, target=explain.Channel("4", positive))  # an (N, C) channel: its value
    for k, unit in enumerate([2, 5]):
        start = torch.zeros_like(z3)
        start[:, unit] = z3[:, unit]
        torch.testing.assert_close(neuron.attributions[:, k], mlp_unit_by_hand(model, x, start, epsilon),
                                   rtol=1e-4, atol=1e-6)
    start = torch.zeros_like(z3)
    start[:, positive] = z3[:, positive]
    torch.testing.assert_close(after_relu.attributions[:, 0], mlp_unit_by_hand(model, x, start, epsilon),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(neuron.scores, z3[:, [2, 5]])
    torch.testing.assert_close(neuron.diagnostics["output_relevance"], z3[:, [2, 5]].double())  # Σ R at the unit
    if epsilon == 0:  # LRP-0 on a bias-free ReLU net: Σ map = the unit's value
        torch.testing.assert_close(neuron.attributions.flatten(2).sum(2), z3[:, [2, 5]], rtol=1e-4, atol=1e-5)
    assert_state_equal(before, model_state(model))
    assert hook_count(model) == 0


def test_lrp_of_a_negative_unit_keeps_its_sign():
    model, x = deep_mlp(), torch.randn(4, 3, 4, 4)
    z3 = model[:4](x).detach()
    image, unit = (z3 < -0.05).nonzero()[0].tolist()  # a unit with a negative value in some image
    method = explain.LRP(model, "epsilon_plus", epsilon=0.0, normalize=None, reduce="sum")
    result = method.explain(x[image:image + 1], target=explain.Neuron("3", unit))
    assert float(result.scores[0]) < 0
    total = result.attributions[0].sum()
    assert float(total) < 0  # was +1: the relevance started at ∂z/∂z
    torch.testing.assert_close(total, z3[image, unit], rtol=1e-4, atol=1e-5)
    assert float(result.diagnostics["conservation_error"].abs().max()) < 1e-4


class TinyCnn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1, bias=False)
        self.conv3 = nn.Conv2d(5, 6, 3, padding=1, bias=False)  # above the unit: its rule must not matter
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        hidden = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(torch.relu(self.conv3(hidden)).mean(dim=(2, 3)))


def conv_rule(x, weight, relevance, low=None, high=None, stabilizer=1e-6):
    """LRP-0 (or z^B with the box [low, high]) of a 3×3 convolution with padding 1, written out on its unfolded
    patches: R_i = Σ_j q_ij R_j / Σ_i' q_i'j with q_ij = x_i w_ij (z^B: − l w⁺_ij − h w⁻_ij)."""
    n, c, h, w = x.shape
    columns = nn.functional.unfold(x, 3, padding=1)  # (N, C·9, L); padding gives 0, also to the box
    flat = weight.detach().flatten(1)  # (O, C·9)
    q = flat[None, :, :, None] * columns[:, None]  # (N, O, C·9, L)
    if low is not None:
        lows = nn.functional.unfold(torch.full_like(x, low), 3, padding=1)
        highs = nn.functional.unfold(torch.full_like(x, high), 3, padding=1)
        positive, negative = flat.clamp(min=0)[None, :, :, None], flat.clamp(max=0)[None, :, :, None]
        q = q - positive * lows[:, None] - negative * highs[:, None]
    z = q.sum(2)  # (N, O, L)
    stabilized = z + stabilizer * torch.where(z >= 0, 1.0, -1.0)
    shares = (q * (relevance.flatten(2) / stabilized)[:, :, None]).sum(1)  # (N, C·9, L)
    return nn.functional.fold(shares, (h, w), 3, padding=1)  # each patch's share back to its pixel


def test_lrp_of_cnn_units_is_lrp_0_and_z_box_from_their_layer():
    model, x = TinyCnn().eval(), torch.rand(2, 3, 6, 6) * 2 - 1
    before = model_state(model)
    a1 = torch.relu(model.conv1(x)).detach()
    z2 = model.conv2(a1).detach()
    method = explain.LRP(model, "epsilon_gamma_box", gamma=0.0, low=-1.0, high=1.0, normalize=None, reduce="sum")
    neuron = method.explain(x, target=explain.Neuron("conv2", [(1, 2, 3), (4, 0, 5)]))
    channel = method.explain(x, target=explain.Channel("conv2", 3))
    starts = []
    for c, i, j in [(1, 2, 3), (4, 0, 5)]:
        start = torch.zeros_like(z2)
        start[:, c, i, j] = z2[:, c, i, j]
        starts.append(start)
    start = torch.zeros_like(z2)
    start[:, 3] = z2[:, 3] / 36  # the channel's mean over 6 × 6 positions
    starts.append(start)
    results = [neuron.attributions[:, 0], neuron.attributions[:, 1], channel.attributions[:, 0]]
    for result, start in zip(results, starts):
        by_hand = conv_rule(x, model.conv1.weight, conv_rule(a1, model.conv2.weight, start), low=-1.0, high=1.0)
        torch.testing.assert_close(result, by_hand, rtol=1e-4, atol=1e-6)
        # LRP-0 and z^B conserve: the map sums to the unit's value, whatever its sign
        torch.testing.assert_close(result.flatten(1).sum(1), start.flatten(1).sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(channel.scores[:, 0], z2[:, 3].mean(dim=(1, 2)))
    assert_state_equal(before, model_state(model))
    assert hook_count(model) == 0


def test_attnlrp_of_a_unit_is_lrp_0_from_its_layer():
    """AttnLRP carries a modified gradient: at the unit's layer it is ∂score/∂z, so its relevance there is
    z ⊙ ∂score/∂z by construction; below it LRP-0 on linear layers."""
    model, x = deep_mlp(), torch.randn(2, 3, 4, 4)
    before = model_state(model)
    z3 = model[:4](x).detach()
    result = explain.AttnLRP(model, normalize=None, reduce="sum").explain(x, target=explain.Neuron("3", [2, 5]))
    for k, unit in enumerate([2, 5]):
        start = torch.zeros_like(z3)
        start[:, unit] = z3[:, unit]
        torch.testing.assert_close(result.attributions[:, k], mlp_unit_by_hand(model, x, start, 0.0),
                                   rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.attributions.flatten(2).sum(2), z3[:, [2, 5]], rtol=1e-4, atol=1e-5)
    assert_state_equal(before, model_state(model))
    assert hook_count(model) == 0


def test_crp_and_deletion_refuse_an_explanation_of_a_unit():
    model, x = deep_mlp(), torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="one class per image"):
        explain.ConceptRelevance(model, "3").explain(x, target=explain.Neuron("3", 2))
    unit = explain.LRP(model, "epsilon_plus").explain(x, target=explain.Neuron("3", 2))
    with pytest.raises(ValueError, match="no class indices.*target="):  # was the top class's curve, silently
        explain.metrics.deletion(model, x, unit, steps=2)
    curve = explain.metrics.deletion(model, x, unit, target=1, steps=2)  # a class given: that class is scored
    given = explain.metrics.deletion(model, x, unit.raw_maps, target=1, steps=2)
    torch.testing.assert_close(curve.curves, given.curves)
    start = torch.softmax(model(x), dim=1)[:, 1].detach()  # step 0: nothing deleted yet
    torch.testing.assert_close(curve.curves[:, 0], start)
    assert hook_count(model) == 0


class Unruled(nn.Module):
    """A call that neither LRP nor AttnLRP has a rule for (torch.prod)."""

    def forward(self, x):
        return x + 0.1 * torch.prod(x[:, :2], dim=1, keepdim=True)


class UnruledBelowAndAbove(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.below, self.above = Unruled(), Unruled()
        self.fc1, self.fc2, self.head = nn.Linear(48, 10), nn.Linear(10, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.above(self.head(self.fc2(torch.relu(self.fc1(self.below(x.flatten(1)))))))


@pytest.mark.parametrize("method", [explain.LRP, explain.AttnLRP])
def test_a_unit_is_warned_of_the_calls_without_a_rule_below_it_only(method):
    model, x = UnruledBelowAndAbove().eval(), torch.randn(2, 3, 4, 4)
    explainer = method(model, "epsilon_plus") if method is explain.LRP else method(model)
    with pytest.warns(RuntimeWarning, match="above: prod"):
        classes = explainer.explain(x, target=1)
    assert {name.split(":")[0] for name in classes.diagnostics["unruled"]} == {"below", "above"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unit = explainer.explain(x, target=explain.Neuron("fc2", 3))  # the head and "above" are above the unit
    said = " ".join(str(warning.message) for warning in caught if warning.category is RuntimeWarning)
    assert "below: prod" in said and "above:" not in said
    assert {name.split(":")[0] for name in unit.diagnostics["unruled"]} == {"below"}
    assert hook_count(model) == 0
