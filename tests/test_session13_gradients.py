"""Session 13: the gradient and attribution family (saliency, IG, SmoothGrad, Blur/Guided IG, expected gradients,
DeepLIFT, guided backprop, XRAI) attacked with the models people use; each test pins a fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import explain

# ------------------------------------------------------------------ DeepLIFT: custom autograd functions, checkpoints


class SiLUBlock(nn.Module):
    """conv → activation → max pool → conv → amax over channels (kept) · mean: a SiLU, a max pooling and a max
    reduction, optionally inside a non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, activation: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3)
        self.activation, self.checkpointed = activation, checkpointed
        self.head = nn.Linear(6, 3)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.max_pool2d(self.activation(self.first(x)), 2)
        hidden = self.activation(self.second(hidden))
        return hidden * hidden.amax(dim=1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(hidden.mean((2, 3)))


def _deeplift(model: nn.Module, x: torch.Tensor) -> tuple[explain.Explanation, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = explain.DeepLift(model, normalize=None).explain(x, target=[0, 2])
    return result, [str(warning.message) for warning in caught]


def test_deeplift_refuses_a_non_reentrant_checkpoint_saying_why():
    """A non-reentrant checkpoint recomputes its block in the backward pass with the plain functions and hands their
    saved tensors to DeepLIFT's rules (SiLU's input as the multipliers: a wrong map; with a max pooling, torch's
    CheckpointError about metadata): refused, naming the checkpoint and how to turn it off."""
    torch.manual_seed(0)
    model = SiLUBlock(nn.SiLU(), checkpointed=True).double().eval()
    x = torch.randn(2, 3, 14, 14, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"(?s)DeepLift cannot follow the model through torch.utils.checkpoint.*"
                                           r"Call the block without checkpoint while explaining"):
        explain.DeepLift(model, normalize=None).explain(x, target=[0, 2])
    with pytest.raises(RuntimeError, match="DeepLiftShap cannot follow the model through torch.utils.checkpoint"):
        explain.DeepLiftShap(model, torch.zeros(2, 3, 14, 14, dtype=torch.float64), normalize=None).explain(x)
    # the same model without the checkpoint, and inside the caller's own saved-tensor hooks: summation to delta
    model.checkpointed = False
    with torch.autograd.graph.save_on_cpu():
        result, messages = _deeplift(model, x)
    assert messages == []
    summed = result.attributions.double().sum(dim=(2, 3, 4))
    torch.testing.assert_close(summed, result.diagnostics["score_change"].double(), rtol=1e-6, atol=1e-9)


def test_deeplift_names_a_custom_autograd_activation_rather_than_blaming_the_baseline():
    """timm's memory-efficient SwishMe is a torch.autograd.Function: its forward runs with gradients off and its
    backward is the plain derivative, out of DeepLIFT's reach. The warning names it (it blamed the baseline)."""
    timm_me = pytest.importorskip("timm.layers.activations_me")
    torch.manual_seed(0)
    model = SiLUBlock(timm_me.SwishMe()).double().eval()
    x = torch.randn(2, 3, 14, 14, dtype=torch.float64)
    result, messages = _deeplift(model, x)
    assert len(messages) == 1, messages
    assert "activation" in messages[0] and "custom torch.autograd.Function" in messages[0]
    assert "grew from layer to layer" not in messages[0]
    # and indeed the attributions do not sum (the warning is not a false alarm)
    assert result.diagnostics["summation_error"].abs().max() > 1e-4 * result.diagnostics["score_change"].abs().max()


def test_deeplift_names_a_no_grad_block_inside_the_forward():
    """A statistic computed under torch.no_grad() inside forward is a constant to autograd but differs between the
    image and the baseline: named as the computation with gradients off."""

    class NoGradScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 3)

        def forward(self, x):
            hidden = self.conv(x)
            with torch.no_grad():
                scale = hidden.abs().mean() + 1
            return self.head((hidden / scale).relu().mean((2, 3)))

    torch.manual_seed(0)
    result, messages = _deeplift(NoGradScale().double().eval(), torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert len(messages) == 1 and "gradients off" in messages[0], messages
