"""Concept Relevance Propagation (CRP; Achtibat et al., Nature Machine Intelligence 2023): what the model saw, not only
where.

A concept is a unit of a layer: a channel of a convolutional layer's (N, C, H, W) output, a neuron (feature) of a
transformer block's (N, T, D) tokens. CRP's conditional relevance R(x | θ) of a prediction for the concept c of layer
l is the relevance LRP (or AttnLRP) propagates to the input when, at layer l, the relevance is kept on channel c and
set to 0 on every other channel. One heatmap per concept says where that concept found its evidence; the concept's
relevance R_c (the layer's relevance summed over channel c) ranks the concepts for the prediction. The rules are
linear in the relevance they pass on, so the conditional maps of all concepts of a layer sum to the unconditional map
(conservation over concepts).

    crp = explain.ConceptRelevance(model, "layer3")                  # LRP (AttnLRP for a transformer), default rules
    e = crp.explain(image, concepts=4)                               # the 4 most relevant channels of layer3
    e.class_indices, e.scores                                        # (N, 4) their channels, their relevance R_c
    e.figure()                                                       # one conditional heatmap per concept

Many conditions go through one backward pass: the images are repeated once per concept (``batch_size`` rows per
pass) and each row's relevance is masked to its own concept, as zennit-crp's batched conditions.

A concept can also be a direction of the layer's channel space (``directions``: (K, C) orthonormal rows u_k, e.g. a
CAV, or a basis of a transformer block's features found by PCA). Its relevance is what a virtual inspection layer
(Vielhaben et al., 2024) gives it: the layer's output a is passed through h = U a and back through a = Uᵀ h (the
identity), LRP-0 through both, and the relevance kept on h_k. With c the relevance per unit of activation at the layer
(c = R / a for LRP, 0 where a = 0; the gradient AttnLRP carries), that is the relevance u_k (u_k · c) ⊙ a passed on
below, and R_k = Σ over positions of (u_k · a)(u_k · c). Channels are the case U = I; the maps of a complete basis
(K = C) sum to the unconditional map.
"""

from __future__ import annotations

import numbers
import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.capture import (
    LayerOutputError,
    LayerSpec,
    find_layers,
    model_device,
    model_dtype,
    model_input_channels,
    preserved_model_state,
    run_model,
)
from ..core.layouts import Layout, channel_evidence, infer_layout
from ..core.targets import Target
from ..io.explanation import Diagnostic, Explanation
from ..io.inputs import Inputs, as_preprocess, folder_images, prepare_inputs
from ..io.loaded_model import LoadedModel, loaded_model_parts
from .attnlrp import AttnLRP
from .base import Explainer
from .lrp import LRP
from .options import is_whole_number
from .registry import get_method

ConceptSpec = Union[int, Sequence[int], Tensor, None]
"""Which concepts ``ConceptRelevance.explain`` maps: an int k (each image's k most relevant), channel indices for
every image ((M,) ints), (N, M) indices per image, or None (every channel of the layer)."""


def _orthonormal_rows(directions: Any) -> Tensor:
    """``directions`` as a (K, C) float64 CPU tensor, checked to have orthonormal rows (U Uᵀ = I)."""
    if isinstance(directions, (list, tuple)) and directions and all(isinstance(row, Tensor) for row in directions):
        directions = torch.stack([row.detach().cpu() for row in directions])  # a list of CAVs, one tensor each
    matrix = torch.as_tensor(directions).detach()
    if matrix.is_complex():
        raise ValueError("directions are complex numbers; give real directions of the layer's channel space.")
    matrix = matrix.to("cpu", torch.float64)
    if matrix.dim() == 1:
        matrix = matrix[None]
    if matrix.dim() != 2 or matrix.shape[0] == 0 or matrix.shape[0] > matrix.shape[1]:
        raise ValueError(f"directions must be (K, C) with 1 ≤ K ≤ C, one direction per row; got shape "
                         f"{tuple(matrix.shape)}.")
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError("directions hold NaN or infinite values.")
    deviation = float((matrix @ matrix.T - torch.eye(matrix.shape[0], dtype=torch.float64)).abs().max())
    if deviation > 1e-4:
        raise ValueError(f"directions must be orthonormal rows (U Uᵀ = I) for the relevance of each to be its own; "
                         f"U Uᵀ differs from I by up to {deviation:.3g}: orthonormalise them, e.g. "
                         "torch.linalg.qr(directions.T).Q.T (a single direction: divide it by its norm).")
    return matrix


def _concept_dim(output: Tensor, channel_dim: Optional[int], layer: nn.Module, name: str) -> int:
    """The dimension of ``layer``'s ``output`` that indexes its concepts: ``channel_dim`` checked (a dimension of the
    output other than the batch's), or by default the last for (N, T, D) tokens and for (N, h, w, C) channels-last
    maps (a layer whose last convolution, norm or linear layer has C channels at dimension 3 and not at 1, as Swin's
    stages), else 1 ((N, C, ...) feature maps, (N, D) vectors)."""
    dims = output.dim()
    if dims < 2:
        raise LayerOutputError(f"layer {name}'s output {tuple(output.shape)} has no channels: give a layer whose "
                               "output is (N, C, ...) or (N, T, D).")
    if channel_dim is not None:
        if (not isinstance(channel_dim, numbers.Integral) or isinstance(channel_dim, bool)
                or not -dims <= channel_dim < dims or channel_dim % dims == 0):
            raise LayerOutputError(f"channel_dim={channel_dim!r} is not a channel dimension of layer {name}'s output "
                                   f"{tuple(output.shape)}: give 1 to {dims - 1} (or -1 to {1 - dims}); dimension 0 "
                                   "is the batch.")
        return int(channel_dim) % dims
    if dims == 3:
        return 2
    evidence = channel_evidence(layer) if dims == 4 else None
    if evidence is not None and output.shape[3] == evidence[0] != output.shape[1]:
        return 3
    return 1


def relevance_method_for(model: Union[nn.Module, LoadedModel]) -> str:
    """The method ``ConceptRelevance(method="auto")`` propagates relevance with: "attnlrp" where the model holds a
    layer norm or an attention module (a ViT, a Swin, a ConvNeXt's LayerNorm2d), which LRP has no rule for (its map
    would not be LRP, and it warns so), else "lrp"."""
    module = loaded_model_parts(model)[0]
    if not isinstance(module, nn.Module):
        return "lrp"  # (the explainer refuses it)
    for submodule in module.modules():
        if isinstance(submodule, (nn.LayerNorm, nn.MultiheadAttention)) or type(submodule).__name__.endswith(
                ("Attention", "SelfAttention", "RMSNorm")):
            return "attnlrp"
    return "lrp"


def _one_layer(model: nn.Module, layer: Any, caller: str) -> tuple[str, nn.Module]:
    """The one layer ``layer`` selects (a name, a glob, a module or a module type) and its name in the model; a clear
    error where it selects several (a glob or a type would otherwise silently mean the first of them)."""
    found = find_layers(model, layer)
    if len(found) != 1:
        names = ", ".join(name for name, _ in found[:6]) + (" …" if len(found) > 6 else "")
        raise ValueError(f"{caller} reads the concepts of one layer; {layer!r} selects {len(found)}: {names}. Give "
                         "one layer's name.")
    return found[0]


def _layer_output(model: nn.Module, layer: nn.Module, name: str, batch: Tensor) -> Tensor:
    """``layer``'s output (detached, a copy: an in-place operation after the layer cannot change it) in one forward
    pass of ``model`` on ``batch`` in eval mode without a graph; another thread's forward passes are not seen. A clear
    error where the layer does not run exactly once or returns no tensor."""
    owner = threading.get_ident()
    store: list[Any] = []

    def on_output(_module: nn.Module, _args: Any, output: Any) -> None:
        if threading.get_ident() == owner:
            store.append(output.detach().clone() if isinstance(output, Tensor) else output)

    handle = layer.register_forward_hook(on_output)
    try:
        with torch.no_grad(), preserved_model_state(model):
            run_model(model, batch)
    finally:
        handle.remove()
    if len(store) != 1:
        raise ValueError(f"layer {name} runs {len(store)} times in one forward pass: give a layer that runs once.")
    if not isinstance(store[0], Tensor):
        raise ValueError(_not_features(name, store[0], model))
    return store[0]


def _not_features(name: str, output: Any, model: nn.Module) -> str:
    """Why layer ``name``'s ``output`` (not a tensor) holds no concepts, naming the modules inside it to give."""
    inside = [child for child, _ in model.named_modules() if child.startswith(name + ".")] if name else []
    hint = (f" (inside it: {', '.join(inside[:6])}{' …' if len(inside) > 6 else ''})" if inside else "")
    return (f"layer {name} returns {type(output).__name__}, not a tensor of features: give the module whose output "
            f"holds the concepts{hint}, or the block around it (`explain layers`).")


BYPASS_IN_MAPS = ("Each conditional map includes that relevance, so the concepts' maps do not add up to the "
                  "unconditional map; to keep only what flowed through a concept, subtract "
                  "diagnostics['bypass_attributions'] from its attributions (not diagnostics['bypass_map'] from its "
                  "map: a map is Σ |relevance| over colour channels, which does not subtract)")
"""What relevance around the layer does to ``ConceptRelevance.explain``'s maps (its warning)."""


class ConceptRelevance:
    """CRP conditional heatmaps of a layer's concepts, by LRP or AttnLRP.

    model: a module or ``explain.load_model``'s result. layer: the layer whose output holds the concepts (a name
    of ``model.named_modules()``, the module itself, or a glob or module type that selects exactly one layer).
    method: "auto" (default: AttnLRP for a model with layer norms or attention, a transformer's, else LRP;
    ``relevance_method_for``), "lrp" or "attnlrp", or an LRP / AttnLRP explainer built on the model (its composite and
    options are used). channel_dim: the dimension of the layer's output that indexes the
    concepts (None: 1 for (N, C, ...) feature maps and (N, D) vectors, the last for (N, T, D) tokens and for
    (N, h, w, C) channels-last maps such as Swin's stages; 0, the batch, is refused).
    directions: None (each channel is a concept) or (K, C) orthonormal rows, each a concept (see the module
    docstring). batch_size: conditions (image × concept) per backward pass. method_options: options of the method
    named.
    """

    def __init__(self, model: Union[nn.Module, LoadedModel], layer: LayerSpec, method: Union[str, Explainer] = "auto",
                 *, channel_dim: Optional[int] = None, directions: Optional[Tensor] = None, batch_size: int = 16,
                 **method_options: Any):
        if isinstance(method, str) and method == "auto":
            method = relevance_method_for(model)
        if isinstance(method, str):
            explainer = get_method(method)(model, **method_options)
        else:
            if method_options:
                raise ValueError("give the method's options when you build the explainer, not to ConceptRelevance.")
            explainer = method
        if not isinstance(explainer, (LRP, AttnLRP)):
            raise ValueError(f"CRP propagates relevance with LRP or AttnLRP; got {type(explainer).__name__}. Give "
                             "method='lrp', method='attnlrp' or such an explainer.")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a whole number ≥ 1; got {batch_size!r}.")
        self.explainer = explainer
        self.model = explainer.model
        self.layer_name, self.layer = _one_layer(self.model, layer, "ConceptRelevance")
        self.channel_dim = channel_dim
        self.directions = None if directions is None else _orthonormal_rows(directions)
        """(K, C) float64 on the CPU, or None (the channels are the concepts)."""
        self.batch_size = batch_size
        self._this_thread = threading.local()  # per calling thread: whether the layer ran in the last pass
        self.relevance_is_gradient_times_activation = isinstance(explainer, AttnLRP)
        """AttnLRP's backward carries gradients (relevance = activation ⊙ gradient); LRP's carries relevance."""

    # ------------------------------------------------------------------ the layer's relevance, masked or read

    def _channel_dim(self, output: Tensor) -> int:
        return _concept_dim(output, self.channel_dim, self.layer, self.layer_name)

    @contextmanager
    def _at_layer(self, masks: Optional[Tensor], recorded: list[Tensor]) -> Iterator[None]:
        """While inside: the layer's output in graph-building forwards passes back, per row r, only the relevance of
        the channels ``masks[r]`` (R, C) keeps (None: all), and the relevance per channel (R, C) it received is
        appended to ``recorded``."""

        owner = threading.get_ident()  # another thread's forward passes on the model run it unchanged
        self._this_thread.layer_ran = False  # read by layer_relevance: did the layer run at all?

        refused: list[ValueError] = []  # raised inside the model's forward, which would wrap it as the input's fault

        def on_output(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, Tensor):
                refused.append(ValueError(_not_features(self.layer_name, output, self.model)))
                raise refused[-1]
            if not output.requires_grad:
                return
            dim = self._channel_dim(output)
            # read by the directions' rule and AttnLRP's R = a ⊙ g: a copy, which an in-place operation after the
            # layer (ReLU(inplace=True)) cannot change
            needs_activation = self.directions is not None or self.relevance_is_gradient_times_activation
            activation = output.detach().clone() if needs_activation else output.detach()
            if self.directions is not None and output.shape[dim] != self.directions.shape[1]:
                raise LayerOutputError(f"the directions have {self.directions.shape[1]} values but layer "
                                       f"{self.layer_name}'s output {tuple(output.shape)} has {output.shape[dim]} "
                                       f"channels along dimension {dim}: give directions of that length, or "
                                       "channel_dim=.")
            concepts = output.shape[dim] if self.directions is None else self.directions.shape[0]
            if masks is not None and (output.shape[0] != masks.shape[0] or concepts != masks.shape[1]):
                raise ValueError(f"layer {self.layer_name}'s output {tuple(output.shape)} has no {masks.shape[1]} "
                                 f"concepts along dimension {dim} for {masks.shape[0]} rows: give channel_dim=.")
            shape = [1] * output.dim()
            shape[0], shape[dim] = output.shape[0], output.shape[dim]

            def on_relevance(flowing: Tensor) -> Tensor:
                if self.directions is not None:
                    return self._along_directions(flowing, activation, dim, masks, recorded)
                relevance = flowing * activation if self.relevance_is_gradient_times_activation else flowing
                others = [axis for axis in range(relevance.dim()) if axis not in (0, dim)]
                per_channel = relevance.double().sum(dim=others) if others else relevance.double()
                recorded.append(per_channel.detach())
                if masks is None:
                    return flowing
                return flowing * masks.to(flowing.dtype).view(shape)

            output.register_hook(on_relevance)

        # the output hook is added when the layer starts running, after the method's own hooks (AttnLRP replaces an
        # activation's output with its rule's): it sees the output the rest of the model reads
        pending: list[Any] = []

        def on_output_last(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() != owner:
                return
            while pending:
                pending.pop().remove()
            on_output(module, args, output)

        def before_layer(module: nn.Module, args: Any) -> None:
            if threading.get_ident() == owner:
                self._this_thread.layer_ran = True
                pending.append(module.register_forward_hook(on_output_last))

        handle = self.layer.register_forward_pre_hook(before_layer)
        try:
            yield
        except Exception:
            if refused:
                raise refused[0] from None
            raise
        finally:
            handle.remove()
            while pending:
                pending.pop().remove()

    def _along_directions(self, flowing: Tensor, activation: Tensor, dim: int, masks: Optional[Tensor],
                          recorded: list[Tensor]) -> Tensor:
        """The virtual inspection layer's relevance (module docstring): records (R, K) R_k = Σ (u_k · a)(u_k · c) and
        returns, per row r, what flows on with the relevance kept on the directions ``masks[r]`` (None: all)."""
        assert self.directions is not None
        directions = self.directions.to(flowing.device)
        moved_flowing, moved_activation = flowing.movedim(dim, -1).double(), activation.movedim(dim, -1).double()
        if self.relevance_is_gradient_times_activation:
            per_unit = moved_flowing
        else:  # LRP carries relevance R = a ⊙ c; a unit with a = 0 passes none on (LRP-0's stabilised 0 / 0)
            nonzero = moved_activation != 0
            per_unit = torch.where(nonzero, moved_flowing / torch.where(nonzero, moved_activation, 1.0), 0.0)
        along = per_unit @ directions.T  # (R, ..., K): u_k · c
        projected = moved_activation @ directions.T  # u_k · a
        recorded.append((projected * along).reshape(along.shape[0], -1, along.shape[-1]).sum(dim=1).detach())
        if masks is None:
            return flowing
        keep = masks.to(along).view(masks.shape[0], *[1] * (along.dim() - 2), masks.shape[1])
        passed = (along * keep) @ directions  # Σ_k mask_k u_k (u_k · c)
        if not self.relevance_is_gradient_times_activation:
            passed = passed * moved_activation
        return passed.movedim(-1, dim).to(flowing.dtype)

    # ------------------------------------------------------------------ the call

    def explain(self, inputs: Inputs, target: Target = None, concepts: ConceptSpec = 5, *,
                bypass: bool = True) -> Explanation:
        """Conditional heatmaps of the concepts of ``layer`` for the prediction ``target`` (None: each image's top
        class; an int or one int per image).

        Returns an Explanation whose maps are (N, M, H, W), one per concept, normalised like the method's; its
        ``class_indices`` (N, M) are the concepts' channels and ``scores`` (N, M) their relevance R_c at the layer
        (most relevant first when ``concepts`` is an int); ``attributions`` (N, M, C, H, W) the conditional input
        relevance. ``diagnostics``: "layer_relevance" (N, C) every channel's R_c, "explained_class" (N,),
        "explained_score" (N,), "unconditional_map" (N, H, W) the method's raw map without a condition, and with
        ``bypass`` (one more row per image) "bypass_map" (N, H, W): the relevance that reaches the input around the
        layer (with every concept masked), 0 where every path from the input to the score goes through the layer,
        and "bypass_attributions" (N, C, H, W), that relevance before the map's reduction over colour channels (what
        to subtract from ``attributions``: a map of |relevance| does not subtract).
        Where it is not 0 (the layer is inside a residual branch) every conditional map includes it, the maps of all
        concepts do not add up to the unconditional map, and a warning says so.
        """
        recorded: list[Tensor] = []
        with self._at_layer(None, recorded):
            unconditional = self.explainer.explain(inputs, target=target)
        if unconditional.class_indices is None or unconditional.class_indices.shape[1] != 1:
            raise ValueError("CRP explains one class per image: give target=None, an int or one int per image.")
        layer_relevance = self.layer_relevance(recorded)  # (N, C)
        classes = unconditional.class_indices[:, 0]
        count, channels = layer_relevance.shape
        chosen = self._concepts(concepts, layer_relevance)  # (N, M)
        if is_whole_number(concepts):
            _warn_about_empty_concepts(layer_relevance, chosen, unconditional.scores[:, 0].cpu())
        per_image = chosen.shape[1]
        rows_image = torch.arange(count).repeat_interleave(per_image)
        rows_concept = chosen.reshape(-1)
        batch = self._prepared(inputs)
        maps, raw_maps, attributions = self.conditional(batch, rows_image, rows_concept, classes[rows_image],
                                                        channels)
        diagnostics: dict[str, Diagnostic] = {"layer_relevance": layer_relevance, "explained_class": classes.cpu(),
                       "explained_score": unconditional.scores[:, 0].cpu(),
                       "unconditional_map": unconditional.raw_map_grid[:, 0].cpu()}
        if bypass:
            bypass_map, bypass_attributions = self._bypass(batch, classes, channels, unconditional, stacklevel=2,
                                                           consequence=BYPASS_IN_MAPS)
            diagnostics["bypass_map"] = bypass_map.cpu()
            if bypass_attributions is not None:
                diagnostics["bypass_attributions"] = bypass_attributions.cpu()
        height, width = unconditional.map_grid.shape[-2:]
        return Explanation(
            map_grid=maps.view(count, per_image, height, width),
            raw_map_grid=raw_maps.view(count, per_image, height, width),
            scores=layer_relevance.gather(1, chosen).float(),
            class_indices=chosen,
            display=unconditional.display,
            method=f"CRP ({unconditional.method})",
            layer=self.layer_name,
            keep_target_dim=True,
            attributions=None if attributions is None else attributions.view(count, per_image,
                                                                              *attributions.shape[1:]),
            diagnostics=diagnostics,
            class_names=["concept"] * channels,
        )

    def bypass(self, batch: Tensor, classes: Tensor, channels: int, unconditional: Explanation, *,
               stacklevel: int = 2, consequence: str = BYPASS_IN_MAPS) -> Tensor:
        """(N, H, W) raw maps of the relevance that reaches the input around the layer: the model-input ``batch``
        explained for ``classes`` with every concept masked (one row per image; 0 where every path from the input to
        the score goes through the layer). Where it is not 0 against ``unconditional`` (the same call without a
        condition), a RuntimeWarning says so, with ``consequence``, pointing ``stacklevel`` frames above the caller
        (1: the caller's line, as ``warnings.warn`` counts)."""
        return self._bypass(batch, classes, channels, unconditional, stacklevel=stacklevel + 1,
                            consequence=consequence)[0]

    def _bypass(self, batch: Tensor, classes: Tensor, channels: int, unconditional: Explanation, *, stacklevel: int,
                consequence: str) -> tuple[Tensor, Optional[Tensor]]:
        """``bypass``'s raw maps (N, H, W) and the signed relevance they are made of, (N, C, H, W) (None where the
        method gives no attributions)."""
        count = batch.shape[0]
        _, maps, attributions = self.conditional(batch, torch.arange(count), torch.full((count,), -1), classes,
                                                 channels)  # its maps are empty where all is well: not warned of
        bypassing = maps if attributions is None else attributions
        reference = unconditional.attributions[:, 0] if unconditional.attributions is not None \
            else unconditional.raw_map_grid[:, 0]
        largest = float(reference.abs().max())
        share = float(bypassing.abs().max()) / largest if largest > 0 else 0.0
        if share > 1e-6:
            warnings.warn(f"layer {self.layer_name} does not carry all the relevance: with every concept masked, "
                          f"relevance still reaches the input around it (a skip connection; up to {share:.3g} of the "
                          f"unconditional map's largest value). {consequence}: choose a layer every path goes through "
                          "(a residual block's output).", RuntimeWarning, stacklevel=stacklevel + 1)
        return maps, attributions

    def layer_relevance(self, recorded: list[Tensor]) -> Tensor:
        """(N, C) the relevance per channel that one unconditional pass recorded at the layer (``_at_layer``), on
        the CPU; a clear error where the layer received none or ran more than once."""
        if not recorded and getattr(self._this_thread, "layer_ran", True) is False:
            raise ValueError(f"layer {self.layer_name} did not run in the model's forward pass (a module the forward "
                             "never calls, such as an auxiliary head that runs in training only: explanations run "
                             "the model in eval mode): give a layer the prediction is computed through "
                             "(`explain layers`).")
        if not recorded:
            raise ValueError(f"layer {self.layer_name}'s output received no relevance: it is not on the path from "
                             "the input to the score, or only on a path the method's rules pass no relevance along "
                             "(a gate, such as a squeeze-and-excitation block's fc layers or a sigmoid gate, whose "
                             "product the rules treat as a constant weight). Give a layer on the main path (the SE "
                             "block's output, the block's output: `explain layers`).")
        if len(recorded) > 1:  # one forward pass, so the layer ran several times (a shared module)
            raise ValueError(f"layer {self.layer_name} runs {len(recorded)} times in one forward pass (a module "
                             "shared between places): its concepts are ambiguous. Give a layer that runs once.")
        return recorded[0].cpu()

    def conditional(self, batch: Tensor, rows_image: Tensor, rows_concept: Tensor, rows_class: Tensor,
                    channels: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The conditional maps of R (image, concept) rows: row r is image ``rows_image[r]`` of the model-input
        ``batch`` explained for class ``rows_class[r]`` with the relevance at the layer kept on channel
        ``rows_concept[r]`` (of ``channels``; -1: on none), ``batch_size`` rows per pass. Returns (maps (R, H, W)
        normalised like the method's, raw maps (R, H, W), attributions (R, C, H, W) or None)."""
        maps, raw_maps, attributions = [], [], []
        state = self.explainer._thread_state
        expected_before = getattr(state, "empty_maps_expected", False)
        # a concept that carried no relevance (a channel a ReLU silenced for this image: R_c = 0) has a map that is
        # 0 everywhere, as it should; the explainer's warning about empty maps (which blames the model's weights and
        # counts rows of this batch, not the caller's images) is for the unconditional pass
        state.empty_maps_expected = True
        try:
            for start in range(0, rows_image.shape[0], self.batch_size):
                images = rows_image[start:start + self.batch_size]
                concepts = rows_concept[start:start + self.batch_size].cpu()
                masks = torch.nn.functional.one_hot(concepts.clamp_min(0), channels) * (concepts >= 0)[:, None]
                with self._at_layer(masks.to(batch.device), []):
                    conditional = self.explainer.explain(batch[images.to(batch.device)],
                                                         target=rows_class[start:start + self.batch_size].tolist())
                maps.append(conditional.map_grid[:, 0])
                raw_maps.append(conditional.raw_map_grid[:, 0])
                if conditional.attributions is not None:
                    attributions.append(conditional.attributions[:, 0])
        finally:
            state.empty_maps_expected = expected_before
        return torch.cat(maps), torch.cat(raw_maps), torch.cat(attributions) if attributions else None

    def _prepared(self, inputs: Inputs) -> Tensor:
        """The model-input batch the explainer builds from ``inputs`` (its preprocessing), for the repeated rows."""
        return prepare_inputs(inputs, self.explainer.preprocess, model_device(self.model),
                              model_dtype(self.model), channels=model_input_channels(self.model)).batch

    @staticmethod
    def _concepts(concepts: ConceptSpec, layer_relevance: Tensor) -> Tensor:
        """(N, M) channel indices of the concepts to map."""
        count, channels = layer_relevance.shape
        if concepts is None:
            return torch.arange(channels).expand(count, -1).clone()
        if is_whole_number(concepts):
            number = int(concepts)  # type: ignore[arg-type]
            if not 1 <= number <= channels:
                raise ValueError(f"concepts={number}: the layer has {channels} concepts; give 1 to {channels}.")
            return layer_relevance.topk(number, dim=1).indices
        chosen = _concept_indices(concepts, channels)
        if chosen.dim() == 1:
            chosen = chosen.expand(count, -1).clone()
        if chosen.dim() != 2 or chosen.shape[0] != count or chosen.shape[1] == 0:
            raise ValueError(f"concepts must be an int, (M,) channel indices or (N, M) per image for {count} images; "
                             f"got shape {tuple(chosen.shape)}.")
        return chosen


def _warn_about_empty_concepts(layer_relevance: Tensor, chosen: Tensor, scores: Tensor) -> None:
    """Warn where the most relevant concepts of an image (``chosen``, (N, M), by signed R_c) include channels with
    R_c = 0 while other channels carry relevance: fewer than M channels have positive relevance (as when the score
    explained is negative), so those concepts' maps are zero everywhere, not evidence."""
    relevance = layer_relevance.gather(1, chosen.to(layer_relevance.device))
    empty = (relevance == 0).any(dim=1) & (layer_relevance != 0).any(dim=1)
    if not bool(empty.any()):
        return
    images = empty.nonzero().flatten().tolist()
    listed = ", ".join(f"image {n} (score {float(scores[n]):.3g}, {int((layer_relevance[n] > 0).sum())} channel(s) "
                       "with positive relevance)" for n in images[:6]) + (" and more" if len(images) > 6 else "")
    warn_at_callers_line(
        f"CRP: among the most relevant concepts of {listed} are channels with no relevance (R_c = 0), whose maps are "
        "zero everywhere: fewer channels than asked for carry positive relevance (most do when the score explained "
        "is negative). Explain a class with a positive score (target=), give fewer concepts, or give the channels "
        "(concepts=[...]); diagnostics['layer_relevance'] holds every channel's R_c.", RuntimeWarning)


def _concept_indices(concepts: Any, channels: Optional[int]) -> Tensor:
    """``concepts`` (channel indices: a list, an array, a tensor) as a long CPU tensor of the same shape, refused
    where a value is not a whole number (a float such as 1.7 would be truncated to another channel silently; a
    boolean mask would be read as the indices 0 and 1) or not a channel of the layer's ``channels`` (None: not known
    yet, not checked)."""
    if isinstance(concepts, (str, bytes)):
        raise ValueError(f"concepts={concepts!r} is text; give the channels' indices as numbers, e.g. [3, 7].")
    try:
        values = torch.as_tensor(concepts.detach().cpu() if isinstance(concepts, Tensor) else concepts)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"concepts={concepts!r} is not channel indices ({error}); give whole numbers, e.g. "
                         "[3, 7], or (N, M) per image.") from None
    if values.numel() == 0:
        raise ValueError("concepts is empty: give the channels' indices, an int k (the k most relevant) or None "
                         "(every channel).")
    if values.dtype == torch.bool:
        raise ValueError("concepts is a boolean mask; give the channels' indices, e.g. mask.nonzero().flatten() "
                         "(True at channel c is the index c, not 1).")
    if values.is_floating_point() or values.is_complex():
        if bool(torch.isfinite(values).all()) and bool((values == values.round()).all()):
            values = values.long()  # 3.0 is channel 3
        else:
            raise ValueError(f"concept indices must be whole numbers (channel indices); got {values.tolist()}.")
    values = values.long()
    if values.dim() == 0:
        raise ValueError(f"concepts={concepts!r}: give an int k (the k most relevant concepts) or the channels' "
                         f"indices as a list (channel {int(values)}: [{int(values)}]).")
    if channels is None and bool((values < 0).any()):
        raise ValueError(f"concept indices must be ≥ 0 (channel indices); got {values.min().item()}.")
    if channels is not None and bool(((values < 0) | (values >= channels)).any()):
        raise ValueError(f"concept indices must be in 0 … {channels - 1} (the layer's concepts: its channels, or "
                         f"the directions given); got {values.min().item()} … {values.max().item()}.")
    return values


def principal_directions(model: Union[nn.Module, LoadedModel], layer: LayerSpec, images: Inputs, count: int = 8, *,
                         channel_dim: Optional[int] = None, preprocess: Any = None) -> Tensor:
    """The ``count`` principal directions (K, C) of ``layer``'s features over ``images``: the right singular vectors of
    the centred (positions × channels) matrix of every image's every position (tokens, pixels of a feature map),
    largest variance first, orthonormal rows, each signed so that the features' mean projection on it is ≥ 0; on the
    CPU in float64. For ``ConceptRelevance(..., directions=...)``: concepts that are directions of a transformer
    block's features rather than single neurons. count: 1 to C, and at most P − 1 for P positions in all (what
    their centred features span). channel_dim as in ConceptRelevance."""
    module, loaded_preprocess, _, _ = loaded_model_parts(model)
    layer, target = _one_layer(module, layer, "principal_directions")
    batch = prepare_inputs(images, as_preprocess(preprocess if preprocess is not None else loaded_preprocess),
                           model_device(module), model_dtype(module), channels=model_input_channels(module)).batch
    output = _layer_output(module, target, layer, batch)
    dim = _concept_dim(output, channel_dim, target, layer)
    features = output.movedim(dim, -1).reshape(-1, output.shape[dim]).double().cpu()
    positions, channels = features.shape
    if not isinstance(count, numbers.Integral) or isinstance(count, bool) or not 1 <= count <= channels:
        raise ValueError(f"count must be 1 to {channels} (the layer's channels); got {count!r}.")
    if count > positions - 1:
        raise ValueError(f"count={count}: the layer's features over these images are {positions} positions (images × "
                         f"positions per image), whose centred values span at most {positions - 1} directions; give "
                         f"more images or count ≤ {max(positions - 1, 0)}.")
    count = int(count)
    _, _, right = torch.linalg.svd(features - features.mean(dim=0), full_matrices=False)
    directions = right[:count]
    signs = torch.where(features.mean(dim=0) @ directions.T < 0, -1.0, 1.0).to(directions)
    return directions * signs[:, None]


# ------------------------------------------------------------------ reference images (relevance maximisation)


@dataclass
class ConceptReferences:
    """For each concept of a layer, the images of a set where it was most relevant (or most active), best first.

    layer: the layer. concepts: (M,) channel indices. images: (M, top) indices into the set given. values: (M, top)
    the concept's relevance R_c for the image's predicted class ("relevance"), or its largest activation
    ("activation"). patches: M lists of (h, w, 3) uint8 RGB crops: the part of the image where the concept's
    conditional heatmap (or its activation, upsampled) reaches half its peak, with a margin of an eighth of its
    size (2 pixels at least). mode: "relevance" or "activation".
    """

    layer: str
    concepts: Tensor
    images: Tensor
    values: Tensor
    patches: list[list[np.ndarray]]
    mode: str

    def of(self, concept: int) -> list[np.ndarray]:
        """The reference patches of channel ``concept``."""
        where = (self.concepts == concept).nonzero()
        if len(where) == 0:
            raise KeyError(f"concept {concept} has no references here (the references hold {self.concepts.tolist()}).")
        return self.patches[int(where[0, 0])]


def _crop(image: np.ndarray, heat: Tensor, share: float = 0.5) -> np.ndarray:
    """The bounding box of the pixels of ``heat`` (H, W) at ``share`` of its peak or above, cut out of ``image``
    (H, W, 3) uint8 (the whole image where the heat has no positive peak)."""
    peak = float(heat.max())
    if peak <= 0:
        return image
    rows, columns = (heat >= share * peak).nonzero(as_tuple=True)
    top, bottom = int(rows.min()), int(rows.max()) + 1
    left, right = int(columns.min()), int(columns.max()) + 1
    margin = max(2, (bottom - top + right - left) // 8)  # some context around the region
    height, width = heat.shape
    return image[max(0, top - margin):min(height, bottom + margin), max(0, left - margin):min(width, right + margin)]


def _uint8(images: Tensor) -> np.ndarray:
    return (images.clamp(0, 1) * 255).round().byte().cpu().numpy()


def concept_references(crp: ConceptRelevance, images: Sequence[Any], concepts: ConceptSpec = None, *, top: int = 6,
                       mode: str = "relevance", batch_size: int = 32) -> ConceptReferences:
    """Relevance maximisation (Achtibat et al. 2023): for each concept of ``crp``'s layer, the ``top`` images of
    ``images`` (anything ``explain()`` accepts, one item per image) where it carried the most relevance for the
    image's own predicted class ("relevance"), or was most active ("activation", activation maximisation for
    comparison), and the patch where it looked. concepts: channel indices, or None for all. images may also be one
    path, a folder (its image files, sorted by name), an (N, C, H, W) tensor or an (N, H, W, 3) array. top: ≥ 1 (at
    most the number of images); batch_size: images per pass, ≥ 1."""
    if mode not in ("relevance", "activation"):
        raise ValueError(f"mode must be 'relevance' or 'activation'; got {mode!r}.")
    for name, value in (("top", top), ("batch_size", batch_size)):
        if not is_whole_number(value) or int(value) < 1:
            raise ValueError(f"{name} must be a whole number ≥ 1; got {value!r}.")
    top, batch_size = int(top), int(batch_size)
    items = _reference_items(images)
    if not items:
        raise ValueError("give at least one image.")
    if concepts is not None and is_whole_number(concepts):
        raise ValueError(f"concepts={concepts!r}: concept_references takes the channels' indices (a list), or None "
                         "for all; for the k most relevant of an image, pass crp.explain(image, concepts=k)"
                         ".class_indices[0].tolist().")
    if concepts is not None:
        _concept_indices(concepts, channels=None)  # whole numbers, not empty: said before the set runs
    values: list[Tensor] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        if mode == "relevance":
            recorded: list[Tensor] = []
            with crp._at_layer(None, recorded):
                unconditional = crp.explainer.explain(chunk)
            values.append(crp.layer_relevance(recorded))
            if start == 0:  # the patches are conditional heatmaps: say if they include relevance around the layer
                assert unconditional.class_indices is not None, "class targets"
                crp.bypass(crp._prepared(chunk), unconditional.class_indices[:, 0], values[0].shape[1],
                           unconditional, stacklevel=2, consequence="The references' patches include that relevance")
        else:
            batch = crp._prepared(chunk)
            output = _layer_output(crp.model, crp.layer, crp.layer_name, batch)
            _spatial_layout(crp, output, batch.shape[-2:])  # a layer without one is refused before the set runs
            values.append(_largest_of(crp, output, batch.shape[-2:]))
    every = torch.cat(values)  # (N, C)
    channels = every.shape[1]
    chosen = torch.arange(channels) if concepts is None else _concept_indices(concepts, channels).flatten()
    count = min(top, len(items))
    best = every[:, chosen].topk(count, dim=0)  # (count, M)
    indices, best_values = best.indices.T, best.values.T.float()
    patches: list[list[np.ndarray]] = []
    for row, concept in enumerate(chosen.tolist()):
        picked = [items[int(index)] for index in indices[row]]
        if mode == "relevance":
            explanation = crp.explain(picked, concepts=[concept], bypass=False)
            heats = explanation.raw_maps[:, 0] if explanation.raw_maps.dim() == 4 else explanation.raw_maps
            pictures = _uint8(explanation.images)
        else:
            batch = crp._prepared(picked)
            heats = _activation_maps(crp, batch, torch.arange(len(picked)), torch.full((len(picked),), concept))
            pictures = _uint8(prepare_inputs(picked, crp.explainer.preprocess, torch.device("cpu"),
                                             torch.float32).display.get())
        patches.append([_crop(picture, heat.cpu()) for picture, heat in zip(pictures, heats)])
    return ConceptReferences(crp.layer_name, chosen, indices, best_values, patches, mode)


def _reference_items(images: Any) -> list[Any]:
    """The images of a reference set, one item each: a list as given; one path, or a folder's image files
    (``folder_images``: sorted, sub-folders included, hidden files left out); the images of an (N, C, H, W) tensor
    or an (N, H, W, 3) array (a string is not iterated character by character)."""
    if isinstance(images, (str, os.PathLike)):
        path = Path(images)
        if path.is_dir():
            return [str(file) for file in folder_images(path)]
        return [images]
    if isinstance(images, Tensor) and images.dim() == 4:
        return list(images.unbind(0))
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    if isinstance(images, (Tensor, np.ndarray, Image.Image)):
        return [images]
    return list(images)


def _concept_activations(crp: ConceptRelevance, output: Tensor) -> Tensor:
    """The layer's output with the concepts along dimension 1: its channels, or its projections u_k · a on the
    directions."""
    moved = output.movedim(crp._channel_dim(output), -1)
    if crp.directions is not None:
        moved = moved.double() @ crp.directions.to(moved.device).T
    return moved.movedim(-1, 1)


def _largest_activations(crp: ConceptRelevance, batch: Tensor) -> Tensor:
    """(N, K) each concept's largest activation in each image (over its patch tokens for tokens; a vector layer's
    value)."""
    output = _layer_output(crp.model, crp.layer, crp.layer_name, batch)
    return _largest_of(crp, output, batch.shape[-2:])


def _largest_of(crp: ConceptRelevance, output: Tensor, input_size: Sequence[int]) -> Tensor:
    """(N, K) each concept's largest activation in each image of the layer's ``output``: over the positions of a
    feature map, over the patch tokens of tokens (where they lie on the image, as the activation maps show them),
    the value of a vector."""
    if output.dim() == 3:
        grid = _spatial_layout(crp, output, input_size).apply(output)  # (N, D, h, w): the patch tokens
        output = grid.flatten(2).movedim(1, -1)  # (N, h·w, D)
        if crp.directions is not None:
            output = output.double() @ crp.directions.to(output.device).T
        return output.amax(dim=1).double().cpu()
    output = _concept_activations(crp, output)
    return output.flatten(2).amax(dim=2).double().cpu() if output.dim() > 2 else output.double().cpu()


def _spatial_layout(crp: ConceptRelevance, output: Tensor, input_size: Sequence[int]) -> Layout:
    """How the layer's output lies on the image: feature maps (N, C, h, w) or (N, h, w, C), or tokens (N, T, D) whose
    patch tokens form the patch embedding's grid (``explain.core.layouts``); a clear error for anything else."""
    if output.dim() not in (3, 4):
        raise ValueError(f"activation references crop feature maps or patch tokens; layer {crp.layer_name} gives "
                         f"{tuple(output.shape)}: use mode='relevance'.")
    return infer_layout(output, input_size, name=crp.layer_name, module=crp.layer, model=crp.model)


def _activation_maps(crp: ConceptRelevance, batch: Tensor, rows: Tensor, concepts: Tensor) -> Tensor:
    """(R, H, W) concept ``concepts[r]`` of image ``rows[r]`` of ``batch``'s layer output on the image: a feature
    map's channel (or direction), or the patch tokens' values on their grid, bilinear to the input's size (0 on
    pixels no patch covers); one forward pass."""
    output = _layer_output(crp.model, crp.layer, crp.layer_name, batch)
    layout = _spatial_layout(crp, output, batch.shape[-2:])
    grid = layout.apply(output)  # (N, C, h, w)
    if crp.directions is not None:
        grid = (grid.movedim(1, -1).double() @ crp.directions.to(grid.device).T).movedim(-1, 1)
    chosen = grid[rows.to(grid.device), concepts.to(grid.device)][:, None].float()
    placed = layout.to_input(chosen, batch.shape[-2:])
    if placed.shape[-2:] == batch.shape[-2:]:
        return placed[:, 0]
    return torch.nn.functional.interpolate(placed, size=batch.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


class ReferencePatches(Protocol):
    """What holds reference patches per concept: ``ConceptReferences``, or a concept atlas
    (``explain.dataset_tools.concept_atlas.Atlas``, read from its files)."""

    def of(self, concept: int) -> list[np.ndarray]: ...


def _check_references_layer(references: Optional[ReferencePatches], layer: Any) -> None:
    """Refuse reference patches of another layer than the explanation's (``ConceptReferences.layer``, an atlas's
    entries["layer"]): its channel c is another feature, and its patches would be drawn as this concept's."""
    theirs = getattr(references, "layer", None)
    if theirs is None:
        entries = getattr(references, "entries", None)
        theirs = entries.get("layer") if isinstance(entries, dict) else None
    if isinstance(theirs, str) and isinstance(layer, str) and theirs != layer:
        raise ValueError(f"the references are of layer {theirs} but the explanation's concepts are of layer {layer}: "
                         "channel c of one layer is another feature than channel c of the other. Give references "
                         "of the explanation's layer (concept_references with the same ConceptRelevance).")


def glocal_figure(explanation: Explanation, references: Optional[ReferencePatches] = None, image: int = 0,
                  patches: int = 4) -> Any:
    """The "glocal" figure of CRP: image ``image`` and, for each of its concepts in ``explanation``
    (``ConceptRelevance.explain``'s), a row with the concept's conditional heatmap, its relevance, and up to
    ``patches`` reference patches from ``references`` (``concept_references``, or a concept atlas). A matplotlib
    figure."""
    import matplotlib.pyplot as plt

    from ..io import render

    if (explanation.class_indices is None or explanation.class_indices.dim() != 2
            or "explained_class" not in explanation.diagnostics or not explanation.method.startswith("CRP")):
        raise ValueError(f"glocal_figure draws ConceptRelevance.explain's result (a map per concept); got "
                         f"{explanation.method}'s. Explain with explain.ConceptRelevance(model, layer).explain(...).")
    count = explanation.class_indices.shape[0]
    if not is_whole_number(image) or not -count <= int(image) < count:
        raise ValueError(f"image={image!r}: the explanation holds {count} image(s); give 0 to {count - 1}.")
    if not is_whole_number(patches) or int(patches) < 0:
        raise ValueError(f"patches must be a whole number ≥ 0 (reference patches per row); got {patches!r}.")
    image, patches = int(image), int(patches)
    _check_references_layer(references, explanation.layer)
    concepts = explanation.class_indices[image].tolist()
    columns = 2 + (patches if references is not None else 0)
    figure, axes = plt.subplots(len(concepts), columns, figsize=(1.8 * columns, 1.8 * len(concepts)), squeeze=False)
    picture = explanation.images[image].numpy()
    drawn, colour_map = render.as_drawn(explanation.map_grid[image].cpu(), "jet")
    for row, concept in enumerate(concepts):
        axes[row, 0].imshow(picture)
        axes[row, 0].set_title("image" if row == 0 else "", fontsize=8)
        axes[row, 1].imshow(picture)
        axes[row, 1].imshow(drawn[row].numpy(), cmap=colour_map, vmin=0, vmax=1, alpha=0.6)
        axes[row, 1].set_title(f"concept {concept}: {float(explanation.scores[image, row]):.3g}", fontsize=8)
        if references is not None:
            try:
                crops = references.of(concept)
            except KeyError:
                crops = []
            for column in range(patches):
                if column < len(crops):
                    axes[row, 2 + column].imshow(crops[column])
            if patches and not crops:  # said, not a blank row that reads as patches not drawn yet
                axes[row, 2].text(0.5, 0.5, "no references", ha="center", va="center", fontsize=7,
                                  transform=axes[row, 2].transAxes)
        for axis in axes[row]:
            axis.axis("off")
    figure.suptitle(f"{explanation.description()}, class {int(explanation.diagnostics['explained_class'][image])}",
                    fontsize=9)
    figure.tight_layout()
    return figure
