"""Sanity check by cascading model-parameter randomisation (Adebayo et al. 2018).

The layers are re-initialised one after the other, from the output back to the
input, on a copy of the model; after each stage the maps are compared with the
trained model's. A method whose maps barely change while the model forgets what
it learned is not explaining the model.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.capture import find_layers, model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import Target
from ..io.inputs import Inputs, prepare_inputs
from ..methods.base import Explainer
from ._common import run_model


def average_ranks(values: Tensor) -> Tensor:
    """(N, P) values → (N, P) ranks 1…P along each row, ties given their average rank."""
    order = values.argsort(dim=1, stable=True)
    sorted_values = values.gather(1, order)
    ranks = torch.empty_like(values, dtype=torch.float64)
    for row in range(values.shape[0]):
        _, inverse, counts = torch.unique_consecutive(sorted_values[row], return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).double()
        averages = ends - (counts.double() - 1) / 2  # mean of the positions a run of ties occupies
        ranks[row, order[row]] = averages[inverse]
    return ranks


def spearman(first: Tensor, second: Tensor) -> Tensor:
    """Spearman rank correlation of each pair of maps, (N, ...) each → (N,) in [-1, 1]
    (0 where a map is constant)."""
    a = average_ranks(first.reshape(first.shape[0], -1).double().cpu())
    b = average_ranks(second.reshape(second.shape[0], -1).double().cpu())
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    denominator = (a.norm(dim=1) * b.norm(dim=1))
    return torch.where(denominator > 0, (a * b).sum(1) / denominator.clamp_min(1e-300), 0.0).float()


def ssim(first: Tensor, second: Tensor, window: int = 11, sigma: float = 1.5) -> Tensor:
    """Structural similarity (Wang et al. 2004) of each pair of (N, H, W) maps in [0, 1],
    Gaussian window, data range 1 → (N,) in [-1, 1], 1 for equal maps."""
    x, y = first.double()[:, None].cpu(), second.double()[:, None].cpu()
    window = min(window, x.shape[-1], x.shape[-2])
    window -= 1 - window % 2  # odd, and no larger than the maps
    coordinates = torch.arange(window, dtype=torch.float64) - window // 2
    gauss = torch.exp(-(coordinates**2) / (2 * sigma**2))
    kernel = (gauss[:, None] * gauss[None, :] / gauss.sum() ** 2)[None, None]

    def blur(values: Tensor) -> Tensor:
        return F.conv2d(values, kernel)

    mean_x, mean_y = blur(x), blur(y)
    var_x = blur(x * x) - mean_x**2
    var_y = blur(y * y) - mean_y**2
    covariance = blur(x * y) - mean_x * mean_y
    c1, c2 = 0.01**2, 0.03**2
    index = ((2 * mean_x * mean_y + c1) * (2 * covariance + c2)) / ((mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2))
    return index.mean(dim=(1, 2, 3)).float()


@dataclass
class RandomizationStage:
    """After re-initialising ``layers`` (this stage's and all above): per image, the Spearman rank
    correlation of |map| and the SSIM of the [0, 1]-scaled |map| against the trained model's.
    Both 1 for unchanged maps; a faithful method's values fall as layers are randomised."""

    layer: str
    layers: list[str]
    rank_correlation: Tensor
    ssim: Tensor


def _execution_order(model: nn.Module, names: Sequence[str], batch: Tensor, options: Mapping[str, Any]) -> list[str]:
    order: list[str] = []
    handles = [
        module.register_forward_hook(lambda module, args, output, name=name: order.append(name))
        for name, module in find_layers(model, list(names))
    ]
    try:
        with torch.no_grad(), preserved_model_state(model):
            run_model(model, batch, options, batch.shape[0])
    finally:
        for handle in handles:
            handle.remove()
    return list(dict.fromkeys(order))


@runtime_checkable
class _ResetsParameters(Protocol):
    def reset_parameters(self) -> None: ...


@runtime_checkable
class _ResetsRunningStats(Protocol):
    def reset_running_stats(self) -> None: ...


FREE_PARAMETER_STD = 0.02
"""The spread of the normal draw (truncated at ±2 std) that re-initialises a parameter no ``reset_parameters``
covers: position embeddings, class tokens, relative position bias tables, layer scales (timm's and
HuggingFace's own initialisation of such parameters)."""


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """A scope whose draws from torch's global generators (``reset_parameters``) start from ``seed``: the CPU's,
    every CUDA device's once CUDA is in use, and MPS's; each is left as it was after the scope (unlike
    ``torch.manual_seed``, which reseeds every device's for good and queues a seed for a CUDA not yet used)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    mps = torch.backends.mps.is_available()
    mps_state = torch.mps.get_rng_state() if mps else None
    try:
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
            torch.random.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed_all(seed)
            if mps:
                torch.mps.manual_seed(seed)
            yield
    finally:
        if mps_state is not None:
            torch.mps.set_rng_state(mps_state)


def reinitialize(module: nn.Module, generator_seed: int) -> None:
    """Re-initialise every parameter (and BatchNorm statistics) of a module, seeded: each submodule's own
    ``reset_parameters`` (``_reset_parameters`` for nn.MultiheadAttention) where it has one, else its own
    parameters drawn afresh (``reinitialize_free_parameters``). A parameter that the reset leaves untouched is
    drawn afresh too: ``torch.nn.utils.weight_norm``'s ``weight_g`` / ``weight_v`` and ``spectral_norm``'s
    ``weight_orig``, from which the forward recomputes the ``weight`` that ``reset_parameters`` re-initialises
    in vain."""
    with seeded_rng(generator_seed):
        for submodule in module.modules():
            if isinstance(submodule, (_ResetsParameters, nn.MultiheadAttention)):
                own = {name: (parameter._version, parameter.detach().clone())
                       for name, parameter in submodule.named_parameters(recurse=False)}
                if isinstance(submodule, _ResetsParameters):  # hasattr(submodule, "reset_parameters")
                    submodule.reset_parameters()
                else:  # nn.MultiheadAttention: its reset is private
                    submodule._reset_parameters()
                reinitialize_free_parameters(submodule, [
                    name for name, parameter in submodule.named_parameters(recurse=False)
                    if name in own and parameter._version == own[name][0] and torch.equal(parameter, own[name][1])])
            else:
                if isinstance(submodule, _ResetsRunningStats):
                    submodule.reset_running_stats()
                reinitialize_free_parameters(submodule)


def reinitialize_free_parameters(module: nn.Module, names: Optional[Sequence[str]] = None) -> None:
    """Draw the module's own parameters (not its children's; only those ``names`` when given) afresh from
    N(0, FREE_PARAMETER_STD²) truncated at ±2 std, from torch's generator."""
    with torch.no_grad():
        for name, parameter in module.named_parameters(recurse=False):
            if names is None or name in names:
                nn.init.trunc_normal_(parameter, std=FREE_PARAMETER_STD, a=-2 * FREE_PARAMETER_STD,
                                      b=2 * FREE_PARAMETER_STD)


def _magnitude(maps: Tensor) -> Tensor:
    magnitude = maps.abs().reshape(maps.shape[0], -1)
    scale = magnitude.amax(dim=1, keepdim=True)
    return torch.where(scale > 0, magnitude / scale.clamp_min(1e-30), 0.0).reshape(maps.shape)


Randomize = Callable[[nn.Module, int], None]
"""How a stage's layer is re-initialised: called with the layer (of the copy) and the stage's index 0, 1, …"""

ORDERS = ("top_down", "bottom_up")


def default_stages(model: nn.Module) -> list[str]:
    """The model's top-level children that have parameters: the default stages of randomisation."""
    return [name for name, child in model.named_children() if any(True for _ in child.parameters())]


def randomized_copies(
    explainer: Explainer,
    batch: Tensor,
    stages: Sequence[str],
    *,
    order: str = "top_down",
    seed: int = 0,
    randomize: Optional[Randomize] = None,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> Iterator[tuple[str, list[str], Explainer]]:
    """Randomise ``stages`` one after the other, cumulatively, on one deep copy of the explainer and its
    model, yielding (layer, the layers randomised so far, the copy) after each stage. The given model is
    not changed.

    order: "top_down" (from the last layer the forward on ``batch`` runs back to the first, as Adebayo et
        al. 2018) or "bottom_up" (first layer first, as Hedström et al. 2023 recommend).
    randomize: re-initialises a stage's layer, given the layer and the stage's index; default
        ``reinitialize(layer, seed + index)``, and with the stage that runs first, the parameters the model
        holds itself (timm's ``pos_embed`` and ``cls_token``: the embedding's). A stage that never runs in the
        forward is left out. explain_options: the model's other inputs (``forward_kwargs``, ...) as ``explain``
        takes them, for the forward that orders the stages.
    """
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be 'top_down' or 'bottom_up'; got {order!r}.")
    executed = _execution_order(explainer.model, stages, batch, explain_options or {})
    sequence = list(reversed(executed)) if order == "top_down" else executed
    with torch.inference_mode(False):  # a copy made in the caller's inference_mode would hold inference tensors
        randomized = copy.deepcopy(explainer)  # copies the model too, and the layers' references into it
    modules = dict(randomized.model.named_modules())
    for index, name in enumerate(sequence):
        with torch.inference_mode(False):
            if randomize is None:
                reinitialize(modules[name], seed + index)
                if name == executed[0]:  # the model's own parameters go with the embedding, which runs first
                    with seeded_rng(seed + index + len(sequence)):
                        reinitialize_free_parameters(randomized.model)
            else:
                randomize(modules[name], index)
        yield name, sequence[: index + 1], randomized


def cascading_randomization(
    explainer: Explainer,
    inputs: Inputs,
    target: Target = None,
    *,
    stages: Optional[Sequence[str]] = None,
    seed: int = 0,
    explain_options: Optional[Mapping[str, Any]] = None,
) -> list[RandomizationStage]:
    """Cascading randomisation, top layer first, on a deep copy of the explainer and its model.

    stages: layer names to randomise, in any order (they are run from the last executed to the
        first); default: the model's top-level children that have parameters.
    The classes explained stay those of the trained model's maps. The given model is not changed.
    Returns one RandomizationStage per layer.
    """
    model = explainer.model
    batch = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model),
                           channels=model_input_channels(model)).batch
    options = explain_options or {}
    trained = explainer.explain(batch, target, **options)
    classes = trained.class_indices if trained.class_indices is not None else target
    reference = _magnitude(trained.map_grid[:, 0])
    results: list[RandomizationStage] = []
    for name, layers, randomized in randomized_copies(
            explainer, batch, default_stages(model) if stages is None else stages, seed=seed,
            explain_options=options):
        maps = randomized.explain(batch, classes, **options).map_grid[:, 0]
        current = _magnitude(maps)
        results.append(RandomizationStage(
            layer=name,
            layers=layers,
            rank_correlation=spearman(reference, current),
            ssim=ssim(reference, current),
        ))
    return results
