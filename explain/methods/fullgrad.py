"""FullGrad (Srinivas & Fleuret 2019): the input-gradient and every bias-gradient of a CNN, aggregated.

For a network with ReLUs, pooling and biases, the output decomposes exactly (the paper's
"completeness") as y = ∇ₓy · x + Σ_layers Σ b · ∂y/∂z, z the output of a layer with bias b
(a BatchNorm in eval mode is an affine map with bias β − γμ/√(σ² + ε); in timm's BatchNormAct2d, z is
the BatchNorm's output before the activation). The saliency map is

    S(x) = ψ(|∇ₓy ⊙ x|) + Σ_{conv, BatchNorm} Σ_c ψ(|b_c ∂y/∂z_c|),

ψ: rescale to [0, 1] (per image; for the bias terms per channel), then upsample bilinearly to
the input. The layers' outputs are recorded with ``explain.core.capture`` (the call's scope), no
module is replaced, and a ReLU applied in place after a layer changes a copy, not the
recorded output, so ``ReLU(inplace=True)`` and ``F.relu`` both work.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import FrozenBatchNorm2d
from typing_extensions import Unpack

from ..core.capture import LayerRecord, capture
from ..core.targets import Target, select_targets
from ..core.units import UnitTarget
from ..io.loaded_model import ModelSource
from .base import Explainer
from .cam import augmented_attribution
from .maps import Attribution
from .registry import register
from .signatures import ExplainerOptions

TIMM_NORM_ACT_BATCH_NORMS = ("BatchNormAct2d", "FrozenBatchNormAct2d")
"""timm's BatchNorms with an activation fused in: BatchNorm, then ``drop``, then ``act`` (EfficientNet, MobileNetV3,
RegNet and others in timm use them for every BatchNorm)."""


def is_timm_norm_act(module: nn.Module) -> bool:
    """Whether the module is one of timm's own ``TIMM_NORM_ACT_BATCH_NORMS`` (not a subclass that changes it)."""
    cls = type(module)
    return cls.__module__.startswith("timm.") and cls.__name__ in TIMM_NORM_ACT_BATCH_NORMS


def is_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm that is an affine map per channel in eval mode: BatchNorm2d with running statistics and
    torch's forward, FrozenBatchNorm2d, or timm's BatchNormAct2d / FrozenBatchNormAct2d with running statistics
    (the part before their activation)."""
    if isinstance(module, FrozenBatchNorm2d):
        return True
    if is_timm_norm_act(module):
        return getattr(module, "running_mean", None) is not None
    return (isinstance(module, nn.BatchNorm2d) and type(module).forward is nn.BatchNorm2d.forward
            and module.running_mean is not None)


def effective_bias(module: nn.Module) -> Optional[Tensor]:
    """The bias that a layer adds to its output, (C,); None for a layer without one.

    Conv2d: its bias. BatchNorm2d (eval, running statistics), FrozenBatchNorm2d and timm's
    BatchNormAct2d / FrozenBatchNormAct2d (before their activation): β − γ μ / √(σ² + ε)
    (γ = 1, β = 0 without affine parameters). Linear: its bias (for completeness only: not spatial).
    Other BatchNorm subclasses that do more in forward are left out.
    """
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        return None if module.bias is None else module.bias.detach()
    if is_batch_norm(module):
        names = ("running_mean", "running_var", "weight", "bias", "eps")
        mean, variance, weight, bias, eps = (getattr(module, name) for name in names)
        assert isinstance(mean, Tensor) and isinstance(variance, Tensor), "a BatchNorm with running statistics"
        scale = torch.rsqrt(variance + eps)
        if isinstance(weight, Tensor):
            scale = scale * weight
        shift = -mean * scale
        return (shift + bias if isinstance(bias, Tensor) else shift).detach()
    return None


def biased_output_module(module: nn.Module) -> Optional[nn.Module]:
    """The module whose output is the layer's output z, to which its bias was added: the layer itself, or for
    timm's norm-act BatchNorms their ``drop`` (Identity or Dropout: the identity in eval mode), which receives
    the BatchNorm's output before the activation; None where that output is not a module's."""
    if not is_timm_norm_act(module):
        return module
    drop = getattr(module, "drop", None)
    return drop if isinstance(drop, (nn.Identity, nn.Dropout)) else None


def rescaled(values: Tensor, dims: tuple[int, ...]) -> Tensor:
    """(values − min) / (max − min) over ``dims``; 0 where the values are constant."""
    low = values.amin(dim=dims, keepdim=True)
    span = values.amax(dim=dims, keepdim=True) - low
    return torch.where(span > 0, (values - low) / torch.where(span > 0, span, 1.0), 0.0)


@register
class FullGrad(Explainer):
    """FullGrad (Srinivas & Fleuret 2019): ψ(|x ⊙ ∂y/∂x|) + Σ over convolutions and BatchNorms, over
    channels c, of ψ(|b_c ∂y/∂z_c|) upsampled; ψ rescales to [0, 1] (per image for the input term,
    per image and channel for the bias terms, as in the paper's formula). Map (N, H, W) ≥ 0.

    No target layer: every Conv2d with a bias and every BatchNorm2d is used (BatchNorm's effective
    bias in eval mode; timm's BatchNormAct2d too, at its output before the activation).
    ``Explanation.diagnostics["completeness_error"]`` (N, K) is y − (Σ x ∂y/∂x + Σ b ∂y/∂z over conv,
    BatchNorm and linear layers): about 0 for networks of ReLUs and pooling (ResNet, VGG, DenseNet,
    timm's RegNetX); not 0 with other non-linearities (EfficientNet's SiLU has implicit biases that
    FullGrad leaves out).

    smooth: None or "augment" (the mean map over flipped and intensity-scaled copies, as for CAMs).
    pytorch-grad-cam rescales the input term per colour channel; the official code
    (idiap/fullgrad-saliency) rescales each layer's bias terms jointly over its channels.
    """

    name = "fullgrad"
    summary = "FullGrad: |input × gradient| plus every conv/BatchNorm bias × its output gradient"

    def reads_pixel_gradients(self) -> bool:
        return True

    def __init__(self, model: ModelSource, *, smooth: Optional[str] = None, **options: Unpack[ExplainerOptions]):
        super().__init__(model, **options)
        if smooth not in (None, "augment"):
            raise ValueError(f"FullGrad's smooth must be None or 'augment'; got {smooth!r}.")
        self.smooth = smooth

    def bias_layers(self) -> list[tuple[nn.Module, Tensor, bool]]:
        """(module whose output z is recorded, effective bias, whether the bias is per channel of a (N, C, h, w)
        map) of every layer that adds a bias to its output (``biased_output_module``)."""
        layers = []
        for module in self.model.modules():
            bias, recorded = effective_bias(module), biased_output_module(module)
            if bias is not None and recorded is not None:
                layers.append((recorded, bias, not isinstance(module, nn.Linear)))
        return layers

    def recorded_outputs(self, layers: list[tuple[nn.Module, Tensor, bool]], captured: Mapping[str, LayerRecord]
                         ) -> list[tuple[Tensor, Tensor, bool]]:
        """(output z, bias b, whether b is per channel of a (N, C, h, w) map) for each call of each layer."""
        name_of = {id(module): name for name, module in self.model.named_modules()}
        recorded: list[tuple[Tensor, Tensor, bool]] = []
        for module, bias, spatial in layers:
            for call in captured[name_of[id(module)]].calls:  # a module that runs twice contributes twice
                if isinstance(call.output, Tensor) and call.output.requires_grad:
                    recorded.append((call.output, bias, spatial))
        return recorded

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        if isinstance(target, UnitTarget):
            with target.bind(self.model) as bound:
                return self.attribute(batch, bound, topk)
        if self.smooth == "augment":
            return augmented_attribution(self._attribute_once, batch, target, topk, self.normalize)
        return self._attribute_once(batch, target, topk)

    def _attribute_once(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        layers = self.bias_layers()
        recording: AbstractContextManager[Mapping[str, LayerRecord]] = (
            capture(self.model, [module for module, _, _ in layers], detach=False) if layers else nullcontext({}))
        with torch.enable_grad(), recording as captured:
            inputs = batch.detach().requires_grad_(True)
            selected = select_targets(self.call_model(inputs), target, topk, batch_size=batch.shape[0])
            recorded = self.recorded_outputs(layers, captured)
            outputs = [output for output, _, _ in recorded]
            maps: list[Tensor] = []
            completeness: list[Tensor] = []
            zero: list[Tensor] = []
            disconnected: list[Tensor] = []
            targets_per_image = selected.scores.shape[1]
            for index in range(targets_per_image):
                score = selected.scores[:, index]
                gradients: Sequence[Optional[Tensor]] = (None,) * (1 + len(outputs))
                if score.requires_grad:
                    gradients = torch.autograd.grad(score.sum(), [inputs, *outputs], allow_unused=True,
                                                    retain_graph=index < targets_per_image - 1)
                disconnected.append(torch.full_like(score, all(g is None for g in gradients), dtype=torch.bool))
                input_gradient = torch.zeros_like(inputs) if gradients[0] is None else gradients[0]
                saliency, total = bias_saliency(recorded, gradients[1:], batch.shape[-2:], batch.shape[0])
                input_terms = (inputs * input_gradient).detach().float()
                maps.append(saliency + rescaled(input_terms.abs(), (1, 2, 3)).sum(1))
                completeness.append(score.detach().float() - input_terms.flatten(1).sum(1) - total)
                zero.append(torch.stack([g.reshape(score.shape[0], -1).eq(0).all(1) for g in gradients if g is not None]
                                        or [torch.ones_like(score, dtype=torch.bool)]).all(0))
        selected.scores = selected.scores.detach()
        return Attribution(
            maps=torch.stack(maps, dim=1),
            selected=selected,
            diagnostics={"completeness_error": torch.stack(completeness, dim=1),
                         "bias_layers": torch.tensor(len(outputs))},
            zero_gradient=torch.stack(zero, dim=1),
            disconnected=torch.stack(disconnected, dim=1),
        )


def per_image_sums(terms: Tensor, count: int) -> Tensor:
    """(count,) sums of a layer output's terms per image. The output has one row per image, or, for a layer run on
    windows (Swin) or folded patches (MobileViT), count · k rows with each image's rows together (its batch is the
    outer dimension, as those models lay them out)."""
    if terms.shape[0] % count != 0:
        raise ValueError(f"FullGrad: a layer with a bias returned {terms.shape[0]} rows for {count} image(s), with no "
                         f"image-by-image layout (shape {tuple(terms.shape)}); its terms cannot be given to the "
                         "images. Use GradCAM(model) for this model.")
    return terms.reshape(count, -1).sum(1)


def bias_saliency(recorded: list[tuple[Tensor, Tensor, bool]], gradients: Sequence[Optional[Tensor]],
                  size: Sequence[int], count: int) -> tuple[Union[Tensor, int], Union[Tensor, int]]:
    """Σ over spatial layers and their channels of ψ(|b_c ∂y/∂z_c|) upsampled, (N, H, W); and Σ b · ∂y/∂z
    over every layer, (N,) (for the completeness check); 0 for no layer. recorded: (z, b, b per channel)
    per layer call; count: N."""
    saliency: Union[Tensor, int] = 0
    total: Union[Tensor, int] = 0
    for (_, bias, spatial), gradient in zip(recorded, gradients):
        if gradient is None:
            continue
        shape = [1] * gradient.dim()
        shape[1 if spatial else -1] = -1
        terms = (gradient * bias.view(shape)).detach().float()
        total = total + per_image_sums(terms, count)
        if spatial and terms.dim() == 4 and terms.shape[0] == count:  # one map per channel, rescaled on its own
            per_layer = rescaled(terms.abs(), (2, 3)).sum(1, keepdim=True)
            saliency = saliency + F.interpolate(per_layer, size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
    return saliency, total
