"""Class activation maps: each method is a weighting of a layer's feature maps A by its gradients G.

The shared ``CAM.attribute`` runs the model once with the layers before the
target layer outside autograd (the target layer's output becomes the leaf that
gradients are taken at), takes ∂score/∂A with ``torch.autograd.grad`` for each
target, and hands (A, G) to the method's ``layer_map``.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..capture import ActivationCapture, LayerSpec, find_layers
from ..targets import Target, select_targets
from .base import Attribution, Explainer, register, upsample_maps

COMBINATIONS = ("mean", "max", "sum")


def gradients_at(scores: Tensor, activations: list[Tensor], retain_graph: bool) -> list[Tensor]:
    """∂(Σ_n scores[n]) / ∂A for each captured activation A (zeros where a score does not depend on A).

    Images of a batch do not interact in eval mode, so the sum over the batch
    gives every image its own gradient in one backward pass.
    """
    if scores.requires_grad:
        gradients = torch.autograd.grad(scores.sum(), activations, retain_graph=retain_graph, allow_unused=True)
    else:
        gradients = (None,) * len(activations)
    if any(gradient is None for gradient in gradients):
        warnings.warn(
            "the explained score does not depend on the target layer's output (zero gradient); "
            "its map is all zeros. Check the layer and the target.",
            RuntimeWarning,
            stacklevel=4,
        )
    return [
        torch.zeros_like(activation) if gradient is None else gradient
        for activation, gradient in zip(activations, gradients)
    ]


class CAM(Explainer):
    """Base of the class-activation-map family.

    layer: the target layer(s): a ``named_modules()`` name ("layer4"), a module,
        or a list of them (one map per layer, resized to the input and combined).
    relu: keep only positive evidence (the papers' ReLU); False keeps signed maps.
    combine: how maps of several layers are merged: "mean", "max" or "sum".
    Other keyword arguments: see ``Explainer``.
    """

    uses_gradients = True

    def __init__(
        self,
        model: nn.Module,
        layer: LayerSpec | Sequence[LayerSpec],
        *,
        relu: bool = True,
        combine: str = "mean",
        **options,
    ):
        super().__init__(model, **options)
        if combine not in COMBINATIONS:
            raise ValueError(f"combine must be one of {COMBINATIONS}; got {combine!r}.")
        self.layers = find_layers(model, layer)
        self.relu = relu
        self.combine = combine

    @abstractmethod
    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        """The method's formula: A (N, C, h, w) and G = ∂y/∂A (N, C, h, w) → map (N, h, w), before ReLU."""

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        with torch.enable_grad():  # also inside a caller's no_grad(): gradients are needed here
            capture = ActivationCapture(self.model, self.layers, graph_from_first_layer=True)
            with capture, torch.no_grad():  # the prefix runs without a graph; the hook turns it on
                output = self.model(batch)
            activations = capture.activations()
            for name, activation in zip(self.layer_names, activations):
                check_feature_maps(name, activation)
            selected = select_targets(output, target, topk, batch_size=batch.shape[0])
            targets_per_image = selected.scores.shape[1]
            per_target: list[list[Tensor]] = []  # [target][layer] → (N, h, w)
            for target_index in range(targets_per_image):
                gradients = gradients_at(
                    selected.scores[:, target_index], activations, retain_graph=target_index < targets_per_image - 1
                )
                per_target.append(
                    [self._rectify(self.layer_map(a.detach(), g)) for a, g in zip(activations, gradients)]
                )
        selected.scores = selected.scores.detach()
        return self._combine_layers(per_target, selected, batch.shape[-2:])

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.layers]

    def _rectify(self, layer_map: Tensor) -> Tensor:
        return torch.relu(layer_map) if self.relu else layer_map

    def _combine_layers(self, per_target: list[list[Tensor]], selected, input_size) -> Attribution:
        """[target][layer] (N, h, w) maps → Attribution with (N, K, H, W) maps, layers combined."""
        low_res = [torch.stack([maps[layer] for maps in per_target], dim=1) for layer in range(len(self.layers))]
        if len(low_res) == 1:
            maps = low_res[0]
            layer: str | list[str] = self.layer_names[0]
        else:
            resized = torch.stack([upsample_maps(maps, input_size) for maps in low_res])
            maps = {"mean": resized.mean(0), "max": resized.amax(0), "sum": resized.sum(0)}[self.combine]
            layer = self.layer_names
        return Attribution(maps=maps, selected=selected, low_res_maps=low_res, layer=layer)


def check_feature_maps(name: str, activation: Tensor) -> None:
    """CAMs weight (N, C, h, w) feature maps; refuse anything else with a clear message."""
    if activation.dim() != 4:
        raise ValueError(
            f"layer {name!r} outputs a tensor of shape {tuple(activation.shape)}; CAM methods need "
            "(N, C, h, w) feature maps. Choose a convolutional layer (`explain layers MODEL` lists "
            "output shapes)."
        )


@register
class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): ReLU(Σ_k α_k A_k), α_k the spatial mean of ∂y/∂A_k."""

    name = "gradcam"
    summary = "Grad-CAM: feature maps weighted by their spatially averaged gradients"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        channel_weights = gradients.mean(dim=(2, 3), keepdim=True)  # (N, C, 1, 1)
        return (channel_weights * activations).sum(dim=1)
