"""The static HTML report of a batch run (explain.dataset_tools.html_report): figures checked against counts made by
hand from the data the test writes, files and escaping checked on disk, and the page checked in
headless Chromium from a file:// address with the network blocked."""

from __future__ import annotations

import csv
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from conftest import offline_page
from PIL import Image

from explain.dataset_tools.html_report import default_order, main_report, read_run_index, report, summarise
from explain.dataset_tools.index import EARLIER_FIELDS, LABEL_FIELDS
from explain.io import render

HOSTILE = "<script>window.__pwned = 1</script>"
QUOTED = 'a "quoted" & <img src=x onerror="window.__pwned = 2">'
CLASS_NAMES = ["cat", "dog", HOSTILE, QUOTED]
SHOTS = Path("/tmp/report-shots")


@dataclass
class Truth:
    """What the test wrote for one image."""

    id: str
    image: str
    label: Optional[int]
    predicted: int
    confidence: float
    targets: list[int]


def write_run(out: Path, count: int, *, label_columns: bool = True, targets: int = 1, seed: int = 0,
              overlays_every: int = 5, size: int = 32, caption_band: int = 0, panel_scale: int = 1) -> list[Truth]:
    """A batch output folder as explain batch writes it: images/, maps/<id>.npy (K, H, W) float16,
    overlays/<id>.png (K panels side by side, each enlarged ``panel_scale`` times, under a dark
    caption band of ``caption_band`` pixels; left out for every ``overlays_every``-th image so
    that thumbnails come from the maps too) and index.csv (CRLF), with or without the label columns.
    Every 7th image has no label; 70 % of the others are predicted right."""
    rng = np.random.default_rng(seed)
    images = out.parent / f"{out.name}-images"
    for folder in (out / "maps", out / "overlays", images):
        folder.mkdir(parents=True, exist_ok=True)
    truths: list[Truth] = []
    rows = []
    for position in range(count):
        label = int(rng.integers(len(CLASS_NAMES)))
        predicted = label if rng.random() < 0.7 else int((label + rng.integers(1, len(CLASS_NAMES))) % len(CLASS_NAMES))
        confidence = float(np.round(rng.uniform(0.05, 1.0), 4))
        explained = [predicted] + [(predicted + k) % len(CLASS_NAMES) for k in range(1, targets)]
        image_id = f"img_{position:04d}-{position * 7919 % 100000:08x}"
        picture = np.full((size, size, 3), 40 + 50 * label, np.uint8)
        picture[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = rng.integers(0, 255, 3, dtype=np.uint8)
        image_path = images / f"img {position:04d}.png"  # a space in the name, as users have
        Image.fromarray(picture).save(image_path)
        yy, xx = np.mgrid[0:size, 0:size] / size
        maps = np.stack([np.exp(-((yy - rng.random()) ** 2 + (xx - rng.random()) ** 2) * 8) for _ in explained])
        np.save(out / "maps" / f"{image_id}.npy", maps.astype(np.float16))
        if position % overlays_every:
            panels = render.overlay(picture, maps).repeat(panel_scale, axis=1).repeat(panel_scale, axis=2)
            tiles = np.concatenate(list(panels), axis=1)
            band = np.full((caption_band, tiles.shape[1], 3), 24, np.uint8)
            band[caption_band // 3 : caption_band // 2, :: 3] = 255  # a line of "text"
            Image.fromarray(np.concatenate([band, tiles])).save(out / "overlays" / f"{image_id}.png")
        unlabelled = position % 7 == 3
        truth = Truth(image_id, str(image_path), None if unlabelled else label, predicted, confidence, explained)
        truths.append(truth)
        for k, target in enumerate(explained):
            row = {"id": image_id, "image": str(image_path), "target": target, "k": k, "targets": len(explained),
                   "class_name": CLASS_NAMES[target], "score": f"{10 * rng.random():.6g}",
                   "probability": f"{confidence if k == 0 else rng.random() / 10:.6g}",
                   "map": f"maps/{image_id}.npy"}
            if label_columns:
                row.update({"label": "" if unlabelled else label,
                            "label_name": "" if unlabelled else CLASS_NAMES[label],
                            "predicted": predicted, "predicted_name": CLASS_NAMES[predicted],
                            "confidence": repr(confidence),
                            "correct": "" if unlabelled else str(int(label == predicted)),
                            "role": "predicted" if k == 0 else "topk"})
            rows.append(row)
    with open(out / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=EARLIER_FIELDS + (LABEL_FIELDS if label_columns else []),
                                lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
    return truths


def write_strategies(out: Path, truths: list[Truth]) -> dict:
    """OUT/strategies.json in the contract's format: two classes, one flagged cluster whose mean map
    PNG is missing (drawn from its values), a reason with HTML characters."""
    (out / "strategies").mkdir(exist_ok=True)
    Image.fromarray((np.random.default_rng(1).random((24, 24, 3)) * 255).astype(np.uint8)).save(
        out / "strategies" / "cat-0.png")
    of_class = {c: [t.id for t in truths if t.predicted == c] for c in range(len(CLASS_NAMES))}
    data = {
        "method": "gradcam", "map_size": [8, 8],
        "classes": [
            {"class": 0, "class_name": "cat", "images": len(of_class[0]), "eigengap_clusters": 1,
             "clusters": [{"cluster": 0, "size": len(of_class[0]), "mean_map": "strategies/cat-0.png",
                           "mean_map_values": np.full((8, 8), 0.5).tolist(), "examples": of_class[0][:8],
                           "flagged": False, "reason": "", "peak": [0.5, 0.5]}]},
            {"class": 2, "class_name": HOSTILE, "images": len(of_class[2]), "eigengap_clusters": 2,
             "clusters": [{"cluster": 0, "size": len(of_class[2]) - 3, "mean_map": "strategies/missing.png",
                           "mean_map_values": np.eye(8).tolist(), "examples": of_class[2][:8], "flagged": False,
                           "reason": "", "peak": [0.1, 0.9]},
                          {"cluster": 1, "size": 3, "mean_map": "strategies/missing-too.png",
                           "mean_map_values": np.ones((8, 8)).tolist(), "examples": of_class[2][:3] + ["not-an-id"],
                           "flagged": True, "reason": "looks at the corner <b>watermark</b>", "peak": [0.95, 0.95]}]},
        ],
    }
    (out / "strategies.json").write_text(json.dumps(data))
    return data


# ---- Reading and figures ---------------------------------------------------------------------

def test_the_figures_match_a_count_by_hand(tmp_path):
    truths = write_run(tmp_path / "out", 90, targets=2)
    run = read_run_index(tmp_path / "out")
    assert run.has_label_columns and len(run.images) == 90
    assert run.class_names == dict(enumerate(CLASS_NAMES))
    summary = summarise(run.images, low_confidence=0.5)
    labelled = [t for t in truths if t.label is not None]
    assert summary.labelled == len(labelled)
    assert summary.correct == sum(t.label == t.predicted for t in labelled)
    assert summary.misclassified == sum(t.label != t.predicted for t in labelled)
    assert summary.low_confidence == sum(t.confidence < 0.5 for t in truths)
    for truth_class in range(len(CLASS_NAMES)):
        for predicted_class in range(len(CLASS_NAMES)):
            expected = sum(t.label == truth_class and t.predicted == predicted_class for t in labelled)
            assert summary.confusion.get((truth_class, predicted_class), 0) == expected
    rows = {row.class_index: row for row in summary.classes}
    for c in range(len(CLASS_NAMES)):
        of_class = [t for t in labelled if t.label == c]
        assert rows[c].labelled == len(of_class)
        assert rows[c].accuracy == pytest.approx(sum(t.predicted == c for t in of_class) / len(of_class))
        predicted_as = [t for t in labelled if t.predicted == c]
        assert rows[c].precision == pytest.approx(sum(t.label == c for t in predicted_as) / len(predicted_as))
        mistakes = {other: sum(t.predicted == other for t in of_class)
                    for other in range(len(CLASS_NAMES)) if other != c}
        most = max(mistakes.values())
        assert rows[c].confused_with == (min(o for o, n in mistakes.items() if n == most), most)
        confidences = [t.confidence for t in truths if t.predicted == c]
        assert rows[c].mean_confidence == pytest.approx(sum(confidences) / len(confidences))
    record = next(r for r in run.images if r.id == truths[5].id)
    assert [target.class_index for target in record.targets] == truths[5].targets
    assert [target.role for target in record.targets] == ["predicted", "topk"]


def test_misclassified_come_first_most_confident_first_then_the_least_confident(tmp_path):
    truths = write_run(tmp_path / "out", 60)
    ordered = default_order(read_run_index(tmp_path / "out").images)
    wrong = sorted((t for t in truths if t.label is not None and t.label != t.predicted), key=lambda t: -t.confidence)
    rest = sorted((t for t in truths if t.label is None or t.label == t.predicted), key=lambda t: t.confidence)
    assert [record.id for record in ordered] == [t.id for t in wrong + rest]


def test_an_index_without_the_label_columns_is_read_with_them_empty(tmp_path):
    write_run(tmp_path / "out", 20, label_columns=False)
    run = read_run_index(tmp_path / "out")
    assert not run.has_label_columns and len(run.images) == 20
    assert all(r.label is None and r.predicted is None and r.confidence is None and r.correct is None
               for r in run.images)
    assert run.notes == []
    summary = summarise(run.images)
    assert summary.labelled == 0 and summary.accuracy is None and summary.confusion == {}
    page = report(tmp_path / "out").page.read_text()
    assert "older explain" in page
    assert 'id="confusion"' not in page and 'id="filter-explained"' in page and 'id="filter-label"' not in page


# ---- Files and escaping --------------------------------------------------------------------------

def data_files(out: Path) -> list[Path]:
    (folder,) = [path for path in (out / "report").glob("data-*")]
    return sorted(folder.iterdir())


def test_every_text_from_the_run_is_escaped_in_the_page_and_data(tmp_path):
    truths = write_run(tmp_path / "out", 40)
    write_strategies(tmp_path / "out", truths)
    page = report(tmp_path / "out").page.read_text()
    for name in (HOSTILE, QUOTED, "<b>watermark</b>"):
        assert name not in page
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in page
    assert "&quot;quoted&quot; &amp; &lt;img" in page
    scripts = re.findall(r"<script[^>]*>", page)
    assert scripts == ['<script type="application/json" id="report-meta">',
                       '<script src="report/report.js" charset="utf-8">']
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', page, re.S).group(1))
    assert meta["classes"] == [[index, name] for index, name in enumerate(CLASS_NAMES)]
    # each data file is one call with a JSON argument: the names come back exactly, as data
    chunk = data_files(tmp_path / "out")[0].read_text()
    call = re.fullmatch(r"explainReport\.addChunk\(0, (.*)\);\n", chunk, re.S)
    records = json.loads(call.group(1))
    assert {target["name"] for record in records for target in record["targets"]} <= set(CLASS_NAMES)


def test_the_page_holds_no_per_image_data(tmp_path):
    truths = write_run(tmp_path / "large", 600, overlays_every=1000)
    page = report(tmp_path / "large", chunk_size=100).page.read_text()
    assert len(page.encode()) < 30_000
    assert not any(t.id in page or Path(t.image).name in page for t in truths)
    chunks = [path for path in data_files(tmp_path / "large") if path.name.startswith("chunk-")]
    assert len(chunks) == 6
    thumbs = list((tmp_path / "large" / "report").glob("thumbs-160/*/*.jpg"))
    assert len(thumbs) == 600
    with Image.open(thumbs[0]) as thumb:
        assert thumb.format == "JPEG" and max(thumb.size) <= 160


def test_regenerating_reuses_thumbnails_and_redoes_those_whose_overlay_changed(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 30, targets=2)
    first = report(out)
    assert (first.thumbnails_made, first.thumbnails_reused) == (60, 0)
    second = report(out)
    assert (second.thumbnails_made, second.thumbnails_reused) == (0, 60)
    assert len(list((out / "report").glob("data-*"))) == 1  # the earlier data folder is gone
    overlay = out / "overlays" / f"{truths[1].id}.png"
    later = time.time() + 5
    os.utime(overlay, (later, later))
    third = report(out)
    assert (third.thumbnails_made, third.thumbnails_reused) == (2, 58)
    assert len(list((out / "report").glob("thumbs-160/*/*.jpg"))) == 60
    report(out, thumbnail_size=64)
    assert not (out / "report" / "thumbs-160").exists()
    assert len(list((out / "report").glob("thumbs-64/*/*.jpg"))) == 60


def test_an_interrupted_report_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_run(out, 30)
    report(out, chunk_size=10)
    (old_data,) = (out / "report").glob("data-*")
    old_page = (out / "report.html").read_text()
    from explain.dataset_tools import html_report as report_module

    written = []
    original = report_module._write_script

    def interrupted(path, function, *arguments):
        if len(written) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the data files are written
        written.append(path)
        original(path, function, *arguments)

    monkeypatch.setattr(report_module, "_write_script", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report(out, chunk_size=10)
    assert (out / "report.html").read_text() == old_page  # the page still reads its own, complete data
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', old_page, re.S).group(1))
    assert (out / meta["dataFolder"]).resolve() == old_data.resolve()
    assert sorted(path.name for path in old_data.iterdir()) == ["chunk-00000.js", "chunk-00001.js", "chunk-00002.js",
                                                                 "keys-0000.js"]
    monkeypatch.setattr(report_module, "_write_script", original)
    report(out, chunk_size=10)
    assert len(list((out / "report").glob("data-*"))) == 1  # the run after removes both earlier folders


def test_a_thumbnail_leaves_out_the_caption_band_of_the_overlay(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 2, targets=2, size=40, caption_band=30, panel_scale=3)
    report(out, thumbnail_size=120)
    (record,) = [r for r in chunk_records(out) if r["id"] == truths[1].id]
    with Image.open(out / "overlays" / f"{truths[1].id}.png") as opened:
        overlay = np.asarray(opened.convert("RGB"), dtype=float)
    assert overlay.shape == (30 + 120, 2 * 120, 3)
    for k in range(2):
        with Image.open(out / record["targets"][k]["thumb"]) as thumb:
            pixels = np.asarray(thumb.convert("RGB"), dtype=float)
        assert pixels.shape == (120, 120, 3)  # the panel, square as the image, without the band
        assert np.abs(pixels - overlay[30:, 120 * k : 120 * (k + 1)]).mean() < 6


def chunk_records(out: Path) -> list[dict]:
    """The image records of the report's data files."""
    records = []
    for path in data_files(out):
        if path.name.startswith("chunk-"):
            records += json.loads(re.fullmatch(r"explainReport\.addChunk\(\d+, (.*)\);\n", path.read_text(),
                                               re.S).group(1))
    return records


def test_odd_ids_get_safe_thumbnail_names_and_encoded_addresses(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 3)
    odd = "odd #1 %41 ü?.png-0000"
    rename_image(out, truths[1].id, odd)
    report(out)
    records = {record["id"]: record for record in chunk_records(out)}
    assert records[odd]["overlay"] == "overlays/odd%20%231%20%2541%20%C3%BC%3F.png-0000.png"
    thumb = records[odd]["targets"][0]["thumb"]
    assert re.fullmatch(r"report/thumbs-160/[0-9a-f]{2}/odd__1__41___.png-0000-[0-9a-f]{8}-0\.jpg", thumb)
    assert (out / thumb).is_file()


def rename_image(out: Path, old: str, new: str) -> None:
    """Give an image another id: its index rows, maps and overlay files."""
    (out / "maps" / f"{old}.npy").rename(out / "maps" / f"{new}.npy")
    (out / "overlays" / f"{old}.png").rename(out / "overlays" / f"{new}.png")
    index = (out / "index.csv").read_text(encoding="utf-8")
    quoted = '"' + new.replace('"', '""') + '"'
    index = index.replace(f"{old},", f"{quoted},").replace(f"maps/{old}.npy", f'"maps/{new}.npy"')
    (out / "index.csv").write_text(index, encoding="utf-8")


def test_a_thumbnail_shows_its_panel_of_the_overlay_or_its_map(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 6, targets=3, size=48)
    Path(truths[5].image).unlink()  # image 5 has no overlay and now no source image: its maps alone
    report(out)
    records = {record["id"]: record for record in chunk_records(out)}
    truth = truths[1]  # image 1 has an overlay
    with Image.open(out / "overlays" / f"{truth.id}.png") as opened:
        overlay = np.asarray(opened.convert("RGB"), dtype=float)
    for k in range(3):
        thumb_url = records[truth.id]["targets"][k]["thumb"]
        with Image.open(out / thumb_url) as thumb:
            pixels = np.asarray(thumb.convert("RGB"), dtype=float)
        panel = overlay[:, 48 * k : 48 * (k + 1)]
        assert pixels.shape == panel.shape
        assert np.abs(pixels - panel).mean() < 6  # the same picture, up to JPEG's loss
        others = [overlay[:, 48 * j : 48 * (j + 1)] for j in range(3) if j != k]
        assert all(np.abs(pixels - other).mean() > np.abs(pixels - panel).mean() for other in others)
    # image 0 has no overlay: its thumbnails are its maps drawn on the source image
    record = records[truths[0].id]
    maps = np.load(out / "maps" / f"{truths[0].id}.npy").astype(np.float32)
    source = np.array(Image.open(truths[0].image).convert("RGB"))
    for k in range(3):
        with Image.open(out / record["targets"][k]["thumb"]) as thumb:
            pixels = np.asarray(thumb.convert("RGB"), dtype=float)
        assert np.abs(pixels - render.overlay(source, maps[k]).astype(float)).mean() < 6
    assert record["overlay"] is None and records[truth.id]["overlay"] == f"overlays/{truth.id}.png"
    maps = np.load(out / "maps" / f"{truths[5].id}.npy").astype(np.float32)
    for k in range(3):
        with Image.open(out / records[truths[5].id]["targets"][k]["thumb"]) as thumb:
            pixels = np.asarray(thumb.convert("RGB"), dtype=float)
        assert np.abs(pixels - 255 * render.colorize(maps[k]).numpy()).mean() < 6
    assert records[truths[5].id]["source"] is None
    assert records[truths[0].id]["source"] == "../out-images/img%200000.png"  # relative to the page, URL-encoded


# ---- Bad input -----------------------------------------------------------------------------------

def test_bad_folders_and_options_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder"):
        report(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="explain batch"):
        report(tmp_path / "empty")
    (tmp_path / "empty" / "index.rank0.csv").write_text("")
    with pytest.raises(FileNotFoundError, match="merge_shard_indexes"):
        report(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "index.csv").write_text("name,value\r\na,1\r\n")
    with pytest.raises(ValueError, match="lacks the column"):
        report(tmp_path / "other")
    write_run(tmp_path / "out", 3)
    for options, message in [({"page_size": 0}, "page_size"), ({"thumbnail_size": 5}, "thumbnail_size"),
                             ({"low_confidence": 1.5}, "low_confidence"), ({"chunk_size": 0}, "chunk_size")]:
        with pytest.raises(ValueError, match=message):
            report(tmp_path / "out", **options)
    (tmp_path / "out" / "report").write_text("in the way")
    with pytest.raises(ValueError, match="is a file"):
        report(tmp_path / "out")


def test_broken_and_hostile_files_are_left_out_with_a_note(tmp_path):
    out = tmp_path / "out"
    truths = write_run(out, 12)
    (out / "overlays" / f"{truths[1].id}.png").write_bytes(b"not a png")  # falls back to the maps
    (out / "maps" / f"{truths[5].id}.npy").write_bytes(b"garbage")  # no overlay (5 % 5 == 0): no picture
    secret = tmp_path / "secret.npy"
    np.save(secret, np.ones((1, 4, 4), np.float16))
    index = (out / "index.csv").read_text(encoding="utf-8")
    index = index.replace(f"maps/{truths[10].id}.npy", "../secret.npy")  # outside OUT: never read
    index += f"{truths[11].id}-torn,x,0,0,2,cat,1"  # a torn last line, of an image with 2 rows
    (out / "index.csv").write_text(index, encoding="utf-8")
    (out / "strategies.json").write_text("{not json")
    with pytest.warns(UserWarning, match="leaves things out") as warned:
        result = report(out)
    assert len(warned) == 1 and "incomplete rows" in str(warned[0].message)  # the first note
    assert result.images == 12
    notes = " ".join(result.notes)
    assert "incomplete rows" in notes and "-torn" in notes
    assert "no readable overlay or map" in notes and truths[5].id in notes and truths[10].id in notes
    assert truths[1].id not in notes
    assert "strategies.json could not be read" in notes
    page = result.page.read_text()
    assert 'id="notes"' in page and 'id="strategies"' not in page


def test_the_command_writes_the_report_or_says_what_is_wrong(tmp_path, capsys):
    write_run(tmp_path / "out", 5)
    assert main_report([str(tmp_path / "out"), "--page-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert "5 image(s)" in printed and "file://" in printed
    assert '"pageSize":2' in (tmp_path / "out" / "report.html").read_text()
    assert main_report([str(tmp_path / "missing")]) == 2
    assert "no folder" in capsys.readouterr().err


# ---- In a browser ----------------------------------------------------------------------------------



@pytest.fixture
def browser_page(chromium):
    """A page with every request that is not file:// aborted, the list of those requests, and the
    page's errors. The page's Content-Security-Policy is bypassed, so that the checks that nothing
    injected runs hold by escaping alone (and so that wait_for_function may evaluate its test)."""
    context, page, blocked, errors = offline_page(chromium, viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    yield page, blocked, errors
    context.close()


def wait_for_render(page, before: int) -> None:
    page.wait_for_function(f"Number(document.getElementById('gallery').dataset.render || 0) > {before} && "
                           "document.getElementById('gallery').dataset.state === 'ready'")
    page.wait_for_function("[...document.images].every(image => image.complete)")


def render_count(page) -> int:
    return int(page.eval_on_selector("#gallery", "gallery => gallery.dataset.render || 0"))


def shown_cards(page) -> list[dict]:
    return page.eval_on_selector_all("#gallery .card", """cards => cards.map(card => ({
        id: card.dataset.id, label: card.dataset.label, predicted: card.dataset.predicted,
        confidence: card.dataset.confidence, correct: card.dataset.correct,
        text: card.innerText}))""")


def broken_images(page) -> list[str]:
    return page.eval_on_selector_all("img", "images => images.filter(i => !(i.complete && i.naturalWidth > 0))"
                                     ".map(i => i.getAttribute('src'))")


def test_the_report_in_a_browser(browser_page, tmp_path):
    page, blocked, errors = browser_page
    SHOTS.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    truths = write_run(out, 130, targets=2, size=64)
    odd = "odd #1 %41 ü?.png-0000"
    rename_image(out, truths[1].id, odd)
    truths[1].id = odd
    write_strategies(out, truths)
    address = report(out, page_size=24).page.resolve().as_uri()
    page.goto(address)
    wait_for_render(page, 0)
    assert page.evaluate("window.__pwned") is None
    page.screenshot(path=str(SHOTS / "report-top.png"))
    page.screenshot(path=str(SHOTS / "report-full.png"), full_page=True)

    # every image shown loads, from the file system
    assert page.eval_on_selector_all("img", "images => images.length") > 24
    assert broken_images(page) == []

    by_id = {t.id: t for t in truths}
    # the default order: misclassified first
    cards = shown_cards(page)
    assert len(cards) == 24
    wrong = sorted((t for t in truths if t.label is not None and t.label != t.predicted), key=lambda t: -t.confidence)
    assert len(wrong) > 24 and [card["id"] for card in cards] == [t.id for t in wrong[:24]]
    assert page.inner_text("#gallery-count") == "Showing 1–24 of 130 images"

    # paging: six pages of 24 that together hold every image once
    assert page.inner_text(".gallery-pager.top .page-number") == "Page 1 of 6"
    seen = [card["id"] for card in cards]
    for number in range(2, 7):
        before = render_count(page)
        page.click(".gallery-pager.top .next")
        wait_for_render(page, before)
        assert page.inner_text(".gallery-pager.top .page-number") == f"Page {number} of 6"
        assert broken_images(page) == []
        seen += [card["id"] for card in shown_cards(page)]
    assert sorted(seen) == sorted(by_id) and len(seen) == 130
    assert page.is_disabled(".gallery-pager.top .next")

    # filter: misclassified only
    before = render_count(page)
    page.select_option("#filter-correctness", "wrong")
    wait_for_render(page, before)
    cards = shown_cards(page)
    assert page.eval_on_selector("#gallery", "g => g.dataset.matching") == str(len(wrong))
    assert [card["id"] for card in cards] == [t.id for t in wrong[:24]]
    assert all(card["correct"] == "0" and "✗" in card["text"] for card in cards)
    page.screenshot(path=str(SHOTS / "report-misclassified.png"))

    # filter: true class "dog" and misclassified
    before = render_count(page)
    page.select_option("#filter-label", "1")
    wait_for_render(page, before)
    expected = {t.id for t in wrong if t.label == 1}
    assert {card["id"] for card in shown_cards(page)} == expected
    assert all(card["label"] == "1" for card in shown_cards(page))

    # filter: the class named with HTML characters, any correctness; its name shows as text
    page.click("#reset-filters")
    before = render_count(page)
    page.select_option("#filter-predicted", "2")
    wait_for_render(page, before)
    cards = shown_cards(page)
    assert {card["id"] for card in cards} == {t.id for t in truths if t.predicted == 2} or len(cards) == 24
    assert all(card["predicted"] == "2" for card in cards)
    assert HOSTILE in cards[0]["text"]
    assert page.evaluate("window.__pwned") is None
    page.screenshot(path=str(SHOTS / "report-hostile-class.png"))

    # sort by confidence, lowest first: the shown confidences are the lowest, in order
    page.click("#reset-filters")
    before = render_count(page)
    page.select_option("#sort", "confidence-ascending")
    wait_for_render(page, before)
    confidences = [float(card["confidence"]) for card in shown_cards(page)]
    assert confidences == sorted(t.confidence for t in truths)[:24]
    before = render_count(page)
    page.select_option("#sort", "confidence-descending")
    wait_for_render(page, before)
    assert [float(card["confidence"]) for card in shown_cards(page)] == sorted(
        (t.confidence for t in truths), reverse=True)[:24]

    # a confidence range
    before = render_count(page)
    page.fill("#filter-confidence-max", "0.3")
    wait_for_render(page, before)
    assert page.eval_on_selector("#gallery", "g => g.dataset.matching") == str(sum(t.confidence <= 0.3 for t in truths))

    # a confusion cell filters to its images
    page.click("#reset-filters")
    before = render_count(page)
    page.click("table.confusion td[data-label='0'][data-predicted='1']")
    wait_for_render(page, before)
    assert {card["id"] for card in shown_cards(page)} == {t.id for t in truths if t.label == 0 and t.predicted == 1}

    # the strategies: flagged cluster highlighted with its reason, mean maps and examples load
    clusters = page.eval_on_selector_all("#strategies-list .cluster", """nodes => nodes.map(node => ({
        flagged: node.dataset.flagged, text: node.innerText, border: getComputedStyle(node).borderTopColor}))""")
    assert len(clusters) == 3
    flagged = [cluster for cluster in clusters if cluster["flagged"] == "1"]
    assert len(flagged) == 1 and "looks at the corner <b>watermark</b>" in flagged[0]["text"]
    assert flagged[0]["border"] != clusters[-1]["border"]
    assert page.inner_text("#strategies-list .strategy-class h3 .class-name") == HOSTILE  # flagged class first
    assert broken_images(page) == []
    page.eval_on_selector("#strategies", "node => node.scrollIntoView()")
    page.screenshot(path=str(SHOTS / "report-strategies.png"))

    # the overlay of an image with an odd id loads from its encoded address
    assert page.evaluate("""() => new Promise(resolve => { const image = new Image();
        image.onload = () => resolve(image.naturalWidth); image.onerror = () => resolve(0);
        image.src = 'overlays/odd%20%231%20%2541%20%C3%BC%3F.png-0000.png'; })""") == 128

    # the detail dialog of a card
    page.click("#gallery .card")
    page.wait_for_selector("dialog#detail[open]")
    page.wait_for_function("[...document.images].every(image => image.complete)")
    assert broken_images(page) == []
    page.screenshot(path=str(SHOTS / "report-detail.png"))
    page.keyboard.press("Escape")

    assert page.evaluate("window.__pwned") is None
    assert blocked == [] and errors == []


def test_an_old_index_in_a_browser(browser_page, tmp_path):
    page, blocked, errors = browser_page
    out = tmp_path / "old"
    truths = write_run(out, 30, label_columns=False)
    page.goto(report(out, page_size=10).page.resolve().as_uri())
    wait_for_render(page, 0)
    assert broken_images(page) == []
    assert page.inner_text(".gallery-pager.top .page-number") == "Page 1 of 3"
    before = render_count(page)
    page.select_option("#filter-explained", "3")
    wait_for_render(page, before)
    cards = shown_cards(page)
    assert {card["id"] for card in cards} == {t.id for t in truths if t.targets[0] == 3}
    assert all(QUOTED in card["text"] for card in cards)
    assert page.evaluate("window.__pwned") is None
    page.screenshot(path=str(SHOTS / "report-old-index.png"), full_page=True)
    assert blocked == [] and errors == []


def test_the_page_works_under_its_content_security_policy(chromium, tmp_path):
    out = tmp_path / "out"
    write_run(out, 12, targets=2)
    context = chromium.new_context(offline=True)  # the page's own policy applies: no inline script, no network
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(report(out, page_size=5).page.resolve().as_uri())
    page.wait_for_selector("#gallery[data-state='ready']")
    assert page.locator("#gallery .card").count() == 5
    assert page.locator("#gallery .card img").count() == 10
    context.close()
    assert errors == []
