"""A model with what is known about its inputs and classes (``LoadedModel``), and what an explainer takes as its
model (``ModelSource``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn

from ..core.targets import OutputSelector
from .inputs import Preprocess


@dataclass
class LoadedModel:
    """A model ready to explain, in eval mode, with what is known about its inputs and classes.

    preprocess: the model's own preprocessing (PIL image → (C, H, W) tensor), with ``mean``/``std``.
    class_names: one name per output class, or None. output: which part of the model's output
        holds the scores (for ``Explainer(output=...)``), or None. input_size: (C, H, W) the model
        expects, when known. default_layer: the layer CAMs use when none is given (None: chosen
        automatically on the first call).
    """

    model: nn.Module
    preprocess: Preprocess
    class_names: Optional[list[str]]
    name: str
    output: OutputSelector = None
    input_size: Optional[tuple[int, int, int]] = None
    default_layer: Optional[str] = None
    task: str = "classification"
    """"classification", "segmentation" ((N, classes, H, W) logits), "detection" (a list of
    dicts per image) or "other" (a backbone or embedding model whose ``output`` is explained)."""
    random_weights: bool = False
    """Whether the model's weights are random: an architecture loaded without weights."""


ModelSource = Union[nn.Module, LoadedModel]
"""What an explainer takes as its model: any ``nn.Module``, or what ``explain.load_model`` returns (its module,
with its preprocessing, class names and output selector as defaults)."""


def loaded_model_parts(model: Any, preprocess: Any = None, class_names: Any = None, output: OutputSelector = None
                       ) -> tuple[Any, Any, Any, OutputSelector]:
    """What an explainer takes from ``model``: a ``LoadedModel`` gives its module, and its preprocessing, class
    names and output selector where the caller gave none (``GradCAM(explain.load_model("demo"), "layer4")``);
    anything else is returned as given (the explainer checks that it is a module)."""
    if not isinstance(model, LoadedModel):
        return model, preprocess, class_names, output
    return (model.model, model.preprocess if preprocess is None else preprocess,
            model.class_names if class_names is None else class_names, model.output if output is None else output)
