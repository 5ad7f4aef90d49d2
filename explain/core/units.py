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
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .capture import LayerNotRunError, LayerOutputError, LayerSpec, find_layers
from .layouts import infer_layout
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
    def values(self, layer_output: Tensor, layer: Optional[nn.Module] = None,
               input_size: Optional[Sequence[int]] = None) -> Tensor:
        """The units' values, (R, K), from the layer's output (R rows); ``layer``, the module, and
        ``input_size``, the (H, W) of the model's input, help tell which axis holds the channels."""

    def __call__(self, output: object) -> Tensor:
        raise TypeError(
            f"{self!r} is read from a layer during the forward pass, and it was called on a model's output "
            "alone. Explainers bind it themselves (`Method(model).explain(x, target=unit)`); elsewhere bind it for "
            "the forward passes: `with unit.bind(model) as target: ...`. Metrics that score classes or their "
            "probabilities (deletion, insertion, ...) cannot score a hidden unit."
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
    position: None (the mean over all positions) or the index of one position, e.g. (i, j) for a
        (N, C, h, w) or (N, h, w, C) output, (t,) for tokens (N, T, D).
    dim: the dimension of the layer's output that holds the channels; None (default) tells it from the
        layer: 1 for (N, C) and convolutions' (N, C, h, w); -1 for tokens (N, T, D) and channels-last
        (N, h, w, C) outputs (Swin, ConvNeXt's norm and MLP), read from the layer's last convolution, norm
        or linear module or else from the shape, as CAMs read feature maps.
    Value for image n: mean over positions of the channel c (or its value at ``position``). For tokens the
    positions are all T tokens, the class (and other prefix) tokens included; position=(0,) is the class
    token of a ViT. For (N, C) the channel's value itself.
    """

    def __init__(self, layer: LayerSpec, channel: Units, position: Optional[Sequence[int]] = None,
                 dim: Optional[int] = None):
        indices, keep, per_image = _index_tensor(channel, 1)
        super().__init__(layer, indices, keep, per_image)
        self.position = None if position is None else tuple(int(p) for p in position)
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, Integral)):
            raise TypeError(f"dim is an int (the channels' dimension) or None (told from the layer); got {dim!r}.")
        self.dim = None if dim is None else int(dim)

    def channel_dim(self, layer_output: Tensor, layer: Optional[nn.Module] = None,
                    input_size: Optional[Sequence[int]] = None) -> int:
        """The dimension of ``layer_output`` that holds the channels (``dim``, or told from the layer)."""
        shape = tuple(layer_output.shape)
        if layer_output.dim() < 2:
            raise ValueError(f"a channel needs a layer output with a batch and a channel dimension; got {shape}.")
        if self.dim is not None:
            if not -layer_output.dim() < self.dim < 0 and not 0 < self.dim < layer_output.dim():
                raise ValueError(f"dim={self.dim} is not a channel dimension of a layer output of shape {shape}: "
                                 f"give one of 1..{layer_output.dim() - 1} (or -1 for the last), not the batch's.")
            return self.dim
        if layer_output.dim() == 3:
            return 1 if _conv1d_channels(layer) == shape[1] else -1  # tokens (N, T, D), unless a 1-d convolution's
        if layer_output.dim() == 4:
            size = tuple(input_size) if input_size is not None else (max(shape[1:]) ** 2,) * 2
            try:
                kind = infer_layout(layer_output, size, None, str(self.layer), layer).kind
            except ValueError:
                raise ValueError(
                    f"layer {self.layer!r} outputs {shape}, whose channels could be at dimension 1 or 3, and nothing "
                    "in the layer tells which: pass dim=1 (channels first, CNNs) or dim=-1 (channels last, "
                    "Swin-like blocks) to Channel.") from None
            return -1 if kind == "channels_last" else 1
        return 1

    def values(self, layer_output: Tensor, layer: Optional[nn.Module] = None,
               input_size: Optional[Sequence[int]] = None) -> Tensor:
        channels_second = layer_output.movedim(self.channel_dim(layer_output, layer, input_size), 1)
        positions = tuple(channels_second.shape[2:])
        if self.position is None:
            per_channel = channels_second.flatten(2).mean(dim=2) if positions else channels_second  # (R, C)
        else:
            if len(self.position) != len(positions):
                raise ValueError(f"position={self.position} needs {len(positions)} index(es), one per position "
                                 f"dimension of the layer's {tuple(layer_output.shape)} output besides the batch and "
                                 f"the channels {positions}.")
            _check_range(torch.tensor([self.position]), positions, "position")
            at_position: tuple[Union[slice, int], ...] = (slice(None), slice(None), *self.position)
            per_channel = channels_second[at_position]
        _check_range(self.indices, per_channel.shape[1:], "channel")
        channels = self.indices[..., 0].remainder(per_channel.shape[1]).to(per_channel.device)  # -1: the last
        if self.per_image:
            self._check_rows(per_channel.shape[0])
            return per_channel.gather(1, channels)
        return per_channel[:, channels]

    def __repr__(self) -> str:
        where = "" if self.position is None else f", position={self.position}"
        axis = "" if self.dim is None else f", dim={self.dim}"
        return f"Channel({self.layer!r}, {self.indices[..., 0].tolist()}{where}{axis})"


def _conv1d_channels(layer: Optional[nn.Module]) -> Optional[int]:
    """The output channels of a layer whose last convolution, norm or linear module is a 1-d convolution
    (or BatchNorm1d) with channels first; None otherwise."""
    for leaf in reversed(list(layer.modules()) if layer is not None else []):
        if isinstance(leaf, nn.Conv1d):
            return leaf.out_channels
        if isinstance(leaf, nn.BatchNorm1d):
            return leaf.num_features
        if isinstance(leaf, (nn.Conv2d, nn.Linear, nn.LayerNorm, nn.BatchNorm2d, nn.GroupNorm)):
            return None
    return None


class Neuron(UnitTarget):
    """One unit of a layer's output per image: output[n, *index].

    layer: the layer's name (or module). index: a tuple over the output's dimensions after the batch,
        e.g. (c, i, j) for (N, C, h, w), (d,) or an int for (N, D), (t, d) for tokens; a list of K such
        tuples (K maps per image); or N lists of K tuples (units per image).
    """

    def __init__(self, layer: LayerSpec, index: Units):
        indices, keep, per_image = _index_tensor(index, None)
        super().__init__(layer, indices, keep, per_image)

    def values(self, layer_output: Tensor, layer: Optional[nn.Module] = None,
               input_size: Optional[Sequence[int]] = None) -> Tensor:
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


_PASSES_KEPT = 2
"""How many finished forward passes a bound unit keeps its layer's outputs of."""


@dataclass
class _Pass:
    """One forward pass of the model: its output and the output's parts, the unit's layer's outputs in it, and the
    (H, W) of its image input (None where it had none)."""

    parts: list[object]
    recorded: list[Tensor]
    input_size: Optional[tuple[int, int]]


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
        self.recorded: list[Tensor] = []  # the unit's layer's outputs in the forward pass in progress
        self.finished: list[_Pass] = []  # the last passes, so that a target finds its own pass's values
        self.open = False

    def setup(self) -> "BoundUnits":
        assert self.model is not None, "a unit is bound to a model"
        self.forward_hook(self.module, self._record)
        self.forward_hook(self.model, self._finish, with_kwargs=True)  # after _record where the layer is the model
        self.open = True
        self.add_undo(self._close)
        return self

    def _close(self) -> None:
        self.open = False
        self.recorded, self.finished = [], []

    def _record(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if not isinstance(output, Tensor):
            raise LayerOutputError(f"layer {self.layer_name!r} returned a {type(output).__name__}, not a tensor; a "
                                   "unit needs a layer whose output is a tensor.")
        # a copy in the graph: a later in-place op (ReLU(inplace=True)) cannot change the unit's value, and
        # the output itself goes on unchanged (a CAM's capture at the same layer sees the true output)
        self.recorded.append(output.clone())

    def _finish(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object) -> None:
        """The end of a forward pass of the model: its records are kept with its output, and the next pass starts."""
        images = [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor) and value.dim() == 4]
        size = (int(images[0].shape[-2]), int(images[0].shape[-1])) if images else None
        parts: list[object] = [output]
        if isinstance(output, (tuple, list)):
            parts += list(output)
        elif isinstance(output, Mapping):
            parts += list(output.values())
        if isinstance(getattr(output, "logits", None), Tensor):
            parts.append(output.logits)  # type: ignore[attr-defined]
        # the pass before too: a method may run the images, then the baselines, and only then read the images' scores
        self.finished = [*self.finished[-(_PASSES_KEPT - 1):], _Pass(parts, self.recorded, size)]
        self.recorded = []

    def _pass_of(self, output: object) -> "_Pass":
        """The finished forward pass whose output (or a part of it: a tuple's item, a dict's value, ``.logits``) is
        ``output``; else the last (an output selector may have made a new object)."""
        for finished in reversed(self.finished):
            if any(part is output for part in finished.parts):
                return finished
        return self.finished[-1] if self.finished else _Pass([], self.recorded, None)

    def read_through(self, output: object, start: Callable[[Tensor], Tensor]) -> None:
        """Read the units' values of the forward pass that produced ``output`` from ``start(layer output)``
        instead of the recorded layer output: ``start`` is the identity in the forward pass whose backward turns
        ∂score/∂z into what the method propagates (LRP's relevance starts there: z ⊙ ∂score/∂z)."""
        forward = self._pass_of(output)
        forward.recorded[:] = [start(tensor) for tensor in forward.recorded]

    def __call__(self, output: object) -> Tensor:
        if not self.open:
            raise RuntimeError(f"{self.unit!r} was bound to a model for a call that has ended; bind it again.")
        forward = self._pass_of(output)
        if len(forward.recorded) != 1:
            ran = "did not run" if not forward.recorded else f"ran {len(forward.recorded)} times"
            raise LayerNotRunError(f"layer {self.layer_name!r} {ran} in the forward pass; a unit needs a layer "
                                   "that runs once (`explain layers MODEL` lists them).")
        values = self.unit.values(forward.recorded[0], self.module, forward.input_size)
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
