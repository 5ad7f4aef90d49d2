"""Explain a whole folder or DataLoader, writing results to disk: resumable, bounded memory,
sharded across processes under ``torchrun``, safe against ``kill -9`` at any moment; with the
images' true labels, explain the true class, the predicted one, or both where they differ.

Output folder layout:

    OUT/index.csv            one row per image and explained target (written by rank 0 when sharded):
                               id, image, target, k, targets, class_name, score, probability, map,
                               label, label_name, predicted, predicted_name, confidence, correct, role
    OUT/maps/batch-<n>.npz   the maps of a batch's images of one size (``explain.dataset_tools.stored_maps``): at the
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
    OUT/run.rank<R>.json     the record of a torchrun process other than rank 0, against which a resume
                             is checked until rank 0 has written run.json (removed at the merge)

The index's columns: ``target`` the class explained (its name ``class_name``, the model's ``score``
for it and its ``probability``, as ``confidence``), row ``k`` of the image's ``targets`` = K rows, ``map`` the
maps file that holds the image's maps (map k is row k's; ``read_maps``); ``label`` and
``label_name`` the true class (empty when the image has no label), ``predicted`` and
``predicted_name`` the model's top-1 class, ``confidence`` its probability in [0, 1] (softmax; sigmoid: one
logit, or the explainer's ``probabilities="sigmoid"``),
``correct`` "1" or "0" (empty without a label), and ``role``, why the row's class was explained:
"label" (the true class), "predicted", "given" (``target=``) or "topk". With labels (``labels=``,
see ``explain.dataset_tools.labels``) an image the model gets wrong has two rows, its label's map then its
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
freeing space finishes the rest. The run is a pipeline (``explain.dataset_tools.pipeline``): worker processes
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
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
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
from torch import Tensor
from tqdm.auto import tqdm

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs into one folder are not locked there
    fcntl = None  # type: ignore[assignment]

from ..core.caller import warn_at_callers_line
from ..core.capture import ModelInputError, model_device, model_dtype, model_input_channels, preserved_model_state
from ..core.targets import Target, class_index, class_probabilities
from ..io import render
from ..io.explanation import Explanation
from ..io.inputs import IMAGE_SUFFIXES, list_image_files, prepare_inputs
from ..methods.base import Explainer, progress_shown_by_caller
from ..methods.maps import NORMALIZATIONS
from ..methods.signatures import setting_text

# What readers of a run's folder import from this module (docs/datasets.md), kept here: the index, the maps
# and the record are read by the modules named here.
from .index import (
    FIELDS,
    SKIPPED_FIELDS,
    IndexContents,
    MapReader,
    _complete_rows,
    _done_ids,
    _indexes,
    _maps_file_prefix,
    _remove_unlisted_maps,
    _rows_with_maps,
    append_rows,
    index_line_ending,
    read_index,
    read_index_contents,
    read_maps,
)
from .labels import (
    DatasetOrder,
    LabelError,
    LabelSource,
    dataset_label_numbering,
    dataset_order,
    folder_labels,
    split_loader_batch,
)
from .pipeline import BackgroundWriter, FileWarnings, LoadedBatch, default_workers, load_batches, usable_workers
from .run_folder import FolderInUseError, Shard, display_name, error_line, folder_lock, one_line, write_atomically
from .run_record import (
    RUN_RECORD,
    RunRecord,
    _check_and_record_run,
    _file_identities,
    rank_record_paths,
    read_run_record,
    weights_fingerprint,
)
from .stored_maps import AT_INPUT, SUFFIX, StoredMaps, normalize_word, save_maps, stored_form

__all__ = ["run", "RunSummary", "Shard", "merge_shard_indexes", "image_files", "item_id", "FIELDS", "IndexContents",
           "MapReader", "read_index", "read_index_contents", "read_maps", "FolderInUseError", "RUN_RECORD",
           "RunRecord", "read_run_record"]

TARGET_MODES = ("label", "predicted", "both")
"""The words ``target=`` (``--target``) takes besides classes: explain each image's true class, its
predicted class, or both where they differ."""
ROLE_CAPTIONS = {"label": "true", "predicted": "predicted", "given": "target", "topk": "top"}
"""Each role as an overlay caption starts."""
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


LoaderBatch = Union[Tensor, tuple[Any, ...], list[Any], Mapping[str, Any]]
"""A batch of a DataLoader: (N, C, H, W) model input; a tuple or list whose first item is that,
with (N,) labels and N file names after it ((images, labels) pairs); or a dict (see
``explain.dataset_tools.labels``)."""


@dataclass
class RunSummary:
    """What a run did. index: this process's index file; explained: images explained by this
    run; already_done: images skipped because an earlier run had explained them; skipped:
    files that could not be read (listed with the reason in ``skipped_file``); labels: where the
    labels came from and how their classes were numbered ("" without labels); labelled and
    misclassified: how many of this run's images had a label, and a label other than the
    model's prediction; notes: what the run warned about (duplicated index rows it removed, a
    run.json of an earlier version that it could not check against, a folder without images, a
    resume that writes overlays of some images only)."""

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
    explainer's ``normalize``: see ``explain.dataset_tools.stored_maps``); for overlays, the maps at the input's
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
    return image_files_and_broken_links(folder, exclude)[0]


def image_files_and_broken_links(folder: Union[str, Path], exclude: Optional[Union[str, Path]] = None
                                 ) -> tuple[list[Path], list[Path]]:
    """``image_files``, and the symbolic links with an image file's name that lead to no file (their target
    missing), which it leaves out, sorted (``explain.io.inputs.list_image_files``: the listing of TCAV's and CRAFT's
    image sets too)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {display_name(folder)!r}.")
    return list_image_files(folder, exclude)


def _broken_link_reason(path: Path) -> str:
    """The skipped.csv reason of a symbolic link that leads to no file."""
    try:
        target = os.readlink(path)
    except OSError:
        return "a broken symbolic link: it leads to no file"
    return f"a broken symbolic link: its target {display_name(target)!r} does not exist (or is a loop of links)"


def check_output_outside(folder: Path, out: Path) -> None:
    """ValueError when the output folder is the input folder or holds it: the output folder is left out of the
    images to explain (its overlays are no images of the data), so every image would be."""
    if folder.is_dir() and folder.resolve().is_relative_to(out.resolve()):
        where = "is the input folder" if folder.resolve() == out.resolve() else "holds the input folder"
        raise ValueError(f"the output folder {display_name(out)} {where} {display_name(folder)}, and the output "
                         "folder's files are never read as images, so there would be no image to explain: give an "
                         f"output folder outside it, or one inside it (e.g. {display_name(folder / 'explained')}).")


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


def _overlays_note(out: Path, done: Collection[str], overlays: bool, more_to_do: bool) -> Optional[str]:
    """What to warn when a resumed run leaves the folder with overlays of some images only: it writes overlays and
    images already ``done`` have none (the earlier run wrote none), or it writes none, images already done have them
    and there may be images still to do (``more_to_do``). Images already done are not explained again, so their
    overlays are not written (or the new images lack theirs). None when the folder stays whole."""
    folder = out / "overlays"
    present = ({entry.name[: -len(".png")] for entry in os.scandir(folder) if entry.name.endswith(".png")}
               if folder.is_dir() else set())
    having = sum(item in present for item in done)
    if overlays and having < len(done):
        return (f"overlays=True (--overlays): {len(done) - having} of the {len(done)} image(s) already explained in "
                f"{display_name(out)} have no overlay (the run that explained them wrote none), and images already "
                "done are not explained again: only the images still to do get overlays. For overlays of every "
                "image, give another output folder (or delete this one first).")
    if not overlays and having and more_to_do:
        return (f"{having} of the {len(done)} image(s) already explained in {display_name(out)} have overlays "
                f"({display_name(folder)}/<id>.png), and this run writes none (overlays=False, no --overlays): the "
                "images still to do get no overlays. For overlays of every image, resume with overlays.")
    return None


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
    says which (see ``explain.dataset_tools.labels``), else by its position; this process's share under torchrun.
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
        labels) or (images, labels, paths) tuples, or dicts (see ``explain.dataset_tools.labels``), e.g. a
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
    and listed in OUT/skipped.csv with the reason (a rerun tries them again; images the model
    fails on are skipped too, unless they are the whole first batch of a run into a folder
    without images explained yet: then the run stops with the model's error). Hidden files and
    folders (".ipynb_checkpoints/") and an output folder inside the input folder are not
    explained; an output folder that is the input folder or holds it is a ValueError. A resume
    that writes overlays (``overlays``) of some images only, the earlier run having written them
    or not, warns. A full disk raises an OSError saying so, with the index consistent (the same run
    resumes after space is freed). Memory stays that of a few batches: the next ones being loaded,
    the ones waiting to be written. Under torchrun each process takes every world_size-th image.
    on_batch(done) is called after each batch's rows are in the index, with the number of images
    written so far, by the thread that writes them; an exception it raises stops the run (nothing
    after that batch is written) and is raised by run. workers: for a folder, the worker processes
    that decode and preprocess its images, the next batches while this one is explained (default
    ``explain.dataset_tools.pipeline.default_workers()``: min(8, CPU cores − 1); 0: in this process); a DataLoader
    loads with its own. Maps are written as ``explain.dataset_tools.stored_maps`` describes (read them back with
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
        check_output_outside(folder, out)
        all_files, broken = image_files_and_broken_links(folder, exclude=out)
        if shard.rank == 0:  # one process lists them: they are no rank's files
            summary.skipped.update((display_name(path), _broken_link_reason(path)) for path in broken)
        if not all_files:
            summary.notes.append(f"no image file in {display_name(folder)} (nor its sub-folders): nothing to explain. "
                                 f"Images are files ending in {', '.join(sorted(IMAGE_SUFFIXES))} (any case)."
                                 + (f" {len(broken)} broken symbolic link(s) with such a name are listed in "
                                    "skipped.csv." if broken else ""))
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
    overlays_note = _overlays_note(out, done, overlays, not isinstance(data, (str, Path))
                                   or any(item not in done for item in file_ids)) if done else None
    summary.notes += [overlays_note] if overlays_note else []
    if done and isinstance(data, (str, Path)) and shard.rank == 0:
        summary.notes += _removed_images_note(done, all_ids, folder, summary.index)
    for note in summary.notes:
        warn_at_callers_line(note)
    if done and isinstance(data, (str, Path)) and read is not None:
        _check_labels_unchanged(out, {item: read.by_path.get(path.relative_to(folder))
                                      for item, path in zip(all_ids, all_files)})
    prefix = _maps_file_prefix(shard)
    first_number = _remove_unlisted_maps(out / "maps", prefix, listed)
    line_ending = index_line_ending(summary.index)
    device = model_device(explainer.model)
    explained = 0  # images explained by this run, written or waiting to be
    resumed = bool(done)  # images explained by an earlier run of the same record: the run's settings work

    def nothing_explained() -> bool:
        """Whether no image was explained with these settings yet, by this run or an earlier one into the folder
        (then a batch that fails as a whole is a problem of the run; else one of its files, skipped)."""
        return explained == 0 and not resumed

    groups: Generator[Union[_Group, _BatchEnd], None, None]
    if isinstance(data, (str, Path)):
        todo = [position for position, item in enumerate(file_ids) if item not in done]
        summary.already_done = len(files) - len(todo)
        chunks = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
        loaded = load_batches(files, chunks, explainer.preprocess, workers, pin_memory=device.type == "cuda",
                              displays=overlays, channels=model_input_channels(explainer.model))
        # the workers start at load_batches, before the threads below
        groups = _folder_groups(loaded, chunks, files, file_ids, folder, None if read is None else read.by_path,
                                device, summary, nothing_explained)
    else:
        groups = _loader_groups(batches, done, device, summary)
    normalize = getattr(explainer, "normalize", None)
    stopping = threading.Event()  # a second Ctrl-C: the writer stops early (see BackgroundWriter)
    file_warnings = FileWarnings()  # the warnings of explaining a batch, naming its files
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
            for result in _explained(explainer, group, plan, summary, file_warnings, nothing_explained, highest_label,
                                     normalize=normalize, overlays=overlays):
                writer.put(result)
                explained += len(result.ids)
    _write_skipped(summary)


def _explained(explainer: Explainer, group: _Group, plan: _TargetPlan, summary: RunSummary,
               file_warnings: FileWarnings, nothing_explained: Callable[[], bool],
               highest_label: list[tuple[int, str]], *, normalize: Optional[str], overlays: bool
               ) -> Iterator[_GroupResult]:
    """A group explained (``_explain_group``), its warnings naming its files (``FileWarnings``); its labels, and the
    folder's ``highest_label`` (emptied once checked), checked first (``_check_labels``). Where explaining it
    fails (a ValueError: a score that is not finite, an input the model refuses), its images are explained one by
    one, so that only those that fail are skipped (recorded in ``summary`` with the reason), each named; the
    error is raised where no image of the run's first batch could be explained (a problem of the run, not of its
    files)."""
    try:
        with file_warnings.naming(group.names, keep_on_error=len(group.ids) == 1):
            _check_labels(explainer, group.inputs, group.labels + [label for label, _ in highest_label],
                          group.names + [name for _, name in highest_label], plan)
            highest_label.clear()
            result = _group_result(group, *_explain_group(explainer, group.inputs, group.labels, plan),
                                   normalize=normalize, overlays=overlays)
    except LabelError:
        raise
    except (ValueError, ModelInputError) as error:
        first_error = error
    else:
        yield result  # outside ``naming``: the caller's code runs with the warnings as the caller set them
        return
    failed = 0
    if len(group.ids) > 1:
        for image in range(len(group.ids)):
            one = _Group(group.ids[image : image + 1], group.names[image : image + 1], group.labels[image : image + 1],
                         group.inputs[image : image + 1],
                         None if group.displays is None else group.displays[image : image + 1], whole_batch=False)
            try:
                with file_warnings.naming(one.names):
                    result = _group_result(one, *_explain_group(explainer, one.inputs, one.labels, plan),
                                           normalize=normalize, overlays=overlays)
            except LabelError:
                raise
            except (ValueError, ModelInputError) as error:
                failed += 1
                summary.skipped[one.names[0]] = f"explaining it failed: {error_line(error)}"
                continue
            yield result
    else:
        failed = 1
        summary.skipped[group.names[0]] = f"explaining it failed: {error_line(first_error)}"
    if failed == len(group.ids) and nothing_explained() and group.whole_batch:
        for name in group.names:
            summary.skipped.pop(name, None)
        raise first_error  # the first batch fails as a whole: a problem of the run, not of its files
    _write_skipped(summary)


def _predictions(explainer: Explainer, inputs: Tensor, plan: _TargetPlan) -> Optional[tuple[list[int], list[float]]]:
    """The model's top-1 class of each image and its probability (softmax; sigmoid: one logit, or the explainer's
    ``probabilities="sigmoid"``), from a forward pass
    without gradients (the model in eval mode, as explaining runs it, and left as found); None
    when the model's output is not (N, C) class scores."""
    if not plan.classifier:
        return None
    model = explainer.model
    with preserved_model_state(model), torch.no_grad():
        prepared = prepare_inputs(inputs, explainer.preprocess, model_device(model), model_dtype(model),
                                  channels=model_input_channels(model))
        output = explainer.call_model(prepared.batch)
    if not isinstance(output, Tensor) or output.dim() != 2:
        plan.classifier = False
        return None
    plan.class_count = output.shape[1]
    predicted = output.argmax(dim=1)
    scores = output.float()
    probabilities = scores.sigmoid() if explainer.probability_function() == "sigmoid" else class_probabilities(scores)
    confidence = probabilities.gather(1, predicted[:, None])[:, 0]
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
    they are stored (``explain.dataset_tools.stored_maps.stored_form``: low-resolution where the explainer's
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
    (``explain.dataset_tools.stored_maps``, OUT/maps/<prefix><number>.npz) and its overlays, each renamed into place,
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


def merge_shard_indexes(out: Union[str, Path]) -> Path:
    """Merge every ``index.rank*.csv`` into ``index.csv``, and every ``skipped.rank*.csv`` into
    ``skipped.csv``, and remove them. Idempotent: rows of an image already in index.csv are not
    added twice, so a merge cut short by a kill can be rerun. Holds the folder's lock (``folder_lock``)
    while it merges."""
    out = Path(out)
    with folder_lock(out):
        return _merge_shard_indexes(out)


def _removed_images_note(done: set[str], ids: list[str], folder: Path, index: Path) -> list[str]:
    """What a resumed run says of the images its index holds that are no longer in the folder: their rows and maps
    are kept (a folder mounted in part would otherwise lose its results), and the report and strategies read them."""
    gone = sorted(done - set(ids))
    if not gone:
        return []
    shown = next((row["image"] for row in read_index(index) if row["id"] == gone[0]), gone[0]) if index.exists() \
        else gone[0]  # its file as the index names it (another rank's row: its id)
    return [f"{len(gone)} image(s) of {display_name(index)} are no longer in {display_name(folder)} (e.g. "
            f"{one_line(shown)}): their rows and maps are kept, and the report and strategies still show them. To "
            "leave them out, delete their rows from the index, or explain the folder into a new --out."]


def _merge_shard_indexes(out: Path) -> Path:
    """The body of ``merge_shard_indexes``, run while the folder is locked."""
    index_path = out / "index.csv"
    notes: list[str] = []
    existing = _complete_rows(index_path, notes)
    present = {row["id"] for row in _rows_with_maps(out, existing)[0]}  # not an image whose maps file is missing
    shards = [index for index in _indexes(out) if index != index_path]
    rows: list[dict[str, str]] = []
    for shard_index in shards:  # each image once, also where two ranks' files hold it (another world size)
        shard_rows = _complete_rows(shard_index, notes)
        new_ids = {row["id"] for row in shard_rows} - present
        rows.extend(row for row in shard_rows if row["id"] in new_ids)
        present |= new_ids
    replaced = {row["id"] for row in rows}  # rows of the index whose maps file is missing, a shard's now
    existing = [row for row in existing if row["id"] not in replaced]
    for note in notes:
        warn_at_callers_line(note)

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
    if (out / RUN_RECORD).exists():  # the ranks' records, checked until rank 0 had written run.json
        for rank_record in rank_record_paths(out):
            rank_record.unlink()
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
