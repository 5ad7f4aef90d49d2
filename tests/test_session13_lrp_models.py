"""LRP and AttnLRP on the models people use, built from configs with random weights (session 13).

AttnLRP's identity rule (∂ → ∂ · (y − y(0)) / x) divided by lxt's x + ε (ε = 1e-10): an activation input near −ε made
the divisor ~0 and the relevance explode (torchvision's MobileNetV3-Small: the input's relevance summed to −90 and
882 times the logit), and inputs far below ε shrank the ratio and the relevance vanished (torchvision's
EfficientNet-B0: 6e-6 of the logit at the input). Now y / x where y(0) = 0, and x + ε·sign(x) where y(0) ≠ 0.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
import transformers
from test_attnlrp import lxt_efficient, restored  # noqa: F401 (a fixture)
from torch import Tensor, nn

import explain

IDENTITY_EPSILON = 1e-10


def strictly(function, *args, **kwargs):
    """The call with every warning an error (an unruled call, a vanished map)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return function(*args, **kwargs)


class TwoLayers(nn.Module):
    """x (N, 4, 1, 1) → W1 x → activation → W2 · (no biases): z = W1 x is the activation's input, set where wanted."""

    def __init__(self, first: Tensor, second: Tensor, activation: nn.Module):
        super().__init__()
        self.first, self.second, self.activation = nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False), activation
        with torch.no_grad():
            self.first.weight.copy_(first)
            self.second.weight.copy_(second)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.activation(self.first(x.flatten(1))))


# activation inputs: one at O(1), one far below ε, one a hair beyond −ε (lxt's x + ε is then −1e-16), one at −ε·3
PRE_ACTIVATIONS = torch.tensor([0.7, 1e-14, -1.000001e-10, -3e-10], dtype=torch.float64)


def two_layers(activation: nn.Module) -> tuple[TwoLayers, Tensor]:
    """The model with W1 = I (so z = x) and the input x = ``PRE_ACTIVATIONS``."""
    torch.manual_seed(0)
    second = torch.randn(2, 4, dtype=torch.float64)
    model = TwoLayers(torch.eye(4, dtype=torch.float64), second, activation).double().eval()
    return model, PRE_ACTIVATIONS[None].clone()


def by_hand(model: TwoLayers, x: Tensor, target: int, at_zero: float, divisor) -> Tensor:
    """LRP-0 on the last layer, R_j = w_j (y_j − y(0)) for the activation's output j (its y(0) share kept, as a
    bias's), the identity rule passing R_j to z_j, LRP-0 without bias on W1 = I: R_i = x_i · w_i (y_i − y(0)) / d_i,
    with d the divisor."""
    z = x[0]
    y = model.activation(z)
    w = model.second.weight[target].detach()
    return z * w * (y - at_zero) / divisor(z)


@pytest.mark.parametrize("activation", [nn.GELU(), nn.SiLU(), nn.Hardswish(), nn.Tanh()],
                         ids=["gelu", "silu", "hardswish", "tanh"])
def test_identity_rule_with_y0_zero_divides_by_x_itself_at_any_scale(activation):
    """y(0) = 0: the input relevance of each unit is w_i · y_i, whatever the scale of z_i (1e-14, or a hair beyond
    −ε, where lxt's x + ε gave a factor 1e6 too large), and sums to the logit: the rules conserve here."""
    model, x = two_layers(activation)
    explanation = strictly(explain.AttnLRP(model, reduce="sum").explain, x.reshape(1, 4, 1, 1), target=[1])
    relevance = explanation.attributions[0, 0].double().flatten()
    expected = by_hand(model, x, 1, 0.0, lambda z: z)
    assert torch.allclose(relevance, expected, rtol=1e-9, atol=0), (relevance, expected)
    diagnostics = explanation.diagnostics
    error = (diagnostics["conservation_error"] / diagnostics["output_relevance"]).abs()
    assert error.max() <= 1e-9, error


class Sigmoid(nn.Module):
    """A sigmoid that is not a gate: its output goes through a linear layer, not into a product."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)


def test_identity_rule_with_y0_nonzero_divides_by_x_plus_epsilon_with_the_sign_of_x():
    """y(0) = ½ (sigmoid): (y − ½) / (x + ε·sign(x)): at x a hair beyond −ε the divisor is −2e-10, not lxt's
    −1e-16 (which multiplied that unit's relevance by 1e6)."""
    model, x = two_layers(Sigmoid())
    explanation = explain.AttnLRP(model, reduce="sum").explain(x.reshape(1, 4, 1, 1), target=[0])
    relevance = explanation.attributions[0, 0].double().flatten()

    def stabilized(z: Tensor) -> Tensor:
        return z + IDENTITY_EPSILON * torch.where(z >= 0, 1.0, -1.0).to(z)

    expected = by_hand(model, x, 0, 0.5, stabilized)
    assert torch.allclose(relevance, expected, rtol=1e-9, atol=0), (relevance, expected)
    assert relevance.abs().max() <= model.second.weight.abs().max() * 0.25 * 0.7 * 1.01  # ≤ |w| · slope · |x|


def untrained(name: str) -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, num_classes=5).eval()


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0"])
def test_torchvision_cnns_with_tiny_activations_conserve_relevance_with_attnlrp(name):
    """torchvision initialises these without biases (BatchNorm shifts 0, running means 0, heads' biases 0), so every
    AttnLRP rule conserves and the input's relevance sums to the logit. Their random weights shrink the activations
    ~100× per stage (hard swish and SiLU inputs 1e-11 to 1e-14 deep down; logits 1e-11 and 1e-13). Measured
    before: −90 and 882 (MobileNetV3: hard swish inputs at −1e-10, lxt's x + ε ~0), 6e-6 and 2e-6 (EfficientNet:
    SiLU inputs ≪ ε); after: 1 ± 1e-6."""
    model = untrained(name)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    diagnostics = explain.AttnLRP(model).explain(x, target=[1, 3]).diagnostics
    assert torch.isfinite(diagnostics["relevance_sum"]).all()
    share = diagnostics["relevance_sum"] / diagnostics["output_relevance"]
    assert (share - 1).abs().max() <= 1e-3, share


# ------------------------------------------------------------------ lxt 2.x, the authors' library, on DINOv2


@pytest.fixture
def lxt_patches(lxt_efficient):  # noqa: F811 (test_attnlrp's fixture, imported above)
    """lxt.efficient.patches (``test_attnlrp.lxt_efficient``: imported without lxt's package __init__)."""
    return lxt_efficient("patches")


def hf_dinov2(implementation: str) -> nn.Module:
    """A small DINOv2 classifier (layer scale, the head reading the class token and the patch tokens' mean)."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                       image_size=28, patch_size=7, num_labels=5, layerscale_value=0.5)
    model = transformers.Dinov2ForImageClassification._from_config(config, attn_implementation=implementation)
    nn.init.normal_(model.classifier.weight, std=0.5)
    return model.double().eval()


@pytest.mark.parametrize("conservative", [False, True], ids=["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attnlrp_on_huggingface_dinov2_equals_lxt(lxt_patches, implementation, conservative):
    """lxt's recipe on DINOv2 (its GELU, LayerNorm and attention-function patches; each image alone, input × its
    gradient) against ours, with eager and with fused attention. Measured: 2.5e-9 (lxt divides its identity rule by
    x + 1e-10, ours by x where y(0) = 0: a GELU input of 0.1 differs by 1e-9); 4e-16 before that change."""
    from transformers.activations import GELUActivation
    from transformers.models.dinov2 import modeling_dinov2

    targets = [1, 3, 0]
    torch.manual_seed(1)
    x = torch.randn(3, 3, 28, 28, dtype=torch.float64)
    explanation = strictly(explain.AttnLRP(hf_dinov2(implementation), output="logits",
                                           conservative=conservative).explain, x, target=targets)
    assert explanation.diagnostics["unruled"] == []
    wrap = lxt_patches.cp_wrap_attention_forward if conservative else lxt_patches.wrap_attention_forward
    with restored(*[(cls, name) for cls in (GELUActivation, nn.LayerNorm) for name in ("forward", "original_forward")],
                  (modeling_dinov2, "eager_attention_forward")):
        lxt_patches.patch_method(lxt_patches.non_linear_forward, GELUActivation, keep_original=True)
        lxt_patches.patch_method(lxt_patches.layer_norm_forward, nn.LayerNorm)
        modeling_dinov2.eager_attention_forward = wrap(modeling_dinov2.eager_attention_forward)
        model = hf_dinov2("eager")
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        reference = []
        for image, target in zip(x, targets):
            image = image[None].clone().requires_grad_(True)
            model(image).logits[0, target].backward()
            reference.append((image * image.grad)[0])
    assert not hasattr(GELUActivation, "original_forward")
    expected = torch.stack(reference).detach()
    error = float((explanation.attributions[:, 0] - expected).abs().max() / expected.abs().max())
    assert error <= 1e-6, f"relative error {error:.3g}"
