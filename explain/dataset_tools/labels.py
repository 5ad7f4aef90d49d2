"""The true labels of a dataset run (``explain.run``, ``explain batch``), and what a DataLoader's
batches and dataset say about the images' files.

Label sources for a folder:

- ``"folders"``: the ImageFolder layout, ``DIR/<class>/.../<image>``: the first folder under DIR
  is the class. Its index is the model's class whose name is the folder's name when the model
  has class names (exact, else case-insensitive or a comma-separated synonym, as ``class_index``
  matches), else the folder's position among DIR's class folders in sorted order (as
  torchvision's ``ImageFolder`` numbers them; the folder names then name the classes).
- a CSV file with the header ``path,label`` (more columns are allowed and ignored): ``path``
  relative to DIR, ``label`` a class index or a class name of the model.
- a mapping ``{path: label}`` (Python only), paths and labels as in the CSV file.

Images that a CSV file or mapping does not list have no label. A DataLoader's labels come from
its batches: ``(images, labels)`` or ``(images, labels, paths)`` tuples, or dicts with
``image``/``images``/``pixel_values``, ``label``/``labels`` and ``path``/``paths`` entries;
labels are (N,) indices of the model's classes, a negative one meaning "no label" (torchvision's
STL10 marks its unlabelled images with -1); an ``ImageFolder`` that numbers its folders otherwise
than the model orders the same class names has its labels renumbered by name
(``dataset_label_numbering``). The images' file names come from the batch when it carries them,
else from the dataset's ``samples`` (torchvision ``ImageFolder``/``DatasetFolder``, also inside a
``Subset``) when the loader reads it in order; a shuffling loader's order cannot be known.
"""

from __future__ import annotations

import csv
import os
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..core.targets import ClassRef, class_index

PathLike = Union[str, "os.PathLike[str]"]
LabelSource = Union[None, PathLike, Mapping[PathLike, ClassRef]]
"""Where a folder's labels come from: None (no labels), "folders", a CSV file, or {path: label}."""

CSV_COLUMNS = ("path", "label")
IMAGE_KEYS = ("image", "images", "pixel_values")
LABEL_KEYS = ("label", "labels")
PATH_KEYS = ("path", "paths")
SHOWN = 5
"""How many offending entries an error lists."""


class LabelError(ValueError):
    """Labels that cannot be used as given (an unknown class, a file that is not there, a label
    out of range): stops the run with a message that says which entry and how to fix it."""


@dataclass
class FolderLabels:
    """The labels of a folder's images.

    by_path: class index per image, by its path relative to the folder; images without a label
        are absent.
    class_names: names of the classes when the model has none and the labels name them (the
        class folders by sorted position), else None.
    note: one sentence for the run's output saying where the labels came from and how they were
        numbered.
    """

    by_path: dict[Path, int]
    class_names: Optional[list[str]]
    note: str


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def folder_labels(folder: Path, files: Sequence[Path], source: LabelSource,
                  class_names: Optional[Sequence[str]], exclude: Optional[Path] = None) -> Optional[FolderLabels]:
    """The labels of ``files`` (every image of ``folder``, as ``image_files`` lists them) from
    ``source`` (see the module docstring); None when ``source`` is None. ``class_names``: the
    model's, or None. ``exclude``: the output folder, never a class folder. Raises LabelError."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        keys = [key for key in source if not isinstance(key, (str, os.PathLike))]
        if keys:
            raise LabelError(f"a labels mapping's keys are paths relative to the image folder; got {keys[0]!r}.")
        entries = [(f"entry {str(key)!r}", os.fspath(key), value) for key, value in source.items()]
        return _table_labels(folder, files, entries, class_names, "the labels mapping")
    if isinstance(source, str) and source == "folders":
        return _labels_from_folders(folder, files, class_names, exclude)
    if not isinstance(source, (str, os.PathLike)):
        raise LabelError(f"labels must be 'folders', a CSV file (columns path,label) or a mapping {{path: label}}; "
                         f"got {type(source).__name__}.")
    path = Path(source)
    if not path.is_file():
        raise LabelError(f"labels {str(source)!r}: no such file. Give 'folders' (the first folder under the image "
                         "folder is the class) or a CSV file with the columns path,label.")
    return _table_labels(folder, files, read_label_csv(path), class_names, f"{path}")


def _labels_from_folders(folder: Path, files: Sequence[Path], class_names: Optional[Sequence[str]],
                         exclude: Optional[Path]) -> FolderLabels:
    excluded = exclude.resolve() if exclude is not None else None
    classes = sorted(entry.name for entry in folder.iterdir()
                     if entry.is_dir() and not entry.name.startswith(".")
                     and (excluded is None or entry.resolve() != excluded))
    loose = [str(path.relative_to(folder)) for path in files if len(path.relative_to(folder).parts) < 2]
    if loose:
        raise LabelError(f"--labels folders reads the class from the first folder under {str(folder)!r}, and "
                         f"{len(loose)} image(s) lie directly in it, outside any class folder: {_listed(loose)}. Move "
                         "them into a class folder, or give the labels in a CSV file (columns path,label).")
    if class_names is None:
        index_of = {name: position for position, name in enumerate(classes)}
        listed = ", ".join(f"{name}={position}" for name, position in list(index_of.items())[:10])
        note = (f"labels: from the class folders by their position in sorted order (the model has no class names): "
                f"{listed}{' ...' if len(classes) > 10 else ''}")
        names: Optional[list[str]] = list(classes)
    else:
        index_of, unknown = _match_class_names(sorted({path.relative_to(folder).parts[0] for path in files}),
                                               class_names)  # the folders holding images
        if unknown:
            raise LabelError(f"--labels folders: {len(unknown)} class folder(s) of {str(folder)!r} name no class of "
                             f"the model: {'; '.join(unknown[:SHOWN])}. Rename the folders to the model's class names, "
                             "or give the labels in a CSV file (columns path,label).")
        clashes = [name for name in index_of if list(index_of.values()).count(index_of[name]) > 1]
        if clashes:
            raise LabelError(f"--labels folders: the folders {_listed(clashes)} name the same class of the model; "
                             "merge them or give the labels in a CSV file.")
        note = f"labels: from the class folders, matched by name to the model's {len(class_names)} class names"
        names = None
    by_path = {path.relative_to(folder): index_of[path.relative_to(folder).parts[0]] for path in files}
    return FolderLabels(by_path, names, note)


def _match_class_names(names: Sequence[str], class_names: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """Each of ``names`` (class folders, a dataset's classes) as the model's class of that name
    (exact, else as ``class_index`` matches, both in composed Unicode); and the names that match
    none, each with the reason."""
    index_of: dict[str, int] = {}
    unknown = []
    composed_names = [_composed(str(known)) for known in class_names]
    for name in names:
        exact = [position for position, known in enumerate(composed_names) if known == _composed(name)]
        try:
            index_of[name] = exact[0] if len(exact) == 1 else class_index(_composed(name), composed_names)
        except ValueError as error:
            unknown.append(f"{name!r} ({error})")
    return index_of, unknown


def read_label_csv(path: Path) -> list[tuple[str, str, Any]]:
    """The entries of a label CSV file as (where, path, label) triples, ``where`` naming its line.
    Raises LabelError for a missing or bad header and for a row without a path or a label."""
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as file:
        rows = list(csv.reader(file))
    expected = ",".join(CSV_COLUMNS)
    if not rows:
        raise LabelError(f"the label file {str(path)!r} is empty; its first line must be the header {expected!r}.")
    header = [column.strip().lower() for column in rows[0]]
    if any(column not in header for column in CSV_COLUMNS) or len(set(header)) != len(header):
        raise LabelError(f"the label file {str(path)!r} must start with the header {expected!r} (a path relative to "
                         f"the image folder, and a class index or name per line); its first line is "
                         f"{','.join(rows[0])!r}.")
    path_column, label_column = header.index("path"), header.index("label")
    entries = []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line
        if len(row) <= max(path_column, label_column):
            raise LabelError(f"{path}, line {number}: {len(row)} column(s), the header has {len(header)}.")
        image, label = row[path_column], row[label_column].strip()
        if not image.strip() or not label:
            raise LabelError(f"{path}, line {number}: {'the path' if not image.strip() else 'the label'} is empty.")
        entries.append((f"line {number}", image, label))
    return entries


def resolve_label(label: Any, class_names: Optional[Sequence[str]], where: str) -> int:
    """A label (an int, a string of decimal digits, signed or not, or a class name) as a class
    index; LabelError otherwise (a negative index included)."""
    if isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_)):
        index = int(label)
    elif isinstance(label, str) and re.fullmatch(r"[+-]?\d+", label.strip()):
        index = int(label.strip())
    elif isinstance(label, str):
        if class_names is None:
            raise LabelError(f"{where}: the label {label!r} is a class name, but the model's class names are not "
                             "known: give class indices, or the names (--class-names FILE, or class_names= of the "
                             "explainer).")
        try:
            return class_index(_composed(label), [_composed(str(name)) for name in class_names])
        except ValueError as error:
            raise LabelError(f"{where}: {error}") from None
    else:
        raise LabelError(f"{where}: a label is a class index (a non-negative int) or a class name; got {label!r}.")
    if index < 0:
        raise LabelError(f"{where}: label {index} is negative; a label is a class index from 0. Leave out an image "
                         "that has no label.")
    if class_names is not None and index >= len(class_names):
        raise LabelError(f"{where}: label {index} is out of range: the model has {len(class_names)} classes.")
    return index


def _composed(text: str) -> str:
    """Text in Unicode's composed form (NFC): "é" as one character, as macOS's file names (decomposed:
    "e" and an accent) are not, so that a folder named on a Mac matches the class name."""
    return unicodedata.normalize("NFC", text)


def _table_labels(folder: Path, files: Sequence[Path], entries: Sequence[tuple[str, str, Any]],
                  class_names: Optional[Sequence[str]], origin: str) -> FolderLabels:
    """Labels listed by path (a CSV file's lines, a mapping's entries), checked against the folder."""
    images = {path.relative_to(folder) for path in files}
    by_path: dict[Path, int] = {}
    first_seen: dict[Path, str] = {}
    missing, duplicated = [], []
    for where, image, label in entries:
        relative = _relative(folder, image)
        if relative is None or relative not in images:
            on_disk = relative is not None and (folder / relative).is_file()
            why = ("outside the folder" if relative is None else
                   "not among the images explained (hidden, not an image file, or in the output folder)" if on_disk
                   else "no such file")
            missing.append(f"{where}: {image!r} ({why})")
            continue
        if relative in first_seen:
            duplicated.append(f"{image!r} ({first_seen[relative]} and {where})")
            continue
        first_seen[relative] = where
        by_path[relative] = resolve_label(label, class_names, f"{origin}, {where}")
    if missing:
        raise LabelError(f"{origin}: {len(missing)} path(s) name no image of {str(folder)!r}: {_listed(missing)}. "
                         "Paths are relative to the image folder.")
    if duplicated:
        raise LabelError(f"{origin}: {len(duplicated)} image(s) are listed more than once: {_listed(duplicated)}. "
                         "Keep one label per image.")
    note = f"labels: {len(by_path)} of {len(images)} image(s) labelled by {origin}"
    return FolderLabels(by_path, None, note)


def _relative(folder: Path, image: str) -> Optional[Path]:
    """A listed path as a path relative to the folder (normalised: "./a//b.png" is "a/b.png"); None
    when it lies outside the folder."""
    path = Path(os.path.normpath(image.strip()))
    if path.is_absolute():
        for base in (folder, folder.resolve()):
            if path.is_relative_to(base):
                return path.relative_to(base)
        return None
    if path.parts and path.parts[0] == "..":
        return None
    return path


# ---------------------------------------------------------------- DataLoader batches and datasets


@dataclass
class LoaderBatchItems:
    """One DataLoader batch, taken apart: images (N, C, H, W) model input; labels: a class index
    per image (None: no label), or None when the batch has none; paths: a file name per image, or
    None when the batch carries none."""

    images: Tensor
    labels: Optional[list[Optional[int]]]
    paths: Optional[list[str]]


def split_loader_batch(batch: Any) -> LoaderBatchItems:
    """A batch as a DataLoader yields it: a (N, C, H, W) tensor; a tuple or list whose first item is
    the images, then labels and file names (in any order after the images: an item of N strings is
    the file names, the first other item the labels; strings that are not file names, such as class
    names, are refused); or a dict (keys in the module docstring).
    Raises LabelError for labels that are not (N,) class indices, ValueError for images that are
    not a (N, C, H, W) tensor."""
    if isinstance(batch, Tensor):
        return LoaderBatchItems(_checked_images(batch), None, None)
    if isinstance(batch, Mapping):
        image_key = next((key for key in IMAGE_KEYS if key in batch), None)
        if image_key is None:
            raise LabelError(f"a dict batch must hold the images under one of {', '.join(IMAGE_KEYS)}; this one has "
                             f"the keys {', '.join(map(str, batch))}.")
        images = _checked_images(batch[image_key])
        label_key = next((key for key in LABEL_KEYS if key in batch), None)
        path_key = next((key for key in PATH_KEYS if key in batch), None)
        count = len(images)
        labels = None if label_key is None else _batch_labels(batch[label_key], count, f"the batch's {label_key!r}")
        paths = None if path_key is None else _batch_paths(batch[path_key], count)
        if path_key is not None and paths is None:
            raise LabelError(f"the batch's {path_key!r} must hold one file name (a string) per image.")
        return LoaderBatchItems(images, labels, paths)
    if isinstance(batch, (tuple, list)) and batch:
        images = _checked_images(batch[0])
        count = len(images)
        labels, paths = None, None
        for position, item in enumerate(batch[1:], start=1):
            found = _batch_paths(item, count) if paths is None else None
            if found is not None and not all(_names_a_file(path) for path in found):
                odd = [path for path in found if not _names_a_file(path)]
                raise LabelError(
                    f"the batch's item {position} holds strings that are not file names (no folder, no file "
                    f"extension: {', '.join(map(repr, odd[:SHOWN]))}). Labels must be (N,) class indices, not class "
                    "names: map each name to its index (e.g. class_names.index(name)); file names without an "
                    "extension go in a dict batch under 'path'.")
            if found is not None:
                paths = found
            elif labels is None:
                labels = _batch_labels(item, count, f"the batch's item {position} (its labels)")
        return LoaderBatchItems(images, labels, paths)
    raise TypeError(f"a DataLoader batch must be a (N, C, H, W) tensor, a tuple (images, labels[, paths]) or a dict; "
                    f"got {type(batch).__name__}.")


def _checked_images(images: Any) -> Tensor:
    """A batch's images, which must be a (N, C, H, W) tensor; ValueError otherwise."""
    if not isinstance(images, Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"a DataLoader batch's images must be a (N, C, H, W) model-input tensor; got {shape}. (A "
                         "DataLoader with batch_size=None yields single images: give it a batch_size.)")
    return images


def _batch_labels(value: Any, count: int, what: str) -> list[Optional[int]]:
    """(N,) integer class indices → a list, negative ones as None; LabelError otherwise."""
    if isinstance(value, Tensor):
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        if value.dim() != 1 or value.shape[0] != count or not integer:
            advice = " (one-hot or scores: pass labels.argmax(1))" if value.dim() == 2 else ""
            raise LabelError(f"{what} must be (N,) integer class indices, N = {count} images; got a {value.dtype} "
                             f"tensor of shape {tuple(value.shape)}{advice}. A batch that is not (images, labels) "
                             "can be passed as the images alone.")
        values = value.tolist()
    elif isinstance(value, (list, tuple)) and len(value) == count and all(
            isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)) for item in value):
        values = [int(item) for item in value]
    else:
        raise LabelError(f"{what} must be (N,) integer class indices, N = {count} images; got {type(value).__name__}.")
    return [int(item) if int(item) >= 0 else None for item in values]


def _names_a_file(text: str) -> bool:
    """Whether a string looks like a file's name (it has a folder or an extension such as ".png"),
    unlike a class name ("cat", "tabby, tabby cat", "st. bernard")."""
    path = Path(text)
    return len(path.parts) > 1 or re.fullmatch(r"\.[A-Za-z0-9]{1,10}", path.suffix) is not None


def _batch_paths(value: Any, count: int) -> Optional[list[str]]:
    """An item holding one file name per image, as strings; None when it is not that."""
    if isinstance(value, (list, tuple)) and len(value) == count and count > 0 and all(
            isinstance(item, (str, os.PathLike)) for item in value):
        return [os.fspath(item) for item in value]
    return None


@dataclass
class DatasetOrder:
    """What a DataLoader's dataset says about its images in the order the loader yields them.

    paths: the file of each image, in that order, or None when unknown; root: the dataset's folder
    (``ImageFolder.root``), for ids relative to it; classes: the dataset's class names
    (``ImageFolder.classes``); shuffled: whether the loader's order changes from run to run (a
    sampler other than sequential), so that positions cannot name images; relabelled: whether the
    dataset has a ``target_transform``, so that its labels need not be positions in ``classes``.
    """

    paths: Optional[list[str]] = None
    root: Optional[Path] = None
    classes: Optional[list[str]] = None
    shuffled: bool = False
    relabelled: bool = False


def dataset_order(loader: Any) -> DatasetOrder:
    """The DatasetOrder of ``loader`` (any iterable; a torch DataLoader is looked into)."""
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

    if not isinstance(loader, DataLoader):
        return DatasetOrder()
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else loader.sampler
    in_order = isinstance(sampler, SequentialSampler) and (batch_sampler is None or type(batch_sampler) is BatchSampler)
    dataset, indices = loader.dataset, None
    while isinstance(dataset, Subset):
        inner = list(dataset.indices)
        indices = inner if indices is None else [inner[index] for index in indices]
        dataset = dataset.dataset
    samples = getattr(dataset, "samples", None) or getattr(dataset, "imgs", None)
    classes = getattr(dataset, "classes", None)
    root = getattr(dataset, "root", None)
    order = DatasetOrder(root=Path(root) if isinstance(root, (str, os.PathLike)) else None,
                         classes=[str(name) for name in classes] if isinstance(classes, (list, tuple)) else None,
                         shuffled=not in_order, relabelled=getattr(dataset, "target_transform", None) is not None)
    if in_order and isinstance(samples, (list, tuple)) and all(
            isinstance(sample, (list, tuple)) and sample and isinstance(sample[0], (str, os.PathLike))
            for sample in samples):
        files = [os.fspath(sample[0]) for sample in samples]
        order.paths = files if indices is None else [files[index] for index in indices]
    return order


def dataset_label_numbering(order: DatasetOrder, class_names: Optional[Sequence[str]]) -> Optional[dict[int, int]]:
    """The model's class index of each of the dataset's label indices, where the dataset numbers the
    model's classes otherwise: an ``ImageFolder`` numbers its class folders in sorted order, and a
    model whose class names are the folders' names may order them otherwise. Matched by name, as
    ``--labels folders`` matches folders. None when the numbering is the model's, or cannot be told
    (no class names on either side, names that are not the model's, a ``target_transform``)."""
    if order.classes is None or class_names is None or order.relabelled:
        return None
    index_of, unknown = _match_class_names(order.classes, class_names)
    if unknown or len(set(index_of.values())) < len(index_of):
        return None
    numbering = {position: index_of[name] for position, name in enumerate(order.classes)}
    return None if all(position == index for position, index in numbering.items()) else numbering
