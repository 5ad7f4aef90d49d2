"""``explain.compare``: explain the same images with several methods by name and lay them out with ``figure``."""

from __future__ import annotations

import difflib
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

from torch import nn
from typing_extensions import Unpack

from ..core.capture import LayerSpec
from ..core.targets import OutputSelector, Target
from ..io import render
from ..io.explanation import Explanation
from ..io.figures import FigureOptions, figure
from ..io.inputs import Inputs, PreprocessSpec
from ..io.loaded_model import LoadedModel
from .base import Explainer
from .registry import get_method
from .signatures import full_signature

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CHEAP_METHODS = ("gradcam", "gradcam++", "layercam", "saliency", "inputxgradient", "guidedbackprop")
"""``compare``'s default methods: each costs one forward and one backward pass per image. Score-CAM
(a forward pass per channel of the layer) and the path methods (Integrated Gradients: 32 passes) are
worth naming when wanted, at their cost."""


class Comparison(NamedTuple):
    """What ``compare`` returns: the figure and the explanations (``fig, explanations = compare(...)``).
    A notebook cell whose result it is shows the figure."""

    figure: "Figure"
    explanations: list[Explanation]

    def _repr_png_(self) -> bytes:
        return render.figure_png(self.figure)

    def save(self, path: Union[str, "os.PathLike[str]"], dpi: Optional[int] = 300) -> None:
        """Save the figure; the format follows the file's extension: PDF and SVG are vector figures (each panel
        one embedded image, the titles and the colour bar text), PNG is drawn at ``dpi``."""
        render.save_figure(self.figure, os.fspath(path), dpi=dpi)


def options_taken(method: type[Explainer]) -> Optional[frozenset[str]]:
    """The names of the keyword options ``method``'s constructor takes (not the model, the layer or the
    explainer it wraps); None when it takes any (``**options`` of its own)."""
    parameters = full_signature(method).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return frozenset(p.name for p in parameters if p.name not in ("self", "model", "layer", "explainer"))


def compare(
    model: Union[nn.Module, LoadedModel],
    images: Inputs,
    methods: Sequence[str] = CHEAP_METHODS,
    *,
    layer: Optional[LayerSpec | Sequence[LayerSpec]] = None,
    target: Target = None,
    method_options: Optional[Mapping[str, Any]] = None,
    preprocess: PreprocessSpec = None,
    class_names: Optional[Sequence[str]] = None,
    output: OutputSelector = None,
    **figure_options: Unpack[FigureOptions],
) -> Comparison:
    """Explain ``images`` with each registered method by name and lay them out with ``figure``.

    model: a module, or what ``explain.load_model`` returns (its preprocessing, class names and output
    selector then go to every method). methods: registered names (``explain methods`` lists them); the
    default, ``CHEAP_METHODS``, costs one forward and one backward pass per image and method. layer: the
    CAM methods' layer (None: chosen automatically). preprocess, class_names, output: as every explainer
    takes them (``Explainer``), for all the methods. method_options: keyword arguments for the methods,
    each passed to the methods that take it (``steps`` to Integrated Gradients only); an option that none
    of them takes is an error. The other keywords are ``figure``'s (titles, colour bar, layout).
    Returns a ``Comparison``: the figure and the explanations, which a notebook shows as the figure;
    ``.save("figure.pdf")`` writes it.
    """
    methods = (methods,) if isinstance(methods, str) else tuple(methods)  # one name is one method, not its letters
    if not methods:
        raise ValueError(f"compare got methods=[] (no method to compare): name at least one (`explain methods` lists "
                         f"them), or leave methods out for the default {CHEAP_METHODS}.")
    unknown_figure_options = sorted(set(figure_options) - set(FigureOptions.__annotations__))
    if unknown_figure_options:
        raise TypeError(f"compare got the keyword(s) {', '.join(unknown_figure_options)}, which neither the methods "
                        "(preprocess, class_names, output; others in method_options=) nor the figure take "
                        f"({', '.join(FigureOptions.__annotations__)}).")
    classes = [get_method(name) for name in methods]
    shared = {"preprocess": preprocess, "class_names": class_names, "output": output}
    options = {**{key: value for key, value in shared.items() if value is not None}, **dict(method_options or {})}
    taken = [options_taken(cls) for cls in classes]
    known = set().union(*(names for names in taken if names is not None))
    unknown = [name for name in options if None not in taken and name not in known]
    if unknown:
        hints = "".join(f" Did you mean {close[0]!r} for {name!r}?" for name in unknown
                        if (close := difflib.get_close_matches(name, sorted(known), n=1)))
        raise ValueError(f"method_options {unknown} {'is' if len(unknown) == 1 else 'are'} taken by none of the "
                         f"methods compared ({', '.join(methods)}).{hints} Their options: {', '.join(sorted(known))}.")
    explanations: list[Explanation] = []
    for method, cls, names in zip(methods, classes, taken):
        make: Callable[..., Explainer] = cls  # constructors differ: CAM methods take the layer after the model
        own = {name: value for name, value in options.items() if names is None or name in names}
        try:
            explainer = make(model, layer, **own) if cls.needs_layer else make(model, **own)
            explanations.append(explainer.explain(images, target=target))
        except (ValueError, TypeError, RuntimeError) as error:
            raise _naming_the_method(error, method) from error
    return Comparison(figure(explanations, **figure_options), explanations)


def _naming_the_method(error: Exception, method: str) -> Exception:
    """``error`` with its message prefixed by the method compared that raised it, of the same type and with the
    same attributes (so that an ``except LayerNotFoundError`` still catches it, and a ModelInputError keeps its
    ``model_error``); ``error`` itself where its type cannot be rebuilt from a message."""
    try:
        named = type(error)(f"compare: method {method!r} failed on this model: {error}")
        named.__dict__.update(error.__dict__)
    except Exception:
        return error
    return named if str(named).startswith("compare: ") else error
