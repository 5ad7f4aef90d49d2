"""Smooth Grad-CAM++ (Omeiza et al. 2019): Grad-CAM++ with the layer's derivatives averaged over noisy
copies of the input, as SmoothGrad averages input gradients."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.capture import ActivationCapture
from ..core.targets import SelectedTargets
from ..core.units import BoundUnits
from ..io.loaded_model import ModelSource
from .cam import CAM, CAMOptions, TargetLayers, gradients_at
from .options import NoiseDraws, drawn_noise, noise_options, normal_draws
from .registry import register


@register
class SmoothGradCAMPlusPlus(CAM):
    """Smooth Grad-CAM++ (Omeiza et al. 2019): Grad-CAM++ whose derivatives are means over ``samples``
    noisy copies x + ε of the input, ε ~ N(0, noise_std²):

        D_p = mean over copies of (∂y/∂A)^p, p = 1, 2, 3 (at the copy's activations),
        α_ij = D_2,ij / (2 D_2,ij + Σ_ab A_ab · D_3,ij)   (0 where the denominator is 0),
        w_k = Σ_ij α_k,ij · ReLU(D_1,k,ij),   map = ReLU(Σ_k w_k A_k),

    A the activations of the image itself. α's numerator is D_2, Grad-CAM++'s closed form that the method
    smooths (torchcam 0.5 notes that the paper prints D_1 there, and uses D_2 too).

    samples: noisy copies (torchcam's default 4); noise_std: the noise's standard deviation in model-input
        units (absolute, default 0.3 as torchcam); seed: the noise's generator seed (same seed, same map;
        None draws afresh); every image of a call gets the same draws, (1, C, H, W) per copy, so that its map
        does not depend on the rest of its batch; noise_draws: a callable ``shape → N(0, 1) tensor`` called
        once per copy with the batch's shape (N, C, H, W), one draw per image, instead of the generator, e.g. to
        replay another library's draws.
    The copies of one sample run as one pass; every target's gradient comes from the same copies.
    torchcam 0.5 differs from the paper twice: its final map uses the last copy's activations and
    gradients instead of the image's and the averages, and its α sums A · D_3 over positions (see
    tests/test_issue31_cams.py).
    """

    name = "smoothgradcam++"
    summary = "Smooth Grad-CAM++: Grad-CAM++ with derivatives averaged over noisy copies of the input"
    layer_maps_reduce_channels = True

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, samples: int = 4, noise_std: float = 0.3,
                 seed: Optional[int] = 0, noise_draws: Optional[NoiseDraws] = None,
                 **options: Unpack[CAMOptions]):
        super().__init__(model, layer, **options)
        self.samples, self.noise_std, self.seed, self.noise_draws = noise_options(samples, noise_std, seed, noise_draws)

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        means = self.mean_derivatives(batch, selected)
        maps = []
        for index, activation in enumerate(activations):
            feature_maps = self.feature_maps(index, activation.detach()).float()  # (N, C, h, w)
            first, second, third = means[index]  # (N, K, C, h, w) each
            mass = feature_maps.sum(dim=(2, 3))[:, None, :, None, None]
            denominator = 2 * second + mass * third
            safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
            alpha = torch.where(denominator != 0, second / safe, torch.zeros_like(denominator))
            weights = (alpha * torch.relu(first)).sum(dim=(3, 4))  # (N, K, C)
            maps.append(self.weighted_maps(weights, feature_maps))
        return maps

    def mean_derivatives(self, batch: Tensor, selected: SelectedTargets) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per layer, the means over the noisy copies of (∂y/∂A)^1, ^2 and ^3, each (N, K, C, h, w) float32."""
        assert self.layers is not None, "during a call, the layers are known"
        count, targets = batch.shape[0], selected.scores.shape[1]
        draws = self.noise_draws or normal_draws(self.seed, batch.device)
        # a hidden unit may lie before the target layer: then the graph starts at the input
        from_input = isinstance(selected.target_function, BoundUnits)
        images = torch.arange(count, device=batch.device)
        # the generator's draws are one image's, shared by the batch's images (an image's map does not depend on the
        # rest of its batch); draws given as noise_draws are the whole batch's, as torchcam draws them
        drawn = count if self.noise_draws is not None else 1
        sums: list[list[Tensor]] = []
        for _ in range(self.samples):
            noise = drawn_noise(draws, (drawn, *batch.shape[1:]), batch.device, batch.dtype)
            capture = ActivationCapture(self.model, self.layers, graph_from_first_layer=True)
            with torch.enable_grad(), capture, contextlib.nullcontext() if from_input else torch.no_grad():
                output = self.call_model(batch + self.noise_std * noise)
            noisy_activations = capture.activations()
            with torch.enable_grad():
                scores = selected.scores_for(output, images)
            for target in range(targets):
                gradients, _ = gradients_at(scores[:, target], noisy_activations, retain_graph=target < targets - 1)
                for index, gradient in enumerate(gradients):
                    derivative = self.feature_maps(index, gradient).float()
                    if len(sums) <= index:
                        sums.append([torch.zeros(count, targets, *derivative.shape[1:], device=derivative.device)
                                     for _ in range(3)])
                    for power in range(3):
                        sums[index][power][:, target] += derivative.pow(power + 1)
        return [(first / self.samples, second / self.samples, third / self.samples)
                for first, second, third in sums]

