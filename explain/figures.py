"""Figures for papers and notebooks: images in rows, methods in columns (or the reverse).

Every panel is one raster image (embedded once in PDF/SVG), titles and colorbars stay text,
so ``fig.savefig("grid.pdf")`` gives a vector figure with one image per panel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypedDict

import numpy as np
from torch import Tensor, nn
from typing_extensions import Unpack

from . import render
from .capture import LayerSpec
from .explanation import Explanation
from .inputs import Inputs
from .targets import Target

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .methods.base import Explainer

NORMALIZATIONS = ("map", "row")


class FigureOptions(TypedDict, total=False):
    """The keyword options of ``figure``, as ``compare`` passes them on."""

    rows: str
    show_image: bool
    cmap: str
    alpha: float
    mode: str
    normalize: str
    signed: Optional[bool]
    clip_percentile: float
    colorbar: bool
    panel_size: float
    fontsize: float


def _panel_values(explanation: Explanation, image: int, signed: bool, clip_percentile: float,
                  row_scale: Optional[float]) -> Tensor:
    """One map in [0, 1] for display: signed maps centred at 0.5, others as normalised."""
    raw = explanation.raw_map_grid[image, 0].detach().float().cpu()
    if signed:
        if row_scale is not None:
            return (raw / row_scale).clamp(-1, 1) * 0.5 + 0.5
        return render.signed_to_unit(raw, clip_percentile)
    if row_scale is not None:
        return (raw.clamp_min(0) / row_scale).clamp(0, 1)
    return explanation.map_grid[image, 0].detach().float().cpu().clamp(0, 1)


def is_signed(explanation: Explanation) -> bool:
    """Whether the maps carry negative evidence (relu=False CAMs, signed attributions)."""
    return bool((explanation.raw_map_grid < 0).any())


def figure(
    explanations: Sequence[Explanation],
    *,
    rows: str = "images",
    show_image: bool = True,
    cmap: str = "jet",
    alpha: float = 0.5,
    mode: str = "blend",
    normalize: str = "map",
    signed: Optional[bool] = None,
    clip_percentile: float = 99.0,
    colorbar: bool = False,
    panel_size: float = 1.9,
    fontsize: float = 8.0,
) -> "Figure":
    """A grid of the explanations of the same images by several methods.

    explanations: one Explanation per method, all of the same N images (the first target of
        each image is shown). rows: "images" (images in rows, methods in columns) or "methods".
    show_image: a column (or row) with the original images. mode / alpha / cmap: see
        ``render.overlay``; colour-blind-safe maps such as "viridis" or "cividis" work as well.
    normalize: "map" (each map to its own maximum) or "row" (each image's maps share one scale,
        the largest |value| among them). signed: draw maps with negative values in a diverging
        colour map centred on zero ("RdBu_r"), clipping |values| at ``clip_percentile``; None
        decides per explanation. colorbar: one shared colorbar, labelled.
    Returns a matplotlib Figure (save it to PNG at any dpi, or to PDF/SVG).
    """
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    if not explanations:
        raise ValueError("figure needs at least one explanation.")
    if rows not in ("images", "methods"):
        raise ValueError(f"rows must be 'images' or 'methods'; got {rows!r}.")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
    count = len(explanations[0])
    if any(len(explanation) != count for explanation in explanations):
        raise ValueError("all explanations must be of the same images (the same N).")
    images = explanations[0].images
    signs = [is_signed(e) if signed is None else signed for e in explanations]
    columns = len(explanations) + int(show_image)
    grid_shape = (count, columns) if rows == "images" else (columns, count)
    fig = Figure(figsize=(panel_size * grid_shape[1] + (0.8 if colorbar else 0), panel_size * grid_shape[0] + 0.3),
                 layout="constrained")
    axes = fig.subplots(*grid_shape, squeeze=False)
    for image in range(count):
        row_scale = None
        if normalize == "row":
            row_scale = max(float(e.raw_map_grid[image, 0].abs().max()) for e in explanations) or 1.0
        panels: list[tuple[str, np.ndarray, Optional[str]]] = []
        if show_image:
            panels.append(("image", (images[image].numpy() * 255).round().astype("uint8"), None))
        for explanation, signed_map in zip(explanations, signs):
            values = _panel_values(explanation, image, signed_map, clip_percentile, row_scale)
            panel_cmap = render.DIVERGING_CMAP if signed_map else cmap
            drawn = render.overlay(images[image], values, alpha=alpha, cmap=panel_cmap, mode=mode)
            header = explanation.description()
            if len(header) > 22:  # long layer names go on their own line, so headers never overlap
                header = header.replace(" @ ", "\n@ ")
            panels.append((header, drawn, explanation.title(image)))
        for position, (header, picture, subtitle) in enumerate(panels):
            axis = axes[image, position] if rows == "images" else axes[position, image]
            axis.imshow(picture, interpolation="bilinear")
            axis.set_xticks([])
            axis.set_yticks([])
            first = image == 0
            if first and rows == "images":
                axis.set_title(header if subtitle is None else f"{header}\n{subtitle}", fontsize=fontsize)
            elif subtitle is not None:
                axis.set_title(subtitle, fontsize=fontsize)
            if rows == "methods" and image == 0:
                axis.set_ylabel(header, fontsize=fontsize)
    if colorbar:
        import matplotlib

        any_signed = any(signs)
        scalar = matplotlib.cm.ScalarMappable(
            norm=Normalize(-1 if any_signed else 0, 1), cmap=render.DIVERGING_CMAP if any_signed else cmap)
        bar = fig.colorbar(scalar, ax=axes, shrink=0.8)
        bar.set_label("signed relevance (scaled)" if any_signed else "relevance (normalised)", fontsize=fontsize)
        bar.ax.tick_params(labelsize=fontsize)
    return fig


def compare(
    model: nn.Module,
    images: Inputs,
    methods: Sequence[str] = ("gradcam", "gradcam++", "scorecam", "saliency", "integratedgradients",
                              "guidedbackprop"),
    *,
    layer: Optional[LayerSpec | Sequence[LayerSpec]] = None,
    target: Target = None,
    method_options: Optional[Mapping[str, Any]] = None,
    **figure_options: Unpack[FigureOptions],
) -> tuple[Figure, list[Explanation]]:
    """Explain ``images`` with each registered method by name and lay them out with ``figure``.

    layer: the CAM methods' layer (None: chosen automatically). method_options: keyword
    arguments for every method (e.g. ``preprocess``, ``class_names``).
    Returns the figure and the explanations.
    """
    from .methods import get_method

    explanations: list[Explanation] = []
    for name in methods:
        cls = get_method(name)
        make: Callable[..., Explainer] = cls  # constructors differ: CAM methods take the layer after the model
        options = dict(method_options or {})
        explainer = make(model, layer, **options) if cls.needs_layer else make(model, **options)
        explanations.append(explainer.explain(images, target=target))
    return figure(explanations, **figure_options), explanations
