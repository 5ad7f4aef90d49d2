"""BatchNorm's backward handed a contiguous gradient: what every explainer call on the CPU does.

torch 2.14's CPU BatchNorm backward (eval mode) is wrong for a one-row batch whose incoming gradient has the strides
of a feature map read as tokens (``x.flatten(2).transpose(1, 2)`` after the BatchNorm, as timm's LeViT and XCiT do:
strides such as (8, 1, 16, 8) for a (1, 8, 2, 2) gradient, which the kernel takes for channels-last): the input
gradient is not grad · weight / √(running_var + eps) (errors of the gradient's own size), while two rows or a
contiguous gradient come out right. Every gradient method then gave an image explained alone another map than the same
image in a batch. Some layouts are wrong at any batch size: a feature map one pixel high or wide read
``transpose(1, 3)`` (strides such as (16, 1, 8, 8)); InstanceNorm, which is one BatchNorm row of N · C channels
inside, read sequence-first (``flatten(2).permute(2, 0, 1)``) or called on one unbatched (C, H, W) image
(tests/test_batch_norm_guard_attacks.py).

``contiguous_batch_norm_gradients`` gives every BatchNorm module of the model (``nn.BatchNorm1d/2d/3d`` and their
subclasses, timm's ``BatchNormAct2d`` included, and InstanceNorm, which torch computes with the same kernel and gets
wrong the same way) a forward hook for the call: on an output that is in the graph (any number of rows) it registers a
pre-hook on the output's autograd node (the module's own backward, read when the module returns, before any in-place
edit of the output rebases it) that makes the gradient arriving there contiguous before that backward reads it (a tensor
hook where the output has no node); for an output laid out channels-last (a batch the CPU runs channels-last,
``explain.core.memory_format``) the gradient is made channels-last instead, the layout the kernel then reads right and
the one the convolutions' backward hands it, so that nothing is copied. The output is the module's own tensor (rules
that follow tensors, LRP's and DeepLIFT's, see nothing new), the backward is torch's (also twice differentiable, as
Shapley-CAM needs), and a gradient that is already contiguous is passed on as it is: no operation is added. A node's
pre-hook costs less than a tensor hook (no handle, no hook dictionary on the tensor). A ``F.batch_norm`` called outside
any BatchNorm module is not covered.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.scope import CallScope


def _contiguous(gradient: Optional[Tensor]) -> Optional[Tensor]:
    return gradient if gradient is None else gradient.contiguous()


def _contiguous_first(gradients: tuple[Optional[Tensor], ...]) -> tuple[Optional[Tensor], ...]:
    """A node's incoming gradients with the first (its output's) contiguous, the others as they are."""
    first = gradients[0]
    if first is None or first.is_contiguous():
        return gradients
    return (first.contiguous(), *gradients[1:])


def _channels_last(gradient: Optional[Tensor]) -> Optional[Tensor]:
    return gradient if gradient is None else gradient.contiguous(memory_format=torch.channels_last)


def _channels_last_first(gradients: tuple[Optional[Tensor], ...]) -> tuple[Optional[Tensor], ...]:
    """A node's incoming gradients with the first (its output's, 4-D) channels-last, the others as they are."""
    first = gradients[0]
    if first is None or first.is_contiguous(memory_format=torch.channels_last):
        return gradients
    return (first.contiguous(memory_format=torch.channels_last), *gradients[1:])


def _is_channels_last(output: Tensor) -> bool:
    """Whether a norm's output is laid out channels-last (a channels-last batch, ``explain.core.memory_format``), so
    that the gradient its backward reads right is channels-last too, not contiguous."""
    return output.dim() == 4 and not output.is_contiguous() and output.is_contiguous(memory_format=torch.channels_last)


def _contiguous_gradient_at_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    if isinstance(output, Tensor) and output.requires_grad and output.dim() >= 2:
        channels_last = _is_channels_last(output)
        node = output.grad_fn
        if node is not None and output.output_nr == 0:
            node.register_prehook(_channels_last_first if channels_last else _contiguous_first)
        else:
            output.register_hook(_channels_last if channels_last else _contiguous)


def contiguous_batch_norm_gradients(scope: CallScope, modules: Iterable[nn.Module]) -> None:
    """For the scope, each BatchNorm and InstanceNorm module's (of ``modules``) output hands its backward a
    contiguous gradient."""
    for module in modules:
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
            scope.forward_hook(module, _contiguous_gradient_at_output)


def _batch_statistics_rows(module: nn.Module, args: Any, output: Any) -> None:
    if isinstance(output, Tensor) and output.dim() >= 2 and output.shape[0] > 1:
        warn_at_callers_line(
            f"the model's {type(module).__name__} keeps no running statistics (track_running_stats=False), so even "
            "in eval mode it normalises with the statistics of the batch it is given: the images of one call, and "
            "the copies of an image that a method runs together (Integrated Gradients' path, SmoothGrad's samples), "
            "change each other's maps. Explain one image per call, with batch_size=1 where the method takes it, for "
            "maps that depend on the image alone.", RuntimeWarning)


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm without running statistics (``track_running_stats=False``), which normalises
    with the statistics of the batch it is given also in eval mode: the rows of a batch change each other's output."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None


def warn_of_batch_statistics(scope: CallScope, modules: Iterable[nn.Module]) -> None:
    """For the scope, a warning where a BatchNorm without running statistics (``uses_batch_statistics``) runs on
    more than one row: the rows of a pass then change each other's maps."""
    for module in modules:
        if uses_batch_statistics(module):
            scope.forward_hook(module, _batch_statistics_rows)
