"""Explainers' options: the ones every explainer takes, their documentation read from docstrings, their text in records
and the full signature of a method's constructor."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import textwrap
from typing import (
    Any,
    Optional,
    Protocol,
    Sequence,
    TypedDict,
    runtime_checkable,
)

import torch
from torch import Tensor, nn

from ..core.targets import (
    OutputSelector,
)
from ..io.inputs import PreprocessSpec


class ExplainerOptions(TypedDict, total=False):
    """The keyword options every explainer takes (see ``Explainer``), for ``**options: Unpack[...]``."""

    preprocess: PreprocessSpec
    normalize: Optional[str]
    class_names: Optional[Sequence[str]]
    output: OutputSelector
    progress: Optional[bool]
    probabilities: Optional[str]


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


@runtime_checkable
class DescribedBySettings(Protocol):
    """An object written as its class and settings in records: an explainer (``Explainer.settings``)."""

    def settings(self) -> dict[str, str]: ...


def setting_text(value: Any) -> str:
    """A short text of an option's value, the same in every process (no memory addresses, sets sorted): a tensor
    as its shape, dtype and a digest of its values, a module with submodules by its class, an explainer by its
    class and ``settings``, a function by its qualified name."""
    if isinstance(value, DescribedBySettings):
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
