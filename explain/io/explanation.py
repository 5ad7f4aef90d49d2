"""The result of every method: maps, targets, scores and display images; show and save."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from . import render
from .inputs import DisplayImages

if TYPE_CHECKING:
    from matplotlib.figure import Figure

VECTOR_FORMATS = {".pdf", ".svg", ".eps", ".ps"}

NORMALISED_TOLERANCE = 1e-3
"""How far a normalised map's largest |value| may be from 1 (``Explanation.drawn_map_grid``)."""

Diagnostic = Union[Tensor, list[str]]
"""One of ``Explanation.diagnostics``: a tensor, (N, ...) with a figure per image (and target) or 0-d (a count),
or names (the attention blocks an attention method rolled out, the layers LRP traced)."""

ImageIndex = Union[int, slice, Sequence[int], Tensor, np.ndarray]
"""Which images ``e[index]`` keeps: an int, a slice, a sequence of ints, or a bool mask of length N."""


NOTEBOOK_PANELS = 24
"""At most this many panels (images and their overlays) in an explanation's notebook figure (``_repr_html_``)."""
NOTEBOOK_TARGETS = 8
"""At most this many targets per image in the notebook figure."""
NOTEBOOK_ROWS = 100
"""At most this many rows (image, target) in the notebook table."""

LOSSY_FORMATS = ("JPEG", "MPO")
"""Raster formats known to be lossy, written without a check; every other format's file is read back and
compared with the overlays (GIF keeps 256 colours, ICO shrinks to icon sizes: those warn)."""


def _warn_if_altered(picture: Image.Image, written: bytes, name: str, file_format: str) -> None:
    """Warn where the file written for ``picture`` does not read back as the same RGB pixels."""
    try:
        with Image.open(io.BytesIO(written)) as stored:
            read_back = np.asarray(stored.convert("RGB"))
    except (OSError, ValueError):  # a format Pillow writes but cannot read back: nothing to compare
        return
    expected = np.asarray(picture.convert("RGB"))
    if read_back.shape != expected.shape:
        change = f"it holds {read_back.shape[1]}×{read_back.shape[0]} pixels, not the overlays' " \
                 f"{expected.shape[1]}×{expected.shape[0]}"
    else:
        difference = int(np.abs(read_back.astype(np.int16) - expected.astype(np.int16)).max())
        if difference == 0:
            return
        colours = len(np.unique(expected.reshape(-1, 3), axis=0))
        change = f"its colours differ from the overlays' by up to {difference}/255 ({colours} colours reduced " \
                 f"to what {file_format} keeps)"
    warn_at_callers_line(f"{name!r} is not the exact overlay: {change}. Save as .png (or .webp, .tif) for the "
                         "exact pixels.")


@dataclass(eq=False)  # compared by identity: field-wise == of tensors has no single truth value
class Explanation:
    """Heatmaps for N images × K targets. ``len(e)`` is N; ``e[i]``, ``e[i:j]``, ``e[[i, j]]`` are the
    explanations of some of the images (an Explanation of 1, j − i, 2 images), and ``for one in e`` goes
    image by image; every per-image field follows.

    map_grid: (N, K, H, W) float maps at the input's resolution, on the model's
        device; in [0, 1] with the default normalisation ([-1, 1] for signed maps).
    raw_map_grid: (N, K, H, W), the same maps before normalisation.
    scores: (N, K) the model's output for each explained target (e.g. the class logit).
    class_indices: (N, K) long class indices, or None for callable targets.
    display: the display images, made when first used (``images``).
    method: the method's name; layer: the layer(s) explained, or None.
    keep_target_dim: whether ``maps`` keeps the K dimension.
    low_res_maps: per layer, (N, K, h, w) maps at the layer's resolution before
        upsampling and normalisation (CAM methods), else None.
    probabilities: (N, K) probability of each explained class (the softmax over the classes; the sigmoid of a
        one-logit model's output), None for callable targets.
    probability_function: how ``probabilities`` came from the class scores: "softmax" (over the classes; a one-logit
        model's sigmoid) or "sigmoid" (each class's own, the explainer's ``probabilities="sigmoid"``: multi-label).
    attributions: (N, K, C, H, W) signed per-channel attributions at the input, before the
        channels are reduced to one map (gradient and guided methods), else None.
    diagnostics: method-specific figures, e.g. "completeness_error" (N, K) for Integrated Gradients
        (tensors; a few are lists of names, e.g. the "attention_blocks" of attention methods).
    boxes: (N, K, 4) for detection explanations (``instances=``): the box of each explained instance, x0, y0, x1,
        y1 in the input's pixels, NaN where an image has fewer instances than K; drawn over its map. Else None.
    """

    map_grid: Tensor
    raw_map_grid: Tensor
    scores: Tensor
    class_indices: Optional[Tensor]
    display: DisplayImages
    method: str
    layer: Union[str, list[str], None] = None
    keep_target_dim: bool = False
    low_res_maps: Optional[list[Tensor]] = None
    probabilities: Optional[Tensor] = None
    attributions: Optional[Tensor] = None
    diagnostics: dict[str, Diagnostic] = field(default_factory=dict)
    class_names: Optional[Sequence[str]] = field(default=None, repr=False)
    boxes: Optional[Tensor] = None
    probability_function: str = "softmax"

    @property
    def images(self) -> Tensor:
        """(N, H, W, 3) float RGB display images in [0, 1], on the CPU: what the model saw."""
        return self.display.get()

    @property
    def maps(self) -> Tensor:
        """(N, H, W) for one target per image, (N, K, H, W) for K targets per image."""
        return self.map_grid if self.keep_target_dim else self.map_grid[:, 0]

    @property
    def raw_maps(self) -> Tensor:
        """``maps`` before normalisation, same shape."""
        return self.raw_map_grid if self.keep_target_dim else self.raw_map_grid[:, 0]

    @property
    def targets(self) -> Optional[Tensor]:
        """Class indices explained: (N,) or (N, K) like ``maps``; None for callable targets."""
        if self.class_indices is None:
            return None
        return self.class_indices if self.keep_target_dim else self.class_indices[:, 0]

    def __len__(self) -> int:
        return self.map_grid.shape[0]

    def __getitem__(self, index: ImageIndex) -> Explanation:
        """The explanation of some of the images, as an Explanation (``e[0]`` is one of 1 image): maps, scores,
        classes, probabilities, display images, attributions, low-resolution maps and per-image diagnostics
        ((N, ...) tensors) are those images'; 0-d diagnostics (counts) and names are kept as they are."""
        rows = self._image_rows(index)
        count = len(self)

        def pick(values: Tensor) -> Tensor:
            return values[rows.to(values.device)]

        def pick_diagnostic(value: Diagnostic) -> Diagnostic:
            per_image = isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == count
            return pick(value) if isinstance(value, Tensor) and per_image else value

        return dataclasses.replace(
            self,
            map_grid=pick(self.map_grid),
            raw_map_grid=pick(self.raw_map_grid),
            scores=pick(self.scores),
            class_indices=None if self.class_indices is None else pick(self.class_indices),
            display=self.display.select(rows),
            low_res_maps=None if self.low_res_maps is None else [pick(maps) for maps in self.low_res_maps],
            probabilities=None if self.probabilities is None else pick(self.probabilities),
            attributions=None if self.attributions is None else pick(self.attributions),
            diagnostics={name: pick_diagnostic(value) for name, value in self.diagnostics.items()},
            boxes=None if self.boxes is None else pick(self.boxes),
        )

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        """Refused, with what to use instead: an explanation is maps, images and overlays, not one array (without
        this, ``np.asarray(e)`` would recurse into ``e[0][0]...`` and fail on numpy's dimension limit)."""
        raise TypeError("an Explanation is not one array: take e.maps.cpu().numpy() for the maps (float, (N, H, W) "
                        "or (N, K, H, W)), e.overlay() for the overlays (uint8 RGB) or e.images.numpy() for the "
                        "display images.")

    def __iter__(self) -> Iterator[Explanation]:
        """The explanation of each image, in order (each an Explanation of 1 image)."""
        return (self[image] for image in range(len(self)))

    def _image_rows(self, index: ImageIndex) -> Tensor:
        """(R,) long indices of the images ``index`` selects; IndexError / TypeError as a list would raise."""
        count = len(self)
        if isinstance(index, slice):
            return torch.tensor(list(range(count)[index]), dtype=torch.long)
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            if not -count <= index < count:
                raise IndexError(f"image index {index} is out of range for an explanation of {count} "
                                 f"image{'s' if count != 1 else ''}.")
            return torch.tensor([int(index) % count])
        if isinstance(index, tuple):
            raise TypeError("an Explanation is indexed by image only (e[i], e[i:j], e[[i, j]]); for target k of "
                            "each image use e.maps[:, k] or e.map_grid[:, k].")
        try:
            given = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError) as error:
            if "Overflow" in str(error):  # e[[2**70]]: an index no tensor holds
                raise IndexError(f"an image index is out of range (beyond int64) for an explanation of {count} "
                                 f"image{'s' if count != 1 else ''}.") from None
            raise TypeError(f"an Explanation is indexed by an int, a slice, a list of image indices or a bool mask "
                            f"of length {count}; got {type(index).__name__}.") from None
        selected = given.reshape(-1)
        if selected.dtype == torch.bool:
            if given.dim() == 0 or len(selected) != count:  # (N,) or (N, 1) as e.scores > s gives
                per_target = " (one per image and target, e.g. e.scores > s with topk: e[mask.any(1)] keeps the " \
                    "images with any)" if given.dim() == 2 and given.shape[0] == count else ""
                raise IndexError(f"a bool mask selects from {count} images: give one of shape ({count},); it has "
                                 f"shape {tuple(given.shape)}{per_target}.")
            return selected.nonzero()[:, 0].cpu()
        if selected.numel() == 0:  # e[[]]: no image (as a list gives a float tensor)
            return torch.zeros(0, dtype=torch.long)
        if selected.is_floating_point() or selected.is_complex():
            raise TypeError(f"image indices must be integers; got {selected.dtype}.")
        selected = selected.long().cpu()  # compared as int64: -count in uint8 or int8 would wrap around
        out_of_range = (selected < -count) | (selected >= count)
        if out_of_range.any():
            raise IndexError(f"image index {int(selected[out_of_range][0])} is out of range for an explanation of "
                             f"{count} image{'s' if count != 1 else ''}.")
        return selected % max(count, 1)

    def title(self, image_index: int, target_index: int = 0) -> str:
        """'class name (index): score' for one map ('#k class name (index): score' for a detected instance; 'text
        (token p): score' for a vision-language model's token map, p its position in the answer).
        Indices count from the end where negative, as in Python; one outside the maps is an IndexError."""
        images, targets = self.scores.shape[:2]
        if not (-images <= image_index < images and -targets <= target_index < targets):
            raise IndexError(f"no map ({image_index}, {target_index}): this explanation holds {images} image(s) × "
                             f"{targets} target(s).")
        image_index, target_index = image_index % images, target_index % targets
        if self.boxes is not None and bool(self.boxes[image_index, target_index].isnan().any()):
            return "no instance"
        prefix = f"#{target_index} " if self.boxes is not None else ""
        index = None if self.class_indices is None else int(self.class_indices[image_index, target_index])
        score = float(self.scores[image_index, target_index])
        positions = self.diagnostics.get("target_positions")  # a token map's place in the answer (explain.vlm)
        if isinstance(positions, Tensor) and positions.shape == self.scores.shape and index is not None \
                and self.class_names is not None and 0 <= index < len(self.class_names):
            name = self.class_names[index]
            if not name:  # a token with no text: its piece of the vocabulary ("<|im_end|>"), as explain.vlm names it
                pieces = self.diagnostics.get("target_pieces")
                piece = str(pieces[target_index]) if isinstance(pieces, list) and len(pieces) == targets else ""
                ids = self.diagnostics.get("target_token_ids")
                token_id = f" (id {int(ids[image_index, target_index])})" \
                    if isinstance(ids, Tensor) and ids.shape == self.scores.shape else ""
                name = (piece or "∅ no text") + token_id
            return f"{name} (token {int(positions[image_index, target_index])}): {score:.3g}"
        return f"{prefix}{render.label_text(index, self.class_names)}: {score:.3g}"

    def description(self) -> str:
        """'method @ layer'."""
        if self.layer is None:
            return self.method
        layer = ", ".join(self.layer) if isinstance(self.layer, list) else self.layer
        return f"{self.method} @ {layer}"

    def overlay(self, alpha: float = 0.5, cmap: render.ColormapSpec = "jet") -> np.ndarray:
        """RGB uint8 images with the heatmap blended: (N, H, W, 3), or (N, K, H, W, 3) for K targets. ``cmap``
        colours maps in [0, 1]; an image's signed maps ([-1, 1]) are drawn with RdBu_r, 0 in the middle
        (``render.as_drawn``), here and in ``save``, ``figure``, ``show`` and the notebook display."""
        self._check_not_empty()
        grid = self.drawn_map_grid()
        return self._overlays(grid if self.keep_target_dim else grid[:, 0], alpha, cmap)

    def drawn_map_grid(self, warn: bool = True) -> Tensor:
        """(N, K, H, W) float32 maps on the CPU as every drawing shows them: ``map_grid`` where it is normalised
        ([0, 1], or [-1, 1] signed). A map that is not (``normalize=None`` keeps the raw values: gradients of
        1e-3 would be drawn as nothing, values above 1 as one saturated colour) is drawn scaled to its own largest
        |value|, as ``normalize="max"`` would make it; NaN is drawn as no evidence (0) and ±inf as the strongest
        evidence (the map's largest finite |value|, with its sign). ``warn``: say so, at the caller's line, when
        a map is drawn other than as it is. ``map_grid`` itself is left as it is."""
        if self.map_grid.device.type == "meta":
            raise ValueError("the maps are on the meta device: they hold no values to draw. Explain on a real "
                             "device (the CPU or a GPU).")
        given = self.map_grid.detach().to("cpu", torch.float32)
        finite = torch.isfinite(given)
        grid = given
        notes = []
        if not bool(finite.all()):
            largest_finite = torch.where(finite, given.abs(), 0.0).amax(dim=(-2, -1), keepdim=True)
            strongest = torch.where(largest_finite > 0, largest_finite, 1.0)
            grid = torch.where(finite, given, torch.where(given.isnan(), 0.0, given.sign() * strongest))
            nans = int(given.isnan().sum())
            notes.append(f"hold {nans} NaN and {int((~finite).sum()) - nans} infinite pixel(s), drawn as no "
                         "evidence (NaN) and as the strongest evidence (±inf)")
        largest = grid.abs().amax(dim=(-2, -1), keepdim=True)
        raw = self.raw_map_grid.detach()
        unnormalised = largest > 1 + NORMALISED_TOLERANCE
        if raw.shape == given.shape and raw.device.type != "meta":
            kept_raw = (raw.to("cpu", torch.float32) == given).flatten(-2).all(-1)[..., None, None]
            unnormalised |= kept_raw & (largest > 0) & (largest < 1 - NORMALISED_TOLERANCE)
        if bool(unnormalised.any()):
            grid = torch.where(unnormalised, grid / largest.clamp_min(torch.finfo(torch.float32).tiny), grid)
            spans = largest[unnormalised]
            notes.append(f"are not normalised ({int(unnormalised.sum())} of {unnormalised.numel()} map(s), largest "
                         f"|value| {float(spans.min()):.3g} to {float(spans.max()):.3g}, e.g. with normalize=None): "
                         "each is drawn scaled to its own largest |value|, as normalize='max' makes it")
        if notes and warn:
            warn_at_callers_line(f"{self.description()}: the maps " + "; they ".join(notes) + ". The values in "
                                 "e.maps are left as they are.")
        return grid

    def _overlays(self, maps: Tensor, alpha: float, cmap: render.ColormapSpec) -> np.ndarray:
        """``render.overlay_explained`` of ``maps`` (the drawn maps, or their grid), with each explained instance's
        box outlined on its own map where the explanation has boxes."""
        overlays = render.overlay_explained(self.images, maps, alpha=alpha, cmap=cmap)
        if self.boxes is None:
            return overlays
        boxes = self.boxes if maps.dim() == 4 else self.boxes[:, 0]
        return np.stack([np.stack([render.draw_boxes(picture, box) for picture, box in zip(pictures, image_boxes)])
                         if maps.dim() == 4 else render.draw_boxes(pictures, image_boxes)
                         for pictures, image_boxes in zip(overlays, boxes)])

    def figure(
        self, alpha: float = 0.5, cmap: render.ColormapSpec = "jet", **options: Unpack[render.ExplanationFigureOptions]
    ) -> Figure:
        """A matplotlib Figure: each image with its overlays under it, titled with class and score."""
        return self._overlay_figure(alpha, cmap, **options)

    def show(self, alpha: float = 0.5, cmap: render.ColormapSpec = "jet",
             **options: Unpack[render.PanelOptions]) -> None:
        """Draw the figure with matplotlib's pyplot (in a notebook or a window). The figure is pyplot's until it
        is shown: with a backend that cannot show figures (Agg, as in scripts without a display, where pyplot's
        show does nothing) it is closed after ``plt.show()``, as a notebook closes it once shown, so that calls
        in a loop do not pile figures up in pyplot; a figure whose drawing fails is closed too."""
        import matplotlib.pyplot as plt

        figure = plt.figure()
        try:
            self._overlay_figure(alpha, cmap, figure=figure, **options)
        except BaseException:
            plt.close(figure)
            raise
        plt.show()
        if render.non_interactive_backend() is not None:
            plt.close(figure)

    def _overlay_figure(self, alpha: float, cmap: render.ColormapSpec,
                        map_titles: Optional[Sequence[Sequence[str]]] = None, title: Optional[str] = None,
                        **layout: Any) -> Figure:
        """``render.overlay_figure`` of this explanation: its maps titled with class and score (or ``map_titles``),
        the figure titled with the method and its layer (or ``title``)."""
        self._check_not_empty()
        grid = self.drawn_map_grid()  # (N, K, H, W)
        if map_titles is None:
            map_titles = [[self.title(image, target) for target in range(grid.shape[1])]
                          for image in range(grid.shape[0])]
        return render.overlay_figure(self.images, grid, map_titles, self.description() if title is None else title,
                                     alpha=alpha, cmap=cmap, boxes=self.boxes, **layout)

    def save(self, path: Union[str, bytes, Path], alpha: float = 0.5, cmap: render.ColormapSpec = "jet",
             dpi: int = 150) -> Path:
        """Write the overlays to ``path``.

        PNG/JPG and other raster formats: the overlays at the input's own
        resolution, images side by side, one row per target, tagged with ``dpi``
        (so a document places them at width / dpi inches). PDF/SVG/EPS: the
        titled figure of ``figure()`` as vector graphics (text as text, each
        panel embedded once at its own pixels, whatever ``dpi``). The folder must exist.
        """
        path = Path(os.fsdecode(path)).expanduser()
        if path.is_dir():
            raise IsADirectoryError(f"{str(path)!r} is a folder: give a file name in it, e.g. "
                                    f"{str(path / 'cam.png')!r}.")
        suffix = path.suffix.lower()
        if suffix not in VECTOR_FORMATS and suffix not in Image.registered_extensions():
            raise ValueError(f"cannot tell which format to write from {path.name!r}: end the name with .png, .jpg, "
                             ".webp or .tif (the overlays as an image) or .pdf, .svg or .eps (the titled figure).")
        render.check_writable(path, dpi)
        buffer = io.BytesIO()  # written whole, then to the file: a format that fails leaves an existing file as it was
        if suffix in VECTOR_FORMATS:
            render.savefig_with_svg_text(self.figure(alpha=alpha, cmap=cmap), buffer, format=suffix[1:], dpi=dpi)
        else:
            picture = self.overlay_image(alpha=alpha, cmap=cmap)
            file_format = Image.registered_extensions()[suffix]
            options = {"lossless": True} if file_format == "WEBP" else {}  # WebP is lossy unless asked
            try:
                picture.save(buffer, format=file_format, dpi=(dpi, dpi), **options)
            except (OSError, ValueError, KeyError) as error:
                raise ValueError(f"cannot write RGB overlays as {file_format} ({path.name!r}: {error}); end the name "
                                 "with .png, .jpg, .webp or .tif (the overlays as an image) or .pdf, .svg or .eps "
                                 "(the titled figure).") from None
            if file_format not in LOSSY_FORMATS:
                _warn_if_altered(picture, buffer.getvalue(), path.name, file_format)
        path.write_bytes(buffer.getvalue())
        return path

    def _check_not_empty(self) -> None:
        if len(self) == 0:
            raise ValueError("this explanation holds no image (an empty selection, e.g. e[mask] with no image "
                             "chosen): there is nothing to draw.")

    def overlay_image(self, alpha: float = 0.5, cmap: render.ColormapSpec = "jet") -> Image.Image:
        """The overlays as one RGB image at the input's resolution: images side by side, one row per
        target (what ``save`` writes to a raster file)."""
        self._check_not_empty()
        overlays = self._overlays(self.drawn_map_grid(), alpha, cmap)
        return Image.fromarray(render.tile(overlays))

    def png(self, dpi: int = 80) -> bytes:
        """The figure of ``figure()`` as PNG bytes (what a notebook shows)."""
        return render.figure_png(self.figure(), dpi=dpi)

    def __repr__(self) -> str:
        """One line: method and layer, N × K, size, and the first images' classes with their scores."""
        count, targets = self.map_grid.shape[:2]
        height, width = self.map_grid.shape[-2:]
        shown = min(count, 3)
        explained = "; ".join(
            f"image {n}: " + ", ".join(self.title(n, k) for k in range(min(targets, 3)))
            + (", …" if targets > 3 else "")
            for n in range(shown)
        )
        more = f"; … ({count - shown} more)" if count > shown else ""
        return (f"Explanation({self.description()}, {count} image{'s' if count != 1 else ''} × {targets} "
                f"target{'s' if targets != 1 else ''}, {height}×{width}; {explained}{more})")

    def _repr_html_(self) -> str:
        """Notebook display: the figure (once, as one PNG at 80 dpi) of the first images and targets, at most
        ``NOTEBOOK_PANELS`` panels and ``NOTEBOOK_TARGETS`` targets (drawing every map of a big batch takes
        minutes and a figure metres wide; a note says what is left out), then a table of image, class, score and
        probability (headed "sigmoid probability" for a multi-label model's, ``probability_function``), at most
        ``NOTEBOOK_ROWS`` rows. There is no ``_repr_png_``: a notebook would store the figure twice."""
        if len(self) == 0:
            return f"<div><p><b>{html.escape(self.description())}</b>: no image (an empty selection)</p></div>"
        count, targets = self.map_grid.shape[:2]
        shown_targets = min(targets, NOTEBOOK_TARGETS)
        shown_images = max(1, min(count, NOTEBOOK_PANELS // (shown_targets + 1)))  # + 1: the image's own panel
        picture = base64.b64encode(self._first_maps_png(shown_images, shown_targets)).decode("ascii")
        left_out = ""
        if (shown_images, shown_targets) != (count, targets):
            left_out = (f"<p>The figure shows images 0–{shown_images - 1} of {count}, targets 0–{shown_targets - 1} "
                        f"of {targets}: e[i:j].show() draws other images, e.figure() every map.</p>")
        probability_header = "sigmoid probability" if self.probability_function == "sigmoid" else "probability"
        rows: list[str] = []
        for image in range(count):
            for target in range(targets):
                if len(rows) == NOTEBOOK_ROWS:
                    break
                probability = "" if self.probabilities is None else f"{float(self.probabilities[image, target]):.3f}"
                rows.append(
                    f"<tr><td>{image}</td><td>{html.escape(self.title(image, target).rsplit(':', 1)[0])}</td>"
                    f"<td>{float(self.scores[image, target]):.4g}</td><td>{probability}</td></tr>"
                )
        if count * targets > len(rows):
            rows.append(f"<tr><td colspan=\"4\">… {count * targets - len(rows)} more rows (e.scores, e.targets and "
                        "e.probabilities hold them all)</td></tr>")
        return (
            f"<div><p><b>{html.escape(self.description())}</b></p>"
            f'<img src="data:image/png;base64,{picture}"/>{left_out}'
            f"<table><tr><th>image</th><th>class</th><th>score</th><th>{probability_header}</th></tr>"
            + "".join(rows) + "</table></div>"
        )

    def _first_maps_png(self, images: int, targets: int) -> bytes:
        """``png()`` of the first ``images`` images' first ``targets`` maps (the notebook's figure)."""
        if (images, targets) == tuple(self.map_grid.shape[:2]):
            return self.png()
        part = self[:images]
        titles = [[self.title(image, target) for target in range(targets)] for image in range(images)]
        figure = render.overlay_figure(part.images, part.drawn_map_grid()[:, :targets], titles, self.description(),
                                       boxes=None if part.boxes is None else part.boxes[:, :targets])
        return render.figure_png(figure, dpi=80)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and deep-copied) with its display images made, not with the model input and the preprocessing
        that would make them: a lambda or a local function cannot be pickled, and one may hold the model."""
        state = self.__dict__.copy()
        state["display"] = DisplayImages(self.images)
        return state
