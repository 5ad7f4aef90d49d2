"""Change what a layer computes, for the duration of a ``with`` block."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from torch import Tensor, nn

from .capture import LayerSpec, find_layers


@contextmanager
def edit(
    model: nn.Module,
    layer: LayerSpec,
    fn: Optional[Callable[[Tensor], Tensor]] = None,
    *,
    where: str = "output",
    grad_fn: Optional[Callable[[Tensor], Tensor]] = None,
) -> Iterator[None]:
    """Replace a layer's output (or first input, ``where="input"``) by ``fn(tensor)``, and/or
    rewrite the gradient flowing back through its output by ``grad_fn(gradient)``.

    Inside the block every forward of the model uses the edited layer (ablations,
    feature clamping, manifold mixup; doubling a gradient). When the block ends,
    also by an exception, the hooks are removed and the model computes as before::

        with explain.edit(model, "layer3", lambda t: t.clamp(max=1.0)):
            clamped = model(x)
        with explain.edit(model, "layer3", grad_fn=lambda g: 2 * g):
            model(x).sum().backward()

    The layer may be a name, glob, module or type; a glob or type edits every match.
    """
    if where not in ("output", "input"):
        raise ValueError(f"where must be 'output' or 'input'; got {where!r}.")
    if fn is None and grad_fn is None:
        raise ValueError("give fn (to change the tensor), grad_fn (to change its gradient), or both.")
    if where == "input" and grad_fn is not None:
        raise ValueError("grad_fn rewrites the gradient of a layer's output; use where='output'.")

    def edit_output(module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, Tensor):
            raise TypeError(f"edit needs a layer whose output is a tensor; this one returned {type(output).__name__}.")
        edited = fn(output) if fn is not None else output
        if grad_fn is not None and edited.requires_grad:
            edited = edited.clone()  # an in-place op after the layer must not move the gradient hook
            edited.register_hook(grad_fn)
            return edited.clone()
        return edited

    def edit_input(module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], Tensor):
            raise TypeError("where='input' edits the first positional input, which must be a tensor.")
        return (fn(args[0]), *args[1:])

    handles = []
    try:
        for _, module in find_layers(model, layer):
            if where == "output":
                handles.append(module.register_forward_hook(edit_output))
            else:
                handles.append(module.register_forward_pre_hook(edit_input))
        yield
    finally:
        for handle in handles:
            handle.remove()
