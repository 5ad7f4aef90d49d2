"""Every method by name: ``@register`` adds a class, ``get_method`` finds one (as the command line's --method takes
it)."""

from __future__ import annotations

import difflib
from typing import (
    TypeVar,
)

from .base import Explainer


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
