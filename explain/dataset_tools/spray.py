"""The strategies a model uses over a data set: SpRAy, spectral relevance analysis (Lapuschkin et al. 2019,
"Unmasking Clever Hans predictors and assessing what machines really learn").

For each explained class, the class's maps are compared with each other and grouped: images that the model
classifies for the same visible reason get similar maps, so a cluster is a strategy, and a cluster whose
relevance sits where the object is not (a watermark in a corner, a border, a fixed position) is a Clever Hans
candidate. The steps, per class:

1. Each map is downsampled by area averaging to ``size`` (32×32 by default: enough to tell positions apart,
   and distances between maps are then not dominated by pixel noise), negative values are set to 0 (SpRAy
   compares where the positive evidence lies), and each map is scaled to **sum 1**. Sum 1 rather than max 1:
   a map is then a distribution of relevance over the image, two maps that put the same share of their
   relevance at the same places are equal however peaked they are, and the share of a cluster's relevance
   inside the object masks is the mean of its maps' shares. (Maps that are all zero become uniform.)
2. An affinity graph joins each map to its ``neighbors`` nearest maps (Euclidean distance; 10 as scikit-learn's
   ``SpectralClustering`` default; at most half the class's maps, so that a class smaller than 2 × ``neighbors``,
   analysed with a lower ``min_images``, does not get a complete graph, which shows no groups), symmetrised as
   (C + Cᵀ) / 2: weight 1 for mutual neighbours, ½ for one-sided.
3. The number of clusters is the eigengap of the graph's normalised Laplacian L = I − D^-½ A D^-½: with its
   smallest eigenvalues λ₀ ≤ λ₁ ≤ …, the count c in 1 … ``max_clusters`` with the largest λ_c − λ_(c−1)
   (c separate groups give c eigenvalues near 0, then a jump), unless ``clusters=`` says otherwise. Maps that
   vary continuously (objects anywhere in the image) form chains in the graph, which the eigengap may cut into
   several clusters by position: the flagging rules compare a cluster with its class's others for that reason.
4. Spectral clustering (scikit-learn's ``SpectralClustering`` on that graph, k-means on the embedding, seeded)
   gives the clusters, numbered by size, largest first (``clusters=`` equal to the class's size: one map each).
   Each reports its mean map (scaled to max 1), its peak and its members, the most typical first (nearest the
   cluster's mean map).

Flagging a cluster ("its relevance sits where the object is not"). The rules are heuristics: a flagged cluster
is a candidate to look at (its mean map and examples), not a verdict.

- With object ``masks`` or ``boxes``: when more than ``outside_threshold`` (default 0.6) of the cluster's
  relevance lies farther than ``margin`` (default 1/16 of each side) from the objects. The margin forgives maps
  that spill a little past an outline. Measured on the watermark demo (``python -m explain.data.train_watermark
  --seeds 0 1 2 --no-save --strategies``) with LRP maps: clusters on the shapes 0.06 to 0.43 (thin triangles
  the most), clusters on the tag 0.71 to 0.89; 0.6 lies between. Maps coarser than the objects do not suit this
  rule: Grad-CAM at the demo's last layer (1/4 of the input's resolution) spreads 0.56 to 0.68 of clean
  triangles' relevance outside, as much as on the tag.
- Without: when the cluster's maps peak at one fixed place: the median distance of its maps' peaks from the
  cluster's peak is at most ``position_tolerance`` (default 0.05 of the image side) and below ``spread_ratio``
  (default 1/3) of the same median in the class's other clusters (so that a class split into clusters by where
  its objects lie is not flagged); or when the hottest 5 % of the mean map's pixels hold at least
  ``border_share`` (default 1/2) of their relevance in the border band (the outer ``border``, default 1/8, of
  each side), where tags, frames and padding live, and its maps agree on them: each member's relevance on the
  band's hottest pixels, picked from the mean of the cluster's other maps, is on average at least ``BORDER_LIFT``
  (3) times its mean relevance per pixel. The band covers 44 % of the image at border 1/8, so the hottest pixels of
  a mean of noise fall there about as often as not; picked without the map, they are no hotter in it than its mean
  (lift about 1: at most 2.0 over 20 seeds of five kinds of noise), while a corner blob or a frame gives 3.8 and
  more, the watermark demo's tag clusters 4.6 to 27. On the demo (LRP, seeds 0, 1, 2) the clusters on the shapes
  have median peak distances 0.06 to 0.34 and put at most 0.2 of their hottest 5 % in the band; the clusters on
  the tag 0.0 and at least 0.95.
Clusters of fewer than 5 maps are never flagged. ``reason`` says which rule fired, with the figures.

    result = explain.strategies("OUT")            # a folder written by explain batch / explain.run
    for entry, cluster in result.flagged: print(entry.class_name, cluster.reason)
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from scipy import sparse
from scipy.sparse.linalg import eigsh
from tqdm.auto import tqdm

from ..core.caller import warn_at_callers_line
from ..io import render
from .index import MapReader, read_index_contents
from .run_folder import FolderInUseError, display_name, folder_lock, write_atomically
from .run_folder import error_line as first_line
from .run_record import RunRecord, read_run_record

MIN_IMAGES = 20
"""A class with fewer maps is skipped (with a note): too few for a 10-neighbour graph to show groups."""
NEIGHBORS = 10
MAX_CLUSTERS = 8
EXAMPLES = 8
OUTSIDE_THRESHOLD = 0.6
MARGIN = 1 / 16
BORDER = 0.125
BORDER_SHARE = 0.5
SPREAD_RATIO = 1 / 3
POSITION_TOLERANCE = 0.05
HOT_SHARE = 0.05
"""The hottest share of the mean map's pixels whose place the border rule looks at."""
BORDER_LIFT = 3.0
"""The border rule's second test: each member's relevance on the band's hottest pixels, picked from the mean of the
cluster's other maps, is at least this many times its mean relevance per pixel (1 where the maps are noise)."""
MIN_FLAG_SIZE = 5
"""A cluster smaller than this is never flagged: a handful of maps peaking together says little."""
ZERO_EIGENVALUE = 1e-9
"""Eigenvalues of the normalised Laplacian below this are 0 (rounding leaves them near 1e-16): one per connected
component of the graph."""
SMALL_CLASS = 256
"""Up to this many maps, a class's nearest neighbours are found with numpy (``small_knn_columns``), above by
scikit-learn, whose fixed cost per call (0.03 to 0.1 s) dominates for small classes."""
TIE_TOLERANCE = 1e-9
"""Squared distances closer than this × (‖a‖² + max ‖b‖²) count as equal in ``small_knn_columns`` (the rounding of
either computation is below 1e-12 × that for maps of up to 4096 pixels)."""
DENSE_LIMIT = 2000
"""Up to this many maps the Laplacian's eigenvalues are computed densely (exact), above by ARPACK."""
ROLES = ("predicted", "label")
MEAN_MAP_DECIMALS = 2
"""strategies.json's mean-map values are rounded to this many decimals (32×32 at 2: about 5 KB a cluster, against
7 KB at 4; a colour map shows no finer steps)."""
JSON_NAME = "strategies.json"
FIGURES_FOLDER = "strategies"

MapsSource = Union[str, Path, np.ndarray, torch.Tensor]
Boxes = Union[np.ndarray, Mapping[str, Sequence[float]]]
Masks = Union[np.ndarray, torch.Tensor, Mapping[str, np.ndarray]]


@dataclass
class Cluster:
    """One strategy of a class.

    cluster: its number within the class (0: the largest). members: the ids of its maps, the most typical first
    (nearest the cluster's mean map). mean_map: (h, w) float32 in [0, 1], the mean of its normalised maps scaled
    to max 1. peak: (y, x) of the mean map's maximum, in [0, 1] image coordinates (pixel centres).
    flagged / reason: whether its relevance sits where the object is not, and why ("" when not flagged).
    outside_share: the share of its relevance outside the object masks or boxes (None without them).
    peak_spread: the median distance of its maps' peaks from ``peak``, in image sides. border_share: the share of
    the hottest 5 % of the mean map's relevance inside the border band. mean_map_file: the PNG's path relative
    to the output folder, once written. border_lift: the members' mean relevance on the band's hottest pixels,
    picked without them (from the mean of the cluster's other maps), as a multiple of their mean relevance per
    pixel: about 1 for maps of noise, whatever the band's area (0 where the band holds none of the hottest)."""

    cluster: int
    members: list[str]
    mean_map: np.ndarray
    peak: tuple[float, float]
    peak_spread: float
    border_share: float
    outside_share: Optional[float] = None
    flagged: bool = False
    reason: str = ""
    mean_map_file: Optional[str] = None
    border_lift: float = 0.0

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def examples(self) -> list[str]:
        """Up to 8 member ids, the most typical first."""
        return self.members[:EXAMPLES]


@dataclass
class ClassStrategies:
    """The strategies of one class. images: how many maps were clustered; eigengap_clusters: the count the
    eigengap chose (used unless ``clusters=`` gave another); eigenvalues: the normalised Laplacian's smallest
    eigenvalues, ascending (max_clusters + 1 of them); clusters: largest first."""

    class_index: int
    class_name: str
    images: int
    eigengap_clusters: int
    eigenvalues: np.ndarray
    clusters: list[Cluster]


@dataclass
class SkippedClass:
    """A class that was not analysed, and why."""

    class_index: int
    class_name: str
    images: int
    reason: str


@dataclass
class Strategies:
    """SpRAy's result over a data set: per class, its clusters of maps. map_size: (h, w) of the compared maps;
    skipped: classes not analysed (too few maps); notes: what else was left out (unreadable map files, rows
    without a class); json_file: where strategies.json was written, if it was."""

    method: str
    map_size: tuple[int, int]
    classes: list[ClassStrategies]
    skipped: list[SkippedClass] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    json_file: Optional[Path] = None

    @property
    def flagged(self) -> list[tuple[ClassStrategies, Cluster]]:
        """Every flagged cluster with its class."""
        return [(entry, cluster) for entry in self.classes for cluster in entry.clusters if cluster.flagged]

    def to_dict(self) -> dict[str, Any]:
        """The contents of strategies.json (``mean_map`` is the PNG's path once written, else ""). The mean maps'
        values are rounded to MEAN_MAP_DECIMALS: the report draws them only where a PNG is missing."""
        return {
            "method": self.method,
            "map_size": list(self.map_size),
            "classes": [{
                "class": entry.class_index,
                "class_name": entry.class_name,
                "images": entry.images,
                "eigengap_clusters": entry.eigengap_clusters,
                "eigenvalues": [round(float(value), 6) for value in entry.eigenvalues],
                "clusters": [{
                    "cluster": cluster.cluster,
                    "size": cluster.size,
                    "mean_map": cluster.mean_map_file or "",
                    "mean_map_values": np.round(cluster.mean_map.astype(float), MEAN_MAP_DECIMALS).tolist(),
                    "examples": cluster.examples,
                    "flagged": cluster.flagged,
                    "reason": cluster.reason,
                    "peak": [round(cluster.peak[0], 4), round(cluster.peak[1], 4)],
                } for cluster in entry.clusters],
            } for entry in self.classes],
            "skipped": [{"class": entry.class_index, "class_name": entry.class_name, "images": entry.images,
                         "reason": entry.reason} for entry in self.skipped],
            "notes": list(self.notes),
        }

    def save(self, out: Union[str, Path], scale: int = 4) -> Path:
        """Write ``out``/strategies.json and each cluster's mean map as ``out``/strategies/class<C>_cluster<K>.png
        (colour map "jet", each map pixel ``scale`` × ``scale``); PNGs of an earlier run that this one does not
        write again are removed, once the new JSON is in place. Returns the JSON's path. Holds ``out``/strategies
        meanwhile (``writing_lock``): raises FolderInUseError while another run writes strategies there."""
        with writing_lock(out):
            return self._write(Path(out), scale)

    def _write(self, out: Path, scale: int = 4) -> Path:
        """``save`` without taking the lock (the caller holds it)."""
        figures = out / FIGURES_FOLDER
        written = set()
        for entry in self.classes:
            for cluster in entry.clusters:
                name = f"class{entry.class_index}_cluster{cluster.cluster}.png"
                indices = render.colour_indices(render.map_as_float(cluster.mean_map)).numpy()
                colours = render.colour_table_uint8()[indices]
                picture = Image.fromarray(np.repeat(np.repeat(colours, scale, axis=0), scale, axis=1))
                write_atomically(figures / name, functools.partial(_save_png, picture))
                cluster.mean_map_file = f"{FIGURES_FOLDER}/{name}"
                written.add(name)
        path = out / JSON_NAME
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
        for stale in figures.glob("class*_cluster*.png"):  # after the JSON: a kill never leaves it pointing nowhere
            if stale.name not in written:
                stale.unlink(missing_ok=True)
        self.json_file = path
        return path


def other_method_note(strategies_method: Optional[str], record: Optional[RunRecord]) -> Optional[str]:
    """A note when OUT/strategies.json was computed from maps of another method than the one OUT/run.json
    (``record``) records, else None (also where either does not name one: maps given as an array, a folder written
    before run.json). The batch run was redone with another method after ``explain strategies OUT`` ran, so the
    strategies are those of the old maps."""
    if not strategies_method or strategies_method == "unspecified" or record is None:
        return None
    recorded = [name for name in (record.method, record.method_class) if name]
    if not recorded or strategies_method.casefold() in {name.casefold() for name in recorded}:
        return None
    now = f"{record.method!r} ({record.method_class})" if record.method else repr(record.method_class)
    return (f"{JSON_NAME} holds the strategies of {strategies_method!r} maps, but run.json records {now}: the "
            f"batch run was redone with another method since, so the strategies shown are those of the old maps, "
            f"not of the maps shown. Run `explain strategies OUT` again, then this report.")


def _save_png(picture: Image.Image, path: Path) -> None:
    picture.save(path, format="PNG")


@contextlib.contextmanager
def writing_lock(out: Union[str, Path]) -> Iterator[None]:
    """Hold ``out``/strategies (``folder_lock`` on ``out``/strategies/.explain.lock, both folders made if missing)
    while strategies are computed and written into ``out``: a second run into ``out`` at once is refused
    (FolderInUseError, naming the process that holds it) rather than removing the other's mean maps or leaving
    strategies.json naming PNGs of another run. The kernel releases the lock when its process ends, also by
    ``kill -9``, so a killed run never blocks the next one. An ``explain batch`` or ``explain report`` writing into
    ``out`` meanwhile holds another lock, not this one."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{display_name(out)!r} is a file; give a folder for strategies.json.")
    figures = out / FIGURES_FOLDER
    if figures.exists() and not figures.is_dir():
        raise ValueError(f"{display_name(figures)!r} is a file; strategies writes its mean maps in a folder there: "
                         "move the file away.")
    made = not figures.exists()
    figures.mkdir(parents=True, exist_ok=True)
    try:
        with folder_lock(figures):
            yield
    except FolderInUseError as error:
        if "in use by another run of explain" not in str(error):
            raise
        found = re.search(r"another run of explain \((.*)\): two runs", str(error))
        holder = found.group(1) if found else "a process that did not say which"
        raise FolderInUseError(
            f"another run of explain strategies is writing into {display_name(out)} ({holder}): two at once would "
            f"each remove the other's mean maps, and {JSON_NAME} could name pictures of the other run. Wait until it "
            "ends, then run this one again (or give another out=).") from None
    finally:
        if made:  # a run that wrote nothing (bad maps) leaves no empty folder behind
            with contextlib.suppress(OSError):
                figures.rmdir()


def strategies(
    source: MapsSource,
    *,
    classes: Optional[Union[Sequence[int], np.ndarray, torch.Tensor]] = None,
    ids: Optional[Sequence[str]] = None,
    class_names: Optional[Sequence[str]] = None,
    method: Optional[str] = None,
    size: tuple[int, int] = (32, 32),
    clusters: Optional[Union[int, Mapping[int, int]]] = None,
    masks: Optional[Masks] = None,
    boxes: Optional[Boxes] = None,
    seed: int = 0,
    neighbors: int = NEIGHBORS,
    max_clusters: int = MAX_CLUSTERS,
    min_images: int = MIN_IMAGES,
    roles: Sequence[str] = ROLES,
    outside_threshold: float = OUTSIDE_THRESHOLD,
    margin: float = MARGIN,
    border: float = BORDER,
    border_share: float = BORDER_SHARE,
    spread_ratio: float = SPREAD_RATIO,
    position_tolerance: float = POSITION_TOLERANCE,
    out: Optional[Union[str, Path]] = None,
    progress: bool = True,
) -> Strategies:
    """SpRAy: group each class's maps into strategies and flag those that look where the object is not
    (steps and rules in this module's docstring).

    source: an output folder of ``explain batch`` / ``explain.run`` (OUT/index.csv and OUT/maps/, read back at the
        input's resolution with ``explain.batch.MapReader``; the rows whose ``role`` is in ``roles``, by default
        those explaining the predicted or the true class, grouped by their ``target``; an index written before the
        label columns: every row; class names from the index, else from OUT/run.json), or maps (N, H, W) with
        ``classes`` (N,) ints, the class each map explains (and optional ``ids``, default "0" … "N−1", and
        ``class_names``).
    method: the explanation method's name, for the record (default: for a folder, the registry name its run.json
        names; else "unspecified").
    size: (h, w) the maps are downsampled to.
    clusters: the number of clusters, for every class (int) or per class (mapping); default: the eigengap.
    masks / boxes: the objects' pixels (N, H, W) bool, or boxes (N, 4) (x0, y0, x1, y1) inclusive, at the maps'
        resolution; for a folder, mappings from an image's id (or its ``image`` column) to its mask or box.
    seed: k-means' seed (the result is deterministic for a given seed). neighbors: of the affinity graph.
    max_clusters: the most clusters the eigengap may choose. min_images: classes with fewer maps are skipped
        (listed in ``skipped``). roles: for a folder, the roles of the rows to analyse.
    outside_threshold, margin, border, border_share, spread_ratio, position_tolerance: the flagging rules (this
        module's docstring).
    out: where to write strategies.json and the mean maps' PNGs: for a folder source, that folder unless
        given; for maps, nothing is written unless given.
    Returns ``Strategies``.
    """
    _check_options(size, neighbors, max_clusters, min_images, outside_threshold, margin, border, border_share,
                   spread_ratio, position_tolerance)
    requested = list(clusters.values()) if isinstance(clusters, Mapping) else [] if clusters is None else [clusters]
    if any(isinstance(count, bool) or int(count) != count or count < 1 for count in requested):
        raise ValueError(f"clusters must be a whole number of at least 1 (or a mapping class → such a number); "
                         f"got {clusters!r}.")
    notes: list[str] = []
    folder = None
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if folder.name == "index.csv" and folder.is_file():  # the index itself given: its folder
            folder = folder.parent
        if classes is not None or ids is not None:
            raise ValueError("classes= and ids= are for maps given as an array; a folder's index gives them.")
        if out is None:
            out = folder
    with contextlib.ExitStack() as held:
        locked = out is not None and Path(out).is_dir()
        if out is not None and locked:  # a second run into out is refused before it reads and clusters the maps
            held.enter_context(writing_lock(out))
        if folder is not None:
            record = _run_record_or_note(folder, notes)
            loaded = _load_folder(folder, roles, size, progress, notes,
                                  None if record is None else record.class_names)
            if method is None and record is not None:
                method = record.method or record.method_class  # "" for a method that is not registered
        else:
            assert not isinstance(source, (str, Path)), "a folder's maps are loaded above"
            loaded = _load_arrays(source, classes, ids, class_names, size)
        objects = _object_fractions(masks, boxes, loaded, size)
        if objects is not None:
            objects = near_objects(objects, margin)
        result = Strategies(method=method or "unspecified", map_size=(int(size[0]), int(size[1])), classes=[],
                            notes=notes)
        class_values = sorted(set(loaded.classes.tolist()))
        _warn_of_maps_without_place(loaded, notes)
        if isinstance(clusters, Mapping) and set(clusters) - set(class_values):
            unknown = sorted(set(clusters) - set(class_values), key=str)
            warn_at_callers_line(f"clusters= names class(es) {unknown} that have no maps here (the classes: "
                                 f"{class_values[:20]}{' …' if len(class_values) > 20 else ''}); their counts are "
                                 "not used. Key the mapping by the class index each map explains.")
        for class_index in tqdm(class_values, disable=not progress or len(class_values) < 2, desc="strategies",
                                unit="class"):
            chosen = np.flatnonzero(loaded.classes == class_index)
            name = loaded.names.get(class_index, "")
            if len(chosen) < min_images:
                result.skipped.append(SkippedClass(class_index, name, len(chosen), (
                    f"{len(chosen)} map(s); SpRAy needs at least {min_images} per class (min_images=) to find groups: "
                    "explain more images of this class")))
                continue
            wanted = clusters.get(class_index) if isinstance(clusters, Mapping) else clusters
            entry = analyse_class(
                loaded.maps[chosen], [loaded.ids[i] for i in chosen], class_index, name,
                None if objects is None else objects[chosen], wanted, seed, neighbors, max_clusters,
                outside_threshold, border, border_share, spread_ratio, position_tolerance)
            result.classes.append(entry)
            if wanted is None and separate_groups(entry.eigenvalues) == len(entry.eigenvalues) > max_clusters:
                note = (f"the maps of class {class_index} ({name or 'unnamed'}) fall into more than {max_clusters} "
                        f"separate groups (their graph has at least {max_clusters + 1} parts with no edge between "
                        f"them), more than max_clusters={max_clusters} allows: some of its {max_clusters} clusters "
                        f"join several groups. Raise max_clusters (or give clusters=) to see them apart.")
                notes.append(note)
                warn_at_callers_line(note)
        if out is not None:
            if not locked:  # out= made now
                held.enter_context(writing_lock(out))
            result._write(Path(out))
    return result


def _warn_of_maps_without_place(loaded: _LoadedMaps, notes: list[str]) -> None:
    """A note and a warning naming the maps that put their relevance at no place in particular (no positive value,
    or the same value everywhere): normalised, they are uniform, identical to each other, so they form a cluster
    of their own whatever the images show."""
    flat = loaded.maps.reshape(len(loaded.maps), -1)
    uniform = np.flatnonzero(flat.max(1) - flat.min(1) <= 1e-6 * flat.max(1))
    if not len(uniform):
        return
    examples = ", ".join(repr(loaded.ids[i]) for i in uniform[:3]) + (" …" if len(uniform) > 3 else "")
    note = (f"{len(uniform)} of the {len(flat)} maps hold no positive relevance, or the same value everywhere (e.g. "
            f"{examples}): they show no place, so SpRAy reads them as uniform and they group together, whatever the "
            "images show. Check the maps' sign (SpRAy compares where the positive relevance lies: for maps whose "
            "evidence is negative, pass their negation) or leave those maps out.")
    notes.append(note)
    warn_at_callers_line(note)


def _check_options(size: tuple[int, int], neighbors: int, max_clusters: int, min_images: int,
                   outside_threshold: float, margin: float, border: float, border_share: float, spread_ratio: float,
                   position_tolerance: float) -> None:
    if len(size) != 2 or any(int(side) != side or side < 4 for side in size):
        raise ValueError(f"size must be (h, w), whole numbers of at least 4; got {size!r}.")
    if neighbors < 1 or max_clusters < 1:
        raise ValueError(f"neighbors and max_clusters must be at least 1; got {neighbors} and {max_clusters}.")
    if min_images < 3:
        raise ValueError(f"min_images must be at least 3 (a graph of fewer maps has no groups); got {min_images}.")
    for name, value in (("outside_threshold", outside_threshold), ("border_share", border_share)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} is a share in [0, 1]; got {value}.")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin is a share of each side in [0, 1); got {margin}.")
    if not 0.0 < border < 0.5:
        raise ValueError(f"border is the band's width as a share of each side, in (0, 0.5); got {border}.")
    if spread_ratio < 0 or position_tolerance < 0:
        raise ValueError(f"spread_ratio and position_tolerance must be at least 0; got {spread_ratio} and "
                         f"{position_tolerance}.")


# Loading maps.


@dataclass
class _LoadedMaps:
    """maps: (N, h, w) float32, each non-negative with sum 1; classes: (N,) int64; ids: N strings; names: class
    index → name; images: N display names (a folder's ``image`` column, or the ids); original_size: (H, W)."""

    maps: np.ndarray
    classes: np.ndarray
    ids: list[str]
    names: dict[int, str]
    images: list[str]
    original_size: tuple[int, int]


def downsample(maps: Union[np.ndarray, torch.Tensor], size: tuple[int, int]) -> np.ndarray:
    """Maps (N, H, W) → (N, h, w) float32 by area averaging (each output pixel the mean of the input pixels it
    covers; bigger sizes repeat pixels)."""
    tensor = torch.as_tensor(np.asarray(maps, dtype=np.float32) if not isinstance(maps, torch.Tensor)
                             else maps.detach().float().cpu())
    return F.interpolate(tensor[:, None], size=tuple(int(side) for side in size), mode="area")[:, 0].numpy()


def normalise(maps: np.ndarray) -> np.ndarray:
    """Maps (N, h, w) → (N, h, w) float32, negative values set to 0 and each map scaled to sum 1; a map without
    positive values becomes uniform."""
    positive = np.clip(np.nan_to_num(np.asarray(maps, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)
    totals = positive.reshape(len(positive), -1).sum(1)  # in float64: float32 sums of values near 1e38 overflow
    empty = totals <= 0
    positive[empty] = 1.0
    totals[empty] = positive[0].size
    return (positive / totals[:, None, None]).astype(np.float32)


def unit_peak(maps: np.ndarray) -> np.ndarray:
    """Maps (N, H, W) of any real dtype → float32, each divided by its largest absolute value (where it is not 0).
    SpRAy scales each map to sum 1 anyway; without this, maps of large values (near 1e38 in float32, past it in
    float64) overflow to inf in float32 (the cast, or the area averaging's sums) and silently become all 0."""
    values = np.asarray(maps)
    if values.dtype != np.float64:  # float16, ints, bools: divided in float32, not rounded to float16 once more
        values = values.astype(np.float32)
    peaks = np.abs(values).reshape(len(values), -1).max(1) if values.size else np.zeros(len(values))
    peaks = np.where(peaks > 0, peaks, 1)
    return (values / peaks[:, None, None]).astype(np.float32)


def _load_arrays(maps: Union[np.ndarray, torch.Tensor], classes: Any, ids: Optional[Sequence[str]],
                 class_names: Optional[Sequence[str]], size: tuple[int, int]) -> _LoadedMaps:
    if isinstance(maps, torch.Tensor):
        array = maps.detach().cpu().to(torch.float64 if maps.dtype == torch.float64 else torch.float32).numpy()
    elif isinstance(maps, (list, tuple)) and len({np.shape(item) for item in maps}) > 1:
        sizes = sorted({"×".join(str(side) for side in np.shape(item)) for item in maps})
        raise ValueError(f"maps of different sizes ({', '.join(sizes[:5])}): SpRAy compares maps place by place, so "
                         "they need one size. Resize them to one (H, W) first, e.g. with "
                         "torch.nn.functional.interpolate, and pass them as one (N, H, W) array.")
    else:
        array = np.asarray(maps)
    if array.ndim != 3:
        raise ValueError(f"maps must be (N, H, W), one map per image (of an Explanation e: e.maps, or "
                         f"e.map_grid[:, k] for its k-th target); got shape {array.shape}.")
    if array.dtype.kind not in "fiub":
        raise ValueError(f"maps must be numbers; got an array of {array.dtype}.")
    if len(array) == 0:
        raise ValueError("there are no maps to analyse (an empty array).")
    _refuse_non_finite(array)
    if classes is None:
        raise ValueError("give classes=, the class each map explains ((N,) ints), to group the maps by class.")
    class_array = np.asarray(classes.cpu() if isinstance(classes, torch.Tensor) else classes).reshape(-1)
    if class_array.shape != (len(array),) or class_array.dtype.kind not in "iu":
        raise ValueError(f"classes must be (N,) = ({len(array)},) whole numbers; got {class_array.dtype} of shape "
                         f"{class_array.shape}.")
    id_list = [str(i) for i in range(len(array))] if ids is None else [str(item) for item in ids]
    if len(id_list) != len(array) or len(set(id_list)) != len(id_list):
        raise ValueError(f"ids must be {len(array)} distinct names, one per map; got {len(id_list)} "
                         f"({len(set(id_list))} distinct).")
    names = {int(c): (class_names[int(c)] if class_names is not None and 0 <= int(c) < len(class_names) else "")
             for c in set(class_array.tolist())}
    small = np.concatenate([downsample(unit_peak(array[start:start + 256]), size)  # a copy of 256 maps at a time
                            for start in range(0, len(array), 256)])
    return _LoadedMaps(normalise(small), class_array.astype(np.int64), id_list, names, id_list,
                       (int(array.shape[1]), int(array.shape[2])))


def _refuse_non_finite(maps: np.ndarray) -> None:
    """ValueError naming the maps (by index) that hold NaN or ±inf, with how many of each."""
    if maps.dtype.kind != "f":
        return
    bad = np.flatnonzero(~np.isfinite(maps).reshape(len(maps), -1).all(axis=1))
    if not len(bad):
        return
    described = []
    for index in bad[:5].tolist():
        counts = [(int(np.isnan(maps[index]).sum()), "NaN"), (int(np.isposinf(maps[index]).sum()), "+inf"),
                  (int(np.isneginf(maps[index]).sum()), "−inf")]
        described.append(f"map {index}: " + ", ".join(f"{count} {what}" for count, what in counts if count))
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise ValueError(
        f"{len(bad)} of the {len(maps)} maps hold values that are not finite ({'; '.join(described)}{more}). SpRAy "
        "compares where each map puts its relevance, and a NaN or infinite value has no share of it: read as 0 it "
        "would silently change the map, and its cluster. Find where the explanation gave them (a score that "
        "overflowed in half precision, a division by a zero gradient), or leave those maps out, with their classes "
        "and ids.")


def _run_record_or_note(folder: Path, notes: list[str]) -> Optional[RunRecord]:
    """The folder's OUT/run.json (its method and class names), or None: where there is none (a run of an earlier
    version), or with a note where it cannot be read."""
    try:
        return read_run_record(folder)
    except ValueError as error:
        notes.append(f"{error} Its method and class names are not used.")
        return None


def _load_folder(folder: Path, roles: Sequence[str], size: tuple[int, int], progress: bool, notes: list[str],
                 class_names: Optional[Sequence[str]]) -> _LoadedMaps:
    """The maps of a batch run's rows whose role is in ``roles`` (every row of an index without the label
    columns), read with ``explain.batch.read_index_contents``. A class's name is the index's ``class_name``, else
    ``class_names[class]`` (run.json's), else ""."""
    index = folder / "index.csv"
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {display_name(folder)!r}; give the output folder of explain batch "
                                "(which holds index.csv and maps/).")
    if not index.is_file():
        raise FileNotFoundError(f"{display_name(folder)} has no index.csv: give the output folder of explain batch "
                                "(explain.run), which holds index.csv and maps/.")
    contents = read_index_contents(index)
    if contents.incomplete:
        notes.append(f"{len(contents.incomplete)} image(s) whose index rows are incomplete (a run in progress, a line "
                     f"torn by a kill) were left out, e.g. {contents.incomplete[0]}.")
    if contents.duplicated:
        notes.append(f"{len(contents.duplicated)} image(s) have their rows in the index more than once (two runs at "
                     "once into the folder, by a version of explain that did not lock it), e.g. "
                     f"{contents.duplicated[0]}: their first rows were used. explain batch with the run's settings "
                     "removes the copies.")
    rows = contents.rows
    if not rows and contents.incomplete:
        raise ValueError(f"{display_name(index)} has no complete image: the rows of all its {len(contents.incomplete)} "
                         "image(s) are incomplete (each image needs its rows k = 0 … K−1, each saying targets = K). "
                         "Let the run finish, or run explain batch again to complete it.")
    if not rows:
        raise ValueError(f"{display_name(index)} has no rows: the run explained no image yet (an empty folder?).")
    if contents.has_label_columns:
        chosen = [row for row in rows if row["role"] in roles]
        if not chosen:
            found = sorted({row["role"] for row in rows})
            raise ValueError(f"no row of {display_name(index)} has a role in {list(roles)} (its roles: {found}); "
                             "run explain batch without --target/--topk, so that the predicted or true class is "
                             "explained, or pass roles= with the roles to analyse.")
    else:
        chosen = rows
    with_class = [row for row in chosen if row["target"].strip().isdigit()]
    if len(with_class) < len(chosen):
        notes.append(f"{len(chosen) - len(with_class)} row(s) explain no class index (a callable target) and were "
                     "left out.")
    selected: dict[tuple[str, int], dict[str, str]] = {}
    for row in with_class:
        selected.setdefault((row["id"], int(row["target"])), row)
    if not selected:
        raise ValueError(f"no row of {display_name(index)} explains a class index; SpRAy groups maps by class.")
    maps: list[np.ndarray] = []
    kept: list[dict[str, str]] = []
    unreadable: list[str] = []
    not_finite: list[str] = []
    first_size: Optional[tuple[tuple[int, int], str]] = None
    reader = MapReader(folder)  # at the input's resolution, from maps files of several images or one .npy each
    image: tuple[str, np.ndarray] = ("", np.zeros((0, 1, 1), np.float32))  # an image's maps are in consecutive rows
    for row in tqdm(list(selected.values()), disable=not progress, desc="strategies: reading maps", unit="map"):
        try:
            if image[0] != row["id"]:
                image = (row["id"], reader.read(row).numpy())
            one = image[1][int(row["k"])]
        except Exception as error:  # missing, truncated, not an array, k out of range, outside the folder ...
            unreadable.append(f"{row['map']} ({first_line(error)})")
            continue
        if not np.isfinite(one).all():
            not_finite.append(f"{row['map']} (image {row['id']}, k = {row['k']})")
            continue
        shape = (int(one.shape[0]), int(one.shape[1]))
        if first_size is None:
            first_size = (shape, row["id"])
        elif shape != first_size[0]:
            raise ValueError(
                f"maps of different sizes: {first_size[1]} is {first_size[0][0]}×{first_size[0][1]}, {row['id']} is "
                f"{shape[0]}×{shape[1]}. SpRAy compares maps place by place, so they need one size: run explain "
                "batch with a fixed input size (--size), or pass maps resized to one size as an array.")
        maps.append(downsample(unit_peak(one[None]), size)[0])
        kept.append(row)
    if unreadable:
        files_count = len({entry.split(" (")[0] for entry in unreadable})
        notes.append(f"{files_count} map file(s) could not be read, so {len(unreadable)} map(s) were left out, "
                     f"e.g. {unreadable[0]}.")
    if not_finite:
        notes.append(f"{len(not_finite)} map(s) hold NaN or infinite values and were left out (SpRAy cannot place "
                     f"their relevance), e.g. {not_finite[0]}.")
    if not kept:
        reasons = [f"{len(unreadable)} could not be read, e.g. {unreadable[0]}" if unreadable else "",
                   f"{len(not_finite)} hold NaN or infinite values, e.g. {not_finite[0]}" if not_finite else ""]
        raise ValueError(f"none of the {len(selected)} maps listed in {display_name(index)} can be used: "
                         f"{'; '.join(reason for reason in reasons if reason)}.")
    targets = np.array([int(row["target"]) for row in kept], np.int64)
    names: dict[int, str] = {}
    for row, target in zip(kept, targets.tolist()):
        if not names.get(target):
            names[target] = row["class_name"]
    for target, name in names.items():
        if not name and class_names is not None and 0 <= target < len(class_names):
            names[target] = class_names[target]
    assert first_size is not None
    return _LoadedMaps(normalise(np.stack(maps)), targets, [row["id"] for row in kept], names,
                       [row["image"] or row["id"] for row in kept], first_size[0])


def _object_fractions(masks: Optional[Masks], boxes: Optional[Boxes], loaded: _LoadedMaps, size: tuple[int, int]
                      ) -> Optional[np.ndarray]:
    """The share of each downsampled pixel covered by the object, (N, h, w) in [0, 1], or None without masks."""
    if masks is None and boxes is None:
        return None
    if masks is not None and boxes is not None:
        raise ValueError("give masks= or boxes=, not both.")
    height, width = loaded.original_size
    count = len(loaded.ids)
    if masks is not None:
        if isinstance(masks, Mapping):
            pixels = np.stack([np.asarray(_look_up(masks, loaded, i, "masks")) for i in range(count)])
        else:
            pixels = np.asarray(masks.cpu() if isinstance(masks, torch.Tensor) else masks)
        if pixels.shape != (count, height, width):
            raise ValueError(f"masks must be one (H, W) = ({height}, {width}) mask per map, at the maps' "
                             f"resolution; got shape {pixels.shape} for {count} maps.")
        pixels = pixels.astype(np.float32)
    else:
        assert boxes is not None
        if isinstance(boxes, Mapping):
            corners = np.array([np.asarray(_look_up(boxes, loaded, i, "boxes"), dtype=float) for i in range(count)])
        else:
            corners = np.asarray(boxes, dtype=float)
        if corners.shape != (count, 4):
            raise ValueError(f"boxes must be one (x0, y0, x1, y1) per map, ({count}, 4); got shape {corners.shape}.")
        bad = np.flatnonzero((corners[:, 2] < corners[:, 0]) | (corners[:, 3] < corners[:, 1]) | (corners < 0).any(1)
                             | (corners[:, 2] >= width) | (corners[:, 3] >= height))
        if len(bad):
            raise ValueError(f"box {corners[bad[0]].tolist()} of map {loaded.ids[bad[0]]!r} is not (x0, y0, x1, y1) "
                             f"with x0 ≤ x1 < {width} and y0 ≤ y1 < {height} (pixels of the maps, inclusive).")
        rows, columns = np.arange(height)[None, :, None], np.arange(width)[None, None, :]
        x0, y0, x1, y1 = (corners[:, i, None, None] for i in range(4))
        pixels = ((rows >= np.floor(y0)) & (rows <= np.ceil(y1)) & (columns >= np.floor(x0))
                  & (columns <= np.ceil(x1))).astype(np.float32)
    return np.clip(downsample(pixels, size), 0.0, 1.0)


def near_objects(objects: np.ndarray, margin: float) -> np.ndarray:
    """Object fractions (N, h, w) in [0, 1] → (N, h, w) float32, 1 where a pixel touches the object or lies within
    ``margin`` (a share of each side, rounded up to whole pixels) of it, else 0."""
    _, height, width = objects.shape
    reach_y, reach_x = math.ceil(margin * height - 1e-9), math.ceil(margin * width - 1e-9)
    touched = torch.from_numpy((objects > 0).astype(np.float32))[:, None]
    grown = F.max_pool2d(touched, (2 * reach_y + 1, 2 * reach_x + 1), stride=1, padding=(reach_y, reach_x))
    return grown[:, 0].numpy()


def _look_up(values: Mapping[str, Any], loaded: _LoadedMaps, position: int, what: str) -> Any:
    for key in (loaded.ids[position], loaded.images[position]):
        if key in values:
            return values[key]
    raise ValueError(f"{what} has no entry for map {loaded.ids[position]!r} (image {loaded.images[position]!r}); "
                     f"give one per explained image, keyed by its id or its image column.")


# The analysis of one class.


@contextlib.contextmanager
def _needs_scikit_learn() -> Iterator[None]:
    try:
        yield
    except ImportError as error:
        raise ImportError("explain.strategies needs scikit-learn (its nearest neighbours and spectral clustering): "
                          "pip install scikit-learn") from error


def knn_affinity(features: np.ndarray, neighbors: int) -> sparse.csr_matrix:
    """The symmetrised k-nearest-neighbour graph of the rows of ``features`` (N, D): (N, N) sparse, A = (C + Cᵀ)/2
    where C[i, j] = 1 when j is one of i's ``neighbors`` nearest rows (Euclidean, i itself excluded). Up to
    SMALL_CLASS rows, C is built from ``small_knn_columns`` (scikit-learn's graph, array for array, without its
    fixed cost of 0.03 to 0.1 s a call); above, or where that declines, by scikit-learn's ``kneighbors_graph``."""
    count = len(features)
    columns = small_knn_columns(features, neighbors) if count <= SMALL_CLASS else None
    if columns is None:
        connectivity = sklearn_knn_connectivity(features, neighbors)
    else:  # as kneighbors_graph builds it
        connectivity = sparse.csr_matrix((np.ones(columns.size), columns.ravel(),
                                          np.arange(0, columns.size + 1, neighbors)), shape=(count, count))
    return sparse.csr_matrix((connectivity + connectivity.T) * 0.5)


def sklearn_knn_connectivity(features: np.ndarray, neighbors: int) -> sparse.csr_matrix:
    """C of ``knn_affinity`` by scikit-learn's ``kneighbors_graph`` (any number of rows)."""
    with _needs_scikit_learn():
        from sklearn.neighbors import kneighbors_graph
    connectivity: sparse.csr_matrix = kneighbors_graph(features, n_neighbors=neighbors, mode="connectivity",
                                                       include_self=False)
    return connectivity


def small_knn_columns(features: np.ndarray, neighbors: int) -> Optional[np.ndarray]:
    """(N, neighbors) int64: row i lists i's ``neighbors`` nearest other rows, nearest first, as scikit-learn's
    brute-force search (the one it uses on more than 15 features) lists them; or None where this cannot tell how it
    would list them.

    scikit-learn sorts the ``neighbors`` + 1 nearest rows to each row i, i itself included, by distance, then drops
    i. Here the same, from squared distances ‖a‖² + ‖b‖² − 2 a·b as it computes them (0 from i to itself). Rows at
    (nearly) equal distances from i, copies of one map most often, are put in order by rounding there (its
    distances from a row to two identical rows differ in the last bits): where two of the neighbours kept, or the
    last kept and the next, are within TIE_TOLERANCE of the distances' scale, None, so that the caller asks
    scikit-learn. (A copy of i itself ties with i; no matter: i is dropped.)"""
    count, dimensions = features.shape
    if dimensions <= 15 or neighbors >= count:  # scikit-learn would search a KD-tree, or refuse
        return None
    values = np.asarray(features, dtype=np.float64)
    norms = (values * values).sum(1)
    squared = np.maximum(norms[:, None] + norms[None, :] - 2.0 * (values @ values.T), 0.0)
    np.fill_diagonal(squared, 0.0)
    order = np.argsort(squared, axis=1, kind="stable")[:, : neighbors + 2]
    ranked = np.take_along_axis(squared, order, axis=1)
    itself = order[:, : neighbors + 1] == np.arange(count)[:, None]
    if not itself.any(1).all():  # more than ``neighbors`` copies of i: which ones scikit-learn keeps is rounding
        return None
    kept = ranked[:, : neighbors + 1][~itself].reshape(count, neighbors)
    if neighbors + 1 < count:
        kept = np.concatenate([kept, ranked[:, neighbors + 1 :]], axis=1)  # the first one left out
    tolerance = TIE_TOLERANCE * (norms + norms.max())  # rounding errors of ‖a‖² + ‖b‖² − 2 a·b scale with this
    if (np.diff(kept, axis=1) <= tolerance[:, None]).any():
        return None
    return order[:, : neighbors + 1][~itself].reshape(count, neighbors).astype(np.int64)


def class_neighbors(neighbors: int, count: int) -> int:
    """The neighbours of each map in the graph of a class of ``count`` maps: ``neighbors``, at most half the class
    (at least 1). Joined to ``count`` − 1 others, every map would be joined to every other: a complete graph, whose
    eigengap is always 1 whatever the maps, and which splits no group of fewer than ``neighbors`` + 1 maps. Classes
    of at least 2 × ``neighbors`` maps (every class at the defaults) use ``neighbors``."""
    return max(1, min(neighbors, count // 2))


def laplacian_eigenvalues(affinity: sparse.spmatrix, count: int, seed: int = 0) -> np.ndarray:
    """The ``count`` smallest eigenvalues, ascending, of the normalised Laplacian I − D^-½ A D^-½ of ``affinity``
    (N, N) symmetric with positive degrees: values in [0, 2]. Exact (dense) up to DENSE_LIMIT nodes, else ARPACK."""
    degrees = np.asarray(affinity.sum(axis=1)).ravel()
    if (degrees <= 0).any():
        raise ValueError("the affinity graph has a node without edges; its normalised Laplacian is undefined.")
    scaling = sparse.diags(1.0 / np.sqrt(degrees))
    normalised_adjacency = scaling @ affinity @ scaling
    nodes = affinity.shape[0]
    if nodes <= DENSE_LIMIT:
        values = np.linalg.eigvalsh(np.eye(nodes) - normalised_adjacency.toarray())[:count]
    else:
        start = np.random.default_rng(seed).uniform(0.5, 1.5, nodes)
        largest = eigsh(normalised_adjacency, k=count, which="LA", v0=start, return_eigenvectors=False)
        values = np.sort(1.0 - largest)
    return np.clip(values, 0.0, 2.0)


def eigengap_count(eigenvalues: np.ndarray, max_clusters: int) -> int:
    """The number of clusters c in 1 … max_clusters whose gap λ_c − λ_(c−1) (0-based, ascending eigenvalues) is
    the largest; ties go to the smaller count. Eigenvalues below ZERO_EIGENVALUE count as 0 (one per connected
    component of the graph): where all of λ_0 … λ_max_clusters are 0, the graph falls into more separate groups
    than max_clusters, and the count is max_clusters (its gaps are rounding noise, which chose any count)."""
    values = np.asarray(eigenvalues, dtype=np.float64)[: max_clusters + 1]
    values = np.where(values < ZERO_EIGENVALUE, 0.0, values)
    if not values[-1] > 0:
        return len(values) - 1
    return int(np.argmax(np.diff(values))) + 1


def separate_groups(eigenvalues: np.ndarray) -> int:
    """How many of ``eigenvalues`` are 0 (below ZERO_EIGENVALUE): the graph's connected components, where fewer
    than the eigenvalues given."""
    return int((np.asarray(eigenvalues) < ZERO_EIGENVALUE).sum())


def spectral_labels(affinity: sparse.spmatrix, count: int, seed: int) -> np.ndarray:
    """(N,) cluster labels 0 … count−1 from scikit-learn's SpectralClustering on ``affinity``, renumbered by
    cluster size, largest first (ties by first member)."""
    nodes = affinity.shape[0]
    if count == 1:
        return np.zeros(nodes, np.int64)
    if count >= nodes:  # one map per cluster (the spectral embedding cannot have as many dimensions as nodes)
        return np.arange(nodes, dtype=np.int64)
    with _needs_scikit_learn():
        from sklearn.cluster import SpectralClustering
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Graph is not fully connected")
        raw = SpectralClustering(n_clusters=count, affinity="precomputed", assign_labels="kmeans", n_init=10,
                                 random_state=seed).fit_predict(affinity)
    order = sorted(set(raw.tolist()), key=lambda label: (-int((raw == label).sum()), int(np.argmax(raw == label))))
    renumbered = np.empty(nodes, np.int64)
    for new, label in enumerate(order):
        renumbered[raw == label] = new
    return renumbered


def _peaks(maps: np.ndarray) -> np.ndarray:
    """(N, h, w) → (N, 2) (y, x) of each map's maximum, in [0, 1] image coordinates (pixel centres)."""
    count, height, width = maps.shape
    flat = maps.reshape(count, -1).argmax(1)
    return np.stack([(flat // width + 0.5) / height, (flat % width + 0.5) / width], 1)


def _border_band(height: int, width: int, border: float) -> np.ndarray:
    """(height, width) bool, True in the outer ``border`` of each side (at least one pixel)."""
    band_rows, band_columns = max(1, math.ceil(border * height)), max(1, math.ceil(border * width))
    band = np.ones((height, width), dtype=bool)
    band[band_rows : height - band_rows, band_columns : width - band_columns] = False
    return band


def _border_share(mean_map: np.ndarray, border: float) -> float:
    """The share of the relevance of the hottest HOT_SHARE of ``mean_map``'s pixels inside the border band."""
    height, width = mean_map.shape
    band = _border_band(height, width, border)
    hottest = mean_map >= np.quantile(mean_map, 1.0 - HOT_SHARE)
    total = float(mean_map[hottest].sum())
    return float(mean_map[hottest & band].sum()) / total if total > 0 else 0.0


def _border_lift(members: np.ndarray, border: float) -> float:
    """Whether the cluster's maps agree on hot pixels in the border band, or the mean map's hottest pixels fell
    there by chance. For each of the maps (M, h, w) (M ≥ 2, each non-negative with sum 1): the hottest HOT_SHARE of
    the pixels of the mean of the other M − 1 maps, those inside the band; the map's mean value on them × h·w (its
    relevance there as a multiple of its mean per pixel; 0 where the band holds none). Returns the mean over the
    maps. Picked without the map itself, those pixels are no hotter in it than any others when the maps are noise
    (about 1), while maps that all put relevance on a tag or a frame give several times that."""
    count, height, width = members.shape
    band = _border_band(height, width, border).reshape(-1)
    flat = members.reshape(count, -1).astype(np.float64)
    total = flat.sum(0)
    lifts = []
    for own in flat:
        others = total - own
        chosen = (others >= np.quantile(others, 1.0 - HOT_SHARE)) & band
        lifts.append(float(own[chosen].mean()) * own.size if chosen.any() else 0.0)
    return float(np.mean(lifts))


def analyse_class(maps: np.ndarray, ids: list[str], class_index: int, class_name: str,
                  objects: Optional[np.ndarray], clusters: Optional[int], seed: int, neighbors: int,
                  max_clusters: int, outside_threshold: float, border: float, border_share: float,
                  spread_ratio: float, position_tolerance: float = POSITION_TOLERANCE) -> ClassStrategies:
    """SpRAy on one class's normalised maps (N, h, w) (non-negative, sum 1), with the object fractions (N, h, w)
    or None: its clusters, flagged by the module's rules."""
    count = len(maps)
    features = maps.reshape(count, -1).astype(np.float64)
    affinity = knn_affinity(features, class_neighbors(neighbors, count))
    spectrum_size = min(max_clusters, count - 1) + 1
    eigenvalues = laplacian_eigenvalues(affinity, spectrum_size, seed)
    chosen_by_gap = eigengap_count(eigenvalues, spectrum_size - 1)
    if clusters is not None and clusters > count:
        raise ValueError(f"clusters={clusters} for class {class_index} ({class_name or 'unnamed'}), which has only "
                         f"{count} maps: give at most {count}.")
    labels = spectral_labels(affinity, clusters or chosen_by_gap, seed)
    peaks = _peaks(maps)
    found: list[Cluster] = []
    for number in range(int(labels.max()) + 1):
        members = np.flatnonzero(labels == number)
        mean = maps[members].mean(0)
        typical = members[np.argsort(((features[members] - mean.reshape(-1)) ** 2).sum(1), kind="stable")]
        peak = _peaks(mean[None])[0]
        cluster = Cluster(
            cluster=number, members=[ids[i] for i in typical],
            mean_map=(mean / mean.max()).astype(np.float32) if mean.max() > 0 else mean.astype(np.float32),
            peak=(float(peak[0]), float(peak[1])),
            peak_spread=float(np.median(np.linalg.norm(peaks[members] - peak, axis=1))),
            border_share=_border_share(mean, border),
            border_lift=_border_lift(maps[members], border) if len(members) >= MIN_FLAG_SIZE else 0.0)
        if objects is not None:
            cluster.outside_share = float((maps[members] * (1.0 - objects[members])).sum() / len(members))
        found.append(cluster)
    _flag(found, objects is not None, outside_threshold, border, border_share, spread_ratio, position_tolerance)
    return ClassStrategies(class_index, class_name, count, chosen_by_gap, eigenvalues, found)


def _flag(found: list[Cluster], with_objects: bool, outside_threshold: float, border: float, border_share: float,
          spread_ratio: float, position_tolerance: float) -> None:
    for cluster in found:
        if cluster.size < MIN_FLAG_SIZE:
            continue
        if with_objects:
            assert cluster.outside_share is not None
            if cluster.outside_share > outside_threshold:
                cluster.flagged = True
                cluster.reason = (f"{cluster.outside_share:.0%} of its relevance lies outside the objects "
                                  f"(threshold {outside_threshold:.0%})")
            continue
        reasons = []
        others = [other.peak_spread for other in found if other is not cluster and other.size >= MIN_FLAG_SIZE]
        if others:
            typical_spread = float(np.median(others))
            if cluster.peak_spread <= position_tolerance and cluster.peak_spread < spread_ratio * typical_spread:
                reasons.append(
                    f"its maps peak at one place (median distance {cluster.peak_spread:.3f} of the image side from "
                    f"({cluster.peak[0]:.2f}, {cluster.peak[1]:.2f})), against {typical_spread:.3f} in the class's "
                    f"other clusters")
        if cluster.border_share >= border_share and cluster.border_lift >= BORDER_LIFT:
            reasons.append(f"{cluster.border_share:.0%} of its hottest {HOT_SHARE:.0%} lies in the border band "
                           f"(outer {border:.1%} of each side; threshold {border_share:.0%}), where each of its maps "
                           f"holds {cluster.border_lift:.1f} times its mean relevance per pixel (at least "
                           f"{BORDER_LIFT:g}; maps of noise: about 1)")
        if reasons:
            cluster.flagged = True
            cluster.reason = "; ".join(reasons)
