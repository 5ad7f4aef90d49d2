"""Load a model by name for the command line: the shipped demo model or a torchvision model.

Weights are a local file (a state dict), a torchvision weights name ("DEFAULT",
"IMAGENET1K_V2", "ResNet50_Weights.IMAGENET1K_V2") downloaded by torchvision,
or none (random weights). A download that fails says so and how to pass a file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torchvision
from torch import nn

from .data.demo import DemoNet, load_demo_model
from .data.demo_vit import DemoViT, load_demo_vit
from .data.synthetic import CLASS_NAMES
from .inputs import Normalize


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights that could not be downloaded or read."""


@dataclass
class LoadedModel:
    """A model ready to explain: in eval mode, with what is known about its inputs and classes."""

    model: nn.Module
    preprocess: Optional[Callable]
    class_names: Optional[Sequence[str]]
    name: str


def _weights_enum(name: str):
    try:
        return torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return None


def _resolve_weights_name(model_name: str, weights: str):
    enum = _weights_enum(model_name)
    if "." in weights:
        return torchvision.models.get_weight(weights)
    if enum is None:
        raise ValueError(f"torchvision has no pretrained weights for {model_name!r}.")
    try:
        return enum[weights]
    except KeyError:
        known = ", ".join(["DEFAULT"] + [member.name for member in enum])
        raise ValueError(
            f"{model_name!r} has no weights named {weights!r}; known: {known}, or give a path to a file."
        ) from None


def _load_state_dict(model: nn.Module, state: dict, weights: str, name: str) -> None:
    """Load weights into a model, or say in a few lines which keys or shapes do not fit."""
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        details = [line.strip() for line in str(error).splitlines() if line.strip()][1:4]
        raise WeightsUnavailableError(
            f"the weights in {weights!r} do not fit the {name} model (were they saved from another "
            f"architecture, or with another number of classes?): {' '.join(details)[:400]}"
        ) from error


def _read_state_dict(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {str(path)!r}.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and format errors of any kind
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WeightsUnavailableError(
            f"could not read weights from {str(path)!r} ({type(error).__name__}: {first[:200]}): give a state "
            "dict saved with torch.save(model.state_dict(), path)."
        ) from error
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise WeightsUnavailableError(f"{str(path)!r} does not hold a state dict (got {type(state).__name__}).")
    return {key.removeprefix("module."): value for key, value in state.items()}


def load_model(name: str, weights: Optional[str] = None) -> LoadedModel:
    """A model by name: "demo" (the shipped CNN), "demo-vit" (the shipped transformer) or any
    torchvision classification model name.

    weights: None (random weights for torchvision models), a path to a state dict,
    or a torchvision weights name. Raises WeightsUnavailableError when weights
    cannot be downloaded or read, with the fix in the message.
    """
    if name == "demo-vit":
        if weights is None:
            model = load_demo_vit()
        else:
            model = DemoViT()
            _load_state_dict(model, _read_state_dict(Path(weights).expanduser()), weights, name)
            model.eval()
        return LoadedModel(model, Normalize(), list(CLASS_NAMES), "demo-vit")
    if name == "demo":
        if weights is None:
            model = load_demo_model()
        else:
            model = DemoNet()
            _load_state_dict(model, _read_state_dict(Path(weights).expanduser()), weights, name)
            model.eval()
        return LoadedModel(model, Normalize(), list(CLASS_NAMES), "demo")
    available = torchvision.models.list_models()
    if name not in available:
        close = difflib.get_close_matches(name, available, n=5, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r}: use 'demo', 'demo-vit' or a torchvision model name.{hint}")
    enum = _weights_enum(name)
    default_weights = enum.DEFAULT if enum is not None else None
    if weights is None:
        model = torchvision.models.get_model(name, weights=None)
        chosen = default_weights
    elif Path(weights).expanduser().is_file():
        state = _read_state_dict(Path(weights).expanduser())
        model = torchvision.models.get_model(name, weights=None)
        _load_state_dict(model, state, weights, name)
        chosen = default_weights
    elif any(separator in weights for separator in ("/", "\\")) or weights.endswith((".pt", ".pth", ".bin")):
        raise FileNotFoundError(f"no weights file at {weights!r}.")
    else:
        chosen = _resolve_weights_name(name, weights)
        try:
            model = torchvision.models.get_model(name, weights=chosen)
        except Exception as error:  # URLError, OSError, SSL errors: no network
            filename = chosen.url.rsplit("/", 1)[-1]
            raise WeightsUnavailableError(
                f"could not download the {chosen} weights for {name} ({type(error).__name__}: {error}). "
                f"This machine may have no network. Download {chosen.url} on a machine that has, copy it "
                f"here and pass its path: --weights /path/to/{filename}"
            ) from error
    categories = chosen.meta.get("categories") if chosen is not None else None
    num_classes = _num_outputs(model)
    class_names = categories if categories is not None and len(categories) == num_classes else None
    preprocess = chosen.transforms() if chosen is not None else Normalize()
    return LoadedModel(model.eval(), preprocess, class_names, name)


def _num_outputs(model: nn.Module) -> Optional[int]:
    last_linear = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last_linear = module
    return None if last_linear is None else last_linear.out_features
