"""Figures for papers and notebooks: images in rows, methods in columns (or the reverse).

Every panel is one raster image (embedded once in PDF/SVG), titles and colorbars stay text,
so ``fig.savefig("grid.pdf")`` gives a vector figure with one image per panel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, TypedDict, Union

import numpy as np
import torch
from torch import Tensor

from ..core.caller import warn_at_callers_line
from . import render
from .explanation import Explanation

if TYPE_CHECKING:
    from matplotlib.figure import Figure


NORMALIZATIONS = ("map", "method", "row")
"""``figure``'s ``normalize``: "map" each map to its own largest |value|; "method" each method's maps to
one scale, the largest |value| of that method over the images; "row" the same as "method"."""

PanelTitles = Union[bool, Sequence[Sequence[str]]]
"""``figure``'s ``panel_titles``: True (each map's class and score), False (none), or the texts, one list per
image with one text per method."""


class FigureOptions(TypedDict, total=False):
    """The keyword options of ``figure``, as ``compare`` passes them on."""

    rows: str
    show_image: bool
    cmap: render.ColormapSpec
    alpha: float
    mode: str
    normalize: str
    signed: Optional[bool]
    clip_percentile: float
    colorbar: bool
    panel_size: float
    fontsize: float
    method_titles: Optional[Sequence[str]]
    image_titles: Optional[Sequence[str]]
    panel_titles: PanelTitles
    image_header: str
    colorbar_label: Optional[str]


def _panel_values(explanation: Explanation, image: int, signed: bool, clip_percentile: float,
                  method_scale: Optional[float], drawn: Optional[Tensor]) -> Tensor:
    """One map in [0, 1] for display: signed maps centred at 0.5, others as normalised (``drawn``: the
    explanation's ``drawn_map_grid``, a map that is not normalised scaled to its own maximum); divided by
    ``method_scale`` (the method's largest finite |value| over the images) when given: NaN pixels are then drawn as
    no evidence and ±inf as the strongest, as ``drawn_map_grid`` draws them."""
    raw = explanation.raw_map_grid[image, 0].detach().float().cpu()
    if method_scale is not None:
        raw = torch.where(raw.isfinite(), raw, torch.where(raw.isnan(), 0.0, raw.sign() * method_scale))
    if signed:
        if method_scale is not None:
            return (raw / method_scale).clamp(-1, 1) * 0.5 + 0.5
        return render.signed_to_unit(raw, clip_percentile)
    if method_scale is not None:
        return (raw.clamp_min(0) / method_scale).clamp(0, 1)
    assert drawn is not None, "the drawn maps are given for unsigned maps on their own scale"
    return drawn[image, 0].clamp(0, 1)


def method_scale(explanation: Explanation) -> float:
    """The largest finite |value| of a method's shown maps (each image's first target) over the images (NaN and
    ±inf pixels left out); 1 for all-zero maps."""
    values = explanation.raw_map_grid[:, 0].detach().abs()
    return float(torch.where(values.isfinite(), values, 0.0).max()) or 1.0


def _warn_if_not_finite(explanations: Sequence[Explanation]) -> None:
    """Say, at the caller's line, which explanations' shown maps hold NaN or ±inf pixels, and how they are drawn."""
    for position, explanation in enumerate(explanations, start=1):
        shown = explanation.raw_map_grid[:, 0].detach()
        if not bool(shown.isfinite().all()):
            nans = int(shown.isnan().sum())
            warn_at_callers_line(f"explanation {position} ({explanation.description()}): its maps hold {nans} NaN and "
                                 f"{int((~shown.isfinite()).sum()) - nans} infinite pixel(s), drawn as no evidence "
                                 "(NaN) and as the strongest evidence (±inf).")


def is_signed(explanation: Explanation) -> bool:
    """Whether the maps carry negative evidence (relu=False CAMs, signed attributions)."""
    return bool((explanation.raw_map_grid < 0).any())


def _titles(given: Optional[Sequence[str]], count: int, what: str, per: str) -> Optional[list[str]]:
    """``given`` as a list of ``count`` texts, or a ValueError saying what was expected."""
    if given is None:
        return None
    if isinstance(given, str) or len(given) != count or not all(isinstance(text, str) for text in given):
        shown = repr(given) if isinstance(given, str) else f"{len(given)} item(s)"
        raise ValueError(f"{what} takes one text per {per}, {count} in all; got {shown}.")
    return list(given)


def _panel_titles(given: PanelTitles, count: int, methods: int) -> Optional[list[list[str]]]:
    """``panel_titles`` as texts [image][method]; None for the default (each map's class and score)."""
    if given is True:
        return None
    if given is False:
        return [[""] * methods for _ in range(count)]
    if (isinstance(given, (str, bool)) or len(given) != count
            or any(isinstance(row, str) or len(row) != methods for row in given)):
        raise ValueError(f"panel_titles takes True (each map's class and score), False (none), or one list per "
                         f"image ({count}) holding one text per method ({methods}).")
    return [[str(text) for text in row] for row in given]


def figure(
    explanations: Sequence[Explanation],
    *,
    rows: str = "images",
    show_image: bool = True,
    cmap: render.ColormapSpec = "jet",
    alpha: float = 0.5,
    mode: str = "blend",
    normalize: str = "map",
    signed: Optional[bool] = None,
    clip_percentile: float = 99.0,
    colorbar: bool = False,
    panel_size: float = 1.9,
    fontsize: float = 8.0,
    method_titles: Optional[Sequence[str]] = None,
    image_titles: Optional[Sequence[str]] = None,
    panel_titles: PanelTitles = True,
    image_header: str = "image",
    colorbar_label: Optional[str] = None,
) -> "Figure":
    """A grid of the explanations of the same images by several methods.

    explanations: one Explanation per method, all of the same N images (the first target of
        each image is shown). rows: "images" (images in rows, methods in columns) or "methods".
    show_image: a column (or row) with the original images. mode / alpha / cmap: see
        ``render.overlay``; colour-blind-safe maps such as "viridis" or "cividis" work as well.
    normalize: "map" (each map to its own maximum) or "method" (each method's maps share one scale,
        that method's largest |value| over the images, so the images can be compared under each method;
        "row" is another name for it). Maps of different methods are never put on one scale: their
        values are in different units (activations × gradients, gradients, logit shares), so one
        method's would blank the others. signed: draw maps with negative values in a diverging
        colour map centred on zero ("RdBu_r"), clipping |values| at ``clip_percentile``; None
        decides per explanation. colorbar: one shared colorbar, labelled (``colorbar_label``: its label
        instead of "relevance (normalised)" / "signed relevance (scaled)").
    Titles, for a paper: method_titles: one per explanation, instead of its description ("GradCAM @ layer4"),
        heading its column (its row with rows="methods"). image_titles: one per image, labelling its row (heading
        its column with rows="methods"). panel_titles: True (each map's class and score, "disc (0): 4.2"), False
        (none), or one list per image of one text per method. image_header: the heading of the images' own column
        (row), "image" by default.
    Returns a matplotlib Figure (save it to PNG at any dpi, or to PDF/SVG: each panel one image, the
    titles text); a notebook cell whose result it is shows it, no ``%matplotlib inline`` needed.
    """
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    if isinstance(explanations, Explanation):
        raise TypeError("figure takes a list of explanations, one per method, of the same images: give "
                        "figure([e]) for one method, or e.figure() for its images with each target's map.")
    if not explanations:
        raise ValueError("figure needs at least one explanation.")
    if rows not in ("images", "methods"):
        raise ValueError(f"rows must be 'images' or 'methods'; got {rows!r}.")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
    if not (isinstance(clip_percentile, (int, float)) and 0 < clip_percentile <= 100):
        raise ValueError(f"clip_percentile must lie in (0, 100] (99: the largest 1 % of |values| saturate); "
                         f"got {clip_percentile!r}.")
    for name, value in (("panel_size", panel_size), ("fontsize", fontsize)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number (inches for panel_size, points for fontsize); "
                             f"got {value!r}.")
    count = len(explanations[0])
    if any(len(explanation) != count for explanation in explanations):
        raise ValueError("all explanations must be of the same images (the same N).")
    if count == 0:
        raise ValueError("the explanations hold no image: nothing to draw.")
    headers = _titles(method_titles, len(explanations), "method_titles", "explanation (method)")
    row_titles = _titles(image_titles, count, "image_titles", "image")
    texts = _panel_titles(panel_titles, count, len(explanations))
    images = explanations[0].images
    for position, explanation in enumerate(explanations[1:], start=2):
        if explanation.images.shape != images.shape or not torch.allclose(explanation.images, images, atol=1 / 255):
            sizes = (f"{tuple(explanation.images.shape[1:3])} display images against the first's "
                     f"{tuple(images.shape[1:3])}" if explanation.images.shape != images.shape else "other pixels")
            raise ValueError(f"explanation {position} is of other images than the first ({sizes}): figure lays out the "
                             "explanations of the same images by several methods. Explain the same inputs with each "
                             "method, with one preprocess (the same size) for all.")
    if headers is None:  # long layer names go on their own line, so headers never overlap
        headers = [explanation.description() for explanation in explanations]
        headers = [header.replace(" @ ", "\n@ ") if len(header) > 22 else header for header in headers]
    for position, explanation in enumerate(explanations, start=1):
        if "meta" in (explanation.map_grid.device.type, explanation.raw_map_grid.device.type):
            raise ValueError(f"explanation {position}'s maps are on the meta device: they hold no values to draw. "
                             "Explain on a real device (the CPU or a GPU).")
    _warn_if_not_finite(explanations)
    signs = [is_signed(e) if signed is None else signed for e in explanations]
    columns = len(explanations) + int(show_image)
    grid_shape = (count, columns) if rows == "images" else (columns, count)
    panel_width, panel_height = render.panel_inches(images.shape[1], images.shape[2], panel_size)
    scales = [method_scale(e) if normalize in ("method", "row") else None for e in explanations]
    unsigned_maps = [e.drawn_map_grid(warn=False) if not sign and scale is None else None
                     for e, sign, scale in zip(explanations, signs, scales)]
    # every panel as (row, column, picture, title above it), then the labels left of the first column
    placed: list[tuple[int, int, np.ndarray, str]] = []
    labels: dict[int, str] = {}
    for image in range(count):
        panels: list[tuple[str, np.ndarray, str]] = []
        if show_image:
            panels.append((image_header, (images[image].numpy() * 255).round().astype("uint8"), ""))
        for number, (explanation, signed_map, scale, own_scale) in enumerate(
                zip(explanations, signs, scales, unsigned_maps)):
            values = _panel_values(explanation, image, signed_map, clip_percentile, scale, own_scale)
            panel_cmap = render.DIVERGING_CMAP if signed_map else cmap
            drawn = render.overlay(images[image], values, alpha=alpha, cmap=panel_cmap, mode=mode, signed=signed_map)
            panels.append((headers[number], drawn, explanation.title(image) if texts is None else texts[image][number]))
        for position, (header, picture, subtitle) in enumerate(panels):
            # the text above a panel: its column's heading (first row only) and its own title
            heading = (header if image == 0 else "") if rows == "images" else (
                row_titles[image] if row_titles is not None and position == 0 else "")
            title = "\n".join(render.wrap_title(text, panel_width, fontsize) for text in (heading, subtitle) if text)
            placed.append((image, position, picture, title) if rows == "images" else (position, image, picture, title))
            if rows == "images" and position == 0 and row_titles is not None:
                labels[image] = row_titles[image]
            if rows == "methods" and image == 0:
                labels[position] = header
    labels = {row: render.wrap_title(text, panel_height, fontsize) for row, text in labels.items()}
    titled_rows = [[title for row, _, _, title in placed if row == grid_row] for grid_row in range(grid_shape[0])]
    fig = render.shown_in_notebooks(Figure(
        figsize=(panel_width * grid_shape[1] + (0.8 if colorbar else 0) + (0.3 if row_titles and rows == "images"
                                                                            else 0),
                 render.rows_height(panel_height, panel_size, titled_rows, fontsize)),
        layout="constrained"))
    axes = fig.subplots(*grid_shape, squeeze=False)
    aspect = render.panel_aspect(images.shape[1], images.shape[2])
    for grid_row, grid_column, picture, title in placed:
        axis = axes[grid_row, grid_column]
        axis.imshow(picture, interpolation=render.PANEL_INTERPOLATION, aspect=aspect)
        axis.set_xticks([])
        axis.set_yticks([])
        if title:
            axis.set_title(title, fontsize=fontsize, parse_math=False)
    for grid_row, label in labels.items():
        axes[grid_row, 0].set_ylabel(label, fontsize=fontsize, parse_math=False)
    if colorbar:  # one per colour map in use: the unsigned maps' (0 to 1), the signed maps' (-1 to 1)
        import matplotlib

        scales_drawn = [(0, cmap, "relevance (normalised)")] if not all(signs) else []
        if any(signs):
            scales_drawn.append((-1, render.DIVERGING_CMAP, "signed relevance (scaled)"))
        for low, bar_cmap, label in scales_drawn:
            scalar = matplotlib.cm.ScalarMappable(norm=Normalize(low, 1), cmap=bar_cmap)
            bar = fig.colorbar(scalar, ax=axes, shrink=0.8 / len(scales_drawn))
            bar.set_label(label if colorbar_label is None else colorbar_label, fontsize=fontsize, parse_math=False)
            bar.ax.tick_params(labelsize=fontsize)
    return fig
