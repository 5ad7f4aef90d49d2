"""Explain a whole folder or DataLoader, writing results to disk: resumable, bounded memory,
sharded across processes under ``torchrun``.

Output folder layout:

    OUT/index.csv            one row per image and target: id, image, target, class_name,
                             score, probability, map  (written by rank 0 when sharded)
    OUT/maps/<id>.npy        float16 (K, H, W) maps in [0, 1] at the input's resolution
    OUT/overlays/<id>.png    heatmap overlays, K side by side (with overlays=True)
    OUT/index.rank<R>.csv    each process's rows when run under torchrun (merged into index.csv)

An image whose row is in an index is done: a rerun skips it, so an interrupted run
resumes where it stopped. A row is written only after its map file.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from . import render
from .methods.base import Explainer

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
FIELDS = ["id", "image", "target", "class_name", "score", "probability", "map"]


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


def image_files(folder: Union[str, Path]) -> list[Path]:
    """Every image file under ``folder`` (recursively), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {str(folder)!r}.")
    return sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())


def _item_id(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder).with_suffix("")).replace(os.sep, "__")


def _done_ids(out: Path) -> set[str]:
    done = set()
    for index in out.glob("index*.csv"):
        with open(index, newline="") as file:
            done.update(row["id"] for row in csv.DictReader(file))
    return done


def _batches_of_files(folder: Path, shard: Shard, batch_size: int) -> Iterator[tuple[list[str], list, list[str]]]:
    files = image_files(folder)[shard.rank :: shard.world_size]
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        yield [_item_id(path, folder) for path in chunk], [str(path) for path in chunk], [str(path) for path in chunk]


def _batches_of_loader(loader: Iterable, shard: Shard) -> Iterator[tuple[list[str], object, list[str]]]:
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
    data: Union[str, Path, Iterable],
    out: Union[str, Path],
    *,
    target=None,
    topk: Optional[int] = None,
    batch_size: int = 16,
    overlays: bool = False,
    progress: bool = True,
    shard: Optional[Shard] = None,
    on_batch: Optional[Callable[[int], None]] = None,
) -> Path:
    """Explain every image of a folder (recursively) or every batch of a DataLoader, and write
    maps, optional overlays and an index to ``out`` (layout in this module's docstring).

    data: a folder of images, or an iterable of (N, C, H, W) model-input batches (or
        (batch, labels) pairs, e.g. a DataLoader without shuffling, so that a rerun sees the
        same order). target / topk: as in ``explain``, applied to every batch.
    Images already in the index are skipped. Memory stays that of one batch.
    Under torchrun each process takes every world_size-th image. on_batch(done) is called
    after each batch with the number of images written so far. Returns this process's index.
    """
    out = Path(out)
    (out / "maps").mkdir(parents=True, exist_ok=True)
    if overlays:
        (out / "overlays").mkdir(exist_ok=True)
    shard = shard or Shard.from_environment()
    index_path = out / ("index.csv" if shard.world_size == 1 else f"index.rank{shard.rank}.csv")
    done = _done_ids(out)
    if isinstance(data, (str, Path)):
        folder = Path(data)
        total = len(image_files(folder)[shard.rank :: shard.world_size])
        batches = _batches_of_files(folder, shard, batch_size)
    else:
        total = None
        batches = _batches_of_loader(data, shard)
    new_index = not index_path.exists()
    written = 0
    with open(index_path, "a", newline="") as index_file, tqdm(
        total=total, disable=not progress, desc=f"explain {explainer.method_name}", unit="image"
    ) as bar:
        writer = csv.DictWriter(index_file, fieldnames=FIELDS)
        if new_index:
            writer.writeheader()
        for ids, inputs, names in batches:
            todo = [position for position, item_id in enumerate(ids) if item_id not in done]
            bar.update(len(ids) - len(todo))
            if not todo:
                continue
            inputs = _select(inputs, todo)
            explanation = explainer.explain(inputs, target=target, topk=topk)
            for row, position in enumerate(todo):
                _write_result(out, writer, explanation, row, ids[position], names[position], overlays)
            index_file.flush()
            written += len(todo)
            bar.update(len(todo))
            if on_batch is not None:
                on_batch(written)
    return index_path


def _select(inputs, positions: Sequence[int]):
    if isinstance(inputs, list):
        return [inputs[position] for position in positions]
    return inputs[list(positions)]


def _write_result(out: Path, writer: csv.DictWriter, explanation, row: int, item_id: str, name: str,
                  overlays: bool) -> None:
    maps = explanation.map_grid[row].detach().float().cpu()  # (K, H, W)
    map_file = Path("maps") / f"{item_id}.npy"
    np.save(out / map_file, maps.numpy().astype(np.float16))
    if overlays:
        tiles = render.overlay(explanation.images[row], maps)
        Image.fromarray(np.concatenate(list(tiles), axis=1)).save(out / "overlays" / f"{item_id}.png")
    for k in range(maps.shape[0]):
        index = None if explanation.class_indices is None else int(explanation.class_indices[row, k])
        names = explanation.class_names
        writer.writerow({
            "id": item_id,
            "image": name,
            "target": "" if index is None else index,
            "class_name": names[index] if names is not None and index is not None and index < len(names) else "",
            "score": f"{float(explanation.scores[row, k]):.6g}",
            "probability": "" if explanation.probabilities is None
            else f"{float(explanation.probabilities[row, k]):.6g}",
            "map": str(map_file),
        })


def merge_shard_indexes(out: Union[str, Path]) -> Path:
    """Append the rows of every ``index.rank*.csv`` to ``index.csv`` (once) and remove them."""
    out = Path(out)
    index_path = out / "index.csv"
    rows = []
    shards = sorted(out.glob("index.rank*.csv"))
    for shard_index in shards:
        with open(shard_index, newline="") as file:
            rows.extend(csv.DictReader(file))
    new_index = not index_path.exists()
    with open(index_path, "a", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        if new_index:
            writer.writeheader()
        writer.writerows(sorted(rows, key=lambda row: row["id"]))
    for shard_index in shards:
        shard_index.unlink()
    return index_path
