"""Explain a whole folder or DataLoader, writing results to disk: resumable, bounded memory,
sharded across processes under ``torchrun``, safe against ``kill -9`` at any moment.

Output folder layout:

    OUT/index.csv            one row per image and target: id, image, target, k, targets,
                             class_name, score, probability, map (written by rank 0 when sharded)
    OUT/maps/<id>.npy        float16 (K, H, W) maps in [0, 1] at the input's resolution
    OUT/overlays/<id>.png    heatmap overlays, K side by side (with overlays=True)
    OUT/skipped.csv          files that could not be read as images, with the reason
    OUT/index.rank<R>.csv    each process's rows when run under torchrun (merged into index.csv)

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
the last line). A file's id is its path relative to the folder, made safe as a file name,
plus a short hash of that path, so that ``cat.png`` and ``cat.jpg``, or ``a/b.png`` and
``a__b.png``, never share files.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm.auto import tqdm

from . import render
from .capture import ModelInputError
from .explanation import Explanation
from .inputs import load_image
from .methods.base import Explainer, progress_shown_by_caller
from .targets import Target

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
FIELDS = ["id", "image", "target", "k", "targets", "class_name", "score", "probability", "map"]
BYTE_ORDER_MARK = b"\xef\xbb\xbf"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SKIPPED_FIELDS = ["image", "reason"]

LoaderBatch = Union[Tensor, tuple[Any, ...], list[Any]]
"""A batch of a DataLoader: (N, C, H, W) model input, or a tuple or list whose first item is that
((batch, labels) pairs)."""
Batch = tuple[list[str], Union[list[Path], Tensor], list[str]]
"""(ids, the files to load or the model-input batch, display names) of one batch of a run."""


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
    files that could not be read (listed with the reason in ``skipped_file``)."""

    index: Path
    explained: int = 0
    already_done: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_file: Optional[Path] = None


def display_name(path: Union[str, Path]) -> str:
    """A path as one line of text that can always be written: bytes that are not UTF-8, and
    control characters (a newline in a file name), appear as \\x escapes."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return re.sub(r"[\x00-\x1f\x7f]", lambda match: f"\\x{ord(match.group()):02x}", text)


def item_id(path: Path, folder: Path) -> str:
    """A stable, unique, file-name-safe id: the relative path (separators as "__", other unsafe
    characters as "_") and 8 hex digits of a hash of the exact relative path."""
    relative = path.relative_to(folder)
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", "__".join(display_name(part) for part in relative.parts))
    digest = hashlib.sha1(os.fsencode(relative)).hexdigest()[:8]
    return f"{readable[-100:]}-{digest}"


def image_files(folder: Union[str, Path], exclude: Optional[Union[str, Path]] = None) -> list[Path]:
    """Every image file under ``folder`` (recursively), sorted; hidden files and files in hidden
    folders (a name starting with ".": ``.ipynb_checkpoints/``, ``.git/``) and files under
    ``exclude`` (the output folder, when it lies inside the input folder) are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {display_name(folder)!r}.")
    excluded = Path(exclude).resolve() if exclude is not None else None
    files: list[Path] = []
    for path in folder.rglob("*"):
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            continue
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
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


def _is_header(line: bytes) -> bool:
    """Whether a line is the index header: the FIELDS, whatever the line ending or byte-order mark."""
    if not line.endswith(b"\n"):
        return False  # torn, or old Mac "\r" line endings, which would make the whole file one line
    text = line.removeprefix(BYTE_ORDER_MARK).decode("utf-8", "replace")
    return next(csv.reader([text]), []) == FIELDS


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


def _done_ids(out: Path, own_index: Path) -> set[str]:
    """Ids of the images complete in this process's index (cut back to its last complete image)
    and in the other indexes of the folder (other ranks, the merged index)."""
    done = {row["id"] for row in _complete_rows(own_index)}
    for index in out.glob("index*.csv"):
        if index != own_index:
            with open(index, newline="", encoding="utf-8-sig", errors="replace") as file:
                rows = list(csv.DictReader(file))
            counts: dict[str, int] = {}
            for row in rows:
                counts[row["id"]] = counts.get(row["id"], 0) + 1
            done.update(row["id"] for row in rows if row.get("targets", "").isdigit()
                        and counts[row["id"]] == int(row["targets"]))
    return done


def _batches_of_files(files: Sequence[Path], folder: Path, batch_size: int) -> Iterator[Batch]:
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        yield [item_id(path, folder) for path in chunk], list(chunk), [display_name(path) for path in chunk]


def _batches_of_loader(loader: Iterable[LoaderBatch], shard: Shard) -> Iterator[Batch]:
    position = 0
    for batch in loader:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        count = len(images)
        ids = [f"{position + offset:08d}" for offset in range(count)]
        position += count
        keep = [offset for offset in range(count) if (position - count + offset) % shard.world_size == shard.rank]
        if keep:
            yield [ids[i] for i in keep], images[keep] if len(keep) < count else images, [ids[i] for i in keep]


def run(
    explainer: Explainer,
    data: Union[str, Path, Iterable[LoaderBatch]],
    out: Union[str, Path],
    *,
    target: Target = None,
    topk: Optional[int] = None,
    batch_size: int = 16,
    overlays: bool = False,
    progress: bool = True,
    shard: Optional[Shard] = None,
    on_batch: Optional[Callable[[int], None]] = None,
) -> RunSummary:
    """Explain every image of a folder (recursively) or every batch of a DataLoader, and write
    maps, optional overlays and an index to ``out`` (layout in this module's docstring).

    data: a folder of images, or an iterable of (N, C, H, W) model-input batches (or
        (batch, labels) pairs, e.g. a DataLoader without shuffling, so that a rerun sees the
        same order). target / topk: as in ``explain``, applied to every batch.
    Images already in the index are skipped; files that cannot be read as images are skipped
    and listed in OUT/skipped.csv with the reason (a rerun tries them again). Hidden files and
    folders (".ipynb_checkpoints/") and an output folder inside the input folder are not
    explained. A full disk raises an OSError saying so, with the index consistent (the same run
    resumes after space is freed). Memory stays that of one batch. Under torchrun
    each process takes every world_size-th image. on_batch(done) is called after each batch
    with the number of images written so far. Returns a RunSummary.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {display_name(out)!r} is a file; give a folder (it is created if missing).")
    shard = shard or Shard.from_environment()
    index_path = out / ("index.csv" if shard.world_size == 1 else f"index.rank{shard.rank}.csv")
    summary = RunSummary(index_path, skipped_file=out / "skipped.csv")
    with _stop_when_disk_full(out, summary):
        _run(explainer, data, out, summary, shard, target, topk, batch_size, overlays, progress, on_batch)
    return summary


def _run(explainer: Explainer, data: Union[str, Path, Iterable[LoaderBatch]], out: Path, summary: RunSummary,
         shard: Shard, target: Target, topk: Optional[int], batch_size: int, overlays: bool, progress: bool,
         on_batch: Optional[Callable[[int], None]]) -> None:
    """The body of ``run``, recording what it did in ``summary``."""
    (out / "maps").mkdir(parents=True, exist_ok=True)
    if overlays:
        (out / "overlays").mkdir(exist_ok=True)
    done = _done_ids(out, summary.index)
    line_ending = index_line_ending(summary.index)
    if isinstance(data, (str, Path)):
        folder = Path(data)
        files = image_files(folder, exclude=out)[shard.rank :: shard.world_size]
        total: Optional[int] = len(files)
        batches: Iterator[Batch] = _batches_of_files(files, folder, batch_size)
    else:
        total = None
        batches = _batches_of_loader(data, shard)
    with open(summary.index, "ab", buffering=0) as index_file, progress_shown_by_caller(), tqdm(
        total=total, disable=not progress, desc=f"explain {explainer.method_name}", unit="image"
    ) as bar:
        for ids, inputs, names in batches:
            todo = [position for position, item in enumerate(ids) if item not in done]
            summary.already_done += len(ids) - len(todo)
            bar.update(len(ids) - len(todo))
            if not todo:
                continue
            for loaded, readable in _explainable_groups(inputs, todo, names, summary):
                try:
                    explanation = explainer.explain(loaded, target=target, topk=topk)
                except (ValueError, ModelInputError) as error:
                    if summary.explained == 0 and len(readable) == len(todo):
                        raise  # the first batch fails as a whole: a problem of the run, not of its files
                    for position in readable:
                        summary.skipped[names[position]] = f"explaining it failed: {_first_line(error)}"
                    _write_skipped(summary)
                    continue
                for row, position in enumerate(readable):
                    rows = _write_result(out, explanation, row, ids[position], names[position], overlays, line_ending)
                    _append(index_file, rows)
                    summary.explained += 1
            bar.update(len(todo))
            if on_batch is not None:
                on_batch(summary.explained)
    _write_skipped(summary)


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
            summary.skipped[names[position]] = _first_line(error)
            continue
        images, positions = groups.setdefault(image.size, ([], []))
        images.append(image)
        positions.append(position)
    if len(summary.skipped):
        _write_skipped(summary)
    yield from groups.values()


def _first_line(error: BaseException) -> str:
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


def _write_result(out: Path, explanation: Explanation, row: int, item: str, name: str, overlays: bool,
                  line_ending: str) -> bytes:
    """Write the image's map (and overlay) files, renamed into place; return its K index rows
    (for ``_append``, which adds them in one write)."""
    maps = explanation.map_grid[row].detach().float().cpu()  # (K, H, W)
    map_file = Path("maps") / f"{item}.npy"
    write_atomically(out / map_file, lambda temporary: _save_array(temporary, maps.numpy().astype(np.float16)))
    if overlays:
        tiles = np.concatenate(list(render.overlay(explanation.images[row], maps)), axis=1)
        write_atomically(out / "overlays" / f"{item}.png",
                          lambda temporary: Image.fromarray(tiles).save(temporary, format="PNG"))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator=line_ending)
    targets = maps.shape[0]
    for k in range(targets):
        index = None if explanation.class_indices is None else int(explanation.class_indices[row, k])
        names = explanation.class_names
        writer.writerow({
            "id": item,
            "image": name,
            "target": "" if index is None else index,
            "k": k,
            "targets": targets,
            "class_name": names[index] if names is not None and index is not None and index < len(names) else "",
            "score": f"{float(explanation.scores[row, k]):.6g}",
            "probability": "" if explanation.probabilities is None
            else f"{float(explanation.probabilities[row, k]):.6g}",
            "map": map_file.as_posix(),
        })
    return buffer.getvalue().encode("utf-8")


def _append(index_file: BinaryIO, rows: bytes) -> None:
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
    """Merge every ``index.rank*.csv`` into ``index.csv`` and remove them. Idempotent: rows of an
    image already in index.csv are not added twice, so a merge cut short by a kill can be rerun."""
    out = Path(out)
    index_path = out / "index.csv"
    existing = _complete_rows(index_path)
    present = {row["id"] for row in existing}
    shards = sorted(out.glob("index.rank*.csv"))
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
    for shard_index in shards:
        shard_index.unlink()
    return index_path
