"""List a model's layers with their output shapes: the step before choosing a layer to explain."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .capture import model_device, model_dtype, preserved_model_state


@dataclass
class LayerInfo:
    """name as named_modules() spells it; kind: the module's class; output_shapes: one
    torch.Size (or nested list/dict of them) per call in the forward pass, empty when
    the layer did not run."""

    name: str
    kind: str
    output_shapes: list

    def shape_text(self) -> str:
        if not self.output_shapes:
            return "(not run)"
        text = _shape_text(self.output_shapes[0])
        return text if len(self.output_shapes) == 1 else f"{text} ×{len(self.output_shapes)} calls"


def _shape_text(value: Any) -> str:
    if isinstance(value, torch.Size):
        return "(" + ", ".join(str(size) for size in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_shape_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_shape_text(item)}" for key, item in value.items()) + "}"
    return str(value)


def list_layers(model: nn.Module, input_size: Sequence[int] = (3, 224, 224), batch_size: int = 1) -> list[LayerInfo]:
    """Every named module of the model with the output shape(s) it produces for a zero input
    of ``(batch_size, *input_size)``. The model is run once in eval mode without gradients
    and left as found."""
    infos = [LayerInfo(name, type(module).__name__, []) for name, module in model.named_modules() if name]
    handles = []

    def hook_for(info: LayerInfo):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            info.output_shapes.append(_shape_of(output))

        return hook

    modules = dict(model.named_modules())
    example = torch.zeros(batch_size, *input_size, device=model_device(model), dtype=model_dtype(model))
    try:
        for info in infos:
            handles.append(modules[info.name].register_forward_hook(hook_for(info)))
        with preserved_model_state(model), torch.no_grad():
            model(example)
    except Exception as error:  # shape asserts of fixed-size models and the like
        raise ValueError(
            f"the model could not run on an input of shape {tuple(example.shape)}: {error}. "
            "Give the input size it expects (--input-size C H W, or input_size=(C, H, W))."
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    return infos


def _shape_of(value: Any) -> Any:
    """A tensor's torch.Size, kept in the nesting of tuples, lists and dicts; other values' type names."""
    if isinstance(value, Tensor):
        return value.shape
    if isinstance(value, (tuple, list)):
        return [_shape_of(item) for item in value]
    if isinstance(value, dict):
        return {key: _shape_of(item) for key, item in value.items()}
    return type(value).__name__


def format_layers(infos: Sequence[LayerInfo]) -> str:
    """A table: indented name, module class, output shape."""
    rows = [(("  " * info.name.count(".")) + info.name, info.kind, info.shape_text()) for info in infos]
    name_width = max(len(row[0]) for row in rows)
    kind_width = max(len(row[1]) for row in rows)
    return "\n".join(f"{name:<{name_width}}  {kind:<{kind_width}}  {shape}" for name, kind, shape in rows)


POOLING = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AvgPool2d, nn.MaxPool2d)
TRANSFORMER_BLOCK_NORMS = re.compile(r"(^|\.)(ln_1|norm1)$")


def default_layer(model: nn.Module, batch: Tensor, run: Optional[Callable[[Tensor], Any]] = None) -> str:
    """The layer a CAM explains when none is given, found by one forward pass on ``batch``.

    Transformers (LayerNorm modules named ``ln_1`` or ``norm1`` inside blocks): the last
    block's first norm. The last block's *output* is a poor choice for a ViT: only the class token feeds the
    head after it, so the gradient there is zero on every patch token; at the last block's
    first norm the gradient reaches the patches through that block's attention.
    CNNs: the last module, in the order modules finish, whose output is a spatial map (N, C, h, w)
    with h, w > 1 and that is not a pooling layer — the last conv stage before global pooling
    (``layer4`` on a ResNet, ``features`` on VGG, DenseNet, MobileNet, EfficientNet, ConvNeXt).
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    finished: list[tuple[str, tuple]] = []
    calls: dict[str, int] = {}
    handles = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            finished.append((name, tuple(output.shape) if isinstance(output, Tensor) else ()))

        return hook

    try:
        for name, module in named:
            handles.append(module.register_forward_hook(hook_for(name)))
        with preserved_model_state(model), torch.no_grad():
            (run or model)(batch)
    finally:
        for handle in handles:
            handle.remove()
    modules = dict(named)
    norms = [name for name, _ in finished if TRANSFORMER_BLOCK_NORMS.search(name) and calls[name] == 1
             and isinstance(modules[name], nn.LayerNorm)]
    if norms:
        return norms[-1]
    candidates = [
        name for name, shape in finished
        if len(shape) == 4 and shape[2] > 1 and shape[3] > 1 and calls[name] == 1
        and not isinstance(modules[name], POOLING)
    ]
    if not candidates:
        raise ValueError(
            "no layer with spatial feature maps was found to explain; pass one explicitly "
            "(`explain layers MODEL` lists them with their output shapes)."
        )
    return candidates[-1]
