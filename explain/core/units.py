"""Hidden units as targets: explain what drives one channel or one neuron of a layer instead of a class.

    GradCAM(model, "layer4").explain(img, target=explain.Channel("layer3", 17))
    Saliency(model).explain(img, target=explain.Neuron("layer3", (17, 2, 5)))

A unit's value is read from its layer's output during the forward pass of the call, through a
forward hook of the call's scope (``explain.core.scope.CallScope``): it acts on the explaining
thread only and is removed when the call ends. ``unit.bind(model)`` opens that scope; the bound
object is a plain target callable ``f(output) -> Tensor[N]`` (or ``[N, K]``) that every method
understands, so ``with unit.bind(model) as target: Method(model).explain(x, target=target)``
works with any method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Integral
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .capture import LayerNotRunError, LayerOutputError, LayerSpec, find_layers
from .scope import CallScope
from .targets import Target

Unit = Union[int, tuple[int, ...]]
"""One unit: an int, or a tuple of ints (one index per dimension of the layer's output after the batch)."""
Units = Union[Unit, list[int], list[tuple[int, ...]], list[list[int]], list[list[tuple[int, ...]]], Tensor]
"""One unit for every image, a list of K units for every image, or N lists of K units (one list per image)."""


def _index_tensor(units: Units, dims: Optional[int]) -> tuple[Tensor, bool, bool]:
    """Units as a long tensor: (K, D) shared by every image or (N, K, D) per image; whether the
    K dimension is kept (a list was given) and whether the units are per image.

    A unit is an int or a tuple of ints (a tuple is one unit's index); a list holds K units
    (for every image) or N lists of K units (one list per image)."""

    def as_unit(value: object) -> list[int]:
        if isinstance(value, Integral) and not isinstance(value, bool):
            return [int(value)]
        if isinstance(value, tuple) and value and all(isinstance(v, Integral) for v in value):
            return [int(v) for v in value]
        raise TypeError(f"a unit is an int or a tuple of ints; got {value!r}.")

    if isinstance(units, Tensor):
        units = units.tolist()
    nested: Union[list[list[int]], list[list[list[int]]]]
    if not isinstance(units, list):
        nested, keep, per_image = [as_unit(units)], False, False
    elif units and all(isinstance(item, list) for item in units):
        rows = [item for item in units if isinstance(item, list)]  # every item: N lists of K units
        nested, keep, per_image = [[as_unit(unit) for unit in row] for row in rows], True, True
        if len({len(row) for row in nested}) != 1 or not nested[0]:
            raise ValueError("per-image units need the same number K ≥ 1 of units for every image.")
    elif units:
        nested, keep, per_image = [as_unit(unit) for unit in units], True, False
    else:
        raise ValueError("the list of units is empty.")
    try:
        indices = torch.tensor(nested, dtype=torch.long)
    except ValueError:
        raise ValueError("all units need indices of the same length.") from None
    if dims is not None and indices.shape[-1] != dims:
        raise ValueError(f"each unit needs {dims} index(es); got {indices.shape[-1]}.")
    return indices, keep, per_image


class UnitTarget(ABC):
    """Base of Channel and Neuron: a layer and the units whose values are explained."""

    def __init__(self, layer: LayerSpec, indices: Tensor, keep_target_dim: bool, per_image: bool):
        self.layer = layer
        self.indices = indices
        self.keep_target_dim = keep_target_dim
        self.per_image = per_image

    @abstractmethod
    def values(self, layer_output: Tensor) -> Tensor:
        """The units' values, (R, K), from the layer's output (R rows)."""

    def __call__(self, output: object) -> Tensor:
        raise TypeError(
            f"{self!r} is read from a layer during the forward pass, and this method was called without "
            "binding it to the model. Bind it for the call: `with unit.bind(model) as target: "
            "Method(model).explain(x, target=target)` (CAM methods and FullGrad bind it themselves)."
        )

    def bind(self, model: nn.Module) -> "BoundUnits":
        """A scope that records the layer's output in this thread's forward passes of ``model``;
        inside it, the returned object is the target callable."""
        return BoundUnits(model, self)

    def _check_rows(self, rows: int) -> None:
        if self.per_image and rows != self.indices.shape[0]:
            raise ValueError(
                f"the units were given per image for {self.indices.shape[0]} images, but this forward pass has "
                f"{rows} rows: methods that score copies of the images (Integrated Gradients, SmoothGrad, "
                "Score-CAM, Ablation-CAM) need units shared by every image."
            )


class Channel(UnitTarget):
    """A channel of a layer: its mean activation over all positions, or its value at one position.

    layer: the layer's name (or module). channel: an int (maps (N, H, W)); a list of K ints (K maps per
        image, the same channels for every image); or N lists of K ints (channels per image).
    position: None (the spatial mean) or the index of one position, e.g. (i, j) for a (N, C, h, w)
        output. dim: the dimension of the layer's output that holds the channels (1 for
        convolutions; -1 for tokens (N, T, D) or channels-last outputs).
    Value for image n: mean over positions of output[n, c] (or output[n, c, i, j]).
    """

    def __init__(self, layer: LayerSpec, channel: Units, position: Optional[Sequence[int]] = None, dim: int = 1):
        indices, keep, per_image = _index_tensor(channel, 1)
        super().__init__(layer, indices, keep, per_image)
        self.position = None if position is None else tuple(int(p) for p in position)
        self.dim = dim

    def values(self, layer_output: Tensor) -> Tensor:
        channels_second = layer_output.movedim(self.dim, 1)
        if self.position is None:
            per_channel = channels_second.flatten(2).mean(dim=2)  # (R, C)
        else:
            at_position: tuple[Union[slice, int], ...] = (slice(None), slice(None), *self.position)
            per_channel = channels_second[at_position]
        _check_range(self.indices, per_channel.shape[1:], "channel")
        if self.per_image:
            self._check_rows(per_channel.shape[0])
            return per_channel.gather(1, self.indices[..., 0].to(per_channel.device))
        return per_channel[:, self.indices[:, 0].to(per_channel.device)]

    def __repr__(self) -> str:
        where = "" if self.position is None else f", position={self.position}"
        return f"Channel({self.layer!r}, {self.indices[..., 0].tolist()}{where})"


class Neuron(UnitTarget):
    """One unit of a layer's output per image: output[n, *index].

    layer: the layer's name (or module). index: a tuple over the output's dimensions after the batch,
        e.g. (c, i, j) for (N, C, h, w), (d,) or an int for (N, D), (t, d) for tokens; a list of K such
        tuples (K maps per image); or N lists of K tuples (units per image).
    """

    def __init__(self, layer: LayerSpec, index: Units):
        indices, keep, per_image = _index_tensor(index, None)
        super().__init__(layer, indices, keep, per_image)

    def values(self, layer_output: Tensor) -> Tensor:
        if self.indices.shape[-1] != layer_output.dim() - 1:
            raise ValueError(f"a neuron of a layer whose output is {tuple(layer_output.shape)} needs "
                             f"{layer_output.dim() - 1} indices; got {self.indices.shape[-1]}.")
        _check_range(self.indices, layer_output.shape[1:], "neuron index")
        indices = self.indices.to(layer_output.device)
        if self.per_image:
            self._check_rows(layer_output.shape[0])
            rows = torch.arange(layer_output.shape[0], device=layer_output.device)[:, None].expand(indices.shape[:2])
            per_image_units: tuple[Tensor, ...] = (rows, *indices.unbind(-1))
            return layer_output[per_image_units]
        shared_units: tuple[Union[slice, Tensor], ...] = (slice(None), *indices.unbind(-1))
        return layer_output[shared_units]

    def __repr__(self) -> str:
        units = [tuple(unit) for unit in self.indices.reshape(-1, self.indices.shape[-1]).tolist()]
        return f"Neuron({self.layer!r}, {units})"


def _check_range(indices: Tensor, sizes: Sequence[int], what: str) -> None:
    flat = indices.reshape(-1, indices.shape[-1])
    for column, size in enumerate(sizes[: flat.shape[1]]):
        bad = (flat[:, column] < -size) | (flat[:, column] >= size)
        if bad.any():
            raise ValueError(f"{what} {flat[bad][0].tolist()} is out of range for a layer output of shape "
                             f"(N, {', '.join(str(s) for s in sizes)}).")


class BoundUnits(CallScope["BoundUnits"]):
    """``with unit.bind(model) as target:`` — records the unit's layer output in this thread's forward
    passes of ``model``; ``target(output)`` returns the units' values (R,) or (R, K) of the forward
    pass that produced ``output``. The hooks are removed when the block ends."""

    def __init__(self, model: nn.Module, unit: UnitTarget):
        super().__init__(model)
        found = find_layers(model, unit.layer)
        if len(found) != 1:
            raise ValueError(f"a unit lies in one layer; {unit.layer!r} selects {len(found)} layers.")
        self.layer_name, self.module = found[0]
        self.unit = unit
        self.recorded: list[Tensor] = []
        self.open = False

    def setup(self) -> "BoundUnits":
        assert self.model is not None, "a unit is bound to a model"
        self.forward_pre_hook(self.model, self._new_forward)
        self.forward_hook(self.module, self._record)
        self.open = True
        self.add_undo(self._close)
        return self

    def _close(self) -> None:
        self.open = False
        self.recorded = []

    def _new_forward(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self.recorded = []

    def _record(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if not isinstance(output, Tensor):
            raise LayerOutputError(f"layer {self.layer_name!r} returned a {type(output).__name__}, not a tensor; a "
                                   "unit needs a layer whose output is a tensor.")
        # a copy in the graph: a later in-place op (ReLU(inplace=True)) cannot change the unit's value, and
        # the output itself goes on unchanged (a CAM's capture at the same layer sees the true output)
        self.recorded.append(output.clone())

    def __call__(self, output: object) -> Tensor:
        if not self.open:
            raise RuntimeError(f"{self.unit!r} was bound to a model for a call that has ended; bind it again.")
        if len(self.recorded) != 1:
            ran = "did not run" if not self.recorded else f"ran {len(self.recorded)} times"
            raise LayerNotRunError(f"layer {self.layer_name!r} {ran} in the forward pass; a unit needs a layer "
                                   "that runs once (`explain layers MODEL` lists them).")
        values = self.unit.values(self.recorded[0])
        return values if self.unit.keep_target_dim else values[:, 0]

    @property
    def keep_target_dim(self) -> bool:
        return self.unit.keep_target_dim

    def __repr__(self) -> str:
        return f"{self.unit!r} bound to layer {self.layer_name!r}"


def bind_units(target: Target, model: nn.Module, scope: CallScope[object]) -> Target:
    """``target`` itself, or for a Channel / Neuron the bound callable, recording for the rest of ``scope``."""
    if isinstance(target, UnitTarget):
        return scope.enter(target.bind(model))
    return target
