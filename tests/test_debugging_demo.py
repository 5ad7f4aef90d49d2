"""``explain demo --debugging``, end to end: held-out images of the watermark model explained with their labels,
SpRAy's strategies, the report; the tag's cluster of "square" is flagged in its corner, no clean class's is."""

from __future__ import annotations

import csv
import json

from explain.cli import main
from explain.data.demo_watermark import WATERMARKED_CLASS
from explain.data.synthetic import CLASS_NAMES


def test_the_debugging_demo_finds_the_watermark_and_writes_a_report(tmp_path, capsys):
    out = tmp_path / "debugging"
    assert main(["demo", "--debugging", "--out", str(out), "--count", "200"]) == 0
    printed = capsys.readouterr().out
    run = out / "run"
    with open(run / "index.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    images = {row["id"] for row in rows}
    assert len(images) == 200
    wrong = {row["id"] for row in rows if row["correct"] == "0"}
    for row in rows:  # labels from the folders; misclassified images explained for both classes, label first
        assert CLASS_NAMES[int(row["label"])] in row["image"]
        expected_roles = ["label", "predicted"] if row["id"] in wrong else ["predicted"]
        assert row["role"] == expected_roles[int(row["k"])]
    found = json.loads((run / "strategies.json").read_text(encoding="utf-8"))
    flagged = [(entry["class"], cluster) for entry in found["classes"] for cluster in entry["clusters"]
               if cluster["flagged"]]
    assert flagged and {index for index, _ in flagged} == {WATERMARKED_CLASS}
    for _, cluster in flagged:  # the tag's corner: bottom right
        assert min(cluster["peak"]) > 0.8, cluster["peak"]
        assert (run / cluster["mean_map"]).is_file()
    assert (run / "report.html").is_file() and "report:" in printed and "flagged: class 'square'" in printed
    # a rerun explains nothing again
    assert main(["demo", "--debugging", "--out", str(out), "--count", "200"]) == 0
    assert "explained 0 image(s) (200 done before)" in capsys.readouterr().out
