"""Class activation maps: each method is a weighting of a layer's feature maps A by its gradients G.

The shared ``CAM.attribute`` runs the model once with the layers before the
target layer outside autograd (the target layer's output becomes the leaf that
gradients are taken at), takes ∂score/∂A with ``torch.autograd.grad`` for each
target, and hands (A, G) to the method's ``layer_map``. Most methods give their
per-channel terms (``channel_terms``, e.g. w_k A_k), which are summed over channels, or
with ``smooth="eigen"`` projected on their first principal component.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..core.attention import StepwiseAttention
from ..core.caller import warn_at_callers_line
from ..core.capture import ActivationCapture, LayerNotRunError, LayerSpec, find_layers
from ..core.layers import default_layer
from ..core.layouts import Layout, Reshape, infer_layout, model_tokens
from ..core.rules import call_rules
from ..core.scope import CallScope
from ..core.targets import RegionTarget, SegmentationTarget, SelectedTargets, Target, select_targets
from ..core.units import BoundUnits, UnitTarget
from ..io.loaded_model import LoadedModel, ModelSource
from ._eval_batch_norm import contiguous_batch_norm_gradients
from .base import Explainer, PerThread
from .maps import Attribution, Flags, flags_of, normalize_maps, upsample_maps
from .options import SEED_RANGE, is_whole_number, number_option
from .passes import autocast_dtype
from .registry import register
from .signatures import ExplainerOptions

COMBINATIONS = ("mean", "max", "sum", "product")
SMOOTHINGS = (None, "augment", "eigen")
AUGMENTATIONS: tuple[tuple[bool, float], ...] = tuple(
    (flip, factor) for flip in (False, True) for factor in (1.0, 0.9, 1.1)
)
"""smooth="augment": (horizontal flip, intensity factor) of each copy, the unchanged image first
(pytorch-grad-cam's aug_smooth: flips × intensities 0.9, 1, 1.1 of the model input)."""

TargetLayers = Optional[Union[LayerSpec, Sequence[LayerSpec]]]
"""A CAM's layer(s): a name, glob, module or module type, a list of them, or None (chosen on the first call)."""


class CAMOptions(ExplainerOptions, total=False):
    """The keyword options every CAM method takes (see ``CAM``), for ``**options: Unpack[CAMOptions]``."""

    relu: bool
    combine: str
    normalize_layers: bool
    smooth: Optional[str]
    reshape: Reshape


def gradients_at(scores: Tensor, activations: list[Tensor], retain_graph: bool) -> tuple[list[Tensor], Tensor]:
    """∂(Σ_n scores[n]) / ∂A for each captured activation A, and (N,) bool: whether image n's score
    does not depend on any A (autograd finds no path; its gradients are zeros).

    Images of a batch do not interact in eval mode, so the sum over the batch
    gives every image its own gradient in one backward pass.
    """
    gradients: Sequence[Optional[Tensor]]
    if scores.requires_grad:
        gradients = torch.autograd.grad(scores.sum(), activations, retain_graph=retain_graph, allow_unused=True)
    else:
        gradients = (None,) * len(activations)
    disconnected = torch.full(scores.shape[:1], all(gradient is None for gradient in gradients), dtype=torch.bool)
    filled = [torch.zeros_like(activation) if gradient is None else gradient
              for activation, gradient in zip(activations, gradients)]
    return filled, disconnected


def principal_component(terms: Tensor) -> Tensor:
    """(..., C, h, w) → (..., h, w): the terms projected on their first principal component.

    Channels are the variables and positions the samples (centred over positions), as in
    Eigen-CAM. The SVD's sign is arbitrary; it is fixed by ``oriented_like``: the projection
    correlates positively with Σ_k terms_k (the map without smoothing: evidence stays positive),
    or, where Σ_k terms_k is constant over positions up to rounding, its larger extreme is positive.
    """
    *leading, channels, height, width = terms.shape
    projection, samples = first_component_scores(terms)
    return oriented_like(projection, samples).reshape(*leading, height, width)


def first_component_scores(terms: Tensor) -> tuple[Tensor, Tensor]:
    """(..., C, h, w) terms → (B, h·w) scores of the positions on the first principal component of the
    channels (centred over positions; sign as the SVD returns it) and the (B, h·w, C) samples, float32."""
    channels, height, width = terms.shape[-3:]
    samples = terms.float().reshape(-1, channels, height * width).transpose(1, 2)  # (B, hw, C)
    centred = samples - samples.mean(dim=1, keepdim=True)
    _, _, right_vectors = torch.linalg.svd(centred, full_matrices=False)
    return torch.einsum("bpc,bc->bp", centred, right_vectors[:, 0]), samples


UNINFORMATIVE_SPREAD = 2.0 ** -6
"""``oriented_like``: Σ_k A_k decides the sign only where its spread over positions exceeds this fraction of ‖A‖
(4 × bfloat16's unit roundoff; rounding A to bfloat16 moves Σ_k A_k by about 2^-10 ‖A‖, to float16 by 2^-13 ‖A‖)."""


def oriented_like(projection: Tensor, samples: Tensor) -> Tensor:
    """(B, P) projections of (B, P, C) samples, each signed to correlate positively with its reference Σ_c samples.

    Where the reference is constant over positions up to rounding (its centred norm at most
    ``UNINFORMATIVE_SPREAD`` ‖samples‖: after a LayerNorm without affine weights Σ_c A_c ≡ 0; before a LayerNorm
    Σ_c G_c A_c ≡ 0), its correlation is rounding noise that flips between float32 and autocast or between a batch
    and an image alone; the projection is then signed by its larger extreme, as Seg-Eigen-CAM's Eq. 13
    (``peak_is_negative``).
    The threshold does not depend on the dtype, so the same convention holds in float32 and under autocast.
    """
    reference = samples.sum(dim=2)
    centred_reference = reference - reference.mean(1, keepdim=True)
    correlation = ((projection - projection.mean(1, keepdim=True)) * centred_reference).sum(1)
    informative = centred_reference.norm(dim=1) > UNINFORMATIVE_SPREAD * samples.flatten(1).norm(dim=1)
    flip = torch.where(informative, correlation < 0, peak_is_negative(projection))
    return torch.where(flip[:, None], -projection, projection)


def peak_is_negative(projection: Tensor) -> Tensor:
    """(B, P) → (B,) bool: whether the minimum is larger in magnitude than the maximum (Seg-Eigen-CAM's Eq. 13)."""
    return projection.amin(dim=1).abs() > projection.amax(dim=1).abs()


def augmented_attribution(attribute: Callable[[Tensor, Target, Optional[int]], Attribution], batch: Tensor,
                          target: Target, topk: Optional[int], normalize: Optional[str]) -> Attribution:
    """smooth="augment": the mean of the maps of flipped and intensity-scaled copies of the batch.

    Each copy's maps (normalised as the explainer normalises, then flipped back to the original
    frame) are averaged; the targets are chosen on the unchanged images and kept for every copy: a
    ``SegmentationTarget``'s region (its mask, or the pixels predicted on the unchanged images) is mirrored
    with the flipped copies. A target of boxes (a ``DetectionTarget``, detected instances) is refused: its boxes
    are in the unchanged images' pixels. Another callable target scores each copy's output as it is.
    The per-layer ``low_res_maps`` are the mean of the copies' raw low-resolution maps.
    """
    if isinstance(target, RegionTarget) and not isinstance(target, SegmentationTarget):
        raise ValueError(
            f"smooth='augment' explains horizontally flipped copies of the images too, but the target "
            f"{type(target).__name__} reads a region (a box) in the unchanged images' pixels, which would "
            "select another region of a flipped copy. Use smooth=None (or 'eigen' for a CAM) to explain boxes "
            "or detected instances.")
    total: Optional[Tensor] = None
    first: Optional[Attribution] = None
    low_res: Optional[list[Tensor]] = None
    flags: dict[str, Tensor] = {}
    kept: Target = target
    for flip, factor in AUGMENTATIONS:
        copy = batch * factor
        copy_target = kept.for_copies(flip) if first is not None and isinstance(kept, SegmentationTarget) else kept
        attribution = attribute(copy.flip(-1) if flip else copy, copy_target, topk)
        if first is None:  # the unchanged images come first: their targets are kept for every copy
            first = attribution
            kept, topk = attribution.selected.target_function or attribution.selected.class_indices, None

        def back(maps: Tensor, flip: bool = flip) -> Tensor:
            return maps.flip(-1) if flip else maps

        maps = back(normalize_maps(attribution.maps.float(), normalize))
        total = maps if total is None else total + maps
        if attribution.low_res_maps is not None:
            layers = [back(maps.float()) for maps in attribution.low_res_maps]
            low_res = layers if low_res is None else [a + b for a, b in zip(low_res, layers)]
        for key in ("zero_gradient", "disconnected", "negative_everywhere"):
            value = flags_of(getattr(attribution, key))
            if value is not None:
                flags[key] = value & flags[key] if key in flags else value
    assert first is not None and total is not None, "AUGMENTATIONS holds at least the unchanged image"
    count = len(AUGMENTATIONS)
    first.maps = total / count
    first.low_res_maps = None if low_res is None else [maps / count for maps in low_res]
    for key in ("zero_gradient", "disconnected", "negative_everywhere"):
        setattr(first, key, flags.get(key))
    first.diagnostics["augmentations"] = torch.tensor(count)
    return first


class CAM(Explainer):
    """Base of the class-activation-map family.

    layer: the target layer(s): a ``named_modules()`` name ("layer4"), a module,
        or a list of them (one map per layer, resized to the input and combined);
        None picks one on the first call (see ``explain.core.layers.default_layer``) and the
        Explanation records it.
    relu: keep only positive evidence (the papers' ReLU); False keeps signed maps.
    combine: how maps of several layers are merged, after each is resized to the input:
        "mean" (default), "max", "sum" or "product" (RefineCAM).
    normalize_layers: divide each layer's maps by their maximum |value| before combining
        (default), so that no layer dominates by its scale (on resnet18, layer4's raw maps are
        several times layer3's); False combines the raw maps.
    smooth: None; "augment" (the mean map over flipped and intensity-scaled copies of the
        input, each mapped back: pytorch-grad-cam's aug_smooth; 6 passes; a ``SegmentationTarget``'s region
        is mirrored with the flipped copies, box targets are refused; see ``augmented_attribution``); "eigen" (the first
        principal component of the per-channel terms instead of their sum: eigen_smooth).
    reshape: how the layer's output becomes (N, C, h, w) maps; None guesses channels-first,
        channels-last or tokens on a patch grid (see ``explain.core.layouts``).
    Other keyword arguments: see ``Explainer``.

    Targets may be hidden units (``explain.Channel``, ``explain.Neuron``): the graph then starts
    at the input, since the unit may lie before the target layer.

    A subclass gives its formula as ``channel_terms(A, G)`` (the per-channel terms whose sum
    is the map) or ``layer_map(A, G)`` (the map itself); methods that weight the feature maps
    by other means (perturbations) override ``layer_maps``.
    """

    setting_attributes = {"layer": "requested_layers"}

    needs_layer = True
    uses_gradients: ClassVar[bool] = True
    """Whether ``layer_map`` needs G = ∂score/∂A (else the whole forward runs without a graph)."""
    _layouts: PerThread[list[Layout]] = PerThread()
    """During a call: how each layer's output maps to (N, C, h, w)."""
    _zero_gradient: PerThread[tuple[Flags, Flags]] = PerThread()
    """During a call: (N, K) bool where the gradient at every layer was zero everywhere, and (N, K)
    bool where the score does not depend on the layers at all."""

    _batch_norm_guard: PerThread[tuple[CallScope, list[nn.Module]]] = PerThread()
    """During a call, until a target layer has run: the call's scope and the model's modules, whose BatchNorm
    modules get their gradient guard then (``guard_batch_norm_gradients``)."""

    layer_maps_reduce_channels: ClassVar[bool] = False
    """For a subclass that overrides ``layer_maps``: whether it sums channels with
    ``reduce_channels`` (so smooth="eigen" applies to it)."""

    def __init__(
        self,
        model: ModelSource,
        layer: TargetLayers = None,
        *,
        relu: bool = True,
        combine: str = "mean",
        normalize_layers: bool = True,
        smooth: Optional[str] = None,
        reshape: Reshape = None,
        **options: Unpack[ExplainerOptions],
    ):
        if type(self) is CAM:  # before super(): nothing of the model is touched
            raise TypeError("explain.CAM is the base class of the class-activation-map family, not a method: for "
                            "Zhou et al.'s CAM (the classifier's weights on the feature maps) use "
                            "explain.ClassActivationMapping (method name 'cam'); for Grad-CAM, explain.GradCAM.")
        if layer is None and isinstance(model, LoadedModel):
            layer = model.default_layer  # the loaded model's own (the demos'), else chosen on the first call
        super().__init__(model, **options)
        if combine not in COMBINATIONS:
            raise ValueError(f"combine must be one of {COMBINATIONS}; got {combine!r}.")
        if smooth not in SMOOTHINGS:
            raise ValueError(f"smooth must be one of {SMOOTHINGS}; got {smooth!r}.")
        if smooth == "eigen" and type(self).layer_maps is not CAM.layer_maps and not self.layer_maps_reduce_channels:
            raise ValueError(f"{type(self).__name__} sums its channels itself, so smooth='eigen' does not apply to it "
                             "yet; use smooth='augment' or None.")
        self.layers = None if layer is None else find_layers(self.model, layer)
        self.requested_layers = None if self.layers is None else [name for name, _ in self.layers]
        """The layers given (None: chosen on the first call), as ``settings`` reports them."""
        self.relu = relu
        self.combine = combine
        self.normalize_layers = normalize_layers
        self.smooth = smooth
        self.reshape = reshape

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.layers or []]

    def default_layer_name(self, batch: Tensor) -> str:
        """The layer explained when none was given, chosen on the first call (``explain.core.layers.default_layer``)."""
        return default_layer(self.model, batch, run=self.call_model)

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        """The method's formula: A (N, C, h, w) and G = ∂y/∂A (N, C, h, w) → map (N, h, w), before ReLU.
        Default: ``reduce_channels(channel_terms(A, G))``."""
        return self.reduce_channels(self.channel_terms(activations, gradients))

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        """The per-channel terms whose sum over channels is the map: (N, C, h, w)."""
        raise TypeError(f"{type(self).__name__} defines neither channel_terms, layer_map nor layer_maps.")

    def reduce_channels(self, terms: Tensor) -> Tensor:
        """(..., C, h, w) per-channel terms → (..., h, w): Σ_k terms_k, or with smooth="eigen" their first
        principal component (sign following Σ_k terms_k; see ``oriented_like``)."""
        return principal_component(terms).to(terms.dtype) if self.smooth == "eigen" else terms.sum(dim=-3)

    def weighted_maps(self, channel_weights: Tensor, activations: Tensor) -> Tensor:
        """Σ_k w_k A_k (or its smooth="eigen" form): weights (N, C) or (N, K, C), A (N, C, h, w) →
        (N, h, w) or (N, K, h, w)."""
        if channel_weights.dim() == 2:
            return self.reduce_channels(channel_weights[:, :, None, None] * activations)
        return self.reduce_channels(channel_weights[..., None, None] * activations[:, None])

    def layer_gradients(self, scores: Tensor, activations: list[Tensor],
                        retain_graph: bool) -> tuple[list[Tensor], Tensor]:
        """The gradients that ``layer_map`` receives: ∂(Σ_n scores[n])/∂A per layer (see ``gradients_at``)."""
        return gradients_at(scores, activations, retain_graph)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        if isinstance(target, UnitTarget):  # a hidden unit: its layer is recorded for the whole call
            with target.bind(self.model) as bound:
                return self.attribute(batch, bound, topk)
        if self.smooth == "augment":
            return augmented_attribution(self._attribute_once, batch, target, topk, self.normalize)
        return self._attribute_once(batch, target, topk)

    def guard_batch_norm_gradients(self, scope: CallScope, modules: list[nn.Module]) -> None:
        """The part of the model before the target layers runs without a graph (``_attribute_once``), so no backward
        reaches a BatchNorm module that runs there: the guard is given to the BatchNorm modules when a target layer
        has run (none run before then get it, and no hook of ours runs in that part), or at once where the graph
        starts at the input (a hidden unit as the target). A CAM that takes no gradient needs none; a subclass that
        runs the model otherwise guards every BatchNorm module, as other methods do."""
        if type(self).attribute is not CAM.attribute or type(self)._attribute_once is not CAM._attribute_once:
            super().guard_batch_norm_gradients(scope, modules)
        elif self.uses_gradients:
            outer = self._batch_norm_guard  # this explainer's call in progress, when it is called inside it
            scope.add_undo(lambda: setattr(self, "_batch_norm_guard", outer))
            self._batch_norm_guard = scope, modules

    def _guard_batch_norm_from_layers(self, target: Target) -> None:
        """Give the BatchNorm modules their gradient guard when the first target layer has run (see
        ``guard_batch_norm_gradients``), or now for a hidden unit, whose graph starts at the input."""
        guard = self._batch_norm_guard
        if guard is None:
            return
        scope, modules = guard
        if isinstance(target, BoundUnits):
            self._batch_norm_guard = None
            contiguous_batch_norm_gradients(scope, modules)
            return

        def guard_the_rest(module: nn.Module, args: Any, output: Any) -> None:
            if self._batch_norm_guard is guard:  # at the first target layer to run
                self._batch_norm_guard = None
                contiguous_batch_norm_gradients(scope, modules)

        for _, layer in self.layers or ():
            scope.forward_hook(layer, guard_the_rest)

    def _attribute_once(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        if self.layers is None:
            self.layers = find_layers(self.model, self.default_layer_name(batch))
        self._guard_batch_norm_from_layers(target)
        # a hidden unit may lie before the target layer: then the graph must start at the input
        prefix = contextlib.nullcontext() if isinstance(target, BoundUnits) else torch.no_grad()
        # also inside a caller's no_grad(): gradient methods need a graph here
        with torch.enable_grad() if self.uses_gradients else torch.no_grad():
            capture = ActivationCapture(self.model, self.layers, graph_from_first_layer=self.uses_gradients)
            with capture, prefix:  # the prefix runs without a graph; the hook turns it on
                output = self.call_model(batch)
            activations = capture.activations()
            check_batch_dimension(self.layer_names, activations, batch.shape[0])
            # what the model states of its tokens, read once for every token layer (feature maps need none)
            tokens = model_tokens(self.model) if any(activation.dim() == 3 for activation in activations) else None
            self._layouts = [infer_layout(activation, batch.shape[-2:], self.reshape, name, module, model=tokens)
                             for (name, module), activation in zip(self.layers, activations)]
            selected = select_targets(output, target, topk, batch_size=batch.shape[0])
            self._zero_gradient = None
            maps = self.layer_maps(batch, activations, selected)
        selected.scores = selected.scores.detach()
        negative = None
        if self.relu:
            before_relu = maps

            def negative() -> Tensor:  # computed when a map is empty, to say why
                return torch.stack([(m <= 0).flatten(2).all(2) & (m != 0).flatten(2).any(2)
                                    for m in before_relu]).all(0)

            maps = [torch.relu(layer_maps) for layer_maps in maps]
        attribution = self._combine_layers(maps, selected, batch.shape[-2:])
        attribution.negative_everywhere = negative
        if self._zero_gradient is not None:
            attribution.zero_gradient, attribution.disconnected = self._zero_gradient
        self._layouts = self._zero_gradient = None
        return attribution

    def feature_maps(self, layer_index: int, tensor: Tensor) -> Tensor:
        """A layer's output (or its gradient), in the layer's own layout, as (N, C, h, w)."""
        layouts = self._layouts
        assert layouts is not None, "feature_maps is called during a call, once the layers' layouts are known"
        return layouts[layer_index].apply(tensor)

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        """Per layer, (N, K, h, w) maps before ReLU, from ``layer_map`` of each target's gradients.
        ``activations`` are the layers' outputs as captured (any layout)."""
        targets_per_image = selected.scores.shape[1]
        if not self.uses_gradients:  # the same map for every target
            maps = [self.layer_map(self.feature_maps(i, activation).float(), None)
                    for i, activation in enumerate(activations)]
            return [layer_map.unsqueeze(1).expand(-1, targets_per_image, -1, -1) for layer_map in maps]
        per_layer: list[list[Tensor]] = [[] for _ in activations]
        nonzero: list[list[Tensor]] = []  # per target, per layer: (N,) counts of non-zero gradient values
        disconnected: list[Tensor] = []
        for target_index in range(targets_per_image):
            gradients, unreachable = self.layer_gradients(
                selected.scores[:, target_index], activations, retain_graph=target_index < targets_per_image - 1
            )
            counts = []
            for i, (maps, activation, gradient) in enumerate(zip(per_layer, activations, gradients)):
                feature_gradients = self.feature_maps(i, gradient).float()
                counts.append(torch.count_nonzero(feature_gradients, dim=tuple(range(1, feature_gradients.dim()))))
                maps.append(self.layer_map(self.feature_maps(i, activation.detach()).float(), feature_gradients))
            nonzero.append(counts)
            disconnected.append(unreachable)

        def zero_gradient() -> Tensor:  # (N, K): the gradient zero at every layer; computed when a map is empty
            return torch.stack([sum(counts).cpu() == 0 for counts in nonzero], dim=1)  # type: ignore[union-attr]

        self._zero_gradient = zero_gradient, lambda: torch.stack([flags.cpu() for flags in disconnected], dim=1)
        return [torch.stack(maps, dim=1) for maps in per_layer]

    def _combine_layers(self, low_res: list[Tensor], selected: SelectedTargets, input_size: Sequence[int]
                        ) -> Attribution:
        """Per layer (N, K, h, w) maps → Attribution with (N, K, H, W) maps, layers combined (a token layer's map is
        0 on the pixels its patch embedding never reads: ``Layout.to_input``)."""
        layouts = self._layouts
        assert layouts is not None, "the layers' layouts are known until the call ends"
        on_input = [layout.to_input(maps, input_size) for layout, maps in zip(layouts, low_res)]
        if len(low_res) == 1:
            return Attribution(maps=on_input[0], selected=selected, low_res_maps=low_res, layer=self.layer_names[0])
        scaled = [normalize_maps(maps, "max") if self.normalize_layers else maps for maps in on_input]
        resized = torch.stack([upsample_maps(maps, input_size) for maps in scaled])
        reductions: dict[str, Callable[[Tensor, int], Tensor]] = {
            "mean": torch.mean, "max": torch.amax, "sum": torch.sum, "product": torch.prod}
        combined = reductions[self.combine]
        return Attribution(maps=combined(resized, 0), selected=selected, low_res_maps=low_res, layer=self.layer_names)


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


def channel_weighted(channel_weights: Tensor, activations: Tensor) -> Tensor:
    """w_k A_k per channel: weights (N, C) and A (N, C, h, w) → (N, C, h, w)."""
    return channel_weights[:, :, None, None] * activations


def required(gradients: Optional[Tensor]) -> Tensor:
    """G in the formula of a method that uses it: ``layer_maps`` passes None only to the methods
    that set ``uses_gradients = False``."""
    assert gradients is not None, "a formula that uses the gradients needs uses_gradients = True"
    return gradients


@register
class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): ReLU(Σ_k α_k A_k), α_k the spatial mean of ∂y/∂A_k."""

    name = "gradcam"
    summary = "Grad-CAM: feature maps weighted by their spatially averaged gradients"

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        return channel_weighted(gradients.mean(dim=(2, 3)), activations)


@register
class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhyay et al. 2018): w_k = Σ_ij α_ij ReLU(G_ij), with the closed form
    α = G² / (2 G² + Σ_ab A_ab · G³) of the paper for an exponential score (α = 0 where that is 0/0)."""

    name = "gradcam++"
    summary = "Grad-CAM++: pixel-wise weighted positive gradients (better for several instances)"

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        squared, cubed = gradients.pow(2), gradients.pow(3)
        denominator = 2 * squared + activations.sum(dim=(2, 3), keepdim=True) * cubed
        safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
        alpha = torch.where(denominator != 0, squared / safe, torch.zeros_like(denominator))
        return channel_weighted((alpha * torch.relu(gradients)).sum(dim=(2, 3)), activations)


@register
class XGradCAM(CAM):
    """XGrad-CAM (Fu et al. 2020): w_k = Σ_ij (A_k,ij / Σ_ab A_k,ab) G_k,ij (0 for a channel summing to 0).

    The paper's activations are non-negative (after a ReLU), where the formula is well conditioned. At a layer
    with signed activations (a LayerNorm or BatchNorm output, a residual stream) a channel whose values nearly
    cancel gets a large weight that rounding decides (under bfloat16 autocast a random swin_t's features.7 map
    moves by 0.3 of its maximum, resnet18's layer4.1.bn2 map by 1.0). Where rounding at the precision the model
    ran in can move a map by more than ``ROUNDING_TOLERANCE`` of its maximum (``rounding_decides``), one
    RuntimeWarning per call says so; the maps keep the paper's formula. Float32 maps at such a layer can also
    differ between a batch and its images one by one (by ~1e-3 of the map).
    Explain a layer after a ReLU/GELU, or use Grad-CAM."""

    name = "xgradcam"
    summary = "XGrad-CAM: gradients weighted by normalised activations (axiom-based)"
    layer_maps_reduce_channels = True  # its layer_maps is CAM's, with the rounding check around it

    _unit_roundoff: PerThread[float] = PerThread()
    """During a call: the unit roundoff of the lowest precision the layers' activations were computed in."""
    _rounding_decides: PerThread[bool] = PerThread()
    """During a call: whether a map may differ from its exact value by more than ``ROUNDING_TOLERANCE``."""

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        outer = self._unit_roundoff, self._rounding_decides
        roundoff = working_unit_roundoff(activations)
        self._unit_roundoff, self._rounding_decides = roundoff, False
        try:
            maps = super().layer_maps(batch, activations, selected)
            rounding_decides = self._rounding_decides
        finally:
            self._unit_roundoff, self._rounding_decides = outer
        if rounding_decides:
            names = self.layer_names
            layers = f"layer {names[0]!r}" if len(names) == 1 else f"one of the layers {', '.join(map(repr, names))}"
            warn_at_callers_line(
                f"{self.method_name} divides each channel's gradient mass by its activation sum Σ A_k, which assumes "
                f"non-negative activations; at {layers} the activations are signed and channels nearly cancel, "
                f"so rounding in {precision_name(roundoff)} can change the map by more "
                f"than {ROUNDING_TOLERANCE} of its maximum. Choose a layer after a ReLU/GELU, use Grad-CAM, or call "
                "explain outside torch.autocast (on a float32 model).", RuntimeWarning)
        return maps

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        channel_sums = activations.sum(dim=(2, 3))
        safe = torch.where(channel_sums != 0, channel_sums, torch.ones_like(channel_sums))
        weights = torch.where(channel_sums != 0, (activations * gradients).sum(dim=(2, 3)) / safe, 0.0)
        roundoff = self._unit_roundoff or working_unit_roundoff([activations])
        if not self._rounding_decides and roundoff > FLOAT32_ROUNDOFF:  # float32 and float64: no check, no operations
            self._rounding_decides = rounding_decides(activations, gradients, weights, channel_sums, roundoff)
        return channel_weighted(weights, activations)


FLOAT32_ROUNDOFF = torch.finfo(torch.float32).eps / 2
"""XGrad-CAM checks its weights' rounding only below float32 (autocast, a float16/bfloat16 model): in float32 a map
would move by 0.02 only where a channel's sum cancels to 1e-5 of Σ|A_k|."""

ROUNDING_GROWTH = 4.0
"""XGrad-CAM: the relative error of a layer's activations, in units of the unit roundoff u of the precision the
model ran in (under bfloat16 autocast a random swin_t's features.7 differs from float32 by 1-5 % of Σ|A_k|: 3-13 u)."""

ROUNDING_TOLERANCE = 0.02
"""XGrad-CAM warns where rounding can move a map by more than this fraction of its maximum (the bound that
docs/guarantees.md gives CAMs under autocast)."""


def rounding_decides(activations: Tensor, gradients: Tensor, weights: Tensor, channel_sums: Tensor,
                     unit_roundoff: float) -> bool:
    """Whether rounding A (relative error ``ROUNDING_GROWTH`` u) can move an XGrad-CAM map Σ_k w_k A_k by more than
    ``ROUNDING_TOLERANCE`` of its maximum through the weights' cancelling denominators (first order).

    w_k = Σ_p A_p G_p / Σ_p A_p has ∂w_k/∂A_p = (G_p − w_k) / Σ A_k, so rounding moves w_k by at most
    ε Σ_p |A_p| |G_p − w_k| / |Σ A_k|; the part beyond a non-negative channel's (Σ|A_k| = |Σ A_k|, as Grad-CAM's
    weights move) is counted: 0 at a ReLU layer, and 0 where G is constant over positions (w_k = G, exactly)."""
    magnitudes = activations.abs().sum(dim=(2, 3))
    deviations = (activations.abs() * (gradients - weights[:, :, None, None]).abs()).sum(dim=(2, 3))
    nonzero = channel_sums != 0
    excess = torch.where(nonzero, deviations * (1 / torch.where(nonzero, channel_sums.abs(), 1.0)
                                                - 1 / torch.where(nonzero, magnitudes, 1.0)), 0.0)
    spread = ROUNDING_GROWTH * unit_roundoff * weighted_sum(excess, activations.abs())
    extent = weighted_sum(weights, activations).abs().flatten(1).amax(1)
    return bool((spread.flatten(1).amax(1) > ROUNDING_TOLERANCE * extent).any())


def working_unit_roundoff(activations: Sequence[Tensor]) -> float:
    """The unit roundoff (half the machine epsilon) of the lowest precision among the activations' dtypes and
    torch.autocast's dtype where autocast is on for their device: 2^-24 for float32, 2^-8 for bfloat16."""
    dtypes = [activation.dtype for activation in activations if activation.is_floating_point()]
    dtypes += [dtype for dtype in (autocast_dtype(activation.device.type) for activation in activations) if dtype]
    return max((torch.finfo(dtype).eps / 2 for dtype in dtypes), default=torch.finfo(torch.float32).eps / 2)


def precision_name(unit_roundoff: float) -> str:
    """'bfloat16', 'float16', 'float32' or 'float64' from its unit roundoff."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        if unit_roundoff >= torch.finfo(dtype).eps / 2:
            return str(dtype).removeprefix("torch.")
    return "float64"


@register
class HiResCAM(CAM):
    """HiResCAM (Draelos & Carin 2020): Σ_k G_k ⊙ A_k, element-wise (no pooling of the gradient)."""

    name = "hirescam"
    summary = "HiResCAM: element-wise gradient × activation, faithful to the score for CNNs"

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        return gradients * activations

    def reads_pixel_gradients(self) -> bool:
        return True  # per-position gradients, not averaged over the layer: reduced precision moves them (warns)


@register
class GradCAMElementWise(CAM):
    """Grad-CAM element-wise (pytorch-grad-cam): Σ_k ReLU(G_k ⊙ A_k), the positive part of each
    HiResCAM term. Map (N, h, w) ≥ 0."""

    name = "gradcamelementwise"
    summary = "Grad-CAM element-wise: sum over channels of ReLU(gradient × activation)"

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        return torch.relu(gradients * activations)

    def reads_pixel_gradients(self) -> bool:
        return True  # per-position gradients, not averaged over the layer: reduced precision moves them (warns)


@register
class LayerCAM(CAM):
    """Layer-CAM (Jiang et al. 2021): Σ_k ReLU(G_k) ⊙ A_k, element-wise."""

    name = "layercam"
    summary = "Layer-CAM: element-wise positive gradient × activation (good at shallow layers)"

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        return torch.relu(gradients) * activations

    def reads_pixel_gradients(self) -> bool:
        return True  # per-position gradients, not averaged over the layer: reduced precision moves them (warns)


@register
class ShapleyCAM(GradCAM):
    """Shapley-CAM (Cai 2025): Grad-CAM with the gradient replaced by G − ½ H A, a second-order
    estimate of each activation's Shapley value: w_k = mean_ij (∂y/∂A − ½ (∂²y/∂A²) A)_k,ij,
    map ReLU(Σ_k w_k A_k). H A is a Hessian-vector product (one double backward pass).

    Where the network after the layer is piecewise linear in A (ReLU, pooling, a linear head)
    H A = 0 and the map is Grad-CAM's; the paper pairs the method with a target that is not, such
    as the logit plus its log-softmax (its "ReST" target): ``target=lambda out: out[:, c] +
    out.log_softmax(1)[:, c]``.
    """

    name = "shapleycam"
    summary = "Shapley-CAM: Grad-CAM weights from the gradient minus half a Hessian-vector product"

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        # the fused attention kernels (timm, HuggingFace sdpa, nn.MultiheadAttention) have no second derivative:
        # attention is computed step by step for the call (the same values to float rounding)
        with call_rules(StepwiseAttention()):
            return super().attribute(batch, target, topk)

    def layer_gradients(self, scores: Tensor, activations: list[Tensor],
                        retain_graph: bool) -> tuple[list[Tensor], Tensor]:
        if not scores.requires_grad:
            return gradients_at(scores, activations, retain_graph)
        gradients = torch.autograd.grad(scores.sum(), activations, create_graph=True, allow_unused=True)
        disconnected = torch.full(scores.shape[:1], all(g is None for g in gradients), dtype=torch.bool)
        shapley = []
        for activation, gradient in zip(activations, gradients):
            if gradient is None:
                shapley.append(torch.zeros_like(activation))
                continue
            hessian_product = None
            if gradient.requires_grad:  # else ∂y/∂A does not depend on A: H A = 0
                (hessian_product,) = torch.autograd.grad(gradient, activation, grad_outputs=activation.detach(),
                                                         retain_graph=True, allow_unused=True)
            shapley.append(gradient.detach() - (0 if hessian_product is None else 0.5 * hessian_product))
        return shapley, disconnected


@register
class RandomCAM(CAM):
    """Random-CAM, a sanity baseline: ReLU(Σ_k w_k A_k) with channel weights w_k drawn uniformly
    from [-1, 1] (a generator seeded with ``seed``: the same weights for every image, target and
    call). Any real method should beat it; it needs no gradient. pytorch-grad-cam 1.5.7 draws new weights
    for every image and call (numpy's global generator); given the same weights its map is this one."""

    name = "randomcam"
    summary = "Random-CAM: feature maps weighted by random numbers, a baseline every method should beat"
    uses_gradients = False

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, seed: int = 0, **options: Unpack[CAMOptions]):
        super().__init__(model, layer, **options)
        if not is_whole_number(seed) or not SEED_RANGE[0] <= int(seed) < SEED_RANGE[1]:
            raise ValueError(f"RandomCAM's seed must be an int: its weights are drawn from it, so that every image, "
                             f"target and call gets the same ones (a baseline that can be reproduced); got {seed!r}.")
        self.seed = int(seed)

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        weights = torch.rand(activations.shape[1], generator=generator) * 2 - 1
        return weights.to(activations)[None, :, None, None] * activations


@register
class FEM(CAM):
    """FEM, feature explanation method (Fuad et al. 2020): Σ_k μ_k · 1[A_k > μ_k + k σ_k], the
    binary maps of each channel's unusually strong responses (k-sigma rule; μ_k, σ_k the mean
    and population standard deviation of A_k over positions) weighted by the channel's mean.
    Class-agnostic, no gradient. k: the number of standard deviations (the paper's 2).

    pytorch-grad-cam 1.5.7 computes Σ_k mean(1[A_k > μ_k + k σ_k]) · A_k instead (weights and
    maps swapped; tests/test_peer_gradcam.py measures the difference).
    """

    name = "fem"
    summary = "FEM: binary maps of each channel's k-sigma outliers weighted by the channel mean (no gradient)"
    uses_gradients = False

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, k: float = 2.0,
                 **options: Unpack[CAMOptions]):
        super().__init__(model, layer, **options)
        self.k = number_option("k", k)

    def channel_terms(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        means = activations.mean(dim=(2, 3), keepdim=True)
        stds = activations.std(dim=(2, 3), keepdim=True, correction=0)
        return means * (activations > means + self.k * stds).to(activations.dtype)

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        attribution = super().attribute(batch, target, topk)
        positions = min(maps.shape[-2] * maps.shape[-1] for maps in attribution.low_res_maps or [attribution.maps])
        if (positions - 1) ** 0.5 <= self.k:  # no value of n can exceed the mean by more than √(n − 1) σ
            attribution.empty_reason = (
                f"over a layer map of {positions} positions no value exceeds its channel's mean by more than "
                f"√{positions - 1} = {(positions - 1) ** 0.5:.2f} standard deviations, so FEM's k = {self.k:g} "
                "threshold cannot be reached. Give a larger input, choose an earlier layer, or a smaller k")
        return attribution


@register
class EigenCAM(CAM):
    """Eigen-CAM (Muhammad & Yeasin 2020): the feature maps projected on their first principal
    component (channels as variables, positions as samples); gradient-free and class-agnostic.

    The SVD's sign is arbitrary; it is fixed so that the map correlates positively with the
    activation mass Σ_k A_k (other libraries return inverted maps for about half the images). Where
    Σ_k A_k is constant over positions up to rounding (after a LayerNorm, e.g. a transformer block's
    norm1), the map's larger extreme is made positive instead, as Seg-Eigen-CAM (see ``oriented_like``).
    smooth="eigen" changes nothing (the map already is a principal component).
    """

    name = "eigencam"
    summary = "Eigen-CAM: first principal component of the feature maps (class-agnostic, no gradient)"
    uses_gradients = False

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        return principal_component(activations).to(activations.dtype)


@register
class EigenGradCAM(CAM):
    """Eigen-Grad-CAM (pytorch-grad-cam): the first principal component of G ⊙ A (class-specific
    Eigen-CAM), sign fixed to correlate positively with Σ_k G_k ⊙ A_k (HiResCAM's map), or where that
    is constant up to rounding (the input of a LayerNorm, where Σ_k G_k A_k ≡ 0) so that the map's
    larger extreme is positive (see ``oriented_like``). pytorch-grad-cam leaves the sign arbitrary."""

    name = "eigengradcam"
    summary = "Eigen-Grad-CAM: first principal component of gradient × activation (class-specific)"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        gradients = required(gradients)
        return principal_component(gradients * activations).to(activations.dtype)

    def reads_pixel_gradients(self) -> bool:
        return True  # per-position gradients, not averaged over the layer: reduced precision moves them (warns)


KERNELS = ("sigmoid", "rbf", "poly", "linear", "cosine")


@register
class KernelPCACAM(CAM):
    """KPCA-CAM (Karmani et al. 2024): Eigen-CAM with kernel PCA, the positions' scores on the first
    kernel principal component of the feature maps (positions as samples, centred).

    kernel: "sigmoid" (default, tanh(γ x·y + c₀)), "rbf" (exp(−γ‖x − y‖²)), "poly" ((γ x·y + c₀)^degree),
    "linear" (x·y: Eigen-CAM) or "cosine"; gamma: γ, default 1 / channels; coef0: c₀. As scikit-learn's
    KernelPCA: the Gram matrix is double-centred, the score is eigenvector · √eigenvalue. Sign fixed
    as Eigen-CAM's: correlating positively with the activation mass Σ_k A_k, or the larger extreme
    positive where Σ_k A_k is constant up to rounding (``oriented_like``). Class-agnostic, no gradient; costs an
    eigendecomposition of an (h·w)² matrix per image.
    """

    name = "kpcacam"
    summary = "KPCA-CAM: first kernel principal component of the feature maps (class-agnostic, no gradient)"
    uses_gradients = False

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, kernel: str = "sigmoid",
                 gamma: Optional[float] = None, degree: int = 3, coef0: float = 1.0, **options: Unpack[CAMOptions]):
        super().__init__(model, layer, **options)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}.")
        self.kernel, self.gamma, self.degree, self.coef0 = kernel, gamma, degree, coef0

    def gram(self, samples: Tensor) -> Tensor:
        """(B, P, C) samples → (B, P, P) kernel matrix."""
        gamma = self.gamma if self.gamma is not None else 1.0 / samples.shape[-1]
        products = samples @ samples.transpose(1, 2)
        if self.kernel == "linear":
            return products
        if self.kernel == "sigmoid":
            return torch.tanh(gamma * products + self.coef0)
        if self.kernel == "poly":
            return (gamma * products + self.coef0) ** self.degree
        if self.kernel == "rbf":
            return torch.exp(-gamma * torch.cdist(samples, samples).pow(2))
        norms = samples.norm(dim=-1, keepdim=True)
        unit = samples / torch.where(norms > 0, norms, torch.ones_like(norms))
        return unit @ unit.transpose(1, 2)

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        count, channels, height, width = activations.shape
        samples = activations.double().reshape(count, channels, -1).transpose(1, 2)  # (N, hw, C)
        gram = self.gram(samples - samples.mean(dim=1, keepdim=True))
        centred = gram - gram.mean(1, keepdim=True) - gram.mean(2, keepdim=True) + gram.mean((1, 2), keepdim=True)
        eigenvalues, eigenvectors = torch.linalg.eigh(centred)  # ascending
        scores = eigenvectors[..., -1] * eigenvalues[..., -1:].clamp_min(0).sqrt()
        return oriented_like(scores, samples).reshape(count, height, width).to(activations.dtype)


@register
class SegEigenCAM(CAM):
    """Seg-Eigen-CAM (Chung & Ying 2025): the first principal component of |G| ⊙ A, the activations
    weighted element-wise by the magnitude of their gradients (negative gradients count too), signed
    as the paper's Eq. 13: the projection is negated where its minimum is larger in magnitude than its
    maximum, so that the salient region is positive. Class-specific; made for segmentation targets
    (``explain.SegmentationTarget``), any target works."""

    name = "segeigencam"
    summary = "Seg-Eigen-CAM: first principal component of |gradient| × activation (for segmentation)"

    def layer_map(self, activations: Tensor, gradients: Optional[Tensor]) -> Tensor:
        count, _, height, width = activations.shape
        projection, _ = first_component_scores(required(gradients).abs() * activations)
        signed = torch.where(peak_is_negative(projection)[:, None], -projection, projection)
        return signed.reshape(count, height, width).to(activations.dtype)

    def reads_pixel_gradients(self) -> bool:
        return True  # per-position gradients, not averaged over the layer: reduced precision moves them (warns)


Classifier = Union[str, nn.Module]
"""CAM's classifier: "auto", a ``named_modules()`` name or the module itself."""


@register
class ClassActivationMapping(CAM):
    """CAM, class activation mapping (Zhou et al. 2016): Σ_k w_c,k A_k, the layer's feature maps weighted
    by the classifier's weights for class c, no gradient. Exact for networks that average-pool the
    layer over positions and then apply one linear layer (ResNets, DenseNets, MobileNetV2, EfficientNets
    at their last convolutional stage): the class score is then the map's mean plus the bias, and
    Grad-CAM at that layer gives the same map. (``explain.CAM`` is the family's base class; this is
    the method of that name, registered as "cam".)

    classifier: the linear layer (or 1 × 1 convolution) that produces the class scores: a
        ``named_modules()`` name, the module, or "auto" (default): the ``nn.Linear`` or 1 × 1 ``nn.Conv2d``
        whose output is the model's output, found in each call's forward pass (the same values, at most
        reshaped: a flatten, dropout in eval mode or an identity may follow it). A model whose scores are
        computed from that output (a temperature, a sigmoid) needs ``classifier=`` named. "auto" never
        takes a hidden layer: where no layer produces the output, or the classifier does not read the
        layer's channels (VGG and MobileNetV3 have hidden layers after pooling; DINOv2's classifier
        reads the class token joined with the mean patch token), the call raises and says why.
    Targets are classes (an int, one per image, K per image, or ``topk``): row c of the classifier's
    weight matrix weights the maps, so the classifier has one row per class of the model's output.
    The layer must be the one whose pooled output the classifier reads (torchvision's DenseNet applies
    a last ReLU as a function after ``features``: the map of ``features`` uses the features before it); a call
    raises where the classifier's input is not the layer averaged over positions (``check_pooled``: a ViT's class
    token, ConvNeXt's normalised pooled features, a transformer block's norm). With layer=None the default is that
    layer (a Swin's final ``norm``), not the family's default where the classifier does not read it.
    The paper's map is signed, as with ``relu=False``; the default ``relu=True`` keeps its positive
    evidence, as every CAM here.
    """

    name = "cam"
    summary = "CAM (Zhou et al. 2016): feature maps weighted by the classifier's weights for the class"
    uses_gradients = False
    layer_maps_reduce_channels = True
    _output_classifier: PerThread[tuple[str, nn.Module]] = PerThread()
    """During a call, classifier="auto": the (name, module) whose output the last forward pass returned."""
    _output_classes: PerThread[int] = PerThread()
    """During a call: the number of classes of the last forward pass's (N, classes) output."""
    _classifier_input: PerThread[Tensor] = PerThread()
    """During a call: the (N, features) input of the classifier (given, or found) in the last forward pass."""

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, classifier: Classifier = "auto",
                 **options: Unpack[CAMOptions]):
        super().__init__(model, layer, **options)
        if isinstance(classifier, str) and classifier != "auto":
            found = find_layers(self.model, classifier)
            if len(found) != 1:
                raise ValueError(f"classifier must name one module; {classifier!r} selects {len(found)}.")
            classifier = found[0][1]
        if not isinstance(classifier, (str, nn.Module)):
            raise TypeError(f"classifier must be 'auto', a module name or an nn.Module; got "
                            f"{type(classifier).__name__}.")
        if isinstance(classifier, nn.Module) and class_weights(classifier) is None:
            raise TypeError(f"classifier must be an nn.Linear or a 1 × 1 nn.Conv2d (its weights give the classes' "
                            f"channel weights); got {type(classifier).__name__}.")
        self.classifier = classifier

    def call_model(self, inputs: Tensor, rows: Optional[Tensor] = None) -> Any:
        """The model's forward pass (see ``Explainer.call_model``); with classifier="auto" it also notes which
        candidate classifier produced the output (see ``OutputProducers``)."""
        given = self.classifier if isinstance(self.classifier, nn.Module) else None
        with OutputProducers(self.model, given) as producers:
            output = super().call_model(inputs, rows)
            found = (module_name(self.model, given), given) if given is not None else producers.producer_of(output)
            if given is None:
                self._output_classifier = found
            self._classifier_input = None if found is None else producers.input_of(found[1])
        self._output_classes = output.shape[1] if isinstance(output, Tensor) and output.dim() == 2 else None
        return output

    def default_layer_name(self, batch: Tensor) -> str:
        """The layer whose average-pooled output the classifier reads: the CAMs' usual default where it is that
        layer, else the last layer to run that is (``PooledLayers``); the usual default where none is (the call then
        raises and says why, ``check_pooled``)."""
        chosen = super().default_layer_name(batch)
        with torch.no_grad(), PooledLayers(self.model, batch.shape[-2:], self.reshape) as pooled:
            self.call_model(batch)
            classifier_input = self._classifier_input
            names = [] if classifier_input is None else pooled.reading(classifier_input)
        if chosen in names or not names:
            return chosen
        modules = dict(self.model.named_modules())  # a layer that computes, rather than a Permute or Flatten after it
        return next((name for name in reversed(names) if any(True for _ in modules[name].children())
                     or any(True for _ in modules[name].parameters(recurse=False))), names[-1])

    def check_pooled(self, feature_maps: Tensor, activation: Tensor, layer_name: str) -> None:
        """Raise where the classifier's input is not the layer's feature maps (N, C, h, w) averaged over positions
        (nor those of their ReLU, as DenseNet applies one as a function): the classifier rows then weight
        features that the score never reads, and the map is not the class score's."""
        classifier_input = self._classifier_input
        if classifier_input is None or classifier_input.numel() != feature_maps.shape[0] * feature_maps.shape[1]:
            return  # no input recorded, or one of another width (``weights_for`` says why)
        tolerance = max(POOLED_TOLERANCE, 16 * working_unit_roundoff([activation, classifier_input]))
        read = classifier_input.detach().float().reshape(feature_maps.shape[:2])
        error = pooled_error(feature_maps, read)
        if error <= tolerance or pooled_error(torch.relu(feature_maps), read) <= tolerance:
            return
        classifier = self._output_classifier[0] if self._output_classifier is not None else module_name(
            self.model, self.classifier) if isinstance(self.classifier, nn.Module) else "the classifier"
        raise ValueError(
            f"the classifier {classifier!r} does not read layer {layer_name!r} averaged over positions (its input "
            f"differs from that average by {error:.2g} of its largest value): CAM weights the layer's maps by the "
            "classifier's rows, which is the class score only for a model that average-pools that layer into one "
            "linear classifier. A ViT's classifier reads its class token, ConvNeXt normalises the pooled features, "
            "and a transformer block's norm is not what is pooled. Give the layer whose output is pooled (layer=; "
            "e.g. a Swin's final norm), or use Grad-CAM, which needs no classifier.")

    def weights_for(self, channels: int, layer_name: str) -> Tensor:
        """(classes, channels) weights of the classifier (given, or found in this call's forward pass) that
        reads the layer's ``channels`` features; an error that says why where there is none."""
        if isinstance(self.classifier, nn.Module):
            name, classifier, described = module_name(self.model, self.classifier), self.classifier, "the classifier"
        else:
            found = self._output_classifier
            if found is None:
                raise ValueError(no_output_classifier_message(self.model, channels, layer_name))
            (name, classifier), described = found, "the model's classifier"
        weights = class_weights(classifier)
        assert weights is not None, "a module given is checked in __init__; one found is a candidate"
        if weights.shape[1] != channels:
            hidden = [other for other in reversed(taking_features(self.model, channels)) if other != name]
            raise ValueError(
                f"{described} {name!r} takes {weights.shape[1]} features, but layer {layer_name!r} has {channels} "
                "channels: CAM needs the layer whose pooled output the classifier reads (usually the last "
                "convolutional stage). A model with hidden layers between the pooling and the classifier (VGG, "
                "MobileNetV3, a head with a hidden MLP) has no such layer: use Grad-CAM, which needs no classifier."
                + (f" (Other layers take {channels} features, {listed(hidden)}, but none of them produces the "
                   "model's output: their rows are not the classes.)" if hidden else ""))
        classes = self._output_classes
        if classes is not None and weights.shape[0] != classes:
            raise ValueError(
                f"{described} {name!r} has {weights.shape[0]} outputs, but the model's output has {classes} classes: "
                "CAM weights the maps by the classifier's row for the class, so the classifier must be the layer "
                "that produces the model's scores, not a hidden layer. Give that layer (classifier='NAME') or "
                "classifier='auto'.")
        return weights

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        if selected.class_indices is None:
            raise ValueError("CAM weights the maps by a class's classifier weights, so its targets are classes (an "
                             "int, one per image, K per image, or topk), not a callable; use Grad-CAM for other "
                             "targets.")
        try:
            maps = []
            for index, (name, activation) in enumerate(zip(self.layer_names, activations)):
                feature_maps = self.feature_maps(index, activation).float()
                weights = self.weights_for(feature_maps.shape[1], name).float().to(feature_maps.device)
                self.check_pooled(feature_maps, activation, name)
                maps.append(self.weighted_maps(weights[selected.class_indices.to(weights.device)], feature_maps))
            return maps
        finally:
            self._output_classifier = self._output_classes = self._classifier_input = None


class OutputProducers(CallScope["OutputProducers"]):
    """Forward hooks, for one forward pass of this thread, that keep the outputs of the candidate classifiers
    (every ``nn.Linear`` and 1 × 1 ``nn.Conv2d``) whose shape can be class scores, (N, K) or (N, K, 1, 1), so
    that ``producer_of`` can tell which one produced the model's output. Other outputs (a transformer's
    per-token projections, a CNN's 1 × 1 convolutions over positions) cannot be the scores and are not kept."""

    def __init__(self, model: nn.Module, classifier: Optional[nn.Module] = None):
        super().__init__(model)
        self.classifier = classifier
        """The classifier given (its input alone is kept), or None: every candidate."""
        self.outputs: list[tuple[str, nn.Module, Tensor]] = []
        self.inputs: dict[nn.Module, Tensor] = {}
        """Per candidate, its input in the last forward of it that could give class scores."""

    def setup(self) -> "OutputProducers":
        self.add_undo(self.outputs.clear)
        self.add_undo(self.inputs.clear)
        if self.classifier is not None:
            self.forward_hook(self.classifier, self._hook_for(""))
            return self
        for name, module in self.model.named_modules() if self.model is not None else ():
            if class_weights(module) is not None:
                self.forward_hook(module, self._hook_for(name))
        return self

    def _hook_for(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if isinstance(output, Tensor) and (output.dim() == 2 or (output.dim() == 4 and output.shape[2:] == (1, 1))):
                if self.classifier is None:
                    self.outputs.append((name, module, output))
                if args and isinstance(args[0], Tensor):
                    self.inputs[module] = args[0].detach()

        return hook

    def input_of(self, classifier: nn.Module) -> Optional[Tensor]:
        """The classifier's input in its last forward (None if it did not run on class-score shapes)."""
        return self.inputs.get(classifier)

    def producer_of(self, output: object) -> Optional[tuple[str, nn.Module]]:
        """(name, module) of the last candidate whose output is the model's ``output``: the same values in the same
        order, at most reshaped or cast (a flatten, dropout in eval mode, an identity, a copy); None if none is."""
        if not isinstance(output, Tensor):
            return None
        for name, module, produced in reversed(self.outputs):
            if produced.shape[0] == output.shape[0] and produced.numel() == output.numel() and torch.equal(
                    produced.detach().reshape(output.shape).to(output.dtype), output.detach()):
                return name, module
        return None


POOLED_TOLERANCE = 1e-3
"""CAM: the largest difference, as a fraction of the classifier input's largest |value|, between that input and the
layer's average-pooled maps for the layer to count as what the classifier reads (float32 pooling rounds to ~1e-7)."""


def pooled_error(feature_maps: Tensor, classifier_input: Tensor) -> float:
    """max |mean over positions of the (N, C, h, w) maps − the (N, C) input| / max |input|."""
    difference = (feature_maps.float().mean(dim=(2, 3)) - classifier_input).abs().amax()
    return float(difference / classifier_input.abs().amax().clamp_min(torch.finfo(torch.float32).tiny))


class PooledLayers(CallScope["PooledLayers"]):
    """Forward hooks, for one forward pass, that keep the average over positions of each module's output read as a
    CAM reads it (``infer_layout``), for the modules that run once and output maps of 2 positions or more;
    ``reading`` tells which of them the classifier's input is (``POOLED_TOLERANCE``): the layers ClassActivationMapping
    can explain."""

    def __init__(self, model: nn.Module, input_size: Sequence[int], reshape: Reshape):
        super().__init__(model)
        self.input_size, self.reshape = input_size, reshape
        self.pooled: dict[str, Tensor] = {}
        """Per module, in the order they finish: its (N, C) output averaged over positions."""
        self.calls: dict[str, int] = {}

    def setup(self) -> "PooledLayers":
        self.add_undo(self.pooled.clear)
        for name, module in self.model.named_modules() if self.model is not None else ():
            self.forward_hook(module, self._hook_for(name))
        return self

    def _hook_for(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.pooled.pop(name, None)  # one that runs more than once is not a layer a CAM can explain
            if self.calls[name] > 1 or not isinstance(output, Tensor) or output.dim() not in (3, 4):
                return
            try:
                tokens = model_tokens(self.model) if output.dim() == 3 else None
                maps = infer_layout(output, self.input_size, self.reshape, name, module, model=tokens).apply(output)
            except (ValueError, RuntimeError):
                return
            if maps.dim() == 4 and maps.shape[-2] * maps.shape[-1] >= 2:  # a pooled (N, C, 1, 1) output is no map
                self.pooled[name] = maps.detach().float().mean(dim=(2, 3))

        return hook

    def reading(self, classifier_input: Tensor) -> list[str]:
        """The modules, in the order they finished, whose pooled output is the (N, C) ``classifier_input``."""
        read = classifier_input.detach().float().flatten(1)
        return [name for name, pooled in self.pooled.items()
                if pooled.shape == read.shape and pooled_error(pooled[..., None, None], read) <= POOLED_TOLERANCE]


def class_weights(classifier: nn.Module) -> Optional[Tensor]:
    """(classes, features) weights of an nn.Linear or 1 × 1 nn.Conv2d, else None."""
    if isinstance(classifier, nn.Linear):
        return classifier.weight.detach()
    if isinstance(classifier, nn.Conv2d) and tuple(classifier.kernel_size) == (1, 1) and classifier.groups == 1:
        return classifier.weight.detach().flatten(1)
    return None


def taking_features(model: nn.Module, features: int) -> list[str]:
    """Names of the model's nn.Linear and 1 × 1 nn.Conv2d modules that take ``features`` input features."""
    return [name for name, module in model.named_modules()
            if (weights := class_weights(module)) is not None and weights.shape[1] == features]


def module_name(model: nn.Module, module: nn.Module) -> str:
    """The module's ``named_modules()`` name in the model (its type's name if it is not the model's)."""
    return next((name for name, candidate in model.named_modules() if candidate is module), type(module).__name__)


def listed(names: Sequence[str], most: int = 5) -> str:
    """'a', 'b' and 3 more: the first ``most`` names quoted, the rest counted."""
    shown = ", ".join(repr(name) for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def no_output_classifier_message(model: nn.Module, channels: int, layer_name: str) -> str:
    """Why classifier="auto" found no classifier, which layers it considered and what to do."""
    considered = list(reversed(taking_features(model, channels)))
    if considered:
        why = (f" It considered the layers that take the {channels} features of layer {layer_name!r}, "
               f"{listed(considered)}: none of them produces the output (hidden layers: their rows are not the "
               "classes).")
    else:
        why = f" No nn.Linear or 1 × 1 nn.Conv2d of the model takes the {channels} features of layer {layer_name!r}."
    return ("CAM's classifier='auto' found no nn.Linear or 1 × 1 nn.Conv2d whose output is the model's output (the "
            "same values, at most reshaped), so it cannot tell which weights belong to the classes." + why
            + " If the model's scores are computed from one layer's outputs (a temperature, a sigmoid), name it: "
            "classifier='NAME'; otherwise use Grad-CAM, which needs no classifier.")
