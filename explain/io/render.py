"""Rendering shared by every method: colour maps, overlays on images, figures.

All functions take maps in [0, 1] (tensors or ndarrays, any leading batch
dimensions) and RGB images, (H, W, 3) or (N, H, W, 3), uint8 or float in
[0, 1]; they return RGB. Maps are resized to the image they are drawn on.
"""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypedDict, Union

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import ImageFont
from torch import Tensor

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


def image_as_float(images: ArrayLike) -> Tensor:
    """RGB images, uint8 (0-255) or float (0-1), → float tensor in [0, 1] of the same shape. Other integer
    types and floats outside [0, 1] are refused: their scale is not known."""
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
    if tuple(tensor.shape[-2:]) == tuple(size):
        return tensor
    leading = tensor.shape[:-2]
    flat = tensor.reshape(-1, 1, *tensor.shape[-2:])
    resized = F.interpolate(flat, size=size, mode="bilinear", align_corners=False)
    return resized.reshape(*leading, *size)


def colormap_table(cmap: str = "jet") -> Tensor:
    """The 256 RGB colours of a matplotlib colour map, (256, 3) float in [0, 1]."""
    colours = matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, 256))[:, :3]
    return torch.as_tensor(colours, dtype=torch.float32)


def colorize(maps: ArrayLike, cmap: str = "jet") -> Tensor:
    """Maps (..., H, W) in [0, 1] → RGB (..., H, W, 3) float in [0, 1] through a colour map.

    A value v takes the colour map's entry round(v * 255); values outside [0, 1] are clipped; uint8 maps are
    read as 0-255.
    """
    values = map_as_float(maps).nan_to_num(0.0).clamp(0.0, 1.0)
    indices = (values * 255.0).round().long()
    return colormap_table(cmap)[indices]


OVERLAY_MODES = ("blend", "alpha", "mask", "contour")
DIVERGING_CMAP = "RdBu_r"


def signed_to_unit(maps: ArrayLike, clip_percentile: float = 99.0) -> Tensor:
    """Signed maps (..., H, W) → [0, 1] with 0 at 0.5, each map scaled by the ``clip_percentile``
    percentile of its |values| and clipped (outliers saturate, as Captum's ``outlier_perc``)."""
    values = _as_float_tensor(maps)
    flat = values.reshape(-1, values.shape[-2] * values.shape[-1]).abs()
    scale = torch.quantile(flat, clip_percentile / 100.0, dim=1).clamp_min(1e-12)
    scaled = (values.reshape(flat.shape) / scale[:, None]).clamp(-1, 1).reshape(values.shape)
    return (scaled + 1) / 2


def as_drawn(maps: ArrayLike, cmap: str) -> tuple[Tensor, str]:
    """(values in [0, 1], colour map) with which one image's maps (any shape) are drawn: maps in [0, 1] as they
    are, with ``cmap``; signed maps (any value below 0: [-1, 1] after the default normalisation) centred, 0 at
    0.5, with the diverging DIVERGING_CMAP, so that negative evidence is not drawn as no evidence. NaN is drawn
    as 0 (no evidence)."""
    values = map_as_float(maps).nan_to_num(0.0)
    if bool((values < 0).any()):
        return (values.clamp(-1, 1) + 1) / 2, DIVERGING_CMAP
    return values, cmap


def overlay_explained(images: ArrayLike, maps: ArrayLike, alpha: float = 0.5, cmap: str = "jet") -> np.ndarray:
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


def overlay_drawn(image: ArrayLike, maps: ArrayLike, alpha: float = 0.5, cmap: str = "jet") -> np.ndarray:
    """``overlay`` of one image's maps (any leading dimensions, e.g. its K targets), drawn as ``as_drawn`` says."""
    values, colours = as_drawn(maps, cmap)
    return overlay(image, values, alpha=alpha, cmap=colours)


def overlay(
    images: ArrayLike,
    maps: ArrayLike,
    alpha: float = 0.5,
    cmap: str = "jet",
    mode: str = "blend",
    keep: float = 0.2,
    levels: Sequence[float] = (0.25, 0.5, 0.75),
) -> np.ndarray:
    """Draw heatmaps on RGB images.

    images: (H, W, 3) or (N, H, W, 3), uint8 or float in [0, 1].
    maps: (h, w), (N, h, w) or (N, K, h, w) in [0, 1]; resized to the images' size.
        With a K dimension each image gets K overlays.
    mode: "blend" ``(1 - alpha) * image + alpha * colour``; "alpha" the same with the opacity
        scaled by the map's value (alpha · m), so irrelevant pixels show the image; "mask" the
        image where the map is in its top ``keep`` share of pixels, dimmed to 15 % elsewhere;
        "contour" the image with the map's iso-lines at ``levels``, coloured by ``cmap``.
    Returns uint8 RGB, shape (..., H, W, 3) following the maps' leading dimensions.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}.")
    if mode not in OVERLAY_MODES:
        raise ValueError(f"mode must be one of {OVERLAY_MODES}; got {mode!r}.")
    image_tensor = image_as_float(images)
    height, width = image_tensor.shape[-3:-1]
    values = resize_maps(maps, (height, width)).nan_to_num(0.0).clamp(0, 1)
    extra_dims = values.dim() + 1 - image_tensor.dim()
    if extra_dims < 0:
        raise ValueError(f"got {tuple(image_tensor.shape)} images for maps of shape {tuple(values.shape)}.")
    if image_tensor.dim() == 4 and values.shape[0] != image_tensor.shape[0]:
        raise ValueError(f"got {image_tensor.shape[0]} images and {values.shape[0]} maps: give one map (or one "
                         "(K, h, w) stack) per image.")
    if image_tensor.dim() == 4 and extra_dims == 1:  # (N, H, W, 3) images with (N, K, H, W) maps
        image_tensor = image_tensor.unsqueeze(1)
    image_tensor = image_tensor.expand(*values.shape, 3)
    if mode in ("blend", "alpha"):
        opacity: Union[float, Tensor] = alpha if mode == "blend" else alpha * values[..., None]
        result = (1.0 - opacity) * image_tensor + opacity * colorize(values, cmap)
    elif mode == "mask":
        flat = values.reshape(-1, height * width)
        threshold = torch.quantile(flat, 1.0 - keep, dim=1).view(*values.shape[:-2], 1, 1)
        result = torch.where((values >= threshold)[..., None], image_tensor, 0.15 * image_tensor)
    else:
        result = _contours(image_tensor, values, levels, cmap)
    return (result * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()


def _contours(images: Tensor, values: Tensor, levels: Sequence[float], cmap: str) -> Tensor:
    """Iso-lines of each map drawn on its image with OpenCV, one colour per level."""
    import cv2

    table = colormap_table(cmap)
    flat_images = (images.reshape(-1, *images.shape[-3:]).numpy() * 255).round().astype(np.uint8).copy()
    flat_values = values.reshape(-1, *values.shape[-2:]).numpy()
    thickness = max(1, round(min(flat_values.shape[-2:]) / 100))
    for canvas, heat in zip(flat_images, flat_values):
        for level in levels:
            contours, _ = cv2.findContours((heat >= level).astype(np.uint8), cv2.RETR_LIST, cv2.CHAIN_APPROX_NONE)
            colour = tuple(int(c) for c in (table[round(level * 255)] * 255).round())
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


def overlay_figure(
    images: Tensor,
    maps: Tensor,
    map_titles: Sequence[Sequence[str]],
    title: str,
    alpha: float = 0.5,
    cmap: str = "jet",
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
    rows = targets_per_image + int(show_original)
    size = (panel_size * count, panel_size * rows + 0.3)
    if figure is None:
        figure = shown_in_notebooks(Figure(figsize=size, layout="constrained"))
    else:
        figure.set_size_inches(*size)
        figure.set_layout_engine("constrained")
    axes = figure.subplots(rows, count, squeeze=False)
    for image_index in range(count):
        if show_original:
            axes[0, image_index].imshow(pictures[image_index], interpolation="nearest")
            heading = image_titles[image_index] if image_titles is not None else f"image {image_index}"
            axes[0, image_index].set_title(heading, fontsize=9, parse_math=False)
        for target_index in range(targets_per_image):
            axis = axes[target_index + int(show_original), image_index]
            axis.imshow(overlays[image_index, target_index], interpolation="nearest")
            axis.set_title(map_titles[image_index][target_index], fontsize=9, parse_math=False)
    for axis in axes.flat:
        axis.set_axis_off()
    if title != "":
        figure.suptitle(title, fontsize=10, parse_math=False)
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


def save_figure(figure: "Figure", path: str, dpi: Optional[int] = 150) -> None:
    """Save a figure; the format follows the file's extension (PNG, JPG, PDF, SVG, ...). Text stays text in
    SVG (searchable, editable), as it does in PDF."""
    savefig_with_svg_text(figure, path, dpi=dpi)


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
