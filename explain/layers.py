"""List a model's layers with their output shapes: the step before choosing a layer to explain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

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
