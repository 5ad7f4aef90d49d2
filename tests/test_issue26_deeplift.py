"""Issue 26, items 2, 3 and 14: DeepLIFT pairs each element with its own reference value whatever the
tensor layout (sequence-first transformers), gives every elementwise nonlinearity the rescale rule (and
products, softmax and normalisation exact rules), names what gets no rule, and computes functions of
parameters plainly. Expected values are worked by hand (float64) or are the same model in another layout."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import torchvision
from test_deeplift_and_shap import calibrated
from torch import Tensor, nn

import explain
from explain.core.capture import ModelInputError


def deeplift(model: nn.Module, x: Tensor, baseline: Tensor, target) -> explain.Explanation:
    return explain.DeepLift(model, baseline=baseline, normalize=None).explain(x, target=target)


def assert_sums_to_delta(result: explain.Explanation, relative: float) -> None:
    error, change = result.diagnostics["summation_error"].double(), result.diagnostics["score_change"].double()
    assert (error.abs() <= relative * change.abs()).all(), (error, change)


@contextlib.contextmanager
def no_rule_warnings() -> Iterator[list[str]]:
    """``with no_rule_warnings() as found:`` — ``found`` gets the messages of DeepLIFT's warnings about
    functions without a rule given in the block."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found.extend(str(warning.message) for warning in caught if "no DeepLIFT rule" in str(warning.message))


# ------------------------------------------------------------------ item 2: the layout of the stacked rows


class TokensFirst(nn.Module):
    """x (N, 3, 2, 2) → tokens (T = 4, N, 3), sequence first → Linear(3, 5) → ReLU → Linear(5, 2) → mean
    over the tokens (dimension 0). With N = 2 images, 2N = T: halving dimension 0 splits tokens, not images."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        tokens = x.flatten(2).permute(2, 0, 1)
        return self.second(torch.relu(self.first(tokens))).mean(0)


def test_a_sequence_first_relu_gets_the_rescale_rule_of_each_image_and_token_worked_by_hand():
    torch.manual_seed(0)
    model = TokensFirst().double().eval()
    x = torch.randn(2, 3, 2, 2, dtype=torch.float64)
    baseline = torch.randn(3, 2, 2, dtype=torch.float64)
    classes = [0, 1]
    result = deeplift(model, x, baseline, classes)
    weights, bias = model.first.weight.detach(), model.first.bias.detach()
    for n, k in enumerate(classes):
        for t in range(4):
            pixel, reference = x[n].flatten(1)[:, t], baseline.flatten(1)[:, t]
            z, z_ref = weights @ pixel + bias, weights @ reference + bias
            multiplier = (z.relu() - z_ref.relu()) / (z - z_ref)
            expected = (pixel - reference) * (weights.T @ (model.second.weight[k].detach() * multiplier)) / 4
            torch.testing.assert_close(result.attributions[n, 0].flatten(1)[:, t], expected, rtol=1e-10, atol=1e-12)
    assert_sums_to_delta(result, 1e-10)


class Encoder(nn.Module):
    """Patch embedding, one nn.TransformerEncoderLayer (LayerNorm, attention, ReLU or GELU feed-forward),
    mean over tokens, head; ``batch_first`` chooses the layout the layer runs in."""

    def __init__(self, batch_first: bool, activation: str = "relu"):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Conv2d(3, 16, 4, 4)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation=activation,
                                                batch_first=batch_first)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)  # (N, T, D)
        if self.batch_first:
            return self.head(self.layer(tokens).mean(1))
        return self.head(self.layer(tokens.transpose(0, 1)).mean(0))  # (T, N, D) inside


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_sequence_first_transformer_equals_the_batch_first_one_and_sums_to_the_score_change(activation):
    """Both layouts compute the same function; DeepLIFT must not depend on which axis holds the images
    (16 tokens, 2 images: 2N = 4 divides T). Attention, softmax and LayerNorm get exact rules, so the
    attributions sum to y(x) − y(x') within 1e-6 (float64)."""
    torch.manual_seed(0)
    batch_first = Encoder(True, activation).double().eval()
    sequence_first = Encoder(False, activation).double().eval()
    sequence_first.load_state_dict(batch_first.state_dict())
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    baseline = torch.randn(3, 16, 16, dtype=torch.float64) * 0.5
    expected = deeplift(batch_first, x, baseline, [0, 3])
    result = deeplift(sequence_first, x, baseline, [0, 3])
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-9, atol=1e-12)
    assert_sums_to_delta(result, 1e-6)
    assert_sums_to_delta(expected, 1e-6)


class OpenClipLikeTower(nn.Module):
    """open_clip's vision tower in small: class token and positions, ln_pre, residual blocks of
    nn.MultiheadAttention and a GELU MLP run sequence first (``x.permute(1, 0, 2)``, NLD → LND),
    ln_post on the class token, projection."""

    def __init__(self, width: int = 16, layers: int = 2):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 4, 4, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) * 0.5)
        self.positional_embedding = nn.Parameter(torch.randn(17, width) * 0.1)
        self.ln_pre, self.ln_post = nn.LayerNorm(width), nn.LayerNorm(width)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln_1": nn.LayerNorm(width), "attn": nn.MultiheadAttention(width, 2),
            "ln_2": nn.LayerNorm(width),
            "mlp": nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)),
        }) for _ in range(layers))
        self.proj = nn.Parameter(torch.randn(width, 4) * width ** -0.5)

    def forward(self, x):
        x = self.conv1(x).flatten(2).permute(0, 2, 1)
        x = torch.cat([self.class_embedding + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype), x], dim=1)
        x = self.ln_pre(x + self.positional_embedding)
        x = x.permute(1, 0, 2)  # NLD -> LND
        for block in self.blocks:
            normed = block["ln_1"](x)
            x = x + block["attn"](normed, normed, normed, need_weights=False)[0]
            x = x + block["mlp"](block["ln_2"](x))
        x = x.permute(1, 0, 2)  # LND -> NLD
        return self.ln_post(x[:, 0]) @ self.proj


def test_an_open_clip_style_sequence_first_tower_sums_to_the_score_change():
    torch.manual_seed(0)
    model = OpenClipLikeTower().double().eval()
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    for baseline in (torch.zeros(3, 16, 16, dtype=torch.float64), torch.randn(3, 16, 16, dtype=torch.float64)):
        with no_rule_warnings() as found:
            assert_sums_to_delta(deeplift(model, x, baseline, [0, 1, 3]), 1e-6)
        assert found == []
    shap = explain.DeepLiftShap(model, torch.randn(2, 3, 16, 16, dtype=torch.float64), normalize=None)
    assert_sums_to_delta(shap.explain(x, target=[0, 1, 3]), 1e-6)


# ------------------------------------------------------------------ item 3: a rule for every nonlinearity


NONLINEARITIES: dict[str, Callable[[Tensor], Tensor]] = {
    "F.relu6": F.relu6, "nn.ReLU6(inplace)": nn.ReLU6(inplace=True),
    "F.hardtanh(inplace=True)": lambda t: F.hardtanh(t, -0.5, 0.5, inplace=True), "nn.Hardtanh": nn.Hardtanh(-0.3, 0.8),
    "torch.clamp": lambda t: torch.clamp(t, -0.2, 0.4), "Tensor.clip": lambda t: t.clip(min=0.1),
    "Tensor.clamp_": lambda t: t.clamp_(-0.3, 0.3), "torch.clamp_min": lambda t: torch.clamp_min(t, 0.2),
    "F.hardswish": F.hardswish, "nn.Hardswish(inplace)": nn.Hardswish(inplace=True),
    "F.hardsigmoid": F.hardsigmoid, "nn.Hardsigmoid(inplace)": nn.Hardsigmoid(inplace=True),
    "nn.PReLU": nn.PReLU(5, init=0.1), "nn.SELU": nn.SELU(), "F.selu_": F.selu_, "nn.CELU": nn.CELU(0.7),
    "nn.Mish": nn.Mish(), "F.mish(inplace=True)": lambda t: F.mish(t, inplace=True),
    "F.silu": F.silu, "nn.SiLU(inplace)": nn.SiLU(inplace=True), "nn.GELU": nn.GELU(),
    "F.gelu(tanh)": lambda t: F.gelu(t, approximate="tanh"), "nn.Softplus": nn.Softplus(beta=2, threshold=1),
    "torch.sigmoid": torch.sigmoid, "Tensor.sigmoid_": Tensor.sigmoid_, "nn.Sigmoid": nn.Sigmoid(),
    "torch.tanh": torch.tanh, "Tensor.tanh_": Tensor.tanh_, "nn.ELU": nn.ELU(0.5), "F.elu_": F.elu_,
    "nn.LeakyReLU": nn.LeakyReLU(0.1), "F.leaky_relu_": lambda t: F.leaky_relu_(t, 0.2),
    "nn.LogSigmoid": nn.LogSigmoid(), "nn.Softsign": nn.Softsign(), "nn.Tanhshrink": nn.Tanhshrink(),
    "nn.Softshrink": nn.Softshrink(0.3), "nn.Hardshrink": nn.Hardshrink(0.3), "nn.Threshold": nn.Threshold(0.1, -1.0),
    "Tensor.relu_": Tensor.relu_, "torch.relu_": torch.relu_, "nn.ReLU(inplace)": nn.ReLU(inplace=True),
    "torch.exp": torch.exp, "x ** 2": lambda t: t ** 2, "2 ** x": lambda t: 2 ** t, "Tensor.abs": Tensor.abs,
    "torch.square": torch.square, "torch.special.expit": torch.special.expit,
}


class OneNonlinearity(nn.Module):
    """x (N, 3, 2, 2) → flatten → Linear(12, 5) → f → Linear(5, 2)."""

    def __init__(self, function: Callable[[Tensor], Tensor]):
        super().__init__()
        self.first, self.second = nn.Linear(12, 5), nn.Linear(5, 2)
        self.function = function

    def forward(self, x):
        return self.second(self.function(self.first(x.flatten(1))))


@pytest.mark.parametrize("name", sorted(NONLINEARITIES))
def test_every_elementwise_nonlinearity_gets_the_rescale_rule_worked_by_hand(name):
    """m = (f(z) − f(z'))/(z − z') per hidden unit; attribution = (x − x') ⊙ W1ᵀ (w2 ⊙ m)."""
    torch.manual_seed(0)
    function = copy.deepcopy(NONLINEARITIES[name]) if isinstance(NONLINEARITIES[name], nn.Module) \
        else NONLINEARITIES[name]
    model = OneNonlinearity(function).double().eval()
    x = torch.randn(3, 3, 2, 2, dtype=torch.float64)
    baseline = torch.randn(3, 2, 2, dtype=torch.float64)
    classes = [0, 1, 1]
    with no_rule_warnings() as found:
        result = deeplift(model, x, baseline, classes)
    assert found == []
    weights, bias = model.first.weight.detach(), model.first.bias.detach()
    with torch.no_grad():
        for n, k in enumerate(classes):
            z, z_ref = weights @ x[n].flatten() + bias, weights @ baseline.flatten() + bias
            multiplier = (model.function(z[None].clone()) - model.function(z_ref[None].clone()))[0] / (z - z_ref)
            expected = (x[n] - baseline).flatten() * (weights.T @ (model.second.weight[k] * multiplier))
            torch.testing.assert_close(result.attributions[n, 0].flatten(), expected, rtol=1e-9, atol=1e-12)
    assert_sums_to_delta(result, 1e-9)


class EveryNonlinearity(nn.Module):
    """Each nonlinearity of the table on its own branch of a small CNN; the branches' pooled outputs summed."""

    def __init__(self):
        super().__init__()
        self.names = sorted(NONLINEARITIES)
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.branches = nn.ModuleList(nn.Conv2d(5, 5, 1) for _ in self.names)
        self.functions = [copy.deepcopy(NONLINEARITIES[name]) for name in self.names]
        self.prelus = nn.ModuleList(f for f in self.functions if isinstance(f, nn.PReLU))  # moved with .double()
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        features = F.relu(self.stem(x))
        total = sum(function(branch(features)).mean((2, 3)) if not isinstance(function, nn.PReLU)
                    else function(branch(features).mean((2, 3)))
                    for branch, function in zip(self.branches, self.functions))
        return self.head(total)


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0", "every_nonlinearity"])
def test_deeplift_sums_to_the_score_change_on_mobilenet_v3_efficientnet_and_every_nonlinearity(name):
    """Hardswish, Hardsigmoid and SiLU, and the squeeze-excitation gates x · σ(...) (a product of two
    tensors that depend on the input, Δ(ab) = Δa·b̄ + ā·Δb): within 1e-4 of y(x) − y(x') in float64,
    and no warning (every function got its rule)."""
    torch.manual_seed(0)
    size = 32
    if name == "every_nonlinearity":
        model = EveryNonlinearity().eval()
    else:
        model = calibrated(torchvision.models.get_model(name, num_classes=5), size)
    model = model.double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    for baseline in ("zeros", torch.randn(3, size, size, dtype=torch.float64) * 0.5):
        with no_rule_warnings() as found:
            assert_sums_to_delta(explain.DeepLift(model, baseline=baseline).explain(x, target=[0, 3]), 1e-4)
        assert found == []


class Gate(nn.Module):
    """a = W1 x, g = σ(W2 x), score = w3 · (a ⊙ g): a squeeze-excitation gate in small."""

    def __init__(self):
        super().__init__()
        self.value, self.gate, self.head = nn.Linear(12, 4, bias=False), nn.Linear(12, 4), nn.Linear(4, 2)

    def forward(self, x):
        x = x.flatten(1)
        return self.head(self.value(x) * torch.sigmoid(self.gate(x)))


def test_a_gate_that_multiplies_two_functions_of_the_input_gets_the_rule_of_products_worked_by_hand():
    """Δ(a g) = Δa · ḡ + ā · Δg with ā = (a + a')/2, Δg = m_σ Δ(W2 x): attribution =
    (x − x') ⊙ (W1ᵀ (w3 ⊙ ḡ) + W2ᵀ (w3 ⊙ ā ⊙ m_σ))."""
    torch.manual_seed(0)
    model = Gate().double().eval()
    x, baseline = torch.randn(2, 3, 2, 2, dtype=torch.float64), torch.randn(3, 2, 2, dtype=torch.float64)
    result = deeplift(model, x, baseline, [1, 0])
    with torch.no_grad():
        for n, k in enumerate([1, 0]):
            flat, reference = x[n].flatten(), baseline.flatten()
            a, a_ref = model.value.weight @ flat, model.value.weight @ reference
            z, z_ref = model.gate(flat), model.gate(reference)
            g, g_ref = torch.sigmoid(z), torch.sigmoid(z_ref)
            w3 = model.head.weight[k]
            expected = (flat - reference) * (model.value.weight.T @ (w3 * (g + g_ref) / 2)
                                             + model.gate.weight.T @ (w3 * (a + a_ref) / 2 * (g - g_ref) / (z - z_ref)))
            torch.testing.assert_close(result.attributions[n, 0].flatten(), expected, rtol=1e-10, atol=1e-12)
    assert_sums_to_delta(result, 1e-10)


class Unruled(nn.Module):
    """A leaky ReLU written with ``where`` (its condition depends on the input) and a logsumexp pooling:
    neither gets a DeepLIFT rule."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, x):
        h = self.conv(x)
        h = torch.where(h > 0, h, 0.1 * h)
        return self.head(torch.logsumexp(h.flatten(2), dim=2))


def test_a_nonlinear_function_without_a_rule_is_named_in_one_warning_per_call():
    torch.manual_seed(0)
    model = Unruled().double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for method in (explain.DeepLift(model), explain.DeepLiftShap(model, torch.randn(3, 3, 8, 8, dtype=torch.float64),
                                                                    batch_size=2)):
        for _ in range(2):
            with no_rule_warnings() as found:
                method.explain(x, target=[0, 1])
            assert len(found) == 1, found
            assert "model: where (it depends on the input through comparisons or indices" in found[0]
            assert "model: logsumexp" in found[0] and "summation_error" in found[0]


def test_deeplift_equals_captum_for_hardswish_and_relu6_given_captum_the_rescale_rule_for_them(monkeypatch):
    """Captum 0.9 applies its rescale rule to the module types of its table (ReLU, ELU, Sigmoid, ...); given
    nn.Hardswish and nn.ReLU6 there, its DeepLift is the rescale rule we apply: the same attributions."""
    deep_lift = pytest.importorskip("captum.attr._core.deep_lift")
    captum = pytest.importorskip("captum.attr")
    monkeypatch.setitem(deep_lift.SUPPORTED_NON_LINEAR, nn.Hardswish, deep_lift.nonlinear)
    monkeypatch.setitem(deep_lift.SUPPORTED_NON_LINEAR, nn.ReLU6, deep_lift.nonlinear)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Hardswish(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)).double().eval()
    x, baseline = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ours = explain.DeepLift(model, baseline=baseline, normalize=None).explain(x, target=[0, 2]).attributions[:, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum.DeepLift(copy.deepcopy(model)).attribute(x, baselines=baseline, target=[0, 2])
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["timm_levit", "timm_deit", "hf_vit"])
def test_deeplift_sums_to_the_score_change_on_timm_and_huggingface_transformers(name):
    """timm's LeViT (BatchNorm feature maps read as tokens, attention with biases, Hardswish), DeiT with its
    distillation token (fused attention), a HuggingFace ViT (eager softmax attention, GELU): no warning, and
    the attributions sum to y(x) − y(x') within 1e-6 (float64)."""
    torch.manual_seed(0)
    if name == "hf_vit":
        transformers = pytest.importorskip("transformers")
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, num_labels=5)
        model = transformers.ViTForImageClassification(config).eval()
        size, options = 32, {"output": "logits"}
    else:
        timm = pytest.importorskip("timm")
        size = 64 if name == "timm_levit" else 32
        architecture = "levit_128s" if name == "timm_levit" else "deit_tiny_distilled_patch16_224"
        model = calibrated(timm.create_model(architecture, num_classes=5, img_size=size), size)
        options = {}
    model = model.double()
    x = torch.rand(2, 3, size, size, dtype=torch.float64)
    with no_rule_warnings() as found:
        result = explain.DeepLift(model, baseline=torch.rand(3, size, size, dtype=torch.float64), normalize=None,
                                  **options).explain(x, target=[0, 4])
    assert found == []
    assert_sums_to_delta(result, 1e-6)


class Tokens(nn.Module):
    """conv → BatchNorm (eval) → ReLU; the feature map read as tokens (``x.flatten(2).transpose(1, 2)``, as
    LeViT does), or averaged as a feature map: the same function."""

    def __init__(self, as_tokens: bool):
        super().__init__()
        self.as_tokens = as_tokens
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.Linear(8, 3)

    def forward(self, x):
        features = torch.relu(self.norm(self.conv(x)))
        if self.as_tokens:
            return self.head(features.flatten(2).transpose(1, 2).mean(1))
        return self.head(features.mean((2, 3)))


def test_a_batch_norm_whose_output_is_read_as_tokens_gets_its_exact_gradient():
    """torch 2.14's CPU BatchNorm backward is wrong for a channels-last gradient of a contiguous one-row output,
    which a rule's backward gives where a feature map is read as tokens and DeepLIFT runs one image (one row
    per forward): the attributions equal those of the same function read as a feature map."""
    torch.manual_seed(0)
    model = calibrated(Tokens(as_tokens=False), 16).double()
    tokens = Tokens(as_tokens=True).double().eval()
    tokens.load_state_dict(model.state_dict())
    x, baseline = torch.rand(1, 3, 16, 16, dtype=torch.float64), torch.rand(3, 16, 16, dtype=torch.float64)
    expected = deeplift(model, x, baseline, [0])
    result = deeplift(tokens, x, baseline, [0])
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-10, atol=1e-13)
    assert_sums_to_delta(result, 1e-10)


# ------------------------------------------------------------------ item 14: nonlinear functions of parameters


class Tempered(nn.Module):
    """logits · softplus(temperature): a nonlinearity of a parameter."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return F.softplus(self.temperature) * self.net(x)


def test_a_nonlinearity_of_a_parameter_is_computed_plainly():
    """softplus(t) is the same for x and x': DeepLIFT of the tempered model is softplus(t) × DeepLIFT of
    the untempered one, and sums to the score change."""
    torch.manual_seed(0)
    model = Tempered().double().eval()
    x, baseline = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(3, 8, 8, dtype=torch.float64)
    result = deeplift(model, x, baseline, [0, 2])
    untempered = deeplift(model.net, x, baseline, [0, 2])
    factor = F.softplus(model.temperature).item()
    torch.testing.assert_close(result.attributions, factor * untempered.attributions, rtol=1e-12, atol=1e-14)
    assert_sums_to_delta(result, 1e-10)


class ClipLike(nn.Module):
    """CLIP in small: an image tower, a text tower run on fixed token embeddings (GELU, LayerNorm: nonlinear
    functions of constants), both normalised, logits = logit_scale.exp() · image @ textᵀ for 3 prompts."""

    def __init__(self, prompts: int = 3):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                   nn.Linear(8, 6))
        self.text = nn.Sequential(nn.Linear(10, 12), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 6))
        self.register_buffer("prompts", torch.randn(prompts, 10))
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    def forward(self, x):
        image = F.normalize(self.image(x), dim=-1)
        text = self.text(self.prompts)
        text = text / text.norm(dim=-1, keepdim=True)
        return self.logit_scale.exp() * image @ text.t()


class Precomputed(nn.Module):
    """The same logits with the text features and the scale computed beforehand (constants)."""

    def __init__(self, clip: ClipLike):
        super().__init__()
        self.image = clip.image
        with torch.no_grad():
            text = clip.text(clip.prompts)
            self.register_buffer("text", (text / text.norm(dim=-1, keepdim=True)).t() * clip.logit_scale.exp())

    def forward(self, x):
        image = self.image(x)
        return image / torch.sqrt((image * image).sum(-1, keepdim=True)) @ self.text


@pytest.mark.parametrize("prompts", [3, 1])
def test_a_clip_like_model_with_a_logit_scale_and_fixed_prompts_sums_to_the_score_change(prompts):
    """The attributions equal those of the model whose constants were computed beforehand: the text tower
    and logit_scale.exp() are computed plainly, the image's normalisation gets its exact rules."""
    torch.manual_seed(0)
    model = ClipLike(prompts).double().eval()
    x, baseline = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(3, 8, 8, dtype=torch.float64)
    targets = [[0, 1, 2], [2, 1, 0]] if prompts == 3 else [0, 0]
    result = deeplift(model, x, baseline, targets)
    expected = deeplift(Precomputed(model).eval(), x, baseline, targets)
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-9, atol=1e-12)
    assert_sums_to_delta(result, 1e-9)


# ------------------------------------------------------------------ what cannot be paired


class BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, x):
        h = self.conv(x)
        if h.mean() > 0:  # control flow on the input's values
            h = torch.relu(h).flatten(2).mean(2)
        else:
            h = torch.sigmoid(h.mean((2, 3)))
        return self.head(h)


def test_a_forward_whose_operations_depend_on_the_input_values_is_a_clear_error_and_leaves_nothing_set():
    torch.manual_seed(0)
    model = BranchesOnValues().double().eval()
    x = torch.full((1, 3, 6, 6), 5.0, dtype=torch.float64)
    baseline = torch.full((3, 6, 6), -5.0, dtype=torch.float64)
    with torch.no_grad():
        assert (model.conv(x).mean() > 0) != (model.conv(baseline[None]).mean() > 0)
    with pytest.raises(ModelInputError, match=r"pairs their operations one by one.*control flow.*IntegratedGradients"):
        explain.DeepLift(model, baseline=baseline).explain(x, target=0)
    assert torch._C._len_torch_function_stack() == 0
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())
