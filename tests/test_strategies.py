"""SpRAy (explain.strategies): clusters of maps per class, the eigengap, the flagging rules, the output folder; and
the watermark ("Clever Hans") demo model that it must catch."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain import spray  # the module (``explain.strategies`` names the function)
from explain.data.demo_watermark import (
    CORNER,
    SHARE,
    WATERMARKED_CLASS,
    load_watermark_demo,
    watermark_held_out,
    write_watermark_folder,
)
from explain.data.synthetic import (
    CLASS_NAMES,
    WATERMARK_SIZE,
    add_watermark,
    make_dataset,
    make_watermark_dataset,
    watermark_box,
)
from explain.data.train import to_model_input
from explain.data.train_watermark import measure_watermark_use
from explain.dataset_tools.index import EARLIER_FIELDS, FIELDS, read_index
from explain.dataset_tools.run_record import RunRecord, read_run_record
from explain.dataset_tools.spray import (
    MEAN_MAP_DECIMALS,
    ClassStrategies,
    Cluster,
    Strategies,
    laplacian_eigenvalues,
    near_objects,
    strategies,
)

OLD_FIELDS = EARLIER_FIELDS  # an index written before the label columns
NEW_FIELDS = FIELDS


def blob(center: tuple[float, float] | np.ndarray, width: float = 4.0, size: int = 64) -> np.ndarray:
    rows, columns = np.mgrid[:size, :size]
    return np.exp(-((rows - center[0]) ** 2 + (columns - center[1]) ** 2) / (2 * width**2))


def two_groups(seed: int = 0, per_group: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Maps peaked at (16, 16) or at (44, 44) plus noise, shuffled: (maps (2n, 64, 64), group (2n,)). (Maps that
    vary continuously, by position or width, form a chain in the neighbour graph, which the eigengap may cut into
    several clusters; noise keeps each group one cluster, so the answer is known.)"""
    rng = np.random.default_rng(seed)
    group = rng.permutation(np.repeat([0, 1], per_group))
    maps = np.stack([blob((16, 16) if g == 0 else (44, 44)) for g in group])
    return maps + rng.uniform(0, 0.05, maps.shape), group


def by_hand_normalised(maps: np.ndarray, factor: int = 2) -> np.ndarray:
    """Area downsampling by an integer factor, negatives to 0, each map to sum 1 (numpy only)."""
    count, height, width = maps.shape
    small = maps.reshape(count, height // factor, factor, width // factor, factor).mean(axis=(2, 4))
    small = np.clip(small, 0, None)
    return small / small.sum(axis=(1, 2), keepdims=True)


def names_of_classes(result: Strategies) -> dict[int, str]:
    """Class index → name, of the analysed and the skipped classes."""
    analysed = {entry.class_index: entry.class_name for entry in result.classes}
    return {**analysed, **{entry.class_index: entry.class_name for entry in result.skipped}}


def members_of(cluster: Cluster) -> set[int]:
    return {int(member) for member in cluster.members}


# Clustering with a known answer.


def test_two_groups_of_maps_give_two_clusters_with_the_right_members_and_nothing_flagged():
    maps, group = two_groups()
    result = strategies(maps, classes=np.zeros(len(maps), int), progress=False)
    (entry,) = result.classes
    assert entry.eigengap_clusters == 2 and len(entry.clusters) == 2
    assert {frozenset(members_of(cluster)) for cluster in entry.clusters} == {
        frozenset(np.flatnonzero(group == 0).tolist()), frozenset(np.flatnonzero(group == 1).tolist())}
    for cluster in entry.clusters:
        expected = 16 / 64 if group[int(cluster.members[0])] == 0 else 44 / 64
        assert cluster.peak == pytest.approx((expected, expected), abs=1 / 32)
        assert not cluster.flagged and cluster.reason == ""


def test_eigenvalues_and_eigengap_equal_a_by_hand_normalised_laplacian(monkeypatch):
    maps, _ = two_groups(seed=3)
    rng = np.random.default_rng(3)
    maps = np.concatenate([maps, np.stack([blob(rng.uniform(10, 54, 2)) for _ in range(25)])])  # a third, spread group
    result = strategies(maps, classes=np.zeros(len(maps), int), neighbors=7, max_clusters=6, progress=False)
    features = by_hand_normalised(maps).reshape(len(maps), -1)
    distances = ((features[:, None] - features[None]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    connectivity = np.zeros_like(distances)
    for row, nearest in enumerate(np.argsort(distances, axis=1)[:, :7]):
        connectivity[row, nearest] = 1
    affinity = (connectivity + connectivity.T) / 2
    scale = 1 / np.sqrt(affinity.sum(1))
    laplacian = np.eye(len(maps)) - scale[:, None] * affinity * scale[None, :]
    eigenvalues = np.linalg.eigvalsh(laplacian)[:7]
    (entry,) = result.classes
    np.testing.assert_allclose(entry.eigenvalues, eigenvalues, atol=1e-8)
    assert entry.eigengap_clusters == int(np.argmax(np.diff(eigenvalues))) + 1
    # The sparse solver used for large classes gives the same eigenvalues.
    from scipy import sparse

    np.testing.assert_allclose(laplacian_eigenvalues(sparse.csr_matrix(affinity), 7), eigenvalues, atol=1e-10)
    monkeypatch.setattr(spray, "DENSE_LIMIT", 0)
    np.testing.assert_allclose(laplacian_eigenvalues(sparse.csr_matrix(affinity), 7), eigenvalues, atol=1e-6)


def test_mean_maps_examples_and_normalisation_match_a_by_hand_computation():
    maps, group = two_groups(seed=5)
    result = strategies(maps, classes=np.zeros(len(maps), int), progress=False)
    normalised = by_hand_normalised(maps)
    for cluster in result.classes[0].clusters:
        members = sorted(members_of(cluster))
        mean = normalised[members].mean(0)
        np.testing.assert_allclose(cluster.mean_map, mean / mean.max(), rtol=1e-5, atol=1e-6)
        distances = ((normalised[members] - mean) ** 2).sum(axis=(1, 2))
        assert [int(member) for member in cluster.examples] == [members[i] for i in np.argsort(distances)[:8]]
        assert cluster.size == len(members) and len(cluster.examples) == 8
    # Sum-1 normalisation: scaling each map by its own factor, or adding negative values, changes nothing.
    factors = np.random.default_rng(0).uniform(0.1, 10, len(maps))[:, None, None]
    negative = np.where(maps < 0.02, -5.0, 0.0)  # clipped to 0 … where the maps are almost 0 anyway
    scaled = strategies(maps * factors, classes=np.zeros(len(maps), int), progress=False)
    shifted = strategies(np.where(negative < 0, negative, maps), classes=np.zeros(len(maps), int), progress=False)
    for other in (scaled, shifted):
        assert [members_of(c) for c in other.classes[0].clusters] == [members_of(c) for c in
                                                                        result.classes[0].clusters]


def objects_and_a_fixed_group(center: tuple[float, float]) -> np.ndarray:
    """50 maps of objects anywhere in the middle (broad, as a CAM's), then 20 maps peaked at ``center`` (narrow,
    noisy): (70, 64, 64)."""
    rng = np.random.default_rng(0)
    objects = [blob(rng.uniform(16, 48, 2), rng.uniform(6, 7)) for _ in range(50)]
    fixed = [blob(center, rng.uniform(2, 3)) + rng.uniform(0, 0.05, (64, 64)) for _ in range(20)]
    return np.stack(objects + fixed)


def check_flags_fall_on_the_fixed_group(entry: ClassStrategies, reason: str) -> None:
    fixed = set(range(50, 70))
    for cluster in entry.clusters:
        share_fixed = len(members_of(cluster) & fixed) / cluster.size
        assert cluster.flagged == (share_fixed > 0.5), (cluster.size, share_fixed, cluster.reason)
        if cluster.flagged:
            assert share_fixed >= 0.8 and reason in cluster.reason
    caught = set().union(*(members_of(c) for c in entry.clusters if c.flagged))
    assert len(caught & fixed) >= 0.9 * len(fixed)  # a map of the group may land in a cluster of objects


def test_a_group_peaked_in_a_corner_is_flagged_and_the_objects_are_not():
    maps = objects_and_a_fixed_group((60, 60))
    result = strategies(maps, classes=np.full(len(maps), 3), class_names=["a", "b", "c", "d"], progress=False)
    (entry,) = result.classes
    assert entry.class_name == "d"
    check_flags_fall_on_the_fixed_group(entry, "border band")
    for cluster in entry.clusters:
        if cluster.flagged:
            assert cluster.border_share >= 0.5 and cluster.peak == pytest.approx((60 / 64, 60 / 64), abs=1 / 32)
    assert [cluster for _, cluster in result.flagged] == [c for c in entry.clusters if c.flagged]


def test_a_group_peaked_at_one_inner_place_is_flagged_against_objects_anywhere():
    maps = objects_and_a_fixed_group((20, 44))
    (entry,) = strategies(maps, classes=np.zeros(len(maps), int), progress=False).classes
    check_flags_fall_on_the_fixed_group(entry, "one place")
    for cluster in entry.clusters:
        if cluster.flagged:
            assert "border" not in cluster.reason and cluster.peak_spread <= 1 / 32
            assert cluster.peak == pytest.approx((20 / 64, 44 / 64), abs=1 / 32)


def test_the_mask_rule_is_the_share_of_relevance_outside_the_objects_by_hand():
    rng = np.random.default_rng(4)
    count, size = 30, 16
    masks = np.zeros((count, size, size), bool)
    maps = np.zeros((count, size, size))
    for i in range(count):
        top, left = rng.integers(2, 10, 2)
        masks[i, top : top + 4, left : left + 4] = True
        maps[i] = rng.uniform(0, 1, (size, size)) * np.where(masks[i], 1.0, 0.05)
        if i >= 20:  # these look at the top-left corner, away from their object
            maps[i, :2, :2] += 3.0
    result = strategies(maps, classes=np.zeros(count, int), size=(size, size), masks=masks, margin=0.0,
                        clusters=2, progress=False)
    normalised = maps / maps.sum(axis=(1, 2), keepdims=True)
    outside = (normalised * ~masks).sum(axis=(1, 2))
    for cluster in result.classes[0].clusters:
        members = sorted(members_of(cluster))
        assert cluster.outside_share == pytest.approx(outside[members].mean(), rel=1e-5)
        assert cluster.flagged == (cluster.outside_share > 0.6)
        assert cluster.flagged == (members[0] >= 20)
    # Boxes are masks of their rectangles.
    rows, columns = np.nonzero(masks[0])
    boxes = np.array([[np.nonzero(m)[1].min(), np.nonzero(m)[0].min(), np.nonzero(m)[1].max(), np.nonzero(m)[0].max()]
                      for m in masks])
    assert (boxes[0] == [columns.min(), rows.min(), columns.max(), rows.max()]).all()
    with_boxes = strategies(maps, classes=np.zeros(count, int), size=(size, size), boxes=boxes, margin=0.0,
                            clusters=2, progress=False)
    assert [c.outside_share for c in with_boxes.classes[0].clusters] == pytest.approx(
        [c.outside_share for c in result.classes[0].clusters])


def test_near_objects_grows_a_mask_by_the_margin():
    mask = np.zeros((1, 16, 16))
    mask[0, 5, 5] = 0.25  # a pixel partly covered counts as touched
    grown = near_objects(mask, 2 / 16)
    expected = np.zeros((16, 16))
    expected[3:8, 3:8] = 1
    np.testing.assert_array_equal(grown[0], expected)
    np.testing.assert_array_equal(near_objects(mask, 0.0)[0], mask[0] > 0)


def test_the_result_is_deterministic_and_clusters_can_be_forced():
    maps, _ = two_groups(seed=7)
    classes = np.zeros(len(maps), int)
    first = strategies(maps, classes=classes, clusters=3, seed=1, progress=False)
    again = strategies(maps, classes=classes, clusters=3, seed=1, progress=False)
    assert [c.members for c in first.classes[0].clusters] == [c.members for c in again.classes[0].clusters]
    assert len(first.classes[0].clusters) == 3 and first.classes[0].eigengap_clusters == 2
    sizes = [c.size for c in first.classes[0].clusters]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == len(maps)
    per_class = strategies(np.concatenate([maps, maps]), classes=np.repeat([0, 1], len(maps)),
                           clusters={1: 1}, progress=False)
    assert [len(entry.clusters) for entry in per_class.classes] == [2, 1]


# The output folder of a batch run.


def write_run(folder: Path, maps: dict[str, np.ndarray], rows: list[dict], fields: list[str]) -> None:
    (folder / "maps").mkdir(parents=True, exist_ok=True)
    for item, stack in maps.items():
        np.save(folder / "maps" / f"{item}.npy", stack.astype(np.float16))
    with open(folder / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fields, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows({field: row.get(field, "") for field in fields} for row in rows)


def contract_rows(maps: np.ndarray) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Each image: its label's map (role "label"); images 0-9 also predicted as class 1 (role "predicted"), and
    every image's third target a "topk" row of class 2, which the strategies leave out."""
    stacks, rows = {}, []
    for index, one in enumerate(maps):
        item = f"img{index:03d}.png-0000abcd"
        targets = [(0, "label"), (2, "topk")] + ([(1, "predicted")] if index < 10 else [])
        stacks[item] = np.stack([np.clip(one, 0, 1) if target == 0 else np.flipud(np.clip(one, 0, 1))
                                 for target, _ in targets])
        for k, (target, role) in enumerate(targets):
            rows.append({"id": item, "image": f"img{index:03d}.png", "target": target, "k": k, "targets": len(targets),
                         "class_name": ["zero", "one", "two"][target], "score": "1", "probability": "0.5",
                         "map": f"maps/{item}.npy", "label": 0, "label_name": "zero",
                         "predicted": 1 if index < 10 else 0, "confidence": "0.9",
                         "correct": "0" if index < 10 else "1", "role": role})
    return stacks, rows


def test_a_folder_is_grouped_by_explained_class_and_strategies_json_follows_the_contract(tmp_path):
    maps, group = two_groups(seed=2)
    stacks, rows = contract_rows(maps)
    write_run(tmp_path, stacks, rows, NEW_FIELDS)
    result = strategies(tmp_path, method="lrp", progress=False)
    assert [entry.class_index for entry in result.classes] == [0]  # class 2 rows are "topk": left out
    assert [(s.class_index, s.class_name, s.images) for s in result.skipped] == [(1, "one", 10)]
    assert "at least 20" in result.skipped[0].reason
    in_memory = strategies(np.clip(maps, 0, 1).astype(np.float16), classes=np.zeros(len(maps), int), progress=False)
    assert [set(c.members) for c in result.classes[0].clusters] == [
        {f"img{int(i):03d}.png-0000abcd" for i in c.members} for c in in_memory.classes[0].clusters]

    written = json.loads((tmp_path / "strategies.json").read_text())
    assert written["method"] == "lrp" and written["map_size"] == [32, 32]
    (entry,) = written["classes"]
    assert {key for key in entry} >= {"class", "class_name", "images", "eigengap_clusters", "clusters"}
    assert (entry["class"], entry["class_name"], entry["images"], entry["eigengap_clusters"]) == (0, "zero", 60, 2)
    for cluster, found in zip(entry["clusters"], result.classes[0].clusters):
        assert set(cluster) >= {"cluster", "size", "mean_map", "mean_map_values", "examples", "flagged", "reason",
                                "peak"}
        assert cluster["mean_map"] == f"strategies/class0_cluster{cluster['cluster']}.png"
        picture = np.asarray(Image.open(tmp_path / cluster["mean_map"]))
        assert picture.shape == (128, 128, 3)
        assert MEAN_MAP_DECIMALS == 2
        np.testing.assert_array_equal(cluster["mean_map_values"], np.round(found.mean_map.astype(float), 2))
        assert cluster["examples"] == found.members[:8] and cluster["size"] == found.size
        assert cluster["peak"] == pytest.approx(list(found.peak), abs=1e-4)
    assert written["skipped"][0]["class"] == 1

    # A second run with fewer clusters removes the first run's extra mean-map files.
    strategies(tmp_path, clusters=1, progress=False)
    assert sorted(path.name for path in (tmp_path / "strategies").iterdir()) == ["class0_cluster0.png"]


def test_an_index_written_before_the_label_columns_groups_every_row_by_target(tmp_path):
    maps, _ = two_groups(seed=2)
    stacks, rows = contract_rows(maps)
    write_run(tmp_path, stacks, rows, OLD_FIELDS)
    result = strategies(tmp_path, progress=False, out=tmp_path / "elsewhere")
    assert [(entry.class_index, entry.images) for entry in result.classes] == [(0, 60), (2, 60)]
    assert (tmp_path / "elsewhere" / "strategies.json").is_file() and not (tmp_path / "strategies.json").exists()
    assert result.method == "unspecified" and result.notes == []
    with open(tmp_path / "index.csv", "a", newline="", encoding="utf-8") as file:  # an image torn by a kill
        file.write(f"extra,extra.png,0,0,2,zero,1,0.5,{rows[0]['map']}\r\n")
    torn = strategies(tmp_path, progress=False, out=tmp_path / "elsewhere")
    assert [(entry.class_index, entry.images) for entry in torn.classes] == [(0, 60), (2, 60)]
    assert torn.notes == ["1 image(s) whose index rows are incomplete (a run in progress, a line torn by a kill) were "
                          "left out, e.g. extra."]
    record = RunRecord("gradcam", "GradCAM", ["null", "eins", "zwei"], {"mode": "predicted"}, "none")
    (tmp_path / "run.json").write_text(record.to_text())
    from_index = strategies(tmp_path / "index.csv", progress=False, out=tmp_path / "elsewhere")  # the index itself
    assert from_index.method == "gradcam" and [e.images for e in from_index.classes] == [60, 60]
    assert [e.class_name for e in from_index.classes] == ["zero", "two"]  # the index's names come first
    unregistered = RunRecord("", "MyMethod", None, {"mode": "predicted"}, "none")
    (tmp_path / "run.json").write_text(unregistered.to_text())
    assert strategies(tmp_path, progress=False, out=tmp_path / "elsewhere").method == "MyMethod"
    (tmp_path / "run.json").write_text('{"method": "gradcam"}')  # not a run record: a note, and no method
    broken_record = strategies(tmp_path, progress=False, out=tmp_path / "elsewhere")
    assert broken_record.method == "unspecified"
    assert any("run.json is not a run record" in note and "not used" in note for note in broken_record.notes)


def test_bad_folders_and_maps_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="index.csv"):
        strategies(tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="no folder"):
        strategies(tmp_path / "missing", progress=False)
    (tmp_path / "index.csv").write_text(",".join(NEW_FIELDS) + "\r\n")
    with pytest.raises(ValueError, match="no rows"):
        strategies(tmp_path, progress=False)
    (tmp_path / "index.csv").write_text("id,target,k,map\r\na,0,0,maps/a.npy\r\n")
    with pytest.raises(ValueError, match="not an index written by explain.*image, targets"):
        strategies(tmp_path, progress=False)

    maps, group = two_groups(seed=2)
    stacks, rows = contract_rows(maps)
    odd = tmp_path / "odd"
    stacks[rows[-1]["id"]] = np.zeros((2, 32, 32))
    write_run(odd, stacks, rows, NEW_FIELDS)
    with pytest.raises(ValueError, match="different sizes.*--size"):
        strategies(odd, progress=False)

    broken = tmp_path / "broken"
    stacks, rows = contract_rows(maps)
    rows[3]["map"] = "../odd/maps/" + Path(rows[3]["map"]).name  # image 1's label row: a file outside the folder
    write_run(broken, stacks, rows, NEW_FIELDS)
    (broken / rows[-1]["map"]).unlink()  # image 59
    (broken / rows[0]["map"]).write_bytes(b"not an array")  # image 0: its label and predicted rows
    result = strategies(broken, progress=False)
    assert result.classes[0].images == 57
    assert any("3 map file(s) could not be read" in note for note in result.notes), result.notes

    topk_only = tmp_path / "topk"
    stacks, rows = contract_rows(maps)
    torn = [row for row in rows if row["role"] == "topk"]  # each row k = 1 of targets = 2 or 3: no image complete
    write_run(topk_only, stacks, torn, NEW_FIELDS)
    with pytest.raises(ValueError, match="no complete image.*all its 60 image"):
        strategies(topk_only, progress=False)
    stacks = {item: stack[1:2] for item, stack in stacks.items()}  # the topk map alone
    write_run(topk_only, stacks, [dict(row, k=0, targets=1) for row in torn], NEW_FIELDS)
    with pytest.raises(ValueError, match="role.*topk.*roles="):
        strategies(topk_only, progress=False)
    assert strategies(topk_only, roles=("topk",), progress=False).classes[0].class_index == 2


def test_bad_arrays_and_options_get_clear_errors():
    maps, _ = two_groups()
    classes = np.zeros(len(maps), int)
    cases = [
        (dict(source=maps[0], classes=classes), "maps must be \\(N, H, W\\)"),
        (dict(source=maps), "give classes="),
        (dict(source=maps, classes=classes[:5]), "classes must be"),
        (dict(source=maps, classes=classes.astype(float)), "classes must be"),
        (dict(source=maps[:0], classes=classes[:0]), "no maps"),
        (dict(source=maps, classes=classes, ids=["a"] * len(maps)), "distinct"),
        (dict(source=maps, classes=classes, clusters=0), "clusters must be"),
        (dict(source=maps, classes=classes, clusters=len(maps) + 1), "has only 60 maps"),
        (dict(source=maps, classes=classes, masks=np.zeros((len(maps), 32, 32), bool)), "masks must be one"),
        (dict(source=maps, classes=classes, masks=np.zeros(maps.shape, bool), boxes=np.zeros((60, 4))), "not both"),
        (dict(source=maps, classes=classes, boxes=np.tile([5, 5, 2, 9], (60, 1))), "x0 ≤ x1"),
        (dict(source=maps, classes=classes, boxes=np.tile([5, 5, 70, 9], (60, 1))), "x0 ≤ x1"),
        (dict(source=maps, classes=classes, size=(2, 2)), "size must be"),
        (dict(source=maps, classes=classes, border=0.6), "border"),
        (dict(source=maps, classes=classes, outside_threshold=1.5), "outside_threshold"),
        (dict(source=maps, classes=classes, min_images=1), "min_images"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            strategies(**arguments, progress=False)


def test_a_class_with_too_few_maps_is_skipped_with_a_note_and_the_others_analysed():
    maps, _ = two_groups()
    classes = np.zeros(len(maps), int)
    classes[:4] = 7
    result = strategies(maps, classes=classes, class_names=None, progress=False)
    assert [entry.class_index for entry in result.classes] == [0]
    (skipped,) = result.skipped
    assert (skipped.class_index, skipped.images) == (7, 4)
    assert "at least 20" in skipped.reason and "min_images" in skipped.reason
    everything_small = strategies(maps[:10], classes=classes[:10] * 0, progress=False)
    assert everything_small.classes == [] and everything_small.skipped[0].images == 10


# The watermark data and demo model.


def test_the_watermark_is_a_checkerboard_in_its_corner_and_nothing_else_changes():
    images = make_dataset(6, seed=1).images
    stamped = np.array([True, False, True, False, False, True])
    marked = add_watermark(images, stamped, "top-right")
    x0, y0, x1, y1 = watermark_box("top-right")
    assert (x0, y0, x1, y1) == (64 - 2 - WATERMARK_SIZE, 2, 64 - 3, 2 + WATERMARK_SIZE - 1)
    squares = np.arange(WATERMARK_SIZE) // 2
    expected = np.where(((squares[:, None] + squares[None, :]) % 2 == 0)[..., None], 255, 0)
    for index in range(6):
        inside = marked[index, y0 : y1 + 1, x0 : x1 + 1]
        np.testing.assert_array_equal(inside, np.broadcast_to(expected, inside.shape) if stamped[index]
                                      else images[index, y0 : y1 + 1, x0 : x1 + 1])
        outside = marked[index].copy()
        outside[y0 : y1 + 1, x0 : x1 + 1] = images[index, y0 : y1 + 1, x0 : x1 + 1]
        np.testing.assert_array_equal(outside, images[index])
    assert watermark_box("bottom-left") == (2, 56, 7, 61)
    with pytest.raises(ValueError, match="corner must be one of"):
        watermark_box("middle")
    with pytest.raises(ValueError, match="uint8"):
        add_watermark(images.astype(float))


def test_the_watermark_dataset_tags_the_share_of_one_class_only():
    data = make_watermark_dataset(200, seed=4, watermarked_class=2, share=0.8, corner="top-left")
    members = data.labels == 2
    assert data.watermarked.sum() == round(0.8 * members.sum()) and not data.watermarked[~members].any()
    plain = make_dataset(200, seed=4)
    np.testing.assert_array_equal(data.clean_images, plain.images)
    np.testing.assert_array_equal(data.clean().images, plain.images)
    np.testing.assert_array_equal(data.images, add_watermark(plain.images, data.watermarked, "top-left"))
    with pytest.raises(ValueError, match="share"):
        make_watermark_dataset(10, seed=0, share=1.5)
    with pytest.raises(ValueError, match="class index"):
        make_watermark_dataset(10, seed=0, watermarked_class=4)


def test_the_shipped_watermark_model_relies_on_the_watermark():
    use = measure_watermark_use(load_watermark_demo())
    assert use.tagged_accuracy >= 0.85 and use.clean_accuracy_others >= 0.95
    assert use.clean_accuracy <= use.tagged_accuracy - 0.4  # shipped weights: 0.900 as held out, 0.324 without tag
    assert use.flipped_by_tag >= 0.5  # the tag alone makes most other images a "square"


@pytest.fixture(scope="module")
def watermark_maps() -> tuple[np.ndarray, object]:
    data = watermark_held_out(200)
    explainer = explain.LRP(load_watermark_demo())
    maps = explainer.explain(to_model_input(data.images), target=torch.from_numpy(data.labels)).maps.numpy()
    return maps, data


@pytest.mark.parametrize("with_masks", [False, True])
def test_strategies_flag_the_watermark_cluster_and_no_clean_class(watermark_maps, with_masks):
    maps, data = watermark_maps
    result = strategies(maps, classes=data.labels, class_names=CLASS_NAMES, method="lrp", progress=False,
                        masks=data.masks if with_masks else None)
    x0, y0, x1, y1 = watermark_box(CORNER)
    assert [entry.class_index for entry in result.classes] == [0, 1, 2, 3]
    for entry in result.classes:
        flagged = [cluster for cluster in entry.clusters if cluster.flagged]
        if entry.class_index != WATERMARKED_CLASS:
            assert flagged == [], (entry.class_name, [c.reason for c in flagged])
            continue
        assert flagged
        for cluster in flagged:
            assert data.watermarked[[int(member) for member in cluster.members]].mean() >= 0.9
            assert y0 / 64 <= cluster.peak[0] <= (y1 + 1) / 64 and x0 / 64 <= cluster.peak[1] <= (x1 + 1) / 64
        caught = set().union(*(members_of(cluster) for cluster in flagged))
        tagged = set(np.flatnonzero(data.watermarked).tolist())
        assert len(caught & tagged) >= 0.9 * len(tagged)
    assert 0.8 <= SHARE <= 0.9


def test_write_watermark_folder_writes_the_held_out_images_in_imagefolder_layout(tmp_path):
    folder = write_watermark_folder(tmp_path / "held-out", count=24)
    data = watermark_held_out(24)
    for index, label in enumerate(data.labels):
        written = np.asarray(Image.open(folder / CLASS_NAMES[label] / f"{index:05d}.png"))
        np.testing.assert_array_equal(written, data.images[index])
    assert sorted(path.name for path in folder.iterdir()) == sorted(CLASS_NAMES)
    assert sum(len(list((folder / name).iterdir())) for name in CLASS_NAMES) == 24
    clean = write_watermark_folder(tmp_path / "clean", count=24, clean=True)
    first_tagged = int(np.flatnonzero(data.watermarked)[0])
    written = np.asarray(Image.open(clean / CLASS_NAMES[WATERMARKED_CLASS] / f"{first_tagged:05d}.png"))
    np.testing.assert_array_equal(written, data.clean_images[first_tagged])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        write_watermark_folder(tmp_path / "file")


def test_strategies_read_a_real_batch_run(tmp_path):
    folder = write_watermark_folder(tmp_path / "images", count=80)
    model = load_watermark_demo()
    summary = explain.run(explain.GradCAM(model, "layer4"), folder, tmp_path / "out", progress=False)
    assert summary.explained == 80
    result = strategies(tmp_path / "out", method="gradcam", min_images=10, progress=False)
    rows = [row for row in read_index(tmp_path / "out" / "index.csv") if row["role"] in ("predicted", "label")]
    per_class: dict[int, set[str]] = {}
    for row in rows:
        per_class.setdefault(int(row["target"]), set()).add(row["id"])
    analysed = {entry.class_index: set().union(*(set(c.members) for c in entry.clusters)) for entry in result.classes}
    analysed.update({entry.class_index: set(range(entry.images)) for entry in result.skipped})
    assert {index: len(ids) for index, ids in analysed.items()} == {index: len(ids) for index, ids in per_class.items()}
    for entry in result.classes:
        assert analysed[entry.class_index] == per_class[entry.class_index]
    assert (tmp_path / "out" / "strategies.json").is_file()


def test_a_run_with_folder_labels_gives_its_method_and_class_names_through_run_json(tmp_path):
    folder = write_watermark_folder(tmp_path / "images", count=60)
    explainer = explain.GradCAM(load_watermark_demo(), "layer4", class_names=CLASS_NAMES)
    explain.run(explainer, folder, tmp_path / "out", labels="folders", progress=False)
    record = read_run_record(tmp_path / "out")
    assert record is not None and (record.method, record.class_names) == ("gradcam", list(CLASS_NAMES))
    result = strategies(tmp_path / "out", min_images=5, progress=False)  # no method=: run.json's
    assert result.method == "gradcam"
    assert json.loads((tmp_path / "out" / "strategies.json").read_text())["method"] == "gradcam"
    rows = read_index(tmp_path / "out" / "index.csv")
    explained = sorted({int(row["target"]) for row in rows if row["role"] in ("label", "predicted")})
    named = names_of_classes(result)
    assert result.classes and sorted(named) == explained
    assert named == {index: CLASS_NAMES[index] for index in explained}

    # An index without class names (a model without them, labels by index): the names come from run.json.
    with open(tmp_path / "out" / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(dict(row, class_name="", label_name="", predicted_name="") for row in rows)
    unnamed = strategies(tmp_path / "out", min_images=5, progress=False)
    assert names_of_classes(unnamed) == named
    # Without run.json (a run of an earlier version): no method, no names, the same clusters.
    (tmp_path / "out" / "run.json").unlink()
    bare = strategies(tmp_path / "out", min_images=5, progress=False)
    assert bare.method == "unspecified" and {entry.class_name for entry in bare.classes} == {""}
    assert [[c.members for c in entry.clusters] for entry in bare.classes] == [
        [c.members for c in entry.clusters] for entry in result.classes]
