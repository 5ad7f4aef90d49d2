"""Change what a layer computes, for the duration of a ``with`` block."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

from .capture import LayerOutputError, LayerSpec, find_layers
from .scope import CallScope


class EditBlock(CallScope[None]):
    """The ``with`` block of ``edit``: hooks for this thread's forward passes, removed at its end."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]],
                 fn: Optional[Callable[[Tensor], Tensor]], where: str,
                 grad_fn: Optional[Callable[[Tensor], Tensor]]):
        super().__init__(model)
        self.layers, self.fn, self.where, self.grad_fn = layers, fn, where, grad_fn

    def _edited(self, tensor: Tensor, name: str) -> Tensor:
        edited = self.fn(tensor) if self.fn is not None else tensor
        if not isinstance(edited, Tensor):
            raise LayerOutputError(
                f"the edit function for layer {name!r} returned {type(edited).__name__}, not a tensor: it must "
                "return the new value (e.g. `lambda t: t.clamp(max=1.0)`; an in-place edit ends with `return t`)."
            )
        return edited

    def _output_hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], Tensor]:
        def edit_output(module: nn.Module, args: tuple[object, ...], output: object) -> Tensor:
            if not isinstance(output, Tensor):
                raise LayerOutputError(
                    f"edit needs a layer whose output is a tensor; {name!r} returned {type(output).__name__}."
                )
            edited = self._edited(output, name)
            if self.grad_fn is not None and edited.requires_grad:
                edited = edited.clone()  # an in-place op after the layer must not move the gradient hook
                edited.register_hook(self.grad_fn)
                return edited.clone()
            return edited

        return edit_output

    def _input_hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...]], tuple[object, ...]]:
        def edit_input(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
            if not args or not isinstance(args[0], Tensor):
                raise LayerOutputError(
                    f"where='input' edits the first positional input of {name!r}, which must be a tensor."
                )
            return (self._edited(args[0], name), *args[1:])

        return edit_input

    def setup(self) -> None:
        for name, module in self.layers:
            if self.where == "output":
                self.forward_hook(module, self._output_hook(name))
            else:
                self.forward_pre_hook(module, self._input_hook(name))


def edit(
    model: nn.Module,
    layer: LayerSpec,
    fn: Optional[Callable[[Tensor], Tensor]] = None,
    *,
    where: str = "output",
    grad_fn: Optional[Callable[[Tensor], Tensor]] = None,
) -> EditBlock:
    """Replace a layer's output (or first input, ``where="input"``) by ``fn(tensor)``, and/or
    rewrite the gradient flowing back through its output by ``grad_fn(gradient)``.

    Inside the block every forward of the model made by this thread uses the edited layer
    (ablations, feature clamping, manifold mixup; doubling a gradient); other threads see
    the plain model. When the block ends, also by an exception or an interrupt, the hooks
    are removed and the model computes as before::

        with explain.edit(model, "layer3", lambda t: t.clamp(max=1.0)):
            clamped = model(x)
        with explain.edit(model, "layer3", grad_fn=lambda g: 2 * g):
            model(x).sum().backward()

    The layer may be a name, glob, module or type; a glob or type edits every match.

    Blocks on one layer act in the order they were entered: nested edits apply the outer
    one first, and ``explain.capture`` records the output as it stood when the capture
    began; capture inside the edit block to record the edited output.
    """
    if where not in ("output", "input"):
        raise ValueError(f"where must be 'output' or 'input'; got {where!r}.")
    if fn is None and grad_fn is None:
        raise ValueError("give fn (to change the tensor), grad_fn (to change its gradient), or both.")
    if where == "input" and grad_fn is not None:
        raise ValueError("grad_fn rewrites the gradient of a layer's output; use where='output'.")
    return EditBlock(model, find_layers(model, layer), fn, where, grad_fn)
