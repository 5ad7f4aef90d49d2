"""A static HTML report of a batch run (``explain report OUT``): accuracy and confusion per class,
misclassified and low-confidence images first, every image's overlays labelled, filters and
sorting by class, correctness and confidence, and the strategies of OUT/strategies.json.

    OUT/report.html                 the page: open it from the file system, no server, no network
    OUT/report/report.css, .js      its style and logic (copied from explain/report_assets)
    OUT/report/data-<token>/        the per-image data as .js files, loaded with <script> tags
                                    (file:// refuses fetch()): keys-NNNN.js, chunk-NNNNN.js,
                                    strategies.js
    OUT/report/thumbs-<size>/       one small JPEG per image and explained target
    OUT/report/strategies/          mean maps drawn from strategies.json's values, where its PNG is
                                    missing

The maps are labelled with the method that OUT/run.json records (``explain.batch.RunRecord``); a
folder written before explain wrote run.json is reported too (its method then the one of
OUT/strategies.json, or ``method=``).
The page's size does not grow with the number of images: the per-image data are chunked and the
gallery is paged, so a run of 100,000 images opens as fast as one of 100. Regenerating reuses the
thumbnails that exist and are newer than their overlay and map files. Every text taken from the
run (file names, class names, reasons) is escaped in the page, or set as text by its script.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import string
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterable, Iterator, Optional, Sequence, Union
from urllib.parse import quote

import numpy as np
from PIL import Image

from ..io import render
from ..io.inputs import list_image_files, open_image, upright
from ..io.page_text import LONE_SURROGATE, escaped, writable
from .index import MapReader, read_index_contents
from .run_folder import FolderInUseError, display_name, folder_lock, write_atomically
from .run_record import RunRecord, read_run_record
from .spray import other_method_note

REPORT_PAGE = "report.html"
REPORT_FOLDER = "report"
ASSETS = Path(__file__).with_name("report_assets")
KEY_BLOCK_SIZE = 20_000
"""Images per keys-NNNN.js file (about 25 bytes each)."""
PAGE_SIZES = (24, 48, 96, 192)
MAX_NOTES_SHOWN = 20
THUMBNAIL_QUALITY = 82
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class ExplainedTarget:
    """One explained target of an image (one index row). class_index None when the run's target
    was not a class (a callable); score, probability None when not recorded."""

    class_index: Optional[int]
    class_name: str
    score: Optional[float]
    probability: Optional[float]
    role: str


@dataclass
class ImageRecord:
    """One image of the run: its K explained targets (k = 0 … K−1) and, when the index has the label
    columns, its true class, the model's top-1 class and its probability in [0, 1] (softmax; sigmoid for one logit);
    correct is None when the image has no label."""

    id: str
    image: str
    map_file: str
    targets: list[ExplainedTarget]
    label: Optional[int] = None
    predicted: Optional[int] = None
    confidence: Optional[float] = None
    correct: Optional[bool] = None


@dataclass
class RunIndex:
    """A batch run read back: the complete images of its index in file order, class names by index,
    whether the index has the label columns, its OUT/run.json (None for a folder written before
    explain wrote it, or where it cannot be read), and what was left out and why."""

    images: list[ImageRecord]
    class_names: dict[int, str]
    has_label_columns: bool
    record: Optional[RunRecord] = None
    notes: list[str] = field(default_factory=list)


@dataclass
class ClassRow:
    """Per-class figures. labelled: images whose true class it is (with a prediction); correct:
    of those, predicted right; predicted: images predicted as it (labelled ones); confused_with:
    the class its images are most often mistaken for and how often; mean_confidence over the
    images predicted as it."""

    class_index: int
    labelled: int = 0
    correct: int = 0
    predicted: int = 0
    predicted_right: int = 0
    confused_with: Optional[tuple[int, int]] = None
    mean_confidence: Optional[float] = None
    low_confidence: int = 0

    @property
    def accuracy(self) -> Optional[float]:
        return self.correct / self.labelled if self.labelled else None

    @property
    def precision(self) -> Optional[float]:
        return self.predicted_right / self.predicted if self.predicted else None


@dataclass
class Summary:
    """A run's accuracy and confusion. confusion[(true, predicted)]: image counts over the images
    with both; accuracy: correct / those images (None when there are none)."""

    images: int
    labelled: int
    correct: int
    misclassified: int
    low_confidence: int
    confusion: dict[tuple[int, int], int]
    classes: list[ClassRow]

    @property
    def accuracy(self) -> Optional[float]:
        return self.correct / self.labelled if self.labelled else None


@dataclass
class ReportResult:
    """What ``report`` did: the page, the number of images, thumbnails made and reused, and
    notes on what was left out (unreadable files, incomplete images)."""

    page: Path
    images: int
    thumbnails_made: int
    thumbnails_reused: int
    notes: list[str]
    seconds: float


# ---- Reading the index ----------------------------------------------------------------------

def _some(items: Sequence[str], shown: int = 5) -> str:
    """The first few items, quoted, for a note."""
    return ", ".join(repr(item) for item in items[:shown]) + (" …" if len(items) > shown else "")


def _integer(text: Optional[str]) -> Optional[int]:
    text = (text or "").strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def _number(text: Optional[str]) -> Optional[float]:
    try:
        value = float((text or "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_run_index(out: Union[str, Path]) -> RunIndex:
    """Read a batch run's OUT/index.csv (with or without the label columns, by
    ``explain.batch.read_index_contents``) into images, and its OUT/run.json. An image whose rows
    are incomplete (a run in progress, a torn last line) is left out with a note, as is a run.json
    that cannot be read. Raises FileNotFoundError without an index, ValueError when the file is not one."""
    out = Path(out)
    index = out / "index.csv"
    if not index.is_file():
        shards = sorted(out.glob("index.rank*.csv"))
        hint = (f" The run was sharded and not merged yet: {len(shards)} index.rank*.csv files are there; merge "
                "them with explain.batch.merge_shard_indexes(OUT)." if shards else
                " Run `explain batch DIR --model MODEL --out OUT` first.")
        raise FileNotFoundError(f"no index at {display_name(index)}: OUT must be the output folder of explain batch."
                                + hint)
    contents = read_index_contents(index)
    rows_by_id: dict[str, list[dict[str, str]]] = {}
    for row in contents.rows:
        rows_by_id.setdefault(row["id"], []).append(row)
    names: dict[int, str] = {}
    images = [_image_record(image_id, rows, names, contents.has_label_columns)
              for image_id, rows in rows_by_id.items()]
    notes = []
    if contents.incomplete:
        notes.append(f"{len(contents.incomplete)} image(s) with incomplete rows in the index were left out (a run in "
                     f"progress?): {_some(contents.incomplete)}")
    if contents.duplicated:
        notes.append(f"{len(contents.duplicated)} image(s) have their rows in the index more than once (two runs at "
                     f"once into the folder), each shown once: {_some(contents.duplicated)}")
    skipped = _skipped_files(out / "skipped.csv")
    if skipped:
        notes.append(f"{len(skipped)} file(s) could not be explained and are not shown (each with the reason in "
                     f"skipped.csv): {'; '.join(f'{image!r} ({reason})' for image, reason in skipped[:3])}"
                     f"{' …' if len(skipped) > 3 else ''}")
    try:
        record = read_run_record(out)
    except ValueError as error:
        notes.append(f"{error} The method is not named.")
        record = None
    return RunIndex(images, dict(sorted(names.items())), contents.has_label_columns, record, notes)


def _skipped_files(path: Path) -> list[tuple[str, str]]:
    """The files that explain batch could not explain, with the reason (OUT/skipped.csv, columns
    image,reason); none where the file is missing or cannot be read."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            return [(row.get("image") or "", row.get("reason") or "") for row in csv.DictReader(file)]
    except (OSError, csv.Error):
        return []


def _image_record(image_id: str, rows: list[dict[str, str]], names: dict[int, str],
                  has_label_columns: bool) -> ImageRecord:
    """An image from its K complete index rows (any order); class names seen in the rows are added
    to ``names``."""
    ordered = sorted(rows, key=lambda row: int(row["k"]))

    def remember(index: Optional[int], name: str) -> None:
        if index is not None and name and not names.get(index):
            names[index] = name

    targets = []
    for row in ordered:
        index = _integer(row["target"])
        remember(index, row["class_name"])
        targets.append(ExplainedTarget(index, row["class_name"], _number(row["score"]),
                                       _number(row["probability"]), row["role"].strip()))
    first = ordered[0]
    record = ImageRecord(image_id, first["image"] or image_id, first["map"], targets)
    if has_label_columns:
        record.label = _integer(first["label"])
        record.predicted = _integer(first["predicted"])
        remember(record.label, first["label_name"])
        remember(record.predicted, first["predicted_name"])
        confidence = _number(first["confidence"])
        record.confidence = confidence if confidence is not None and 0.0 <= confidence <= 1.0 else None
        correct = first["correct"].strip()
        if correct in ("0", "1"):
            record.correct = correct == "1"
        elif record.label is not None and record.predicted is not None:
            record.correct = record.label == record.predicted
    return record


# ---- Figures ----------------------------------------------------------------------------------

def default_order(images: Sequence[ImageRecord]) -> list[ImageRecord]:
    """The gallery's default order: misclassified images first (most confident mistakes first),
    then the others by confidence, least confident first, then those without a confidence; ties
    by file name."""

    def key(record: ImageRecord) -> tuple[int, float, str, str]:
        if record.correct is False:
            return 0, -(record.confidence if record.confidence is not None else 0.0), record.image, record.id
        if record.confidence is not None:
            return 1, record.confidence, record.image, record.id
        return 2, 0.0, record.image, record.id

    return sorted(images, key=key)


def summarise(images: Sequence[ImageRecord], low_confidence: float = 0.5) -> Summary:
    """Accuracy, confusion counts and per-class figures of a run's images (see ``Summary``, ``ClassRow``).
    low_confidence: a confidence below it counts as low, in [0, 1]."""
    confusion: Counter[tuple[int, int]] = Counter()
    rows: dict[int, ClassRow] = {}
    confidences: dict[int, list[float]] = {}
    low = 0
    for record in images:
        if record.confidence is not None and record.confidence < low_confidence:
            low += 1
        if record.predicted is not None:
            row = rows.setdefault(record.predicted, ClassRow(record.predicted))
            if record.confidence is not None:
                confidences.setdefault(record.predicted, []).append(record.confidence)
                row.low_confidence += record.confidence < low_confidence
        if record.label is not None:
            rows.setdefault(record.label, ClassRow(record.label))
        if record.label is None or record.predicted is None:
            continue
        confusion[(record.label, record.predicted)] += 1
        truth, guess = rows[record.label], rows[record.predicted]
        truth.labelled += 1
        guess.predicted += 1
        if record.label == record.predicted:
            truth.correct += 1
            guess.predicted_right += 1
    for (truth_index, guess_index), count in confusion.items():
        if truth_index != guess_index:
            row = rows[truth_index]
            if row.confused_with is None or (count, -guess_index) > (row.confused_with[1], -row.confused_with[0]):
                row.confused_with = (guess_index, count)
    for index, values in confidences.items():
        rows[index].mean_confidence = sum(values) / len(values)
    labelled = sum(confusion.values())
    correct = sum(count for (truth_index, guess_index), count in confusion.items() if truth_index == guess_index)
    return Summary(len(images), labelled, correct, labelled - correct, low, dict(confusion),
                   [rows[index] for index in sorted(rows)])


# ---- Files of the run -------------------------------------------------------------------------

def _inside(out: Path, relative: str) -> Optional[Path]:
    """OUT/relative when it names a file inside OUT: an index may be hostile, so a path that is
    absolute or climbs out ("..") is refused without being opened."""
    if not relative:
        return None
    parts = PurePosixPath(relative.replace("\\", "/"))
    if parts.is_absolute() or ".." in parts.parts or PureWindowsPath(relative).drive or "\x00" in relative:
        return None
    path = out / parts
    try:
        return path if path.is_file() else None
    except (OSError, ValueError):
        return None


def _url(relative: Union[str, Path]) -> str:
    """A path relative to the page as a URL (each part percent-encoded: '#', '?', '%', a newline in names; a
    byte that is not UTF-8, read as a lone surrogate, as that very byte, %E9, which a browser opens)."""
    return "/".join(quote(_path_bytes(part)) for part in Path(relative).as_posix().split("/"))


def _path_bytes(part: str) -> bytes:
    """A file name's bytes on disk (``os.fsencode``); a lone surrogate no file name holds as UTF-8's three bytes."""
    try:
        return os.fsencode(part)
    except UnicodeEncodeError:
        return part.encode("utf-8", "surrogatepass")


def _safe_name(text: str) -> str:
    """A file name for ``text`` (an image id): its safe characters and 8 hex digits of its hash."""
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{SAFE_NAME.sub('_', text)[-80:]}-{digest[:8]}"


@dataclass
class _ThumbnailJob:
    """Where an image's K thumbnails go and what they are made from: its overlay, its maps (the file
    that holds them, read with ``reader``), its source image."""

    paths: list[Path]
    overlay: Optional[Path]
    map_file: Optional[Path]
    source: Optional[Path]
    image_id: str = ""
    reader: Optional[MapReader] = None

    def maps(self) -> Optional[np.ndarray]:
        """The image's (K, H, W) maps at the input's resolution, None when they cannot be read."""
        if self.map_file is None or self.reader is None:
            return None
        try:  # the index's name of the file, relative to OUT (the reader joins it to OUT, which may be relative)
            name = self.map_file.relative_to(self.reader.out).as_posix()
            return self.reader.read({"id": self.image_id, "map": name}).numpy()
        except (OSError, ValueError, KeyError):
            return None


def _modified(path: Optional[Path]) -> float:
    try:
        return path.stat().st_mtime if path is not None else 0.0
    except OSError:
        return 0.0


def _source_image(record: ImageRecord, by_id: Optional[dict[str, Path]] = None) -> Optional[Path]:
    """The image file the run read, when it is still where the index says (relative to the
    current folder, as the run was given it), else the one of its id in ``by_id`` (``_sources_by_id``)."""
    found = (by_id or {}).get(record.id)
    if found is not None or not record.image or record.image == record.id:
        return found
    path = Path(record.image)
    try:
        return path if path.suffix and path.is_file() else None
    except (OSError, ValueError):
        return None


def _sources_by_id(out: Path, record: Optional[RunRecord], images: Sequence[ImageRecord]) -> dict[str, Path]:
    """The source images of the images whose index entry names no file, found by their id among the files of the
    run's input folder (run.json's data.folder), listed as explain batch lists it. The index shows a file name in
    its display form, which names no file where it holds a newline, a tab or a byte that is not UTF-8 (each written
    as a \\x escape), and a run started in another folder names its files relative to that one."""
    data = record.data if record is not None else None
    folder = data.get("folder") if isinstance(data, dict) else None
    missing = {image.id for image in images if image.image and image.image != image.id
               and _source_image(image) is None}
    if not missing or not isinstance(folder, str):
        return {}
    from .batch import item_id  # the batch module imports much: loaded only when an image is not found

    try:
        files, _ = list_image_files(folder, exclude=out)
    except (OSError, ValueError):  # the folder is gone, or cannot be read: the images are shown without a link
        return {}
    found = {}
    for path in files:
        identifier = item_id(path, Path(folder))
        if identifier in missing:
            found[identifier] = path
    return found


def _make_thumbnails(job: _ThumbnailJob, size: int) -> bool:
    """Write the K thumbnails of one image: panels of its overlay PNG, else its maps drawn on the
    source image, else its maps alone. Returns False when nothing could be read."""
    count = len(job.paths)
    if job.overlay is None and job.map_file is None:
        return False
    panels: Optional[list[Image.Image]] = None
    if job.overlay is not None:
        try:
            with open_image(job.overlay) as opened:
                overlay = opened.convert("RGB")
            if overlay.width % count == 0:
                width = overlay.width // count
                maps = job.maps()
                top = _caption_band(overlay.size, count, None if maps is None else maps.shape)
                panels = [overlay.crop((k * width, top, (k + 1) * width, overlay.height)) for k in range(count)]
        except (OSError, ValueError, Image.DecompressionBombError):
            panels = None
    if panels is None and job.map_file is not None:
        panels = _panels_from_maps(job.maps(), job.source, count, size)
    if panels is None:
        return False
    for path, panel in zip(job.paths, panels):
        panel.thumbnail((size, size), Image.Resampling.BILINEAR, reducing_gap=2.0)
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_jpeg(panel, path)
    return True


def _caption_band(overlay_size: tuple[int, int], count: int, map_shape: Optional[tuple[int, ...]]) -> int:
    """The height of the caption band above an overlay's panels (explain batch draws each panel's
    class, score and method there; older overlays have none), from the sizes alone: each panel is
    its (H, W) map enlarged by a whole factor s, so the band is the overlay's height minus s·H.
    0 when the sizes do not fit that layout. The report writes its own captions beside thumbnails."""
    if map_shape is None or len(map_shape) != 3 or map_shape[0] != count or min(map_shape[1:]) < 1:
        return 0
    width, height = overlay_size
    scale, remainder = divmod(width // count, map_shape[2])
    band = height - scale * map_shape[1]
    return band if scale >= 1 and remainder == 0 and 0 <= band < height else 0


def _save_jpeg(picture: Image.Image, path: Path) -> None:
    write_atomically(path, lambda temporary: picture.save(temporary, format="JPEG", quality=THUMBNAIL_QUALITY))


def _panels_from_maps(maps: Optional[np.ndarray], source: Optional[Path], count: int, size: int
                      ) -> Optional[list[Image.Image]]:
    """An image's K maps, (K, H, W) in [0, 1], drawn at about ``size`` pixels: on the source image when
    it can be read, else alone through the colour map. None when they are not K maps (or None)."""
    if maps is None or maps.ndim != 3 or maps.shape[0] != count or min(maps.shape[1:]) < 1:
        return None
    height, width = maps.shape[1:]
    scale = min(1.0, size / max(height, width))
    shape = (max(1, round(height * scale)), max(1, round(width * scale)))
    values, cmap = render.as_drawn(maps.astype(np.float32), "jet")  # signed maps diverging, as explain draws them
    small = render.resize_maps(values, shape)
    background: Optional[np.ndarray] = None
    if source is not None:
        try:
            with open_image(source) as opened:
                side = 2 * max(shape)  # the stored picture may be turned: at least twice the thumbnail either way
                opened.draft("RGB", (side, side))
                shown = upright(opened).convert("RGB")  # as the maps were made (load_image turns it upright)
                background = np.array(shown.resize((shape[1], shape[0]), Image.Resampling.BILINEAR))
        except (OSError, ValueError, Image.DecompressionBombError):
            background = None
    if background is not None:
        pixels = render.overlay(background, small, cmap=cmap)
    else:
        pixels = render.colour_table_uint8(cmap)[render.colour_indices(small).numpy()]
    return [Image.fromarray(np.ascontiguousarray(panel)) for panel in pixels]


def _draw_mean_map(values: Any, path: Path, size: int = 96) -> bool:
    """A strategies cluster's mean map (h × w values in [0, 1]) as a colour-mapped PNG."""
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        return False
    if array.ndim != 2 or min(array.shape) < 1:
        return False
    small = render.resize_maps(np.nan_to_num(array).clip(0, 1), (size, size))
    pixels = render.colour_table_uint8()[render.colour_indices(small).numpy()]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda temporary: Image.fromarray(pixels).save(temporary, format="PNG"))
    return True


# ---- Writing the report -----------------------------------------------------------------------

def _check_options(page_size: int, thumbnail_size: int, chunk_size: int, low_confidence: float,
                   matrix_classes: int) -> None:
    checks = [
        (isinstance(page_size, int) and 1 <= page_size <= 1000,
         f"page_size must be 1 to 1000 images; got {page_size!r}."),
        (isinstance(thumbnail_size, int) and 16 <= thumbnail_size <= 1024,
         f"thumbnail_size must be 16 to 1024 pixels; got {thumbnail_size!r}."),
        (isinstance(chunk_size, int) and 1 <= chunk_size <= 100_000,
         f"chunk_size must be 1 to 100000 images; got {chunk_size!r}."),
        (isinstance(low_confidence, (int, float)) and 0.0 <= low_confidence <= 1.0,
         f"low_confidence must lie in [0, 1]; got {low_confidence!r}."),
        (isinstance(matrix_classes, int) and matrix_classes >= 1,
         f"matrix_classes must be at least 1; got {matrix_classes!r}."),
    ]
    for passed, message in checks:
        if not passed:
            raise ValueError(message)


def report(
    out: Union[str, Path],
    *,
    page_size: int = 48,
    thumbnail_size: int = 160,
    low_confidence: float = 0.5,
    method: Optional[str] = None,
    title: Optional[str] = None,
    chunk_size: int = 200,
    matrix_classes: int = 20,
) -> ReportResult:
    """Write OUT/report.html, the static report of the batch run in ``out`` (layout in this
    module's docstring), and return what was done (``ReportResult``; its ``page`` is the page's
    path). Open the page from the file system: no server needed.

    page_size: images per gallery page (1 to 1000). thumbnail_size: the longer side of each
    thumbnail in pixels (16 to 1024). low_confidence: confidences below it (in [0, 1]) are marked
    low. method: the method's name shown with each map (default: the one OUT/run.json records,
    else the one in OUT/strategies.json, else none). chunk_size: images per data file.
    matrix_classes: the confusion matrix is drawn as a table up to this many classes, listed as
    the most frequent confusions beyond.
    Raises FileNotFoundError when ``out`` has no index.csv, ValueError for a file that is not an
    index or options out of range; files that cannot be read are left out and listed in the
    report's notes (a warning says how many).
    """
    started = time.perf_counter()
    _check_options(page_size, thumbnail_size, chunk_size, low_confidence, matrix_classes)
    out = Path(out)
    if not out.is_dir():
        raise FileNotFoundError(f"no folder at {display_name(out)}: give the output folder of explain batch.")
    run_index = read_run_index(out)
    folder = out / REPORT_FOLDER
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{display_name(folder)} is a file; the report writes a folder there: move the file away.")
    if (out / REPORT_PAGE).is_dir():
        raise ValueError(f"{display_name(out / REPORT_PAGE)} is a folder; the report writes its page there.")
    folder.mkdir(exist_ok=True)
    with _report_lock(out, folder):  # two reports at once would each remove the other's data folder
        notes = list(run_index.notes)
        images = default_order(run_index.images)
        thumbnail_folder = f"thumbs-{thumbnail_size}"
        files, made, reused = _write_thumbnails(out, images, folder / thumbnail_folder, thumbnail_size, notes,
                                                run_index.record)
        strategies_file = out / "strategies.json"
        strategies, strategies_method = _read_strategies(out, strategies_file, images, files, run_index.class_names,
                                                         notes) if strategies_file.exists() else (None, None)
        stale = other_method_note(strategies_method, run_index.record) if strategies is not None else None
        if stale is not None:
            notes.append(stale)
        if strategies is not None and _modified(strategies_file) < _modified(out / "index.csv"):
            notes.append("strategies.json is older than index.csv: images explained since then are not in the "
                         "strategies. Run `explain strategies OUT` again, then this report.")
        if method is None:
            method = run_index.record.method_class if run_index.record is not None else strategies_method or ""

        token = f"data-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
        data_folder = folder / token
        data_folder.mkdir()
        summary = summarise(images, low_confidence)
        key_files, chunk_files = _write_data(data_folder, images, files, chunk_size)
        if strategies is not None:
            _write_script(data_folder / "strategies.js", "addStrategies", strategies)
        for asset in ("report.css", "report.js"):
            _copy_atomically(ASSETS / asset, folder / asset)
        meta = {
            "images": len(images), "dataFolder": f"{REPORT_FOLDER}/{token}", "keyFiles": key_files,
            "chunkFiles": chunk_files, "chunkSize": chunk_size, "pageSize": page_size, "method": method,
            "hasLabels": any(record.label is not None for record in images),
            "hasPredictions": any(record.predicted is not None for record in images),
            "lowConfidence": low_confidence, "strategies": strategies is not None,
            "classes": [[index, name] for index, name in run_index.class_names.items()],
        }
        page_text = _page(out, title, method, images, summary, meta, strategies, notes, run_index.has_label_columns,
                          page_size, matrix_classes)
        page = out / REPORT_PAGE
        write_atomically(page, lambda temporary: temporary.write_text(page_text, encoding="utf-8"))
        for old in folder.glob("data-*"):  # earlier reports' data, no longer referenced
            if old.name != token and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        _remove_unused_thumbnails(folder, thumbnail_folder, files)
        if notes:
            warnings.warn(f"the report of {display_name(out)} leaves things out ({len(notes)} note(s), listed at the "
                          f"top of the page); the first: {notes[0]}", stacklevel=2)
        return ReportResult(page, len(images), made, reused, notes, time.perf_counter() - started)


@contextlib.contextmanager
def _report_lock(out: Path, folder: Path) -> Iterator[None]:
    """Hold OUT/report (``folder_lock`` on OUT/report/.explain.lock) while a report is written: a second report
    into OUT at once is refused (FolderInUseError) rather than removing the data folder of the other's page, or its
    thumbnails. An ``explain batch`` writing into OUT meanwhile holds OUT's own lock, not this one."""
    try:
        with folder_lock(folder):
            yield
    except FolderInUseError as error:
        if "in use by another run of explain" not in str(error):
            raise
        raise FolderInUseError(
            f"another explain report is being written into {display_name(out)} ({_holder(error)}): two at once would "
            "each remove the other's data, and the page would show no images. Wait until it ends, then run this "
            "one again.") from None


def _holder(error: FolderInUseError) -> str:
    """Who holds the lock, as ``folder_lock``'s error names it ("pid 123 on host, since ...")."""
    found = re.search(r"another run of explain \((.*)\): two runs", str(error))
    return found.group(1) if found else "a process that did not say which"


def _copy_atomically(source: Path, destination: Path) -> None:
    write_atomically(destination, lambda temporary: shutil.copyfile(source, temporary))


def _thumbnail_paths(folder: Path, record: ImageRecord) -> list[Path]:
    name = _safe_name(record.id)
    bucket = hashlib.sha1(record.id.encode("utf-8", "surrogatepass")).hexdigest()[:2]
    return [folder / bucket / f"{name}-{k}.jpg" for k in range(len(record.targets))]


@dataclass
class _ImageFiles:
    """An image's files as URLs relative to the page: its K thumbnails (None where none could be
    made), its overlay PNG and its source image (None when not there)."""

    thumbs: list[Optional[str]]
    overlay: Optional[str]
    source: Optional[str]


def _write_thumbnails(out: Path, images: Sequence[ImageRecord], folder: Path, size: int, notes: list[str],
                      run_record: Optional[RunRecord] = None) -> tuple[dict[str, _ImageFiles], int, int]:
    """Each image's files, making its K thumbnails where those on disk are missing or older than
    its overlay and map files (in threads: decoding and resizing release Python's lock); and how
    many thumbnails were made and reused."""
    files: dict[str, _ImageFiles] = {}
    jobs: dict[str, _ThumbnailJob] = {}
    reused = 0
    reader = MapReader(out, files_kept=16)  # shared by the threads: a maps file holds the maps of several images
    by_id = _sources_by_id(out, run_record, images)
    for record in images:
        paths = _thumbnail_paths(folder, record)
        overlay = _inside(out, f"overlays/{record.id}.png")
        map_file = _inside(out, record.map_file)
        source = _source_image(record, by_id)
        newest_input = max(_modified(overlay), _modified(map_file))
        files[record.id] = _ImageFiles([_url(path.relative_to(out)) for path in paths],
                                       _url(overlay.relative_to(out)) if overlay is not None else None,
                                       _relative_url(source, out) if source is not None else None)
        if all(_modified(path) >= newest_input > 0 for path in paths):
            reused += len(paths)
        else:
            jobs[record.id] = _ThumbnailJob(paths, overlay, map_file, source, record.id, reader)
    made = 0
    unreadable: list[str] = []
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for image_id, written in zip(jobs, pool.map(lambda job: _make_thumbnails(job, size), jobs.values())):
            if written:
                made += len(jobs[image_id].paths)
            else:
                unreadable.append(image_id)
                files[image_id].thumbs = [None] * len(jobs[image_id].paths)
    if unreadable:
        notes.append(f"{len(unreadable)} image(s) have no readable overlay or map file and are shown without a "
                     f"picture: {_some(unreadable)}")
    return files, made, reused


def _relative_url(path: Path, out: Path) -> Optional[str]:
    """A file anywhere as a URL relative to the page in OUT (None on another drive)."""
    try:
        return _url(os.path.relpath(path.resolve(), out.resolve()))
    except ValueError:
        return None


def _remove_unused_thumbnails(folder: Path, current: str, files: dict[str, _ImageFiles]) -> None:
    """Remove thumbnails of images no longer in the index, and folders of other thumbnail sizes."""
    for other in folder.glob("thumbs-*"):
        if other.name != current and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)
    used = {url.rsplit("/", 1)[-1] for item in files.values() for url in item.thumbs if url}
    for path in (folder / current).glob("*/*.jpg"):
        if path.name not in used:
            path.unlink(missing_ok=True)


def _rounded(value: Optional[float], digits: int = 6) -> Optional[float]:
    return None if value is None else float(f"{value:.{digits}g}")


def _write_script(path: Path, function: str, *arguments: Any) -> None:
    """A data file: one call of window.explainReport.<function>(arguments as JSON). JSON is a JS
    expression, so no text in it can end the call or run as code."""
    text = ", ".join(_json_text(argument) for argument in arguments)
    path.write_text(f"explainReport.{function}({text});\n", encoding="utf-8")


def _write_data(folder: Path, images: Sequence[ImageRecord], files: dict[str, _ImageFiles], chunk_size: int
                ) -> tuple[int, int]:
    """Write keys-NNNN.js (every image's filter and sort keys) and chunk-NNNNN.js (each image's
    details); return how many of each."""
    name_rank = {record.id: rank for rank, record in enumerate(sorted(images, key=lambda r: (r.image, r.id)))}

    def unknown_as(value: Optional[int], missing: int = -1) -> int:
        return missing if value is None else value

    key_files = 0
    for start in range(0, len(images), KEY_BLOCK_SIZE):
        block = images[start : start + KEY_BLOCK_SIZE]
        keys = {
            "label": [unknown_as(record.label) for record in block],
            "predicted": [unknown_as(record.predicted) for record in block],
            "explained": [unknown_as(record.targets[0].class_index) for record in block],
            "confidence": [-1 if record.confidence is None else round(record.confidence * 10000) for record in block],
            "correct": [-1 if record.correct is None else int(record.correct) for record in block],
            "nameRank": [name_rank[record.id] for record in block],
        }
        _write_script(folder / f"keys-{key_files:04d}.js", "addKeys", key_files, keys)
        key_files += 1
    chunk_files = 0
    for start in range(0, len(images), chunk_size):
        records = []
        for record in images[start : start + chunk_size]:
            item = files[record.id]
            records.append({
                "id": record.id, "image": record.image, "label": record.label, "predicted": record.predicted,
                "confidence": _rounded(record.confidence), "correct": record.correct,
                "overlay": item.overlay, "source": item.source,
                "targets": [{"class": target.class_index, "name": target.class_name, "score": _rounded(target.score),
                             "probability": _rounded(target.probability), "role": target.role, "thumb": thumb}
                            for target, thumb in zip(record.targets, item.thumbs)],
            })
        _write_script(folder / f"chunk-{chunk_files:05d}.js", "addChunk", chunk_files, records)
        chunk_files += 1
    return key_files, chunk_files


# ---- Strategies -------------------------------------------------------------------------------

def _read_strategies(out: Path, path: Path, images: Sequence[ImageRecord], files: dict[str, _ImageFiles],
                     class_names: dict[int, str], notes: list[str]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """OUT/strategies.json as the page shows it (classes with a flagged cluster first), and its
    method; (None, None) with a note when it cannot be read. Its notes join the report's."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        notes.append(f"strategies.json could not be read ({type(error).__name__}: {str(error)[:200]}); the "
                     "strategies are not shown. Write it again with explain's strategies.")
        return None, None
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list):
        notes.append("strategies.json is not a strategies file (no list of classes); the strategies are not shown.")
        return None, None
    if isinstance(data.get("notes"), list):  # what SpRAy left out or doubted (maps unreadable, without a place...)
        notes.extend(f"strategies: {note}" for note in data["notes"])
    records = {record.id: record for record in images}
    skipped = 0
    classes = []
    for entry in data["classes"]:
        shown = _strategy_class(out, entry, records, files, class_names) if isinstance(entry, dict) else None
        if shown is None:
            skipped += 1
        else:
            classes.append(shown)
    if skipped:
        notes.append(f"{skipped} class(es) of strategies.json lack the fields of the format (class, clusters with "
                     "cluster, size, examples) and are not shown.")
    classes.sort(key=lambda entry: (entry["flagged"] == 0, entry["class"]))
    method = data.get("method") if isinstance(data.get("method"), str) else None
    not_analysed = [{"class": entry["class"], "name": str(entry.get("class_name") or "")
                     or class_names.get(entry["class"], ""), "reason": str(entry.get("reason") or "")}
                    for entry in data.get("skipped") or [] if isinstance(entry, dict)
                    and isinstance(entry.get("class"), int)]
    return {"method": method or "", "classes": classes, "skipped": not_analysed}, method


def _strategy_class(out: Path, entry: dict[str, Any], records: dict[str, ImageRecord],
                    files: dict[str, _ImageFiles], class_names: dict[int, str]) -> Optional[dict[str, Any]]:
    class_index = entry.get("class")
    clusters = entry.get("clusters")
    if not isinstance(class_index, int) or not isinstance(clusters, list):
        return None
    shown_clusters = []
    for cluster in clusters:
        if not (isinstance(cluster, dict) and isinstance(cluster.get("cluster"), int)
                and isinstance(cluster.get("size"), int) and isinstance(cluster.get("examples", []), list)):
            return None
        mean_map = cluster.get("mean_map")
        mean_path = _inside(out, mean_map) if isinstance(mean_map, str) else None
        mean_url = _url(mean_path.relative_to(out)) if mean_path is not None else None
        if mean_url is None and cluster.get("mean_map_values") is not None:
            drawn = out / REPORT_FOLDER / "strategies" / f"{class_index}-{cluster['cluster']}.png"
            if _draw_mean_map(cluster["mean_map_values"], drawn):
                mean_url = _url(drawn.relative_to(out))
        examples = []
        for example in cluster.get("examples", [])[:8]:
            example_id = str(example)
            record = records.get(example_id)
            examples.append({"id": example_id, "image": record.image if record else "",
                             "thumb": _example_thumbnail(record, class_index, files) if record else None})
        peak = cluster.get("peak")
        shown_clusters.append({
            "cluster": cluster["cluster"], "size": cluster["size"], "meanMap": mean_url,
            "flagged": bool(cluster.get("flagged")), "reason": str(cluster.get("reason") or ""),
            "peak": [float(value) for value in peak] if isinstance(peak, list) and len(peak) == 2
            and all(isinstance(value, (int, float)) and math.isfinite(value) for value in peak) else None,
            "examples": examples,
        })
    name = entry.get("class_name")
    images = entry.get("images")
    eigengap = entry.get("eigengap_clusters")
    return {
        "class": class_index, "name": name if isinstance(name, str) and name else class_names.get(class_index, ""),
        "images": images if isinstance(images, int) else sum(cluster["size"] for cluster in shown_clusters),
        "eigengapClusters": eigengap if isinstance(eigengap, int) else len(shown_clusters),
        "flagged": sum(cluster["flagged"] for cluster in shown_clusters), "clusters": shown_clusters,
    }


def _example_thumbnail(record: ImageRecord, class_index: int, files: dict[str, _ImageFiles]) -> Optional[str]:
    """The thumbnail of an image's map for ``class_index`` (its first map when that class was not explained)."""
    k = next((k for k, target in enumerate(record.targets) if target.class_index == class_index), 0)
    return files[record.id].thumbs[k]


# ---- The page ---------------------------------------------------------------------------------

def _writable_value(value: Any) -> Any:
    """``value`` (JSON's types) with every string, key or value, ``writable``."""
    if isinstance(value, str):
        return writable(value)
    if isinstance(value, dict):
        return {writable(key) if isinstance(key, str) else key: _writable_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_writable_value(item) for item in value]
    return value


def _json_text(value: Any) -> str:
    """``value`` as compact JSON that UTF-8 can write (``writable`` strings)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if LONE_SURROGATE.search(text):  # rare: walk the value only then
        text = json.dumps(_writable_value(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text


def _json_for_html(value: Any) -> str:
    """JSON to sit inside <script type="application/json">: '<', '>' and '&' as \\u escapes, so
    that no text ("</script>") can end the element."""
    text = _json_text(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _percent(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _tiles(summary: Summary, images: Sequence[ImageRecord], low_confidence: float, class_count: int) -> str:
    tiles = [("", f"{summary.images:,}", "images")]
    counts = sorted({len(record.targets) for record in images})
    if counts:
        tiles.append(("", "–".join(str(count) for count in (counts[0], counts[-1]) if count)
                      if counts[0] != counts[-1] else str(counts[0]), "maps per image"))
    if summary.labelled:
        tiles.append(("correct", _percent(summary.accuracy), f"accuracy ({summary.labelled:,} labelled)"))
        tiles.append(("wrong", f"{summary.misclassified:,}", "misclassified"))
    if any(record.confidence is not None for record in images):
        tiles.append(("low", f"{summary.low_confidence:,}", f"confidence below {low_confidence:g}"))
    tiles.append(("", f"{class_count:,}", "classes seen"))
    return "".join(f'<div class="tile {kind}"><div class="value">{escaped(value)}</div>'
                   f'<div class="label">{escaped(label)}</div></div>' for kind, value, label in tiles)


def _class_cell(index: int, names: dict[int, str]) -> str:
    """A table cell naming a class (escaped) with its index."""
    return f'<td class="class-name">{escaped(names.get(index) or f"class {index}")} <small>({index})</small></td>'


def _classes_section(summary: Summary, images: Sequence[ImageRecord], names: dict[int, str]) -> str:
    """The per-class table: accuracy and confusion with labels, prediction counts without. A row
    filters the gallery to its class; the table scrolls beyond 30 rows (1,000 classes of ImageNet
    take about 300 KB)."""
    if summary.labelled:
        rows = sorted((row for row in summary.classes if row.labelled or row.predicted),
                      key=lambda row: (row.accuracy is None, row.accuracy or 0.0, -row.labelled, row.class_index))
        head = ("<th>class</th><th class=n>images</th><th class=n>correct</th><th>accuracy</th>"
                "<th class=n>predicted as it</th><th class=n>precision</th><th>most often mistaken for</th>"
                "<th class=n>mean confidence</th>")
        body = []
        for row in rows:
            confused = ""
            if row.confused_with is not None:
                other, count = row.confused_with
                confused = (f'<button type="button" class="link" data-filter data-label="{row.class_index}" '
                            f'data-predicted="{other}">{escaped(names.get(other) or f"class {other}")} '
                            f'<small>({other})</small> × {count:,}</button>')
            bar = ("" if row.accuracy is None else
                   f'<b class="bar correct"><i style="width:{100 * row.accuracy:.0f}%"></i></b>')
            body.append(
                f'<tr data-filter data-label="{row.class_index}">{_class_cell(row.class_index, names)}'
                f"<td class=n>{row.labelled:,}</td><td class=n>{row.correct:,}</td>"
                f"<td class=nowrap>{bar}{_percent(row.accuracy)}</td><td class=n>{row.predicted:,}</td>"
                f"<td class=n>{_percent(row.precision)}</td><td>{confused}</td>"
                f"<td class=n>{_number_text(row.mean_confidence)}</td></tr>")
        hint = "Worst classes first. A class, or its most frequent mistake, shows its images in the gallery below."
    elif summary.classes:
        rows = sorted(summary.classes, key=lambda row: row.class_index)
        counts = Counter(record.predicted for record in images)
        head = ("<th>predicted class</th><th class=n>images</th><th class=n>mean confidence</th>"
                "<th class=n>low confidence</th>")
        body = [f'<tr data-filter data-predicted="{row.class_index}">{_class_cell(row.class_index, names)}'
                f"<td class=n>{counts[row.class_index]:,}</td><td class=n>{_number_text(row.mean_confidence)}</td>"
                f"<td class=n>{row.low_confidence:,}</td></tr>" for row in rows]
        hint = "The images have no labels: predictions only. A class shows its images in the gallery below."
    else:
        explained = Counter(index for record in images if (index := record.targets[0].class_index) is not None)
        if not explained:
            return ""
        head = "<th>explained class (first map)</th><th class=n>images</th>"
        body = [f'<tr data-filter data-explained="{index}">{_class_cell(index, names)}<td class=n>{count:,}</td></tr>'
                for index, count in sorted(explained.items())]
        hint = "The index records no labels or predictions: the classes of each image's first map."
    scroll = " scroll" if len(body) > 30 else ""
    return (f'<section id="classes"><h2>Classes</h2><p class="hint">{hint}</p><div class="panel-box{scroll}">'
            f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div></section>')


def _number_text(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.3f}"


def _confusion_section(summary: Summary, names: dict[int, str], matrix_classes: int) -> str:
    """The confusion matrix as a table (rows: true class, columns: predicted, shaded by the row's
    share), or the most frequent confusions when there are more than ``matrix_classes`` classes."""
    if not summary.labelled:
        return ""
    classes = sorted({index for pair in summary.confusion for index in pair})
    if len(classes) <= matrix_classes:
        totals: Counter[int] = Counter()
        for (truth, _), count in summary.confusion.items():
            totals[truth] += count
        header = "".join(f'<th title="{escaped(names.get(index) or f"class {index}")}">'
                         f'{escaped(names.get(index) or f"class {index}")}</th>' for index in classes)
        rows = []
        for truth in classes:
            cells = []
            for guess in classes:
                count = summary.confusion.get((truth, guess), 0)
                share = count / totals[truth] if totals[truth] else 0.0
                kind = "diagonal" if truth == guess else ""
                if count == 0:
                    cells.append(f'<td class="empty {kind}">0</td>')
                    continue
                colour = "27, 127, 59" if truth == guess else "192, 57, 43"
                text_colour = "#fff" if share > 0.55 else "inherit"
                title = (f"true {names.get(truth) or truth}, predicted {names.get(guess) or guess}: {count} image(s), "
                         f"{100 * share:.1f} % of the class")
                cells.append(f'<td class="{kind}" data-filter data-label="{truth}" data-predicted="{guess}" '
                             f'title="{escaped(title)}" style="background: rgba({colour}, {0.08 + 0.82 * share:.2f}); '
                             f'color: {text_colour}">{count:,}</td>')
            label = names.get(truth) or f"class {truth}"
            rows.append(f'<tr><th class="row" title="{escaped(label)}">{escaped(label)}</th>{"".join(cells)}</tr>')
        table = (f'<table class="confusion"><caption>rows: true class · columns: predicted class · shade: share of '
                 f'the row</caption><thead><tr><th></th>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>')
        hint = "A cell shows its images in the gallery below."
    else:
        mistakes = sorted(((count, truth, guess) for (truth, guess), count in summary.confusion.items()
                           if truth != guess), key=lambda item: (-item[0], item[1], item[2]))[:25]
        body = "".join(f'<tr data-filter data-label="{truth}" data-predicted="{guess}">{_class_cell(truth, names)}'
                       f"{_class_cell(guess, names)}<td class=n>{count:,}</td></tr>"
                       for count, truth, guess in mistakes)
        table = (f'<table class="data"><thead><tr><th>true class</th><th>predicted as</th><th class=n>images'
                 f'</th></tr></thead><tbody>{body}</tbody></table>')
        hint = (f"{len(classes)} classes: too many for a matrix, so the 25 most frequent confusions. A count shows "
                "its images in the gallery below.")
    return (f'<section id="confusion"><h2>Confusion</h2><p class="hint">{hint}</p>'
            f'<div class="panel-box">{table}</div></section>')


def _strategies_section(strategies: Optional[dict[str, Any]]) -> str:
    if strategies is None:
        return ""
    flagged = sum(entry["flagged"] for entry in strategies["classes"])
    hint = (f"How the model decides, per class: the maps of each class grouped into clusters (one strategy each), "
            f"with their mean map and most typical images. {len(strategies['classes'])} class(es) analysed, "
            f"{flagged} cluster(s) flagged, shown first.")
    skipped = strategies["skipped"]
    not_analysed = ""
    if skipped:  # a class too small to analyse is not a class without a flagged cluster
        listed = "; ".join(f"{entry['name'] or 'class ' + str(entry['class'])} ({entry['class']}): {entry['reason']}"
                           for entry in skipped[:MAX_NOTES_SHOWN])
        more = f"; … and {len(skipped) - MAX_NOTES_SHOWN} more" if len(skipped) > MAX_NOTES_SHOWN else ""
        not_analysed = (f'<p class="hint" id="strategies-skipped">{len(skipped)} class(es) not analysed, so '
                        f'nothing is known of their strategies: {escaped(listed + more)}</p>')
    return (f'<section id="strategies"><h2>Strategies</h2><p class="hint">{escaped(hint)}</p>{not_analysed}'
            '<div class="strategy-controls"><label><input type="checkbox" id="strategies-flagged"> flagged only'
            '</label><span class="pager" id="strategies-pager"><button type="button" class="previous">‹ Previous'
            '</button><span class="page-number"></span><button type="button" class="next">Next ›</button></span>'
            '</div><div id="strategies-list"></div></section>')


def _select(identifier: str, label: str, options: Iterable[tuple[str, str]], kind: str = "") -> str:
    """A labelled <select> of the toolbar; the class selects are filled by the page's script."""
    choices = "".join(f'<option value="{escaped(value)}">{escaped(text)}</option>' for value, text in options)
    return f'<label>{escaped(label)}<select id="{identifier}" class="{kind}">{choices}</select></label>'


def _gallery_pager(position: str) -> str:
    """The gallery's page buttons, above ("top") or below ("bottom") it; the page's script runs both."""

    def button(kind: str, title: str, text: str) -> str:
        return f'<button type="button" class="{kind}" title="{title}">{text}</button>'

    return (f'<span class="pager gallery-pager {position}">{button("first", "First page", "«")}'
            f'{button("previous", "Previous page", "‹ Previous")}<span class="page-number"></span>'
            f'{button("next", "Next page", "Next ›")}{button("last", "Last page", "»")}</span>')


def _toolbar(meta: dict[str, Any], page_size: int, has_confidence: bool) -> str:
    parts = []
    if meta["hasLabels"]:
        parts.append(_select("filter-label", "True class", [("-2", "any")], "classes"))
    if meta["hasPredictions"]:
        parts.append(_select("filter-predicted", "Predicted class", [("-2", "any")], "classes"))
    else:
        parts.append(_select("filter-explained", "Explained class", [("-2", "any")], "classes"))
    correctness = [("all", "all images")]
    if meta["hasLabels"]:
        correctness += [("wrong", "misclassified"), ("correct", "correct"), ("unlabelled", "without label")]
    if has_confidence:
        correctness.append(("low", f"confidence below {meta['lowConfidence']:g}"))
    parts.append(_select("filter-correctness", "Show", correctness))
    if has_confidence:
        parts.append('<label>Confidence from<input type="number" id="filter-confidence-min" min="0" max="1" '
                     'step="0.05" placeholder="0"></label><label>to<input type="number" id="filter-confidence-max" '
                     'min="0" max="1" step="0.05" placeholder="1"></label>')
    sorts = [("default", "misclassified, then least confident" if meta["hasLabels"] else "least confident first"
              if has_confidence else "index order")]
    if has_confidence:
        sorts += [("confidence-ascending", "confidence, lowest first"),
                  ("confidence-descending", "confidence, highest first")]
    if meta["hasLabels"]:
        sorts.append(("label", "true class"))
    sorts += [("predicted", "predicted class" if meta["hasPredictions"] else "explained class"), ("name", "file name")]
    parts.append(_select("sort", "Sort by", sorts))
    sizes = sorted(set(PAGE_SIZES) | {page_size})
    parts.append(_select("page-size", "Per page", [(str(size), str(size)) for size in sizes]))
    parts.append('<span class="spacer"></span><button type="button" class="reset" id="reset-filters">Reset</button>')
    return "".join(parts)


def _page(out: Path, title: Optional[str], method: str, images: Sequence[ImageRecord], summary: Summary,
          meta: dict[str, Any], strategies: Optional[dict[str, Any]], notes: list[str], has_label_columns: bool,
          page_size: int, matrix_classes: int) -> str:
    names = {int(index): name for index, name in meta["classes"]}
    has_confidence = any(record.confidence is not None for record in images)
    classes_seen = len({index for record in images for index in
                        [record.label, record.predicted, *(target.class_index for target in record.targets)]
                        if index is not None})
    title = title or f"Explanations of {out.resolve().name or out}"
    subtitle = f"{display_name(out.resolve())}" + (f" · {method}" if method else "") + f" · {len(images):,} images"
    sections = {
        "classes": _classes_section(summary, images, names),
        "confusion": _confusion_section(summary, names, matrix_classes),
        "strategies": _strategies_section(strategies),
    }
    navigation = [("#summary", "Summary")] + [(f"#{key}", key.capitalize()) for key, text in sections.items() if text]
    navigation.append(("#gallery-section", "Images"))
    notes_html = ""
    shown_notes = list(notes)
    if not has_label_columns:
        shown_notes.append("The index has no label and prediction columns (written by an older explain): accuracy, "
                           "confusion and confidence are not available; run explain batch again to get them.")
    if shown_notes:
        items = "".join(f"<li>{escaped(note)}</li>" for note in shown_notes[:MAX_NOTES_SHOWN])
        more = (f"<li>… and {len(shown_notes) - MAX_NOTES_SHOWN} more</li>" if len(shown_notes) > MAX_NOTES_SHOWN
                else "")
        notes_html = f'<section id="notes" class="notes"><strong>Notes</strong><ul>{items}{more}</ul></section>'
    if meta["hasLabels"]:
        gallery_hint = ("Misclassified images first (the most confident mistakes first), then the others from the "
                        "least confident. Click an image for its details.")
    elif has_confidence:
        gallery_hint = "The least confident images first. Click an image for its details."
    else:
        gallery_hint = "Click an image for its details."
    template = string.Template((ASSETS / "report.html").read_text(encoding="utf-8"))
    return template.substitute(
        title=escaped(title), subtitle=escaped(subtitle), folder=REPORT_FOLDER,
        navigation="".join(f'<a href="{href}">{escaped(text)}</a>' for href, text in navigation),
        notes=notes_html, tiles=_tiles(summary, images, meta["lowConfidence"], classes_seen), **sections,
        gallery_hint=escaped(gallery_hint), toolbar=_toolbar(meta, page_size, has_confidence),
        pager_top=_gallery_pager("top"), pager_bottom=_gallery_pager("bottom"),
        footer=escaped(f"Written by explain report on {time.strftime('%Y-%m-%d %H:%M')}."),
        meta=_json_for_html(meta),
    )


# ---- Command line -----------------------------------------------------------------------------

def main_report(argv: Sequence[str]) -> int:
    """``explain report OUT``: write OUT/report.html from a batch run's index and maps."""
    parser = argparse.ArgumentParser(
        prog="explain report", description=main_report.__doc__,
        epilog="Open OUT/report.html in a browser: it needs no server and no network.")
    parser.add_argument("out", metavar="OUT", help="the output folder of `explain batch`")
    parser.add_argument("--page-size", type=int, default=48, help="images per gallery page (default 48)")
    parser.add_argument("--thumbnail-size", type=int, default=160, help="thumbnail size in pixels (default 160)")
    parser.add_argument("--low-confidence", type=float, default=0.5,
                        help="confidences below this are marked low (default 0.5)")
    parser.add_argument("--method",
                        help="the method's name shown with each map (default: the one OUT/run.json records)")
    parser.add_argument("--title", help="the page's title")
    arguments = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = report(arguments.out, page_size=arguments.page_size, thumbnail_size=arguments.thumbnail_size,
                            low_confidence=arguments.low_confidence, method=arguments.method, title=arguments.title)
    except (ValueError, OSError) as error:
        print(f"explain: error: {error}", file=sys.stderr)
        return 2
    for note in result.notes[:MAX_NOTES_SHOWN]:
        print(f"note: {note}", file=sys.stderr)
    print(f"{result.images:,} image(s); thumbnails: {result.thumbnails_made:,} made, "
          f"{result.thumbnails_reused:,} reused; {result.seconds:.1f} s. Open {result.page.resolve().as_uri()}")
    return 0
