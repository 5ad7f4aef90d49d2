"""Rendering shared by every method: colour maps, overlays on images, figures.

All functions take maps in [0, 1] (tensors or ndarrays, any leading batch
dimensions) and RGB images, (H, W, 3) or (N, H, W, 3), uint8 or float in
[0, 1]; they return RGB. Maps are resized to the image they are drawn on.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypedDict, Union

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFont
from torch import Tensor

from ..core.caller import warn_at_callers_line
from .inputs import outside_unit_range

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ArrayLike = Union[np.ndarray, Tensor]


class PanelOptions(TypedDict, total=False):
    """The layout options of ``Explanation.figure`` and ``show`` (``overlay_figure``'s)."""

    panel_size: float
    show_original: bool
    image_titles: Optional[Sequence[str]]
    map_titles: Optional[Sequence[Sequence[str]]]
    title: Optional[str]


class ExplanationFigureOptions(PanelOptions, total=False):
    """``PanelOptions`` and the figure to draw into."""

    figure: Optional[Figure]


def _as_float_tensor(values: ArrayLike) -> Tensor:
    if isinstance(values, Tensor) and values.device.type == "meta":
        raise ValueError("got a tensor on the meta device: it holds no values to draw. Compute it on a real device "
                         "(the CPU or a GPU).")
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.float32)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: read-only arrays (of PIL images) too


def _is_uint8(values: ArrayLike) -> bool:
    return (isinstance(values, np.ndarray) and values.dtype == np.uint8) or (
        isinstance(values, Tensor) and values.dtype == torch.uint8)


def _is_float_or_uint8(values: ArrayLike) -> bool:
    if isinstance(values, Tensor):
        return values.is_floating_point() or values.dtype == torch.uint8
    array = np.asarray(values)
    return array.dtype == np.uint8 or np.issubdtype(array.dtype, np.floating)


def image_as_float(images: Union[ArrayLike, Image.Image]) -> Tensor:
    """RGB images, uint8 (0-255) or float (0-1), or an RGB PIL image, → float tensor in [0, 1] of the same shape.
    Other integer types and floats outside [0, 1] are refused: their scale is not known."""
    if isinstance(images, Image.Image):
        images = np.asarray(images)  # uint8 for RGB; other modes are refused below by their shape or dtype
    if not _is_float_or_uint8(images):
        dtype = images.dtype if isinstance(images, Tensor) else np.asarray(images).dtype
        raise ValueError(f"images must be uint8 (0-255) or float in [0, 1]; got {dtype} values. Convert "
                         "them, e.g. images.astype(np.uint8) for 0-255 values.")
    tensor = _as_float_tensor(images)
    if _is_uint8(images):
        tensor = tensor / 255.0
    elif outside_unit_range(tensor):
        raise ValueError(f"float images must lie in [0, 1]; these span [{float(tensor.min()):.4g}, "
                         f"{float(tensor.max()):.4g}]. Divide 0-255 values by 255.")
    if tensor.shape[-1] != 3:
        raise ValueError(f"images must be RGB, (..., H, W, 3); got shape {tuple(tensor.shape)}.")
    return tensor.clamp(0.0, 1.0)


def as_uint8(images: ArrayLike) -> np.ndarray:
    """RGB images, uint8 or float in [0, 1], → a uint8 ndarray of the same shape."""
    return (image_as_float(images).numpy() * 255).round().astype(np.uint8)


def map_as_float(maps: ArrayLike) -> Tensor:
    """Maps as a float tensor (CPU): uint8 maps (a heatmap read from an image file) are read as 0-255."""
    tensor = _as_float_tensor(maps)
    return tensor / 255.0 if _is_uint8(maps) else tensor


def resize_maps(maps: ArrayLike, size: tuple[int, int]) -> Tensor:
    """Maps (..., h, w) → (..., H, W) by bilinear interpolation (float tensor, CPU; uint8 maps read as 0-255)."""
    tensor = map_as_float(maps)
    if tensor.dim() < 2 or tensor.shape[-2] < 1 or tensor.shape[-1] < 1:
        raise ValueError(f"maps must be (h, w), (N, h, w) or (N, K, h, w) with at least one pixel; got shape "
                         f"{tuple(tensor.shape)}.")
    if tuple(tensor.shape[-2:]) == tuple(size):
        return tensor
    leading = tensor.shape[:-2]
    flat = tensor.reshape(-1, 1, *tensor.shape[-2:])
    resized = F.interpolate(flat, size=size, mode="bilinear", align_corners=False)
    return resized.reshape(*leading, *size)


ColormapSpec = Union[str, "matplotlib.colors.Colormap"]
"""A colour map: a matplotlib colour map's name ("jet", "magma", ...) or a ``matplotlib.colors.Colormap``."""


def resolved_colormap(cmap: ColormapSpec) -> matplotlib.colors.Colormap:
    """The ``matplotlib.colors.Colormap`` that ``cmap`` (a name or a Colormap) stands for; ValueError for a name
    matplotlib does not know, TypeError for anything else."""
    if isinstance(cmap, matplotlib.colors.Colormap):
        return cmap
    if not isinstance(cmap, str):
        raise TypeError(f"cmap must be a matplotlib colour map's name (such as 'jet' or 'magma') or a "
                        f"matplotlib.colors.Colormap; got {type(cmap).__name__} {cmap!r}.")
    try:
        return matplotlib.colormaps[cmap]
    except KeyError:
        raise ValueError(f"cmap {cmap!r} is not a matplotlib colour map: give one of matplotlib.colormaps' names "
                         "(such as 'jet', 'viridis', 'magma') or a matplotlib.colors.Colormap.") from None


def colormap_table(cmap: ColormapSpec = "jet") -> Tensor:
    """The 256 RGB colours of a matplotlib colour map (a name or a Colormap), (256, 3) float in [0, 1]."""
    colours = resolved_colormap(cmap)(np.linspace(0.0, 1.0, 256))[:, :3]
    return torch.as_tensor(colours, dtype=torch.float32)


def colour_indices(values: Tensor) -> Tensor:
    """Values in [0, 1] (any shape) → the entries of a 256-colour table they take, int64 in [0, 255]: v takes
    floor(256 · v), 1 takes 255, as matplotlib's colour maps choose (each colour covers an equal 1/256 of [0, 1],
    so a figure drawn with ``plt.imshow(map, cmap=...)`` shows the same colours). Values outside [0, 1] are
    clipped, NaN reads as 0."""
    return (values.nan_to_num(0.0).clamp(0.0, 1.0) * 256.0).floor().clamp(max=255.0).long()


def colour_table_uint8(cmap: ColormapSpec = "jet") -> np.ndarray:
    """``colormap_table(cmap)`` as uint8, (256, 3), read-only: a map's uint8 RGB pixels are
    ``colour_table_uint8(cmap)[colour_indices(values).numpy()]`` (``colorize``'s colours, rounded). Built once per
    colour map name."""
    if isinstance(cmap, str):
        return _named_colour_table_uint8(cmap)
    return _frozen_uint8_table(cmap)


@functools.lru_cache(maxsize=16)
def _named_colour_table_uint8(cmap: str) -> np.ndarray:
    return _frozen_uint8_table(cmap)


def _frozen_uint8_table(cmap: ColormapSpec) -> np.ndarray:
    table = (colormap_table(cmap) * 255.0).round().to(torch.uint8).numpy()
    table.flags.writeable = False  # shared by every caller (cached)
    return table


def colorize(maps: ArrayLike, cmap: ColormapSpec = "jet") -> Tensor:
    """Maps (..., H, W) in [0, 1] → RGB (..., H, W, 3) float in [0, 1] through a colour map.

    A value v takes the colour map's entry ``colour_indices(v)`` (matplotlib's choice); values outside [0, 1] are
    clipped; uint8 maps are read as 0-255.
    """
    return colormap_table(cmap)[colour_indices(map_as_float(maps))]


OVERLAY_MODES = ("blend", "alpha", "mask", "contour")
DIVERGING_CMAP = "RdBu_r"


def signed_to_unit(maps: ArrayLike, clip_percentile: float = 99.0) -> Tensor:
    """Signed maps (..., H, W) → [0, 1] with 0 at 0.5, each map scaled by the ``clip_percentile``
    percentile of its finite |values| and clipped (outliers saturate, as Captum's ``outlier_perc``). NaN pixels
    are drawn at 0.5 (no evidence), as ``as_drawn`` draws them, and ±inf at 1 and 0 (the strongest evidence);
    neither is counted in the percentile (a map with many ±inf pixels took an infinite or NaN scale)."""
    values = _as_float_tensor(maps)
    flat = values.reshape(-1, values.shape[-2] * values.shape[-1]).abs()
    finite = torch.where(flat.isfinite(), flat, float("nan"))
    scale = torch.nanquantile(finite, clip_percentile / 100.0, dim=1).nan_to_num(0.0)
    scale = torch.where(scale > 0, scale, 1.0)  # however small a map's values (1e-13 gradients), never a floor
    scaled = (values.reshape(flat.shape) / scale[:, None]).nan_to_num(0.0).clamp(-1, 1).reshape(values.shape)
    return (scaled + 1) / 2


def as_drawn(maps: ArrayLike, cmap: ColormapSpec) -> tuple[Tensor, ColormapSpec]:
    """(values in [0, 1], colour map) with which one image's maps (any shape) are drawn: maps in [0, 1] as they
    are, with ``cmap``; signed maps (any value below 0: [-1, 1] after the default normalisation) centred, 0 at
    0.5, with the diverging DIVERGING_CMAP, so that negative evidence is not drawn as no evidence. NaN is drawn
    as 0 (no evidence)."""
    values = map_as_float(maps).nan_to_num(0.0)
    if bool((values < 0).any()):
        return (values.clamp(-1, 1) + 1) / 2, DIVERGING_CMAP
    return values, cmap


def overlay_explained(images: ArrayLike, maps: ArrayLike, alpha: float = 0.5, cmap: ColormapSpec = "jet") -> np.ndarray:
    """``overlay`` of an explanation's maps, (N, H, W) or (N, K, H, W), on its (N, H, W, 3) images, each image's
    maps drawn as ``as_drawn`` decides for that image alone (an image's drawing never depends on the others of
    its batch). Returns uint8 (N, H, W, 3) or (N, K, H, W, 3)."""
    pictures = [overlay_drawn(image, image_maps, alpha, cmap) for image, image_maps in zip(images, maps)]
    if not pictures:
        raise ValueError("there is no image to draw.")
    return np.stack(pictures)


BOX_COLOUR = (255, 255, 255)
"""The outline of an explained instance's box drawn over its map (and on the image, with its label)."""


def draw_boxes(pictures: np.ndarray, boxes: ArrayLike, labels: Optional[Sequence[str]] = None) -> np.ndarray:
    """``pictures`` (H, W, 3) uint8 with each box of ``boxes`` (B, 4) x0, y0, x1, y1 in the picture's pixels outlined
    (1 px, white on a dark edge); a box with a NaN coordinate is skipped. labels: one text per box, written above
    it. Returns a new array."""
    import cv2

    drawn = np.ascontiguousarray(pictures.copy())
    values = torch.as_tensor(boxes).detach().float().cpu().reshape(-1, 4)
    for index, box in enumerate(values):
        if bool(box.isnan().any()):
            continue
        x0, y0, x1, y1 = (int(round(float(value))) for value in box)
        cv2.rectangle(drawn, (x0, y0), (x1 - 1, y1 - 1), (0, 0, 0), 3)
        cv2.rectangle(drawn, (x0, y0), (x1 - 1, y1 - 1), BOX_COLOUR, 1)
        if labels is not None and labels[index]:
            cv2.putText(drawn, labels[index], (x0 + 1, max(y0 - 3, 8)), cv2.FONT_HERSHEY_PLAIN, 0.7, BOX_COLOUR, 1,
                        cv2.LINE_AA)
    return drawn


def overlay_drawn(image: ArrayLike, maps: ArrayLike, alpha: float = 0.5, cmap: ColormapSpec = "jet") -> np.ndarray:
    """``overlay`` of one image's maps (any leading dimensions, e.g. its K targets), drawn as ``as_drawn`` says."""
    values, colours = as_drawn(maps, cmap)
    return overlay(image, values, alpha=alpha, cmap=colours)


def overlay(
    images: ArrayLike,
    maps: ArrayLike,
    alpha: float = 0.5,
    cmap: ColormapSpec = "jet",
    mode: str = "blend",
    keep: float = 0.2,
    levels: Sequence[float] = (0.25, 0.5, 0.75),
    signed: bool = False,
) -> np.ndarray:
    """Draw heatmaps on RGB images.

    images: (H, W, 3) or (N, H, W, 3), uint8 or float in [0, 1] (or an RGB PIL image).
    maps: (h, w), (N, h, w) or (N, K, h, w) in [0, 1]; resized to the images' size (bilinear, whatever their
        aspect ratio). With a K dimension each image gets K overlays. Values outside [0, 1] are clipped, with a
        warning (scale them first); NaN is drawn as 0.
    mode: "blend" ``(1 - alpha) * image + alpha * colour``; "alpha" the same with the opacity
        scaled by the map's value (alpha · m), so irrelevant pixels show the image; "mask" the
        image where the map is in its top ``keep`` share of pixels and above 0 (an all-zero map
        keeps nothing; ties at the threshold are all kept), dimmed to 15 % elsewhere;
        "contour" the image with the map's iso-lines at ``levels``, coloured by ``cmap``.
    signed: the maps are signed maps drawn centred (``signed_to_unit``: 0.5 is no evidence, 0 and 1 the
        strongest evidence against and for): "alpha" then scales the opacity by |2m − 1|, so evidence against
        is drawn as strongly as evidence for and 0.5 shows the image; "mask" keeps the top ``keep`` share of
        the evidence for (m > 0.5); "contour" draws each level on both signs, where the evidence for reaches it
        (2m − 1 = level) and where the evidence against does (1 − 2m = level), each line in ``cmap``'s colour
        there (a diverging map's negative colour for evidence against).
    Returns uint8 RGB, shape (..., H, W, 3) following the maps' leading dimensions.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}.")
    if mode not in OVERLAY_MODES:
        raise ValueError(f"mode must be one of {OVERLAY_MODES}; got {mode!r}.")
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep is the share of pixels that mode='mask' keeps, in [0, 1] (0.2: the top 20 %); "
                         f"got {keep}.")
    if any(not 0.0 <= float(level) <= 1.0 for level in levels):
        raise ValueError(f"levels are map values in [0, 1] at which mode='contour' draws iso-lines; got "
                         f"{list(levels)}.")
    image_tensor = image_as_float(images)
    height, width = image_tensor.shape[-3:-1]
    values = resize_maps(maps, (height, width))
    if outside_unit_range(values):
        warn_at_callers_line(f"overlay draws maps in [0, 1]; these span [{float(values.min()):.4g}, "
                             f"{float(values.max()):.4g}] and are clipped (all above 1 one colour, all below 0 "
                             "another). Scale them first: maps / maps.max() for positive maps, "
                             "render.signed_to_unit(maps) with signed=True for signed ones.")
    values = values.nan_to_num(0.0).clamp(0, 1)
    extra_dims = values.dim() + 1 - image_tensor.dim()
    if extra_dims < 0:
        raise ValueError(f"got {tuple(image_tensor.shape)} images for maps of shape {tuple(values.shape)}.")
    if image_tensor.dim() == 4 and values.shape[0] != image_tensor.shape[0]:
        raise ValueError(f"got {image_tensor.shape[0]} images and {values.shape[0]} maps: give one map (or one "
                         "(K, h, w) stack) per image.")
    if image_tensor.dim() == 4 and extra_dims == 1:  # (N, H, W, 3) images with (N, K, H, W) maps
        image_tensor = image_tensor.unsqueeze(1)
    image_tensor = image_tensor.expand(*values.shape, 3)
    strength = (2 * values - 1).abs() if signed else values  # how much evidence a pixel holds, 0 to 1
    if mode in ("blend", "alpha"):
        opacity: Union[float, Tensor] = alpha if mode == "blend" else alpha * strength[..., None]
        result = (1.0 - opacity) * image_tensor + opacity * colorize(values, cmap)
    elif mode == "mask":
        evidence_for = (2 * values - 1).clamp_min(0) if signed else values
        flat = evidence_for.reshape(-1, height * width)
        threshold = torch.quantile(flat, 1.0 - keep, dim=1).view(*values.shape[:-2], 1, 1)
        kept = (evidence_for >= threshold) & (evidence_for > 0)  # no evidence is never shown as relevant
        result = torch.where(kept[..., None], image_tensor, 0.15 * image_tensor)
    else:
        result = _contours(image_tensor, values, _contour_levels(levels, signed), cmap)
    return (result * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()


def _contour_levels(levels: Sequence[float], signed: bool) -> list[tuple[float, bool]]:
    """The iso-lines to draw, (map value, whether the line bounds the values above it): ``levels`` as they are, or
    for signed maps (0.5 no evidence) each level of evidence on both signs, 0.5 ± level / 2."""
    if not signed:
        return [(float(level), True) for level in levels]
    lines = [(0.5 + float(level) / 2, True) for level in levels]
    return lines + [(0.5 - float(level) / 2, False) for level in levels]


def _contours(images: Tensor, values: Tensor, levels: Sequence[tuple[float, bool]], cmap: ColormapSpec) -> Tensor:
    """Iso-lines of each map drawn on its image with OpenCV, one colour per level (``_contour_levels``: a line around
    the values at or above its level, or at or below it)."""
    import cv2

    table = colour_table_uint8(cmap)
    flat_images = (images.reshape(-1, *images.shape[-3:]).numpy() * 255).round().astype(np.uint8).copy()
    flat_values = values.reshape(-1, *values.shape[-2:]).numpy()
    thickness = max(1, round(min(flat_values.shape[-2:]) / 100))
    for canvas, heat in zip(flat_images, flat_values):
        for level, above in levels:
            region = heat >= level if above else heat <= level
            contours, _ = cv2.findContours(region.astype(np.uint8), cv2.RETR_LIST, cv2.CHAIN_APPROX_NONE)
            colour = tuple(int(c) for c in table[int(colour_indices(torch.tensor(level)))])
            cv2.drawContours(canvas, contours, -1, colour, thickness)
    return torch.from_numpy(flat_images).float().reshape(images.shape) / 255.0


def tile(images: np.ndarray) -> np.ndarray:
    """(H, W, 3), (N, H, W, 3) or (N, K, H, W, 3) uint8 → one image: images in columns, targets in rows."""
    if images.ndim == 3:
        return images
    if images.ndim == 4:
        return np.concatenate(list(images), axis=1)
    columns = [np.concatenate(list(per_image), axis=0) for per_image in images]
    return np.concatenate(columns, axis=1)


PANEL_INTERPOLATION = "none"
"""How figure panels are drawn (``imshow``'s interpolation): "none" embeds each panel's own pixels once in PDF/SVG/EPS
(exact colours, a file that does not grow with the dpi; SVG marks it to be shown pixelated) and draws them as
nearest-neighbour blocks in PNG, so no colour is drawn that the overlay does not hold (bilinear resampling mixed a
red and a blue pixel into the diverging map's white, "no evidence", and blurred small images)."""

MAX_PANEL_ASPECT = 8.0
"""The flattest (and narrowest) a figure panel is: an image more than 8 times wider than tall (or taller than wide),
such as a 1 × 2000 strip, is stretched to fill a panel of this ratio, else it would be drawn less than a pixel
thick (``panel_inches``, ``panel_aspect``)."""


def panel_inches(height: int, width: int, panel_size: float) -> tuple[float, float]:
    """(width, height) in inches of a figure panel showing an image of ``height`` × ``width`` pixels: its longer
    side ``panel_size`` (a wide image's panel is as wide as a square one's and less tall), a tall image's panel no
    narrower than half of ``panel_size`` (room for its title), so that panels are not mostly blank; a wide panel no
    flatter than 1 : MAX_PANEL_ASPECT."""
    aspect = min(width / max(height, 1), MAX_PANEL_ASPECT)
    if aspect >= 1:
        return panel_size, panel_size / aspect
    return panel_size * max(aspect, 0.5), panel_size


def panel_aspect(height: int, width: int) -> str:
    """``imshow``'s aspect for a panel of an image of ``height`` × ``width`` pixels: "equal" (square pixels), or
    "auto" (the image stretched over its panel) for one flatter or narrower than 1 : MAX_PANEL_ASPECT, which drawn
    with square pixels would be a line too thin to see."""
    ratio = width / max(height, 1)
    return "auto" if not 1 / MAX_PANEL_ASPECT <= ratio <= MAX_PANEL_ASPECT else "equal"


TITLE_LINE_HEIGHT = 1.3
"""The height of a line of a panel's title, in multiples of its font size (with its spacing)."""


def wrap_title(text: str, width_inches: float, fontsize: float) -> str:
    """``text`` broken into lines no wider than ``width_inches`` at ``fontsize`` points (measured with
    matplotlib's DejaVu Sans): at spaces where it can; a word longer than a line ("encoder.layers.block_3.ln_1",
    a long class name without spaces) is cut after a ".", "_", "-", "/" or "," where one falls in the line, else
    where the line is full. So a long class name or layer stays over its own panel instead of running over its
    neighbours and off the figure, every character kept. Lines already in ``text`` are kept."""
    font, _ = _caption_font(100)  # measured at 100 px, scaled to the font size
    room = max(width_inches * 72.0, fontsize) * 100.0 / fontsize

    def fits(line: str) -> bool:
        return font.getlength(line) <= room

    def longest_start(line: str) -> int:
        """How many characters of ``line`` (wider than a line) to keep on this line: up to a separator if one
        falls in what fits, else all that fits (at least one)."""
        end = 1
        while end < len(line) and fits(line[:end + 1]):
            end += 1
        separators = [index + 1 for index in range(end) if line[index] in "._-/,"]
        return separators[-1] if separators and separators[-1] > end // 2 else end

    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if fits(candidate):
                line = candidate
                continue
            if fits(word):
                lines.append(line)
                line = word
                continue
            line = candidate  # a word wider than a line: start it here and cut it where it must be
            while not fits(line):
                cut = longest_start(line)
                lines.append(line[:cut].rstrip())
                line = line[cut:].lstrip()
        lines.append(line)
    return "\n".join(lines)


def title_inches(texts: Sequence[str], fontsize: float) -> float:
    """The height in inches that the tallest of ``texts`` (panel titles of one row) takes, with its padding."""
    lines = max((text.count("\n") + 1 for text in texts if text), default=0)
    return lines * fontsize * TITLE_LINE_HEIGHT / 72.0 + (0.08 if lines else 0.0)


TITLE_SHARE = 0.3
"""The most of a square panel's height that its title may take (``rows_height``); a longer title gets more room."""


def rows_height(panel_height: float, panel_size: float, titled_rows: Sequence[Sequence[str]], fontsize: float) -> float:
    """The height in inches of a figure's rows of panels ``panel_height`` tall, with their titles (one list of texts per
    row) and 0.3 in for the figure's margins. A square panel (``panel_height`` = ``panel_size``) gives up some of its
    height to its title, as constrained layout shrinks it, at most TITLE_SHARE of it (a title of many lines gets the
    rest as room of its own, so the panel is not shrunk to nothing); a flatter panel cannot, so its title's room is
    added, in the share that the panel is flatter than square."""
    flatter = max(0.0, 1.0 - panel_height / panel_size)

    def room(row: Sequence[str]) -> float:
        title = title_inches(row, fontsize)
        return max(title * flatter, title - TITLE_SHARE * panel_height)

    return sum(panel_height + room(row) for row in titled_rows) + 0.3


def overlay_figure(
    images: Tensor,
    maps: Tensor,
    map_titles: Sequence[Sequence[str]],
    title: str,
    alpha: float = 0.5,
    cmap: ColormapSpec = "jet",
    panel_size: float = 2.4,
    show_original: bool = True,
    image_titles: Optional[Sequence[str]] = None,
    figure: Optional["Figure"] = None,
    boxes: Optional[Tensor] = None,
) -> "Figure":
    """A matplotlib figure of maps over their images: one column per image, the image on top and one overlay per
    map under it (what ``Explanation.figure`` draws). boxes: (N, K, 4) the box each map explains (detection):
    outlined on its overlay, and all of an image's boxes, with the map titles, on the image.

    images: (N, H, W, 3) RGB, uint8 or float in [0, 1]; maps: (N, K, H, W) in [0, 1] (or signed, drawn on the
    diverging colour map). map_titles: one list per image of one text per map; title: the figure's title ("" for
    none); image_titles: one per image (default "image i"). Draws into ``figure`` when given (e.g. one made by
    pyplot), else into a new Figure.
    """
    from matplotlib.figure import Figure

    if isinstance(panel_size, bool) or not isinstance(panel_size, (int, float)) or not 0 < panel_size < float("inf"):
        raise ValueError(f"panel_size must be a positive number of inches, e.g. 2.4; got {panel_size!r}.")
    if figure is not None and figure.axes:
        raise ValueError("the figure given already holds axes (a drawing): give an empty one, e.g. plt.figure(), or "
                         "call figure.clear() first.")
    count, targets_per_image = maps.shape[:2]
    if count == 0:
        raise ValueError("this explanation holds no image (an empty selection): there is nothing to draw.")
    if image_titles is not None and len(image_titles) != count:
        raise ValueError(f"image_titles holds {len(image_titles)} title(s) for {count} image(s): give one per image.")
    if len(map_titles) != count or any(isinstance(texts, str) or len(texts) != targets_per_image
                                       for texts in map_titles):
        raise ValueError(f"map_titles takes one list per image ({count}) of one text per target "
                         f"({targets_per_image}).")
    overlays = overlay_explained(images, maps, alpha=alpha, cmap=cmap)  # (N, K, H, W, 3)
    pictures = [np.asarray(image) for image in images]
    if boxes is not None:
        overlays = np.stack([np.stack([draw_boxes(overlays[image, target], boxes[image, target])
                                       for target in range(targets_per_image)]) for image in range(count)])
        pictures = [draw_boxes(as_uint8(images[image]), boxes[image], [str(index) for index in range(
            targets_per_image)]) for image in range(count)]
    panel_width, panel_height = panel_inches(overlays.shape[-3], overlays.shape[-2], panel_size)
    fontsize = 9.0
    # the panels' titles, one list per row, wrapped to the panel's width (a long class name stays over its panel)
    titled_rows = ([[image_titles[index] if image_titles is not None else f"image {index}" for index in range(count)]]
                   if show_original else [])
    titled_rows += [[map_titles[index][target] for index in range(count)] for target in range(targets_per_image)]
    titled_rows = [[wrap_title(str(text), panel_width, fontsize) for text in row] for row in titled_rows]
    heading = wrap_title(title, panel_width * count, 10.0) if title != "" else ""
    heading_room = max(0.0, title_inches([heading], 10.0) - title_inches(["one line"], 10.0))  # lines 2, 3, ...
    size = (panel_width * count, rows_height(panel_height, panel_size, titled_rows, fontsize) + heading_room)
    if figure is None:
        figure = shown_in_notebooks(Figure(figsize=size, layout="constrained"))
    else:
        figure.set_size_inches(*size)
        figure.set_layout_engine("constrained")
    axes = figure.subplots(len(titled_rows), count, squeeze=False)
    aspect = panel_aspect(overlays.shape[-3], overlays.shape[-2])
    for image_index in range(count):
        if show_original:
            axes[0, image_index].imshow(pictures[image_index], interpolation=PANEL_INTERPOLATION, aspect=aspect)
        for target_index in range(targets_per_image):
            axis = axes[target_index + int(show_original), image_index]
            axis.imshow(overlays[image_index, target_index], interpolation=PANEL_INTERPOLATION,
                        aspect=aspect)
    for row, texts in enumerate(titled_rows):
        for image_index, text in enumerate(texts):
            axes[row, image_index].set_title(text, fontsize=fontsize, parse_math=False)
    for axis in axes.flat:
        axis.set_axis_off()
    if heading:
        figure.suptitle(heading, fontsize=10, parse_math=False)
    return figure


def figure_png(figure: "Figure", dpi: float = 100) -> bytes:
    """A figure as PNG bytes, cropped to what is drawn (as a notebook shows figures)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def shown_in_notebooks(figure: "Figure") -> "Figure":
    """``figure`` with a ``_repr_png_``: a Jupyter cell whose result it is shows it, without ``%matplotlib
    inline`` or pyplot (our figures are not pyplot's, so pyplot never shows them a second time). With
    ``%matplotlib inline`` IPython's own formatter for figures draws it instead, once. Its ``savefig``
    keeps text as text in SVG too (matplotlib's default draws SVG glyphs as outlines)."""
    figure._repr_png_ = functools.partial(figure_png, figure)  # type: ignore[attr-defined]
    figure.savefig = functools.partial(savefig_with_svg_text, figure)  # type: ignore[method-assign]
    return figure


def savefig_with_svg_text(figure: "Figure", *arguments: Any, **options: Any) -> Any:
    """``Figure.savefig``, with SVG text written as text."""
    from matplotlib.figure import Figure

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        return Figure.savefig(figure, *arguments, **options)


def save_figure(figure: "Figure", path: str, dpi: Optional[float] = 150) -> None:
    """Save a figure; the format follows the file's extension (PNG, JPG, PDF, SVG, ...). Text stays text in
    SVG (searchable, editable), as it does in PDF. A folder that does not exist and a dpi that is not a
    positive number are errors that say so (before anything is drawn)."""
    path = str(Path(path).expanduser())
    check_writable(Path(path), dpi)
    savefig_with_svg_text(figure, path, dpi=dpi)


def check_writable(path: Path, dpi: Optional[float]) -> None:
    """Refuse, with the fix, a file whose folder does not exist (FileNotFoundError) and a ``dpi`` that is not a
    positive number (ValueError; None is matplotlib's default)."""
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot write {path.name!r}: the folder {str(folder)!r} does not exist. Create it "
                                f"first (Path({str(folder)!r}).mkdir(parents=True)) or save elsewhere.")
    if dpi is not None and (isinstance(dpi, bool) or not isinstance(dpi, (int, float)) or not dpi > 0
                            or not np.isfinite(dpi)):
        raise ValueError(f"dpi must be a positive number of dots per inch, e.g. 300; got {dpi!r}.")


def non_interactive_backend() -> Optional[str]:
    """The name of pyplot's backend when it cannot show figures (Agg, PDF, SVG, ...: scripts without a display),
    else None (a window toolkit, or a notebook's inline backend)."""
    backend = matplotlib.get_backend()
    try:
        from matplotlib.backends import BackendFilter, backend_registry

        non_interactive = set(backend_registry.list_builtin(BackendFilter.NON_INTERACTIVE))
    except ImportError:  # matplotlib < 3.9
        from matplotlib import rcsetup

        non_interactive = {name.lower() for name in getattr(rcsetup, "non_interactive_bk", ())}
    return backend if backend.lower() in non_interactive else None


def label_text(class_index: Optional[int], class_names: Optional[Sequence[str]]) -> str:
    """'name (index)' when class names are known, 'class index' otherwise."""
    if class_index is None:
        return "target"
    if class_names is not None and 0 <= class_index < len(class_names):
        return f"{class_names[class_index]} ({class_index})"
    return f"class {class_index}"


def captioned_panels(panels: np.ndarray, captions: Sequence[Sequence[str]], min_width: int = 192) -> np.ndarray:
    """K panels side by side, each under its caption (a few short lines: class, score, method).

    panels: (K, H, W, 3) uint8 RGB overlays; captions: K lists of lines, one list per panel.
    A panel narrower than ``min_width`` pixels is enlarged by a whole factor s (nearest neighbour,
    each pixel an s × s block) so that its caption can be read; text too long for a panel is cut
    with "…". Returns (B + s·H, K·s·W, 3) uint8: a dark band of B pixels holding the captions in
    white, then the panels.
    """
    from PIL import Image, ImageDraw

    if panels.ndim != 4 or panels.shape[-1] != 3 or panels.dtype != np.uint8:
        raise ValueError(f"panels must be (K, H, W, 3) uint8; got {panels.dtype} {tuple(panels.shape)}.")
    if len(captions) != panels.shape[0]:
        raise ValueError(f"{panels.shape[0]} panels need {panels.shape[0]} captions; got {len(captions)}.")
    count, height, width = panels.shape[:3]
    scale = max(1, -(-min_width // width))
    width *= scale
    font_size = int(min(28, max(10, width // 17)))
    font, ellipsis = _caption_font(font_size)
    line_height = round(font_size * 1.25)
    lines = max((len(lines) for lines in captions), default=0)
    margin = max(2, font_size // 4)
    band = lines * line_height + 2 * margin if lines else 0
    canvas = Image.new("RGB", (count * width, band + height * scale), (24, 24, 24))
    draw = ImageDraw.Draw(canvas)
    for index, (panel, panel_lines) in enumerate(zip(panels, captions)):
        left = index * width
        canvas.paste(Image.fromarray(panel.repeat(scale, axis=0).repeat(scale, axis=1)), (left, band))
        for number, line in enumerate(panel_lines):
            text, room = str(line), width - 2 * margin
            if draw.textlength(text, font=font) > room:
                while text and draw.textlength(text + ellipsis, font=font) > room:
                    text = text[:-1]
                text += ellipsis
            draw.text((left + margin, margin + number * line_height), text, fill=(255, 255, 255), font=font)
    return np.asarray(canvas)


@functools.lru_cache(maxsize=8)
def _caption_font(size: int) -> tuple[Union[ImageFont.FreeTypeFont, ImageFont.ImageFont], str]:
    """The captions' font at ``size`` pixels (matplotlib's DejaVu Sans) and its ellipsis; PIL's own
    bitmap font, with "...", where FreeType or the font file is missing."""
    try:
        return ImageFont.truetype(f"{matplotlib.get_data_path()}/fonts/ttf/DejaVuSans.ttf", size), "…"
    except OSError:
        return ImageFont.load_default(), "..."
