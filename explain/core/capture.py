"""Hooks: find layers by name, capture their inputs, outputs and gradients, remove every hook after.

``capture`` is the public API (read any layer); ``ActivationCapture`` is what the
explainers use (feature maps that gradients are taken at).

This module is the only place in the toolkit that registers hooks on a model.
Every hook lives inside a ``with`` block and is removed in a ``finally``, so a
model carries no hook of ours between calls, also when a call raises.
"""

from __future__ import annotations

import ast
import copy
import difflib
import inspect
import linecache
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Generic, Iterator, Literal, Optional, Sequence, Union, cast, overload

import torch
from torch import Tensor, nn
from typing_extensions import TypeVar

from .caller import warn_at_callers_line
from .scope import CallScope, errors_handled_outside

LayerSpec = Union[str, nn.Module, type]
"""A layer: its ``named_modules()`` name (or as Python reaches it, ``"features[-1]"``), a glob over names, the module
itself, or a module type."""


class LayerNotFoundError(ValueError):
    """A layer name, module or type that the model does not contain."""


class LayerNotRunError(RuntimeError):
    """A target layer that did not run (or ran more than once) in a forward pass."""


class ModelInputError(RuntimeError):
    """The model itself failed on the input it was given (wrong size, channels or dtype)."""

    model_error: Optional[BaseException] = None
    """The exception the model's forward raised, when the model itself failed (``run_model``); None for an
    error of the toolkit's own checks during the forward."""


class LayerOutputError(TypeError):
    """A layer's output (or an edit of it) that is not what the toolkit needs, e.g. not a tensor."""


ForwardArguments = tuple[tuple[Any, ...], dict[str, Any]]
"""``(args, kwargs)`` of one call of a model's forward."""


def run_model(model: nn.Module, inputs: object, call: Optional[ForwardArguments] = None) -> Any:
    """``model(inputs)`` (or ``model(*call[0], **call[1])`` when the explained ``inputs`` are one of
    several arguments), with the model's own failures turned into a ModelInputError that says
    what was passed and how to fix it (our hooks' errors pass through unchanged)."""
    try:
        return model(inputs) if call is None else model(*call[0], **call[1])
    except (LayerNotRunError, LayerNotFoundError, ModelInputError, LayerOutputError):
        raise
    except (TypeError, IndexError) as error:
        mapping = _string_key_hint(inputs, error)  # a forward that reads its input as a dict: batch["image"]
        if mapping is not None:
            raise _model_failure(f"the model failed on an input of shape {_shape_text(inputs)}: "
                                 f"{_first_line(error)}. {mapping}", error) from error
        if isinstance(error, TypeError):  # a forward called without its other inputs, or with the wrong ones
            raise _model_failure(
                f"the model failed on an input of shape {_shape_text(inputs)}: {_first_line(error)}. If its forward "
                "takes other inputs, pass them with forward_args= or forward_kwargs= (and input_position= for where "
                "the image goes).", error
            ) from error
        if is_out_of_memory(error):  # not the input's fault: passed on as it is (see Explainer.row_passes)
            raise
        raise _input_failure(model, inputs, error) from error
    except (RuntimeError, AssertionError, ValueError) as error:
        if is_out_of_memory(error):
            raise
        raise _input_failure(model, inputs, error) from error


def _input_failure(model: nn.Module, inputs: object, error: BaseException) -> ModelInputError:
    """The ModelInputError for a model that failed on its input (``error``): its size, channels or dtype."""
    return _model_failure(
        f"the model failed on an input of shape {_shape_text(inputs)}: {_first_line(error)}."
        f"{_channels_last_hint(model, inputs, error)} If it expects "
        "another size or channel count, pass a preprocess that produces it (e.g. torchvision "
        "weights.transforms() for its 224 px models), or resize the tensor yourself.", error
    )


_TENSOR_STRING_INDEX_ERRORS = ("too many indices for tensor", "invalid data type 'str'")
"""Words of the errors by which a tensor refuses a string index (torch reads ``x["image"]`` as a sequence of
characters: too many indices, or none of the types an index can be)."""


def _string_key_hint(inputs: object, error: BaseException) -> Optional[str]:
    """Where ``error`` was raised by the model's forward indexing a tensor with a string (``batch["image"]``, a
    forward that takes a dict of inputs): what happened and the wrapper that passes the image as that dict; else
    None. Read from the failing expression in the innermost frame of the traceback outside torch."""
    if not any(words in str(error) for words in _TENSOR_STRING_INDEX_ERRORS):
        return None
    torch_files = os.path.dirname(torch.__file__) + os.sep
    frames = [(frame, summary) for (frame, _), summary in zip(traceback.walk_tb(error.__traceback__),
                                                              traceback.extract_tb(error.__traceback__))
              if not summary.filename.startswith(torch_files)]
    if not frames:
        return None
    frame, summary = frames[-1]
    expression = _failed_expression(summary)
    if not isinstance(expression, ast.Subscript):
        return None
    key = _value_in_frame(expression.slice, frame)
    indexed = _value_in_frame(expression.value, frame)  # a torch error: a tensor, where it cannot be read
    if not isinstance(key, str) or not isinstance(indexed, (Tensor, type(None))):
        return None
    what = ("the image tensor it was given" if indexed is inputs else
            f"the tensor `{ast.unparse(expression.value)}`" if indexed is not None else "a tensor")
    return (f"Its forward indexes {what} with the string key {key!r} (`{ast.unparse(expression)}`, "
            f"{os.path.basename(summary.filename)} line {summary.lineno}): the model takes a dict (mapping) of "
            "inputs there, and the toolkit passes the image as a tensor. Explain a wrapper whose forward takes the "
            "image tensor and calls the model with the dict, e.g. `class Wrapped(nn.Module): def __init__(self, "
            "model): super().__init__(); self.model = model` with `def forward(self, x): return "
            f"self.model({{{key!r}: x}})` (add the dict's other entries there; the layers' names gain the "
            "prefix 'model.').")


def _value_in_frame(expression: ast.expr, frame: FrameType) -> object:
    """The value of a constant, a variable or attributes of one (``self.key``) in ``frame``, read without running
    code (no property is called); None for other expressions or a name not found."""
    if isinstance(expression, ast.Constant):
        return expression.value
    if isinstance(expression, ast.Name):
        return frame.f_locals.get(expression.id, frame.f_globals.get(expression.id))
    if isinstance(expression, ast.Attribute):
        owner = _value_in_frame(expression.value, frame)
        try:
            return None if owner is None else inspect.getattr_static(owner, expression.attr)
        except AttributeError:
            return None
    return None


def _failed_expression(summary: traceback.FrameSummary) -> Optional[ast.expr]:
    """The expression whose evaluation raised, as the traceback's positions delimit it in the source; None where
    the source or the positions are not at hand."""
    # the positions of the failing expression (Python 3.11 on): read by name, as FrameSummary had none before
    first, last = summary.lineno, getattr(summary, "end_lineno", None)
    start, end = getattr(summary, "colno", None), getattr(summary, "end_colno", None)
    if first is None or last is None or start is None or end is None:
        return None
    lines = [linecache.getline(summary.filename, number).encode() for number in range(first, last + 1)]
    if not all(lines):
        return None
    lines[-1] = lines[-1][:end]
    lines[0] = lines[0][start:]
    try:
        return ast.parse(b"".join(lines).decode().strip(), mode="eval").body
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _model_failure(message: str, error: BaseException) -> ModelInputError:
    """A ModelInputError saying ``message`` about the model's own ``error``."""
    failure = ModelInputError(message)
    failure.model_error = error
    return failure


_EXPECTED_CHANNELS = re.compile(r"to have (\d+) channels")
"""How a convolution's error states the channels it expected ("expected input[1, 16, 16, 3] to have 3 channels")."""


def _channels_last_hint(model: nn.Module, inputs: object, error: BaseException) -> str:
    """Where the model failed on a channel count and ``inputs`` looks channels-last (its last dimension is the
    channels expected, its channel dimension is not): the permute that makes it channels first; else ""."""
    if not isinstance(inputs, Tensor) or inputs.dim() not in (3, 4) or "channels" not in str(error):
        return ""
    stated = _EXPECTED_CHANNELS.search(str(error))
    channels = int(stated.group(1)) if stated else model_input_channels(model)
    if channels is None or inputs.shape[-1] != channels or inputs.shape[-3] == channels:
        return ""
    permute = "x.permute(0, 3, 1, 2)" if inputs.dim() == 4 else "x.permute(2, 0, 1)"
    layout = "(N, H, W, C)" if inputs.dim() == 4 else "(H, W, C)"
    ndarray = ", or the image as an (H, W, 3) ndarray" if channels == 3 else ""
    return (f" The input looks channels-last, {layout}: its last dimension is the {channels} channels the model "
            f"expects. Pass {permute} (channels first){ndarray}.")


_ALLOCATION_FAILURES = ("out of memory", "can't allocate memory", "not enough memory", "alloc_failed",
                        "allocfailed", "resource_exhausted")
"""Words (compared in lower case) of the errors by which allocators, cuBLAS, cuDNN, cuFFT, cuSOLVER and
MIOpen say they could not allocate memory."""


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """The error, then what it was raised from or while handling, and so on, up to the exceptions the
    caller was handling when the call began (``errors_handled_outside``: a call made inside the caller's
    own ``except OutOfMemoryError:`` is not out of memory itself); a chain that loops is walked once."""
    visited = errors_handled_outside()
    seen: Optional[BaseException] = error
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is, or was raised from, a failed allocation: torch's OutOfMemoryError, or a
    RuntimeError from an allocator or a GPU library that says so."""
    return any(isinstance(seen, torch.cuda.OutOfMemoryError) or (
        isinstance(seen, RuntimeError) and any(words in str(seen).lower() for words in _ALLOCATION_FAILURES))
        for seen in error_chain(error))


def _shape_text(inputs: object) -> str:
    return str(tuple(inputs.shape)) if isinstance(inputs, Tensor) else type(inputs).__name__


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


def _is_glob(text: str) -> bool:
    return any(character in text for character in "*?[")


def glob_pattern(pattern: str) -> "re.Pattern[str]":
    """A layer-name glob as a regex: ``*`` and ``?`` stay inside one dotted component
    (``"layer*"`` is layer1…layer4, not their children), ``**`` crosses components,
    ``[...]`` is a character class."""
    parts: list[str] = []
    index = 0
    while index < len(pattern):
        if pattern.startswith("**", index):
            parts.append(".*")
            index += 2
        elif pattern[index] == "*":
            parts.append("[^.]*")
            index += 1
        elif pattern[index] == "?":
            parts.append("[^.]")
            index += 1
        elif pattern[index] == "[" and "]" in pattern[index:]:
            end = pattern.index("]", index)
            parts.append(pattern[index : end + 1])
            index = end + 1
        else:
            parts.append(re.escape(pattern[index]))
            index += 1
    return re.compile("".join(parts) + r"\Z")


def _unknown_name_message(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, names, n=6, cutoff=0.4)
    if not close:  # fall back to names that share the first dotted component
        head = name.split(".")[0]
        close = [candidate for candidate in names if candidate.split(".")[0] == head][:6]
    if not close:
        close = [candidate for candidate in names if "." not in candidate][:12]
    listed = ", ".join(repr(candidate) for candidate in close)
    return (
        f"the model has no layer named {name!r}. Closest names: {listed}. "
        "Run `explain layers MODEL` (or explain.list_layers(model)) to see every name."
    )


PathPart = Union[str, int]
"""One step of a layer path: a child's name, or a position among a Sequential's or ModuleList's children."""

_PATH_STEP = re.compile(r"""\[\s*(?:(-?\d+)|'([^']*)'|"([^"]*)")\s*\]|(?:^|\.)([^.\[\]]+)""")
"""A step of a layer written as Python reaches it: ``[2]``, ``[-1]``, ``['key']``, or a dotted name (``.conv2``)."""


def _path_parts(spec: str) -> Optional[list[PathPart]]:
    """The steps of a layer name written as Python reaches the module (``"features[2]"``, ``"layer4[-1].conv2"``,
    ``"features.-1"``, ``"blocks['attn']"``): child names and (int) positions; None when it is not so written."""
    parts: list[PathPart] = []
    index = 0
    while index < len(spec):
        step = _PATH_STEP.match(spec, index)
        if step is None or step.end() == index:
            return None
        position, single, double, name = step.groups()
        if position is not None:
            parts.append(int(position))
        elif name is not None:  # a dotted negative position ("features.-1") is one from the end, as [-1]
            parts.append(int(name) if re.fullmatch(r"-\d+", name) else name)
        else:
            parts.append(single if single is not None else double)
        index = step.end()
    return parts


def _walk_path(model: nn.Module, parts: Sequence[PathPart]) -> tuple[Optional[str], str, int]:
    """Follow ``parts`` from ``model``: (the dotted name of the module reached, "", steps) or (None, why not, the
    steps taken before the one that failed). An int indexes a Sequential or ModuleList as Python does (negative
    from the end); on another module a non-negative int is the child of that name."""
    module: Optional[nn.Module] = model
    names: list[str] = []
    for step, part in enumerate(parts):
        assert module is not None, "a step to None returns"
        where = repr(".".join(names)) if names else "the model"
        children = list(module._modules.items())
        if isinstance(part, int) and isinstance(module, (nn.Sequential, nn.ModuleList)):
            if not -len(children) <= part < len(children):
                return None, (f"{where} ({type(module).__name__}) has {len(children)} children, positions 0 to "
                              f"{len(children) - 1} (or -{len(children)} to -1); [{part}] is not one of them."), step
            name, module = children[part]
            if module is None:
                return None, f"{where}[{part}] is None, not a module.", step
        elif isinstance(part, int) and part < 0:
            return None, (f"{where} is a {type(module).__name__}, not a Sequential or ModuleList, so it has no "
                          f"position [{part}]; its children: {', '.join(repr(n) for n, _ in children[:12]) or 'none'}."
                          ), step
        else:
            name = str(part)
            if module._modules.get(name) is None:
                listed = ", ".join(repr(child) for child, _ in children[:12]) or "none"
                return None, f"{where} has no child {name!r}; its children: {listed}.", step
            module = module._modules[name]
        names.append(name)
    return ".".join(names), "", len(parts)


def _names_matching(model: nn.Module, named: dict[str, nn.Module], spec: str) -> list[str]:
    """The names of ``model``'s layers that the name ``spec`` gives: the name itself, the name written as Python
    reaches the module (``"features[-1]"``: positions index a Sequential or ModuleList, negative ones from the
    end), or a glob; raises LayerNotFoundError, saying why, when none does."""
    if spec in named:
        return [spec]
    why = ""
    parts = _path_parts(spec) if not any(character in spec for character in "*?") else None
    if parts:
        found, why, steps = _walk_path(model, parts)
        if found is not None:
            # a module reached under two names (shared) is known by the first one named_modules() gives
            return [found if found in named else next(name for name, module in named.items()
                                                          if module is model.get_submodule(found))]
        if steps == 0 or not ("[" in spec or any(isinstance(part, int) for part in parts)):
            why = ""  # a glob, or a dotted name with a typo (said with the closest names)
    if _is_glob(spec):
        regex = glob_pattern(spec)
        matches = [name for name in named if name and regex.match(name)]
        if matches:
            return matches
        if not why:
            raise LayerNotFoundError(f"the pattern {spec!r} matches no layer name of the model. "
                                     "Run `explain layers MODEL` to see every name.")
    if why:
        raise LayerNotFoundError(f"the model has no layer {spec!r}: {why} "
                                 "Run `explain layers MODEL` (or explain.list_layers(model)) to see every name.")
    raise LayerNotFoundError(_unknown_name_message(spec, [name for name in named if name]))


def _wrapper_hint(model: nn.Module, spec: str) -> str:
    """Where ``spec`` names no layer of ``model`` but names one of a model it wraps (``"features.3"``, the
    ``module.features.3`` of a DataParallel model): a sentence saying so, with the full name; else ""."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        wrapped, what = "module", "is a DataParallel or DistributedDataParallel wrapper"
    elif _compile_wrapper(model):
        wrapped, what = "_orig_mod", "is a torch.compile wrapper"
    elif len(model._modules) == 1:
        wrapped = next(iter(model._modules))
        what = f"({type(model).__name__}) holds one module, {wrapped!r}"
    else:
        return ""
    child = model._modules[wrapped]
    if child is None:
        return ""
    try:
        found = _names_matching(child, dict(child.named_modules()), spec)
    except LayerNotFoundError:
        return ""
    name = f"{wrapped}.{spec if any(character in spec for character in '*?') else found[0]}"  # a glob stays one
    unwrap = f", or pass the wrapped model (model.{wrapped})" if what.startswith("is a") else ""
    return (f" The model {what}: its layers' names start with {wrapped + '.'!r}, so this layer is {name!r}. "
            f"Write that name{unwrap}.")


def find_layers(
    model: nn.Module, layers: LayerSpec | Sequence[LayerSpec]
) -> list[tuple[str, nn.Module]]:
    """Resolve layer specifications to ``(name, module)`` pairs, in the order given.

    Each specification is a name as ``model.named_modules()`` spells it
    (``"layer4"``, ``"features.29"``), the same name written as Python reaches
    the module (``"features[29]"``, ``"features[-1]"``, ``"layer4[-1].conv2"``;
    also ``"features.-1"``: positions index a Sequential or ModuleList, negative
    ones from the end), a glob over those names (``"layer*"``,
    ``"blocks.*.norm1"``; ``*`` stays within one dotted part, ``**`` crosses
    parts, ``[...]`` is a character class where the name does not index a
    module), a module of the model, or a module type (``nn.Conv2d``: every
    module of that type). Duplicates are dropped.
    """
    check_hookable(model)
    if isinstance(layers, (str, nn.Module, type)):
        layers = [layers]
    elif not isinstance(layers, (list, tuple)):
        raise TypeError(
            "a layer is given by its name (\"layer4\"), a glob, the module, a module type, or a list of "
            f"these; got {type(layers).__name__} {layers!r}."
        )
    if not layers:
        raise ValueError("the list of layers is empty; give at least one layer name or module.")
    named = dict(model.named_modules())
    names = [name for name in named if name]
    name_of = {id(module): name for name, module in named.items()}
    found: dict[str, nn.Module] = {}
    for spec in layers:
        while isinstance(spec, str) and spec not in named and spec.startswith(COMPILED_PREFIX):
            spec = spec[len(COMPILED_PREFIX):]  # a name inside torch.compile(model): the wrapped module's
        if isinstance(spec, str):
            try:
                matches = _names_matching(model, named, spec)
            except LayerNotFoundError as error:
                hint = _wrapper_hint(model, spec)
                if not hint:
                    raise
                raise LayerNotFoundError(f"{error}{hint}") from None
        elif isinstance(spec, nn.Module):
            if id(spec) not in name_of:
                raise LayerNotFoundError(
                    f"the module {type(spec).__name__} passed as a layer is not part of the "
                    "model (was the model copied or rebuilt after the module was taken?)."
                )
            matches = [name_of[id(spec)]]
        elif isinstance(spec, type) and issubclass(spec, nn.Module):
            matches = [name for name in names if isinstance(named[name], spec)]
            if not matches:
                raise LayerNotFoundError(f"the model has no module of type {spec.__name__}.")
        else:
            raise TypeError(
                "a layer is given by its name, a glob, the module or a module type; "
                f"got {type(spec).__name__}."
            )
        for name in matches:
            found[name] = named[name]
    return list(found.items())


def check_hookable(model: nn.Module) -> None:
    """Refuse models whose forward does not run Python hooks (TorchScript: scripted or traced)."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"the model is a TorchScript module ({type(model).__name__}): its compiled forward does not "
            "run the forward hooks that capture feature maps and gradients. Explain the original "
            "nn.Module, before torch.jit.script / torch.jit.trace (load its state dict into the "
            "model's Python class)."
        )


def _compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile(module)`` wrapper (an ``OptimizedModule``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def _compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs torch.compile'd code: a ``torch.compile`` wrapper or a module
    compiled in place (``module.compile()``)."""
    return _compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def eager_model(model: nn.Module, what: str, compiled_code_runs: bool = False) -> nn.Module:
    """The module that runs ``model``'s forward eagerly, for methods that record what the forward
    computes: ``model`` itself, or for ``torch.compile(model)`` the original module it wraps
    (``_orig_mod``: the same module, parameters and buffers; its output equals the compiled one's to
    float rounding, and the compiled wrapper and its caches are left untouched). Raises TypeError,
    naming torch.compile and the fix, where compiled code would still run: a module compiled in
    place (``module.compile()``) or a compiled submodule. Compiled code runs neither module hooks
    nor call-scoped rules, and the gradients of what it records come out zero. ``compiled_code_runs``:
    for a method that only differentiates the output (no hook, no rule), which such code serves as well."""
    while _compile_wrapper(model):
        wrapped = getattr(model, "_orig_mod", None)
        if not isinstance(wrapped, nn.Module):
            break
        model = wrapped
    if compiled_code_runs:
        return model
    compiled = [name or "the model" for name, module in model.named_modules() if _compiled(module)]
    if compiled:
        listed = ", ".join(repr(name) for name in compiled[:3]) + (" and others" if len(compiled) > 3 else "")
        raise TypeError(
            f"{what} cannot look inside code that torch.compile runs: {listed} is compiled in place "
            "(Module.compile()) or wrapped by torch.compile, and compiled code runs neither the hooks nor the "
            "rules that record what the forward computes (gradients come out zero). Explain an uncompiled "
            "model: pass compiled._orig_mod for a compiled = torch.compile(model) (the same weights; a "
            "compiled model passed whole is unwrapped so), or a module on which .compile() was not called."
        )
    return model


COMPILED_PREFIX = "_orig_mod."
"""How ``torch.compile(model)``'s module names start: explainers run the module it wraps, whose names lack it."""


def first_tensor(tensors: Iterator[Tensor], accepted: Callable[[Tensor], bool] = lambda _: True) -> Optional[Tensor]:
    """The first of ``tensors`` (a module's ``parameters()``, ``buffers()``) that ``accepted`` takes, else None. The
    generator is closed here: one left suspended is closed when it is collected, where a Ctrl-C landing in it is lost
    (Python reports it as "Exception ignored")."""
    try:
        for tensor in tensors:
            if accepted(tensor):
                return tensor
        return None
    finally:
        close = getattr(tensors, "close", None)
        if close is not None:
            close()


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    tensor = first_tensor(model.parameters())
    tensor = tensor if tensor is not None else first_tensor(model.buffers())
    return tensor.device if tensor is not None else torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of the model's first floating parameter (float32 if none)."""
    tensor = first_tensor(model.parameters(), Tensor.is_floating_point)
    return tensor.dtype if tensor is not None else torch.float32


def model_input_channels(model: nn.Module) -> Optional[int]:
    """The channels of the images a model takes, as its first 2-D convolution (in module order: the stem of a CNN,
    a ViT's patch embedding) states them; None for a model without one (or with a lazy one not yet built)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            return int(module.in_channels) or None
    return None


def preserved_model_state(model: nn.Module, eval_mode: bool = True) -> CallScope:
    """A scope that runs its block with the model in eval mode and restores every module's flag after.

    Explainers run the model in eval mode so that BatchNorm uses (and never
    updates) its running statistics and dropout is off: a map is then a
    deterministic function of the image. Each module's own flag is restored,
    so models with mixed modes (frozen BatchNorm in a training model) come
    back exactly as they were (see ``explain.core.scope.CallScope``).
    """
    return CallScope(model, eval_mode=eval_mode)


class ActivationCapture(CallScope["ActivationCapture"]):
    """Forward hooks that capture target layers' outputs so that gradients can be taken at them.

    Use as a context manager around one forward pass::

        with ActivationCapture(model, [("layer4", model.layer4)], graph_from_first_layer=True) as capture:
            with torch.no_grad():
                output = model(batch)
        activations = capture.activations()   # one tensor per layer, (N, C, h, w)

    With ``graph_from_first_layer`` the forward is meant to run under
    ``torch.no_grad()``: the first target layer's hook turns gradients back on
    and replaces that layer's output by a fresh leaf tensor, so the autograd
    graph covers only the rest of the network (Grad-CAM costs one forward).
    Otherwise the captured outputs stay connected to the graph built so far.

    Each hook hands a clone of the captured output on to the rest of the
    network: an in-place operation after the layer (``ReLU(inplace=True)``)
    changes the clone, not the captured activation, and the gradient taken at
    the captured tensor is the gradient of the layer's true output. The hooks act
    on this thread's forward passes only and are removed when the block ends.
    """

    def __init__(self, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], *, graph_from_first_layer: bool):
        super().__init__(model)
        self.root = model
        self.layers = list(layers)
        self.graph_from_first_layer = graph_from_first_layer
        self._captured: dict[str, Tensor] = {}
        self._runs: dict[str, int] = {}
        """How many times each target layer, and each block containing one, ran in the forward."""

    def _hook_for(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], Optional[Tensor]]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> Optional[Tensor]:
            self._runs[name] = self._runs.get(name, 0) + 1
            if name in self._captured:  # refused by ``activations``, once the forward has said which blocks run once
                return None
            if not isinstance(output, Tensor):
                raise LayerOutputError(
                    f"layer {name!r} returned a {type(output).__name__}, not a tensor; "
                    "choose a layer whose output is a tensor of feature maps."
                )
            if self.graph_from_first_layer and not torch.is_grad_enabled():
                activation = output.detach().requires_grad_(True)
                torch.set_grad_enabled(True)  # the enclosing no_grad() restores the caller's mode on exit
            else:
                activation = output
            self._captured[name] = activation
            return activation.clone()

        return hook

    def _count_runs(self, name: str) -> Callable[..., None]:
        def count(module: nn.Module, args: tuple[object, ...]) -> None:
            self._runs[name] = self._runs.get(name, 0) + 1

        return count

    def setup(self) -> "ActivationCapture":
        self._captured.clear()
        self._runs.clear()
        targets = {name for name, _ in self.layers}
        for block in sorted({parent for name in targets for parent in _parent_names(name)} - targets):
            module = _submodule(self.root, block)
            if module is not None:
                self.forward_pre_hook(module, self._count_runs(block))
        for name, module in self.layers:
            self.forward_hook(module, self._hook_for(name))
        return self

    def activations(self) -> list[Tensor]:
        """The captured output of each target layer, in the order the layers were given.

        Raises LayerNotRunError for a layer that did not run in the forward pass, or ran more than once.
        """
        for name, _ in self.layers:
            runs = self._runs.get(name, 0)
            if runs > 1:
                raise LayerNotRunError(
                    f"layer {name!r} ran more than once in one forward pass ({runs} times: a module used in several "
                    "places, such as the one `relu` of a torchvision BasicBlock, or inside a block that runs several "
                    "times). A "
                    f"map needs a layer that runs once: {_run_once_advice(self.root, name, self._runs)}"
                )
        missing = [name for name, _ in self.layers if name not in self._captured]
        if missing:
            raise LayerNotRunError(
                f"layer {missing[0]!r} did not run during the model's forward pass, so there is "
                "nothing to explain at it. Choose a layer that the forward uses "
                f"(`explain layers MODEL` lists them with their output shapes).{_fx_block_note(self.root, missing[0])}"
            )
        return [self._captured[name] for name, _ in self.layers]

    def clear(self) -> None:
        """Drop the captured tensors (and with them the autograd graph they hold)."""
        self._captured.clear()


def _parent_names(name: str) -> list[str]:
    """The names of the blocks that contain layer ``name``, nearest first (``"a.b.c"``: ``"a.b"``, ``"a"``)."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]


def _submodule(model: nn.Module, name: str) -> Optional[nn.Module]:
    """The module called ``name`` in ``model``, or None where there is none."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _fx_graph_module(model: nn.Module, name: str) -> Optional[tuple[str, torch.fx.GraphModule]]:
    """(its name, the GraphModule) of the innermost torch.fx GraphModule containing layer ``name`` (the model
    itself: name ""), or None where none does."""
    for owner in [*_parent_names(name), ""]:
        module = _submodule(model, owner) if owner else model
        if isinstance(module, torch.fx.GraphModule):
            return owner, module
    return None


def _fx_leaves_run_once(model: nn.Module, block: str) -> Optional[list[str]]:
    """For a layer ``block`` inside a torch.fx GraphModule: the leaf layers under it that the graph calls once,
    last first (None where the layer is in no GraphModule)."""
    graph_module = _fx_graph_module(model, block)
    if graph_module is None:
        return None
    owner, module = graph_module
    prefix = f"{owner}." if owner else ""
    called = [prefix + str(node.target) for node in module.graph.nodes if node.op == "call_module"]
    inside = [name for name in called if name.startswith(f"{block}.")]
    return [name for name in reversed(dict.fromkeys(inside)) if called.count(name) == 1]


def _fx_block_note(model: nn.Module, name: str) -> str:
    """Where layer ``name`` is a block of a torch.fx GraphModule (which never runs as a module): why it did
    not run and what to name instead; else ""."""
    leaves = _fx_leaves_run_once(model, name)
    module = _submodule(model, name)
    if leaves is None or module is None or not any(True for _ in module.children()):
        return ""
    instead = (f" Leaf layers under it that run once, last first: {', '.join(map(repr, leaves[:4]))}." if leaves
               else "")
    return (f" The model is a torch.fx GraphModule, which calls its leaf modules directly: a block such as {name!r} "
            "never runs as a module. Explain the model as it was before torch.fx.symbolic_trace, or name a leaf "
            f"layer.{instead}")


def _run_once_advice(model: nn.Module, name: str, runs: dict[str, int]) -> str:
    """What to choose instead of layer ``name``, which ran more than once: the nearest block containing it that
    ran once in the forward (``runs``: the times each block ran), else why none did and what to do."""
    parents = _parent_names(name)
    counts = [runs.get(parent, 0) for parent in parents]
    if not parents:
        return ("choose another layer (one that runs once: `explain layers MODEL` lists them), or give the model a "
                f"separate module for each place {name!r} is used.")
    ran = ", ".join(f"{parent!r} {_times(count)}" for parent, count in zip(parents, counts))
    if counts[0] == 1:
        return f"choose its parent block ({parents[0]!r}, which ran once) or another layer."
    if 1 in counts:
        block = parents[counts.index(1)]
        return (f"its parent block ({parents[0]!r}) did not run once ({ran}): choose {block!r}, the nearest block "
                "containing it that ran once, or another layer.")
    leaves = _fx_leaves_run_once(model, parents[0])
    if leaves is not None:
        instead = f" (e.g. {', '.join(map(repr, leaves[:4]))})" if leaves else ""
        return (f"its parent block ({parents[0]!r}) and the blocks around it never run as modules: the model is a "
                "torch.fx GraphModule, which calls its leaf modules directly. Explain the model as it was before "
                f"torch.fx.symbolic_trace, or choose a leaf layer that runs once{instead}.")
    return (f"no block containing it ran once, not its parent block ({parents[0]!r}) either ({ran}). Choose another "
            "layer that runs once (`explain layers MODEL` lists them), or give the model a separate module for each "
            "place the shared one is used (e.g. a copy.deepcopy of the block for its second use).")


def _times(count: int) -> str:
    """How many times a block ran, in words."""
    return "never (its layers were called directly)" if count == 0 else "once" if count == 1 else f"{count} times"


def map_tensors(value: Any, function: Callable[[Tensor], Any]) -> Any:
    """Apply ``function`` to every tensor in a nested tuple / list / dict structure."""
    return _map_leaves(value, Tensor, function)


def _map_leaves(value: Any, leaf: type, function: Callable[[Any], Any]) -> Any:
    """Apply ``function`` to every instance of ``leaf`` in a nested tuple / list / dict structure, which keeps its
    types (a namedtuple, a HuggingFace ModelOutput, a defaultdict with its default factory)."""
    if isinstance(value, leaf):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_leaves(item, leaf, function) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_leaves(item, leaf, function) for item in value)
    if isinstance(value, dict):
        items = [(key, _map_leaves(item, leaf, function)) for key, item in value.items()]
        try:
            return type(value)(items)
        except TypeError:  # a constructor that takes other arguments first (defaultdict's default factory)
            mapped = copy.copy(value)
            for key, item in items:
                mapped[key] = item
            return mapped
    return value


@dataclass(frozen=True)
class _Slot:
    """Where the tensor at ``index`` (in ``map_tensors`` order) stood in a structure of tensors."""

    index: int


RecordedArgs = tuple[object, ...]
"""A call's positional inputs, as ``capture(..., inputs=True)`` records them."""
RecordedKwargs = dict[str, object]
"""A call's keyword inputs, as ``capture(..., inputs=True)`` records them."""
Args = TypeVar("Args", bound=Optional[RecordedArgs], covariant=True, default=Optional[RecordedArgs])
"""The type of a record's ``args``: ``RecordedArgs`` when ``capture`` was called with ``inputs=True``
(so that ``captured[name].args[0]`` type-checks), else ``Optional[RecordedArgs]`` (None when not recorded)."""
Kwargs = TypeVar("Kwargs", bound=Optional[RecordedKwargs], covariant=True, default=Optional[RecordedKwargs])
"""The type of a record's ``kwargs``, as ``Args``."""


@dataclass
class Call:
    """One call of a module during a forward pass.

    args, kwargs: its positional and keyword inputs (with ``inputs=True``, else None).
    output: what it returned (with ``outputs=True``, else None): usually a tensor, or a tuple,
        list or dict of them; its type is the module's.
    grad: the gradient of the loss with respect to ``output``, once a backward pass
        has run inside the ``capture`` block (with ``grads=True``; None before, or for
        an output that does not require grad). Same structure as ``output``.
    """

    args: Optional[RecordedArgs] = None
    kwargs: Optional[RecordedKwargs] = None
    output: object = None
    grad: object = None
    _no_grad_reason: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    """Why no gradient can reach ``output`` (it requires none), when ``grads=True`` asked for one."""


@dataclass
class LayerRecord(Generic[Args, Kwargs]):
    """What ``capture`` recorded for one layer: one ``Call`` per time the module ran, in call order.

    The type parameters are the types of ``args`` and ``kwargs``: ``LayerRecord[RecordedArgs,
    RecordedKwargs]`` with ``capture(..., inputs=True)``; a plain ``LayerRecord`` (Optional ones) otherwise.
    """

    name: str
    calls: list[Call] = field(default_factory=list)

    def _single(self, attribute: str) -> object:
        if not self.calls:
            raise LayerNotRunError(
                f"layer {self.name!r} did not run in the captured forward pass(es), so it has no {attribute}: "
                "run the model inside the capture block, and choose a layer that its forward uses "
                "(`explain layers MODEL` lists them with their output shapes)."
            )
        if len(self.calls) != 1:
            raise LayerNotRunError(
                f"layer {self.name!r} ran {len(self.calls)} times in the captured forward pass(es); "
                f"read .calls[i].{attribute} (or .{attribute}s) for each call, in call order."
            )
        return getattr(self.calls[0], attribute)

    @property
    def output(self) -> object:
        """The output of the layer's only call (an error if it ran several times: use ``outputs``)."""
        return self._single("output")

    @property
    def grad(self) -> object:
        """The output gradient of the layer's only call (after a backward pass; a warning says why when
        none can come: the forward ran under ``torch.no_grad()``, for instance)."""
        gradient = self._single("grad")
        self._warn_without_grad(self.calls)
        return gradient

    @property
    def args(self) -> Args:
        """The positional inputs of the layer's only call."""
        # a tuple when the block was opened with inputs=True, which capture's overloads make Args say
        return cast(Args, self._single("args"))

    @property
    def kwargs(self) -> Kwargs:
        """The keyword inputs of the layer's only call."""
        return cast(Kwargs, self._single("kwargs"))  # see args

    @property
    def outputs(self) -> list[object]:
        """Outputs of every call, in call order."""
        return [call.output for call in self.calls]

    @property
    def grads(self) -> list[object]:
        """Output gradients of every call, in call order (a warning says why for calls that can have none)."""
        self._warn_without_grad(self.calls)
        return [call.grad for call in self.calls]

    def _warn_without_grad(self, calls: list[Call]) -> None:
        """Warn, at the user's line, about the calls whose output no gradient can reach (``grads=True`` but
        the forward ran without gradients), which would otherwise read as a silent None."""
        reasons = [call._no_grad_reason for call in calls if call.grad is None and call._no_grad_reason]
        if reasons:
            which = "its call" if len(calls) == 1 else f"{len(reasons)} of its {len(calls)} calls"
            warn_at_callers_line(
                f"layer {self.name!r} has no gradient for {which} (None): {reasons[0]}, so no backward pass can "
                "reach its output. Run the model with gradients on inside the capture block (not under "
                "torch.no_grad() or torch.inference_mode()); for a frozen model, call x.requires_grad_() on "
                "the input."
            )


class Captured(dict[str, LayerRecord[Args, Kwargs]], Generic[Args, Kwargs]):
    """``capture``'s result: layer name → LayerRecord, in the order the layers were selected."""

    def __repr__(self) -> str:
        rows = ", ".join(f"{name!r}: {len(record.calls)} call(s)" for name, record in self.items())
        return f"Captured({{{rows}}})"


LayerHook = Callable[[nn.Module, tuple[object, ...], dict[str, object], object], object]
"""A forward hook registered with ``with_kwargs=True``: (module, args, kwargs, output) → new output or None."""


class CaptureBlock(CallScope[Captured[Args, Kwargs]]):
    """The ``with`` block of ``capture``: hooks for this thread's forward passes, removed at its end."""

    def __init__(self, model: nn.Module, selected: list[tuple[str, nn.Module]], *, inputs: bool, outputs: bool,
                 grads: bool, detach: bool, to: Union[str, torch.device, None]):
        super().__init__(model)
        self.selected = selected
        self.captured: Captured[Args, Kwargs] = Captured((name, LayerRecord(name)) for name, _ in selected)
        self.record_inputs, self.record_outputs, self.record_grads = inputs, outputs, grads
        self.detach, self.to = detach, to

    def keep(self, tensor: Tensor) -> Tensor:
        kept = tensor.detach().clone() if self.detach else tensor
        return kept.to(self.to) if self.to is not None else kept

    def _hook_for(self, record: LayerRecord[Args, Kwargs]) -> LayerHook:
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object) -> object:
            call = Call()
            record.calls.append(call)
            if self.record_inputs:
                call.args, call.kwargs = map_tensors(args, self.keep), map_tensors(kwargs, self.keep)
            if self.record_outputs:
                call.output = map_tensors(output, self.keep)
            if not (self.record_grads or (self.record_outputs and not self.detach)):
                return None
            if self.record_grads:
                self._record_output_grads(call, output)
            # hand a clone on, so that an in-place op after the layer changes neither
            # the recorded output nor the tensor whose gradient is recorded
            return map_tensors(output, lambda tensor: tensor.clone())

        return hook

    def setup(self) -> Captured[Args, Kwargs]:
        for name, module in self.selected:
            self.forward_hook(module, self._hook_for(self.captured[name]), with_kwargs=True)
        return self.captured

    def _record_output_grads(self, call: Call, output: object) -> None:
        """Tensor hooks that store ∂loss/∂output into ``call.grad`` (same structure as the output).

        The hooks hold the output's structure, not its tensors: a tensor whose hook held the tensor itself would
        keep itself, and the graph of its forward pass, alive until the block ends (a loop over a data set inside
        one block would hold every batch's graph)."""
        leaves: list[Tensor] = []
        map_tensors(output, leaves.append)
        positions = iter(range(len(leaves)))
        structure = map_tensors(output, lambda _: _Slot(next(positions)))
        gradients: list[Optional[Tensor]] = [None] * len(leaves)

        def store(index: int) -> Callable[[Tensor], None]:
            def tensor_hook(gradient: Tensor) -> None:
                gradients[index] = self.keep(gradient)
                call.grad = _map_leaves(structure, _Slot, lambda slot: gradients[slot.index])

            return tensor_hook

        for index, tensor in enumerate(leaves):
            if tensor.requires_grad:
                self.add_undo(tensor.register_hook(store(index)).remove)
        if leaves and not any(tensor.requires_grad for tensor in leaves):
            call._no_grad_reason = no_gradient_reason()


def no_gradient_reason() -> str:
    """Why a layer's output, seen by a hook of this forward pass, requires no gradient."""
    if torch.is_inference_mode_enabled():
        return "the forward ran under torch.inference_mode()"
    if not torch.is_grad_enabled():
        return "the forward ran under torch.no_grad()"
    return "its output depends on nothing that requires grad (no parameter before it does, nor the input)"


@overload
def capture(
    model: nn.Module,
    layers: LayerSpec | Sequence[LayerSpec],
    *,
    inputs: Literal[True],
    outputs: bool = ...,
    grads: bool = ...,
    detach: bool = ...,
    to: Union[str, torch.device, None] = ...,
) -> CaptureBlock[RecordedArgs, RecordedKwargs]: ...


@overload
def capture(
    model: nn.Module,
    layers: LayerSpec | Sequence[LayerSpec],
    *,
    inputs: bool = ...,
    outputs: bool = ...,
    grads: bool = ...,
    detach: bool = ...,
    to: Union[str, torch.device, None] = ...,
) -> CaptureBlock: ...


def capture(
    model: nn.Module,
    layers: LayerSpec | Sequence[LayerSpec],
    *,
    inputs: bool = False,
    outputs: bool = True,
    grads: bool = False,
    detach: bool = True,
    to: Union[str, torch.device, None] = None,
) -> CaptureBlock:
    """Record layers' inputs, outputs and output gradients while the block runs the model.

    layers: names, modules, globs (``"layer*"``, ``"encoder.layers.*.dropout2"``) or
        a module type (``nn.Conv2d``); see ``find_layers``.
    inputs / outputs / grads: what to record. Gradients are recorded when a
        backward pass runs inside the block (the last backward's, for several);
        reading ``.grad`` warns when the forward ran without gradients
        (``torch.no_grad()``), so that none can come.
    detach: True (default) stores detached copies, safe from later in-place
        operations; False keeps the outputs in the autograd graph, so a loss on
        them back-propagates into the model (feature distillation).
    to: a device to move recorded tensors to (e.g. "cpu").

    ``with capture(...) as captured`` gives a ``Captured`` dict: name → LayerRecord, whose
    ``calls`` list holds one ``Call`` per time the module ran. Only forward passes of the
    thread that opened the block are recorded (other threads see the plain model). Every
    hook is removed when the block ends, also when it raises or is interrupted::

        with explain.capture(model, "layer4", grads=True) as captured:
            model(x)[0, 3].backward()
        captured["layer4"].output, captured["layer4"].grad
    """
    return CaptureBlock(model, find_layers(model, layers), inputs=inputs, outputs=outputs, grads=grads,
                        detach=detach, to=to)
