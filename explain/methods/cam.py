"""Class activation maps: each method is a weighting of a layer's feature maps A by its gradients G.

The shared ``CAM.attribute`` runs the model once with the layers before the
target layer outside autograd (the target layer's output becomes the leaf that
gradients are taken at), takes ∂score/∂A with ``torch.autograd.grad`` for each
target, and hands (A, G) to the method's ``layer_map``.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import torch
from torch import Tensor, nn

from ..capture import ActivationCapture, LayerNotRunError, LayerSpec, find_layers
from ..layers import default_layer
from ..layouts import Layout, Reshape, infer_layout
from ..targets import SelectedTargets, Target, select_targets
from .base import Attribution, Explainer, PerThread, register, upsample_maps

COMBINATIONS = ("mean", "max", "sum")


def gradients_at(scores: Tensor, activations: list[Tensor], retain_graph: bool) -> tuple[list[Tensor], Tensor]:
    """∂(Σ_n scores[n]) / ∂A for each captured activation A, and (N,) bool: whether image n's score
    does not depend on any A (autograd finds no path; its gradients are zeros).

    Images of a batch do not interact in eval mode, so the sum over the batch
    gives every image its own gradient in one backward pass.
    """
    if scores.requires_grad:
        gradients = torch.autograd.grad(scores.sum(), activations, retain_graph=retain_graph, allow_unused=True)
    else:
        gradients = (None,) * len(activations)
    disconnected = torch.full(scores.shape[:1], all(gradient is None for gradient in gradients), dtype=torch.bool)
    filled = [torch.zeros_like(activation) if gradient is None else gradient
              for activation, gradient in zip(activations, gradients)]
    return filled, disconnected


class CAM(Explainer):
    """Base of the class-activation-map family.

    layer: the target layer(s): a ``named_modules()`` name ("layer4"), a module,
        or a list of them (one map per layer, resized to the input and combined);
        None picks one on the first call (see ``explain.layers.default_layer``) and the
        Explanation records it.
    relu: keep only positive evidence (the papers' ReLU); False keeps signed maps.
    combine: how maps of several layers are merged: "mean", "max" or "sum".
    reshape: how the layer's output becomes (N, C, h, w) maps; None guesses channels-first,
        channels-last or tokens on a patch grid (see ``explain.layouts``).
    Other keyword arguments: see ``Explainer``.

    A subclass gives its formula as ``layer_map(A, G)``; methods that weight the
    feature maps by other means (perturbations) override ``layer_maps``.
    """

    needs_layer = True
    uses_gradients: ClassVar[bool] = True
    """Whether ``layer_map`` needs G = ∂score/∂A (else the whole forward runs without a graph)."""
    layouts: PerThread[list[Layout]] = PerThread()
    """During a call: how each layer's output maps to (N, C, h, w)."""
    zero_gradient: PerThread[tuple[Tensor, Tensor]] = PerThread()
    """During a call: (N, K) bool where the gradient at every layer was zero everywhere, and (N, K)
    bool where the score does not depend on the layers at all."""

    def __init__(
        self,
        model: nn.Module,
        layer: Optional[LayerSpec | Sequence[LayerSpec]] = None,
        *,
        relu: bool = True,
        combine: str = "mean",
        reshape: Reshape = None,
        **options,
    ):
        super().__init__(model, **options)
        if combine not in COMBINATIONS:
            raise ValueError(f"combine must be one of {COMBINATIONS}; got {combine!r}.")
        self.layers = None if layer is None else find_layers(model, layer)
        self.relu = relu
        self.combine = combine
        self.reshape = reshape

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.layers or []]

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        """The method's formula: A (N, C, h, w) and G = ∂y/∂A (N, C, h, w) → map (N, h, w), before ReLU."""
        raise TypeError(f"{type(self).__name__} defines neither layer_map nor layer_maps.")

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        if self.layers is None:
            self.layers = find_layers(self.model, default_layer(self.model, batch, run=self.call_model))
        # also inside a caller's no_grad(): gradient methods need a graph here
        with torch.enable_grad() if self.uses_gradients else torch.no_grad():
            capture = ActivationCapture(self.model, self.layers, graph_from_first_layer=self.uses_gradients)
            with capture, torch.no_grad():  # the prefix runs without a graph; the hook turns it on
                output = self.call_model(batch)
            activations = capture.activations()
            check_batch_dimension(self.layer_names, activations, batch.shape[0])
            self.layouts = [infer_layout(activation, batch.shape[-2:], self.reshape, name, module)
                            for (name, module), activation in zip(self.layers, activations)]
            selected = select_targets(output, target, topk, batch_size=batch.shape[0])
            self.zero_gradient = None
            maps = self.layer_maps(batch, activations, selected)
        selected.scores = selected.scores.detach()
        negative = None
        if self.relu:
            negative = torch.stack([(m <= 0).flatten(2).all(2) & (m != 0).flatten(2).any(2) for m in maps]).all(0)
            maps = [torch.relu(layer_maps) for layer_maps in maps]
        attribution = self._combine_layers(maps, selected, batch.shape[-2:])
        attribution.negative_everywhere = negative
        if self.zero_gradient is not None:
            attribution.zero_gradient, attribution.disconnected = self.zero_gradient
        self.layouts = self.zero_gradient = None
        return attribution

    def feature_maps(self, layer_index: int, tensor: Tensor) -> Tensor:
        """A layer's output (or its gradient), in the layer's own layout, as (N, C, h, w)."""
        return self.layouts[layer_index].apply(tensor)

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        """Per layer, (N, K, h, w) maps before ReLU, from ``layer_map`` of each target's gradients.
        ``activations`` are the layers' outputs as captured (any layout)."""
        targets_per_image = selected.scores.shape[1]
        if not self.uses_gradients:  # the same map for every target
            maps = [self.layer_map(self.feature_maps(i, activation).float(), None)
                    for i, activation in enumerate(activations)]
            return [layer_map.unsqueeze(1).expand(-1, targets_per_image, -1, -1) for layer_map in maps]
        per_layer: list[list[Tensor]] = [[] for _ in activations]
        zero_gradient, disconnected = [], []
        for target_index in range(targets_per_image):
            gradients, unreachable = gradients_at(
                selected.scores[:, target_index], activations, retain_graph=target_index < targets_per_image - 1
            )
            zero_at_every_layer = torch.ones(len(selected.scores), dtype=torch.bool, device=selected.scores.device)
            for i, (maps, activation, gradient) in enumerate(zip(per_layer, activations, gradients)):
                feature_gradients = self.feature_maps(i, gradient).float()
                zero_at_every_layer &= feature_gradients.flatten(1).eq(0).all(1).to(zero_at_every_layer.device)
                maps.append(self.layer_map(self.feature_maps(i, activation.detach()).float(), feature_gradients))
            zero_gradient.append(zero_at_every_layer)
            disconnected.append(unreachable.to(zero_at_every_layer.device))
        self.zero_gradient = torch.stack(zero_gradient, dim=1), torch.stack(disconnected, dim=1)
        return [torch.stack(maps, dim=1) for maps in per_layer]

    def _combine_layers(self, low_res: list[Tensor], selected: SelectedTargets, input_size) -> Attribution:
        """Per layer (N, K, h, w) maps → Attribution with (N, K, H, W) maps, layers combined."""
        if len(low_res) == 1:
            return Attribution(maps=low_res[0], selected=selected, low_res_maps=low_res, layer=self.layer_names[0])
        resized = torch.stack([upsample_maps(maps, input_size) for maps in low_res])
        maps = {"mean": resized.mean(0), "max": resized.amax(0), "sum": resized.sum(0)}[self.combine]
        return Attribution(maps=maps, selected=selected, low_res_maps=low_res, layer=self.layer_names)


def check_batch_dimension(names: Sequence[str], activations: Sequence[Tensor], batch_size: int) -> None:
    """Raise when a layer's output does not have one row per image (a model that folds patches or
    windows into the batch dimension inside, as MobileViT does): its maps cannot be told apart."""
    for name, activation in zip(names, activations):
        if activation.dim() == 0 or activation.shape[0] != batch_size:
            raise LayerNotRunError(
                f"layer {name!r} outputs a tensor of shape {tuple(activation.shape)}, whose first dimension is not "
                f"the batch size {batch_size}: the model reshapes the batch inside (e.g. folds patches into it), "
                "so its rows are not images. Choose a layer outside that part (`explain layers MODEL` lists "
                "output shapes), e.g. the block or stage that contains it."
            )


def weighted_sum(channel_weights: Tensor, activations: Tensor) -> Tensor:
    """Σ_k w_k A_k: weights (N, C) or (N, K, C) and A (N, C, h, w) → (N, h, w) or (N, K, h, w)."""
    if channel_weights.dim() == 2:
        return torch.einsum("nc,nchw->nhw", channel_weights, activations)
    return torch.einsum("nkc,nchw->nkhw", channel_weights, activations)


@register
class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): ReLU(Σ_k α_k A_k), α_k the spatial mean of ∂y/∂A_k."""

    name = "gradcam"
    summary = "Grad-CAM: feature maps weighted by their spatially averaged gradients"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        return weighted_sum(gradients.mean(dim=(2, 3)), activations)


@register
class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhyay et al. 2018): w_k = Σ_ij α_ij ReLU(G_ij), with the closed form
    α = G² / (2 G² + Σ_ab A_ab · G³) of the paper for an exponential score (α = 0 where that is 0/0)."""

    name = "gradcam++"
    summary = "Grad-CAM++: pixel-wise weighted positive gradients (better for several instances)"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        squared, cubed = gradients.pow(2), gradients.pow(3)
        denominator = 2 * squared + activations.sum(dim=(2, 3), keepdim=True) * cubed
        safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
        alpha = torch.where(denominator != 0, squared / safe, torch.zeros_like(denominator))
        return weighted_sum((alpha * torch.relu(gradients)).sum(dim=(2, 3)), activations)


@register
class XGradCAM(CAM):
    """XGrad-CAM (Fu et al. 2020): w_k = Σ_ij (A_k,ij / Σ_ab A_k,ab) G_k,ij (0 for a channel summing to 0)."""

    name = "xgradcam"
    summary = "XGrad-CAM: gradients weighted by normalised activations (axiom-based)"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        channel_sums = activations.sum(dim=(2, 3))
        safe = torch.where(channel_sums != 0, channel_sums, torch.ones_like(channel_sums))
        weights = torch.where(channel_sums != 0, (activations * gradients).sum(dim=(2, 3)) / safe, 0.0)
        return weighted_sum(weights, activations)


@register
class HiResCAM(CAM):
    """HiResCAM (Draelos & Carin 2020): Σ_k G_k ⊙ A_k, element-wise (no pooling of the gradient)."""

    name = "hirescam"
    summary = "HiResCAM: element-wise gradient × activation, faithful to the score for CNNs"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        return (gradients * activations).sum(dim=1)


@register
class LayerCAM(CAM):
    """Layer-CAM (Jiang et al. 2021): Σ_k ReLU(G_k) ⊙ A_k, element-wise."""

    name = "layercam"
    summary = "Layer-CAM: element-wise positive gradient × activation (good at shallow layers)"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        return (torch.relu(gradients) * activations).sum(dim=1)


@register
class EigenCAM(CAM):
    """Eigen-CAM (Muhammad & Yeasin 2020): the feature maps projected on their first principal
    component (channels as variables, positions as samples); gradient-free and class-agnostic.

    The SVD's sign is arbitrary; it is fixed so that the map correlates positively with the
    activation mass Σ_k A_k (other libraries return inverted maps for about half the images).
    """

    name = "eigencam"
    summary = "Eigen-CAM: first principal component of the feature maps (class-agnostic, no gradient)"
    uses_gradients = False

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        count, channels, height, width = activations.shape
        samples = activations.float().reshape(count, channels, -1).transpose(1, 2)  # (N, hw, C)
        centered = samples - samples.mean(dim=1, keepdim=True)
        _, _, right_vectors = torch.linalg.svd(centered, full_matrices=False)
        projection = torch.einsum("npc,nc->np", centered, right_vectors[:, 0])  # (N, hw)
        mass = samples.sum(dim=2)
        correlation = ((projection - projection.mean(1, keepdim=True)) * (mass - mass.mean(1, keepdim=True))).sum(1)
        sign = torch.where(correlation < 0, -1.0, 1.0).to(projection.dtype)
        return (projection * sign[:, None]).reshape(count, height, width).to(activations.dtype)
