"""BatchNorm's backward handed a contiguous gradient: what every explainer call on the CPU does.

torch 2.14's CPU BatchNorm backward (eval mode) is wrong for a one-row batch whose incoming gradient has the strides
of a feature map read as tokens (``x.flatten(2).transpose(1, 2)`` after the BatchNorm, as timm's LeViT and XCiT do:
strides such as (8, 1, 16, 8) for a (1, 8, 2, 2) gradient, which the kernel takes for channels-last): the input
gradient is not grad · weight / √(running_var + eps) (errors of the gradient's own size), while two rows or a
contiguous gradient come out right. Every gradient method then gave an image explained alone another map than the same
image in a batch.

``contiguous_batch_norm_gradients`` gives every BatchNorm module of the model (``nn.BatchNorm1d/2d/3d`` and their
subclasses, timm's ``BatchNormAct2d`` included, and InstanceNorm, which torch computes with the same kernel and
gets wrong the same way) a forward hook for the call: on a one-row output that is in the graph
it registers a tensor hook that makes the gradient arriving there contiguous before BatchNorm's own backward reads it.
The output is the module's own tensor (rules that follow tensors, LRP's and DeepLIFT's, see nothing new), the backward
is torch's (also twice differentiable, as Shapley-CAM needs), and a gradient that is already contiguous is passed on
as it is: no operation is added. A ``F.batch_norm`` called outside any BatchNorm module is not covered.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import Tensor, nn

from ..core.scope import CallScope


def _contiguous(gradient: Optional[Tensor]) -> Optional[Tensor]:
    return gradient if gradient is None else gradient.contiguous()


def _contiguous_gradient_at_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    if isinstance(output, Tensor) and output.requires_grad and output.dim() >= 2 and output.shape[0] == 1:
        output.register_hook(_contiguous)


def contiguous_batch_norm_gradients(scope: CallScope, modules: Iterable[nn.Module]) -> None:
    """For the scope, each BatchNorm and InstanceNorm module's (of ``modules``) one-row output hands its backward a
    contiguous gradient."""
    for module in modules:
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
            scope.forward_hook(module, _contiguous_gradient_at_output)
