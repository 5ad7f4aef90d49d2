"""Explain a whole folder or DataLoader, writing results to disk: resumable, bounded memory,
sharded across processes under ``torchrun``, safe against ``kill -9`` at any moment; with the
images' true labels, explain the true class, the predicted one, or both where they differ.

Output folder layout:

    OUT/index.csv            one row per image and explained target (written by rank 0 when sharded):
                               id, image, target, k, targets, class_name, score, probability, map,
                               label, label_name, predicted, predicted_name, confidence, correct, role
    OUT/maps/batch-<n>.npz   the maps of a batch's images of one size (``explain.stored_maps``): at the
                             method's resolution where the explainer's upsampling and normalisation give
                             the maps at the input's resolution back exactly (Grad-CAM: 7 × 7 float32 for
                             resnet50's layer4, 0.3 KB an image), else at the input's, float16; read them
                             back at the input's resolution with ``read_maps`` or ``MapReader`` (which also
                             read the OUT/maps/<id>.npy files of earlier versions: (K, H, W) float16)
    OUT/overlays/<id>.png    heatmap overlays, K side by side, each under a caption: its role and
                             class, score and probability, method (with overlays=True)
    OUT/skipped.csv          files that could not be read as images, with the reason
    OUT/run.json             how the images are explained: the method and its settings (layer,
                             options, preprocessing), the target, where the labels come from, the
                             class names, the model (its weights' fingerprint) and the input (its
                             folder, each file's size and modification time) (see ``RunRecord``); a
                             resumed run must agree
    OUT/.explain.lock        held (``fcntl.flock``) while a run writes to the folder, removed at its end:
                             a second run into the folder at the same time is refused
    OUT/index.rank<R>.csv    each process's rows when run under torchrun (merged into index.csv)
    OUT/skipped.rank<R>.csv  each process's skipped files under torchrun (merged into skipped.csv)

The index's columns: ``target`` the class explained (its name ``class_name``, the model's ``score``
for it and its softmax ``probability``), row ``k`` of the image's ``targets`` = K rows, ``map`` the
maps file that holds the image's maps (map k is row k's; ``read_maps``); ``label`` and
``label_name`` the true class (empty when the image has no label), ``predicted`` and
``predicted_name`` the model's top-1 class, ``confidence`` its probability in [0, 1] (softmax; sigmoid: one logit),
``correct`` "1" or "0" (empty without a label), and ``role``, why the row's class was explained:
"label" (the true class), "predicted", "given" (``target=``) or "topk". With labels (``labels=``,
see ``explain.labels``) an image the model gets wrong has two rows, its label's map then its
predicted class's, and an image it gets right one, the predicted class; ``target="label"`` or
``"predicted"`` explains only that one. Without labels the predicted class is explained, as by
``explain``. Prediction columns are empty for targets that are not classes (a callable target of a
segmentation model).

Hidden files and folders (names starting with ".", such as ``.ipynb_checkpoints/``) are not
explained. An image is done when its K rows (k = 0 … K−1, ``targets`` = K) are in an index: a
rerun skips it, so an interrupted run resumes where it stopped, also after the index was opened
and saved by another program (CRLF or LF line endings, a UTF-8 byte-order mark: rows are
appended in the file's own line ending). A full disk stops the run with an ``OSError`` that says
so; the index then holds exactly the images whose files were written, and the same run after
freeing space finishes the rest. The run is a pipeline (``explain.pipeline``): worker processes
decode and preprocess a folder's next batches while this one is explained, and a thread writes
the results in the background. Writes are ordered so that a kill at any moment leaves a
consistent folder: a batch's maps file and its overlays are written to a temporary name and
renamed into place before its rows, its rows go to the index in one synced write, and a resumed
run first cuts an index back to its last complete image (a kill can tear the last line) and
removes the maps files (and temporary files) of its own that no row names (their images are
explained again). An exception while explaining (Ctrl-C) lets the writer finish the batches
already explained before it is raised; a second Ctrl-C stops the writer at its next step (the
batch being written left as a kill there would leave it, those waiting dropped). Either way
nothing is written once ``run`` has returned or raised (the folder is unlocked then). An index
written by an earlier version of explain (without the label columns) is not resumed: the run
stops with an error saying to move it away (``read_index`` still reads it, with empty label
columns). One run at a time writes to a folder: a run holds an exclusive lock
on OUT/.explain.lock (the processes of a torchrun run share it, each holding its rank's own), and
a run started while another holds it stops with ``FolderInUseError`` naming the other process.
The kernel releases the lock when its process ends, also by ``kill -9``. An index in which an
image's rows appear more than once (two runs at once into one folder, by a version of explain that
did not lock it) keeps each image's first rows: a resumed run removes the copies from the file,
and ``read_index`` leaves them out. A file's id is its path relative to the folder, made safe as a
file name, plus a short hash of that path, so that ``cat.png`` and ``cat.jpg``, or ``a/b.png``
and ``a__b.png``, never share files; a DataLoader's images get the ids of their files when the
batches or the dataset name them (the ids of the same folder's run), else their position
(``00000000``, ...).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import functools
import hashlib
import io
import json
import os
import re
import socket
import sys
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import (
    Any,
    BinaryIO,
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from tqdm.auto import tqdm

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs into one folder are not locked there
    fcntl = None  # type: ignore[assignment]

from . import render
from .capture import ModelInputError, model_device, model_dtype, preserved_model_state
from .explanation import Explanation
from .inputs import prepare_inputs
from .labels import (
    DatasetOrder,
    LabelError,
    LabelSource,
    dataset_label_numbering,
    dataset_order,
    folder_labels,
    split_loader_batch,
)
from .methods.base import NORMALIZATIONS, Explainer, progress_shown_by_caller, setting_text
from .pipeline import BackgroundWriter, LoadedBatch, default_workers, load_batches, usable_workers
from .stored_maps import AT_INPUT, SUFFIX, StoredMaps, load_maps, normalize_word, save_maps, stored_form
from .targets import Target, class_index, class_probabilities

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

LOCK_FILE = ".explain.lock"
"""The file of an output folder that a run holds locked while it writes there (see ``folder_lock``)."""

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
    model's prediction; notes: what the run warned about (duplicated index rows it removed, a
    run.json of an earlier version that it could not check against)."""

    index: Path
    explained: int = 0
    already_done: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_file: Optional[Path] = None
    labels: str = ""
    labelled: int = 0
    misclassified: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class _Batch:
    """One batch of a DataLoader: ids, the model-input batch, display names, and a label per image
    (None: no label)."""

    ids: list[str]
    inputs: Tensor
    names: list[str]
    labels: list[Optional[int]]


@dataclass
class _Group:
    """Images of one size to explain together: ids, display names, labels (None: no label), the
    (B, C, H, W) model input on the model's device, display images (B, H, W, 3) for overlays (None:
    made from the model input when needed), and whether they are all the images still to do of
    their batch (then a failure to explain them is a problem of the run when nothing was explained yet)."""

    ids: list[str]
    names: list[str]
    labels: list[Optional[int]]
    inputs: Tensor
    displays: Optional[Tensor]
    whole_batch: bool


@dataclass
class _BatchEnd:
    """The end of a batch: ``handled`` images of it (explained, skipped, or done before) for the
    progress bar; ``explained`` whether any of them was to be explained (then on_batch is called)."""

    handled: int
    explained: bool


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
class _GroupResult:
    """A group's explained images, ready to write, on the CPU: per image (M) its id, name, label, number of
    maps K, prediction and confidence (None when unknown); per map (R = the sum of K, an image's maps one
    after the other) its class (None for a callable target), score, probability and role; the maps
    themselves as the maps file stores them (``form``, ``maps`` (R, h, w), the input's ``size``, the
    explainer's ``normalize``: see ``explain.stored_maps``); for overlays, the maps at the input's
    resolution (R, H, W) and the display images (M, H, W, 3)."""

    ids: list[str]
    names: list[str]
    labels: list[Optional[int]]
    counts: list[int]
    predicted: list[Optional[int]]
    confidence: list[Optional[float]]
    targets: list[Optional[int]]
    scores: list[float]
    probabilities: list[Optional[float]]
    roles: list[str]
    form: str
    maps: Tensor
    size: tuple[int, int]
    normalize: str
    method: str
    overlay_maps: Optional[Tensor] = None
    images: Optional[Tensor] = None


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


class FolderInUseError(OSError):
    """Another run is writing to the output folder: a process holds its lock (see ``folder_lock``)."""


LOCKS_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)
"""flock's errors on a file system that does not lock files (some network and FUSE file systems)."""


@contextlib.contextmanager
def folder_lock(out: Union[str, Path], shard: Optional[Shard] = None) -> Iterator[None]:
    """Hold the output folder ``out`` (which must exist) for a run: an exclusive ``fcntl.flock`` on
    OUT/.explain.lock (``LOCK_FILE``), whose text names this process; under torchrun (a ``shard`` of
    several processes) a shared lock on it, which the ranks of one run hold together, and an
    exclusive one on OUT/.explain.rank<R>.lock. Raises FolderInUseError, naming the process that
    holds it, when another run holds the folder. The kernel releases a lock when its process ends,
    also by ``kill -9``, so a killed run never blocks the next one; the last process to hold a lock
    file removes it. Without ``fcntl`` (Windows), or on a file system that cannot lock files (a
    warning says so), nothing is locked."""
    out = Path(out)
    shard = shard or Shard()
    sharded = shard.world_size > 1
    held: list[tuple[int, Path, bool]] = []
    try:
        if fcntl is not None:
            holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            locks = [(out / LOCK_FILE, not sharded, holder)]
            if sharded:
                locks.append((out / f".explain.rank{shard.rank}.lock", True,
                              f"{holder}, rank {shard.rank} of {shard.world_size}"))
            for path, exclusive, text in locks:
                descriptor = _lock(path, exclusive, text, out)
                if descriptor is None:
                    break
                held.append((descriptor, path, exclusive))
                _HELD_LOCKS.add(descriptor)
        yield
    finally:
        for descriptor, path, exclusive in reversed(held):
            _unlock(descriptor, path, exclusive)


def _lock(path: Path, exclusive: bool, holder: str, out: Path) -> Optional[int]:
    """Lock ``path`` (created if missing) without waiting and return its descriptor; an exclusive
    holder writes ``holder`` in it. None where the file system cannot lock (after a warning)."""
    assert fcntl is not None
    for _ in range(100):  # a lock file removed by a run that just ended is created again: lock the new one
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _lock_holders(descriptor, out)
            os.close(descriptor)
            raise FolderInUseError(
                f"{display_name(out)} is in use by another run of explain ({who}): two runs writing into one folder "
                "would both explain every image and write each image's rows twice. Wait until that run ends (a run "
                "started after it goes on where it stopped), or give another output folder.") from None
        except OSError as error:
            os.close(descriptor)
            if error.errno not in LOCKS_UNSUPPORTED:
                raise
            _warn_at_callers_line(
                f"the file system of {display_name(out)} cannot lock files ({error_line(error)}), so this run does "
                "not hold the folder: start no other run into it until this one ends (two at once would explain "
                "every image twice), or write to a folder on a local disk.")
            return None
        try:
            same = os.path.samestat(os.stat(path), os.fstat(descriptor))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(descriptor, 0)  # a shared holder leaves it empty: no one process holds the folder
            if exclusive:
                os.pwrite(descriptor, holder.encode("utf-8", "backslashreplace"), 0)
            return descriptor
        os.close(descriptor)
    raise FolderInUseError(f"{display_name(path)} keeps being removed and made again: another program is using it; "
                           "give another output folder.")


def _lock_holders(descriptor: int, out: Path) -> str:
    """Who holds a folder's lock, as its lock files say: "pid 123 on host, since ...", one per
    process of a torchrun run, or "a process that did not say which" (a lock being taken)."""
    texts = [os.pread(descriptor, 1000, 0).decode("utf-8", "replace").strip()]
    if not texts[0]:  # held shared: by the ranks of a torchrun run, each named in its own lock file
        texts = []
        for path in sorted(out.glob(".explain.rank*.lock")):
            with contextlib.suppress(OSError):
                texts.append(path.read_text(encoding="utf-8", errors="replace").strip())
    texts = [one_line(text) for text in texts if text]
    return "; ".join(texts) if texts else "a process that did not say which"


def _unlock(descriptor: int, path: Path, exclusive: bool) -> None:
    """Release a lock taken by ``_lock``; the last holder (the only one for an exclusive lock)
    removes the lock file while it still holds it, so that no run locks a file that is gone."""
    assert fcntl is not None
    try:
        if not exclusive:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while another rank holds it
        if os.path.samestat(os.stat(path), os.fstat(descriptor)):
            path.unlink()
    except OSError:
        pass  # another rank still holds it, or the file is gone: it stays, or was removed, unlocked
    finally:
        _HELD_LOCKS.discard(descriptor)
        os.close(descriptor)


_HELD_LOCKS: set[int] = set()
"""The descriptors of the folder locks this process holds (``folder_lock``)."""


def _close_inherited_locks() -> None:
    """In a process forked while this one holds a folder's lock (a DataLoader's worker): close its copies
    of the lock's descriptors, without unlocking (that would unlock the parent's). A flock belongs to every
    process that has the descriptor, so a worker that outlives its run by ``kill -9`` would otherwise keep
    the folder locked against the next run."""
    for descriptor in list(_HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def _warn_at_callers_line(message: str) -> None:
    """A UserWarning attributed to the first line on the call stack outside this package (and
    outside contextlib): the caller's call of ``run``, or the command line's."""
    package = str(Path(__file__).parent) + os.sep
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(package)
                                        or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


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


def _complete_rows(index: Path, notes: Optional[list[str]] = None) -> list[dict[str, str]]:
    """The rows of an index that form complete images, after cutting the file back to the end of
    its last complete image (a kill while appending can leave a torn line or part of an image's
    rows) and removing the copies of an image's rows after its first (two runs at once into the
    folder, by a version of explain that did not lock it; a note in ``notes`` says so). Creates the
    index, with its header, when it does not exist. The header is compared by its fields: CRLF or
    LF line endings and a UTF-8 byte-order mark are accepted."""
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
    kept_lines = [lines[0]]
    pending: list[tuple[dict[str, str], bytes]] = []
    seen: set[str] = set()
    copies: list[str] = []
    position = end = len(lines[0])
    for line in lines[1:]:
        position += len(line)
        if not line.endswith(b"\n"):
            break  # torn by a kill
        values = next(csv.reader([line.decode("utf-8", "replace")]), [])
        row = dict(zip(FIELDS, values))
        if len(values) != len(FIELDS) or not (row["k"].isdigit() and row["targets"].isdigit()):
            break
        if int(row["k"]) != len(pending) or (pending and row["id"] != pending[0][0]["id"]):
            break
        pending.append((row, line))
        if len(pending) == int(row["targets"]):
            if row["id"] in seen:
                copies.append(row["id"])
            else:
                seen.add(row["id"])
                rows.extend(pending_row for pending_row, _ in pending)
                kept_lines.extend(pending_line for _, pending_line in pending)
            pending, end = [], position
    if copies:
        write_atomically(index, lambda temporary: temporary.write_bytes(b"".join(kept_lines)))
        if notes is not None:
            notes.append(f"{display_name(index)} held the rows of {len(set(copies))} image(s) more than once (two runs "
                         "at once into the folder, by a version of explain that did not lock it), e.g. "
                         f"{copies[0]}: the copies were removed, keeping each image's first rows.")
    elif end < sum(len(line) for line in lines):
        with open(index, "r+b") as file:
            file.truncate(end)
    return rows


def _indexes(out: Path) -> list[Path]:
    """The index files of an output folder: index.csv and the ranks' index.rank<R>.csv."""
    return sorted(path for path in out.glob("index*.csv") if re.fullmatch(r"index(\.rank\d+)?\.csv", path.name))


def _done_ids(out: Path, own_index: Path, notes: list[str]) -> tuple[set[str], set[str]]:
    """Ids of the images complete in this process's index (cut back to its last complete image,
    copies of an image's rows removed, with a note in ``notes``) and in the other indexes of the
    folder (other ranks, the merged index); and the maps files those images' rows name."""
    others = [index for index in _indexes(out) if index != own_index]
    for index in others:  # refused before this process's index is created or cut
        with open(index, "rb") as file:
            _refuse_an_earlier_index(index, file.readline())
    rows = _complete_rows(own_index, notes)
    for index in others:
        rows += read_index(index)
    return {row["id"] for row in rows}, {row["map"] for row in rows}


def _maps_file_prefix(shard: Shard) -> str:
    """How this process's maps files are named, before their number: "batch-", "rank<R>-batch-" under torchrun."""
    return "batch-" if shard.world_size == 1 else f"rank{shard.rank}-batch-"


def _remove_unlisted_maps(maps: Path, prefix: str, listed: Collection[str]) -> int:
    """Remove this process's maps files (``prefix``, see ``_maps_file_prefix``) that no index row names (written
    by a run killed before it added their rows; their images are explained again) and its temporary files
    left by a kill; return the number the next maps file takes."""
    listed_names = {Path(path).name for path in listed}
    numbers = [0]
    with os.scandir(maps) as entries:
        for entry in entries:
            name = entry.name
            number = name[len(prefix):-len(SUFFIX)]
            if name.startswith(prefix) and name.endswith(SUFFIX) and number.isdigit():
                if name in listed_names:
                    numbers.append(int(number))
                else:
                    Path(entry.path).unlink(missing_ok=True)
            elif name.startswith(f".{prefix}") and name.endswith(f"{SUFFIX}.part"):
                Path(entry.path).unlink(missing_ok=True)
    return max(numbers) + 1


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
    duplicated: list[str] = field(default_factory=list)
    """Ids of the images whose rows are there more than once, each copy complete (two runs at once
    into one folder, by a version of explain that did not lock it), in file order: their first rows
    are in ``rows``."""


def read_index_contents(path: Union[str, Path]) -> IndexContents:
    """Read an index of this version or of an earlier one (without the label columns), keeping the
    images whose K rows are all there: rows k = 0 … K−1, each saying ``targets`` = K, none cut
    short; of an image whose K rows are there several times over (``duplicated``), the first K.
    Raises ValueError for a file that is not an index (it lacks one of EARLIER_FIELDS)."""
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
    incomplete, duplicated = [], []
    left_out: set[int] = set()  # the rows left out, by id()
    for image_id, image_rows in by_id.items():
        if _is_complete_image(image_id, image_rows):
            continue
        copies = _copies(image_id, image_rows)
        if copies is None:
            incomplete.append(image_id)
            left_out.update(id(row) for row in image_rows)
        else:
            duplicated.append(image_id)
            left_out.update(id(row) for row in image_rows[copies:])
    rows = [{name: row.get(name) or "" for name in FIELDS} for row in read if id(row) not in left_out]
    return IndexContents(rows, all(name in columns for name in LABEL_FIELDS), incomplete, duplicated)


def _copies(image_id: str, rows: list[dict[str, Optional[str]]]) -> Optional[int]:
    """Where an image's rows are several complete copies of its K rows, one after the other: K (the
    first copy's length); else None."""
    count = rows[0]["targets"] or ""
    if not count.isdigit() or int(count) == 0 or len(rows) % int(count):
        return None
    size = int(count)
    copies = [rows[start:start + size] for start in range(0, len(rows), size)]
    in_order = all([row["k"] for row in copy] == [str(k) for k in range(size)] for copy in copies)
    return size if in_order and all(_is_complete_image(image_id, copy) for copy in copies) else None


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


class MapReader:
    """Reads the maps of a run's output folder back, at the input's resolution: each image's (K, H, W)
    float32 maps as ``Explanation.map_grid`` held them (see ``explain.stored_maps``: maps stored at the
    method's resolution are upsampled and normalised as the explainer did, bit for bit on the CPU; maps
    stored at the input's resolution are float16), from the maps files of this version and the one .npy
    per image of earlier ones. Keeps the last few files read (``files_kept``), so that reading the images
    in index order reads each file once; safe to use from several threads."""

    def __init__(self, out: Union[str, Path], files_kept: int = 4):
        self.out = Path(out)
        self.files_kept = files_kept
        self._files: OrderedDict[str, Union[StoredMaps, np.ndarray]] = OrderedDict()
        self._map_of: Optional[dict[str, str]] = None
        self._lock = threading.Lock()

    def read(self, image: Union[str, Mapping[str, str]], raw: bool = False) -> Tensor:
        """The (K, H, W) float32 maps of one image, given by its id or by one of its index rows (its
        ``id`` and ``map``): normalised, or with ``raw`` before normalisation (only for maps stored at the
        method's resolution). ValueError when the maps file is missing, is not one, does not hold the
        image, or lies outside the folder; KeyError for an id that no index of the folder lists."""
        if isinstance(image, str):
            image_id, map_file = image, self._map_file_of(image)
        else:
            image_id, map_file = image["id"], image["map"]
        contents = self._contents(map_file)
        if isinstance(contents, StoredMaps):
            try:
                return contents.image(image_id, raw)
            except KeyError:
                raise ValueError(f"{map_file} does not hold the maps of image {image_id} (the file was replaced?)."
                                 ) from None
        if raw:
            raise ValueError(f"{map_file} was written by an earlier version of explain: it holds normalised float16 "
                             "maps, not their values before normalisation. Read it with raw=False.")
        maps = torch.from_numpy(np.asarray(contents, dtype=np.float32))
        return maps[None] if maps.dim() == 2 else maps

    def _map_file_of(self, image_id: str) -> str:
        with self._lock:
            if self._map_of is None:
                self._map_of = {}
                for index in _indexes(self.out):
                    for row in read_index(index):
                        self._map_of.setdefault(row["id"], row["map"])
            return self._map_of[image_id]

    def _contents(self, map_file: str) -> Union[StoredMaps, np.ndarray]:
        with self._lock:
            if map_file in self._files:
                self._files.move_to_end(map_file)
                return self._files[map_file]
            path = self.out / map_file
            if not path.resolve().is_relative_to(self.out.resolve()):
                raise ValueError(f"the map file {map_file!r} lies outside {display_name(self.out)}: it is not read.")
            if path.suffix == SUFFIX:
                contents: Union[StoredMaps, np.ndarray] = load_maps(path)
            else:  # an earlier version's (K, H, W) float16 maps of one image
                try:
                    array = np.load(path, allow_pickle=False)
                except (EOFError, ValueError) as error:  # truncated, not an array, a pickled object
                    raise ValueError(f"{map_file} is not a maps file ({error_line(error)}).") from error
                if not isinstance(array, np.ndarray) or array.ndim not in (2, 3):
                    shape = getattr(array, "shape", type(array).__name__)
                    raise ValueError(f"{map_file} holds an array of shape {shape}, not (K, H, W) maps.")
                contents = array
            self._files[map_file] = contents
            while len(self._files) > self.files_kept:
                self._files.popitem(last=False)
            return contents


def read_maps(out: Union[str, Path], images: Optional[Iterable[Union[str, Mapping[str, str]]]] = None, *,
              raw: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(id, maps) for each image of a run's output folder: its (K, H, W) float32 maps at the input's
    resolution, row k of them the map of its index row k (see ``MapReader``; ``raw``: before
    normalisation). images: ids or index rows, in the order wanted; default every complete image of the
    folder's indexes, in file order."""
    reader = MapReader(out)
    if images is None:
        seen: set[str] = set()
        rows = []
        for index in _indexes(Path(out)):
            for row in read_index(index):
                if row["id"] not in seen:
                    seen.add(row["id"])
                    rows.append(row)
        images = rows
    for image in images:
        yield (image if isinstance(image, str) else image["id"]), reader.read(image, raw)


def _folder_groups(loaded_batches: Generator[LoadedBatch, None, None], chunks: Sequence[Sequence[int]],
                   files: Sequence[Path], ids: Sequence[str], folder: Path, labels: Optional[Mapping[Path, int]],
                   device: torch.device, summary: RunSummary, nothing_explained: Callable[[], bool]
                   ) -> Generator[Union[_Group, _BatchEnd], None, None]:
    """The folder's images still to do, batch by batch (``chunks``: positions in ``files``), as
    ``load_batches`` decoded and preprocessed them: groups of one size, moved to ``device``, then the end
    of the batch. Files that cannot be read are recorded as skipped; an image whose preprocessing raises a
    ValueError is skipped too, unless nothing was explained yet and no image of its batch could be
    prepared (then the preprocessing is wrong for the run: it is raised, as other errors are)."""
    with contextlib.closing(loaded_batches):
        for chunk, loaded in zip(chunks, loaded_batches):
            unprepared = []
            for failure in loaded.failures:
                name = display_name(files[failure.position])
                if failure.stage == "read":
                    summary.skipped[name] = error_line(failure.error)
                elif isinstance(failure.error, (ValueError, ModelInputError)):
                    unprepared.append((name, failure.error))
                else:
                    raise failure.error
            if unprepared and not loaded.groups and nothing_explained():
                raise unprepared[0][1]
            for name, error in unprepared:
                summary.skipped[name] = f"preparing it for the model failed: {error_line(error)}"
            if loaded.failures:
                _write_skipped(summary)
            for group in loaded.groups:
                yield _Group([ids[position] for position in group.positions],
                             [display_name(files[position]) for position in group.positions],
                             [None if labels is None else labels.get(files[position].relative_to(folder))
                              for position in group.positions],
                             group.inputs.to(device, non_blocking=True), group.displays,
                             whole_batch=len(group.positions) == len(chunk))
            yield _BatchEnd(len(chunk), explained=True)


def _loader_groups(batches: Iterator[_Batch], done: set[str], device: torch.device, summary: RunSummary
                   ) -> Generator[Union[_Group, _BatchEnd], None, None]:
    """A DataLoader's images not ``done`` (an id given twice is explained once), batch by batch, moved to
    ``device``; the images already done are counted in ``summary``."""
    for batch in batches:
        todo = []
        for position, item in enumerate(batch.ids):
            if item not in done:
                todo.append(position)
                done.add(item)
        summary.already_done += len(batch.ids) - len(todo)
        if todo:
            inputs = batch.inputs[todo] if len(todo) < len(batch.inputs) else batch.inputs
            yield _Group([batch.ids[position] for position in todo], [batch.names[position] for position in todo],
                         [batch.labels[position] for position in todo], inputs.to(device, non_blocking=True), None,
                         whole_batch=True)
        yield _BatchEnd(len(batch.ids), explained=bool(todo))


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
    "a mapping", "the DataLoader's batches"); settings: the explainer's options, its layer and
    preprocessing among them (``setting_text(explainer)``: "GradCAM(layer=..., relu=True, ...,
    preprocess=...)"; None in a record written before explain recorded them); model: which model,
    {"class": its class with its module, "name" and "weights": as the caller named them (the
    command's --model and --weights, a file as its absolute path; None through the Python API),
    "fingerprint": ``weights_fingerprint``, the SHA-256 of its weights}; data: which images,
    {"folder": the input folder's absolute path (a DataLoader's dataset's folder; None when it has
    none), "files": {image id: [size in bytes, modification time in ns]} for the files known when
    the run starts (None for a DataLoader that does not name its files)}, and for a DataLoader
    "transform": its dataset's transform (``setting_text``; None without one). model and data are
    None in a record written before explain recorded them.
    """

    method: str
    method_class: str
    class_names: Optional[list[str]]
    target: dict[str, Any]
    labels: str
    settings: Optional[str] = None
    model: Optional[dict[str, Any]] = None
    data: Optional[dict[str, Any]] = None

    def to_text(self) -> str:
        """The record as run.json holds it: JSON, one setting a line (class names, and the files,
        on one line)."""
        fields = asdict(self)
        lines = [f"  {json.dumps(name)}: {json.dumps(value, ensure_ascii=False)}" for name, value in fields.items()]
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RunRecord":
        """A record from run.json's parsed JSON; ValueError naming ``where`` when a field is missing
        or of the wrong type (more fields are allowed: a later version's; settings, model and data
        may be missing: a record of an earlier version)."""
        checks = {
            "method": lambda value: isinstance(value, str),
            "method_class": lambda value: isinstance(value, str),
            "class_names": lambda value: value is None or (isinstance(value, list)
                                                           and all(isinstance(name, str) for name in value)),
            "target": lambda value: isinstance(value, dict) and isinstance(value.get("mode"), str),
            "labels": lambda value: isinstance(value, str),
        }
        optional = {
            "settings": lambda value: isinstance(value, str),
            "model": lambda value: isinstance(value, dict) and isinstance(value.get("fingerprint"), str),
            "data": lambda value: isinstance(value, dict) and isinstance(value.get("files"), (dict, type(None)))
            and isinstance(value.get("folder"), (str, type(None))),
        }
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not a run record of explain: it holds {type(data).__name__}, not an object.")
        wrong = [name for name, check in checks.items() if name not in data or not check(data[name])]
        if wrong:
            raise ValueError(f"{where} is not a run record of explain: its field(s) {', '.join(wrong)} are missing or "
                             "of the wrong type.")
        wrong = [name for name, check in optional.items() if data.get(name) is not None and not check(data[name])]
        if wrong:
            raise ValueError(f"{where} is not a run record of explain: its field(s) {', '.join(wrong)} are of the "
                             "wrong type.")
        return cls(data["method"], data["method_class"], data["class_names"], data["target"], data["labels"],
                   data.get("settings"), data.get("model"), data.get("data"))

    def differences(self, earlier: "RunRecord", done: Optional[Collection[str]] = None) -> list[str]:
        """What this run does otherwise than ``earlier``, one line a setting ("method: 'gradcam'
        (GradCAM) earlier, 'saliency' (Saliency) now"). The files are compared for the image ids
        ``done`` (the images already explained; default: every file both records know). A field
        that either record lacks (a record of an earlier version) is not compared."""
        found = []
        if (self.method, self.method_class) != (earlier.method, earlier.method_class):
            found.append(f"method: {earlier.method!r} ({earlier.method_class}) earlier, {self.method!r} "
                         f"({self.method_class}) now")
        elif None not in (self.settings, earlier.settings) and self.settings != earlier.settings:
            found.append(f"method settings: {earlier.settings} earlier, {self.settings} now")
        if self.model is not None and earlier.model is not None and _model_identity(self.model) != _model_identity(
                earlier.model):
            found.append(f"model: {_model_text(earlier.model)} earlier, {_model_text(self.model)} now")
        if self.target != earlier.target:
            found.append(f"target: {_target_text(earlier.target)} earlier, {_target_text(self.target)} now")
        if self.labels != earlier.labels:
            found.append(f"labels: {earlier.labels} earlier, {self.labels} now")
        if self.class_names != earlier.class_names:
            found.append(f"class names: {_names_text(earlier.class_names, self.class_names)}")
        if self.data is not None and earlier.data is not None:
            found.extend(_data_differences(earlier.data, self.data, done))
        return found


def weights_fingerprint(model: nn.Module) -> str:
    """The SHA-256 (64 hex digits) of a model's weights: of each entry of its state dict, in order,
    its dtype, shape and bytes (the names are left out, so that a wrapper's prefix, DataParallel's
    "module.", does not change it). Reads every byte once, on the CPU: about 0.08 s for resnet50's
    100 MB; a model on a GPU is copied over tensor by tensor."""
    digest = hashlib.sha256()
    for value in model.state_dict().values():
        if not isinstance(value, Tensor):
            digest.update(f"{setting_text(value)};".encode())
            continue
        digest.update(f"{value.dtype} {tuple(value.shape)};".encode())
        data = value.detach()
        if data.is_quantized:
            data = data.dequantize()
        if data.layout != torch.strided:
            data = data.to_dense()
        if data.device.type == "meta":
            continue  # no values to read
        digest.update(data.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _model_identity(model: Mapping[str, Any]) -> tuple[Any, Any]:
    """What a resumed run's model must share with the earlier one's: its class and its weights."""
    return model.get("class"), model.get("fingerprint")


def _model_text(model: Mapping[str, Any]) -> str:
    """A recorded model in a few words: "'demo' (DemoNet, weights' fingerprint 1a2b3c4d5e6f)", or
    "DemoNet (weights' fingerprint 1a2b3c4d5e6f)" where the caller did not name it."""
    kind = str(model.get("class") or "").rsplit(".", 1)[-1]
    weights = f" with weights {model['weights']!r}" if model.get("weights") else ""
    fingerprint = f"weights' fingerprint {str(model.get('fingerprint'))[:12]}"
    if model.get("name"):
        return f"{model['name']!r}{weights} ({kind}, {fingerprint})"
    return f"{kind}{weights} ({fingerprint})"


def _file_identities(files: Iterable[tuple[str, Union[str, Path]]]) -> dict[str, list[int]]:
    """{image id: [size in bytes, modification time in ns]} of each (id, path) whose file can be
    read (one stat each), sorted by id."""
    identities = {}
    for item, path in files:
        try:
            status = os.stat(path)
        except OSError:
            continue
        identities[item] = [status.st_size, status.st_mtime_ns]
    return dict(sorted(identities.items()))


def _data_differences(earlier: Mapping[str, Any], now: Mapping[str, Any], done: Optional[Collection[str]]
                      ) -> list[str]:
    """How the images of two runs differ: their folder, else a DataLoader's transform and the files
    of the images ``done`` whose size or modification time changed."""
    if earlier.get("folder") and now.get("folder") and earlier["folder"] != now["folder"]:
        return [f"input folder: {earlier['folder']} earlier, {now['folder']} now"]
    found = []
    if None not in (earlier.get("transform"), now.get("transform")) and earlier["transform"] != now["transform"]:
        before_text, after_text = (" ".join(str(text).split()) for text in (earlier["transform"], now["transform"]))
        found.append(f"the dataset's transform: {before_text} earlier, {after_text} now")
    before, after = earlier.get("files"), now.get("files")
    if isinstance(before, dict) and isinstance(after, dict):
        compared = before.keys() & after.keys() if done is None else [item for item in done if item in before
                                                                      and item in after]
        changed = sorted(item for item in compared if list(before[item]) != list(after[item]))
        if changed:
            shown = "; ".join(f"{item} ({_file_text(before[item])} earlier, {_file_text(after[item])} now)"
                              for item in changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
            found.append(f"images: {len(changed)} of the images already explained changed since (another size or "
                         f"modification time): {shown}")
    return found


def _file_text(identity: Sequence[int]) -> str:
    """[size, modification time in ns] as "1234 bytes, modified 2025-01-02 10:11:12.123456"."""
    size, modified = int(identity[0]), int(identity[1])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(modified // 10**9))
    return f"{size} bytes, modified {when}.{modified % 10**9 // 1000:06d}"


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
                labels: LabelSource, class_names: Optional[Sequence[str]], model_name: Optional[str],
                weights_name: Optional[str], images: dict[str, Any]) -> RunRecord:
    """What this run explains (see ``RunRecord``); ``images``: the record's data."""
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
    kind = type(explainer.model)
    model = {"class": f"{kind.__module__}.{kind.__qualname__}", "name": model_name, "weights": weights_name,
             "fingerprint": weights_fingerprint(explainer.model)}
    return RunRecord(explainer.name, type(explainer).__name__, names, target, source, setting_text(explainer), model,
                     images)


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


def _check_and_record_run(out: Path, record: RunRecord, shard: Shard, done: Collection[str]) -> list[str]:
    """Write OUT/run.json (rank 0), unless the folder holds images already explained (``done``, their
    ids): then check the run against the record there, and write it again only to add what it lacks
    (the whole record for a folder written before run.json, the model and the input for one written
    before explain recorded them, the files added to the input folder since). Raises ValueError,
    saying what differs and what to do, when the images were explained otherwise; returns notes on
    what could not be checked."""
    path = out / RUN_RECORD
    notes = []
    if done:
        try:
            earlier = read_run_record(out)
        except ValueError as error:
            raise ValueError(f"{error} It should say how the images already in {display_name(out)} were explained. "
                             "If this run's settings are those of the earlier run, delete it (it is written anew); "
                             "else give another output folder.") from error
        if earlier is not None:
            differences = record.differences(earlier, done)
            if differences:
                raise ValueError(_refusal(out, record, earlier, differences))
        if earlier is not None:  # (none: a folder written before run.json, or a rank of a run whose rank 0 is late)
            unchecked = [(what, same) for what, same, value in (
                ("the model", "by this run's model", earlier.model),
                ("the input images", "from this run's files", earlier.data)) if value is None]
            if unchecked:
                lacks = " and ".join(what for what, _ in unchecked)
                how = " and ".join(same for _, same in unchecked)
                notes.append(f"{display_name(path)} was written by an earlier version of explain, which did not record "
                             f"{lacks}: this run cannot check that the {len(done)} image(s) already done were "
                             f"explained {how}. It takes them as such and records its own from now on; if they were "
                             "not, give another output folder.")
            record = replace(earlier, model=earlier.model or record.model, data=_merged_data(earlier.data, record.data))
    if shard.rank == 0:
        text = record.to_text()
        try:
            unchanged = path.read_text(encoding="utf-8") == text
        except (OSError, UnicodeDecodeError):
            unchanged = False
        if not unchanged:
            write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    return notes


def _refusal(out: Path, record: RunRecord, earlier: RunRecord, differences: list[str]) -> str:
    """The error of a resumed run that differs from the earlier one: what differs, and what to do."""
    def differ(*starts: str) -> bool:
        return any(line.startswith(starts) for line in differences)

    if differ("method:"):
        mixing, keep = "maps of two methods", "method"
    elif differ("model:"):
        mixing, keep = "maps of two models", "model"
    elif differ("method settings:", "target:", "labels:", "class names:", "the dataset's transform:"):
        mixing, keep = "maps made two ways", "settings"
    else:
        mixing, keep = "maps of other images under the same names", "images"
    text = (f"{display_name(out)} holds images explained by another run, as {RUN_RECORD} records: "
            f"{'; '.join(differences)}. Images already done are not explained again, so the folder would mix {mixing} "
            f"in one index. Resume with the earlier run's {keep}, or give another output folder; to start over in "
            "this one, delete it first.")
    if "random" in {str((earlier.model or {}).get("weights")), str((record.model or {}).get("weights"))}:
        text += (" Random weights (--weights random) are drawn anew by every run, so a run with them cannot be "
                 "resumed.")
    if differ("input folder:", "images:"):
        text += (f" If they are the same images (the folder moved or copied, the files touched), delete the \"data\" "
                 f"entry of {RUN_RECORD} to resume without this check.")
    return text


def _merged_data(earlier: Optional[dict[str, Any]], now: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The input of a resumed run's record: the earlier one's, with the files known now added (the
    images already done have not changed: they were checked)."""
    if earlier is None or now is None:
        return earlier if now is None else now
    merged = dict(earlier)
    before, after = earlier.get("files"), now.get("files")
    if isinstance(before, dict) and isinstance(after, dict):
        merged["files"] = dict(sorted({**before, **after}.items()))
    elif before is None:
        merged["files"] = after
    return merged


def _dataset_transform(loader: Iterable[LoaderBatch]) -> Optional[str]:
    """The transform of a DataLoader's dataset (``ImageFolder(transform=...)``), as ``setting_text``;
    None without one (or for an iterable that is not a DataLoader)."""
    from torch.utils.data import DataLoader, Subset

    if not isinstance(loader, DataLoader):
        return None
    dataset = loader.dataset
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    transform = getattr(dataset, "transform", None)
    return None if transform is None else setting_text(transform)


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
    model_name: Optional[str] = None,
    weights_name: Optional[str] = None,
    workers: Optional[int] = None,
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
    resumes after space is freed). Memory stays that of a few batches: the next ones being loaded,
    the ones waiting to be written. Under torchrun each process takes every world_size-th image.
    on_batch(done) is called after each batch's rows are in the index, with the number of images
    written so far, by the thread that writes them; an exception it raises stops the run (nothing
    after that batch is written) and is raised by run. workers: for a folder, the worker processes
    that decode and preprocess its images, the next batches while this one is explained (default
    ``explain.pipeline.default_workers()``: min(8, CPU cores − 1); 0: in this process); a DataLoader
    loads with its own. Maps are written as ``explain.stored_maps`` describes (read them back with
    ``read_maps``). Raises LabelError (a ValueError) for labels that
    cannot be used (an unknown class name, a path that names no image, a duplicated path, a bad
    header, a label out of range), before any image is explained where it can. OUT/run.json
    records the method and its settings (layer, options, preprocessing), the target, the label
    source, the class names, the model (its class and the SHA-256 of its weights) and the input
    (the folder's absolute path, each file's size and modification time) when the run starts; a run
    on a folder that already holds explained images must agree with it, else ValueError says what
    differs (maps of two methods or two models, made two ways, or of other images under the same
    names would mix in one index) and what to do; a record of an earlier version without the model
    and input resumes, with a warning. model_name, weights_name: how the caller names the model and
    its weights (the command passes --model and --weights), recorded beside the fingerprint to say
    which models differ. One run at a time writes to a folder (``folder_lock``): a run into a folder
    that another run is writing to raises FolderInUseError (an OSError) naming its process. Returns
    a RunSummary (its ``labels`` says how the labels were read, its ``notes`` what was warned).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers must be a whole number of at least 0 (0: decode in this process); got {workers!r}.")
    if workers is not None and not isinstance(data, (str, Path)):
        raise ValueError("workers= sets the processes that decode a folder's images; a DataLoader loads with its own "
                         "num_workers: leave workers=None.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {display_name(out)!r} is a file; give a folder (it is created if missing).")
    shard = shard or Shard.from_environment()
    plan = _target_plan(target, topk)
    index_path = out / ("index.csv" if shard.world_size == 1 else f"index.rank{shard.rank}.csv")
    skipped_path = out / ("skipped.csv" if shard.world_size == 1 else f"skipped.rank{shard.rank}.csv")
    summary = RunSummary(index_path, skipped_file=skipped_path)
    with _stop_when_disk_full(out, summary), contextlib.ExitStack() as lock:
        _run(explainer, data, out, summary, shard, plan, labels, batch_size, overlays, progress, on_batch, model_name,
             weights_name, default_workers() if workers is None else workers, lock)
    return summary


def _run(explainer: Explainer, data: Union[str, Path, Iterable[LoaderBatch]], out: Path, summary: RunSummary,
         shard: Shard, plan: _TargetPlan, labels: LabelSource, batch_size: int, overlays: bool, progress: bool,
         on_batch: Optional[Callable[[int], None]], model_name: Optional[str], weights_name: Optional[str],
         workers: int, lock: contextlib.ExitStack) -> None:
    """The body of ``run``, recording what it did in ``summary``; the folder's lock is taken into
    ``lock`` before the first write."""
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
        all_ids = [item_id(path, folder) for path in all_files]
        files, file_ids = all_files[shard.rank :: shard.world_size], all_ids[shard.rank :: shard.world_size]
        images: dict[str, Any] = {"folder": str(folder.resolve()), "files": _file_identities(zip(all_ids, all_files))}
        total: Optional[int] = len(files)
    else:
        if labels is not None:
            raise LabelError("labels= reads the labels of a folder's images; a DataLoader's labels come from its "
                             "batches, (images, labels): leave labels=None.")
        total = None
        order = dataset_order(data)
        images = {"folder": None if order.root is None else str(order.root.resolve()),
                  "transform": _dataset_transform(data),
                  "files": None if order.paths is None else _file_identities(
                      (_path_id(path, order.root), path) for path in order.paths)}
        batches = _batches_of_loader(data, order, shard, plan, summary, class_names)
        class_names = class_names if class_names is not None else order.classes
    if class_names is not None:  # a newline in a class name would split its index rows and overlay captions
        class_names = [one_line(str(name)) for name in class_names]
    record = _run_record(explainer, plan, data, labels, class_names, model_name, weights_name, images)
    out.mkdir(parents=True, exist_ok=True)
    lock.enter_context(folder_lock(out, shard))  # one run at a time writes to the folder, until run returns
    (out / "maps").mkdir(parents=True, exist_ok=True)
    if overlays:
        (out / "overlays").mkdir(exist_ok=True)
    done, listed = _done_ids(out, summary.index, summary.notes)
    summary.notes += _check_and_record_run(out, record, shard, done)
    if isinstance(data, (str, Path)):
        workers, reason = usable_workers(workers, explainer.preprocess)
        summary.notes += [reason] if reason else []
    for note in summary.notes:
        _warn_at_callers_line(note)
    if done and isinstance(data, (str, Path)) and read is not None:
        _check_labels_unchanged(out, {item: read.by_path.get(path.relative_to(folder))
                                      for item, path in zip(all_ids, all_files)})
    prefix = _maps_file_prefix(shard)
    first_number = _remove_unlisted_maps(out / "maps", prefix, listed)
    line_ending = index_line_ending(summary.index)
    device = model_device(explainer.model)
    explained = 0  # images explained by this run, written or waiting to be

    def nothing_explained() -> bool:
        return explained == 0

    groups: Generator[Union[_Group, _BatchEnd], None, None]
    if isinstance(data, (str, Path)):
        todo = [position for position, item in enumerate(file_ids) if item not in done]
        summary.already_done = len(files) - len(todo)
        chunks = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
        loaded = load_batches(files, chunks, explainer.preprocess, workers, pin_memory=device.type == "cuda",
                              displays=overlays)  # the workers start here, before the threads below
        groups = _folder_groups(loaded, chunks, files, file_ids, folder, None if read is None else read.by_path,
                                device, summary, nothing_explained)
    else:
        groups = _loader_groups(batches, done, device, summary)
    normalize = getattr(explainer, "normalize", None)
    stopping = threading.Event()  # a second Ctrl-C: the writer stops early (see BackgroundWriter)
    with contextlib.closing(groups), open(summary.index, "ab", buffering=0) as index_file, \
            progress_shown_by_caller(), tqdm(total=total, disable=not progress or shard.rank != 0,  # one bar: rank 0's
                                             desc=f"explain {explainer.method_name}", unit="image",
                                             initial=summary.already_done) as bar, \
            BackgroundWriter(_ResultWriter(out, index_file, summary, class_names, overlays, line_ending, prefix,
                                           first_number, on_batch, stopping), stopping=stopping) as writer:
        for group in groups:
            if isinstance(group, _BatchEnd):
                bar.update(group.handled)
                if group.explained and on_batch is not None:
                    writer.put(group)
                continue
            try:
                _check_labels(explainer, group.inputs, group.labels + [label for label, _ in highest_label],
                              group.names + [name for _, name in highest_label], plan)
                highest_label = []
                result = _group_result(group, *_explain_group(explainer, group.inputs, group.labels, plan),
                                       normalize=normalize, overlays=overlays)
            except LabelError:
                raise
            except (ValueError, ModelInputError) as error:
                if explained == 0 and group.whole_batch:
                    raise  # the first batch fails as a whole: a problem of the run, not of its files
                for name in group.names:
                    summary.skipped[name] = f"explaining it failed: {error_line(error)}"
                _write_skipped(summary)
                continue
            writer.put(result)
            explained += len(group.ids)
    _write_skipped(summary)


def _predictions(explainer: Explainer, inputs: Tensor, plan: _TargetPlan) -> Optional[tuple[list[int], list[float]]]:
    """The model's top-1 class of each image and its probability (softmax; sigmoid: one logit), from a forward pass
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
    confidence = class_probabilities(output.float()).gather(1, predicted[:, None])[:, 0]
    return predicted.tolist(), confidence.tolist()


def _check_labels(explainer: Explainer, inputs: Tensor, labels: list[Optional[int]], names: list[str],
                  plan: _TargetPlan) -> None:
    """LabelError for a label that is not one of the model's classes (the class count is learnt
    once per run, from the class names or a forward pass of one image)."""
    if all(label is None for label in labels):
        return
    if plan.class_count is None:
        if explainer.class_names is not None:
            plan.class_count = len(explainer.class_names)
        else:
            _predictions(explainer, inputs[:1], plan)
    if plan.class_count is None:
        raise LabelError("labels are class indices, and this model's output is not (N, C) class scores: labels "
                         "need a classifier.")
    for label, name in zip(labels, names):
        if label is not None and label >= plan.class_count:
            raise LabelError(f"the label of {name} is {label}, out of range: the model has {plan.class_count} classes "
                             f"(0 to {plan.class_count - 1}). Fix the label, or the model's class count.")


Pick = tuple[int, int, str]
"""One image's maps from one explanation: (which explanation, its row, the role of its maps)."""


def _explain_group(explainer: Explainer, inputs: Tensor, labels: list[Optional[int]], plan: _TargetPlan
                   ) -> tuple[list[Explanation], list[list[Pick]], Optional[tuple[list[int], list[float]]]]:
    """Explain a group of images (one size, (B, C, H, W) on the model's device) as the plan says: the
    explanations made, each image's maps among them in order (``Pick``), and the model's top-1 class
    and its probability per image (None when the output is not class scores). The predicted class
    costs no extra pass where an explanation gives it (the top-1 or top-k classes); for a given class
    or the labels alone, a forward pass without gradients finds it."""
    if plan.mode == "topk":
        explanation = explainer.explain(inputs, topk=plan.topk)
        return [explanation], _picks(len(explanation), "topk"), _top_predictions(explanation)
    if plan.mode == "given":
        explanation = explainer.explain(inputs, target=plan.target)
        predicted = _predictions(explainer, inputs, plan) if explanation.class_indices is not None else None
        return [explanation], _picks(len(explanation), "given"), predicted
    if plan.mode == "label":
        predicted = _predictions(explainer, inputs, plan)
        if predicted is None:
            raise LabelError("target='label' explains class labels: this model's output is not (N, C) class scores.")
        targets: list[int] = [label if label is not None else guess for label, guess in zip(labels, predicted[0])]
        explanation = explainer.explain(inputs, target=targets)
        return [explanation], [[(0, row, "label" if labels[row] is not None else "predicted")]
                               for row in range(len(explanation))], predicted
    explanation = explainer.explain(inputs)  # the predicted (top-1) class of each image
    predicted = _top_predictions(explanation)
    misclassified: dict[int, int] = {} if plan.mode == "predicted" or predicted is None else {
        row: label for row, label in enumerate(labels) if label is not None and label != predicted[0][row]}
    if not misclassified:
        return [explanation], _picks(len(explanation), "predicted"), predicted
    rows = list(misclassified)
    of_labels = explainer.explain(inputs[rows], target=list(misclassified.values()))
    label_row = {row: position for position, row in enumerate(rows)}
    picks = [([(1, label_row[row], "label")] if row in label_row else []) + [(0, row, "predicted")]
             for row in range(len(explanation))]  # the label's map first, then the prediction's
    return [explanation, of_labels], picks, predicted


def _picks(count: int, role: str) -> list[list[Pick]]:
    """Each of ``count`` images' maps from the one explanation, with one role."""
    return [[(0, row, role)] for row in range(count)]


def _top_predictions(explanation: Explanation) -> Optional[tuple[list[int], list[float]]]:
    """The top-1 class and its probability per image of an explanation of the top classes (None
    without classes)."""
    if explanation.class_indices is None or explanation.probabilities is None:
        return None
    return explanation.class_indices[:, 0].tolist(), explanation.probabilities[:, 0].tolist()


def _group_result(group: _Group, explanations: list[Explanation], picks: list[list[Pick]],
                  predicted: Optional[tuple[list[int], list[float]]], *, normalize: Optional[str],
                  overlays: bool) -> _GroupResult:
    """A group's explanations as one result to write: the maps of every image in order, in the form
    they are stored (``explain.stored_maps.stored_form``: low-resolution where the explainer's
    upsampling and normalisation, ``normalize``, give its maps back exactly), each tensor gathered on
    its device and copied to the CPU once."""
    forms = [stored_form(explanation, normalize) for explanation in explanations]
    if len({form for form, _ in forms}) > 1:  # one maps file holds one form
        forms = [(AT_INPUT, explanation.map_grid.detach().half()) for explanation in explanations]
    targets_of = [explanation.map_grid.shape[1] for explanation in explanations]
    starts = np.cumsum([0] + [len(explanation) * count for explanation, count in zip(explanations, targets_of)])
    order = [int(starts[which]) + row * targets_of[which] + k for image in picks for which, row, _ in image
             for k in range(targets_of[which])]

    def gathered(tensors: list[Tensor]) -> Tensor:
        """The rows ``order`` of the explanations' (N, K, ...) tensors, on the CPU."""
        flat = torch.cat([tensor.detach().reshape(-1, *tensor.shape[2:]) for tensor in tensors])
        return flat[torch.tensor(order, device=flat.device)].cpu()

    maps = gathered([stored for _, stored in forms])
    scores = gathered([explanation.scores.double() for explanation in explanations]).tolist()
    classes: Optional[list[int]] = None
    probabilities: Optional[list[float]] = None
    if all(explanation.class_indices is not None for explanation in explanations):
        classes = gathered([explanation.class_indices for explanation in explanations]).tolist()  # type: ignore
        if all(explanation.probabilities is not None for explanation in explanations):
            probabilities = gathered([explanation.probabilities.double()  # type: ignore[union-attr]
                                      for explanation in explanations]).tolist()
    roles = [role for image in picks for which, _, role in image for _ in range(targets_of[which])]
    images = len(picks)
    return _GroupResult(
        ids=group.ids, names=group.names, labels=group.labels,
        counts=[sum(targets_of[which] for which, _, _ in image) for image in picks],
        predicted=[None] * images if predicted is None else list(predicted[0]),
        confidence=[None] * images if predicted is None else list(predicted[1]),
        targets=[None] * len(order) if classes is None else list[Optional[int]](classes),
        scores=scores,
        probabilities=[None] * len(order) if probabilities is None else list[Optional[float]](probabilities),
        roles=roles, form=forms[0][0], maps=maps, size=(int(explanations[0].map_grid.shape[-2]),
                                                         int(explanations[0].map_grid.shape[-1])),
        normalize=normalize_word(normalize) if normalize in NORMALIZATIONS else "none",
        method=explanations[0].description(),
        overlay_maps=gathered([explanation.map_grid.float() for explanation in explanations]) if overlays else None,
        images=(group.displays if group.displays is not None else explanations[0].images) if overlays else None,
    )


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


class _ResultWriter:
    """Writes each explained group (run by ``BackgroundWriter``, a thread): its maps file
    (``explain.stored_maps``, OUT/maps/<prefix><number>.npz) and its overlays, each renamed into place,
    then its index rows in one synced append (``append_rows``); counts the images written in the
    summary. At the end of a batch (``_BatchEnd``) it calls on_batch with that count."""

    def __init__(self, out: Path, index_file: BinaryIO, summary: RunSummary, class_names: Optional[Sequence[str]],
                 overlays: bool, line_ending: str, prefix: str, number: int,
                 on_batch: Optional[Callable[[int], None]], stopping: threading.Event):
        self.out, self.index_file, self.summary, self.class_names = out, index_file, summary, class_names
        self.overlays, self.line_ending, self.prefix, self.number = overlays, line_ending, prefix, number
        self.on_batch = on_batch
        self.stopping = stopping
        """Set by a second Ctrl-C (``BackgroundWriter``): the group being written ends at its next step, its
        rows not added (its maps file removed), as a kill there would leave it."""

    def __call__(self, item: Union[_GroupResult, _BatchEnd]) -> None:
        if isinstance(item, _BatchEnd):
            if self.on_batch is not None and not self.stopping.is_set():
                self.on_batch(self.summary.explained)
            return
        if self.stopping.is_set():
            return
        map_file = Path("maps") / f"{self.prefix}{self.number:06d}{SUFFIX}"
        self.number += 1
        stored = StoredMaps(item.ids, item.counts, item.maps, item.form, item.size, item.normalize)
        write_atomically(self.out / map_file, lambda temporary: _save_maps_file(temporary, stored))
        if self.overlays:
            self._write_overlays(item)
        if self.stopping.is_set():  # no rows name the maps file: a resumed run would remove it, and explain them
            (self.out / map_file).unlink(missing_ok=True)
            return
        append_rows(self.index_file, _index_rows(item, map_file.as_posix(), self.class_names, self.line_ending))
        self.summary.explained += len(item.ids)
        for label, predicted in zip(item.labels, item.predicted):
            self.summary.labelled += label is not None
            self.summary.misclassified += label is not None and predicted not in (None, label)

    def _write_overlays(self, item: _GroupResult) -> None:
        assert item.overlay_maps is not None and item.images is not None, "made for a run with overlays"
        start = 0
        for image, (image_id, count) in enumerate(zip(item.ids, item.counts)):
            if self.stopping.is_set():
                return
            rows = slice(start, start + count)
            start += count
            captions = panel_captions(item.roles[rows], item.targets[rows], item.scores[rows],
                                      item.probabilities[rows], item.method, self.class_names)
            picture = render.captioned_panels(render.overlay_drawn(item.images[image], item.overlay_maps[rows]),
                                              captions)  # as e.save draws
            write_atomically(self.out / "overlays" / f"{image_id}.png",
                             functools.partial(_save_png, Image.fromarray(picture)))


def _save_png(picture: Image.Image, path: Path) -> None:
    picture.save(path, format="PNG")


def _save_maps_file(path: Path, stored: StoredMaps) -> None:
    with open(path, "wb") as file:
        save_maps(file, stored)


def _index_rows(result: _GroupResult, map_file: str, class_names: Optional[Sequence[str]], line_ending: str) -> bytes:
    """A group's index rows, each image's K rows in order (for ``append_rows``, which adds them in one write)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator=line_ending)
    row = 0
    for item, name, label, count, predicted, confidence in zip(result.ids, result.names, result.labels, result.counts,
                                                                result.predicted, result.confidence):
        for k in range(count):
            index, probability = result.targets[row], result.probabilities[row]
            writer.writerow({
                "id": item,
                "image": name,
                "target": "" if index is None else index,
                "k": k,
                "targets": count,
                "class_name": _class_name(index, class_names),
                "score": f"{result.scores[row]:.6g}",
                "probability": "" if probability is None else f"{probability:.6g}",
                "map": map_file,
                "label": "" if label is None else label,
                "label_name": _class_name(label, class_names),
                "predicted": "" if predicted is None else predicted,
                "predicted_name": _class_name(predicted, class_names),
                "confidence": "" if confidence is None else repr(float(confidence)),
                "correct": "" if label is None or predicted is None else int(label == predicted),
                "role": result.roles[row],
            })
            row += 1
    return buffer.getvalue().encode("utf-8")


def append_rows(index_file: BinaryIO, rows: bytes) -> None:
    """Add rows (some images' K rows each) to the index in one write, and sync; a write that fails (a
    full disk) or is interrupted is undone, so that the index still ends with a complete image."""
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


def merge_shard_indexes(out: Union[str, Path]) -> Path:
    """Merge every ``index.rank*.csv`` into ``index.csv``, and every ``skipped.rank*.csv`` into
    ``skipped.csv``, and remove them. Idempotent: rows of an image already in index.csv are not
    added twice, so a merge cut short by a kill can be rerun. Holds the folder's lock (``folder_lock``)
    while it merges."""
    out = Path(out)
    with folder_lock(out):
        return _merge_shard_indexes(out)


def _merge_shard_indexes(out: Path) -> Path:
    """The body of ``merge_shard_indexes``, run while the folder is locked."""
    index_path = out / "index.csv"
    notes: list[str] = []
    existing = _complete_rows(index_path, notes)
    present = {row["id"] for row in existing}
    shards = [index for index in _indexes(out) if index != index_path]
    rows: list[dict[str, str]] = []
    for shard_index in shards:  # each image once, also where two ranks' files hold it (another world size)
        shard_rows = _complete_rows(shard_index, notes)
        new_ids = {row["id"] for row in shard_rows} - present
        rows.extend(row for row in shard_rows if row["id"] in new_ids)
        present |= new_ids
    for note in notes:
        _warn_at_callers_line(note)

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
