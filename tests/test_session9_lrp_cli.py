"""Session 9, three silences found by hostile tests:

1. LRP: a score near epsilon / the stabiliser, of which they absorb a large share (random-weight EfficientNet-B0:
   score ~1e-5, 26 % of it lost to ε), gave no word (only relevance that vanished entirely did). Checked on a
   single linear layer whose ε rule can be written out by hand: relevance at the input = z · z / (z + ε·sign z).
2. ``explain strategies`` never printed the SpRAy notes (unreadable maps, maps without a place, ...).
3. ``explain batch`` left broken symbolic links named *.png out without a word; they belong in skipped.csv.
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import explain
from explain.cli import main as cli_main
from explain.data import CLASS_NAMES, load_demo_model
from explain.dataset_tools.batch import run
from explain.dataset_tools.index import FIELDS
from explain.methods.lrp import LRP

# ---- 1. LRP: a share of a score near epsilon absorbed ---------------------------------------------------------


def linear_model(dot: float, bias: float = 0.0) -> tuple[nn.Module, torch.Tensor]:
    """Flatten → Linear(12 → 2) and an input x of ones (1, 3, 2, 2): class 0's logit is z = ``dot`` + ``bias``, of
    which x · w = ``dot``."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].weight[0].fill_(dot / 12)
        model[1].weight[1].fill_(-1.0)  # class 1 far below: class 0 is the top class
        model[1].bias.copy_(torch.tensor([bias, 0.0]))
    return model.double().eval(), torch.ones(1, 3, 2, 2, dtype=torch.float64)


def epsilon_relevance_by_hand(dot: float, bias: float, epsilon: float) -> float:
    """Σ input relevance of LRP-ε on one linear layer, starting from R = z: Σ_i x_i w_i · z / (z + ε·sign z)."""
    z = dot + bias
    return dot * z / (z + epsilon * (1.0 if z >= 0 else -1.0))


def explain_lrp(model: nn.Module, x: torch.Tensor, **options) -> tuple[explain.Explanation, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = LRP(model, "epsilon_plus", normalize=None, **options).explain(x, target=0)
    return explanation, [str(warning.message) for warning in caught]


def absorbed_warnings(messages: list[str]) -> list[str]:
    return [message for message in messages if "lost a large share of their relevance" in message]


@pytest.mark.parametrize("dot, lost", [(1e-6, 0.5), (-1e-6, 0.5), (8e-6, 1 / 9)])
def test_a_score_near_epsilon_that_loses_more_than_a_tenth_of_its_relevance_warns(dot, lost):
    """z = ±1e-6 = ε: the ε rule keeps z / (z ± ε) = 1/2 (50 % lost); z = 8e-6: 8/9 kept (11 % lost). HEAD: silent."""
    model, x = linear_model(dot)
    explanation, messages = explain_lrp(model, x)
    by_hand = epsilon_relevance_by_hand(dot, 0.0, 1e-6)
    assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(by_hand, rel=1e-6)
    assert 1 - by_hand / dot == pytest.approx(lost, rel=1e-6)
    (message,) = absorbed_warnings(messages)
    assert f"{lost:.0%} of the score's {dot:.3g}" in message and "(0, 0)" in message
    assert "epsilon=1e-06" in message and "stabilizer=1e-06" in message
    assert "trained weights" in message and "smaller epsilon= and stabilizer=" in message
    assert not [m for m in messages if "almost no relevance" in m]  # the relevance did not vanish


def test_no_warning_where_epsilon_takes_less_than_a_tenth_or_is_made_small():
    """z = 1e-5 is near ε but ε takes 1/11 = 9 % of it; with epsilon=stabilizer=1e-30 it takes ~1e-24 of z = 1e-6."""
    for dot, options in ((1e-5, {}), (1e-6, {"epsilon": 1e-30, "stabilizer": 1e-30})):
        model, x = linear_model(dot)
        explanation, messages = explain_lrp(model, x, **options)
        by_hand = epsilon_relevance_by_hand(dot, 0.0, options.get("epsilon", 1e-6))
        assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(by_hand, rel=1e-6)
        assert not absorbed_warnings(messages), messages


def test_relevance_a_bias_absorbs_from_a_normal_score_is_the_rule_and_no_warning():
    """z = 0.5 + bias 0.5 = 1: the bias takes half of the relevance (x · w / z), as the ε rule prescribes; the score is
    far above ε, so that is the model, not ε: no warning (as on resnet18 / resnet10t with random weights)."""
    model, x = linear_model(0.5, bias=0.5)
    explanation, messages = explain_lrp(model, x)
    assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(
        epsilon_relevance_by_hand(0.5, 0.5, 1e-6), rel=1e-6)
    assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(0.5, rel=1e-5)
    assert not absorbed_warnings(messages), messages


def test_relevance_that_vanishes_gets_its_own_warning_only():
    """z = 1e-15: ε keeps 1e-9 of it, below ``VANISHED``: the vanished warning, not this one as well."""
    model, x = linear_model(1e-15)
    explanation, messages = explain_lrp(model, x)
    assert explanation.diagnostics["relevance_sum"][0, 0].item() == pytest.approx(
        epsilon_relevance_by_hand(1e-15, 0.0, 1e-6), rel=1e-6)
    assert [m for m in messages if "almost no relevance" in m] and not absorbed_warnings(messages)


# ---- 2. explain strategies prints the notes -----------------------------------------------------------------------


def write_run(folder: Path, count: int, uniform: int, unreadable: int) -> None:
    """A batch run's folder of ``count`` 16 × 16 maps of class 0 (a peak at one of two places), the first ``uniform``
    of them zero everywhere (no place) and the last ``unreadable`` map files not arrays."""
    rng = np.random.default_rng(0)
    (folder / "maps").mkdir(parents=True)
    rows = []
    for index in range(count):
        item = f"img{index:03d}.png-0000abcd"
        one = np.zeros((1, 16, 16), np.float16)
        if index >= uniform:
            y, x = (3, 3) if index % 2 else (12, 12)
            one[0, y - 1:y + 2, x - 1:x + 2] = 1 + rng.random((3, 3))
        np.save(folder / "maps" / f"{item}.npy", one)
        if index >= count - unreadable:
            (folder / "maps" / f"{item}.npy").write_bytes(b"not an array")
        rows.append({"id": item, "image": f"img{index:03d}.png", "target": 0, "k": 0, "targets": 1,
                     "class_name": "zero", "score": "1", "probability": "0.5", "map": f"maps/{item}.npy",
                     "label": 0, "label_name": "zero", "predicted": 0, "confidence": "0.9", "correct": "1",
                     "role": "label"})
    with open(folder / "index.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows({field: row.get(field, "") for field in FIELDS} for row in rows)


def test_explain_strategies_prints_every_note_once(tmp_path, capsys):
    """3 maps without a place and 2 unreadable map files: strategies.json holds a note on each; the command printed
    neither (HEAD). Each is printed once as `note: ...` (and not given again as a warning)."""
    write_run(tmp_path, count=30, uniform=3, unreadable=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(["strategies", str(tmp_path), "--min-images", "5", "--no-progress"]) == 0
    notes = json.loads((tmp_path / "strategies.json").read_text())["notes"]
    assert any(note.startswith("2 map file(s) could not be read, so 2 map(s) were left out") for note in notes)
    assert any(note.startswith("3 of the 28 maps hold no positive relevance") for note in notes)
    printed = capsys.readouterr()
    note_lines = [line for line in printed.err.splitlines() if line.startswith("note: ")]
    assert note_lines == [f"note: {note}" for note in notes]
    assert not [warning for warning in caught if str(warning.message) in notes]


# ---- 3. explain batch lists broken symbolic links in skipped.csv ------------------------------------------------


def save(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


def skipped_rows(out: Path) -> dict[str, str]:
    with open(out / "skipped.csv", newline="", encoding="utf-8") as file:
        return {row["image"]: row["reason"] for row in csv.DictReader(file)}


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="symbolic links")
def test_a_broken_symbolic_link_is_listed_in_skipped_csv_like_a_broken_file(tmp_path):
    """images/: a.png, b.png → a.png (a working link: explained), gone.png → missing.png (broken), loop.png → itself,
    bad.png (not an image). HEAD listed bad.png in skipped.csv and left gone.png and loop.png out without a word."""
    folder = tmp_path / "images"
    save(folder / "a.png", 0)
    (folder / "b.png").symlink_to(folder / "a.png")
    (folder / "gone.png").symlink_to(folder / "missing.png")
    (folder / "loop.png").symlink_to(folder / "loop.png")
    (folder / "bad.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    explainer = explain.GradCAM(load_demo_model(), "layer4", class_names=CLASS_NAMES)
    summary = run(explainer, folder, out, progress=False, workers=0)
    assert summary.explained == 2
    rows = skipped_rows(out)
    assert set(rows) == {str(folder / name) for name in ("bad.png", "gone.png", "loop.png")}
    assert rows[str(folder / "gone.png")] == (f"a broken symbolic link: its target {str(folder / 'missing.png')!r} "
                                              "does not exist (or is a loop of links)")
    assert summary.skipped == rows


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="symbolic links")
def test_a_folder_of_broken_links_only_says_where_they_are_listed(tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "x.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(["batch", str(folder), "--model", "demo", "--method", "gradcam", "--out", str(out),
                         "--no-progress", "--workers", "0"]) == 0
    assert list(skipped_rows(out)) == [str(folder / "x.jpg")]
    assert any("1 broken symbolic link(s) with such a name are listed in skipped.csv" in str(w.message)
               for w in caught)
    assert "1 file(s) skipped" in capsys.readouterr().out
