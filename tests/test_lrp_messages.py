"""LRP's messages on models it has no rule for, and its squeeze-and-excitation gate rule (``hold_gates``).

- A map that overflows to inf/NaN through calls without an LRP rule (a transformer's einsum): the error names those
  calls and AttnLRP, not the model's precision (the model is float32).
- A squeeze-and-excitation gate x · σ(W s): with ``hold_gates=False`` the warning names the gate's product and the
  option; by default, the gate is a constant of the product (Arras et al. 2017's "signal-take-all"), and the
  relevance equals the rules worked out by hand, conserved to the stabilisers' share."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import assert_state_equal, model_state
from torch import nn

from explain.methods.lrp import LRP


def lrp(model: nn.Module, x: torch.Tensor, target: int, **options):
    """The explanation with the raw relevance kept (no normalisation), z⁺ for convolutions and ε for linear layers."""
    return LRP(model, "epsilon_plus", normalize=None, **options).explain(x, target=target)


# ------------------------------------------------------------------ a map that overflows through unruled calls


class Overflowing(nn.Module):
    """Two products h · h of a tensor scaled down and up by 1e20 (einsum, as MaxViT's attention computes): the forward
    is h⁴, finite; the plain gradient that relevance follows through each product multiplies it by 1e20 · h, so two
    of them overflow float32 (1e40 > 3.4e38)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.embed(x.flatten(1))) + 1
        for _ in range(2):
            h = torch.einsum("bi,bi->bi", h * 1e-20, h * 1e20)
        return self.head(h)


def test_a_map_that_overflows_through_unruled_calls_names_them_and_attnlrp_not_float16():
    torch.manual_seed(0)
    model = Overflowing().eval()
    x = torch.rand(1, 1, 2, 3)
    score = model(x)[0, 1]
    assert torch.isfinite(score)  # the forward is finite: only the propagated relevance overflows
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error says it all: no warning repeats it
        with pytest.raises(ValueError) as raised:
            lrp(model, x, 1)
    message = str(raised.value)
    assert "NaN or inf values (image 0, target 0)" in message
    assert "no rule for model: einsum on the input's path" in message
    assert "AttnLRP (explain.AttnLRP, --method attnlrp)" in message
    assert "float16" not in message and "input's range" not in message
    assert_state_equal(before, model_state(model))


def test_a_float16_model_that_overflows_through_unruled_calls_is_also_told_its_precision():
    # the relevance of a float16 model's einsum overflows at 6.5e4: 1e3 · 1e3 · h² is enough
    class Small(Overflowing):
        def forward(self, x):
            h = torch.relu(self.embed(x.flatten(1))) + 1
            for _ in range(2):
                h = torch.einsum("bi,bi->bi", h * 1e-3, h * 1e3)
            return self.head(h)

    torch.manual_seed(0)
    model = Small().half().eval()
    with pytest.raises(ValueError, match=r"no rule for model: einsum.*AttnLRP.*runs in torch.float16"):
        lrp(model, torch.rand(1, 1, 2, 3).half(), 1, epsilon=1e-3, stabilizer=1e-3)


# ------------------------------------------------------------------ squeeze-and-excitation gates


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, 2, 1)
        self.fc2 = nn.Conv2d(2, channels, 1)

    def forward(self, a):
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(a.mean(dim=(2, 3), keepdim=True)))))
        return a * gate


class Gated(nn.Module):
    """A 1×1 convolution, ReLU, a squeeze-and-excitation block, a mean and a classifier: no biases on the relevance
    path (the gate's branch has them: holding the gate constant, they take no relevance)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1, bias=False)
        self.se = SqueezeExcitation(4)
        self.head = nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.head(self.se(torch.relu(self.conv(x))).mean(dim=(2, 3)))


def stabilized(z: np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    return z + epsilon * np.where(z >= 0, 1.0, -1.0)


def by_hand(model: Gated, x: torch.Tensor, target: int) -> tuple[np.ndarray, float]:
    """(input relevance (3, H, W), score): ε for the classifier, the mean's contributions, the gated tensor keeping
    all the relevance of the product, ReLU passing it, z⁺ for the convolution; the gate a constant."""
    x0 = x[0].numpy()  # (3, H, W), ≥ 0
    w1 = model.conv.weight.detach()[:, :, 0, 0].numpy()  # (4, 3)
    a = np.clip(np.einsum("jc,chw->jhw", w1, x0), 0, None)  # (4, H, W)
    with torch.no_grad():
        gate = model.se(torch.relu(model.conv(x)))[0].numpy() / np.where(a == 0, 1, a)  # σ(W s) where a ≠ 0
    y = a * gate
    p = y.mean(axis=(1, 2))
    w3 = model.head.weight.detach().numpy()  # (3, 4)
    logits = w3 @ p
    relevance = np.eye(3)[target] * logits
    r_p = (w3 * p).T @ (relevance / stabilized(logits))  # ε: R_i = Σ_k p_i w_ki R_k / stab(z_k)
    r_y = y / y[0].size / stabilized(p)[:, None, None] * r_p[:, None, None]  # the mean: by contributions
    r_a = r_y  # the gate held constant: all to the gated tensor; ReLU passes it on
    q = np.clip(w1, 0, None)[:, :, None, None] * x0[None]  # (4, 3, H, W) z⁺ contributions, x ≥ 0
    r_x = (q / stabilized(q.sum(axis=1))[:, None] * r_a[:, None]).sum(axis=0)
    return r_x, float(logits[target])


def test_an_unruled_gate_product_gets_a_warning_naming_it_and_hold_gates():
    torch.manual_seed(0)
    model = Gated().eval()
    with pytest.warns(RuntimeWarning) as record:
        explanation = lrp(model, torch.rand(1, 3, 4, 4), 0, hold_gates=False)
    message = " ".join(str(warning.message) for warning in record)
    assert "no rule for se: mul on the input's path" in message
    assert "1 of them (se: mul) multiply a tensor by a sigmoid gate" in message
    assert "hold_gates=True" in message
    assert "explain.AttnLRP" not in message  # the gate option is the fix named; no transformer call here
    assert explanation.diagnostics["unruled"] == ["se: mul"]


@pytest.mark.parametrize("in_place", [False, True])
def test_held_gates_give_the_gated_tensor_all_the_relevance_as_worked_out_by_hand(in_place):
    torch.manual_seed(0)
    model = Gated().double().eval()
    if in_place:  # a *= gate, as a view (timm's and torchvision's blocks multiply out of place; some in place)
        def forward(a):
            gate = torch.sigmoid(model.se.fc2(torch.relu(model.se.fc1(a.mean(dim=(2, 3))[:, :, None, None]))))
            a = a.clone()
            a *= gate.view(1, 4, 1, 1)
            return a

        model.se.forward = forward
    x = torch.rand(1, 3, 5, 5, dtype=torch.float64)
    expected, score = by_hand(model, x, 2)
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the gate has its rule: no warning
        explanation = lrp(model, x, 2)  # hold_gates=True, the default
    assert_state_equal(before, model_state(model))
    np.testing.assert_allclose(explanation.attributions[0, 0].numpy(), expected, rtol=1e-9, atol=1e-15)
    diagnostics = explanation.diagnostics
    assert diagnostics["unruled"] == []
    assert float(diagnostics["output_relevance"][0, 0]) == pytest.approx(score, rel=1e-12)
    # conserved up to what the stabilisers (1e-6) absorb; without the rule the product loses half or more
    assert abs(float(diagnostics["conservation_error"][0, 0])) < 1e-4 * abs(score)
    with pytest.warns(RuntimeWarning, match="sigmoid gate"):
        unheld = lrp(model, x, 2, hold_gates=False)
    assert abs(float(unheld.diagnostics["conservation_error"][0, 0])) > 0.1 * abs(score)


def test_hold_gates_is_checked():
    with pytest.raises(TypeError, match="hold_gates must be True or False"):
        LRP(Gated(), "epsilon_plus", hold_gates="yes")
