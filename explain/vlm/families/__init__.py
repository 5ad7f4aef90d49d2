"""The model families whose image-token layouts explain knows; importing a module registers its layout function.
One line per family (kept apart so that families can be added line by line); ``layout_for`` finds a model's."""
# ruff: noqa: F401, I001

from torch import nn

from ..layout import LAYOUTS, LayoutFunction

from . import llava
from . import llava_next
from . import paligemma
from . import qwen2_vl
from . import idefics3


def layout_for(model: nn.Module) -> LayoutFunction:
    """The registered layout function of a model (by ``model.config.model_type``), or a clear error."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LAYOUTS:
        known = ", ".join(sorted(LAYOUTS))
        raise ValueError(f"explain does not know where {type(model).__name__}'s image tokens lie "
                         f"(config.model_type {model_type!r}); models it knows: {known}.")
    return LAYOUTS[model_type]
