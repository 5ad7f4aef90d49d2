"""DeepLIFT with the rescale rule (Shrikumar et al. 2017) and DeepLIFT-SHAP.

The model runs once on the images and their baselines stacked, [x; x'], (2N, C, H, W). During
that forward only, a call-scoped rule (``explain.rules``) reroutes every nonlinearity through an autograd function
whose backward is the rescale rule: the multiplier of y = f(z) is Δy/Δz = (f(z) − f(z'))/(z − z')
instead of f'(z) (the ordinary derivative where |Δz| < eps). Max pooling takes its rule from
the pair of maxima. ``autograd.grad`` then gives the multipliers m at the input, and the
attributions are (x − x') ⊙ m, which sum to y(x) − y(x') ("summation to delta") for networks
of linear layers, these nonlinearities and pooling.

Functional calls (``F.relu``, ``torch.sigmoid``, ``Tensor.relu_``) count as well as modules, and a
ReLU module used several times (torchvision's BasicBlock) is fine: the rule belongs to each
call, not to a module. No module is replaced.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Unpack

from ..rules import CallRules, Rule
from ..scope import CallScope
from ..targets import SelectedTargets, Target, select_targets
from .base import Attribution, checked_batch_size, register
from .expected_gradients import check_references, references_for
from .gradients import GradientExplainer, GradientOptions, all_zero, baseline_like

ELEMENTWISE: dict[Callable[..., Any], Callable[..., Tensor]] = {
    F.relu: F.relu, torch.relu: F.relu, Tensor.relu: F.relu,
    torch.relu_: F.relu, Tensor.relu_: F.relu,
    F.elu: F.elu, F.leaky_relu: F.leaky_relu, F.softplus: F.softplus, F.gelu: F.gelu, F.silu: F.silu,
    torch.sigmoid: torch.sigmoid, Tensor.sigmoid: torch.sigmoid, F.sigmoid: torch.sigmoid,
    torch.tanh: torch.tanh, Tensor.tanh: torch.tanh, F.tanh: torch.tanh,
}
"""Elementwise nonlinearities whose backward becomes the rescale rule, and the function computed."""
IN_PLACE: set[Callable[..., Any]] = {torch.relu_, Tensor.relu_}
MAX_POOLS: set[Callable[..., Any]] = {F.max_pool1d, F.max_pool2d, F.max_pool3d}


def _halves(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of the images and of their baselines, of a (2N, ...) tensor."""
    images, baselines = tensor.chunk(2)
    return images, baselines


class RescaledNonlinearity(torch.autograd.Function):
    """y = f(z) on [z; z']; backward: grad · m with the multiplier m = Δy/Δz for both halves, and f'
    at each half's own z where |Δz| < eps. The multipliers are computed in the forward and kept alone
    (not the inputs and outputs, which later in-place operations could change)."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, function: Callable[[Tensor], Tensor], eps: float) -> Tensor:
        outputs = function(inputs)
        z, z_ref = _halves(inputs)
        y, y_ref = _halves(outputs)
        delta_in = z - z_ref
        small = delta_in.abs() < eps
        rescaled = (y - y_ref) / torch.where(small, torch.ones_like(delta_in), delta_in)
        ordinary = _derivative(function, inputs)
        ctx.save_for_backward(torch.where(torch.cat([small, small]), ordinary, torch.cat([rescaled, rescaled])))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], None, None]:
        (grad_output,) = grad_outputs  # one output, one gradient
        (multipliers,) = ctx.saved_tensors
        return grad_output * multipliers, None, None


def _derivative(function: Callable[[Tensor], Tensor], inputs: Tensor) -> Tensor:
    """f'(z) elementwise for an elementwise f: by its formula for ReLU, by autograd otherwise."""
    if function is F.relu:
        return (inputs > 0).to(inputs.dtype)
    with torch.enable_grad():
        leaf = inputs.detach().requires_grad_(True)
        (derivative,) = torch.autograd.grad(function(leaf).sum(), leaf)
    return derivative


class MaxPoolRule(torch.autograd.Function):
    """Max pooling on [z; z'] (Shrikumar et al.'s rule): with y = pool(z), y' = pool(z') and
    u = max(y, y'), the images' half sends grad · (u − y') back to the positions of z's maxima,
    the baselines' half grad · (y − u) to those of z''s maxima, both halves get the sum divided by
    Δz. Positions shared by overlapping windows (a 3×3 pool of stride 2) add up their windows'
    shares, so the multipliers sum exactly to the pooled difference. Where |Δz| < eps, the pooling's
    ordinary gradient (grad sent to each half's own maxima)."""

    eps = 1e-10

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, pool: Callable[..., Any], options: dict[str, Any]) -> Tensor:
        outputs, indices = pool(inputs, return_indices=True, **options)
        z, z_ref = _halves(inputs)
        ctx.input_shape = inputs.shape
        ctx.save_for_backward(z - z_ref, outputs.detach().clone(), indices)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Optional[Tensor], None, None]:
        (grad_output,) = grad_outputs  # one output, one gradient
        delta_half, outputs, indices = ctx.saved_tensors
        y, y_ref = _halves(outputs)
        larger = torch.max(y, y_ref)
        shares = grad_output * torch.cat([larger - y_ref, y - larger])
        first, second = _halves(_to_maxima(shares, indices, ctx.input_shape))
        small = delta_half.abs() < MaxPoolRule.eps
        rescaled = (first + second) / torch.where(small, torch.ones_like(delta_half), delta_half)
        ordinary = _to_maxima(grad_output, indices, ctx.input_shape)  # max pooling's own backward
        return torch.where(torch.cat([small, small]), ordinary, torch.cat([rescaled, rescaled])), None, None


def _to_maxima(values: Tensor, indices: Tensor, input_shape: torch.Size) -> Tensor:
    """(N, C, *pooled) values added up at the input positions their windows' maxima came from
    (``indices`` as max pooling returns them): (N, C, *input spatial)."""
    spread = torch.zeros(*input_shape[:2], input_shape[2:].numel(), dtype=values.dtype, device=values.device)
    spread.scatter_add_(2, indices.flatten(2), values.flatten(2))
    return spread.view(input_shape)


def _pool_options(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> Optional[dict[str, Any]]:
    """The keyword arguments of a max_pool call (None for one that asks for indices itself)."""
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    options = dict(zip(names, args[1:]))
    options.update(kwargs)
    if options.pop("return_indices", False):
        return None
    if options.get("stride") is None:
        options.pop("stride", None)
    return options


class RescaleRule(Rule):
    """During the forward on [x; x']: nonlinearities and max pooling with DeepLIFT's backward;
    ``calls`` counts the calls rerouted."""

    functions: ClassVar[frozenset[Callable[..., Any]]] = frozenset(ELEMENTWISE) | frozenset(MAX_POOLS)

    def __init__(self, eps: float):
        self.eps = eps
        self.calls = 0

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func in ELEMENTWISE and args and isinstance(args[0], Tensor) and args[0].is_floating_point():
            self.calls += 1
            inputs, compute, in_place = _elementwise_call(func, args, kwargs)
            result = RescaledNonlinearity.apply(inputs, compute, self.eps)
            return inputs.copy_(result) if in_place else result
        if func in MAX_POOLS and args and isinstance(args[0], Tensor):
            options = _pool_options(func, args, kwargs)
            if options is not None:
                self.calls += 1
                return MaxPoolRule.apply(args[0], func, options)
        return func(*args, **kwargs)


def _elementwise_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[Tensor, Callable[[Tensor], Tensor], bool]:
    """(input, the out-of-place computation of the call on a tensor, whether the call was in place)."""
    function = ELEMENTWISE[func]
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):  # built-ins without a signature: other arguments passed on as given
        return args[0], lambda tensor: function(tensor, *args[1:], **kwargs), func in IN_PLACE
    parameters = dict(bound.arguments)
    inputs = parameters.pop(next(iter(parameters)))
    in_place = bool(parameters.pop("inplace", False)) or func in IN_PLACE
    if function is not func:  # torch.relu → F.relu etc.: only the input is passed
        parameters = {}
    return inputs, lambda tensor: function(tensor, **parameters), in_place


class rescale_rule(CallScope[RescaleRule]):  # noqa: N801 - used like a function, as torch.no_grad is
    """``with rescale_rule(eps) as rule:`` — this thread's forward passes run on [x; x'] with DeepLIFT's
    rescale rule at every nonlinearity and max pooling; removed when the block ends."""

    def __init__(self, eps: float = 1e-10):
        super().__init__()
        self.rule = RescaleRule(eps)

    def setup(self) -> RescaleRule:
        self.enter(CallRules([self.rule]))
        return self.rule


@register
class DeepLift(GradientExplainer):
    """DeepLIFT, rescale rule (Shrikumar et al. 2017): (x − x') ⊙ the multipliers of the score,
    back-propagated with Δy/Δz in place of each nonlinearity's derivative.

    baseline: "zeros" (default), "blur" or a tensor broadcastable to the batch (see
        IntegratedGradients). eps: |Δz| below which the ordinary derivative is used.
    ``Explanation.diagnostics["summation_error"]`` (N, K) is Σ attributions − (y(x) − y(x')),
    zero up to rounding for ReLU/max-pool networks; ``["score_change"]`` is y(x) − y(x').
    The targets (top-1, top-k) and scores come from the images' rows of the one forward on [x; x'].
    A model whose rows depend on each other in eval mode (batch statistics computed inside its
    forward) gives other scores there than on x alone, and so do its attributions: such a model has
    no per-image DeepLIFT, here or in Captum, which stacks the rows alike.
    """

    name = "deeplift"
    summary = "DeepLIFT: differences from a baseline propagated with the rescale rule (sums to the score change)"

    def __init__(self, model: nn.Module, *, baseline: Union[str, Tensor] = "zeros", eps: float = 1e-10,
                 **options: Unpack[GradientOptions]):
        super().__init__(model, **options)
        baseline_like(baseline, None)  # validates
        self.baseline, self.eps = baseline, eps

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        baseline = baseline_like(self.baseline, batch)
        attributions, score_change, disconnected, selected = self.rescaled(
            batch, baseline, (target, topk), torch.arange(count, device=batch.device))
        self.disconnected = disconnected
        summation_error = attributions.double().sum(dim=(2, 3, 4)) - score_change
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(attributions),
                                     summation_error=summation_error.float(), score_change=score_change.float())

    def rescaled(self, inputs: Tensor, baselines: Tensor, targets: SelectedTargets | tuple[Target, Optional[int]],
                 image_of_row: Tensor) -> tuple[Tensor, Tensor, Tensor, SelectedTargets]:
        """DeepLIFT of R rows against their own baselines, row r being a copy of image
        ``image_of_row[r]``: ((R, K, C, H, W) attributions, (R, K) y(x) − y(x') in float64,
        (R, K) bool where the score does not depend on the input, the targets). targets: selected
        already, or (target, topk) to select on the images' half of this forward (R = N images)."""
        rows = len(inputs)
        both_images = torch.cat([image_of_row, image_of_row])
        with torch.enable_grad():
            stacked = torch.cat([inputs, baselines]).detach().requires_grad_(True)
            with rescale_rule(self.eps):
                output = self.call_model(stacked, rows=both_images)
            if isinstance(targets, SelectedTargets):
                selected = targets
            elif isinstance(output, Tensor) and output.shape[:1] == (2 * rows,):  # no forward of its own
                selected = select_targets(output[:rows].detach(), *targets, batch_size=rows)
            else:  # an output that cannot be split by rows: the targets from a forward at x
                with torch.no_grad():
                    selected = select_targets(self.call_model(inputs), *targets, batch_size=rows)
            scores = selected.scores_for(output, both_images)  # (2R, K)
            multipliers, disconnected = [], []
            for k in range(scores.shape[1]):
                score = scores[:, k].sum()  # both halves, as Captum does: max pooling mixes them
                gradient = None
                if score.requires_grad:
                    (gradient,) = torch.autograd.grad(score, stacked, retain_graph=k < scores.shape[1] - 1,
                                                      allow_unused=True)
                multipliers.append(torch.zeros_like(inputs) if gradient is None else gradient[:rows])
                disconnected.append(torch.full((rows,), gradient is None, dtype=torch.bool, device=inputs.device))
        score_change = (scores[:rows] - scores[rows:]).detach().double()
        attributions = (inputs - baselines)[:, None] * torch.stack(multipliers, dim=1)
        return attributions, score_change, torch.stack(disconnected, dim=1), selected


@register
class DeepLiftShap(DeepLift):
    """DeepLIFT-SHAP (Lundberg & Lee 2017): the mean of DeepLIFT attributions over a distribution
    of baselines.

    baselines: (B, C, H, W) reference inputs (e.g. a batch of training images, preprocessed);
        every image is explained against each of them and the attributions averaged. None:
        the zero input alone (then this equals DeepLift).
    batch_size: image-baseline pairs per forward/backward pass;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    ``diagnostics["summation_error"]``: Σ attributions − mean over baselines of (y(x) − y(b)).
    """

    name = "deepliftshap"
    summary = "DeepLIFT-SHAP: DeepLIFT averaged over a distribution of baselines"

    not_options: ClassVar[tuple[str, ...]] = ("baseline",)
    """DeepLift's single baseline is replaced by ``baselines``."""

    def __init__(self, model: nn.Module, baselines: Optional[Tensor] = None, *, eps: float = 1e-10,
                 batch_size: Optional[int] = None, **options: Unpack[GradientOptions]):
        check_references(baselines)
        checked_batch_size(batch_size)
        super().__init__(model, eps=eps, **options)
        self.baselines, self.batch_size = baselines, batch_size

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            selected = select_targets(self.call_model(batch), target, topk, batch_size=count)
        baselines = references_for(self.baselines, batch)
        pairs = torch.cartesian_prod(torch.arange(count), torch.arange(len(baselines))).to(batch.device)
        total = torch.zeros(count, selected.scores.shape[1], *batch.shape[1:], dtype=torch.float64,
                            device=batch.device)
        change = torch.zeros(count, selected.scores.shape[1], dtype=torch.float64, device=batch.device)
        disconnected = torch.ones(count, selected.scores.shape[1], dtype=torch.bool, device=batch.device)

        def pair_attributions(rows: slice) -> tuple[Tensor, Tensor, Tensor]:
            images, references = pairs[rows].unbind(1)
            attributions, score_change, unreachable, _ = self.rescaled(batch[images], baselines[references],
                                                                       selected, images)
            return attributions.double(), score_change, unreachable

        for rows, (attributions, score_change, unreachable) in self.row_passes(len(pairs), self.batch_size,
                                                                               batch.device, pair_attributions):
            images = pairs[rows, 0]
            total.index_add_(0, images, attributions)
            change.index_add_(0, images, score_change)
            disconnected[images] &= unreachable
        attributions = (total / len(baselines)).to(batch.dtype)
        score_change = change / len(baselines)
        self.disconnected = disconnected
        summation_error = attributions.double().sum(dim=(2, 3, 4)) - score_change
        return self.attribution_from(attributions, selected, zero_gradient=all_zero(attributions),
                                     summation_error=summation_error.float(), score_change=score_change.float())
