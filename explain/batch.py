"""Explain a whole folder or DataLoader, writing results to disk: resumable, bounded memory,
sharded across processes under ``torchrun``, safe against ``kill -9`` at any moment; with the
images' true labels, explain the true class, the predicted one, or both where they differ.

Output folder layout:

    OUT/index.csv            one row per image and explained target (written by rank 0 when sharded):
                               id, image, target, k, targets, class_name, score, probability, map,
                               label, label_name, predicted, predicted_name, confidence, correct, role
    OUT/maps/<id>.npy        float16 (K, H, W) maps in [0, 1] at the input's resolution
    OUT/overlays/<id>.png    heatmap overlays, K side by side, each under a caption: its role and
                             class, score and probability, method (with overlays=True)
    OUT/skipped.csv          files that could not be read as images, with the reason
    OUT/run.json             how the images are explained: the method, the target, where the labels
                             come from, the class names (see ``RunRecord``); a resumed run must agree
    OUT/index.rank<R>.csv    each process's rows when run under torchrun (merged into index.csv)
    OUT/skipped.rank<R>.csv  each process's skipped files under torchrun (merged into skipped.csv)

The index's columns: ``target`` the class explained (its name ``class_name``, the model's
``score`` for it and its softmax ``probability``), row ``k`` of the image's ``targets`` = K rows,
``map`` the image's maps file (row k is map k); ``label`` and ``label_name`` the true class (empty
when the image has no label), ``predicted`` and ``predicted_name`` the model's top-1 class,
``confidence`` its softmax probability in [0, 1], ``correct`` "1" or "0" (empty without a label),
and ``role``, why the row's class was explained: "label" (the true class), "predicted", "given"
(``target=``) or "topk". With labels (``labels=``, see ``explain.labels``) an image the model gets
wrong has two rows, its label's map then its predicted class's, and an image it gets right one,
the predicted class; ``target="label"`` or ``"predicted"`` explains only that one. Without
labels the predicted class is explained, as by ``explain``. Prediction columns are empty for
targets that are not classes (a callable target of a segmentation model).

Hidden files and folders (names starting with ".", such as ``.ipynb_checkpoints/``) are not
explained. An image is done when its K rows (k = 0 … K−1, ``targets`` = K) are in an index: a
rerun skips it, so an interrupted run resumes where it stopped, also after the index was opened
and saved by another program (CRLF or LF line endings, a UTF-8 byte-order mark: rows are
appended in the file's own line ending). A full disk stops the run with an ``OSError`` that says
so; the index then holds exactly the images whose files were written, and the same run after
freeing space finishes the rest. Writes are ordered so that a kill
at any moment leaves a consistent folder: map and overlay files are written to a temporary
name and renamed into place before the image's rows, an image's rows go to the index in one
write, and a resumed run first cuts an index back to its last complete image (a kill can tear
the last line). An index written by an earlier version of explain (without the label columns)
is not resumed: the run stops with an error saying to move it away (``read_index`` still reads
it, with empty label columns). A file's id is its path relative to the folder, made safe as a
file name, plus a short hash of that path, so that ``cat.png`` and ``cat.jpg``, or ``a/b.png``
and ``a__b.png``, never share files; a DataLoader's images get the ids of their files when the
batches or the dataset name them (the ids of the same folder's run), else their position
(``00000000``, ...).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm.auto import tqdm

from . import render
from .capture import ModelInputError, model_device, model_dtype, preserved_model_state
from .explanation import Explanation
from .inputs import load_image, prepare_inputs
from .labels import (
    DatasetOrder,
    LabelError,
    LabelSource,
    dataset_label_numbering,
    dataset_order,
    folder_labels,
    split_loader_batch,
)
from .methods.base import Explainer, progress_shown_by_caller, setting_text
from .targets import Target, class_index

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
EARLIER_FIELDS = ["id", "image", "target", "k", "targets", "class_name", "score", "probability", "map"]
"""The columns of an index written before the label columns were added."""
LABEL_FIELDS = ["label", "label_name", "predicted", "predicted_name", "confidence", "correct", "role"]
FIELDS = EARLIER_FIELDS + LABEL_FIELDS
TARGET_MODES = ("label", "predicted", "both")
"""The words ``target=`` (``--target``) takes besides classes: explain each image's true class, its
predicted class, or both where they differ."""
ROLE_CAPTIONS = {"label": "true", "predicted": "predicted", "given": "target", "topk": "top"}
"""Each role as an overlay caption starts."""
BYTE_ORDER_MARK = b"\xef\xbb\xbf"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SKIPPED_FIELDS = ["image", "reason"]
RUN_RECORD = "run.json"
"""The file of an output folder that records how its images are explained (see ``RunRecord``)."""

LoaderBatch = Union[Tensor, tuple[Any, ...], list[Any], Mapping[str, Any]]
"""A batch of a DataLoader: (N, C, H, W) model input; a tuple or list whose first item is that,
with (N,) labels and N file names after it ((images, labels) pairs); or a dict (see
``explain.labels``)."""


@dataclass
class Shard:
    """This process's part of the data set: items ``rank``, ``rank + world_size``, …"""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls) -> "Shard":
        """torch.distributed's rank and world size when initialised, else torchrun's RANK and
        WORLD_SIZE variables, else a single shard."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


@dataclass
class RunSummary:
    """What a run did. index: this process's index file; explained: images explained by this
    run; already_done: images skipped because an earlier run had explained them; skipped:
    files that could not be read (listed with the reason in ``skipped_file``); labels: where the
    labels came from and how their classes were numbered ("" without labels); labelled and
    misclassified: how many of this run's images had a label, and a label other than the
    model's prediction."""

    index: Path
    explained: int = 0
    already_done: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_file: Optional[Path] = None
    labels: str = ""
    labelled: int = 0
    misclassified: int = 0


@dataclass
class _Batch:
    """One batch of a run: ids, the files to load or the model-input batch, display names, and a
    label per image (None: no label)."""

    ids: list[str]
    inputs: Union[list[Path], Tensor]
    names: list[str]
    labels: list[Optional[int]]


@dataclass
class _TargetPlan:
    """What to explain for each image. mode: "given" (``target``), "topk", "label", "predicted" or
    "both" (the label and the prediction where they differ, the prediction alone otherwise);
    labels_required: the caller asked for labels explicitly (target="label" or "both")."""

    mode: str
    target: Target = None
    topk: Optional[int] = None
    labels_required: bool = False
    class_count: Optional[int] = None
    """The model's number of classes, once known (to check labels against)."""
    classifier: bool = True
    """False once the model's output is seen not to be (N, C) class scores: no predictions then."""


@dataclass
class _ImageResult:
    """An image's K explained targets, ready to write: maps (K, H, W) in [0, 1] on the CPU; image()
    its display image (H, W, 3) in [0, 1] (made when an overlay needs it); per target its class
    (None for a callable target), score, probability and role; the model's prediction and its
    confidence (None when unknown)."""

    maps: Tensor
    image: Callable[[], Tensor]
    targets: list[Optional[int]]
    scores: list[float]
    probabilities: list[Optional[float]]
    roles: list[str]
    predicted: Optional[int]
    confidence: Optional[float]
    method: str


def display_name(path: Union[str, Path]) -> str:
    """A path as one line of text that can always be written: bytes that are not UTF-8, and
    control characters (a newline in a file name), appear as \\x escapes."""
    return one_line(os.fsencode(path).decode("utf-8", "backslashreplace"))


def one_line(text: str) -> str:
    """Text with its control characters (a newline, a tab) as \\x escapes: one line of an index
    row or of a caption."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda match: f"\\x{ord(match.group()):02x}", text)


def item_id(path: Path, folder: Path) -> str:
    """A stable, unique, file-name-safe id: the relative path (separators as "__", other unsafe
    characters as "_") and 8 hex digits of a hash of the exact relative path."""
    relative = path.relative_to(folder)
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", "__".join(display_name(part) for part in relative.parts))
    digest = hashlib.sha1(os.fsencode(relative)).hexdigest()[:8]
    return f"{readable[-100:]}-{digest}"


def _path_id(path: str, root: Optional[Path]) -> str:
    """The id of a DataLoader image's file: ``item_id`` relative to the dataset's folder when it
    lies inside it (the id a run over that folder gives), else of the path as it is written."""
    file = Path(path)
    if root is not None and file.is_relative_to(root):
        return item_id(file, root)
    return item_id(file, Path(file.anchor) if file.is_absolute() else Path())


def image_files(folder: Union[str, Path], exclude: Optional[Union[str, Path]] = None) -> list[Path]:
    """Every image file under ``folder`` (recursively, into linked folders too, as torchvision's
    ``ImageFolder`` goes: a class folder may be a symbolic link; each folder once, so that a link
    to a folder above cannot loop), sorted; hidden files and files in hidden folders (a name
    starting with ".": ``.ipynb_checkpoints/``, ``.git/``) and files under ``exclude`` (the output
    folder, when it lies inside the input folder) are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {display_name(folder)!r}.")
    excluded = Path(exclude).resolve() if exclude is not None else None
    files: list[Path] = []
    visited: set[Path] = set()
    for root, folders, names in os.walk(folder, followlinks=True):
        real = Path(root).resolve()
        if real in visited or (excluded is not None and real.is_relative_to(excluded)):
            folders.clear()
            continue
        visited.add(real)
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
                continue
            if excluded is not None and path.resolve().is_relative_to(excluded):
                continue
            files.append(path)
    return sorted(files)


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary)`` then rename into place: a kill leaves the old file or the new one, a
    failed write (a full disk) the old one and no temporary file."""
    temporary = path.with_name(f".{path.name}.part")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def index_line_ending(index: Path) -> str:
    """The line ending of an index's header ("\r\n", as written by explain, or "\n"), so that rows
    are appended in the file's own. An index that does not exist yet gets "\r\n"."""
    if not index.exists():
        return "\r\n"
    with open(index, "rb") as file:
        first = file.readline()
    return "\r\n" if first.endswith(b"\r\n") or not first.endswith(b"\n") else "\n"


def _header_fields(line: bytes) -> list[str]:
    """The fields of an index's first line, whatever its line ending or byte-order mark."""
    text = line.removeprefix(BYTE_ORDER_MARK).decode("utf-8", "replace")
    return next(csv.reader([text]), [])


def _is_header(line: bytes) -> bool:
    """Whether a line is the index header: the FIELDS, whatever the line ending or byte-order mark."""
    if not line.endswith(b"\n"):
        return False  # torn, or old Mac "\r" line endings, which would make the whole file one line
    return _header_fields(line) == FIELDS


def _refuse_an_earlier_index(index: Path, first_line: bytes) -> None:
    """Raise when an index was written by an earlier version of explain (without the label
    columns): its rows cannot be resumed with them; say how to go on."""
    if _header_fields(first_line) == EARLIER_FIELDS:
        raise ValueError(
            f"{display_name(index)} was written by an earlier version of explain: it lacks the label columns "
            f"({', '.join(LABEL_FIELDS)}), so this run cannot add to it. Move it out of the way (rename it, e.g. to "
            "earlier-index.csv, or choose another output folder) and run again: the images are explained anew. "
            "explain.batch.read_index still reads it, with empty label columns."
        )


def _complete_rows(index: Path) -> list[dict[str, str]]:
    """The rows of an index that form complete images, after cutting the file back to the end of
    its last complete image (a kill while appending can leave a torn line or part of an image's
    rows). Creates the index, with its header, when it does not exist. The header is compared by
    its fields: CRLF or LF line endings and a UTF-8 byte-order mark are accepted."""
    header = (",".join(FIELDS) + "\r\n").encode()
    if not index.exists():
        write_atomically(index, lambda temporary: temporary.write_bytes(header))
        return []
    lines = index.read_bytes().splitlines(keepends=True)
    if lines and lines[0].endswith(b"\n"):
        _refuse_an_earlier_index(index, lines[0])
    if not lines or not _is_header(lines[0]):
        raise ValueError(
            f"{display_name(index)} is not an index of this version of explain (its first line is not the "
            f"header {header.decode().strip()!r}, ending in CRLF or LF); move it away or choose another output folder."
        )
    rows: list[dict[str, str]] = []
    pending: list[dict[str, str]] = []
    position = end = len(lines[0])
    for line in lines[1:]:
        position += len(line)
        if not line.endswith(b"\n"):
            break  # torn by a kill
        values = next(csv.reader([line.decode("utf-8", "replace")]), [])
        row = dict(zip(FIELDS, values))
        if len(values) != len(FIELDS) or not (row["k"].isdigit() and row["targets"].isdigit()):
            break
        if int(row["k"]) != len(pending) or (pending and row["id"] != pending[0]["id"]):
            break
        pending.append(row)
        if len(pending) == int(row["targets"]):
            rows.extend(pending)
            pending, end = [], position
    if end < sum(len(line) for line in lines):
        with open(index, "r+b") as file:
            file.truncate(end)
    return rows


def _indexes(out: Path) -> list[Path]:
    """The index files of an output folder: index.csv and the ranks' index.rank<R>.csv."""
    return sorted(path for path in out.glob("index*.csv") if re.fullmatch(r"index(\.rank\d+)?\.csv", path.name))


def _done_ids(out: Path, own_index: Path) -> set[str]:
    """Ids of the images complete in this process's index (cut back to its last complete image)
    and in the other indexes of the folder (other ranks, the merged index)."""
    others = [index for index in _indexes(out) if index != own_index]
    for index in others:  # refused before this process's index is created or cut
        with open(index, "rb") as file:
            _refuse_an_earlier_index(index, file.readline())
    done = {row["id"] for row in _complete_rows(own_index)}
    for index in others:
        done.update(row["id"] for row in read_index(index))
    return done


def _check_labels_unchanged(out: Path, label_of: Mapping[str, Optional[int]]) -> None:
    """LabelError when an image already in the folder's indexes has another label now (``label_of``:
    each image id's label, None for none): a label file edited between two runs. Those images are
    not explained again, so their rows, and the maps of a misclassified image, would keep the earlier
    labels."""
    changed = []
    for index in _indexes(out):
        for row in read_index(index):
            if row["k"] != "0" or row["id"] not in label_of:
                continue
            now = label_of[row["id"]]
            if row["label"] != ("" if now is None else str(now)):
                changed.append(f"{row['image']} ({row['label'] or 'no label'} in the index, "
                               f"{'no label' if now is None else now} now)")
    if changed:
        shown = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise LabelError(f"{display_name(out)}: {len(changed)} image(s) already explained have another label now: "
                         f"{shown}. Images already done are not explained again, so their rows and maps would keep "
                         "the earlier labels: give another output folder to explain them with these labels, or go "
                         "on with the earlier ones.")


@dataclass
class IndexContents:
    """An index read back. rows: the rows of its complete images in file order, each a dict with
    every one of FIELDS ("" for a column the index lacks: no label, prediction unknown);
    has_label_columns: whether it has every one of LABEL_FIELDS (False for an index written before
    them); incomplete: ids of the images whose rows are not all there, in file order (a run in
    progress, a line torn by a kill)."""

    rows: list[dict[str, str]]
    has_label_columns: bool
    incomplete: list[str]


def read_index_contents(path: Union[str, Path]) -> IndexContents:
    """Read an index of this version or of an earlier one (without the label columns), keeping the
    images whose K rows are all there: rows k = 0 … K−1, each saying ``targets`` = K, none cut
    short. Raises ValueError for a file that is not an index (it lacks one of EARLIER_FIELDS)."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as file:
        reader = csv.DictReader(file)
        columns = list(reader.fieldnames or [])
        missing = [name for name in EARLIER_FIELDS if name not in columns]
        if missing:
            raise ValueError(f"{display_name(path)} is not an index written by explain: it lacks the column(s) "
                             f"{', '.join(missing)} (its header is {','.join(columns)[:200]!r}; an index's is "
                             f"{','.join(FIELDS)!r}, or {','.join(EARLIER_FIELDS)!r} before the label columns).")
        read = list(reader)
    by_id: dict[str, list[dict[str, Optional[str]]]] = {}
    for row in read:
        by_id.setdefault(row["id"] or "", []).append(row)
    incomplete = [image_id for image_id, rows in by_id.items() if not _is_complete_image(image_id, rows)]
    left_out = set(incomplete)
    rows = [{name: row.get(name) or "" for name in FIELDS} for row in read if (row["id"] or "") not in left_out]
    return IndexContents(rows, all(name in columns for name in LABEL_FIELDS), incomplete)


def _is_complete_image(image_id: str, rows: list[dict[str, Optional[str]]]) -> bool:
    """Whether an image's index rows are its K rows k = 0 … K−1, each saying ``targets`` = K, none cut
    short or longer than the header (csv.DictReader gives a short row None values, a long one a None key)."""
    if not image_id or any(None in row or None in row.values() for row in rows):
        return False
    count = rows[0]["targets"] or ""
    if not count.isdigit() or any(row["targets"] != count for row in rows):
        return False
    ks = sorted(int(k) if k.isdigit() else -1 for k in (row["k"] or "" for row in rows))
    return ks == list(range(int(count)))


def read_index(path: Union[str, Path]) -> list[dict[str, str]]:
    """The rows of an index (of this version, or of an earlier one without the label columns) that
    form complete images, each a dict with every one of FIELDS; a column the index lacks is ""
    (no label, prediction unknown). Raises ValueError for a file that is not an index. See
    ``read_index_contents`` for which images are left out and whether the label columns are there."""
    return read_index_contents(path).rows


def _batches_of_files(files: Sequence[Path], folder: Path, batch_size: int,
                      labels: Optional[dict[Path, int]]) -> Iterator[_Batch]:
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        yield _Batch([item_id(path, folder) for path in chunk], list(chunk), [display_name(path) for path in chunk],
                     [None if labels is None else labels.get(path.relative_to(folder)) for path in chunk])


def _batches_of_loader(loader: Iterable[LoaderBatch], order: DatasetOrder, shard: Shard, plan: _TargetPlan,
                       summary: RunSummary, class_names: Optional[Sequence[str]]) -> Iterator[_Batch]:
    """The loader's batches, each image named by its file when the batch or the dataset (``order``)
    says which (see ``explain.labels``), else by its position; this process's share under torchrun.
    Labels numbered by the dataset otherwise than by the model (``dataset_label_numbering``, with
    the model's ``class_names``) are renumbered by name."""
    numbering = dataset_label_numbering(order, class_names)
    renumbered = "" if numbering is None or order.classes is None else (
        ", renumbered from the dataset's classes to the model's of the same name: " + ", ".join(
            f"{order.classes[old]} {old}→{new}" for old, new in numbering.items() if old != new))
    position = 0
    warned = False
    for batch in loader:
        items = split_loader_batch(batch)
        count = len(items.images)
        if items.labels is None and plan.labels_required:
            raise LabelError(f"target={plan.mode!r} explains the images' true classes, and the DataLoader's batches "
                             "carry no labels: give (images, labels) batches, or target='predicted'.")
        if items.labels is not None and not summary.labels:
            summary.labels = "labels: from the DataLoader's batches" + renumbered
        paths = items.paths
        if paths is None and order.paths is not None:
            if position + count > len(order.paths):
                raise LabelError(f"the DataLoader gave more images ({position + count}) than its dataset's samples "
                                 f"list ({len(order.paths)}), so their files cannot be named: let the batches carry "
                                 "the file names, (images, labels, paths).")
            paths = order.paths[position : position + count]
        if paths is None and order.shuffled and not warned:
            warnings.warn(
                "the DataLoader does not read its dataset in order (shuffle=True or another sampler) and its batches "
                "carry no file names, so the images cannot be named by their files: their ids are their positions in "
                "this run's order, which a rerun would give to other images (so it would not resume). Use "
                "shuffle=False, or let the dataset return the file name with each image, (image, label, path).",
                stacklevel=4)
            warned = True
        ids = ([_path_id(path, order.root) for path in paths] if paths is not None
               else [f"{position + offset:08d}" for offset in range(count)])
        names = [display_name(path) for path in paths] if paths is not None else ids
        labels = items.labels if items.labels is not None else [None] * count
        if numbering is not None:  # the dataset's numbering of the classes, as the model's
            labels = [None if label is None else numbering.get(label, label) for label in labels]
        keep = [offset for offset in range(count) if (position + offset) % shard.world_size == shard.rank]
        position += count
        if keep:
            images = items.images[keep] if len(keep) < count else items.images
            yield _Batch([ids[i] for i in keep], images, [names[i] for i in keep], [labels[i] for i in keep])


@dataclass(frozen=True)
class RunRecord:
    """How a run explains its images, written to OUT/run.json (``RUN_RECORD``) when it starts, so
    that a resumed run can be checked against the images already done and the report can name the
    method.

    method: the method's registry name, as ``--method`` takes it ("gradcam"; "" for a method that
    is not registered); method_class: its class name ("GradCAM"); class_names: the model's class
    names by index (None when unknown); target: what each image's maps explain, {"mode": one of
    "both", "label", "predicted", "given", "topk"}, with "target" (the class(es) given, class names
    as indices where the names are known; a callable by its name) for "given" and "topk" (K) for
    "topk"; labels: where the true labels come from ("none", "class folders", "the file NAME",
    "a mapping", "the DataLoader's batches"); settings: the explainer's options
    (``setting_text(explainer)``: "GradCAM(layer=..., relu=True, ...)"; None in a record written before
    explain recorded them).
    """

    method: str
    method_class: str
    class_names: Optional[list[str]]
    target: dict[str, Any]
    labels: str
    settings: Optional[str] = None

    def to_text(self) -> str:
        """The record as run.json holds it: JSON, one setting a line (class names on one line)."""
        fields = asdict(self)
        lines = [f"  {json.dumps(name)}: {json.dumps(value, ensure_ascii=False)}" for name, value in fields.items()]
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RunRecord":
        """A record from run.json's parsed JSON; ValueError naming ``where`` when a field is missing
        or of the wrong type (more fields are allowed: a later version's)."""
        checks = {
            "method": lambda value: isinstance(value, str),
            "method_class": lambda value: isinstance(value, str),
            "class_names": lambda value: value is None or (isinstance(value, list)
                                                           and all(isinstance(name, str) for name in value)),
            "target": lambda value: isinstance(value, dict) and isinstance(value.get("mode"), str),
            "labels": lambda value: isinstance(value, str),
        }
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not a run record of explain: it holds {type(data).__name__}, not an object.")
        wrong = [name for name, check in checks.items() if name not in data or not check(data[name])]
        if wrong:
            raise ValueError(f"{where} is not a run record of explain: its field(s) {', '.join(wrong)} are missing or "
                             "of the wrong type.")
        settings = data.get("settings")
        if settings is not None and not isinstance(settings, str):
            raise ValueError(f"{where} is not a run record of explain: its field settings is of the wrong type.")
        return cls(**{name: data[name] for name in checks}, settings=settings)

    def differences(self, earlier: "RunRecord") -> list[str]:
        """What this run does otherwise than ``earlier``, one line a setting ("method: 'gradcam'
        (GradCAM) earlier, 'saliency' (Saliency) now")."""
        found = []
        if (self.method, self.method_class) != (earlier.method, earlier.method_class):
            found.append(f"method: {earlier.method!r} ({earlier.method_class}) earlier, {self.method!r} "
                         f"({self.method_class}) now")
        elif None not in (self.settings, earlier.settings) and self.settings != earlier.settings:
            found.append(f"method settings: {earlier.settings} earlier, {self.settings} now")
        if self.target != earlier.target:
            found.append(f"target: {_target_text(earlier.target)} earlier, {_target_text(self.target)} now")
        if self.labels != earlier.labels:
            found.append(f"labels: {earlier.labels} earlier, {self.labels} now")
        if self.class_names != earlier.class_names:
            found.append(f"class names: {_names_text(earlier.class_names, self.class_names)}")
        return found


def _target_text(target: dict[str, Any]) -> str:
    details = ", ".join(f"{name} {value!r}" for name, value in target.items() if name != "mode")
    return f"{target.get('mode')!r}" + (f" ({details})" if details else "")


def _names_text(earlier: Optional[list[str]], now: Optional[list[str]]) -> str:
    """How two lists of class names differ, in a few words."""
    if earlier is None or now is None or len(earlier) != len(now):
        def count(names: Optional[list[str]]) -> str:
            return "none" if names is None else f"{len(names)}"
        return f"{count(earlier)} earlier, {count(now)} now"
    index = next(index for index, (before, after) in enumerate(zip(earlier, now)) if before != after)
    return f"class {index} is {earlier[index]!r} earlier, {now[index]!r} now"


def read_run_record(out: Union[str, Path]) -> Optional[RunRecord]:
    """OUT/run.json, or None where there is none (a folder written before explain wrote it).
    Raises ValueError for a file that is not a run record."""
    path = Path(out) / RUN_RECORD
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{display_name(path)} cannot be read ({error_line(error)}).") from error
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{display_name(path)} is not JSON ({error_line(error)}).") from error
    return RunRecord.from_json(data, display_name(path))


def _run_record(explainer: Explainer, plan: _TargetPlan, data: Union[str, Path, Iterable[LoaderBatch]],
                labels: LabelSource, class_names: Optional[Sequence[str]]) -> RunRecord:
    """What this run explains (see ``RunRecord``)."""
    if not isinstance(data, (str, Path)):
        source = "the DataLoader's batches"
    elif labels is None:
        source = "none"
    elif isinstance(labels, Mapping):
        source = "a mapping"
    elif isinstance(labels, str) and labels == "folders":
        source = "class folders"
    else:
        source = f"the file {display_name(Path(labels).name)}"
    target: dict[str, Any] = {"mode": plan.mode}
    if plan.mode == "topk":
        target["topk"] = plan.topk
    elif plan.mode == "given":
        target["target"] = _target_as_json(plan.target, class_names)
    names = None if class_names is None else [str(name) for name in class_names]
    return RunRecord(explainer.name, type(explainer).__name__, names, target, source, setting_text(explainer))


def _target_as_json(target: Target, class_names: Optional[Sequence[str]]) -> Any:
    """A given target as JSON: class indices as ints (a class name as its index where the names are
    known, so that "cat" and 3 are the same target), a tensor as nested lists, a callable by its name."""
    if isinstance(target, Tensor):
        return target.tolist()
    if isinstance(target, (int, np.integer)):
        return int(target)
    if isinstance(target, str):
        try:
            return class_index(target, class_names)
        except ValueError:
            return target
    if isinstance(target, Sequence):
        return [_target_as_json(item, class_names) for item in target]
    return f"callable {getattr(target, '__qualname__', type(target).__qualname__)}"


def _check_and_record_run(out: Path, record: RunRecord, shard: Shard, images_done: bool) -> None:
    """Write OUT/run.json (rank 0), unless the folder holds images already explained: then check the
    run against the record there (written anew only where there is none: a folder of an earlier
    version). Raises ValueError, saying what differs, when the images were explained otherwise."""
    path = out / RUN_RECORD
    if images_done:
        try:
            earlier = read_run_record(out)
        except ValueError as error:
            raise ValueError(f"{error} It should say how the images already in {display_name(out)} were explained. "
                             "If this run's settings are those of the earlier run, delete it (it is written anew); "
                             "else give another output folder.") from error
        if earlier is not None:
            differences = record.differences(earlier)
            if differences:
                other_method = (record.method, record.method_class) != (earlier.method, earlier.method_class)
                mixing = "maps of two methods" if other_method else "maps made two ways"
                raise ValueError(
                    f"{display_name(out)} holds images explained by another run, as {RUN_RECORD} records: "
                    f"{'; '.join(differences)}. Images already done are not explained again, so the folder would "
                    f"mix {mixing} in one index. Resume with the earlier run's settings, or give another output "
                    "folder.")
            return
    if shard.rank == 0:
        write_atomically(path, lambda temporary: temporary.write_text(record.to_text(), encoding="utf-8"))


def _target_plan(target: Target, topk: Optional[int]) -> _TargetPlan:
    """What ``target=`` and ``topk=`` ask to explain (see ``run``)."""
    mode = target if isinstance(target, str) and target in TARGET_MODES else None
    if topk is not None:
        if target is not None:
            raise ValueError(f"give either target or topk, not both (target={target!r}, topk={topk}).")
        return _TargetPlan("topk", topk=topk)
    if mode is not None:
        return _TargetPlan(mode, labels_required=mode != "predicted")
    if target is None:
        return _TargetPlan("both")  # the predicted class, and the label's where the model gets it wrong
    return _TargetPlan("given", target=target)


def run(
    explainer: Explainer,
    data: Union[str, Path, Iterable[LoaderBatch]],
    out: Union[str, Path],
    *,
    target: Target = None,
    topk: Optional[int] = None,
    labels: LabelSource = None,
    batch_size: int = 16,
    overlays: bool = False,
    progress: bool = True,
    shard: Optional[Shard] = None,
    on_batch: Optional[Callable[[int], None]] = None,
) -> RunSummary:
    """Explain every image of a folder (recursively) or every batch of a DataLoader, and write
    maps, optional overlays and an index to ``out`` (layout and columns in this module's docstring).

    data: a folder of images, or an iterable of (N, C, H, W) model-input batches, (images,
        labels) or (images, labels, paths) tuples, or dicts (see ``explain.labels``), e.g. a
        DataLoader without shuffling, so that a rerun sees the same order; the images of an
        ``ImageFolder`` read in order get the ids of their files.
    labels: for a folder, where the true labels come from: "folders" (DIR/<class>/...), a CSV
        file with columns path,label, or a mapping {path: label} (paths relative to the folder,
        labels class indices or names); None: no labels. A DataLoader's labels come from its
        batches (leave labels None).
    target: "both" (the default with labels: an image the model gets wrong is explained for its
        label, role "label", and its predicted class, role "predicted"; one it gets right for the
        predicted class), "label" (the true class; the predicted one for an image without a
        label), "predicted" (the default without labels), or a target as in ``explain`` (a class
        index or name, a callable: role "given"). topk: each image's k top classes (role "topk").
    Images already in the index are skipped; files that cannot be read as images are skipped
    and listed in OUT/skipped.csv with the reason (a rerun tries them again). Hidden files and
    folders (".ipynb_checkpoints/") and an output folder inside the input folder are not
    explained. A full disk raises an OSError saying so, with the index consistent (the same run
    resumes after space is freed). Memory stays that of one batch. Under torchrun
    each process takes every world_size-th image. on_batch(done) is called after each batch
    with the number of images written so far. Raises LabelError (a ValueError) for labels that
    cannot be used (an unknown class name, a path that names no image, a duplicated path, a bad
    header, a label out of range), before any image is explained where it can. OUT/run.json
    records the method, the target, the label source and the class names when the run starts; a
    run on a folder that already holds explained images must agree with it, else ValueError says
    what differs (maps of two methods, or made two ways, would mix in one index). Returns a
    RunSummary (its ``labels`` says how the labels were read).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {display_name(out)!r} is a file; give a folder (it is created if missing).")
    shard = shard or Shard.from_environment()
    plan = _target_plan(target, topk)
    index_path = out / ("index.csv" if shard.world_size == 1 else f"index.rank{shard.rank}.csv")
    skipped_path = out / ("skipped.csv" if shard.world_size == 1 else f"skipped.rank{shard.rank}.csv")
    summary = RunSummary(index_path, skipped_file=skipped_path)
    with _stop_when_disk_full(out, summary):
        _run(explainer, data, out, summary, shard, plan, labels, batch_size, overlays, progress, on_batch)
    return summary


def _run(explainer: Explainer, data: Union[str, Path, Iterable[LoaderBatch]], out: Path, summary: RunSummary,
         shard: Shard, plan: _TargetPlan, labels: LabelSource, batch_size: int, overlays: bool, progress: bool,
         on_batch: Optional[Callable[[int], None]]) -> None:
    """The body of ``run``, recording what it did in ``summary``."""
    class_names = explainer.class_names
    highest_label: list[tuple[int, str]] = []  # the folder's highest label and its file, checked with the first group
    if isinstance(data, (str, Path)):
        folder = Path(data)
        all_files = image_files(folder, exclude=out)
        read = folder_labels(folder, all_files, labels, class_names, exclude=out)
        if read is None and plan.labels_required:
            raise LabelError(f"target={plan.mode!r} explains the images' true classes: give their labels (labels="
                             "'folders', a CSV file with columns path,label, or a mapping {path: label}).")
        if read is not None:
            summary.labels = read.note
            class_names = class_names if class_names is not None else read.class_names
        if read is not None and read.by_path:  # a label out of range stops the run before any image is written
            highest_path, highest = max(read.by_path.items(), key=lambda item: item[1])
            highest_label = [(highest, display_name(folder / highest_path))]
        files = all_files[shard.rank :: shard.world_size]
        total: Optional[int] = len(files)
        batches: Iterator[_Batch] = _batches_of_files(files, folder, batch_size, None if read is None else read.by_path)
    else:
        if labels is not None:
            raise LabelError("labels= reads the labels of a folder's images; a DataLoader's labels come from its "
                             "batches, (images, labels): leave labels=None.")
        total = None
        order = dataset_order(data)
        batches = _batches_of_loader(data, order, shard, plan, summary, class_names)
        class_names = class_names if class_names is not None else order.classes
    if class_names is not None:  # a newline in a class name would split its index rows and overlay captions
        class_names = [one_line(str(name)) for name in class_names]
    record = _run_record(explainer, plan, data, labels, class_names)
    (out / "maps").mkdir(parents=True, exist_ok=True)
    if overlays:
        (out / "overlays").mkdir(exist_ok=True)
    done = _done_ids(out, summary.index)
    _check_and_record_run(out, record, shard, images_done=bool(done))
    if done and isinstance(data, (str, Path)) and read is not None:
        _check_labels_unchanged(out, {item_id(path, folder): read.by_path.get(path.relative_to(folder))
                                      for path in all_files})
    line_ending = index_line_ending(summary.index)
    with open(summary.index, "ab", buffering=0) as index_file, progress_shown_by_caller(), tqdm(
        total=total, disable=not progress, desc=f"explain {explainer.method_name}", unit="image"
    ) as bar:
        for batch in batches:
            todo = []
            for position, item in enumerate(batch.ids):
                if item not in done:  # an id given twice (a loader repeating a file) is explained once
                    todo.append(position)
                    done.add(item)
            summary.already_done += len(batch.ids) - len(todo)
            bar.update(len(batch.ids) - len(todo))
            if not todo:
                continue
            for loaded, readable in _explainable_groups(batch.inputs, todo, batch.names, summary):
                group_labels = [batch.labels[position] for position in readable]
                try:
                    _check_labels(explainer, loaded, group_labels + [label for label, _ in highest_label],
                                  [batch.names[p] for p in readable] + [name for _, name in highest_label], plan)
                    highest_label = []
                    results = _explain_group(explainer, loaded, group_labels, plan)
                except LabelError:
                    raise
                except (ValueError, ModelInputError) as error:
                    if summary.explained == 0 and len(readable) == len(todo):
                        raise  # the first batch fails as a whole: a problem of the run, not of its files
                    for position in readable:
                        summary.skipped[batch.names[position]] = f"explaining it failed: {error_line(error)}"
                    _write_skipped(summary)
                    continue
                for result, position, label in zip(results, readable, group_labels):
                    rows = _write_result(out, result, batch.ids[position], batch.names[position], label, class_names,
                                         overlays, line_ending)
                    append_rows(index_file, rows)
                    summary.explained += 1
                    summary.labelled += label is not None
                    summary.misclassified += label is not None and result.predicted not in (None, label)
            bar.update(len(todo))
            if on_batch is not None:
                on_batch(summary.explained)
    _write_skipped(summary)


def _predictions(explainer: Explainer, inputs: Union[list[Image.Image], Tensor],
                 plan: _TargetPlan) -> Optional[tuple[list[int], list[float]]]:
    """The model's top-1 class of each image and its softmax probability, from one forward pass
    without gradients (the model in eval mode, as explaining runs it, and left as found); None
    when the model's output is not (N, C) class scores."""
    if not plan.classifier:
        return None
    model = explainer.model
    with preserved_model_state(model), torch.no_grad():
        prepared = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model))
        output = explainer.call_model(prepared.batch)
    if not isinstance(output, Tensor) or output.dim() != 2:
        plan.classifier = False
        return None
    plan.class_count = output.shape[1]
    predicted = output.argmax(dim=1)
    confidence = output.float().softmax(dim=1).gather(1, predicted[:, None])[:, 0]
    return predicted.tolist(), confidence.tolist()


def _subset(inputs: Union[list[Image.Image], Tensor], positions: list[int]) -> Union[list[Image.Image], Tensor]:
    if isinstance(inputs, Tensor):
        return inputs[positions]
    return [inputs[position] for position in positions]


def _check_labels(explainer: Explainer, inputs: Union[list[Image.Image], Tensor], labels: list[Optional[int]],
                  names: list[str], plan: _TargetPlan) -> None:
    """LabelError for a label that is not one of the model's classes (the class count is learnt
    once per run, from the class names or a forward pass of one image)."""
    if all(label is None for label in labels):
        return
    if plan.class_count is None:
        if explainer.class_names is not None:
            plan.class_count = len(explainer.class_names)
        else:
            _predictions(explainer, _subset(inputs, [0]), plan)
    if plan.class_count is None:
        raise LabelError("labels are class indices, and this model's output is not (N, C) class scores: labels "
                         "need a classifier.")
    for label, name in zip(labels, names):
        if label is not None and label >= plan.class_count:
            raise LabelError(f"the label of {name} is {label}, out of range: the model has {plan.class_count} classes "
                             f"(0 to {plan.class_count - 1}). Fix the label, or the model's class count.")


def _explain_group(explainer: Explainer, inputs: Union[list[Image.Image], Tensor], labels: list[Optional[int]],
                   plan: _TargetPlan) -> list[_ImageResult]:
    """Explain a group of images (one size) as the plan says, one result per image. The predicted
    class costs no extra pass where an explanation gives it (the top-1 or top-k classes); for a
    given class or the labels alone, a forward pass without gradients finds it."""
    if plan.mode == "topk":
        explanation = explainer.explain(inputs, topk=plan.topk)
        top = explanation.class_indices, explanation.probabilities
        predicted = None if top[0] is None or top[1] is None else (top[0][:, 0].tolist(), top[1][:, 0].tolist())
        return [_result(explanation, row, None, "topk", predicted) for row in range(len(explanation))]
    if plan.mode == "given":
        explanation = explainer.explain(inputs, target=plan.target)
        predicted = _predictions(explainer, inputs, plan) if explanation.class_indices is not None else None
        return [_result(explanation, row, None, "given", predicted) for row in range(len(explanation))]
    if plan.mode == "label":
        predicted = _predictions(explainer, inputs, plan)
        if predicted is None:
            raise LabelError("target='label' explains class labels: this model's output is not (N, C) class scores.")
        targets: list[int] = [label if label is not None else guess for label, guess in zip(labels, predicted[0])]
        explanation = explainer.explain(inputs, target=targets)
        return [_result(explanation, row, None, "label" if labels[row] is not None else "predicted", predicted)
                for row in range(len(explanation))]
    explanation = explainer.explain(inputs)  # the predicted (top-1) class of each image
    top = explanation.class_indices, explanation.probabilities
    predicted = None if top[0] is None or top[1] is None else (top[0][:, 0].tolist(), top[1][:, 0].tolist())
    misclassified: dict[int, int] = {} if plan.mode == "predicted" or predicted is None else {
        row: label for row, label in enumerate(labels) if label is not None and label != predicted[0][row]}
    rows = list(misclassified)
    of_labels = explainer.explain(_subset(inputs, rows), target=list(misclassified.values())) if rows else None
    results = []
    for row in range(len(explanation)):
        result = _result(explanation, row, None, "predicted", predicted)
        if of_labels is not None and row in misclassified:  # the label's map first, then the prediction's
            result = _result(of_labels, rows.index(row), result, "label", predicted)
        results.append(result)
    return results


def _result(explanation: Explanation, row: int, after: Optional[_ImageResult], role: str,
            predicted: Optional[tuple[list[int], list[float]]]) -> _ImageResult:
    """Row ``row`` of an explanation as an image's result; its targets go before those of
    ``after`` (the same image's result from another explanation) when given."""
    maps = explanation.map_grid[row].detach().float().cpu()  # (K, H, W)
    count = maps.shape[0]
    classes: list[Optional[int]] = [None] * count if explanation.class_indices is None else [
        int(index) for index in explanation.class_indices[row]]
    probabilities: list[Optional[float]] = [None] * count if explanation.probabilities is None else [
        float(value) for value in explanation.probabilities[row]]
    result = _ImageResult(
        maps=maps,
        image=lambda: explanation.images[row],
        targets=classes,
        scores=[float(score) for score in explanation.scores[row]],
        probabilities=probabilities,
        roles=[role] * count,
        predicted=None if predicted is None else predicted[0][row],
        confidence=None if predicted is None else predicted[1][row],
        method=explanation.description(),
    )
    if after is not None:
        result.maps = torch.cat([result.maps, after.maps])
        result.image, result.predicted, result.confidence = after.image, after.predicted, after.confidence
        for name in ("targets", "scores", "probabilities", "roles"):
            setattr(result, name, getattr(result, name) + getattr(after, name))
    return result


@contextlib.contextmanager
def _stop_when_disk_full(out: Path, summary: RunSummary) -> Iterator[None]:
    """A full disk (or quota) while writing: an OSError that says what was kept and what to do."""
    try:
        yield
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        raise OSError(error.errno, (
            f"no space left to write the results in {display_name(out)} ({error.strerror}): the run stopped. "
            f"The index holds every image whose files were written ({summary.explained} by this run); free some "
            "space and run the same command again: it goes on with the images still to do."
        )) from error


def _explainable_groups(inputs: Union[list[Path], Tensor], todo: list[int], names: list[str], summary: RunSummary
                        ) -> Iterator[tuple[Union[list[Image.Image], Tensor], list[int]]]:
    """The inputs still to explain, loaded, in groups of one image size (a batch needs one size);
    files that cannot be read are recorded as skipped."""
    if not isinstance(inputs, list):  # a DataLoader batch: tensors, nothing to read
        yield (inputs[todo] if len(todo) < len(inputs) else inputs), todo
        return
    groups: dict[tuple[int, int], tuple[list[Image.Image], list[int]]] = {}
    for position in todo:
        try:
            image = load_image(inputs[position])
        except Exception as error:  # corrupt, empty, truncated, not an image, RGBA, decompression bomb ...
            summary.skipped[names[position]] = error_line(error)
            continue
        images, positions = groups.setdefault(image.size, ([], []))
        images.append(image)
        positions.append(position)
    if len(summary.skipped):
        _write_skipped(summary)
    yield from groups.values()


def error_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _write_skipped(summary: RunSummary) -> None:
    if summary.skipped_file is None or (not summary.skipped and not summary.skipped_file.exists()):
        return

    def write(temporary: Path) -> None:
        with open(temporary, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=SKIPPED_FIELDS)
            writer.writeheader()
            writer.writerows({"image": image, "reason": reason} for image, reason in summary.skipped.items())

    write_atomically(summary.skipped_file, write)


def _class_name(index: Optional[int], class_names: Optional[Sequence[str]]) -> str:
    return str(class_names[index]) if class_names is not None and index is not None and index < len(class_names) else ""


def panel_captions(roles: Sequence[str], targets: Sequence[Optional[int]], scores: Sequence[float],
                   probabilities: Sequence[Optional[float]], method: str,
                   class_names: Optional[Sequence[str]]) -> list[list[str]]:
    """The caption lines of an image's K overlay panels: role and class ("true: cat (3)",
    "predicted: dog (5)", "top 2: ...", "target: ..."), score and probability, method."""
    captions = []
    for k, (role, index, score, probability) in enumerate(zip(roles, targets, scores, probabilities)):
        what = f"{ROLE_CAPTIONS[role]} {k + 1}" if role == "topk" else ROLE_CAPTIONS[role]
        chance = "" if probability is None else f", p {probability:.3f}"
        captions.append([f"{what}: {render.label_text(index, class_names)}", f"score {score:.4g}{chance}", method])
    return captions


def _write_result(out: Path, result: _ImageResult, item: str, name: str, label: Optional[int],
                  class_names: Optional[Sequence[str]], overlays: bool, line_ending: str) -> bytes:
    """Write the image's map (and overlay) files, renamed into place; return its K index rows
    (for ``append_rows``, which adds them in one write)."""
    map_file = Path("maps") / f"{item}.npy"
    maps = result.maps
    write_atomically(out / map_file, lambda temporary: _save_array(temporary, maps.numpy().astype(np.float16)))
    if overlays:
        captions = panel_captions(result.roles, result.targets, result.scores, result.probabilities, result.method,
                                  class_names)
        picture = render.captioned_panels(render.overlay_drawn(result.image(), maps), captions)  # as e.save draws
        write_atomically(out / "overlays" / f"{item}.png",
                         lambda temporary: Image.fromarray(picture).save(temporary, format="PNG"))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator=line_ending)
    targets = maps.shape[0]
    predicted = result.predicted
    for k in range(targets):
        index, probability = result.targets[k], result.probabilities[k]
        writer.writerow({
            "id": item,
            "image": name,
            "target": "" if index is None else index,
            "k": k,
            "targets": targets,
            "class_name": _class_name(index, class_names),
            "score": f"{result.scores[k]:.6g}",
            "probability": "" if probability is None else f"{probability:.6g}",
            "map": map_file.as_posix(),
            "label": "" if label is None else label,
            "label_name": _class_name(label, class_names),
            "predicted": "" if predicted is None else predicted,
            "predicted_name": _class_name(predicted, class_names),
            "confidence": "" if result.confidence is None else repr(float(result.confidence)),
            "correct": "" if label is None or predicted is None else int(label == predicted),
            "role": result.roles[k],
        })
    return buffer.getvalue().encode("utf-8")


def append_rows(index_file: BinaryIO, rows: bytes) -> None:
    """Add an image's rows to the index and sync; a write that fails (a full disk) or is
    interrupted is undone, so that the index still ends with a complete image."""
    descriptor = index_file.fileno()
    size = os.fstat(descriptor).st_size
    try:
        _write_all(descriptor, rows)
        os.fsync(descriptor)
    except BaseException:
        try:
            os.ftruncate(descriptor, size)
        except OSError:
            pass  # a resumed run cuts the index back to its last complete image
        raise


def _write_all(descriptor: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take part of them)."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view):]


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as file:
        np.save(file, array)


def merge_shard_indexes(out: Union[str, Path]) -> Path:
    """Merge every ``index.rank*.csv`` into ``index.csv``, and every ``skipped.rank*.csv`` into
    ``skipped.csv``, and remove them. Idempotent: rows of an image already in index.csv are not
    added twice, so a merge cut short by a kill can be rerun."""
    out = Path(out)
    index_path = out / "index.csv"
    existing = _complete_rows(index_path)
    present = {row["id"] for row in existing}
    shards = [index for index in _indexes(out) if index != index_path]
    rows: list[dict[str, str]] = []
    for shard_index in shards:
        rows.extend(row for row in _complete_rows(shard_index) if row["id"] not in present)

    line_ending = index_line_ending(index_path)

    def write(temporary: Path) -> None:
        with open(temporary, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator=line_ending)
            writer.writeheader()
            writer.writerows(existing + sorted(rows, key=lambda row: (row["id"], int(row["k"]))))

    write_atomically(index_path, write)
    _merge_skipped(out)
    for shard_index in shards:
        shard_index.unlink()
    return index_path


def _merge_skipped(out: Path) -> None:
    """Write the ranks' skipped.rank<R>.csv files as skipped.csv (the files this run could not
    read, as a run of one process lists them) and remove them."""
    rank_files = sorted(path for path in out.glob("skipped.rank*.csv") if re.fullmatch(r"skipped\.rank\d+\.csv",
                                                                                          path.name))
    if not rank_files:
        return
    merged = RunSummary(out / "index.csv", skipped_file=out / "skipped.csv")
    for path in rank_files:
        with open(path, newline="", encoding="utf-8") as file:
            merged.skipped.update((row["image"], row["reason"]) for row in csv.DictReader(file))
    _write_skipped(merged)
    for path in rank_files:
        path.unlink()
