"""Attacks on SpRAy (explain.strategies) and the HTML report (explain report): tiny classes, as many clusters as
maps, a report of a folder given by a relative path, two reports into one folder at once. Each case is compared
with an independent computation (a by-hand normalised Laplacian, maps drawn by hand) on two different inputs."""

from __future__ import annotations

import csv
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import explain
from explain.cli import main as cli_main
from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder
from explain.dataset_tools import html_report
from explain.dataset_tools.html_report import report
from explain.dataset_tools.index import read_index
from explain.dataset_tools.run_folder import FolderInUseError
from explain.dataset_tools.spray import class_neighbors, strategies
from explain.io import render


def left_or_right(left: int, right: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Maps whose relevance fills the left or the right quarter (plus a little noise), shuffled: (maps (N, size,
    size), side (N,) 0 left / 1 right). Two strategies that anyone can see."""
    rng = np.random.default_rng(seed)
    maps = np.zeros((left + right, size, size))
    maps[:left, :, : size // 4] = 1
    maps[left:, :, -size // 4 :] = 1
    order = rng.permutation(left + right)
    return (maps + rng.uniform(0, 0.05, maps.shape))[order], (order >= left).astype(int)


def by_hand_spectrum(maps: np.ndarray, neighbors: int) -> tuple[np.ndarray, np.ndarray]:
    """SpRAy as Lapuschkin et al. define it, in numpy: maps to sum 1, a symmetrised ``neighbors``-nearest graph,
    L = I − D^-½ A D^-½; returns (eigenvalues ascending, eigenvectors)."""
    features = np.clip(maps, 0, None).reshape(len(maps), -1)
    features = features / features.sum(1, keepdims=True)
    distances = ((features[:, None] - features[None]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    connectivity = np.zeros_like(distances)
    for row, nearest in enumerate(np.argsort(distances, axis=1, kind="stable")[:, :neighbors]):
        connectivity[row, nearest] = 1
    affinity = (connectivity + connectivity.T) / 2
    scale = 1 / np.sqrt(affinity.sum(1))
    return np.linalg.eigh(np.eye(len(maps)) - scale[:, None] * affinity * scale[None, :])


def by_hand_two_groups(maps: np.ndarray, neighbors: int) -> set[frozenset[int]]:
    """The graph's split into two (Shi and Malik's normalised cut): the sign of the eigenvector of L's second
    smallest eigenvalue, scaled by D^-½."""
    values, vectors = by_hand_spectrum(maps, neighbors)
    fiedler = vectors[:, 1]
    return {frozenset(np.flatnonzero(fiedler < 0).tolist()), frozenset(np.flatnonzero(fiedler >= 0).tolist())}


# ---- SpRAy: classes smaller than the graph's neighbourhood ---------------------------------------------------


@pytest.mark.parametrize("left, right, seed", [(3, 3, 0), (6, 4, 1), (8, 8, 2)])
def test_a_small_class_with_two_obvious_strategies_gets_two_clusters(left, right, seed):
    """A class of fewer than 11 maps (allowed with min_images=) was joined into a complete graph (each map to its
    count − 1 others), whose eigengap is 1 whatever the maps: 3 maps on the left and 3 on the right were one
    strategy. The graph uses at most half the class as neighbours; the clusters and eigenvalues equal a by-hand
    normalised Laplacian of that graph, whose second eigenvector splits the maps by side."""
    maps, side = left_or_right(left, right, seed)
    result = strategies(maps, classes=np.zeros(len(maps), int), min_images=3, size=(16, 16), progress=False)
    (entry,) = result.classes
    neighbors = class_neighbors(10, len(maps))
    assert neighbors < len(maps) - 1
    values, _ = by_hand_spectrum(maps, neighbors)
    np.testing.assert_allclose(entry.eigenvalues, values[: len(entry.eigenvalues)], atol=1e-8)
    assert entry.eigengap_clusters == int(np.argmax(np.diff(values[: len(entry.eigenvalues)]))) + 1 == 2
    truth = {frozenset(np.flatnonzero(side == 0).tolist()), frozenset(np.flatnonzero(side == 1).tolist())}
    assert by_hand_two_groups(maps, neighbors) == truth
    assert {frozenset(int(member) for member in cluster.members) for cluster in entry.clusters} == truth


def test_classes_of_the_default_size_keep_ten_neighbours_and_their_clusters():
    """The rule leaves every class of at least 2 × neighbors maps (all at the defaults) as before: 10 neighbours,
    and the by-hand Laplacian's eigenvalues."""
    assert [class_neighbors(10, count) for count in (3, 6, 19, 20, 21, 500)] == [1, 3, 9, 10, 10, 10]
    maps, side = left_or_right(12, 12, seed=3)
    (entry,) = strategies(maps, classes=np.zeros(24, int), size=(16, 16), min_images=20, progress=False).classes
    values, _ = by_hand_spectrum(maps, 10)
    np.testing.assert_allclose(entry.eigenvalues, values[:9], atol=1e-8)
    assert {frozenset(int(m) for m in c.members) for c in entry.clusters} == {
        frozenset(np.flatnonzero(side == 0).tolist()), frozenset(np.flatnonzero(side == 1).tolist())}


# ---- SpRAy: as many clusters as maps -------------------------------------------------------------------------


@pytest.mark.parametrize("count", [3, 7])
def test_as_many_clusters_as_maps_gives_one_map_each(count):
    """clusters= equal to a class's size is allowed ("give at most N"), but scikit-learn's spectral embedding
    cannot have N dimensions: it raised "Cannot use scipy.linalg.eigh for sparse A with k >= N". By definition
    each map is then its own cluster, its mean map its own map scaled to max 1."""
    rng = np.random.default_rng(count)
    maps = rng.random((count, 16, 16))
    result = strategies(maps, classes=np.zeros(count, int), clusters=count, min_images=3, size=(16, 16),
                        progress=False)
    (entry,) = result.classes
    assert sorted(int(cluster.members[0]) for cluster in entry.clusters) == list(range(count))
    for cluster in entry.clusters:
        assert cluster.size == 1
        one = maps[int(cluster.members[0])]
        np.testing.assert_allclose(cluster.mean_map, one / one.max(), rtol=1e-5)


def test_the_command_with_as_many_clusters_as_a_class_has_maps(tmp_path, capsys):
    """The same through `explain strategies OUT --clusters N` on a real run of the watermark demo model: a class
    of N maps gets N clusters of one map each (it stopped with scikit-learn's error)."""
    folder = write_watermark_folder(tmp_path / "images", count=12)
    explain.run(explain.GradCAM(load_watermark_demo(), "layer4"), folder, tmp_path / "out", progress=False)
    rows = [row for row in read_index(tmp_path / "out" / "index.csv") if row["role"] in ("predicted", "label")]
    per_class: dict[int, set[str]] = {}
    for row in rows:
        per_class.setdefault(int(row["target"]), set()).add(row["id"])
    smallest = min(len(ids) for ids in per_class.values())
    assert smallest >= 3
    assert cli_main(["strategies", str(tmp_path / "out"), "--clusters", str(smallest), "--min-images", "3",
                     "--no-progress"]) == 0
    found = strategies(tmp_path / "out", clusters=smallest, min_images=3, progress=False)
    for entry in found.classes:
        assert len(entry.clusters) == smallest
        if entry.images == smallest:
            assert {cluster.members[0] for cluster in entry.clusters} == per_class[entry.class_index]
    assert "written to" in capsys.readouterr().out


# ---- The report of a folder given by a relative path ---------------------------------------------------------


def write_small_run(out: Path, count: int, targets: int, seed: int) -> np.ndarray:
    """A run of ``count`` images of ``targets`` maps each, stored as an earlier version did (maps/<id>.npy, (K, H, W)
    float16 in [0, 1]), without overlays or source images: the report draws the thumbnails from the maps."""
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[:24, :24]
    centres = rng.uniform(4, 20, (count, targets, 2))  # smooth maps: JPEG keeps them close to their colours
    maps = np.exp(-((rows - centres[..., :1, None]) ** 2 + (columns - centres[..., 1:, None]) ** 2) / 50)
    maps = maps.astype(np.float16)
    (out / "maps").mkdir(parents=True)
    fields = ["id", "image", "target", "k", "targets", "class_name", "score", "probability", "map"]
    with open(out / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fields, lineterminator="\r\n")
        writer.writeheader()
        for index in range(count):
            np.save(out / "maps" / f"img{index}.npy", maps[index])
            for k in range(targets):
                writer.writerow({"id": f"img{index}", "image": f"img{index}.png", "target": k, "k": k,
                                 "targets": targets, "class_name": f"c{k}", "score": "1", "probability": "0.5",
                                 "map": f"maps/img{index}.npy"})
    return maps


def drawn_by_hand(one_map: np.ndarray) -> np.ndarray:
    """A map in [0, 1] through the "jet" table of render, as uint8 RGB: the thumbnail without a source image."""
    table = (render.colormap_table("jet").numpy() * 255).round().astype(np.uint8)
    return table[(one_map.astype(np.float32).clip(0, 1) * 255).round().astype(np.intp)]


@pytest.mark.parametrize("count, targets", [(3, 1), (2, 3)])
def test_a_report_of_a_relative_folder_draws_every_thumbnail_from_the_maps(tmp_path, monkeypatch, count, targets):
    """`explain report out` from the folder above OUT (the usual way to call it): the map files were looked up at
    OUT/OUT/maps/..., so no thumbnail was drawn and every image was noted "no readable overlay or map file". Each
    thumbnail must be its map through the colour table (JPEG: within a small tolerance)."""
    maps = write_small_run(tmp_path / "out", count, targets, seed=count)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: every image has its thumbnails
        result = report("out", thumbnail_size=24)
    assert result.thumbnails_made == count * targets and result.notes == []
    for index in range(count):
        record = html_report.ImageRecord(f"img{index}", f"img{index}.png", "", [None] * targets)
        for k, path in enumerate(html_report._thumbnail_paths(Path("out") / "report" / "thumbs-24", record)):
            thumbnail = np.asarray(Image.open(path).convert("RGB"), dtype=float)
            expected = drawn_by_hand(maps[index, k]).astype(float)
            assert thumbnail.shape == expected.shape
            assert np.abs(thumbnail - expected).mean() < 12  # JPEG at quality 82; a wrong map differs by ~80


# ---- Two reports into one folder at once ---------------------------------------------------------------------


def referenced_files_exist(out: Path) -> list[str]:
    """The files that OUT/report.html and its data files name and that are missing."""
    page = (out / "report.html").read_text(encoding="utf-8")
    data_folder = re.search(r'"dataFolder":"([^"]+)"', page).group(1)
    missing = [] if (out / data_folder).is_dir() else [data_folder]
    for script in (out / data_folder).glob("*.js") if not missing else []:
        for url in re.findall(r'"(?:thumb|overlay|meanMap)":"([^"]+)"', script.read_text(encoding="utf-8")):
            if not (out / url).is_file():
                missing.append(url)
    return missing


@pytest.mark.parametrize("second_size", [160, 96])
def test_a_second_report_into_a_folder_being_reported_is_refused_and_the_page_stays_whole(tmp_path, monkeypatch,
                                                                                          second_size):
    """Report A writes its page; report B, started meanwhile, writes its own page; A then removes every data
    folder but its own, B's included (and with another thumbnail size, B's thumbnails): the page on disk named
    files that were gone and showed no image. The second report must be refused with a clear error while the first
    holds OUT/report, and the page left must name only files that exist."""
    write_small_run(tmp_path / "out", 4, 2, seed=9)
    out = tmp_path / "out"
    errors: list[BaseException] = []
    original = html_report.write_atomically
    started = threading.Event()

    def second_report() -> None:
        try:
            report(out, thumbnail_size=second_size)
        except BaseException as error:  # noqa: BLE001 - examined below
            errors.append(error)

    def page_then_second(path: Path, write) -> None:
        original(path, write)
        if path.name == "report.html" and not started.is_set():  # A's page is written; B runs now, to its end
            started.set()
            thread = threading.Thread(target=second_report)
            thread.start()
            thread.join(timeout=60)

    monkeypatch.setattr(html_report, "write_atomically", page_then_second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report(out, thumbnail_size=160)
    assert started.is_set()
    assert referenced_files_exist(out) == []
    assert len(errors) == 1 and isinstance(errors[0], FolderInUseError)
    assert "another explain report is being written into" in str(errors[0]) and "pid" in str(errors[0])
    monkeypatch.setattr(html_report, "write_atomically", original)
    with warnings.catch_warnings():  # once the first has ended, the second goes through
        warnings.simplefilter("ignore")
        report(out, thumbnail_size=second_size)
    assert referenced_files_exist(out) == []
