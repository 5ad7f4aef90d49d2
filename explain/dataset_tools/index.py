"""A run's index (OUT/index.csv, one per shard): its rows written so that a kill leaves whole rows, read back, and
merged across shards."""

from __future__ import annotations

import csv
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    BinaryIO,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Union,
)

import numpy as np
import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs into one folder are not locked there
    fcntl = None  # type: ignore[assignment]

from .run_folder import Shard, display_name, error_line, write_atomically
from .stored_maps import SUFFIX, StoredMaps, load_maps

EARLIER_FIELDS = ["id", "image", "target", "k", "targets", "class_name", "score", "probability", "map"]
"""The columns of an index written before the label columns were added."""


LABEL_FIELDS = ["label", "label_name", "predicted", "predicted_name", "confidence", "correct", "role"]


FIELDS = EARLIER_FIELDS + LABEL_FIELDS


BYTE_ORDER_MARK = b"\xef\xbb\xbf"


SKIPPED_FIELDS = ["image", "reason"]


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
    kept, lost = _rows_with_maps(out, rows)
    if lost:  # its maps files deleted: the images are explained again, their rows removed so that none is twice
        kept_ids = {row["id"] for row in kept}
        lines = own_index.read_bytes().splitlines(keepends=True)
        write_atomically(own_index, lambda temporary: temporary.write_bytes(b"".join(
            [lines[0]] + [line for line, row in zip(lines[1:], rows) if row["id"] in kept_ids])))
        notes.append(_missing_maps_note(own_index, rows, lost))
    for index in others:  # another process's rows: its images are not done where their maps file is missing
        kept += _rows_with_maps(out, read_index(index))[0]
    return {row["id"] for row in kept}, {row["map"] for row in kept}


def _rows_with_maps(out: Path, rows: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    """The rows of the images whose maps file is in the folder ``out``, and the maps files that are not (deleted
    by hand), in the order their rows name them."""
    present: dict[str, bool] = {}
    for row in rows:
        if row["map"] not in present:
            present[row["map"]] = (out / row["map"]).is_file()
    missing_ids = {row["id"] for row in rows if not present[row["map"]]}
    return [row for row in rows if row["id"] not in missing_ids], [name for name, there in present.items()
                                                                    if not there]


def _missing_maps_note(index: Path, rows: list[dict[str, str]], lost: list[str]) -> str:
    """What a resumed run says when maps files that its index names are missing."""
    images = len({row["id"] for row in rows if row["map"] in set(lost)})
    return (f"{len(lost)} maps file(s) that {display_name(index)} names are missing (deleted?), e.g. {lost[0]}: "
            f"the rows of their {images} image(s) were removed from it, and those images are explained again.")


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
    float32 maps as ``Explanation.map_grid`` held them (see ``explain.dataset_tools.stored_maps``: maps stored at the
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


