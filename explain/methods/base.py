"""The pipeline every method shares: inputs → model → targets → method's maps → Explanation."""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import model_device, model_dtype, preserved_model_state, run_model
from ..explanation import Explanation
from ..inputs import Inputs, Normalize, prepare_inputs
from ..targets import OutputSelector, SelectedTargets, Target, select_output

NORMALIZATIONS = ("max", "minmax", None)


@dataclass
class ForwardCall:
    """The other arguments of a model's forward, for models with several inputs.

    args / kwargs: passed through; position: where the explained batch goes, an index into the
    positional arguments or a keyword name; batch_size: N. Tensors whose first dimension is N
    are per-image and follow the rows when a method runs copies of the images.
    """

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    position: int | str = 0
    batch_size: int = 0

    def arguments(self, inputs: Tensor) -> tuple[tuple, dict]:
        if isinstance(self.position, str):
            return self.args, {**self.kwargs, self.position: inputs}
        args = list(self.args)
        args.insert(self.position, inputs)
        return tuple(args), self.kwargs

    def for_rows(self, rows: Tensor) -> "ForwardCall":
        """The same call for a batch whose row r is a copy of image ``rows[r]``."""

        def select(value):
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.batch_size:
                return value[rows.to(value.device)]
            return value

        return ForwardCall(tuple(select(value) for value in self.args),
                           {key: select(value) for key, value in self.kwargs.items()}, self.position, len(rows))


@dataclass
class Attribution:
    """What a method computes for a batch.

    maps: (N, K, h, w) raw maps, at any resolution (upsampled to the input's afterwards).
    selected: the targets explained and their scores.
    low_res_maps: per layer, (N, K, h, w) maps at the layer's resolution (CAM methods).
    layer: the layer name(s), for the Explanation.
    attributions: (N, K, C, H, W) per-channel attributions at the input (gradient methods).
    diagnostics: method-specific figures, e.g. Integrated Gradients' completeness error.
    """

    maps: Tensor
    selected: SelectedTargets
    low_res_maps: Optional[list[Tensor]] = None
    layer: Optional[str | list[str]] = None
    attributions: Optional[Tensor] = None
    diagnostics: dict = field(default_factory=dict)


def normalize_maps(maps: Tensor, how: Optional[str]) -> Tensor:
    """Normalise each (H, W) map of (..., H, W) on its own.

    "max": divide by the largest |value| (non-negative maps → [0, 1], signed → [-1, 1],
    zero stays zero); "minmax": (m - min) / (max - min) → [0, 1]; None: unchanged.
    An all-zero (or constant, for "minmax") map becomes all zeros, never NaN.
    """
    if how is None:
        return maps
    flat = maps.reshape(*maps.shape[:-2], -1)
    if how == "max":
        scale = flat.abs().amax(dim=-1, keepdim=True)
        tiny = torch.finfo(flat.dtype).tiny
        normalized = torch.where(scale > 0, flat / scale.clamp_min(tiny), torch.zeros_like(flat))
    elif how == "minmax":
        low = flat.amin(dim=-1, keepdim=True)
        span = flat.amax(dim=-1, keepdim=True) - low
        tiny = torch.finfo(flat.dtype).tiny
        normalized = torch.where(span > 0, (flat - low) / span.clamp_min(tiny), torch.zeros_like(flat))
    else:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {how!r}.")
    return normalized.reshape(maps.shape)


def upsample_maps(maps: Tensor, size: Sequence[int]) -> Tensor:
    """(N, K, h, w) → (N, K, H, W), bilinear (align_corners=False), float32."""
    maps = maps.float()
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps, size=tuple(size), mode="bilinear", align_corners=False)


class Explainer(ABC):
    """Base class of every method: ``Method(model, ...).explain(inputs, target=...)``.

    model: any ``nn.Module``; it is run in eval mode during a call and left exactly
        as found afterwards (modes, flags, hooks), also when the call raises.
    preprocess: turns an RGB image (PIL) into model input; default: ImageNet
        mean/std normalisation with the size kept. Tensors skip it.
    normalize: "max" (default), "minmax" or None, applied to each map.
    class_names: names of the model's classes, for titles.
    output: which part of the model's output holds the scores when it is not a plain tensor
        (a key, an index or a callable); None picks it automatically (see ``select_output``).
    """

    name: ClassVar[str] = ""
    """Registry name, as the command line's ``--method`` takes it."""
    needs_layer: ClassVar[bool] = False
    """Whether the constructor takes a target layer after the model (CAM methods)."""
    summary: ClassVar[str] = ""
    """One line for ``explain methods``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        preprocess: Optional[Callable] = None,
        normalize: Optional[str] = "max",
        class_names: Optional[Sequence[str]] = None,
        output: OutputSelector = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
        self.model = model
        self.preprocess = preprocess if preprocess is not None else Normalize()
        self.normalize = normalize
        self.class_names = class_names
        self.output = output
        self.forward_call: Optional[ForwardCall] = None

    def call_model(self, inputs: Tensor, rows: Optional[Tensor] = None) -> Any:
        """The model's scores for a batch: its forward pass (with the call's other arguments), then
        the output selector. rows: for a batch of copies, the image each row is a copy of."""
        call = self.forward_call
        if call is None:
            return select_output(run_model(self.model, inputs), self.output)
        if rows is not None:
            call = call.for_rows(rows)
        return select_output(run_model(self.model, inputs, call.arguments(inputs)), self.output)

    @property
    def method_name(self) -> str:
        return type(self).__name__

    def explain(
        self,
        inputs: Inputs,
        target: Target = None,
        *,
        topk: Optional[int] = None,
        forward_args: Sequence = (),
        forward_kwargs: Optional[dict] = None,
        input_position: int | str = 0,
    ) -> Explanation:
        """Explain N images for one or K targets each.

        inputs: a path, PIL image, (H, W, 3) ndarray, (C, H, W) or (N, C, H, W)
            tensor, or a list of these (see ``explain.inputs``).
        target: None (top-1 class), an int, one int per image, K ints per image,
            or a callable ``f(output) -> Tensor[N]`` (see ``explain.targets``).
        topk: explain each image's k highest-scoring classes.
        forward_args, forward_kwargs: the model's other inputs, for models with several; the
            explained batch goes at ``input_position`` (an index among the positional arguments,
            or a keyword name). Tensors of first dimension N are taken as per-image.
        Returns an Explanation whose maps are (N, H, W), or (N, K, H, W) for K targets per image.
        """
        prepared = prepare_inputs(inputs, self.preprocess, model_device(self.model), model_dtype(self.model))
        if forward_args or forward_kwargs or input_position != 0:
            self.forward_call = ForwardCall(tuple(forward_args), dict(forward_kwargs or {}), input_position,
                                            prepared.batch.shape[0])
        try:
            with preserved_model_state(self.model):
                attribution = self.attribute(prepared.batch, target, topk)
        finally:
            self.forward_call = None
        raw = upsample_maps(attribution.maps.detach(), prepared.batch.shape[-2:])
        selected = attribution.selected
        return Explanation(
            map_grid=normalize_maps(raw, self.normalize),
            raw_map_grid=raw,
            scores=selected.scores.detach().float(),
            class_indices=selected.class_indices,
            images=prepared.images,
            method=self.method_name,
            layer=attribution.layer,
            keep_target_dim=selected.keep_target_dim,
            low_res_maps=attribution.low_res_maps,
            probabilities=selected.probabilities,
            attributions=None if attribution.attributions is None else attribution.attributions.detach(),
            diagnostics=attribution.diagnostics,
            class_names=self.class_names,
        )

    @abstractmethod
    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        """The method itself: a prepared (N, C, H, W) batch → raw (N, K, h, w) maps."""


REGISTRY: dict[str, type[Explainer]] = {}


def register(cls: type[Explainer]) -> type[Explainer]:
    """Class decorator: make a method available by its ``name`` (command line, ``get_method``)."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"method name {cls.name!r} is empty or taken.")
    REGISTRY[cls.name] = cls
    return cls


def get_method(name: str) -> type[Explainer]:
    """The method class registered under ``name`` (case and '-'/'_' insensitive)."""
    key = name.lower().replace("-", "").replace("_", "")
    for registered, cls in REGISTRY.items():
        if registered.replace("-", "").replace("_", "") == key:
            return cls
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown method {name!r}.{hint} Known methods: {', '.join(sorted(REGISTRY))}.")
