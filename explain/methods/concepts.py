"""Concept Relevance Propagation (CRP; Achtibat et al., Nature Machine Intelligence 2023): what the model saw, not only
where.

A concept is a unit of a layer: a channel of a convolutional layer's (N, C, H, W) output, a neuron (feature) of a
transformer block's (N, T, D) tokens. CRP's conditional relevance R(x | θ) of a prediction for the concept c of layer
l is the relevance LRP (or AttnLRP) propagates to the input when, at layer l, the relevance is kept on channel c and
set to 0 on every other channel. One heatmap per concept says where that concept found its evidence; the concept's
relevance R_c (the layer's relevance summed over channel c) ranks the concepts for the prediction. The rules are
linear in the relevance they pass on, so the conditional maps of all concepts of a layer sum to the unconditional map
(conservation over concepts).

    crp = explain.ConceptRelevance(model, "layer3")                  # LRP, composite epsilon_plus by default
    e = crp.explain(image, concepts=4)                               # the 4 most relevant channels of layer3
    e.class_indices, e.scores                                        # (N, 4) their channels, their relevance R_c
    e.figure()                                                       # one conditional heatmap per concept

Many conditions go through one backward pass: the images are repeated once per concept (``batch_size`` rows per
pass) and each row's relevance is masked to its own concept, as zennit-crp's batched conditions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..core.capture import find_layers, model_device, model_dtype
from ..core.targets import Target
from ..io.explanation import Explanation
from ..io.inputs import Inputs, prepare_inputs
from ..io.loaded_model import LoadedModel
from .attnlrp import AttnLRP
from .base import Explainer
from .lrp import LRP
from .registry import get_method

ConceptSpec = Union[int, Sequence[int], Tensor, None]
"""Which concepts ``ConceptRelevance.explain`` maps: an int k (each image's k most relevant), channel indices for
every image ((M,) ints), (N, M) indices per image, or None (every channel of the layer)."""


class ConceptRelevance:
    """CRP conditional heatmaps of a layer's concepts, by LRP or AttnLRP.

    model: a module or ``explain.load_model``'s result. layer: the layer whose output holds the concepts (a name
    of ``model.named_modules()``). method: "lrp" or "attnlrp", or an LRP / AttnLRP explainer built on the model
    (its composite and options are used). channel_dim: the dimension of the layer's output that indexes the
    concepts (None: 1 for (N, C, ...) feature maps and (N, D) vectors, the last for (N, T, D) tokens).
    batch_size: conditions (image × concept) per backward pass. method_options: options of the method named.
    """

    def __init__(self, model: Union[nn.Module, LoadedModel], layer: str, method: Union[str, Explainer] = "lrp", *,
                 channel_dim: Optional[int] = None, batch_size: int = 16, **method_options: Any):
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
        self.layer_name = layer
        self.layer = find_layers(self.model, layer)[0][1]
        self.channel_dim = channel_dim
        self.batch_size = batch_size
        self.relevance_is_gradient_times_activation = isinstance(explainer, AttnLRP)
        """AttnLRP's backward carries gradients (relevance = activation ⊙ gradient); LRP's carries relevance."""

    # ------------------------------------------------------------------ the layer's relevance, masked or read

    def _channel_dim(self, output: Tensor) -> int:
        if self.channel_dim is not None:
            return self.channel_dim % output.dim()
        return output.dim() - 1 if output.dim() == 3 else 1

    @contextmanager
    def _at_layer(self, masks: Optional[Tensor], recorded: list[Tensor]) -> Iterator[None]:
        """While inside: the layer's output in graph-building forwards passes back, per row r, only the relevance of
        the channels ``masks[r]`` (R, C) keeps (None: all), and the relevance per channel (R, C) it received is
        appended to ``recorded``."""

        def on_output(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            dim = self._channel_dim(output)
            activation = output.detach()
            if masks is not None and (output.shape[0] != masks.shape[0] or output.shape[dim] != masks.shape[1]):
                raise ValueError(f"layer {self.layer_name}'s output {tuple(output.shape)} has no {masks.shape[1]} "
                                 f"concepts along dimension {dim} for {masks.shape[0]} rows: give channel_dim=.")
            shape = [1] * output.dim()
            shape[0], shape[dim] = output.shape[0], output.shape[dim]

            def on_relevance(flowing: Tensor) -> Tensor:
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
            while pending:
                pending.pop().remove()
            on_output(module, args, output)

        def before_layer(module: nn.Module, args: Any) -> None:
            pending.append(module.register_forward_hook(on_output_last))

        handle = self.layer.register_forward_pre_hook(before_layer)
        try:
            yield
        finally:
            handle.remove()
            while pending:
                pending.pop().remove()

    # ------------------------------------------------------------------ the call

    def explain(self, inputs: Inputs, target: Target = None, concepts: ConceptSpec = 5) -> Explanation:
        """Conditional heatmaps of the concepts of ``layer`` for the prediction ``target`` (None: each image's top
        class; an int or one int per image).

        Returns an Explanation whose maps are (N, M, H, W), one per concept, normalised like the method's; its
        ``class_indices`` (N, M) are the concepts' channels and ``scores`` (N, M) their relevance R_c at the layer
        (most relevant first when ``concepts`` is an int); ``attributions`` (N, M, C, H, W) the conditional input
        relevance. ``diagnostics``: "layer_relevance" (N, C) every channel's R_c, "explained_class" (N,),
        "explained_score" (N,), "unconditional_map" (N, H, W) the method's raw map without a condition.
        """
        recorded: list[Tensor] = []
        with self._at_layer(None, recorded):
            unconditional = self.explainer.explain(inputs, target=target)
        if unconditional.class_indices is None or unconditional.class_indices.shape[1] != 1:
            raise ValueError("CRP explains one class per image: give target=None, an int or one int per image.")
        if not recorded:
            raise ValueError(f"layer {self.layer_name} is not on the path from the input to the score (its output "
                             "received no relevance): give a layer the prediction depends on.")
        layer_relevance = recorded[-1].cpu()  # (N, C)
        classes = unconditional.class_indices[:, 0]
        count, channels = layer_relevance.shape
        chosen = self._concepts(concepts, layer_relevance)  # (N, M)
        per_image = chosen.shape[1]
        rows_image = torch.arange(count).repeat_interleave(per_image)
        rows_concept = chosen.reshape(-1)
        batch = self._prepared(inputs)
        maps, raw_maps, attributions = [], [], []
        for start in range(0, rows_image.shape[0], self.batch_size):
            images = rows_image[start:start + self.batch_size]
            masks = torch.nn.functional.one_hot(rows_concept[start:start + self.batch_size], channels)
            masks = masks.to(batch.device)
            with self._at_layer(masks, []):
                conditional = self.explainer.explain(batch[images.to(batch.device)],
                                                     target=classes[images].tolist())
            maps.append(conditional.map_grid[:, 0])
            raw_maps.append(conditional.raw_map_grid[:, 0])
            if conditional.attributions is not None:
                attributions.append(conditional.attributions[:, 0])
        height, width = unconditional.map_grid.shape[-2:]
        return Explanation(
            map_grid=torch.cat(maps).view(count, per_image, height, width),
            raw_map_grid=torch.cat(raw_maps).view(count, per_image, height, width),
            scores=layer_relevance.gather(1, chosen).float(),
            class_indices=chosen,
            display=unconditional.display,
            method=f"CRP ({unconditional.method})",
            layer=self.layer_name,
            keep_target_dim=True,
            attributions=torch.cat(attributions).view(count, per_image, *attributions[0].shape[1:])
            if attributions else None,
            diagnostics={"layer_relevance": layer_relevance, "explained_class": classes.cpu(),
                         "explained_score": unconditional.scores[:, 0].cpu(),
                         "unconditional_map": unconditional.raw_map_grid[:, 0].cpu()},
            class_names=["concept"] * channels,
        )

    def _prepared(self, inputs: Inputs) -> Tensor:
        """The model-input batch the explainer builds from ``inputs`` (its preprocessing), for the repeated rows."""
        return prepare_inputs(inputs, self.explainer.preprocess, model_device(self.model),
                              model_dtype(self.model)).batch

    @staticmethod
    def _concepts(concepts: ConceptSpec, layer_relevance: Tensor) -> Tensor:
        """(N, M) channel indices of the concepts to map."""
        count, channels = layer_relevance.shape
        if concepts is None:
            return torch.arange(channels).expand(count, -1).clone()
        if isinstance(concepts, int) and not isinstance(concepts, bool):
            if not 1 <= concepts <= channels:
                raise ValueError(f"concepts={concepts}: the layer has {channels} concepts; give 1 to {channels}.")
            return layer_relevance.topk(concepts, dim=1).indices
        chosen = torch.as_tensor(concepts).long().cpu()
        if chosen.dim() == 1:
            chosen = chosen.expand(count, -1).clone()
        if chosen.dim() != 2 or chosen.shape[0] != count or chosen.shape[1] == 0:
            raise ValueError(f"concepts must be an int, (M,) channel indices or (N, M) per image for {count} images; "
                             f"got shape {tuple(chosen.shape)}.")
        if bool(((chosen < 0) | (chosen >= channels)).any()):
            raise ValueError(f"concept indices must be in 0 … {channels - 1} (the layer's channels); got "
                             f"{chosen.min().item()} … {chosen.max().item()}.")
        return chosen
