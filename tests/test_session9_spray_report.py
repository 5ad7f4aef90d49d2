"""Session 9 attacks on SpRAy (explain.strategies), the HTML report and the concept atlas. SpRAy is checked against
an independent numpy computation of Lapuschkin et al.'s spectral clustering (kNN graph, normalised Laplacian,
eigengap) on maps whose groups anyone can see; the atlas's references and patches against a model whose concept
relevance is worked out by hand."""

from __future__ import annotations

import csv
import json
import shutil
import warnings
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from explain.dataset_tools.concept_atlas import build_atlas
from explain.dataset_tools.html_report import report
from explain.dataset_tools.spray import eigengap_count, strategies
from explain.io import render


def corner_maps(count: int, seed: int, scale: float = 1.0, dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``count`` maps (32 × 32) whose relevance sits in the top-left or the bottom-right corner (6 × 6, plus a
    little noise), shuffled: (maps, corner (N,) 0 top-left / 1 bottom-right)."""
    rng = np.random.default_rng(seed)
    maps = np.zeros((count, 32, 32))
    half = count // 2
    maps[:half, :6, :6] = 1
    maps[half:, -6:, -6:] = 1
    order = rng.permutation(count)
    return ((maps + rng.uniform(0, 0.05, maps.shape))[order] * scale).astype(dtype), (order >= half).astype(int)


def by_hand_spray(maps: np.ndarray, neighbors: int) -> tuple[np.ndarray, np.ndarray]:
    """SpRAy's spectrum in plain numpy, as the paper and CoRelAy define it: maps (already 32 × 32) clipped at 0 and
    scaled to sum 1, each joined to its ``neighbors`` nearest (Euclidean), A = (C + Cᵀ) / 2, L = I − D^-½ A D^-½.
    Returns (eigenvalues ascending, eigenvectors)."""
    features = np.clip(maps.astype(np.float64), 0, None).reshape(len(maps), -1)
    features /= features.sum(1, keepdims=True)
    distances = np.sqrt(((features[:, None] - features[None]) ** 2).sum(-1))
    np.fill_diagonal(distances, np.inf)
    connectivity = np.zeros_like(distances)
    for row in range(len(maps)):
        connectivity[row, np.argsort(distances[row], kind="stable")[:neighbors]] = 1
    affinity = (connectivity + connectivity.T) / 2
    scale = 1 / np.sqrt(affinity.sum(1))
    return np.linalg.eigh(np.eye(len(maps)) - scale[:, None] * affinity * scale[None, :])


def partition(labels: dict[str, int]) -> set[frozenset[str]]:
    groups: dict[int, set[str]] = {}
    for key, label in labels.items():
        groups.setdefault(label, set()).add(key)
    return {frozenset(group) for group in groups.values()}


# ---- SpRAy against an independent computation -----------------------------------------------------------------


@pytest.mark.parametrize("count, seed", [(40, 0), (30, 3)])
def test_two_corner_strategies_match_an_independent_spectral_clustering_whatever_the_seed(count, seed):
    maps, corner = corner_maps(count, seed)
    values, vectors = by_hand_spray(maps, neighbors=10)
    assert values[1] < 1e-9 < 0.3 < values[2]  # two separate groups: two zero eigenvalues, then the jump
    embedding = vectors[:, :2] / np.linalg.norm(vectors[:, :2], axis=1, keepdims=True)  # Ng, Jordan and Weiss
    directions = {tuple(np.round(row, 6)) for row in embedding}  # one per separate group, whatever the basis
    by_hand = {str(i): sorted(directions).index(tuple(np.round(embedding[i], 6))) for i in range(count)}
    truth = {str(i): int(corner[i]) for i in range(count)}
    assert len(directions) == 2 and partition(by_hand) == partition(truth)
    runs = [strategies(maps, classes=np.zeros(count, int), seed=chosen, progress=False).classes[0]
            for chosen in (0, 0, 1, 7)]
    for entry in runs:
        np.testing.assert_allclose(entry.eigenvalues, values[:9], atol=1e-6)
        assert entry.eigengap_clusters == 2 == int(np.argmax(np.diff(values[:9]))) + 1
        found = {member: cluster.cluster for cluster in entry.clusters for member in cluster.members}
        assert partition(found) == partition(truth)
    assert [cluster.members for cluster in runs[0].clusters] == [cluster.members for cluster in runs[1].clusters]


@pytest.mark.parametrize("scale, dtype", [(1e37, np.float32), (1e300, np.float64), (1e-40, np.float32)])
def test_maps_of_very_large_or_small_values_cluster_as_the_same_maps_at_scale_one(scale, dtype):
    """Near 1e38 the float32 sums of the area averaging and of the normalisation overflowed to inf, so every map
    became 0: one cluster of all 40, whose mean map was 0. The scale of a map must not matter (each is taken to sum
    1), as a tensor too."""
    maps, corner = corner_maps(40, 1)
    reference = strategies(maps, classes=np.zeros(40, int), progress=False).classes[0]
    scaled = corner_maps(40, 1, scale, dtype)[0]
    for given in (scaled, torch.from_numpy(scaled)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow, no note of maps without a place
            entry = strategies(given, classes=np.zeros(40, int), progress=False).classes[0]
        assert [cluster.members for cluster in entry.clusters] == [cluster.members for cluster in reference.clusters]
        for mine, expected in zip(entry.clusters, reference.clusters):
            np.testing.assert_allclose(mine.mean_map, expected.mean_map, atol=1e-5)
    assert partition({m: c.cluster for c in reference.clusters for m in c.members}) == \
        partition({str(i): int(corner[i]) for i in range(40)})


def test_more_separate_groups_than_max_clusters_gives_max_clusters_and_says_so():
    """Ten groups of twelve near-identical maps: the graph has ten parts, so λ_0 … λ_8 are all 0 but for rounding
    (1e-16), and the eigengap picked 7 or 8 by that noise (exact zeros: 1, one cluster of everything). It must give
    max_clusters, say that the groups outnumber it, and with room for them find each group."""
    rng = np.random.default_rng(0)
    maps = np.zeros((9 * 12, 32, 32))
    for group in range(9):
        maps[group * 12:(group + 1) * 12, 3 * group:3 * group + 3, 3 * group:3 * group + 3] = 1
    maps += rng.uniform(0, 0.01, maps.shape)
    assert eigengap_count(np.zeros(9), 8) == 8
    assert eigengap_count(np.array([0, 1e-16, 3e-16, 0.5, 0.6]), 4) == 3
    with pytest.warns(UserWarning, match="more than 8 separate groups") as caught:
        result = strategies(maps, classes=np.zeros(len(maps), int), progress=False)
    assert caught[0].filename == __file__
    assert result.classes[0].eigengap_clusters == 8 and len(result.classes[0].clusters) == 8
    assert any("more than 8 separate groups" in note for note in result.notes)
    wide = strategies(maps, classes=np.zeros(len(maps), int), max_clusters=12, progress=False)
    found = {member: cluster.cluster for cluster in wide.classes[0].clusters for member in cluster.members}
    assert wide.classes[0].eigengap_clusters == 9 and wide.notes == []
    assert partition(found) == partition({str(i): i // 12 for i in range(len(maps))})


def test_maps_without_a_place_are_named_in_a_warning_and_a_note():
    """All-negative, all-zero or constant maps are read as uniform (they show no place) and form a cluster of their
    own whatever the images show: silently, before. The warning names how many."""
    maps, _ = corner_maps(30, 2)
    maps[:4] = -maps[:4]  # evidence of the wrong sign
    maps[4] = 0.0
    maps[5] = 0.3  # the same everywhere
    with pytest.warns(UserWarning, match=r"6 of the 30 maps hold no positive relevance") as caught:
        result = strategies(maps, classes=np.zeros(30, int), progress=False)
    assert caught[0].filename == __file__
    assert len(result.notes) == 1 and "'0', '1', '2' …" in result.notes[0]
    clean, _ = corner_maps(30, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategies(clean, classes=np.zeros(30, int), progress=False).notes == []


def test_maps_of_different_sizes_or_clusters_for_a_class_not_there_are_said_clearly():
    maps = [np.ones((8, 8)), np.ones((8, 8)), np.ones((9, 9))]
    with pytest.raises(ValueError, match=r"maps of different sizes \(8×8, 9×9\)"):
        strategies(maps, classes=[0, 0, 0], min_images=3, progress=False)
    same, _ = corner_maps(6, 0)
    with pytest.warns(UserWarning, match=r"clusters= names class\(es\) \[1\] that have no maps here"):
        result = strategies(same, classes=np.zeros(6, int), min_images=3, clusters={1: 2}, progress=False)
    assert result.classes[0].eigengap_clusters == len(result.classes[0].clusters)  # the eigengap's count was used


# ---- The report ---------------------------------------------------------------------------------------------

HOSTILE_IDS = ["a/b", "a_b", "A_b", "<script>alert(1)</script>", "x\"y'z&amp;", "日本語 ü", "a b#c%20", "a?b", "q"]
HOSTILE_CLASSES = ["</script><script>alert('c0')</script>", "quote \" & ' <b>bold</b>", "ünïcødé 猫"]


def write_hostile_run(out: Path) -> np.ndarray:
    """A run (maps/<i>.npy, (1, 16, 16), a blob each) whose ids, image names and class names hold markup, quotes,
    '&', '%', '#', '?', unicode, and ids that collide once made safe for a file name ("a/b", "a_b", "a?b")."""
    rng = np.random.default_rng(5)
    rows, columns = np.mgrid[:16, :16]
    centres = rng.uniform(2, 14, (len(HOSTILE_IDS), 2))  # smooth maps: JPEG keeps them close to their colours
    maps = np.exp(-((rows - centres[:, :1, None]) ** 2 + (columns - centres[:, 1:, None]) ** 2) / 40)
    maps = maps[:, None].astype(np.float32)
    (out / "maps").mkdir(parents=True)
    fields = ["id", "image", "target", "k", "targets", "class_name", "score", "probability", "map"]
    with open(out / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        for index, image_id in enumerate(HOSTILE_IDS):
            np.save(out / "maps" / f"m{index}.npy", maps[index])
            writer.writerow({"id": image_id, "image": image_id + ".png", "target": index % 3, "k": 0, "targets": 1,
                             "class_name": HOSTILE_CLASSES[index % 3], "score": 1, "probability": 0.5,
                             "map": f"maps/m{index}.npy"})
    return maps


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list]] = []
        self.text = ""

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data) -> None:
        self.text += data


def script_arguments(path: Path) -> list:
    """The JSON arguments of a data file explainReport.f(a, b);."""
    text = path.read_text(encoding="utf-8")
    return json.loads("[" + text[text.index("(") + 1 : text.rindex(")")] + "]")


def test_hostile_names_stay_text_every_thumbnail_is_its_own_map_and_a_moved_folder_loads(tmp_path):
    maps = write_hostile_run(tmp_path / "run")
    strategies(tmp_path / "run", min_images=3, progress=False)
    shutil.move(str(tmp_path / "run"), str(tmp_path / "moved"))  # the report, then the page, from elsewhere
    out = tmp_path / "moved"
    report(out, thumbnail_size=16)
    shutil.move(str(out), str(tmp_path / "again"))
    out = tmp_path / "again"
    page = Elements()
    page.feed((out / "report.html").read_text(encoding="utf-8"))
    scripts = [dict(attributes) for tag, attributes in page.tags if tag == "script"]
    assert scripts == [{"type": "application/json", "id": "report-meta"},
                       {"src": "report/report.js", "charset": "utf-8"}]
    assert not any(tag == "b" for tag, _ in page.tags)
    meta = json.loads(page.text[page.text.index('{"images"'):page.text.rindex("}") + 1])
    assert sorted(name for _, name in meta["classes"]) == sorted(HOSTILE_CLASSES)
    data = out / meta["dataFolder"]
    records = [record for path in sorted(data.glob("chunk-*.js")) for record in script_arguments(path)[1]]
    assert sorted(record["id"] for record in records) == sorted(HOSTILE_IDS)
    thumbs = {record["id"]: record["targets"][0]["thumb"] for record in records}
    assert len(set(thumbs.values())) == len(HOSTILE_IDS)  # no two images share a thumbnail
    table = render.colormap_table("jet").numpy() * 255
    for index, image_id in enumerate(HOSTILE_IDS):  # relative URLs: they resolve in the moved folder
        picture = np.asarray(Image.open(out / thumbs[image_id]).convert("RGB"), dtype=float)
        drawn = [table[(one[0].clip(0, 1) * 255).round().astype(int)] for one in maps]
        errors = [float(np.abs(picture - expected).mean()) for expected in drawn]
        assert errors[index] < 20 and int(np.argmin(errors)) == index  # JPEG at quality 82; its own map, no other
    shown = script_arguments(data / "strategies.js")[0]
    assert {entry["name"] for entry in shown["classes"]} == set(HOSTILE_CLASSES)
    for entry in shown["classes"]:
        for cluster in entry["clusters"]:
            assert (out / cluster["meanMap"]).is_file()
            assert all((out / example["thumb"]).is_file() for example in cluster["examples"])


def test_the_notes_of_strategies_reach_the_report(tmp_path):
    """strategies.json's notes (maps left out, maps without a place, groups beyond max_clusters) were not shown:
    a report reader could not know the strategies left maps out."""
    write_hostile_run(tmp_path / "run")
    strategies(tmp_path / "run", min_images=3, progress=False)
    saved = json.loads((tmp_path / "run" / "strategies.json").read_text(encoding="utf-8"))
    saved["notes"] = ["2 map file(s) could not be read <b>x</b> & so on"]
    (tmp_path / "run" / "strategies.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.warns(UserWarning, match="leaves things out"):
        result = report(tmp_path / "run", thumbnail_size=16)
    assert result.notes == ["strategies: 2 map file(s) could not be read <b>x</b> & so on"]
    assert "<li>strategies: 2 map file(s) could not be read &lt;b&gt;x&lt;/b&gt; &amp; so on</li>" in \
        (tmp_path / "run" / "report.html").read_text(encoding="utf-8")


# ---- The concept atlas ----------------------------------------------------------------------------------------


class ColourConcepts(nn.Module):
    """Concept 0: the red channel, concept 1: the blue one (1 × 1 convolution, no bias), ReLU, mean over the image,
    class k = concept k. With LRP, a concept's relevance for the predicted class is its mean activation
    (Σ_c R_c = the logit, the linear layer having no bias), and its conditional heatmap lies on its colour's pixels."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1, bias=False)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.weight[0, 2 if swap else 0] = 1
            self.conv.weight[1, 0 if swap else 2] = 1
            self.fc.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.relu(self.conv(x))).flatten(1))


def write_squares(folder: Path) -> dict[str, tuple[int, int, int, int]]:
    """Six 32 × 32 black images with one square, red (even) or blue (odd), of side 4, 6, … 14: name → (top, left,
    side, channel)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    squares = {}
    for index in range(6):
        side = 4 + 2 * index
        top, left = (int(value) for value in rng.integers(0, 32 - side, 2))
        channel = 0 if index % 2 == 0 else 2
        pixels = np.zeros((32, 32, 3), np.uint8)
        pixels[top:top + side, left:left + side, channel] = 255
        Image.fromarray(pixels).save(folder / f"im{index}.png")
        squares[f"im{index}.png"] = (top, left, side, channel)
    return squares


def by_hand_patch(square: tuple[int, int, int, int]) -> np.ndarray:
    """The square with the context ``_crop`` adds (max(2, (h + w) // 8) pixels each side, inside the image)."""
    top, left, side, channel = square
    margin = max(2, 2 * side // 8)
    pixels = np.zeros((32, 32, 3), np.uint8)
    pixels[top:top + side, left:left + side, channel] = 255
    return pixels[max(0, top - margin):top + side + margin, max(0, left - margin):left + side + margin]


def test_the_atlas_references_and_patches_are_the_most_relevant_squares_by_hand(tmp_path):
    squares = write_squares(tmp_path / "images")
    atlas = build_atlas(ColourConcepts().eval(), "relu", tmp_path / "images", tmp_path / "atlas", top=3,
                        batch_size=4, progress=False)
    red_on_normalised = (1 - 0.485) / 0.229  # ImageNet normalisation of a full red pixel (the default)
    blue_on_normalised = (1 - 0.406) / 0.225
    for concept, channel, level in ((0, 0, red_on_normalised), (1, 2, blue_on_normalised)):
        ranked = sorted((name for name, square in squares.items() if square[3] == channel),
                        key=lambda name: -squares[name][2])
        references = atlas.references(concept)
        assert [reference["image"] for reference in references] == ranked
        for reference in references:
            side = squares[reference["image"]][2]
            assert reference["value"] == pytest.approx(side ** 2 * level / 32 ** 2, rel=1e-4)
        for reference, patch in zip(references, atlas.patches(concept)):
            np.testing.assert_array_equal(patch, by_hand_patch(squares[reference["image"]]))


def test_a_new_atlas_in_an_old_folder_shows_no_patch_of_the_old_one_and_batches_without_record_are_refused(tmp_path):
    """After the batches of an atlas were deleted, an atlas of another model in its folder reused the old patches
    by name: concept 0's references were the blue squares, its patches red ones. And batches whose record was
    deleted were resumed whatever model measured them."""
    squares = write_squares(tmp_path / "images")
    build_atlas(ColourConcepts().eval(), "relu", tmp_path / "images", tmp_path / "atlas", top=2, batch_size=4,
                progress=False)
    shutil.rmtree(tmp_path / "atlas" / "batches")
    swapped = build_atlas(ColourConcepts(swap=True).eval(), "relu", tmp_path / "images", tmp_path / "atlas", top=2,
                          batch_size=4, progress=False)
    for concept in (0, 1):
        for reference, patch in zip(swapped.references(concept), swapped.patches(concept)):
            np.testing.assert_array_equal(patch, by_hand_patch(squares[reference["image"]]))
        assert {squares[reference["image"]][3] for reference in swapped.references(concept)} == {2 - 2 * concept}
    for model, layer, differs in ((ColourConcepts(swap=True), "conv", "layer: 'relu' earlier, 'conv' now"),
                                  (ColourConcepts(), "relu", "model: ")):  # resumed with another layer or model
        with pytest.raises(ValueError, match="holds an atlas with other settings") as refused:
            build_atlas(model.eval(), layer, tmp_path / "images", tmp_path / "atlas", top=2, batch_size=4,
                        progress=False)
        assert differs in str(refused.value)
    (tmp_path / "atlas" / "atlas-record.json").unlink()
    with pytest.raises(ValueError, match=r"holds measured batches \(batches/\) but no atlas-record.json"):
        build_atlas(ColourConcepts().eval(), "relu", tmp_path / "images", tmp_path / "atlas", top=2, batch_size=4,
                    progress=False)
