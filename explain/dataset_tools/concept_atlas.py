"""A concept atlas: for every concept (channel) of a layer, the images of a data set where it carried the most relevance
for the image's predicted class (CRP's relevance maximisation) and where it was most active, with the patches where it
looked, and the classes that use it most; stored once, looked up for free, browsable offline.

    atlas = build_atlas(model, "layer3", "images/", "atlas/")     # resumable: run it again after a kill
    atlas.references(12)                                           # concept 12's relevance references
    # atlas/atlas.html: a card per concept (open it in a browser, no network needed)

The run is resumable like ``explain batch``: each batch's per-channel relevance R_c (N, C), largest activations
(N, C) and predicted classes go to OUT/batches/NNNNNN.pt in one atomic write, after which a kill loses nothing, and a
rerun computes only what is missing; OUT/atlas-record.json holds the settings (layer, method, top, batch size, the
model's parameters' fingerprint, its preprocessing, the image names' fingerprint and that of the files' sizes and
modification times), and a rerun with other settings, another model or other images is an error that says what
differs. ``shard=(i, n)`` computes only the batches b with b % n == i (several processes or machines share the
data); a call without ``shard`` computes what is still missing and merges. Every call skips the batches already
stored, whatever layout wrote them, and the batch another process is measuring (it holds the batch's claim,
OUT/batches/.NNNNNN.claim): shards of other n at once (shard=(1, 2) beside shard=(2, 3), whose batches overlap)
measure each batch once, as do ``explain batch``'s shards, which skip the images done whatever world size did them.
One run at a time writes into OUT (it holds OUT/.explain.lock; the shards of one run share it, and two shards of
the same i are refused). The references' patches are written per concept (OUT/patches/), then OUT/atlas.json and
OUT/atlas.html.

Files that cannot be read as images, or that the model's preprocessing refuses (an alpha channel, 16-bit pixels), and
symbolic links with an image's name that lead to no file (as ``explain batch`` lists them in skipped.csv) are left out,
listed with the reason in atlas.json's "skipped" and on the page, and a warning says how many; images whose
preprocessed sizes differ are measured in groups of one size. An output folder inside the data folder is left out of
its images.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union
from urllib.parse import quote

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.caller import warn_at_callers_line
from ..io.inputs import IMAGE_SUFFIXES, prepare_inputs
from ..io.loaded_model import LoadedModel
from ..io.page_text import escaped
from ..methods.base import Explainer
from ..methods.concepts import (
    ConceptRelevance,
    _activation_maps,
    _concept_activations,
    _crop,
    _largest_activations,
    _layer_output,
    _uint8,
    relevance_method_for,
)
from ..methods.signatures import setting_text
from .batch import _broken_link_reason as broken_link_reason
from .batch import image_files_and_broken_links as folder_image_files
from .run_folder import LOCKS_UNSUPPORTED, Shard, display_name, error_line, folder_lock, write_atomically

try:
    import fcntl
except ImportError:  # Windows: no flock, so shards measuring at once are not kept off each other's batches
    fcntl = None  # type: ignore[assignment]

RECORD_FILE = "atlas-record.json"
ATLAS_FILE = "atlas.json"
PAGE_FILE = "atlas.html"
RECORD_LOCK = ".atlas-record.lock"
"""Held by the process checking or writing the record (``_check_record``), one at a time."""


@dataclass
class Atlas:
    """A built atlas: ``folder`` and its ``entries`` (atlas.json's): per concept, its relevance and activation
    references (image path relative to the data folder, value, patch file relative to ``folder``) and the classes
    that use it most (mean R_c per predicted class)."""

    folder: Path
    entries: dict[str, Any]

    def references(self, concept: int, kind: str = "relevance") -> list[dict[str, Any]]:
        """Concept ``concept``'s references, best first: {"image", "value", "patch"} ("relevance" or "activation")."""
        for entry in self.entries["concepts"]:
            if entry["concept"] == concept:
                return entry[f"{kind}_references"]
        raise KeyError(f"concept {concept} is not in the atlas of {self.entries['layer']} "
                       f"({len(self.entries['concepts'])} concepts).")

    def of(self, concept: int) -> list[np.ndarray]:
        """The relevance reference patches of ``concept`` (what ``glocal_figure`` draws)."""
        return self.patches(concept)

    def patches(self, concept: int, kind: str = "relevance") -> list[np.ndarray]:
        """The reference patches of ``concept`` as (h, w, 3) uint8 RGB arrays, read from the atlas's files."""
        return [np.asarray(Image.open(self.folder / reference["patch"]).convert("RGB"))
                for reference in self.references(concept, kind)]


def load_atlas(folder: Union[str, Path]) -> Atlas:
    """An atlas written by ``build_atlas`` (OUT/atlas.json)."""
    path = Path(folder) / ATLAS_FILE
    if not path.is_file():
        raise ValueError(f"{folder} holds no concept atlas ({ATLAS_FILE}); build one with `explain concepts DIR "
                         "--model M --layer L --out OUT`.")
    return Atlas(Path(folder), json.loads(path.read_text(encoding="utf-8")))


def image_files(data: Union[str, Path, Sequence[Union[str, Path]]], exclude: Optional[Union[str, Path]] = None
                ) -> tuple[list[Path], list[str]]:
    """(the image files, the names the atlas gives them): a folder's files, sub-folders included (as ``explain
    batch`` lists them: ``explain.dataset_tools.batch.image_files``, ``exclude`` left out), sorted by path relative to
    it (their names); or a list of files (their paths as given)."""
    files, names, _ = image_files_and_broken_links(data, exclude)
    return files, names


def image_files_and_broken_links(data: Union[str, Path, Sequence[Union[str, Path]]],
                                 exclude: Optional[Union[str, Path]] = None
                                 ) -> tuple[list[Path], list[str], dict[str, str]]:
    """``image_files``, and {name: reason} for a folder's symbolic links with an image's name that lead to no file
    (left out, as ``explain batch`` lists them in skipped.csv)."""
    broken: dict[str, str] = {}
    if isinstance(data, (str, Path)):
        root = Path(data)
        if not root.is_dir():
            raise ValueError(f"{display_name(root)} is not a folder of images.")
        files, links = folder_image_files(root, exclude)
        names = [display_name(path.relative_to(root)) for path in files]
        broken = {display_name(path.relative_to(root)): broken_link_reason(path) for path in links}
    else:
        files = [Path(path) for path in data]
        names = [display_name(path) for path in files]
    if not files:
        listed = (f"; {len(broken)} broken symbolic link(s) with such a name: "
                  + "; ".join(f"{name}: {reason}" for name, reason in list(broken.items())[:3]) if broken else "")
        raise ValueError(f"{data} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}){listed}.")
    return files, names, broken


def _fingerprint(texts: Sequence[str]) -> str:
    hasher = hashlib.sha256()
    for text in texts:
        hasher.update(text.encode("utf-8", "surrogateescape") + b"\n")
    return hasher.hexdigest()[:16]


def _model_fingerprint(model: nn.Module) -> str:
    hasher = hashlib.sha256()
    for name, tensor in list(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def _files_fingerprint(files: Sequence[Path], names: Sequence[str]) -> str:
    """A fingerprint of each file's name, size and modification time: another data folder with the same file names,
    or files changed since, give another."""
    texts = []
    for path, name in zip(files, names):
        status = path.stat()
        texts.append(f"{name}\t{status.st_size}\t{status.st_mtime_ns}")
    return _fingerprint(texts)


RECORD_MEANINGS = {"model": "a fingerprint of the model's weights", "images": "a fingerprint of the image files' names",
                   "files": "a fingerprint of the image files' sizes and modification times: other files, or the "
                            "same ones changed since",
                   "settings": "the class and options of the explainer given as method, None for a method given by "
                               "its name: an atlas begun with an explainer resumes with an explainer of the same "
                               "class and options, one begun with a name with that name and options"}


def _option_text(value: Any) -> str:
    """An option as the record keeps it: a tensor by its shape and a fingerprint of its values."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().double().contiguous().reshape(-1).numpy().tobytes()
        return f"tensor{tuple(value.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"
    return repr(value)


def build_atlas(model: Union[nn.Module, LoadedModel], layer: str, data: Union[str, Path, Sequence[Union[str, Path]]],
                out: Union[str, Path], *, method: Union[str, Explainer] = "auto", top: int = 8, batch_size: int = 32,
                shard: Optional[tuple[int, int]] = None, progress: bool = True, **method_options: Any
                ) -> Optional[Atlas]:
    """The concept atlas of ``layer`` over the images of ``data`` (a folder, read recursively, or a list of files),
    written to ``out`` (see the module docstring). top: references per concept; batch_size: images per pass.
    Returns the Atlas, or None for a shard's call (the merge is a call without ``shard``).

    method: "auto" (AttnLRP for a transformer, else LRP; recorded as the one chosen), "lrp" or "attnlrp"
    (``ConceptRelevance``), its options in ``method_options``; or an LRP / AttnLRP
    explainer built on ``model`` (its composite, options and preprocessing are used; ``method_options`` then holds
    only ConceptRelevance's own, ``directions`` or ``channel_dim``). The record (OUT/atlas-record.json) keeps a name
    as given, with its options; an explainer by its registered name ("lrp") and its settings (``setting_text``: its
    class and every option), as ``explain batch``'s run.json does. A resume must give the method the same way: an
    explainer of the same class and options (a new one will do) for an atlas begun with one, the same name and
    options for one begun with a name; any other method is refused, saying what differs. A class (``LRP``), an
    explainer built on another model, or anything else is refused before anything is written."""
    if isinstance(method, str) and method == "auto":
        method = relevance_method_for(model)
    if inspect.isclass(method):
        name = getattr(method, "name", "") or "lrp"
        raise ValueError(f"method is the class {method.__name__}: give its name (method={name!r}, with its options "
                         f"as keyword arguments) or an explainer built on the model ({method.__name__}(model, ...)).")
    if not isinstance(method, (str, Explainer)):
        raise ValueError(f"method must be a method's name (\"lrp\", \"attnlrp\") or an LRP / AttnLRP explainer built "
                         f"on the model; got {type(method).__name__}.")
    if isinstance(method, Explainer) and method.model is not (model.model if isinstance(model, LoadedModel) else model):
        kind = type(method).__name__
        raise ValueError(f"the explainer given as method ({kind}) was built on another model than the one given: the "
                         f"atlas would be that model's. Build it on this model ({kind}(model, ...)), or give the "
                         "method's name and its options.")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a whole number ≥ 1; got {top!r}.")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number ≥ 1; got {batch_size!r}.")
    if shard is not None and not (len(shard) == 2 and 0 <= shard[0] < shard[1]):
        raise ValueError(f"shard must be (i, n) with 0 ≤ i < n; got {shard!r}.")
    folder = Path(out)
    files, names, broken = image_files_and_broken_links(data, exclude=folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; give a folder for the atlas (it is created if missing).")
    crp = ConceptRelevance(model, layer, method, batch_size=batch_size, **method_options)  # a wrong layer: no folder
    preprocess = " ".join(setting_text(crp.explainer.preprocess).split())  # on one line
    record: dict[str, Any] = {"layer": layer, "method": method if isinstance(method, str) else method.name}
    if isinstance(method, Explainer):  # by its class and options, as ``explain batch``'s run.json records it
        record["settings"] = " ".join(setting_text(method).split())
    record.update({"top": top, "batch_size": batch_size, "model": _model_fingerprint(crp.model),
                   "preprocess": preprocess, "images": _fingerprint(names), "files": _files_fingerprint(files, names),
                   "image_count": len(files)})
    if method_options:  # the composite, directions...: a resumed build must use the same
        record["options"] = {key: _option_text(value) for key, value in sorted(method_options.items())}
    (folder / "batches").mkdir(parents=True, exist_ok=True)
    with folder_lock(folder, None if shard is None else Shard(shard[0], shard[1])):
        _check_record(folder, record)
        batches = range(0, len(files), batch_size)
        mine = [start for index, start in enumerate(batches) if shard is None or index % shard[1] == shard[0]]
        with tqdm(total=len(mine), desc=f"atlas {layer}", unit="batch", disable=not progress) as bar:
            for start in mine:
                destination = folder / "batches" / f"{start // batch_size:06d}.pt"
                with _batch_claim(destination) as claimed:  # not stored, and no other shard measuring it
                    if claimed:
                        _measure_batch(crp, files, start, batch_size, destination, folder, record)
                bar.update(1)
        if shard is not None:
            return None
        parts = [torch.load(folder / "batches" / f"{index:06d}.pt") for index in range(len(batches))]
        measured = [part for part in parts if len(part["rows"])]
        skipped = {names[int(row)]: reason for part in parts for row, reason in part["skipped"].items()}
        skipped = dict(sorted({**skipped, **broken}.items()))  # by name, the broken links among the files
        if not measured:
            raise ValueError(f"none of the {len(files)} files of {data} could be used: "
                             + "; ".join(f"{name}: {reason}" for name, reason in list(skipped.items())[:3]))
        rows = torch.cat([part["rows"] for part in measured]).tolist()
        relevance = torch.cat([part["relevance"] for part in measured])
        activation = torch.cat([part["activation"] for part in measured])
        classes = torch.cat([part["classes"] for part in measured])
        entries = _entries(crp, [files[row] for row in rows], [names[row] for row in rows], relevance, activation,
                           classes, top, folder, progress)
        entries["skipped"] = [{"image": name, "reason": reason} for name, reason in skipped.items()]
        write_atomically(folder / ATLAS_FILE, lambda path: path.write_text(json.dumps(entries, indent=1),
                                                                           encoding="utf-8"))
        write_atomically(folder / PAGE_FILE, lambda path: path.write_text(_page(entries), encoding="utf-8"))
    if skipped:
        first = next(iter(skipped))
        warn_at_callers_line(
            f"{len(skipped)} of the {len(files) + len(broken)} files of the atlas were left out, as they could not be "
            f"used (e.g. {first}: {skipped[first]}); atlas.json's \"skipped\" lists them all. Fix or remove them and "
            "build the atlas again in a new folder to include them.", RuntimeWarning)
    return Atlas(folder, entries)


def _check_record(folder: Path, record: dict[str, Any]) -> None:
    """Refuse ``record`` where the folder holds batches measured with other settings, else write it (where it
    differs), one process at a time: shards starting together neither both pass nor write one file together."""
    with _exclusive(folder / RECORD_LOCK):
        _check_and_write_record(folder, record)


def _check_and_write_record(folder: Path, record: dict[str, Any]) -> None:
    """Refuse ``record`` where stored batches were measured with other settings (or with settings unknown: batches
    without a record), else write it. A new record leaves no patch of the earlier settings behind: patches are
    reused by name, so another layer's or model's would be shown for the new references."""
    path = folder / RECORD_FILE
    stored = any((folder / "batches").glob("[0-9]*.pt"))
    if not path.exists() and stored:
        raise ValueError(f"{folder} holds measured batches (batches/) but no {RECORD_FILE}, so the settings they "
                         "were measured with are unknown and they cannot be resumed; delete the folder's batches/ "
                         "(or the whole folder) to start afresh, or give another folder.")
    if path.exists():
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} is not an atlas record ({error}); delete it and the folder's batches/ to start "
                             "afresh.") from None
        if earlier == record:
            return
        if stored:
            keys = list(record) + [key for key in earlier if key not in record]
            differences = [f"{key}: {earlier.get(key)!r} earlier, {record.get(key)!r} now"
                           + (f" ({RECORD_MEANINGS[key]})" if key in RECORD_MEANINGS else "")
                           for key in keys if earlier.get(key) != record.get(key)]
            raise ValueError(f"{folder} holds an atlas with other settings ({'; '.join(differences)}); rerun with "
                             "the earlier settings to resume it, or give another folder.")
    for stale in (folder / "patches").glob("*.png"):  # no batches: an earlier atlas's, or one of unknown settings
        stale.unlink(missing_ok=True)
    write_atomically(path, lambda target: target.write_text(json.dumps(record, indent=1), encoding="utf-8"))


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """While inside, this process alone holds ``path`` (created if missing; an exclusive ``flock``, waited for).
    Nothing is held without ``fcntl`` (Windows) or on a file system that cannot lock (``folder_lock`` warned)."""
    if fcntl is None:
        yield
        return
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in LOCKS_UNSUPPORTED:
                raise
        yield
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _batch_claim(destination: Path) -> Iterator[bool]:
    """Whether this process is to measure the batch stored at ``destination``: False where it is stored, or where
    another process (a shard of this atlas, of any layout) holds its claim, OUT/batches/.NNNNNN.claim, an exclusive
    ``flock``; else True, and the claim is held while inside (others get False), then removed once the batch is
    stored. A claim held by a process that was killed is free again (the kernel releases it), so a rerun measures the
    batch. Without ``fcntl`` (Windows), or where the file system cannot lock, only the stored batches are skipped."""
    if destination.exists():
        yield False
        return
    if fcntl is None:
        yield True
        return
    claim = destination.with_name(f".{destination.stem}.claim")
    descriptor = os.open(claim, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:  # the claim of a batch just stored was removed: this descriptor's file is no longer it
                current = os.path.samestat(os.stat(claim), os.fstat(descriptor))
            except FileNotFoundError:
                current = False
        except BlockingIOError:
            current = False  # another process is measuring it
        except OSError as error:
            if error.errno not in LOCKS_UNSUPPORTED:
                raise
            current = True
        claimed = current and not destination.exists()
        yield claimed
        if claimed and destination.exists():
            claim.unlink(missing_ok=True)  # while held: a process that opened it before finds the batch stored
    finally:
        os.close(descriptor)


def _prepared_groups(crp: ConceptRelevance, files: Sequence[Path]) -> tuple[list[tuple[list[int], Tensor]],
                                                                            dict[int, str]]:
    """``files`` prepared for the model one by one: ([(positions, their batch)] grouped by size, {position: why it
    could not be used} for the files that cannot be read as images or that the preprocessing refuses)."""
    prepared: dict[int, Tensor] = {}
    skipped: dict[int, str] = {}
    for position, path in enumerate(files):
        try:
            prepared[position] = crp._prepared([path])
        except (ValueError, OSError) as error:
            skipped[position] = error_line(error)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for position, batch in prepared.items():
        by_shape.setdefault(tuple(batch.shape), []).append(position)
    groups = [(positions, torch.cat([prepared[position] for position in positions]))
              for positions in by_shape.values()]
    return groups, skipped


def _measure_batch(crp: ConceptRelevance, files: Sequence[Path], start: int, batch_size: int, destination: Path,
                   folder: Path, record: dict[str, Any]) -> None:
    """Batch ``files[start:start + batch_size]``: the rows (indices in ``files``) of the images it could use, their
    R_c (N, C) for their predicted classes, largest activations (N, C) and classes (N,), and {index: reason} for the
    files left out, saved (after checking that no other run changed the folder's record)."""
    groups, skipped = _prepared_groups(crp, files[start:start + batch_size])
    rows: list[int] = []
    relevance, activation, classes = [], [], []
    for positions, batch in groups:
        recorded: list[Tensor] = []
        with crp._at_layer(None, recorded):
            explanation = crp.explainer.explain(batch)
        assert explanation.class_indices is not None, "class targets"
        rows.extend(start + position for position in positions)
        relevance.append(crp.layer_relevance(recorded).float())
        activation.append(_activation_values(crp, batch).float())
        classes.append(explanation.class_indices[:, 0].cpu())
    order = torch.tensor(rows, dtype=torch.long).argsort()
    result = {"rows": torch.tensor(rows, dtype=torch.long)[order],
              "relevance": torch.cat(relevance)[order] if rows else None,
              "activation": torch.cat(activation)[order] if rows else None,
              "classes": torch.cat(classes)[order] if rows else None,
              "skipped": {start + position: reason for position, reason in skipped.items()}}
    _check_record_unchanged(folder, record)
    write_atomically(destination, lambda path: torch.save(result, path))


def _check_record_unchanged(folder: Path, record: dict[str, Any]) -> None:
    """Refuse to write a batch where another run (a shard started with other settings) rewrote the record."""
    try:
        now = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        now = None
    if now != record:
        raise ValueError(f"{folder}'s {RECORD_FILE} was changed by another run while this one was writing (another "
                         "shard with other settings?); its batches would mix two settings. Give each setting its own "
                         "folder.")


def _activation_values(crp: ConceptRelevance, batch: Tensor) -> Tensor:
    """(N, K) each concept's largest activation per image: on the image where the layer's output lies on it (feature
    maps, patch tokens), else over all its positions (tokens without a patch grid)."""
    try:
        return _largest_activations(crp, batch)
    except ValueError:
        output = _layer_output(crp.model, crp.layer, crp.layer_name, batch)
        return _concept_activations(crp, output).flatten(2).amax(dim=2).double().cpu()


def _activation_heats(crp: ConceptRelevance, batch: Tensor, rows: Tensor, concepts: Tensor) -> Tensor:
    """``_activation_maps``, or zeros where the layer's output does not lie on the image (its activation patches are
    then the whole images)."""
    try:
        return _activation_maps(crp, batch, rows, concepts)
    except ValueError:
        return torch.zeros(len(rows), *batch.shape[-2:])


def _check_bypass(crp: ConceptRelevance, files: Sequence[Path], classes: Tensor, channels: int) -> None:
    """Warn, from the first images, where relevance reaches the input around the layer (a layer inside a residual
    branch): the relevance patches then include it."""
    batch = crp._prepared(list(files))
    unconditional = crp.explainer.explain(batch, target=classes.tolist())
    crp.bypass(batch, classes, channels, unconditional, stacklevel=4,
               consequence="The relevance references' patches include that relevance")


def _entries(crp: ConceptRelevance, files: Sequence[Path], names: Sequence[str], relevance: Tensor,
             activation: Tensor, classes: Tensor, top: int, folder: Path, progress: bool) -> dict[str, Any]:
    """atlas.json's content; the patches of every concept's references written first (OUT/patches/, skipped where
    an earlier run wrote them): the relevance references' conditional heatmaps computed for all (image, concept)
    pairs in batched passes, the activation references' upsampled activations."""
    (folder / "patches").mkdir(exist_ok=True)
    count = min(top, len(files))
    channels = relevance.shape[1]
    best = {"relevance": relevance.topk(count, dim=0), "activation": activation.topk(count, dim=0)}  # (count, C)
    patch_names = {kind: [[f"patches/{kind[0]}{concept:05d}_{rank}.png" for rank in range(count)]
                          for concept in range(channels)] for kind in best}
    for kind in ("relevance", "activation"):
        pairs = [(int(best[kind].indices[rank, concept]), concept, rank) for concept in range(channels)
                 for rank in range(count) if not (folder / patch_names[kind][concept][rank]).exists()]
        if kind == "relevance" and pairs:  # patches to make: say first if they would include relevance around the layer
            first = _prepared_groups(crp, files[:crp.batch_size])[0][0][0]  # the first images of one size
            _check_bypass(crp, [files[image] for image in first], classes[first], channels)
        for start in tqdm(range(0, len(pairs), crp.batch_size), desc=f"{kind} patches", disable=not progress):
            chunk = pairs[start:start + crp.batch_size]
            unique = sorted({image for image, _, _ in chunk})
            for positions, batch in _prepared_groups(crp, [files[image] for image in unique])[0]:  # one size each
                images = [unique[position] for position in positions]
                pictures = _uint8(prepare_inputs([files[image] for image in images], crp.explainer.preprocess,
                                                 torch.device("cpu"), torch.float32).display.get())
                group = [pair for pair in chunk if pair[0] in images]
                rows = torch.tensor([images.index(image) for image, _, _ in group])
                concepts = torch.tensor([concept for _, concept, _ in group])
                if kind == "relevance":
                    rows_class = classes[torch.tensor([image for image, _, _ in group])]
                    _, heats, _ = crp.conditional(batch, rows, concepts, rows_class, channels)
                else:
                    heats = _activation_heats(crp, batch, rows, concepts)
                for (_, concept, rank), row, heat in zip(group, rows.tolist(), heats):
                    crop = _crop(pictures[row], heat.detach().cpu().float())
                    _write_png(folder / patch_names[kind][concept][rank], crop)
    class_names = getattr(crp.explainer, "class_names", None)
    entries = []
    for concept in range(channels):
        entry: dict[str, Any] = {"concept": concept}
        for kind in ("relevance", "activation"):
            entry[f"{kind}_references"] = [
                {"image": names[int(index)], "value": float(value), "patch": patch}
                for index, value, patch in zip(best[kind].indices[:, concept], best[kind].values[:, concept],
                                               patch_names[kind][concept])]
        usage: list[dict[str, Any]] = []
        for label in classes.unique().tolist():
            mean = float(relevance[classes == label, concept].mean())
            name = str(class_names[label]) if class_names is not None and 0 <= label < len(class_names) \
                else str(label)
            usage.append({"class": int(label), "name": name, "mean_relevance": mean})
        entry["classes"] = sorted(usage, key=lambda item: -item["mean_relevance"])[:3]
        entries.append(entry)
    return {"layer": crp.layer_name, "method": crp.explainer.method_name, "images": len(files), "top": count,
            "concepts": entries}


def _write_png(path: Path, pixels: np.ndarray) -> None:
    write_atomically(path, lambda target: Image.fromarray(pixels).save(target, format="PNG"))


def _page(entries: dict[str, Any]) -> str:
    """A static page: a card per concept with its classes, relevance references and activation references. Every
    name is escaped text; a patch's address percent-encoded."""
    cards = []
    for entry in entries["concepts"]:
        classes = ", ".join(f"{escaped(item['name'])} ({item['mean_relevance']:.3g})" for item in entry["classes"])
        rows = []
        for kind in ("relevance", "activation"):
            images = "".join(
                f'<figure><img src="{escaped(quote(reference["patch"]))}" alt="{escaped(reference["image"])}" '
                f'title="{escaped(reference["image"])}: {reference["value"]:.3g}"></figure>'
                for reference in entry[f"{kind}_references"])
            rows.append(f'<div class="row"><span class="kind">{kind}</span>{images}</div>')
        cards.append(f'<section class="card" id="concept-{entry["concept"]}"><h2>concept {entry["concept"]}</h2>'
                     f'<p>used most by: {classes}</p>{"".join(rows)}</section>')
    skipped = entries.get("skipped", [])
    if skipped:
        cards.append(f'<section class="card" id="skipped"><h2>{len(skipped)} file(s) left out</h2><ul>'
                     + "".join(f"<li>{escaped(item['image'])}: {escaped(item['reason'])}</li>"
                               for item in skipped) + "</ul></section>")
    title = escaped(f"Concept atlas of {entries['layer']} ({entries['method']}, {entries['images']} images)")
    style = ("body{font-family:sans-serif;margin:1em}.card{border:1px solid #ccc;margin:.5em 0;padding:.5em}"
             ".row{display:flex;align-items:center;gap:4px}.kind{width:6em;font-size:80%}"
             "figure{margin:0}img{height:64px;image-rendering:pixelated}h2{font-size:100%;margin:0}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src \'self\' file:; '
            f'style-src \'unsafe-inline\'"><style>{style}</style></head><body><h1>{title}</h1>'
            f'{"".join(cards)}</body></html>\n')
