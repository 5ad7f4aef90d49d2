"""A run's record (OUT/run.json): what it explained with (method, settings, model, data, targets), so that a resumed run
that differs is refused and says how."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import (
    Any,
    Collection,
    Iterable,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import torch
from torch import Tensor, nn

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs into one folder are not locked there
    fcntl = None  # type: ignore[assignment]

from ..io.page_text import LONE_SURROGATE
from ..methods.signatures import setting_text
from .run_folder import Shard, display_name, error_line, write_atomically

RUN_RECORD = "run.json"
"""The file of an output folder that records how its images are explained (see ``RunRecord``)."""


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
        lines = [f"  {json.dumps(name)}: {_json_text(value)}" for name, value in fields.items()]
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
        else:  # no run.json (yet): the ranks of a torchrun run whose rank 0 has not written it say how they explained
            for rank_path, rank_record in _rank_records(out):
                differences = record.differences(rank_record, done)
                if differences:
                    raise ValueError(_refusal(out, record, rank_record, differences, display_name(rank_path.name)))
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
    if shard.rank != 0:  # rank 0 writes run.json; another rank's record is checked until it has
        path = out / rank_record_name(shard.rank)
    if shard.rank == 0 or shard.world_size > 1:
        text = record.to_text()
        try:
            unchanged = path.read_text(encoding="utf-8") == text
        except (OSError, UnicodeDecodeError):
            unchanged = False
        if not unchanged:
            write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    return notes


def rank_record_name(rank: int) -> str:
    """The record a rank other than 0 of a torchrun run writes (rank 0 writes run.json): run.rank<R>.json."""
    return f"run.rank{rank}.json"


def rank_record_paths(out: Path) -> list[Path]:
    """The records of the ranks other than 0 in ``out`` (``rank_record_name``), sorted."""
    return sorted(path for path in out.glob("run.rank*.json") if re.fullmatch(r"run\.rank\d+\.json", path.name))


def _rank_records(out: Path) -> list[tuple[Path, RunRecord]]:
    """The records of the ranks other than 0 in ``out`` (``rank_record_name``), by rank; ValueError for one that
    is not a run record."""
    records = []
    for path in rank_record_paths(out):
        try:
            records.append((path, RunRecord.from_json(json.loads(path.read_text(encoding="utf-8")),
                                                      display_name(path))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{display_name(path)} is not a run record ({error_line(error)}); delete it, and the "
                             "index of its rank if it was not written by this run.") from error
    return records


def _refusal(out: Path, record: RunRecord, earlier: RunRecord, differences: list[str],
             source: str = RUN_RECORD) -> str:
    """The error of a resumed run that differs from the earlier one (as ``source``, the file, records it): what
    differs, and what to do."""
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
    text = (f"{display_name(out)} holds images explained by another run, as {source} records: "
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


def _json_text(value: Any) -> str:
    """``value`` as JSON with its letters as they are, except a lone surrogate (a folder's byte that is not UTF-8,
    as Python reads it), which UTF-8 cannot write: that one as its \\u escape, which JSON reads back as the same
    character."""
    return LONE_SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", json.dumps(value, ensure_ascii=False))
