"""DeepLIFT through normalisation layers against a baseline whose tokens are constant across channels (the
zero baseline): the rule of products split y = c · (1/σ) at the means, giving Δc the multiplier
(1/σ + 1/σ')/2 ≈ 158/σ with 1/σ' = 1/√eps and taking it back through Δ(1/σ); exact in exact arithmetic,
but ~150 times Δy per normalisation, so that a few of them in sequence (MobileViT's transformer) lost the
score change to rounding (1e28 in float32, 1e20 in float64) or overflowed. The normalisation now has its own
rule: Δy = Δc · r + c' · Δr where the image's scale r ≤ the baseline's r', Δy = Δc · r' + c · Δr elsewhere.
Expected values are worked by hand in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_zoo_attacks import hf_mobilevit
from torch import Tensor, nn

import explain

torch.set_num_threads(1)


class Normalised(nn.Module):
    """x (N, C, H, W) → tokens (N, HW, C) → [LayerNorm → Linear (no bias)] × depth → mean over the tokens →
    Linear head."""

    def __init__(self, channels: int = 6, depth: int = 1, classes: int = 3):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(channels) for _ in range(depth))
        self.linears = nn.ModuleList(nn.Linear(channels, channels, bias=False) for _ in range(depth))
        self.head = nn.Linear(channels, classes)
        with torch.no_grad():
            for norm in self.norms:
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_(0, 0.1)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(2).transpose(1, 2)
        for norm, linear in zip(self.norms, self.linears):
            tokens = linear(norm(tokens))
        return self.head(tokens.mean(1))


def tokens_of(x: Tensor) -> Tensor:
    return x.flatten(2).transpose(1, 2)


def images_of(tokens: Tensor, like: Tensor) -> Tensor:
    return tokens.transpose(1, 2).reshape(like.shape)


def layer_norm_multipliers(t: Tensor, t_ref: Tensor, norm: nn.LayerNorm, upstream: Tensor) -> Tensor:
    """By hand: the multipliers of the tokens t (N, T, n) given those of the LayerNorm's output (upstream),
    with the rule of normalisations. Per token: c = t − mean t, m = mean c² + eps, r = m^(−1/2) (and c', m',
    r' of the baseline), k = (r − r')/(m − m') the rescale rule's multiplier of rsqrt (−m^(−3/2)/2 where
    m = m'), Δm = Σ_j (c_j + c'_j) Δc_j / n; Δy_i = w_i (Δc_i · r_A + c_B,i · k · Δm) with (r_A, c_B) = (r, c')
    where r ≤ r', else (r', c); the centring's transpose last."""
    n = t.shape[-1]
    eps = norm.eps
    c, c_ref = t - t.mean(-1, keepdim=True), t_ref - t_ref.mean(-1, keepdim=True)
    m, m_ref = (c * c).mean(-1, keepdim=True) + eps, (c_ref * c_ref).mean(-1, keepdim=True) + eps
    r, r_ref = m ** -0.5, m_ref ** -0.5
    same = (m - m_ref).abs() < 1e-10
    k = torch.where(same, -0.5 * m ** -1.5, (r - r_ref) / torch.where(same, torch.ones_like(m), m - m_ref))
    image_smaller = r <= r_ref
    r_a = torch.where(image_smaller, r, r_ref)
    c_b = torch.where(image_smaller, c_ref, c)
    g = upstream * norm.weight.detach()  # multipliers of c · r
    through_c = g * r_a
    through_scale = (g * c_b).sum(-1, keepdim=True) * k * (c + c_ref) / n
    g_c = through_c + through_scale
    return g_c - g_c.mean(-1, keepdim=True)


def hand_deeplift(model: Normalised, x: Tensor, baseline: Tensor, target: int) -> Tensor:
    """The attributions (N, C, H, W) by hand: the forward on both, then the multipliers layer by layer."""
    t, t_ref = tokens_of(x), tokens_of(baseline)
    inputs = []
    with torch.no_grad():
        for norm, linear in zip(model.norms, model.linears):
            inputs.append((t, t_ref))
            t, t_ref = linear(norm(t)), linear(norm(t_ref))
        multipliers = (model.head.weight[target] / t.shape[1]).expand_as(t)
        for (t_in, t_in_ref), norm, linear in reversed(list(zip(inputs, model.norms, model.linears))):
            multipliers = layer_norm_multipliers(t_in, t_in_ref, norm, multipliers @ linear.weight)
    return (x - baseline) * images_of(multipliers, x)


def score_change(model: nn.Module, x: Tensor, baseline: Tensor, target: int) -> Tensor:
    with torch.no_grad():
        return model(x)[:, target] - model(baseline)[:, target]


def deeplift(model: nn.Module, x: Tensor, baseline: Tensor, target: int) -> explain.Explanation:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no warning: every function has its rule and the sums hold
        return explain.DeepLift(model, baseline=baseline, normalize=None).explain(x, target=target)


@pytest.mark.parametrize("depth", [1, 2])
def test_layer_norm_against_the_zero_baseline_equals_the_hand_computation(depth):
    torch.manual_seed(0)
    model = Normalised(depth=depth).double().eval()
    x = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    baseline = torch.zeros_like(x)
    expected = hand_deeplift(model, x, baseline, 1)
    result = deeplift(model, x, baseline, 1)
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-9, atol=1e-12)
    change = score_change(model, x, baseline, 1)
    torch.testing.assert_close(expected.flatten(1).sum(1), change, rtol=1e-9, atol=1e-12)  # the hand sums too
    # the baseline's tokens are 0, so c' = 0: Δy = Δc · r alone, the LayerNorm held at the image's scale
    # (multipliers of the size of 1/σ, not of 1/√eps = 316)
    assert result.attributions.abs().max() < 10 * change.abs().max()


def test_layer_norm_against_a_varying_baseline_equals_the_hand_computation():
    """Tokens of the baseline with larger and smaller variances than the image's: both orders of the split."""
    torch.manual_seed(1)
    model = Normalised(depth=2).double().eval()
    x = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    baseline = torch.randn_like(x) * torch.tensor([0.2, 3.0, 0.5], dtype=torch.float64).view(1, 1, 1, 3)
    tokens, reference = tokens_of(x), tokens_of(baseline)
    scales = tokens.var(-1), reference.var(-1)
    assert (scales[0] > scales[1]).any() and (scales[0] < scales[1]).any()
    expected = hand_deeplift(model, x, baseline, 2)
    result = deeplift(model, x, baseline, 2)
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(expected.flatten(1).sum(1), score_change(model, x, baseline, 2), rtol=1e-9,
                               atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_layer_norms_in_sequence_keep_their_multipliers_and_the_sum(dtype):
    """Eight LayerNorms: the split at the means gave attributions of 3e14 for a score change of 0.2."""
    torch.manual_seed(2)
    model = Normalised(depth=8).to(dtype).eval()
    x = torch.randn(2, 6, 2, 3, dtype=dtype)
    baseline = torch.zeros_like(x)
    result = deeplift(model, x, baseline, 0)
    change = result.diagnostics["score_change"].double()
    relative = 1e-6 if dtype == torch.float64 else 1e-3
    assert (result.diagnostics["summation_error"].double().abs() <= relative * change.abs()).all()
    assert result.attributions.abs().max() < 100 * change.abs().max()
    if dtype == torch.float64:
        torch.testing.assert_close(result.attributions[:, 0], hand_deeplift(model, x, baseline, 0), rtol=1e-8,
                                   atol=1e-12)


def test_rms_group_and_instance_norms_sum_to_the_score_change_against_the_zero_baseline():
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 1, bias=False),
        nn.InstanceNorm2d(8, affine=True), nn.Conv2d(8, 8, 1, bias=False), nn.GroupNorm(4, 8),
        nn.Conv2d(8, 8, 1, bias=False), nn.Flatten(2), nn.RMSNorm(16), nn.Linear(16, 16, bias=False),
        nn.RMSNorm(16), nn.Flatten(1), nn.Linear(128, 3)).double().eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    result = deeplift(model, x, torch.zeros_like(x), 0)
    change = result.diagnostics["score_change"].double()
    assert (result.diagnostics["summation_error"].double().abs() <= 1e-6 * change.abs()).all()
    assert result.attributions.abs().max() < 100 * change.abs().max()


# ------------------------------------------------------------------ MobileViT


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mobilevit_against_the_zero_baseline_sums_to_the_score_change(dtype):
    """Nine transformer layers of LayerNorms on tokens that the zero baseline makes constant."""
    model = hf_mobilevit(image_size=32, labels=4).to(dtype)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = explain.DeepLift(model, normalize=None).explain(x, target=[0, 1])  # image n: class n
    with torch.no_grad():
        change = (model(x).logits - model(torch.zeros_like(x)).logits)[[0, 1], [0, 1]].double()[:, None]
    torch.testing.assert_close(result.diagnostics["score_change"].double(), change, rtol=1e-5, atol=1e-7)
    total = result.attributions.double().flatten(2).sum(2)
    if dtype == torch.float64:
        assert ((total - change).abs() <= 1e-6 * change.abs()).all(), (total, change)
    else:
        torch.testing.assert_close(total, change, rtol=1e-3, atol=1e-6)
    assert result.attributions.abs().max() < change.abs().max()  # no multipliers of 1e12


# ------------------------------------------------------------------ what is left: said, never silent


class HandWrittenNorms(nn.Module):
    """A LayerNorm written by hand, (t − mean) / √(var + eps), 16 times in sequence: the quotient gets the
    rule of quotients (split at the means), whose multipliers grow against the zero baseline as the
    LayerNorm's did."""

    def __init__(self, channels: int = 8, depth: int = 16):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(channels, channels, bias=False) for _ in range(depth))
        self.head = nn.Linear(channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        tokens = tokens_of(x)
        for linear in self.linears:
            centred = tokens - tokens.mean(-1, keepdim=True)
            tokens = linear(centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5))
        return self.head(tokens.mean(1))


def test_attributions_that_do_not_sum_to_the_score_change_are_warned_about():
    torch.manual_seed(0)
    model = HandWrittenNorms().double().eval()
    x = torch.randn(2, 8, 2, 2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = explain.DeepLift(model, normalize=None).explain(x, target=0)
    error, change = result.diagnostics["summation_error"].double(), result.diagnostics["score_change"].double()
    if (error.abs() <= 1e-6 * change.abs()).all():
        pytest.skip("the rule of quotients no longer loses the sum here")
    messages = [str(warning.message) for warning in caught if "do not sum to the score change" in
                str(warning.message)]
    assert len(messages) == 1, [str(warning.message) for warning in caught]
    assert "y(x) − y(x′)" in messages[0] and "baseline='blur'" in messages[0]
    # with a baseline that is not constant across channels the sum holds
    blurred = explain.DeepLift(model, baseline="blur", normalize=None).explain(x, target=0)
    error, change = blurred.diagnostics["summation_error"].double(), blurred.diagnostics["score_change"].double()
    assert (error.abs() <= 1e-6 * change.abs()).all()


def test_attributions_that_overflow_are_said_to_be_deeplifts_not_the_models():
    torch.manual_seed(0)
    model = HandWrittenNorms(depth=40).float().eval()
    x = torch.randn(2, 8, 2, 2)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all() and torch.isfinite(model(torch.zeros_like(x))).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = explain.DeepLift(model, normalize=None).explain(x, target=0)
        except ValueError as error:
            message = str(error)
            assert "DeepLIFT's multipliers, not the model, overflowed" in message, message
            assert "Check the input's range" not in message and "baseline='blur'" in message
            return
    if not torch.isfinite(result.attributions).all():
        pytest.fail("non-finite attributions returned")
    pytest.skip("the multipliers no longer overflow here")
