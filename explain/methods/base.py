"""The pipeline every method shares: inputs → model → targets → method's maps → Explanation."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import math
import numbers
import re
import textwrap
import threading
import warnings
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    ClassVar,
    Collection,
    Generic,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    TypedDict,
    TypeVar,
    Union,
    overload,
)

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..capture import (
    ForwardArguments,
    check_hookable,
    eager_model,
    is_out_of_memory,
    map_tensors,
    model_device,
    model_dtype,
    run_model,
)
from ..checks import check, deferred_checks
from ..explanation import Diagnostic, Explanation
from ..inputs import Inputs, PreprocessSpec, as_preprocess, prepare_inputs
from ..memory_format import channels_last_copies, may_be_layout_error, model_batch, usual_layout_only
from ..models import ModelSource, loaded_model_parts
from ..scope import CallScope
from ..targets import (
    OutputSelector,
    SelectedTargets,
    Target,
    class_indices_for_names,
    model_class_names,
    select_output,
)
from ..units import bind_units
from ._eval_batch_norm import contiguous_batch_norm_gradients

NORMALIZATIONS = ("max", "minmax", None)


PerImage = Collection[Union[int, str]]
"""Which of a model's other arguments hold one row per image: positions in ``forward_args`` (int)
and names in ``forward_kwargs`` (str)."""


def tensor_shapes(value: object) -> list[tuple[int, ...]]:
    """The shapes of the tensors a (nested tuple / list / dict) argument holds."""
    shapes: list[tuple[int, ...]] = []
    map_tensors(value, lambda tensor: shapes.append(tuple(tensor.shape)))
    return shapes


@dataclass
class ForwardCall:
    """The other arguments of a model's forward, for models with several inputs.

    args / kwargs: passed through; position: where the explained batch goes, an index into the
    positional arguments or a keyword name; batch_size: N. per_image: (positions, keyword names)
    of the tensors that hold one row per image and follow the rows when a method runs copies of
    the images (path points, noisy copies); the others are shared by every copy. None: not stated
    by the caller, which is only accepted where it cannot be misread: no tensor argument has N rows.
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    position: int | str = 0
    batch_size: int = 0
    per_image: Optional[tuple[frozenset[int], frozenset[str]]] = None

    @classmethod
    def stated(cls, args: object, kwargs: object, position: object, batch_size: int,
               per_image: Optional[PerImage]) -> Optional["ForwardCall"]:
        """The call as ``explain`` receives it, each part checked: ``args`` a tuple or list, ``kwargs`` a
        dict, ``position`` where the batch goes among the positional arguments (0 … len(args); −1 is the
        last place) or a keyword that ``kwargs`` does not hold, ``per_image`` naming arguments given.
        None for a model called with the batch alone."""
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"forward_args must be a tuple or list of the model's other positional inputs (e.g. "
                            f"forward_args=(text,)); got {type(args).__name__}.")
        if not isinstance(kwargs, dict):
            raise TypeError(f"forward_kwargs must be a dict of the model's other keyword inputs; got "
                            f"{type(kwargs).__name__}.")
        if isinstance(position, str):
            if position in kwargs:
                raise ValueError(f"input_position={position!r} names the keyword where the images go, and "
                                 f"forward_kwargs holds {position!r} too: leave it out of forward_kwargs.")
        elif isinstance(position, int) and not isinstance(position, bool) and -len(args) - 1 <= position <= len(args):
            position = position if position >= 0 else position + len(args) + 1
        else:
            raise ValueError(f"input_position must be a keyword name or the images' place among the model's "
                             f"{len(args) + 1} positional inputs, 0 to {len(args)} (or −1 for the last); got "
                             f"{position!r}.")
        if not args and not kwargs and position == 0 and not per_image:
            return None
        call = cls(tuple(args), dict(kwargs), position, batch_size)
        if per_image is None:
            return call
        if isinstance(per_image, (str, int)):
            raise TypeError(f"per_image must be a collection of forward_args positions and forward_kwargs names "
                            f"(e.g. per_image=[{per_image!r}]); got {per_image!r}.")
        names = [item for item in per_image if isinstance(item, str)]
        positions = [item for item in per_image if isinstance(item, int) and not isinstance(item, bool)]
        unknown = [item for item in per_image if item not in names and item not in positions]
        unknown += [name for name in names if name not in kwargs]
        unknown += [index for index in positions if not -len(args) <= index < len(args)]
        if unknown:
            raise ValueError(f"per_image names {unknown!r}, which are not among the model's other inputs "
                             f"(forward_args positions {list(range(len(args)))}, forward_kwargs names "
                             f"{sorted(kwargs)}).")
        positions = [index % len(args) for index in positions]
        for where, value in [*((f"forward_args[{i}]", args[i]) for i in positions),
                             *((f"forward_kwargs[{n!r}]", kwargs[n]) for n in names)]:
            shapes = tensor_shapes(value)
            if not shapes or any(not shape or shape[0] != batch_size for shape in shapes):
                shown = shapes[0] if isinstance(value, Tensor) else f"{type(value).__name__} of tensors {shapes}"
                raise ValueError(f"per_image says {where} holds one row per image, but it is {shown} for "
                                 f"{batch_size} image{'s' if batch_size != 1 else ''}: a per-image tensor's first "
                                 "dimension (of every tensor, in a list or dict) is the number of images. Leave it "
                                 "out of per_image if every image shares it.")
        call.per_image = frozenset(positions), frozenset(names)
        return call

    def arguments(self, inputs: Tensor) -> ForwardArguments:
        """(args, kwargs) of one forward, with copies of the other tensors (the model may edit them in place)."""
        copy = map_tensors(self.args, Tensor.clone), map_tensors(self.kwargs, Tensor.clone)
        if isinstance(self.position, str):
            return copy[0], {**copy[1], self.position: inputs}
        args = list(copy[0])
        args.insert(self.position, inputs)
        return tuple(args), copy[1]

    def per_image_arguments(self) -> tuple[frozenset[int], frozenset[str]]:
        """(positions, keyword names) of the arguments that hold one row per image: as stated by the
        caller, else none, after checking that no tensor argument could be per-image (N rows)."""
        if self.per_image is not None:
            return self.per_image
        ambiguous: list[tuple[str, int | str]] = [(f"forward_args[{index}]", index)
                                                  for index, value in enumerate(self.args)
                                                  if self._has_image_rows(value)]
        ambiguous += [(f"forward_kwargs[{name!r}]", name) for name, value in self.kwargs.items()
                      if self._has_image_rows(value)]
        if ambiguous:
            wheres = " and ".join(where for where, _ in ambiguous)
            example = ", ".join(repr(key) for _, key in ambiguous)
            count = f"{self.batch_size} image{'s' if self.batch_size != 1 else ''}"
            raise ValueError(
                f"{wheres} {'has' if len(ambiguous) == 1 else 'have'} {self.batch_size} "
                f"row{'s' if self.batch_size != 1 else ''}, as many as the {count} explained, and this method runs "
                "copies of the images (path points, noisy copies), so it must know whether each copy takes its "
                f"image's row or the whole tensor. Say which: per_image=[{example}] (one row per image, e.g. "
                "a mask or a condition per image) or per_image=[] (shared by every image, e.g. CLIP's prompts)."
            )
        return frozenset(), frozenset()

    def _has_image_rows(self, value: object) -> bool:
        """Whether the argument is, or holds, a tensor of N rows (which could be one row per image)."""
        return any(shape and shape[0] == self.batch_size for shape in tensor_shapes(value))

    def for_rows(self, rows: Tensor) -> "ForwardCall":
        """The same call for a batch whose row r is a copy of image ``rows[r]``."""
        positions, names = self.per_image_arguments()

        def select(value: Any) -> Any:
            return map_tensors(value, lambda tensor: tensor[rows.to(tensor.device)])

        args = tuple(select(value) if index in positions else value for index, value in enumerate(self.args))
        kwargs = {name: select(value) if name in names else value for name, value in self.kwargs.items()}
        return ForwardCall(args, kwargs, self.position, len(rows), (positions, names))


Flags = Union[Tensor, Callable[[], Tensor]]
"""A (N, K) or (N,) bool tensor, or a function that computes it when it is needed."""


def flags_of(flags: Optional[Flags]) -> Optional[Tensor]:
    """The flags, computed now if given as a function."""
    return flags() if callable(flags) else flags


@dataclass
class Attribution:
    """What a method computes for a batch.

    maps: (N, K, h, w) raw maps, at any resolution (upsampled to the input's afterwards).
    selected: the targets explained and their scores.
    low_res_maps: per layer, (N, K, h, w) maps at the layer's resolution (CAM methods).
    layer: the layer name(s), for the Explanation.
    attributions: (N, K, C, H, W) per-channel attributions at the input (gradient methods).
    diagnostics: method-specific figures, e.g. Integrated Gradients' completeness error.
    zero_gradient: (N, K) bool, where ∂score/∂(layer or input) was zero everywhere (why a map
        may be empty); None when the method takes no gradient.
    disconnected: (N, K) bool, where the score does not depend on the layer or input at all.
    negative_everywhere: (N, K) bool, where a map was ≤ 0 everywhere, and not all zero, before
        its ReLU (CAM methods).
    baseline_is_input: (N,) bool, where a path method's baseline equals the image (a path of length 0).
    empty_reason: why a map of this call that is zero everywhere is so, when the method knows it better than
        the generic "the layer's activations are zero" (FEM: a threshold no value can reach).
    The flags (zero_gradient, disconnected, negative_everywhere, baseline_is_input) may also be given as functions
    that compute them: they are needed only to say why a map is empty, so they are computed only then.
    nonnegative_maps: the method's maps are ≥ 0 (or NaN) by construction (e.g. |gradient| reduced over channels), so
        their largest |value| is their largest value (``map_extremes``).
    """

    maps: Tensor
    selected: SelectedTargets
    low_res_maps: Optional[list[Tensor]] = None
    layer: Optional[str | list[str]] = None
    attributions: Optional[Tensor] = None
    diagnostics: dict[str, Diagnostic] = field(default_factory=dict)
    zero_gradient: Optional[Flags] = None
    disconnected: Optional[Flags] = None
    negative_everywhere: Optional[Flags] = None
    baseline_is_input: Optional[Flags] = None
    empty_reason: Optional[str] = None
    nonnegative_maps: bool = False


def without_graph(tensor: Tensor) -> Tensor:
    """``tensor`` out of the autograd graph (detached only if it is in one: a detach is an operation per call)."""
    return tensor.detach() if tensor.requires_grad else tensor


def normalize_maps(maps: Tensor, how: Optional[str], extremes: Optional[Tensor] = None) -> Tensor:
    """Normalise each (H, W) map of (..., H, W) on its own.

    "max": divide by the largest |value| (non-negative maps → [0, 1], signed → [-1, 1],
    zero stays zero); "minmax": (m - min) / (max - min) → [0, 1]; None: unchanged.
    An all-zero (or constant, for "minmax") map becomes all zeros, never NaN.
    extremes: ``map_extremes(maps, how)`` when the caller has it already.
    """
    if how is None:
        return maps
    if how not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {how!r}.")
    extremes = map_extremes(maps, how) if extremes is None else extremes
    tiny = torch.finfo(maps.dtype).tiny
    if how == "max":  # a map whose largest |value| is 0 is 0 everywhere: 0 / tiny = 0
        return maps / extremes.clamp_min(tiny).view(*extremes.shape, 1, 1)
    # likewise a map whose span is 0 equals its minimum everywhere
    flat = maps.reshape(*maps.shape[:-2], -1)
    low, high = extremes.unbind(-1)
    normalized = (flat - low.unsqueeze(-1)) / (high - low).clamp_min(tiny).unsqueeze(-1)
    return normalized.reshape(maps.shape)


def map_extremes(maps: Tensor, how: Optional[str], nonnegative: bool = False) -> Tensor:
    """Per (H, W) map of (..., H, W), what its normalisation divides by: the largest |value| (..., ) for "max" and
    None, (minimum, maximum) (..., 2) for "minmax". NaN or inf in a map makes its extremes NaN or inf, and an
    all-zero map's extremes are 0. nonnegative: the maps are known to be ≥ 0 (or NaN) everywhere, so their
    largest value is their largest |value| (one operation fewer)."""
    if how == "minmax":
        low, high = torch.aminmax(maps.reshape(*maps.shape[:-2], -1), dim=-1)
        return torch.stack([low, high], dim=-1)
    return (maps if nonnegative else maps.abs()).amax(dim=(-2, -1))


def upsample_maps(maps: Tensor, size: Sequence[int]) -> Tensor:
    """(N, K, h, w) → (N, K, H, W), bilinear (align_corners=False), float32."""
    maps = maps.float()
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps, size=tuple(size), mode="bilinear", align_corners=False)


ROWS_PER_PASS = {"cpu": 16}
"""Rows (path points, noisy or reference copies of the images) per forward/backward pass when a
method's ``batch_size`` is None, by device type; 256 on other devices (GPUs). On the CPU, passes of
16 rows cost the least per row (Integrated Gradients, 32 steps, 224 px: 0.86× the time of 32-row
passes on resnet18, 0.63× on resnet50; per-row costs by pass size in benchmarks/RESULTS.md, "Memory
layout of the model's input"). On a GPU each pass has a fixed cost (kernel launches, Python) that
small passes do not spread: on an H200, Captum's single 256-row pass of Integrated Gradients took
0.62× the time of eight 32-row passes (benchmarks/RESULTS.md, "Attribution methods next to their
peers (CUDA)"). A pass that runs out of memory is run again in halves (``Explainer.row_passes``)."""


def checked_batch_size(batch_size: Optional[int]) -> Optional[int]:
    """``batch_size`` as a method takes it: None (automatic, see ``rows_per_pass``) or an int ≥ 1."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be None (chosen for the device) or an int of at least 1; "
                         f"got {batch_size!r}.")
    return int(batch_size)


def rows_per_pass(batch_size: Optional[int], device: torch.device) -> int:
    """The rows per forward/backward pass: ``batch_size`` if given, else ``ROWS_PER_PASS`` for the device."""
    return batch_size if batch_size is not None else ROWS_PER_PASS.get(device.type, 256)


Result = TypeVar("Result")

PROGRESS_THRESHOLD = 8
"""With ``progress=None`` a bar is shown when a call needs more passes through the model than this."""

_progress_bars = threading.local()
"""``open``: how many explainers' progress bars this thread has open (an inner call shows none)."""


def out_of_memory_error(error: BaseException, method: str, device: torch.device, rows: int,
                        batch_size: Optional[int]) -> BaseException:
    """The error to raise when a pass of ``rows`` rows ran out of memory and cannot be made smaller:
    ``error`` with what was tried and what to do, as torch's OutOfMemoryError or a RuntimeError as it
    was (an error of the model's own type is returned as it is, with the advice as a note on Python 3.11+)."""
    if batch_size is not None and batch_size > 1:
        hint = f"batch_size={batch_size} was given: pass a smaller one"
    else:
        hint = "even one row at a time: explain fewer images per call, use smaller inputs, or another device"
    advice = f"{method} ran out of memory on {device} at {rows} row{'s' if rows > 1 else ''} per pass ({hint})."
    if type(error) in (torch.cuda.OutOfMemoryError, RuntimeError):
        return type(error)(f"{error}\n{advice}")
    if hasattr(error, "add_note"):
        error.add_note(advice)
    return error


def check_parameters_usable(model: nn.Module, cause: Optional[BaseException] = None) -> None:
    """Refuse a model whose parameters were created inside ``torch.inference_mode()``: autograd
    cannot record operations on them, so no gradient-based map can be computed. cause: the error autograd raised
    (explainer calls check when one is raised; a method that needs no gradient works with such parameters)."""
    if any(parameter.is_inference() for parameter in model.parameters()):
        raise RuntimeError(
            "the model's parameters were created inside torch.inference_mode() (inference tensors), which "
            "autograd cannot use. Build or load the model outside inference_mode (calling explain inside "
            "inference_mode is fine), or clone its parameters: model.load_state_dict({k: v.clone() for k, v "
            "in model.state_dict().items()}) outside it."
        ) from cause


def check_finite_maps(raw_maps: Tensor, method: str) -> None:
    """Raise when a map holds NaN or inf (a non-finite gradient or perturbation score)."""
    bad = ~torch.isfinite(raw_maps).flatten(2).all(dim=2)  # (N, K)
    if bad.any():
        raise non_finite_maps_error(bad.nonzero().tolist(), method)


def non_finite_maps_error(pairs: Sequence[Sequence[int]], method: str) -> ValueError:
    listed = ", ".join(f"image {n}, target {k}" for n, k in pairs[:6])
    return ValueError(
        f"{method} computed a map with NaN or inf values ({listed}): a gradient or a score overflowed inside "
        "the model. Check the input's range, and run a float16 model in float32 or under autocast."
    )


def checked_map_extremes(values: list[float], shape: Sequence[int], how: Optional[str], method: str) -> list[bool]:
    """From the maps' extremes on the host (``map_extremes``, flattened; ``shape`` theirs): raise when a map holds
    NaN or inf; else whether each (image, target) map is zero everywhere, in row-major order."""
    per_map = 2 if how == "minmax" else 1
    images, targets = shape[0], shape[1]
    rows = [values[i * per_map : (i + 1) * per_map] for i in range(images * targets)]
    bad = [(i // targets, i % targets) for i, row in enumerate(rows) if not all(math.isfinite(v) for v in row)]
    if bad:
        raise non_finite_maps_error(bad, method)
    return [all(v == 0 for v in row) for row in rows]


EMPTY_MAP_REASONS = {
    "empty_region": "the target's region is empty in this image, so the score explained is 0: {region}",
    "empty_path": (
        "the baseline equals the image, so the path from it has length 0 and every attribution is 0 "
        "(they add up to y(x) − y(x') = 0). Give a baseline that differs from the image (baseline='zeros', "
        "'blur' on a larger image, or another tensor)"
    ),
    "disconnected": (
        "the score does not depend on {where} (autograd finds no path): a detached or constant target, or a "
        "model that runs that part under no_grad or detach() inside forward. Check the target and the layer"
    ),
    "zero_gradient": (
        "the gradient of the score at {where} is zero everywhere although the score depends on it: it vanishes "
        "on the way (a zero-initialised classifier head, such as torchvision's untrained ViT heads; a "
        "transformer block's output, after which only the class token reaches the head). Load trained "
        "weights, or choose an earlier layer"
    ),
    "negative": (
        "the map is ≤ 0 everywhere before the ReLU: the layer holds only evidence against this target. "
        "relu=False shows that evidence; or try another layer or method"
    ),
    "other": "the map is zero everywhere (e.g. the layer's activations are all zero for this image)",
}


def warn_about_empty_maps(empty_map: Tensor, attribution: "Attribution", method: str) -> None:
    """One RuntimeWarning naming the images and targets whose map is zero everywhere (``empty_map``, (N, K) bool on
    the host), and why; also those whose target region (a ``RegionTarget``'s pixels or box) is empty, whatever
    their map. The method's flags are computed here, when a map is empty."""
    empty_region = attribution.selected.empty_region
    empty_region = torch.zeros_like(empty_map) if empty_region is None else empty_region.cpu()
    if not (empty_map | empty_region).any():
        return
    where = "the target layer's output" if attribution.low_res_maps is not None else "the input"
    empty_path = flags_of(attribution.baseline_is_input)
    empty_path = None if empty_path is None else empty_path.cpu()[:, None].expand_as(empty_map)
    given = [("empty_region", empty_region), ("empty_path", empty_path),
             ("disconnected", flags_of(attribution.disconnected)),
             ("zero_gradient", flags_of(attribution.zero_gradient)),
             ("negative", flags_of(attribution.negative_everywhere))]
    checks = [(name, None if flags is None else flags.cpu()) for name, flags in given]
    groups: dict[str, list[str]] = {}
    for n, k in (empty_map | empty_region).nonzero().tolist():
        reason = next((name for name, flags in checks if flags is not None and bool(flags[n, k])), "other")
        groups.setdefault(reason, []).append(f"({n}, {k})")
    reasons = dict(EMPTY_MAP_REASONS, other=attribution.empty_reason or EMPTY_MAP_REASONS["other"])
    lines = [
        f"(image, target) {', '.join(pairs[:8])}{' and more' if len(pairs) > 8 else ''}: "
        + reasons[reason].format(where=where, region=attribution.selected.empty_region_advice) + "."
        for reason, pairs in groups.items()
    ]
    heading = ("returned maps that are zero everywhere" if bool(empty_map[empty_region].all())
               else "explained targets whose region is empty")
    warnings.warn(f"{method} {heading}. " + " ".join(lines), RuntimeWarning, stacklevel=3)


REDUCED_PRECISIONS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes in on this device type in this thread, or None when it is off."""
    try:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: one function per device type
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return dtype if enabled else None


def reduced_precision(model: nn.Module, batch: Tensor) -> Optional[str]:
    """How the model computes when it is not float32/float64: "bfloat16 (torch.autocast)", "float16 (the
    model's dtype)", ...; None when it computes in full precision."""
    autocast = autocast_dtype(batch.device.type)
    if autocast in REDUCED_PRECISIONS:
        return f"{REDUCED_PRECISIONS[autocast]} (torch.autocast)"
    for parameter in model.parameters():
        if parameter.dtype in REDUCED_PRECISIONS:
            return f"{REDUCED_PRECISIONS[parameter.dtype]} (the model's dtype)"
    if batch.dtype in REDUCED_PRECISIONS:
        return f"{REDUCED_PRECISIONS[batch.dtype]} (the input's dtype)"
    return None


def warn_about_precision(explainer: "Explainer", precision: Optional[str]) -> None:
    """One RuntimeWarning when a method whose maps are made of per-pixel gradients
    (``reads_pixel_gradients``) ran in reduced precision: those gradients carry its rounding, which no sum
    in float32 can take back (CAMs average gradients over a layer and change by ≤ 0.02: no warning)."""
    if precision is None or not explainer.reads_pixel_gradients():
        return
    method = explainer.method_name
    warnings.warn(
        f"{method} ran in {precision}: the model's forward and backward passes round to "
        f"{8 if precision.startswith('bfloat16') else 11} significant bits, so per-pixel gradients, and maps "
        "made of them, differ from the float32 model's (on the shipped demo CNN by up to 0.2 of the map's maximum "
        "for saliency and guided backprop, 0.1 for Integrated Gradients and SmoothGrad, against ≤ 0.02 for "
        "Grad-CAM). The sums over steps and samples are kept in float64 and the maps returned in float32. For "
        "float32 maps, call explain outside torch.autocast, or on a float32 copy of the model (model.float()).",
        RuntimeWarning, stacklevel=3)


Value = TypeVar("Value")


class PerThread(Generic[Value]):
    """An explainer attribute that each thread sees on its own: the state of the call in progress
    (the model's other inputs, layouts), so that one explainer can serve several threads."""

    def __init__(self, default: Optional[Value] = None):
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, explainer: None, owner: type) -> PerThread[Value]: ...

    @overload
    def __get__(self, explainer: Explainer, owner: Optional[type] = None) -> Optional[Value]: ...

    def __get__(self, explainer: Optional[Explainer], owner: Optional[type] = None) -> PerThread[Value] | Value | None:
        if explainer is None:
            return self
        return getattr(explainer._thread_state, self.name, self.default)

    def __set__(self, explainer: Explainer, value: Optional[Value]) -> None:
        setattr(explainer._thread_state, self.name, value)


class ExplainerOptions(TypedDict, total=False):
    """The keyword options every explainer takes (see ``Explainer``), for ``**options: Unpack[...]``."""

    preprocess: PreprocessSpec
    normalize: Optional[str]
    class_names: Optional[Sequence[str]]
    output: OutputSelector
    progress: Optional[bool]


_ENTRY = re.compile(r"^    (\w+(?:, \w+)*): ", re.M)


def parameter_docs(docstring: Optional[str]) -> dict[str, str]:
    """The "name: meaning" entries of a docstring written as this package writes them (an entry starts
    at 4 spaces of indentation, its continuation lines at 8), by parameter name."""
    docs: dict[str, str] = {}
    if not docstring:
        return docs
    lines = inspect.cleandoc(docstring).splitlines()
    text = "\n".join("    " + line for line in lines)
    for match in _ENTRY.finditer(text):
        end = text.find("\n    ", match.end())
        while end != -1 and text.startswith("        ", end + 1):  # continuation lines
            end = text.find("\n    ", end + 1)
        entry = text[match.start() + 4 : len(text) if end == -1 else end]
        for name in match.group(1).split(", "):
            docs[name] = " ".join(part.strip() for part in entry.splitlines())
    return docs


def setting_text(value: Any) -> str:
    """A short text of an option's value, the same in every process (no memory addresses, sets sorted): a tensor
    as its shape, dtype and a digest of its values, a module with submodules by its class, an explainer by its
    class and ``settings``, a function by its qualified name."""
    if isinstance(value, Explainer):
        return f"{type(value).__name__}({', '.join(f'{k}={v}' for k, v in value.settings().items())})"
    if isinstance(value, Tensor):
        data = value.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor{tuple(value.shape)} {value.dtype} {digest[:12]}"
    if isinstance(value, nn.Module) and next(value.children(), None) is not None:
        return type(value).__name__
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{item.name}={setting_text(getattr(value, item.name))}"
                           for item in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(setting_text(item) for item in value)) + "}"
    if isinstance(value, (list, tuple)):
        items = ", ".join(setting_text(item) for item in value)
        return f"[{items}]" if isinstance(value, list) else f"({items})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{setting_text(key)}: {setting_text(item)}" for key, item in value.items()) + "}"
    if inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def full_signature(cls: type) -> inspect.Signature:
    """The constructor's signature with every ``**options`` expanded into the keyword parameters of the
    base-class constructors it is passed on to (their defaults included): what a caller may pass. A class
    lists in ``not_options`` the base options it sets itself (DeepLIFT-SHAP's single ``baseline``)."""
    parameters: list[inspect.Parameter] = []
    seen: set[str] = set(getattr(cls, "not_options", ()))
    for owner in cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None or owner is object:
            continue
        own = list(inspect.signature(init).parameters.values())
        if parameters:  # a base's constructor: only its keyword options fill the **options of the ones before
            own = [p for p in own if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)]
        pending_var = [p for p in own if p.kind is inspect.Parameter.VAR_KEYWORD]
        parameters = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
        parameters += [p for p in own if p.name not in seen and p.kind is not inspect.Parameter.VAR_KEYWORD]
        seen.update(p.name for p in own)
        if not pending_var:
            break
        parameters += pending_var
    return inspect.Signature(parameters)


def document_options(cls: type) -> None:
    """Give a class the signature of ``full_signature`` (for ``help()``, ``inspect.signature`` and
    editors that read it) and append to its docstring the meaning of every option it takes but does
    not document itself, as its base classes document them."""
    signature = full_signature(cls)
    if "__init__" in cls.__dict__:
        init = cls.__dict__["__init__"]
        init.__signature__ = signature
        if init.__doc__ is None:
            init.__doc__ = f"Every parameter is described in the class's docstring: help({cls.__name__})."
    without_self = [p for name, p in signature.parameters.items() if name != "self"]
    # typeshed's `type` does not declare __signature__, which inspect.signature reads
    cls.__signature__ = signature.replace(parameters=without_self)  # type: ignore[attr-defined]
    own_doc = cls.__dict__.get("__doc__") or ""
    inherited: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        inherited.update(parameter_docs(base.__dict__.get("__doc__")))
    missing = [inherited[name] for name in signature.parameters
               if name in inherited and not re.search(rf"\b{name}\b[^\n]*:", own_doc)]
    if missing:
        entries = [textwrap.fill(entry, 100, subsequent_indent="    ", break_on_hyphens=False)
                   for entry in dict.fromkeys(missing)]
        cls.__doc__ = inspect.cleandoc(own_doc) + "\n\nOptions shared with other methods:\n\n" + "\n".join(entries)


class Explainer(ABC):
    """Base class of every method: ``Method(model, ...).explain(inputs, target=...)``.

    model: any ``nn.Module``; it is run in eval mode during a call and left exactly
        as found afterwards (modes, flags, hooks), also when the call raises.
    preprocess: turns an RGB image (PIL) into model input: a callable (torchvision's
        ``weights.transforms()``) or a HuggingFace image processor; default: ImageNet mean/std
        normalisation with the size kept. Tensors are taken as model input and skip it.
    normalize: "max" (default: each map divided by its largest |value|, so maps lie in [0, 1],
        signed ones in [-1, 1]), "minmax" ([0, 1]) or None (raw values).
    class_names: names of the model's classes, for titles.
    output: which part of the model's output holds the scores when it is not a plain tensor
        (a key, an index or a callable); None picks it automatically (see ``select_output``).
    progress: a progress bar for calls that run many passes through the model (path points, noisy
        copies, perturbed inputs): True, False, or None (default: when a call needs more than
        ``PROGRESS_THRESHOLD`` passes). A call made inside another's bar shows none of its own.
    """

    name: ClassVar[str] = ""
    """Registry name, as the command line's ``--method`` takes it."""
    needs_layer: ClassVar[bool] = False
    """Whether the constructor takes a target layer after the model (CAM methods)."""
    scores_are_outputs: ClassVar[bool] = True
    """Whether ``Explanation.scores`` are the model's (selected) outputs for the classes explained (Finer-CAM's are
    its contrastive scores)."""
    summary: ClassVar[str] = ""
    """One line for ``explain methods``."""
    records_the_forward: ClassVar[bool] = True
    """Whether the method hooks the model's modules or changes how its functions compute during a call,
    which code compiled in place (``module.compile()``) would skip: such a model is refused (see
    ``explain.capture.eager_model``). False for methods that only differentiate the output."""
    _forward_call: PerThread[ForwardCall] = PerThread()
    """The model's other inputs during a call (None for a model with one input)."""

    def __init__(
        self,
        model: ModelSource,
        *,
        preprocess: PreprocessSpec = None,
        normalize: Optional[str] = "max",
        class_names: Optional[Sequence[str]] = None,
        output: OutputSelector = None,
        progress: Optional[bool] = None,
    ):
        model, preprocess, class_names, output = loaded_model_parts(model, preprocess, class_names, output)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}.")
        check_hookable(model)
        # torch.compile(model): the module it wraps; code compiled in place only where nothing is recorded
        model = eager_model(model, type(self).__name__, compiled_code_runs=not self.records_the_forward)
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
        self.model = model
        self.preprocess = as_preprocess(preprocess)
        self.normalize = normalize
        if isinstance(class_names, str) or not (class_names is None or isinstance(class_names, Sequence)):
            raise TypeError(f"class_names must be a list of names, one per class (index i: class i's name); got "
                            f"{type(class_names).__name__}.")
        self.class_names = class_names if class_names is not None else model_class_names(model)
        self.output = output
        if progress not in (None, True, False):
            raise ValueError(f"progress must be True, False or None (on long calls); got {progress!r}.")
        self.progress = progress
        self.rows_that_fit: dict[str, int] = {}
        """Per device, the rows per pass that fitted in memory after a pass ran out of it (see
        ``row_passes``); later calls start there."""
        self._thread_state = threading.local()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        document_options(cls)

    setting_attributes: ClassVar[Mapping[str, str]] = {}
    """Options kept under another attribute name (option → attribute), for ``settings``."""

    def settings(self) -> dict[str, str]:
        """What the explainer computes with, as short texts that are the same in every process: each constructor
        option it keeps (under the option's name or ``setting_attributes``) except those that do not change a map
        (``class_names``, ``progress``), and the explainers it wraps. Two explainers of one class with equal
        settings compute the same maps; ``explain.evaluate`` and ``explain.batch.run`` record them so that a
        resumed run never mixes two settings of a method."""
        texts = {}
        for option in inspect.signature(type(self)).parameters:
            attribute = self.setting_attributes.get(option, option)
            if option not in ("model", "class_names", "progress") and attribute in self.__dict__:
                texts[option] = setting_text(self.__dict__[attribute])
        for attribute, value in self.__dict__.items():
            if isinstance(value, Explainer) and attribute not in texts:
                texts[attribute] = setting_text(value)
        return texts

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_thread_state"]  # per-call state (copy.deepcopy, pickle) is not copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("rows_that_fit", {})
        self._thread_state = threading.local()

    def row_passes(self, rows: int, batch_size: Optional[int], device: torch.device,
                   compute: Callable[[slice], Result]) -> Iterator[tuple[slice, Result]]:
        """Run ``compute`` on consecutive slices of ``range(rows)``, ``rows_per_pass`` at a time, yielding
        (slice, its result) in order. ``compute`` must only compute: the caller adds up the results, so
        that a pass can be run again.

        With ``batch_size`` None, a pass that runs out of memory is run again with half its rows (down to
        one), and the explainer remembers the largest pass that fitted for its later calls on the device
        (``rows_that_fit``). A ``batch_size`` given by the caller is kept: running out of memory then
        raises, with a hint.
        """
        per_pass = rows_per_pass(batch_size, device)
        if batch_size is None:
            per_pass = min(per_pass, self.rows_that_fit.get(str(device), per_pass))
        with self.progress_bar(-(-rows // per_pass), rows, "row") as bar:
            largest_fitted = 0
            start = 0
            while start < rows:
                chunk = slice(start, min(start + per_pass, rows))
                tried = chunk.stop - chunk.start
                failed = False
                try:
                    result = compute(chunk)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    if batch_size is not None or tried == 1:
                        advised = out_of_memory_error(error, self.method_name, device, tried, batch_size)
                        if advised is error:
                            raise
                        raise advised from error
                    failed = True  # run again below, once the error's frames (and their tensors) are released
                if failed:
                    per_pass = tried // 2
                    self.rows_that_fit[str(device)] = max(per_pass, largest_fitted)
                    continue
                largest_fitted = max(largest_fitted, tried)
                bar.update(tried)
                yield chunk, result
                start = chunk.stop

    @contextmanager
    def progress_bar(self, passes: int, total: int, unit: str) -> Iterator[tqdm]:
        """A tqdm bar of ``total`` units for a call of ``passes`` passes, shown as ``progress`` says
        (None: when passes > ``PROGRESS_THRESHOLD``), never inside another explainer's bar in this thread."""
        show = self.progress if self.progress is not None else passes > PROGRESS_THRESHOLD
        nested = getattr(_progress_bars, "open", 0) > 0
        with progress_shown_by_caller(), tqdm(total=total, desc=self.method_name, unit=unit,
                                              disable=not show or nested, leave=False) as bar:
            yield bar

    def call_model(self, inputs: Tensor, rows: Optional[Tensor] = None) -> Any:
        """The model's scores for a batch: its forward pass (with the call's other arguments), then
        the output selector. rows: for a batch of copies, the image each row is a copy of.

        The model gets a copy of the batch (inside the autograd graph when it requires grad): a
        model that edits its input in place changes neither the caller's tensor nor the batch
        that the method's other forward passes use. The copy is channels-last where that runs
        faster (``explain.memory_format``)."""
        inputs = model_batch(self.model, inputs)
        call = self._forward_call
        if call is None:
            return select_output(run_model(self.model, inputs), self.output)
        if rows is not None:
            call = call.for_rows(rows)
        return select_output(run_model(self.model, inputs, call.arguments(inputs)), self.output)

    @property
    def method_name(self) -> str:
        return type(self).__name__

    def reads_pixel_gradients(self) -> bool:
        """Whether the maps are made of per-pixel (or per-unit) gradients, which a model computing in
        reduced precision changes materially (see ``warn_about_precision``); CAMs average theirs."""
        return False

    def explain(
        self,
        inputs: Inputs,
        target: Target = None,
        *,
        topk: Optional[int] = None,
        forward_args: Sequence[Any] = (),
        forward_kwargs: Optional[dict[str, Any]] = None,
        input_position: int | str = 0,
        per_image: Optional[PerImage] = None,
    ) -> Explanation:
        """Explain N images for one or K targets each.

        inputs: a path, PIL image, (H, W, 3) ndarray, (C, H, W) or (N, C, H, W)
            tensor, or a list of these (see ``explain.inputs``).
        target: None (top-1 class), an int, one int per image, K ints per image,
            a callable ``f(output) -> Tensor[N]`` (see ``explain.targets``), or a hidden unit
            (``explain.Channel``, ``explain.Neuron``).
        topk: explain each image's k highest-scoring classes.
        forward_args, forward_kwargs: the model's other inputs, for models with several; the
            explained batch goes at ``input_position`` (an index among the positional arguments,
            or a keyword name).
        per_image: which of those inputs hold one row per image (positions in ``forward_args``,
            names in ``forward_kwargs``): a method that runs copies of the images gives each copy
            its image's row of these, and the whole of the others. ``[]``: all shared (CLIP's
            prompts). Needed by such methods when a tensor input has N rows, where it could be either.
        Returns an Explanation whose maps are (N, H, W), or (N, K, H, W) for K targets per image.
        """
        scope = CallScope(self.model)
        with scope, deferred_checks() as checks:  # the checks of values: one host sync, at the end of the call
            if torch.is_inference_mode_enabled():  # the caller's inference_mode(): no graph could be built
                scope.enter(torch.inference_mode(False))
            device = model_device(self.model)
            prepared = prepare_inputs(inputs, self.preprocess, device, model_dtype(self.model))
            outer_call = self._forward_call  # this explainer's call in progress, when it is called inside it
            scope.add_undo(lambda: setattr(self, "_forward_call", outer_call))
            self._forward_call = ForwardCall.stated(forward_args, {} if forward_kwargs is None else forward_kwargs,
                                                    input_position, prepared.batch.shape[0], per_image)
            modules = list(self.model.modules())
            scope.eval_mode(self.model, modules)
            scope.without_gradient_checkpointing(self.model, modules)
            if device.type == "cpu":  # torch's CPU BatchNorm backward (see _eval_batch_norm)
                self.guard_batch_norm_gradients(scope, modules)
            target = class_indices_for_names(target, self.class_names)
            target = bind_units(target, self.model, scope)  # a Channel / Neuron: its layer recorded for the call
            try:
                attribution = self._attribute_in_a_layout_the_model_takes(scope, prepared.batch, target, topk)
            except Exception as error:
                checks.run()  # a check that fails (a NaN input or score) is the cause to report
                if isinstance(error, RuntimeError):
                    check_parameters_usable(self.model, error)  # parameters made in inference mode: say so
                raise
            raw = upsample_maps(without_graph(attribution.maps), prepared.batch.shape[-2:])
            extremes = map_extremes(raw, self.normalize, attribution.nonnegative_maps)
            empty: list[bool] = []
            check(extremes, lambda values: empty.extend(checked_map_extremes(values, extremes.shape, self.normalize,
                                                                             self.method_name)))
            checks.run()
            if any(empty):
                warn_about_empty_maps(torch.tensor(empty).view(raw.shape[:2]), attribution, self.method_name)
            if self.reads_pixel_gradients():
                warn_about_precision(self, reduced_precision(self.model, prepared.batch))
            selected = attribution.selected
            return Explanation(
                map_grid=normalize_maps(raw, self.normalize, extremes),
                raw_map_grid=raw,
                scores=without_graph(selected.scores).float(),
                class_indices=selected.class_indices,
                display=prepared.display,
                method=self.method_name,
                layer=attribution.layer,
                keep_target_dim=selected.keep_target_dim,
                low_res_maps=attribution.low_res_maps,
                probabilities=selected.probabilities,
                attributions=(None if attribution.attributions is None
                              else without_graph(attribution.attributions).contiguous()),
                diagnostics=attribution.diagnostics,
                class_names=self.class_names,
            )

    def guard_batch_norm_gradients(self, scope: CallScope, modules: list[nn.Module]) -> None:
        """On the CPU, for the call (``scope``): every BatchNorm module among ``modules`` (the model's) that the call
        differentiates hands its backward a contiguous gradient (``_eval_batch_norm``); here, all of them. A method
        that knows which of them its backward passes can reach may guard those alone."""
        contiguous_batch_norm_gradients(scope, modules)

    def _attribute_in_a_layout_the_model_takes(self, scope: CallScope, batch: Tensor, target: Target,
                                               topk: Optional[int]) -> Attribution:
        """``attribute``, run again in the batch's usual layout when the model refused a channels-last copy."""
        copies_before = channels_last_copies()
        try:
            return self.attribute(batch, target, topk)
        except (RuntimeError, AssertionError, ValueError) as error:
            if channels_last_copies() == copies_before or not may_be_layout_error(error):
                raise
        scope.enter(usual_layout_only())
        return self.attribute(batch, target, topk)

    @abstractmethod
    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        """The method itself: a prepared (N, C, H, W) batch → raw (N, K, h, w) maps."""


@contextmanager
def progress_shown_by_caller() -> Iterator[None]:
    """Inside: explainers called by this thread show no progress bar of their own (the caller shows one,
    such as an explainer wrapping another, or ``explain.run`` over a dataset)."""
    _progress_bars.open = getattr(_progress_bars, "open", 0) + 1
    try:
        yield
    finally:
        _progress_bars.open -= 1


class MethodRegistry(dict[str, type[Explainer]]):
    """Every registered method class by its name, as the command line's ``--method`` and
    ``explain.get_method`` take it (``"gradcam"`` → ``GradCAM``). ``@register`` adds a class; the
    reliability suites and the command-line test run over every entry."""


REGISTRY: MethodRegistry = MethodRegistry()


ExplainerClass = TypeVar("ExplainerClass", bound=type[Explainer])


def register(cls: ExplainerClass) -> ExplainerClass:
    """Class decorator: make a method available by its ``name`` (command line, ``get_method``)."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"method name {cls.name!r} is empty or taken.")
    REGISTRY[cls.name] = cls
    return cls


def get_method(name: str) -> type[Explainer]:
    """The method class registered under ``name`` (case and '-'/'_' insensitive)."""
    key = name.lower().replace("-", "").replace("_", "")
    for registered, cls in REGISTRY.items():
        if registered.replace("-", "").replace("_", "") == key:
            return cls
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown method {name!r}.{hint} Known methods: {', '.join(sorted(REGISTRY))}.")
